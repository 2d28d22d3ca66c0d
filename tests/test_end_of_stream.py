"""End of stream (issue 21; docs/spec/ipc-protocol.md §4.9).

The vectors (tests/vectors/end_of_stream.json) run against the broker core and against a live
broker over raw frames; then the library: iterators end after every handoff was received, a
crashed producer never ends a stream, a new producer reopens it, the state survives a broker
restart, and user metadata arrives exactly as sent.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from barrier import Barrier
from brokerproc import BrokerProcess
from conftest import Proc
from hurray_ipc import ClosedError, Consumer, EndOfStream, HurrayTimeout, Producer, workload
from hurray_ipc.broker.core import BrokerCore, Send
from hurray_ipc.devices.base import host_id
from hurray_ipc.wire.ipc import Message, decode_all
from test_protocol_raw import pack_hot

VEC = json.loads((Path(__file__).parent / "vectors" / "end_of_stream.json").read_text())["scenarios"]
VEC += json.loads((Path(__file__).parent / "vectors" / "ipc_scenarios.json").read_text())["scenarios"]
HOST = host_id()
OTHER_HOST = "f" * 32  # a host id that is not this machine's ('host': 'other' in a vector)
HANDLE = bytes.fromhex("0010000000000000" "00010000" "00" "00" "0000")  # 4096 bytes, CPU, PRODUCER_SYNCED


def _endpoint(pid: int, host: str = HOST) -> dict[str, Any]:
    return {"device": {"kind": "cpu", "ordinal": 0, "uuid": "cpu-eos", "pci_bus_id": "", "emulated": False,
                       "host": host},
            "caps": {"ipc_memory": True, "ipc_events": False, "ipc_streams": False, "peers": []},
            "pid": pid, "stream": None}


class Driver:
    """Plays a scenario's actions as named clients; ``step`` returns what each client received."""

    def __init__(self) -> None:
        self.grants: dict[str, list[int]] = {}  # producer -> GRANT ids received, not yet used
        self.delivered: dict[str, list[str]] = {}  # consumer -> tokens of the DELIVERs it received
        self.hids: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self.timeout_s = 3.0  # the broker's timeout_ms, as its latest WELCOME said

    def frames(self, who: str, act: dict[str, Any]) -> list[bytes]:
        a = act["action"]
        if a == "hello":
            pid = self.pid(who)
            host = OTHER_HOST if act.get("host") == "other" else HOST
            h = {"protocol": 2, "role": act["role"], "channel": "eos", "pid": pid, "endpoint": _endpoint(pid, host)}
            if "ended" in act:
                h["ended"] = act["ended"]
            if "kept_mappings" in act:
                h["kept_mappings"] = act["kept_mappings"]
            if "held" in act:  # claims to handoffs of an earlier broker (§6): 'producer' is a client's name
                h["held"] = [{"token": self.token(who, x), "producer_id": self.rid(x["producer"]).decode(),
                              "handoff_id": x["handoff_id"], "event_pending": False} for x in act["held"]]
            if "outstanding" in act:  # 'holder' is a client's name, sent as its label
                h["outstanding"] = [{"handoff_id": x["handoff_id"],
                                     "consumer_id": BrokerCore.label_of(self.rid(x["holder"]))}
                                    for x in act["outstanding"]]
            return [b"HELLO", json.dumps(h).encode()]
        if a in ("request", "ready"):
            return [a.upper().encode(), json.dumps({"credits": act["credits"]}).encode()]
        if a == "handoff":
            self.hids[who] = self.hids.get(who, 0) + 1
            grant = self.grants[who].pop(0)
            return pack_hot("HANDOFF", {"grant_id": grant, "handoff_id": self.hids[who], "offset": 0},
                            [HANDLE, b"M" * 64])
        if a in ("end", "bye"):
            return [a.upper().encode(), b"{}"]
        if a == "release":
            return pack_hot("RELEASE", {"token": self.token(who, act)}, [])
        if a == "unmap":  # 'consumers' name clients, sent as their labels (§4.10)
            h = {"request": act["request"], "consumers": [BrokerCore.label_of(self.rid(c)) for c in act["consumers"]]}
            return [b"UNMAP", json.dumps(h).encode(), b"M" * 64]
        if a == "unmapped":
            return [b"UNMAPPED", json.dumps({"request": act["request"],
                                             "producer_id": self.rid(act["producer"]).decode()}).encode()]
        raise AssertionError(a)

    def rid(self, who: str) -> bytes:
        """The routing id client ``who`` speaks with."""
        return who.encode()

    def token(self, who: str, act: dict[str, Any]) -> str:
        """``act``'s token: given, or ``delivered: N``, that of the N-th DELIVER ``who`` received."""
        return act["token"] if "token" in act else self.delivered[who][act["delivered"] - 1]

    def note(self, got: dict[str, list[Message]]) -> None:
        for who, msgs in got.items():
            self.timeout_s = next((m.fields()["timeout_ms"] / 1000 for m in msgs if m.verb == "WELCOME"),
                                  self.timeout_s)
            self.grants.setdefault(who, []).extend(m.fields()["grant_id"] for m in msgs if m.verb == "GRANT")
            self.delivered.setdefault(who, []).extend(m.fields()["token"] for m in msgs if m.verb == "DELIVER")

    def pid(self, who: str) -> int:
        """Each client its own process: same-process clients would pair in-process (§3)."""
        return self.pids.setdefault(who, 1000 + len(self.pids))

    def step(self, who: str, acts: list[dict[str, Any]], expect: dict[str, Any]) -> dict[str, list[Message]]:
        """Do ``acts`` as ``who``; what each client received. ``expect`` (the step's expectation)
        only tells a live driver how long a time rule may take to show: it is checked after."""
        raise NotImplementedError


