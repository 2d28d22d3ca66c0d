"""The consumer: receives handoffs and applies the sync rule the handle declares.

Contract (docs/spec/sync-contract.md §2, §3): after ``receive``, call ``handoff.wait(stream, ...)`` before enqueuing
work on the buffer — it stream-waits on the producer's event (EVENT) and then releases the event,
or orders another stream after the declared one (CONSUMER_STREAM); PRODUCER_SYNCED needs nothing.
``handoff.release()`` gives the buffer back only after your device work on it has *completed*
(sync-contract §3) without blocking you: it records an event on each stream the handoff was ordered on
(``release(stream=s)``: on ``s`` only) and the client's pump sends RELEASE once they completed.
A released buffer must not be touched again.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
import warnings
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import numpy as np
import zmq

from ..contract.handoff import AlreadyReleasedError, Handoff, HandoffError
from ..contract.meta import check_meta
from ..devices import Device, open_device
from ..devices.base import Buffer, MemoryExport, order_key
from ..devices.cuda import CudaDevice, CudaEvent, CudaStream
from ..devices.pool import Pool
from ..errors import (
    BrokerUnavailable,
    ClosedError,
    EndOfStream,
    ExportRefused,
    HurrayTimeout,
    InvalidArgument,
    MissingDependency,
    ProducerGone,
    RemoteError,
    UnsupportedObject,
)
from ..format.handle import BufferHandle, DeviceTag, HandleError, SyncMode
from ..interop import dlpack
from ..transport import inproc
from ..transport.pairing import Endpoint
from ..wire.fields import consumer_label
from ..wire.ipc import Deliver
from ..wire.ipc import EventRelease as EventReleaseMessage
from ..wire.ipc import Release as ReleaseMessage
from ..wire.messages import AnyMessage, ChannelState, Error
from ..wire.messages import ProducerGone as ProducerGoneMessage
from ..wire.messages import Unmap as UnmapMessage
from ..wire.messages import Unmapped as UnmappedMessage
from .core import Action, ConsumerCore, Delivery, EventRelease, Flush, Release, Unmap
from .session import Session, check_client_args, check_timeout

log = logging.getLogger("hurray.consumer")


_UNSET: Any = object()  # __dlpack__ called without a stream keyword


class ReceivedBuffer:
    """The bytes of one handoff, exposed without a copy, with the array metadata that travelled
    with them (docs/spec/ipc-protocol.md §4.8): ``shape`` (``()`` for 0-d), ``typestr`` (byte
    order kept), ``dl_dtype`` (a DLPack dtype numpy lacks, e.g. bfloat16) and ``readonly``.

    Host buffers: :meth:`numpy`, :meth:`host_view`, ``__array_interface__``, and the buffer
    protocol (``memoryview(buf)``) on Python 3.12+ (``__buffer__``; a Python class cannot offer
    it earlier: use :meth:`host_view` or :meth:`numpy` there). GPU buffers:
    ``__cuda_array_interface__`` (v3), and without any GPU framework :meth:`copy_to_host` or
    ``consumer.stream.copy(dst, buffer)``. Both: ``__dlpack__`` by the array API standard
    (2023.12), ordered on the stream the caller names.
    """

    def __init__(self, handoff: ReceivedHandoff, buf: Buffer, typestr: str, shape: tuple[int, ...],
                 dl_dtype: list[int] | None = None, readonly: bool = False):
        self._handoff = handoff
        self._buf = buf
        self.typestr = typestr
        self.shape = shape
        self.dl_dtype = dl_dtype
        self.readonly = readonly
        self.device_tag = handoff.handle.device_tag
        self._device_asked = False  # a DLPack consumer asked __dlpack_device__ (see __dlpack__)

    @property
    def ptr(self) -> int:
        return self._buf.ptr

    @property
    def device_buffer(self) -> Buffer:
        """The device-layer buffer, for copies on your own streams (after :meth:`wait`)."""
        self._check()
        return self._buf

    @property
    def nbytes(self) -> int:
        return self._buf.size

    @property
    def dtype_name(self) -> str:
        """'bfloat16' for a DLPack-only dtype, else the typestr ('<f4')."""
        return dlpack.dtype_name(self.typestr, self.dl_dtype)

    @property
    def on_host(self) -> bool:
        return self.device_tag in (DeviceTag.CPU, DeviceTag.CUDA_HOST)

    def _check(self) -> None:
        self._handoff._check_usable()

    def host_view(self) -> memoryview:
        """The bytes as a flat memoryview (read-only when the producer said so); host buffers."""
        return self._host_view("ReceivedBuffer.host_view()")

    def _host_view(self, where: str) -> memoryview:
        self._check()
        if not self.on_host:
            raise UnsupportedObject(f"a {self.device_tag.name} buffer has no host view: copy it with "
                                    "buffer.copy_to_host(), or use __cuda_array_interface__, __dlpack__ or "
                                    "handoff.torch() / .cupy()", where=where)
        v = self._buf.host_view()
        return v.toreadonly() if self.readonly else v

    def numpy(self) -> np.ndarray:
        """A zero-copy numpy view with the exact shape and dtype (host buffers; read-only when
        the producer said so). A dtype numpy lacks raises UnsupportedObject (a TypeError) naming it;
        a GPU buffer has no view: :meth:`copy_to_host` copies it."""
        if self.dl_dtype is not None:
            raise UnsupportedObject(f"{self.dtype_name} has no numpy dtype; use handoff.torch(), handoff.cupy() or "
                                    "another DLPack consumer (from_dlpack), which get it exactly",
                                    where="ReceivedBuffer.numpy()")
        return np.frombuffer(self._host_view("numpy()"), dtype=np.dtype(self.typestr)).reshape(self.shape)

    def copy_to_host(self, out: Any = None) -> np.ndarray:
        """The bytes copied into host memory: a new numpy array of this buffer's shape and dtype (a
        DLPack-only dtype such as bfloat16 as unsigned ints of its size), or into ``out``, any
        writable C-contiguous buffer of exactly :attr:`nbytes` bytes (returned as a numpy array
        over it). Needs no GPU framework.

        CUDA buffers: the copy is ordered after the producer's writes, on a stream of this
        handoff (the one already ordered, else the consumer's stream, which is then one that
        :meth:`ReceivedHandoff.release` waits for), and the call returns once it completed (a
        host-wait of that stream). Host buffers: a plain copy. The handoff stays yours to release."""
        self._check()
        itemsize = int(self.typestr[2:])
        dt = np.dtype(self.typestr if self.dl_dtype is None else f"u{itemsize}")
        if out is None:
            arr = np.empty(self.shape, dtype=dt)
        else:
            try:
                arr = out if isinstance(out, np.ndarray) else np.frombuffer(out, dtype=np.uint8)
            except (TypeError, ValueError):
                raise InvalidArgument(f"out is a {type(out).__name__}, not a writable buffer",
                                      where="ReceivedBuffer.copy_to_host(out=)", value=type(out).__name__) from None
            if not arr.flags.c_contiguous or not arr.flags.writeable or arr.nbytes != self.nbytes:
                raise InvalidArgument(f"out must be writable, C-contiguous and exactly {self.nbytes} bytes; it is "
                                      f"{arr.nbytes} bytes, contiguous={arr.flags.c_contiguous}, "
                                      f"writable={arr.flags.writeable}", where="ReceivedBuffer.copy_to_host(out=)",
                                      value=f"{type(out).__name__} of {arr.nbytes} bytes")
        flat = arr.reshape(-1).view(np.uint8)
        if self.on_host:
            flat[:] = np.frombuffer(self._buf.host_view(), dtype=np.uint8)
            return arr
        s = self._handoff.ordered_stream() or self._handoff.order_onto(self._handoff._consumer.stream)
        s.copy(flat, self._buf, self.nbytes)
        s.synchronize()
        return arr

    def __hurray_buffer__(self, stream: Any, writable: bool = False) -> Buffer:
        """The device-layer buffer with ``stream`` ordered after the producer's writes (device-side):
        what ``CudaStream.copy`` takes a received buffer as (devices/base.py, ``ordered_buffer``).
        As a copy's destination (``writable``) a read-only buffer is refused."""
        self._check()
        if writable and self.readonly:
            raise InvalidArgument("this handoff's buffer is read-only (the producer said so): it cannot be a copy's "
                                  "destination", where="CudaStream.copy(dst=)")
        if not self.on_host:
            self._handoff.order_onto(stream)
        return self._buf

    def __buffer__(self, flags: int) -> memoryview:
        if self.readonly and flags & 1:  # inspect.BufferFlags.WRITABLE
            raise ExportRefused("this handoff's buffer is read-only (the producer said so): ask for a read-only "
                                "view", where="memoryview(ReceivedBuffer)")
        return self.host_view()

    @property
    def __array_interface__(self) -> dict[str, Any]:
        if not self.on_host:
            raise AttributeError("__array_interface__ is only offered for host buffers")
        self._check()
        return {"shape": self.shape, "typestr": self.typestr, "data": (self._buf.ptr, self.readonly), "version": 3}

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3: ``stream`` is a stream already ordered after the producer
        (the waited one; for an EVENT handoff not yet waited, the consumer's stream is made to
        wait here, device-side); ``None`` when the producer synced. Reading it sends nothing."""
        if self.device_tag is not DeviceTag.CUDA:
            raise AttributeError("__cuda_array_interface__ is only offered for CUDA buffers")
        if self.dl_dtype is not None:
            raise AttributeError(f"{self.dtype_name} has no CUDA Array Interface typestr; use __dlpack__")
        self._check()
        s = self._handoff.ordered_stream()
        return {"shape": self.shape, "typestr": self.typestr, "data": (self._buf.ptr, self.readonly), "version": 3,
                "strides": None, "stream": None if s is None else s.protocol_handle}

    def __dlpack_device__(self) -> tuple[int, int]:
        self._device_asked = True
        return self._dl_device()

    def _dl_device(self) -> tuple[int, int]:
        if self.device_tag is DeviceTag.CUDA:
            return (dlpack.KDL_CUDA, self._buf.device.identity.ordinal)
        return (dlpack.KDL_CPU, 0)

    def __dlpack__(self, *, stream: Any = _UNSET, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        """A DLPack capsule, by the array API standard (2023.12).

        ``stream``: CUDA: where the caller will use the buffer; it is made to wait for the
        handoff first, device-side (``None``: the legacy default stream; ``-1``: no ordering; 1,
        2, other ints, CudaStreams and ``__cuda_stream__`` objects as in
        :meth:`CudaDevice.as_stream`); :meth:`ReceivedHandoff.release` then waits for work on it
        too. Host buffers take only ``None`` (or ``-1``). ``max_version`` >= (1, 0): a versioned
        capsule (READ_ONLY flag when the producer said so, IS_COPIED for a copy); else a legacy
        one, which a read-only buffer cannot have (BufferError). ``dl_device``: only this
        buffer's own device (BufferError otherwise). ``copy=True``: a private copy (host: numpy
        memory; CUDA: a new allocation, copied on the ordered stream); ``False``/``None``: the
        buffer itself. Sends no message.

        A CUDA buffer asked for without a ``stream`` keyword by a caller that never asked
        ``__dlpack_device__`` is refused (ExportRefused, a BufferError, naming the fix): that is
        how CPU-only consumers such as ``numpy.from_dlpack`` ask, and they cannot read device
        memory. GPU consumers (torch, CuPy, JAX) ask where the buffer lives first and name their
        stream. Capsules are built so that a consumer failing after taking one keeps its own
        error (interop/dlpack.py)."""
        self._check()
        _check_dlpack_args(max_version, dl_device, copy)
        here = self._dl_device()
        if dl_device is not None and (int(dl_device[0]), int(dl_device[1])) != here:
            raise ExportRefused(f"this buffer lives on DLPack device {here} and is exported there only, not to "
                                f"{tuple(dl_device)}" + (": copy it with buffer.copy_to_host()"
                                                         if int(dl_device[0]) == dlpack.KDL_CPU else ""),
                                where="ReceivedBuffer.__dlpack__(dl_device=)", value=tuple(dl_device))
        cuda = self.device_tag is DeviceTag.CUDA
        if cuda and stream is _UNSET and not self._device_asked:
            raise ExportRefused(f"this buffer is in CUDA memory (cuda:{here[1]}); the caller asked for it without "
                                "asking where it lives (__dlpack_device__) or naming a stream, as CPU-only consumers "
                                "such as numpy.from_dlpack do, and could not read it: copy it to the host with "
                                "buffer.copy_to_host(), or read it with a CUDA library (torch.from_dlpack, "
                                "cupy.from_dlpack, handoff.torch())", where="ReceivedBuffer.__dlpack__()")
        if stream is _UNSET:
            stream = None
        no_sync = isinstance(stream, int) and not isinstance(stream, bool) and stream == -1
        if not cuda and stream is not None and not no_sync:
            raise InvalidArgument("a host buffer takes only None there (the array API standard)",
                                  where="ReceivedBuffer.__dlpack__(stream=)", value=stream)
        versioned = max_version is not None and int(max_version[0]) >= 1
        dlpack.dtype_of(self.typestr, self.dl_dtype)  # BufferError for what DLPack cannot express
        if not cuda:  # numpy copies host memory itself when asked to
            return dlpack.patch(self._host_array().__dlpack__(max_version=max_version, copy=copy),
                                dl_dtype=self.dl_dtype)
        ordered = None
        if not no_sync:
            ordered = self._handoff.order_onto(1 if stream is None else stream)
        if copy:
            return self._copy_capsule(here, versioned, ordered)
        return dlpack.make_capsule(self._buf.ptr, self.shape, self.typestr, here[0], here[1], self,
                                   dl_dtype=self.dl_dtype, versioned=versioned, read_only=self.readonly)

    def _host_array(self) -> np.ndarray:
        """A numpy view of the host bytes that keeps this buffer (so its handoff) alive; a dtype
        numpy lacks is viewed as unsigned ints of its size (``dlpack.patch`` renames it)."""
        self._check()
        return dlpack.host_array(self._buf.ptr, self.shape, self.typestr, self, self.dl_dtype, self.readonly)

    def _copy_capsule(self, here: tuple[int, int], versioned: bool, ordered: CudaStream | None) -> Any:
        if ordered is None:
            raise ExportRefused("copy=True with stream=-1: the copy needs a stream ordered after the producer",
                                where="ReceivedBuffer.__dlpack__(copy=True)")
        dst = self._buf.device.allocate(self._buf.size)
        ordered.copy(dst, self._buf, self._buf.size)
        owner = _OwnedCopy(dst)
        return dlpack.make_capsule(dst.ptr, self.shape, self.typestr, here[0], here[1], owner,
                                   dl_dtype=self.dl_dtype, versioned=versioned, copied=True)


def _int_pair(v: Any) -> bool:
    return (isinstance(v, tuple | list) and len(v) == 2  # a tuple by the standard; a list harms nobody
            and all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in v))


def _check_dlpack_args(max_version: Any, dl_device: Any, copy: Any) -> None:
    """``__dlpack__``'s keywords as the array API standard types them; InvalidArgument otherwise."""
    where = "ReceivedBuffer.__dlpack__"
    if max_version is not None and not _int_pair(max_version):
        raise InvalidArgument("max_version is a (major, minor) tuple of ints, or None", where=f"{where}(max_version=)",
                              value=max_version)
    if dl_device is not None and not _int_pair(dl_device):
        raise InvalidArgument("dl_device is a (device type, device id) tuple of ints, or None",
                              where=f"{where}(dl_device=)", value=dl_device)
    if copy is not None and not isinstance(copy, bool | np.bool_):
        raise InvalidArgument("copy is True, False or None", where=f"{where}(copy=)", value=copy)


