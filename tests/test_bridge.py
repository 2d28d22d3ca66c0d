"""Cross-machine transport: two brokers bridged over TCP on loopback (and, where the machine allows
it, across two network namespaces joined by veth)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zmq

from brokerproc import BrokerProcess
from conftest import SPAWN, emu_config, free_port
from hurray_ipc import workload
from hurray_ipc.broker.bridge import bound_endpoint, wait_bound
from hurray_ipc.client import Consumer, Producer
from test_clients import Proc
from workers import collect, once_let_through

ANY_PORT = "tcp://127.0.0.1:*"  # --listen: the sending bridge binds a free port and logs it (bridge_listening)


def listening(out, timeout: float = 30.0) -> str:
    """The endpoint that the sending bridge ``out``, started with ``--listen`` :data:`ANY_PORT`,
    bound: its object's (an :class:`InThread`), else its log's ``bridge_listening`` line, read
    without moving the file offset the bridge process writes at. A process that never says is
    killed (nothing else would stop it) and fails the test."""
    if isinstance(out, InThread):
        return str(out.bridge.endpoint)
    fd = out.log.fileno()

    def read() -> str:
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    if (url := wait_bound(read, lambda: out.poll() is None, timeout)) is None:
        out.kill()
        out.wait()
        raise AssertionError(f"the sending bridge (status {out.returncode}) never said where it listens: "
                             f"{read()[-1500:]}")
    return url


def bridge(*args, env=None):
    """A bridge process whose log goes to a file (``stop`` returns it): a pipe nobody drains fills
    at 64 KiB and then blocks the bridge in its next log line."""
    log = tempfile.TemporaryFile("w+")
    p = subprocess.Popen([sys.executable, "-m", "hurray_ipc.broker.bridge", *args], stderr=log, text=True,
                         env={**os.environ, **(env or {})})
    p.log = log  # type: ignore[attr-defined]
    return p


class _ThreadLog(logging.Handler):
    """Keeps the lines of the records that pass its filter (one :class:`InThread`'s log)."""

    def __init__(self, lines: list[str]):
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


class InThread:
    """A bridge built as ``python -m hurray_ipc.broker.bridge *args`` builds it (bridge.build), serving
    in a thread of this process: for tests whose subject is the link, not the process (no interpreter
    to start). Its log is what its serving thread logged (the lines a bridge process writes);
    :func:`stop` sets its stop event, joins it and returns that log."""

    level = logging.NOTSET  # the bridge logger's level before the first of those serving hooked it

    def __init__(self, *args: str):
        from hurray_ipc.broker.bridge import build, log, parser

        self.lines: list[str] = []
        self.error: BaseException | None = None
        self.threads = {threading.get_ident()}  # its construction's lines, then its thread's
        self.handler = _ThreadLog(self.lines)
        self.handler.addFilter(lambda r: r.thread in self.threads)
        self.log = log
        if not any(isinstance(h, _ThreadLog) for h in log.handlers):  # the first of those hooked
            InThread.level = log.level
        log.addHandler(self.handler)
        log.setLevel(logging.INFO)
        try:
            self.bridge = build(parser().parse_args(list(args)))
        except BaseException:
            self._unhook()
            raise
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, name=f"bridge-{args[0]}", daemon=True)
        self.thread.start()
        _LIVE.append(self)
        self.returncode: int | None = None

    def _serve(self) -> None:
        self.threads = {threading.get_ident()}
        try:
            self.bridge.serve(self.stopping)
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def _unhook(self) -> None:
        self.log.removeHandler(self.handler)
        if not any(isinstance(h, _ThreadLog) for h in self.log.handlers):  # the last of those hooked
            self.log.setLevel(InThread.level)

    def poll(self) -> int | None:
        return None if self.thread.is_alive() else 0

    def log_so_far(self) -> str:
        return "\n".join(list(self.lines))

    def stop(self) -> str:
        """Stop it (once), wait for its loop to close the bridge (10 s at most) and return its log;
        a loop that raised or did not end fails the test."""
        self.stopping.set()
        if self in _LIVE:
            _LIVE.remove(self)
        if self.returncode is None:
            self.thread.join(10)
            self._unhook()
            self.returncode = 0
            assert not self.thread.is_alive(), f"the bridge's loop did not end: {self.log_so_far()[-1500:]}"
            assert self.error is None, f"the bridge's loop raised {self.error!r}: {self.log_so_far()[-1500:]}"
        return self.log_so_far()


_LIVE: list[InThread] = []  # started and not yet stopped


@pytest.fixture(autouse=True)
def _no_bridge_thread_left():
    """Stop the :class:`InThread` bridges a test left serving (one that failed before its
    ``finally``, e.g. building its second bridge): a loop left running would hold its sockets and
    context into the next tests."""
    yield
    while _LIVE:
        _LIVE.pop().stop()


_SEQ = itertools.count(1)


def fresh(name: str) -> str:
    """A channel name no other test of this module uses: the brokers are shared between tests
    (:func:`two_brokers`), so each test's channel starts with no producer, consumer or end."""
    return f"{name}-{next(_SEQ)}"


def _start_brokers(d):
    """Brokers A and B on ``d``, started together (each start is mostly the interpreter's import)."""
    pair = BrokerProcess(f"ipc://{d}/a.sock"), BrokerProcess(f"ipc://{d}/b.sock")
    with ThreadPoolExecutor(2) as pool:
        return tuple(pool.map(BrokerProcess.start, pair))


def _stop_brokers(*brokers):
    with ThreadPoolExecutor(len(brokers)) as pool:  # their shutdowns overlap
        list(pool.map(BrokerProcess.stop, brokers))


@pytest.fixture(scope="module")
def _shared_brokers(tmp_path_factory):
    d = tmp_path_factory.mktemp("brokers")
    pair = list(_start_brokers(d))
    yield d, pair
    _stop_brokers(*pair)


@pytest.fixture
def two_brokers(_shared_brokers):
    """Brokers A and B, shared by the tests of this module: each test uses channels of its own
    (:func:`fresh`). A broker a test took down is started again for the next test, and that test
    fails: every test here leaves both brokers running."""
    d, pair = _shared_brokers
    if any(x.proc is None or x.proc.poll() is not None for x in pair):
        _stop_brokers(*pair)
        pair[:] = _start_brokers(d)
    yield tuple(pair)
    down = [x.endpoint for x in pair if x.proc is None or x.proc.poll() is not None]
    assert not down, f"a broker went down during the test: {down}"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("bridge") / "keys"
    r = subprocess.run([sys.executable, "-m", "hurray_ipc.broker.bridge", "keygen", str(d)], capture_output=True)
    assert r.returncode == 0
    return d


def _terminate(p):
    """SIGTERM ``p``, once: a second SIGTERM may come while it shuts down, its handler gone, and
    kill it (a broker's status is then -15, not 0). An :class:`InThread` bridge: its stop event."""
    if isinstance(p, InThread):
        p.stopping.set()
    elif p.poll() is None and not getattr(p, "terminated", False):
        p.send_signal(signal.SIGTERM)
        p.terminated = True


