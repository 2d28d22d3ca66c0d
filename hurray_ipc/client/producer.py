"""The producer: hands buffers to consumers through the broker, in the cheapest valid sync mode.

Contract (docs/spec/sync-contract.md §1): before a handle leaves ``send``, the producer
has either host-waited the writing stream (PRODUCER_SYNCED), recorded an event on it (EVENT), or
made the consumer's declared stream wait on it (CONSUMER_STREAM, in-process). The producer keeps
the buffer (and an EVENT's event) alive until the consumer releases it; then ``on_release`` fires
exactly once. Each SYNC_EVENT handoff gets an IPC event of its own, recorded once and destroyed at
the handoff's RELEASED; ``Producer(event_pool=True)`` / ``HURRAY_EVENT_POOL=1`` instead re-records
released events for later handoffs (see :class:`EventPool`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..contract.sync import Transport, choose_sync_mode
from ..devices import Device, open_device
from ..devices.base import Buffer, order_key
from ..devices.cpu import CpuDevice
from ..devices.cuda import CudaDevice, CudaEvent, CudaStream
from ..devices.errors import DeviceError
from ..devices.pool import Pool
from ..errors import BrokerUnavailable, ClosedError, InvalidArgument, RemoteError
from ..format.handle import BufferHandle, DeviceTag, SyncMode
from ..interop.source import Source, check_user_meta, resolve
from ..interop.staging import StagingExhausted, StagingPool
from ..transport import inproc
from ..transport.pairing import Endpoint, ModeCache, PairModes, host_side
from ..wire.ipc import MAX_BATCH, Accepted, EventReleased, Handoff, Released
from ..wire.ipc import Grant as GrantMessage
from ..wire.messages import MAX_UNMAP_CONSUMERS, MAX_UNMAPS, AnyMessage, End, Error, Revoke
from ..wire.messages import Unmap as UnmapMessage
from ..wire.messages import Unmapped as UnmappedMessage
from .credits import Credits
from .grants import Grant, GrantBook, Granted
from .session import Session, check_client_args, check_timeout, run_callbacks

log = logging.getLogger("hurray.producer")

DEFAULT_ALIGNMENT = 256


@functools.lru_cache(maxsize=1024)
def _handle(size: int, tag: DeviceTag, mode: SyncMode) -> BufferHandle:
    """Handles are immutable and a producer sends few distinct ones: validate and encode each once."""
    return BufferHandle(size, DEFAULT_ALIGNMENT, tag, mode)


def _settled(ticket: Ticket) -> bool:
    # A refusal settles it at once: the buffer may still wait for its writes before on_release.
    return ticket.accepted or ticket.released or ticket.error is not None


def _fewer_in_use(staging: StagingPool, before: int) -> bool:
    return staging.in_use < before


def event_pool_setting(event_pool: bool | None) -> bool:
    """``event_pool`` if given, else ``HURRAY_EVENT_POOL`` (0, the default: one event per handoff,
    recorded once; 1: re-record released events)."""
    if event_pool is not None:
        return bool(event_pool)
    raw = os.environ.get("HURRAY_EVENT_POOL", "0").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise InvalidArgument("expected 1 (reuse released events) or 0 (one event per handoff)", where="HURRAY_EVENT_POOL",
                          value=raw)


class EventPool:
    """The interprocess events of one device for SYNC_EVENT handoffs. The producer acquires one per
    handoff and records it; it releases it when the consumer's EVENT_RELEASED (or the handoff's
    RELEASED) arrives.

    ``pooled=False`` (the default): one event per handoff, recorded once and destroyed with its
    buffer (RELEASED, not EVENT_RELEASED: an importer's wait may be issued but not yet run at
    EVENT_RELEASED, and an imported event whose exporter destroyed it is undefined). cuda.core
    refuses to re-record IPC events ("IPC-enabled events should not be re-recorded"); the default
    follows that reading. The cost is a cudaEventCreate + cudaIpcGetEventHandle per handoff on the
    producer; the consumer opens (cudaIpcOpenEventHandle) each handoff's event in either mode.
    ``pooled=True`` (opt-in): a released event is re-recorded for a later handoff. The CUDA Runtime API
    allows this: cudaEventRecord may be called on an event again and overwrites its captured
    state, and cudaStreamWaitEvent waits for the state captured by the most recent
    cudaEventRecord *at the time of the wait call*, unaffected by later records. The consumer
    releases the event only after issuing its stream-waits (sync-contract §3), so a re-record
    after the release cannot change what those waits order after.

    In-process handoffs (EVENT and CONSUMER_STREAM to a consumer in this process) take ordinary
    events (``interprocess=False``), always pooled: no other process imports them, so neither
    cuda.core's rule nor an export applies, and a re-record after the waits were issued is safe.
    ``created`` and ``size`` count interprocess events only.
    """

    def __init__(self, device: CudaDevice, pooled: bool = False):
        self.device = device
        self.pooled = pooled

        def pool(interprocess: bool, keep: int | None) -> Pool[None, CudaEvent]:
            return Pool(lambda _: device.create_event(interprocess=interprocess), CudaEvent.close,
                        lambda _: None, keep=keep, what="events")

        self._ipc = pool(True, None if pooled else 0)
        self._local = pool(False, None)  # in-process events: always pooled

    def acquire(self, interprocess: bool = True) -> CudaEvent:
        return (self._ipc if interprocess else self._local).take(None)

    def release(self, ev: CudaEvent) -> None:
        """Back to the pool, or (unpooled) destroyed; the consumer's waits were already issued."""
        (self._ipc if ev.interprocess else self._local).give(ev)

    @property
    def created(self) -> int:
        """Interprocess events created so far."""
        return self._ipc.made

    @property
    def size(self) -> int:
        """Interprocess events alive (idle in the pool or out with a handoff)."""
        return self._ipc.idle + self._ipc.out

    @property
    def idle(self) -> int:
        """Interprocess events in the pool, waiting for a handoff."""
        return self._ipc.idle

    def close(self) -> None:
        self._ipc.close()
        self._local.close()


@dataclass
class Ticket:
    """One handoff as the producer sees it. ``outcome`` once released: 'released' (by the
    consumer), 'consumer_gone' (broker released it for a dead consumer), 'consumer_fenced' (its
    consumer was deregistered while it may still read the buffer: see :meth:`Producer.holds`), or
    'rejected'.
    ``obj``: what was sent (so an ``on_release`` callback knows what it may reuse).
    ``accepted``: the broker said so (only a ``send(block=True)`` asks, spec §4.6)."""

    handoff_id: int
    mode: SyncMode
    staged: bool
    transport: Transport
    consumer: str
    accepted: bool = False
    outcome: str | None = None
    error: RemoteError | None = None
    obj: Any = field(default=None, repr=False)

    @property
    def released(self) -> bool:
        return self.outcome is not None


