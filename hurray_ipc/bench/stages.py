"""CPU per handoff of each stage alone: the broker's dispatch, the producer, the consumer.

The end-to-end rows (suite.py) measure a process's CPU, libzmq's I/O thread and the system calls of
its sockets included, and cannot say which stage's Python costs what. Here each stage runs alone,
in one process, against what the others would send it:

- **broker**: :class:`~hurray_ipc.broker.core.BrokerCore` fed encoded messages directly, one
  producer and one consumer: per handoff a HANDOFF in and its DELIVER out, a RELEASE in and its
  RELEASED and GRANT out (one bundle), each message decoded, dispatched and its answers grouped and
  encoded as the broker's loop does (no socket). Time: that thread's CPU.
- **producer** / **consumer**: the real :class:`Producer` (or :class:`Consumer`) over an inproc
  socket (no I/O thread, no system call per message) to a :class:`_PeerThread` in the same process:
  a BrokerCore behind a ROUTER, with the far peer played inside it (a consumer that releases each
  DELIVER at once, or a producer that answers each GRANT with a HANDOFF of one shared-memory
  buffer). Time: the process's CPU (every thread: the client's caller and its pump thread) less the
  peer thread's own CPU (its scheduler clock, read through /proc).

The producer sends one 4 KiB buffer of its own (``allocate``, zero copy) with ``send(block=False)``
keeping :data:`WINDOW` in flight, the consumer ``receive()``s and ``release()``s; every figure
is CPU microseconds per handoff, after a warm-up.

- **socket floor**: the client stages' socket traffic with no library code in it: a client that
  sends one HANDOFF's frames per handoff and receives one message back, :data:`WINDOW` in flight,
  over the same inproc socket with the same wake-up (poll on the socket's ZMQ_FD, then
  ZMQ_EVENTS) and the same accounting, to a peer thread that echoes. Each client stage also
  counts the messages its client sent and received per handoff (a batch of DELIVERs or RELEASEs
  is one), and the table scales the floor's cost per message to that count: what a stage costs
  above it is mostly its own Python (its steps, its session's lock and pump, wake-ups the echo
  does not cause). The scaling assumes a message costs the same whatever it carries.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import zmq

from ..broker.core import BrokerCore, Send
from ..devices.base import host_id
from ..devices.cpu import CpuDevice
from ..format.handle import BufferHandle, DeviceTag, SyncMode
from ..transport.pairing import Endpoint
from ..wire.ipc import (
    PROTOCOL_VERSION,
    Deliver,
    Grant,
    Handoff,
    Message,
    Release,
    encode_group,
    parcels,
)
from .harness import WINDOW

__all__ = ["FLOOR", "STAGES", "TARGETS_US", "broker_stage", "consumer_stage", "markdown", "producer_stage",
           "run_stages", "socket_floor"]

SIZE = 4096
_PEER = b"peer"  # the far peer's routing id inside the peer thread
_seq = itertools.count()
# The far peer's pid: another process than the measured client's (so handoffs are cross-process,
# as in a deployment), and one that always lives (pid 1), should the core ever check.
_FAR_PID = 1


def _frames(verb: str, header: dict[str, Any]) -> list[bytes]:
    return Message(verb, header).encode()


def _hello(core: BrokerCore, rid: bytes, role: str, channel: str, cpu: CpuDevice, now: float, pid: int = _FAR_PID,
           **extra: Any) -> list[Any]:
    ep = Endpoint(cpu.identity, cpu.capabilities(), pid).to_dict()
    return core.receive(rid, _frames("HELLO", {"protocol": PROTOCOL_VERSION, "role": role, "channel": channel,
                                              "pid": pid, "endpoint": ep, **extra}), now)


class _FarProducer:
    """Answers each GRANT with a HANDOFF of the same 4 KiB shared-memory buffer (with READY 1)."""

    def __init__(self, cpu: CpuDevice):
        self.buf = cpu.allocate(SIZE)
        self.exp = cpu.export_memory(self.buf)
        self.handle = BufferHandle(SIZE, 256, DeviceTag.CPU, SyncMode.PRODUCER_SYNCED).encode()
        self.ids = itertools.count(1)

    def answer(self, msg: Any) -> list[bytes] | None:
        if isinstance(msg, Grant):
            return Handoff(grant_id=msg.grant_id, handoff_id=next(self.ids), handle=self.handle,
                           memory=self.exp.blob, offset=self.exp.offset, ready=1).encode()
        return None


class _FarConsumer:
    """Releases each DELIVER at once, asking for one more."""

    def answer(self, msg: Any) -> list[bytes] | None:
        if isinstance(msg, Deliver):
            return Release(msg.token, credits=1).encode()
        return None


class _Peer(threading.Thread):
    """What a client stage talks to: an inproc ROUTER served by this thread, which hands every
    message it receives to :meth:`answer`."""

    def __init__(self) -> None:
        super().__init__(name="hurray-stage-peer", daemon=True)
        self.endpoint = f"inproc://hurray-stage-{os.getpid()}-{next(_seq)}"
        self.router = zmq.Context.instance().socket(zmq.ROUTER)
        self.router.bind(self.endpoint)
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def answer(self, parts: list[Any]) -> None:
        raise NotImplementedError

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                if self.router.poll(5):
                    while True:
                        try:
                            parts = self.router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.answer(parts)
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)
        self.router.close(0)
        if self.error is not None:
            raise RuntimeError(f"the stage's peer thread failed: {self.error!r}") from self.error


class _Echo(_Peer):
    """Sends every message back as it came: the socket floor's peer."""

    def answer(self, parts: list[Any]) -> None:
        self.router.send_multipart(parts)