def stop(p):
    """SIGTERM ``p`` (unless it was), wait for it (SIGKILL after 10 s), and return its log."""
    if isinstance(p, InThread):
        return p.stop()
    _terminate(p)
    try:
        err = p.communicate(timeout=10)[1]
    except subprocess.TimeoutExpired:
        p.kill()
        err = p.communicate()[1]
    log = getattr(p, "log", None)
    if log is not None:  # kept: a test may stop a bridge twice
        if not log.closed:
            log.seek(0)
            p.log_text = log.read()
            log.close()
        err = p.log_text
    return err


def stop_all(*procs):
    """:func:`stop` each of ``procs``, all signalled first so that their shutdowns overlap; their logs."""
    for p in procs:
        _terminate(p)
    return tuple(stop(p) for p in procs)


def test_bridged_handoffs_curve(two_brokers, keys):
    a, b = two_brokers
    ch = fresh("x")
    out = bridge("out", "--channel", ch, "--endpoint", a.endpoint, "--listen", ANY_PORT,
                 "--server-key", str(keys / "server.key_secret"), "--clients", str(keys / "clients"))
    url = listening(out)
    inn = bridge("in", "--channel", ch, "--endpoint", b.endpoint, "--connect", url,
                 "--client-key", str(keys / "client.key_secret"), "--server-public", str(keys / "server.key"))
    try:
        env = emu_config().to_env()
        n, size = 6, (3 << 20) + 12345  # several chunks, not a multiple of the chunk size
        c = Proc(workload.run_consumer, endpoint=b.endpoint, channel=ch, device="cpu", count=n, env=env)
        p = Proc(workload.run_producer, endpoint=a.endpoint, channel=ch, device="cuda:0", count=n, size=size, env=env)
        pr, cr = p.result(), c.result()
        assert pr["error"] is None and cr["error"] is None, (pr["error"], cr["error"])
        assert cr["received"] == cr["intact"] == n and cr["corrupt"] == 0
        assert cr["modes"] == {"SYNC_PRODUCER_SYNCED": n}
        assert pr["staged"] == n, "the sending bridge is a CPU consumer: GPU buffers reach it host-staged"
        assert pr["released"] == n
    finally:
        stop_all(out, inn)


def test_arrays_and_user_metadata_cross_the_bridges_as_sent(two_brokers):
    """Shape, dtype, byte order and the sender's own metadata (h.meta, exactly as sent) arrive on
    the other broker's consumer: the sending bridge forwards the HANDOFF's whole meta object."""
    import numpy as np

    from hurray_ipc.client import Consumer, Producer

    a, b = two_brokers
    ch = fresh("m")
    out = InThread("out", "--channel", ch, "--endpoint", a.endpoint, "--listen", ANY_PORT, "--insecure")
    url = listening(out)
    inn = InThread("in", "--channel", ch, "--endpoint", b.endpoint, "--connect", url, "--insecure")
    sent = [(np.arange(6, dtype=">i2").reshape(2, 3), {"frame": 1, "tags": ["a", "b"]}),
            (np.float32(2.5).reshape(()), ["x", 2]),
            (np.arange(4, dtype=np.uint8), None)]
    try:
        with Producer(a.endpoint, ch, "cpu") as p, Consumer(b.endpoint, ch, "cpu") as c:
            for arr, meta in sent:
                p.send(arr, meta=meta, block=False, timeout=30)
                with c.receive(timeout=30) as h:
                    got = h.numpy()
                    assert (got.dtype.str, got.shape, h.meta) == (arr.dtype.str, arr.shape, meta)
                    assert np.array_equal(got, arr)
    finally:
        stop_all(out, inn)


def _channel_state(endpoint, channel):
    """The broker's own view of ``channel`` (STATS): its producers and whether it is ended."""
    from hurray_ipc.client.query import stats

    ch = [x for x in stats(endpoint, 5.0)["channels"] if x["name"] == channel]
    return (ch[0]["producers"], ch[0]["ended"]) if ch else (0, False)


def test_an_ended_stream_on_one_side_neither_stops_nor_ends_the_bridge(two_brokers):
    """A producer on A that ends its stream (close) must not end the sending bridge (it is a
    consumer of A, whose receive raises EndOfStream then), and a receiving bridge that stops must
    not end B's stream: neither end came from a producer of B's channel."""
    from hurray_ipc.client import Consumer, Producer

    a, b = two_brokers
    ch = fresh("e")
    out = InThread("out", "--channel", ch, "--endpoint", a.endpoint, "--listen", ANY_PORT, "--insecure")
    url = listening(out)
    inn = InThread("in", "--channel", ch, "--endpoint", b.endpoint, "--connect", url, "--insecure")
    try:
        with Consumer(b.endpoint, ch, "cpu") as c:
            for i in range(2):
                with Producer(a.endpoint, ch, "cpu") as p:  # leaving the block ends A's stream
                    p.send(bytes([i]) * 8, block=False, timeout=30)
                    with c.receive(timeout=30) as h:
                        assert bytes(h.buffer.host_view()) == bytes([i]) * 8
            assert out.poll() is None, stop(out)
            assert stop(inn) is not None and inn.returncode is not None
            deadline = time.monotonic() + 10
            while _channel_state(b.endpoint, ch)[0]:  # the receiving bridge, B's producer, went
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert _channel_state(b.endpoint, ch) == (0, False) and not c.ended
    finally:
        stop_all(out, inn)


def test_keys_required_unless_insecure(two_brokers):
    a, _ = two_brokers
    ch = fresh("x")
    p = bridge("out", "--channel", ch, "--endpoint", a.endpoint, "--listen", ANY_PORT)
    assert p.wait(30) == 2 and "--insecure" in stop(p)


