"""The handoff object: the Python form of the C ABI handoff structure (docs/spec/sync-contract.md §4).

A :class:`Handoff` couples a buffer with its handle and the payload that the handle's
``sync_mode`` calls for, and owns the two release obligations:

* the **event release** (SYNC_EVENT only): the consumer calls it exactly once, after it has
  issued its stream-wait on ``sync_handle`` (typically right after handoff);
* the **buffer release**: the consumer calls it exactly once, after all its device work on the
  buffer has completed (docs/spec/sync-contract.md §3).

Both are thread-safe and refuse a second call. A handoff garbage-collected with a release still
owed warns (ResourceWarning) and then performs the owed releases, so nothing leaks silently and
nothing is freed twice.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import HurrayError
from ..format.handle import BufferHandle, DeviceTag, SyncMode

_H = TypeVar("_H", bound="Handoff")  # typing.Self is 3.11+

ReleaseFn = Callable[[], None]


class HandoffError(HurrayError, ValueError):
    """A handoff whose payload does not match its handle's declared sync_mode (a producer bug)."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(f"handoff rejected: {message} [{reason}]")


class AlreadyReleasedError(HurrayError, RuntimeError):
    """A release callback was called a second time."""


def _validate_payload(
    handle: BufferHandle,
    sync_handle: Any,
    sync_handle_device_tag: DeviceTag | None,
    event_release: ReleaseFn | None,
    consumer_stream: Any,
) -> None:
    mode = handle.sync_mode
    name = mode.wire_name
    if mode is SyncMode.EVENT:
        if sync_handle is None:
            raise HandoffError("missing_sync_handle", f"{name} needs a sync_handle (the producer's event)")
        if event_release is None or not callable(event_release):
            raise HandoffError("missing_event_release", f"{name} needs a callable event_release")
        if sync_handle_device_tag is not handle.device_tag:
            raise HandoffError(
                "sync_handle_device_tag",
                f"sync_handle_device_tag {sync_handle_device_tag!r} must equal the buffer's device_tag "
                f"{handle.device_tag.name}",
            )
    elif sync_handle is not None or event_release is not None or sync_handle_device_tag is not None:
        raise HandoffError("unexpected_sync_handle", f"{name} carries no event payload")
    if mode is SyncMode.CONSUMER_STREAM:
        if consumer_stream is None:
            raise HandoffError(
                "missing_consumer_stream", f"{name} needs the consumer stream supplied at request time"
            )
    elif consumer_stream is not None:
        raise HandoffError("unexpected_consumer_stream", f"{name} carries no consumer stream")


class Handoff:
    """One buffer handed from a producer to a consumer, with its release obligations.

    Construction validates that the payload matches ``handle.sync_mode`` and raises
    :class:`HandoffError` otherwise, so a consumer never sees a mismatched handoff.
    """

    def __init__(
        self,
        handle: BufferHandle,
        buffer: Any,
        release: ReleaseFn,
        *,
        sync_handle: Any = None,
        sync_handle_device_tag: DeviceTag | None = None,
        event_release: ReleaseFn | None = None,
        consumer_stream: Any = None,
    ) -> None:
        if not isinstance(handle, BufferHandle):
            raise HandoffError("handle_type", f"handle must be a BufferHandle, not {type(handle).__name__}")
        if not callable(release):
            raise HandoffError("missing_release", "a buffer-release callback is required")
        _validate_payload(handle, sync_handle, sync_handle_device_tag, event_release, consumer_stream)
        self.handle = handle
        self.buffer = buffer
        self.sync_handle = sync_handle
        self.sync_handle_device_tag = sync_handle_device_tag
        self.consumer_stream = consumer_stream
        self._lock = threading.Lock()
        self._release: ReleaseFn | None = release
        self._event_release: ReleaseFn | None = event_release

    @property
    def sync_mode(self) -> SyncMode:
        return self.handle.sync_mode

    @property
    def released(self) -> bool:
        return self._release is None

    @property
    def event_released(self) -> bool:
        """True once the event was released, and always for modes without an event."""
        return self._event_release is None

    def _take(self, attr: str, what: str) -> ReleaseFn:
        with self._lock:
            fn = getattr(self, attr)
            if fn is None:
                raise AlreadyReleasedError(f"{what} of this handoff was already released")
            setattr(self, attr, None)
            return fn

    def release_event(self) -> None:
        """Release the producer's event; call exactly once, after issuing the stream-wait(s)."""
        if self.handle.sync_mode is not SyncMode.EVENT:
            raise HandoffError("no_event", f"a {self.handle.sync_mode.wire_name} handoff has no event to release")
        self._take("_event_release", "the event")()

    def release(self) -> None:
        """Release the buffer; call exactly once, after all device work on it has completed.

        An event still owed is released first: the producer must not get the buffer back while
        it still keeps the event alive for us.
        """
        if self.handle.sync_mode is SyncMode.EVENT and not self.event_released:
            try:
                self.release_event()
            except AlreadyReleasedError:
                pass  # a concurrent release_event() won the race; that is the one release
        self._take("_release", "the buffer")()

    def __enter__(self: _H) -> _H:  # `with c.receive() as h`: h is the subclass (ReceivedHandoff)
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.released:
            self.release()

    def __del__(self) -> None:
        if getattr(self, "_release", None) is None and getattr(self, "_event_release", None) is None:
            return
        warnings.warn(
            f"unreleased {self.handle.sync_mode.wire_name} handoff of {self.handle.size} bytes was garbage-"
            "collected; releasing it now (call release() after your device work has completed)",
            ResourceWarning,
            stacklevel=2,
        )
        for attr in ("_event_release", "_release"):
            fn = getattr(self, attr, None)
            setattr(self, attr, None)
            if fn is not None:
                # A finaliser must not raise: suppress whatever the release hits at collection time.
                with contextlib.suppress(Exception):
                    fn()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Handoff {self.handle.sync_mode.wire_name} {self.handle.device_tag.name} {self.handle.size}B {state}>"