class _PeerThread(_Peer):
    """A BrokerCore behind the inproc ROUTER, the far peer inside it."""

    def __init__(self, channel: str, far: str):
        super().__init__()
        self.cpu = CpuDevice()
        self.core = BrokerCore(host=host_id(), timeout_s=3600.0)
        now = time.monotonic()
        if far == "producer":
            self.far: _FarProducer | _FarConsumer = _FarProducer(self.cpu)
            outs = _hello(self.core, _PEER, "producer", channel, self.cpu, now, credits=WINDOW)
        else:
            self.far = _FarConsumer()
            outs = _hello(self.core, _PEER, "consumer", channel, self.cpu, now)
            outs += self.core.receive(_PEER, _frames("REQUEST", {"credits": WINDOW}), now)
        self._pending: dict[bytes, list[Any]] = {}
        self._apply(outs)

    def _apply(self, outs: list[Any]) -> None:
        work = list(outs)
        while work:
            o = work.pop(0)
            if not isinstance(o, Send):
                continue
            if o.rid == _PEER:
                frames = self.far.answer(o.msg)
                if frames is not None:
                    work.extend(self.core.receive(_PEER, frames, time.monotonic()))
            else:
                self._pending.setdefault(o.rid, []).append(o.msg)
        for rid, msgs in self._pending.items():
            for parcel in parcels(msgs, self.core.reads_bundles(rid)):
                self.router.send_multipart([rid, *(f for group in parcel for f in encode_group(group))])
        self._pending.clear()

    def answer(self, parts: list[Any]) -> None:
        self._apply(self.core.receive(parts[0], parts[1:], time.monotonic()))


class Figure(NamedTuple):
    """One stage run: CPU µs per handoff, and the messages its client sent and received per
    handoff (None for the broker stage, which has no socket)."""

    us: float
    messages: float | None = None


