"""A healthy pair's rate beside one flood on a live broker (hurray_ipc/broker/DESIGN.md, Known limits).

Usage: .venv/bin/python scripts/floods.py [KIND ...] [--seconds S] [--hold S] [--pool N]  (KIND: below)

Starts a broker, a producer and a consumer of the public API (one process each, a 4 KiB host array
per send) and, after a few seconds, one attacker process speaking raw frames:

- releases: a registered consumer sending RELEASE batches of 64 tokens the broker never issued,
  as fast as it can, never reading;
- unregistered: the same batches from a connection that never sent HELLO;
- hello: one connection sending 0.88 MB HELLOs (8192 `held` entries) that are refused;
- queries: 200 unregistered connections sending STATS and CAPS, never reading;
- hold: a consumer on the pair's channel asking for 4096 credits, reading every DELIVER and
  releasing none, pinging so that it is never judged silent;
- deaf: a consumer on the pair's channel with 64 credits that never reads its socket;
- deaf-pings: the same consumer sending PINGs as fast as it can, so that the PONGs it never
  reads fill its queue at the broker (66,560 messages) and sends to it fail as full; only then
  does it ask for its 64 credits (REQUEST);
- newcomers: 500 connections, each sending 4 KiB HELLOs (refused for a bad lease) as fast as it
  can, never reading: they spend the byte budget peers not registered share, and each also gets
  the two small messages a second a routing id may send past it (spec §6a);
- spin: the control: an attacker process that only burns CPU and never connects, so what the
  pair loses to it is what any busy process on this machine costs it, not the broker's work.

``--hold S`` gives the broker a hold bound (``hurray-broker --hold``, spec §5): a delivery held
longer is fenced. ``--pool N``: the pair's producer sends from N buffers of its own (``allocate()``),
each again once it came back, instead of a new array per send: a fixed pool, which a consumer
that holds everything stalls.

Two seconds into a flood that lasts longer a second pair (channel "late") starts: the time from
its clients' construction (the later of the two, after their imports) to its first handoff says
whether a client can register while the flood goes on ("none": not before it ended). It stops
there, so that it takes from the first pair's rate as little as it can (its processes' start still
takes some CPU in the flood's third second).

It prints the pair's handoffs, those of its producer's that ended other than released (e.g.
"undelivered: full") and the broker's RSS each second before, during and after the flood, then one
line per attack with the medians. Loopback only; it stops by itself. Not a test: what it
measures is load on this machine, which the attacker's own CPU use is part of.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the raw-frame client written from the spec, and the broker runner

KINDS = ("releases", "unregistered", "hello", "newcomers", "queries", "hold", "deaf", "deaf-pings", "spin")


def _producer(ep: str, lost: mp.sharedctypes.Synchronized, stop: mp.synchronize.Event, pool: int,
              channel: str = "good", times: Any = None) -> None:
    import numpy as np

    from hurray_ipc import HurrayError, Producer

    def released(ticket: object) -> None:
        if getattr(ticket, "outcome", None) != "released":  # e.g. "undelivered: full": never read
            with lost.get_lock():
                lost.value += 1

    a = np.zeros(1024, np.float32)
    if times is not None:
        times[1] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of this machine
    with Producer(channel=channel, endpoint=ep) as p:
        bufs = [p.allocate(a.nbytes) for _ in range(pool)]
        while not stop.is_set():
            free = [b for b in bufs if not p.holds(b)]
            if bufs and not free:
                try:
                    p.wait_released(timeout=0.5)
                except HurrayError:
                    pass  # every buffer held: wait on
                continue
            try:
                p.send(free[0] if bufs else a, timeout=1, on_release=released)
            except HurrayError:
                pass  # the flood may delay a grant past the timeout: try again


def _consumer(ep: str, count: mp.sharedctypes.Synchronized, stop: mp.synchronize.Event,
              channel: str = "good", times: Any = None) -> None:
    from hurray_ipc import Consumer, HurrayError
    if times is not None:
        times[0] = time.monotonic()
    with Consumer(channel=channel, endpoint=ep) as c:
        while not stop.is_set():
            try:
                h = c.receive(timeout=0.5)
            except HurrayError:
                continue
            if h is None:
                break
            h.release()
            if times is not None and not times[2]:
                times[2] = time.monotonic()
            with count.get_lock():
                count.value += 1


def _attack(kind: str, ep: str, stop: mp.synchronize.Event) -> None:
    if kind == "spin":
        while not stop.is_set():
            sum(range(10_000))
        return
    import zmq

    from test_protocol_raw import BATCH, RELEASE, Raw, endpoint_dict
    ctx = zmq.Context()
    if kind in ("releases", "unregistered"):
        r = Raw(ctx, ep, "flood")
        if kind == "releases":
            r.hello("consumer", "flood", endpoint_dict(os.getpid()))
        r.s.setsockopt(zmq.SNDHWM, 0)
        body = BATCH.pack(64, 0, 0) + b"".join(RELEASE.pack(os.urandom(24), 1, 0) for _ in range(64))
        while not stop.is_set():
            try:
                r.s.send_multipart([b"RELEASE", body], zmq.NOBLOCK)
            except zmq.Again:
                stop.wait(0.001)
    elif kind == "hello":
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ep)
        held = [{"token": "f0" * 24, "producer_id": "p" * 16, "handoff_id": i, "event_pending": False}
                for i in range(8192)]
        hello = json.dumps({"protocol": 2, "role": "consumer", "channel": "x", "pid": os.getpid(),
                            "endpoint": endpoint_dict(os.getpid()), "held": held, "lease": "not a lease"}).encode()
        while not stop.is_set():
            try:
                s.send_multipart([b"HELLO", hello], zmq.NOBLOCK)
            except zmq.Again:
                stop.wait(0.001)
    elif kind == "newcomers":
        socks = []
        for _ in range(500):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            socks.append(s)
        hello = {"protocol": 2, "role": "consumer", "channel": "x", "pid": os.getpid(),
                 "endpoint": endpoint_dict(os.getpid()), "lease": "not a lease", "pad": ""}
        hello["pad"] = "x" * (4096 - len(b"HELLO") - len(json.dumps(hello)))
        small = [b"HELLO", json.dumps(hello).encode()]
        assert sum(map(len, small)) == 4096
        while not stop.is_set():
            for s in socks:
                try:
                    s.send_multipart(small, zmq.NOBLOCK)
                except zmq.Again:
                    pass
    elif kind == "queries":
        socks = []
        for _ in range(200):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(ep)
            socks.append(s)
        caps = json.dumps({"device": endpoint_dict(os.getpid()), "request_id": 1}).encode()
        while not stop.is_set():
            for i, s in enumerate(socks):
                try:
                    s.send_multipart([b"STATS", b"{}"] if i % 2 else [b"CAPS", caps], zmq.NOBLOCK)
                except zmq.Again:
                    pass
    else:
        r = Raw(ctx, ep, kind)
        r.send("HELLO", {"protocol": 2, "role": "consumer", "channel": "good", "client_id": "x", "pid": os.getpid(),
                         "endpoint": endpoint_dict(os.getpid()),
                         "credits": {"hold": 4096, "deaf": 64}.get(kind, 0)})
        if kind.startswith("deaf"):
            r.s.setsockopt(zmq.RCVHWM, 1)
        pings = 0
        while not stop.is_set():
            r.send("PING", {})
            if kind == "deaf-pings":
                pings += 1
                if pings == 150_000:  # over twice the broker's queue for it, whatever it sent on
                    r.send("REQUEST", {"credits": 64})
                continue
            if kind == "hold":
                while r.s.poll(10):
                    r.s.recv_multipart()
            else:
                stop.wait(0.1)
    ctx.destroy(linger=0)


def run(kind: str, seconds: int, hold: float | None = None, pool: int = 0) -> dict[str, float]:
    from brokerproc import BrokerProcess
    b = BrokerProcess(f"ipc://{tempfile.mkdtemp(prefix='hurray-floods-')}/b.sock", timeout=1.0,
                      extra_args=[] if hold is None else ["--hold", str(hold)]).start()
    assert b.proc is not None
    stop, attack_stop = mp.Event(), mp.Event()
    count, lost = mp.Value("q", 0), mp.Value("q", 0)
    pair = [mp.Process(target=_producer, args=(b.endpoint, lost, stop, pool)),
            mp.Process(target=_consumer, args=(b.endpoint, count, stop))]
    for p in pair:
        p.start()
    rates: dict[str, list[int]] = {"before": [], "during": [], "after": []}
    losses: dict[str, int] = {}
    rss = 0

    def window(phase: str, n: int) -> None:
        nonlocal rss
        for _ in range(n):
            c0, l0 = count.value, lost.value
            time.sleep(1)  # a rate is counted over wall time: this is the measurement's clock
            rates[phase].append(count.value - c0)
            losses[phase] = losses.get(phase, 0) + lost.value - l0
            now_mb = b.rss_kib // 1024
            rss = max(rss, now_mb)
            print(f"{kind:8s} {phase:6s} {rates[phase][-1]:6d} handoffs/s  {lost.value - l0:5d} not released"
                  f"  broker RSS {now_mb} MB", flush=True)

    # The second pair stops at its first handoff (or with the flood), so that it costs the first
    # pair as little as it can. Its processes note when each began to construct its client (after
    # their imports) and when the first handoff was released: [consumer, producer, first].
    late_count, late_lost, late_stop = mp.Value("q", 0), mp.Value("q", 0), mp.Event()
    late_times = mp.Array("d", 3)
    late = [mp.Process(target=_producer, args=(b.endpoint, late_lost, late_stop, 0, "late", late_times)),
            mp.Process(target=_consumer, args=(b.endpoint, late_count, late_stop, "late", late_times))]
    first_late: float | None = None
    try:
        window("before", 4)
        a = mp.Process(target=_attack, args=(kind, b.endpoint, attack_stop))
        a.start()
        window("during", min(2, seconds))
        # A new pair starts while the flood goes on (when it lasts over 2 s): how long from its
        # clients' construction to its first handoff says whether newcomers can register during it.
        if seconds > 2:
            for p in late:
                p.start()

            def watch() -> None:
                while not late_times[2] and not attack_stop.is_set():
                    time.sleep(0.02)  # polled against wall time, as the rates are
                late_stop.set()

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
        window("during", seconds - min(2, seconds))
        flood_end = time.monotonic()
        attack_stop.set()
        if seconds > 2:
            watcher.join()  # it set late_stop
            for p in late:
                p.join(5)
            if 0 < late_times[2] <= flood_end:  # a first handoff after the flood does not count
                first_late = late_times[2] - max(late_times[0], late_times[1])
        a.join(5)
        if a.is_alive():
            a.kill()
        window("after", 5)
    finally:
        stop.set()
        for p in pair + [q for q in late if q.pid is not None]:
            p.join(5)
            if p.is_alive():
                p.kill()
        b.stop()
    return {"before": statistics.median(rates["before"][1:]), "during": statistics.median(rates["during"]),
            "after_first": rates["after"][0], "after": statistics.median(rates["after"]), "rss_max_mb": rss,
            "not_released": sum(losses.values()), "late_first_s": first_late}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kinds", nargs="*", choices=KINDS, default=list(KINDS), metavar="KIND",
                    help=f"attacks to run, one after another: {', '.join(KINDS)} (default: all)")
    ap.add_argument("--seconds", type=int, default=8, help="how long each flood lasts (default 8)")
    ap.add_argument("--hold", type=float, default=None, metavar="S",
                    help="the broker's hold bound in seconds (hurray-broker --hold; default: none)")
    ap.add_argument("--pool", type=int, default=0, metavar="N",
                    help="the pair's producer sends from N allocate()d buffers (default 0: a new array per send)")
    args = ap.parse_args()
    if args.seconds < 1:
        ap.error(f"--seconds takes a whole number of seconds >= 1 (got {args.seconds})")
    if args.hold is not None and not args.hold > 0:
        ap.error(f"--hold takes a positive number of seconds (got {args.hold})")
    if args.pool < 0:
        ap.error(f"--pool takes a number of buffers >= 0 (got {args.pool})")
    mp.set_start_method("spawn")
    results = {k: run(k, args.seconds, args.hold, args.pool) for k in args.kinds}
    print("\nattack     pair before  during  1st s after  after  broker RSS max  pair's handoffs not released"
          "  new pair's 1st handoff during it")
    for k, r in results.items():
        late = ("n/a (--seconds 2 or less)" if args.seconds <= 2 else "none" if r["late_first_s"] is None
                else f"after {r['late_first_s']:.2f} s")
        print(f"{k:10s} {r['before']:9.0f}/s {r['during']:6.0f}/s {r['after_first']:9.0f}/s {r['after']:5.0f}/s"
              f"  {r['rss_max_mb']:9d} MB  {r['not_released']:29d}  {late}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
