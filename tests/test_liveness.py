"""Liveness leases (transport/liveness.py) and the endpoint lock (hurray_ipc/broker/lock.py).

Every verdict here follows a state the test established first (the child printed its lease, the
child was reaped, the child is stopped): nothing depends on timing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import unshare_cmd
from hurray_ipc.broker.lock import BrokerAlreadyRunning, acquire_endpoint
from hurray_ipc.devices import shm
from hurray_ipc.transport import liveness

HOLDER = textwrap.dedent("""
    import sys, os
    from hurray_ipc.transport.liveness import Lease, pid_namespace
    lease = Lease()
    print(lease.name, pid_namespace(), os.getpid(), flush=True)
    sys.stdin.read()  # hold until told (EOF) or killed
    if sys.argv[-1] == "close":
        lease.close()
    else:
        os._exit(0)  # die without closing (like a crash; SIGKILL cannot reach a namespace's init)
""")


def _holder(*prefix: str, close: bool = False) -> tuple[subprocess.Popen, str, int, int]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([*prefix, sys.executable, "-c", HOLDER, "close" if close else "keep"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None
    name, ns, pid = p.stdout.readline().split()
    return p, name, int(ns), int(pid)


def test_lease_alive_while_held_and_gone_after_close():
    lease = liveness.Lease()
    assert liveness.probe(lease.name) is True
    lease.close()
    assert liveness.probe(lease.name) is None, "a closed lease's file is gone: nothing to probe"


@pytest.mark.machine_wide  # any broker's sweep probes (and removes) every dead lease of this user
def test_killed_holder_is_dead_at_once_and_its_file_swept():
    p, name, _, _ = _holder()
    assert liveness.probe(name) is True
    p.kill()
    p.wait()  # reaped: the kernel has released its lock
    assert liveness.probe(name) is False
    assert not (liveness.LEASE_DIR / name).exists()


def test_stopped_holder_is_alive():
    """A process that cannot answer (SIGSTOP, a C call holding the GIL) is not dead."""
    p, name, _, _ = _holder()
    try:
        os.kill(p.pid, signal.SIGSTOP)
        assert liveness.probe(name) is True
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait()


def test_clean_exit_closes_the_lease():
    p, name, _, _ = _holder(close=True)
    p.communicate("")
    assert liveness.probe(name) is None


@pytest.mark.parametrize("name", ["", "x", "hurray-0-lease-1-2-zz", "../etc/passwd",
                                  f"hurray-{os.getuid() + 1}-lease-1-2-{'a' * 16}",
                                  f"hurray-{os.getuid()}-lease-1-2-{'b' * 16}", 12])
def test_probe_of_a_non_lease_is_unknown(name):
    assert liveness.probe(name) is None


def test_probe_refuses_a_file_it_cannot_trust(tmp_path):
    name = f"hurray-{os.getuid()}-lease-1-2-{'c' * 16}"
    (tmp_path / name).mkdir()
    assert liveness.probe(name, tmp_path) is None, "a directory is not a lease"


@pytest.mark.machine_wide  # as above: its last probe races any other sweep
def test_holder_in_another_pid_namespace():
    """Its pid means nothing here (it is 1 or 2 in its namespace); its lease still decides."""
    p, name, ns, pid = _holder(*unshare_cmd())
    try:
        assert ns != liveness.pid_namespace() and pid < 10
        assert liveness.probe(name) is True
        assert pid in liveness.live_foreign_pids()
    finally:
        p.communicate("")  # EOF: the holder exits abruptly; unshare returns once it is gone
    assert liveness.probe(name) is False


@pytest.mark.machine_wide
def test_stale_segment_sweep_keeps_live_foreign_namespace_segments_and_survives_huge_pids():
    fake_foreign = f"/{shm.PREFIX}-{os.getuid()}-4000000-c1-aaaaaa"  # a pid no live process has here
    huge = f"/{shm.PREFIX}-{os.getuid()}-2147483648-c1-bbbbbb"       # once killed the broker (OverflowError)
    for n in (fake_foreign, huge):
        shm.Segment.create(8, "c").close()  # the sweep's real segments: exercise the normal path too
        with open(shm.SHM_DIR / n.lstrip("/"), "wb") as f:
            f.write(b"\0" * 8)
    removed = shm.cleanup_stale(keep_pids={4000000})
    assert huge in removed and fake_foreign not in removed
    assert shm.unlink(fake_foreign)


@pytest.mark.parametrize("pid", [0, -1, 2**31, 2**63, True, "1"])
def test_pid_alive_is_false_for_non_pids(pid):
    assert shm.pid_alive(pid) is False


def test_second_broker_lock_refused_and_released(tmp_path):
    sock = tmp_path / "b.sock"
    first = acquire_endpoint(sock)
    with pytest.raises(BrokerAlreadyRunning, match="broker already running at ipc://"):
        acquire_endpoint(sock)
    first.release()
    acquire_endpoint(sock).release()


def test_a_zombie_is_not_alive():
    """A killed process its parent has not reaped yet holds no memory: its segments are stale
    (a lease reports the death before the reap, so the sweep runs while it is a zombie)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert shm.pid_alive(p.pid)
    p.kill()
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # exited, deliberately not reaped
    assert not shm.pid_alive(p.pid)
    p.wait()


