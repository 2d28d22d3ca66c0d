"""Host arrays travel in recycled shared-memory slots (issue 24): ``send(numpy_array)`` is one
memcpy into a slot of the producer's staging pool, handed off as the slot's first ``nbytes``
and given back only when the consumer released it.

Why each rule fails every time when broken, not by timing:

- Reuse is deterministic: a fresh producer's pool holds no slot; the first send of a size class
  makes slot S; once S is back, the next send of that class takes S again (the only idle one).
  So a slot given back before its consumer released it (at send time) is overwritten by the
  very next send, and a consumer that reads its held handoff only after it received that next
  one sees the other's bytes.
- Counts, not timings: segments made (the pool's ``made``), mappings the consumer opened (its
  import cache's ``opens``), slots in use.
- Exhaustion: the blocked send is observed through the pool refusing (an Event), and proceeds
  only after the consumer was told (another Event) to release.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest

from conftest import Proc
from hurray_ipc import DeviceError, InvalidArgument, Producer, workload
from hurray_ipc.devices import CpuDevice
from hurray_ipc.interop.staging import MIN_SLOT, StagingExhausted, StagingPool
from hurray_ipc.workload import SPAWN
from workers import hold_first_then_receive

SIZE = 4096
TAG = 24


def segments() -> set[str]:
    """This process's CPU shared-memory segments (devices/shm.py names: kind c)."""
    prefix = f"hurray-{os.getuid()}-{os.getpid()}-c"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def data(seq: int, nbytes: int = SIZE) -> np.ndarray:
    return workload.pattern(TAG, seq, nbytes).copy()  # a new array each send, as a user makes them


def holder(broker: Any, channel: str, count: int, go: Any = None) -> tuple[Proc, Any]:
    held = SPAWN.Event()
    return Proc(hold_first_then_receive, endpoint=broker.endpoint, channel=channel, count=count, held=held,
                go=go), held


def check(r: dict[str, Any], count: int) -> None:
    assert "error" not in r, r.get("trace")
    assert r["others"] == [(TAG, seq, True) for seq in range(1, count + 1)], r["others"]


def test_a_held_handoff_keeps_its_bytes_while_later_sends_of_its_size_class_go(broker):
    before = segments()
    c, held = holder(broker, "keep", 3)
    with Producer(broker.endpoint, "keep", "cpu") as p:
        p.send(data(0), timeout=10)  # A, in slot S: the consumer holds it
        assert held.wait(20)
        for seq in range(1, 4):  # same size class: S must not be among the slots they take
            p.send(data(seq), timeout=10)
        r = c.result()
        assert "error" not in r, r.get("trace")
        assert r["first"] == data(0).tobytes(), "A arrived wrong"
        assert r["last"] == r["first"], "A's slot was written while its consumer held it"
        check(r, 3)
        p.flush(10)
        assert p.staging.in_use == 0
    assert segments() <= before, "a slot was left behind after close"


def test_steady_state_creates_no_segment_and_the_consumer_maps_each_slot_once(broker):
    n = 30
    before = segments()
    c, held = holder(broker, "steady", n)
    with Producer(broker.endpoint, "steady", "cpu") as p:
        p.send(data(0), timeout=10)
        assert held.wait(20)
        for seq in range(1, n + 1):
            p.send(data(seq), timeout=10)
        r = c.result()
        check(r, n)
        made = p.staging._slots.made
        # The held A, plus the few in flight at once (a send returns when the broker accepted it,
        # before its release came back): a handful, not one per send.
        assert made <= 4, f"{made} segments for {n + 1} same-size sends"
        assert r["opens"] == made, f"the consumer opened {r['opens']} mappings for {made} slots"
        assert p.staging.in_use == 0
    assert segments() <= before, "a slot was left behind after close"


