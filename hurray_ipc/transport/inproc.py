"""Objects that cannot travel through a socket, handed between threads of one process.

In-process handoffs carry a reference key instead of IPC blobs (a real CUDA process cannot open its
own IPC handles), and a consumer's stream is found by its integer id for SYNC_CONSUMER_STREAM.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

_lock = threading.Lock()
_refs: dict[str, Any] = {}
_streams: dict[int, Any] = {}


def put(obj: Any) -> str:
    key = secrets.token_hex(12)
    with _lock:
        _refs[key] = obj
    return key


def take(key: str) -> Any:
    with _lock:
        try:
            return _refs.pop(key)
        except KeyError:
            raise KeyError(
                f"in-process handoff reference {key!r} is unknown (already taken, or another process)"
            ) from None


def drop(key: str) -> None:
    with _lock:
        _refs.pop(key, None)


def register_stream(stream: Any) -> int:
    with _lock:
        _streams[stream.handle] = stream
    return stream.handle


def unregister_stream(stream: Any) -> None:
    with _lock:
        _streams.pop(stream.handle, None)


def stream(ident: int) -> Any:
    with _lock:
        try:
            return _streams[ident]
        except KeyError:
            raise KeyError(f"consumer stream {ident:#x} is not registered in this process") from None
