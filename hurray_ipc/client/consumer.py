"""The consumer: receives handoffs and applies the sync rule the handle declares.

Contract (ADR-018 §2, §5): after ``receive``, call ``handoff.wait(stream, ...)`` before enqueuing
work on the buffer — it stream-waits on the producer's event (EVENT) and then releases the event,
or orders another stream after the declared one (CONSUMER_STREAM); PRODUCER_SYNCED needs nothing.
Call ``handoff.release()`` only after your device work on the buffer has *completed*: host-wait
your stream (``stream.synchronize()``), or record your own event and wait on it, or release from a
completion callback on your stream. A released buffer must not be touched again.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import Any

import numpy as np

from ..contract.handoff import Handoff
from ..devices import Device, open_device
from ..devices.base import Buffer, MemoryExport
from ..devices.cuda import CudaDevice, CudaStream
from ..format.handle import BufferHandle, DeviceTag, HandleError, SyncMode
from ..transport import dlpack, inproc
from ..transport.pairing import Endpoint
from ..transport.protocol import Message, order_key
from .session import RemoteError, Session

log = logging.getLogger("hurray.consumer")


class ProducerGone(RuntimeError):
    """The producer of this handoff died; its memory may no longer be valid."""


class ReceivedBuffer:
    """The bytes of one handoff, exposed without a copy.

    Host buffers: ``numpy()``, ``memoryview()``/``host_view()``, ``__array_interface__``, and the
    buffer protocol (``__buffer__``, Python 3.12+). GPU buffers: ``__cuda_array_interface__`` (v3)
    and ``__dlpack__(stream=...)``, both ordered on the stream(s) the handoff was waited on.
    """

    def __init__(self, handoff: "ReceivedHandoff", buf: Buffer, typestr: str, shape: tuple[int, ...]):
        self._handoff = handoff
        self._buf = buf
        self.typestr = typestr
        self.shape = shape
        self.device_tag = handoff.handle.device_tag

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
    def on_host(self) -> bool:
        return self.device_tag in (DeviceTag.CPU, DeviceTag.CUDA_HOST)

    def _check(self) -> None:
        self._handoff._check_usable()

    def host_view(self) -> memoryview:
        self._check()
        return self._buf.host_view()

    def numpy(self) -> np.ndarray:
        """A zero-copy numpy view (host buffers)."""
        return np.frombuffer(self.host_view(), dtype=np.dtype(self.typestr)).reshape(self.shape)

    def __buffer__(self, flags: int) -> memoryview:
        return self.host_view()

    @property
    def __array_interface__(self) -> dict[str, Any]:
        if not self.on_host:
            raise AttributeError("__array_interface__ is only offered for host buffers")
        self._check()
        return {"shape": self.shape, "typestr": self.typestr, "data": (self._buf.ptr, False), "version": 3}

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self.device_tag is not DeviceTag.CUDA:
            raise AttributeError("__cuda_array_interface__ is only offered for CUDA buffers")
        self._check()
        s = self._handoff.ordered_stream()
        return {"shape": self.shape, "typestr": self.typestr, "data": (self._buf.ptr, False), "version": 3,
                "strides": None, "stream": None if s is None else s.handle}

    def __dlpack_device__(self) -> tuple[int, int]:
        if self.device_tag is DeviceTag.CUDA:
            return (dlpack.KDL_CUDA, self._buf.device.identity.ordinal)
        return (dlpack.KDL_CPU, 0)

    def __dlpack__(self, stream: int | None = None, **_kw: Any) -> Any:
        """A DLPack capsule. For CUDA, ``stream`` (the consumer's stream) is ordered first."""
        self._check()
        if self.device_tag is DeviceTag.CUDA and stream is not None and stream != -1:
            self._handoff.order_onto(stream)
        dev_type, dev_id = self.__dlpack_device__()
        return dlpack.make_capsule(self._buf.ptr, self.shape, self.typestr, dev_type, dev_id, self)


class ReceivedHandoff(Handoff):
    """A handoff on the consumer side: :meth:`wait`, then use :attr:`buffer`, then :meth:`release`."""

    def __init__(self, consumer: "Consumer", token: str, handle: BufferHandle, buf: Buffer, header: dict[str, Any],
                 event: Any, event_blob: bytes | None, consumer_stream: CudaStream | None):
        self._consumer = consumer
        self.token = token
        self.staged = bool(header.get("staged"))
        self.producer_id = str(header.get("producer_id", ""))
        self.handoff_id = int(header.get("handoff_id", 0))
        self.meta = header.get("meta") or {}
        self.producer_gone = False
        self._event = event  # in-process: the producer's CudaEvent
        self._event_blob = event_blob
        self._waited: list[CudaStream] = []
        self._raw = buf
        mode = handle.sync_mode
        super().__init__(
            handle, None, self._release_buffer,
            sync_handle=(event if event is not None else event_blob) if mode is SyncMode.EVENT else None,
            sync_handle_device_tag=handle.device_tag if mode is SyncMode.EVENT else None,
            event_release=self._release_event if mode is SyncMode.EVENT else None,
            consumer_stream=consumer_stream if mode is SyncMode.CONSUMER_STREAM else None,
        )
        shape = tuple(int(x) for x in self.meta.get("shape", [handle.size]))
        self.buffer = ReceivedBuffer(self, buf, str(self.meta.get("typestr", "|u1")), shape)

    # --- the sync rule -----------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self.producer_gone:
            raise ProducerGone(f"the producer of handoff {self.token[:8]} died; its buffer is no longer valid")
        if self.released:
            raise RuntimeError("the buffer of this handoff was released; it must not be accessed")

    def wait(self, *streams: CudaStream) -> None:
        """Order ``streams`` (default: the consumer's stream) after the producer's writes.

        EVENT: stream-wait on the event on every given stream, then release the event (once; call
        wait with all the streams that will touch the buffer). CONSUMER_STREAM: streams other than
        the declared one wait on it. PRODUCER_SYNCED: nothing to do.
        """
        self._check_usable()
        targets = list(streams) or ([self._consumer.stream] if self._consumer.stream is not None else [])
        mode = self.handle.sync_mode
        if mode is SyncMode.EVENT:
            if self.event_released:
                for s in targets:
                    self._after_waited(s)
                return
            if not targets:
                raise ValueError("an EVENT handoff needs a stream to wait on (Consumer(stream=...) or wait(stream))")
            ev = self._event if self._event is not None else self._consumer.gpu.import_event(self._event_blob)
            try:
                for s in targets:
                    s.wait(ev)
                    self._waited.append(s)
            finally:
                if self._event is None:
                    ev.close()  # the importer destroys its own copy once its waits are issued
            self.release_event()
        elif mode is SyncMode.CONSUMER_STREAM:
            for s in targets:
                if s is not self.consumer_stream:
                    self._after_waited(s, self.consumer_stream)

    def _after_waited(self, stream: CudaStream, base: CudaStream | None = None) -> None:
        """Make ``stream`` wait on a stream that already is ordered after the producer."""
        base = base or (self._waited[0] if self._waited else None)
        if base is None or stream is base or stream in self._waited:
            return
        ev = self._consumer.gpu.create_event(interprocess=False)
        ev.record(base)
        stream.wait(ev)
        ev.close()
        self._waited.append(stream)

    def ordered_stream(self) -> CudaStream | None:
        """A stream on which the buffer is safe to use (None: any, the producer synced)."""
        if self.handle.sync_mode is SyncMode.EVENT:
            if not self._waited:
                self.wait()
            return self._waited[0]
        if self.handle.sync_mode is SyncMode.CONSUMER_STREAM:
            return self.consumer_stream
        return None

    def order_onto(self, stream_id: int) -> None:
        gpu = self._consumer.gpu
        s = gpu.wrap_stream(gpu.rt.stream_from_id(stream_id))
        known = [w for w in self._waited + ([self.consumer_stream] if self.consumer_stream else []) if w.handle == stream_id]
        if known:
            return
        if self.handle.sync_mode is SyncMode.EVENT and not self.event_released:
            self.wait(s)
        elif self.handle.sync_mode is not SyncMode.PRODUCER_SYNCED:
            self._after_waited(s, self.ordered_stream())

    # --- releases -------------------------------------------------------------------------
    def _release_event(self) -> None:
        self._consumer._send_release("EVENT_RELEASE", self)

    def _release_buffer(self) -> None:
        self._raw.close()
        self._consumer._send_release("RELEASE", self)


class Consumer:
    """Receive buffers from the producers of ``channel``.

    ``device``: where you will use the buffers ('cpu' or 'cuda:N'); ``stream``: a CUDA stream you
    declare for SYNC_CONSUMER_STREAM (producers in this process then make it wait for you) and the
    default stream of :meth:`ReceivedHandoff.wait`; ``prefetch``: requests kept outstanding
    (0: ask for one buffer per ``receive`` call only, never ahead).
    """

    def __init__(self, endpoint: str | None = None, channel: str = "default", device: "str | Device" = "cpu", *,
                 stream: CudaStream | None = None, prefetch: int = 1, heartbeat_s: float = 0.5,
                 timeout_s: float = 3.0, name: str | None = None):
        self.device = open_device(device)
        self.cpu = open_device("cpu")
        self.gpu: CudaDevice | None = self.device if isinstance(self.device, CudaDevice) else None
        self.declared_stream = stream
        self.stream: CudaStream | None = stream or (self.gpu.create_stream() if self.gpu else None)
        if stream is not None:
            inproc.register_stream(stream)
        self.prefetch = max(0, prefetch)
        self.endpoint_info = Endpoint(self.device.identity, self.device.capabilities(), os.getpid(),
                                      None if stream is None else stream.handle)
        self._inbox: deque[ReceivedHandoff] = deque()
        self._requested = 0
        self._held: dict[str, ReceivedHandoff] = {}
        self.name = name or f"consumer-{os.getpid()}"
        self.errors: list[RemoteError] = []
        self.session = Session(endpoint, "consumer", channel, self._hello, self._dispatch,
                               heartbeat_s=heartbeat_s, timeout_s=timeout_s)

    def _hello(self) -> dict[str, Any]:
        held = [{"token": t, "producer_id": h.producer_id, "handoff_id": h.handoff_id,
                 "event_pending": h.handle.sync_mode is SyncMode.EVENT and not h.event_released}
                for t, h in self._held.items() if not h.producer_gone]
        # Credits travel in HELLO: a REQUEST sent to a broker that lost us is not lost with it.
        return {"name": self.name, "endpoint": self.endpoint_info.to_dict(), "held": held,
                "credits": self._requested}

    def _dispatch(self, msg: Message) -> list[Any]:
        h = msg.header
        if msg.verb == "DELIVER":
            self._requested = max(0, self._requested - 1)
            try:
                self._inbox.append(self._accept(msg))
            except Exception as e:  # noqa: BLE001 - a bad delivery must not kill the pump
                log.error("rejecting delivery %s: %s", h.get("token"), e)
                token = h.get("token")
                if isinstance(token, str):
                    self.session.send(Message("RELEASE", {"token": token, "reason": f"rejected: {e}"}))
        elif msg.verb == "PRODUCER_GONE":
            for token in h.get("tokens", []):
                ho = self._held.pop(token, None)
                if ho is not None:
                    ho.producer_gone = True
            for ho in [x for x in self._inbox if x.producer_gone]:
                self._inbox.remove(ho)  # in place: a waiting receive() watches this deque
        elif msg.verb == "ERROR":
            err = RemoteError(str(h.get("code")), str(h.get("message")), h)
            if err.code not in ("unknown_token",):
                self.errors.append(err)
            log.warning("broker error: %s", err)
        return []

    def _accept(self, msg: Message) -> ReceivedHandoff:
        h = msg.header
        handle = BufferHandle.decode(msg.frames["handle"])  # the consumer checks too: never trust the wire
        token = str(h["token"])
        self.device.order_receive(order_key(str(h.get("producer_id", "")), int(h.get("handoff_id", 0)), "handoff"))
        event = None
        if h.get("inproc"):
            objs = inproc.take(str(h["inproc_ref"]))
            src: Buffer = objs["buffer"]
            buf = src.device.buffer_at(src.ptr, handle.size) if handle.device_tag is DeviceTag.CPU else \
                self.gpu.buffer_at(src.ptr, handle.size)  # type: ignore[union-attr]
            event = objs.get("event")
        else:
            exp = MemoryExport(msg.frames["memory"], int(h.get("offset", 0)), handle.size)
            dev = self.cpu if handle.device_tag is DeviceTag.CPU else self.gpu
            if dev is None:
                raise HandleError("device_tag", "device_tag", 12, int(handle.device_tag),
                                  "names a GPU buffer but this consumer has no GPU")
            buf = dev.import_memory(exp)
        ho = ReceivedHandoff(self, token, handle, buf, h, event, msg.frames.get("event"), self.declared_stream)
        self._held[token] = ho
        return ho

    def _send_release(self, verb: str, ho: ReceivedHandoff) -> None:
        with self.session.lock:  # the background pump reads these too
            if verb == "RELEASE":
                self._held.pop(ho.token, None)
            if ho.producer_gone:
                return  # nobody to give it back to
            header: dict[str, Any] = {"token": ho.token}
            if verb == "RELEASE":
                want = self.prefetch - len(self._inbox) - self._requested
                if want > 0:  # ask for the next buffers on this message instead of a REQUEST
                    header["credits"] = want
                    self._requested += want
            try:
                if verb == "RELEASE":
                    self.device.order_send(order_key(ho.producer_id, ho.handoff_id, "release"))
                self.session.send(Message(verb, header))
            except Exception as e:  # noqa: BLE001
                log.warning("%s of %s not sent: %s", verb, ho.token[:8], e)

    @property
    def held(self) -> int:
        """Handoffs received and not yet released."""
        return len(self._held)

    def receive(self, timeout: float | None = None) -> ReceivedHandoff:
        """The next handoff (raises TimeoutError, or BrokerUnavailable if the broker is gone)."""
        def asked(n: int) -> None:
            self._requested += n

        return self.session.pull(self._inbox, "REQUEST", lambda: max(self.prefetch, 1) - len(self._inbox) - self._requested,
                                 asked, timeout, "waiting for a handoff")

    def close(self) -> None:
        """Disconnect. Handoffs still held are released (the broker releases them to producers)."""
        for ho in list(self._inbox):
            if not ho.released:
                ho.release()
        self.session.close()
        if self.declared_stream is not None:
            inproc.unregister_stream(self.declared_stream)

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