def raw_sender():
    """A hand-driven sending peer: its ROUTER socket, bound to a free port, and that endpoint."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(ANY_PORT)
    return s, s.getsockopt_string(zmq.LAST_ENDPOINT)


def recv(s, verb, timeout=10000):
    deadline = time.monotonic() + timeout / 1000
    while time.monotonic() < deadline:
        if s.poll(100):
            parts = s.recv_multipart()
            if parts[1].decode() == verb:
                return parts[0], json.loads(parts[2])
    raise AssertionError(f"no {verb}")


def send(s, rid, verb, header, *frames):
    s.send_multipart([rid, verb.encode(), json.dumps(header).encode(), *frames])


def raw_receiver(url):
    """A hand-driven receiving peer: its DEALER socket, say(verb, header, *frames), expect(verb) -> header."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(url)

    def say(verb, header, *frames):
        s.send_multipart([verb.encode(), json.dumps(header).encode(), *frames])

    def expect(verb, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if s.poll(100):
                parts = s.recv_multipart()
                if parts[0] == verb.encode():
                    return json.loads(parts[1])
        raise AssertionError(f"no {verb}")

    return s, say, expect


def _longest_silence(s, rid, seconds, after=lambda: True, within=30.0):
    """As a hand-driven sender, speak to the receiver every 50 ms until ``after()`` holds (at most
    ``within`` s), then for ``seconds`` more, and return the longest time it said nothing to us."""
    heard = [time.monotonic()]
    end, deadline = None, heard[0] + within
    while end is None or time.monotonic() < end:
        if end is None and after():
            end = time.monotonic() + seconds
        assert end is not None or time.monotonic() < deadline, "what the observation waits for never happened"
        send(s, rid, "LINK_PONG", {})
        if s.poll(50):
            s.recv_multipart()
            heard.append(time.monotonic())
    heard.append(time.monotonic())
    return max(y - x for x, y in zip(heard, heard[1:], strict=False))


def log_so_far(p) -> str:
    """What the bridge ``p`` (started by :func:`bridge`) logged so far, read while it runs: pread
    leaves alone the file offset the bridge shares with us (a seek would move where it writes)."""
    if isinstance(p, InThread):
        return p.log_so_far()
    fd = p.log.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def test_descriptors_that_fit_alone_but_not_together_get_no_space_not_sigbus(two_brokers):
    """Red team item 7 (interchange.md §3 receiver rule 1): a receiving bridge whose /dev/shm is
    96 MiB (a tmpfs in its own mount namespace) gets two 60 MiB descriptors. Each passes a
    free-space check alone; before, both were accepted and the bytes of the second killed the
    bridge with SIGBUS. Now the first destination is reserved whole, the second is refused
    `no_space` with its credit, and the bridge goes on: the first transfer's bytes all land."""
    import shutil

    ns = ["unshare", "--user", "--map-root-user", "--mount"]
    if shutil.which("unshare") is None or subprocess.run([*ns, "true"], capture_output=True).returncode != 0:
        pytest.skip("this machine does not let this user create user+mount namespaces")
    _, b = two_brokers
    ch = fresh("full")
    s, url = raw_sender()
    inn = subprocess.Popen([*ns, "sh", "-c", "mount -t tmpfs -o size=96m tmpfs /dev/shm && exec \"$@\"", "sh",
                            sys.executable, "-m", "hurray_ipc.broker.bridge", "in", "--channel", ch,
                            "--endpoint", b.endpoint, "--connect", url, "--insecure"],
                           stderr=subprocess.PIPE, text=True)
    size = 60 << 20
    chunk = b"\x01" * (4 << 20)
    try:
        rid, _ = recv(s, "LINK_HELLO", timeout=30_000)
        send(s, rid, "LINK_WELCOME", {"protocol": 1})
        recv(s, "CREDIT")
        for tid in (1, 2):
            send(s, rid, "TENSOR_DESCRIPTOR", {"transfer_id": tid, "total_bytes": size},
                 struct.pack("<QIBB2s", size, 64, 0, 0, b"\0\0"))
        for tid in (1, 2):  # the bytes of both, as a sender that ignores the REJECT would
            for off in range(0, size, len(chunk)):
                send(s, rid, "TENSOR_DATA", {"transfer_id": tid, "byte_offset_in_buffer": off}, chunk)
        _, rej = recv(s, "REJECT", timeout=30_000)
        assert (rej["transfer_id"], rej["reason"]) == (2, "no_space"), rej
        assert recv(s, "CREDIT")[1] == {"n": 1}
        recv(s, "LINK_PING", timeout=30_000)  # alive after every byte of transfer 1 landed
        assert inn.poll() is None
    finally:
        err = stop(inn)
        s.close()
    assert "SIGBUS" not in err and "no_space" in err, err[-2000:]


def test_a_consumer_gone_before_its_handoff_arrived_neither_loses_it_nor_stops_the_link(two_brokers):
    """A local consumer asks (REQUEST) and leaves (BYE) before the bridge's handoff to it arrives:
    the broker refuses the handoff (consumer_gone). The receiving bridge hands the buffer on again
    to the next consumer, and meanwhile goes on answering the link (a send that waited for another
    consumer inside its loop fell silent: its sender would drop the link)."""
    from hurray_ipc.client.query import BrokerQuery
    from test_vectors_refusals import _ep

    _, b = two_brokers
    ch = fresh("v")
    s, url = raw_sender()
    timeout = 1.0  # the link timeout: a receiver silent this long is dropped by its sender
    inn = InThread("in", "--channel", ch, "--endpoint", b.endpoint, "--connect", url, "--insecure",
                   "--timeout", str(timeout))
    # The next consumer: its process starts now, and connects to B only once let through below
    gate = SPAWN.Event()
    collector = Proc(once_let_through, gate=gate, target=collect, endpoint=b.endpoint, channel=ch, n=1)
    data = workload.pattern(5, 0, 4096).tobytes()
    gone = zmq.Context.instance().socket(zmq.DEALER)
    gone.setsockopt(zmq.LINGER, 1000)
    watcher = BrokerQuery(b.endpoint)
    try:
        rid, _ = recv(s, "LINK_HELLO")
        send(s, rid, "LINK_WELCOME", {"protocol": 1})
        recv(s, "CREDIT")
        send(s, rid, "TENSOR_DESCRIPTOR", {"transfer_id": 1, "total_bytes": 4096},
             struct.pack("<QIBB2s", 4096, 64, 0, 0, b"\0\0"))
        send(s, rid, "TENSOR_DATA", {"transfer_id": 1, "byte_offset_in_buffer": 0}, data)
        send(s, rid, "TENSOR_DATA_END", {"transfer_id": 1, "total_bytes": 4096})
        gone.connect(b.endpoint)

        def ready():  # the bridge's READY the broker holds for channel v (STATS, spec §2.3)
            reply = watcher.stats(5.0)
            return sum(c["ready"] for c in reply["channels"] if c["name"] == ch)

        deadline = time.monotonic() + 20
        while not ready():  # the ended transfer waits and the bridge has asked for a consumer
            assert time.monotonic() < deadline, "the bridge never asked for a consumer"
            send(s, rid, "LINK_PONG", {})  # the sender keeps the link answered meanwhile
            time.sleep(0.02)
        # One burst, handled in order by the broker: the GRANT goes to the bridge, then the consumer is gone.
        for verb, header in (("HELLO", {"protocol": 2, "role": "consumer", "channel": ch, "pid": os.getpid(),
                                        "endpoint": _ep(os.getpid())}),
                             ("REQUEST", {"credits": 1}), ("BYE", {})):
            gone.send_multipart([verb.encode(), json.dumps(header).encode()])
        # From the burst until two link timeouts after the bridge bounced the refused handoff (the
        # moment a bridge that waited for another consumer in its loop would fall silent):
        gap = _longest_silence(s, rid, 2 * timeout, after=lambda: '"hand_on_again"' in log_so_far(inn))
        assert gap < timeout, f"the receiver said nothing for {gap:.2f} s after its consumer went"
        gate.set()
        got = collector.result()
        assert isinstance(got, list), got  # else the collector's error
        assert [g["hex"] for g in got] == [data.hex()]
    finally:
        if not gate.is_set():  # the test failed before: it never ran
            collector.kill()
        err = stop(inn)
        s.close()
        gone.close()
        watcher.close()
    assert '"hand_on_again"' in err and "hand_on_refused" not in err, err[-1500:]


@pytest.mark.parametrize("plane", ["zmq", "nixl"])
def test_link_cut_mid_transfer_releases_once(two_brokers, plane):
    if plane == "nixl" and _nixl_reason() is not None:
        pytest.skip(f"NIXL unusable: {_nixl_reason()}")
    rdma = ["--rdma"] if plane == "nixl" else []
    a, b = two_brokers
    ch = fresh("y")
    # A link timeout of 1 s (3 s by default): the sending bridge learns of the cut by the
    # receiver's silence, so the release after the cut comes a link timeout later.
    out = bridge("out", "--channel", ch, "--endpoint", a.endpoint, "--listen", ANY_PORT, "--insecure", "--timeout", "1",
                 *rdma)
    url = listening(out)
    inn = bridge("in", "--channel", ch, "--endpoint", b.endpoint, "--connect", url, "--insecure", "--timeout", "1",
                 *rdma)
    try:
        counters = SPAWN.Array("q", workload.COUNTERS)
        # several transfers in flight (the receiver's window is 4) when the link is cut
        p = Proc(workload.run_producer, endpoint=a.endpoint, channel=ch, device="cpu", count=4, size=96 << 20,
                 env={}, pool=4, counters=counters)
        deadline = time.monotonic() + 60
        while counters[workload.P_SENT] < 4:  # the bridge took all four: transfers are under way
            assert time.monotonic() < deadline, "the handoff never reached the bridge"
            time.sleep(0.01)
        inn.kill()  # cut the link mid-transfer (or just after): either way one release, in bounded time
        pr = p.result(timeout=120)
        assert pr["error"] is None, pr["error"]
        assert pr["sent"] == pr["released"] == 4, "each released back to the producer exactly once"
    finally:
        stop_all(out, inn)


@pytest.mark.parametrize("plane", ["zmq", "nixl"])
def test_a_late_local_consumer_loses_nothing_and_keeps_the_link(two_brokers, plane):
    """A receiving bridge never waits for a local consumer: while none asks, ended transfers wait
    (their credits with them: the sender's backpressure) and the link stays answered. Here B has
    no consumer for three link timeouts after the bridge took the producer's first buffers; then
    one comes and gets every buffer, each released to the producer once, and the link was never
    lost. (A receiver that blocked until a consumer asked fell silent: its sender dropped the link
    and the transfers in flight.)"""
    if plane == "nixl" and _nixl_reason() is not None:
        pytest.skip(f"NIXL unusable: {_nixl_reason()}")
    rdma = ["--rdma"] if plane == "nixl" else []
    a, b = two_brokers
    ch = fresh("late")
    timeout = 0.5  # the link timeout: a receiver silent this long is dropped by its sender
    out = InThread("out", "--channel", ch, "--endpoint", a.endpoint, "--listen", ANY_PORT, "--insecure",
                   "--timeout", str(timeout), *rdma)
    url = listening(out)
    inn = InThread("in", "--channel", ch, "--endpoint", b.endpoint, "--connect", url, "--insecure",
                   "--timeout", str(timeout), *rdma)
    gate, c = SPAWN.Event(), None
    try:
        counters = SPAWN.Array("q", workload.COUNTERS)
        p = Proc(workload.run_producer, endpoint=a.endpoint, channel=ch, device="cpu", count=8, size=1 << 20,
                 env={}, pool=8, counters=counters, timeout=60)
        deadline = time.monotonic() + 60
        while counters[workload.P_SENT] < 4:  # the receiver's window of transfers is under way
            assert time.monotonic() < deadline, "the handoffs never reached the bridge"
            time.sleep(0.01)
        # B's consumer: its process starts now, and connects to B only once let through after the wait
        c = Proc(once_let_through, gate=gate, target=workload.run_consumer, endpoint=b.endpoint, channel=ch,
                 device="cpu", count=8, env={}, timeout=60)
        time.sleep(3 * timeout)  # the scenario: no consumer on B for three link timeouts
        gate.set()
        pr, cr = p.result(), c.result()
    finally:
        if c is not None and not gate.is_set():  # the test failed before: it never ran
            c.kill()
        out_err, in_err = stop_all(out, inn)
    logs = _all_through(pr, cr, 8, out_err, in_err)
    assert in_err.count('"event": "linked"') == 1 and "transfer_aborted" not in out_err, logs


def _netns(*cmd):
    return subprocess.run(["ip", *cmd], capture_output=True, text=True)


@pytest.fixture
def netns_pair():
    """Two network namespaces joined by a veth pair: two test hosts, 10.77.0.1 and 10.77.0.2."""
    tag = f"h{os.getpid() % 100000}"
    a, b = f"hurray-{tag}-a", f"hurray-{tag}-b"
    if _netns("netns", "add", a).returncode != 0:
        pytest.skip("cannot create network namespaces here (needs root and iproute2)")
    try:
        steps = [("netns", "add", b), ("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b"),
                 ("link", "set", f"{tag}a", "netns", a), ("link", "set", f"{tag}b", "netns", b),
                 ("-n", a, "addr", "add", "10.77.0.1/30", "dev", f"{tag}a"),
                 ("-n", b, "addr", "add", "10.77.0.2/30", "dev", f"{tag}b"),
                 ("-n", a, "link", "set", f"{tag}a", "up"), ("-n", b, "link", "set", f"{tag}b", "up"),
                 ("-n", a, "link", "set", "lo", "up"), ("-n", b, "link", "set", "lo", "up")]
        for st in steps:
            r = _netns(*st)
            if r.returncode != 0:
                pytest.skip(f"cannot set up veth between namespaces: ip {' '.join(st)}: {r.stderr.strip()}")
        yield a, b
    finally:
        _netns("netns", "del", a), _netns("netns", "del", b)


@pytest.mark.parametrize("plane", ["zmq", "nixl"])
def test_bridge_across_network_namespaces(two_brokers, keys, netns_pair, plane):
    if plane == "nixl" and _nixl_reason() is not None:
        pytest.skip(f"NIXL unusable: {_nixl_reason()}")
    rdma = ["--rdma"] if plane == "nixl" else []
    a, b = two_brokers
    ch = fresh("z")
    ns_a, ns_b = netns_pair
    url = f"tcp://10.77.0.1:{5599 if plane == 'zmq' else 5598}"
    out = subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, "-m", "hurray_ipc.broker.bridge", "out",
                            "--channel", ch, "--endpoint", a.endpoint, "--listen", url,
                            "--server-key", str(keys / "server.key_secret"), "--clients", str(keys / "clients"),
                            *rdma], stderr=subprocess.PIPE, text=True)
    inn = subprocess.Popen(["ip", "netns", "exec", ns_b, sys.executable, "-m", "hurray_ipc.broker.bridge", "in",
                            "--channel", ch, "--endpoint", b.endpoint, "--connect", url,
                            "--client-key", str(keys / "client.key_secret"),
                            "--server-public", str(keys / "server.key"), *rdma],
                           stderr=subprocess.PIPE, text=True)
    try:
        c = Proc(workload.run_consumer, endpoint=b.endpoint, channel=ch, device="cpu", count=4, env={})
        p = Proc(workload.run_producer, endpoint=a.endpoint, channel=ch, device="cpu", count=4, size=2 << 20, env={})
        pr, cr = p.result(), c.result()
        assert pr["error"] is None and cr["error"] is None, (pr["error"], cr["error"])
        assert cr["intact"] == 4 and pr["released"] == 4
    finally:
        out_err, in_err = stop_all(out, inn)
    said = f'"data_plane": "{plane}"'
    assert said in out_err and said in in_err, (out_err[-800:], in_err[-800:])