def _import(module: str, how: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(f"this needs {module}, which is not installed ({how}): {e}") from e


class _OwnedCopy:
    """A device copy made for ``__dlpack__(copy=True)``: freed when the capsule's consumer deletes it."""

    def __init__(self, buf: Buffer):
        self.buf = buf

    def __del__(self) -> None:
        self.buf.close()


class ReceivedHandoff(Handoff):
    """A handoff on the consumer side: :meth:`wait`, then use :attr:`buffer`, then :meth:`release`.

    ``with handoff:`` releases it on leaving the block (:meth:`release` without ``stream=``: after
    the device work on every stream it was ordered on). The array helpers :meth:`numpy`,
    :meth:`torch` and :meth:`cupy` are zero-copy views, valid until the release.
    """

    def __init__(self, consumer: Consumer, msg: Deliver, handle: BufferHandle, buf: Buffer, event: Any,
                 consumer_stream: CudaStream | None):
        self._consumer = consumer
        self.token = msg.token
        self.staged = msg.staged
        self.producer_id = msg.producer_id
        self.handoff_id = msg.handoff_id
        #: The HANDOFF's ``meta`` object as it travelled (ipc-protocol.md §4.8: typestr, shape,
        #: dl_dtype, readonly, user), for relays such as the bridge; :attr:`meta` is the sender's own.
        self.wire_meta: dict[str, Any] = msg.meta or {}
        #: What the producer passed as ``send(meta=)``, exactly as sent; None when it passed none.
        self.meta: Any = self.wire_meta.get("user")
        self.producer_gone = False
        #: The handoff was fenced while this consumer held it (spec §5: the consumer was silent past
        #: the broker's fence_ms, or held it past its hold_ms): its producer took it back and retired
        #: the memory. Views taken before still read the bytes as delivered (that memory
        #: is never written again); the handoff itself is over (``producer_gone`` is also true).
        self.fenced = False
        self._event = event  # in-process: the producer's CudaEvent
        self._event_blob = msg.event
        self._waited: list[CudaStream] = []  # streams ordered after the producer, in order of ordering
        self._release_streams: list[CudaStream] | None = None  # release(stream=s): [s]; release(): None
        self._raw = buf
        self._buffer_ref: weakref.ref[ReceivedBuffer] | None = None
        mode = handle.sync_mode
        super().__init__(
            handle, None, self._release_buffer,
            sync_handle=(event if event is not None else msg.event) if mode is SyncMode.EVENT else None,
            sync_handle_device_tag=handle.device_tag if mode is SyncMode.EVENT else None,
            event_release=self._release_event if mode is SyncMode.EVENT else None,
            consumer_stream=consumer_stream if mode is SyncMode.CONSUMER_STREAM else None,
        )

    # The buffer refers to its handoff (a buffer kept alive keeps the handoff, and so its release,
    # alive); the handoff refers to its buffer only weakly, so no reference cycle is built per
    # handoff (the garbage collector would otherwise run every few hundred handoffs to free them).
    @property
    def buffer(self) -> ReceivedBuffer:
        """The bytes, without a copy (the same object while you hold it)."""
        b = self._buffer_ref() if self._buffer_ref is not None else None
        if b is None:
            m = self.wire_meta
            shape = tuple(int(x) for x in m.get("shape", [self.handle.size]))
            b = ReceivedBuffer(self, self._raw, str(m.get("typestr", "|u1")), shape, m.get("dl_dtype"),
                               bool(m.get("readonly", False)))
            self._buffer_ref = weakref.ref(b)
        return b

    @buffer.setter
    def buffer(self, value: object) -> None:
        if value is not None:  # Handoff.__init__ sets None; nothing else may set it
            raise AttributeError("a received handoff's buffer cannot be replaced")

    # --- array helpers ----------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """A zero-copy numpy array of a host buffer (exact shape, dtype and byte order)."""
        return self.buffer.numpy()

    def torch(self) -> Any:
        """A zero-copy torch tensor (``torch.from_dlpack``). On CUDA it is ordered on torch's
        current stream, which torch names in ``__dlpack__(stream=)``; :meth:`release` then
        waits for the work enqueued there."""
        torch = _import("torch", "pip install torch")
        if self.handle.device_tag is DeviceTag.CUDA and not torch.cuda.is_available():
            raise UnsupportedObject("this buffer is in CUDA memory and this torch has no CUDA (a CPU build, or no "
                                    "GPU here): copy it with handoff.buffer.copy_to_host() and torch.from_numpy()",
                                    where="ReceivedHandoff.torch()")
        return torch.from_dlpack(self.buffer)

    def cupy(self) -> Any:
        """A zero-copy CuPy array of a CUDA buffer (``cupy.from_dlpack``), ordered on CuPy's
        current stream the same way."""
        return _import("cupy", "pip install cupy-cuda12x").from_dlpack(self.buffer)

    # --- the sync rule -----------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self.fenced:
            raise ProducerGone(f"handoff {self.handoff_id} was fenced: this consumer was silent past the broker's "
                               "fence_ms while it held it, or held it past the broker's hold_ms, so its producer "
                               "took the buffer back; release this handoff (views taken before keep the bytes as "
                               "delivered)")
        if self.producer_gone:
            raise ProducerGone(f"the producer of handoff {self.handoff_id} ({self.producer_id[:8]}) went away; its "
                               "buffer is no longer valid: release this handoff")
        if self.released:
            raise AlreadyReleasedError("the buffer of this handoff was released; it must not be accessed")

    def wait(self, *streams: Any) -> None:
        """Order ``streams`` (default: the consumer's stream) after the producer's writes.

        Streams may be CudaStreams, ``__cuda_stream__`` objects or cudaStream_t ints. EVENT:
        stream-wait on the event on every given stream, then release the event (once; later calls
        order new streams after one already waited). CONSUMER_STREAM: streams other than the
        declared one wait on it. PRODUCER_SYNCED: nothing to do. Every stream given here is one
        that :meth:`release` without ``stream=`` waits for.
        """
        self._check_usable()
        targets = [self._consumer.as_stream(s, "ReceivedHandoff.wait(*streams)") for s in streams] or (
            [self._consumer.stream] if self._consumer.stream is not None else [])
        if self.handle.sync_mode is SyncMode.EVENT and not self.event_released and not targets:
            raise InvalidArgument("an EVENT handoff needs a stream to wait on: Consumer(stream=...) or "
                                  "wait(stream)", where="ReceivedHandoff.wait()")
        self._order_on(targets)
        if self.handle.sync_mode is SyncMode.EVENT and not self.event_released:
            self.release_event()

    def _order_on(self, targets: list[CudaStream]) -> None:
        """Device-side only (no message): make each stream wait for the producer's writes."""
        mode = self.handle.sync_mode
        if mode is SyncMode.PRODUCER_SYNCED:
            for s in targets:
                self._note(s)
            return
        fresh = [s for s in targets if s not in self._waited and s is not self.consumer_stream]
        if mode is SyncMode.EVENT and not self.event_released and fresh:
            ev = self._event if self._event is not None else self._import_event()
            try:
                for s in fresh:
                    s.wait(ev)
                    self._waited.append(s)
            finally:
                if self._event is None:
                    ev.close()  # the importer destroys its own copy once its waits are issued
            return
        base = self.consumer_stream if mode is SyncMode.CONSUMER_STREAM else (self._waited[0] if self._waited else None)
        for s in fresh:
            self._after(s, base)

    def _import_event(self) -> CudaEvent:
        gpu, blob = self._consumer.gpu, self._event_blob
        if gpu is None or blob is None:
            raise HandoffError("no_event", "an EVENT handoff reached a consumer without a GPU, or without its "
                               "event blob")
        return gpu.import_event(blob)

    def _note(self, stream: CudaStream) -> None:
        if stream not in self._waited:
            self._waited.append(stream)

    def _after(self, stream: CudaStream, base: CudaStream | None) -> None:
        """Make ``stream`` wait on ``base``, a stream already ordered after the producer."""
        if base is None:
            raise AlreadyReleasedError("no stream of this handoff is ordered after the producer, and its event "
                                       "was already released: wait(stream) before release_event()")
        ev = self._consumer.gpu.create_event(interprocess=False)  # type: ignore[union-attr]
        ev.record(base)
        stream.wait(ev)
        ev.close()
        self._waited.append(stream)

    def ordered_stream(self) -> CudaStream | None:
        """A stream on which the buffer is safe to use (None: any, the producer synced).

        Device-side only: an EVENT handoff not yet waited is stream-waited on the consumer's
        stream here, and its event is released later, with the buffer (no message now).
        """
        mode = self.handle.sync_mode
        if mode is SyncMode.EVENT:
            if not self._waited:
                if self._consumer.stream is None:
                    raise InvalidArgument("an EVENT handoff needs a stream to wait on: Consumer(stream=...)",
                                          where="ReceivedBuffer.__cuda_array_interface__")
                self._order_on([self._consumer.stream])
            return self._waited[0]
        if mode is SyncMode.CONSUMER_STREAM:
            return self.consumer_stream
        return None

    def order_onto(self, stream: Any) -> CudaStream:
        """Make ``stream`` wait for the handoff, device-side only (``__dlpack__(stream=)``). As
        :meth:`wait`, refused once the handoff was released or its producer is gone."""
        self._check_usable()
        s = self._consumer.as_stream(stream, "ReceivedHandoff.order_onto(stream=)")
        if self.handle.sync_mode is SyncMode.EVENT and self.event_released and not self._waited:
            raise AlreadyReleasedError("the event was released before any stream waited on it")
        self._order_on([s])
        return s

    # --- releases -------------------------------------------------------------------------
    def release(self, stream: Any = None) -> None:
        """Give the buffer back once your device work on it has completed, without blocking.

        ``release(stream=s)``: records an event on ``s`` now; RELEASE goes to the producer once
        that event completed (the client's pump polls it). Use it when all your work on the
        buffer is on ``s``. ``release()``: the same, for every stream this handoff was ordered on
        — each stream given to :meth:`wait`, each stream ordered through ``__dlpack__(stream=)``
        or ``__cuda_array_interface__``, the declared consumer stream — and the consumer's own
        :attr:`Consumer.stream`; work you enqueued elsewhere must be fenced by you (pass that
        stream, or host-wait it first). Host buffers are released at once. An EVENT not yet
        released is released first (its stream-waits are already issued). Exactly once: a second
        call raises AlreadyReleasedError. ``with handoff:`` calls ``release()`` on exit.
        """
        # Under the session lock, so that release_many's check and its releases are one step:
        # a release from another thread lands before or after the whole list, never inside it.
        with self._consumer.session.lock:
            if self.released:
                raise AlreadyReleasedError("the buffer of this handoff was already released")
            self._release_streams = None if stream is None else [
                self._consumer.as_stream(stream, "ReceivedHandoff.release(stream=)")]
            super().release()

    def _fence_streams(self) -> list[CudaStream]:
        if self._release_streams is not None:
            return self._release_streams
        if self.handle.device_tag is not DeviceTag.CUDA:
            return []
        found: list[CudaStream] = []
        for s in self._waited + [self.consumer_stream, self._consumer.stream]:
            if s is not None and s.raw is not None and s not in found:
                found.append(s)
        return found

    def _release_event(self) -> None:
        self._consumer._event_released(self)

    def _release_buffer(self) -> None:
        fences = []
        for s in self._fence_streams():
            ev = self._consumer._fence()
            ev.record(s)
            fences.append(ev)
        self._consumer._release_after(self, fences)

    def __del__(self) -> None:
        """Finalizer policy: never any socket I/O (nor the session lock) from the garbage collector.
        An un-released handoff warns with ResourceWarning and is queued on its consumer (a deque
        append, atomic without the lock); the session's next pump releases it (EVENT_RELEASE,
        then RELEASE once device work recorded on its streams completed)."""
        if getattr(self, "_release", None) is None and getattr(self, "_event_release", None) is None:
            return
        warnings.warn(
            f"unreleased {self.handle.sync_mode.wire_name} handoff of {self.handle.size} bytes was garbage-"
            "collected; its release is queued for the session's next pump (call release() after your "
            "device work has completed)", ResourceWarning, stacklevel=2)
        consumer = getattr(self, "_consumer", None)
        if consumer is not None:
            consumer._dropped.append(self)  # resurrects self until the pump released it (PEP 442)


def _check_max_n(max_n: Any, where: str) -> None:
    if type(max_n) is not int or max_n < 1:
        raise InvalidArgument(f"max_n must be a positive int, not {max_n!r}", where=where, value=max_n)


class Consumer:
    """Receive buffers from the producers of ``channel``.

    ``device``: where you will use the buffers ('cpu' or 'cuda:N'); ``stream``: a CUDA stream
    (CudaStream, ``__cuda_stream__`` object or cudaStream_t int) you declare for
    SYNC_CONSUMER_STREAM (producers in this process then make it wait for you), the default
    stream of :meth:`ReceivedHandoff.wait` and one that :meth:`ReceivedHandoff.release` waits for;
    ``prefetch``: requests kept outstanding
    (0: ask for one buffer per ``receive`` call only, never ahead).

    Thread-safe: ``receive``, ``flush_releases`` and the handoffs' ``release`` may be called from
    several threads at once (each delivery goes to exactly one ``receive``); ``close`` must not
    race them. See client/DESIGN.md, "Threads and the session pump".

    ``errors``: the broker's refusals of this consumer's messages, newest last (at most 256 kept;
    each is also logged). A RELEASE refused ``unknown_token`` is one of them unless the broker had
    already said that handoff's producer was gone: the broker did not count the buffer as this
    consumer's, so its producer may have had it back while it was read.
    """

    def __init__(self, endpoint: str | None = None, channel: str = "default", device: str | Device = "cpu", *,
                 stream: Any = None, prefetch: int = 1, heartbeat_s: float = 0.5,
                 timeout_s: float = 3.0, name: str | None = None):
        check_client_args("consumer", channel, prefetch, 0, heartbeat_s, timeout_s)
        self.device = open_device(device, where="Consumer(device=)")
        self.cpu = open_device("cpu")
        self.gpu: CudaDevice | None = self.device if isinstance(self.device, CudaDevice) else None
        if stream is not None:
            stream = self.as_stream(stream, "Consumer(stream=)")
        self.declared_stream = stream
        self.stream: CudaStream | None = stream or (self.gpu.create_stream() if self.gpu else None)
        if stream is not None:
            inproc.register_stream(stream)
        # Deliveries, credits and the release queue (client/core.py); everything below it here is
        # what the core cannot hold: objects, mappings, device events, the socket.
        self.core = ConsumerCore(prefetch)
        self.credits = self.core.credits  # REQUEST credits sent and not yet delivered
        self.endpoint_info = Endpoint(self.device.identity, self.device.capabilities(), os.getpid(),
                                      None if stream is None else stream.handle)
        self._waiting: dict[str, ReceivedHandoff] = {}  # the handoffs of core.inbox's tokens
        # Weak: a handoff the application drops is collected, and its finalizer queues it on
        # _dropped (see ReceivedHandoff.__del__) for the pump to release.
        self._held: weakref.WeakValueDictionary[str, ReceivedHandoff] = weakref.WeakValueDictionary()
        self._dropped: deque[ReceivedHandoff] = deque()
        self._closing = False  # close() began: receive() takes nothing more
        self._maps: dict[str, Buffer] = {}  # each delivery's mapping, closed when the core says Unmap
        self.name = name or f"consumer-{os.getpid()}"
        self.errors: deque[RemoteError] = deque(maxlen=256)
        # PRODUCER_GONE messages with reason fenced (spec §5): this consumer fenced for silence, or
        # handoffs it held past the broker's hold_ms fenced (one message per tick that fenced some).
        self.fenced = 0
        self._fence_events: dict[int, CudaEvent] = {}  # the core's pending fence ids -> their events
        self._fence_ids = 0
        # Fence events, recorded again by later releases once completed (creating one per release
        # costs a driver call, and far more in the emulation).
        self._fences: Pool[None, CudaEvent] | None = None
        if self.gpu is not None:
            gpu = self.gpu
            self._fences = Pool(lambda _: gpu.create_event(interprocess=False), CudaEvent.close, lambda _: None,
                                what="fences")
        self.session = Session(endpoint, "consumer", channel, self._hello, self._dispatch,
                               heartbeat_s=heartbeat_s, timeout_s=timeout_s, poll=self._poll_releases)
        self.session.on_pong.append(self.core.credits.retry)
        self.session.on_welcome.append(self.core.credits.retry)
        self._label = consumer_label(self.session.client_id.encode())  # how producers name us (§1)
        self._kept_from: set[str] = set()  # producers that sent us kept mappings (spec §4.10)

    def as_stream(self, stream: Any, where: str = "stream=") -> CudaStream:
        """``stream`` (CudaStream, ``__cuda_stream__`` object or cudaStream_t int) on our GPU; errors
        name ``where`` (the call and argument it was given to)."""
        if self.gpu is None:
            raise InvalidArgument(f"a consumer on {self.device.identity.spec} has no streams: create it with "
                                  "Consumer(device='cuda:N')", where=where, value=stream)
        return self.gpu.as_stream(stream, where)

    # --- deferred releases ------------------------------------------------------------------
    def _fence(self) -> CudaEvent:
        """A process-local event to record a release fence on (a consumer with a GPU only)."""
        return self._fences.take(None)  # type: ignore[union-attr]  # streams exist only with a GPU

    def _release_after(self, ho: ReceivedHandoff, fences: list[CudaEvent]) -> None:
        """The application released ``ho``; its RELEASE goes once every fence event completed (at
        once when there are none), after its mapping was closed (the core decides, we carry out)."""
        with self.session.lock:
            ids = []
            for ev in fences:
                self._fence_ids += 1
                self._fence_events[self._fence_ids] = ev
                ids.append(self._fence_ids)
            self._waiting.pop(ho.token, None)  # close() releases what receive() never took
            self._carry_out(self.core.released(ho.token, ids))
            self._check_fences()

    def _event_released(self, ho: ReceivedHandoff) -> None:
        with self.session.lock:  # the background pump reads these too
            self._carry_out(self.core.event_released(ho.token))

    def _check_fences(self) -> None:
        """Report every pending fence that completed (a successful event query is where the host
        learns the work finished); its event is re-recordable for a later release."""
        for fid in self.core.pending_fences():
            ev = self._fence_events[fid]
            if ev.query():
                del self._fence_events[fid]
                self._fences.give(ev)  # type: ignore[union-attr]  # a fence exists: there is a GPU
                self._carry_out(self.core.fence_completed(fid))

    def _poll_releases(self) -> bool:
        """Called by the session's pump (under its lock) at the start of each round: release the
        handoffs the garbage collector found un-released and report completed fences. True while
        some release is still owed."""
        while self._dropped:  # handoffs the garbage collector found un-released
            ho = self._dropped.popleft()
            try:
                if not ho.released:
                    ho.release()  # EVENT_RELEASE first if owed; then fenced RELEASE (re-enters here)
                elif not ho.event_released:
                    ho.release_event()
            except Exception:  # noqa: BLE001 - one bad handoff must not stop the pump
                log.exception("releasing a garbage-collected handoff failed")
        self._check_fences()
        return self.core.releasing > 0

    def _carry_out(self, actions: list[Action]) -> None:
        """Do what the core asked, in its order (under the session lock). A mapping that fails to
        close keeps its RELEASE back: the producer must not reuse memory still mapped here."""
        unmap_failed: set[str] = set()
        for a in actions:
            try:
                if isinstance(a, Unmap):
                    buf = self._maps.pop(a.token, None)
                    if buf is not None:
                        try:
                            buf.close()
                        except Exception:
                            unmap_failed.add(a.token)
                            self.core.unmap_failed(a.delivery)
                            raise
                elif isinstance(a, Release) and a.token in unmap_failed:
                    log.error("RELEASE of %s not sent: its mapping did not close", a.token[:16])
                    self.credits.answered(a.credits)  # they never left
                elif isinstance(a, Release):
                    if a.reason is None:
                        self.device.order_send(order_key(a.producer_id, a.handoff_id, "release"))
                    msg = ReleaseMessage(a.token, a.reason, max(a.credits, 0))
                    if a.now:
                        self.session.send(msg)
                    else:
                        self.session.queue(msg)
                elif isinstance(a, EventRelease):
                    self.session.queue(EventReleaseMessage(a.token))
                elif isinstance(a, Flush):
                    self.session.flush_out()
            except Exception as e:  # noqa: BLE001 - the pump and the other releases go on
                log.warning("%s not carried out: %s", a, e)

    @property
    def hold_s(self) -> float | None:
        """The broker's hold bound in seconds, as its latest WELCOME stated it (spec §5,
        ``hurray-broker --hold``): a handoff held longer, counted from when the broker delivered
        it (a prefetched one not yet received too), is fenced (``h.fenced``: its producer took the
        buffer back) and this consumer gets nothing for a while. Release sooner, or copy the bytes
        out first. None when the broker sets no bound, and before it first answered (known once
        ``receive()`` returned a handoff)."""
        return self.session.hold_s

    @property
    def releasing(self) -> int:
        """Handoffs released by the application whose RELEASE waits for their device work."""
        return self.core.releasing

    @property
    def ended(self) -> bool:
        """The broker said every producer of the channel ended (CHANNEL_STATE, §4.9)."""
        return self.core.ended

    @property
    def _inbox(self) -> deque[str]:
        """Tokens delivered and not yet received, oldest first (the core's)."""
        return self.core.inbox

    def flush_releases(self, timeout: float | None = None) -> None:
        """Wait until every deferred release was sent (HurrayTimeout after ``timeout`` seconds)."""
        check_timeout(timeout, "flush_releases(timeout=)")
        self.session.pump(lambda: not self._poll_releases(), timeout,
                          f"waiting for the device work of {self.core.releasing} release(s)")

    def _hello(self, epoch: int) -> dict[str, Any]:
        return {"name": self.name, "endpoint": self.endpoint_info.to_dict(), "kept_mappings": True,
                **self.core.registering(epoch)}

    def _dispatch(self, msg: AnyMessage) -> list[Any]:
        if isinstance(msg, Deliver):
            try:
                ho = self._accept(msg)
            except Exception as e:  # noqa: BLE001 - a bad delivery must not kill the pump
                log.error("rejecting delivery %s: %s", msg.token, e)
                self._carry_out(self.core.rejected(msg.token, f"rejected: {str(e)[:1000]}"))
            else:
                self._waiting[ho.token] = ho
                self.core.delivered(Delivery(ho.token, ho.producer_id, ho.handoff_id,
                                             ho.handle.sync_mode is SyncMode.EVENT))
            return []
        if isinstance(msg, ProducerGoneMessage):
            tokens = msg.tokens
            fenced = msg.reason == "fenced"
            self.fenced += fenced
            dropped, actions = self.core.producer_gone(tokens)
            gone = set(tokens)
            found: list[ReceivedHandoff | None] = [self._held.pop(t, None) for t in tokens]
            for x in found + list(self._dropped):
                if x is not None and x.token in gone:
                    x.producer_gone = True
                    x.fenced = fenced
            for t in dropped:
                self._waiting.pop(t, None)  # no receive() hands it out; collected, it is released
            self._carry_out(actions)
        elif isinstance(msg, ChannelState):
            self.core.channel_state(msg.ended)
        elif isinstance(msg, UnmapMessage):
            self._unmap(msg)
        elif isinstance(msg, Error):
            err = RemoteError(msg.code, msg.message, msg.fields())
            self.core.credits.refused(msg.refused_credits, msg.extra.get("limit"))  # asked again by want()
            if err.code in ("unknown_token", "already_released") and self.core.crossed(msg.token):
                log.debug("RELEASE crossed PRODUCER_GONE: %s", err)  # expected: nothing to report
            else:
                self.errors.append(err)
                if err.code == "unknown_token":
                    log.error("the broker does not count buffer %s as this consumer's: its producer may "
                              "have had it back while it was read (%s)", str(msg.token)[:16], err)
                else:
                    log.warning("broker error: %s", err)
        return []

    def _unmap(self, msg: UnmapMessage) -> None:
        """A producer asks for an allocation it sent with ``keep`` back (spec §4.10): close the
        mapping (now if idle, else when the last buffer of it is released), then answer UNMAPPED,
        ordered after the close (the producer frees the allocation once every consumer answered)."""
        producer, request = msg.producer_id, msg.request
        if producer is None:
            log.warning("dropping an UNMAP without producer_id")
            return

        def answer() -> None:
            if self.session.closed:
                return  # our BYE went first: the broker answered for us (spec §4.10)
            self.device.order_send(order_key(producer, request, f"unmapped:{self._label}"))
            self.session.send(UnmappedMessage(request, producer_id=producer))

        if self.gpu is None:
            answer()  # no GPU here, so no CUDA mapping of it
        else:
            self.gpu.import_cache.unmap(bytes(msg.memory), answer)

    def _accept(self, msg: Deliver) -> ReceivedHandoff:
        handle = BufferHandle.decode(msg.handle)  # the consumer checks too: never trust the wire
        token = msg.token
        check_meta(msg.meta, handle.size)  # before any view is built from it
        self.device.order_receive(order_key(msg.producer_id, msg.handoff_id, "handoff"))
        event = None
        if msg.inproc_ref is not None:
            objs = inproc.take(msg.inproc_ref)
            src: Buffer = objs["buffer"]
            buf = src.device.buffer_at(src.ptr, handle.size) if handle.device_tag is DeviceTag.CPU else \
                self.gpu.buffer_at(src.ptr, handle.size)  # type: ignore[union-attr]
            event = objs.get("event")
        else:
            if msg.memory is None:
                raise ValueError("an IPC delivery without its memory blob")
            exp = MemoryExport(msg.memory, msg.offset, handle.size)
            dev = self.cpu if handle.device_tag is DeviceTag.CPU else self.gpu
            if dev is None:
                raise HandleError("device_tag", "device_tag", 12, int(handle.device_tag),
                                  "names a GPU buffer but this consumer has no GPU")
            buf = dev.import_memory(exp, keep=msg.keep)
            if msg.keep:
                self._kept_from.add(msg.producer_id)
        ho = ReceivedHandoff(self, msg, handle, buf, event, self.declared_stream)
        self._held[token] = ho
        self._maps[token] = buf
        return ho

    @property
    def held(self) -> int:
        """Handoffs received and not yet released."""
        return self.core.held

    def receive(self, timeout: float | None = None) -> ReceivedHandoff:
        """The next handoff. Raises EndOfStream once every producer of the channel ended and every
        handoff they sent was received (spec §4.9), HurrayTimeout after ``timeout`` seconds,
        BrokerUnavailable if the broker is gone, ClosedError once :meth:`close` began.

        Thread-safe: concurrent callers each get a different handoff."""
        check_timeout(timeout, "receive(timeout=)")
        got = self.session.pull(self.core.inbox, "REQUEST", self.core.want_request, self.core.requested, timeout,
                                f"waiting for a handoff on channel {self.session.channel!r}",
                                stop=lambda: self.core.ended or self._closing, take_next=self._take)
        if got is None:
            if self._closing:
                raise self._closing_error()
            raise EndOfStream(f"every producer of channel {self.session.channel!r} ended its stream and every "
                              "handoff they sent was received")
        return got

    def receive_many(self, max_n: int, timeout: float | None = None) -> list[ReceivedHandoff]:
        """Up to ``max_n`` handoffs at once: waits for the first as :meth:`receive` does (same
        errors: EndOfStream only when nothing is left), then takes, without waiting, every further
        one already delivered (a DELIVER batch arrives whole), oldest first. Release them one by
        one or together with :meth:`release_many`. Thread-safe: concurrent callers never get the
        same handoff."""
        _check_max_n(max_n, "receive_many(max_n=)")
        return self._more([self.receive(timeout)], max_n)

    async def areceive_many(self, max_n: int, timeout: float | None = None) -> list[ReceivedHandoff]:
        """:meth:`receive_many` on the running asyncio loop: the first handoff awaited as
        :meth:`areceive` does, the others already delivered taken with it."""
        _check_max_n(max_n, "areceive_many(max_n=)")
        return self._more([await self.areceive(timeout)], max_n)

    def _more(self, got: list[ReceivedHandoff], max_n: int) -> list[ReceivedHandoff]:
        """``got`` and, up to ``max_n`` in all, the deliveries already in the inbox (no waiting)."""
        with self.session.lock:
            while len(got) < max_n and self.core.inbox:
                got.append(self._take())
        return got

    def release_many(self, handoffs: Iterable[ReceivedHandoff], stream: Any = None) -> None:
        """:meth:`ReceivedHandoff.release` for each of ``handoffs``, their RELEASEs leaving
        together (one message where the protocol batches them): each is still sent only once its
        own device work completed (a fenced one later, with the next batch). All or nothing: the
        whole list is checked before any is released, and a bad one (not a handoff this consumer
        received: InvalidArgument; listed twice: InvalidArgument; already released:
        AlreadyReleasedError; a ``stream`` that is not one: as :meth:`ReceivedHandoff.release`)
        leaves every handoff of the list held."""
        where = "release_many(handoffs=)"
        batch = list(handoffs)
        seen: set[int] = set()
        for i, h in enumerate(batch):
            if not isinstance(h, ReceivedHandoff) or h._consumer is not self:
                raise InvalidArgument(f"item {i} is not a handoff this consumer received: {h!r}", where=where,
                                      value=h)
            if id(h) in seen:
                raise InvalidArgument(f"item {i} (handoff {h.handoff_id}) is listed twice", where=where, value=h)
            seen.add(id(h))
        fence = None if stream is None else self.as_stream(stream, "release_many(stream=)")
        with self.session.holding():  # checked and released as one step (ReceivedHandoff.release locks too)
            done = [h.handoff_id for h in batch if h.released]
            if done:
                raise AlreadyReleasedError(f"{len(done)} of these {len(batch)} handoffs were already released "
                                           f"(handoff ids {done[:8]}); none was released now")
            for h in batch:
                h.release(fence)

    def _unreleased(self) -> list[ReceivedHandoff]:
        """Under the session lock: handoffs delivered or received and not released (nor gone)."""
        return [ho for ho in self._held.values() if not ho.released and not ho.producer_gone]

    def _closing_error(self) -> ClosedError:
        return ClosedError(f"this consumer of channel {self.session.channel!r} is closing (close() began in "
                           "another thread): nothing more is received")

    def _take(self) -> ReceivedHandoff:
        """Under the lock, inside the pump: the oldest delivery, for one ``receive()``; ClosedError
        once :meth:`close` began (it releases what is held, so nothing more may be taken)."""
        if self._closing:
            raise self._closing_error()
        token, actions = self.core.taken()
        self._carry_out(actions)  # the inbox emptied: the releases held back for it go now
        return self._waiting.pop(token)

    def wait_open(self, timeout: float | None = None) -> None:
        """Wait until the channel's stream is open: at once when it has not ended, else until a
        producer registers and reopens it (spec §4.9); HurrayTimeout after ``timeout`` seconds.
        For a consumer that serves one stream after another: ``while True: c.wait_open();
        for h in c: ...``."""
        check_timeout(timeout, "wait_open(timeout=)")
        self.session.pump(lambda: not self.ended, timeout,
                          f"waiting for a producer to reopen channel {self.session.channel!r}")

    def __iter__(self) -> Iterator[ReceivedHandoff]:
        """``for handoff in consumer:`` receives until the end of the stream (every producer of
        the channel ended, §4.9), until the consumer is closed (from another thread) or the broker
        shuts down in order (SHUTDOWN); a broker that vanishes raises BrokerUnavailable. Each
        handoff is yours to release (``with handoff:``). Iterating a consumer closed before the
        loop raises ClosedError (a mistake, not an empty stream)."""
        self.session.check_open("iterating over it")
        return self._iter()

    def _iter(self) -> Iterator[ReceivedHandoff]:
        while not self.session.closed:
            try:
                yield self.receive()
            except (EndOfStream, ClosedError):
                return
            except BrokerUnavailable:
                if self.session.closed or self.session.shutdown_reason is not None:
                    return
                raise
            except zmq.ZMQError:
                if self.session.closed:
                    return  # closed while we waited
                raise

    async def areceive(self, timeout: float | None = None) -> ReceivedHandoff:
        """The next handoff, awaited on the running asyncio loop (raises TimeoutError, or
        BrokerUnavailable). The loop is never blocked: each attempt is one non-blocking pump
        round, and between attempts the coroutine awaits the session socket becoming readable
        (watched by the loop's selector on ZMQ_FD, as zmq.asyncio does) or another thread
        having dispatched something (woken through the loop, thread-safely). A zmq.asyncio
        Poller is not used on the socket itself because it would call into libzmq from the
        loop's thread outside the session lock, while the pump thread uses the socket."""
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(woken.set)

        deadline = None if timeout is None else loop.time() + timeout
        fd = self.session.fd
        self.session.wakers.append(wake)
        loop.add_reader(fd, woken.set)
        try:
            while True:
                woken.clear()  # before the attempt: a dispatch after it wakes the wait below
                try:
                    return self.receive(timeout=0)
                except TimeoutError:
                    pass
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    raise HurrayTimeout(f"timed out after {timeout} s while waiting for a handoff")
                # Bounded by the heartbeat: a silent broker is noticed (BrokerUnavailable) by the
                # next attempt, as a blocking receive() notices it.
                hb = self.session.heartbeat_s
                try:
                    await asyncio.wait_for(woken.wait(), hb if left is None else min(hb, left))
                except asyncio.TimeoutError:
                    pass
        finally:
            loop.remove_reader(fd)
            self.session.wakers.remove(wake)

    def __aiter__(self) -> AsyncIterator[ReceivedHandoff]:
        """``async for handoff in consumer:`` — :meth:`areceive` until closed or shut down;
        ClosedError when it was closed before the loop."""
        self.session.check_open("iterating over it")
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[ReceivedHandoff]:
        session = self.session
        while not session.closed:  # checked first: areceive would watch the closed socket's descriptor
            try:
                yield await self.areceive()
            except (EndOfStream, ClosedError):
                return
            except BrokerUnavailable:
                if session.closed or session.shutdown_reason is not None:
                    return
                raise

    def close(self) -> None:
        """Disconnect. Every handoff still held, received or not, is released first as
        :meth:`ReceivedHandoff.release` would (after the device work on every stream it was
        ordered on), so it raises AlreadyReleasedError on use from then on; views taken before
        must not be used either. The BYE leaves only once each of those releases went out: the
        broker gives a BYE's deliveries straight back to their producers (spec §5), which may
        then write them. When a release is still owed after the session's timeout (its device
        work has not completed, the broker did not answer, or the release failed), the consumer
        leaves without a BYE, so the broker fences it and the producers retire those buffers
        instead of reusing them; until the broker notices (its fence), a grant it holds for this
        consumer may still be used by a producer's send, whose ticket then says the handoff was
        undelivered. From the start of close() on, receive() in another thread raises ClosedError
        (a loop ends) instead of taking a delivery; a handoff that thread still holds is released
        here like the others, so stop using it first. Idempotent."""
        if self.session.closed:
            return
        with self.session.lock:
            self._closing = True  # receive() takes nothing more (_take)
        failed = 0
        deadline = time.monotonic() + self.session.timeout_s
        for _ in range(3):  # a delivery that arrives while close() waits is released in the next round
            with self.session.lock:
                self._poll_releases()  # un-released handoffs the garbage collector found: released first
                held = self._unreleased()
            for ho in held:
                try:
                    ho.release()
                except Exception as e:  # noqa: BLE001 - one handoff's failure must not keep the others
                    failed += 1
                    log.warning("closing: releasing %s failed: %s", ho.token[:16], e)
            if not self.core.releasing or not self.session.alive:
                break
            try:
                self.flush_releases(max(0.0, deadline - time.monotonic()))
            except (TimeoutError, ConnectionError):
                break  # judged at the BYE

        def bye() -> bool:  # under the session lock, with the BYE: nothing owed, nothing held
            owed = self.core.releasing + len(self._unreleased())
            if owed or failed:
                log.warning("closing without BYE: %d release(s) still owed (device work not completed within %g s, "
                            "no broker, or %d failed); the broker fences this consumer and its producers retire "
                            "those buffers", owed, self.session.timeout_s, failed)
            return not owed and not failed
        if self.gpu is not None and self._kept_from:
            # Kept mappings close before the BYE: the broker answers a later UNMAP for a consumer
            # that said BYE (spec §4.10), so its producer may free the allocation at once.
            self.gpu.import_cache.close_idle()
            for producer in self._kept_from:
                self.gpu.order_send(order_key(producer, 0, f"left:{self._label}"))
        self.session.close(bye)
        if self._fences is not None:
            self._fences.close(taken_too=False)  # those still pending complete on their own
        if self.declared_stream is not None:
            inproc.unregister_stream(self.declared_stream)

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

