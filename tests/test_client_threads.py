"""Client robustness (issue 10, "Clients"): several threads on one Producer/Consumer, contained user
callbacks, finalizers without socket I/O, rejected deliveries returning their credit. In-process
clients through a real broker; every wait is on a message or an event, none on a sleep."""

from __future__ import annotations

import gc
import logging
import os
import select
import threading
import warnings

import numpy as np

from fakebroker import FakeBroker, spin_until
from hurray_ipc.client import Consumer, Producer
from hurray_ipc.client import session as session_mod
from hurray_ipc.client.session import Session
from hurray_ipc.contract.handoff import AlreadyReleasedError
from hurray_ipc.errors import ClosedError, HurrayTimeout
from hurray_ipc.transport.sockets import readable
from hurray_ipc.wire.messages import ChannelState, Ping, Request, Welcome

THREADS = 3
PER_THREAD = 40


def _run_threads(threads: list[threading.Thread], errors: list[BaseException]) -> None:
    """Start them all, wait for each (90 s at most), and fail on one still running or any error."""
    for th in threads:
        th.start()
    for th in threads:
        th.join(90)
    assert not any(th.is_alive() for th in threads), "a client call hung"
    assert errors == [], errors


def test_consumer_and_producer_from_three_threads_each(broker):
    """3 producer threads send and 3 consumer threads receive through one Producer and one
    Consumer: every handoff arrives exactly once with its bytes intact, and no call raises (the
    old check-then-popleft in Session.pull raised IndexError when two receivers raced)."""
    total = THREADS * PER_THREAD
    errors: list[BaseException] = []
    seen: list[int] = []
    seen_lock = threading.Lock()
    with Producer(broker.endpoint, "mt", "cpu", prefetch=2) as p, \
            Consumer(broker.endpoint, "mt", "cpu", prefetch=2) as c:
        def produce(t: int) -> None:
            try:
                for i in range(PER_THREAD):
                    seq = t * PER_THREAD + i
                    p.send(np.full(256, seq, dtype=np.int64), timeout=30)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        def consume() -> None:
            try:
                for _ in range(PER_THREAD):
                    h = c.receive(timeout=30)
                    h.wait()
                    a = h.buffer.numpy()
                    assert a.shape == (256,) and (a == a[0]).all(), "torn or foreign bytes"
                    with seen_lock:
                        seen.append(int(a[0]))
                    h.release()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        _run_threads([threading.Thread(target=produce, args=(t,)) for t in range(THREADS)]
                     + [threading.Thread(target=consume) for _ in range(THREADS)], errors)
        assert sorted(seen) == list(range(total))
        p.flush(10)
        assert p.outstanding == 0


def test_batch_calls_from_three_threads_each(broker):
    """send_many from 3 producer threads, receive_many + release_many from 3 consumer threads on
    one Producer and one Consumer: every handoff arrives exactly once with its bytes intact, no
    call raises, and every release reaches the producer."""
    rounds, per_call = 12, 3
    total = THREADS * rounds * per_call
    errors: list[BaseException] = []
    seen: list[int] = []
    seen_lock = threading.Lock()
    with Producer(broker.endpoint, "mt-many", "cpu", prefetch=4) as p, \
            Consumer(broker.endpoint, "mt-many", "cpu", prefetch=4) as c:
        def produce(t: int) -> None:
            try:
                for r in range(rounds):
                    first = (t * rounds + r) * per_call
                    p.send_many([np.full(256, first + k, dtype=np.int64) for k in range(per_call)], timeout=30)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        def consume() -> None:
            try:
                while True:
                    with seen_lock:
                        if len(seen) >= total or errors:
                            return
                    try:
                        hs = c.receive_many(per_call + 1, timeout=0.5)  # the bound only lets it look at `seen`
                    except HurrayTimeout:
                        continue
                    for h in hs:
                        a = h.buffer.numpy()
                        assert a.shape == (256,) and (a == a[0]).all(), "torn or foreign bytes"
                        with seen_lock:
                            seen.append(int(a[0]))
                    c.release_many(hs)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        _run_threads([threading.Thread(target=produce, args=(t,)) for t in range(THREADS)]
                     + [threading.Thread(target=consume) for _ in range(THREADS)], errors)
        assert sorted(seen) == list(range(total)), "a handoff was lost or delivered twice"
        p.flush(10)
        assert p.outstanding == 0
        assert c.held == 0


