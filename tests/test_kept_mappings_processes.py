"""Kept mappings (docs/spec/ipc-protocol.md §4.10), end to end: producer and consumer processes on
the emulated runtime, whose race checker fails each broken variant every time (the free of a kept
allocation must be ordered after every consumer's close of its mapping); an old broker, an old
consumer, a stranger label, a refused UNMAP, a broker restart with a round open. The broker's
rounds without sockets and the import cache are in tests/test_kept_mappings.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest

import workers
from brokerproc import BrokerProcess
from conftest import SPAWN, Proc, emu_env, emulated_gpu
from hurray_ipc.client import Consumer, Producer
from hurray_ipc.errors import EndOfStream
from hurray_ipc.workload import emulated_races

DELAYS = pytest.mark.parametrize("delay", [0.0, 0.02], ids=["delay0", "delay20ms"])


def _run(broker, delay, breaks_p=None, breaks_c=None, allocs=2, rounds=3, size=4096, env=None):
    """A producer and a consumer process hand ``allocs`` buffers over ``rounds`` times each
    (workers.kept_producer / kept_consumer: the variants named there) and report. ``env``: more
    variables for both."""
    done = SPAWN.Event()
    # The producer closes its buffers (and asks them back) only once the consumer counted what it
    # keeps, and, in the leaving variants, said BYE, whatever the timing: an UNMAP answered
    # earlier would have closed what is counted, or left no leaving to test.
    counted = SPAWN.Event()
    env = {**emu_env(op_delay_s=delay), **(env or {})}
    n = allocs * rounds
    c = Proc(workers.kept_consumer, endpoint=broker.endpoint, channel="kept", env=env, count=n, size=size, done=done,
             breaks=breaks_c, counted=counted)
    p = Proc(workers.kept_producer, endpoint=broker.endpoint, channel="kept", env=env, allocs=allocs, rounds=rounds,
             size=size, done=done, breaks=breaks_p, consumer_counted=counted)
    pr, cr = p.result(), c.result()
    assert isinstance(pr, dict) and "error" not in pr, pr
    assert isinstance(cr, dict) and "error" not in cr, cr
    assert cr["values"] == [(r * allocs + i) & 0xFF for r in range(rounds) for i in range(allocs)], cr
    return pr, cr


@DELAYS
def test_a_consumer_opens_each_kept_allocation_once_and_its_producer_frees_it_after_asking(broker, delay):
    pr, cr = _run(broker, delay)
    assert cr["opens"] == 2 and cr["kept"] == 2, "one open per allocation, not per handoff; kept idle after"
    assert cr["left"] == 0, "both closed when asked back"
    assert pr["kept"] == 2 and pr["left"] == 0 and pr["retired"] == 0, "both asked back, answered and freed"
    assert pr["races"] == cr["races"] == 0


# The rule each variant breaks -> (the producer's variant, the consumer's).
BROKEN = {
    "the free not waiting for the consumers": ("free-at-close", None),
    "UNMAPPED sent before the close": (None, "answer-first"),
    "a mapping kept without its producer's promise": ("device-memory", "keep-everything"),
    "BYE with kept mappings open": (None, "bye-with-mappings"),
}


@DELAYS
@pytest.mark.races_expected
@pytest.mark.parametrize("rule", list(BROKEN))
def test_each_rule_broken_is_caught_every_time(broker, delay, rule):
    """Each broken variant leaves the free of both allocations unordered with a close of their
    mappings: the race checker reports both, whichever ran first."""
    breaks_p, breaks_c = BROKEN[rule]
    pr, cr = _run(broker, delay, breaks_p=breaks_p, breaks_c=breaks_c)
    assert pr["races"] + cr["races"] == 2, (pr, cr)


@DELAYS
def test_memory_its_producer_does_not_own_is_never_kept(broker, delay):
    pr, cr = _run(broker, delay, breaks_p="device-memory")
    assert cr["opens"] == 6 and cr["kept"] == 0, "closed at each release: no keep promise was made"
    assert pr["kept"] == 0 and pr["races"] == cr["races"] == 0


@DELAYS
def test_a_consumer_that_leaves_closes_its_kept_mappings_before_its_bye(broker, delay):
    """The broker answers for it as gone, so its producer frees at once: after the close."""
    pr, cr = _run(broker, delay, breaks_c="leave-first")
    assert cr["kept"] == 2 and cr["left"] == 0 and pr["left"] == pr["retired"] == 0
    assert pr["races"] == cr["races"] == 0


@DELAYS
def test_an_allocation_a_consumer_cannot_be_answered_for_stays_allocated(broker, delay):
    """A label the broker never saw register (a consumer of the broker before a restart) is
    fenced: its allocation is never freed while the producer lives; the consumer it could ask
    still closed its mapping."""
    pr, cr = _run(broker, delay, breaks_p="stranger")
    assert pr["retired"] == pr["left"] == 2 and cr["left"] == 0
    assert pr["races"] == cr["races"] == 0


def test_a_producer_leaving_without_waiting_keeps_its_allocations_and_says_so_once(broker):
    """A producer that fails inside its with-block closes without waiting (timeout 0): what its
    consumers may still map stays allocated until the process exits (whether they answered the
    UNMAP it sent or not), said in one warning that counts the allocations and says why (not one
    per allocation blaming the consumers)."""
    pr, cr = _run(broker, 0.0, breaks_p="raise-inside", allocs=4, rounds=1)
    assert pr["kept"] == pr["retired"] == pr["left"] == 4
    assert len(pr["warnings"]) == 1, pr["warnings"]
    assert pr["warnings"][0].startswith("closing: 4 allocation(s) of allocate()") and "without waiting" in \
        pr["warnings"][0], pr["warnings"]
    assert pr["races"] == cr["races"] == 0


def test_a_producer_interrupted_while_its_consumers_unmap_disconnects_and_frees_its_pools(broker):
    """A Ctrl-C while close() waits for the UNMAP answers: the allocations asked back are retired
    (said in one warning), the producer disconnects, and its idle pooled events and host slots are
    freed, although close() raises KeyboardInterrupt. An application that catches it and lives on
    (a notebook) keeps no staging segment in /dev/shm and no event for them. The consumer never
    answers UNMAP, so the rounds are still open when the Ctrl-C comes, whatever the timing."""
    pr, cr = _run(broker, 0.0, breaks_p="interrupt-in-wait", breaks_c="deaf-to-unmap", allocs=2, rounds=1,
                  env={"HURRAY_EVENT_POOL": "1"})
    assert pr["kept"] == pr["retired"] == pr["left"] == 2
    assert len(pr["warnings"]) == 1 and "the producer was interrupted" in pr["warnings"][0], pr["warnings"]
    assert pr["pooled"][0] == 1 and pr["pooled"][1] > 0, pr["pooled"]  # what there was to free
    assert pr["disconnected"] and pr["after"] == (0, 0), pr
    assert pr["races"] == cr["races"] == 0


def test_a_close_interrupted_before_it_left_the_broker_destroys_no_event(broker):
    """Spec §5: a producer destroys no event of a fenced handoff while it is registered (its
    consumer may still issue a wait on it). Such an event stays in the producer's event pool, and
    closing the pool destroys every event in it, idle or out: so a Ctrl-C that ends close() before
    its BYE left, still registered, must not close the pool. An idle event shows whether it did;
    the next close() frees it."""
    with emulated_gpu(0.0) as device:
        p = Producer(broker.endpoint, "interrupted-bye", device, event_pool=True)
        p.events.release(p.events.acquire())  # type: ignore[union-attr]  # idle in the pool
        close = p.session.close

        def interrupted() -> None:
            raise KeyboardInterrupt

        p.session.close = interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            p.close()
        assert not p.session.closed and p.events.size == 1, "an event was destroyed while still registered"
        p.session.close = close  # type: ignore[method-assign]
        p.close()
        assert p.session.closed and p.events.size == 0


def test_a_round_open_when_the_broker_restarts_is_asked_again_and_ends(tmp_path):
    """The open round is lost with the broker; the producer asks again after its new WELCOME.
    The consumer is stopped across the restart, so that UNMAP reaches the new broker before the
    consumer registers there (the order that used to cost the allocation): the broker awaits
    its label, asks it once it registered, and the buffer is freed after its answer."""
    b = BrokerProcess(f"ipc://{tmp_path}/b.sock", timeout=5.0).start()
    env = emu_env(op_delay_s=0.0)
    # The consumer waits on an event of its own: setting one a stopped process waits on blocks.
    round_open, restarted, reasked, finished = SPAWN.Event(), SPAWN.Event(), SPAWN.Event(), SPAWN.Event()
    try:
        c = Proc(workers.kept_consumer_deaf_to_the_first_broker, endpoint=b.endpoint, channel="kr", env=env,
                 done=finished)
        p = Proc(workers.kept_restart_producer, endpoint=b.endpoint, channel="kr", env=env, size=4096,
                 round_open=round_open, restarted=restarted, reasked=reasked)
        assert round_open.wait(60), "the producer never opened its round"
        os.kill(c.p.pid, signal.SIGSTOP)
        try:
            b.stop(signal.SIGKILL)
            b.start()
            restarted.set()
            assert reasked.wait(60), "the producer never asked the new broker"
        finally:
            os.kill(c.p.pid, signal.SIGCONT)
        pr = p.result()
        finished.set()
        cr = c.result()
    finally:
        b.stop()
    assert isinstance(pr, dict) and "error" not in pr, pr
    assert isinstance(cr, dict) and "error" not in cr, cr
    assert pr["closed"], ("the round lost with the old broker never ended", pr, cr)
    assert len(cr["answered"]) == 1, "the new broker asked it (the old one's UNMAP, if read, was ignored)"
    assert (pr["freed"], pr["retired"]) == (True, False), (pr, cr)
    assert pr["races"] == cr["races"] == 0


@DELAYS
def test_a_broker_that_does_not_carry_kept_mappings_is_sent_no_keep(broker, delay):
    pr, cr = _run(broker, delay, breaks_p="old-broker")
    assert pr["kept"] == 0 and cr["opens"] == 6 and cr["kept"] == 0, "opened and closed per handoff"
    assert pr["left"] == 0 and pr["races"] == cr["races"] == 0


@DELAYS
def test_a_consumer_that_does_not_keep_mappings_gets_no_keep_and_is_answered_for(broker, delay):
    pr, cr = _run(broker, delay, breaks_c="old-consumer")
    assert cr["opens"] == 6 and cr["kept"] == 0, "the broker took keep off its DELIVERs"
    assert pr["kept"] == 2 and pr["left"] == pr["retired"] == 0, "asked back, answered by the broker, freed"
    assert pr["races"] == cr["races"] == 0


@DELAYS
def test_an_unmap_the_broker_refuses_leaves_the_allocation_allocated(broker, delay):
    """Its ERROR names the round (``request``); nobody was asked, so nothing is freed."""
    pr, cr = _run(broker, delay, breaks_p="refused")
    assert pr["retired"] == pr["left"] == 2 and cr["kept"] == 2
    assert pr["races"] == cr["races"] == 0


@DELAYS
def test_an_allocation_its_application_closes_while_a_handoff_of_it_is_out_waits_for_the_release(broker, delay):
    """The library asks an allocation back (UNMAP, step 3) only once no handoff of it is
    outstanding: a consumer that does not keep mappings is answered for at once (step 4), though
    it may still be reading the buffer. Broken (asked back, so freed, at the close), the consumer's
    read and unmap after the free are the race checker's races, every run: the consumer reads only
    once the producer's close and any round it started are over."""
    holding, closed = SPAWN.Event(), SPAWN.Event()
    with emulated_gpu(delay) as device:
        c = Proc(workers.read_after_its_producer_closed, endpoint=broker.endpoint, channel="close-early",
                 holding=holding, closed=closed, env=emu_env(op_delay_s=delay))
        with Producer(broker.endpoint, "close-early", device) as p:
            buf = p.allocate(4096)
            p.stream.memset(buf, 0x5A)  # type: ignore[union-attr]
            t = p.send(buf, "PRODUCER_SYNCED", timeout=30)
            assert holding.wait(60), c.result(timeout=5)
            buf.close()
            # A round the close started (none, kept): over once the broker's answer was read.
            p.session.pump(lambda: not p._rounds, 30, "the UNMAP round")
            closed.set()
            p.wait_released(timeout=30)
            assert t.outcome == "released"
            p.session.pump(lambda: not p._rounds, 30, "the UNMAP round")  # asked back once released
            assert not p._kept, "freed after the release and the round"
        res = c.result()
    assert res["error"] is None, res["error"]
    assert res["first"] == 0x5A and res["races"] == 0, res



