"""The receiving bridge's protocol state machine, without I/O (docs/spec/interchange.md §3-§4, R3-R4).

:class:`ReceiverCore` takes events — a decoded link message from the sender (:class:`LinkReceived`),
the passage of time (:class:`Tick`), and what the loop did with the core's last actions
(:class:`Reserved`, :class:`Offered`, :class:`ConsumerAsked`, :class:`HandoffEnded`...) — and returns
what to do, as typed actions: messages to send (:class:`Send`), destinations to reserve, fill,
quarantine or free, buffers to hand on. It reads no clock (``now`` comes with each event), touches
no socket, buffer, NIXL agent or broker, and starts no thread; ``BridgeIn``
(hurray_ipc/broker/bridge.py) is its loop: it owns those, runs the actions in order, and feeds the
results back, from its one thread (a local consumer's release, which a pump thread sees, is queued
and reaches the core from the loop).

Destinations are named by ids the core hands out (:class:`Reserve`); the loop maps each to its
buffer. A destination's life, and who ends it:

- ``Reserve`` → the loop allocates and reserves it and answers :class:`Reserved` or
  :class:`ReserveFailed` (then REJECT ``no_space``) before any other event;
- on the NIXL plane, ``Offer`` → the loop faults it in and registers it, sends RDMA_REGISTER and
  answers :class:`Offered` (from then on the sender's NIC may write it) or :class:`OfferFailed`;
- ``Write`` → TENSOR_DATA bytes into it;
- ``HandOn`` → to a local consumer (``again``: after a bounce); the loop answers
  :class:`HandoffEnded` exactly once per HandOn (or :class:`HandOnFailed`);
- ``Free`` (back to its pool) ends it, ``Keep`` (a fenced consumer may still read it: never
  reused) ends it, and ``Quarantine`` (deregister now) is followed by its ``Free`` only once no
  WRITE of the sender can land in it any more (R4.4: 2T plus a link timeout after its offer).

Invariants (:meth:`ReceiverCore.check_invariants`; tests/test_interchange_receiver.py drives every
interleaving and checks the actions): at most ``window`` partial transfers held, and the credits a
sender can hold plus the partial transfers never above ``window``; every destination ends exactly
once and nothing touches it after; no destination the sender's NIC may still write is freed before
its quarantine ended; buffers are handed on in descriptor order; a buffer bounces at most
``max_bounces`` times.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from hurray_ipc.notes import Note, to_logger
from hurray_ipc.wire.link import (
    INTERCHANGE_VERSION,
    MAX_WINDOW,
    Credit,
    LinkHello,
    LinkMessage,
    LinkPing,
    LinkWelcome,
    RdmaReady,
    Reject,
    TensorData,
    TensorDataEnd,
    TensorDescriptor,
    TransferFault,
)

from .rules import MAX_BOUNCES, SENDER_ENDED, WINDOW, Coverage, Plane, transfer_bound

HELLO_EVERY_S = 0.5  # how often an unlinked receiver says LINK_HELLO


# --- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReceiverConfig:
    channel: str
    window: int = WINDOW
    timeout_s: float = 3.0
    max_bytes: int = 1 << 40
    planes: tuple[Plane, ...] = (Plane.ZMQ,)  # in this receiver's order of preference (R1.1)
    gpu_destination: str | None = None  # LINK_HELLO, informational (R1.5)
    max_bounces: int = MAX_BOUNCES


# --- events -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkReceived:
    """A link message from the sender, decoded (or a TransferFault: one the spec answers)."""

    msg: LinkMessage | TransferFault
    now: float


@dataclass(frozen=True)
class Tick:
    """Time passed: say hello or ping, release quarantined destinations, notice a silent sender."""

    now: float


@dataclass(frozen=True)
class Reserved:
    """The destination of a ``Reserve`` is allocated, every page reserved (§3 receiver rule 1)."""

    dest: int
    now: float


@dataclass(frozen=True)
class ReserveFailed:
    dest: int
    message: str
    now: float


@dataclass(frozen=True)
class Offered:
    """RDMA_REGISTER for ``dest`` was sent at ``now``: from now on the sender's NIC may write it."""

    dest: int
    now: float


@dataclass(frozen=True)
class OfferFailed:
    """``dest`` could not be faulted in or registered: the transfer is refused (``rdma_failed``)."""

    dest: int
    message: str
    now: float


