"""A failed send gives back everything it took (issue 21; client/DESIGN.md, "Failure semantics").

Each test makes one send fail at one point — before the grant (metadata, shape, dtype, the
object itself), or after it (export, staging copy, event, the socket send, a broker refusal of
the entry or of the whole message, the broker's death) — and then checks that the channel keeps
flowing at once: the next sends succeed within seconds and a consumer in another process gets
every buffer intact; and that nothing stayed taken: no staging slot, no pooled event, no
in-process reference, no shared-memory copy.

Why a removed give-back fails every run, not by timing: the consumer asks for one buffer at a
time (prefetch 1), so a grant the producer loses is never replaced; the broker here revokes an
unused grant only after 30 s (spec §4.3a), so the next ``send`` raises HurrayTimeout after its
5 s. And why a kept give-back passes every run: the producer holds the consumer's grant
(:func:`primed`) before the failing send, so no send's time bound includes a process start, and
no grant a correct run leaves unused (a trailing grant after the last handoff) sits long enough
to be revoked before :func:`nothing_taken` reads ``grants_revoked``, which must be 0. Leaks are
counted, not timed.
``scripts/check-sync-mutants`` applies each give-back mutant and checks that this file fails.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from brokerproc import BrokerProcess
from conftest import Proc, emu_config
from hurray_ipc import (
    BrokerUnavailable,
    ClosedError,
    Consumer,
    DeviceError,
    InvalidArgument,
    Producer,
    RemoteError,
    UnsupportedObject,
    workload,
)
from hurray_ipc.devices import CpuDevice, CudaDevice, set_runtime
from hurray_ipc.devices.backend.emulated import EmulatedRuntime
from hurray_ipc.devices.cuda import CudaEvent
from hurray_ipc.interop.source import Source
from hurray_ipc.transport import inproc
from hurray_ipc.wire.ipc import json_bytes

SIZE = 4096
TAG = 7
EMU = emu_config(op_delay_s=0.0)


@pytest.fixture
def broker(tmp_path):
    """A broker that revokes an unused grant after 30 s, not 2: see the module doc."""
    b = BrokerProcess(f"ipc://{tmp_path}/broker.sock", timeout=30.0).start()
    yield b
    b.stop()


def primed(p: Producer) -> None:
    """The consumer process is up and asked: the producer holds its grant."""
    assert p.grant_ready(timeout=60), "the consumer never asked for a buffer"


def consumer(broker: BrokerProcess, channel: str, count: int, device: str = "cpu") -> Proc:
    """A consumer process that receives and checks ``count`` buffers, one request at a time."""
    env = EMU.to_env() if device != "cpu" else None
    return Proc(workload.run_consumer, endpoint=broker.endpoint, channel=channel, device=device, count=count,
                timeout=20.0, env=env)


def segments() -> set[str]:
    """This process's CPU shared-memory buffers (devices/shm.py names: kind c)."""
    prefix = f"hurray-{os.getuid()}-{os.getpid()}-c"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def send_good(p: Producer, first: int, n: int) -> None:
    """``n`` checksummed sends that must each succeed at once (a lost grant times out here)."""
    for seq in range(first, first + n):
        data = workload.pattern(TAG, seq, SIZE)
        if p.gpu is not None:
            buf = p.allocate(SIZE)
            p.stream.copy(buf, data)  # type: ignore[union-attr]
            p.send(buf, timeout=5, on_release=lambda t, b=buf: b.close())
        else:
            p.send(data, timeout=5)


def grants_revoked(endpoint: str) -> int:
    """The broker's count of grants it took back because their producer did not use them."""
    import zmq

    from hurray_ipc.wire.ipc import Message, decode_all

    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        s.send_multipart(Message("STATS", {"request_id": "revoked"}).encode())
        assert s.poll(10_000), "the broker did not answer STATS"
        (reply,) = decode_all(s.recv_multipart())
        return int(reply.fields()["totals"]["grants_revoked"])
    finally:
        ctx.destroy(linger=0)