@pytest.mark.machine_wide
def test_a_sweep_touches_only_regular_files_this_user_owns(tmp_path):
    """The red team's 'another user's file stops the broker': a file named like one of our
    segments but owned by someone else made the sweep raise posix_ipc's PermissionsError (no
    OSError), which ended the broker; a directory of that name made every sweep fail. Both are
    skipped now, and a real stale segment of ours is still removed."""
    import posix_ipc

    from brokerproc import BrokerProcess
    from hurray_ipc.devices import shm

    uid = os.getuid()
    ours = f"/hurray-{uid}-{2**22 - 1}-c0-0badcafe"  # a dead pid's segment: stale, ours
    posix_ipc.SharedMemory(ours, posix_ipc.O_CREX, size=64).close_fd()
    planted = [f"/dev/shm/hurray-{uid}-{2**22 - 1}-c{i}-0badcafe" for i in (1, 2, 3)]
    os.mkdir(planted[0])  # a directory
    os.symlink("/dev/null", planted[1])  # a symlink
    with open(planted[2], "w") as f:  # another user's file (when we may give it away)
        f.write("x")
    foreign = os.getuid() == 0
    if foreign:
        os.chown(planted[2], 54321, 54321)
    try:
        removed = shm.cleanup_stale()
        assert ours in removed and all(os.path.lexists(p) for p in planted), removed
        if foreign:  # the broker starts (it sweeps at once) and keeps serving with them there
            b = BrokerProcess(f"ipc://{tmp_path}/b.sock").start()
            try:
                from hurray_ipc.client.query import stats

                assert stats(b.endpoint, 5.0)["broker"]["pid"] == b.proc.pid
            finally:
                assert "stale_sweep_failed" not in b.stop()
    finally:
        os.rmdir(planted[0])
        os.unlink(planted[1])
        os.unlink(planted[2])
        shm.unlink(ours)


def test_a_client_without_a_lease_is_judged_by_heartbeats_not_by_its_pid(tmp_path):
    """The spec-only implementation's finding 4: a same-host client without a lease whose pid the
    broker cannot see (a container's) got WELCOME and was dropped at the broker's next tick
    ('process gone'), then looped HELLO -> drop -> HELLO. Without a lease, heartbeats decide."""
    import json
    import time

    import zmq

    from brokerproc import BrokerProcess
    from hurray_ipc.devices.base import host_id
    from hurray_ipc.wire.ipc import decode_all

    b = BrokerProcess(f"ipc://{tmp_path}/b.sock", timeout=1.5).start()
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(b.endpoint)
        unseen = 4_000_000  # a pid of another namespace: none such here (past the kernel's pid_max)
        ep = {"device": {"kind": "cpu", "ordinal": 0, "uuid": "cpu-x", "pci_bus_id": "", "emulated": False,
                         "host": host_id()},
              "caps": {"ipc_memory": True, "ipc_events": False, "ipc_streams": False, "peers": []},
              "pid": unseen, "stream": None}

        def ask(verb: str, header: dict) -> str:
            s.send_multipart([verb.encode(), json.dumps(header).encode()])
            assert s.poll(5000)
            return decode_all(s.recv_multipart())[0].verb

        assert ask("HELLO", {"protocol": 2, "role": "consumer", "channel": "ns", "pid": unseen, "endpoint": ep}) \
            == "WELCOME"
        for _ in range(4):  # 1.2 s: the broker ticks every 50 ms; a pid verdict would have dropped it
            time.sleep(0.3)  # the client's own heartbeat period (a PING keeps it alive)
            assert ask("PING", {}) == "PONG"
        time.sleep(2.5)  # silent past timeout_ms: now it is gone
        assert ask("PING", {}) == "ERROR"  # not_registered
    finally:
        ctx.destroy(linger=0)
        b.stop()
