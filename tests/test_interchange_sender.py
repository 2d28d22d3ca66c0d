"""The sending bridge's core (hurray_ipc/interchange/sender.py), driven over every interleaving
hypothesis finds: no sockets, threads, processes or clock.

The machine plays two receivers (LINK_HELLO, CREDIT, PING, RDMA_REGISTER, REJECT, silence), the
local broker's handoffs, ZeroMQ's trackers and NIXL (offers checked or refused, WRITEs posted,
done, failed, cancellations that fail), and checks every action the core returns:

- never more transfers started to a peer than it granted by CREDIT since its LINK_HELLO, never
  more than its window unended on the NIXL plane, never more than max_in_flight under way;
- each handoff (source) released exactly once, and never while a NIXL WRITE may still read it
  (its WRITEs DONE or cancelled, or the agent closed first);
- a REJECT that ends a NIXL transfer only after its WRITEs were cancelled, none for the transfers
  the agent's closing ended (R4.5); TENSOR_DATA_END only once every byte was reported DONE.

Each rule is then shown to matter: a core with it broken makes the machine fail, every run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hurray_ipc.interchange.rules import SENDER_ENDED, Plane
from hurray_ipc.interchange.sender import (
    AcceptOffer,
    CloseEngine,
    Closing,
    Describe,
    EndWrites,
    EngineRenewed,
    ForgetAgent,
    LinkReceived,
    OfferAccepted,
    OfferRefused,
    PostNext,
    PostWrite,
    Reaped,
    Release,
    Send,
    SenderAction,
    SenderConfig,
    SenderCore,
    SenderEvent,
    SendFailed,
    SendTransfer,
    Started,
    Tick,
    Transfer,
    Unreachable,
    Unregister,
    WriteDone,
    WriteFailed,
    WritesEnded,
)
from hurray_ipc.wire import link
from hurray_ipc.wire.link import (
    Credit,
    LinkHello,
    LinkPing,
    LinkPong,
    LinkWelcome,
    RdmaReady,
    RdmaRegister,
    Reject,
    TensorDataEnd,
)
from machines import machine_settings

TIMEOUT = 1.0
MAX_IN_FLIGHT = 3
CHUNK = 8  # bytes per WRITE here: a 16-byte transfer takes two
RIDS = (b"A", b"B")
SIZES = (0, 8, 16)


@dataclass
class PeerModel:
    """A receiver's view of its link."""

    granted: int = 0  # credits granted since its LINK_HELLO
    started: int = 0  # descriptors it got since then
    window: int = 1
    linked: bool = False
    unended: set[int] = field(default_factory=set)  # NIXL transfers described, not yet ended (END or REJECT)


@dataclass
class SrcModel:
    """A handoff the loop took (its source), and what the core did with it."""

    rid: bytes
    size: int
    tid: int | None = None
    nixl: bool = False
    released: bool = False
    writes: set[tuple[int, int]] = field(default_factory=set)  # posted, not DONE nor cancelled
    done: int = 0  # bytes reported DONE
    offered: bool = False
    posted: bool = False  # a WRITE was posted: NIXL may read it until they are cancelled or the agent closed
    cancel: str = ""  # its EndWrites: "asked", answered "cancelled" or "failed"; or "closed" (CloseEngine)


