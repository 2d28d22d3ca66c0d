"""Producer/consumer through a real broker process, in spawned processes, on CPU and emulated CUDA,
for every valid mode, the host-staged fallback, and process death."""

from __future__ import annotations

import os
import signal
import stat
import threading
import time

import numpy as np
import pytest

from brokerproc import BrokerProcess
from conftest import SPAWN, Proc, emu_config, emu_env
from hurray_ipc import workload
from hurray_ipc.broker.bridge import read_route_key
from hurray_ipc.broker.keyfile import route_key_path
from hurray_ipc.client import BrokerUnavailable, Consumer, Producer, ProducerGone
from hurray_ipc.devices import shm


def run_pair(broker, pdev, cdev, env, n=12, size=64 << 10, mode=None, channel="ch", pids=None):
    """A producer and a consumer worker hand ``n`` buffers over; ``pids`` (a list) gets their pids."""
    c = Proc(workload.run_consumer, endpoint=broker.endpoint, channel=channel, device=cdev, count=n, env=env)
    p = Proc(workload.run_producer, endpoint=broker.endpoint, channel=channel, device=pdev, count=n, size=size,
             mode=mode, env=env)
    if pids is not None:
        pids += [c.p.pid, p.p.pid]
    pr, cr = p.result(), c.result()
    assert pr["error"] is None, pr["error"]
    assert cr["error"] is None, cr["error"]
    assert pr["sent"] == pr["released"] == n
    assert pr["races"] == 0, "the producer's checker found a race (e.g. a staged copy read before it retired)"
    assert cr["received"] == cr["intact"] == n and cr["corrupt"] == 0 and cr["races"] == 0
    assert sorted(s for _, s in cr["seen"]) == list(range(n))
    return pr, cr


def test_cpu_ipc_zero_copy(broker):
    pr, cr = run_pair(broker, "cpu", "cpu", {})
    assert cr["modes"] == {"SYNC_PRODUCER_SYNCED": 12} and cr["staged"] == 0


def test_close_releases_what_the_application_still_holds_before_its_bye(broker):
    """Consumer.close() with a received handoff still held: it is released (the producer's ticket
    says 'released', not 'consumer_gone', which would hand the buffer back whatever the consumer
    still does with it) and refuses use afterwards, so the old handle cannot read the bytes of the
    producer's next send into the same slot."""
    from hurray_ipc import AlreadyReleasedError

    with Producer(broker.endpoint, "close-held") as p:
        with Consumer(broker.endpoint, "close-held") as c:
            sent: list = []
            th = threading.Thread(target=lambda: sent.append(p.send(np.full(4, 7, np.float32), timeout=10)))
            th.start()
            h = c.receive(timeout=10)
            th.join(10)
            c.close()
            p.flush(10)
            assert sent[0].outcome == "released"
            with pytest.raises(AlreadyReleasedError):
                h.numpy()
            c.close()  # idempotent


def test_emulated_cuda_event_mode(broker):
    pr, cr = run_pair(broker, "cuda:0", "cuda:0", emu_env(op_delay_s=0.005))
    assert cr["modes"] == {"SYNC_EVENT": 12} and cr["staged"] == 0


def test_emulated_cuda_producer_synced_when_asked(broker):
    pr, cr = run_pair(broker, "cuda:0", "cuda:0", emu_env(), mode="PRODUCER_SYNCED")
    assert cr["modes"] == {"SYNC_PRODUCER_SYNCED": 12}


def test_emulated_without_ipc_events_falls_to_producer_synced(broker):
    pr, cr = run_pair(broker, "cuda:0", "cuda:0", emu_env(ipc_events=False), mode="EVENT")
    assert cr["modes"] == {"SYNC_PRODUCER_SYNCED": 12}


def test_peer_gpu_event(broker):
    pr, cr = run_pair(broker, "cuda:0", "cuda:1", emu_env(peer_access=True))
    assert cr["modes"] == {"SYNC_EVENT": 12} and cr["staged"] == 0


@pytest.mark.parametrize("cdev,env", [
    ("cpu", emu_env()),  # consumer without a GPU
    ("cuda:1", emu_env(peer_access=False)),  # another GPU without peer access
    ("cuda:0", emu_env(ipc_memory=False)),  # IPC memory unsupported
], ids=["cpu-consumer", "no-peer-access", "no-ipc-memory"])
def test_host_staged_fallback(broker, cdev, env):
    pr, cr = run_pair(broker, "cuda:0", cdev, env, n=8)
    assert cr["staged"] == 8 and cr["modes"] == {"SYNC_PRODUCER_SYNCED": 8}
    assert pr["staged"] == 8