@DELAYS
def test_an_allocation_closed_while_its_send_failed_is_freed_by_the_next_close_and_only_once(broker, delay,
                                                                                            monkeypatch):
    """A send of an allocation that the application closed meanwhile (another thread), and that
    then failed (here the socket), queues the allocation's next step (free, or ask back) for the
    next pump round, after the failure is handled. A ``close()`` that comes before any pump round
    runs that step itself: the producer's session lock is held from before the send until after
    the close, so no pump round can run between them. Broken, the allocation stays allocated for
    the process's life. The queued step, run afterwards (as a pump round after the close's own would,
    e.g. while other allocations are asked back), finds it freed and does nothing; broken (the free
    not taken as it runs), it frees or forgets it a second time and raises. The consumer is in
    this process, so it keeps no mapping (nothing to ask back)."""
    with emulated_gpu(delay) as device, Consumer(broker.endpoint, "closed-failed", device, prefetch=1) as c:
        ended: list[BaseException] = []

        def receive() -> None:
            try:
                c.receive(timeout=30)
            except BaseException as e:  # noqa: BLE001 - the producer's END, read by the test thread
                ended.append(e)

        receiver = threading.Thread(target=receive)
        receiver.start()  # its REQUEST gives the producer a grant
        p = Producer(broker.endpoint, "closed-failed", device)
        try:
            assert p.grant_ready(timeout=30)
            buf = p.allocate(4096)
            ptr, real, failed = buf.ptr, p.session.send_batch, []

            def close_then_fail(msgs: list) -> None:
                if msgs[0].verb == "HANDOFF" and not failed:
                    failed.append(True)
                    buf.close()  # the application's close, while the send runs
                    raise OSError("injected: the socket send failed")
                real(msgs)

            monkeypatch.setattr(p.session, "send_batch", close_then_fail)
            with p.session.lock:  # no pump round between the failure and the close
                with pytest.raises(OSError, match="injected"):
                    p.send(buf, "PRODUCER_SYNCED", timeout=30)
                assert failed and ptr in p._kept and p.session.deferred, "its next step waits for a pump round"
                p.close()
            assert not p._kept and ptr not in device.rt._allocs, "the close ran the queued step: freed"
            for step in p.session.deferred:
                step()  # a later pump round's: nothing left to free
            assert not p._kept and ptr not in device.rt._allocs
        finally:
            p.close()
            receiver.join(60)
        assert len(ended) == 1 and isinstance(ended[0], EndOfStream), ended
        assert emulated_races(device) == 0

