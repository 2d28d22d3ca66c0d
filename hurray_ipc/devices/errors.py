"""Errors raised by the device layer."""

from __future__ import annotations

from ..errors import HurrayError


class DeviceError(HurrayError, RuntimeError):
    """A device or driver call failed. ``call`` names it; ``code`` is the driver's error, if any."""

    def __init__(self, call: str, message: str, code: object = None):
        self.call = call
        self.code = code
        super().__init__(f"{call}: {message}" + (f" ({code})" if code is not None else ""))


class RaceError(DeviceError):
    """The emulated runtime saw a read of bytes whose write was not ordered before it."""