def hold_s(scenario: dict[str, Any]) -> float | None:
    """The hold bound a scenario's broker must have (its 'broker': {'hold_ms': N}), or None."""
    ms = scenario.get("broker", {}).get("hold_ms")
    return None if ms is None else ms / 1000


class CoreDriver(Driver):
    def __init__(self, hold: float | None = None) -> None:
        super().__init__()
        self.core = BrokerCore(host=HOST, hold_s=hold)
        self.now = 0.0

    def step(self, who: str, acts: list[dict[str, Any]], expect: dict[str, Any]) -> dict[str, list[Message]]:
        got: dict[str, list[Message]] = {}
        for act in acts:
            if act["action"] == "die":
                out = self.core.client_gone(who.encode(), "process gone")
            elif act["action"] in ("silent", "wait"):  # the others PING past the timeout; the clock ticks
                self.now += self.core.timeout_s + 0.1
                out = []
                for other in [rid for rid in self.core.clients if rid != who.encode() or act["action"] == "wait"]:
                    out += [o for o in self.core.receive(other, [b"PING", b"{}"], self.now)
                            if not (isinstance(o, Send) and o.msg.verb == "PONG")]
                out += self.core.tick(self.now, lambda c: None)  # no leases: heartbeats alone (§5)
            else:
                out = self.core.receive(who.encode(), self.frames(who, act), self.now)
            for o in out:
                if isinstance(o, Send):
                    got.setdefault(o.rid.decode(), []).append(o.msg)
            self.core.check_invariants()
        return got