@pytest.mark.parametrize("delay", [0.0, 0.05], ids=["delay0", "delay50ms"])
def test_host_staged_copy_is_host_waited_before_the_handle_leaves(broker, delay):
    """The consumer reads a staging slot on its host, and its only edge to the producer's stream
    is the HANDOFF: the producer must host-wait the device-to-host copy before the handle leaves
    (sync-contract §5). The checker judges it at the send (``hb_publish_host``), whatever the timing:
    without the wait, every handoff is a race at 0 ms, where the bytes happen to arrive intact, as
    at 50 ms, where they do not (mutant staged-no-host-wait)."""
    pr, cr = run_pair(broker, "cuda:0", "cpu", emu_env(op_delay_s=delay), n=4)
    assert pr["staged"] == cr["staged"] == 4


def test_two_producers_two_consumers_each_handoff_owned_once(broker):
    env = emu_env()
    cs = [Proc(workload.run_consumer, endpoint=broker.endpoint, channel="mp", device="cuda:0", count=None,
               env=env) for _ in range(2)]
    ps = [Proc(workload.run_producer, endpoint=broker.endpoint, channel="mp", device="cuda:0", count=10,
               size=4096, tag=t, env=env) for t in (1, 2)]
    prs = [p.result() for p in ps]  # each got its 10 releases back, and left without ending the stream
    # Both are done: a producer of our own ends the stream (every producer registered now has
    # ended, spec §4.9), which stops the consumers however long each process took to start.
    Producer(broker.endpoint, "mp", "cpu").close()
    crs = [c.result() for c in cs]
    for r in prs + crs:
        assert r["error"] is None, r["error"]
    seen = [tuple(x) for r in crs for x in r["seen"]]
    assert sorted(seen) == sorted((t, s) for t in (1, 2) for s in range(10)), "every handoff exactly once"
    assert all(r["corrupt"] == 0 for r in crs)


def test_in_process_all_modes_consumer_stream(broker):
    """Threads of one process: CONSUMER_STREAM is valid and exercised; in-process EVENT too."""
    from hurray_ipc.devices import CudaDevice, set_runtime
    from hurray_ipc.devices.backend.emulated import EmulatedRuntime

    rt = EmulatedRuntime(emu_config(op_delay_s=0.01))
    set_runtime(rt)
    try:
        dev = CudaDevice(0, runtime=rt)
        cstream = dev.create_stream()
        got = []
        with Producer(broker.endpoint, "inproc", dev) as p, \
                Consumer(broker.endpoint, "inproc", dev, stream=cstream) as c:
            def produce():
                for i, mode in enumerate(["CONSUMER_STREAM", "EVENT", "PRODUCER_SYNCED"]):
                    buf = p.allocate(4096)
                    p.stream.copy(buf, workload.pattern(7, i, 4096))
                    t = p.send(buf, workload.SyncMode.from_name(mode), on_release=lambda t, b=buf: b.close())
                    got.append((t.mode.wire_name, t.transport.value))

            th = threading.Thread(target=produce)
            th.start()
            for i in range(3):
                h = c.receive(timeout=10)
                h.wait()
                out = np.empty(4096, np.uint8)
                cstream.copy(out, h.buffer.device_buffer)
                cstream.synchronize()
                assert workload.verify(out) == (7, i, True)
                h.release()
            th.join()
            p.flush(5)
        assert got == [("SYNC_CONSUMER_STREAM", "in-process"), ("SYNC_EVENT", "in-process"),
                       ("SYNC_PRODUCER_SYNCED", "in-process")]
        assert not rt.races
    finally:
        set_runtime(None)


