"""What every benchmark row shares: the pacing, the window, percentiles, and a spawned pair.

Latency rows idle :data:`PACE` between round trips, so each measures a wake from idle (the case a
pipeline stage sees) rather than a hot loop; throughput rows keep :data:`WINDOW` handoffs in
flight. :func:`run_pair` runs two row functions in their own spawned processes and returns both
results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..workload import spawn

__all__ = ["PACE", "WINDOW", "latency", "pct", "run_pair"]

WINDOW = 8
PACE = 0.0005  # seconds idle between round trips; comparing a paced row with a hot one is unfair


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile of ``xs`` (nearest rank); NaN when empty."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else float("nan")


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
