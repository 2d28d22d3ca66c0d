"""A checksummed producer/consumer workload, shared by the demo, the stress runner and the tests.

Every buffer's bytes are a pattern derived from (producer, sequence number), written on the
producer's stream (an async copy, so on emulated CUDA it is still in flight at handoff), and
checked on the consumer's stream after the consumer applied the sync rule. A sync bug therefore
shows up as a corrupt buffer, not as luck.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import numpy as np

from .devices.base import Buffer
from .devices.cuda import CudaDevice
from .format.handle import SyncMode

_MUL = np.uint64(0x9E3779B97F4A7C15)
SPAWN = mp.get_context("spawn")  # CUDA and ZeroMQ contexts do not survive fork


def run_into_queue(fn: Callable[..., Any], kwargs: dict[str, Any], q: Any) -> None:
    """Put ``fn(**kwargs)`` (or {"error", "trace"}) on ``q``: the target of a spawned process."""
    try:
        q.put(fn(**kwargs))
    except Exception as e:  # noqa: BLE001 - the parent reports it; it must not wait forever
        q.put({"error": f"{e!r}", "trace": traceback.format_exc()})


def spawn(fn: Callable[..., Any], **kwargs: Any) -> tuple[Any, Any]:
    """Run ``fn(**kwargs)`` in a spawned process; its result (or {"error": ...}) arrives on the queue."""
    q = SPAWN.Queue()
    p = SPAWN.Process(target=run_into_queue, args=(fn, kwargs, q), daemon=True)
    p.start()
    return p, q


MIN_SIZE = 16  # bytes: the head of every pattern names (tag, seq), which verify() reads


def pattern(tag: int, seq: int, nbytes: int) -> np.ndarray:
    """The bytes buffer ``seq`` of producer ``tag`` carries; the first 16 name (tag, seq)."""
    words = max(2, -(-nbytes // 8))
    a = np.arange(words, dtype=np.uint64) * _MUL + np.uint64((tag << 32) ^ seq)
    a[0], a[1] = tag, seq
    return a.view(np.uint8)[:nbytes]


def verify(data: np.ndarray) -> tuple[int, int, bool]:
    """(tag, seq, intact) of received bytes."""
    if data.nbytes < MIN_SIZE:
        return -1, -1, False
    head = data[:16].view(np.uint64)
    tag, seq = int(head[0]), int(head[1])
    return tag, seq, bool(np.array_equal(data, pattern(tag, seq, data.nbytes)))


# Fault injection: each breaks one rule of the sync contract (docs/spec/sync-contract.md §1-§3). A run with any of
# them must fail, every time and at any emulated op delay, through the emulation's race checker.
INJECTIONS = {
    "skip-wait": "consumer: no stream-wait on the producer's event (reads right away)",
    "wrong-stream": "consumer: waits on its stream, reads on another one",
    "no-host-wait": "producer: declares PRODUCER_SYNCED without host-waiting its writing stream",
    "record-wrong-stream": "producer: writes on one stream, records the event on another (idle) one",
    "early-release": "consumer: reads on its stream but releases fenced on another (idle) one, so RELEASE "
                     "can reach the producer before the read finished (sync-contract §3)",
}
CONSUMER_INJECTIONS = ("skip-wait", "wrong-stream", "early-release")
PRODUCER_INJECTIONS = ("no-host-wait", "record-wrong-stream")


#: What ``paths="mixed"`` varies, per buffer, on CUDA devices (the stress runner's ``--paths``):
#: the producer writes on its own stream, on another one given as ``send(stream=)``, through a
#: CUDA Array Interface v3 object naming its stream, or through a DLPack-only object that orders
#: the producer's stream itself; it cycles the preferred mode over (cheapest valid, EVENT,
#: CONSUMER_STREAM, PRODUCER_SYNCED; CONSUMER_STREAM is valid in-process only, so between the
#: stress runner's processes it falls back, and its ``--pairs`` (:func:`run_pair`) use it). The
#: consumer reads on its own stream after waiting and its host wait, on another stream given to
#: ``wait(s)``, or on a stream ordered by ``__dlpack__(stream=)``, and in the last two releases
#: with its reads still pending, so the library's release-after-work must fence them. Each is a
#: rule the plain workload never touches. On the CPU, every other handoff is a new numpy array
#: instead of the producer's own buffer: the library copies it into a recycled slot of its pool
#: (interop/staging.py), which must come back only at its release, and never while a fenced
#: consumer may still read it.
PATHS = ("plain", "mixed")
#: How long a consumer of a finished stress run (:func:`run_consumer`'s ``finished``) waits for a
#: handoff still on its way before it stops.
FINISHED_QUIET_S = 0.2
_MODES = (None, SyncMode.EVENT, SyncMode.CONSUMER_STREAM, SyncMode.PRODUCER_SYNCED)


class CaiView:
    """A CuPy-like view of a device buffer written on ``stream`` (CUDA Array Interface v3): the
    mixed stress paths and tests/test_paths.py send it."""

    def __init__(self, buf: Buffer, stream: Any):
        self.buf, self.stream = buf, stream

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.buf.size,), "typestr": "|u1", "data": (self.buf.ptr, False), "version": 3,
                "strides": None, "stream": self.stream.handle}


class DlpackView:
    """A JAX-like DLPack-only view of a device buffer written on ``stream``: ``__dlpack__(stream=s)``
    makes ``s`` wait for those writes (the array API's exporter duty), unless ``honest`` is False
    (a broken exporter, for tests); ``asked`` records every ``stream`` it was given."""

    def __init__(self, dev: CudaDevice, buf: Buffer, stream: Any, honest: bool = True):
        self.dev, self.buf, self.stream, self.honest = dev, buf, stream, honest
        self.asked: list[Any] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        from .interop import dlpack

        return (dlpack.KDL_CUDA, self.dev.ordinal)

    def __dlpack__(self, stream: Any = None, **_kw: Any) -> Any:
        from .interop import dlpack

        self.asked.append(stream)
        if self.honest and stream != -1:
            ev = self.dev.create_event(interprocess=False)
            ev.record(self.stream)
            self.dev.as_stream(1 if stream is None else stream).wait(ev)
            ev.close()
        return dlpack.make_capsule(self.buf.ptr, (self.buf.size,), "|u1", dlpack.KDL_CUDA, self.dev.ordinal, self)


def check_injection(inject: str | None, role: str) -> None:
    if inject is not None and inject not in INJECTIONS:
        raise ValueError(f"inject={inject!r}: expected one of {', '.join(INJECTIONS)}")
    if inject is not None and inject not in (CONSUMER_INJECTIONS if role == "consumer" else PRODUCER_INJECTIONS):
        raise ValueError(f"inject={inject!r} is not a {role} fault")


def emulated_races(device: Any) -> int:
    """Races the emulated runtime behind ``device`` found in this process (0 elsewhere)."""
    return len(getattr(getattr(device, "rt", None), "races", ()))


@dataclass
class ProducerReport:
    tag: int
    sent: int = 0
    released: int = 0
    consumer_gone: int = 0
    modes: dict[str, int] = field(default_factory=dict)
    staged: int = 0
    copied: int = 0  # host arrays the library copied into a slot of its pool (mixed paths, CPU)
    races: int = 0  # writes or frees the emulation saw unordered after a consumer's read
    error: str | None = None


@dataclass
class ConsumerReport:
    received: int = 0
    intact: int = 0
    corrupt: int = 0
    producer_gone: int = 0
    races: int = 0  # reads the emulation saw unordered after the producer's write
    modes: dict[str, int] = field(default_factory=dict)
    staged: int = 0
    seen: list[tuple[int, int]] = field(default_factory=list)
    ended: bool = False  # stopped at the end of the stream (every producer ended, §4.9)
    error: str | None = None


# Indices into the shared counter arrays the stress runner passes (they survive a SIGKILL).
P_SENT, P_RELEASED, P_CONSUMER_GONE, P_REJECTED, P_DOUBLE, P_RACES, P_HELD = range(7)
C_RECEIVED, C_INTACT, C_CORRUPT, C_PRODUCER_GONE, C_RACES = range(5)
COUNTERS = 7


def release(h: Any) -> None:
    """Give a received buffer back unless an injected early release already did."""
    if not h.released:
        h.release()


def _bump(counters: Any, i: int, n: int = 1) -> None:
    if counters is not None:
        with counters.get_lock():
            counters[i] += n


def run_producer(endpoint: str, channel: str, device: str, count: int, size: int, *, mode: str | None = None,
                 tag: int | None = None, pool: int = 4, duration: float | None = None, timeout: float = 30.0,
                 env: dict[str, str] | None = None, counters: Any = None, broker_grace: float = 15.0,
                 inject: str | None = None, deadline: float | None = None,
                 end_stream: bool = False, paths: str = "plain", gate: Any = None,
                 gate_at: int = 0) -> dict[str, Any]:
    """Send ``count`` checksummed buffers (or until ``duration``); wait for their releases.

    ``gate``: a shared flag (``SPAWN.RawValue``) this producer waits to see set, up to ``timeout``
    s, once it has sent ``gate_at`` buffers: the stress runner holds its producers there until it
    made the kills a run owes, so that they happen however fast the run goes. A flag, not an
    Event: setting a multiprocessing Event waits for each sleeper to wake, and a producer
    SIGKILLed while it slept never does.

    ``end_stream``: end the channel's stream when done (ipc-protocol.md §4.9). Off by default: with
    several producers counted in all, one that finishes before another registered would end the
    stream for its consumers (the rule is per registered producer).

    ``deadline``: a wall-clock time (``time.time()``) after which no buffer is sent, whenever this
    process started: the stress runner's one deadline, so that a replacement for a killed producer
    does not start the clock again. Read once at start and turned into a monotonic end.

    Survives a broker outage of up to ``broker_grace`` seconds: a send refused because the broker
    went away moves on to the next buffer (the refused one comes back through its release).
    ``inject``: one of :data:`PRODUCER_INJECTIONS` (fault injection; the run must fail).
    ``paths``: "plain", or "mixed" to vary how each buffer is written and sent (:data:`PATHS`).
    """
    check_injection(inject, "producer")
    if env:
        os.environ.update(env)
    from .client import BrokerUnavailable, Producer

    tag = os.getpid() if tag is None else tag
    rep = ProducerReport(tag)
    pref = SyncMode.from_name(mode) if mode else None
    dev: Any = None
    try:
        with Producer(endpoint, channel, device) as p:
            dev = p.device
            writer = p.stream  # the stream the buffers' writes go to
            if inject == "no-host-wait" and p.stream is not None:
                pref = SyncMode.PRODUCER_SYNCED
                p.stream.synchronize = lambda: None  # type: ignore[method-assign]  # the skipped host wait
            elif inject == "record-wrong-stream" and p.gpu is not None:
                writer = p.gpu.create_stream()  # writes go here; send() is told the idle p.stream
            mixed = paths == "mixed" and inject is None
            side = p.gpu.create_stream() if mixed and p.gpu is not None else None
            free: list[Buffer] = [p.allocate(size) for _ in range(pool)]
            host: list[Any] = [None] * pool
            end = None if duration is None else time.monotonic() + duration
            if deadline is not None:
                until = time.monotonic() + (deadline - time.time())
                end = until if end is None else min(end, until)
            outage: float | None = None

            def back(t: Any, buf: Buffer | None) -> None:
                # t.obj: what was sent (the buffer, a CAI/DLPack view of it, or a numpy array the
                # library copied: buf None, on the mixed paths)
                if buf is None:
                    pass
                elif t.outcome == "consumer_fenced" and p.holds(t.obj):
                    free.append(p.allocate(size))  # a fenced consumer may still read it: never reuse (§5)
                else:
                    free.append(buf)
                if t.outcome == "rejected":  # never delivered (send raised): not a handoff
                    _bump(counters, P_REJECTED)
                    return
                rep.released += 1
                rep.consumer_gone += t.outcome == "consumer_gone"
                _bump(counters, P_RELEASED)
                _bump(counters, P_CONSUMER_GONE, t.outcome == "consumer_gone")

            seq = 0
            while seq < count and (end is None or time.monotonic() < end):
                if gate is not None and seq >= gate_at:
                    _bump(counters, P_HELD)  # the runner sees it waits (its sends may have been refused)
                    held_until = time.monotonic() + timeout
                    while not gate.value:  # polling the runner's flag, an observable condition
                        if time.monotonic() > held_until:
                            raise TimeoutError(f"held after {seq} handoffs, never let go on (the run's gate)")
                        time.sleep(0.01)
                    gate = None
                buf: Buffer | None = None
                obj: Any = None
                on: Any = None  # the stream the buffer's write went to
                try:
                    if not free:
                        p.wait_released(timeout)
                        continue
                    buf = free.pop()
                    data = pattern(tag, seq, size)
                    obj = buf
                    kw: dict[str, Any] = {"meta": [tag, seq]}  # the consumer checks it read these bytes
                    want = pref
                    if isinstance(p.device, CudaDevice):
                        if writer is None:  # Producer gives every CUDA device a stream; never expected
                            raise RuntimeError(f"producer on {p.device.identity} has no CUDA stream to write on")
                        style = seq % 4 if side is not None else 0
                        on = side if style and side is not None else writer
                        on.copy(buf, data)  # async: still in flight when the handle leaves
                        host[seq % pool] = data  # an async copy's source must outlive it
                        if style == 1:
                            kw["stream"] = side
                        elif style == 2:
                            obj = CaiView(buf, side)
                        elif style == 3 and p.gpu is not None:
                            obj = DlpackView(p.gpu, buf, side)
                        if side is not None and pref is None:
                            want = _MODES[(seq // 4) % len(_MODES)]
                    elif mixed and seq % 2:  # a new array, copied into a slot of the library's pool
                        free.append(buf)
                        buf, obj = None, data
                    else:
                        np.frombuffer(buf.host_view(), dtype=np.uint8)[:] = data
                    seq += 1
                    t = p.send(obj, want, timeout=timeout, on_release=partial(back, buf=buf), **kw)
                    outage = None
                    rep.sent += 1
                    _bump(counters, P_SENT)
                    rep.modes[t.mode.wire_name] = rep.modes.get(t.mode.wire_name, 0) + 1
                    rep.staged += t.staged
                    rep.copied += buf is None
                except BrokerUnavailable:
                    if buf is not None and not p.holds(obj):
                        # It never left: no release will bring it back. A send that raises hands it
                        # back as it took it: its write is ours to order before the next one.
                        if on is not None:
                            on.synchronize()
                        free.append(buf)
                    outage = outage or time.monotonic()
                    if time.monotonic() - outage > broker_grace:
                        raise
                    time.sleep(0.1)
            if end_stream:  # before waiting for releases: a consumer may hold its last buffer until the end
                p.end()
            deadline = time.monotonic() + broker_grace + timeout
            while p.outstanding and time.monotonic() < deadline:
                try:
                    p.flush(timeout)
                except BrokerUnavailable:
                    time.sleep(0.1)
            _bump(counters, P_DOUBLE, p.unknown_releases)
            for buf in free:
                buf.close()
            p.close(end=end_stream)
    except Exception:  # noqa: BLE001 - not swallowed: the traceback goes to the parent in rep.error
        rep.error = traceback.format_exc()
    # Counted on every exit: a race the checker raised as RaceError is still a race found.
    rep.races = emulated_races(dev)
    _bump(counters, P_RACES, rep.races)
    return asdict(rep)


def run_pair(endpoint: str, channel: str, device: str, count: int, size: int, *, env: dict[str, str] | None = None,
             counters: Any = None, consumer_counters: Any = None, paths: str = "plain", timeout: float = 30.0,
             broker_grace: float = 15.0, deadline: float | None = None) -> dict[str, Any]:
    """A producer and a consumer in one process, alone on ``channel``: the pair between which
    CONSUMER_STREAM is valid (the producer makes the consumer's declared stream wait for its
    writes; no event crosses a process), so that stress covers that mode too. The consumer runs
    in a thread until the producer ends the stream. Returns ``{"producer": ..., "consumer": ...}``,
    each as :func:`run_producer` and :func:`run_consumer` report."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="pair-consumer") as pool:
        c = pool.submit(run_consumer, endpoint, channel, device, None, timeout=timeout, env=env,
                        counters=consumer_counters, broker_grace=broker_grace, paths=paths, declare_stream=True,
                        keep_seen=False)
        p = run_producer(endpoint, channel, device, count, size, env=env, counters=counters, timeout=timeout,
                         broker_grace=broker_grace, paths=paths, deadline=deadline, end_stream=True)
        return {"producer": p, "consumer": c.result()}


def run_consumer(endpoint: str, channel: str, device: str, count: int | None, *, timeout: float = 30.0,
                 idle_stop: float | None = None, hold: float = 0.0, env: dict[str, str] | None = None,
                 keep_seen: bool = True, inject: str | None = None, counters: Any = None,
                 broker_grace: float = 15.0, paths: str = "plain", declare_stream: bool = False,
                 gate: Any = None, finished: Any = None) -> dict[str, Any]:
    """Receive up to ``count`` buffers (or until ``idle_stop`` s pass with none, or until the end of
    the stream, ipc-protocol.md §4.9), checking each. ``gate``: the producers' (see
    :func:`run_producer`); while it is shut they wait at it, so idling is not stopping.
    ``finished``: a flag (a shared ``RawValue``) the stress runner sets once no producer is left
    alive: a producer that finishes has waited for every release, and a killed one sends nothing
    more, so from then on the first receive that finds nothing within :data:`FINISHED_QUIET_S`
    ends the run (instead of a whole ``idle_stop``).
    ``paths``: "plain", or "mixed" to vary how each buffer is waited for, read and released
    (:data:`PATHS`). ``declare_stream``: name the consumer's stream at request time, so that an
    in-process producer may order it itself (CONSUMER_STREAM, :func:`run_pair`).

    ``inject``: one of :data:`CONSUMER_INJECTIONS`: the consumer breaks the contract, which the
    emulation's race checker (and, when the timing exposes it, the checksums) must catch.
    """
    check_injection(inject, "consumer")
    if env:
        os.environ.update(env)
    from .client import BrokerUnavailable, Consumer, ProducerGone
    from .devices.errors import DeviceError, RaceError
    from .errors import EndOfStream

    rep = ConsumerReport()
    dev: Any = None
    try:
        declared = None
        if declare_stream:
            from .devices import open_device
            gpu = open_device(device)
            declared = gpu.create_stream() if isinstance(gpu, CudaDevice) else None
        with Consumer(endpoint, channel, device, stream=declared) as c:
            dev = c.device
            reader = c.gpu.create_stream() if inject == "wrong-stream" and c.gpu is not None else c.stream
            # early-release: the stream the release is (wrongly) fenced on; nothing runs on it.
            fence = c.gpu.create_stream() if inject == "early-release" and c.gpu is not None else None
            mixed = paths == "mixed" and inject is None and c.gpu is not None
            s1, s2 = (c.gpu.create_stream(), c.gpu.create_stream()) if mixed and c.gpu is not None else (None, None)
            outage: float | None = None
            wait = idle_stop if idle_stop is not None else timeout
            since = time.monotonic()  # of the last handoff (or gate, or outage): idle time counts from it
            while count is None or rep.received < count:
                try:
                    # In slices when there is a finished flag to look at between them.
                    h = c.receive(timeout=wait if finished is None else min(wait, FINISHED_QUIET_S))
                    outage = None
                    since = time.monotonic()
                except EndOfStream:
                    rep.ended = True
                    break
                except TimeoutError:
                    if gate is not None and not gate.value:
                        since = time.monotonic()
                        continue  # the producers wait at the runner's gate: more is coming
                    if finished is not None and finished.value:
                        break  # no producer is left: nothing more can come
                    if time.monotonic() - since < wait:
                        continue
                    if idle_stop is not None:
                        break
                    raise
                except BrokerUnavailable:
                    outage = outage or time.monotonic()
                    if time.monotonic() - outage > broker_grace:
                        raise
                    time.sleep(0.1)
                    since = time.monotonic()
                    continue
                rep.received += 1
                _bump(counters, C_RECEIVED)
                rep.modes[h.sync_mode.wire_name] = rep.modes.get(h.sync_mode.wire_name, 0) + 1
                rep.staged += h.staged
                try:
                    style = rep.received % 3 if s1 is not None and not h.buffer.on_host else 0
                    if style:
                        out = _read_elsewhere(h, style, s1, s2)  # released there, with the read pending
                    else:
                        if inject != "skip-wait":
                            h.wait()
                        elif h.sync_mode is SyncMode.EVENT:
                            h.release_event()  # give the event back without having waited on it
                        out = np.empty(h.handle.size, dtype=np.uint8)
                        if h.buffer.on_host:
                            out[:] = h.buffer.numpy().reshape(-1).view(np.uint8)
                        else:
                            if reader is None:  # a device-memory handoff only reaches a CUDA consumer
                                raise RuntimeError(f"device-memory handoff on {c.device.identity}, which has no "
                                                   "stream")
                            reader.copy(out, h.buffer.device_buffer)  # our own read, on our stream
                            if fence is not None:
                                h.release(stream=fence)  # the injected fault: fenced on the wrong stream
                                c.flush_releases()  # RELEASE is out while the read may still run
                            reader.synchronize()  # our device work is complete: now we may release
                    if hold:
                        time.sleep(hold)
                    tag, seq, ok = verify(out)
                    # Intact bytes of another handoff (a buffer or slot reused under this one) are corrupt too.
                    ok = ok and (h.meta is None or h.meta == [tag, seq])
                    rep.intact += ok
                    rep.corrupt += not ok
                    _bump(counters, C_INTACT if ok else C_CORRUPT)
                    if keep_seen:
                        rep.seen.append((tag, seq))
                    release(h)
                except ProducerGone:
                    rep.producer_gone += 1
                    _bump(counters, C_PRODUCER_GONE)
                    release(h)
                except RaceError:
                    rep.races += 1
                    rep.corrupt += 1
                    _bump(counters, C_RACES)
                    _bump(counters, C_CORRUPT)
                    release(h)
                except DeviceError as e:
                    if e.code != "cudaErrorLaunchFailure":
                        raise
                    # The producer died before its event was reached (its PRODUCER_GONE may still
                    # be on the way): the buffer is as lost as with ProducerGone.
                    rep.producer_gone += 1
                    _bump(counters, C_PRODUCER_GONE)
                    release(h)
    except Exception:  # noqa: BLE001 - not swallowed: the traceback goes to the parent in rep.error
        rep.error = traceback.format_exc()
    # Every race the checker recorded here, also those no read raised (an unmap checked against
    # the exporter's free, ...): reads that raised RaceError are among them.
    rep.races = max(rep.races, emulated_races(dev))
    return asdict(rep)


def _read_elsewhere(h: Any, style: int, s1: Any, s2: Any) -> np.ndarray:
    """``paths="mixed"``, consumer: read ``h`` on a stream of our own, ordered by ``h.wait(s1)``
    (style 1) or by ``__dlpack__(stream=s1)`` after a wait on ``s2`` (style 2), and release it
    while the read may still run: the library's release fences every stream the handoff was
    ordered on. Then the host waits for the read (after the release) and returns the bytes."""
    out = np.empty(h.handle.size, dtype=np.uint8)
    if style == 1:
        h.wait(s1)
    else:
        h.wait(s2)
        h.buffer.__dlpack__(stream=s1.handle, max_version=(1, 0))  # orders s1; the capsule is dropped
    s1.copy(out, h.buffer.device_buffer)
    release(h)
    s1.synchronize()
    return out
