"""What every device offers: buffers, streams, events, export/import, identity and capabilities.

Lifetimes are explicit: every :class:`Buffer`, :class:`Stream` and :class:`Event` has ``close()``
(and is a context manager). Closing an owned buffer frees it; closing an imported one drops this
process's reference to the cached mapping. Closing an exported event destroys it; closing an
imported event destroys this process's opened copy only.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format.handle import DeviceTag
from .errors import DeviceError


def host_id() -> str:
    """Identifies this machine (boot), so endpoints can tell 'same host' from 'other host'."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


@dataclass(frozen=True)
class DeviceIdentity:
    kind: str  # "cpu" or "cuda"
    ordinal: int
    uuid: str
    pci_bus_id: str = ""
    emulated: bool = False
    host: str = field(default_factory=host_id)

    @property
    def spec(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.ordinal}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ordinal": self.ordinal, "uuid": self.uuid, "pci_bus_id": self.pci_bus_id,
                "emulated": self.emulated, "host": self.host}


@dataclass(frozen=True)
class DeviceCapabilities:
    ipc_memory: bool
    ipc_events: bool
    ipc_streams: bool = False  # no CUDA device exports streams
    peers: tuple[str, ...] = ()  # uuids this device can access as a peer
    # (capability, why not) for each unsupported one whose probe said why, e.g.
    # ("ipc_memory", "cudaIpcGetMemHandle: CUDA call failed (cudaErrorNotSupported)")
    why_not: tuple[tuple[str, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"ipc_memory": self.ipc_memory, "ipc_events": self.ipc_events,
                             "ipc_streams": self.ipc_streams, "peers": list(self.peers)}
        if self.why_not:
            d["why_not"] = dict(self.why_not)
        return d


@dataclass(frozen=True)
class MemoryExport:
    """What travels out of band for one buffer: the allocation's 64-byte blob and the offset."""

    blob: bytes
    offset: int
    size: int


class Mapping:
    """One opening of an allocation in this process (an imported shared-memory segment or CUDA IPC
    allocation). It may outlive every Buffer carved from it (:class:`ImportCache` keeps idle ones
    open) and ends when it is unmapped; something that holds state about its addresses (a NIC's
    memory registration) learns of that through :meth:`on_unmap`, because the same addresses may
    name another allocation afterwards. ``serial`` tells mappings apart for the whole process."""

    _serials = itertools.count(1)

    def __init__(self) -> None:
        self.serial = next(Mapping._serials)
        self.unmapped = False
        self._hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def on_unmap(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` once, when this mapping is unmapped (at once if it already is). It runs
        in whichever thread unmaps, under the cache's lock: it must be quick and must not block."""
        with self._lock:
            if not self.unmapped:
                self._hooks.append(hook)
                return
        hook()

    def _unmap(self) -> None:
        with self._lock:
            self.unmapped = True
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()


class Buffer:
    """A span of memory on one device. ``ptr`` is an address valid in this process only.
    ``mapping``: the opening of another process's allocation it lies in (imported buffers)."""

    def __init__(self, device: Device, ptr: int, size: int, *, closer: Callable[[], None] | None = None,
                 host: memoryview | None = None, imported: bool = False, mapping: Mapping | None = None):
        self.device = device
        self.ptr = ptr
        self.size = size
        self.imported = imported
        self.mapping = mapping
        self.closed = False
        self._closer = closer
        self._host = host

    @property
    def tag(self) -> DeviceTag:
        return self.device.tag

    def host_view(self) -> memoryview:
        """The bytes, for host memory only (device memory needs a copy on a stream)."""
        if self._host is None:
            raise DeviceError("host_view", f"{self.device.identity.spec} memory is not host-addressable")
        return self._host

    def close(self) -> None:
        closer, self._closer = self._closer, None
        self._host = None
        self.ptr = 0
        self.closed = True
        if closer is not None:
            closer()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Buffer {self.device.identity.spec} 0x{self.ptr:x} {self.size}B{' imported' if self.imported else ''}>"


def host_pointer(obj: Any, writable: bool) -> tuple[int, int, Any]:
    """(address, nbytes, keepalive) of a host object exposing the buffer protocol."""
    arr = np.frombuffer(obj, dtype=np.uint8) if not isinstance(obj, np.ndarray) else obj.reshape(-1).view(np.uint8)
    if writable and not arr.flags.writeable:
        raise DeviceError("copy", "destination host buffer is read-only")
    if not arr.flags.c_contiguous:
        raise DeviceError("copy", "host buffer must be contiguous")
    return int(arr.ctypes.data), int(arr.nbytes), arr


def ordered_buffer(obj: Any, stream: Any, writable: bool) -> Any:
    """``obj`` as one end of a copy on ``stream`` (``writable``: the destination). An object with
    ``__hurray_buffer__(stream, writable)`` (a received buffer: client/consumer.py) makes ``stream``
    wait, device-side, for its producer's writes and gives its device-layer Buffer, refusing to be
    written when it is read-only; anything else is returned as is."""
    hook = getattr(type(obj), "__hurray_buffer__", None)
    return hook(obj, stream, writable) if hook is not None else obj


def resolve_copy(dst: Any, src: Any, nbytes: int | None, keep: list[Any]) -> tuple[int, int, int]:
    """(dst address, src address, byte count) for a copy between Buffers, raw pointers and host
    buffers. Host objects are appended to ``keep`` (they must outlive the async copy)."""

    def addr(obj: Any, writable: bool) -> tuple[int, int]:
        if isinstance(obj, Buffer):
            return obj.ptr, obj.size
        if isinstance(obj, int):
            return obj, -1
        ptr, n, keepalive = host_pointer(obj, writable)
        keep.append(keepalive)
        return ptr, n

    d, dn = addr(dst, True)
    s, sn = addr(src, False)
    known = [x for x in (dn, sn) if x >= 0]
    if nbytes is None:
        if not known:
            raise DeviceError("copy", "nbytes is required when both ends are raw pointers")
        if len(known) == 2 and dn != sn:
            raise DeviceError("copy", f"source is {sn} bytes, destination {dn}: pass nbytes to copy a part")
        nbytes = known[0]
    if nbytes < 0 or any(nbytes > x for x in known):
        raise DeviceError("copy", f"{nbytes} bytes do not fit (source {sn}, destination {dn})")
    return d, s, nbytes


class Event(ABC):
    device: Device

    @abstractmethod
    def record(self, stream: Stream) -> None: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def query(self) -> bool: ...

    @abstractmethod
    def export(self) -> bytes:
        """The 64-byte IPC blob (cudaIpcEventHandle) of an interprocess event."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Event:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Stream(ABC):
    """An in-order queue of device work. Copies take Buffers, device pointers or host buffers."""

    device: Device

    @property
    @abstractmethod
    def handle(self) -> int:
        """The integer a ``__cuda_array_interface__`` consumer expects as its ``stream``."""

    @abstractmethod
    def copy(self, dst: Any, src: Any, nbytes: int | None = None) -> None: ...

    @abstractmethod
    def memset(self, dst: Buffer, value: int, nbytes: int | None = None) -> None: ...

    @abstractmethod
    def record(self, event: Event) -> None: ...

    @abstractmethod
    def wait(self, event: Event) -> None:
        """Order later work on this stream after the event's latest record (at call time)."""

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def query(self) -> bool: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Device(ABC):
    tag: DeviceTag
    identity: DeviceIdentity

    @abstractmethod
    def capabilities(self) -> DeviceCapabilities: ...

    @abstractmethod
    def allocate(self, size: int) -> Buffer: ...

    @abstractmethod
    def export_memory(self, buf: Buffer) -> MemoryExport: ...

    @abstractmethod
    def import_memory(self, exp: MemoryExport, keep: bool = False) -> Buffer:
        """Map another process's buffer; the allocation is opened once per process and cached.
        ``keep``: its exporter lets the mapping stay open after the buffer's release
        (ipc-protocol.md §4.10; only a device whose mappings must otherwise close at once cares)."""

    @abstractmethod
    def create_stream(self) -> Stream: ...

    @abstractmethod
    def create_event(self, interprocess: bool = True) -> Event: ...

    @abstractmethod
    def import_event(self, blob: bytes) -> Event: ...

    def buffer_at(self, ptr: int, size: int) -> Buffer:
        """A non-owning Buffer for memory someone else allocated (a CuPy/PyTorch array)."""
        return Buffer(self, ptr, size)

    # Happens-before annotations for the emulated runtime's race checker: a process about to send
    # a message that orders another process's device work (a handoff, a release) calls
    # order_send(key); the receiver calls order_receive(key) before touching the buffer. The key
    # names the message on both sides (e.g. "<producer id>:<handoff id>:handoff"). On CPU devices
    # and real CUDA they do nothing: the message itself is the ordering.
    def order_send(self, key: str) -> None:
        """This host is about to send the message ``key``; what it has waited for so far is
        ordered before whatever the receiver does after :meth:`order_receive`."""

    def order_receive(self, key: str) -> None:
        """The message ``key`` arrived: order this host's later work after its sender's."""

    def order_forget(self, key: str) -> None:
        """The message ``key`` was sent but will never be received."""

    def close(self) -> None:
        pass

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ImportCache:
    """Opened allocations, keyed by their blob: buffers carved from one allocation and held at the
    same time share one mapping (opening costs about a millisecond on CUDA, far more in some
    frameworks).

    ``limit`` bounds how many mappings stay open: beyond it the oldest idle ones (no Buffer
    references them) are closed, and held ones never are; all are closed on ``clear``.
    ``limit=0`` closes a mapping when its reference count reaches zero — what CUDA needs, because
    the exporter's cudaFree must not run before our cudaIpcCloseMemHandle. The default
    (``HURRAY_IMPORT_CACHE``, 64) suits shared-memory mappings, which stay valid after their owner
    unlinks them.

    ``keep``: how many idle *kept* mappings may stay open on top of ``limit`` (the newest). A
    mapping is kept while every acquire of it since it was opened said ``keep=True``: its exporter
    promised not to free the allocation before asking for it back (ipc-protocol.md §4.10), which
    :meth:`unmap` answers.
    """

    def __init__(self, limit: int | None = None, keep: int = 0):
        if limit is None:
            raw = os.environ.get("HURRAY_IMPORT_CACHE", "64")
            try:
                limit = int(raw)
            except ValueError:
                raise DeviceError("ImportCache", f"HURRAY_IMPORT_CACHE={raw!r} is not an integer") from None
        if limit < 0 or keep < 0:
            raise DeviceError("ImportCache", f"the idle-mapping limits must be >= 0, got {limit} and {keep}")
        self.limit = limit
        self.keep = keep
        # blob -> [opened, closer, refs, Mapping, kept, callbacks to run once it is closed]
        self._entries: dict[bytes, list[Any]] = {}
        self.opens = 0  # how many times an allocation was actually opened (tests read it)
        self.closes = 0  # how many mappings were closed (tests read it)
        self._lock = threading.Lock()

    def acquire(self, blob: bytes, opener: Callable[[], tuple[Any, Callable[[], None]]], keep: bool = False) -> Any:
        """The opened allocation for ``blob`` (``opener()`` -> (opened, closer) on first use)."""
        with self._lock:
            e = self._entries.get(blob)
            if e is None:
                base, closer = opener()
                self.opens += 1
                e = self._entries[blob] = [base, closer, 0, Mapping(), keep, []]
            else:  # move to the end: most recently used
                self._entries[blob] = self._entries.pop(blob)
                e[4] = e[4] and keep
            e[2] += 1
            done = self._evict()
        _run(done)
        return e[0]

    def mapping(self, blob: bytes) -> Mapping:
        """The Mapping of ``blob``'s opened allocation: call while holding a reference (acquire)."""
        with self._lock:
            return self._entries[blob][3]

    def release(self, blob: bytes) -> None:
        with self._lock:
            e = self._entries.get(blob)
            if e is None:
                return
            e[2] -= 1
            done = self._evict()
        _run(done)

    def unmap(self, blob: bytes, then: Callable[[], None]) -> None:
        """Close ``blob``'s mapping and call ``then()`` after it closed: at once when it is idle
        or not open, else when its last reference goes (it is no longer kept)."""
        with self._lock:
            e = self._entries.get(blob)
            if e is not None and e[2] > 0:
                e[4] = False
                e[5].append(then)
                return
            done = [then]
            if e is not None:
                done = self._close(blob) + done
        _run(done)

    def close_idle(self) -> None:
        """Close every idle mapping, kept or not (before telling exporters this process is done)."""
        with self._lock:
            done = [f for blob in [k for k, e in self._entries.items() if e[2] <= 0] for f in self._close(blob)]
        _run(done)

    def _close(self, blob: bytes) -> list[Callable[[], None]]:
        # Closers run under the lock: a mapping is closed before the same blob can be reopened.
        e = self._entries.pop(blob)
        e[3]._unmap()  # before the addresses can name anything else
        e[1]()
        self.closes += 1
        return list(e[5])

    def _evict(self) -> list[Callable[[], None]]:
        """Close idle mappings beyond the limits (caller holds the lock); what to call after."""
        if len(self._entries) <= self.limit:
            return []
        idle = [k for k, e in self._entries.items() if e[2] <= 0]
        kept = [k for k in idle if self._entries[k][4]]
        spare = set(kept[len(kept) - self.keep:]) if self.keep else set()
        victims = [k for k in idle if k not in spare]
        done: list[Callable[[], None]] = []
        while len(self._entries) - len(spare) > self.limit and victims:
            done += self._close(victims.pop(0))
        return done

    def kept(self) -> int:
        """Idle kept mappings open now."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e[2] <= 0 and e[4])

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            entries, self._entries = self._entries, {}
        done: list[Callable[[], None]] = []
        for _base, closer, _refs, mapping, _kept, then in entries.values():
            mapping._unmap()
            closer()
            self.closes += 1
            done += then
        _run(done)


def _run(callbacks: list[Callable[[], None]]) -> None:
    for f in callbacks:
        f()


def order_key(producer_id: str, handoff_id: int, message: str) -> str:
    """The name both ends give a handoff's HANDOFF/DELIVER ("handoff") or RELEASE/RELEASED
    ("release") message in happens-before annotations (:meth:`Device.order_send`)."""
    return f"{producer_id}:{handoff_id}:{message}"
