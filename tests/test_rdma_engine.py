"""hurray_ipc/broker/rdma.py: the NIXL (UCX) engine of the bridge's RDMA data plane (interchange.md, "RDMA data
plane (NIXL)"). Two engines in this process, and a receiver in a spawned process (rdma_workers.py)
that gets its offer to us over a queue, as RDMA_REGISTER would carry it over the link.

Every wait is a poll with a deadline; nothing sleeps to synchronise. The sender observes DONE before
anything reads the destination (sync-contract §6: the receiver reads nothing before TENSOR_DATA_END)."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from contextlib import contextmanager

import numpy as np
import pytest

from conftest import SPAWN
from hurray_ipc.broker import rdma
from hurray_ipc.broker.rdma import Offer, RdmaEngine, RdmaError, RdmaTimeout
from rdma_workers import receiver

REASON = rdma.nixl_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"NIXL unusable: {REASON}")

MiB = 1 << 20
Q_TIMEOUT = 60


def payload(size: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(a).hexdigest()


def get(q) -> dict:
    msg = q.get(timeout=Q_TIMEOUT)
    assert "error" not in msg, msg["error"]
    return msg


@pytest.fixture
def pair():
    with RdmaEngine("test-tx") as tx, RdmaEngine("test-rx") as rx:
        yield tx, rx


@contextmanager
def receiver_process(size: int):
    """A receiver process of ``size`` bytes: (offer message, out queue, cmd queue, process); ended
    (woken if stopped, told to exit, killed if it does not) on leaving."""
    out, cmd = SPAWN.Queue(), SPAWN.Queue()
    p = SPAWN.Process(target=receiver, args=(size, out, cmd), daemon=True)
    p.start()
    try:
        yield get(out), out, cmd, p
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
            cmd.put("exit")
            p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


@pytest.fixture
def remote(request):
    """A receiver process of ``request.param`` bytes (see receiver_process)."""
    with receiver_process(request.param) as r:
        yield r


def test_available_and_info():
    info = rdma.nixl_info()
    assert "UCX" in info.plugins
    assert "DRAM_SEG" in info.ucx_mem_types
    assert info.gpudirect == ("VRAM_SEG" in info.ucx_mem_types)


@pytest.mark.parametrize("size", [1 * MiB, 64 * MiB])
def test_write_in_process(pair, size):
    tx, rx = pair
    src, dst = payload(size), np.zeros(size, np.uint8)
    offer = rx.expose(rx.register_array(dst))
    local = tx.register_array(src)
    with tx.write(local, offer, b"xfer-1") as t:
        t.wait(timeout=30)
        assert t.state == "DONE"  # observed by the sender before anyone reads the destination
    assert sha(dst) == sha(src)
    assert offer["header"]["agent"] == rx.name and offer["header"]["size"] == size
    assert [bytes(m) for m in _notifs(rx, tx.name)] == [b"xfer-1"]


def _notifs(eng: RdmaEngine, sender: str) -> list[bytes]:
    """Poll notifications with a deadline (they may trail the sender's DONE)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = eng.notifications().get(sender)
        if got:
            return got
        time.sleep(0.001)
    return []


@pytest.mark.parametrize("remote", [1 * MiB, 64 * MiB], indirect=True, ids=["1MiB", "64MiB"])
def test_write_to_spawned_process(remote):
    msg, out, cmd, _ = remote
    size = msg["offer"]["header"]["size"]
    src = payload(size, seed=size)
    with RdmaEngine("test-tx") as tx:
        local = tx.register_array(src)
        for round_ in range(2):  # the second write reuses the loaded remote agent
            src[:8] = round_
            with tx.write(local, msg["offer"], f"n{round_}".encode()) as t:
                t.wait(timeout=30)
                assert t.state == "DONE"
            cmd.put("check")  # only now may the receiver read (TENSOR_DATA_END)
            got = get(out)
            assert got["sha256"] == sha(src)
            assert got["notifs"] == [f"n{round_}".encode()]
        assert tx.remote_agents == [msg["offer"]["header"]["agent"]]
    cmd.put("close")
    assert get(out) == {"left": 0, "remotes": 0}


def test_write_at_offsets(pair):
    """Two writes into halves of one offered region (RDMA_READY ranges), both DONE before reading."""
    tx, rx = pair
    src, dst = payload(2 * MiB), np.zeros(2 * MiB, np.uint8)
    offer = rx.expose(rx.register_array(dst))
    halves = [tx.register(int(src.ctypes.data) + i * MiB, MiB, "DRAM") for i in range(2)]
    transfers = [tx.write(h, offer, offset=i * MiB) for i, h in enumerate(halves)]
    for t in transfers:
        t.wait(timeout=30)
        t.release()
    assert sha(dst) == sha(src)


def test_registration_cache(pair):
    tx, _ = pair
    a = np.zeros(MiB, np.uint8)
    r1 = tx.register_array(a)
    r2 = tx.register(int(a.ctypes.data), a.nbytes, "DRAM")
    assert r2 is r1 and r1.refs == 2  # a cache hit: one NIXL registration
    r3 = tx.register(int(a.ctypes.data), a.nbytes // 2, "DRAM")
    assert r3 is not r1  # another size is another region
    tx.release(r1)
    assert not r1.released and len(tx.registrations) == 2
    tx.release(r2)
    tx.release(r3)
    assert r1.released and r3.released and tx.registrations == []
    with pytest.raises(RdmaError, match="not registered"):
        tx.release(r1)


def test_release_and_close_leave_nothing_registered(pair):
    tx, rx = pair
    src, dst = payload(MiB), np.zeros(MiB, np.uint8)
    local, dest = tx.register_array(src), rx.register_array(dst)
    offer = rx.expose(dest)
    with tx.write(local, offer) as t:
        t.wait(timeout=30)
    raw, descs = tx._agent, local._descs
    tx.release(local)
    assert tx.registrations == [] and local.released
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):  # NIXL itself no longer has it
        raw.deregister_memory(descs)
    with pytest.raises(RdmaError, match="not registered"):
        tx.write(local, offer)
    # close: every registration, remote agent and transfer goes, including ones never released.
    local = tx.register_array(src)
    pending = tx.write(local, offer)
    tx.close()
    assert tx.closed and tx.registrations == [] and tx.remote_agents == [] and tx.open_transfers == 0
    assert local.released and pending.released
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
        raw.deregister_memory(local._descs)
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):  # the remote agent was removed too
        raw.initialize_xfer("WRITE", raw.get_xfer_descs([(local.ptr, MiB, 0)], "DRAM"),
                            raw.get_xfer_descs([(dest.ptr, MiB, 0)], "DRAM"), rx.name)
    tx.close()  # idempotent
    with pytest.raises(RdmaError, match="closed"):
        tx.register_array(src)


