"""The few ZeroMQ socket calls on the hot path, made without pyzmq's per-call conveniences.

pyzmq's ``Socket.send_multipart`` combines its flags as ``enum.IntFlag`` values and re-checks
every frame in Python, about 8 µs per message on this project's machines; ``recv_multipart`` and
``getsockopt`` likewise. These helpers call the backend socket methods (``zmq.backend.Socket``,
which pyzmq's Socket subclasses) with plain integer flags: the same libzmq calls, a quarter of
the Python around them. Only bytes-like frames, only copying sends: what the protocol sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq
from zmq.backend import Socket as _Backend

_send = _Backend.send
_recv = _Backend.recv
_get = _Backend.get
SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def send_frames(sock: Any, frames: Sequence[Any], flags: int = 0) -> None:
    """Send one multipart message (``flags``: 0 or NOBLOCK; raises zmq.Again / ZMQError as
    ``send_multipart`` would)."""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        _send(sock, f, flags | SNDMORE if i < last else flags)


def recv_frames(sock: Any, flags: int = 0) -> list[bytes]:
    """Receive one multipart message as bytes frames. Each part is received as a zmq.Frame and
    copied out, because the frame says whether more follow (zmq_msg_more) for less than asking
    the socket (``getsockopt(RCVMORE)``: pyzmq looks the option up in an enum on every call,
    about 1 µs a message of four frames)."""
    f = _recv(sock, flags, False)
    parts = [f.bytes]
    while f.more:
        f = _recv(sock, flags, False)
        parts.append(f.bytes)
    return parts


def readable(sock: Any) -> bool:
    """A whole message can be received without blocking (ZMQ_EVENTS & POLLIN)."""
    return bool(int(_get(sock, _EVENTS)) & _POLLIN)
