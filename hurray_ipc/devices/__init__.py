"""Devices: CPU shared memory and CUDA (real or emulated backend). See DESIGN.md beside this file."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgument
from .backend import backend_name, get_runtime, set_runtime
from .base import Buffer, Device, DeviceCapabilities, DeviceIdentity, Event, MemoryExport, Stream, host_id
from .cpu import CpuDevice
from .cuda import CudaDevice, CudaEvent, CudaStream
from .errors import DeviceError, RaceError


def parse_spec(spec: str, where: str = "device=") -> tuple[str, int]:
    """'cpu' -> ('cpu', 0); 'cuda' / 'cuda:N' -> ('cuda', N); InvalidArgument (naming ``where``) otherwise."""
    if not isinstance(spec, str):
        raise InvalidArgument("a device is 'cpu', 'cuda:N' or a Device", where=where, value=spec)
    s = spec.strip().lower()
    if s == "cpu":
        return "cpu", 0
    if s == "cuda":
        return "cuda", 0
    if s.startswith("cuda:") and s[5:].isdigit():
        return "cuda", int(s[5:])
    raise InvalidArgument("a device is 'cpu' or 'cuda:N'", where=where, value=spec)


_open: dict[str, Device] = {}


def open_device(spec: str | Device, where: str = "device=") -> Device:
    """The process-wide device for a spec ('cpu', 'cuda:0'), created once."""
    if isinstance(spec, Device):
        return spec
    kind, ordinal = parse_spec(spec, where)
    key = f"{kind}:{ordinal}"
    dev = _open.get(key)
    if dev is None:
        dev = _open[key] = CpuDevice() if kind == "cpu" else CudaDevice(ordinal)
    return dev


@dataclass
class CudaProbe:
    backend: str
    available: bool
    reason: str | None
    devices: list[dict[str, Any]] = field(default_factory=list)


def probe_cuda() -> CudaProbe:
    """What the selected CUDA backend offers here; never raises for a missing driver or GPU."""
    try:
        rt = get_runtime()
        why = rt.probe()
    except Exception as e:  # noqa: BLE001 - a broken install must still be reported, not crash
        return CudaProbe(backend_name(), False, f"CUDA unavailable: {e}")
    if why is not None:
        return CudaProbe(rt.name, False, f"CUDA unavailable: {why}")
    out = []
    for i in range(rt.device_count()):
        dev = open_device(f"cuda:{i}")
        out.append({**dev.identity.to_dict(), **dev.capabilities().to_dict()})
    return CudaProbe(rt.name, True, None, out)


__all__ = [
    "Buffer", "CpuDevice", "CudaDevice", "CudaEvent", "CudaProbe", "CudaStream", "Device", "DeviceCapabilities",
    "DeviceError", "DeviceIdentity", "Event", "MemoryExport", "RaceError", "Stream", "backend_name",
    "get_runtime", "host_id", "open_device", "parse_spec", "probe_cuda", "set_runtime",
]
