"""The consumer's core (hurray_ipc/client/core.py), without a broker, socket, thread or device: a
hypothesis state machine plays broker, application and GPU against it, and checks its rules after
every step. Each rule is then broken on purpose (a subclass of the core) and the machine must fail.

The core reads no clock (nothing in it depends on time: fences are events), so the machine has
none; it keeps its own model of the wire: what the session holds queued and what it sent."""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hurray_ipc.client.core import Action, ConsumerCore, Delivery, EventRelease, Flush, Release, Stage, Unmap


class ConsumerMachine(RuleBasedStateMachine):
    """Deliveries (good and rejected), receive, event and buffer releases with 0-2 fences that
    complete in any order, pump rounds, PRODUCER_GONE, CHANNEL_STATE and re-HELLOs, in any order.

    Invariants: each delivery is given back with exactly one RELEASE (none once its producer is
    gone, one with a reason when rejected); a RELEASE goes only after its fences completed, after
    its mapping was closed and after its EVENT_RELEASE; the inbox plus the credits the broker counts
    never exceed ``max(prefetch, 1)``, and the core counts what the broker counts; with an empty
    inbox no RELEASE is held back (queued, unflushed); a re-HELLO declares
    exactly the deliveries still owed, with their events, and the credits asked; a RELEASE after it
    names a token it declared or one delivered since."""

    core_cls: type[ConsumerCore] = ConsumerCore

    @initialize(prefetch=st.integers(0, 3))
    def start(self, prefetch: int) -> None:
        self.core = self.core_cls(prefetch)
        self.prefetch = prefetch
        self.n = 0
        self.next_fence = 1
        self.broker_credits = 0  # credits the broker counts for us: REQUESTs and RELEASE credits, less DELIVERs
        self.inbox: deque[str] = deque()
        self.deliveries: dict[str, Delivery] = {}
        self.taken: list[str] = []  # received (or dropped from the inbox by PRODUCER_GONE): the app's to release
        self.event_owed: set[str] = set()
        self.released: set[str] = set()  # by the application
        self.fences: dict[str, set[int]] = {}
        self.pending: set[int] = set()
        self.done: set[int] = set()
        self.gone: set[str] = set()
        self.rejected: set[str] = set()
        self.unmapped: set[str] = set()
        self.event_sent: set[str] = set()
        self.releases: dict[str, int] = {}  # RELEASEs emitted per token (queued or sent)
        self.queued: list[Action] = []  # the session's outbox: held for the next flush
        self.ended = False
        self.epoch = 1
        self.known: set[str] = set()  # tokens the current registration was told of
        self.core.registering(self.epoch)

    # --- carrying out what the core asks, as the Consumer does --------------------------------
    def apply(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Unmap):
                assert a.token not in self.unmapped, f"{a.token} unmapped twice"
                assert a.token in self.released, f"{a.token} unmapped before the application released it"
                self.unmapped.add(a.token)
            elif isinstance(a, EventRelease):
                assert a.token not in self.event_sent and a.token not in self.gone
                assert a.token not in self.releases, f"EVENT_RELEASE of {a.token} after its RELEASE"
                self.event_sent.add(a.token)
                self.queued.append(a)
            elif isinstance(a, Release):
                self.on_release(a)
                self.broker_credits += a.credits
                self.queued.append(a)
                if a.now:
                    self.flush()
            elif isinstance(a, Flush):
                self.flush()

    def on_release(self, a: Release) -> None:
        t = a.token
        self.releases[t] = self.releases.get(t, 0) + 1
        assert self.releases[t] == 1, f"RELEASE of {t} sent twice"
        assert t not in self.gone, f"RELEASE of {t} after PRODUCER_GONE named it"
        if t in self.rejected:
            assert a.reason is not None and a.now
            return
        assert t in self.known, f"RELEASE of {t}, which this registration was never told of"
        assert t in self.released, f"RELEASE of {t} before the application released it"
        assert self.fences[t] <= self.done, f"RELEASE of {t} before its fences {self.fences[t] - self.done} completed"
        assert t in self.unmapped, f"RELEASE of {t} while its mapping is open"
        assert not self.deliveries[t].event or t in self.event_sent, f"RELEASE of {t} before its EVENT_RELEASE"

    def flush(self) -> None:
        self.queued.clear()

    def token(self) -> str:
        self.n += 1
        return f"t{self.n}"

    # --- the broker -----------------------------------------------------------------------
    @rule()
    def receive_asks(self) -> None:  # Session.pull's round: REQUEST what want() says
        n = self.core.want_request()
        if n > 0:
            self.core.requested(n)
            self.broker_credits += n

    @precondition(lambda self: self.broker_credits > 0)
    @rule(event=st.booleans())
    def deliver(self, event: bool) -> None:
        d = Delivery(self.token(), "p", self.n, event)
        self.broker_credits -= 1
        self.core.delivered(d)
        self.deliveries[d.token] = d
        self.inbox.append(d.token)
        self.known.add(d.token)
        if event:
            self.event_owed.add(d.token)

    @precondition(lambda self: self.broker_credits > 0)
    @rule()
    def reject(self) -> None:
        t = self.token()
        self.broker_credits -= 1
        self.rejected.add(t)
        self.known.add(t)
        self.apply(self.core.rejected(t, "rejected: bad handle"))
        assert self.releases.get(t) == 1, "a rejected delivery was not refused at once"

    @precondition(lambda self: bool(self.deliveries))
    @rule(data=st.data())
    def producer_gone(self, data: st.DataObject) -> None:
        tokens = data.draw(st.lists(st.sampled_from(sorted(self.deliveries)), min_size=1, max_size=3, unique=True))
        self.gone |= set(tokens)
        dropped, actions = self.core.producer_gone(tokens + ["unknown-token"])
        assert set(dropped) == {t for t in tokens if t in self.inbox}
        for t in dropped:
            self.inbox.remove(t)
            self.taken.append(t)  # its owner (the garbage collector's pump) releases it
        self.apply(actions)

    @rule(ended=st.booleans())
    def channel_state(self, ended: bool) -> None:
        self.ended = ended
        self.core.channel_state(ended)

    @rule()
    def hello_again(self) -> None:
        self.flush()  # Session.send(HELLO) sends what is queued first
        self.epoch += 1
        hello = self.core.registering(self.epoch)
        owed = {t for t in self.deliveries if not self.releases.get(t) and t not in self.gone}
        assert {h.token for h in hello["held"]} == owed, "HELLO does not list exactly what is owed"
        assert len(hello["held"]) == len(owed), "HELLO lists a delivery twice"
        for h in hello["held"]:
            d = self.deliveries[h.token]
            assert (h.producer_id, h.handoff_id) == (d.producer_id, d.handoff_id)
            assert h.event_pending == (h.token in self.event_owed), f"{h.token}: event_pending wrong"
        assert hello["credits"] == self.broker_credits, "HELLO does not re-declare the credits asked"
        assert hello.get("ended", False) == self.ended
        self.broker_credits = hello["credits"]  # the new registration counts these
        self.known = owed

    # --- the application and its GPU -------------------------------------------------------
    @precondition(lambda self: bool(self.inbox))
    @rule()
    def take(self) -> None:
        token, actions = self.core.taken()
        assert token == self.inbox.popleft(), "receive() did not get the oldest delivery"
        self.taken.append(token)
        self.apply(actions)

    @precondition(lambda self: bool(self.event_owed & set(self.taken)))
    @rule(data=st.data())
    def wait_event(self, data: st.DataObject) -> None:
        t = data.draw(st.sampled_from(sorted(self.event_owed & set(self.taken))))
        self.event_owed.discard(t)
        self.apply(self.core.event_released(t))

    @precondition(lambda self: bool(self.taken))
    @rule(data=st.data(), n_fences=st.integers(0, 2))
    def release(self, data: st.DataObject, n_fences: int) -> None:
        t = self.taken.pop(data.draw(st.integers(0, len(self.taken) - 1)))
        self._release(t, n_fences)

    @precondition(lambda self: bool(self.inbox))
    @rule(n_fences=st.integers(1, 2))
    def receive_work_release(self, n_fences: int) -> None:  # the common life: one step, fenced
        self.take()
        t = self.taken.pop()
        if t in self.event_owed:
            self.event_owed.discard(t)
            self.apply(self.core.event_released(t))
        self._release(t, n_fences)

    @precondition(lambda self: bool(self.inbox))
    @rule(data=st.data())
    def release_unreceived(self, data: st.DataObject) -> None:  # Consumer.close()
        t = data.draw(st.sampled_from(list(self.inbox)))
        self.inbox.remove(t)
        self._release(t, 0)

    def _release(self, t: str, n_fences: int) -> None:
        ids = set(range(self.next_fence, self.next_fence + n_fences))
        self.next_fence += n_fences
        self.fences[t] = ids
        self.pending |= ids
        self.released.add(t)
        self.event_owed.discard(t)  # Handoff.release() releases an owed event first
        self.apply(self.core.released(t, sorted(ids)))
        self.apply(self.core.released(t, []))  # a second release: nothing more

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def fence_completes(self, data: st.DataObject) -> None:
        f = data.draw(st.sampled_from(sorted(self.pending)))
        self.pending.discard(f)
        self.done.add(f)
        self.apply(self.core.fence_completed(f))

    def _multi_fenced(self) -> list[int]:
        return [max(fs & self.pending) for fs in self.fences.values() if len(fs & self.pending) > 1]

    @precondition(lambda self: bool(self._multi_fenced()))
    @rule()
    def streams_finish_out_of_order(self) -> None:  # the last stream fenced finishes first
        f = self._multi_fenced()[0]
        self.pending.discard(f)
        self.done.add(f)
        self.apply(self.core.fence_completed(f))

    @rule()
    def pump_round(self) -> None:
        assert set(self.core.pending_fences()) <= self.pending, "the core waits on a fence never recorded"
        self.flush()  # a round that waits on the socket flushes what is queued first

    # --- invariants ------------------------------------------------------------------------
    @invariant()
    def within_prefetch(self) -> None:
        if not hasattr(self, "core"):
            return
        assert list(self.core.inbox) == list(self.inbox)
        assert self.core.credits.asked == self.broker_credits, "the core and the broker count different credits"
        assert len(self.inbox) + self.broker_credits <= max(self.prefetch, 1), \
            f"{len(self.inbox)} waiting + {self.broker_credits} asked > prefetch {self.prefetch}"

    @invariant()
    def nothing_held_back_with_an_empty_inbox(self) -> None:
        if not hasattr(self, "core") or self.inbox:
            return
        assert not any(isinstance(a, Release) for a in self.queued), "a RELEASE is held back, the inbox empty"

    @invariant()
    def each_delivery_released_once(self) -> None:
        if not hasattr(self, "core"):
            return
        for t in self.rejected:
            assert self.releases.get(t) == 1
        owed = 0
        for t in self.deliveries:
            ready = t in self.released and self.fences[t] <= self.done and t not in self.gone
            sent = self.releases.get(t, 0)
            assert sent <= 1
            if ready:
                assert sent == 1, f"{t}: its fences completed and it was never released"
            if not sent and t not in self.gone:
                owed += 1
            if t in self.released and self.fences[t] <= self.done:
                assert t in self.unmapped, f"{t}: its fences completed and its mapping stays open"
        assert self.core.held == owed, f"the core counts {self.core.held} deliveries owed, not {owed}"


