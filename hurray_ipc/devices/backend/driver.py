"""Which CUDA version the NVIDIA driver supports, which cuda-bindings is installed, and whether
they fit -- found without importing cuda-bindings.

Contract:

* :func:`driver_cuda_version` -- ``(major, minor)`` of the newest CUDA the installed driver
  supports: ``cuDriverGetVersion`` from ``libcuda.so.1`` through ctypes (12040 -> ``(12, 4)``),
  else the "CUDA Version: X.Y" line of ``nvidia-smi``, else ``None`` (no driver). Never raises,
  never imports ``cuda``; it may run ``nvidia-smi`` (at most 10 s).
* :func:`bindings_version` -- ``(major, minor)`` of the installed cuda-bindings distribution (or
  of a cuda-python older than the split, which carried the bindings itself), from package metadata
  without importing it; ``None`` when neither is installed.
* :func:`extra_for` -- the hurray-ipc extra (``cuda12``, ``cuda13``) whose cuda-bindings the
  driver runs: the newest one not newer than the driver (drivers run older CUDA majors, not newer).
  ``None`` without a driver or for one older than CUDA 12.
* :func:`install_hint` -- the ``pip install`` line for this machine, one line.
* :func:`diagnose` -- why real CUDA cannot work with this driver and these bindings, naming both
  versions and the fix; ``None`` when nothing here explains a failure.

Pure standard library and no imports from the package, so the set-up scripts run this file
directly before anything is installed: ``python driver.py extra`` prints the extra (an empty line
without one), ``python driver.py hint`` the install line.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys

Version = tuple[int, int]

# extra name per CUDA major version of cuda-bindings; pyproject.toml's [project.optional-dependencies]
EXTRAS: dict[int, str] = {12: "cuda12", 13: "cuda13"}

_SMI_VERSION = re.compile(r"CUDA Version:\s*(\d+)\.(\d+)")


def _from_libcuda(name: str = "libcuda.so.1") -> Version | None:
    """cuDriverGetVersion through ctypes; None when the library does not load or the call fails."""
    try:
        lib = ctypes.CDLL(name)
        fn = lib.cuDriverGetVersion
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
    fn.restype = ctypes.c_int
    out = ctypes.c_int(0)
    if fn(ctypes.byref(out)) != 0 or out.value <= 0:
        return None
    return out.value // 1000, (out.value % 1000) // 10


def parse_nvidia_smi(text: str) -> Version | None:
    """The "CUDA Version: X.Y" of ``nvidia-smi``'s banner; None when the text has none."""
    m = _SMI_VERSION.search(text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _from_nvidia_smi() -> Version | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi(r.stdout) if r.returncode == 0 else None


def driver_cuda_version() -> Version | None:
    """The CUDA version the NVIDIA driver supports (libcuda, else nvidia-smi); None: no driver."""
    return _from_libcuda() or _from_nvidia_smi()


def _leading(version: str) -> Version | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def bindings_version() -> Version | None:
    """The installed cuda-bindings (or pre-split cuda-python) version, from its metadata."""
    from importlib import metadata  # here: the scripts' `driver.py extra` needs none of it

    for dist in ("cuda-bindings", "cuda-python"):
        try:
            return _leading(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return None


def extra_for(driver: Version | None) -> str | None:
    """``cuda12``/``cuda13`` for a driver's CUDA version; None without a driver or below CUDA 12."""
    if driver is None:
        return None
    fits = [major for major in EXTRAS if major <= driver[0]]
    return EXTRAS[max(fits)] if fits else None


def install_hint(driver: Version | None) -> str:
    """How to install hurray-ipc for a driver's CUDA version, as one line."""
    if driver is None:
        return "no NVIDIA driver found: pip install hurray-ipc"
    extra = extra_for(driver)
    if extra is None:
        return (f"the NVIDIA driver supports CUDA {driver[0]}.{driver[1]}, older than CUDA {min(EXTRAS)}: "
                f"pip install hurray-ipc (CPU devices and the CUDA emulation); update the driver for real CUDA")
    return f"pip install 'hurray-ipc[{extra}]'"


def diagnose(driver: Version | None, bindings: Version | None) -> str | None:
    """Why real CUDA cannot work with ``driver`` and ``bindings`` (versions as returned above),
    with the fix; None when they fit (a failure then has another cause)."""
    if driver is None:
        return "no NVIDIA driver found (libcuda.so.1 does not load, no nvidia-smi answers)"
    d = f"{driver[0]}.{driver[1]}"
    extra = extra_for(driver)
    if extra is None:
        return f"the NVIDIA driver supports CUDA {d}; hurray-ipc needs CUDA {min(EXTRAS)} or newer: update the driver"
    fix = f"install hurray-ipc[{extra}] (pip install 'hurray-ipc[{extra}]')"
    if bindings is None:
        return f"cuda-bindings is not installed (the driver supports CUDA {d}): {fix}"
    b = f"{bindings[0]}.{bindings[1]}"
    if bindings[0] > driver[0]:
        return f"driver supports CUDA {d}, cuda-bindings {b} installed (needs a CUDA {bindings[0]} driver): {fix}"
    if bindings[0] < min(EXTRAS):
        return f"cuda-bindings {b} installed, hurray-ipc needs {min(EXTRAS)} or newer: {fix}"
    return None


EMULATION_HINT = "no GPU here? HURRAY_CUDA=emulated runs the same code on the project's CUDA emulation"


def with_emulation_hint(message: str) -> str:
    """``message`` plus how to run without a GPU, where this machine has no NVIDIA driver (with
    a driver the message's own fix applies) and the message does not say it already."""
    if EMULATION_HINT in message or driver_cuda_version() is not None:
        return message
    return f"{message} ({EMULATION_HINT})"


def main(argv: list[str]) -> int:
    """``extra``: the extra for this driver (an empty line without one); ``hint``: :func:`install_hint`."""
    queries = ("extra", "hint")
    if len(argv) != 1 or argv[0] not in queries:
        print(f"driver.py: expected one argument, one of {', '.join(queries)}; got {argv!r}", file=sys.stderr)
        return 2
    driver = driver_cuda_version()
    if argv[0] == "extra":
        print(extra_for(driver) or "")
    else:
        print(install_hint(driver))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
