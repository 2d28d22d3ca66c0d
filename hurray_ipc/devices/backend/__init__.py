"""The CUDA runtime backend, chosen in one place.

``HURRAY_CUDA=real`` (the default) uses cuda.bindings; ``HURRAY_CUDA=emulated`` uses the
cross-process emulation. The emulation is never chosen silently: without a GPU the real backend
reports "CUDA unavailable: <reason>" and callers fall back to CPU devices or fail clearly.
"""

from __future__ import annotations

import os
import threading

from ..errors import DeviceError
from .base import EMULATED_MAGIC, IPC_HANDLE_SIZE, Runtime

_lock = threading.Lock()
_runtime: Runtime | None = None


def backend_name() -> str:
    name = os.environ.get("HURRAY_CUDA", "real").strip().lower() or "real"
    if name not in ("real", "emulated"):
        raise DeviceError("HURRAY_CUDA", f"{name!r} is not a CUDA backend; expected 'real' or 'emulated'")
    return name


def get_runtime() -> Runtime:
    """The process-wide runtime selected by ``HURRAY_CUDA`` (created on first use)."""
    global _runtime
    with _lock:
        if _runtime is None:
            if backend_name() == "emulated":
                from .emulated import EmulatedRuntime

                _runtime = EmulatedRuntime()
            else:
                from .real import RealRuntime

                _runtime = RealRuntime()
        return _runtime


def set_runtime(runtime: Runtime | None) -> None:
    """Replace the process-wide runtime (tests; None re-reads ``HURRAY_CUDA`` on next use)."""
    global _runtime
    with _lock:
        _runtime = runtime


__all__ = ["EMULATED_MAGIC", "IPC_HANDLE_SIZE", "Runtime", "backend_name", "get_runtime", "set_runtime"]
