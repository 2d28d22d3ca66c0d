"""A cross-process emulation of the CUDA runtime surface in :mod:`.base`.

What is emulated, and how (see ../DESIGN.md for why):

* **Device memory** is POSIX shared memory: one segment per allocation, a 4 KiB header (race
  table) followed by the data. A device pointer is the data's real address in this process, so
  copies are ``memmove``; an IPC mem handle names the segment, and opening it maps the segment at
  another address, as CUDA IPC does.
* **Streams** are per-process worker threads that run queued operations in order. Each memory
  operation (copy, memset) takes ``op_delay_s``: it reads its source when it starts and its
  writes land when it ends, so an unsynchronised reader reliably sees stale bytes.
* **Events** live in a small shared segment holding two counters: ``recorded`` (bumped when
  ``event_record`` is *called*) and ``completed`` (raised when the stream *reaches* the record).
  ``stream_wait_event`` captures ``recorded`` at call time and blocks the stream until
  ``completed`` reaches it: CUDA's rule that a wait orders after the latest record at the time of
  the wait, so a released event may be re-recorded.
* **Race check**: each allocation's header lists writes that were enqueued but have not finished.
  A read (a copy *from* device memory) that executes while an overlapping write enqueued *before
  the read was enqueued* is still pending was not ordered after that write: it is reported as a
  :class:`RaceError` (raised at the next synchronize) and counted in :attr:`races`.

Configuration comes from :class:`EmulationConfig` (``HURRAY_EMU_*`` variables for spawned
processes). Emulated UUIDs start with ``EMU-`` and every blob with :data:`EMULATED_MAGIC`, so a
real CUDA process never opens an emulated blob, and vice versa.
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import itertools
import os
import queue
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import DeviceError, RaceError
from ..shm import Segment, pid_alive
from .base import EMULATED_MAGIC, IPC_HANDLE_SIZE, Runtime, check_blob

HEADER = 4096
_SLOTS = 120  # pending-write slots per allocation: (start, end, enqueue_ns, token) u64 each
_MEM_MAGIC = EMULATED_MAGIC + b"M1"
_EVT_MAGIC = EMULATED_MAGIC + b"E1"
_BLOB = struct.Struct("<8sIIQ40s")  # magic, device ordinal, pid of exporter, size, segment name
assert _BLOB.size == IPC_HANDLE_SIZE


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise DeviceError("emulation config", f"{name}={raw!r} is not a boolean (1/0)")


@dataclass(frozen=True)
class EmulationConfig:
    """What the emulated machine offers. ``from_env`` reads ``HURRAY_EMU_*``."""

    devices: int = 2
    ipc_memory: bool = True
    ipc_events: bool = True
    peer_access: bool = True
    op_delay_s: float = 0.002
    race_check: bool = True

    @classmethod
    def from_env(cls) -> "EmulationConfig":
        try:
            devices = int(os.environ.get("HURRAY_EMU_DEVICES", "2"))
            delay = float(os.environ.get("HURRAY_EMU_DELAY_MS", "2")) / 1000.0
        except ValueError as e:
            raise DeviceError("emulation config", f"HURRAY_EMU_DEVICES / HURRAY_EMU_DELAY_MS: {e}") from None
        if devices < 0 or delay < 0:
            raise DeviceError("emulation config", "HURRAY_EMU_DEVICES and HURRAY_EMU_DELAY_MS must be >= 0")
        return cls(
            devices=devices,
            ipc_memory=_env_bool("HURRAY_EMU_IPC_MEMORY", True),
            ipc_events=_env_bool("HURRAY_EMU_IPC_EVENTS", True),
            peer_access=_env_bool("HURRAY_EMU_PEER", True),
            op_delay_s=delay,
            race_check=_env_bool("HURRAY_EMU_RACE_CHECK", True),
        )

    def to_env(self) -> dict[str, str]:
        """The variables that make a spawned process see the same machine."""
        b = lambda v: "1" if v else "0"  # noqa: E731
        return {
            "HURRAY_CUDA": "emulated",
            "HURRAY_EMU_DEVICES": str(self.devices),
            "HURRAY_EMU_IPC_MEMORY": b(self.ipc_memory),
            "HURRAY_EMU_IPC_EVENTS": b(self.ipc_events),
            "HURRAY_EMU_PEER": b(self.peer_access),
            "HURRAY_EMU_DELAY_MS": repr(self.op_delay_s * 1000.0),
            "HURRAY_EMU_RACE_CHECK": b(self.race_check),
        }


class _Locked:
    """Process-local lock plus flock on the segment: threads and processes both exclude."""

    def __init__(self, seg: Segment):
        self.seg = seg
        self.local = threading.Lock()

    def __enter__(self) -> None:
        self.local.acquire()
        self.held = not self.seg.closed  # a destroyed event's late record needs no cross-process lock
        if self.held:
            fcntl.flock(self.seg.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self.held:
            fcntl.flock(self.seg.fd, fcntl.LOCK_UN)
        self.local.release()


@dataclass
class _Alloc:
    seg: Segment
    base: int  # address of the data in this process
    size: int
    device: int
    imported: bool
    lock: _Locked
    table: np.ndarray  # (_SLOTS, 4) uint64 view of the header's pending-write table

    def note_write(self, start: int, end: int, token: int) -> int:
        with self.lock:
            free = np.flatnonzero(self.table[:, 3] == 0)
            if free.size == 0:
                raise DeviceError("emulated write", f"more than {_SLOTS} writes in flight on one allocation")
            i = int(free[0])
            self.table[i, 0], self.table[i, 1], self.table[i, 2] = start, end, time.monotonic_ns()
            self.table[i, 3] = token
            return i

    def retire_write(self, slot: int, token: int) -> None:
        with self.lock:
            if int(self.table[slot, 3]) == token:
                self.table[slot, 3] = 0

    def unordered_writes(self, start: int, end: int, read_enqueued_ns: int) -> list[tuple[int, int]]:
        with self.lock:
            t = self.table
            hit = (t[:, 3] != 0) & (t[:, 0] < end) & (t[:, 1] > start) & (t[:, 2] < read_enqueued_ns)
            return [(int(a), int(b)) for a, b in t[hit, :2]]


class _Event:
    """Shared counters: [magic, recorded, completed, owner_pid]."""

    def __init__(self, seg: Segment, owner: bool, interprocess: bool, device: int):
        self.seg = seg
        self.owner = owner
        self.interprocess = interprocess
        self.device = device
        self.lock = _Locked(seg)
        self.words = np.frombuffer(seg.map, dtype=np.uint64, count=4)
        self.destroyed = False

    def owner_pid(self) -> int:
        return int(self.words[3])


class _Stream:
    """One worker thread running this stream's operations in order."""

    _ids = itertools.count(1)

    def __init__(self, runtime: "EmulatedRuntime", device: int):
        self.id = 0x5EA0_0000 + next(self._ids)
        self.device = device
        self.rt = runtime
        self.q: "queue.Queue[Callable[[], None] | None]" = queue.Queue()
        self.pending = 0
        self.cv = threading.Condition()
        self.error: DeviceError | None = None
        self.thread = threading.Thread(target=self._run, name=f"emu-stream-{self.id:x}", daemon=True)
        self.thread.start()

    def enqueue(self, op: Callable[[], None]) -> None:
        with self.cv:
            self.pending += 1
        self.q.put(op)

    def _run(self) -> None:
        while True:
            op = self.q.get()
            if op is None:
                return
            try:
                op()
            except DeviceError as e:
                with self.cv:
                    self.error = self.error or e  # sticky, like a CUDA stream error
            except Exception as e:  # noqa: BLE001 - surface anything at the next synchronize
                with self.cv:
                    self.error = self.error or DeviceError("emulated stream op", repr(e))
            with self.cv:
                self.pending -= 1
                self.cv.notify_all()

    def synchronize(self) -> None:
        with self.cv:
            while self.pending:
                self.cv.wait()
            err, self.error = self.error, None
        if err is not None:
            raise err

    def idle(self) -> bool:
        with self.cv:
            return self.pending == 0

    def close(self) -> None:
        self.q.put(None)