def nothing_taken(p: Producer, c: Proc, received: int, before: set[str]) -> None:
    # A grant the failed send kept would have stalled send_good (the broker revokes it only
    # after 30 s, spec §4.3a); none may have been revoked either.
    assert grants_revoked(p.session.endpoint) == 0, "a grant was not given back: the broker had to revoke it"
    r = c.result()
    assert r["error"] is None, r["error"]
    assert r["received"] == r["intact"] == received and r["corrupt"] == 0
    p.flush(10)
    assert p.staging.in_use == 0, "a staging slot was not given back"
    if p.events is not None:
        assert p.events.idle == p.events.size, "a pooled event was not given back"
    assert not inproc._refs, "an in-process reference was not dropped"
    pooled = {p.cpu.segment_of(slot)[0].name.lstrip("/") for slot in p.staging.slots()}  # kept for reuse
    left = segments() - before - pooled
    assert not left, f"shared-memory copies left behind: {left}"


def fail_once(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, error: BaseException,
              when: Any = None) -> list[int]:
    """Make ``owner.name`` raise ``error`` on its first call (for which ``when(*args)`` holds, if
    given) only; returns the count of calls that raised."""
    real = getattr(owner, name)
    raised = [0]

    def once(*a: Any, **kw: Any) -> Any:
        if not raised[0] and (when is None or when(*a)):
            raised[0] += 1
            raise error
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, once)
    return raised


# --- refused before a grant is taken ------------------------------------------------------------
@pytest.mark.parametrize(("kw", "error", "words"), [
    ({"meta": {"x": object()}}, InvalidArgument, r"meta\['x'\] is an object, not a JSON value"),
    ({"meta": {"big": "a" * 70000}}, InvalidArgument, r"70\d\d\d bytes of JSON; the protocol allows 65536"),
    ({"meta": {1: "a"}}, InvalidArgument, r"has the key 1, an int"),
    ({"shape": (3,)}, InvalidArgument, r"shape \(3,\) of <i8 describes 24 bytes, the buffer has 4096"),
    ({"dtype": "<f8"}, InvalidArgument, r"the <i8 array would travel as <f8, its bytes reinterpreted"),
    ({"shape": (1.5,)}, InvalidArgument, r"dimension 1.5 is a float"),
    ({"shape": "4"}, InvalidArgument, r"not a string"),
    ({"shape": (2**62, 4)}, InvalidArgument, r"describes 147573952589676412928 bytes"),
    ({"dtype": "datetime64[s]"}, UnsupportedObject, r"not a scalar number or bool dtype"),
    ({"dtype": "nonsense"}, InvalidArgument, r"'nonsense' is not a dtype"),
    ({"mode": "EVENT"}, InvalidArgument, r"SYNC_EVENT is for GPU buffers; a host buffer is always"),
    ({"mode": "FAST"}, InvalidArgument, r"unknown sync mode 'FAST'"),
    ({"timeout": -1}, InvalidArgument, r"send\(timeout=\)"),
])
def test_refused_before_a_grant_and_the_next_send_flows(broker, kw, error, words):
    before = segments()
    c = consumer(broker, "pre", 2)
    with Producer(broker.endpoint, "pre", "cpu") as p:
        with pytest.raises(error, match=words):
            p.send(np.arange(512, dtype=np.int64), **kw)
        assert not p.grants and not p._out and p.credits.asked == 0  # no grant was even asked for
        primed(p)
        send_good(p, 0, 2)
        nothing_taken(p, c, 2, before)


