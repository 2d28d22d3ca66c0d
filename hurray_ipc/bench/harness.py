"""What every benchmark row shares: the pacing, the window, percentiles, and a spawned pair.

Latency rows idle :data:`PACE` between round trips, so each measures a wake from idle (the case a
pipeline stage sees) rather than a hot loop; throughput rows keep :func:`window` handoffs in
flight (:data:`WINDOW`, or ``HURRAY_BENCH_WINDOW``, which ``hurray-bench --window`` sets for its
own process and so for every process it spawns). :func:`run_pair` runs two row functions in their
own spawned processes and returns both results.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument
from ..workload import spawn

__all__ = ["MAX_WINDOW", "PACE", "WINDOW", "WINDOW_ENV", "broker_process", "latency", "pct", "proc_cpu_s",
           "proc_rss_kib", "run_pair", "warm_up", "window"]

WINDOW = 8  # the default window: the issues' throughput targets are at 8
MAX_WINDOW = 64  # each Hurray producer row allocates a window of buffers of the row's size
WINDOW_ENV = "HURRAY_BENCH_WINDOW"
PACE = 0.0005  # seconds idle between round trips; comparing a paced row with a hot one is unfair


def window() -> int:
    """Handoffs a throughput row keeps in flight (and its clients' prefetch): ``HURRAY_BENCH_WINDOW``
    when set, else :data:`WINDOW`. Read when a row starts, in whichever process runs it, so a
    spawned row sees what its parent was given. Raises InvalidArgument for a value that is not an
    integer in 1-:data:`MAX_WINDOW`."""
    raw = os.environ.get(WINDOW_ENV)
    if raw is None:
        return WINDOW
    try:
        w = int(raw)
    except ValueError:
        w = 0
    if not 1 <= w <= MAX_WINDOW:
        raise InvalidArgument(f"the window is an integer in 1-{MAX_WINDOW}", where=WINDOW_ENV, value=raw)
    return w


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile of ``xs`` (nearest rank); NaN when empty."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else float("nan")


def warm_up(w: int) -> int:
    """Handoffs a Hurray row sends before it measures, at window ``w`` (producer and consumer
    count the same): at least one per buffer of the window, so that every buffer or pool slot the
    measured phases use exists and is mapped by the consumer before they start."""
    return max(10, w)


def latency(xs: list[float]) -> dict[str, float]:
    """A latency row's figures from one-way seconds: p50 and p99 in microseconds, and the count."""
    return {"p50_us": round(pct(xs, 50) * 1e6, 1), "p99_us": round(pct(xs, 99) * 1e6, 1), "n": len(xs)}


def run_pair(a: tuple[Callable[..., Any], dict[str, Any]], b: tuple[Callable[..., Any], dict[str, Any]],
             timeout: float = 300) -> tuple[Any, Any]:
    """Run ``a`` and ``b`` (function, keyword arguments) each in a spawned process; their results.
    A result carrying ``error`` is raised as RuntimeError with the child's traceback."""
    pa, qa = spawn(a[0], **a[1])
    pb, qb = spawn(b[0], **b[1])
    ra, rb = qa.get(timeout=timeout), qb.get(timeout=timeout)
    pa.join(10), pb.join(10)
    for r in (ra, rb):
        if isinstance(r, dict) and "error" in r:
            raise RuntimeError(r["error"] + "\n" + r.get("trace", ""))
    return ra, rb


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far, from /proc (any process of ours)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_kib(pid: int) -> int:
    """Resident memory (VmRSS, KiB) of process ``pid`` now, from /proc/<pid>/status."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


@contextmanager
def broker_process(tmp: Path, profile: Path | None = None,
                   start_timeout: float = 30) -> Iterator[subprocess.Popen[bytes]]:
    """A broker in its own process listening on ``ipc://<tmp>/broker.sock`` until the block ends
    (then terminated and reaped). ``profile``: cProfile output of it in ``<profile>/broker.pstats``.
    Raises RuntimeError when it exits or is not listening within ``start_timeout`` seconds."""
    ep = f"ipc://{tmp}/broker.sock"
    cmd = [sys.executable, "-m", "hurray_ipc.broker", "--endpoint", ep, "--log-level", "error"]
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        cmd[1:1] = ["-m", "cProfile", "-o", str(profile / "broker.pstats")]
    broker = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + start_timeout
        while not (tmp / "broker.sock").exists():
            if broker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("broker did not start")
            time.sleep(0.02)  # polling for a file another process creates: no event to wait on
        yield broker
    finally:
        broker.terminate()
        broker.wait(10)
