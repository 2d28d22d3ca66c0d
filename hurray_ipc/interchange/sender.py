"""The sending bridge's protocol state machine, without I/O (docs/spec/interchange.md §3-§4, R3-R4).

:class:`SenderCore` takes events — a decoded link message from a receiver (:class:`LinkReceived`),
the passage of time (:class:`Tick`), a handoff the loop took for a peer (:class:`Started`), and
what the loop's I/O came to (queued frames done, an offer checked, a WRITE done or failed, WRITEs
cancelled...) — and returns typed actions. It reads no clock, touches no socket, NIXL agent,
buffer or broker; ``BridgeOut`` (hurray_ipc/broker/bridge.py) is its loop and answers each action
that has an outcome at once, from its one thread.

Who releases what, and when (§3 sender rule 4, R4.1): every handoff the loop started a transfer of
(its *source*, named by the loop's id) is released exactly once, by :class:`Release`:

- zmq plane: after ZeroMQ is done with every zero-copy frame (:class:`Reaped`; at its deadline, a
  peer that stopped reading, it is released anyway and the peer dropped);
- NIXL plane: after TENSOR_DATA_END (every WRITE observed DONE), or after the loop cancelled its
  WRITEs (:class:`EndWrites` → :class:`WritesEnded`); a REJECT this side sends for it follows the
  cancellation, never precedes it; if NIXL could not cancel, the agent is closed first
  (:class:`CloseEngine`), every NIXL transfer released after, with no REJECT (R4.5), and every
  link dropped.

Flow control: a transfer starts only to a peer holding a credit (each CREDIT adds its ``n``, each
descriptor uses one), with fewer than its ``window`` unended NIXL transfers, and while fewer than
``max_in_flight`` transfers are under way (sent, not yet released) in all; :meth:`SenderCore.pick`
says to which peer (the one that waited longest).
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

from hurray_ipc.notes import Note, to_logger
from hurray_ipc.transport.route import MAX_PEER_CHARS
from hurray_ipc.wire.link import (
    INTERCHANGE_VERSION,
    Credit,
    LinkHello,
    LinkMessage,
    LinkPing,
    LinkPong,
    LinkWelcome,
    RdmaReady,
    RdmaRegister,
    Reject,
    TensorDataEnd,
)

from .rules import Plane, transfer_bound

MAX_IN_FLIGHT = 4  # transfers a sender has under way and not yet released (bounds the handoffs it holds)
WRITE_CHUNK = 64 << 20  # bytes per NIXL WRITE: one per turn of the loop keeps the link answered (R6)
MAX_FAILED_WRITES = 32  # failed NIXL transfers after which the loop renews its agent


@dataclass(frozen=True)
class SenderConfig:
    channel: str
    timeout_s: float = 3.0
    planes: tuple[Plane, ...] = (Plane.ZMQ,)  # in this bridge's order of preference
    gpu_source: str = "host-staged"  # LINK_WELCOME, informational (R1.5)
    max_in_flight: int = MAX_IN_FLIGHT
    write_chunk: int = WRITE_CHUNK


# --- events -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkReceived:
    rid: bytes
    msg: LinkMessage
    now: float
    address: str = "?"


@dataclass(frozen=True)
class Tick:
    """Forget silent peers, end NIXL transfers past their deadline."""

    now: float


@dataclass(frozen=True)
class Started:
    """The loop took a handoff for ``rid`` (as :meth:`SenderCore.pick` said) and its source ``src``
    (``size`` bytes) is readable: start its transfer."""

    rid: bytes
    src: int
    size: int
    now: float


@dataclass(frozen=True)
class Unreadable:
    """A handoff taken could not be read (the loop released it): counted aborted."""

    error: str


@dataclass(frozen=True)
class SendFailed:
    """Queuing transfer ``tid``'s frames (or its descriptor) failed: its peer is dropped."""

    tid: int
    error: str
    now: float


@dataclass(frozen=True)
class Unreachable:
    """A send to ``rid`` failed (the peer is gone): drop it."""

    rid: bytes
    error: str
    now: float


@dataclass(frozen=True)
class Reaped:
    """ZeroMQ is done with the oldest queued transfer's frames (``ok``), or its deadline passed."""

    tid: int
    ok: bool
    now: float


