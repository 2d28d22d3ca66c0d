"""hurray-bench --legs: where one paced handoff's one-way latency goes, leg by leg.

The latency rows say how long a handoff takes; the stage harness (stages.py) says how much CPU each
process spends per handoff in a hot loop. Neither says where a *paced* handoff's time goes, and a
paced handoff runs its code cold (caches and branch predictors taken by the other processes while
it idled), at several times its hot-loop cost. So this mode takes timestamps inside the three
processes at the points where a handoff crosses from one to the next, on the host's one monotonic
clock (CLOCK_MONOTONIC is system-wide), and reports each leg:

=========================  ==========================================================================
``producer``               ``send()`` called until its HANDOFF is handed to ZeroMQ
``hop in``                 until the broker's loop read that HANDOFF (the send call, both I/O threads)
``broker dispatch``        the broker's core: decode, checks, matching, the DELIVER built
``broker flush``           until the DELIVER is handed to ZeroMQ (the rest of the drain round, encoding)
``hop out``                until the consumer's pump read the DELIVER
``consumer``               the DELIVER read until ``receive()`` and then ``wait()`` returned
=========================  ==========================================================================

A message is stamped when it is *handed* to ZeroMQ, not when the send call returns: the receiver
may read it before the sender's call returns (the send wakes ZeroMQ's I/O thread, which can take
the core the sender was on), so a leg ending at the return could come out negative. How long the
broker's DELIVER send call took is reported beside the legs (``broker send call``, part of ``hop
out``).

The points are taken by wrapping the functions there (the library is not changed for it): the
client session's ``send_frames`` and ``Session._handle``, the broker loop's ``recv_frames``,
``send_frames`` and ``Broker._queue``. A run whose stamps do not pair up one per handoff (one of
those functions renamed, a handoff sent twice) raises instead of reporting shifted legs.

Each round runs ``send()`` (blocking: it waits for the broker's ACCEPTED, the public API's
default) of a CPU buffer, the same with ``send(block=False)``, ``send()`` of an emulated CUDA
buffer (zero op delay, EVENT mode; the consumer's leg then includes ``wait()``, as the latency
rows do) and the forwarding-only relay (bench/floor.py) in a shuffled
order, each with its own broker; figures are medians over the rounds of each leg's per-round
percentile. The timestamps cost a few microseconds per point, so the total is a little above the
latency row's.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from ..workload import spawn
from .harness import PACE, WINDOW, pct, run_pair

__all__ = ["ASIDES", "LEGS", "MODES", "legs_of", "markdown", "run_legs"]

WARMUP = 10
SIZE = 4096
# (leg, from point, to point); the points in the order a handoff passes them.
LEGS: tuple[tuple[str, str, str], ...] = (
    ("producer", "send", "handoff_send"),
    ("hop in", "handoff_send", "broker_in"),
    ("broker dispatch", "broker_in", "dispatched"),
    ("broker flush", "dispatched", "deliver_send"),
    ("hop out", "deliver_send", "deliver_in"),
    ("consumer", "deliver_in", "received"),
)
# Durations within a leg, reported beside the legs (not added to the total).
ASIDES: tuple[tuple[str, str, str], ...] = (("broker send call", "deliver_send", "deliver_sent"),)
# label -> (device of both ends, send(block=))
MODES: dict[str, tuple[str, bool]] = {"cpu send()": ("cpu", True), "cpu send(block=False)": ("cpu", False),
                                      "emulated cuda send()": ("cuda:0", True)}


def _broker(endpoint: str) -> dict[str, list[float]]:
    """A broker serving ``endpoint`` until SIGTERM, stamping each HANDOFF read, each batch of
    outputs holding a DELIVER, and each DELIVER send's start and end."""
    from ..broker import server

    stamps: dict[str, list[float]] = {"broker_in": [], "dispatched": [], "deliver_send": [], "deliver_sent": []}
    recv, send, queue = server.recv_frames, server.send_frames, server.Broker._queue

    def recv_frames(sock: Any, flags: int = 0) -> list[bytes]:
        parts = recv(sock, flags)
        if len(parts) > 1 and parts[1] == b"HANDOFF":
            stamps["broker_in"].append(time.monotonic())
        return parts

    def send_frames(sock: Any, frames: Any, flags: int = 0) -> None:
        deliver = len(frames) > 1 and frames[1] == b"DELIVER"
        if deliver:
            stamps["deliver_send"].append(time.monotonic())
        send(sock, frames, flags)
        if deliver:
            stamps["deliver_sent"].append(time.monotonic())

    def _queue(self: Any, outs: list[Any]) -> None:
        t = time.monotonic()
        if any(isinstance(o, server.Send) and o.msg.verb == "DELIVER" for o in outs):
            stamps["dispatched"].append(t)
        queue(self, outs)

    server.recv_frames, server.send_frames = recv_frames, send_frames
    server.Broker._queue = _queue  # type: ignore[method-assign]
    b = server.Broker(endpoint)
    b.install_signal_handlers()
    b.serve()
    return stamps