def test_send_many_refuses_the_whole_call_before_a_grant(broker):
    before = segments()
    c = consumer(broker, "many", 3)
    with Producer(broker.endpoint, "many", "cpu") as p:
        good = [workload.pattern(TAG, i, SIZE) for i in range(2)]
        with pytest.raises(UnsupportedObject, match="cannot hand off a list"):
            p.send_many([*good, [1, 2, 3]])
        assert p.staging.in_use == 0, "the slots holding the copies of the good objects were not given back"
        pooled = {p.cpu.segment_of(slot)[0].name.lstrip("/") for slot in p.staging.slots()}  # kept for reuse
        assert segments() - pooled <= before, "a copy of a good object was left outside the pool"
        primed(p)
        p.send_many(good, timeout=5)
        send_good(p, 2, 1)
        nothing_taken(p, c, 3, before)


# --- failures after the grant was taken ---------------------------------------------------------
def send_one(p: Producer, how: str, obj: Any) -> None:
    """One handoff through ``send`` or ``send_many`` (which shares preparation and submission)."""
    if how == "send":
        p.send(obj, timeout=5)
    else:
        p.send_many([obj], timeout=5)


@pytest.mark.parametrize("how", ["send", "send_many"])
def test_export_failure_gives_the_grant_back(broker, monkeypatch, how):
    before = segments()
    c = consumer(broker, f"export-{how}", 2)
    with Producer(broker.endpoint, f"export-{how}", "cpu") as p:
        primed(p)
        fail_once(monkeypatch, CpuDevice, "export_memory", DeviceError("export", "injected"))
        with pytest.raises(DeviceError, match="injected"):
            send_one(p, how, workload.pattern(TAG, 99, SIZE))
        send_good(p, 0, 2)
        nothing_taken(p, c, 2, before)


@pytest.mark.parametrize("how", ["send", "send_many"])
def test_socket_send_failure_unregisters_and_gives_the_grant_back(broker, monkeypatch, how):
    before = segments()
    c = consumer(broker, f"sock-{how}", 2)
    with Producer(broker.endpoint, f"sock-{how}", "cpu") as p:
        primed(p)
        raised = fail_once(monkeypatch, p.session, "send_batch", OSError("injected: socket send failed"),
                           when=lambda msgs: msgs[0].verb == "HANDOFF")  # not the READY asking for a grant
        with pytest.raises(OSError, match="injected"):
            send_one(p, how, workload.pattern(TAG, 99, SIZE))
        assert raised == [1] and not p._out  # the HANDOFF failed; nothing stayed registered as sent
        send_good(p, 0, 2)
        nothing_taken(p, c, 2, before)


@pytest.fixture
def emulated_gpu():
    rt = EmulatedRuntime(EMU)
    set_runtime(rt)
    try:
        yield CudaDevice(0, runtime=rt)
    finally:
        set_runtime(None)


def test_staging_copy_failure_gives_the_slot_and_the_grant_back(broker, monkeypatch, emulated_gpu):
    before = segments()
    c = consumer(broker, "staged", 2, device="cpu")  # a CPU consumer: GPU buffers are host-staged
    with Producer(broker.endpoint, "staged", emulated_gpu) as p:
        buf = p.allocate(SIZE)
        p.stream.copy(buf, workload.pattern(TAG, 99, SIZE))  # type: ignore[union-attr]
        primed(p)
        fail_once(monkeypatch, p.stream, "copy", DeviceError("cudaMemcpyAsync", "injected"))
        with pytest.raises(DeviceError, match="injected"):
            p.send(buf, timeout=5)
        assert p.staging.in_use == 0
        send_good(p, 0, 2)
        nothing_taken(p, c, 2, before)


def test_event_export_failure_gives_the_event_and_the_grant_back(broker, monkeypatch, emulated_gpu):
    before = segments()
    c = consumer(broker, "event", 2, device="cuda:0")
    with Producer(broker.endpoint, "event", emulated_gpu) as p:
        buf = p.allocate(SIZE)
        p.stream.copy(buf, workload.pattern(TAG, 99, SIZE))  # type: ignore[union-attr]
        primed(p)
        fail_once(monkeypatch, CudaEvent, "export", DeviceError("cudaIpcGetEventHandle", "injected"))
        with pytest.raises(DeviceError, match="injected"):
            p.send(buf, "EVENT", timeout=5)
        assert p.events.idle == p.events.size  # type: ignore[union-attr]
        send_good(p, 0, 2)
        nothing_taken(p, c, 2, before)