# CI runs a fixed set of draws (a red run is a regression); HURRAY_HYPOTHESIS_EXAMPLES explores.
EXAMPLES = int(os.environ.get("HURRAY_HYPOTHESIS_EXAMPLES", "300"))
ConsumerMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                                             derandomize="HURRAY_HYPOTHESIS_EXAMPLES" not in os.environ,
                                             suppress_health_check=[HealthCheck.too_slow])
TestConsumerCore = ConsumerMachine.TestCase


# --- each rule, broken: the machine must notice ------------------------------------------------

class ReleasesTwice(ConsumerCore):
    def released(self, token: str, fences: Any = ()) -> list[Action]:
        out = super().released(token, fences)
        return out + [a for a in out if isinstance(a, Release)]


class ReleasesBeforeFences(ConsumerCore):
    def released(self, token: str, fences: Any = ()) -> list[Action]:
        return super().released(token, ())


class WaitsOnTheLastFenceOnly(ConsumerCore):
    def released(self, token: str, fences: Any = ()) -> list[Action]:
        return super().released(token, list(fences)[-1:])  # "last recorded, last done": not across streams


class IgnoresPrefetch(ConsumerCore):
    def want_request(self) -> int:
        return self.credits.want(0, at_least=1)  # the deliveries waiting in the inbox not counted