@pytest.mark.parametrize("how", ["send", "send_many"])
def test_a_failed_send_gives_its_slot_back_for_the_next(broker, monkeypatch, how):
    before = segments()
    c, held = holder(broker, f"fail-{how}", 1)
    with Producer(broker.endpoint, f"fail-{how}", "cpu") as p:
        real = CpuDevice.export_memory
        calls = [0]

        def fail_first(self: CpuDevice, buf: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                raise DeviceError("export", "injected")
            return real(self, buf)

        monkeypatch.setattr(CpuDevice, "export_memory", fail_first)
        with pytest.raises(DeviceError, match="injected"):
            if how == "send":
                p.send(data(99), timeout=10)
            else:
                p.send_many([data(99)], timeout=10)
        assert p.staging.in_use == 0, "the failed send kept its slot"
        assert p.staging._slots.made == 1
        p.send(data(0), timeout=10)
        assert held.wait(20)
        p.send(data(1), timeout=10)
        r = c.result()
        check(r, 1)
        assert r["first"] == data(0).tobytes()
        assert p.staging._slots.made == 2, "the failed send's slot was not reused"  # A's and the last one's
    assert segments() <= before


def test_an_exhausted_pool_waits_for_a_release_then_proceeds(broker, monkeypatch):
    go = SPAWN.Event()
    c, held = holder(broker, "full", 1, go=go)
    with Producer(broker.endpoint, "full", "cpu") as p:
        p.staging.max_bytes = MIN_SLOT  # one slot
        p.send(data(0), timeout=10)  # A takes it; the consumer holds A until go
        assert held.wait(20)
        refused = threading.Event()
        real = StagingPool.acquire

        def watch(self: StagingPool, nbytes: int) -> Any:
            try:
                return real(self, nbytes)
            except StagingExhausted:
                refused.set()
                raise

        monkeypatch.setattr(StagingPool, "acquire", watch)
        done: list[BaseException | None] = []

        def send_b() -> None:
            try:
                p.send(data(1), timeout=10)
                done.append(None)
            except BaseException as e:  # noqa: BLE001 - checked in the test's thread
                done.append(e)

        t = threading.Thread(target=send_b, daemon=True)
        t.start()
        assert refused.wait(20), "B never found the pool full"
        assert not done, "B was sent while A's consumer held the only slot"
        go.set()  # the consumer releases A: its slot comes back, B proceeds
        t.join(20)
        assert done == [None], done
        r = c.result()
        check(r, 1)
        assert r["first"] == data(0).tobytes()
        assert p.staging._slots.made == 1


@pytest.mark.parametrize(("raw", "limit"), [("4096", 4096), ("512M", 512 << 20), ("1G", 1 << 30), ("2GiB", 2 << 30),
                                            ("1.5G", 3 << 29), ("-1", None), ("lots", None)])
def test_the_pool_limit_reads_sizes_as_the_readme_writes_them(monkeypatch, raw, limit):
    """HURRAY_STAGING_BYTES takes bytes or K/M/G (the README's "1 GiB"); anything else is refused
    naming the variable (it was a bare int() ValueError)."""
    monkeypatch.setenv("HURRAY_STAGING_BYTES", raw)
    if limit is None:
        with pytest.raises(InvalidArgument, match=r"^HURRAY_STAGING_BYTES: .* is not a byte count: expected e\.g\."):
            StagingPool(CpuDevice())
    else:
        assert StagingPool(CpuDevice()).max_bytes == limit


def test_an_array_larger_than_the_pool_is_refused_up_front_naming_the_limit(broker):
    with Producer(broker.endpoint, "big", "cpu") as p:
        p.staging.max_bytes = MIN_SLOT
        with pytest.raises(InvalidArgument, match=r"HURRAY_STAGING_BYTES") as e:
            p.send(np.zeros(MIN_SLOT + 1, np.uint8), timeout=5)
        assert f"at most {MIN_SLOT} bytes" in str(e.value)
        assert not p.grants and not p._out and p.credits.asked == 0  # refused before a grant was asked for
        assert p.staging._slots.made == 0


def _lend(pool: StagingPool) -> Any:
    def host_slot(nbytes: int) -> Any:
        slot = pool.acquire(nbytes)
        return slot, lambda: pool.release(slot)
    return host_slot


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_the_copy_is_the_slots_first_nbytes_with_the_arrays_own_shape_and_dtype(kind):
    """The handoff describes the array, not the slot's size class, and exports as the slot's
    segment at offset 0 (so a consumer's import cache, keyed by segment, hits when it comes back)."""
    from hurray_ipc.interop.source import resolve

    if kind == "torch":
        torch = pytest.importorskip("torch")
        obj: Any = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
        expect = obj.numpy().tobytes()
    else:
        obj = np.arange(1000, dtype=np.float32).reshape(10, 100)
        expect = obj.tobytes()
    cpu = CpuDevice()
    pool = StagingPool(cpu)
    try:
        src = resolve(obj, _lend(pool), None, None, None)
        assert src.copied and src.slot is not None and src.slot.size == MIN_SLOT
        assert src.buffer.size == 4000 and src.buffer.ptr == src.slot.ptr
        assert (src.typestr, src.shape) == ("<f4", (10, 100))
        assert bytes(src.buffer.host_view()) == expect
        exp, slot_exp = cpu.export_memory(src.buffer), cpu.export_memory(src.slot)
        assert (exp.blob, exp.offset, exp.size) == (slot_exp.blob, 0, 4000)
        src.free()
        src.free()  # once only: a second free gives nothing back twice
        assert pool.in_use == 0 and pool.slots() == [src.slot]  # idle, for the next copy
        again = resolve(obj, _lend(pool), None, None, None)
        assert again.slot is src.slot and cpu.export_memory(again.buffer).blob == exp.blob
        again.free()
        # The slot remembers its view of the last size it lent: another size in the same slot
        # gets a view of its own size, and the first size again its own bytes.
        small = np.arange(100, dtype=np.float32)
        for x, n, want in ((small, 400, small.tobytes()), (obj, 4000, expect)):
            other = resolve(x, _lend(pool), None, None, None)
            assert other.slot is src.slot and other.buffer.size == n and bytes(other.buffer.host_view()) == want
            assert (cpu.export_memory(other.buffer).size, other.shape) == (n, x.shape)
            other.free()
    finally:
        pool.close()
        cpu.close()


def test_idle_slots_of_a_size_no_longer_sent_are_freed_and_a_size_in_use_keeps_its_own():
    now = [0.0]
    cpu = CpuDevice()
    pool = StagingPool(cpu, idle_s=10, clock=lambda: now[0])
    try:
        a = pool.acquire(SIZE)  # the 64 KiB class, asked for at t=0
        gone = cpu.segment_of(a)[0].name.lstrip("/")
        pool.release(a)
        now[0] = 5
        b = pool.acquire(2 * MIN_SLOT)  # the 128 KiB class, at t=5
        pool.release(b)
        assert {id(s) for s in pool.slots()} == {id(a), id(b)}
        now[0] = 12  # 64 KiB not asked for in 10 s; 128 KiB asked for again now
        assert pool.acquire(2 * MIN_SLOT) is b, "the slot of a size still sent was not reused"
        assert pool.slots() == [b] and pool.total == 2 * MIN_SLOT
        assert gone not in segments(), "the idle slot of a size no longer sent is still in /dev/shm"
        pool.release(b)
    finally:
        pool.close()
        cpu.close()


def test_staging_idle_s_must_be_seconds(monkeypatch):
    monkeypatch.setenv("HURRAY_STAGING_IDLE_S", "soon")
    with pytest.raises(InvalidArgument, match="HURRAY_STAGING_IDLE_S"):
        StagingPool(CpuDevice())
