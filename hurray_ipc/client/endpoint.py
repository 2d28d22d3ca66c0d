"""Where the broker listens by default, and the owner-only directory for its socket."""

from __future__ import annotations

import os
from pathlib import Path


def runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "hurray" if xdg else Path(f"/tmp/hurray-{os.getuid()}")


def default_endpoint() -> str:
    """``HURRAY_BROKER`` if set, else ipc://$XDG_RUNTIME_DIR/hurray/broker.sock (or /tmp/hurray-$UID/)."""
    return os.environ.get("HURRAY_BROKER") or f"ipc://{runtime_dir() / 'broker.sock'}"
