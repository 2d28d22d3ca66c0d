"""The CPU device: buffers in POSIX shared memory, mapped zero-copy by consumers."""

from __future__ import annotations

import ctypes
import struct
from typing import Any

from ..format.handle import DeviceTag
from . import shm
from .base import (
    Buffer,
    Device,
    DeviceCapabilities,
    DeviceIdentity,
    Event,
    ImportCache,
    MemoryExport,
    Stream,
    host_id,
    resolve_copy,
)
from .errors import DeviceError
from .shm import Segment

CPU_MAGIC = b"HRYSHM01"
_BLOB = struct.Struct("<8sQ48s")  # magic, segment size, segment name


class HostStream(Stream):
    """Host 'stream': every operation completes before the call returns."""

    def __init__(self, device: CpuDevice):
        self.device = device

    @property
    def handle(self) -> int:
        return 0

    def copy(self, dst: Any, src: Any, nbytes: int | None = None) -> None:
        d, s, n = resolve_copy(dst, src, nbytes, [])
        ctypes.memmove(d, s, n)

    def memset(self, dst: Buffer, value: int, nbytes: int | None = None) -> None:
        n = dst.size if nbytes is None else nbytes
        if not 0 <= n <= dst.size:
            raise DeviceError("memset", f"{n} bytes into a buffer of {dst.size}")
        ctypes.memset(dst.ptr, value & 0xFF, n)

    def record(self, event: Event) -> None:
        raise DeviceError("record", "the CPU device has no events; CPU handoffs are SYNC_PRODUCER_SYNCED")

    def wait(self, event: Event) -> None:
        raise DeviceError("wait", "the CPU device has no events; CPU handoffs are SYNC_PRODUCER_SYNCED")

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def close(self) -> None:
        pass


class CpuDevice(Device):
    """Host memory in named POSIX shared-memory segments (mode 0600, unlinked on free)."""

    tag = DeviceTag.CPU

    def __init__(self) -> None:
        self.identity = DeviceIdentity("cpu", 0, f"CPU-{host_id()}")
        self._cache = ImportCache()
        self._segments: dict[int, Segment] = {}

    def capabilities(self) -> DeviceCapabilities:
        return DeviceCapabilities(ipc_memory=True, ipc_events=False)

    def allocate(self, size: int) -> Buffer:
        seg = Segment.create(size, "c")
        ptr = seg.address()
        self._segments[ptr] = seg

        def free() -> None:
            self._segments.pop(ptr, None)
            seg.close()

        return Buffer(self, ptr, size, closer=free, host=memoryview(seg.map)[:size])

    def segment_of(self, buf: Buffer) -> tuple[Segment, int]:
        for base, seg in list(self._segments.items()):  # a copy: another thread may allocate or free
            if base <= buf.ptr < base + seg.size or (buf.size == 0 and buf.ptr == base):
                return seg, buf.ptr - base
        raise DeviceError("export_memory", f"{buf!r} is not in shared memory this process allocated")

    def export_memory(self, buf: Buffer) -> MemoryExport:
        cached: tuple[Segment, str, MemoryExport] | None = getattr(buf, "_export", None)
        # A buffer's segment and offset never change: found once, then remembered; its name
        # changes when the segment is renewed (retire_memory).
        if cached is not None and cached[0].name is cached[1]:
            return cached[2]
        seg, offset = self.segment_of(buf)
        exp = MemoryExport(_BLOB.pack(CPU_MAGIC, seg.size, seg.name.encode()), offset, buf.size)
        buf._export = (seg, seg.name, exp)  # type: ignore[attr-defined]
        return exp

    def retire_memory(self, buf: Buffer) -> None:
        """A fenced consumer may still read ``buf`` (spec §5): give the segment holding it fresh
        pages in place (:meth:`Segment.renew`), so the caller may go on writing ``buf`` while that
        consumer keeps the old pages, unchanged. Its next export names the new segment."""
        seg, _ = self.segment_of(buf)
        seg.renew()

    def import_memory(self, exp: MemoryExport, keep: bool = False) -> Buffer:
        blob = bytes(exp.blob)
        if len(blob) != _BLOB.size or not blob.startswith(CPU_MAGIC):
            raise DeviceError("import_memory", "not a CPU shared-memory blob")
        _magic, seg_size, raw_name = _BLOB.unpack(blob)
        name = raw_name.rstrip(b"\0")
        if exp.offset < 0 or exp.size < 0 or exp.offset + exp.size > seg_size:
            raise DeviceError("import_memory",
                              f"offset {exp.offset} + size {exp.size} exceeds the segment ({seg_size})")

        def opener() -> tuple[Segment, Any]:  # first use of this blob: check the name, then open
            if not name.startswith(b"/") or shm.parse_name(name.decode("ascii", "replace")) is None:
                raise DeviceError("import_memory", f"segment name {name[:48]!r} is not a Hurray segment name "
                                  "(/hurray-<uid>-<pid>-<kind><n>-<hex>)")
            seg = Segment.attach(name.decode())
            seg.address()
            return seg, seg.close

        seg = self._cache.acquire(blob, opener)
        if exp.offset + exp.size > len(seg.map):  # the segment's real size: the blob's may lie
            self._cache.release(blob)
            raise DeviceError("import_memory", f"offset {exp.offset} + size {exp.size} exceeds the segment "
                              f"({len(seg.map)} bytes)")
        # A slice of the mmap pins the mapping: a view a user keeps can never dangle.
        view = memoryview(seg.map)[exp.offset:exp.offset + exp.size]
        return Buffer(self, seg.address() + exp.offset, exp.size, closer=lambda: self._cache.release(blob),
                      host=view, imported=True, mapping=self._cache.mapping(blob))

    def buffer_at(self, ptr: int, size: int) -> Buffer:
        """A non-owning view of host memory at ``ptr`` (the caller keeps the memory alive)."""
        view = memoryview((ctypes.c_char * size).from_address(ptr)).cast("B") if size else memoryview(b"")
        return Buffer(self, ptr, size, host=view)

    def create_stream(self) -> Stream:
        return HostStream(self)

    def create_event(self, interprocess: bool = True) -> Event:
        raise DeviceError("create_event", "the CPU device has no events; CPU handoffs are SYNC_PRODUCER_SYNCED")

    def import_event(self, blob: bytes) -> Event:
        raise DeviceError("import_event", "the CPU device has no events")

    def close(self) -> None:
        self._cache.clear()
        for seg in list(self._segments.values()):
            seg.close()
        self._segments.clear()
