"""Raw NIXL WRITE throughput between two processes: the floor under the NIXL bridge rows.

One buffer on each side, registered once; the sender times each WRITE from post to the DONE it
observes. Runs only where NIXL loads (``nixl-cu12``). Moved here from hurray_ipc/broker/rdma.py, which holds
the engine the bridges use and nothing that only measures it.

    python -m hurray_ipc.bench.nixl [SIZE [ROUNDS]]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["BENCH_MEMORY", "bench"]


def _rdma() -> Any:
    from ..broker import rdma
    return rdma


BENCH_MEMORY = ("private", "shared")


def _bench_memory(memory: str, size: int) -> tuple[np.ndarray, Callable[[], None]]:
    """``size`` bytes of ``memory`` for the raw bench, every page faulted in (written), and what
    frees it: "private", anonymous process memory (numpy; transparent huge pages where the
    kernel gives them), or "shared", a POSIX shared-memory segment, what a bridge's buffers are."""
    if memory == "private":
        return np.zeros(size, np.uint8), lambda: None
    from hurray_ipc.devices import CpuDevice

    buf = CpuDevice().allocate(size)
    arr = np.frombuffer(buf.host_view(), np.uint8)
    arr.fill(0)
    return arr, buf.close


def _bench_receiver(size: int, offers: Any, done: Any, progress_thread: bool, memory: str) -> None:
    """Spawned: register a destination, send its offer, stay until told to go (making progress every
    millisecond, as a receiving bridge does, where NIXL has no progress thread); report the checksum."""
    import queue

    with _rdma().RdmaEngine("bench-rx", progress_thread=progress_thread) as eng:
        dst, free = _bench_memory(memory, size)
        reg = eng.register_array(dst)
        offers.put(eng.expose(reg))
        deadline = time.monotonic() + 300
        while True:
            try:
                done.get(timeout=0.001)
                break
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError("the bench's sender never said it was done") from None
                if not progress_thread:
                    eng.progress()
        offers.put(int(dst[:: 4096].astype(np.uint64).sum()))
        eng.release(reg)
        del dst
        free()


def bench(size: int = 64 << 20, rounds: int = 7, timeout: float = 60.0, *,
          progress_thread: bool = False, memory: str = "private") -> dict[str, Any]:
    """Raw NIXL WRITE throughput from this process into a spawned one: ``rounds`` writes of ``size``
    bytes, each timed from post to DONE observed by the sender. Returns the median and every round
    in MB/s (10^6 bytes per second), and whether the last write arrived intact (sampled checksum).
    ``progress_thread``: NIXL's (see hurray_ipc/broker/rdma.py's ``RdmaEngine``); off by default, as in the bridges.
    ``memory``: of the source and the destination, one of BENCH_MEMORY (see _bench_memory)."""
    if memory not in BENCH_MEMORY:
        raise ValueError(f"memory must be one of {BENCH_MEMORY}, got {memory!r}")
    rdma = _rdma()
    reason = rdma.nixl_available()
    if reason is not None:
        raise rdma.RdmaError(reason)
    ctx = mp.get_context("spawn")
    offers, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_bench_receiver, args=(size, offers, done, progress_thread, memory), daemon=True)
    p.start()
    src, free = _bench_memory(memory, size)
    try:
        offer = offers.get(timeout=timeout)
        src[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        rates = []
        with rdma.RdmaEngine("bench-tx", progress_thread=progress_thread) as eng:
            reg = eng.register_array(src)
            for _ in range(rounds + 1):  # the first round connects and warms up: not counted
                t0 = time.perf_counter()
                with eng.write(reg, offer) as t:
                    t.wait(timeout)
                rates.append(size / (time.perf_counter() - t0) / 1e6)
            eng.release(reg)
        done.put(None)
        intact = offers.get(timeout=timeout) == int(src[:: 4096].astype(np.uint64).sum())
    finally:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
        del src
        free()
    measured = rates[1:]
    return {"size": size, "rounds": rounds, "mb_s_median": statistics.median(measured),
            "mb_s": measured, "intact": intact, "warmup_mb_s": rates[0],
            "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"), "progress_thread": progress_thread,
            "memory": memory}


if __name__ == "__main__":
    import json

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
    r = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    print(json.dumps(bench(n, r), indent=1))