class LiveDriver(Driver):
    """Raw DEALER sockets on a live broker. After a step, the acting client is synchronised first
    (a CAPS on its own socket is answered after its earlier messages were handled), then every
    other client: what the step sent them is queued before their CAPS_REPLY."""

    def __init__(self, endpoint: str, ctx: zmq.Context, run: int) -> None:
        super().__init__()
        self.endpoint, self.ctx, self.run = endpoint, ctx, run
        self.socks: dict[str, zmq.Socket] = {}
        self.barriers: dict[str, Barrier] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.left: set[str] = set()  # said BYE since their last HELLO: as in CoreDriver, nobody pings for them

    def rid(self, who: str) -> bytes:
        return f"eos{self.run}-{who}".encode()

    def pid(self, who: str) -> int:
        if who not in self.procs:  # a process of its own, so that 'die' can end it
            self.procs[who] = subprocess.Popen(["sleep", "120"])
        return self.procs[who].pid

    def sock(self, who: str) -> zmq.Socket:
        if who not in self.socks:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, self.rid(who))
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.endpoint)
            self.socks[who] = s
            self.barriers[who] = Barrier(_endpoint(os.getpid()))
        return self.socks[who]

    def _ask(self, who: str, verb: str) -> tuple[list[Message], Message]:
        """``verb`` (CAPS or STATS) from ``who``: what came before its answer, and the answer."""
        s, barrier = self.sock(who), self.barriers[who]
        s.send_multipart(barrier.frames(verb))
        out: list[Message] = []
        while True:
            assert s.poll(10_000), "the broker did not answer"
            parts = s.recv_multipart()
            msgs = decode_all(parts)
            if barrier.is_answer(parts):
                return out, msgs[0]
            out.extend(m for m in msgs if m.verb != "PONG")  # our own keep-alives

    def sync(self, who: str) -> list[Message]:
        return self._ask(who, "CAPS")[0]

    def gone(self, who: str) -> bool:
        label = BrokerCore.label_of(self.rid(who))
        reply = self._ask("stats", "STATS")[1]
        return all(c["id"] != label for c in reply.fields()["clients"])

    def _ping_others(self, who: str | None = None) -> None:
        for other, sock in self.socks.items():
            if other not in (who, "stats") and other not in self.left:
                sock.send_multipart([b"PING", b"{}"])

    def step(self, who: str, acts: list[dict[str, Any]], expect: dict[str, Any]) -> dict[str, list[Message]]:
        for act in acts:
            if act["action"] == "wait":
                # The broker's timeout (the WELCOMEs said it) and a margin for its next tick pass
                # while every client keeps sending PING: a time rule's effect, not a race.
                until = time.monotonic() + self.timeout_s + 0.5
                while time.monotonic() < until:
                    self._ping_others()
                    time.sleep(0.1)
            elif act["action"] in ("die", "silent"):
                if act["action"] == "die":
                    self.procs[who].kill()
                    self.procs[who].wait()
                # These raw clients have no lease: the broker judges them by heartbeats (§5), so
                # the silent (or dead) one goes after timeout_ms while the others keep pinging.
                # STATS may be a snapshot up to 0.25 s old (§2.3): seen listed first, then gone.
                deadline, pinged, seen = time.monotonic() + 15, 0.0, False
                while True:
                    listed = not self.gone(who)
                    seen = seen or listed
                    if seen and not listed:
                        break
                    assert time.monotonic() < deadline, "the broker did not drop the silent client"
                    if time.monotonic() - pinged > 0.2:
                        pinged = time.monotonic()
                        self._ping_others(who)
                    time.sleep(0.02)  # polling the broker's STATS, an observable condition
            else:
                self.sock(who).send_multipart(self.frames(who, act))
                if act["action"] == "bye":
                    self.left.add(who)
                elif act["action"] == "hello":
                    self.left.discard(who)
        heard = ([who] if acts[0]["action"] != "die" else []) + [o for o in self.socks if o not in (who, "stats")]
        got: dict[str, list[Message]] = {}

        def collect() -> None:
            for k in heard:
                got.setdefault(k, []).extend(self.sync(k))

        collect()
        if any(a["action"] == "wait" for a in acts):
            # The broker applies a time rule at its next tick, after what it had drained: on a
            # loaded machine a sync's CAPS may be answered first. So keep pinging and syncing
            # until every client the step expects heard something, for 3 s at most (a rule
            # applied later than that is a broker that does not tick: _check then names what is
            # missing, and an unexpected message is still one too many).
            deadline = time.monotonic() + 3
            while not all(got.get(k) for k in expect) and time.monotonic() < deadline:
                self._ping_others()
                time.sleep(0.1)
                collect()
        return {k: v for k, v in got.items() if v}

    def close(self) -> None:
        for s in self.socks.values():
            s.send_multipart([b"BYE", b"{}"])
            s.close(0)
        for p in self.procs.values():
            p.kill()
            p.wait()