@DELAYS
@pytest.mark.parametrize("part", ["whole", "view"])
def test_an_allocation_closed_while_an_in_process_handoff_of_it_is_out_is_read_intact(broker, delay, part):
    """The same in one process (the consumer reads the producer's own memory by its address): the
    application's close waits for the release, and the consumer is handed the address, not the
    application's Buffer, which the close empties; ``view``: a Buffer inside the allocation, found
    by its base address. The consumer's session lock is held from before the send until after the
    close, so it takes the delivery only then (workers.inproc_close_while_out, in a process of its
    own): broken any of these ways, it reads freed memory or address 0 and that process dies, every
    run. A closed Buffer sent again is refused, naming it."""
    c = Proc(workers.inproc_close_while_out, endpoint=broker.endpoint, channel=f"inproc-close-{part}", part=part,
             env=emu_env(op_delay_s=delay))
    c.p.join(120)
    assert c.p.exitcode == 0, f"the in-process run died (exit code {c.p.exitcode}): it read freed memory or address 0"
    res = c.q.get(timeout=10)
    assert res["error"] is None, res["error"]
    assert res["transport"] == "in-process" and res["size"] == (4096 if part == "whole" else 1024), res
    assert res["intact"] and res["races"] == 0, res
    assert res["kept"] == 0, "freed at the release"
    assert "was closed" in res["refused"], res
