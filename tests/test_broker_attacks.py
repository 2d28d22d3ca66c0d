"""Issue 10's attacks on a live broker, each now refused or survived (docs/spec/ipc-protocol.md).

A broker that one message could kill, whose clients' buffers a neighbour could release, or that
dropped a live but paused consumer's buffers: each attack is a test. Waits are on messages and
processes; the only deliberate time passage is the broker's own heartbeat timeout in the paused
consumer test (there, what must *not* happen is that the producer gets its buffer back).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from brokerproc import BrokerProcess
from conftest import Proc, unshare_cmd
from hurray_ipc import workload
from hurray_ipc.client import Producer
from hurray_ipc.devices import shm
from test_protocol_raw import Raw, endpoint_dict, one_handoff
from workers import hold_one_buffer, receive_one_later


@pytest.fixture
def live(tmp_path):
    b = BrokerProcess(f"ipc://{tmp_path}/b.sock", timeout=1.0, log_level="info").start()
    ctx = zmq.Context()
    yield b, ctx
    ctx.destroy(linger=0)
    if b.proc is not None:  # (a test may have stopped it to read its final stats)
        assert b.proc.poll() is None, "the broker died"
        b.stop()


def _alive(b, ctx) -> None:
    probe = Raw(ctx, b.endpoint, f"probe-{os.urandom(4).hex()}")
    probe.send("CAPS", {"device": endpoint_dict(os.getpid()), "request_id": 1})
    h, _ = probe.expect("CAPS_REPLY")
    assert h["request_id"] == 1


def test_one_message_cannot_kill_it(live, tmp_path):
    b, ctx = live
    evil = Raw(ctx, b.endpoint, "evil")
    for verb, body in ((b"NOPE", b"[" * 100_000), (b"HELLO", b"[" * 100_000), (b"HELLO", b'{"a":' * 30_000),
                       (b"RELEASE", b"[" * 70_000)):
        evil.s.send_multipart([verb, body])
        assert evil.expect("ERROR")[0]["code"] in ("bad_header", "unknown_verb")
    hello = {"protocol": 2, "role": "producer", "channel": "x", "pid": 2**31, "endpoint": endpoint_dict(2**31)}
    evil.send("HELLO", hello)
    err, _ = evil.expect("ERROR")
    assert err["code"] == "bad_header" and "pid" in err["message"]
    _alive(b, ctx)


@pytest.mark.machine_wide
def test_stale_segment_with_a_huge_pid_does_not_kill_it(live):
    b, ctx = live
    name = f"{shm.PREFIX}-{os.getuid()}-2147483648-c1-00"
    (shm.SHM_DIR / name).write_bytes(b"\0" * 8)
    try:
        victim = Raw(ctx, b.endpoint, "victim")
        victim.hello("consumer", "x", endpoint_dict(os.getpid()))
        victim.send("BYE", {})
        dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        goner = Raw(ctx, b.endpoint, "goner")
        goner.hello("consumer", "x", endpoint_dict(dead.pid))
        dead.kill()
        dead.wait()  # a same-host client whose process is gone: the broker sweeps stale segments
        _alive(b, ctx)
    finally:
        (shm.SHM_DIR / name).unlink(missing_ok=True)


def test_forged_held_list_cannot_release_another_consumers_buffer(live):
    b, ctx = live
    prod, honest, thief = (Raw(ctx, b.endpoint, n) for n in ("p", "honest", "thief"))
    prod.hello("producer", "ch", endpoint_dict(os.getppid()))
    honest.hello("consumer", "ch", endpoint_dict(os.getpid()))
    token, hid = one_handoff(prod, honest)
    thief.send("HELLO", {"protocol": 2, "role": "consumer", "channel": "ch", "pid": os.getpid(),
                         "endpoint": endpoint_dict(os.getpid()),
                         "held": [{"token": "0d" * 24, "producer_id": "p", "handoff_id": hid},
                                  {"token": token, "producer_id": "p", "handoff_id": hid}]})
    thief.expect("WELCOME")
    for t in ("0d" * 24, token):
        thief.send("RELEASE", {"token": t})
        assert thief.expect("ERROR")[0]["code"] in ("unknown_token", "foreign_token")
    honest.send("RELEASE", {"token": token})
    r, _ = prod.expect("RELEASED")
    assert r["handoff_id"] == hid and r.get("reason") == "released", "the honest consumer released it, once"


def test_routing_id_cannot_be_taken_over(live):
    b, ctx = live
    prod, cons = Raw(ctx, b.endpoint, "p"), Raw(ctx, b.endpoint, "c1")
    prod.hello("producer", "ch", endpoint_dict(os.getppid()))
    cons.hello("consumer", "ch", endpoint_dict(os.getpid()))
    token, hid = one_handoff(prod, cons)
    impostor = Raw(ctx, b.endpoint, "c1")  # the same routing id, a second connection
    impostor.send("BYE", {})
    _alive(b, ctx)  # ordered after the impostor's BYE on the broker's socket... if it got through
    cons.send("PING", {})
    assert cons.recv()[0] == "PONG", "the real consumer is still registered"
    cons.send("RELEASE", {"token": token})
    r, _ = prod.expect("RELEASED")
    assert r["handoff_id"] == hid and r.get("reason") == "released"


def test_caps_does_not_reveal_routing_ids(live):
    b, ctx = live
    cons = Raw(ctx, b.endpoint, "secret-routing-id")
    cons.hello("consumer", "ch", endpoint_dict(os.getpid()))
    q = Raw(ctx, b.endpoint, "q")
    q.send("CAPS", {"device": endpoint_dict(os.getpid()), "channel": "ch"})
    h, _ = q.expect("CAPS_REPLY")
    assert h["consumers"] and "secret-routing-id" not in json.dumps(h)


def test_second_broker_refuses_a_live_endpoint(live):
    b, ctx = live
    r = subprocess.run([sys.executable, "-m", "hurray_ipc.broker", "--endpoint", b.endpoint, "--duration", "5"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "broker already running at" in r.stderr, r.stderr[-500:]
    _alive(b, ctx)


def test_socket_directory_open_to_others_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    r = subprocess.run([sys.executable, "-m", "hurray_ipc.broker", "--endpoint", f"ipc://{d}/b.sock",
                        "--duration", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "other users could replace" in r.stderr, r.stderr[-500:]


def test_paused_consumer_keeps_its_buffer_and_reads_it_intact(live):
    """SIGSTOP past the heartbeat timeout: the broker sees a live process (its lease), so the
    buffer stays bound; resumed, the consumer reads the producer's bytes and releases once."""
    b, _ = live
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    c = Proc(hold_one_buffer, endpoint=b.endpoint, channel="pause", ready=ready, go=go)
    with Producer(b.endpoint, "pause", "cpu") as p:
        buf = p.allocate(64 << 10)
        np.frombuffer(buf.host_view(), dtype=np.uint8)[:] = workload.pattern(7, 1, 64 << 10)
        t = p.send(buf, timeout=30)
        if not ready.wait(60):
            pytest.fail(f"the consumer never held the buffer: {c.result(timeout=5)}")
        os.kill(c.p.pid, signal.SIGSTOP)
        try:
            with pytest.raises(TimeoutError):
                p.wait_released(timeout=4 * b.timeout)  # 4x the broker's heartbeat timeout
        finally:
            os.kill(c.p.pid, signal.SIGCONT)
        go.set()
        res = c.result()
        assert res.get("error") is None, res.get("error")
        assert res["intact"] and res["seq"] == 1
        p.wait_released(timeout=30)
        assert t.outcome == "released" and p.unknown_releases == 0