def _check(name: str, i: int, step: dict[str, Any], got: dict[str, list[Message]], d: Driver) -> None:
    """``got`` is what ``step`` expects; an expected '@name' is the label of client ``name``."""

    def resolve(v: Any) -> Any:
        if isinstance(v, list):
            return [resolve(x) for x in v]
        if isinstance(v, str) and v.startswith("@"):
            return BrokerCore.label_of(d.rid(v[1:]))
        return v

    exp = step["expect"]
    where = f"{name!r} step {i} ({step['client']}: {[a['action'] for a in step['do']]})"
    assert set(got) == set(exp), f"{where}: clients reached {sorted(got)}, expected {sorted(exp)}: {got}"
    for who, want in exp.items():
        have = got[who]
        assert [m.verb for m in have] == [w["verb"] for w in want], f"{where}: {who} got {have}"
        for m, w in zip(have, want, strict=True):
            for k, v in w.items():
                if k != "verb":
                    v = resolve(v)
                    assert m.fields().get(k) == v, f"{where}: {who}'s {m.verb} has {k}={m.fields().get(k)!r}, not {v!r}"


def play(d: Driver, scenario: dict[str, Any]) -> None:
    for i, step in enumerate(scenario["steps"]):
        got = d.step(step["client"], step["do"], step["expect"])
        d.note(got)
        _check(scenario["name"], i, step, got, d)


@pytest.mark.parametrize("scenario", VEC, ids=[s["name"] for s in VEC])
def test_vector_on_the_core(scenario):
    play(CoreDriver(hold_s(scenario)), scenario)


@pytest.fixture
def quick_broker(tmp_path):
    """A broker that drops a silent client after 1 s, not 2: the scenarios' time rules (``wait``,
    ``silent``) each wait for that timeout, and every other client pings while they do."""
    b = BrokerProcess(f"ipc://{tmp_path}/broker.sock", timeout=1.0).start()
    yield b
    b.stop()


def test_vectors_on_a_live_broker(quick_broker, tmp_path):
    """Every scenario on a live broker: those without broker settings one after another on one
    broker, each that needs a hold bound on a broker of its own started with it (--hold)."""
    ctx = zmq.Context()
    try:
        for i, scenario in enumerate(VEC):
            hold = hold_s(scenario)
            broker = quick_broker if hold is None else BrokerProcess(
                f"ipc://{tmp_path}/hold{i}.sock", timeout=1.0, extra_args=["--hold", str(hold)]).start()
            d = LiveDriver(broker.endpoint, ctx, i)
            try:
                play(d, scenario)
            finally:
                d.close()
                if broker is not quick_broker:
                    broker.stop()
    finally:
        ctx.destroy(linger=0)


# --- the library -----------------------------------------------------------------------------------
SIZE = 4096


def producer(broker: BrokerProcess, channel: str, count: int, end: bool = True) -> Proc:
    return Proc(workload.run_producer, endpoint=broker.endpoint, channel=channel, device="cpu", count=count,
                size=SIZE, tag=5, end_stream=end)


def channel_state(endpoint: str, channel: str) -> tuple[int, bool]:
    """The broker's own view (STATS): the channel's registered producers, and whether it ended."""
    from hurray_ipc.client.query import stats

    ch = [x for x in stats(endpoint, 5.0)["channels"] if x["name"] == channel]
    return (ch[0]["producers"], ch[0]["ended"]) if ch else (0, False)


def until(cond: Any, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)  # polling an observable condition


def test_iterator_ends_after_every_handoff_was_received(broker):
    """A producer sends 20 and closes (which ends its stream): ``for h in c`` gets all 20 and
    stops by itself; receive() then raises EndOfStream at once. (That deliveries queued when the
    end arrives come first is the next test's, deterministically.)"""
    p = producer(broker, "it", 20)
    seen = []
    with Consumer(broker.endpoint, "it", "cpu", prefetch=4) as c:
        for h in c:
            with h:
                seen.append(workload.verify(h.numpy().copy()))
        t0 = time.monotonic()
        with pytest.raises(EndOfStream, match="every producer of channel 'it' ended"):
            c.receive(timeout=10)
        assert time.monotonic() - t0 < 5, "it waited out the timeout instead of raising at once"
    assert seen == [(5, i, True) for i in range(20)]
    assert p.result()["error"] is None