@dataclass
class _Outgoing:
    """One handoff from its preparation to its release. Everything it takes is recorded here as
    soon as it is taken, so that a failure at any step gives all of it back (:meth:`Producer._undo`)."""

    ticket: Ticket
    source: Source
    grant: Grant
    event: CudaEvent | None = None
    slot: Buffer | None = None
    inproc_key: str | None = None
    kept: _Kept | None = None  # the allocation of allocate() it hands off, counted busy until its release
    on_release: Callable[[Ticket], None] | None = None
    resend: bool = False  # send() re-sends the source if the consumer died before delivery
    ready: int = 0  # READY credits its HANDOFF message carried (on the batch's last entry)


@dataclass
class _Kept:
    """An allocation of :meth:`Producer.allocate` on a GPU, which its consumers may keep mapped
    between handoffs (spec §4.10): it is freed only once every consumer it was delivered to said
    it unmapped it, or the broker answered for it."""

    blob: bytes | None = None  # its memory blob, once exported
    consumers: set[str] = field(default_factory=set)  # labels it was delivered to with keep
    request: int | None = None  # the UNMAP round asking for it back, while one is open
    asked: set[str] = field(default_factory=set)  # the labels that round asked
    free: Callable[[], None] | None = None  # set when the application closed it: free it then
    retired: bool = False  # a consumer could not be answered for, or was fenced: never freed while we live
    busy: int = 0  # handoffs of it not yet released: a close waits for them
    ptr: int = 0


class _VoidGrant(Exception):
    """A grant of an earlier registration of this producer: unusable, and not to be given back."""


def _check_on_release(on_release: Any, where: str) -> None:
    """``on_release`` is None or a callable (it is called with the ticket, later, from a pump)."""
    if on_release is not None and not callable(on_release):
        raise InvalidArgument("on_release is a callable taking the Ticket, or None", where=where, value=on_release)


def _preferred_mode(mode: Any) -> SyncMode | None:
    """``send(mode=)``: a SyncMode, its name ('EVENT', 'SYNC_EVENT', 'event') or None."""
    if mode is None or isinstance(mode, SyncMode):
        return mode
    if isinstance(mode, str):
        return SyncMode.from_name(mode, where="send(mode=)")
    raise InvalidArgument("a sync mode is a SyncMode or its name ('EVENT', 'SYNC_EVENT')", where="send(mode=)",
                          value=mode)