def test_release_many_is_all_or_nothing_against_a_release_from_another_thread(broker):
    """release_many checks its list and releases it as one step: a release() of one of its
    handoffs from another thread, issued while the list is being released, waits for the whole
    list and then raises AlreadyReleasedError, instead of slipping in between and leaving
    release_many to fail half done (the check used to run before the lock was taken)."""
    with Producer(broker.endpoint, "mt-all", "cpu") as p, Consumer(broker.endpoint, "mt-all", "cpu", prefetch=2) as c:
        sender = threading.Thread(target=lambda: p.send_many([np.arange(8), np.arange(8)], timeout=10))
        sender.start()  # the grants come once the consumer asks, in its receive
        hs = c.receive_many(2, timeout=10)
        while len(hs) < 2:
            hs += c.receive_many(2 - len(hs), timeout=10)
        sender.join(10)
        h1, h2 = hs
        other_took_h2 = threading.Event()
        outcome: list[object] = []

        def other() -> None:
            try:
                h2.release()
                outcome.append("released")
            except AlreadyReleasedError as e:
                outcome.append(e)

        th = threading.Thread(target=other)
        release_h1, release_h2 = h1._release, h2._release

        def h1_released_first() -> None:  # runs inside release_many, between its check and h2
            th.start()
            # Kept: the other thread cannot take h2 before release_many ends (so this waits out
            # its bound). Broken: it takes h2 at once.
            other_took_h2.wait(2.0)
            release_h1()

        def h2_taken() -> None:
            if threading.current_thread() is th:
                other_took_h2.set()
            release_h2()

        h1._release, h2._release = h1_released_first, h2_taken
        c.release_many([h1, h2])  # raises AlreadyReleasedError when the other thread slipped in
        th.join(10)
        assert not th.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], AlreadyReleasedError), outcome
        assert h1.released and h2.released
        p.flush(10)
        assert p.outstanding == 0


def test_on_release_callback_that_raises_is_contained(broker, caplog):
    """A user's on_release that raises is logged on 'hurray.client' and counted; the unrelated
    call whose pump ran it (here the next send and flush) does not see the exception."""
    before = session_mod.callback_errors
    fired = threading.Event()

    def bad(ticket) -> None:
        fired.set()
        raise ValueError("user bug in on_release")

    caplog.set_level(logging.ERROR, logger="hurray.client")
    with Producer(broker.endpoint, "cb", "cpu") as p, Consumer(broker.endpoint, "cb", "cpu") as c:
        th = threading.Thread(target=lambda: p.send(np.zeros(8), on_release=bad, timeout=10))
        th.start()
        c.receive(timeout=10).release()
        th.join(10)
        th2 = threading.Thread(target=lambda: p.send(np.ones(8), timeout=10))
        th2.start()
        h = c.receive(timeout=10)
        h.release()
        th2.join(10)
        p.flush(10)  # must not raise the callback's ValueError
        assert fired.is_set()
    assert session_mod.callback_errors == before + 1
    assert any("user bug in on_release" in (r.exc_text or "") or "raised" in r.getMessage()
               for r in caplog.records if r.name == "hurray.client")


def test_dropped_handoff_warns_and_is_released_by_the_next_pump_not_the_gc(broker):
    """An un-released handoff dropped on the floor: ResourceWarning, no socket send from the
    finalizer (the session's send is counted while gc runs), and the RELEASE reaches the
    producer at the next pump (its on_release fires)."""
    released = threading.Event()
    with Producer(broker.endpoint, "gc", "cpu") as p, Consumer(broker.endpoint, "gc", "cpu", prefetch=0) as c:
        th = threading.Thread(target=lambda: p.send(np.arange(8), on_release=lambda t: released.set(), timeout=10))
        th.start()
        h = c.receive(timeout=10)
        th.join(10)
        sends: list[str] = []
        with c.session.lock:  # the background pump cannot run while we collect
            real = c.session.sock.send_multipart

            def counting(parts, *a, **kw):
                sends.append(parts[0] if parts else b"")
                return real(parts, *a, **kw)

            c.session.sock.send_multipart = counting
            try:
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    del h
                    gc.collect()
                assert any(issubclass(x.category, ResourceWarning) for x in w)
                assert sends == [], "the finalizer sent a message"
                assert len(c._dropped) == 1
            finally:
                c.session.sock.send_multipart = real
        c.session.pump(released.is_set, 10, "waiting for the dropped handoff's release")
        assert not c._dropped and c.held == 0