def test_write_to_closed_peer_in_process_fails(pair):
    tx, rx = pair
    src, dst = payload(MiB), np.zeros(MiB, np.uint8)
    local = tx.register_array(src)
    offer = rx.expose(rx.register_array(dst))
    with tx.write(local, offer) as t:
        t.wait(timeout=30)
    rx.close()  # deregisters and drops its agent: its UCX worker disconnects from us
    error = write_until_error(tx, local, offer)
    assert "NIXL_ERR_REMOTE_DISCONNECT" in str(error)


def write_until_error(tx: RdmaEngine, local, offer) -> RdmaError:
    """Write until one fails. The disconnect of a gone peer reaches our agent asynchronously, so a
    write racing it may still land (the test's destination memory is still mapped); within a
    deadline a write must fail with RdmaError, never hang and never time out."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with tx.write(local, offer) as t:
                t.wait(timeout=30)
        except RdmaError as e:
            assert not isinstance(e, RdmaTimeout), e
            return e
    raise AssertionError("writes to a gone peer kept succeeding for 10 s")


@pytest.mark.parametrize("remote", [MiB], indirect=True, ids=["1MiB"])
def test_write_to_dead_process_fails(remote):
    """The receiver dies after its offer was used once: the next write is an RdmaError, not a hang."""
    msg, out, cmd, p = remote
    src = payload(MiB)
    with RdmaEngine("test-tx") as tx:
        local = tx.register_array(src)
        with tx.write(local, msg["offer"]) as t:
            t.wait(timeout=30)
        cmd.put("exit")
        p.join(timeout=Q_TIMEOUT)
        assert p.exitcode == 0
        assert "NIXL" in str(write_until_error(tx, local, msg["offer"]))


def test_forgotten_agent_is_loaded_again(pair):
    tx, rx = pair
    src, dst = payload(MiB), np.zeros(MiB, np.uint8)
    local = tx.register_array(src)
    offer = rx.expose(rx.register_array(dst))
    with tx.write(local, offer) as t:
        t.wait(timeout=30)
    tx.forget(rx.name)
    assert tx.remote_agents == []
    dst[:] = 0
    with tx.write(local, offer) as t:
        t.wait(timeout=30)
    assert sha(dst) == sha(src)


@pytest.fixture
def tcp_remote(monkeypatch):
    """A 64 MiB receiver process on UCX's TCP transport (set before either agent starts): unlike
    shared memory, a TCP write needs the receiver's process to progress, so stopping it holds the
    transfer in flight for as long as the test wants."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    with receiver_process(64 * MiB) as r:
        yield r