def _emulation() -> dict[str, str]:
    from ..devices.backend.emulated import EmulationConfig

    return EmulationConfig(devices=1, op_delay_s=0.0).to_env()


def _producer(endpoint: str, channel: str, n: int, device: str, block: bool,
              env: dict[str, str]) -> dict[str, list[float]]:
    os.environ.update(env)
    from ..client import Producer, session

    stamps: dict[str, list[float]] = {"send": [], "handoff_send": []}
    send = session.send_frames

    def send_frames(sock: Any, frames: Any, flags: int = 0) -> None:
        if frames and frames[0] == b"HANDOFF":
            stamps["handoff_send"].append(time.monotonic())
        send(sock, frames, flags)

    session.send_frames = send_frames
    with Producer(endpoint, channel, device, prefetch=WINDOW) as p:
        buf = p.allocate(SIZE)
        for _ in range(WARMUP + n):
            time.sleep(PACE)  # idle between handoffs, as in every latency row
            stamps["send"].append(time.monotonic())
            p.send(buf, block=block)
            p.flush(30)
        buf.close()
    return stamps


def _consumer(endpoint: str, channel: str, n: int, device: str, env: dict[str, str]) -> dict[str, list[float]]:
    os.environ.update(env)
    from ..client import Consumer
    from ..client.session import Session

    stamps: dict[str, list[float]] = {"deliver_in": [], "received": []}
    handle = Session._handle

    def _handle(self: Any, parts: list[bytes], out: list[Any]) -> None:
        if parts and parts[0] == b"DELIVER":
            stamps["deliver_in"].append(time.monotonic())
        handle(self, parts, out)

    Session._handle = _handle  # type: ignore[method-assign]
    with Consumer(endpoint, channel, device, prefetch=WINDOW) as c:
        for _ in range(WARMUP + n):
            h = c.receive(timeout=60)
            h.wait()
            stamps["received"].append(time.monotonic())
            h.release()
        c.flush_releases(30)
    return stamps


def _one_mode(n: int, mode: str) -> dict[str, Any]:
    """One mode's run with a broker of its own: each leg's p10/p50/p90 in microseconds."""
    tmp = Path(tempfile.mkdtemp(prefix="hurray-legs-"))
    ep = f"ipc://{tmp}/broker.sock"
    bp, bq = spawn(_broker, endpoint=ep)
    try:
        deadline = time.monotonic() + 30
        while not (tmp / "broker.sock").exists():
            if not bp.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the legs broker did not start")
            time.sleep(0.01)  # polling for a file another process creates: no event to wait on
        device, block = MODES[mode]
        env = _emulation() if device != "cpu" else {}
        pr, cr = run_pair((_producer, {"endpoint": ep, "channel": "legs", "n": n, "device": device, "block": block,
                                       "env": env}),
                          (_consumer, {"endpoint": ep, "channel": "legs", "n": n, "device": device, "env": env}))
    finally:
        bp.terminate()
    br = bq.get(timeout=30)
    bp.join(10)
    if "error" in br:
        raise RuntimeError(br["error"] + "\n" + br.get("trace", ""))
    return legs_of({**pr, **br, **cr}, n)