def test_rejected_delivery_asks_again(broker):
    """A delivery the consumer refuses (it cannot map it) returns its credit: receive() asks
    again and returns the next, good delivery promptly instead of starving until its timeout."""
    with Producer(broker.endpoint, "rej", "cpu") as p, Consumer(broker.endpoint, "rej", "cpu", prefetch=1) as c:
        real_accept = c._accept
        refused = []

        def accept(msg):
            if not refused:
                refused.append(msg.fields().get("token"))
                raise OSError("cannot map this one")
            return real_accept(msg)

        c._accept = accept
        outcomes = []

        def produce() -> None:
            for v in (1, 2):
                t = p.send(np.full(4, v, dtype=np.int32), timeout=10)
                outcomes.append(t)

        th = threading.Thread(target=produce)
        th.start()
        h = c.receive(timeout=5)
        assert refused and (h.buffer.numpy() == 2).all()
        h.release()
        th.join(10)
        p.flush(10)


def test_event_synchronize_on_a_dead_zombie_recorder_raises():
    """The emulated cudaEventSynchronize on an event whose recording process was killed (and is
    not yet reaped: a zombie, which os.kill(pid, 0) calls alive) raises DeviceError instead of
    spinning forever."""
    import os

    from conftest import emu_config
    from hurray_ipc.devices.backend.emulated import EmulatedRuntime
    from hurray_ipc.devices.errors import DeviceError

    rt = EmulatedRuntime(emu_config())
    ev = rt.event_create(interprocess=True)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, left a zombie
        ev.words[1] = 1  # recorded by the dead process, never completed
        ev.words[3] = pid
        outcome: list[BaseException] = []

        def sync() -> None:
            try:
                rt.event_synchronize(ev)
            except BaseException as e:  # noqa: BLE001
                outcome.append(e)

        th = threading.Thread(target=sync, daemon=True)
        th.start()
        th.join(20)
        assert not th.is_alive(), "event_synchronize spun forever on a dead recorder"
        assert len(outcome) == 1 and isinstance(outcome[0], DeviceError)
    finally:
        os.waitpid(pid, 0)
        ev.words[2] = 1  # let any waiter finish
        rt.event_destroy(ev)


# --- waiting threads, without sockets of a real broker ---------------------------------------------
# A fake broker (a ROUTER the test drives) answers the HELLO and then says nothing unless told.
# With a heartbeat of a minute nothing arrives by itself, so a thread that waits between pump
# rounds for anything but what the tests below require sleeps past their 10 s bound.


def _session(fake: FakeBroker, dispatch) -> Session:
    s = Session(fake.endpoint, "consumer", "ch", lambda epoch: {"endpoint": {}}, dispatch, heartbeat_s=60.0,
                timeout_s=120.0)
    assert fake.next()[0] == b"HELLO"
    fake.say(Welcome(session="ab" * 8, heartbeat_ms=60_000, timeout_ms=120_000, fence_ms=120_000))
    s.pump(lambda: s.registered, 10, "registering")
    return s


