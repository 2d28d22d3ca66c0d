"""The scaling table of ``hurray-bench --scaling``: N producers x N consumers on one channel and
spread over several channels, against one broker, 4 KiB CPU buffers, each producer keeping
:data:`~.harness.WINDOW` handoffs in flight (``send(block=False)``).

Per configuration: the aggregate handoffs/s (all handoffs over the span from the first producer's
start to the last producer's flush), the broker's CPU per handoff and its share of one core over
that span (``/proc/<pid>/stat``), and the broker's VmRSS when the last producer has flushed.

Spreading: ``N`` producers and ``N`` consumers go over ``min(channels, N)`` channels, producer and
consumer ``i`` on channel ``i mod k``; so 1x1 is always one channel, 4x4 "on 16 channels" is four
channels of 1x1, 16x16 on 16 channels is sixteen of 1x1. A row names the channels it really used.

Every process is spawned; all of them wait on one barrier (bounded), so every producer and consumer
has joined before anything is sent; producers warm up (one window each, flushed) and wait on a
second barrier with the parent, then send, flush and close. Consumers receive until EndOfStream
(every producer of their channel closed and everything it sent was received), so the consumers'
counts must add up to exactly what was sent; the parent checks that.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument
from ..workload import SPAWN, spawn
from .harness import WINDOW, broker_process, proc_cpu_s, proc_rss_kib

__all__ = ["SIZE", "configurations", "ideal_ratio", "run_scaling", "scaling_markdown", "scaling_targets"]

SIZE = 4096
START_TIMEOUT = 120.0  # spawning 33 processes on 2 busy cores takes a while
TIMEOUT = 120.0  # any one wait of a process for handoffs or releases


def configurations(counts: list[int], channels: int) -> list[tuple[int, int]]:
    """(N, channels used) per configuration: each N on one channel, then on ``min(channels, N)``
    channels when that is more than one."""
    out: list[tuple[int, int]] = []
    for n in counts:
        out.append((n, 1))
        if min(channels, n) > 1:
            out.append((n, min(channels, n)))
    return out


def _producer(endpoint: str, channel: str, n: int, warmup: int, ready: Any, go: Any) -> dict[str, Any]:
    from ..client import Producer
    from .suite import _back_to

    with Producer(endpoint, channel, "cpu", prefetch=WINDOW) as p:
        bufs = [p.allocate(SIZE) for _ in range(WINDOW)]
        ready.wait(START_TIMEOUT)
        for i in range(warmup):  # opens the consumers' import caches
            p.send(bufs[i % WINDOW], block=False)
        p.flush(TIMEOUT)
        go.wait(START_TIMEOUT)
        cpu0, t0 = time.process_time(), time.monotonic()
        free = list(bufs)
        for _ in range(n):
            while not free:
                p.wait_released(TIMEOUT)
            b = free.pop()
            p.send(b, block=False, on_release=_back_to(free, b))
        p.flush(TIMEOUT)
        t1, cpu = time.monotonic(), time.process_time() - cpu0
        for b in bufs:
            b.close()
    return {"sent": n + warmup, "t0": t0, "t1": t1, "cpu_s": cpu}


def _consumer(endpoint: str, channel: str, ready: Any) -> dict[str, Any]:
    from ..client import Consumer
    from ..errors import EndOfStream

    got = 0
    with Consumer(endpoint, channel, "cpu", prefetch=WINDOW) as c:
        ready.wait(START_TIMEOUT)
        while True:
            try:
                h = c.receive(timeout=TIMEOUT)
            except EndOfStream:  # every producer of the channel closed and all it sent was received
                break
            h.wait()
            h.release()
            got += 1
        c.flush_releases(TIMEOUT)
    return {"received": got}


def _result(q: Any) -> dict[str, Any]:
    r: dict[str, Any] = q.get(timeout=TIMEOUT + START_TIMEOUT)
    if "error" in r:
        raise RuntimeError(r["error"] + "\n" + r.get("trace", ""))
    return r


def bench_scaling(endpoint: str, broker_pid: int, n: int, channels: int, handoffs: int, tag: str) -> dict[str, Any]:
    """One configuration: ``n`` producers x ``n`` consumers over ``channels`` channels, ``handoffs``
    in all (split evenly over the producers, at least one each), measured as the module says.
    Raises RuntimeError (with the child's traceback) when a process fails, and when the consumers'
    count differs from what the producers sent."""
    per = max(1, handoffs // n)
    warmup = WINDOW
    ready, go = SPAWN.Barrier(2 * n + 1), SPAWN.Barrier(n + 1)
    chans = [f"scale-{tag}-{n}x{n}-{channels}ch-{k}" for k in range(channels)]
    procs = []
    try:
        cons = [spawn(_consumer, endpoint=endpoint, channel=chans[i % channels], ready=ready)
                for i in range(n)]
        prods = [spawn(_producer, endpoint=endpoint, channel=chans[i % channels], n=per, warmup=warmup,
                       ready=ready, go=go) for i in range(n)]
        procs = [p for p, _ in cons + prods]
        ready.wait(START_TIMEOUT)
        go.wait(START_TIMEOUT)
        cpu0 = proc_cpu_s(broker_pid)
        pr = [_result(q) for _, q in prods]
        broker_cpu = proc_cpu_s(broker_pid) - cpu0
        rss = proc_rss_kib(broker_pid)
        cr = [_result(q) for _, q in cons]
    finally:
        for b in (ready, go):
            b.abort()  # frees any process still waiting on a barrier after a failure
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
    sent, received = sum(r["sent"] for r in pr), sum(r["received"] for r in cr)
    if sent != received:
        raise RuntimeError(f"{n}x{n} on {channels} channels: {sent} handoffs sent, {received} received")
    total = per * n
    wall = max(r["t1"] for r in pr) - min(r["t0"] for r in pr)
    return {"name": f"{n}x{n}, {channels} channel{'s' if channels > 1 else ''}", "size": SIZE,
            "producers": n, "consumers": n, "channels": channels, "handoffs": total, "received": received,
            "per_s": round(total / wall), "broker_cpu_us": round(broker_cpu / total * 1e6, 1),
            "broker_share": round(broker_cpu / wall, 3), "broker_rss_kib": rss,
            "producer_cpu_us": round(statistics.mean(r["cpu_s"] for r in pr) / per * 1e6, 1)}


def ideal_ratio(rate: float, rate_1x1: float, broker_share_1x1: float) -> float:
    """``rate`` over the ideal one-core broker rate: 1x1's rate divided by the broker's share of one
    core in 1x1 (= one second over 1x1's broker CPU per handoff), i.e. what 1x1 would reach if
    the broker had a core to itself. The issue's target is >= 0.8."""
    if not rate_1x1 > 0:
        raise InvalidArgument("the 1x1 rate must be positive", where="ideal_ratio(rate_1x1=)", value=rate_1x1)
    if not broker_share_1x1 > 0:
        raise InvalidArgument("the broker's share must be positive", where="ideal_ratio(broker_share_1x1=)",
                              value=broker_share_1x1)
    return rate / (rate_1x1 / broker_share_1x1)


def scaling_targets(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's scaling target for the largest N measured on one channel, per round against that
    round's 1x1 (:func:`ideal_ratio`), median over the rounds; reported, never asserted."""
    ok = [r for r in raw if "skipped" not in r]
    by = {(r["producers"], r["channels"], r["round"]): r for r in ok}
    ns = sorted({r["producers"] for r in ok if r["channels"] == 1 and r["producers"] > 1})
    if not ns:
        return []
    n = ns[-1]
    vals = [ideal_ratio(r["per_s"], by[(1, 1, rnd)]["per_s"], by[(1, 1, rnd)]["broker_share"])
            for (p, ch, rnd), r in by.items() if p == n and ch == 1 and (1, 1, rnd) in by
            and by[(1, 1, rnd)]["broker_share"] > 0]
    if not vals:
        return []
    v = round(statistics.median(vals), 2)
    return [{"target": f"{n}x{n} on one channel >= 0.8x the 1x1 rate / the broker's share of one core in 1x1",
             "value": v, "met": v >= 0.8, "issue": 24}]


def run_scaling(counts: list[int], channels: int = 16, handoffs: int = 3000, rounds: int = 3, seed: int = 0,
                progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every configuration of :func:`configurations`, ``rounds`` times in a new shuffled order each,
    against one broker; rows are medians over the rounds (``aggregate``), a failed configuration
    becomes a row with ``skipped``."""
    from .suite import aggregate

    if not counts or any(c < 1 for c in counts):
        raise InvalidArgument("needs one or more counts, each >= 1", where="run_scaling(counts=)", value=counts)
    for name, v in (("channels", channels), ("handoffs", handoffs), ("rounds", rounds)):
        if v < 1:
            raise InvalidArgument("must be >= 1", where=f"run_scaling({name}=)", value=v)
    tmp = Path(tempfile.mkdtemp(prefix="hurray-scaling-"))
    rng = random.Random(seed)
    raw: list[dict[str, Any]] = []
    with broker_process(tmp) as broker:
        ep = f"ipc://{tmp}/broker.sock"
        for rnd in range(rounds):
            confs = configurations(counts, channels)
            rng.shuffle(confs)
            for n, ch in confs:
                progress(f"round {rnd + 1}/{rounds}: scaling {n}x{n} on {ch} channel(s)")
                try:
                    row = bench_scaling(ep, broker.pid, n, ch, handoffs, f"r{rnd}")
                except Exception as e:  # noqa: BLE001 - one failed configuration is a row, not the end
                    row = {"name": f"{n}x{n}, {ch} channel{'s' if ch > 1 else ''}", "size": SIZE, "producers": n,
                           "consumers": n, "channels": ch, "skipped": f"failed: {str(e).splitlines()[0]}"}
                row["round"] = rnd
                raw.append(row)
    rows = sorted(aggregate(raw), key=lambda r: (r["producers"], r["channels"]))
    return {"rows": rows, "raw": raw, "targets": scaling_targets(raw), "rounds": rounds, "handoffs": handoffs,
            "window": WINDOW, "size": SIZE}


def scaling_markdown(sc: dict[str, Any], cores: int | None) -> list[str]:
    """The "Scaling" table's markdown lines (with its notes and target)."""
    lines = ["", "### Scaling", "",
             f"{SIZE // 1024} KiB CPU buffers, window {sc['window']} per producer, about {sc['handoffs']} handoffs "
             f"per configuration, medians of {sc['rounds']} shuffled rounds. Broker share = broker CPU seconds / "
             f"wall seconds of the run (1.0 = one full core). {cores} cores on this machine: with N x N clients, "
             f"2N client processes compete with the broker for them, so the broker's share (and the rate) is "
             f"bounded by the cores left to it, not only by its own cost.", "",
             "| configuration | channels | handoffs/s | broker CPU µs per handoff | broker share of one core | "
             "broker RSS MiB | producer CPU µs per handoff | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in sc["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['name']} | {r['channels']} | | | | | | skipped: {r['skipped']} |")
        else:
            lines.append(f"| {r['producers']} x {r['consumers']} | {r['channels']} | {r['per_s']} | "
                         f"{r['broker_cpu_us']} | {r['broker_share']} | {r['broker_rss_kib'] / 1024:.1f} | "
                         f"{r['producer_cpu_us']} | {r['received']} received (warm-up included) |")
    if sc.get("targets"):
        lines += ["", "| target | issue | measured | met |", "|---|---:|---:|---|"]
        lines += [f"| {t['target']} | {t.get('issue', '')} | {t['value']} | {'yes' if t['met'] else 'no'} |"
                  for t in sc["targets"]]
    return lines