def _client_stage(far: str, n: int, run: Callable[[str, str, int], None], close: Callable[[], None],
                  messages: Callable[[], int]) -> Figure:
    """CPU µs per handoff of the client ``run(endpoint, channel, count)`` drives, less the peer's
    (``far``: the far peer's role, or ``"echo"``: :class:`_Echo`), and the client's ``messages()``
    (sent and received so far) per handoff; ``close()`` closes the client while the peer still
    answers (an inproc send to a closed ROUTER would block)."""
    channel = f"stage-{os.getpid()}-{next(_seq)}"
    peer = _Echo() if far == "echo" else _PeerThread(channel, far)
    peer.start()
    try:
        run(peer.endpoint, channel, 0)  # the client's construction and warm-up are not measured
        cpu0, peer0, msgs0 = time.process_time(), _peer_cpu(peer), messages()
        run(peer.endpoint, channel, n)
        cpu, peer_cpu = time.process_time() - cpu0, _peer_cpu(peer) - peer0
        msgs = messages() - msgs0
    finally:
        try:
            close()
        finally:
            peer.stop()
    return Figure(round((cpu - peer_cpu) / n * 1e6, 1), round(msgs / n, 2))


def _peer_cpu(peer: _Peer) -> float:
    """The peer thread's CPU so far (its clock, read from this thread through /proc)."""
    with open(f"/proc/self/task/{peer.native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _traffic(clients: dict[str, Any], key: str) -> Callable[[], int]:
    """Messages the client ``clients[key]`` has sent and received so far (0 before it exists)."""
    def count() -> int:
        c = clients.get(key)
        return c.session.messages_sent + c.session.messages_received if c is not None else 0
    return count


def producer_stage(n: int = 5000) -> Figure:
    """Producer CPU µs per handoff: ``send(block=False)`` of one allocated 4 KiB buffer, window 8."""
    from ..client import Producer

    clients: dict[str, Any] = {}

    def run(endpoint: str, channel: str, count: int) -> None:
        if "p" not in clients:
            p = clients["p"] = Producer(endpoint, channel, "cpu", prefetch=WINDOW)
            clients["buf"] = p.allocate(SIZE)
            count = 200  # warm-up
        p, buf = clients["p"], clients["buf"]
        for _ in range(count):
            while p.outstanding >= WINDOW:
                p.wait_released(30)
            p.send(buf, block=False)
        p.flush(30)

    def close() -> None:
        if "p" in clients:
            clients["buf"].close()
            clients["p"].close()

    return _client_stage("consumer", n, run, close, _traffic(clients, "p"))


def consumer_stage(n: int = 5000) -> Figure:
    """Consumer CPU µs per handoff: ``receive()`` then ``release()`` of a 4 KiB CPU buffer, prefetch 8."""
    from ..client import Consumer

    clients: dict[str, Any] = {}

    def run(endpoint: str, channel: str, count: int) -> None:
        if "c" not in clients:
            clients["c"] = Consumer(endpoint, channel, "cpu", prefetch=WINDOW)
            count = 200  # warm-up: maps the buffer once
        c = clients["c"]
        for _ in range(count):
            c.receive(timeout=30).release()
        c.flush_releases(30)

    def close() -> None:
        if "c" in clients:
            clients["c"].close()

    return _client_stage("producer", n, run, close, _traffic(clients, "c"))


def socket_floor(n: int = 5000) -> Figure:
    """CPU µs per handoff of the client stages' harness alone (no library code): one HANDOFF's
    frames out and one message back per handoff, :data:`WINDOW` in flight, woken as a client's
    session is woken."""
    import select

    from ..transport.sockets import NOBLOCK, readable, recv_frames, send_frames

    socks: dict[str, Any] = {"messages": 0}
    far = _FarProducer(CpuDevice())
    frames = far.answer(Grant(grant_id=1, epoch=1, consumer_id="0" * 16))
    assert frames is not None

    def run(endpoint: str, channel: str, count: int) -> None:
        if "d" not in socks:
            d = socks["d"] = zmq.Context.instance().socket(zmq.DEALER)
            d.connect(endpoint)
            socks["poll"] = select.poll()
            socks["poll"].register(d.getsockopt(zmq.FD), select.POLLIN)
            count = 200  # warm-up
        d, sleep = socks["d"], socks["poll"]
        sent = back = 0
        while back < count:
            while sent < count and sent - back < WINDOW:
                send_frames(d, frames)
                sent += 1
            while not readable(d):
                sleep.poll(100)
            while readable(d):
                recv_frames(d, NOBLOCK)
                back += 1
        socks["messages"] += sent + back

    def close() -> None:
        if "d" in socks:
            socks["d"].close(0)
        far.buf.close()

    return _client_stage("echo", n, run, close, lambda: int(socks["messages"]))


def broker_stage(n: int = 5000) -> Figure:
    """Broker CPU µs per handoff: decode, dispatch, coalesce and encode of HANDOFF -> DELIVER and
    RELEASE -> RELEASED + GRANT, BrokerCore alone."""
    cpu = CpuDevice()
    core = BrokerCore(host=host_id(), timeout_s=3600.0)
    far_p, far_c = _FarProducer(cpu), _FarConsumer()
    _hello(core, b"p", "producer", "stage", cpu, 0.0, bundles=True)  # as the library's clients say
    _hello(core, b"c", "consumer", "stage", cpu, 0.0, pid=os.getpid(), bundles=True)
    core.receive(b"c", _frames("REQUEST", {"credits": 1}), 0.0)
    outs = core.receive(b"p", _frames("READY", {"credits": 1}), 0.0)

    clock = time.thread_time
    spent = [0.0]  # the broker's own CPU: receive, coalesce and encode, never the far peers' answers

    def step(outs: list[Any]) -> tuple[bytes, list[bytes]]:
        """Encode ``outs`` as the loop would; the far peer's answer to them (and who sends it)."""
        answer: tuple[bytes, list[bytes]] | None = None
        t = clock()
        pending: dict[bytes, list[Any]] = {}
        for o in outs:
            if isinstance(o, Send):
                pending.setdefault(o.rid, []).append(o.msg)
        for rid, msgs in pending.items():
            for parcel in parcels(msgs, core.reads_bundles(rid)):
                for group in parcel:
                    encode_group(group)
        spent[0] += clock() - t
        for o in outs:
            if isinstance(o, Send):
                frames = (far_p if o.rid == b"p" else far_c).answer(o.msg)
                if frames is not None:
                    answer = (o.rid, frames)
        if answer is None:
            raise RuntimeError(f"the broker core answered {outs!r}: no GRANT or DELIVER to go on with")
        return answer

    rid, frames = step(outs)
    try:
        for i in range(200 + 2 * n):  # HANDOFF and RELEASE alternate: two messages per handoff
            if i == 200:
                spent[0] = 0.0
            t = clock()
            outs = core.receive(rid, frames, 1.0)
            spent[0] += clock() - t
            rid, frames = step(outs)
        return Figure(round(spent[0] / n * 1e6, 1))
    finally:
        far_p.buf.close()


STAGES: dict[str, Callable[[int], Figure]] = {"broker": broker_stage, "producer": producer_stage,
                                              "consumer": consumer_stage}
TARGETS_US = {"broker": 15.0, "producer": 25.0, "consumer": 25.0}  # issue 24
FLOOR = "socket floor"  # run beside the stages, once per round: no library code, so no pure/compiled pair
_RUNNABLE: dict[str, Callable[[int], Figure]] = {**STAGES, FLOOR: socket_floor}


def _one(stage: str, n: int, pure: bool) -> Figure:
    """``stage`` in a new process (HURRAY_PURE as given): a stage never inherits another's caches."""
    env = {**os.environ, "HURRAY_PURE": "1" if pure else "0"}
    out = subprocess.run([sys.executable, "-m", "hurray_ipc.bench.stages", "--one", stage, str(n)], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"stage {stage} failed: {out.stderr[-2000:]}")
    return Figure(**json.loads(out.stdout.strip().splitlines()[-1]))


def best_us(row: dict[str, Any]) -> float:
    """A stage row's figure that the target judges: the compiled one where it was built, else pure."""
    return float(row.get("compiled_us", row["pure_us"]))


def run_stages(n: int = 5000, rounds: int = 5, seed: int | None = 0,
               say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Each stage, pure and compiled (where built), and the socket floor, in each of ``rounds``
    rounds, every round in a new shuffled order, each run in its own process; medians, and the
    compiled/pure ratio of each round's pair (side by side) as their median."""
    from ..compiled import status

    built = "compiled" in status().values()
    variants = [False, True] if built else [True]
    rng = random.Random(seed)
    per: dict[str, list[float]] = {f"{st} {'pure' if pure else 'compiled'}": [] for st in STAGES for pure in variants}
    per[FLOOR] = []
    messages: dict[str, list[float]] = {}  # per stage (pure and compiled together): its client's messages per handoff
    for r in range(rounds):
        order = [(st, pure) for st in STAGES for pure in variants] + [(FLOOR, not built)]
        rng.shuffle(order)
        for st, pure in order:
            key = st if st == FLOOR else f"{st} {'pure' if pure else 'compiled'}"
            say(f"round {r + 1}: {key}")
            fig = _one(st, n, pure)
            per[key].append(fig.us)
            if fig.messages is not None:
                messages.setdefault(st, []).append(fig.messages)
    rows = []
    for st in STAGES:
        pure_us = per[f"{st} pure"]
        row: dict[str, Any] = {"stage": st, "pure_us": statistics.median(pure_us), "target_us": TARGETS_US[st]}
        if built:
            comp = per[f"{st} compiled"]
            row["compiled_us"] = statistics.median(comp)
            row["compiled_over_pure"] = round(statistics.median(c / p for c, p in zip(comp, pure_us, strict=True)), 2)
        row["met"] = best_us(row) <= TARGETS_US[st]
        if st in messages:
            row["messages_per_handoff"] = statistics.median(messages[st])
        rows.append(row)
    return {"n": n, "rounds": rounds, "compiled": status(), "raw": per, "rows": rows,
            "floor_us": statistics.median(per[FLOOR]), "floor_messages_per_handoff": statistics.median(messages[FLOOR])}


def markdown(res: dict[str, Any]) -> str:
    """The stage table of :func:`run_stages`' result."""
    lines = [f"CPU µs per handoff, each stage alone (hurray_ipc/bench/stages.py), {res['n']} handoffs, medians "
             f"of {res['rounds']} shuffled rounds", "",
             "| stage | pure Python | compiled | compiled / pure | target | met |", "|---|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['stage']} | {r['pure_us']:.1f} | {r.get('compiled_us', float('nan')):.1f} | "
                     f"{r.get('compiled_over_pure', '')} | {r['target_us']:g} | {'yes' if r['met'] else 'no'} |")
    floor, floor_msgs = res.get("floor_us"), res.get("floor_messages_per_handoff")
    if floor is not None and floor_msgs:  # results written before the floor was measured have none
        per_msg = floor / floor_msgs
        lines += ["", f"Socket floor of the client stages (the same socket and wake-up, no library code): "
                      f"{floor:.1f} µs per handoff at {floor_msgs:g} messages, "
                      f"{per_msg:.1f} µs a message."]
        for r in res["rows"]:
            if "messages_per_handoff" in r:
                m = r["messages_per_handoff"]
                lines.append(f"- {r['stage']}: {m:g} messages per handoff (sent and received), so about "
                             f"{per_msg * m:.1f} µs of socket floor and {best_us(r) - per_msg * m:.1f} µs above it.")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(_RUNNABLE[sys.argv[2]](int(sys.argv[3]))._asdict()))
    else:
        print(markdown(run_stages(int(sys.argv[1]) if len(sys.argv) > 1 else 5000)))