class Producer:
    """Hand buffers to the consumers of ``channel``.

    ``device``: 'cpu', 'cuda:N' or a Device; ``stream``: the CUDA stream your writes to device-layer
    buffers go to (a CudaStream, a ``__cuda_stream__`` object or a cudaStream_t int; a new
    non-blocking stream is created if omitted; see :attr:`stream` and :meth:`send`);
    ``prefetch``: how many consumer requests to hold ahead (one held unused for a heartbeat while
    another producer of the channel waits is taken back by the broker, REVOKE: spec §4.3a);
    ``event_pool``: create, record once and destroy one SYNC_EVENT event per handoff (False) or
    re-record released events (True); default from ``HURRAY_EVENT_POOL`` (0). See :class:`EventPool`.

    Thread-safe: ``send``, ``flush``, ``wait_released`` and ``holds`` may be called from several
    threads at once (each grant is taken by exactly one ``send``); ``close`` must not race them.
    ``on_release`` callbacks run outside the session lock; one that raises is logged and counted
    (``session.callback_errors``), never raised into another call. See client/DESIGN.md.
    """

    def __init__(self, endpoint: str | None = None, channel: str = "default", device: str | Device = "cpu", *,
                 stream: CudaStream | None = None, prefetch: int = 1, heartbeat_s: float = 0.5,
                 timeout_s: float = 3.0, name: str | None = None, event_pool: bool | None = None):
        check_client_args("producer", channel, prefetch, 1, heartbeat_s, timeout_s)
        self.device = open_device(device, where="Producer(device=)")
        self.cpu: CpuDevice = open_device("cpu")  # type: ignore[assignment]
        self.gpu: CudaDevice | None = self.device if isinstance(self.device, CudaDevice) else None
        if stream is not None and self.gpu is None:
            raise InvalidArgument(f"a producer on {self.device.identity.spec} has no streams: create it with "
                                  "Producer(device='cuda:N')", where="Producer(stream=)", value=stream)
        #: Where the producer orders device-layer Buffers it sends without ``stream=`` (enqueue your
        #: writes to ``allocate()``d buffers here), and what it passes to a CUDA DLPack exporter.
        self.stream: CudaStream | None = None
        if self.gpu is not None:
            self.stream = self.gpu.as_stream(stream, "Producer(stream=)") if stream is not None \
                else self.gpu.create_stream()
        self.events = EventPool(self.gpu, event_pool_setting(event_pool)) if self.gpu else None
        self.staging = StagingPool(self.cpu, pin_with=self.gpu)
        self.credits = Credits(prefetch)  # READY credits sent and not yet granted
        self.endpoint_info = Endpoint(self.device.identity, self.device.capabilities(), os.getpid())
        # Grants to send on, the consumers' endpoints they carried, END (grants.py); the pair's
        # modes from the one cache the broker uses too (keyed by the endpoints' values).
        self.grants = GrantBook(self.credits)
        self._ids = itertools.count(1)
        self._out: dict[int, _Outgoing] = {}
        # Released handoffs whose own writes may still run (their event not yet seen complete):
        # handoff id -> (outcome, free_source); they stay in _out until _settle gives them back.
        self._settling: dict[int, tuple[str, bool]] = {}
        self._modes = ModeCache()
        self.name = name or f"producer-{os.getpid()}"
        self.unknown_releases = 0  # RELEASED for a handoff already finished: a double release
        # Sources a fenced consumer may still read that could not be moved (_retire):
        # kept alive until close.
        self._fenced: list[Source] = []
        # GPU allocations of allocate() by base address, and the open UNMAP rounds (spec §4.10).
        self._kept: dict[int, _Kept] = {}
        self._rounds: dict[int, int] = {}  # request -> base address
        self._unasked: list[int] = []  # base addresses waiting for a round (MAX_UNMAPS are open)
        self._unmap_ids = itertools.count(1)
        self._asked_of: str | None = None  # the broker session the open rounds were asked of
        self.session = Session(endpoint, "producer", channel, self._hello, self._dispatch,
                               heartbeat_s=heartbeat_s, timeout_s=timeout_s, poll=self._settle)
        self.session.on_welcome.append(self._ask_again)
        self.session.on_welcome.append(self.credits.retry)
        self.session.on_pong.append(self.credits.retry)

    # --- broker messages -------------------------------------------------------------------
    @property
    def ended(self) -> bool:
        """:meth:`end` was called: no more handoffs (spec §4.9)."""
        return self.grants.ended

    def _hello(self, epoch: int) -> dict[str, Any]:
        # Grants of a previous registration are void; ask for as many again (none once ended).
        credits = self.grants.registering(epoch)
        # Every handoff not released is listed, accepted or not (acceptance is implicit, so we may
        # not know): one a consumer holds is claimed by it; one that never arrived comes back
        # after the timeout as RELEASED consumer_gone. None is freed before the broker says so.
        return {"name": self.name, "endpoint": self.endpoint_info.to_dict(), "credits": credits, "ended": self.ended,
                # Which consumer holds each: the broker lets only that consumer claim it again.
                "outstanding": {h: o.ticket.consumer for h, o in self._out.items() if h not in self._settling}}

    def _dispatch(self, msg: AnyMessage) -> list[Callable[[], None]]:
        if isinstance(msg, GrantMessage):
            if self.grants.granted(msg) is Granted.UNKNOWN_CONSUMER:
                log.error("GRANT %s names consumer %s whose endpoint this producer was never sent; "
                          "registering again", msg.grant_id, msg.consumer_id)
                self.session.registered = False
                self.session._register()
        elif isinstance(msg, Accepted):
            o = self._out.get(msg.handoff_id)
            if o is not None:
                o.ticket.accepted = True
        elif isinstance(msg, EventReleased):
            o = self._out.get(msg.handoff_id)
            # A pooled event is re-recorded for a later handoff now: a record does not change what
            # the consumer's waits, already issued, order after. One event per handoff is destroyed
            # only with the buffer (RELEASED, _finish): the consumer's waits were issued, not
            # necessarily run, and an importer's wait on an event its exporter destroyed is undefined.
            # Either way not before it completed: until then it is what tells _finish that our own
            # writes to the buffer did.
            pool = self.events
            if o is not None and o.event is not None and pool is not None and pool.pooled and self._writes_done(o):
                pool.release(o.event)
                o.event = None
        elif isinstance(msg, Released):
            hid = msg.handoff_id
            if hid in self._out:
                self.device.order_receive(order_key(self.session.client_id, hid, "release"))
            return self._finish(hid, msg.reason)
        elif isinstance(msg, UnmappedMessage):
            self._unmapped(msg)
        elif isinstance(msg, Revoke):
            # Grants we did not use in time (spec §4): their consumers were asked again. One
            # already on its way in a HANDOFF is refused unknown_grant, and send() re-sends.
            self.grants.revoked(msg.grant_ids)
        elif isinstance(msg, Error):
            h = msg.fields()
            self.credits.refused(msg.refused_credits, msg.extra.get("limit"))  # asked again by want()
            if h.get("ref") == "UNMAP" and h.get("request") in self._rounds:
                self._unmap_refused(h["request"], msg)
                return []
            ref = msg.handoff_id
            if ref is not None and ref in self._out:
                hid = ref
                o = self._out[hid]
                o.ticket.error = RemoteError(msg.code, msg.message, h)
                keep = o.resend and o.ticket.error.code in ("consumer_gone", "unknown_grant")  # send() may re-send
                return self._finish(hid, "rejected", free_source=not keep)
            ids = msg.handoff_ids
            if any(i in self._out for i in ids):
                # A HANDOFF message refused as a whole (spec §2.2): the broker used none of its
                # grants, so they are still ours; each handoff fails with the broker's reason.
                out: list[Callable[[], None]] = []
                for i in ids:
                    o = self._out.get(i)
                    if o is None or i in self._settling:
                        continue
                    o.ticket.error = RemoteError(msg.code, msg.message, h)
                    self.grants.give_back(o.grant)
                    self.credits.answered(o.ready)  # its READY was not applied either
                    out += self._finish(i, "rejected")
                return out
            log.warning("broker error: %s: %s", msg.code, msg.message)
        return []

    def _finish(self, handoff_id: int, outcome: str, free_source: bool = True) -> list[Callable[[], None]]:
        """The handoff ended (``outcome``): give back what it took and, unless it is re-sent
        (``free_source`` false), the buffer to the application (on_release). Not before this
        producer's own writes to it completed: a release proves that only when its consumer waited
        on the event and fenced that wait; one that never waited, or the broker releasing for a
        dead consumer, proves nothing of them (sync-contract §3, "What a buffer release proves to
        the producer"). Until its event completed the handoff stays outstanding (:meth:`_settle`)."""
        o = self._out.get(handoff_id)
        if o is None:
            self.unknown_releases += 1
            log.warning("release of handoff %s that is not outstanding", handoff_id)
            return []
        if handoff_id in self._settling:
            self.unknown_releases += 1
            log.warning("release of handoff %s that ended already (it waits for its writes)", handoff_id)
            return []
        if free_source and outcome != "consumer_fenced" and o.event is not None and not self._writes_done(o):
            self._settling[handoff_id] = (outcome, free_source)
            return []
        del self._out[handoff_id]
        self.device.order_forget(order_key(self.session.client_id, handoff_id, "handoff"))
        if outcome == "consumer_fenced":
            self._retire(o)
        self._undo(o)
        if free_source:
            o.source.free()
        o.ticket.outcome = outcome
        if not free_source:
            return []  # re-sent: on_release belongs to the handoff that is delivered
        cb = o.on_release
        return [lambda: cb(o.ticket)] if cb is not None else []

    def _writes_done(self, o: _Outgoing) -> bool:
        """Whether the writes ``o``'s event was recorded after completed (a successful query is
        where the host learns so). A query that fails counts as done, with an error on the log, so
        that no handoff waits for ever: on CUDA such errors are sticky, and nothing enqueued after
        them runs either."""
        assert o.event is not None
        try:
            return o.event.query()
        except DeviceError as e:
            log.error("handoff %s: its event cannot be queried (%s); given back without knowing that the writes "
                      "before it completed", o.ticket.handoff_id, e)
            return True

    def _settle_now(self) -> None:
        """At close, after the last pump round: every ended handoff still waiting for its writes
        host-waits them (this producer's own work, already enqueued) and is given back."""
        with self.session.lock:
            for hid in self._settling:
                try:
                    self._out[hid].event.synchronize()  # type: ignore[union-attr]
                except DeviceError:
                    pass  # _writes_done logs it
            self._settle()
            callbacks, self.session.deferred = self.session.deferred, []
        run_callbacks(callbacks)

    def _settle(self) -> bool:
        """The pump's hook, each round (under the session lock): :meth:`_finish` again every ended
        handoff still waiting for its writes; those whose event completed now are given back (their
        callbacks run in this round, after the lock), the others wait again. True while one waits."""
        if not self._settling:
            return False
        for hid in list(self._settling):
            outcome, free_source = self._settling.pop(hid)
            self.session.deferred += self._finish(hid, outcome, free_source)
        return bool(self._settling)

    def _retire(self, o: _Outgoing) -> None:
        """A fenced consumer may still read this handoff (spec §5): nothing it may read or wait on
        is written, re-recorded or handed out again until this producer closes. Its event is kept
        idle until close; its staging slot, or the slot holding the copy the library made, is
        freed (the pages stay with the consumer's mapping and are never handed out again). The caller's own shared
        memory gets fresh pages in place, so the caller may reuse it. Anything else (device
        memory, memory another process exported) cannot be moved: it is kept alive and
        :meth:`holds` stays true for it until :meth:`close` (cudaFree under an importer's mapping
        is undefined)."""
        # Not given back: still in the pool's list of all its events, so neither re-recorded
        # nor destroyed before close().
        o.event = None
        if o.slot is not None:
            self.staging.retire(o.slot)
            o.slot = None
        if o.source.slot is not None:  # the library's copy: retired, never written again
            self.staging.retire(o.source.slot)
            o.source.slot = o.source.cleanup = None
        buf = o.source.buffer
        if o.ticket.staged or o.source.copied:
            return  # the consumer maps the slot or the copy, not the caller's memory
        if o.kept is not None:
            o.kept.retired = True  # an allocation of allocate(): closing it frees nothing now
        # In process the consumer reads our own mapping: new pages under it would not help.
        if isinstance(buf.device, CpuDevice) and not buf.imported and o.inproc_key is None:
            try:
                buf.device.retire_memory(buf)
                return
            except Exception as e:  # noqa: BLE001 - it runs on the pump thread: keep the buffer instead
                log.warning("a fenced consumer may still read %r, which cannot be moved (%s): kept until close", buf, e)
        self._fenced.append(o.source)

    def _undo(self, o: _Outgoing, failed: bool = False) -> None:
        """Give back what one handoff took (its event, staging slot, in-process reference, its
        count on an allocation), at its release or when it ``failed`` before it left. Its grant and
        its source are the callers'."""
        if o.event is not None:
            self.events.release(o.event)  # type: ignore[union-attr]
            o.event = None
        if o.slot is not None:
            self.staging.release(o.slot)
            o.slot = None
        if o.inproc_key is not None:
            inproc.drop(o.inproc_key)
            o.inproc_key = None
        if o.kept is not None:
            k, o.kept = o.kept, None
            with self.session.lock:
                k.busy -= 1
                if not failed:
                    self._dispose(k)
                elif k.free is not None and not k.busy:
                    # Closed while this send failed: the next step may send (an UNMAP) or free,
                    # so it runs after the failure is handled, from the next pump round.
                    self.session.deferred.append(partial(self._closed_later, k))

    # --- the API ---------------------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        """Handoffs sent and not yet given back (released, and the writes they covered completed)."""
        return len(self._out)

    # --- kept mappings (spec §4.10) ----------------------------------------------------------
    def _closed(self, ptr: int, free: Callable[[], None]) -> None:
        """The application closed a buffer of :meth:`allocate`: free it once no handoff of it is
        outstanding (a consumer reads it until its release), then at once if no consumer may keep it
        mapped, else once they all said they unmapped it (UNMAP round); never while this process
        lives if a consumer was fenced while it held it (spec §5: :meth:`holds` stays true)."""
        with self.session.lock:
            k = self._kept.get(ptr)
            if k is None:
                free()
                return
            k.free = free
            self._dispose(k)

    def _dispose(self, k: _Kept) -> None:
        """The next step toward freeing a closed allocation (under the session lock)."""
        if k.free is None or k.busy:
            return  # open, freed already (free is taken once), or out (its last release calls this again)
        if k.retired:
            log.warning("a buffer of allocate() that a consumer nobody could answer for may keep mapped (fenced, "
                        "or not answering UNMAP) stays allocated until this process exits (spec §4.10, §5)")
        elif not k.consumers:
            del self._kept[k.ptr]
            free, k.free = k.free, None
            free()
        elif k.request is None:
            if self.session.closed:  # every consumer was asked at close(); these were not answered
                k.retired = True
            else:
                self._ask_back(k.ptr, k)

    def _closed_later(self, k: _Kept) -> None:
        with self.session.lock:
            self._dispose(k)

    def _count_out(self, out: _Outgoing, ptr: int, offset: int | None, blob: bytes | None) -> bool:
        """Count ``out`` as a handoff of its :meth:`allocate` allocation, if it is one, so that a
        close waits for its release; ``offset`` is ``ptr``'s from the allocation's base (None: not
        known, in process). True when its HANDOFF may carry ``keep`` (``blob``: its memory frame):
        ours to free, so its consumer may keep the mapping after the release (§4.10)."""
        if not self._kept:
            return False
        with self.session.lock:  # closes and releases change these too, from other threads
            k = self._kept.get(ptr if offset is None else ptr - offset)
            if k is None and offset is None:
                try:
                    k = self._kept.get(self.gpu.base_of(ptr))  # type: ignore[union-attr]
                except DeviceError:
                    k = None  # memory the driver cannot place is not an allocation of ours
            if k is None:
                return False
            out.kept = k
            k.busy += 1
            if blob is None or k.free is not None or k.request is not None or k.retired \
                    or not self.session.kept_mappings:
                return False
            k.blob = blob
            k.consumers.add(out.grant.consumer_id)
            return True

    def _ask_back(self, ptr: int, k: _Kept) -> None:
        """UNMAP: ask every consumer this allocation was delivered to with ``keep`` to close its
        mapping (under the session lock); at most MAX_UNMAPS rounds at once, the rest wait."""
        assert k.blob is not None  # consumers are recorded only with the blob
        if not self.session.kept_mappings:  # registered again with a broker that cannot ask them
            k.retired = True
            log.warning("an allocation of allocate() kept mapped by consumers stays allocated until this process "
                        "exits: the broker does not carry UNMAP (spec §4.10)")
            return
        if len(k.consumers) > MAX_UNMAP_CONSUMERS:  # one UNMAP cannot name them all
            k.retired = True
            log.warning("an allocation of allocate() delivered with keep to %d consumers stays allocated until this "
                        "process exits: one UNMAP names at most %d (spec §4.10)", len(k.consumers),
                        MAX_UNMAP_CONSUMERS)
            return
        if len(self._rounds) >= MAX_UNMAPS:
            if ptr not in self._unasked:
                self._unasked.append(ptr)
            return
        k.request = request = next(self._unmap_ids)
        k.asked = set(k.consumers)
        self._rounds[request] = ptr
        self._asked_of = self.session.broker_session
        self.session.send(UnmapMessage(request, k.blob, consumers=sorted(k.asked)))

    def _ask_again(self) -> None:
        """After a WELCOME from another broker session: the rounds still open were lost with the
        broker that had them, so they are asked again (a re-registration with the same broker
        keeps them)."""
        if self.session.broker_session == self._asked_of:
            return
        for request, ptr in list(self._rounds.items()):
            del self._rounds[request]
            k = self._kept[ptr]
            k.request = None
            self._ask_back(ptr, k)

    def _ask_next(self) -> None:
        """A round ended: ask one waiting for a free place."""
        while self._unasked and len(self._rounds) < MAX_UNMAPS:
            ptr = self._unasked.pop(0)
            k = self._kept.get(ptr)
            if k is not None and k.request is None and not k.retired:
                self._ask_back(ptr, k)

    def _unmapped(self, msg: UnmappedMessage) -> None:
        """The broker closed an UNMAP round: free the allocation if the application closed it
        and no consumer was fenced; with a fenced one, keep it until this process exits."""
        ptr = self._rounds.pop(msg.request, None)
        k = self._kept.get(ptr) if ptr is not None else None
        if k is None or k.request != msg.request:
            return
        k.request = None
        self._ask_next()
        me = self.session.client_id
        for label in msg.unmapped or []:  # each closed its mapping before it answered
            self.device.order_receive(order_key(me, msg.request, f"unmapped:{label}"))
        for label in msg.gone or []:  # each closed its mappings before its BYE (or exited)
            self.device.order_receive(order_key(me, 0, f"left:{label}"))
        if msg.fenced:
            k.retired = True
            log.warning("consumer(s) %s could not be asked to unmap an allocation of allocate() (fenced, or not "
                        "registered within the broker's timeout since a broker restart or since it was dropped "
                        "silent): it stays allocated until this process exits",
                        ", ".join(msg.fenced))
            return
        k.consumers -= k.asked
        self._dispose(k)

    def _unmap_refused(self, request: int, err: Error) -> None:
        """The broker refused an UNMAP (a library bug, or a broker's limit): nobody was asked, so
        the allocation stays allocated until this process exits."""
        k = self._kept[self._rounds.pop(request)]
        k.request, k.retired = None, True
        log.error("UNMAP %d refused (%s: %s): its allocation stays allocated until this process exits", request,
                  err.code, err.message)
        self._ask_next()

    def _unmap_all(self, timeout: float) -> None:
        """At close: ask back every kept allocation and wait (at most ``timeout`` s) for the
        answers; what stays unanswered is retired (spec §4.10), said in one warning with why.
        Without a wait (timeout 0, no broker) what was asked is retired in the same hold of the
        lock, so an answer arriving meanwhile changes nothing: the count does not depend on timing."""
        left, wait = 0, False
        why = "the producer was interrupted while their consumers were asked to unmap"
        try:
            with self.session.lock:
                for ptr, k in self._kept.items():
                    if k.consumers and k.request is None and not k.retired:
                        self._ask_back(ptr, k)
                wait = bool(self._rounds) and self.session.alive and timeout > 0
                if not wait:
                    why = ("the producer closed without waiting for their consumers to unmap (timeout 0, or a "
                           "with-block left through an exception)" if self.session.alive else
                           "the broker is unavailable, so their consumers could not be asked to unmap")
                    left = self._retire_unanswered()
            if wait:
                self.session.pump(lambda: not self._rounds, timeout, "waiting for consumers to unmap")
        except BrokerUnavailable:
            why = "the broker went while their consumers were asked to unmap"
        except TimeoutError:
            why = f"their consumers did not answer UNMAP within {timeout:g} s"
        finally:
            if wait:
                with self.session.lock:
                    left = self._retire_unanswered()
            if left:
                log.warning("closing: %d allocation(s) of allocate() that consumers may still map stay allocated "
                            "until this process exits: %s", left, why)

    def _retire_unanswered(self) -> int:
        """(Under the session lock.) Retire every allocation still asked back or waiting to be:
        kept until this process exits (spec §4.10). Returns how many."""
        left = len(self._unasked) + len(self._rounds)
        for ptr in self._unasked:
            self._kept[ptr].retired = True
        self._unasked.clear()
        for request in list(self._rounds):
            k = self._kept[self._rounds.pop(request)]
            k.request, k.retired = None, True
        return left

    def holds(self, obj: Any) -> bool:
        """True while ``obj`` is part of a handoff not yet released (it will come back through
        on_release), and for good when a fenced consumer may still read it and its memory could
        not be moved (device memory: spec §5): never write or free such an object while this
        producer is open (closing a GPU buffer of :meth:`allocate` is safe: the library keeps its
        memory while a consumer may read it). Host shared memory from :meth:`allocate` is moved
        instead, so it is free."""
        with self.session.lock:
            return (any(o.source.keep is obj for o in self._out.values())
                    or any(src.keep is obj for src in self._fenced))

    def allocate(self, size: int) -> Buffer:
        """A buffer of ``size`` bytes (an int >= 0) on the producer's device that hands off without
        a copy; yours until you send it, then the consumer's until its release. Close it
        (``buf.close()``, not while a ``send()`` of it runs) when done: a GPU buffer's memory is
        freed only once no handoff of it is outstanding and no consumer may still map it (spec
        §4.10; never while this process lives once a consumer was fenced while it held it, §5).
        ClosedError after :meth:`close` or :meth:`end`."""
        self._check_open("allocate")
        try:
            n = operator.index(size) if not isinstance(size, bool) else -1
        except TypeError:
            n = -1
        if n < 0:
            raise InvalidArgument("a size is an int of bytes >= 0", where="allocate(size=)", value=size)
        if self.gpu is None:
            return self.device.allocate(n)
        buf = self.gpu.allocate(n, on_close=self._closed)
        with self.session.lock:
            self._kept[buf.ptr] = _Kept(ptr=buf.ptr)
        return buf

    def _take_grant(self, timeout: float | None) -> Grant:
        """The next grant, waiting for a consumer to ask. ClosedError once this producer ended
        (also when another thread ends it meanwhile)."""
        grant: Grant | None = self.session.pull(self.grants.queue, "READY", lambda: self.credits.want(len(self.grants)),
                                  self.credits.ask, timeout,
                                  f"waiting for a consumer request on channel {self.session.channel!r}",
                                  stop=lambda: self.ended)
        if grant is None:
            raise ClosedError(f"this producer of channel {self.session.channel!r} ended its stream (end()) while a "
                              "send waited for a consumer")
        return grant

    def grant_ready(self, timeout: float = 0.0) -> bool:
        """Whether a consumer has asked (a GRANT is held), so that the next :meth:`send` does not
        wait for one; waits up to ``timeout`` seconds for it, asking the broker (READY) as
        :meth:`send` would. For a caller that must not block on a consumer: a loop with other work
        (a bridge) calls this with 0 and sends only when it returns True. Raises BrokerUnavailable
        as :meth:`send` does."""
        check_timeout(timeout, "grant_ready(timeout=)")
        try:
            grant = self._take_grant(timeout)
        except TimeoutError:
            return False
        with self.session.lock:
            self.grants.give_back(grant)  # the next send takes it (unless it became void meanwhile)
        return True

    def send(self, obj: Any, mode: SyncMode | str | None = None, *, stream: Any = None,
             timeout: float | None = None, block: bool = True,
             on_release: Callable[[Ticket], None] | None = None, meta: Any = None,
             shape: Any = None, dtype: Any = None, readonly: bool | None = None) -> Ticket:
        """Hand ``obj`` to the next consumer that asks.

        ``mode``: preferred sync mode for a GPU buffer (a SyncMode or its name); the cheapest
        valid one is used where it is not valid for the consumer (EVENT, then CONSUMER_STREAM,
        then PRODUCER_SYNCED, then a host-staged copy): ``ticket.mode`` says which. A host buffer
        is always PRODUCER_SYNCED (sync-contract §1): another mode for one is refused.
        ``stream``: where ``obj``'s writes were enqueued (a CudaStream, a ``__cuda_stream__``
        object or a cudaStream_t int). The producer orders the handoff after it: it host-waits it
        (PRODUCER_SYNCED, staged copies) or records the handoff's event on it (EVENT, CONSUMER_STREAM).
        Without ``stream=`` the stream comes from ``obj``: a ``__cuda_array_interface__`` (v3)
        object's ``stream`` entry (absent: the legacy default stream; ``None``: the exporter says
        no ordering is needed, and :attr:`stream` is used); a CUDA DLPack-only object is asked
        ``obj.__dlpack__(stream=self.stream)``, so the exporter makes :attr:`stream` wait for its
        writes (its capsule is kept until the release); a device-layer Buffer was written on
        :attr:`stream`. Host objects need no stream.
        ``block``: wait until the broker accepted the handoff (a refusal raises RemoteError here);
        with ``block=False`` it lands on the returned ticket. ``on_release(ticket)`` runs once, when
        the buffer is yours again to write on any stream: after the consumer's release and after
        your writes to it that the handoff covered completed (sync-contract §3).
        ``timeout``: seconds to wait for a consumer's grant: HurrayTimeout, with nothing sent and
        nothing taken (0: only when a grant is already here). Once the handoff left, a blocking
        send waits for the broker's answer whatever ``timeout`` says (a timeout then would raise
        for a handoff that is out and may be delivered); that wait ends with BrokerUnavailable when
        the broker stays silent for the session's ``timeout_s``.
        ``meta``: your own metadata, any JSON value (dicts with str keys, lists, str, numbers,
        bool, None), delivered exactly as sent as ``handoff.meta``; refused (InvalidArgument)
        before anything is taken when it is not JSON or its encoding is over 64 KiB.
        ``shape``/``dtype``: how the consumer sees the bytes (e.g. for a buffer from
        :meth:`allocate`, which is otherwise plain bytes); ``dtype`` is anything ``numpy.dtype``
        takes, a torch dtype, or a name numpy lacks ('bfloat16', 'float8_e4m3fn'); shape times
        item size must be the buffer's size exactly (InvalidArgument otherwise).
        ``readonly``: the consumer must not write (default: True when ``obj`` is read-only,
        e.g. bytes or a non-writeable array); its array views and DLPack capsules say so.
        Host bytes not in shared memory (numpy, bytes, a torch CPU tensor) are copied into a slot
        of the producer's pool (:attr:`staging`), which is written again only after this handoff's
        release; when every slot is in use at ``HURRAY_STAGING_BYTES``, ``send`` waits for a
        release (at most 4 session timeouts, then HurrayTimeout); a copy larger than that limit is
        refused (InvalidArgument) before a grant is taken. A buffer from :meth:`allocate` is not copied.

        A handoff whose consumer died before it arrived is re-sent to the next consumer. A send
        that raises gives back everything it took: the consumer's grant (the next send takes
        it), the staging slot, the event, the shared-memory copy. A Buffer closed before the send
        or while it waits (another thread) is refused with InvalidArgument. Raises ClosedError after
        :meth:`close` or :meth:`end`, BrokerUnavailable when no broker answers.
        """
        preferred = _preferred_mode(mode)
        check_timeout(timeout, "send(timeout=)")
        _check_on_release(on_release, "send(on_release=)")
        src = self._source(obj, stream, preferred, meta, shape, dtype, readonly)
        try:
            while True:
                grant = self._take_grant(timeout)
                try:
                    prepared = self._prepare(src, grant, preferred, on_release, resend=block, ack=block)
                except _VoidGrant:
                    continue  # the registration it came with is gone: take the next one
                except BaseException:
                    with self.session.lock:
                        self.grants.give_back(grant)  # unused: the next send takes it
                    raise
                ticket = self._submit([prepared])[0]
                if not block:
                    return ticket
                # Not bounded by `timeout`: the handoff is out (see the docstring).
                self.session.pump(partial(_settled, ticket), None, "waiting for the broker to accept")
                if ticket.error is not None and ticket.error.code in ("consumer_gone", "unknown_grant"):
                    continue  # never delivered: its consumer died, or its grant was revoked or void
                if ticket.error is not None:
                    raise ticket.error
                return ticket
        except BaseException:
            with self.session.lock:
                pending = [o for o in self._out.values() if o.source is src]
            for o in pending:
                o.resend = False  # nobody will re-send it now: its release must free and report
            if not pending:
                src.free()
            raise

    def _source(self, obj: Any, stream: Any, preferred: SyncMode | None, meta: Any, shape: Any, dtype: Any,
                readonly: bool | None) -> Source:
        """``obj`` as a Source with its metadata encoded, everything checked that can be checked
        before a grant is taken; nothing is held when it raises."""
        self._check_open("send")
        if meta is not None:
            check_user_meta(meta)
        explicit = self._explicit_stream(stream)
        src = resolve(obj, self._host_slot, self.gpu, explicit, self.stream)
        try:
            if preferred is not None and preferred is not SyncMode.PRODUCER_SYNCED and not isinstance(
                    src.buffer.device, CudaDevice):
                raise InvalidArgument(f"{preferred.wire_name} is for GPU buffers; a host buffer is always "
                                      "SYNC_PRODUCER_SYNCED (sync-contract §1): leave mode= out", where="send(mode=)",
                                      value=preferred.wire_name)
            if shape is not None or dtype is not None:
                src.describe_as(shape, dtype)
            if readonly is not None:
                if not isinstance(readonly, bool):
                    raise InvalidArgument("readonly is True, False or None (from the object)", where="send(readonly=)",
                                          value=readonly)
                src.readonly = readonly
            src.user = meta
            src.wire = src.wire_meta()
        except BaseException:
            src.free()
            raise
        return src

    def _check_open(self, what: str) -> None:
        self.session.check_open(what)
        if self.ended:
            raise ClosedError(f"this producer of channel {self.session.channel!r} ended its stream (end() or "
                              f"close()) before {what}; create a new Producer to send again")
        self.session.check_open(what)

    def _explicit_stream(self, stream: Any) -> CudaStream | None:
        """``send(stream=)`` as a CudaStream of our device (None: not given)."""
        if stream is None:
            return None
        if self.gpu is None:
            raise InvalidArgument("a producer without a CUDA device has no streams", where="send(stream=)",
                                  value=stream)
        return self.gpu.as_stream(stream, "send(stream=)")

    def _pairing(self, grant: Grant, on_gpu: bool) -> tuple[Endpoint, PairModes]:
        """The consumer's endpoint (as its pairing's first GRANT carried it) and the pair's valid
        modes. _VoidGrant when the session registered again since the grant came (a re-HELLO
        voids every grant and forgets the endpoints)."""
        with self.session.lock:
            consumer = self.grants.consumer(grant)
        if consumer is None:
            raise _VoidGrant(grant)
        me = self.endpoint_info if on_gpu else host_side(self.endpoint_info)
        return consumer, self._modes.get(me, consumer)

    def send_many(self, objs: list[Any], mode: SyncMode | str | None = None, *, stream: Any = None,
                  timeout: float | None = None, on_release: Callable[[Ticket], None] | None = None,
                  meta: Any = None) -> list[Ticket]:
        """Hand several objects over in as few messages as the grants allow: each round takes
        every grant already here (waiting only for the first), prepares that many handoffs as
        :meth:`send` would, and sends them as one HANDOFF batch (spec §4.7). Like
        ``send(block=False)``: errors the broker reports land on the tickets, ``on_release(ticket)``
        runs once per handoff; a handoff whose consumer died before it arrived is not re-sent.
        Every object is checked (and copied to shared memory where needed) before any grant is
        taken; one that fails raises and nothing of this call is sent. A failure later (the
        broker gone, a timeout) raises after the handoffs already sent, whose tickets stay valid."""
        preferred = _preferred_mode(mode)
        check_timeout(timeout, "send_many(timeout=)")
        _check_on_release(on_release, "send_many(on_release=)")
        if not isinstance(objs, list | tuple):  # an array is one object: iterating it would send each row
            raise InvalidArgument("send_many takes a list (or tuple) of objects; send() takes one",
                                  where="send_many(objs=)", value=f"<{type(objs).__name__}>")
        srcs: list[Source] = []
        try:
            for obj in objs:
                srcs.append(self._source(obj, stream, preferred, meta, None, None, None))
        except BaseException:
            for src in srcs:
                src.free()
            raise
        tickets: list[Ticket] = []
        done = 0
        try:
            while done < len(srcs):
                grants = [self._take_grant(timeout)]
                with self.session.lock:
                    while self.grants.queue and len(grants) < min(len(srcs) - done, MAX_BATCH):
                        grants.append(self.grants.queue.popleft())
                batch: list[tuple[_Outgoing, Handoff]] = []
                try:
                    for src, g in zip(srcs[done:], grants, strict=False):
                        batch.append(self._prepare(src, g, preferred, on_release, resend=False, ack=False))
                except _VoidGrant:
                    pass  # the session registered again: what is prepared goes; the rest waits for new grants
                finally:  # what was prepared goes out; grants not used stay for the next send (if still valid)
                    with self.session.lock:
                        for g in reversed(grants[len(batch):]):
                            self.grants.give_back(g)
                    if batch:
                        tickets += self._submit(batch)
                        done += len(batch)
        except BaseException:
            for src in srcs[done:]:
                src.free()
            raise
        return tickets

    def _submit(self, batch: list[tuple[_Outgoing, Handoff]]) -> list[Ticket]:
        """Register the prepared handoffs and send them as one message (the last carries the
        READY). If the message cannot be sent, nothing stays registered and each handoff gives
        back what it took, its grant included."""
        with self.session.lock:  # the background pump reads these too
            want = self.credits.ask_for(len(self.grants))
            if want > 0:  # ask for the next grants on this message instead of a READY of their own
                batch[-1][1].ready = batch[-1][0].ready = want
            for out, _msg in batch:
                hid = out.ticket.handoff_id
                self._out[hid] = out
                self.device.order_send(order_key(self.session.client_id, hid, "handoff"))
            sent_before = self.session.messages_sent
            try:
                self.session.send_batch([msg for _out, msg in batch])
            except BaseException:
                if self.session.messages_sent != sent_before:
                    raise  # it left (e.g. Ctrl-C just after): it is outstanding, its release comes back
                self.credits.answered(want)
                for out, _msg in batch:
                    hid = out.ticket.handoff_id
                    del self._out[hid]
                    self.device.order_forget(order_key(self.session.client_id, hid, "handoff"))
                    self._undo(out, failed=True)
                    self.grants.give_back(out.grant)
                raise
        return [out.ticket for out, _msg in batch]

    def _prepare(self, src: Source, grant: Grant, preferred: SyncMode | None,
                 on_release: Callable[[Ticket], None] | None, resend: bool,
                 ack: bool) -> tuple[_Outgoing, Handoff]:
        """One handoff's mode, producer obligation (sync-contract §1) and HANDOFF entry; not yet sent.
        What it takes (event, staging slot, in-process reference) is given back if it raises."""
        buf = src.buffer
        if buf.closed:  # by another thread while send() ran (a re-send): no memory to hand off
            raise InvalidArgument(f"{buf!r} was closed while it was being sent", where="send(obj=)")
        on_gpu = isinstance(buf.device, CudaDevice)
        consumer, pm = self._pairing(grant, on_gpu)
        hid = next(self._ids)
        out = _Outgoing(Ticket(hid, SyncMode.PRODUCER_SYNCED, False, pm.transport, grant.consumer_id,
                               obj=src.keep), src, grant, on_release=on_release, resend=resend)
        meta, raw = src.wire
        msg = Handoff(grant_id=grant.grant_id, handoff_id=hid, handle=b"", meta=meta, meta_raw=raw, ack=ack)
        inproc_obj: dict[str, Any] = {}
        try:
            if on_gpu and pm.host_staged:
                slot = self._stage(buf, src.stream, out)
                out.ticket.staged = msg.staged = True
                handle = BufferHandle(buf.size, DEFAULT_ALIGNMENT, DeviceTag.CPU)
                target = self.cpu.buffer_at(slot.ptr, buf.size)
                share = slot
            else:
                mode = choose_sync_mode(pm.valid, preferred) if on_gpu else SyncMode.PRODUCER_SYNCED
                assert mode is not None
                handle = _handle(buf.size, buf.tag, mode)
                out.ticket.mode = mode
                target = share = buf
                if on_gpu:
                    self._order(mode, src.stream, out, consumer, inproc_obj, msg, pm.transport)
            if pm.transport is Transport.IN_PROCESS:
                # Its address, not the application's Buffer, which a close empties (ptr 0) while
                # the handoff is out; the memory stays until the release (_count_out).
                inproc_obj["buffer"] = Buffer(target.device, target.ptr, target.size)
                out.inproc_key = msg.inproc_ref = inproc.put(inproc_obj)
                if on_gpu and not msg.staged:
                    self._count_out(out, share.ptr, None, None)
            else:
                exp = share.device.export_memory(share)
                msg.memory = exp.blob
                msg.offset = exp.offset
                if on_gpu and not msg.staged:
                    msg.keep = self._count_out(out, share.ptr, exp.offset, exp.blob)
        except BaseException:
            self._undo(out, failed=True)
            raise
        msg.handle = handle.encode()
        return out, msg

    def _order(self, mode: SyncMode, stream: CudaStream | None, out: _Outgoing, consumer: Endpoint,
               inproc_obj: dict[str, Any], msg: Handoff, transport: Transport) -> None:
        """Make the buffer's writes visible per ``mode`` (sync-contract §1), before the handle leaves."""
        if stream is None:
            raise InvalidArgument("a GPU buffer needs the stream its writes were enqueued on", where="send(stream=)")
        if mode is SyncMode.PRODUCER_SYNCED:
            stream.synchronize()
            return
        ev = out.event = self.events.acquire(transport is not Transport.IN_PROCESS)  # type: ignore[union-attr]
        ev.record(stream)
        if mode is SyncMode.EVENT:
            if transport is Transport.IN_PROCESS:
                inproc_obj["event"] = ev
            else:
                msg.event = ev.export()
        else:  # CONSUMER_STREAM: the consumer's stream waits; no event crosses the boundary
            inproc.stream(consumer.stream).wait(ev)  # type: ignore[arg-type]
            # Kept until the release all the same: it tells _finish when our writes completed.

    def _slot(self, nbytes: int) -> Buffer:
        """A slot of the staging pool for ``nbytes``: one idle of its size class, or a new one.
        At the pool's byte limit with every slot in use, waits (pumping the session) until a
        consumer's release gives one back, at most 4 session timeouts (then HurrayTimeout);
        larger than the limit: InvalidArgument at once (:meth:`StagingPool.acquire`)."""
        while True:
            try:
                return self.staging.acquire(nbytes)
            except StagingExhausted:
                before = self.staging.in_use
                self.session.pump(partial(_fewer_in_use, self.staging, before), self.session.timeout_s * 4,
                                  "waiting for a staging slot to be released")

    def _host_slot(self, nbytes: int) -> tuple[Buffer, Callable[[], None]]:
        """Where ``send`` copies host bytes that are not in shared memory (interop.source.HostSlot):
        a slot given back when the handoff's release frees its source (:meth:`_finish`), or
        retired when a fenced consumer may still read it (:meth:`_retire`)."""
        slot = self._slot(nbytes)
        return slot, partial(self.staging.release, slot)

    def _stage(self, buf: Buffer, stream: CudaStream | None, out: _Outgoing) -> Buffer:
        """Copy a GPU buffer into a staging slot (``out.slot``) and host-wait the copy (host-staged fallback)."""
        slot = out.slot = self._slot(buf.size)
        s = stream or self.stream
        assert s is not None
        s.copy(slot, buf, buf.size)
        s.synchronize()
        s.device.publish_host(slot.ptr, buf.size, "a staging slot")  # the consumer's host reads it
        return slot

    def wait_released(self, timeout: float | None = None) -> None:
        """Wait until at least one outstanding handoff is released (HurrayTimeout after ``timeout``
        seconds)."""
        check_timeout(timeout, "wait_released(timeout=)")
        before = len(self._out)
        if before:
            self.session.pump(lambda: len(self._out) < before, timeout, "waiting for a release")

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every handoff was released (HurrayTimeout after ``timeout`` seconds)."""
        check_timeout(timeout, "flush(timeout=)")
        self.session.pump(lambda: not self._out, timeout, f"waiting for {len(self._out)} release(s)")

    def end(self) -> None:
        """End this producer's stream (spec §4.9): it sends nothing more on its channel. Grants it
        holds go back to their consumers; releases of what it sent still arrive (:meth:`flush`).
        Once every producer registered on the channel has ended, each consumer's iterator ends
        (and ``receive()`` raises EndOfStream) after the handoffs sent before. A producer that
        registers later reopens the channel. Idempotent; :meth:`close` calls it unless
        ``close(end=False)``; ``send`` after it raises ClosedError."""
        with self.session.lock:
            if self.ended:
                return
            self.session.check_open("end()")
            self.grants.end()
            self.session.send(End())

    def close(self, timeout: float | None = None, *, end: bool = True) -> None:
        """End the stream (unless ``end=False``: for a producer another one takes over from),
        wait for every outstanding release (at most ``timeout`` seconds when given; saying so on
        the log after half a second), then disconnect and free pooled resources. Idempotent.

        Why wait: a producer's memory stays valid only while it is registered; one that leaves
        takes what its consumers did not release yet (they get PRODUCER_GONE, and drop what they
        had queued: spec §4.9). So the handoffs sent before the end all reach a slow consumer.
        The wait ends early when the broker goes (BrokerUnavailable) or on Ctrl-C.

        Leaving ``with Producer(...)`` normally is ``close()``; leaving it through an exception
        (Ctrl-C above all) neither waits nor ends the stream: a producer that failed did not
        finish, so its consumers wait for another (as for a crash, spec §4.9)."""
        if self.session.closed:
            return
        check_timeout(timeout, "close(timeout=)")
        try:
            if end and not self.ended:
                self.end()
            if self._out and self.session.alive and (timeout is None or timeout > 0):
                try:
                    self.flush(0.5 if timeout is None else min(timeout, 0.5))
                except TimeoutError:
                    log.warning("closing: waiting %s for %d handoff(s) to be released by their consumers "
                                "(Ctrl-C leaves now; they are then lost to them)",
                                "without end" if timeout is None else f"up to {timeout - 0.5:.1f} s", len(self._out))
                    self.flush(None if timeout is None else max(0.0, timeout - 0.5))
        except (TimeoutError, BrokerUnavailable):
            log.warning("closing with %d handoff(s) unreleased", len(self._out))
        finally:
            if self._settling:
                self._settle_now()
            with self.session.lock:  # closed while a send failed, its next step still queued
                for k in [k for k in self._kept.values() if not k.retired]:  # retired: warned at its close
                    self._dispose(k)
            try:
                if any(k.consumers for k in self._kept.values()):
                    self._unmap_all(self.session.timeout_s if timeout is None else max(0.0, min(timeout,
                                                                                              self.session.timeout_s)))
            finally:  # a Ctrl-C in the wait still disconnects and frees the pools (a notebook lives on)
                try:
                    self.session.close()
                finally:
                    if self.session.closed:  # not while registered: a fenced handoff's event outlives our BYE
                        self._close_pools()

    def _close_pools(self) -> None:
        """At close, once disconnected: destroy the pooled events and free the staging slots,
        unless a handoff is still out (one unreleased at a close that could not wait keeps its event
        and slot until the process exits, where a consumer may still use them)."""
        if self._out:
            return
        if self.events is not None:
            self.events.close()
        self.staging.close()
        self._fenced.clear()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # leave at once: the broker releases what is outstanding when we go
            self.close(timeout=0.0, end=False)