def test_transfer_timeout_is_an_error(tcp_remote):
    msg, out, cmd, p = tcp_remote
    src = payload(64 * MiB, seed=7)
    with RdmaEngine("test-tx") as tx:
        local = tx.register_array(src)
        os.kill(p.pid, signal.SIGSTOP)
        try:
            t = tx.write(local, msg["offer"], b"late")
            with pytest.raises(RdmaTimeout, match="NIXL state PROC"):
                t.wait(timeout=0.5)
            assert t.state == "PROC" and not t.poll()
        finally:
            os.kill(p.pid, signal.SIGCONT)
        t.wait(timeout=30)  # a timeout is the caller's verdict, not NIXL's: the write still finishes
        t.release()
        cmd.put("check")
        assert get(out)["sha256"] == sha(src)


def test_offer_validation(pair):
    tx, rx = pair
    dst = np.zeros(MiB, np.uint8)
    offer = rx.expose(rx.register_array(dst))
    assert Offer.from_wire(offer).size == MiB
    local = tx.register_array(np.zeros(2 * MiB, np.uint8))
    with pytest.raises(RdmaError, match="does not fit"):
        tx.write(local, offer)
    half = tx.register(int(local.ptr), MiB // 2, "DRAM")
    with pytest.raises(RdmaError, match="does not fit"):
        tx.write(half, offer, offset=MiB // 2 + 1)
    with pytest.raises(RdmaError, match="does not fit"):
        tx.write(half, offer, offset=-1)
    tx.release(half)

    def bad(**changes):
        h = dict(offer["header"], **changes)
        return {"header": h, "frames": offer["frames"]}

    small = tx.register_array(np.zeros(MiB, np.uint8))
    for wire, match in [
        (bad(version=2), "version"),
        (bad(mem="FILE"), "mem must be one of"),
        (bad(descs=[[0, MiB, 0]]), r"descs\.0\.address must be in 1\.\."),
        (bad(descs=[[1, MiB, 0], [2, MiB, 0]]), "descs must have exactly 1 items"),
        (bad(size=MiB + 1), "'size'"),
        (bad(agent=""), "agent must have 1-256 characters"),
        ({"header": offer["header"], "frames": []}, "frames"),
        ({"header": offer["header"], "frames": [b""]}, "metadata"),
        ({"header": offer["header"]}, "frames"),
        (bad(agent="someone-else"), "metadata is agent"),  # the name inside the metadata rules
    ]:
        with pytest.raises(RdmaError, match=match):
            tx.write(small, wire)
    assert tx.remote_agents == [] and tx.open_transfers == 0


def test_json_header(pair):
    import json

    _, rx = pair
    offer = rx.expose(rx.register_array(np.zeros(MiB, np.uint8)))
    header = json.loads(json.dumps(offer["header"]))
    assert header == offer["header"]
    assert all(isinstance(f, bytes) for f in offer["frames"])


def test_bench_small():
    from hurray_ipc.bench.nixl import bench

    r = bench(4 * MiB, rounds=3)
    assert r["intact"] and len(r["mb_s"]) == 3 and r["mb_s_median"] > 0


@pytest.mark.gpu
def test_vram_round_trip():
    """DRAM -> VRAM -> DRAM through two engines (GPUDirect-capable UCX backend and a CUDA device).
    The receiver's device reads only after the sender observed DONE (here: the same process)."""
    from conftest import REAL_SKIP
    from hurray_ipc.devices.backend.real import RealRuntime

    if REAL_SKIP:
        pytest.skip(f"real CUDA not available here: {REAL_SKIP}")
    if not rdma.nixl_info().gpudirect:
        pytest.skip("NIXL's UCX backend here takes no VRAM regions")
    rt = RealRuntime()
    rt.set_device(0)
    size = 64 * MiB
    src, back = payload(size, seed=3), np.zeros(size, np.uint8)
    dptr = rt.malloc(size)
    stream = rt.stream_create()
    try:
        rt.memset_async(dptr, 0, size, stream)
        rt.stream_synchronize(stream)  # sync-contract §6: writes to the destination retired first
        with RdmaEngine("test-tx") as tx, RdmaEngine("test-rx") as rx:
            vram = rx.register(dptr, size, "VRAM", 0)
            with tx.write(tx.register_array(src), rx.expose(vram)) as t:
                t.wait(timeout=30)
            # and back: the device region as the source, host memory as the destination
            with rx.write(vram, tx.expose(tx.register_array(back))) as t:
                t.wait(timeout=30)
        assert sha(back) == sha(src)
    finally:
        rt.stream_destroy(stream)
        rt.free(dptr)


_CORRUPT_OFFER = """
import numpy as np
from hurray_ipc.broker import rdma
tx = rdma.RdmaEngine("tx")
rx = rdma.RdmaEngine("rx")
offer = rx.expose(rx.register_array(np.zeros(4096, np.uint8)))
md = bytearray(offer["frames"][0])
md[md.index(b"|c") + 2 + 8] = 0x4D  # the UCX worker address's first byte: version 13
try:
    tx.write(tx.register_array(np.zeros(4096, np.uint8)), {"header": offer["header"], "frames": [bytes(md)]})
    print("POSTED")
except rdma.RdmaError as e:
    print("REFUSED", e)
good = rx.expose(rx.register_array(np.zeros(4096, np.uint8)))
tx.write(tx.register_array(np.ones(4096, np.uint8)), good).wait(30)
print("ALIVE")
"""


def test_an_offer_whose_ucx_address_version_is_unknown_is_refused_not_an_abort(tmp_path):
    """Red team item 1: a linked receiver's RDMA_REGISTER whose UCX worker address starts with
    0x4d made UCX assert inside add_remote_agent (SIGABRT of the exporting broker and every local
    client). The offer's metadata head is checked first: refused with RdmaError, and the engine
    goes on writing to a good offer. In a child process, so a regression fails this test only."""
    import subprocess
    import sys

    script = tmp_path / "corrupt.py"
    script.write_text(_CORRUPT_OFFER)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"rc {r.returncode} (-6: SIGABRT): {r.stdout} {r.stderr[-1500:]}"
    assert "REFUSED bad offer: UCX worker address version 13" in r.stdout and "ALIVE" in r.stdout, r.stdout


def test_metadata_head_checks():
    md = b"nixlSerDes|Agent\x02\x00\x00\x00\x00\x00\x00\x00ab|Conns\x08\x00\x00\x00\x00\x00\x00\x00" \
         b"\x01\x00\x00\x00\x00\x00\x00\x00|t\x03\x00\x00\x00\x00\x00\x00\x00UCX|c\x01\x00\x00\x00\x00\x00\x00\x00\x21"
    rdma.check_metadata(md, "ab")
    for bad, match in [(md[:5], "nixlSerDes"), (md.replace(b"|Agent", b"|Agenx"), "lacks '|Agent'"),
                       (md[:-1], "runs past its end"), (md[:-1] + b"\x4d", "version 13"),
                       (md.replace(b"\x01\x00\x00\x00\x00\x00\x00\x00|t", b"\x00\x00\x00\x00\x00\x00\x00\x00|t"),
                        "0 backend connections")]:
        with pytest.raises(RdmaError, match=match):
            rdma.check_metadata(bad, "ab")
    with pytest.raises(RdmaError, match="metadata is agent ab"):
        rdma.check_metadata(md, "someone")


@pytest.mark.parametrize("wire", [
    None,
    {"header": {}, "frames": []},
    {"header": {"version": rdma.OFFER_VERSION, "agent": "", "mem": "DRAM", "descs": [[1, 1, 0]], "size": 1},
     "frames": [b"x"]},
    {"header": {"version": rdma.OFFER_VERSION, "agent": "a", "mem": "DRAM", "descs": [[1, 1, 0]], "size": 2},
     "frames": [b"x"]},
    {"header": {"version": rdma.OFFER_VERSION, "agent": "a", "mem": "DRAM", "descs": [[1, 1, 0]], "size": 1},
     "frames": [b"not NIXL's serialisation"]},
    {"header": {"version": rdma.OFFER_VERSION, "agent": "a", "mem": "DRAM", "descs": [[True, 1, 0]], "size": 1},
     "frames": [b"x"]},
    {"header": {"version": rdma.OFFER_VERSION, "agent": "a", "mem": "DRAM", "descs": [[1, 1, 0], [2, 1, 0]],
                "size": 2}, "frames": [b"x"]},
    {"header": {"version": True, "agent": "a", "mem": "DRAM", "descs": [[1, 1, 0]], "size": 1}, "frames": [b"x"]},
], ids=["not-a-dict", "empty", "no-agent", "wrong-size", "bad-metadata", "boolean-address", "two-descriptors",
        "boolean-version"])
def test_a_malformed_offer_is_a_bad_offer_by_type(wire):
    """The bridge answers bad_offer for the link's fault and rdma_failed for NIXL's: it told them
    apart by the words 'bad offer' in the message, now by the exception's type (issue 23)."""
    with pytest.raises(rdma.BadOffer, match="^bad offer: "):
        rdma.Offer.from_wire(wire)