def test_deliveries_queued_before_the_end_are_received_first(broker):
    """Deterministic: three deliveries sit in the consumer's inbox when it learns of the end
    (they reached its socket before CHANNEL_STATE); receive() hands out all three, then raises."""
    with Consumer(broker.endpoint, "queued", "cpu", prefetch=4) as c, Producer(broker.endpoint, "queued", "cpu") as p:
        with pytest.raises(HurrayTimeout):
            c.receive(timeout=0)  # asks for 4
        for i in range(3):
            p.send(workload.pattern(5, i, SIZE), timeout=5)
        p.end()
        deadline = time.monotonic() + 10
        while not c.ended:  # the pump thread dispatches the DELIVERs, then CHANNEL_STATE
            assert time.monotonic() < deadline, "the end never reached the consumer"
            time.sleep(0.01)
        got = []
        for h in c:
            with h:
                got.append(workload.verify(h.numpy().copy())[1])
        assert got == [0, 1, 2]


def test_a_closing_producer_waits_for_what_a_slow_consumer_queued(broker):
    """The consumer holds one handoff and has three more queued when the producer closes: the
    end reaches it, then it takes six seconds (longer than close() ever waited before: 5 s). A
    producer that left would take its buffers with it (PRODUCER_GONE drops the queued three), so
    close() waits for every release; all four arrive intact."""
    with Consumer(broker.endpoint, "slow", "cpu", prefetch=4) as c, Producer(broker.endpoint, "slow", "cpu") as p:
        with pytest.raises(HurrayTimeout):
            c.receive(timeout=0)  # asks for 4
        for i in range(4):
            p.send(workload.pattern(5, i, SIZE), timeout=5)
        first = c.receive(timeout=5)
        closer = threading.Thread(target=p.close, daemon=True)
        closer.start()
        until(lambda: c.ended, "the end to reach the consumer")
        time.sleep(6.0)  # the slow consumer (the scenario itself, not a synchronisation)
        got = [workload.verify(first.numpy().copy())[1]]
        first.release()
        for h in c:
            with h:
                got.append(workload.verify(h.numpy().copy())[1])
        closer.join(10)
        assert got == [0, 1, 2, 3] and not closer.is_alive()


def test_end_from_another_thread_unblocks_a_waiting_send(broker):
    """send() waiting for a consumer that never comes ends with ClosedError when another thread
    ends the stream, whether end() comes before or after it started waiting."""
    with Producer(broker.endpoint, "unblock", "cpu") as p:
        err: list[BaseException] = []

        def send() -> None:
            try:
                p.send(b"x" * 8)  # no timeout: only the end can stop it
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                err.append(e)

        th = threading.Thread(target=send, daemon=True)
        th.start()
        p.end()
        th.join(10)
        assert not th.is_alive() and len(err) == 1 and isinstance(err[0], ClosedError), err
        assert "ended its stream" in str(err[0])


def test_async_for_ends_too(broker):
    p = producer(broker, "aio", 5)

    async def main() -> list[int]:
        got = []
        with Consumer(broker.endpoint, "aio", "cpu") as c:
            async for h in c:
                with h:
                    got.append(workload.verify(h.numpy().copy())[1])
        return got

    assert asyncio.run(asyncio.wait_for(main(), 30)) == list(range(5))
    assert p.result()["error"] is None


def test_a_crashed_producer_does_not_end_the_stream_and_a_new_one_continues_it(broker):
    with Consumer(broker.endpoint, "crash", "cpu") as c:
        doomed = Proc(workload.run_producer, endpoint=broker.endpoint, channel="crash", device="cpu", count=10**6,
                      size=SIZE, tag=1, end_stream=True)
        with c.receive(timeout=10):
            pass
        doomed.kill()
        until(lambda: channel_state(broker.endpoint, "crash")[0] == 0, "the broker to notice the death")
        assert channel_state(broker.endpoint, "crash") == (0, False)  # not ended by the broker
        while True:  # what it sent before dying may still be queued here; then nothing, and no end
            try:
                with c.receive(timeout=1.0):
                    pass
            except HurrayTimeout:
                break
        assert not c.ended
        p = producer(broker, "crash", 3)
        got = []
        for h in c:  # ends when the new producer ends
            with h:
                got.append(workload.verify(h.numpy().copy())[0])
        assert got == [5, 5, 5] and p.result()["error"] is None