def _routes(endpoint, channel):
    """The bridges CAPS_REPLY names for ``channel`` (ipc-protocol.md §2.4): (direction, data_plane, gpu) per link."""
    from hurray_ipc.cli.caps import broker_answer, render

    d = broker_answer(endpoint, "cpu", None, channel, None, 5.0)
    assert "bridge" in render(d) or not d["bridges"]  # hurray-caps prints them too
    return [(b["direction"], x["data_plane"], x["gpu"]) for b in d["bridges"] for x in b["links"]]


def test_sending_bridge_leaves_its_broker_when_its_last_peer_goes(two_brokers):
    """A sending bridge is a consumer of its broker only while a peer is linked (it must not hold
    handoffs nobody can receive): its route appears in CAPS with the peer's link and goes, consumer
    and all, once the peer falls silent past the link timeout."""
    from hurray_ipc.cli.caps import broker_answer

    a, _ = two_brokers
    ch = fresh("lv")
    # a 0.5 s link timeout: the peer stays linked while it speaks (below), goes half a second after it falls silent
    out = InThread("out", "--channel", ch, "--endpoint", a.endpoint, "--listen", ANY_PORT, "--insecure",
                   "--timeout", "0.5")
    url = listening(out)
    s, say, expect = raw_receiver(url)

    def bridges():
        return [(x["direction"], len(x["links"])) for x in broker_answer(a.endpoint, "cpu", None, ch, None, 5.0)
                .get("bridges", [])]

    try:
        say("LINK_HELLO", {"protocol": 1, "channel": ch, "window": 2})
        expect("LINK_WELCOME")
        deadline = time.monotonic() + 20
        while bridges() != [("export", 1)]:
            assert time.monotonic() < deadline, f"never linked in CAPS: {bridges()}"
            say("LINK_PING", {})  # a linked receiver's keep-alive: the peer is not silent yet
            time.sleep(0.05)
        s.close()  # the peer falls silent
        deadline = time.monotonic() + 20
        while bridges() != []:
            assert time.monotonic() < deadline, f"the bridge still a consumer of its broker: {bridges()}"
            time.sleep(0.05)
    finally:
        stop(out)


