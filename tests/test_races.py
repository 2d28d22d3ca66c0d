"""The sync contract's rules, each broken on purpose and kept, against the emulation's
happens-before checker (hurray_ipc/devices/backend/hb.py).

For every rule there is a broken variant that must raise RaceError (and be counted) on every run,
and its correct twin that must not, at HURRAY_EMU_DELAY_MS=0 and at a large delay: the checker's
verdict comes from the program's synchronisation alone, so the op delay must not matter.

Device-level scenarios run "producer" and "consumer" as two runtimes in this process (each its own
host agent, ordered only through events and order_send/order_receive, as two processes are), 100
times at delay 0; the client-level ones run real processes through a real broker with the
stress workload's fault injections.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os

import numpy as np
import pytest

from conftest import Proc, emu_config, emu_env
from hurray_ipc import workload
from hurray_ipc.devices import CudaDevice, RaceError
from hurray_ipc.devices.backend import hb
from hurray_ipc.devices.backend.emulated import EmulatedRuntime

pytestmark = pytest.mark.races_expected

N = 4096
LARGE_DELAY = 0.25
RUNS_AT_ZERO = 100
_keys = itertools.count()


class World:
    """A producer and a consumer runtime on one emulated machine, with two streams each."""

    def __init__(self, delay: float):
        cfg = emu_config(op_delay_s=delay)
        self.P = CudaDevice(0, runtime=EmulatedRuntime(cfg))
        self.C = CudaDevice(0, runtime=EmulatedRuntime(cfg))
        self.ps, self.ps2 = self.P.create_stream(), self.P.create_stream()
        self.cs, self.cs2 = self.C.create_stream(), self.C.create_stream()

    def close(self) -> None:
        for s in (self.ps, self.ps2, self.cs, self.cs2):
            s.close()

    def message(self, sender: CudaDevice, receiver: CudaDevice) -> None:
        """One message from ``sender``'s host to ``receiver``'s (a DELIVER, a RELEASE)."""
        key = f"test-races-{next(_keys)}"
        sender.order_send(key)
        receiver.order_receive(key)


def sync(stream) -> str | None:
    try:
        stream.synchronize()
    except RaceError as e:
        return str(e)
    return None


def produce(w: World, *, mode: str, host_wait: bool = True, record_on_other: bool = False):
    """The producer writes a pattern on ps and hands it off in ``mode``; returns (buf, data, event)."""
    buf = w.P.allocate(N)
    data = workload.pattern(1, next(_keys), N)
    w.ps.copy(buf, data)
    ev = None
    if mode == "event":
        ev = w.P.create_event(interprocess=True)
        ev.record(w.ps2 if record_on_other else w.ps)
    elif host_wait:
        w.ps.synchronize()
    w.message(w.P, w.C)  # DELIVER
    return buf, data, ev


def give_back(w: World, buf, ev, *, after_work: bool = True, rewrite: bool = False, free: bool = False):
    """The consumer releases (RELEASE message); the producer then rewrites or frees the buffer."""
    if after_work:
        w.cs.synchronize()
        w.cs2.synchronize()
    w.message(w.C, w.P)  # RELEASE
    if not after_work:
        w.cs.synchronize()
        w.cs2.synchronize()
    if rewrite:
        w.ps.memset(buf, 0x5A)
    if ev is not None:
        ev.close()  # before the synchronize: a destroy the release did not order is found in this run
    race = sync(w.ps)
    buf.close()
    after = sync(w.ps) if free else None  # always drained: a race left pending would land in the next run
    return race or after


def consume(w: World, buf, ev, *, wait: bool = True, wait_on=None, read_on=None):
    """The consumer imports, stream-waits (EVENT), reads on a stream; returns (race, bytes)."""
    exp = w.P.export_memory(buf)
    cbuf = w.C.import_memory(exp)
    if ev is not None:
        cev = w.C.import_event(ev.export())
        if wait:
            (wait_on or w.cs).wait(cev)
        cev.close()
    out = np.empty(N, dtype=np.uint8)
    reader = read_on or w.cs
    reader.copy(out, cbuf)
    race = sync(reader)
    cbuf.close()
    return race, out


# Each scenario returns the race report (None when there was none) and whether the bytes were intact
# (only asserted for correct programs: a racy read may see old or new bytes by chance).

def skip_wait(w: World, broken: bool):
    buf, data, ev = produce(w, mode="event")
    race, out = consume(w, buf, ev, wait=not broken)
    give_back(w, buf, ev)
    return race, np.array_equal(out, data)


def wait_one_read_another(w: World, broken: bool):
    buf, data, ev = produce(w, mode="event")
    race, out = consume(w, buf, ev, wait_on=w.cs, read_on=w.cs2 if broken else w.cs)
    give_back(w, buf, ev)
    return race, np.array_equal(out, data)


def producer_synced_without_host_wait(w: World, broken: bool):
    buf, data, ev = produce(w, mode="producer_synced", host_wait=not broken)
    race, out = consume(w, buf, ev, read_on=w.cs2)  # P1: any stream may read at once
    give_back(w, buf, ev)
    return race, np.array_equal(out, data)


def record_on_wrong_stream(w: World, broken: bool):
    buf, data, ev = produce(w, mode="event", record_on_other=broken)
    race, out = consume(w, buf, ev)
    give_back(w, buf, ev)
    return race, np.array_equal(out, data)


def undeclared_consumer_stream(w: World, broken: bool):
    """CONSUMER_STREAM (in-process): the producer made the declared stream wait; reading on another
    stream without an inter-stream wait is a race."""
    P = w.P
    declared, other = w.ps2, P.create_stream()
    buf = P.allocate(N)
    data = workload.pattern(2, next(_keys), N)
    w.ps.copy(buf, data)
    ev = P.create_event(interprocess=False)
    ev.record(w.ps)
    declared.wait(ev)  # the producer's device-side wait on the consumer's declared stream
    out = np.empty(N, dtype=np.uint8)
    reader = other if broken else declared
    reader.copy(out, buf)
    race = sync(reader)
    for s in (w.ps, declared, other):
        s.synchronize()
    other.close(), ev.close(), buf.close()
    return race, np.array_equal(out, data)


def _release_before_work(w: World, broken: bool, *, then: str):
    """The consumer reads (after the EVENT wait), releases, and the producer then ``rewrite``s or
    ``free``s the buffer: broken, the release comes before the read completed."""
    buf, data, ev = produce(w, mode="event")
    cbuf = w.C.import_memory(w.P.export_memory(buf))
    cev = w.C.import_event(ev.export())
    w.cs.wait(cev)
    cev.close()
    out = np.empty(N, dtype=np.uint8)
    w.cs.copy(out, cbuf)
    if not broken:
        w.cs.synchronize()
    cbuf.close()  # the importer unmaps before its RELEASE, as the library does
    race = give_back(w, buf, ev, after_work=not broken, rewrite=then == "rewrite", free=then == "free")
    return race, np.array_equal(out, data)


def release_before_work_then_rewrite(w: World, broken: bool):
    return _release_before_work(w, broken, then="rewrite")


def release_before_work_then_free(w: World, broken: bool):
    return _release_before_work(w, broken, then="free")


def release_before_unmap_then_free(w: World, broken: bool):
    """The exporter frees an allocation only after every importer closed its mapping (CUDA: a
    cudaFree before the importer's cudaIpcCloseMemHandle is undefined). Kept: the consumer unmaps,
    then releases; broken: it releases, the producer frees, and it unmaps afterwards."""
    buf, data, ev = produce(w, mode="event")
    cbuf = w.C.import_memory(w.P.export_memory(buf))
    cev = w.C.import_event(ev.export())
    w.cs.wait(cev)
    cev.close()
    out = np.empty(N, dtype=np.uint8)
    w.cs.copy(out, cbuf)
    w.cs.synchronize()  # the read is done in both variants: only the unmap is out of order
    if not broken:
        cbuf.close()
    w.message(w.C, w.P)  # RELEASE
    ev.close()
    buf.close()  # cudaFree
    race = sync(w.ps)
    if broken:
        cbuf.close()  # the unmap after the free: found here if the free did not find it
        race = race or sync(w.cs)
    return race, np.array_equal(out, data)


def two_streams_write_same_bytes(w: World, broken: bool):
    buf = w.P.allocate(N)
    w.ps.memset(buf, 1)
    if not broken:
        ev = w.P.create_event(interprocess=False)
        ev.record(w.ps)
        w.ps2.wait(ev)
        ev.close()
    w.ps2.memset(buf, 2)
    race = sync(w.ps2)
    w.ps.synchronize()
    out = np.empty(N, dtype=np.uint8)
    w.ps2.copy(out, buf)
    w.ps2.synchronize()
    buf.close()
    return race, broken or bool((out == 2).all())


def wait_orders_after_latest_record_at_call_time(w: World, broken: bool):
    """A wait orders after the record that was latest when it was *issued*: re-recording the event
    later (as the event pool does after EVENT_RELEASE) orders nothing for an earlier wait."""
    a, b = w.P.allocate(N), w.P.allocate(N)
    ev = w.P.create_event(interprocess=True)
    w.ps.memset(a, 7)
    ev.record(w.ps)
    w.message(w.P, w.C)
    cev = w.C.import_event(ev.export())
    w.cs.wait(cev)  # captures the first record
    w.ps.memset(b, 9)
    ev.record(w.ps)  # a re-record after the consumer's wait was issued
    w.message(w.P, w.C)
    target = b if broken else a
    cbuf = w.C.import_memory(w.P.export_memory(target))
    out = np.empty(N, dtype=np.uint8)
    w.cs.copy(out, cbuf)
    race = sync(w.cs)
    cev.close(), cbuf.close()
    w.message(w.C, w.P)
    w.ps.synchronize()
    ev.close(), a.close(), b.close()
    return race, broken or bool((out == 7).all())


def host_learns_by_query(w: World, broken: bool):
    """A successful stream query is a host synchronization (release(stream=) relies on it)."""
    buf = w.P.allocate(N)
    data = workload.pattern(3, next(_keys), N)
    w.ps.copy(buf, data)
    if not broken:
        while not w.ps.query():  # polling a query, as a non-blocking deferred release does
            pass
    w.message(w.P, w.C)
    race, out = consume(w, buf, None)
    give_back(w, buf, None)
    return race, np.array_equal(out, data)


def record_after_the_message_left(w: World, broken: bool):
    """A wait orders after the latest record that happens-before it (the DELIVER carries it),
    not the latest in wall-clock time: a producer that records the event after the DELIVER left
    is racy (in CUDA the consumer's wait may be issued before that record) even when, as here,
    the consumer's wait comes after the record in time. Issue 22's checker limit A: before, the
    wait joined whatever record was latest when it was called, and this went unreported."""
    buf = w.P.allocate(N)
    data = workload.pattern(4, next(_keys), N)
    w.ps.copy(buf, data)
    ev = w.P.create_event(interprocess=True)
    if not broken:
        ev.record(w.ps)
    w.message(w.P, w.C)  # DELIVER
    if broken:
        ev.record(w.ps)  # recorded after the DELIVER left; the consumer's wait below is later still
    race, out = consume(w, buf, ev)
    give_back(w, buf, ev)
    return race, np.array_equal(out, data)


def staged_copy_without_host_wait(w: World, broken: bool):
    """The host-staged fallback: the consumer reads the staging slot on its host, and its only
    edge to the producer's copy is the message. So the copy must be host-waited before the handle
    leaves; the checker judges it when the producer publishes the slot (``publish_host``), not by
    whether the bytes happened to land. Issue 22's checker limit C: host reads were not modelled,
    and only a slow copy's checksum caught a missing wait."""
    buf = w.P.allocate(N)
    data = workload.pattern(5, next(_keys), N)
    w.ps.copy(buf, data)
    slot = np.zeros(N, dtype=np.uint8)
    w.ps.copy(slot, buf)  # device to host, into what the consumer will read
    if not broken:
        w.ps.synchronize()
    w.P.publish_host(slot.ctypes.data, N, "a staging slot")
    w.message(w.P, w.C)  # DELIVER
    race = sync(w.ps)  # the producer's runtime raises what it found at its next synchronize
    buf.close()
    return race, np.array_equal(slot, data)


SCENARIOS = [skip_wait, wait_one_read_another, producer_synced_without_host_wait, record_on_wrong_stream,
             undeclared_consumer_stream, release_before_work_then_rewrite, release_before_work_then_free,
             release_before_unmap_then_free, two_streams_write_same_bytes, wait_orders_after_latest_record_at_call_time,
             host_learns_by_query, record_after_the_message_left, staged_copy_without_host_wait]


@pytest.mark.parametrize("delay", [0.0, LARGE_DELAY], ids=["delay0", "delay250ms"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_rule_broken_fails_every_time_and_kept_passes(scenario, delay):
    w = World(delay)
    runs = RUNS_AT_ZERO if delay == 0 else 1
    try:
        for i in range(runs):
            race, _ = scenario(w, broken=True)
            assert race is not None and " race on " in race, f"run {i}: the broken variant went unreported"
            race, intact = scenario(w, broken=False)
            assert race is None, f"run {i}: a false positive: {race}"
            assert intact, f"run {i}: the correct variant read wrong bytes"
        reported = len(w.P.rt.races) + len(w.C.rt.races)
        assert reported >= runs, "every reported race is counted in the runtime's race counter"
    finally:
        w.close()


def test_race_report_names_both_operations():
    w = World(0.0)
    try:
        race, _ = skip_wait(w, broken=True)
    finally:
        w.close()
    assert race is not None
    assert "read-after-write race on /hurray-" in race and "bytes [0, 4096)" in race
    reader, writer = race.split(" is not ordered after ")
    assert "cudaMemcpyAsync read [0, 4096)" in reader and "stream 0x" in reader and "pid " in reader
    assert "cudaMemcpyAsync write [0, 4096)" in writer and "stream 0x" in writer


def test_checker_off_reports_nothing():
    cfg = emu_config(op_delay_s=0.0, race_check=False)
    w = World(0.0)
    w.P, w.C = CudaDevice(0, runtime=EmulatedRuntime(cfg)), CudaDevice(0, runtime=EmulatedRuntime(cfg))
    w.ps, w.ps2, w.cs, w.cs2 = w.P.create_stream(), w.P.create_stream(), w.C.create_stream(), w.C.create_stream()
    try:
        race, _ = skip_wait(w, broken=True)
    finally:
        w.close()
    assert race is None and not w.C.rt.races


# --- the shadow memory on its own ------------------------------------------------------------------

def rec(agent, count, what="op"):
    return (agent, count, 1, 1, what)


def never_gone(_r):
    return False


def test_shadow_partial_overlap_splits_and_checks_only_overlapping_bytes():
    sh, races = hb.access([], 0, 100, True, rec(1, 1), {1: 1}, never_gone)
    assert races == [] and sh == [[0, 100, rec(1, 1), []]]
    sh, races = hb.access(sh, 100, 200, False, rec(2, 1), {2: 1}, never_gone)
    assert races == [], "bytes nobody wrote are no race"
    sh, races = hb.access(sh, 50, 150, False, rec(3, 1), {3: 1}, never_gone)
    assert [(k, o[0], a, b) for k, o, a, b in races] == [("read-after-write", 1, 50, 100)]
    assert [iv[:2] for iv in sh] == [[0, 50], [50, 100], [100, 150], [150, 200]]


def test_shadow_write_after_unordered_read_whichever_ran_first():
    sh, _ = hb.access([], 0, 8, False, rec(2, 5), {2: 5}, never_gone)
    _, races = hb.access(sh, 0, 8, True, rec(1, 1), {1: 1}, never_gone)
    assert [r[0] for r in races] == ["write-after-read"]
    _, races = hb.access(sh, 0, 8, True, rec(1, 1), {1: 1, 2: 5}, never_gone)
    assert races == [], "a write ordered after the read is no race"


def test_shadow_forgets_the_reads_of_processes_that_exited():
    """An exited reader reads nothing more: a write after its read is no race."""
    sh, _ = hb.access([], 0, 8, False, rec(2, 5), {2: 5}, never_gone)
    _, races = hb.access(sh, 0, 8, True, rec(1, 1), {1: 1}, lambda r: r[0] == 2)
    assert races == []


@pytest.mark.parametrize("is_write", [False, True], ids=["read", "write"])
def test_shadow_keeps_the_writes_of_processes_that_exited(is_write):
    """Issue 22's checker limit B: an unsynchronised writer was a race while it lived and clean once
    it exited, so the verdict depended on when the reader ran. Its write keeps its history now: an
    access nobody ordered after it is a race whether or not the writer still lives."""
    sh, _ = hb.access([], 0, 8, True, rec(2, 5), {2: 5}, never_gone)
    for gone in (never_gone, lambda r: r[0] == 2):
        _, races = hb.access(sh, 0, 8, is_write, rec(1, 1), {1: 1}, gone)
        assert [r[0] for r in races] == ["write-after-write" if is_write else "read-after-write"]
        _, races = hb.access(sh, 0, 8, is_write, rec(1, 1), {1: 1, 2: 5}, gone)
        assert races == [], "an access ordered after the write is no race"
    # A clock that forgot exited agents (hb.prune, past 64 of them in a soak) cannot tell an
    # ordered write of theirs from an unordered one: it forgives them, as before.
    pruned = hb.prune({1: 1, 2: 5}, lambda a: a == 2)
    assert pruned == {1: 1, hb.PRUNED: 1}
    _, races = hb.access(sh, 0, 8, is_write, rec(1, 1), pruned, lambda r: r[0] == 2)
    assert races == []


@pytest.mark.parametrize("delay", [0.0, LARGE_DELAY], ids=["delay0", "delay250ms"])
@pytest.mark.parametrize("host_wait", [False, True], ids=["unsynchronised", "host-waited"])
def test_a_writer_that_exited_is_still_a_race_unless_ordered(host_wait, delay):
    """Checker limit B as a program: a process writes device memory on a stream, tells another
    process about it before (race) or after (clean) host-waiting the write, and exits; only then
    does the other process read. The verdict used to flip to clean once the writer had exited."""
    from hurray_ipc.devices.base import MemoryExport
    from workers import emulated_writer_that_exits
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    key = f"test-races-exited-{os.getpid()}-{next(_keys)}"
    child = ctx.Process(target=emulated_writer_that_exits, args=(delay, host_wait, key, q, done))
    child.start()
    try:
        msg = q.get(timeout=60)
        assert msg[0] == "ok", msg[1]
        dev = CudaDevice(0, runtime=EmulatedRuntime(emu_config(op_delay_s=delay)))
        dev.order_receive(key)
        cbuf = dev.import_memory(MemoryExport(*msg[1:]))
        done.set()
        child.join(30)
        assert child.exitcode == 0
        out = np.empty(N, dtype=np.uint8)
        s = dev.create_stream()
        s.copy(out, cbuf)
        race = sync(s)
        cbuf.close()
        s.close()
    finally:
        done.set()
        child.join(10)
    if host_wait:
        assert race is None and (out == 0x5A).all()
    else:
        assert race is not None and "read-after-write" in race, "the exited writer's write was forgiven"


def test_shadow_merges_adjacent_equal_intervals():
    sh, _ = hb.access([], 0, 10, True, rec(1, 1), {1: 1}, never_gone)
    sh, _ = hb.access(sh, 10, 20, True, rec(1, 1), {1: 1}, never_gone)
    assert sh == [[0, 20, rec(1, 1), []]]


# --- the whole stack: real processes, a real broker, the stress workload's fault injections -------

@pytest.mark.parametrize("delay", [0.0, 0.2], ids=["delay0", "delay200ms"])
@pytest.mark.parametrize("inject", [None, *workload.INJECTIONS])
def test_injected_fault_fails_every_time_correct_run_passes(broker, inject, delay):
    env = {**emu_env(op_delay_s=delay), "HURRAY_EVENT_POOL": "0"}  # the counts below are for the default
    n = 4
    channel = f"inj-{inject}"
    c = Proc(workload.run_consumer, endpoint=broker.endpoint, channel=channel, device="cuda:0", count=n, env=env,
             inject=inject if inject in workload.CONSUMER_INJECTIONS else None)
    p = Proc(workload.run_producer, endpoint=broker.endpoint, channel=channel, device="cuda:0", count=n, size=N,
             env=env, pool=1, inject=inject if inject in workload.PRODUCER_INJECTIONS else None)
    pr, cr = p.result(), c.result()
    assert cr["error"] is None and pr["error"] is None, (cr["error"], pr["error"])
    assert cr["received"] == n and pr["sent"] == pr["released"] == n
    if inject is None:
        assert cr["races"] == pr["races"] == 0 and cr["intact"] == n, (cr, pr)
    elif inject == "early-release":
        # Found by the producer: write-after-read at each rewrite (pool=1: n-1), and each
        # handoff's event destroyed at its RELEASED before the consumer's wait was known to have
        # run (one event per handoff, the default): 2n - 1 every time. The free waits for the
        # consumer's UNMAPPED (a kept mapping, spec §4.10), so it races with the last read only
        # when the consumer answered before its host waited for that read: one more, or not.
        assert 2 * n - 1 <= pr["races"] <= 2 * n and cr["races"] == 0, (cr, pr)
    else:
        assert cr["races"] == n and cr["corrupt"] == n, cr
