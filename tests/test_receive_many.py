"""Consumer.receive_many / areceive_many and release_many: a DELIVER batch taken whole, released as one."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest

from hurray_ipc import AlreadyReleasedError, Consumer, EndOfStream, HurrayTimeout, InvalidArgument, Producer


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


@pytest.mark.parametrize("bad", ["twice", "not a handoff", "another consumer's", "a stream on a cpu consumer"])
def test_release_many_is_all_or_nothing(pair, broker, bad):
    """Each bad list is refused with a typed error naming the item, and every handoff of it stays
    held (a failed call gives back what it took: here, it took nothing). Checking item by item
    while releasing releases ``a`` before it meets the bad one: this test then fails."""
    p, c = pair
    _send(p, range(2))
    a = c.receive(timeout=10)
    _queued(c, 1)
    (b,) = c.receive_many(4)
    with contextlib.ExitStack() as other:
        kwargs: dict = {}
        where, match = "release_many(handoffs=)", "item 2"
        if bad == "twice":
            items, match = [a, b, a], "item 2 .* is listed twice"
        elif bad == "not a handoff":
            items = [a, b, "h"]
        elif bad == "another consumer's":
            p2 = other.enter_context(Producer(broker.endpoint, "other", "cpu"))
            c2 = other.enter_context(Consumer(broker.endpoint, "other", "cpu"))
            t = threading.Thread(target=lambda: p2.send(np.zeros(8, np.uint8), block=False, timeout=30))
            t.start()
            foreign = c2.receive(timeout=10)
            t.join(30)
            items, match = [a, b, foreign], "item 2 is not a handoff this consumer received"
        else:
            items, kwargs, where, match = [a, b], {"stream": 7}, "release_many(stream=)", "has no streams"
        with pytest.raises(InvalidArgument, match=match) as e:
            c.release_many(items, **kwargs)
        assert e.value.where == where
        if bad == "another consumer's":
            assert not foreign.released
            foreign.release()
            p2.flush(10)
    assert not a.released and not b.released, "a refused release_many released part of its list"
    sent = c.session.messages_sent
    c.release_many([a, b])
    assert c.session.messages_sent - sent == 1
    p.flush(10)


def test_end_of_stream_mid_batch_gives_what_was_sent_then_ends(pair):
    """The producer ends its stream after 3 sends: receive_many(8) gives the 3 (not an error for
    asking more), the next raises EndOfStream; nothing is lost or doubled."""
    p, c = pair
    _send(p, range(3))
    first = c.receive(timeout=10)
    _queued(c, 2)
    _SENDERS.pop()[0].join(30)
    p.end()
    got = [first, *c.receive_many(8, timeout=10)]
    assert [int(h.numpy()[0]) for h in got] == [0, 1, 2]
    c.release_many(got)
    with pytest.raises(EndOfStream):
        c.receive_many(8, timeout=10)


def test_concurrent_batches_never_share_a_handoff(pair):
    """Two threads take batches from one consumer until 40 handoffs arrived: each handoff comes
    to exactly one of them (the inbox is taken under the session lock)."""
    p, c = pair
    _send(p, range(40))
    seen: list[list[int]] = [[], []]
    stop = threading.Event()

    deadline = time.monotonic() + 60  # a lost handoff fails the assertion below, never hangs the run

    def take(mine: list[int]) -> None:
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                batch = c.receive_many(5, timeout=0.5)
            except HurrayTimeout:
                continue
            mine.extend(int(h.numpy()[0]) for h in batch)
            c.release_many(batch)
            if len(seen[0]) + len(seen[1]) >= 40:
                stop.set()

    workers = [threading.Thread(target=take, args=(m,), daemon=True) for m in seen]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert sorted(seen[0] + seen[1]) == list(range(40))
    p.flush(10)


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