def test_bridge_copies_to_receiver_gpu(two_brokers):
    """--device cuda:0 on the receiving side: buffers reach B's consumers in GPU memory, synced."""
    a, b = two_brokers
    ch = fresh("g")
    env = emu_config().to_env()
    out = bridge("out", "--channel", ch, "--endpoint", a.endpoint, "--listen", ANY_PORT, "--insecure")
    url = listening(out)
    inn = bridge("in", "--channel", ch, "--endpoint", b.endpoint, "--connect", url, "--insecure", "--device", "cuda:0",
                 env=env)
    try:
        c = Proc(workload.run_consumer, endpoint=b.endpoint, channel=ch, device="cuda:0", count=3, env=env)
        p = Proc(workload.run_producer, endpoint=a.endpoint, channel=ch, device="cpu", count=3, size=1 << 20, env={})
        pr, cr = p.result(), c.result()
        assert pr["error"] is None and cr["error"] is None, (pr["error"], cr["error"])
        assert cr["intact"] == 3 and cr["modes"] == {"SYNC_PRODUCER_SYNCED": 3} and cr["staged"] == 0
    finally:
        stop_all(out, inn)


@pytest.mark.parametrize("plane", ["zmq", "nixl"])
def test_brokers_bridge_channels_themselves(tmp_path, keys, plane):
    """hurray-broker --export / --import: the brokers run the bridge, no separate process
    (--bridge-rdma: on the NIXL plane)."""
    if plane == "nixl" and _nixl_reason() is not None:
        pytest.skip(f"NIXL unusable: {_nixl_reason()}")
    rdma = ["--bridge-rdma"] if plane == "nixl" else []
    url = f"tcp://127.0.0.1:{free_port()}"
    a_ep, b_ep = f"ipc://{tmp_path}/ea.sock", f"ipc://{tmp_path}/eb.sock"
    procs = [subprocess.Popen([sys.executable, "-m", "hurray_ipc.broker", "--endpoint", a_ep, "--log-level", "warning",
                               "--export", f"e={url}", "--bridge-keys", str(keys), *rdma], stderr=subprocess.PIPE,
                              text=True),
             subprocess.Popen([sys.executable, "-m", "hurray_ipc.broker", "--endpoint", b_ep, "--log-level", "info",
                               "--log-format", "json", "--import", f"e={url}", "--bridge-keys", str(keys), *rdma],
                              stderr=subprocess.PIPE,
                              text=True)]
    try:
        c = Proc(workload.run_consumer, endpoint=b_ep, channel="e", device="cpu", count=3, env={})
        p = Proc(workload.run_producer, endpoint=a_ep, channel="e", device="cpu", count=3, size=1 << 20, env={})
        pr, cr = p.result(), c.result()
        assert pr["error"] is None and cr["error"] is None, (pr["error"], cr["error"])
        assert cr["intact"] == 3 and pr["released"] == 3
    finally:
        errs = stop_all(*procs)
    assert all(x.returncode == 0 for x in procs), ([x.returncode for x in procs], errs)
    assert f'"data_plane": "{plane}"' in errs[1], errs[1][-1500:]


def _log_events(path, event: str) -> list[dict]:
    out = []
    for line in (path.read_text() if path.exists() else "").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == event:
            out.append(rec)
    return out


def _until_logged(path, event: str, n: int, proc, timeout: float = 60.0) -> list[dict]:
    """The broker's log lines of ``event`` once there are ``n`` (waiting on the log, bounded)."""
    deadline = time.monotonic() + timeout
    while len(found := _log_events(path, event)) < n:
        assert proc.poll() is None, f"the broker died (status {proc.returncode}): {path.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"no {n} '{event}' in the broker's log: {path.read_text()[-2000:]}"
        time.sleep(0.05)
    return found


def test_an_aborting_bridge_costs_its_link_not_the_broker(tmp_path, keys):
    """Red team item 1: one malformed NIXL offer made UCX assert inside the bridge, and the SIGABRT
    took the exporting broker and every local client with it. The broker's bridges now run in
    processes of their own (hurray_ipc/broker/supervise.py): a bridge that aborts is logged and started again,
    the broker and its local clients carry on, and the channel flows across the restarted link."""
    url = f"tcp://127.0.0.1:{free_port()}"
    a_ep, b_ep = f"ipc://{tmp_path}/ea.sock", f"ipc://{tmp_path}/eb.sock"
    a_log = tmp_path / "a.log"
    a = subprocess.Popen([sys.executable, "-m", "hurray_ipc.broker", "--endpoint", a_ep, "--log-format", "json",
                          "--log-file", str(a_log), "--export", f"e={url}", "--bridge-keys", str(keys)])
    b = subprocess.Popen([sys.executable, "-m", "hurray_ipc.broker", "--endpoint", b_ep, "--log-level", "warning",
                          "--import", f"e={url}", "--bridge-keys", str(keys)], stderr=subprocess.PIPE, text=True)
    gate, procs = SPAWN.Event(), []
    try:
        (started,) = _until_logged(a_log, "bridge_started", 1, a)
        os.kill(started["pid"], signal.SIGABRT)  # what a UCX assertion does
        (exited,) = _until_logged(a_log, "bridge_exited", 1, a)
        assert exited["signal"] == "SIGABRT" and exited["restart_in_s"] > 0, exited
        # The channel's consumer and producer: their processes start during the back-off, and reach
        # the brokers only once let through below, after the restart (across the restarted link).
        procs = [Proc(once_let_through, gate=gate, target=workload.run_consumer, endpoint=b_ep, channel="e",
                      device="cpu", count=3, env={}),
                 Proc(once_let_through, gate=gate, target=workload.run_producer, endpoint=a_ep, channel="e",
                      device="cpu", count=3, size=1 << 16, env={})]
        again = _until_logged(a_log, "bridge_started", 2, a)[1]
        assert again["restarts"] == 1 and again["pid"] != started["pid"]
        with Producer(a_ep, "local", "cpu") as p, Consumer(a_ep, "local", "cpu") as c, \
                ThreadPoolExecutor(1) as pool:  # local clients: unharmed
            got = pool.submit(c.receive, timeout=30)
            p.send(workload.pattern(3, 1, 4096), timeout=30)
            with got.result(timeout=60) as h:
                assert workload.verify(h.numpy())[2]
        gate.set()
        cr, pr = procs
        pres, cres = pr.result(), cr.result()
        assert pres["error"] is None and cres["error"] is None, (pres["error"], cres["error"])
        assert cres["intact"] == 3 and pres["released"] == 3
        assert a.poll() is None, "the exporting broker died"
    finally:
        if not gate.is_set():  # the test failed before: they never ran
            for x in procs:
                x.kill()
        stop(b)
        stop(a)
    assert a.returncode == 0, a_log.read_text()[-2000:]