@dataclass(frozen=True)
class OfferAccepted:
    """The loop checked transfer ``tid``'s RDMA_REGISTER (R2) and registered its source."""

    tid: int
    agent: str
    now: float


@dataclass(frozen=True)
class OfferRefused:
    tid: int
    reason: str  # bad_offer or rdma_failed
    message: str
    now: float


@dataclass(frozen=True)
class PostNext:
    """The loop may post one WRITE now (one per turn of its loop)."""

    now: float


@dataclass(frozen=True)
class WriteFailed:
    tid: int
    reason: str  # bad_offer or rdma_failed
    message: str
    now: float


@dataclass(frozen=True)
class WriteDone:
    """NIXL reports the WRITE of ``[offset, offset + length)`` DONE (the loop released its request)."""

    tid: int
    offset: int
    length: int
    now: float


@dataclass(frozen=True)
class WritesEnded:
    """The loop's answer to EndWrites: ``cancelled`` (NIXL let go of the source) or not (R4.5)."""

    tid: int
    cancelled: bool
    now: float


@dataclass(frozen=True)
class EngineRenewed:
    """The loop replaced its NIXL agent (``ok``), or could not start one again (zmq from now on)."""

    ok: bool


@dataclass(frozen=True)
class Closing:
    now: float


SenderEvent = (LinkReceived | Tick | Started | Unreadable | SendFailed | Unreachable | Reaped | OfferAccepted
               | OfferRefused | PostNext | WriteFailed | WriteDone | WritesEnded | EngineRenewed | Closing)


# --- actions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    rid: bytes
    msg: LinkMessage


@dataclass(frozen=True)
class SendTransfer:
    """zmq plane: queue TENSOR_DESCRIPTOR, every TENSOR_DATA (zero-copy, tracked) and
    TENSOR_DATA_END of ``src`` as transfer ``tid``; answer SendFailed if queuing fails."""

    rid: bytes
    tid: int
    src: int


@dataclass(frozen=True)
class Describe:
    """NIXL plane: send ``src``'s TENSOR_DESCRIPTOR as ``tid``; answer SendFailed if that fails."""

    rid: bytes
    tid: int
    src: int


@dataclass(frozen=True)
class AcceptOffer:
    """Check ``offer`` (R2) against ``size``, register ``src``; answer OfferAccepted or OfferRefused."""

    tid: int
    src: int
    size: int
    offer: RdmaRegister


@dataclass(frozen=True)
class PostWrite:
    """Post one WRITE of ``src`` into transfer ``tid``'s offer; answer WriteFailed if posting fails."""

    tid: int
    offset: int
    length: int
    last: bool


@dataclass(frozen=True)
class EndWrites:
    """Cancel (release) every WRITE of ``tid`` still posted; answer WritesEnded."""

    tid: int


@dataclass(frozen=True)
class Unregister:
    """Release ``tid``'s source registration (NIXL no longer reads it)."""

    tid: int


@dataclass(frozen=True)
class Release:
    """Give ``src`` back (release the handoff, or return a staging buffer): exactly once."""

    src: int


@dataclass(frozen=True)
class ForgetAgent:
    agent: str


@dataclass(frozen=True)
class CloseEngine:
    """R4.5: NIXL could not cancel a WRITE: close the agent (its WRITEs end with it) before any
    source of a NIXL transfer is released."""


SenderAction = (Send | SendTransfer | Describe | AcceptOffer | PostWrite | EndWrites | Unregister | Release
                | ForgetAgent | CloseEngine)


# --- state --------------------------------------------------------------------------------------


@dataclass
class Peer:
    """A linked receiving bridge."""

    rid: bytes
    name: str
    plane: Plane
    window: int
    seen: float
    credits: int = 0
    last: float = 0.0  # when it was last given a transfer: the longest waiting goes first
    agents: set[str] = field(default_factory=set)  # NIXL agents it offered from (forgotten with it, R4.7)


class Stage(enum.Enum):
    QUEUED = "queued"  # zmq: frames queued; released once ZeroMQ is done with them
    DESCRIBED = "described"  # NIXL: descriptor sent, waiting for the receiver's RDMA_REGISTER
    OFFERED = "offered"  # NIXL: its RDMA_REGISTER is being checked (AcceptOffer)
    WRITING = "writing"  # NIXL: offer accepted; WRITEs posted one chunk at a time
    ENDING = "ending"  # NIXL: its WRITEs are being cancelled (EndWrites)