class KeepsReleasesWhenInboxEmpties(ConsumerCore):
    def _inbox_shrank(self) -> list[Action]:
        return []  # RELEASEs stay queued unflushed until some later round


class ForgetsReleasingOnReHello(ConsumerCore):
    def registering(self, epoch: int) -> dict[str, Any]:
        hello = super().registering(epoch)
        hello["held"] = [h for h in hello["held"] if self.stage(h.token) in (Stage.INBOX, Stage.HELD)]
        return hello


class ForgetsCreditsOnReHello(ConsumerCore):
    def registering(self, epoch: int) -> dict[str, Any]:
        return {**super().registering(epoch), "credits": 0}


class ReleasesBeforeUnmap(ConsumerCore):
    def _advance(self, e: Any) -> list[Action]:
        out = super()._advance(e)
        return [a for a in out if not isinstance(a, Unmap)] + [a for a in out if isinstance(a, Unmap)]


class ReleasesAfterProducerGone(ConsumerCore):
    def _advance(self, e: Any) -> list[Action]:
        if e.gone and e.stage is Stage.FENCED and not e.fences:
            e.gone = False  # gives back what nobody waits for any more
            self._gone -= 1
        return super()._advance(e)


@pytest.mark.parametrize(("broken", "caught"), [
    (ReleasesTwice, "sent twice"),
    (ReleasesBeforeFences, "before its fences"),
    (WaitsOnTheLastFenceOnly, "before its fences"),
    (IgnoresPrefetch, "> prefetch"),
    (KeepsReleasesWhenInboxEmpties, "held back, the inbox empty"),
    (ForgetsReleasingOnReHello, "HELLO does not list exactly what is owed"),
    (ForgetsCreditsOnReHello, "HELLO does not re-declare the credits"),
    (ReleasesBeforeUnmap, "while its mapping is open"),
    (ReleasesAfterProducerGone, "after PRODUCER_GONE"),
], ids=lambda x: x.__name__ if isinstance(x, type) else "")
def test_the_machine_catches_a_broken_core(broken: type[ConsumerCore], caught: str) -> None:
    """Deterministic (derandomized draws): the same interleaving catches it on every run."""
    machine = type(f"{broken.__name__}Machine", (ConsumerMachine,), {"core_cls": broken})
    with pytest.raises(AssertionError, match=caught):
        run_state_machine_as_test(machine, settings=settings(
            max_examples=300, stateful_step_count=40, deadline=None, derandomize=True, database=None,
            phases=[Phase.generate], suppress_health_check=list(HealthCheck)))


def test_a_mapping_that_will_not_close_is_never_given_back_and_stays_declared() -> None:
    """Its memory may still be mapped here: no RELEASE, a second release does nothing, and every
    re-HELLO lists it as held, so that no broker (a restarted one included) hands it back."""
    core = ConsumerCore(prefetch=1)
    core.requested(1)
    d = Delivery("t" * 48, "p", 7, event=False)
    core.delivered(d)
    core.taken()
    out = core.released(d.token)
    assert out[0] == Unmap(d.token, d) and isinstance(out[1], Release), out
    core.unmap_failed(d)  # the consumer could not close it: it drops the Release that followed
    assert core.stage(d.token) is Stage.KEPT and core.held == 1
    assert core.released(d.token) == [] and core.fence_completed(1) == []
    assert [h.token for h in core.registering(2)["held"]] == [d.token]