def test_broker_bridge_needs_keys_or_insecure(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hurray_ipc.broker", "--endpoint", f"ipc://{tmp_path}/x.sock",
                        "--export", "e=tcp://127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--bridge-insecure" in r.stderr


def test_the_bound_endpoint_is_read_from_the_sending_bridges_own_line_once_whole():
    """``--listen tcp://HOST:*``: the port is learnt from the bridge's bridge_listening line; not
    from a broker's own listening line (a broker's bridges log into its log), nor from a line
    still being written."""
    broker = '{"event": "listening", "endpoint": "ipc:///tmp/b.sock", "session": "s"}\n'
    line = '{"event": "bridge_listening", "channel": "c", "endpoint": "tcp://127.0.0.1:41234"}\n'
    assert bound_endpoint("") is None and bound_endpoint(broker) is None
    assert bound_endpoint(broker + line[:-9]) is None
    assert bound_endpoint("bridge: plain text\n" + broker + line) == "tcp://127.0.0.1:41234"


def test_waiting_for_the_bound_endpoint_ends_when_the_bridge_says_stops_or_time_runs_out():
    """:func:`wait_bound` reads the log until the line is whole; a bridge that stopped, or never
    says within the timeout, gives None (the caller stops it and reports), never a wait without end."""
    line = '{"event": "bridge_listening", "channel": "c", "endpoint": "tcp://127.0.0.1:41234"}\n'
    logs = iter(["", line[:20], line])
    assert wait_bound(lambda: next(logs), lambda: True, 60) == "tcp://127.0.0.1:41234"
    assert next(logs, "read no further") == "read no further"
    reads = []
    assert wait_bound(lambda: reads.append(1) or "", lambda: False, 60) is None and reads == [1]
    assert wait_bound(lambda: "", lambda: True, 0) is None


@pytest.mark.parametrize("option", ["--export", "--import"])
def test_a_broker_bridge_needs_a_port_number(tmp_path, option):
    """A broker's bridge is bound (or reached) at an address the other broker names as well, and
    bound again after every restart: ``tcp://*:*`` (any free port) would be a different port each
    time, which nobody could connect to. Refused before the broker serves, naming the spec."""
    r = subprocess.run([sys.executable, "-m", "hurray_ipc.broker", "--endpoint", f"ipc://{tmp_path}/x.sock",
                        option, "e=tcp://127.0.0.1:*", "--bridge-insecure"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert ("hurray-broker: bridge 'e=tcp://127.0.0.1:*': the port must be a number, which the other broker's "
            f"{'--import' if option == '--export' else '--export'} names too") in r.stderr.splitlines(), r.stderr


def test_coverage_counts_bytes_once_and_names_the_gap():
    from hurray_ipc.interchange.rules import Coverage

    c = Coverage(64)
    assert c.add(32, 32) and c.add(0, 16)
    assert not c.add(0, 32), "overlaps [0, 16)"
    assert not c.add(60, 8), "outside [0, 64)"
    assert not c.complete and c.first_gap() == "[16, 32)" and c.bytes == 48
    assert c.add(16, 16) and c.complete and c._runs == [[0, 64]]
    assert Coverage(0).complete


# --- the NIXL data plane (interchange.md, RDMA data plane) --------------------------------------------
def _nixl_reason() -> str | None:
    from hurray_ipc.broker.rdma import nixl_available

    return nixl_available()


NEEDS_NIXL = pytest.mark.skipif(_nixl_reason() is not None, reason=f"NIXL unusable: {_nixl_reason()}")


def _all_through(pr, cr, n, out_err, in_err):
    """Producer and consumer ended without error, the consumer got ``n`` buffers intact and each
    went back to the producer exactly once; the bridges' log tails (for further asserts)."""
    logs = f"out: {out_err[-1500:]}\nin: {in_err[-1500:]}"
    assert pr["error"] is None and cr["error"] is None, (pr["error"], cr["error"], logs)
    assert cr["received"] == cr["intact"] == n and cr["corrupt"] == 0, (cr, logs)
    assert pr["sent"] == pr["released"] == n, ("each handoff released to the producer exactly once", pr, logs)
    return logs


def _bridged_pair(a, b, out_args, in_args, n=6, size=(3 << 20) + 12345, pool=4, start=InThread):
    """``n`` buffers from a producer on A to a consumer on B across a pair of bridges (``start``:
    :class:`InThread`, or :func:`bridge` for processes); the bridges' logs."""
    ch = fresh("r")
    out = start("out", "--channel", ch, "--endpoint", a.endpoint, "--listen", ANY_PORT, "--insecure", *out_args)
    inn = start("in", "--channel", ch, "--endpoint", b.endpoint, "--connect", listening(out), "--insecure", *in_args)
    try:
        c = Proc(workload.run_consumer, endpoint=b.endpoint, channel=ch, device="cpu", count=n, env={})
        p = Proc(workload.run_producer, endpoint=a.endpoint, channel=ch, device="cpu", count=n, size=size, env={},
                 pool=pool)
        pr, cr = p.result(), c.result()
    finally:
        out_err, in_err = stop_all(out, inn)
    _all_through(pr, cr, n, out_err, in_err)
    return out_err, in_err


@NEEDS_NIXL
def test_bridged_over_nixl(two_brokers):
    a, b = two_brokers
    out_err, in_err = _bridged_pair(a, b, ["--rdma"], ["--rdma"])
    assert '"data_plane": "nixl"' in out_err and '"data_plane": "nixl"' in in_err, (out_err[-800:], in_err[-800:])


def _closed(log: str) -> dict:
    """A bridge's closing line (its counters)."""
    return next(json.loads(x) for x in reversed(log.splitlines()) if '"bridge_closed"' in x)


@NEEDS_NIXL
@pytest.mark.parametrize("import_cache", ["64", "0"])
def test_source_registrations_live_as_long_as_the_mapping(two_brokers, monkeypatch, import_cache):
    """The sending bridge registers each producer buffer with NIXL once and keeps it while the
    buffer stays mapped (12 transfers from a pool of 4 buffers: 4 registrations), and lets it go
    when the mapping goes (HURRAY_IMPORT_CACHE=0 unmaps every buffer at its release: 12
    registrations; a registration kept past its unmap would be found again by address for the
    next buffer mapped there, naming memory that is no longer the producer's buffer). On the
    receiving side the destinations' registrations live with the pool (at most window + 1)."""
    from hurray_ipc.interchange.rules import WINDOW

    monkeypatch.setenv("HURRAY_IMPORT_CACHE", import_cache)  # the bridges' consumer maps the buffers
    a, b = two_brokers
    # Bridge processes: a process reads HURRAY_IMPORT_CACHE once (this one's CPU device has read it)
    out_err, in_err = _bridged_pair(a, b, ["--rdma"], ["--rdma"], n=12,
                                    size=1 << 20, start=bridge)
    out, inn = _closed(out_err), _closed(in_err)
    assert out["sent"] == 12 and out["nixl_registrations"] == (4 if import_cache == "64" else 12), out
    assert inn["delivered"] == 12 and inn["nixl_registrations"] <= WINDOW + 1, inn


@NEEDS_NIXL
def test_nixl_transfer_in_several_writes(two_brokers, monkeypatch):
    """A transfer over the write chunk goes as several WRITEs, each announced by its own RDMA_READY
    range (R2): bytes land where they belong, the last, shorter range included. The sending bridge
    serves in this process with a 1 MiB chunk (64 MiB by default): the same three WRITEs per
    transfer as 2 x 64 MiB + 4097 bytes, without moving 256 MiB."""
    from hurray_ipc.broker import bridge as bridge_module

    chunk = 1 << 20
    monkeypatch.setattr(bridge_module, "WRITE_CHUNK", chunk)  # read when a sending bridge is built
    a, b = two_brokers
    out_err, _ = _bridged_pair(a, b, ["--rdma"], ["--rdma"], n=2,
                               size=2 * chunk + 4097, pool=2)
    assert _closed(out_err)["rdma_writes"] == 2 * 3, _closed(out_err)


@NEEDS_NIXL
def test_bridged_over_nixl_on_ucx_tcp(two_brokers, monkeypatch):
    """NIXL runs without its progress thread in a bridge (it spins a core per agent): on UCX's TCP
    transport a WRITE lands only while the receiving bridge makes progress, which it must do
    while it has a region offered (RdmaEngine.progress)."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by UCX once per process: bridges of their own
    a, b = two_brokers
    out_err, in_err = _bridged_pair(a, b, ["--rdma"], ["--rdma"], n=3, start=bridge)
    assert '"data_plane": "nixl"' in in_err and "transfer_aborted" not in out_err, out_err[-800:]


@NEEDS_NIXL
def test_nixl_writes_into_receiver_gpu_and_flushes_before_handing_on(two_brokers):
    """R5 on the emulated GPU: with --device cuda:0 on the NIXL plane the receiving bridge offers GPU
    memory (no host staging), and makes the NIC's writes visible to its GPU (the flush of R5.2)
    before the buffer is handed on: the emulation's race check fails a consumer's read of memory
    offered to a NIC with no flush since."""
    a, b = two_brokers
    ch = fresh("v")
    env = emu_config().to_env()
    out = bridge("out", "--channel", ch, "--endpoint", a.endpoint, "--listen", ANY_PORT, "--insecure", "--rdma")
    url = listening(out)
    inn = bridge("in", "--channel", ch, "--endpoint", b.endpoint, "--connect", url, "--insecure", "--rdma",
                 "--device", "cuda:0", env=env)
    try:
        c = Proc(workload.run_consumer, endpoint=b.endpoint, channel=ch, device="cuda:0", count=4, env=env)
        p = Proc(workload.run_producer, endpoint=a.endpoint, channel=ch, device="cpu", count=4, size=1 << 20, env={})
        pr, cr = p.result(), c.result()
        # Each bridge announced its link before the first handoff of it (ROUTE): its broker says so.
        routes = _routes(a.endpoint, ch), _routes(b.endpoint, ch)
    finally:
        out_err, in_err = stop_all(out, inn)
    assert pr["error"] is None and cr["error"] is None, (pr["error"], cr["error"], in_err[-1500:])
    assert cr["races"] == 0, "a read of NIC-written memory before the flush"
    assert cr["intact"] == 4 and cr["modes"] == {"SYNC_PRODUCER_SYNCED": 4} and cr["staged"] == 0
    assert '"path": "device"' in in_err and '"gpu_destination": "device"' in in_err, in_err[-1500:]
    assert '"peer_gpu_destination": "device"' in out_err and '"gpu_source": "host-staged"' in out_err
    assert routes == ([("export", "nixl", None)], [("import", "nixl", "device")])


@pytest.mark.parametrize("plane", ["zmq", "nixl"])
def test_sending_bridge_on_the_gpu_reads_retired_device_memory(two_brokers, plane):
    """out --device cuda:0: GPU buffers come to the sending bridge by IPC (EVENT), not host-staged
    by the producer. On the NIXL plane the NIC reads them in place, only after the bridge host-waited
    the producer's writes (the emulation checks the NIC's read as a host read: without the wait it
    is a race and the transfer is refused); on the zmq plane the bridge stages them to host itself."""
    if plane == "nixl" and _nixl_reason() is not None:
        pytest.skip(f"NIXL unusable: {_nixl_reason()}")
    rdma = ["--rdma"] if plane == "nixl" else []
    a, b = two_brokers
    ch = fresh("s")
    env = emu_config().to_env()
    out = bridge("out", "--channel", ch, "--endpoint", a.endpoint, "--listen", ANY_PORT, "--insecure", "--device",
                 "cuda:0", *rdma, env=env)
    url = listening(out)
    inn = bridge("in", "--channel", ch, "--endpoint", b.endpoint, "--connect", url, "--insecure", *rdma)
    try:
        c = Proc(workload.run_consumer, endpoint=b.endpoint, channel=ch, device="cpu", count=4, env={}, timeout=40)
        p = Proc(workload.run_producer, endpoint=a.endpoint, channel=ch, device="cuda:0", count=4, size=1 << 20,
                 env=env, timeout=40)
        pr, cr = p.result(), c.result()
        routes = _routes(a.endpoint, ch), _routes(b.endpoint, ch)
    finally:
        out_err, in_err = stop_all(out, inn)
    assert pr["error"] is None and cr["error"] is None, (pr["error"], cr["error"], out_err[-1500:], in_err[-800:])
    assert pr["staged"] == 0 and pr["races"] == 0, pr
    assert pr["sent"] == pr["released"] == 4 and cr["received"] == cr["intact"] == 4, (pr, cr)
    assert "source_unreadable" not in out_err, out_err[-1500:]
    want = "device" if plane == "nixl" else "host-staged"
    assert f'"gpu_source": "{want}"' in out_err, out_err[-1500:]
    assert routes == ([("export", plane, want)], [("import", plane, None)])


@pytest.mark.gpu
@NEEDS_NIXL
def test_real_gpu_to_gpu_over_nixl(two_brokers):
    """Real CUDA (scripts/gpu-check): a producer's GPU buffers reach a consumer's GPU through both
    bridges on the NIXL plane, VRAM to VRAM between two processes where NIXL takes VRAM, with no
    host staging on either side, intact and released once each."""
    from conftest import REAL_SKIP
    from hurray_ipc.broker.rdma import nixl_info

    if REAL_SKIP:
        pytest.skip(f"real CUDA not available here: {REAL_SKIP}")
    a, b = two_brokers
    ch = fresh("g2g")
    env = {"HURRAY_CUDA": "real"}
    out = bridge("out", "--channel", ch, "--endpoint", a.endpoint, "--listen", ANY_PORT, "--insecure", "--rdma",
                 "--device", "cuda:0", env=env)
    url = listening(out)
    inn = bridge("in", "--channel", ch, "--endpoint", b.endpoint, "--connect", url, "--insecure", "--rdma",
                 "--device", "cuda:0", env=env)
    try:
        c = Proc(workload.run_consumer, endpoint=b.endpoint, channel=ch, device="cuda:0", count=4, env=env)
        p = Proc(workload.run_producer, endpoint=a.endpoint, channel=ch, device="cuda:0", count=4, size=64 << 20,
                 env=env)
        pr, cr = p.result(), c.result()
    finally:
        out_err, in_err = stop_all(out, inn)
    logs = _all_through(pr, cr, 4, out_err, in_err)
    path = "device" if nixl_info().gpudirect else "host-staged"
    assert f'"gpu_source": "{path}"' in out_err and f'"path": "{path}"' in in_err, logs
    print(f"GPU to GPU over NIXL: {path} on both sides; {logs[-600:]}")


@NEEDS_NIXL
@pytest.mark.parametrize("side", ["out", "in"])
def test_a_bridge_without_nixl_still_links_over_zmq(two_brokers, side):
    a, b = two_brokers
    rdma = {"out": (["--rdma"], []), "in": ([], ["--rdma"])}[side]
    out_err, in_err = _bridged_pair(a, b, *rdma, n=3)
    assert '"data_plane": "zmq"' in out_err and '"data_plane": "zmq"' in in_err, (out_err[-800:], in_err[-800:])


def test_transfer_bound_is_a_link_timeout_per_started_64_mib():
    from hurray_ipc.interchange.rules import transfer_bound

    mib = 1 << 20
    assert [transfer_bound(3.0, n) for n in (0, 1, 64 * mib, 64 * mib + 1, 1 << 30)] == [3.0, 3.0, 3.0, 6.0, 48.0]


@NEEDS_NIXL
def test_offers_of_a_gone_agent_do_not_leak_the_sending_bridges_sockets(two_brokers):
    """Red team item 14: a linked receiver answering every descriptor with an offer of a NIXL
    agent that is gone made each failed WRITE leave a UCX socket in the exporting bridge (~1 fd
    per transfer, without bound). The bridge now renews its agent after MAX_FAILED_WRITES failed
    transfers with none in flight, which closes them: over 100 such transfers its descriptors
    grow by less than that bound, and every handoff still goes back to its producer."""
    from hurray_ipc.broker.rdma import RdmaEngine
    from hurray_ipc.interchange.sender import MAX_FAILED_WRITES

    a, _ = two_brokers
    ch = fresh("gone")
    # A link timeout far past the run: this hand-driven receiver sends no LINK_PING, and under load
    # 100 failed NIXL connects may leave it silent longer than the default (it was dropped, link_lost).
    out = bridge("out", "--channel", ch, "--endpoint", a.endpoint, "--listen", ANY_PORT, "--insecure", "--rdma",
                 "--timeout", "60")
    url = listening(out)
    s, say, expect = raw_receiver(url)
    with RdmaEngine("gone-rx") as rx:
        offer = rx.expose(rx.register_array(np.zeros(4096, np.uint8)))
    n = 100
    p = Proc(workload.run_producer, endpoint=a.endpoint, channel=ch, device="cpu", count=n, size=4096, env={},
             timeout=60)

    def fds() -> int:
        return len(os.listdir(f"/proc/{out.pid}/fd"))

    try:
        say("LINK_HELLO", {"protocol": 1, "channel": ch, "data_planes": ["nixl", "zmq"], "window": 1})
        assert expect("LINK_WELCOME")["data_plane"] == "nixl"
        say("CREDIT", {"n": 1})
        counts = []
        for _ in range(n):
            d = expect("TENSOR_DESCRIPTOR")
            say("RDMA_REGISTER", {"transfer_id": d["transfer_id"], **offer["header"]}, *offer["frames"])
            rej = expect("REJECT")
            assert rej["transfer_id"] == d["transfer_id"] and rej["reason"] == "rdma_failed", rej
            counts.append(fds())
            say("CREDIT", {"n": 1})
        pr = p.result()
        assert pr["error"] is None and pr["sent"] == pr["released"] == n, pr
        assert max(counts) - counts[0] < MAX_FAILED_WRITES + 8, counts
    finally:
        s.close()
        err = stop(out)
    assert "rdma_agent_renewed" in err, err[-2000:]


def test_handoffs_that_ended_change_the_receiving_bridge_only_in_its_loop():
    """Issue 23: the handed-on buffers' release callback ran in whichever thread pumped the
    producer's session (its background pump among them) and changed the bridge's counters, its
    bounce queue and its fenced list under the loop. The callback now only queues; the loop's
    _settle() hands them to the receiver core, in one thread: a buffer whose consumer went before
    it arrived is handed on again (at most MAX_BOUNCES times), one whose consumer was fenced is
    kept, any other goes back. White-box: no link, no broker."""
    import threading
    from collections import deque

    from hurray_ipc.broker.bridge import BridgeIn, Dest
    from hurray_ipc.client import RemoteError
    from hurray_ipc.client.producer import Ticket
    from hurray_ipc.contract.sync import Transport
    from hurray_ipc.format.handle import SyncMode
    from hurray_ipc.interchange.receiver import HandedOn, ReceiverConfig, ReceiverCore
    from hurray_ipc.interchange.rules import MAX_BOUNCES

    b = object.__new__(BridgeIn)
    b.ended, b.fenced_buffers, b.dests, b.delivered = deque(), [], {}, 0
    b.core = ReceiverCore(ReceiverConfig("v"))
    back: list[str] = []

    def ended(dest: int, name: str, outcome: str, code: str | None = None, bounces: int = 0) -> None:
        b.core.handed[dest] = HandedOn(dest, None, bounces=bounces)
        b.dests[dest] = Dest(name, back.append, None)
        t = Ticket(1, SyncMode.PRODUCER_SYNCED, False, Transport.IPC, "c", outcome=outcome,
                   error=RemoteError(code, "x") if code else None)
        b.ended.append((dest, t))

    threads = [threading.Thread(target=ended, args=args) for args in (
        (1, "released", "released"), (2, "fenced", "consumer_fenced"), (3, "gone", "rejected", "consumer_gone"),
        (4, "gone-again", "rejected", "consumer_gone", MAX_BOUNCES), (5, "refused", "rejected", "bad_handle"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (back, list(b.core.bounced), b.fenced_buffers, b.stats["discarded"]) == ([], [], [], 0)  # nothing yet
    b._settle()
    assert sorted(back) == ["gone-again", "refused", "released"]
    assert [(b.core.handed[d].bounces, b.dests[d].buf) for d in b.core.bounced] == [(1, "gone")]
    assert b.fenced_buffers == ["fenced"] and b.stats["discarded"] == 2 and not b.ended
