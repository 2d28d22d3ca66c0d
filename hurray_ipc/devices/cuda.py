"""The CUDA device, over an exchangeable runtime backend (real cuda.bindings or the emulation)."""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..errors import InvalidArgument, UnsupportedObject
from ..format.handle import DeviceTag
from .backend import Runtime, get_runtime
from .backend.driver import with_emulation_hint
from .base import (
    Buffer,
    Device,
    DeviceCapabilities,
    DeviceIdentity,
    Event,
    ImportCache,
    MemoryExport,
    Stream,
    ordered_buffer,
    resolve_copy,
)
from .errors import DeviceError

F = TypeVar("F", bound=Callable[..., Any])


def _on_device(method: F) -> F:
    """Run a CUDA object's method with its device current, and the caller's device again after
    (see :meth:`CudaDevice.current`); nested calls on the same device switch nothing."""
    @functools.wraps(method)
    def run(self: Any, *a: Any, **kw: Any) -> Any:
        dev = self if isinstance(self, CudaDevice) else self.device
        prev = dev._make_current()
        if prev is None:  # the usual case, without current()'s generator: several calls per handoff
            return method(self, *a, **kw)
        try:
            return method(self, *a, **kw)
        finally:
            dev._restore(prev)

    return run  # type: ignore[return-value]


class CudaEvent(Event):
    """An event. Exported (owned) events are destroyed on close; imported ones drop our copy."""

    device: CudaDevice  # narrows Event.device: a CUDA event only ever belongs to a CudaDevice

    def __init__(self, device: CudaDevice, raw: Any, *, interprocess: bool, imported: bool = False):
        self.device = device
        self.raw = raw
        self.interprocess = interprocess
        self.imported = imported
        self._blob: bytes | None = None

    def _live(self) -> Any:
        if self.raw is None:
            raise DeviceError("event", "event already destroyed")
        return self.raw

    @_on_device
    def record(self, stream: Stream) -> None:
        if not isinstance(stream, CudaStream):
            raise DeviceError("cudaEventRecord", f"{stream!r} is not a CUDA stream")
        self.device.rt.event_record(self._live(), stream.raw)

    @_on_device
    def synchronize(self) -> None:
        self.device.rt.event_synchronize(self._live())

    @_on_device
    def query(self) -> bool:
        return self.device.rt.event_query(self._live())

    @_on_device
    def export(self) -> bytes:
        if self._blob is None:  # the handle of an event never changes; fetch it once
            self._blob = self.device.rt.ipc_get_event_handle(self._live())
        return self._blob

    @_on_device
    def close(self) -> None:
        raw, self.raw = self.raw, None
        if raw is not None:
            self.device.rt.event_destroy(raw)