def _client_pids(endpoint: str) -> set[int]:
    from hurray_ipc.client.query import stats
    return {c["pid"] for c in stats(endpoint, 5.0)["clients"]}


def test_a_paused_consumer_holding_nothing_is_dropped_and_registers_again_when_it_resumes(live):
    """Red team item 3 (squatting): a live but silent client kept its registration for ever. One
    that holds nothing is now dropped after the timeout (nothing of anyone's is at stake), and
    the library registers again at its next message: resumed, it receives as if nothing happened."""
    b, _ = live
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    c = Proc(receive_one_later, endpoint=b.endpoint, channel="squat", ready=ready, go=go)
    if not ready.wait(60):
        pytest.fail(f"the consumer never registered: {c.result(timeout=5)}")
    assert c.p.pid in _client_pids(b.endpoint)
    os.kill(c.p.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10 * b.timeout
        while c.p.pid in _client_pids(b.endpoint):  # polling the broker's own view
            assert time.monotonic() < deadline, "a silent consumer holding nothing was never dropped"
            time.sleep(0.05)
    finally:
        os.kill(c.p.pid, signal.SIGCONT)
    with Producer(b.endpoint, "squat", "cpu") as p:
        buf = p.allocate(64 << 10)
        np.frombuffer(buf.host_view(), dtype=np.uint8)[:] = workload.pattern(7, 1, 64 << 10)
        go.set()
        t = p.send(buf, timeout=30)
        res = c.result()
        assert res.get("error") is None, res.get("error")
        assert res["intact"] and res["seq"] == 1
        p.wait_released(timeout=30)
        assert t.outcome == "released"


def test_a_hoarding_producer_does_not_starve_the_good_pair(live):
    """Red team item 12: a producer asks for 4096 grants and never sends, but pings, so it stays
    registered. Before, it kept the consumer's only credit for ever and the good pair stalled; now
    its idle grant is revoked (REVOKE) after a heartbeat and goes to the producer that asks, and the
    hoarder is passed over from then on. The hoarder is made to hold the consumer's credit first (it
    waits for its GRANT before the good producer exists), so the stall is certain without the fix."""
    from hurray_ipc.client import Consumer

    b, ctx = live
    hoard = Raw(ctx, b.endpoint, "hoarder")
    hoard.hello("producer", "fair", endpoint_dict(os.getpid()))
    hoard.send("READY", {"credits": 4096})
    heard: list[bytes] = []
    stop = threading.Event()

    def keep_hoarding() -> None:  # the hoarder's own thread: a ZeroMQ socket is used by one thread
        while not stop.wait(0.05):
            hoard.send("PING", {})
            while hoard.s.poll(0):
                heard.append(hoard.s.recv_multipart()[0])

    got: list[tuple[int, int, bool]] = []
    with Consumer(b.endpoint, "fair", "cpu", prefetch=1) as c:
        def consume() -> None:
            for _ in range(20):
                with c.receive(timeout=15) as h:
                    got.append(workload.verify(np.frombuffer(h.buffer.host_view(), dtype=np.uint8).copy()))

        t = threading.Thread(target=consume)
        t.start()
        try:
            hoard.expect("GRANT", timeout=15_000)  # the consumer's only credit is the hoarder's now
            pinger = threading.Thread(target=keep_hoarding)
            pinger.start()
            try:
                with Producer(b.endpoint, "fair", "cpu") as p:
                    for i in range(20):
                        buf = p.allocate(4096)
                        np.frombuffer(buf.host_view(), dtype=np.uint8)[:] = workload.pattern(3, i, 4096)
                        p.send(buf, timeout=15)
            finally:
                stop.set()
                pinger.join(10)
        finally:
            t.join(60)
    assert got == [(3, i, True) for i in range(20)]
    while b"REVOKE" not in heard and hoard.s.poll(5000):  # sent before the good producer's first GRANT
        heard.append(hoard.s.recv_multipart()[0])
    assert b"REVOKE" in heard and b"ERROR" not in heard  # revoked, never dropped


def test_producer_in_its_own_pid_namespace_keeps_working(live):
    """A containerised producer says "pid 1"; its lease, not its pid, tells the broker it lives."""
    b, _ = live
    c = Proc(workload.run_consumer, endpoint=b.endpoint, channel="ns", device="cpu", count=20)
    code = ("import json, sys; from hurray_ipc import workload; "
            f"r = workload.run_producer({b.endpoint!r}, 'ns', 'cpu', 20, 4096, timeout=30); "
            "print(json.dumps({'pid': __import__('os').getpid(), **{k: r[k] for k in ('sent', 'released', 'error')}}))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([*unshare_cmd(), sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    pr = json.loads(r.stdout.strip().splitlines()[-1])
    cr = c.result()
    assert pr["pid"] == 1 and pr["error"] is None and pr["sent"] == pr["released"] == 20, pr
    assert cr["error"] is None and cr["intact"] == 20 and cr["corrupt"] == 0, cr


@pytest.mark.parametrize("name", [b"/etc/passwd", b"hurray-0-1-c1-ab", b"/hurray-0-1-c1-ab/../x", b"/other-0-1-c1-ab"])
def test_consumer_refuses_a_segment_name_outside_the_grammar(name):
    from hurray_ipc.devices import open_device
    from hurray_ipc.devices.base import MemoryExport
    from hurray_ipc.devices.cpu import _BLOB, CPU_MAGIC
    from hurray_ipc.devices.errors import DeviceError
    blob = _BLOB.pack(CPU_MAGIC, 4096, name)
    with pytest.raises(DeviceError, match="not a Hurray segment name"):
        open_device("cpu").import_memory(MemoryExport(blob, 0, 64))


def test_consumer_bounds_offsets_by_the_real_segment_not_the_blob():
    from hurray_ipc.devices import open_device
    from hurray_ipc.devices.base import MemoryExport
    from hurray_ipc.devices.cpu import _BLOB
    from hurray_ipc.devices.errors import DeviceError
    dev = open_device("cpu")
    buf = dev.allocate(4096)
    exp = dev.export_memory(buf)
    magic, _size, name = _BLOB.unpack(bytes(exp.blob))
    lying = _BLOB.pack(magic, 1 << 40, name)  # the blob claims a 1 TiB segment
    with pytest.raises(DeviceError, match="exceeds the segment"):
        dev.import_memory(MemoryExport(lying, 4096, 4096))
    buf.close()


def test_memset_past_the_buffer_is_refused_not_a_segfault():
    from hurray_ipc.devices import open_device
    from hurray_ipc.devices.errors import DeviceError
    dev = open_device("cpu")
    buf = dev.allocate(64)
    with pytest.raises(DeviceError, match="64"):
        dev.create_stream().memset(buf, 0, 1 << 20)
    buf.close()


def test_a_peer_that_stops_reading_is_counted_and_granted_nothing_until_it_reads_again(live):
    """ROUTER_MANDATORY: messages for a peer whose queue is full are counted (stats at shutdown),
    and the broker keeps serving everyone else. Such a consumer is choked (spec §1): none of its
    credits is granted, so no producer's handoff is sent to bounce back ``undelivered: full``
    (before, about 190 of a healthy pair's handoffs a second did: scripts/floods.py deaf-pings),
    until it reads its queue and a probe gets through; then they are granted again."""
    from hurray_ipc.broker.core import BrokerCore
    from hurray_ipc.client.query import BrokerQuery
    b, ctx = live
    deaf = Raw(ctx, b.endpoint, "deaf")
    # Its credits are asked first (no producer yet grants them): asked right after the flood, its
    # REQUEST could be past its message rate (§6a) on a fast machine.
    deaf.send("HELLO", {"protocol": 2, "role": "consumer", "channel": "ch", "pid": os.getpid(),
                        "endpoint": endpoint_dict(os.getpid()), "credits": 2})
    deaf.expect("WELCOME")
    ping = [b"PING", b"{}"]
    stats = BrokerQuery(b.endpoint)

    def state() -> tuple[str, int]:
        (c,) = [c for c in stats.stats(5)["clients"] if c["id"] == BrokerCore.label_of(b"deaf")]
        return c["state"], c["credits"]

    # Replies (PONG, or ERROR past the rate limit) it does not read, until the broker's queue for
    # it (66,560), its own (1000) and the socket buffer between them are full: how many that takes
    # depends on the machine's socket buffers, so the broker is asked. (ZeroMQ tells the broker of
    # room only after 65,536 were read from its queue, which a socket buffer far above Linux's
    # default of 208 KiB could take in: then the choke could end while it still does not read.)
    for _ in range(100):
        for _ in range(10_000):
            deaf.s.send_multipart(ping)
        if state() == ("choked", 2):
            break
    else:
        raise AssertionError("a million replies it never read, and no send to it failed")
    producer, good = Raw(ctx, b.endpoint, "p"), Raw(ctx, b.endpoint, "good")
    producer.hello("producer", "ch", endpoint_dict(os.getpid()))
    producer.send("READY", {"credits": 2})
    good.send("HELLO", {"protocol": 2, "role": "consumer", "channel": "ch", "pid": os.getpid(),
                        "endpoint": endpoint_dict(os.getpid()), "credits": 1})
    grant, _ = producer.expect("GRANT")  # the deaf consumer asked first, but is choked
    assert grant["consumer_id"] == BrokerCore.label_of(b"good")
    good.send("BYE", {})  # its grant, unused, is revoked after the timeout: no credit goes back
    # The deaf consumer reads again: its queue drains, a probe gets through and its credits are
    # granted (the producer asked for 2 and got 1).
    deadline = time.monotonic() + 20
    grant = None
    while grant is None:
        assert time.monotonic() < deadline, "the consumer read its queue, and its credits were never granted"
        n = 0
        while n < 5000 and deaf.s.poll(10):  # a share of its queue, then both ping (no lease: 1 s of
            deaf.s.recv_multipart()          # silence drops them)
            n += 1
        for c in (deaf, producer):
            c.s.send_multipart(ping)
        while grant is None and producer.s.poll(0):
            v, h, _ = producer.recv()
            assert v in ("GRANT", "PONG", "REVOKE"), (v, h)
            grant = h if v == "GRANT" else None
    assert grant["consumer_id"] == BrokerCore.label_of(b"deaf")
    assert stats.stats(5)["totals"]["consumers_choked"] >= 1
    stats.close()
    _alive(b, ctx)
    deaf.s.close(0)
    log = b.stop()
    (shutdown,) = [json.loads(line.split(" ", 1)[1] if not line.startswith("{") else line)
                   for line in log.splitlines() if '"event": "shutdown"' in line]
    assert shutdown["dropped_full"] > 0, shutdown


def test_a_frame_over_a_mebibyte_drops_only_its_sender(broker):
    """Red team medium item 8: a 256 MiB header frame was read whole (60 -> 570 MB) before the
    size check refused it. The broker's socket now drops a connection that sends a frame over
    1 MiB unread; a 100 KiB header is still answered bad_header; other clients are served."""
    from hurray_ipc.wire.ipc import decode_all

    ctx = zmq.Context()
    try:
        def sock():
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(broker.endpoint)
            return s

        def rss_mb() -> float:
            with open(f"/proc/{broker.proc.pid}/status") as f:
                return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024

        before = rss_mb()
        big, mid, good = sock(), sock(), sock()
        for _ in range(8):  # 8 x 64 MiB frames: dropped as they arrive, never read whole
            big.send_multipart([b"STATS", b"{" + b" " * (64 << 20) + b"}"])
        mid.send_multipart([b"STATS", b" " * (100 << 10)])
        assert mid.poll(10_000)
        (err,) = decode_all(mid.recv_multipart())
        assert err.verb == "ERROR" and err.fields()["code"] == "bad_header"
        good.send_multipart([b"STATS", b"{}"])
        assert good.poll(10_000) and decode_all(good.recv_multipart())[0].verb == "STATS_REPLY"
        assert not big.poll(500)  # never answered: those frames were dropped unread
        assert rss_mb() - before < 64, (before, rss_mb())
    finally:
        ctx.destroy(linger=0)