@pytest.mark.parametrize("kind", ["cpu", "emulated"])
def test_a_buffer_closed_while_its_send_waited_for_a_grant_is_refused_and_the_grant_given_back(
        broker, monkeypatch, emulated_gpu, kind):
    """``send()`` checks its object before it takes a grant, then may wait for one; an
    application thread may close the buffer meanwhile (or between a re-send's tries). Here the
    close runs inside the wait (``_take_grant`` wrapped), after that first check passed: the send
    must refuse it with InvalidArgument naming it once the grant came, and give the grant back.
    Broken (no check after the grant), a CPU buffer sent before is handed off by its cached export,
    naming a segment its close unlinked, so the send returns; a GPU one fails inside the export
    with a DeviceError about address 0; either way no InvalidArgument, every run."""
    before = segments()
    c = consumer(broker, f"closed-{kind}", 2, device="cpu" if kind == "cpu" else "cuda:0")
    with Producer(broker.endpoint, f"closed-{kind}", "cpu" if kind == "cpu" else emulated_gpu) as p:
        buf = p.allocate(SIZE)
        data = workload.pattern(TAG, 0, SIZE)
        if p.gpu is not None:
            p.stream.copy(buf, data)  # type: ignore[union-attr]
        else:
            buf.host_view()[:] = data.tobytes()
        p.send(buf, timeout=5)  # delivered: the CPU buffer's export is cached from here on
        p.flush(10)
        real = p._take_grant

        def closed_meanwhile(timeout: float | None) -> Any:
            buf.close()
            return real(timeout)

        monkeypatch.setattr(p, "_take_grant", closed_meanwhile)
        with pytest.raises(InvalidArgument, match=r"was closed while it was being sent") as e:
            p.send(buf, timeout=5)
        assert e.value.where == "send(obj=)"
        monkeypatch.setattr(p, "_take_grant", real)
        send_good(p, 1, 1)
        nothing_taken(p, c, 2, before)

# --- the broker refuses ---------------------------------------------------------------------------
def _bad_meta(monkeypatch: pytest.MonkeyPatch, wire: tuple[dict[str, Any], bytes]) -> None:
    """The next Source's wire metadata is ``wire`` (what a buggy client would send), once."""
    real = Source.wire_meta
    calls = [0]

    def crafted(self: Source) -> tuple[dict[str, Any] | None, bytes | None]:
        calls[0] += 1
        return wire if calls[0] == 1 else real(self)

    monkeypatch.setattr(Source, "wire_meta", crafted)


def test_broker_refusal_of_an_entry_raises_its_reason_and_the_channel_flows(broker, monkeypatch):
    before = segments()
    c = consumer(broker, "entry", 2)
    with Producer(broker.endpoint, "entry", "cpu") as p:
        meta = {"typestr": "|u1", "shape": [3]}  # 3 bytes described, 4096 sent: payload_mismatch
        primed(p)
        _bad_meta(monkeypatch, (meta, json_bytes(meta)))
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="payload_mismatch") as e:
            p.send(workload.pattern(TAG, 99, SIZE), timeout=10)
        assert time.monotonic() - t0 < 5, "the refusal came as a timeout, not as the broker's reason"
        assert e.value.code == "payload_mismatch" and e.value.header.get("field") == "meta"
        send_good(p, 0, 2)
        nothing_taken(p, c, 2, before)