def test_consumer_death_releases_back_to_producer(broker):
    env = emu_env()
    counters = SPAWN.Array("q", workload.COUNTERS)
    c = Proc(workload.run_consumer, endpoint=broker.endpoint, channel="cd", device="cuda:0", count=50, env=env,
             hold=30.0, counters=counters)  # holds the first buffer "forever"
    p = Proc(workload.run_producer, endpoint=broker.endpoint, channel="cd", device="cuda:0", count=1, size=4096,
             env=env)
    _until("the consumer received the buffer", lambda: counters[workload.C_RECEIVED] >= 1, 60)
    c.kill()
    pr = p.result(timeout=30)
    assert pr["error"] is None, pr["error"]
    assert pr["sent"] == 1 and pr["released"] == 1 and pr["consumer_gone"] == 1


def test_producer_death_tells_consumer(broker, tmp_path):
    env = emu_env()
    os.environ.update(env)
    from hurray_ipc.devices import set_runtime

    set_runtime(None)
    try:
        with Consumer(broker.endpoint, "pd", "cuda:0", timeout_s=5) as c:
            p = Proc(_hold_producer, endpoint=broker.endpoint, env=env)
            h = c.receive(timeout=30)
            p.kill()
            deadline = time.monotonic() + 10
            while not h.producer_gone and time.monotonic() < deadline:
                try:
                    c.receive(timeout=0.2)
                except TimeoutError:
                    pass
            assert h.producer_gone
            with pytest.raises(ProducerGone):
                h.wait()
            h.release()  # a local no-op now; must not raise
    finally:
        for k in env:
            os.environ.pop(k, None)
        set_runtime(None)


def _hold_producer(endpoint, env):
    os.environ.update(env)
    with Producer(endpoint, "pd", "cuda:0") as p:
        buf = p.allocate(4096)
        p.send(buf)
        time.sleep(60)
    return {}


def test_broker_gone_then_back(tmp_path):
    b = BrokerProcess(f"ipc://{tmp_path}/b.sock", timeout=3.0).start()
    # timeout_s leaves a loaded machine's broker room to be slow without being declared gone;
    # receive(timeout=10) bounds how late the death may be noticed.
    c = Consumer(b.endpoint, "bg", "cpu", heartbeat_s=0.2, timeout_s=3.0)
    try:
        with pytest.raises(TimeoutError):
            c.receive(timeout=0.5)
        b.stop(signal.SIGKILL)
        with pytest.raises(BrokerUnavailable, match="silent for .* socket file .* exists but nothing answered"):
            c.receive(timeout=10)
        b.start()
        p = Producer(b.endpoint, "bg", "cpu", heartbeat_s=0.2, timeout_s=3.0)
        buf = p.allocate(16)
        buf.host_view()[:] = b"back again......"
        th = threading.Thread(target=lambda: p.send(buf, timeout=10))
        th.start()
        deadline = time.monotonic() + 15
        while True:
            try:
                h = c.receive(timeout=5)
                break
            except BrokerUnavailable:
                assert time.monotonic() < deadline, "consumer never reconnected"
                time.sleep(0.2)
        assert bytes(h.buffer.host_view()) == b"back again......"
        h.release()
        th.join(10)
        p.flush(5)
        p.close()
    finally:
        c.close()
        b.stop()