def legs_of(stamps: dict[str, list[float]], n: int) -> dict[str, Any]:
    """Each leg's p10/p50/p90 in microseconds from every point's timestamps (seconds), one per
    handoff in the order sent, the first WARMUP of each skipped. Raises RuntimeError unless every
    point of :data:`LEGS` has exactly ``WARMUP + n`` stamps."""
    points = {p for _, a, b in LEGS + ASIDES for p in (a, b)}
    counts = {k: len(stamps.get(k, [])) for k in sorted(points)}
    if set(counts.values()) != {WARMUP + n}:
        raise RuntimeError(f"stamps do not pair up one per handoff ({WARMUP + n} handoffs): {counts}")
    s = {k: stamps[k][WARMUP:] for k in points}

    def figures(a: str, b: str) -> dict[str, float]:
        d = [(y - x) * 1e6 for x, y in zip(s[a], s[b], strict=False)]
        return {"p10": round(pct(d, 10), 1), "p50": round(pct(d, 50), 1), "p90": round(pct(d, 90), 1)}

    return {"legs": {leg: figures(a, b) for leg, a, b in LEGS}, "total": figures(LEGS[0][1], LEGS[-1][2]),
            "asides": {name: figures(a, b) for name, a, b in ASIDES}}


def run_legs(n: int = 1000, rounds: int = 3, seed: int = 0,
             say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """``rounds`` rounds of both modes and the relay, each round in a shuffled order; medians over
    the rounds of every figure."""
    from .floor import bench_relay

    rng = random.Random(seed)
    raw: list[dict[str, Any]] = []
    for r in range(rounds):
        runs: list[tuple[str, Callable[[], Any]]] = [(m, partial(_one_mode, n, m)) for m in MODES]
        runs.append(("relay", lambda: bench_relay(Path(tempfile.mkdtemp(prefix="hurray-legs-")), SIZE, n, False,
                                                  WINDOW)))  # legs keep the default window, whatever the env
        rng.shuffle(runs)
        got: dict[str, Any] = {"round": r}
        for name, fn in runs:
            say(f"legs round {r + 1}/{rounds}: {name}")
            got[name] = fn()
        raw.append(got)

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 1)

    def over_rounds(m: str, part: str, names: tuple[tuple[str, str, str], ...]) -> dict[str, dict[str, float]]:
        return {name: {p: med([x[m][part][name][p] for x in raw]) for p in ("p10", "p50", "p90")}
                for name, _, _ in names}

    modes = {m: {"legs": over_rounds(m, "legs", LEGS), "asides": over_rounds(m, "asides", ASIDES),
                 "total": {p: med([x[m]["total"][p] for x in raw]) for p in ("p10", "p50", "p90")}}
             for m in MODES}
    return {"n": n, "rounds": rounds, "size": SIZE, "pace_s": PACE, "modes": modes,
            "relay_p50_us": med([x["relay"]["latency"]["p50_us"] for x in raw]), "raw": raw}


def markdown(res: dict[str, Any]) -> str:
    head = " | ".join(f"{m} p50 (p10-p90)" for m in MODES)
    lines = [f"One paced {res['size']} B handoff, leg by leg (µs; medians of {res['rounds']} rounds of "
             f"{res['n']} handoffs)", "", f"| leg | {head} |", "|---|" + "---:|" * len(MODES)]

    def cell(f: dict[str, float]) -> str:
        return f"{f['p50']:.1f} ({f['p10']:.0f}-{f['p90']:.0f})"

    for leg, _, _ in LEGS:
        lines.append(f"| {leg} | " + " | ".join(cell(res["modes"][m]["legs"][leg]) for m in MODES) + " |")
    lines.append("| **one-way total** | " + " | ".join(cell(res["modes"][m]["total"]) for m in MODES) + " |")
    for name, _, _ in ASIDES:
        lines.append(f"| *{name}* | " + " | ".join(cell(res["modes"][m]["asides"][name]) for m in MODES) + " |")
    lines += ["", f"The forwarding-only relay's whole one-way p50, same rounds: {res['relay_p50_us']:.1f} µs."]
    return "\n".join(lines) + "\n"