def test_broker_refusal_of_a_whole_message_gives_grant_and_ready_back(broker, monkeypatch):
    """A HANDOFF refused as a whole (its meta frame is over the limit) is answered with every
    entry's id (spec §2.2): send raises the broker's reason, and the grant and the READY that
    message carried come back to the producer. Three sends follow: the third is the one that
    needs the READY accounting to be right."""
    before = segments()
    c = consumer(broker, "whole", 3)
    with Producer(broker.endpoint, "whole", "cpu") as p:
        meta = {"typestr": "|u1", "shape": [SIZE], "user": "x" * 70000}
        primed(p)
        _bad_meta(monkeypatch, (meta, json_bytes(meta)))
        t0 = time.monotonic()
        with pytest.raises(RemoteError, match="bad_header") as e:
            p.send(workload.pattern(TAG, 99, SIZE), timeout=10)
        assert time.monotonic() - t0 < 5, "the refusal came as a timeout, not as the broker's reason"
        assert e.value.header.get("handoff_ids") == [1]  # the producer's first handoff
        send_good(p, 0, 3)
        nothing_taken(p, c, 3, before)


# --- the broker dies while a send waits for its acceptance ---------------------------------------------
def wait_for(cond: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)  # polling an observable condition, not standing in for one


def test_broker_death_during_a_send_then_the_channel_flows_again(tmp_path):
    """The HANDOFF goes to a broker that is stopped and then killed: send raises
    BrokerUnavailable; once a new broker runs, both clients register again by themselves, the
    swallowed handoff comes back to its producer (RELEASED consumer_fenced, spec §6: nothing proves
    its holder gone, so the producer retires it) and the next send is delivered."""
    # 3 s of silence before anyone is declared gone: a loaded machine's slow broker or client
    # must not pass for a dead one; the send's 10 s bounds how late the death is noticed.
    b = BrokerProcess(f"ipc://{tmp_path}/b.sock", timeout=3.0).start()
    try:
        before = segments()
        outcomes: list[str | None] = []
        with Producer(b.endpoint, "death", "cpu", heartbeat_s=0.1, timeout_s=3.0) as p, \
                Consumer(b.endpoint, "death", "cpu", heartbeat_s=0.1, timeout_s=3.0) as c:
            with pytest.raises(TimeoutError):
                c.receive(timeout=0)  # asks for one buffer
            assert p.grant_ready(timeout=5)  # the producer holds the consumer's grant
            first = p.session.broker_session
            os.kill(b.proc.pid, signal.SIGSTOP)
            with pytest.raises(BrokerUnavailable):
                p.send(workload.pattern(TAG, 99, SIZE), on_release=lambda t: outcomes.append(t.outcome), timeout=10)
            b.stop(signal.SIGKILL)
            b.start()
            wait_for(lambda: all(x.session.registered and x.session.broker_session not in (None, first)
                                 for x in (p, c)),
                     20, "both clients to register with the new broker")
            err: list[BaseException] = []
            th = threading.Thread(target=_send, args=(p, err), daemon=True)
            th.start()
            h = c.receive(timeout=10)
            th.join(10)
            assert not err, err
            data = h.numpy().copy()
            h.release()
            assert workload.verify(data) == (TAG, 1, True)
            p.flush(10)  # the handoff the dead broker swallowed came back
            assert outcomes == ["consumer_fenced"]
            assert p.outstanding == 0 and p.staging.in_use == 0
        assert segments() <= before
    finally:
        b.stop()


def _send(p: Producer, err: list[BaseException]) -> None:
    try:
        p.send(workload.pattern(TAG, 1, SIZE), timeout=5)
    except BaseException as e:  # noqa: BLE001 - handed to the test thread
        err.append(e)


# --- closed and ended producers -------------------------------------------------------------------
def test_send_after_close_or_end_is_a_closed_error(broker):
    p = Producer(broker.endpoint, "closed", "cpu")
    p.end()
    with pytest.raises(ClosedError, match="ended its stream"):
        p.send(b"x")
    p.close()
    with pytest.raises(ClosedError, match="was closed"):
        p.send(b"x")
    c = Consumer(broker.endpoint, "closed", "cpu")
    c.close()
    with pytest.raises(ClosedError, match="was closed"):
        c.receive(timeout=1)
    assert not Path(f"/dev/shm/hurray-{os.getuid()}-{os.getpid()}-c").exists()
