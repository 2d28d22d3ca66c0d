"""Consumer.receive_many / areceive_many and release_many: a DELIVER batch taken whole, released as one."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from hurray_ipc import AlreadyReleasedError, Consumer, HurrayTimeout, InvalidArgument, Producer


def _queued(c: Consumer, n: int) -> None:
    """Pump until ``n`` deliveries wait in the consumer's inbox (what the broker sent, received)."""
    c.session.pump(lambda: len(c.core.inbox) >= n, 10, f"waiting for {n} deliveries")


@pytest.fixture
def pair(broker):
    with Producer(broker.endpoint, "many", "cpu", prefetch=8) as p, \
            Consumer(broker.endpoint, "many", "cpu", prefetch=8) as c:
        yield p, c


def _send(p: Producer, values: range) -> list:
    """Send ``values`` from a thread (each send waits for a consumer's credit, granted once this
    thread's consumer asks); the tickets once every send returned."""
    tickets: list = []
    t = threading.Thread(target=lambda: tickets.extend(p.send(np.full(64, v, dtype=np.uint8), block=False,
                                                              timeout=30) for v in values))
    t.start()
    _SENDERS.append((t, tickets))
    return tickets


_SENDERS: list = []


@pytest.fixture(autouse=True)
def _senders_joined():
    yield
    while _SENDERS:
        _SENDERS.pop()[0].join(30)


def test_a_delivered_batch_comes_back_whole_in_order_and_up_to_max_n(pair):
    p, c = pair
    _send(p, range(6))
    first = c.receive(timeout=10)  # asks for the prefetch: the other five are delivered
    _queued(c, 5)
    two = c.receive_many(2, timeout=10)
    rest = c.receive_many(8, timeout=10)
    got = [first, *two, *rest]
    assert len(two) == 2 and len(rest) == 3 and not c.core.inbox
    assert [int(h.numpy()[0]) for h in got] == list(range(6))
    c.release_many(got)
    p.flush(10)


def test_a_batch_is_released_in_one_message(pair):
    p, c = pair
    tickets = _send(p, range(5))
    batch = [c.receive(timeout=10)]
    _queued(c, 4)
    batch += c.receive_many(8, timeout=10)
    assert len(batch) == 5
    sent = c.session.messages_sent
    c.release_many(batch)
    assert c.session.messages_sent - sent == 1, "five RELEASEs left as more than one message"
    _SENDERS[-1][0].join(30)
    p.flush(10)
    assert len(tickets) == 5 and all(t.released for t in tickets)


def test_bad_max_n_is_refused_and_takes_nothing(pair):
    p, c = pair
    _send(p, range(2))
    c.receive(timeout=10).release()
    _queued(c, 1)
    for bad in (0, -1, True, "3", 1.5):
        with pytest.raises(InvalidArgument, match="max_n") as e:
            c.receive_many(bad)
        assert e.value.where == "receive_many(max_n=)"
    assert len(c.core.inbox) == 1
    c.receive_many(1)[0].release()


def test_release_many_refuses_a_released_handoff_and_releases_none(pair):
    p, c = pair
    _send(p, range(2))
    a = c.receive(timeout=10)
    _queued(c, 1)
    (b,) = c.receive_many(4)
    a.release()
    with pytest.raises(AlreadyReleasedError):
        c.release_many([b, a])
    assert not b.released
    c.release_many([b])


def test_nothing_to_receive_times_out(pair):
    _, c = pair
    with pytest.raises(HurrayTimeout):
        c.receive_many(4, timeout=0.2)


def test_the_async_twin_takes_the_batch_on_the_loop(pair):
    p, c = pair
    _send(p, range(3))

    async def main():
        first = await c.areceive(timeout=10)
        _queued(c, 2)
        return [first, *await c.areceive_many(8, timeout=10)]

    got = asyncio.run(main())
    assert [int(h.numpy()[0]) for h in got] == [0, 1, 2]
    c.release_many(got)
