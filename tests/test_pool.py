"""hurray_ipc/devices/pool.py: the one free list behind the event, staging and destination pools."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hurray_ipc.devices.errors import DeviceError
from hurray_ipc.devices.pool import Pool


class Res:
    def __init__(self, key: int):
        self.key, self.alive = key, True


def _pool(keep: int | None = None) -> tuple[Pool[int, Res], list[Res]]:
    made: list[Res] = []

    def make(key: int) -> Res:
        made.append(Res(key))
        return made[-1]

    def destroy(r: Res) -> None:
        assert r.alive, "destroyed twice"
        r.alive = False

    return Pool(make, destroy, lambda r: r.key, keep=keep, what="test"), made


def test_an_item_given_back_is_reused_for_its_key_only():
    pool, made = _pool()
    a = pool.take(1)
    pool.give(a)
    assert pool.take(1) is a and pool.take(2) is not a and pool.made == 2 == len(made)


def test_keep_bounds_the_idle_items_per_key():
    pool, made = _pool(keep=1)
    a, b = pool.take(1), pool.take(1)
    pool.give(a)
    pool.give(b)
    assert a.alive and not b.alive and pool.idle == 1 and pool.out == 0
    pool0, _ = _pool(keep=0)
    c = pool0.take(1)
    pool0.give(c)
    assert not c.alive and pool0.idle == 0


def test_twice_or_a_stranger_is_refused_and_changes_nothing():
    pool, _ = _pool()
    a = pool.take(1)
    pool.give(a)
    for bad in (lambda: pool.give(a), lambda: pool.discard(a), lambda: pool.give(Res(1))):
        with pytest.raises(DeviceError, match="twice, or not from this pool"):
            bad()
    assert pool.idle == 1 and pool.out == 0 and a.alive


def test_a_make_that_raises_takes_nothing():
    def make(key: int) -> Res:
        raise DeviceError("test", "out of memory")

    pool: Pool[int, Res] = Pool(make, lambda r: None, lambda r: r.key)
    with pytest.raises(DeviceError, match="out of memory"):
        pool.take(1)
    assert pool.out == 0 and pool.made == 0


def test_trim_spares_a_key_and_stops_when_enough():
    pool, _ = _pool()
    items = [pool.take(k) for k in (1, 1, 2, 3)]
    for r in items:
        pool.give(r)
    pool.trim(lambda: sum(r.alive for r in items) <= 2, spare=1)
    assert [r.alive for r in items] == [True, True, False, False]


def test_close_goes_on_past_an_item_that_will_not_close(caplog):
    """One destroy that raises is logged; the other items are still destroyed."""
    closed: list[int] = []

    def destroy(r: Res) -> None:
        if r.key == 1:
            raise DeviceError("test", "cannot close")
        closed.append(r.key)

    pool: Pool[int, Res] = Pool(Res, destroy, lambda r: r.key, what="test")
    items = [pool.take(k) for k in (0, 1, 2)]
    pool.give(items[0])
    pool.close()
    assert sorted(closed) == [0, 2] and pool.out == 0 and pool.idle == 0
    assert "destroying an item failed" in caplog.text


class PoolMachine(RuleBasedStateMachine):
    """Every item is alive exactly while it is out or idle; out and idle never overlap; idle per key
    never exceeds ``keep``; close destroys everything once."""

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.made = _pool(keep=2)
        self.out: list[Res] = []

    @rule(key=st.integers(0, 2))
    def take(self, key: int) -> None:
        r = self.pool.take(key)
        assert r.alive and r not in self.out and r.key == key
        self.out.append(r)

    @precondition(lambda self: self.out)
    @rule(i=st.integers(0, 100), discard=st.booleans())
    def back(self, i: int, discard: bool) -> None:
        r = self.out.pop(i % len(self.out))
        (self.pool.discard if discard else self.pool.give)(r)
        assert not (discard and r.alive), "a discarded item must be destroyed"

    @rule()
    def close(self) -> None:
        self.pool.close()
        self.out.clear()
        assert not any(r.alive for r in self.made)

    @invariant()
    def accounted(self) -> None:
        assert self.pool.out == len(self.out)
        assert sum(r.alive for r in self.made) == self.pool.out + self.pool.idle
        assert all(r.alive for r in self.out)
        assert all(len(v) <= 2 for v in self.pool._idle.values())


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=200, stateful_step_count=30, derandomize=True, deadline=None)