def test_a_new_producer_reopens_the_stream(broker):
    with Consumer(broker.endpoint, "reopen", "cpu") as c:
        p1 = producer(broker, "reopen", 2)
        assert len([h.release() for h in c]) == 2 and p1.result()["error"] is None
        with pytest.raises(EndOfStream):
            c.receive(timeout=5)
        with pytest.raises(HurrayTimeout):
            c.wait_open(timeout=0.2)  # nobody reopened it yet
        p2 = producer(broker, "reopen", 3)
        c.wait_open(timeout=10)
        assert len([h.release() for h in c]) == 3 and p2.result()["error"] is None


def test_close_without_end_and_a_failing_producer_leave_the_stream_open(broker):
    with Consumer(broker.endpoint, "open", "cpu") as c:
        # Each registers before it leaves, so a count of 0 below means the broker handled both goodbyes.
        quiet = Producer(broker.endpoint, "open", "cpu")
        until(lambda: quiet.session.registered, "the first producer to register")
        quiet.close(end=False)
        with pytest.raises(RuntimeError, match="boom"), Producer(broker.endpoint, "open", "cpu") as failing:
            until(lambda: failing.session.registered, "the second producer to register")
            raise RuntimeError("boom")  # leaving through an exception: the producer did not finish
        # Both goodbyes were handled, and the broker's own state has the stream open: an end it
        # sent would be on its way already, so the wait below is not what decides.
        until(lambda: channel_state(broker.endpoint, "open")[0] == 0, "the broker to see both producers leave")
        assert channel_state(broker.endpoint, "open") == (0, False)
        with pytest.raises(HurrayTimeout):
            c.receive(timeout=1.0)
        assert not c.ended
        Producer(broker.endpoint, "open", "cpu").close()
        with pytest.raises(EndOfStream):
            c.receive(timeout=5)


def test_the_end_survives_a_broker_restart(tmp_path):
    b = BrokerProcess(f"ipc://{tmp_path}/b.sock", timeout=3.0).start()  # room for a slow machine
    try:
        with Consumer(b.endpoint, "restart", "cpu", heartbeat_s=0.1, timeout_s=3.0) as c:
            Producer(b.endpoint, "restart", "cpu").close()
            with pytest.raises(EndOfStream):
                c.receive(timeout=5)
            first = c.session.broker_session
            b.stop(signal.SIGKILL)
            b.start()
            deadline = time.monotonic() + 20
            while not (c.session.registered and c.session.broker_session not in (None, first)):
                assert time.monotonic() < deadline, "the consumer did not register with the new broker"
                time.sleep(0.01)
            # It told the new broker, which has the channel ended (its own state, not the client's):
            assert channel_state(b.endpoint, "restart") == (0, True)
            with pytest.raises(EndOfStream):
                c.receive(timeout=2)
            p = producer(b, "restart", 2)
            c.wait_open(timeout=10)
            assert len([h.release() for h in c]) == 2 and p.result()["error"] is None
    finally:
        b.stop()


# --- user metadata arrives exactly as sent -------------------------------------------------------------
@pytest.mark.parametrize("meta", [
    {"frame": 3, "tags": ["a", "b"], "nested": {"x": [1, 2.5, None, True]}},
    ["a", 1, {"b": []}],
    "end-of-batch",
    0,
    {},
])
def test_user_metadata_arrives_exactly_as_sent(broker, meta):
    with Consumer(broker.endpoint, "meta", "cpu") as c, Producer(broker.endpoint, "meta", "cpu") as p:
        with pytest.raises(HurrayTimeout):
            c.receive(timeout=0)  # asks for one
        p.send(np.arange(3, dtype=np.float32), meta=meta, timeout=5)
        with c.receive(timeout=5) as h:
            assert h.meta == meta and type(h.meta) is type(meta)
            assert h.wire_meta["shape"] == [3] and h.wire_meta["typestr"] == "<f4"
        p.send(b"abc", timeout=5)  # without meta: None
        with c.receive(timeout=5) as h:
            assert h.meta is None