def _until(what, check, timeout=15.0):
    """Poll ``check()`` until it returns something true (a condition, not a delay), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return got


def test_route_is_announced_again_to_a_restarted_broker(tmp_path):
    """ROUTE (spec §2.4): a restarted broker knows no route, so the session sends it again after
    WELCOME; CAPS on the new broker names it without the client doing anything."""
    from hurray_ipc.cli.caps import broker_answer

    b = BrokerProcess(f"ipc://{tmp_path}/b.sock", timeout=3.0).start()
    p = Producer(b.endpoint, "rt", "cpu", heartbeat_s=0.2, timeout_s=3.0, name="bridge-in:rt")
    link = {"peer": "tcp://192.0.2.1:5555", "data_plane": "nixl", "gpu": None, "window": 4}

    def links():
        try:
            return [x["links"] for x in broker_answer(b.endpoint, "cpu", None, "rt", None, 2.0).get("bridges", [])]
        except ConnectionError:  # the broker is not up yet
            return None

    try:
        assert _until("registered", lambda: p.session.registered)  # so ROUTE goes now, not at WELCOME
        key_file = route_key_path(b.endpoint)
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600  # only the broker's user may ROUTE
        p.session.set_route({"direction": "import", "links": [link]}, read_route_key(b.endpoint, None))
        assert _until("the route reached the broker", lambda: links() == [[link]])
        b.stop(signal.SIGKILL)
        b.start()
        assert _until("the route reached the restarted broker", lambda: links() == [[link]])
        p.session.set_route(None, p.session.route_key)
        assert _until("the route withdrawn", lambda: links() == [])
    finally:
        p.close()
        b.stop()


def test_broker_shutdown_tells_clients(tmp_path):
    b = BrokerProcess(f"ipc://{tmp_path}/b.sock").start()
    c = Consumer(b.endpoint, "sd", "cpu", heartbeat_s=0.2)
    try:
        _registered(c)  # the broker knows whom to tell
        err = b.stop(signal.SIGTERM)
        with pytest.raises(BrokerUnavailable, match="shut down"):
            c.receive(timeout=5)
        assert b.returncode == 0, err
    finally:
        c.close()


def _registered(c: Consumer) -> None:
    c.session.pump(lambda: c.session.registered, 10, "registering")


def test_async_for_ends_when_the_broker_shuts_down(tmp_path):
    """``async for`` over a consumer ends quietly when its broker shut down in order (SHUTDOWN);
    beside the next test, where a broker that vanished without a word is an error."""
    import asyncio

    b = BrokerProcess(f"ipc://{tmp_path}/b.sock").start()
    c = Consumer(b.endpoint, "aio-sd", "cpu", heartbeat_s=0.2)
    try:
        _registered(c)
        b.stop(signal.SIGTERM)  # returns once the broker exited, its SHUTDOWN sent
        assert b.returncode == 0

        async def loop() -> int:
            return sum([1 async for _ in c])

        assert asyncio.run(asyncio.wait_for(loop(), 30)) == 0
        assert c.session.shutdown_reason is not None
    finally:
        c.close()


def test_async_for_raises_when_the_broker_vanishes(tmp_path):
    import asyncio

    b = BrokerProcess(f"ipc://{tmp_path}/b.sock").start()
    c = Consumer(b.endpoint, "aio-kill", "cpu", heartbeat_s=0.2, timeout_s=3.0)
    try:
        _registered(c)
        b.stop(signal.SIGKILL)  # no SHUTDOWN: the consumer learns it from the silence

        async def loop() -> None:
            async for _ in c:
                pass

        with pytest.raises(BrokerUnavailable):
            asyncio.run(asyncio.wait_for(loop(), 30))
        assert c.session.shutdown_reason is None
    finally:
        c.close()


def test_async_for_ends_when_the_consumer_is_closed_while_it_waits(broker):
    """Closing the consumer while ``async for`` awaits the next handoff ends the loop (the wait
    finds the session closed), as closing it between two handoffs does; closed before the loop,
    it is an error (test_iterating_a_closed_consumer_says_so)."""
    import asyncio

    c = Consumer(broker.endpoint, "aio-close", "cpu", heartbeat_s=0.2)
    _registered(c)

    async def loop() -> int:
        asyncio.get_running_loop().call_soon(c.close)  # runs once the loop awaits its first handoff
        return sum([1 async for _ in c])

    assert asyncio.run(asyncio.wait_for(loop(), 30)) == 0
    assert c.session.closed


@pytest.mark.machine_wide  # a sweep beside it would remove a leaked segment of the dead workers first
def test_no_segments_left_behind(broker):
    """The workers' segments are gone once they exited: none of their pid is left in /dev/shm
    (only theirs are counted: other tests or test runs on this machine make and remove their own)."""
    pids: list[int] = []
    run_pair(broker, "cuda:0", "cuda:0", emu_env(), n=4, pids=pids)
    run_pair(broker, "cuda:0", "cpu", emu_env(), n=4, pids=pids)
    assert len(pids) == 4
    left = {n for n in shm.list_segments() if shm.parse_name(n)[1] in pids}
    assert not left, left


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["EVENT", "PRODUCER_SYNCED"])
def test_real_cuda_ipc_handoff(broker, mode):
    """The same multi-process run on a real GPU (cudaIpc*), unchanged; skipped without one."""
    from conftest import REAL_SKIP

    if REAL_SKIP:
        pytest.skip(f"real CUDA not available here: {REAL_SKIP}")
    pr, cr = run_pair(broker, "cuda:0", "cuda:0", {"HURRAY_CUDA": "real"}, mode=mode, size=1 << 20)
    assert cr["modes"] == {f"SYNC_{mode}": 12}


def test_real_cuda_to_cpu_consumer_is_staged(broker):
    from conftest import REAL_SKIP

    if REAL_SKIP:
        pytest.skip(f"real CUDA not available here: {REAL_SKIP}")
    pr, cr = run_pair(broker, "cuda:0", "cpu", {"HURRAY_CUDA": "real"}, n=8)
    assert cr["staged"] == 8


def test_received_host_buffer_is_zero_copy_for_numpy(broker):
    """numpy takes a received host buffer through DLPack and the array interface without a copy."""
    with Producer(broker.endpoint, "np", "cpu") as p, Consumer(broker.endpoint, "np", "cpu") as c:
        arr = np.arange(12, dtype=np.float32).reshape(3, 4)
        th = threading.Thread(target=lambda: p.send(arr))
        th.start()
        h = c.receive(timeout=10)
        h.wait()
        via_dlpack = np.from_dlpack(h.buffer)
        via_interface = np.asarray(h.buffer)
        assert via_dlpack.shape == (3, 4) and via_dlpack.dtype == np.float32
        assert np.array_equal(via_dlpack, arr) and np.array_equal(via_interface, arr)
        assert via_dlpack.ctypes.data == h.buffer.ptr == via_interface.ctypes.data, "no copy on the consumer side"
        assert h.buffer.__dlpack_device__() == (1, 0)
        del via_dlpack, via_interface
        h.release()
        th.join(10)
        p.flush(5)


def test_received_cuda_buffer_interfaces(broker):
    """An emulated-CUDA handoff exposes __cuda_array_interface__ v3 ordered on the waited stream."""
    from hurray_ipc.devices import CudaDevice, set_runtime
    from hurray_ipc.devices.backend.emulated import EmulatedRuntime

    rt = EmulatedRuntime(emu_config())
    set_runtime(rt)
    try:
        dev = CudaDevice(0, runtime=rt)
        with Producer(broker.endpoint, "cai", dev) as p, Consumer(broker.endpoint, "cai", dev) as c:
            buf = p.allocate(64)
            p.stream.memset(buf, 1)
            th = threading.Thread(target=lambda: p.send(buf, workload.SyncMode.EVENT))
            th.start()
            h = c.receive(timeout=10)
            cai = h.buffer.__cuda_array_interface__  # orders the consumer's stream, device-side only
            assert cai["version"] == 3 and cai["shape"] == (64,) and cai["typestr"] == "|u1"
            assert cai["data"] == (h.buffer.ptr, False) and cai["stream"] == c.stream.handle
            # no message because an attribute was read: the event goes back with the buffer
            assert not h.event_released and h.buffer.__dlpack_device__() == (2, 0)
            with pytest.raises(AttributeError):
                _ = h.buffer.__array_interface__
            h.release()
            th.join(10)
            p.flush(5)
    finally:
        set_runtime(None)


def test_delivery_that_cannot_be_mapped_is_rejected_naming_the_cuda_call(broker):
    """An importer whose cudaIpcOpenMemHandle fails rejects the delivery, and the reason names the
    call and the CUDA error."""
    from hurray_ipc.devices import CudaDevice, set_runtime
    from hurray_ipc.devices.backend.emulated import EmulatedRuntime
    from hurray_ipc.format.handle import BufferHandle, DeviceTag, SyncMode
    from hurray_ipc.wire.ipc import Deliver

    rt = EmulatedRuntime(emu_config())
    set_runtime(rt)
    try:
        exporter = CudaDevice(0, runtime=EmulatedRuntime(emu_config()))  # another "process"
        gone = exporter.allocate(64)
        blob = exporter.export_memory(gone).blob
        gone.close()  # freed: its handle no longer opens
        with Consumer(broker.endpoint, "unmappable", CudaDevice(0, runtime=rt)) as c:
            sent = []
            send, c.session.send = c.session.send, sent.append
            try:
                handle = BufferHandle(64, 256, DeviceTag.CUDA, SyncMode.PRODUCER_SYNCED).encode()
                c._dispatch(Deliver(token="t-unmappable", producer_id="p", handoff_id=1, handle=handle,
                                    memory=blob))
            finally:
                c.session.send = send
            assert not c._inbox and c.held == 0
            (rel,) = [m for m in sent if m.verb == "RELEASE"]
            assert rel.fields()["token"] == "t-unmappable"
            assert rel.fields()["reason"].startswith("rejected: cudaIpcOpenMemHandle: ")
            assert "cudaErrorInvalidValue" in rel.fields()["reason"]
        exporter.close()
    finally:
        set_runtime(None)


@pytest.mark.parametrize("pooled", [True, False, None], ids=["event-pool", "event-per-handoff", "default"])
def test_event_pool_and_event_per_handoff(broker, pooled, monkeypatch):
    """Pooled (opt-in): one event serves sequential handoffs (re-recorded after its release).
    Unpooled, the default: one event per handoff, recorded once (cuda.core's rule for IPC events)
    and destroyed when its handoff is released. No event is left alive either way."""
    from hurray_ipc.devices import CudaDevice, set_runtime
    from hurray_ipc.devices.backend.emulated import EmulatedRuntime

    monkeypatch.delenv("HURRAY_EVENT_POOL", raising=False)
    rt = EmulatedRuntime(emu_config())
    records: dict[int, int] = {}  # event object id -> cudaEventRecord calls on it
    recorded = []  # the events themselves, kept so that no id is reused
    real_record = rt.event_record

    def counting_record(event, stream):
        recorded.append(event)
        records[id(event)] = records.get(id(event), 0) + 1
        return real_record(event, stream)

    monkeypatch.setattr(rt, "event_record", counting_record)
    set_runtime(rt)
    try:
        c = Proc(workload.run_consumer, endpoint=broker.endpoint, channel="evp", device="cuda:0", count=4,
                 env=emu_env())
        keep = []
        with Producer(broker.endpoint, "evp", CudaDevice(0, runtime=rt), event_pool=pooled) as p:
            for i in range(4):
                buf = p.allocate(4096)
                keep.append(workload.pattern(5, i, 4096))
                p.stream.copy(buf, keep[-1])
                t = p.send(buf, workload.SyncMode.EVENT, on_release=lambda t, b=buf: b.close())
                assert t.mode is workload.SyncMode.EVENT and t.transport.value == "ipc"
                p.flush(10)
                assert rt.live_events == (1 if pooled else 0)
            assert p.events.created == (1 if pooled else 4)
            assert p.events.size == (1 if pooled else 0)
        assert rt.live_events == 0, "every event destroyed"
        if pooled:
            assert sorted(records.values()) == [4]
        else:
            assert sorted(records.values()) == [1, 1, 1, 1], "each IPC event is recorded exactly once"
        cr = c.result()
        assert cr["error"] is None, cr["error"]
        assert cr["intact"] == 4 and cr["races"] == 0 and cr["modes"] == {"SYNC_EVENT": 4}
    finally:
        set_runtime(None)


def test_event_pool_setting_from_env(monkeypatch):
    from hurray_ipc.client.producer import event_pool_setting

    monkeypatch.delenv("HURRAY_EVENT_POOL", raising=False)
    assert event_pool_setting(None) is False  # record-once events unless asked
    monkeypatch.setenv("HURRAY_EVENT_POOL", "1")
    assert event_pool_setting(None) is True and event_pool_setting(False) is False
    monkeypatch.setenv("HURRAY_EVENT_POOL", "0")
    assert event_pool_setting(None) is False and event_pool_setting(True) is True
    monkeypatch.setenv("HURRAY_EVENT_POOL", "maybe")
    with pytest.raises(ValueError, match="HURRAY_EVENT_POOL: .*got 'maybe'"):
        event_pool_setting(None)


def test_a_release_the_broker_cannot_place_is_reported_unless_it_crossed_producer_gone(broker):
    """Red team item 5's tail: a RELEASE refused unknown_token was ignored by the library. It is
    now reported in ``Consumer.errors`` (and logged as an error), except when the broker had said
    that handoff's producer was gone (the RELEASE crossed the PRODUCER_GONE: expected)."""
    from hurray_ipc.wire.ipc import Release
    from hurray_ipc.wire.messages import ProducerGone

    crossed, unplaced = "ab" * 24, "cd" * 24
    with Consumer(broker.endpoint, "unplaced", "cpu", prefetch=0) as c:
        with c.session.lock:
            c._dispatch(ProducerGone([crossed]))
        c.session.send(Release(crossed))
        c.session.send(Release(unplaced))
        # The broker answers in order: once the second refusal is here, the first was handled.
        c.session.pump(lambda: len(c.errors) > 0, 10, "the broker's refusal")
        assert [(e.code, e.header.get("token")) for e in c.errors] == [("unknown_token", unplaced)]


def test_a_send_whose_grant_was_revoked_in_flight_is_sent_again(broker):
    """Spec §4.3a: a HANDOFF naming a grant the broker revoked meanwhile (its REVOKE crossed the
    HANDOFF) is refused unknown_grant; a blocking send() sends the buffer again with the next
    grant instead of raising. The crossing is forced: the producer's lock is held, so nothing reads
    its socket, while a rival producer waits until the broker revoked the held grant and gave the
    credit to the rival; the rival then leaves (BYE), which puts the credit back for the next READY."""
    import zmq

    from test_protocol_raw import Raw, endpoint_dict

    ctx = zmq.Context()
    try:
        with Consumer(broker.endpoint, "revoked", "cpu", prefetch=1) as c, \
                Producer(broker.endpoint, "revoked", "cpu") as p:
            got: list[tuple[int, int, bool]] = []

            def receive() -> None:
                with c.receive(timeout=20) as h:
                    got.append(workload.verify(np.frombuffer(h.buffer.host_view(), dtype=np.uint8).copy()))

            reader = threading.Thread(target=receive)
            reader.start()
            assert p.grant_ready(timeout=10)  # holds the consumer's only credit
            with p.session.lock:  # the REVOKE stays unread until send() has used the grant
                rival = Raw(ctx, broker.endpoint, "rival")
                rival.hello("producer", "revoked", endpoint_dict(os.getpid()))
                rival.send("READY", {"credits": 1})
                h, _ = rival.expect("GRANT", timeout=10_000)  # so the broker revoked p's grant
                probe = Raw(ctx, broker.endpoint, "probe")
                probe.send("STATS", {"request_id": 1})
                assert probe.expect("STATS_REPLY")[0]["totals"]["grants_revoked"] == 1
                rival.send("BYE", {})
                buf = p.allocate(4096)
                np.frombuffer(buf.host_view(), dtype=np.uint8)[:] = workload.pattern(5, 0, 4096)
                t = p.send(buf, timeout=10)
            reader.join(30)
            assert t.error is None and got == [(5, 0, True)]
            p.wait_released(timeout=10)
    finally:
        ctx.destroy(linger=0)


def test_iterating_a_closed_consumer_says_so(broker):
    """Issue 21's tail: ``for h in c`` after ``c.close()`` ended silently, as an empty stream
    would. It raises ClosedError, naming the channel (sync and async alike)."""
    import asyncio

    from hurray_ipc import ClosedError

    c = Consumer(broker.endpoint, "closed-iter", "cpu")
    c.close()
    with pytest.raises(ClosedError, match="channel 'closed-iter' was closed before iterating over it"):
        for _ in c:
            pass

    async def loop() -> None:
        async for _ in c:
            pass

    with pytest.raises(ClosedError, match="closed before iterating"):
        asyncio.run(loop())


def test_a_bridge_reads_only_an_owner_only_route_key(tmp_path, caplog):
    """A bridge in another process announces routes with the key the broker wrote beside its
    socket, and only from the file the broker would keep (keyfile.read_token): a regular file of
    this uid, mode 0600, one token. A link, another mode, other content or a FIFO (which must not
    block) give no key, and the bridge says so instead of sending what it read."""
    from hurray_ipc.broker.keyfile import kept_token

    ep = f"ipc://{tmp_path}/b.sock"
    path = route_key_path(ep)
    token = kept_token(path)
    assert read_route_key(ep, None) == token and read_route_key(ep, "given") == "given"
    assert kept_token(path) == token  # a restarted broker keeps it
    path.chmod(0o644)
    assert read_route_key(ep, None) == ""
    path.chmod(0o600)
    path.write_text("not a token\n")
    assert read_route_key(ep, None) == ""
    real = tmp_path / "elsewhere"
    real.write_text(token)
    real.chmod(0o600)
    path.unlink()
    path.symlink_to(real)
    assert read_route_key(ep, None) == ""
    path.unlink()
    os.mkfifo(path, 0o600)
    assert read_route_key(ep, None) == ""
    assert "route will not be announced" in caplog.text
    path.unlink()
    assert read_route_key(ep, None) == ""  # missing: logged, not raised
