"""Where the broker listens by default, and the owner-only directory for its socket."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InvalidArgument


def runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "hurray" if xdg else Path(f"/tmp/hurray-{os.getuid()}")


def default_endpoint() -> str:
    """``HURRAY_BROKER`` if set, else ipc://$XDG_RUNTIME_DIR/hurray/broker.sock (or /tmp/hurray-$UID/)."""
    return os.environ.get("HURRAY_BROKER") or f"ipc://{runtime_dir() / 'broker.sock'}"


SCHEMES = ("ipc://", "tcp://", "inproc://")


def check_endpoint(value: str) -> str:
    """``value`` if it is a ZeroMQ endpoint with a scheme (ipc://, tcp://, inproc://), else
    ValueError naming the value and the forms that work."""
    if not isinstance(value, str) or not value.startswith(SCHEMES) or value in SCHEMES:
        hint = f" (did you mean ipc://{value}?)" if isinstance(value, str) and value.startswith("/") else ""
        raise InvalidArgument(f"{value!r} is not a ZeroMQ endpoint: use ipc:///path/to.sock, tcp://host:port or "
                              f"inproc://name{hint}", where="endpoint=", value=value)
    return value
