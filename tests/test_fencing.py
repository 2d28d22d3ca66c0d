"""Fencing (spec §5): a consumer that lives but stays silent past the broker's fence while it holds
a buffer loses the buffer, and can never read memory its producer reused; so does one that holds
a buffer past the broker's hold bound (``--hold``), however live and talkative it is.

The consumer process is stopped with SIGSTOP while it holds a zero-copy view (the hold bound's
tests leave it running: it waits, its session pumping and pinging, until told to look). Its producer gets
the buffer back (RELEASED ``consumer_fenced``) and then does what a producer does with a buffer
it got back: it writes new bytes into the same ``allocate()``d buffer and hands it on, or stages
the next handoff of the same size. Only then does the stopped consumer resume and look at its old
view. Every step waits on the one before (a release, a received handoff, a pipe), so the check
is decided by what the library does, never by timing: a producer that reused the memory under
the consumer fails it every run (mutants fence-as-gone, fenced-slot-pooled, fenced-copy-pooled,
fenced-memory-kept in scripts/check-sync-mutants).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from brokerproc import BrokerProcess
from conftest import Proc, emu_config, emulated_gpu
from hurray_ipc import workload
from hurray_ipc.client import Producer
from hurray_ipc.client.query import stats
from workers import hold_fenced_then_leave, hold_while_fenced

SIZE = 64 << 10
TIMEOUT_S, FENCE_S = 1.0, 2.0
HOLD_S = 1.0  # the hold bound: a running consumer's heartbeats (0.5 s) never stop it


def _broker(tmp_path, *options: str):
    b = BrokerProcess(f"ipc://{tmp_path}/b.sock", timeout=TIMEOUT_S, extra_args=list(options)).start()
    yield b
    assert b.proc is not None and b.proc.poll() is None, "the broker died"
    b.stop()


@pytest.fixture
def fencing(tmp_path):
    yield from _broker(tmp_path, "--fence", str(FENCE_S))


def _write(p: Producer, buf, seq: int) -> None:
    data = workload.pattern(7, seq, SIZE)
    if p.gpu is not None:
        p.stream.copy(buf, data)  # type: ignore[union-attr]
    else:
        np.frombuffer(buf.host_view(), dtype=np.uint8)[:] = data


@pytest.fixture
def holding(tmp_path):
    """A broker with a hold bound and the default fence (20 timeouts): only holding fences here."""
    yield from _broker(tmp_path, "--hold", str(HOLD_S))


@pytest.mark.parametrize("path,delay", [("allocated", None), ("copied", None), ("device", 0.0), ("device", 0.05)])
def test_a_consumer_holding_past_the_hold_bound_never_reads_memory_its_producer_reused(holding, path, delay):
    """Spec §5, hold bound: the consumer keeps running and heartbeating while it holds the buffer,
    so only the bound can fence it. Its producer gets RELEASED ``consumer_fenced`` and retires the
    buffer (moves it, or for mapped device memory keeps it out of reach), reuses what it can, and
    only then does the consumer look at its old view; it stays registered, told PRODUCER_GONE
    ``fenced`` for that handoff alone (mutants hold-fence-as-gone, hold-never)."""
    with contextlib.ExitStack() as stack:
        device = stack.enter_context(emulated_gpu(delay)) if path == "device" else "cpu"
        _fence_and_reuse(holding, device, "cuda:0" if path == "device" else "cpu", delay, copied=path == "copied",
                         stop=False)
    assert stats(holding.endpoint, 5)["totals"]["holds_fenced"] == 1


@pytest.mark.parametrize("path,delay", [("allocated", None), ("copied", None), ("staged", 0.0), ("staged", 0.05),
                                        ("device", 0.0), ("device", 0.05)])
def test_a_fenced_consumer_never_reads_memory_its_producer_reused(fencing, path, delay):
    """``allocated``: a CPU producer's own shared-memory buffer, written again and sent again once
    it came back (the library moved it to fresh pages). ``copied``: a numpy array, which the
    library copied into a slot of its pool; the next array of the same size must not get the
    fenced consumer's slot. ``staged``: a GPU producer's buffer
    staged for a CPU consumer; the next staged handoff of the same size must not get the fenced
    consumer's slot. ``device``: a GPU buffer a GPU consumer maps cannot be moved: the producer
    keeps it out of reach (``holds`` stays true) instead, and keeps its event alive until close:
    no RELEASE ever orders the stopped consumer's stream-wait on it before a destroy, so destroying
    it is the checker's destroy-before-wait race (conftest's no_unexpected_races fails the test)."""
    with contextlib.ExitStack() as stack:  # emulated device operations taking no time, and 50 ms each
        device = stack.enter_context(emulated_gpu(delay)) if path not in ("allocated", "copied") else "cpu"
        _fence_and_reuse(fencing, device, "cuda:0" if path == "device" else "cpu", delay, copied=path == "copied")


def _fence_and_reuse(fencing: BrokerProcess, device, consumer_device: str, delay: float | None,
                     copied: bool = False, stop: bool = True) -> None:
    """``stop``: SIGSTOP the consumer while it holds (silent past the fence); else it keeps running
    (the hold bound fences it)."""
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    env = emu_config(op_delay_s=delay).to_env() if consumer_device != "cpu" else None
    c = Proc(hold_while_fenced, endpoint=fencing.endpoint, channel="fence", ready=ready, go=go,
             device=consumer_device, env=env)
    stopped = False
    with Producer(fencing.endpoint, "fence", device) as p:
        buf = None if copied else p.allocate(SIZE)
        if buf is not None:
            _write(p, buf, 1)
        obj = workload.pattern(7, 1, SIZE).copy() if buf is None else buf
        t = p.send(obj, timeout=30)
        if not ready.wait(60):
            pytest.fail(f"the consumer never held the buffer: {c.result(timeout=5)}")
        if stop:
            os.kill(c.p.pid, signal.SIGSTOP)
            stopped = True
        try:
            p.wait_released(timeout=FENCE_S + 30)  # the fence gives it back
            assert t.outcome == "consumer_fenced", t
            if consumer_device != "cpu":  # mapped device memory: never to be written or freed again
                assert p.holds(buf) and not t.staged
            else:
                assert not p.holds(obj)
                _reuse(fencing, p, buf)
        finally:
            if stopped:
                os.kill(c.p.pid, signal.SIGCONT)
        go.set()
        res = c.result()
    assert res["error"] is None, res["error"]
    assert res["same"], "the fenced consumer's view changed under it: its producer reused the memory"
    assert res["fenced"] and res["times_fenced"] == 1 and "fenced" in res["refused"], res
    assert res["hold_s"] == (None if stop else HOLD_S), "Consumer.hold_s is not the broker's bound"
    assert res["errors"] == [], res


def _reuse(fencing: BrokerProcess, p: Producer, buf) -> None:
    """What any producer does with a buffer it got back: write it and send it again (here while
    the fenced consumer is stopped), to a consumer in another process, which must attach it (a
    renewed segment under a new name) and read the new bytes. ``buf`` None: a new numpy array of
    the same size instead, which the library copies into a slot of its pool."""
    other = Proc(workload.run_consumer, endpoint=fencing.endpoint, channel="fence", device="cpu", count=1, env={})
    if buf is not None:
        _write(p, buf, 2)
    t2 = p.send(workload.pattern(7, 2, SIZE).copy() if buf is None else buf, timeout=30)
    r = other.result()
    assert r["error"] is None, r["error"]
    assert r["intact"] == 1 and [tuple(x) for x in r["seen"]] == [(7, 2)], "the next handoff lost the new bytes"
    p.wait_released(timeout=30)
    assert t2.outcome == "released"


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_a_fenced_device_buffer_closed_by_its_application_is_not_freed_when_its_consumer_leaves(fencing, delay):
    """Spec §5, §4.10 step 6: a consumer fenced while it held an ``allocate()``d GPU buffer
    registers again and leaves (BYE) while its application still holds the fenced handoff (the
    broker no longer counts it, so it counts the consumer gone). The producer's application then
    closes the buffer: the library must not free it (not at the close, not when an UNMAP round
    answers ``gone``), since the consumer's mapping may still be open: it stays allocated until the
    producer's process exits. Broken, the consumer's unmap after that free is the race checker's
    free-before-close race, in every run: each step waits on the one before (the release, pipes, the
    broker's count of consumers), never on time."""
    ctx = mp.get_context("spawn")
    ready, go, left, after = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    with emulated_gpu(delay) as device:
        c = Proc(hold_fenced_then_leave, endpoint=fencing.endpoint, channel="fence", ready=ready, go=go, left=left,
                 after=after, env=emu_config(op_delay_s=delay).to_env())
        p = Producer(fencing.endpoint, "fence", device)
        try:
            buf = p.allocate(SIZE)
            _write(p, buf, 1)
            # No event: the producer's close destroys a fenced handoff's event while the consumer
            # lives, which is allowed (it leaves) but is a race to the checker; memory is the point.
            t = p.send(buf, "PRODUCER_SYNCED", timeout=30)
            if not ready.wait(60):
                pytest.fail(f"the consumer never held the buffer: {c.result(timeout=5)}")
            os.kill(c.p.pid, signal.SIGSTOP)
            try:
                p.wait_released(timeout=FENCE_S + 30)  # the fence gives it back
            finally:
                os.kill(c.p.pid, signal.SIGCONT)
            assert t.outcome == "consumer_fenced", t
            go.set()
            if not left.wait(60):
                pytest.fail(f"the consumer never left: {c.result(timeout=5)}")
            deadline = time.monotonic() + 30
            while stats(fencing.endpoint, 5)["gauges"]["consumers"] and time.monotonic() < deadline:
                time.sleep(0.05)  # until the broker read its BYE (a snapshot is at most 0.25 s old)
            assert p.holds(buf)
            buf.close()  # what the application does with a buffer it no longer needs
            p.close()  # waits for any UNMAP round the close started
        finally:
            after.set()
            p.close()
        res = c.result()
    assert res["error"] is None, res["error"]
    assert res["fenced"] and res["registered_again"], res
    assert res["races"] == 0, "the producer freed memory the fenced consumer still mapped"