@dataclass(frozen=True)
class ConsumerAsked:
    """A local consumer's grant is held: the next buffer in order may be handed on."""

    now: float


@dataclass(frozen=True)
class HandOnFailed:
    """The local broker could not take ``dest`` (it is unavailable). ``held``: the producer still
    holds the buffer (a :class:`HandoffEnded` follows); else the loop's answer to that HandOn ends here."""

    dest: int
    message: str
    held: bool
    now: float


@dataclass(frozen=True)
class HandoffEnded:
    """The local broker's word on a handed-on ``dest`` (once per HandOn). ``consumer_gone``: its
    consumer went before it arrived (hand it on again); ``error``: any refusal; ``fenced``: its
    consumer was fenced and may still read it."""

    dest: int
    now: float
    consumer_gone: bool = False
    error: str | None = None
    fenced: bool = False


@dataclass(frozen=True)
class Closing:
    """The bridge stops: every partial transfer is discarded (before the local producer goes)."""

    now: float


@dataclass(frozen=True)
class Closed:
    """The local producer is gone (its releases were fed as HandoffEnded): give back what is left."""

    now: float


ReceiverEvent = (LinkReceived | Tick | Reserved | ReserveFailed | Offered | OfferFailed | ConsumerAsked | HandOnFailed
                 | HandoffEnded | Closing | Closed)


# --- actions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    msg: LinkMessage


@dataclass(frozen=True)
class Reserve:
    """Allocate and reserve ``size`` bytes as destination ``dest`` (``nixl``: for the NIXL plane),
    then answer Reserved or ReserveFailed."""

    dest: int
    size: int
    nixl: bool


@dataclass(frozen=True)
class Offer:
    """Fault ``dest`` in, register it, send its RDMA_REGISTER for ``transfer_id``; answer Offered or OfferFailed."""

    dest: int
    transfer_id: int


@dataclass(frozen=True)
class Write:
    dest: int
    offset: int
    data: bytes | memoryview = field(repr=False)


@dataclass(frozen=True)
class HandOn:
    """Hand ``dest`` to the local consumer whose grant is held, as SYNC_PRODUCER_SYNCED with ``meta``
    (first time, ``again`` False: after TENSOR_DATA_END; made visible to the device first). An
    Offer of it not yet made is void (its transfer ended over TENSOR_DATA: nothing is to write it)."""

    dest: int
    transfer_id: int
    meta: dict[str, Any] | None
    again: bool


@dataclass(frozen=True)
class Free:
    """``dest`` is no one's any more: back to its pool (forget any faulting in of it)."""

    dest: int


@dataclass(frozen=True)
class Quarantine:
    """Deregister ``dest`` now and keep it out of the pool: a Free follows once no WRITE can land."""

    dest: int


@dataclass(frozen=True)
class Keep:
    """A fenced consumer may still read ``dest``: never reuse or free it while the bridge runs."""

    dest: int


@dataclass(frozen=True)
class Announce:
    """The link changed (linked, plane): tell the local broker the route before any handoff."""


ReceiverAction = (Send | Reserve | Offer | Write | HandOn | Free | Quarantine | Keep | Announce)


# --- state --------------------------------------------------------------------------------------


class Stage(enum.Enum):
    RESERVING = "reserving"  # Reserve sent, its answer not yet in
    RECEIVING = "receiving"  # accepted: bytes arrive
    ENDED = "ended"  # TENSOR_DATA_END with every byte: waits to be handed on


@dataclass
class Partial:
    """A transfer whose descriptor was accepted, not yet handed on or discarded (§3 receiver rule 4)."""

    tid: int
    size: int
    meta: dict[str, Any] | None
    dest: int
    nixl: bool
    seq: int  # descriptor order
    coverage: Coverage
    stage: Stage = Stage.RESERVING
    offered_at: float | None = None  # RDMA_REGISTER sent: the sender's NIC may write until it lets go


class Hand(enum.Enum):
    AT_CONSUMER = "at_consumer"  # HandOn done, its end not yet reported
    BOUNCED = "bounced"  # its consumer went before it arrived: waits to be handed on again


@dataclass
class HandedOn:
    tid: int
    meta: dict[str, Any] | None
    state: Hand = Hand.AT_CONSUMER
    bounces: int = 0


@dataclass
class Quarantined:
    until: float
    dest: int


@dataclass
class ReceiverStats:
    rejected: int = 0
    discarded: int = 0


