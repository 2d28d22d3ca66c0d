"""Where the broker listens by default, and the owner-only directory for its socket."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import InvalidArgument, UnsafeEndpoint


def runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "hurray" if xdg else Path(f"/tmp/hurray-{os.getuid()}")


def default_endpoint() -> str:
    """``HURRAY_BROKER`` if set, else ipc://$XDG_RUNTIME_DIR/hurray/broker.sock (or /tmp/hurray-$UID/)."""
    return os.environ.get("HURRAY_BROKER") or f"ipc://{runtime_dir() / 'broker.sock'}"


SCHEMES = ("ipc://", "tcp://", "inproc://")


def check_socket_dir(d: Path, group: bool) -> None:
    """Refuse a socket directory others could swap the socket in (ipc-protocol.md §1): writable by
    other users without the sticky bit (by the group too unless ``group``), or owned by another
    user (root excepted), or not a directory. A missing one is fine (the broker creates it with its
    own mode). The broker checks before it binds; clients check before they connect, with
    ``group`` set (a broker started with --group shares a group-writable directory)."""
    try:
        st = d.stat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeEndpoint(f"socket directory {d} is not a directory")
    if st.st_uid not in (os.getuid(), 0):
        raise UnsafeEndpoint(f"socket directory {d} belongs to uid {st.st_uid}, not to us ({os.getuid()}) or root: "
                             "another user could run a broker there")
    open_to = stat.S_IWOTH | (0 if group else stat.S_IWGRP)
    if st.st_mode & open_to and not st.st_mode & stat.S_ISVTX:
        raise UnsafeEndpoint(f"socket directory {d} has mode {stat.S_IMODE(st.st_mode):o}: other users could replace "
                             "the broker's socket; use a directory only you can write (or one with the sticky bit)")


def check_endpoint(value: str) -> str:
    """``value`` if it is a ZeroMQ endpoint with a scheme (ipc://, tcp://, inproc://), else
    ValueError naming the value and the forms that work."""
    if not isinstance(value, str) or not value.startswith(SCHEMES) or value in SCHEMES:
        hint = f" (did you mean ipc://{value}?)" if isinstance(value, str) and value.startswith("/") else ""
        raise InvalidArgument(f"{value!r} is not a ZeroMQ endpoint: use ipc:///path/to.sock, tcp://host:port or "
                              f"inproc://name{hint}", where="endpoint=", value=value)
    return value
