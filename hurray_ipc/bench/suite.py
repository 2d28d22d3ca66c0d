"""The benchmark suite behind ``hurray-bench``: Hurray and what users would pick instead, side by
side in one run, each in its own spawned processes.

Latency rows are one-way (the sender stamps CLOCK_MONOTONIC, shared by all processes on a Linux
host; the receiver subtracts when the data is usable) in ping-pong, so no queueing is measured.
Throughput rows keep :func:`~.harness.window` handoffs in flight (8 unless ``--window`` says
otherwise). Every row runs in several rounds, each round in a new shuffled order; a row reports the
median over the rounds of its p50 / p99 / rate / CPU, and ratios are taken between rows of the same
round (side by side), then their median.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ..workload import SPAWN, run_into_queue, spawn
from . import nixl
from .floor import bench_relay
from .harness import PACE, WINDOW, broker_process, latency, proc_cpu_s, run_pair, warm_up, window

# --- raw pyzmq echo: the floor for one broker hop --------------------------------------------------

def _echo_server(endpoint: str, count: int) -> dict[str, Any]:
    import zmq

    s = zmq.Context.instance().socket(zmq.ROUTER)
    s.bind(endpoint)
    for _ in range(count):
        s.send_multipart(s.recv_multipart())
    s.close(linger=1000)
    return {}


def _echo_client(endpoint: str, n: int, payload: int) -> dict[str, Any]:
    import zmq

    s = zmq.Context.instance().socket(zmq.DEALER)
    s.connect(endpoint)
    msg = [b"HANDOFF", b"x" * payload]
    for _ in range(20):  # warm-up
        s.send_multipart(msg)
        s.recv_multipart()
    rtt = []
    for _ in range(n):
        time.sleep(PACE)  # paced exactly like the handoff ping-pong: both wake from idle
        t = time.perf_counter()
        s.send_multipart(msg)
        s.recv_multipart()
        rtt.append(time.perf_counter() - t)
    t0 = time.perf_counter()
    sent = got = 0
    w = window()
    while got < n:
        while sent < n and sent - got < w:
            s.send_multipart(msg)
            sent += 1
        s.recv_multipart()
        got += 1
    rate = n / (time.perf_counter() - t0)
    s.close(linger=0)
    return {"latency": latency(rtt), "per_s": round(rate), "window": w}


def bench_zmq_echo(tmp: Path, n: int) -> dict[str, Any]:
    ep = f"ipc://{tmp}/echo.sock"
    srv, cli = run_pair((_echo_server, {"endpoint": ep, "count": 2 * n + 20}),
                     (_echo_client, {"endpoint": ep, "n": n, "payload": 200}))
    return {"name": "pyzmq ROUTER/DEALER echo (200 B)", "what": "round trip", **cli}


# --- Hurray ----------------------------------------------------------------------------------

def _back_to(free: list[Any], buf: Any) -> Callable[[object], None]:
    """An ``on_release`` callback that puts ``buf`` (bound now, not when it runs) back on ``free``."""
    return lambda _ticket: free.append(buf)


class Profiled:
    """cProfile around a bench process's work when HURRAY_BENCH_PROFILE names a folder (``--profile``):
    writes ``<folder>/<name>.pstats``."""

    def __init__(self, name: str):
        self.dir = os.environ.get("HURRAY_BENCH_PROFILE")
        self.name = name
        self.prof: Any = None

    def __enter__(self) -> Profiled:
        if self.dir:
            import cProfile

            self.prof = cProfile.Profile()
            self.prof.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.prof is not None:
            self.prof.disable()
            Path(self.dir).mkdir(parents=True, exist_ok=True)  # type: ignore[arg-type]
            self.prof.dump_stats(str(Path(self.dir) / f"{self.name}.pstats"))  # type: ignore[arg-type]


def _hurray_producer(endpoint: str, channel: str, device: str, size: int, n: int, env: dict[str, str],
                     mode: str | None, broker_pid: int | None = None, batch: bool = False) -> dict[str, Any]:
    os.environ.update(env)
    from ..client import Producer
    from ..format.handle import SyncMode

    pref = SyncMode.from_name(mode) if mode else None
    w = window()
    with Producer(endpoint, channel, device, prefetch=w) as p, Profiled(f"{channel}-producer"):
        bufs = [p.allocate(size) for _ in range(w)]
        for i in range(warm_up(w)):  # warm-up: every buffer once, so the consumer has mapped each
            p.send(bufs[i % w], pref)
            p.flush(30)
        stall = []
        for _ in range(n):
            t = time.monotonic()
            p.send(bufs[0], pref, meta={"t": t})
            stall.append(time.monotonic() - t)
            p.flush(30)
            time.sleep(PACE)  # idle between round trips, as in every latency row
        # The pipelined phase: rate, and what it cost in CPU and messages (the consumer and the
        # broker measure the same phase: from the first handoff without a timestamp to the last).
        ses = p.session
        msgs0 = ses.messages_sent + ses.messages_received
        broker0 = proc_cpu_s(broker_pid) if broker_pid else 0.0
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        free = list(bufs)
        back = free.append
        sent = 0
        while sent < n:
            while not free:
                p.wait_released(30)
            if batch:  # every free buffer in one call: as many per message as grants allow
                objs = free[:n - sent]
                del free[:len(objs)]
                p.send_many(objs, pref, on_release=lambda t: back(t.obj))
                sent += len(objs)
            else:
                b = free.pop()
                p.send(b, pref, block=False, on_release=_back_to(free, b))
                sent += 1
        p.flush(60)
        rate = n / (time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
        broker = proc_cpu_s(broker_pid) - broker0 if broker_pid else float("nan")
        msgs = ses.messages_sent + ses.messages_received - msgs0
        for b in bufs:
            b.close()
    return {"per_s": round(rate), "send_call": latency(stall), "cpu_us": round(cpu / n * 1e6, 1),
            "broker_cpu_us": round(broker / n * 1e6, 1), "messages": msgs, "window": w}


def _hurray_consumer(endpoint: str, channel: str, device: str, n: int, env: dict[str, str],
                     batch: bool = False) -> dict[str, Any]:
    """``batch``: the pipelined phase takes what was delivered with ``receive_many`` and gives it
    back with ``release_many``."""
    os.environ.update(env)
    from ..client import Consumer

    lat = []
    modes = set()
    mark: tuple[float, int, int] | None = None  # (cpu, messages, handoffs) when the pipelined phase began
    warm = warm_up(w := window())
    total = warm + 2 * n
    with Consumer(endpoint, channel, device, prefetch=w) as c, Profiled(f"{channel}-consumer"):
        ses = c.session
        i = 0
        while i < total:
            hs = c.receive_many(min(w, total - i), timeout=60) if batch and mark else [c.receive(timeout=60)]
            for h in hs:
                h.wait()
                t = (h.meta or {}).get("t")
                if t is not None:
                    lat.append(time.monotonic() - t)
                elif mark is None and i >= warm:
                    mark = (time.process_time(), ses.messages_sent + ses.messages_received - 1, i)
                modes.add(h.sync_mode.wire_name + (" staged" if h.staged else ""))
                i += 1
            c.release_many(hs)
        c.flush_releases(30)
        cpu, msgs = time.process_time(), ses.messages_sent + ses.messages_received
    count = total - mark[2] if mark else 1
    return {"latency": latency(lat), "modes": sorted(modes), "window": w,
            "cpu_us": round((cpu - mark[0]) / count * 1e6, 1) if mark else float("nan"),
            "messages": msgs - mark[1] if mark else 0}


def bench_hurray(endpoint: str, label: str, pdev: str, cdev: str, size: int, n: int, env: dict[str, str],
                 mode: str | None = None, broker_pid: int | None = None, batch: bool = False,
                 receive_batch: bool = False) -> dict[str, Any]:
    """``batch``: the pipelined phase sends with ``send_many`` (every free buffer at once);
    ``receive_batch``: the consumer takes it with ``receive_many`` and ``release_many``."""
    ch = f"bench-{label}-{size}".replace(" ", "-").replace(",", "")
    pr, cr = run_pair((_hurray_producer, {"endpoint": endpoint, "channel": ch, "device": pdev, "size": size, "n": n,
                                       "env": env, "mode": mode, "broker_pid": broker_pid, "batch": batch}),
                   (_hurray_consumer, {"endpoint": endpoint, "channel": ch, "device": cdev, "n": n, "env": env,
                                       "batch": receive_batch}))
    return {"name": f"hurray {label}", "what": "one-way handoff", "size": size, "latency": cr["latency"],
            "per_s": pr["per_s"], "modes": cr["modes"], "producer_send_call": pr["send_call"],
            "cpu_us": {"producer": pr["cpu_us"], "broker": pr["broker_cpu_us"], "consumer": cr["cpu_us"]},
            "messages_per_handoff": round((pr["messages"] + cr["messages"]) / n, 2),
            "window": _one_window(pr, cr)}


def _one_window(*results: dict[str, Any]) -> int:
    """The window a row's processes ran with; they read it each in its own process, so a row whose
    processes disagree is refused rather than reported."""
    seen = {r["window"] for r in results}
    if len(seen) != 1:
        raise RuntimeError(f"a row's processes ran with different windows: {sorted(seen)}")
    return seen.pop()


# --- Hurray with host arrays the library copies (issue 24): the pair of the torch rows -------

def _hurray_host_producer(endpoint: str, channel: str, size: int, n: int, fresh: bool,
                          broker_pid: int | None = None) -> dict[str, Any]:
    """Send numpy arrays (copied into a recycled shared-memory slot per send): ``fresh``, a new
    array made before each send (as a pipeline that produces a new tensor per step), else the
    same preallocated one. Same phases and outputs as :func:`_hurray_producer`."""
    from ..client import Producer

    keep = np.ones(size, np.uint8)

    def make(i: int) -> np.ndarray:
        return np.full(size, i & 0xFF, np.uint8) if fresh else keep

    w = window()
    with Producer(endpoint, channel, "cpu", prefetch=w) as p, Profiled(f"{channel}-producer"):
        # Warm-up, pipelined as the measured phase is: the pool grows to the window's slots and
        # the consumer maps each (measured, a 4 MiB row grew them inside its first 100 handoffs:
        # 72 page faults and about 200 µs of producer CPU per handoff more)
        for i in range(warm_up(w)):
            while p.outstanding >= w:
                p.wait_released(30)
            p.send(make(i), block=False)
        p.flush(30)
        stall = []
        for i in range(n):
            x = make(i)
            t = time.monotonic()
            p.send(x, meta={"t": t})
            stall.append(time.monotonic() - t)
            del x
            p.flush(30)
            time.sleep(PACE)
        ses = p.session
        msgs0 = ses.messages_sent + ses.messages_received
        broker0 = proc_cpu_s(broker_pid) if broker_pid else 0.0
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        for i in range(n):
            while p.outstanding >= w:
                p.wait_released(30)
            p.send(make(i), block=False)
        p.flush(60)
        rate = n / (time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
        broker = proc_cpu_s(broker_pid) - broker0 if broker_pid else float("nan")
        msgs = ses.messages_sent + ses.messages_received - msgs0
        segments = p.staging._slots.made
    return {"per_s": round(rate), "send_call": latency(stall), "cpu_us": round(cpu / n * 1e6, 1),
            "broker_cpu_us": round(broker / n * 1e6, 1), "messages": msgs, "segments": segments, "window": w}


def bench_host(endpoint: str, size: int, n: int, fresh: bool, broker_pid: int | None = None) -> dict[str, Any]:
    """Hurray sending host arrays through the public API (one memcpy into a pooled slot each);
    ``segments``: shared-memory segments the producer created in all (the pool's slots)."""
    label = "new array per send" if fresh else "reused array"
    ch = f"bench-host-{'new' if fresh else 'reused'}-{size}"
    pr, cr = run_pair((_hurray_host_producer, {"endpoint": endpoint, "channel": ch, "size": size, "n": n,
                                               "fresh": fresh, "broker_pid": broker_pid}),
                      (_hurray_consumer, {"endpoint": endpoint, "channel": ch, "device": "cpu", "n": n, "env": {}}))
    return {"name": f"hurray cpu, {label}", "what": "one-way handoff (numpy array, copied to a pooled slot)",
            "size": size, "latency": cr["latency"], "per_s": pr["per_s"], "modes": cr["modes"],
            "producer_send_call": pr["send_call"],
            "cpu_us": {"producer": pr["cpu_us"], "broker": pr["broker_cpu_us"], "consumer": cr["cpu_us"]},
            "messages_per_handoff": round((pr["messages"] + cr["messages"]) / n, 2), "segments": pr["segments"],
            "window": _one_window(pr, cr)}


def host_rows(endpoint: str, size: int, n: int, broker_pid: int | None) -> list[tuple[str, Callable[[], Any]]]:
    """Issue 24's pairs, shuffled with every other row: Hurray and torch.multiprocessing, each with a
    new host tensor per send and with one reused."""
    return [(f"host new {size}", partial(bench_host, endpoint, size, n, True, broker_pid)),
            (f"host reused {size}", partial(bench_host, endpoint, size, n, False, broker_pid)),
            (f"torch new {size}", partial(bench_torch, size, n, "cpu", True))]


def host_targets(raw: list[dict[str, Any]], add: Callable[[str, float | None, Callable[[float], bool]], None],
                 p50: Callable[[dict[str, Any]], float]) -> None:
    """Issue 24: host arrays sent through Hurray at <= 0.7x torch.multiprocessing's p50, with a new
    tensor per send and with a reused one (rows of the same round)."""
    new = "hurray cpu, new array per send"
    for size in sorted({r["size"] for r in raw if r["name"] == new and "skipped" not in r}):
        add(f"new host array per send p50 <= 0.7x torch.multiprocessing ({size} B)",
            _side_by_side(raw, new, size,
                          "torch.multiprocessing Queue (cpu tensor, new per send)", p50), lambda v: v <= 0.7)
        add(f"reused host array p50 <= 0.7x torch.multiprocessing ({size} B)",
            _side_by_side(raw, "hurray cpu, reused array", size, "torch.multiprocessing Queue (cpu tensor)", p50),
            lambda v: v <= 0.7)


# --- multiprocessing.Queue with numpy arrays -------------------------------------------------

def _queue_producer(q: Any, ack: Any, item: Any, n: int,
                    make: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Ping-pong ``n`` (paced) for the consumer's latency, then ``n`` with a window for the rate.
    ``make(i)``: a new item per put instead of ``item``, made before the timestamp is taken."""
    for i in range(5 + n):
        time.sleep(PACE)
        x = make(i) if make is not None else item
        q.put((time.monotonic() if i >= 5 else None, x))
        del x
        ack.get()
    t0 = time.perf_counter()
    inflight = 0
    w = window()
    for i in range(n):
        if inflight >= w:
            ack.get()
            inflight -= 1
        q.put((None, make(i) if make is not None else item))
        inflight += 1
    for _ in range(inflight):
        ack.get()
    return {"per_s": round(n / (time.perf_counter() - t0)), "window": w}


def _queue_consumer(q: Any, ack: Any, n: int) -> dict[str, Any]:
    lat = []
    for _ in range(5 + 2 * n):
        t, x = q.get()
        _ = x[0]  # touch the data
        if t is not None:
            lat.append(time.monotonic() - t)
        del x  # a shared tensor's producer-side reference may go
        ack.put(1)
    return {"latency": latency(lat)}


def _mpq_producer(q: Any, ack: Any, size: int, n: int) -> dict[str, Any]:
    return _queue_producer(q, ack, np.ones(size, np.uint8), n)


def bench_mp_queue(size: int, n: int) -> dict[str, Any]:
    q, ack = SPAWN.Queue(), SPAWN.Queue()
    pr, cr = run_pair((_mpq_producer, {"q": q, "ack": ack, "size": size, "n": n}),
                   (_queue_consumer, {"q": q, "ack": ack, "n": n}))
    return {"name": "multiprocessing.Queue + numpy", "what": "one-way (pickled copy)", "size": size,
            "latency": cr["latency"], "per_s": pr["per_s"], "window": pr["window"]}


# --- multiprocessing.shared_memory, names through a queue (hand-made zero copy) --------------

def _shm_producer(q: Any, ack: Any, size: int, n: int) -> dict[str, Any]:
    from multiprocessing import shared_memory

    w = window()
    segs = [shared_memory.SharedMemory(create=True, size=size) for _ in range(w)]
    free = [s.name for s in segs]
    try:
        for i in range(5 + n):
            name = free[0]
            time.sleep(PACE)
            q.put((time.monotonic() if i >= 5 else None, name))
            ack.get()
        t0 = time.perf_counter()
        for _ in range(n):
            if not free:
                free.append(ack.get())
            q.put((None, free.pop()))
        while len(free) < w:
            free.append(ack.get())
        rate = n / (time.perf_counter() - t0)
    finally:
        for s in segs:
            s.close()
            s.unlink()
    return {"per_s": round(rate), "window": w}


def _shm_consumer(q: Any, ack: Any, n: int) -> dict[str, Any]:
    from multiprocessing import shared_memory

    cache: dict[str, Any] = {}
    lat = []
    for _ in range(5 + 2 * n):
        t, name = q.get()
        seg = cache.get(name)
        if seg is None:
            # track=False (3.13+) would stop the resource tracker unlinking what we only attach
            # (CPython #82300); on older Pythons the producer outlives us, which is enough here.
            seg = cache[name] = shared_memory.SharedMemory(name=name)
        _ = seg.buf[0]
        if t is not None:
            lat.append(time.monotonic() - t)
        ack.put(name)
    for s in cache.values():
        s.close()
    return {"latency": latency(lat)}


def bench_shared_memory(size: int, n: int) -> dict[str, Any]:
    q, ack = SPAWN.Queue(), SPAWN.Queue()
    pr, cr = run_pair((_shm_producer, {"q": q, "ack": ack, "size": size, "n": n}),
                   (_shm_consumer, {"q": q, "ack": ack, "n": n}))
    return {"name": "shared_memory + names via Queue", "what": "one-way (zero copy)", "size": size,
            "latency": cr["latency"], "per_s": pr["per_s"], "window": pr["window"]}


# --- torch.multiprocessing --------------------------------------------------------------------

def _torch_producer(q: Any, ack: Any, size: int, n: int, device: str, fresh: bool = False) -> dict[str, Any]:
    """``fresh``: a new CPU tensor per put (torch moves each to a new shared-memory segment);
    else the same tensor every time (moved once, then only its handle travels)."""
    import torch

    t = torch.ones(size, dtype=torch.uint8, device=device)
    if device != "cpu":
        torch.cuda.synchronize()
    make = (lambda i: torch.full((size,), i & 0xFF, dtype=torch.uint8)) if fresh else None
    return _queue_producer(q, ack, t, n, make)


def bench_torch(size: int, n: int, device: str = "cpu", fresh: bool = False) -> dict[str, Any]:
    """torch.multiprocessing as a new user would use it: a tensor put on its Queue. ``fresh``
    (CPU): a new tensor per send, the pair of :func:`bench_host`'s ``fresh`` row."""
    row = {"name": f"torch.multiprocessing Queue ({device} tensor{', new per send' if fresh else ''})",
           "what": "one-way (shared, " + ("a new tensor each send)" if fresh else "the same tensor each send)"),
           "size": size}
    try:
        import torch.multiprocessing as tmp  # noqa: F401
    except ImportError:
        return {**row, "skipped": "torch is not installed"}
    ctx = tmp.get_context("spawn")
    q, ack = ctx.Queue(), ctx.Queue()
    pp = ctx.Process(target=run_into_queue,
                     args=(_torch_producer, {"q": q, "ack": ack, "size": size, "n": n, "device": device,
                                             "fresh": fresh},
                           rq := ctx.Queue()))
    pc = ctx.Process(target=run_into_queue, args=(_queue_consumer, {"q": q, "ack": ack, "n": n}, rc := ctx.Queue()))
    pp.start()
    pc.start()
    pr, cr = rq.get(timeout=300), rc.get(timeout=300)
    pp.join(10)
    pc.join(10)
    if "error" in pr or "error" in cr:
        return {**row, "skipped": pr.get("error") or cr.get("error")}
    return {**row, "latency": cr["latency"], "per_s": pr["per_s"], "window": pr["window"]}


# --- host-staged fallback bandwidth vs memcpy ------------------------------------------------

def _staging(size: int, reps: int, env: dict[str, str]) -> dict[str, Any]:
    os.environ.update(env)
    from ..devices import CpuDevice, open_device
    from ..interop.staging import StagingPool

    gpu = open_device("cuda:0")
    cpu = CpuDevice()
    pool = StagingPool(cpu, pin_with=gpu)  # type: ignore[arg-type]
    s = gpu.create_stream()
    src = gpu.allocate(size)
    s.memset(src, 3)
    s.synchronize()
    a, b = np.ones(size, np.uint8), np.empty(size, np.uint8)
    st, mc = [], []
    for _ in range(reps):
        slot = pool.acquire(size)
        t = time.perf_counter()
        s.copy(slot, src, size)  # exactly what Producer._stage does: copy, then host-wait
        s.synchronize()
        st.append(time.perf_counter() - t)
        pool.release(slot)
        t = time.perf_counter()
        np.copyto(b, a)
        mc.append(time.perf_counter() - t)
    src.close()
    pool.close()
    gbs = lambda xs: round(size / statistics.median(xs) / 1e9, 2)  # noqa: E731
    return {"staged_GBps": gbs(st), "memcpy_GBps": gbs(mc),
            "ratio": round(statistics.median(mc) / statistics.median(st), 2),
            "backend": gpu.identity.emulated and "emulated" or "real"}


def bench_staging(size: int, reps: int, env: dict[str, str]) -> dict[str, Any]:
    p, q = spawn(_staging, size=size, reps=reps, env=env)
    r = q.get(timeout=300)
    p.join(10)
    if "error" in r:
        raise RuntimeError(r["error"])
    return {"name": "host-staged copy vs memcpy", "size": size, **r}


# --- the whole suite -------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": _commit()}


def _commit() -> str | None:
    """The git commit of the code measured (``+dirty`` when its checkout has changes), or None
    outside a git checkout (an installed wheel)."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def run_suite(sizes: list[int], n_small: int, n_large: int, progress: Callable[[str], None] = lambda s: None,
              cuda_env: dict[str, str] | None = None, rounds: int = 3, seed: int = 0,
              profile: Path | None = None) -> dict[str, Any]:
    """Every row, ``rounds`` times, each round in a new shuffled order, against one broker.
    Rows report medians over the rounds; ratios are taken per round (rows measured side by side)
    and then their median (:func:`targets`). ``profile``: cProfile output per process there."""
    from ..devices.backend.emulated import EmulationConfig

    emu = cuda_env if cuda_env is not None else EmulationConfig(devices=1, op_delay_s=0.0).to_env()
    w = window()  # each row reads it again, in its own processes
    tmp = Path(tempfile.mkdtemp(prefix="hurray-bench-"))
    ep = f"ipc://{tmp}/broker.sock"
    if profile is not None:
        os.environ["HURRAY_BENCH_PROFILE"] = str(profile)  # the spawned bench processes inherit it
    rng = random.Random(seed)
    raw: list[dict[str, Any]] = []
    with broker_process(tmp, profile) as broker:
        for rnd in range(rounds):
            fns: list[tuple[str, Callable[[], dict[str, Any]]]] = [
                ("pyzmq echo", partial(bench_zmq_echo, tmp, n_small))]
            for size in sizes:
                n = n_small if size <= (1 << 20) else n_large
                # partial binds size and n now, whenever the shuffled list runs them.
                fns += [
                    (f"relay {size}", partial(bench_relay, tmp, size, n, header=False)),
                    (f"relay struct {size}", partial(bench_relay, tmp, size, n, header=True)),
                    (f"cpu {size}", partial(bench_hurray, ep, "cpu", "cpu", "cpu", size, n, {},
                                            broker_pid=broker.pid)),
                    (f"cpu send_many {size}", partial(bench_hurray, ep, "cpu, send_many", "cpu", "cpu", size, n, {},
                                                      broker_pid=broker.pid, batch=True)),
                    (f"cpu many both ways {size}", partial(bench_hurray, ep, "cpu, send_many + receive_many", "cpu",
                                                           "cpu", size, n, {}, broker_pid=broker.pid, batch=True,
                                                           receive_batch=True)),
                    (f"emulated cuda {size}", partial(bench_hurray, ep, "emulated cuda", "cuda:0", "cuda:0", size, n,
                                                      emu, broker_pid=broker.pid)),
                    (f"mp.Queue {size}", partial(bench_mp_queue, size, n)),
                    (f"shared_memory {size}", partial(bench_shared_memory, size, n)),
                    (f"torch {size}", partial(bench_torch, size, n)),
                    *host_rows(ep, size, n, broker.pid),
                ]
                if rnd == 0:  # bandwidth rows, once: they are not compared side by side
                    fns.append((f"staging {size}", partial(bench_staging, size, max(5, n // 4), emu)))
                    if size >= 64 << 20:  # the cross-machine rows, for big buffers only
                        fns += [(f"tcp {size}", partial(bench_tcp, size, n // 4 or 2)),
                                (f"tcp curve {size}", partial(bench_tcp, size, n // 4 or 2, curve=True)),
                                (f"bridge {size}", partial(bench_bridge, tmp, size, n // 4 or 2, curve=False)),
                                (f"bridge curve {size}", partial(bench_bridge, tmp, size, n // 4 or 2, curve=True))]
                        if _nixl_usable():
                            fns += [(f"nixl {size}", partial(bench_nixl, size, n // 4 or 2)),
                                    (f"nixl private {size}", partial(bench_nixl, size, n // 4 or 2, "private")),
                                    (f"bridge nixl {size}", partial(bench_bridge, tmp, size, n // 4 or 2,
                                                                    curve=True, rdma=True))]
            rng.shuffle(fns)
            for label, fn in fns:
                progress(f"round {rnd + 1}/{rounds}: {label}")
                try:
                    row = fn()
                except Exception as e:  # noqa: BLE001
                    row = {"name": label, "size": int(label.rsplit(" ", 1)[-1]) if label[-1].isdigit() else None,
                           "skipped": f"failed: {e}"}
                row["round"] = rnd
                raw.append(row)
    rows = aggregate(raw)
    return {"machine": machine(), "window": w, "rounds": rounds, "rows": rows, "raw": raw,
            "targets": targets(raw, at_window=w), "emulation": {k: v for k, v in emu.items() if k.startswith("HURRAY")}}


def _median_tree(xs: list[Any]) -> Any:
    """The median of each numeric leaf across rows of the same shape (first value elsewhere;
    identifying fields, ``size`` and ``n``, are never averaged)."""
    first = xs[0]
    if isinstance(first, dict):
        return {k: first[k] if k in ("size", "n") else
                _median_tree([x[k] for x in xs if isinstance(x, dict) and k in x]) for k in first}
    nums = [x for x in xs if isinstance(x, int | float) and not isinstance(x, bool) and x == x]
    if isinstance(first, int | float) and not isinstance(first, bool) and nums:
        m = statistics.median(nums)
        if all(isinstance(x, int) for x in nums):
            return int(round(m))
        return round(m, 2 if abs(m) < 100 else 1)
    return first


def aggregate(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (name, size): medians over the rounds that measured it, in first-seen order."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for r in raw:
        groups.setdefault((r["name"], r.get("size")), []).append(r)
    out = []
    for rs in sorted(groups.values(), key=lambda g: (g[0].get("size") or 0, _ORDER.get(g[0]["name"], 99))):
        ok = [r for r in rs if "skipped" not in r]
        if not ok:
            out.append(rs[0])
            continue
        row = _median_tree(ok)
        row["rounds"] = len(ok)
        row.pop("round", None)
        if "per_s" in ok[0]:
            row["per_s_rounds"] = [r["per_s"] for r in ok]
        out.append(row)
    return out


_ORDER = {"pyzmq ROUTER/DEALER echo (200 B)": 0, "relay, forwarding only": 1, "relay, struct header": 2,
          "hurray cpu": 3, "hurray cpu, send_many": 4, "hurray cpu, send_many + receive_many": 4.5,
          "hurray emulated cuda": 5,
          "hurray cpu, new array per send": 6, "torch.multiprocessing Queue (cpu tensor, new per send)": 7,
          "hurray cpu, reused array": 8, "torch.multiprocessing Queue (cpu tensor)": 9}


def _side_by_side(raw: list[dict[str, Any]], name: str, size: int, base: str,
                  value: Callable[[dict[str, Any]], float]) -> float | None:
    """Median over rounds of value(row) / value(base row of the same round and size)."""
    by = {(r["name"], r.get("size"), r.get("round")): r for r in raw if "skipped" not in r}
    ratios = []
    for (n, sz, rnd), r in by.items():
        b = by.get((base, size, rnd))
        if n == name and sz == size and b is not None and value(b):
            ratios.append(value(r) / value(b))
    return round(statistics.median(ratios), 2) if ratios else None


def targets(raw: list[dict[str, Any]], at_window: int = WINDOW) -> list[dict[str, Any]]:
    """The speed targets of issues 11 and 24, reported (never asserted): ratios of rows measured
    side by side (same round), medians over the rounds. Each entry names the issue that set it;
    where issue 24 set a stricter bound on what issue 11 measured (the relay ratios of the plain
    ``send`` row), only issue 24's is reported. Issue 24's CPU targets are the stage harness's
    (``--stages``, :data:`~hurray_ipc.bench.stages.TARGETS_US`), not these whole-process ones.
    ``at_window``: the run's window (its results' ``window``). The issues set the targets of the
    pipelined phase (rates, CPU per handoff) at :data:`~.harness.WINDOW`; at another window they
    are reported with ``met`` None (not judged), their labels naming the window."""
    out: list[dict[str, Any]] = []

    def adder(issue: int, pipelined: bool = False) -> Callable[[str, float | None, Callable[[float], bool]], None]:
        def add(what: str, value: float | None, ok: Callable[[float], bool]) -> None:
            if value is not None:
                judged = not pipelined or at_window == WINDOW
                out.append({"target": what, "value": value, "met": ok(value) if judged else None, "issue": issue})
        return add

    add11, add24 = adder(11), adder(24)
    rate11, rate24 = adder(11, pipelined=True), adder(24, pipelined=True)
    win = f"window {at_window}"

    relay = "relay, forwarding only"
    p50: Callable[[dict[str, Any]], float] = lambda r: r["latency"]["p50_us"]  # noqa: E731
    rate: Callable[[dict[str, Any]], float] = lambda r: r["per_s"]  # noqa: E731
    sizes = sorted({r["size"] for r in raw if r["name"] == "hurray cpu" and "skipped" not in r})
    for size in sizes:
        add24(f"one-way p50 <= 1.2x relay ({size} B, cpu)", _side_by_side(raw, "hurray cpu", size, relay, p50),
             lambda v: v <= 1.2)
        rate24(f"handoffs/s ({win}) >= 1.0x relay ({size} B, cpu)",
             _side_by_side(raw, "hurray cpu", size, relay, rate), lambda v: v >= 1.0)
        rate24(f"handoffs/s with send_many + receive_many >= 2.0x relay ({size} B, cpu, {win})",
             _side_by_side(raw, "hurray cpu, send_many + receive_many", size, relay, rate), lambda v: v >= 2.0)
        rate11(f"handoffs/s with batching (send_many) >= 1.0x relay ({size} B, cpu, {win})",
             _side_by_side(raw, "hurray cpu, send_many", size, relay, rate), lambda v: v >= 1.0)
        cpu = [r["cpu_us"] for r in raw if r["name"] == "hurray cpu" and r.get("size") == size and "cpu_us" in r]
        for who in ("producer", "consumer"):
            vals = [c[who] for c in cpu if c[who] == c[who]]
            if vals:
                rate11(f"{who} CPU per handoff <= 50 µs ({size} B, cpu, {win})", round(statistics.median(vals), 1),
                     lambda v: v <= 50)
        add24(f"emulated CUDA p50 <= 1.3x cpu ({size} B, zero op delay)",
             _side_by_side(raw, "hurray emulated cuda", size, "hurray cpu", p50), lambda v: v <= 1.3)
        rate24(f"emulated CUDA handoffs/s >= 1/1.3x cpu ({size} B, zero op delay, {win})",
             _side_by_side(raw, "hurray emulated cuda", size, "hurray cpu", rate), lambda v: v >= 1 / 1.3)
    if len(sizes) > 1:
        small, large = sizes[0], sizes[-1]
        by = {(r["size"], r["round"]): r for r in raw if r["name"] == "hurray cpu" and "skipped" not in r}
        ratios = [p50(by[(large, rnd)]) / p50(by[(small, rnd)]) for (sz, rnd) in by if sz == small
                  and (large, rnd) in by]
        if ratios:
            add11(f"{large} B handoff p50 within 1.2x of {small} B", round(statistics.median(ratios), 2),
                 lambda v: v <= 1.2)
    mbps: Callable[[dict[str, Any]], float] = lambda r: r["MBps"]  # noqa: E731
    tcp = "raw pyzmq PUSH/PULL over TCP (plaintext)"
    for size in sorted({r["size"] for r in raw if r["name"] == tcp and "skipped" not in r}):
        add11(f"bridge over zmq >= 0.8x raw pyzmq TCP ({size} B, plaintext)",
             _side_by_side(raw, "bridge, TCP (plaintext)", size, tcp, mbps), lambda v: v >= 0.8)
        add11(f"bridge over zmq >= 0.8x raw pyzmq TCP ({size} B, both CurveZMQ)",
             _side_by_side(raw, "bridge, TCP (CurveZMQ)", size, "raw pyzmq PUSH/PULL over TCP (CurveZMQ)", mbps),
             lambda v: v >= 0.8)
        for memory, floor in NIXL_FLOORS.items():
            add11(f"bridge over NIXL >= 0.8x raw NIXL ({size} B, {memory} memory)",
                 _side_by_side(raw, "bridge, NIXL data plane, control over TCP (CurveZMQ)", size, floor, mbps),
                 lambda v: v >= 0.8)
    host_targets(raw, add24, p50)
    for r in raw:
        if r["name"].startswith("host-staged") and "ratio" in r:
            add11(f"host-staged copy >= 0.8x memcpy ({r['size']} B)", r["ratio"], lambda v: v >= 0.8)
    return out


def _met(met: bool | None) -> str:
    return f"n/a: set at window {WINDOW}" if met is None else "yes" if met else "no"


def markdown(res: dict[str, Any]) -> str:
    def human(n: int | None) -> str:
        if n is None:
            return "-"
        for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
            if n >= k and n % k == 0:
                return f"{n // k} {unit}"
        return f"{n} B"

    m = res["machine"]
    raw = res.get("raw", res["rows"])
    lines = [f"Machine: {m['cpu']} ({m['cores']} cores), Python {m['python']}, {m['platform']}; {m['date']}. "
             f"Medians of {res.get('rounds', 1)} shuffled rounds; window {res.get('window', WINDOW)}; "
             f"code {m.get('commit') or 'unknown'}.", "",
             "| benchmark | size | p50 µs | p99 µs | per second | ÷ relay: p50 / rate | CPU µs per handoff: "
             "producer / broker / consumer | messages per handoff | notes |",
             "|---|---|---:|---:|---:|---|---|---:|---|"]
    blank = "| | | |"
    for r in res["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['name']} | {human(r.get('size'))} | | | {blank} skipped: {r['skipped']} |")
        elif "MBps" in r:
            lines.append(f"| {r['name']} | {human(r['size'])} | | | {blank} {r['MBps']} MB/s |")
        elif "ratio" in r:
            lines.append(f"| {r['name']} | {human(r['size'])} | | | {blank} staged {r['staged_GBps']} GB/s vs "
                         f"memcpy {r['memcpy_GBps']} GB/s = {r['ratio']}x ({r['backend']}) |")
        else:
            notes = r.get("what", "")
            if r.get("modes"):
                notes += "; " + ", ".join(r["modes"])
            lat = r["latency"]
            rel = ""
            if r.get("size") is not None:
                a = _side_by_side(raw, r["name"], r["size"], "relay, forwarding only", lambda x: x["latency"]["p50_us"])
                b = _side_by_side(raw, r["name"], r["size"], "relay, forwarding only", lambda x: x["per_s"])
                rel = f"{a} / {b}" if a is not None and b is not None else ""
            cpu = r.get("cpu_us")
            cpu_s = " / ".join(str(cpu.get(k, "")) for k in ("producer", "broker", "consumer")) if cpu else ""
            lines.append(f"| {r['name']} | {human(r.get('size'))} | {lat['p50_us']} | {lat['p99_us']} | "
                         f"{r['per_s']} | {rel} | {cpu_s} | {r.get('messages_per_handoff', '')} | {notes} |")
    if res.get("targets"):
        lines += ["", "| target | issue | measured | met |", "|---|---:|---:|---|"]
        lines += [f"| {t['target']} | {t.get('issue', '')} | {t['value']} | {_met(t['met'])} |"
                  for t in res["targets"]]
    if res.get("scaling"):
        from .scaling import scaling_markdown

        if not res["rows"]:  # a scaling-only run: no empty main table
            lines = lines[:1]
        lines += scaling_markdown(res["scaling"], m["cores"])
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install -e '.[bench]')"
    names = sorted({r["name"] for r in res["rows"] if "latency" in r and "size" in r})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in names:
        pts = sorted((r["size"], r["latency"]["p50_us"]) for r in res["rows"] if r["name"] == name and "latency" in r)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    echo = next((r for r in res["rows"] if r["name"].startswith("pyzmq")), None)
    if echo:
        ax.axhline(echo["latency"]["p50_us"], color="grey", ls="--", label="pyzmq round trip")
    ax.set_xscale("log", base=2), ax.set_yscale("log")
    ax.set_xlabel("buffer bytes"), ax.set_ylabel("one-way latency p50 (µs)")
    ax.set_title("Handoff latency, one run, side by side")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


# --- cross-machine bridge vs raw pyzmq TCP (loopback) --------------------------------------------

def _tcp_sink(url: str, n: int, keys: tuple[bytes, bytes] | None = None) -> dict[str, Any]:
    import zmq

    s = zmq.Context.instance().socket(zmq.PULL)
    if keys is not None:  # CurveZMQ server, as the sending bridge is
        s.curve_server = True
        s.curve_publickey, s.curve_secretkey = keys
    s.bind(url)
    s.recv(copy=False)  # warm-up
    t0 = time.perf_counter()
    total = 0
    for _ in range(n):
        total += len(s.recv(copy=False).buffer)
    dt = time.perf_counter() - t0
    s.close(linger=0)
    return {"MBps": round(total / dt / 1e6)}


def _tcp_source(url: str, n: int, size: int, server_public: bytes | None = None) -> dict[str, Any]:
    import zmq

    s = zmq.Context.instance().socket(zmq.PUSH)
    if server_public is not None:
        s.curve_serverkey = server_public
        s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
    s.setsockopt(zmq.SNDHWM, 4)
    s.connect(url)
    buf = np.ones(size, np.uint8)
    # pyzmq types data as the PEP 688 Buffer protocol (__buffer__), which numpy's stubs only give
    # ndarray for Python >= 3.12; at our python_version 3.10 the zero-copy send cannot type-check.
    trackers = [s.send(buf, copy=False, track=True) for _ in range(n + 1)]  # type: ignore[call-overload]
    for t in trackers:  # ZeroMQ must be done with the buffer before this process may exit
        t.wait(120)
    s.close(linger=-1)
    zmq.Context.instance().term()
    return {}


def _bridge_sink(endpoint: str, channel: str, n: int) -> dict[str, Any]:
    from ..client import Consumer

    with Consumer(endpoint, channel, "cpu") as c:
        for _ in range(BRIDGE_WARMUP):
            c.receive(timeout=120).release()
        t0 = time.perf_counter()
        total = 0
        for _ in range(n):
            h = c.receive(timeout=120)
            total += h.handle.size
            h.release()
        dt = time.perf_counter() - t0
    return {"MBps": round(total / dt / 1e6)}


BRIDGE_BUFFERS = 4  # the source's buffers in the bridge rows: the receiving bridge's default window
# Transfers before the clock starts: enough for every buffer of the source and of the receiving
# bridge's pool (window + 1) to have been used once, as the raw NIXL floor's one buffer on each side
# was (it does not count its first round), and for the buffers that queued up behind a slow first
# use to have been taken: timed per receive, a 1 GiB row's last first use came as late as the 7th
# transfer and was followed by 3 receives that did not wait, which a clock started at the 8th
# counted (28 GB/s). A first use costs a fresh buffer's page faults and a NIXL registration
# (docs/benchmarks.md gives it separately).
BRIDGE_WARMUP = 4 * BRIDGE_BUFFERS


def _bridge_source(endpoint: str, channel: str, n: int, size: int) -> dict[str, Any]:
    from ..client import Producer

    with Producer(endpoint, channel, "cpu") as p:
        bufs = [p.allocate(size) for _ in range(BRIDGE_BUFFERS)]
        for i, b in enumerate(bufs):  # written once, as a producer's data is (no page is a hole)
            np.frombuffer(b.host_view(), np.uint8).fill(i + 1)
        free = list(bufs)
        for _ in range(n + BRIDGE_WARMUP):
            while not free:
                p.wait_released(120)
            b = free.pop()
            p.send(b, timeout=120, on_release=_back_to(free, b))
        p.flush(120)
        for b in bufs:
            b.close()
    return {}


def _rdma() -> Any:
    from ..broker import rdma
    return rdma


def _nixl_usable() -> bool:
    return _rdma().nixl_available() is None


NIXL_FLOORS = {"shared": "raw NIXL WRITE (UCX, shared memory)", "private": "raw NIXL WRITE (UCX, private memory)"}


def bench_nixl(size: int, n: int, memory: str = "shared") -> dict[str, Any]:
    """Raw NIXL WRITEs (UCX) between two processes, one buffer on each side: the floors of the NIXL
    bridge row. "shared": POSIX shared memory on both sides, what the bridges write from and into
    (the like-for-like floor); "private": anonymous memory, which the kernel may back with huge
    pages, as /dev/shm here is not (faster to copy: shown beside it)."""
    r = nixl.bench(size, max(3, n), memory=memory)
    return {"name": NIXL_FLOORS[memory], "size": size, "MBps": round(r["mb_s_median"])}


def bench_bridge(tmp: Path, size: int, n: int, curve: bool, rdma: bool = False) -> dict[str, Any]:
    """Bridged throughput between two brokers on loopback TCP (one link; ``rdma``: both bridges
    offer NIXL, so the bytes move over it and only control messages over ZeroMQ)."""
    from ..broker.bridge import wait_bound

    tag = ("curve" if curve else "plain") + ("-rdma" if rdma else "")
    a, b = f"ipc://{tmp}/a-{tag}.sock", f"ipc://{tmp}/b-{tag}.sock"
    procs = [subprocess.Popen([sys.executable, "-m", "hurray_ipc.broker", "--endpoint", ep, "--log-level", "error"])
             for ep in (a, b)]
    if curve:
        subprocess.run([sys.executable, "-m", "hurray_ipc.broker.bridge", "keygen", str(tmp / "keys")],
                       check=True, capture_output=True)
        out_sec = ["--server-key", str(tmp / "keys/server.key_secret"), "--clients", str(tmp / "keys/clients")]
        in_sec = ["--client-key", str(tmp / "keys/client.key_secret"), "--server-public", str(tmp / "keys/server.key")]
    else:
        out_sec = in_sec = ["--insecure"]
    if rdma:
        out_sec, in_sec = [*out_sec, "--rdma"], [*in_sec, "--rdma"]
    try:
        while not all(Path(ep[6:]).exists() for ep in (a, b)):
            time.sleep(0.02)
        logs = [tmp / f"bridge-{side}-{tag}.log" for side in ("out", "in")]
        with logs[0].open("w") as out_log, logs[1].open("w") as in_log:
            procs.append(subprocess.Popen([sys.executable, "-m", "hurray_ipc.broker.bridge", "out", "--channel", "bb",
                                           "--endpoint", a, "--listen", "tcp://127.0.0.1:*", *out_sec], stderr=out_log))
            sender = procs[-1]
            if (url := wait_bound(logs[0].read_text, lambda: sender.poll() is None, 60)) is None:
                raise RuntimeError(f"the sending bridge never said where it listens: {logs[0].read_text()[-1500:]}")
            procs.append(subprocess.Popen([sys.executable, "-m", "hurray_ipc.broker.bridge", "in", "--channel", "bb",
                                           "--endpoint", b, "--connect", url, *in_sec], stderr=in_log))
        try:
            src, sink = run_pair((_bridge_source, {"endpoint": a, "channel": "bb", "n": n, "size": size}),
                              (_bridge_sink, {"endpoint": b, "channel": "bb", "n": n}))
        except RuntimeError as e:  # a failed row says what the bridges said
            tails = "\n".join(f"{f.name}: {f.read_text()[-1500:]}" for f in logs)
            raise RuntimeError(f"{e}\n{tails}") from None
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(10)
    how = "NIXL data plane, control over " if rdma else ""
    return {"name": f"bridge, {how}TCP ({'CurveZMQ' if curve else 'plaintext'})", "size": size, "MBps": sink["MBps"]}


def bench_tcp(size: int, n: int, curve: bool = False) -> dict[str, Any]:
    """Raw pyzmq PUSH/PULL over loopback TCP, one buffer sent zero-copy again and again: the floor
    of the bridge rows (``curve``: both ends CurveZMQ, the floor of the CurveZMQ bridge)."""
    import socket

    import zmq

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    public, secret = zmq.curve_keypair() if curve else (None, None)
    sink, _ = run_pair((_tcp_sink, {"url": url, "n": n, "keys": (public, secret) if curve else None}),
                    (_tcp_source, {"url": url, "n": n, "size": size, "server_public": public}))
    return {"name": f"raw pyzmq PUSH/PULL over TCP ({'CurveZMQ' if curve else 'plaintext'})", "size": size,
            "MBps": sink["MBps"]}