class ReceiverCore:
    """The receiving side of one link (module docstring). ``handle(event)`` returns the actions to
    run, in order."""

    def __init__(self, config: ReceiverConfig, note: Note | None = None):
        self._note: Note = note or to_logger("hurray.bridge")  # what it has to say (hurray_ipc/notes.py)
        if not 1 <= config.window <= MAX_WINDOW:
            raise ValueError(f"window {config.window} is outside 1-{MAX_WINDOW}")
        self.config = config
        self.linked = False
        self.plane = Plane.ZMQ
        self.last_rx = -math.inf
        self.last_tx = -math.inf
        self.last_hello = -math.inf
        self.last_ping = -math.inf
        self.partials: OrderedDict[int, Partial] = OrderedDict()  # transfer_id -> partial, descriptor order
        self.handed: dict[int, HandedOn] = {}  # dest -> a buffer handed on, its end not yet reported
        self.bounced: deque[int] = deque()  # dests to hand on again, before any partial transfer
        self.quarantined: deque[Quarantined] = deque()
        self.kept: set[int] = set()
        self.stats = ReceiverStats()
        self._dests = itertools.count(1)
        self._seq = itertools.count(1)
        self._by_dest: dict[int, Partial] = {}

    # -- queries the loop makes ------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """A buffer waits for a local consumer (bounced, or the oldest partial transfer ended)."""
        first = next(iter(self.partials.values()), None)
        return bool(self.bounced) or (first is not None and first.stage is Stage.ENDED)

    @property
    def offered(self) -> bool:
        """A destination is offered to the sender's NIC and its transfer not ended (the loop
        progresses NIXL meanwhile)."""
        return any(p.offered_at is not None and p.stage is not Stage.ENDED for p in self.partials.values())

    def hello(self) -> LinkHello:
        c = self.config
        return LinkHello(channel=c.channel, window=c.window, data_planes=tuple(p.value for p in c.planes),
                         gpu_destination=c.gpu_destination, protocol=INTERCHANGE_VERSION)

    # -- events ----------------------------------------------------------------------------------

    def handle(self, event: ReceiverEvent) -> list[ReceiverAction]:
        out: list[ReceiverAction] = []
        if isinstance(event, LinkReceived):
            self.last_rx = event.now
            self._received(event.msg, out)
        elif isinstance(event, Tick):
            self._tick(event.now, out)
        elif isinstance(event, Reserved):
            p = self._by_dest[event.dest]
            p.stage = Stage.RECEIVING
            if p.nixl:
                out.append(Offer(p.dest, p.tid))
        elif isinstance(event, ReserveFailed):
            p = self._by_dest.pop(event.dest)
            del self.partials[p.tid]
            self._reject(p.tid, "no_space", f"cannot allocate the destination of {p.size} bytes: {event.message}",
                         out)
        elif isinstance(event, Offered):
            self.last_tx = event.now  # the loop sent RDMA_REGISTER
            offered = self._by_dest.get(event.dest)
            if offered is not None:  # (else handed on meanwhile: the loop voids an offer then, see HandOn)
                offered.offered_at = event.now
        elif isinstance(event, OfferFailed):
            failed = self._by_dest.get(event.dest)
            if failed is not None:
                self._discard(failed, event.message, out, reject="rdma_failed")
        elif isinstance(event, ConsumerAsked):
            self._hand_on_next(out)
        elif isinstance(event, HandOnFailed):
            self.stats.discarded += 1
            h = self.handed[event.dest]
            self._note(logging.WARNING, {"event": "local_broker_unavailable", "transfer_id": h.tid,
                                         "error": event.message})
            if not event.held:
                del self.handed[event.dest]
                out.append(Free(event.dest))
        elif isinstance(event, HandoffEnded):
            self._ended(event, out)
        elif isinstance(event, Closing):
            for p in list(self.partials.values()):
                self._discard(p, "closing", out)
        elif isinstance(event, Closed):
            while self.bounced:
                dest = self.bounced.popleft()
                del self.handed[dest]
                out.append(Free(dest))
            self._release_quarantined(event.now, out)
            if self.quarantined:  # a peer's WRITE may still land in them (R4.4): never freed, left to exit
                self._note(logging.WARNING, {"event": "quarantined_at_close", "buffers": len(self.quarantined)})
                self.quarantined.clear()
        else:  # pragma: no cover - the Union is exhaustive
            raise TypeError(f"not a receiver event: {event!r}")
        self._sent(out, getattr(event, "now", None))
        return out

    def _sent(self, out: list[ReceiverAction], now: float | None) -> None:
        if now is not None and any(isinstance(a, Send) for a in out):
            self.last_tx = now

    def _tick(self, now: float, out: list[ReceiverAction]) -> None:
        third = self.config.timeout_s / 3
        if not self.linked and now - self.last_hello > HELLO_EVERY_S:
            out.append(Send(self.hello()))
            self.last_hello = now
        elif self.linked and (now - self.last_tx > third or now - max(self.last_rx, self.last_ping) > third):
            # Sent nothing (the sender forgets a silent receiver, §4, even while it streams to it),
            # or heard nothing (the PONG says the sender is there).
            out.append(Send(LinkPing()))
            self.last_ping = now
        self._release_quarantined(now, out)
        if self.linked and now - self.last_rx > self.config.timeout_s:
            self.linked = False
            self._discard_unended(f"no word from the sender for {self.config.timeout_s} s (link cut or sender gone)",
                                  out)

    def _received(self, msg: LinkMessage | TransferFault, out: list[ReceiverAction]) -> None:
        if isinstance(msg, TransferFault):
            if msg.verb == "TENSOR_DESCRIPTOR":
                self._descriptor(msg, out)
            else:  # bad_offset of TENSOR_DATA or RDMA_READY
                p = self._held(msg.transfer_id)
                if p is not None:
                    self._discard(p, msg.detail, out, reject=msg.reason)
        elif isinstance(msg, LinkWelcome):
            self._welcome(msg, out)
        elif isinstance(msg, Reject):
            self._rejected(msg, out)
        elif isinstance(msg, TensorDescriptor):
            self._descriptor(msg, out)
        elif isinstance(msg, TensorData):
            p = self._held(msg.transfer_id)
            if p is None:
                return  # data of a transfer we discarded or refused
            if not p.coverage.add(msg.offset, len(msg.data)):
                self._discard(p, f"TENSOR_DATA at {msg.offset!r}+{len(msg.data)} is outside the buffer or overlaps "
                              "bytes already received", out, reject="bad_offset")
                return
            out.append(Write(p.dest, msg.offset, msg.data))
        elif isinstance(msg, RdmaReady):
            p = self._held(msg.transfer_id)
            if p is None:
                return
            if p.offered_at is None or not p.coverage.add(msg.offset, msg.length):
                self._discard(p, f"RDMA_READY {msg.offset!r}+{msg.length!r} is outside the buffer, overlaps, or is "
                              "for a transfer without an offer", out, reject="bad_offset")
        elif isinstance(msg, TensorDataEnd):
            p = self._held(msg.transfer_id)
            if p is None:
                return
            if msg.total_bytes != p.size:
                self._discard(p, f"TENSOR_DATA_END total_bytes {msg.total_bytes!r} is not the descriptor's "
                              f"{p.size}", out, reject="size_mismatch")
            elif not p.coverage.complete:
                self._discard(p, f"bytes {p.coverage.first_gap()} never arrived (got {p.coverage.bytes} of {p.size})",
                              out, reject="incomplete")
            else:
                p.stage = Stage.ENDED  # the sender observed its writes complete (R3.5): nothing writes it now
        # LINK_PONG: heard (last_rx); anything else a sender sends is no verb a receiver accepts

    def _welcome(self, w: LinkWelcome, out: list[ReceiverAction]) -> None:
        plane = next((p for p in self.config.planes if p.value == w.data_plane), None)
        if plane is None:
            self._note(logging.WARNING, {"event": "bad_data_plane", "data_plane": w.data_plane[:32]})
            self.last_hello = -math.inf  # a plane we did not offer: say hello again
            return
        # A new link: the sender knows none of our unended transfers (its ids may start again).
        self._discard_unended("the link was set up again", out)
        self.plane = plane
        self._note(logging.INFO, {"event": "linked", "data_plane": w.data_plane, "window": self.config.window,
                                  "gpu_destination": self.config.gpu_destination if plane is Plane.NIXL else None,
                                  "peer_gpu_source": str(w.gpu_source)[:32]})
        self.linked = True
        out.append(Announce())  # before any handoff of this link: CAPS then names its plane
        out.extend(self._grant_at_link())

    def _grant_at_link(self) -> list[ReceiverAction]:
        """§3 receiver rule 5: ``window`` ahead, less the ended transfers still held (each sends
        its CREDIT when handed on): the next transfers stream while one is handed on locally."""
        held = len(self.partials)
        return [Send(Credit(self.config.window - held))] if held < self.config.window else []

    def _rejected(self, r: Reject, out: list[ReceiverAction]) -> None:
        if r.names_transfer:
            p = self._held(r.id)
            if p is not None and r.reason in SENDER_ENDED:
                # The sender ended this transfer: its NIXL request is released (R4.1), so the
                # destination may go at once (R4.6); the credit comes back.
                self._discard(p, f"the sender rejected it: {r.reason}", out, sender_let_go=True)
                out.append(Send(Credit(1)))
            else:
                self._note(logging.WARNING, {"event": "peer_rejected", "transfer_id": str(r.transfer_id)[:32],
                                             "reason": r.reason[:64]})
            return
        self.linked = False  # the sender does not know us (restarted): say hello again
        self.last_hello = -math.inf

    def _descriptor(self, d: TensorDescriptor | TransferFault, out: list[ReceiverAction]) -> None:
        """A TENSOR_DESCRIPTOR: supersede what it displaces (§3 receiver rule 4), check it (rule 1),
        and hold it as a new partial transfer (its destination reserved first)."""
        if isinstance(d, TransferFault) and d.reason == "bad_transfer_id":
            return self._reject(d.transfer_id, d.reason, d.detail, out)
        tid = d.transfer_id
        if not isinstance(tid, int):  # pragma: no cover - a TransferFault of a descriptor names one
            raise TypeError(tid)
        window = self.config.window
        same = self.partials.get(tid)
        if same is not None:
            self._discard(same, f"a new descriptor with its transfer_id {tid} arrived", out, reject="superseded")
        elif len(self.partials) >= window:
            oldest = next((p for p in self.partials.values() if p.stage is not Stage.ENDED), None)
            if oldest is None:  # all ended, waiting for a local consumer: their credits are not back
                return self._reject(tid, "no_credit", f"{window} transfers wait to be handed on and their credits "
                                    "were not returned (sender rule 3)", out)
            self._discard(oldest, f"a new descriptor arrived while {window} transfers were held (window)", out,
                          reject="superseded")
        size = d.size if isinstance(d, TransferFault) else d.total_bytes
        if size is not None and size > self.config.max_bytes:
            return self._reject(tid, "too_large", f"{size} bytes exceed this receiver's {self.config.max_bytes}", out)
        if isinstance(d, TransferFault):
            return self._reject(tid, d.reason, d.detail, out)
        size = d.total_bytes
        p = Partial(tid, size, d.meta, next(self._dests), self.plane is Plane.NIXL and size > 0, next(self._seq),
                    Coverage(size))
        self.partials[tid] = p
        self._by_dest[p.dest] = p
        out.append(Reserve(p.dest, size, p.nixl))

    def _held(self, tid: object) -> Partial | None:
        """The unended partial transfer ``tid`` names, if any."""
        p = self.partials.get(tid) if type(tid) is int else None
        return None if p is None or p.stage is Stage.ENDED else p

    def _reject(self, tid: object, reason: str, message: str, out: list[ReceiverAction]) -> None:
        """Refuse transfer ``tid``: REJECT, and the credit it used (§3 receiver rule 2)."""
        self.stats.rejected += 1
        self._note(logging.WARNING, {"event": "reject", "transfer_id": tid, "reason": reason, "message": message})
        out.append(Send(Reject(reason, message, tid)))
        out.append(Send(Credit(1)))

    def _discard(self, p: Partial, why: str, out: list[ReceiverAction], reject: str | None = None,
                 sender_let_go: bool = False) -> None:
        """Drop partial transfer ``p``; with ``reject``, also tell the sender (REJECT + its credit).
        ``sender_let_go``: the sender said it ended the transfer (its NIXL no longer writes)."""
        if self.partials.pop(p.tid, None) is None:
            return
        del self._by_dest[p.dest]
        if p.offered_at is not None and not sender_let_go:
            self._quarantine(p, out)
        else:
            out.append(Free(p.dest))
        self.stats.discarded += 1
        self._note(logging.WARNING, {"event": "partial_discarded", "transfer_id": p.tid, "why": why})
        if reject is not None:
            self._reject(p.tid, reject, why, out)

    def quarantine_until(self, offered_at: float, size: int) -> float:
        """R4.3-R4.4: 2T after the offer every WRITE into it has ended, plus a link timeout for the
        offer's way to the sender (it counts T from reading it)."""
        return offered_at + 2 * transfer_bound(self.config.timeout_s, size) + self.config.timeout_s

    def _quarantine(self, p: Partial, out: list[ReceiverAction]) -> None:
        """A NIXL destination dropped without the sender's word: deregistered now, reused only once
        every WRITE into it has ended: neither deregistering nor closing our agent stops a peer's
        write on every UCX transport."""
        assert p.offered_at is not None
        out.append(Quarantine(p.dest))
        self.quarantined.append(Quarantined(self.quarantine_until(p.offered_at, p.size), p.dest))

    def _release_quarantined(self, now: float, out: list[ReceiverAction]) -> None:
        while self.quarantined and self.quarantined[0].until <= now:
            out.append(Free(self.quarantined.popleft().dest))

    def _discard_unended(self, why: str, out: list[ReceiverAction]) -> None:
        """Drop every transfer still waiting for its TENSOR_DATA_END, without a message (the link is
        gone or new); those that ended stay, to be handed on in order."""
        for p in [p for p in self.partials.values() if p.stage is not Stage.ENDED]:
            self._discard(p, why, out)

    def _hand_on_next(self, out: list[ReceiverAction]) -> None:
        """One grant: a bounced buffer first (older than any partial transfer), else the oldest
        partial transfer if it ended (§3 receiver rule 5: descriptor order), with its CREDIT."""
        if self.bounced:
            dest = self.bounced.popleft()
            h = self.handed[dest]
            h.state = Hand.AT_CONSUMER
            out.append(HandOn(dest, h.tid, h.meta, again=True))
            return
        p = next(iter(self.partials.values()), None)
        if p is None or p.stage is not Stage.ENDED:
            return
        del self.partials[p.tid]
        del self._by_dest[p.dest]
        self.handed[p.dest] = HandedOn(p.tid, p.meta)
        out.append(HandOn(p.dest, p.tid, p.meta, again=False))
        out.append(Send(Credit(1)))

    def _ended(self, e: HandoffEnded, out: list[ReceiverAction]) -> None:
        """A handed-on buffer's handoff ended: one whose consumer went before it arrived is handed on
        again (at most max_bounces times), one whose consumer was fenced is kept, any other goes back."""
        h = self.handed.get(e.dest)
        if h is None or h.state is not Hand.AT_CONSUMER:
            self._note(logging.ERROR, {"event": "unknown_handoff_ended", "dest": e.dest})
            return
        if e.consumer_gone and h.bounces < self.config.max_bounces:
            h.bounces += 1
            h.state = Hand.BOUNCED
            self._note(logging.INFO, {"event": "hand_on_again", "transfer_id": h.tid, "why": "consumer_gone"})
            self.bounced.append(e.dest)  # never delivered: hand it on again
            return
        del self.handed[e.dest]
        if e.error is not None:
            self.stats.discarded += 1
            self._note(logging.WARNING, {"event": "hand_on_refused", "transfer_id": h.tid, "error": e.error[:200]})
        if e.fenced:
            # Its consumer may still read it (ipc-protocol.md §5): never pooled, written by the
            # NIC (a registration pins its pages) or freed again while this bridge runs.
            self.kept.add(e.dest)
            out.append(Keep(e.dest))
            return
        out.append(Free(e.dest))

    def check_invariants(self) -> None:
        """What holds after every event (module docstring); AssertionError names the broken one."""
        assert len(self.partials) <= self.config.window, f"{len(self.partials)} partial transfers held"
        seqs = [p.seq for p in self.partials.values()]
        assert seqs == sorted(seqs), "partial transfers out of descriptor order"
        assert {p.dest for p in self.partials.values()} == set(self._by_dest), "dest index out of step"
        dests = [p.dest for p in self.partials.values()] + list(self.handed) + [q.dest for q in self.quarantined]
        assert len(dests) == len(set(dests)), f"a destination in two places: {dests}"
        assert all(h.bounces <= self.config.max_bounces for h in self.handed.values()), "bounced too often"
        assert sorted(self.bounced) == sorted(d for d, h in self.handed.items() if h.state is Hand.BOUNCED)
        assert not self.kept & set(dests), "a kept buffer in use"
