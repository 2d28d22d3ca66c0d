"""What every Hurray command line shares: ``--version``, and argument types that refuse bad
values with a one-line error and exit status 2 (argparse's convention) instead of a traceback."""

from __future__ import annotations

import argparse
import re

from .. import __version__
from ..client.endpoint import check_endpoint
from ..devices.backend.driver import with_emulation_hint
from ..units import parse_bytes

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_DEVICE = re.compile(r"^(cpu|cuda:[0-9]{1,4})$")


def add_version(p: argparse.ArgumentParser) -> None:
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")


def endpoint(value: str) -> str:
    """A ZeroMQ endpoint with its scheme: ipc:///path, tcp://host:port or inproc://name."""
    try:
        return check_endpoint(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def device(value: str) -> str:
    """``cpu`` or ``cuda:N``."""
    if not _DEVICE.match(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: use cpu or cuda:N (e.g. cuda:0)")
    return value


def _int_at_least(value: str, least: int, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"{n} is not {what} (at least {least})")
    return n


def parse_size(text: str) -> int:
    """Bytes as a command line writes them: 4096, 64K, 1M, 2GiB (>= 0; :func:`units.parse_bytes`)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"size {e}") from None


def buffer_size(text: str) -> int:
    """A buffer size for the checked workload (hurray-stress, the demo): at least its header."""
    from ..workload import MIN_SIZE

    n = parse_size(text)
    if n < MIN_SIZE:
        raise argparse.ArgumentTypeError(f"size {text!r}: at least {MIN_SIZE} bytes, which name the buffer's "
                                         "producer and number for the check")
    return n


def positive_float(value: str) -> float:
    try:
        f = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not (f > 0 and f != float("inf")):  # also NaN
        raise argparse.ArgumentTypeError(f"{value} is not a finite number > 0")
    return f


def non_negative_int(value: str) -> int:
    return _int_at_least(value, 0, "a count")


def positive_int(value: str) -> int:
    return _int_at_least(value, 1, "a positive integer")


def sync_mode(value: str) -> str:
    """A sync mode name (SYNC_EVENT, EVENT or event ...), checked now rather than in the workers."""
    from ..format.handle import SyncMode

    try:
        SyncMode.from_name(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def cuda_hint(message: str) -> str:
    """``message`` plus how to run without a GPU, when it says CUDA is unavailable on a machine
    without an NVIDIA driver (devices.backend.driver.with_emulation_hint)."""
    return with_emulation_hint(message) if "CUDA unavailable" in message else message