class EmulatedRuntime(Runtime):
    name = "emulated"
    emulated = True

    def __init__(self, config: EmulationConfig | None = None):
        self.config = config or EmulationConfig.from_env()
        self._lock = threading.Lock()
        self._bases: list[int] = []  # sorted, for mem_range
        self._allocs: dict[int, _Alloc] = {}
        self._tls = threading.local()
        self._tokens = itertools.count(1)
        self._default: dict[int, _Stream] = {}
        self.races: list[str] = []  # every race reported in this process
        self._streams: "weakref.WeakSet[_Stream]" = weakref.WeakSet()

    def _drain(self) -> None:
        """cudaFree and cudaIpcCloseMemHandle synchronize the device first; so do we."""
        for st in list(self._streams):
            with st.cv:
                while st.pending:
                    st.cv.wait()

    # --- devices -------------------------------------------------------------------------------
    def probe(self) -> str | None:
        return None if self.config.devices > 0 else "emulated runtime configured with 0 devices"

    def device_count(self) -> int:
        return self.config.devices

    def _device(self) -> int:
        return getattr(self._tls, "device", 0)

    def _check_ordinal(self, call: str, ordinal: int) -> None:
        if not 0 <= ordinal < self.config.devices:
            raise DeviceError(call, f"device {ordinal} does not exist ({self.config.devices} emulated)",
                              code="cudaErrorInvalidDevice")

    def set_device(self, ordinal: int) -> None:
        self._check_ordinal("cudaSetDevice", ordinal)
        self._tls.device = ordinal

    def device_uuid(self, ordinal: int) -> str:
        self._check_ordinal("cudaGetDeviceProperties", ordinal)
        return f"EMU-{os.getuid():08x}-{ordinal:04x}"

    def pci_bus_id(self, ordinal: int) -> str:
        self._check_ordinal("cudaDeviceGetPCIBusId", ordinal)
        return f"emu:{ordinal:02x}:00.0"

    def ipc_memory_support(self, ordinal: int) -> bool:
        self._check_ordinal("cudaDeviceGetAttribute", ordinal)
        return self.config.ipc_memory

    def ipc_event_support(self, ordinal: int) -> bool:
        self._check_ordinal("cudaDeviceGetAttribute", ordinal)
        return self.config.ipc_events

    def unsupported_reason(self, ordinal: int, capability: str) -> str | None:
        off = {"ipc_memory": not self.config.ipc_memory, "ipc_events": not self.config.ipc_events}
        return f"{capability} disabled in this emulation (HURRAY_EMU_*)" if off.get(capability) else None

    def can_access_peer(self, ordinal: int, peer: int) -> bool:
        self._check_ordinal("cudaDeviceCanAccessPeer", ordinal)
        self._check_ordinal("cudaDeviceCanAccessPeer", peer)
        return ordinal == peer or self.config.peer_access

    # --- memory --------------------------------------------------------------------------------
    def _register(self, seg: Segment, device: int, imported: bool) -> _Alloc:
        base = seg.address() + HEADER
        table = np.frombuffer(seg.map, dtype=np.uint64, count=_SLOTS * 4, offset=64).reshape(_SLOTS, 4)
        a = _Alloc(seg, base, seg.size - HEADER, device, imported, _Locked(seg), table)
        with self._lock:
            bisect.insort(self._bases, base)
            self._allocs[base] = a
        return a

    def _unregister(self, base: int) -> _Alloc:
        with self._lock:
            a = self._allocs.pop(base, None)
            if a is None:
                raise DeviceError("cudaFree", f"0x{base:x} is not an allocation base", code="cudaErrorInvalidValue")
            self._bases.remove(base)
        return a

    def _find(self, ptr: int) -> _Alloc | None:
        with self._lock:
            i = bisect.bisect_right(self._bases, ptr) - 1
            if i >= 0:
                a = self._allocs[self._bases[i]]
                if ptr < a.base + max(a.size, 1):
                    return a
        return None

    def malloc(self, nbytes: int) -> int:
        seg = Segment.create(HEADER + max(nbytes, 1), "m")
        seg.map[:8] = _MEM_MAGIC
        struct.pack_into("<QQ", seg.map, 8, nbytes, self._device())
        return self._register(seg, self._device(), imported=False).base

    def free(self, ptr: int) -> None:
        self._drain()
        a = self._unregister(ptr)
        if a.imported:
            raise DeviceError("cudaFree", "pointer came from cudaIpcOpenMemHandle; close it instead",
                              code="cudaErrorInvalidValue")
        self._drop(a)

    @staticmethod
    def _drop(a: _Alloc) -> None:
        a.table = None  # type: ignore[assignment]
        a.seg.close()

    def mem_range(self, ptr: int) -> tuple[int, int]:
        a = self._find(ptr)
        if a is None:
            raise DeviceError("cuMemGetAddressRange", f"0x{ptr:x} is not emulated device memory",
                              code="CUDA_ERROR_NOT_FOUND")
        return a.base, a.size

    def ipc_get_mem_handle(self, base: int) -> bytes:
        if not self.config.ipc_memory:
            raise DeviceError("cudaIpcGetMemHandle", "IPC memory disabled in this emulation", code="cudaErrorNotSupported")
        a = self._allocs.get(base)
        if a is None:
            raise DeviceError("cudaIpcGetMemHandle", f"0x{base:x} is not an allocation base", code="cudaErrorInvalidValue")
        return _BLOB.pack(_MEM_MAGIC, a.device, os.getpid(), a.size, a.seg.name.encode())

    def ipc_open_mem_handle(self, blob: bytes) -> int:
        raw = check_blob(blob, "cudaIpcOpenMemHandle", emulated=True)
        magic, device, _pid, size, name = _BLOB.unpack(raw)
        if magic != _MEM_MAGIC:
            raise DeviceError("cudaIpcOpenMemHandle", "not an emulated memory handle", code="cudaErrorInvalidValue")
        self._check_ordinal("cudaIpcOpenMemHandle", device)
        if not self.can_access_peer(self._device(), device):
            raise DeviceError("cudaIpcOpenMemHandle",
                              f"memory on device {device} is not peer-accessible from device {self._device()}",
                              code="cudaErrorPeerAccessUnsupported")
        try:
            seg = Segment.attach(name.rstrip(b"\0").decode())
        except DeviceError as e:  # CUDA reports a freed allocation's handle as an invalid value
            raise DeviceError("cudaIpcOpenMemHandle", str(e), code="cudaErrorInvalidValue") from e
        return self._register(seg, device, imported=True).base

    def ipc_close_mem_handle(self, base: int) -> None:
        self._drain()
        a = self._unregister(base)
        if not a.imported:
            raise DeviceError("cudaIpcCloseMemHandle", "pointer was not opened from an IPC handle",
                              code="cudaErrorInvalidValue")
        self._drop(a)

    def host_register(self, ptr: int, nbytes: int) -> None:
        pass  # all emulated "device" copies are host copies; page-locking changes nothing here

    def host_unregister(self, ptr: int) -> None:
        pass

    # --- streams -------------------------------------------------------------------------------
    def _stream(self, s: Any) -> _Stream:
        if s is None or s == 0:
            dev = self._device()
            with self._lock:
                st = self._default.get(dev)
                if st is None:
                    st = self._default[dev] = _Stream(self, dev)
                    self._streams.add(st)
            return st
        if not isinstance(s, _Stream):
            raise DeviceError("stream", f"{s!r} is not an emulated stream", code="cudaErrorInvalidResourceHandle")
        return s

    def stream_create(self) -> Any:
        st = _Stream(self, self._device())
        self._streams.add(st)
        return st

    def stream_destroy(self, stream: Any) -> None:
        self._stream(stream).close()

    def stream_synchronize(self, stream: Any) -> None:
        self._stream(stream).synchronize()

    def stream_query(self, stream: Any) -> bool:
        return self._stream(stream).idle()

    def stream_id(self, stream: Any) -> int:
        return self._stream(stream).id

    def stream_from_id(self, ident: int) -> Any:
        if ident in (0, 1, 2):
            return self._stream(0)
        for st in list(self._streams):
            if st.id == ident:
                return st
        raise DeviceError("stream", f"no emulated stream {ident:#x} in this process", code="cudaErrorInvalidResourceHandle")

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        ev = self._event(event, "cudaStreamWaitEvent")
        target = int(ev.words[1])  # the latest record at the time of this call
        owner = ev.owner_pid()

        def wait() -> None:
            spin = 0
            while int(ev.words[2]) < target:
                spin += 1
                time.sleep(0.00005 if spin < 100 else 0.001)
                if spin % 500 == 0 and owner and not pid_alive(owner):
                    raise DeviceError("cudaStreamWaitEvent", f"the process {owner} that records this event died",
                                      code="cudaErrorLaunchFailure")

        self._stream(stream).enqueue(wait)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if nbytes <= 0:
            return
        st = self._stream(stream)
        d, s = self._find(dst), self._find(src)
        for a, p, what in ((d, dst, "destination"), (s, src, "source")):
            if a is not None and p + nbytes > a.base + a.size:
                raise DeviceError("cudaMemcpyAsync", f"{what} range exceeds its allocation", code="cudaErrorInvalidValue")
        enq = time.monotonic_ns()
        slot = token = None
        if d is not None and self.config.race_check:
            token = next(self._tokens) | (os.getpid() << 32)
            slot = d.note_write(dst - d.base, dst - d.base + nbytes, token)

        delay = self.config.op_delay_s

        def copy() -> None:
            # Reads happen when the op starts, writes land when it ends: the widest window in
            # which an unordered reader sees stale bytes, as a slow kernel would make it.
            try:
                race = None
                if s is not None and self.config.race_check:
                    bad = s.unordered_writes(src - s.base, src - s.base + nbytes, enq)
                    if bad:
                        race = (f"read of device bytes [{src - s.base}, {src - s.base + nbytes}) of {s.seg.name} "
                                f"is not ordered after pending write(s) {bad}: a missing stream-wait or sync")
                        self.races.append(race)
                if delay:
                    snapshot = ctypes.string_at(src, nbytes)
                    time.sleep(delay)
                    ctypes.memmove(dst, snapshot, nbytes)
                else:
                    ctypes.memmove(dst, src, nbytes)
                if race is not None:
                    raise RaceError("cudaMemcpyAsync", race, code="emulated race")
            finally:
                if slot is not None:
                    d.retire_write(slot, token)

        st.enqueue(copy)

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: Any) -> None:
        if nbytes <= 0:
            return
        a = self._find(ptr)
        if a is None or ptr + nbytes > a.base + a.size:
            raise DeviceError("cudaMemsetAsync", f"0x{ptr:x}+{nbytes} is not inside emulated device memory",
                              code="cudaErrorInvalidValue")
        slot = token = None
        if self.config.race_check:
            token = next(self._tokens) | (os.getpid() << 32)
            slot = a.note_write(ptr - a.base, ptr - a.base + nbytes, token)

        delay = self.config.op_delay_s

        def fill() -> None:
            try:
                if delay:
                    time.sleep(delay)
                ctypes.memset(ptr, value & 0xFF, nbytes)
            finally:
                if slot is not None:
                    a.retire_write(slot, token)

        self._stream(stream).enqueue(fill)

    # --- events --------------------------------------------------------------------------------
    def _event(self, e: Any, call: str) -> _Event:
        if not isinstance(e, _Event) or e.destroyed:
            raise DeviceError(call, f"{e!r} is not a live emulated event", code="cudaErrorInvalidResourceHandle")
        return e

    def event_create(self, interprocess: bool) -> Any:
        seg = Segment.create(64, "v")
        ev = _Event(seg, owner=True, interprocess=interprocess, device=self._device())
        seg.map[:8] = _EVT_MAGIC
        ev.words[3] = os.getpid()
        return ev

    def event_destroy(self, event: Any) -> None:
        ev = self._event(event, "cudaEventDestroy")
        ev.destroyed = True
        # A wait already enqueued keeps its reference to the words and still completes, as in CUDA;
        # the segment's name goes now, its mapping when the last reference does.
        ev.seg.close()  # unlinks for the exporter; the importer only drops its copy

    def event_record(self, event: Any, stream: Any) -> None:
        ev = self._event(event, "cudaEventRecord")
        with ev.lock:
            seq = int(ev.words[1]) + 1
            ev.words[1] = seq

        def complete() -> None:
            with ev.lock:
                if int(ev.words[2]) < seq:
                    ev.words[2] = seq

        self._stream(stream).enqueue(complete)

    def event_synchronize(self, event: Any) -> None:
        ev = self._event(event, "cudaEventSynchronize")
        target = int(ev.words[1])
        while int(ev.words[2]) < target:
            time.sleep(0.0001)

    def event_query(self, event: Any) -> bool:
        ev = self._event(event, "cudaEventQuery")
        return int(ev.words[2]) >= int(ev.words[1])

    def ipc_get_event_handle(self, event: Any) -> bytes:
        ev = self._event(event, "cudaIpcGetEventHandle")
        if not self.config.ipc_events:
            raise DeviceError("cudaIpcGetEventHandle", "IPC events disabled in this emulation", code="cudaErrorNotSupported")
        if not ev.interprocess:
            raise DeviceError("cudaIpcGetEventHandle", "event was not created with cudaEventInterprocess",
                              code="cudaErrorInvalidResourceHandle")
        return _BLOB.pack(_EVT_MAGIC, ev.device, ev.owner_pid(), 0, ev.seg.name.encode())

    def ipc_open_event_handle(self, blob: bytes) -> Any:
        raw = check_blob(blob, "cudaIpcOpenEventHandle", emulated=True)
        magic, device, _pid, _size, name = _BLOB.unpack(raw)
        if magic != _EVT_MAGIC:
            raise DeviceError("cudaIpcOpenEventHandle", "not an emulated event handle", code="cudaErrorInvalidValue")
        seg = Segment.attach(name.rstrip(b"\0").decode())
        return _Event(seg, owner=False, interprocess=True, device=device)