@dataclass
class Transfer:
    """A transfer under way: from its descriptor until its source is released."""

    rid: bytes
    tid: int
    src: int
    size: int
    deadline: float
    stage: Stage
    queued_ok: bool = True  # zmq: every frame was queued (else it was aborted, and its peer dropped)
    next_off: int = 0  # NIXL: bytes posted so far
    posted: int = 0  # NIXL: WRITEs posted, not yet DONE
    done_bytes: int = 0  # NIXL: bytes reported DONE (RDMA_READY sent)
    reason: str | None = None  # ENDING: the REJECT that follows the cancellation (None: none)
    message: str = ""


@dataclass
class SenderStats:
    sent: int = 0
    rejected: int = 0
    aborted: int = 0
    writes: int = 0  # NIXL WRITEs posted


class SenderCore:
    """The sending side of every link of one bridge (module docstring). ``handle(event)`` returns
    the actions to run, in order."""

    def __init__(self, config: SenderConfig, note: Note | None = None):
        self._note: Note = note or to_logger("hurray.bridge")  # what it has to say (hurray_ipc/notes.py)
        self.config = config
        self.planes = config.planes
        self.rdma = Plane.NIXL in config.planes  # the loop has a NIXL agent
        self.peers: dict[bytes, Peer] = {}
        self.transfers: dict[int, Transfer] = {}  # transfer_id -> transfer, in start order
        self.queued: deque[Transfer] = deque()  # zmq transfers, oldest first (released in this order)
        self.failed_writes = 0  # NIXL transfers that failed or timed out on the current agent
        self.stats = SenderStats()
        self._ids = itertools.count(1)

    # -- queries the loop makes ------------------------------------------------------------------

    def unended(self, rid: bytes) -> int:
        """NIXL transfers to ``rid`` under way (at most its window: one more would supersede)."""
        return sum(1 for t in self.transfers.values() if t.rid == rid and t.stage is not Stage.QUEUED)

    def pick(self) -> bytes | None:
        """The peer the next handoff goes to: one with a credit and room in its window, the one that
        waited longest; None when none may have one, or max_in_flight transfers are under way."""
        if len(self.transfers) >= self.config.max_in_flight:
            return None
        ready = [p for p in self.peers.values() if p.credits > 0 and self.unended(p.rid) < p.window]
        return min(ready, key=lambda p: p.last).rid if ready else None

    def nixl(self, rid: bytes, size: int) -> bool:
        """Whether a transfer of ``size`` bytes to ``rid`` goes over NIXL (its source read by the NIC)."""
        peer = self.peers.get(rid)
        return peer is not None and peer.plane is Plane.NIXL and size > 0

    @property
    def renew_due(self) -> bool:
        """MAX_FAILED_WRITES transfers failed on the agent and none is under way on it: renew it."""
        return self.rdma and self.failed_writes >= MAX_FAILED_WRITES and not any(
            t.stage is not Stage.QUEUED for t in self.transfers.values())

    @property
    def writing(self) -> bool:
        """A NIXL WRITE is posted (the loop polls for its completion)."""
        return any(t.posted for t in self.transfers.values())

    # -- events ----------------------------------------------------------------------------------

    def handle(self, event: SenderEvent) -> list[SenderAction]:
        out: list[SenderAction] = []
        if isinstance(event, LinkReceived):
            self._received(event, out)
        elif isinstance(event, Tick):
            for rid in [r for r, p in self.peers.items() if event.now - p.seen > self.config.timeout_s]:
                self._drop_peer(rid, out)
            for t in list(self.transfers.values()):
                if t.stage in (Stage.DESCRIBED, Stage.WRITING) and event.now > t.deadline:
                    bound = transfer_bound(self.config.timeout_s, t.size)
                    self._end(t, "rdma_timeout", f"no offer or no completion within {bound:g} s", out)
        elif isinstance(event, Started):
            self._start(event, out)
        elif isinstance(event, Unreadable):
            self.stats.aborted += 1
            self._note(logging.WARNING, {"event": "source_unreadable", "error": event.error})
        elif isinstance(event, SendFailed):
            t = self.transfers[event.tid]
            queued = t.stage is Stage.QUEUED
            if not queued:  # out before the peer is dropped, so that it is not also ended as link_lost
                del self.transfers[t.tid]
            self._abort(t.rid, t.tid, event.error, out)
            if queued:
                t.queued_ok = False  # released once ZeroMQ is done with what it queued (Reaped)
            else:
                out.append(Release(t.src))  # nothing was posted: NIXL never read it
        elif isinstance(event, Unreachable):
            self._note(logging.WARNING, {"event": "peer_unreachable", "error": event.error})
            self._drop_peer(event.rid, out)
        elif isinstance(event, Reaped):
            self._reaped(event, out)
        elif isinstance(event, OfferAccepted):
            t = self.transfers[event.tid]
            t.stage = Stage.WRITING
            t.deadline = event.now + transfer_bound(self.config.timeout_s, t.size)  # R4.1, R4.3: from now
            peer = self.peers.get(t.rid)
            if peer is not None:
                peer.agents.add(event.agent)
        elif isinstance(event, OfferRefused):
            self._end(self.transfers[event.tid], event.reason, event.message, out)
        elif isinstance(event, PostNext):
            self._post_next(event.now, out)
        elif isinstance(event, WriteFailed):
            self._end(self.transfers[event.tid], event.reason, event.message, out)
        elif isinstance(event, WriteDone):
            self._write_done(event, out)
        elif isinstance(event, WritesEnded):
            self._writes_ended(event, out)
        elif isinstance(event, EngineRenewed):
            self.failed_writes = 0
            if not event.ok:  # NIXL would not start again: zmq from now on, every link set up again
                self._zmq_only()
        elif isinstance(event, Closing):
            for rid in {t.rid for t in self.transfers.values() if t.stage is not Stage.QUEUED}:
                self._forget_peer(rid, self.peers.get(rid), out)
        else:  # pragma: no cover - the union is exhaustive
            raise TypeError(f"not a sender event: {event!r}")
        return out

    def _received(self, e: LinkReceived, out: list[SenderAction]) -> None:
        rid, msg, now = e.rid, e.msg, e.now
        peer = self.peers.get(rid)
        if isinstance(msg, LinkHello):
            self._hello(rid, msg, e.address, now, out)
        elif peer is None:
            out.append(Send(rid, Reject("not_linked", "send LINK_HELLO first")))
        elif isinstance(msg, Credit):
            peer.seen = now
            peer.credits += msg.n
        elif isinstance(msg, LinkPing):
            peer.seen = now
            out.append(Send(rid, LinkPong()))
        elif isinstance(msg, Reject):
            self.stats.rejected += 1
            self._note(logging.WARNING, {"event": "peer_rejected", "transfer_id": str(msg.transfer_id)[:32],
                                         "reason": msg.reason[:64], "message": msg.message[:200]})
            t = self._transfer_of(rid, msg.id)
            if t is not None and t.stage is not Stage.QUEUED:
                self._end(t, None, "", out)  # the receiver gave up on it: NIXL must let go first
        elif isinstance(msg, RdmaRegister):
            peer.seen = now
            self._offer(rid, msg, out)

    def _hello(self, rid: bytes, msg: LinkHello, address: str, now: float, out: list[SenderAction]) -> None:
        if msg.protocol != INTERCHANGE_VERSION or msg.channel != self.config.channel:
            out.append(Send(rid, Reject("link_hello", f"this bridge serves channel {self.config.channel!r}, "
                                        "interchange v1")))
            return
        self._forget_peer(rid, self.peers.get(rid), out)  # first: it may drop the NIXL plane (R4.5)
        names = {p.value: p for p in self.planes}
        plane = next((names[x] for x in msg.data_planes if x in names), Plane.ZMQ)
        name = f"tcp://{address}#{rid.hex()}"[:MAX_PEER_CHARS]
        self.peers[rid] = Peer(rid, name, plane, msg.window, now)
        self._note(logging.INFO, {"event": "linked", "peer": name, "data_plane": plane.value,
                                  "offered": list(msg.data_planes[:8]), "window": msg.window,
                                  "gpu_source": self.config.gpu_source,
                                  "peer_gpu_destination": str(msg.gpu_destination)[:32]})
        out.append(Send(rid, LinkWelcome(data_plane=plane.value, gpu_source=self.config.gpu_source)))

    def _transfer_of(self, rid: bytes, tid: int | None) -> Transfer | None:
        t = self.transfers.get(tid) if tid is not None else None
        return t if t is not None and t.rid == rid else None

    def _start(self, e: Started, out: list[SenderAction]) -> None:
        peer = self.peers[e.rid]
        if peer.credits <= 0 or len(self.transfers) >= self.config.max_in_flight:
            raise RuntimeError(f"a transfer started to {peer.name} without credit or room (pick() said no)")
        peer.credits -= 1
        peer.last = e.now
        tid = next(self._ids)
        timeout = self.config.timeout_s
        if self.nixl(e.rid, e.size):
            # Until the offer: the receiver allocates and registers the destination (first use: faulted in).
            deadline = e.now + timeout * 4 + transfer_bound(timeout, e.size)
            self.transfers[tid] = Transfer(e.rid, tid, e.src, e.size, deadline, Stage.DESCRIBED)
            out.append(Describe(e.rid, tid, e.src))
            return
        # Not waited for: the next transfer's frames queue behind these at once, so the link never
        # drains between transfers. Its frames leave after those queued ahead of them: the deadline
        # counts their bytes too (R4's bound).
        ahead = sum(t.size for t in self.queued)
        t = Transfer(e.rid, tid, e.src, e.size, e.now + timeout + transfer_bound(timeout, ahead + e.size),
                     Stage.QUEUED)
        self.transfers[tid] = t
        self.queued.append(t)
        out.append(SendTransfer(e.rid, tid, e.src))

    def _reaped(self, e: Reaped, out: list[SenderAction]) -> None:
        t = self.queued.popleft()
        if t.tid != e.tid:
            raise RuntimeError(f"reaped {e.tid}, but {t.tid} is the oldest queued transfer")
        del self.transfers[t.tid]
        if not e.ok:
            self._abort(t.rid, t.tid, "ZeroMQ did not send every frame before the deadline", out)
        elif t.queued_ok:
            self.stats.sent += 1
        out.append(Release(t.src))

    def _abort(self, rid: bytes, tid: int, error: str, out: list[SenderAction]) -> None:
        self.stats.aborted += 1
        self._drop_peer(rid, out)
        self._note(logging.WARNING, {"event": "transfer_aborted", "transfer_id": tid, "error": error})

    def _offer(self, rid: bytes, msg: RdmaRegister, out: list[SenderAction]) -> None:
        """RDMA_REGISTER: the loop checks it and registers the source (AcceptOffer)."""
        t = self._transfer_of(rid, msg.id)
        if t is not None and t.stage is Stage.DESCRIBED and not self.rdma:  # the NIXL plane was dropped (R4.5)
            self._end(t, "rdma_failed", "this bridge closed its NIXL agent", out)
            return
        if t is None or t.stage is not Stage.DESCRIBED:
            out.append(Send(rid, Reject("unexpected", "no transfer of this link waits for RDMA_REGISTER",
                                        msg.transfer_id)))
            return
        t.stage = Stage.OFFERED
        out.append(AcceptOffer(t.tid, t.src, t.size, msg))

    def _post_next(self, now: float, out: list[SenderAction]) -> None:
        """One WRITE of at most write_chunk bytes, for the oldest transfer with bytes left."""
        for t in self.transfers.values():
            if t.stage is not Stage.WRITING or t.next_off >= t.size:
                continue
            if now > t.deadline:  # R4.3: no WRITE into an offer older than T
                bound = transfer_bound(self.config.timeout_s, t.size)
                self._end(t, "rdma_timeout", f"the offer is older than {bound:g} s", out)
                return
            n = min(self.config.write_chunk, t.size - t.next_off)
            out.append(PostWrite(t.tid, t.next_off, n, last=t.next_off + n >= t.size))
            t.next_off += n
            t.posted += 1
            self.stats.writes += 1
            return

    def _write_done(self, e: WriteDone, out: list[SenderAction]) -> None:
        """A WRITE observed DONE is announced (RDMA_READY); once every byte is, TENSOR_DATA_END (R3.4-R3.5)."""
        t = self.transfers.get(e.tid)
        if t is None or t.stage is not Stage.WRITING:
            return  # ended meanwhile: its writes were released with it
        t.posted -= 1
        t.done_bytes += e.length
        out.append(Send(t.rid, RdmaReady(t.tid, e.offset, e.length)))
        if t.next_off >= t.size and not t.posted:
            out.append(Send(t.rid, TensorDataEnd(t.tid, t.size)))
            self.stats.sent += 1
            self._end(t, None, "", out)

    def _end(self, t: Transfer, reason: str | None, message: str, out: list[SenderAction]) -> None:
        """End NIXL transfer ``t`` exactly once: its WRITEs cancelled first (EndWrites), then (only
        if NIXL let go of the source) its REJECT with ``reason``, its registration, its source."""
        if t.stage in (Stage.QUEUED, Stage.ENDING) or self.transfers.get(t.tid) is not t:
            return
        if reason in ("rdma_failed", "rdma_timeout"):
            self.failed_writes += 1
        if reason is not None:
            self.stats.aborted += 1
            self._note(logging.WARNING, {"event": "transfer_aborted", "transfer_id": t.tid, "reason": reason,
                                         "error": message})
        t.stage, t.reason, t.message = Stage.ENDING, reason, message
        out.append(EndWrites(t.tid))

    def _writes_ended(self, e: WritesEnded, out: list[SenderAction]) -> None:
        t = self.transfers.get(e.tid)
        if t is None or t.stage is not Stage.ENDING:
            return
        if not e.cancelled:
            self._note(logging.WARNING, {"event": "rdma_not_cancelled", "transfer_id": t.tid})
            self._give_up_rdma(out)
            return
        del self.transfers[t.tid]
        if t.reason is not None:
            out.append(Send(t.rid, Reject(t.reason, t.message, t.tid)))
        out.append(Unregister(t.tid))
        out.append(Release(t.src))

    def _give_up_rdma(self, out: list[SenderAction]) -> None:
        """R4.5: NIXL could not cancel a WRITE. Close the agent (sources are released only after
        that), end every NIXL transfer without a REJECT (it would tell the receiver that nothing
        writes its destination any more, and a closed agent is no fence: the receiver supersedes or
        times out the transfer and quarantines its destination), and drop every link."""
        out.append(CloseEngine())
        for t in [t for t in self.transfers.values() if t.stage is not Stage.QUEUED]:
            del self.transfers[t.tid]
            out.append(Release(t.src))
        self._zmq_only()
        self._note(logging.WARNING, {"event": "rdma_plane_dropped", "data_planes": [p.value for p in self.planes]})

    def _zmq_only(self) -> None:
        self.rdma, self.planes = False, (Plane.ZMQ,)
        self.peers.clear()

    def _drop_peer(self, rid: bytes, out: list[SenderAction]) -> None:
        """A peer gone (silent, unreachable, its transfer aborted): forget it and its NIXL agents.
        Popped first, so a send that fails on the way cannot come back here."""
        peer = self.peers.pop(rid, None)
        if peer is not None:
            self._forget_peer(rid, peer, out)

    def _forget_peer(self, rid: bytes, peer: Peer | None, out: list[SenderAction]) -> None:
        """A peer gone or linking again: end its NIXL transfers (each released once) and forget every
        agent it offered from (a restarted receiver comes back under a new name, R4.7)."""
        for t in [t for t in self.transfers.values() if t.rid == rid and t.stage is not Stage.QUEUED]:
            self._end(t, "link_lost", "the link was lost or set up again", out)
        for agent in sorted(peer.agents if peer is not None else ()):
            if self.rdma:
                out.append(ForgetAgent(agent))

    def check_invariants(self) -> None:
        """What holds after every event; AssertionError names the broken one."""
        assert len(self.transfers) <= self.config.max_in_flight, f"{len(self.transfers)} transfers under way"
        assert list(self.queued) == [t for t in self.transfers.values() if t.stage is Stage.QUEUED]
        for p in self.peers.values():
            assert p.credits >= 0, f"{p.name} holds {p.credits} credits"
        for t in self.transfers.values():
            assert t.posted >= 0 and t.next_off <= t.size