class SenderMachine(RuleBasedStateMachine):
    core_class: type[SenderCore] = SenderCore

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.notes: list[tuple[int, dict]] = []  # what the core reports (it logs nothing itself)
        self.core = self.core_class(SenderConfig("ch", TIMEOUT, (Plane.NIXL, Plane.ZMQ), "host-staged",
                                                 MAX_IN_FLIGHT, CHUNK),
                                    note=lambda level, fields: self.notes.append((level, fields)))
        self.peers = {rid: PeerModel() for rid in RIDS}
        self.srcs: dict[int, SrcModel] = {}
        self.by_tid: dict[int, int] = {}  # transfer id -> source id
        self.next_src = 1
        self.socket_broken = False
        self.offer_bad = False
        self.cancel_fails = False
        self.abandoned: set[int] = set()  # NIXL transfers the agent's closing ended: no REJECT for them
        self.prompt = False  # the receiver offers each destination at once, and the loop posts at once
        # REJECTs after a failed cancel (R4.5): failed once their action list ran, so that a Release
        # in the same list is reported first as the R4.1 break it is
        self.late_rejects: list[str] = []

    # -- running the core's actions, checking each ---------------------------------------------

    def feed(self, event: SenderEvent) -> None:
        self.run(self.core.handle(event))

    def src_of(self, tid: int) -> SrcModel:
        return self.srcs[self.by_tid[tid]]

    def run(self, actions: list[SenderAction]) -> None:
        self.run_each(actions)
        assert not self.late_rejects, self.late_rejects[0]

    def run_each(self, actions: list[SenderAction]) -> None:
        for a in actions:
            if isinstance(a, Send):
                self.sent(a.rid, a.msg)
            elif isinstance(a, SendTransfer | Describe):
                s = self.srcs[a.src]
                assert s.tid is None and not s.released and s.rid == a.rid
                s.tid, s.nixl = a.tid, isinstance(a, Describe)
                self.by_tid[a.tid] = a.src
                p = self.peers[a.rid]
                p.started += 1
                assert p.started <= p.granted, f"{p.started} transfers started on {p.granted} credits (sender rule 3)"
                if s.nixl:
                    p.unended.add(a.tid)
                    assert len(p.unended) <= p.window, f"{len(p.unended)} unended on a window of {p.window}"
                if self.socket_broken:
                    self.feed(SendFailed(a.tid, "broken", self.now))
                elif s.nixl and self.prompt:
                    self.feed(LinkReceived(a.rid, RdmaRegister(a.tid, {"version": 1}, b"m"), self.now))
                    self.feed(PostNext(self.now))
            elif isinstance(a, AcceptOffer):
                s = self.src_of(a.tid)
                assert s.nixl and not s.released
                if self.offer_bad:
                    self.feed(OfferRefused(a.tid, "bad_offer", "bad", self.now))
                else:
                    s.offered = True
                    self.feed(OfferAccepted(a.tid, "agent-" + s.rid.decode(), self.now))
            elif isinstance(a, PostWrite):
                s = self.src_of(a.tid)
                assert s.offered and not s.released and a.offset + a.length <= s.size
                s.writes.add((a.offset, a.length))
                s.posted = True
            elif isinstance(a, EndWrites):
                s = self.src_of(a.tid)
                s.cancel = "asked"
                if self.cancel_fails and s.writes:
                    s.cancel = "failed"
                    self.feed(WritesEnded(a.tid, False, self.now))
                else:
                    s.writes.clear()  # cancelled: NIXL let go
                    s.cancel = "cancelled"
                    self.feed(WritesEnded(a.tid, True, self.now))
            elif isinstance(a, CloseEngine):
                for tid, sid in self.by_tid.items():
                    s = self.srcs[sid]
                    if s.nixl and not s.released:
                        s.writes.clear()  # closing the agent ends them
                        s.cancel = "closed"
                        self.abandoned.add(tid)
                for p in self.peers.values():
                    p.linked = False
            elif isinstance(a, Release):
                s = self.srcs[a.src]
                assert not s.released, f"source {a.src} released twice (sender rule 4)"
                assert not s.posted or s.cancel in ("cancelled", "closed"), (
                    f"source {a.src} released while NIXL may read it: cancel {s.cancel or 'not asked'}, "
                    "agent open (R4.1)")
                assert not s.writes, f"source {a.src} released while NIXL may still read it (R4.1)"
                s.released = True
                if s.tid is not None:
                    self.peers[s.rid].unended.discard(s.tid)
            else:
                assert isinstance(a, Unregister | ForgetAgent), a

    def sent(self, rid: bytes, m: link.LinkMessage) -> None:
        p = self.peers[rid]
        if isinstance(m, LinkWelcome):
            p.linked = True
        elif isinstance(m, Reject):
            if m.id is not None and m.id in self.by_tid:
                s = self.src_of(m.id)
                assert m.id not in self.abandoned, "a REJECT for a transfer the closed agent ended (R4.5)"
                if s.nixl:
                    assert s.cancel in ("cancelled", "failed"), (
                        f"REJECT {m.reason} of {m.id} before its EndWrites was answered cancelled (R4.1)")
                    if s.cancel == "failed":
                        self.late_rejects.append(f"REJECT {m.reason} of {m.id} after its WRITEs could not be "
                                                 "cancelled (R4.5)")
                assert m.reason in SENDER_ENDED or m.reason in ("bad_offer", "unexpected"), m
                p.unended.discard(m.id)
        elif isinstance(m, TensorDataEnd):
            s = self.src_of(m.transfer_id)
            assert not s.writes and s.done == s.size == m.total_bytes, "TENSOR_DATA_END before every WRITE was DONE"
            p.unended.discard(m.transfer_id)
        else:
            assert isinstance(m, LinkPong | RdmaReady), m

    # -- rules ----------------------------------------------------------------------------------

    @initialize(window=st.sampled_from([1, 2]), plane=st.sampled_from(["nixl", "zmq"]), cancel_fails=st.booleans(),
                prompt=st.booleans())
    def link_a(self, window: int, plane: str, cancel_fails: bool, prompt: bool) -> None:
        # (From the start in half the runs: NIXL that cannot cancel is rare, and a receiver that
        # offers at once and a sender that posts at once reach the WRITEs in fewer steps.)
        self.cancel_fails, self.prompt = cancel_fails, prompt
        self.hello(RIDS[0], window, plane)
        self.credit(RIDS[0], 3)

    @rule(rid=st.sampled_from(RIDS), window=st.sampled_from([1, 2]), plane=st.sampled_from(["nixl", "zmq"]))
    def hello(self, rid: bytes, window: int, plane: str) -> None:
        p = self.peers[rid]
        p.granted = p.started = 0
        p.window = window
        p.unended.clear()  # its old transfers: a new link (the core ends them, link_lost)
        self.feed(LinkReceived(rid, LinkHello("ch", window, (plane, "zmq")), self.now))

    @rule(rid=st.sampled_from(RIDS), n=st.sampled_from([1, 2]))
    def credit(self, rid: bytes, n: int) -> None:
        p = self.peers[rid]
        if p.linked and rid in self.core.peers:
            p.granted += n
        self.feed(LinkReceived(rid, Credit(n), self.now))

    @rule(rid=st.sampled_from(RIDS))
    def ping(self, rid: bytes) -> None:
        self.feed(LinkReceived(rid, LinkPing(), self.now))

    @rule(size=st.sampled_from(SIZES))
    def take(self, size: int) -> None:
        self.take_handoff(size)

    @rule(size=st.sampled_from(SIZES))
    def take_more(self, size: int) -> None:
        """(A second rule: handoffs are the common event, and several must be under way at once.)"""
        self.take_handoff(size)

    def take_handoff(self, size: int) -> None:
        rid = self.core.pick()
        if rid is None:
            return
        sid = self.next_src
        self.next_src += 1
        self.srcs[sid] = SrcModel(rid, size)
        self.feed(Started(rid, sid, size, self.now))

    @precondition(lambda self: self.core.queued)
    @rule(ok=st.booleans())
    def reap(self, ok: bool) -> None:
        self.feed(Reaped(self.core.queued[0].tid, ok, self.now))

    def nixl_transfers(self, stage: str | None = None) -> list[Transfer]:
        return [t for t in self.core.transfers.values() if t.stage.value != "queued"
                and (stage is None or t.stage.value == stage)]

    @rule(data=st.data(), bogus=st.sampled_from([False, False, False, True]), post=st.booleans())
    def offer(self, data: st.DataObject, bogus: bool, post: bool) -> None:
        ts = self.nixl_transfers("described")
        if bogus or not ts:
            rid, tid = data.draw(st.sampled_from(RIDS)), 999
        else:
            t = data.draw(st.sampled_from(ts))
            rid, tid = t.rid, t.tid
        self.feed(LinkReceived(rid, RdmaRegister(tid, {"version": 1}, b"m"), self.now))
        if post:  # the loop's next turn
            self.feed(PostNext(self.now))

    @rule()
    def post(self) -> None:
        self.feed(PostNext(self.now))

    @precondition(lambda self: any(s.writes for s in self.srcs.values()))
    @rule(data=st.data(), fail=st.booleans())
    def write_completes(self, data: st.DataObject, fail: bool) -> None:
        sid = data.draw(st.sampled_from(sorted(k for k, s in self.srcs.items() if s.writes)))
        s = self.srcs[sid]
        assert s.tid is not None
        if fail:
            self.feed(WriteFailed(s.tid, "rdma_failed", "ERR", self.now))
            return
        off, n = min(s.writes)
        s.writes.discard((off, n))
        s.done += n
        self.feed(WriteDone(s.tid, off, n, self.now))

    @precondition(lambda self: self.core.transfers)
    @rule(data=st.data(), reason=st.sampled_from(["superseded", "bad_offset", "rdma_failed"]))
    def receiver_rejects(self, data: st.DataObject, reason: str) -> None:
        t = data.draw(st.sampled_from(list(self.core.transfers.values())))
        self.peers[t.rid].unended.discard(t.tid)  # the receiver discarded it
        self.feed(LinkReceived(t.rid, Reject(reason, "", t.tid), self.now))

    @rule(dt=st.sampled_from([0.1, 0.1, TIMEOUT / 2, TIMEOUT / 2, TIMEOUT + 0.01, 6 * TIMEOUT]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.feed(Tick(self.now))
        for rid, p in self.peers.items():
            if rid not in self.core.peers:
                p.linked = False

    @rule(rid=st.sampled_from(RIDS))
    def unreachable(self, rid: bytes) -> None:
        self.feed(Unreachable(rid, "gone", self.now))
        self.peers[rid].linked = False

    @rule(broken=st.booleans())
    def socket_trouble(self, broken: bool) -> None:
        self.socket_broken = broken

    @rule(bad=st.booleans())
    def offers_trouble(self, bad: bool) -> None:
        self.offer_bad = bad

    @rule(fails=st.booleans())
    def cancel_trouble(self, fails: bool) -> None:
        self.cancel_fails = fails

    @precondition(lambda self: self.core.renew_due)
    @rule(ok=st.booleans())
    def renew(self, ok: bool) -> None:
        self.feed(EngineRenewed(ok))

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def bounds(self) -> None:
        self.core.check_invariants()
        under_way = sum(1 for s in self.srcs.values() if not s.released)
        assert under_way <= MAX_IN_FLIGHT, f"{under_way} handoffs held, at most {MAX_IN_FLIGHT}"

    def teardown(self) -> None:
        """Close as the bridge does: reap what is queued, then end the rest: every source released once."""
        if sys.exc_info()[0] is not None:
            return  # a rule or invariant failed: its message is the finding, not this accounting
        self.cancel_fails = False
        while self.core.queued:
            self.feed(Reaped(self.core.queued[0].tid, True, self.now))
        self.feed(Closing(self.now))
        left = [k for k, s in self.srcs.items() if not s.released]
        assert not left, f"sources never released: {left}"


TestSenderCore = SenderMachine.TestCase
TestSenderCore.settings = machine_settings(300)


# --- broken variants ---------------------------------------------------------------------------


class IgnoresCredit(SenderCore):
    """Starts transfers to a peer without credit."""

    def pick(self) -> bytes | None:
        if len(self.transfers) >= self.config.max_in_flight or not self.peers:
            return None
        return next(iter(self.peers))

    def _start(self, e: Started, out: list[SenderAction]) -> None:
        self.peers[e.rid].credits = max(1, self.peers[e.rid].credits)
        super()._start(e, out)


class IgnoresWindow(SenderCore):
    """Keeps more NIXL transfers unended on a link than the receiver's window."""

    def unended(self, rid: bytes) -> int:
        return 0


class ReleasesTwice(SenderCore):
    """Releases a queued transfer's source twice."""

    def _reaped(self, e: Reaped, out: list[SenderAction]) -> None:
        super()._reaped(e, out)
        out.append(out[-1])


class RejectsBeforeCancelling(SenderCore):
    """Tells the receiver a NIXL transfer ended before its WRITEs were cancelled."""

    def _end(self, t: Transfer, reason: str | None, message: str, out: list[SenderAction]) -> None:
        if reason is not None and t.stage.value not in ("queued", "ending") and self.transfers.get(t.tid) is t:
            out.append(Send(t.rid, Reject(reason, message, t.tid)))
            reason = None
        super()._end(t, reason, message, out)


class RejectsAfterAFailedCancel(SenderCore):
    """Still sends the transfer's REJECT when NIXL could not cancel its WRITEs (R4.5 says none:
    a closed agent is no fence, the receiver must supersede or time the transfer out)."""

    def _writes_ended(self, e: WritesEnded, out: list[SenderAction]) -> None:
        t = self.transfers.get(e.tid)
        reject = None if t is None or e.cancelled or t.reason is None else Send(t.rid, Reject(t.reason, "", t.tid))
        super()._writes_ended(e, out)
        if reject is not None:
            out.append(reject)


class ReleasesWhatNixlReads(SenderCore):
    """Releases the source even when NIXL could not cancel its WRITEs."""

    def _writes_ended(self, e: WritesEnded, out: list[SenderAction]) -> None:
        super()._writes_ended(WritesEnded(e.tid, True, e.now), out)


@pytest.mark.parametrize(("broken", "caught"), [
    (IgnoresCredit, r"transfers started on \d+ credits \(sender rule 3\)"),
    (IgnoresWindow, r"unended on a window of"),
    (ReleasesTwice, r"released twice \(sender rule 4\)"),
    (RejectsBeforeCancelling, r"REJECT \w+ of \d+ before its EndWrites was answered cancelled \(R4\.1\)"),
    (ReleasesWhatNixlReads, r"released while NIXL may read it: cancel failed, agent open \(R4\.1\)"),
    # Either R4.5 check: a REJECT after the failed cancel, or for a transfer the closed agent ended.
    (RejectsAfterAFailedCancel, r"REJECT .*\(R4\.5\)"),
], ids=lambda x: x.__name__ if isinstance(x, type) else "")
def test_the_machine_finds_each_broken_rule(broken: type[SenderCore], caught: str) -> None:
    """Each variant fails on the invariant that states the rule it breaks, at the step that breaks
    it (match=), not on teardown's accounting (skipped once a step failed)."""
    machine = type(f"{broken.__name__}Machine", (SenderMachine,), {"core_class": broken})
    with pytest.raises(AssertionError, match=caught):
        run_state_machine_as_test(machine, settings=machine_settings(1000))


# --- focused examples --------------------------------------------------------------------------


def _core() -> SenderCore:
    return SenderCore(SenderConfig("ch", TIMEOUT, (Plane.NIXL, Plane.ZMQ), "host-staged", MAX_IN_FLIGHT, CHUNK),
                      note=lambda level, fields: None)


def test_hello_for_another_channel_or_version_is_rejected_and_unknown_peers_not_linked() -> None:
    core = _core()
    assert core.handle(LinkReceived(b"x", LinkHello("other"), 0.0)) == [
        Send(b"x", Reject("link_hello", "this bridge serves channel 'ch', interchange v1"))]
    assert core.handle(LinkReceived(b"x", LinkHello("ch", protocol=2), 0.0))[0].msg.reason == "link_hello"
    assert core.handle(LinkReceived(b"x", Credit(1), 0.0)) == [
        Send(b"x", Reject("not_linked", "send LINK_HELLO first"))]
    out = core.handle(LinkReceived(b"x", LinkHello("ch", 2, ("tcp", "nixl", "zmq")), 0.0, "10.0.0.1"))
    assert out == [Send(b"x", LinkWelcome(data_plane="nixl", gpu_source="host-staged"))]
    assert core.peers[b"x"].name == "tcp://10.0.0.1#78" and core.peers[b"x"].window == 2


def test_the_peer_that_waited_longest_gets_the_next_transfer_and_credit_is_spent() -> None:
    core = _core()
    for rid in (b"a", b"b"):
        core.handle(LinkReceived(rid, LinkHello("ch"), 0.0))
        core.handle(LinkReceived(rid, Credit(1), 0.0))
    assert core.pick() == b"a"
    assert core.handle(Started(b"a", 1, 8, 1.0)) == [SendTransfer(b"a", 1, 1)]
    assert core.pick() == b"b"
    core.handle(Started(b"b", 2, 8, 2.0))
    assert core.pick() is None, "no credit left"


def test_a_silent_peer_is_dropped_and_its_nixl_transfers_end_link_lost() -> None:
    core = _core()
    core.handle(LinkReceived(b"a", LinkHello("ch", 1, ("nixl", "zmq")), 0.0))
    core.handle(LinkReceived(b"a", Credit(1), 0.0))
    assert core.handle(Started(b"a", 7, 8, 0.0)) == [Describe(b"a", 1, 7)]
    out = core.handle(Tick(TIMEOUT + 0.1))
    assert out == [EndWrites(1)] and b"a" not in core.peers
    out = core.handle(WritesEnded(1, True, TIMEOUT + 0.1))
    assert out == [Send(b"a", Reject("link_lost", "the link was lost or set up again", 1)), Unregister(1), Release(7)]


def test_a_descriptor_that_cannot_be_sent_aborts_its_nixl_transfer_once() -> None:
    """The loop could not send the TENSOR_DESCRIPTOR: the transfer is released at once (NIXL never
    read it) and counted aborted once, not again as link_lost when its peer is dropped."""
    core = _core()
    core.handle(LinkReceived(b"a", LinkHello("ch", 1, ("nixl", "zmq")), 0.0))
    core.handle(LinkReceived(b"a", Credit(1), 0.0))
    assert core.handle(Started(b"a", 7, 8, 0.0)) == [Describe(b"a", 1, 7)]
    out = core.handle(SendFailed(1, "Host unreachable", 0.1))
    assert [a for a in out if isinstance(a, Release)] == [Release(7)] and not any(isinstance(a, EndWrites) for a in out)
    assert core.stats.aborted == 1 and b"a" not in core.peers and not core.transfers


def test_a_queued_transfer_past_its_deadline_is_released_and_its_peer_dropped() -> None:
    core = _core()
    core.handle(LinkReceived(b"a", LinkHello("ch"), 0.0))
    core.handle(LinkReceived(b"a", Credit(2), 0.0))
    core.handle(Started(b"a", 1, 8, 0.0))
    core.handle(Started(b"a", 2, 8, 0.0))
    assert [t.deadline for t in core.queued] == [2 * TIMEOUT, 2 * TIMEOUT], "one link timeout + T for what is ahead"
    assert core.handle(Reaped(1, True, 0.5)) == [Release(1)] and core.stats.sent == 1
    assert core.handle(Reaped(2, False, 3.0)) == [Release(2)] and b"a" not in core.peers and core.stats.aborted == 1


def test_an_offer_for_no_transfer_is_unexpected() -> None:
    core = _core()
    core.handle(LinkReceived(b"a", LinkHello("ch", 1, ("nixl",)), 0.0))
    assert core.handle(LinkReceived(b"a", RdmaRegister("x", {}, b""), 0.0)) == [
        Send(b"a", Reject("unexpected", "no transfer of this link waits for RDMA_REGISTER", "x"))]


def test_a_nixl_transfer_in_two_writes_ends_after_both_are_done() -> None:
    core = _core()
    core.handle(LinkReceived(b"a", LinkHello("ch", 1, ("nixl",)), 0.0))
    core.handle(LinkReceived(b"a", Credit(1), 0.0))
    core.handle(Started(b"a", 3, 16, 0.0))
    (accept,) = core.handle(LinkReceived(b"a", RdmaRegister(1, {"version": 1}, b"m"), 0.0))
    assert isinstance(accept, AcceptOffer) and accept.size == 16
    core.handle(OfferAccepted(1, "B", 0.0))
    assert core.handle(PostNext(0.0)) == [PostWrite(1, 0, 8, last=False)]
    assert core.handle(PostNext(0.0)) == [PostWrite(1, 8, 8, last=True)]
    assert core.handle(PostNext(0.0)) == []
    assert core.handle(WriteDone(1, 8, 8, 0.1)) == [Send(b"a", RdmaReady(1, 8, 8))]
    assert core.handle(WriteDone(1, 0, 8, 0.2)) == [Send(b"a", RdmaReady(1, 0, 8)), Send(b"a", TensorDataEnd(1, 16)),
                                                    EndWrites(1)]
    assert core.handle(WritesEnded(1, True, 0.2)) == [Unregister(1), Release(3)] and core.stats.sent == 1


def test_a_write_nixl_cannot_cancel_closes_the_agent_before_any_release_and_drops_every_link() -> None:
    core = _core()
    core.handle(LinkReceived(b"a", LinkHello("ch", 2, ("nixl",)), 0.0))
    core.handle(LinkReceived(b"a", Credit(2), 0.0))
    core.handle(Started(b"a", 1, 8, 0.0))
    core.handle(Started(b"a", 2, 8, 0.0))
    core.handle(LinkReceived(b"a", RdmaRegister(1, {}, b"m"), 0.0))
    core.handle(OfferAccepted(1, "B", 0.0))
    core.handle(PostNext(0.0))
    assert core.handle(WriteFailed(1, "rdma_failed", "ERR", 0.1)) == [EndWrites(1)]
    out = core.handle(WritesEnded(1, False, 0.1))
    assert out == [CloseEngine(), Release(1), Release(2)], "no REJECT: a closed agent is no fence (R4.5)"
    assert not core.peers and core.planes == (Plane.ZMQ,) and not core.transfers


def test_malformed_transfer_ids_end_nothing_and_the_link_stays_served() -> None:
    """A REJECT and an RDMA_REGISTER whose transfer_id is no integer name no transfer: logged, or
    answered `unexpected`, and the peer's next PING is answered. (Was a process test.)"""
    core = _core()
    core.handle(LinkReceived(b"a", LinkHello("ch"), 0.0))
    rej = link.decode([b"REJECT", b'{"transfer_id":[1],"reason":"x","message":"x"}'], link.FROM_RECEIVER)
    reg = link.decode([b"RDMA_REGISTER", b'{"transfer_id":{"a":1}}', b"metadata"], link.FROM_RECEIVER)
    assert core.handle(LinkReceived(b"a", rej, 0.1)) == [] and core.stats.rejected == 1
    assert core.handle(LinkReceived(b"a", reg, 0.2)) == [
        Send(b"a", Reject("unexpected", "no transfer of this link waits for RDMA_REGISTER", {"a": 1}))]
    assert core.handle(LinkReceived(b"a", LinkPing(), 0.3)) == [Send(b"a", LinkPong())]


def test_the_nixl_plane_keeps_a_window_of_transfers_in_flight_each_released_once() -> None:
    """Issue 13: several NIXL transfers per link at once. To a receiver with window 2 a second
    descriptor goes before the first was answered, a third not (it would supersede); each ends by
    the receiver's REJECT and is released once. (Was a process test in test_bridge.py.)"""
    core = _core()
    core.handle(LinkReceived(b"a", LinkHello("ch", 2, ("nixl", "zmq")), 0.0))
    core.handle(LinkReceived(b"a", Credit(3), 0.0))
    for src in (1, 2):
        assert core.pick() == b"a"
        assert core.handle(Started(b"a", src, 8, 0.0)) == [Describe(b"a", src, src)]
    assert core.unended(b"a") == 2 and core.pick() is None, "the window is full, though a credit is left"
    for tid in (1, 2):
        assert core.handle(LinkReceived(b"a", Reject("too_large", "test", tid), 0.1)) == [EndWrites(tid)]
        assert core.handle(WritesEnded(tid, True, 0.1)) == [Unregister(tid), Release(tid)]
    assert core.pick() == b"a" and not core.transfers
