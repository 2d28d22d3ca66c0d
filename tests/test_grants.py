"""A producer's grants (hurray_ipc/client/grants.py), without a broker: every way a grant ends,
in every order, checked by a hypothesis state machine."""

from __future__ import annotations

import os

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hurray_ipc.client.credits import Credits
from hurray_ipc.client.grants import Grant, GrantBook, Granted
from hurray_ipc.devices.base import DeviceCapabilities, DeviceIdentity
from hurray_ipc.transport.pairing import Endpoint
from hurray_ipc.wire.ipc import Grant as GrantMessage


def _endpoint(pid: int) -> dict:
    return Endpoint(DeviceIdentity("cpu", 0, "cpu-t", "", False, "h"), DeviceCapabilities(True, False), pid).to_dict()


def test_a_grant_of_an_earlier_registration_or_after_end_is_void():
    book = GrantBook(Credits(2))
    book.registering(2)
    assert book.granted(GrantMessage(1, 1, "c", _endpoint(1))) is Granted.VOID
    assert book.granted(GrantMessage(2, 2, "c")) is Granted.UNKNOWN_CONSUMER
    assert book.granted(GrantMessage(3, 2, "c", _endpoint(1))) is Granted.QUEUED
    assert book.granted(GrantMessage(4, 2, "c")) is Granted.QUEUED  # endpoint known now
    g = book.queue.popleft()
    book.registering(3)  # the broker forgot us: both grants are void
    assert not book.queue and book.consumer(g) is None and book.credits.asked == 1  # the queued one, again
    book.give_back(g)
    assert not book.queue
    book.end()
    assert book.registering(4) == 0 and book.granted(GrantMessage(5, 4, "c", _endpoint(1))) is Granted.VOID


class GrantLife(RuleBasedStateMachine):
    """GRANT, REVOKE, take, give back, re-HELLO and END in any order. Invariants: a queued grant
    belongs to this registration, was not revoked, names a consumer whose endpoint is known, and
    nothing is queued after END; credits asked are never negative; a given-back grant is queued
    again exactly when it is still good."""

    @initialize()
    def start(self) -> None:
        self.book = GrantBook(Credits(4))
        self.epoch = 1
        self.book.registering(self.epoch)
        self.ids = 0
        self.revoked: set[int] = set()
        self.taken: list[Grant] = []
        self.known: set[str] = set()

    @rule(consumer=st.sampled_from(["a", "b"]), with_endpoint=st.booleans(), old=st.booleans())
    def grant(self, consumer: str, with_endpoint: bool, old: bool) -> None:
        self.ids += 1
        outcome = self.book.granted(GrantMessage(self.ids, self.epoch - 1 if old else self.epoch, consumer,
                                                 _endpoint(7) if with_endpoint else None))
        if old or self.book.ended:
            assert outcome is Granted.VOID
            return
        if with_endpoint:
            self.known.add(consumer)
        assert outcome is (Granted.QUEUED if consumer in self.known else Granted.UNKNOWN_CONSUMER)

    @precondition(lambda self: self.ids > 0)
    @rule(data=st.data())
    def revoke(self, data: st.DataObject) -> None:  # the broker revokes only grants it issued
        ids = data.draw(st.lists(st.integers(1, self.ids), max_size=3))
        self.revoked |= set(ids)
        self.book.revoked(ids)

    @precondition(lambda self: bool(self.book.queue))
    @rule()
    def take(self) -> None:
        self.taken.append(self.book.queue.popleft())

    @precondition(lambda self: bool(self.taken))
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        g = self.taken.pop(data.draw(st.integers(0, len(self.taken) - 1)))
        before = len(self.book)
        self.book.give_back(g)
        good = g.epoch == self.epoch and not self.book.ended and g.grant_id not in self.revoked
        assert len(self.book) == before + good
        if good:
            assert self.book.queue[0] == g  # the next send takes it first

    @rule()
    def hello_again(self) -> None:
        self.epoch += 1
        self.known.clear()
        self.book.registering(self.epoch)
        assert not self.book.queue

    @rule()
    def end(self) -> None:
        self.book.end()

    @invariant()
    def queued_grants_are_good(self) -> None:
        for g in self.book.queue:
            assert g.epoch == self.epoch and g.grant_id not in self.revoked and g.consumer_id in self.known
            assert self.book.consumer(g) is not None
        assert not (self.book.ended and self.book.queue)
        assert self.book.credits.asked >= 0


# As the broker core's machine: CI runs a fixed set of draws; HURRAY_HYPOTHESIS_EXAMPLES explores.
GrantLife.TestCase.settings = settings(max_examples=int(os.environ.get("HURRAY_HYPOTHESIS_EXAMPLES", "300")),
                                       stateful_step_count=40, deadline=None,
                                       derandomize="HURRAY_HYPOTHESIS_EXAMPLES" not in os.environ)
test_grant_life = GrantLife.TestCase