class CudaStream(Stream):
    device: CudaDevice  # narrows Stream.device: a CUDA stream only ever belongs to a CudaDevice

    def __init__(self, device: CudaDevice, raw: Any, *, owned: bool = True):
        self.device = device
        self.raw = raw
        self.owned = owned
        self._keep: list[Any] = []  # host objects an async copy still reads or writes

    @property
    def handle(self) -> int:
        return self.device.rt.stream_id(self.raw)

    @property
    def protocol_handle(self) -> int:
        """This stream as CUDA Array Interface v3 and DLPack name it to other libraries: the legacy
        default stream (cudaStream_t 0) as 1, since both protocols forbid 0 as ambiguous."""
        h = self.handle
        return 1 if h == 0 else h

    @_on_device
    def copy(self, dst: Any, src: Any, nbytes: int | None = None) -> None:
        """Enqueue a copy; host objects must stay alive and unchanged until synchronize. Either
        end may be a Buffer, a raw pointer, a host buffer (numpy, bytearray) or a received
        buffer (``handoff.buffer``), which this stream is first ordered after (device-side)."""
        dst, src = ordered_buffer(dst, self, True), ordered_buffer(src, self, False)
        d, s, n = resolve_copy(dst, src, nbytes, self._keep)
        self.device.rt.memcpy_async(d, s, n, self.raw)

    @_on_device
    def memset(self, dst: Buffer, value: int, nbytes: int | None = None) -> None:
        n = dst.size if nbytes is None else nbytes
        if not 0 <= n <= dst.size:
            raise DeviceError("memset", f"{n} bytes into a buffer of {dst.size}")
        self.device.rt.memset_async(dst.ptr, value, n, self.raw)

    def record(self, event: Event) -> None:
        event.record(self)

    @_on_device
    def wait(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise DeviceError("cudaStreamWaitEvent", f"{event!r} is not a CUDA event")
        self.device.rt.stream_wait_event(self.raw, event._live())

    @_on_device
    def synchronize(self) -> None:
        try:
            self.device.rt.stream_synchronize(self.raw)
        finally:
            self._keep.clear()

    @_on_device
    def query(self) -> bool:
        done = self.device.rt.stream_query(self.raw)
        if done:
            self._keep.clear()
        return done

    @_on_device
    def close(self) -> None:
        raw, self.raw = self.raw, None
        if raw is not None and self.owned:
            self.device.rt.stream_destroy(raw)


def _keep_mappings() -> int:
    raw = os.environ.get("HURRAY_CUDA_KEEP_MAPPINGS", "32")
    try:
        n = int(raw)
    except ValueError:
        raise DeviceError("CudaDevice", f"HURRAY_CUDA_KEEP_MAPPINGS={raw!r} is not an integer") from None
    if n < 0:
        raise DeviceError("CudaDevice", f"HURRAY_CUDA_KEEP_MAPPINGS must be >= 0, got {n}")
    return n


class CudaDevice(Device):
    """One CUDA device (``cuda:N``). Raises DeviceError('CUDA unavailable: ...') without one."""

    tag = DeviceTag.CUDA

    def __init__(self, ordinal: int = 0, runtime: Runtime | None = None):
        self.rt = runtime or get_runtime()
        why = self.rt.probe()
        if why is not None:
            raise DeviceError("CudaDevice", with_emulation_hint(f"CUDA unavailable: {why}"))
        n = self.rt.device_count()
        if not 0 <= ordinal < n:
            raise DeviceError("CudaDevice", f"cuda:{ordinal} does not exist ({n} device(s))")
        self.ordinal = ordinal
        with self.current():
            self.identity = DeviceIdentity("cuda", ordinal, self.rt.device_uuid(ordinal),
                                           self.rt.pci_bus_id(ordinal), emulated=self.rt.emulated)
        # A cudaIpcCloseMemHandle must precede the exporter's cudaFree, so a mapping is closed as
        # soon as no buffer references it (see "Mapping lifetime" in docs/spec/sync-contract.md),
        # unless its exporter promised to ask for it back first (a kept mapping, ipc-protocol.md
        # §4.10): up to HURRAY_CUDA_KEEP_MAPPINGS of those stay open idle.
        self._cache = ImportCache(limit=0, keep=_keep_mappings())
        # cudaIpcMemHandle per allocation base, for allocations this device made only: we see
        # their cudaFree, so an entry never outlives its allocation. Foreign memory (buffer_at on
        # PyTorch/CuPy arrays) may be freed and reallocated at the same base behind our back.
        self._owned: dict[int, bytes | None] = {}
        self._caps: DeviceCapabilities | None = None
        # handle -> the one CudaStream object standing for it, so coerced streams compare by identity
        self._by_handle: weakref.WeakValueDictionary[int, CudaStream] = weakref.WeakValueDictionary()

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """This device current on the calling thread for the block, and the caller's device again
        after it: a PyTorch or CuPy thread that works on another device is not switched behind its
        back (issue 22). Asked of the runtime every time, never cached: other code on the thread
        may have called cudaSetDevice since."""
        prev = self._make_current()
        try:
            yield
        finally:
            self._restore(prev)

    def _make_current(self) -> int | None:
        """Make this device current on the calling thread; the device to make current again
        after (None: it already was, nothing to restore)."""
        prev = self.rt.get_device()
        if prev == self.ordinal:
            return None
        self.rt.set_device(self.ordinal)
        return prev

    def _restore(self, prev: int | None) -> None:
        """Make ``prev`` (from :meth:`_make_current`) current again, if anything was switched."""
        if prev is not None:
            self.rt.set_device(prev)

    def capabilities(self) -> DeviceCapabilities:
        if self._caps is None:
            rt, o = self.rt, self.ordinal
            peers = tuple(rt.device_uuid(p) for p in range(rt.device_count()) if p != o and rt.can_access_peer(o, p))
            mem, ev = rt.ipc_memory_support(o), rt.ipc_event_support(o)
            why = tuple((what, rt.unsupported_reason(o, what) or "not supported by the device")
                        for what, ok in (("ipc_memory", mem), ("ipc_events", ev)) if not ok)
            self._caps = DeviceCapabilities(mem, ev, False, peers, why)
        return self._caps

    @_on_device
    def allocate(self, size: int, on_close: Callable[[int, Callable[[], None]], None] | None = None) -> Buffer:
        """A new allocation. ``on_close(ptr, free)``: what closing the buffer does instead of
        freeing at once; it calls ``free()`` when the allocation may go (a producer whose
        consumers keep mappings of it, ipc-protocol.md §4.10)."""
        ptr = self.rt.malloc(size)
        self._owned[ptr] = None

        def free() -> None:
            self._owned.pop(ptr, None)
            with self.current():
                self.rt.free(ptr)

        return Buffer(self, ptr, size, closer=free if on_close is None else lambda: on_close(ptr, free))

    @_on_device
    def base_of(self, ptr: int) -> int:
        """The base address of the allocation ``ptr`` lies in (cuMemGetAddressRange)."""
        return self.rt.mem_range(ptr)[0]

    @_on_device
    def export_memory(self, buf: Buffer) -> MemoryExport:
        """The base allocation's handle plus the buffer's offset from it (handles name allocations).

        The handle of an allocation from :meth:`allocate` is fetched once and kept until its free;
        for memory someone else allocated it is fetched at every export, since its owner may have
        freed and reallocated it at the same address since the last one.
        """
        base = self.base_of(buf.ptr)
        if base not in self._owned:
            return MemoryExport(self.rt.ipc_get_mem_handle(base), buf.ptr - base, buf.size)
        blob = self._owned.get(base)
        if blob is None:
            blob = self.rt.ipc_get_mem_handle(base)
            if base in self._owned:  # not freed by another thread meanwhile
                self._owned[base] = blob
        return MemoryExport(blob, buf.ptr - base, buf.size)

    @_on_device
    def import_memory(self, exp: MemoryExport, keep: bool = False) -> Buffer:
        blob = bytes(exp.blob)
        if exp.offset < 0 or exp.size < 0:
            raise DeviceError("import_memory", f"negative offset {exp.offset} or size {exp.size}")

        def opener() -> tuple[tuple[int, int], Any]:
            base = self.rt.ipc_open_mem_handle(blob)

            def close() -> None:
                with self.current():
                    self.rt.ipc_close_mem_handle(base)

            try:
                _, size = self.rt.mem_range(base)  # the real allocation's size, not what the sender says
            except BaseException:
                close()
                raise
            return (base, size), close

        base, size = self._cache.acquire(blob, opener, keep)
        if exp.offset + exp.size > size:
            self._cache.release(blob)
            raise DeviceError("import_memory", f"offset {exp.offset} + size {exp.size} exceeds the allocation "
                              f"({size} bytes)")
        return Buffer(self, base + exp.offset, exp.size, closer=lambda: self._cache.release(blob), imported=True,
                      mapping=self._cache.mapping(blob))

    @property
    def import_cache(self) -> ImportCache:
        return self._cache

    @_on_device
    def create_stream(self) -> CudaStream:
        s = CudaStream(self, self.rt.stream_create())
        self._by_handle[s.handle] = s
        return s

    def wrap_stream(self, raw: Any) -> CudaStream:
        """A non-owning CudaStream for a stream someone else created (never destroyed by us)."""
        return CudaStream(self, raw, owned=False)

    def same_device(self, other: Device) -> bool:
        """Whether ``other`` is this GPU: this object, or another opened on the same runtime and ordinal."""
        return other is self or (isinstance(other, CudaDevice) and other.rt is self.rt
                                 and other.ordinal == self.ordinal)

    def as_stream(self, obj: Any, where: str | None = None) -> CudaStream:
        """The :class:`CudaStream` of this device that ``obj`` names; the one place streams are coerced.

        Accepted: a :class:`CudaStream` of this device; any object with the ``__cuda_stream__``
        protocol (cuda.core, recent CuPy/PyTorch: ``(0, cudaStream_t address)``); a raw
        ``cudaStream_t`` int: 0 or 1 the legacy default stream, 2 the per-thread default stream,
        anything else a stream handle. The same handle always gives the same object, so streams
        compare by identity. Raises UnsupportedObject (a TypeError) or InvalidArgument (a ValueError)
        naming the offending value otherwise, prefixed with ``where`` (the call and argument) when given.
        """
        try:
            return self._as_stream(obj)
        except (InvalidArgument, UnsupportedObject) as e:
            if where is None or e.where is not None:
                raise
            raise type(e)(str(e), where=where) from None

    def _as_stream(self, obj: Any) -> CudaStream:
        if isinstance(obj, CudaStream):
            if not self.same_device(obj.device):
                raise InvalidArgument(f"stream {obj!r} is a stream of {obj.device.identity.spec}, not of "
                                      f"{self.identity.spec}: the event recorded or waited on it would be another "
                                      "device's")
            if obj.raw is None:
                raise InvalidArgument(f"stream {obj!r} was closed")
            return obj
        if hasattr(obj, "__cuda_stream__"):
            got = obj.__cuda_stream__()
            if (not isinstance(got, tuple) or len(got) != 2 or not all(isinstance(x, int) for x in got)):
                raise UnsupportedObject(f"{type(obj).__name__}.__cuda_stream__() returned {got!r}; "
                                        "the protocol wants a (version, cudaStream_t address) tuple of ints")
            if got[0] != 0:
                raise InvalidArgument(f"{type(obj).__name__}.__cuda_stream__() speaks protocol version {got[0]}; "
                                      "only version 0 is understood")
            return self._stream_of_handle(got[1], f"{type(obj).__name__}.__cuda_stream__()")
        if isinstance(obj, int) and not isinstance(obj, bool):
            return self._stream_of_handle(obj, "stream")
        raise UnsupportedObject(f"not a CUDA stream: {obj!r} ({type(obj).__name__}); pass a CudaStream, an object "
                                "with __cuda_stream__ (cuda.core, CuPy, PyTorch) or a cudaStream_t int (1: legacy "
                                "default, 2: per-thread default)")

    @_on_device
    def _stream_of_handle(self, handle: int, what: str) -> CudaStream:
        if handle < 0:
            raise InvalidArgument(f"{what} gave cudaStream_t {handle}; stream handles are >= 0")
        known = self._by_handle.get(handle)
        if known is not None and known.raw is not None:
            return known
        s = self.wrap_stream(self.rt.stream_from_id(handle))
        try:
            key = s.handle  # 0, 1 and 2 name the same default stream: one object for all three
        except Exception:  # noqa: BLE001 - a backend without ids for its defaults: key by what was given
            key = handle
        known = self._by_handle.get(key)
        if known is not None and known.raw is not None:
            s = known
        self._by_handle[key] = self._by_handle[handle] = s
        return s

    @_on_device
    def create_event(self, interprocess: bool = True) -> CudaEvent:
        return CudaEvent(self, self.rt.event_create(interprocess), interprocess=interprocess)

    @_on_device
    def import_event(self, blob: bytes) -> CudaEvent:
        return CudaEvent(self, self.rt.ipc_open_event_handle(blob), interprocess=True, imported=True)

    def order_send(self, key: str) -> None:
        self.rt.hb_send(key)

    def order_receive(self, key: str) -> None:
        self.rt.hb_receive(key)

    def order_forget(self, key: str) -> None:
        self.rt.hb_forget(key)

    def publish_host(self, ptr: int, nbytes: int, what: str) -> None:
        """Host memory this device's streams wrote leaves with the next message, for another
        process's host to read: the caller must have host-waited those writes (the race checker
        reports it otherwise; real CUDA: nothing to do)."""
        self.rt.hb_publish_host(ptr, nbytes, what)

    # --- GPUDirect RDMA destinations (interchange.md R5) ----------------------------------------
    def rdma_write_ordering(self) -> str | None:
        """Why NIC writes into this device's memory cannot be made visible to it (None: they can)."""
        return self.rt.rdma_write_ordering(self.ordinal)

    def rdma_expose(self, buf: Buffer) -> None:
        """``buf`` is about to be offered to a NIC for writes: nothing on the device may read it
        until :meth:`flush_rdma_writes` after those writes (the emulation checks it)."""
        self.rt.rdma_expose(buf.ptr)

    def rdma_source(self, buf: Buffer) -> None:
        """A NIC is about to read ``buf`` (a NIXL WRITE's source): the caller host-waited its writes
        (sync-contract §6); the emulation checks that it did."""
        self.rt.rdma_source(buf.ptr, buf.size)

    @_on_device
    def flush_rdma_writes(self) -> None:
        """Block until every NIC write into this device's memory so far is visible to the device:
        the receiver's half of sync-contract §6's GPUDirect ordering, done before a buffer is handed on."""
        self.rt.flush_rdma_writes()

    def host_register_supported(self) -> bool:
        """cudaDevAttrHostRegisterSupported: whether :meth:`host_register` can page-lock here."""
        return self.rt.host_register_support(self.ordinal)

    @_on_device
    def host_register(self, buf: Buffer) -> None:
        self.rt.host_register(buf.ptr, max(buf.size, 1))

    @_on_device
    def host_unregister(self, buf: Buffer) -> None:
        self.rt.host_unregister(buf.ptr)

    def close(self) -> None:
        self._cache.clear()