def _waiting(s: Session, until, what: str, errors: list[BaseException] | None = None) -> threading.Thread:
    """A thread pumping until ``until()``; what it raises goes to ``errors``."""
    def run() -> None:
        try:
            s.pump(until, 30, what)
        except BaseException as e:  # noqa: BLE001
            (errors if errors is not None else []).append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def test_a_thread_waiting_for_a_message_never_keeps_another_from_sending(fake):
    """A waits (for a message only the test would send); B's send must leave at once. A pump that
    slept holding the session lock kept B's send back until its heartbeat (a minute here): a
    producer thread's HANDOFF waited for another thread's wait to end."""
    s = _session(fake, lambda msg: [])
    errors: list[BaseException] = []
    try:
        a = _waiting(s, lambda: False, "waiting for nothing", errors)
        spin_until(lambda: s._leader, "A never slept between rounds")
        s.send(Request(3))
        assert fake.next()[0] == b"REQUEST", "B's send left"
    finally:
        s.close()
    a.join(10)
    assert not a.is_alive(), "close() left a sleeping thread asleep"
    assert [type(e) for e in errors] == [ClosedError], errors


def test_a_message_one_waiting_thread_takes_wakes_the_others(fake):
    """Three threads wait for the first, second and third message; whichever thread drains the
    socket dispatches all of them, and each other thread must look again at once, not at its
    next heartbeat (a minute)."""
    seen: list[object] = []
    s = _session(fake, lambda msg: seen.append(msg) or [])
    try:
        threads = [_waiting(s, lambda n=n: len(seen) >= n, f"waiting for message {n}") for n in (1, 2, 3)]
        spin_until(lambda: s._leader and s._followers == 2, "the three threads never all waited")
        for _ in range(3):
            fake.say(ChannelState(False))
        for th in threads:
            th.join(10)
            assert not th.is_alive(), "a waiting thread slept through what another one dispatched"
    finally:
        s.close()


def _poked(s: Session) -> bool:
    """The wake pipe holds a byte (and is emptied)."""
    if not select.select([s._wake_r], [], [], 0)[0]:
        return False
    os.read(s._wake_r, 4096)
    return True


def test_whoever_takes_what_the_sleeping_thread_waits_on_wakes_it(fake):
    """The leader sleeps on the socket's edge-triggered fd: a pump round of another thread (the
    background pump's) that drains a message, or a send that finds one arrived, consumed the edge
    the leader would wake on, so it must write the wake pipe; so must close(). As if a leader
    slept (no thread does, so nothing else touches the socket or the pipe)."""
    s = _session(fake, lambda msg: [])
    try:
        with s.lock:
            s._leader = True
            s._pump_once(lambda: False, None, [])
            assert not _poked(s), "nothing arrived: no wake"
            fake.say(ChannelState(False))
            spin_until(lambda: readable(s.sock), "the message never arrived")
            s._pump_once(lambda: False, None, [])
            assert _poked(s), "a round dispatched a message and let the leader sleep on"
            fake.say(ChannelState(False))
            spin_until(lambda: readable(s.sock), "the message never arrived")
            s.send(Ping())
            assert _poked(s), "a send found a message arrived and let the leader sleep on"
            s._pump_once(lambda: False, None, [])  # took it
            _poked(s)
            assert not readable(s.sock)
        s.close()
        assert _poked(s), "close() let the leader sleep on (on the fd of a closed socket)"
    finally:
        s._leader = False
        s.close()


def test_a_pump_round_never_blocks_on_a_broker_that_does_not_read(broker):
    """The broker reads a peer only 256 messages ahead (spec §1), and a client sends under its
    session lock: with ZeroMQ's default send high-water mark (1000) a client with more than that
    unread by a stopped broker blocked in send() holding the lock, against the session's rule that
    a pump round never blocks. 20,000 messages of 1 KB also outrun the kernel's socket buffers
    (a few hundred KB by default)."""
    import signal

    from hurray_ipc.wire.ipc import Message

    with Consumer(broker.endpoint, "nohwm", timeout_s=60) as c:
        c.wait_open(timeout=10)
        os.kill(broker.proc.pid, signal.SIGSTOP)
        try:
            def burst() -> None:
                for _ in range(20_000):
                    c.session.queue(Message("PING", {"pad": "x" * 1000}))
                c.session.flush_out()

            t = threading.Thread(target=burst, daemon=True)
            t.start()
            t.join(30)
            blocked = t.is_alive()
        finally:
            os.kill(broker.proc.pid, signal.SIGCONT)
        t.join(30)
        assert not blocked, "flush_out blocked in send() while the broker did not read"
