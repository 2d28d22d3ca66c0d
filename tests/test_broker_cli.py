"""hurray-broker as a person meets it (issue 21): ``--daemon`` and ``--stop``, one line when the
endpoint is taken, a log a person can read (``--log-format text``, the default) or a machine
(``json``), and a broker restart under traffic that logs no warning."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from brokerproc import BrokerProcess
from conftest import Proc
from hurray_ipc import workload
from hurray_ipc.broker.logfmt import JsonFormatter, TextFormatter
from hurray_ipc.client import BrokerUnavailable, Consumer

TEXT_LINE = re.compile(r'^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (debug|info |warning|error|critical) (\S+)'
                       r'((?: [\w.]+=(?:"(?:[^"\\]|\\.)*"|[^\s"]+))*)$')


def hurray_broker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hurray_ipc.broker", *args], capture_output=True, text=True,
                          timeout=timeout)


def gone(pid: int) -> bool:
    """The process exited (no longer listed, or a zombie waiting for init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def one_line(r: subprocess.CompletedProcess[str], stream: str = "stdout") -> str:
    lines = getattr(r, stream).strip().splitlines()
    assert len(lines) == 1, (r.stdout, r.stderr)
    return lines[0]


# --- --daemon / --stop -------------------------------------------------------------------------------

def test_daemon_serves_clients_is_idempotent_and_stop_ends_it(tmp_path):
    ep, sock = f"ipc://{tmp_path}/b.sock", tmp_path / "b.sock"
    started: list[int] = []
    try:
        r = hurray_broker("--daemon", "--endpoint", ep, "--heartbeat", "0.2")
        assert r.returncode == 0 and r.stderr == "", r
        m = re.fullmatch(rf"hurray-broker: running at {re.escape(ep)} \(pid (\d+), log (\S+)\)", one_line(r))
        assert m, r.stdout
        pid, log = int(m[1]), Path(m[2])
        started.append(pid)
        assert log == tmp_path / "b.sock.log" and (log.stat().st_mode & 0o777) == 0o600
        # detached: its own session, nothing of ours on stdin/stdout, and the exit of the command above
        assert os.getsid(pid) == pid
        assert [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (0, 1)] == ["/dev/null", "/dev/null"]
        assert (tmp_path / "b.sock.lock").read_text() == f"{pid}\n"

        c = Proc(workload.run_consumer, endpoint=ep, channel="daemon", device="cpu", count=4, env={})
        p = Proc(workload.run_producer, endpoint=ep, channel="daemon", device="cpu", count=4, size=4096, env={})
        pr, cr = p.result(), c.result()
        assert pr["error"] is None and cr["error"] is None, (pr["error"], cr["error"])
        assert cr["intact"] == 4 and pr["released"] == 4

        r = hurray_broker("--daemon", "--endpoint", ep)
        assert r.returncode == 0 and one_line(r) == f"hurray-broker: already running at {ep} (pid {pid})", r

        r = hurray_broker("--stop", "--endpoint", ep)
        assert r.returncode == 0 and one_line(r) == f"hurray-broker: stopped the broker at {ep} (pid {pid})", r
        assert gone(pid) and not sock.exists()
        assert "shutdown" in log.read_text().splitlines()[-1], "a SIGTERM shutdown, logged"

        r = hurray_broker("--stop", "--endpoint", ep)  # nothing to stop: done, as --daemon of a running one
        assert r.returncode == 0 and r.stderr == "", r
        assert one_line(r) == f"hurray-broker: no broker running at {ep} (nothing to stop)"

        def daemon() -> int:
            r = hurray_broker("--daemon", "--endpoint", ep)
            assert r.returncode == 0, r
            started.append(int(re.fullmatch(r"hurray-broker: running at \S+ \(pid (\d+), log \S+\)", one_line(r))[1]))
            return started[-1]

        pid2 = daemon()
        assert pid2 != pid
        os.kill(pid2, signal.SIGKILL)  # leaves its socket file and its pid in the lock file behind
        deadline = time.monotonic() + 30
        while not gone(pid2):
            assert time.monotonic() < deadline, "SIGKILL did not end the broker"
            time.sleep(0.01)
        assert sock.exists()
        pid3 = daemon()
        r = hurray_broker("--stop", "--endpoint", ep)
        assert r.returncode == 0 and one_line(r) == f"hurray-broker: stopped the broker at {ep} (pid {pid3})", r
    finally:
        for pid in started:  # only what this test started, should an assertion have left it running
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_daemon_that_cannot_start_says_why_in_one_line(tmp_path):
    log = tmp_path / "custom.log"
    r = hurray_broker("--daemon", "--endpoint", f"ipc://{tmp_path}/b.sock", "--log-file", str(log),
               "--export", "e=tcp://127.0.0.1:1")  # no --bridge-keys: the child refuses
    assert r.returncode == 1 and r.stdout == "", r
    line = one_line(r, "stderr")
    assert line.startswith("hurray-broker: the broker did not start (exit 2): --export/--import need --bridge-keys")
    assert line.endswith(f"(log {log})") and log.exists()


def test_stop_leaves_a_stale_pid_alone(tmp_path):
    """A broker killed with SIGKILL leaves its pid in the lock file; --stop must not believe it
    (the number may be any process by now: here, this test's own)."""
    (tmp_path / "b.sock.lock").write_text(f"{os.getpid()}\n")
    ep = f"ipc://{tmp_path}/b.sock"
    r = hurray_broker("--stop", "--endpoint", ep)
    assert r.returncode == 0 and one_line(r) == f"hurray-broker: no broker running at {ep} (nothing to stop)"
    assert (tmp_path / "b.sock.lock").exists(), "not ours to remove"


@pytest.mark.parametrize("option", ["--daemon", "--stop"])
def test_daemon_and_stop_need_an_ipc_endpoint(option):
    r = hurray_broker(option, "--endpoint", "tcp://127.0.0.1:5555")
    assert r.returncode == 2 and "needs an ipc:// endpoint, not tcp://127.0.0.1:5555" in one_line(r, "stderr")


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "0.0009", "1e17"])
def test_a_hold_bound_outside_a_millisecond_to_a_year_is_refused(value, tmp_path):
    """1e17 s would be a hold_ms no client can read (WELCOME's integers end at 2^63 - 1)."""
    r = hurray_broker("--hold", value, "--endpoint", f"ipc://{tmp_path}/b.sock")
    assert r.returncode == 2 and f"--hold {float(value)} must be 0.001 to 31622400 seconds" in r.stderr


# --- a second broker ----------------------------------------------------------------------------------

def test_second_broker_on_a_live_endpoint_is_one_line_exit_1(broker):
    path = broker.endpoint[len("ipc://"):]
    r = hurray_broker("--endpoint", broker.endpoint)
    assert r.returncode == 1 and r.stdout == "", r
    assert one_line(r, "stderr") == (f"hurray-broker: broker already running at {broker.endpoint} "
                                     f"(pid {broker.proc.pid}, it holds {path}.lock)")


def test_unsafe_socket_directory_is_one_line_exit_1(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    r = hurray_broker("--endpoint", f"ipc://{d}/b.sock", "--duration", "1")
    assert r.returncode == 1 and r.stdout == "", r
    assert one_line(r, "stderr") == (f"hurray-broker: cannot serve ipc://{d}/b.sock: socket directory {d} has mode "
                                     "777: other users could replace the broker's socket; use a directory only you "
                                     "can write (or one with the sticky bit)")


# --- log formats --------------------------------------------------------------------------------------

def _record(msg: str, level: int = logging.INFO, name: str = "hurray.broker") -> logging.LogRecord:
    r = logging.LogRecord(name, level, __file__, 1, msg, None, None)
    r.created = 1796366825.1234  # 2026-12-04T06:47:05.123Z
    return r


def test_text_format_is_time_level_event_and_fields():
    f = TextFormatter()
    line = f.format(_record(json.dumps({"event": "hello", "client": "0376e6a0" + "9" * 24, "role": "consumer",
                                        "channel": "my frames", "pid": 42, "ok": True, "held": [1, 2],
                                        "empty": "", "quote": 'a"b'})))
    assert line == ('2026-12-04T06:47:05.123Z info  hello client=0376e6a0 role=consumer channel="my frames" pid=42 '
                    'ok=true held=[1,2] empty="" quote="a\\"b"')
    assert TEXT_LINE.match(line)
    assert f.format(_record("plain words\nand a forged line", logging.WARNING)) == \
        "2026-12-04T06:47:05.123Z warning plain words\\nand a forged line"
    assert f.format(_record(json.dumps({"event": "linked", "data_plane": "zmq"}), name="hurray.bridge")) == \
        "2026-12-04T06:47:05.123Z info  linked data_plane=zmq logger=hurray.bridge"


def test_json_format_keeps_its_fields_and_adds_iso_time():
    d = json.loads(JsonFormatter().format(_record(json.dumps({"event": "hello", "client": "c" * 32}))))
    assert d == {"ts": 1796366825.123, "time": "2026-12-04T06:47:05.123Z", "level": "info",
                 "logger": "hurray.broker", "event": "hello", "client": "c" * 32}
    d = json.loads(JsonFormatter().format(_record("not json")))
    assert d["message"] == "not json" and d["time"] == "2026-12-04T06:47:05.123Z"


def _log_of_a_session(tmp_path: Path, log_format: str | None) -> str:
    b = BrokerProcess(f"ipc://{tmp_path}/b.sock", log_level="info", log_format=log_format).start()
    try:
        with Consumer(b.endpoint, "log test", "cpu") as c:
            c.session.pump(lambda: c.session.registered, 30, "registering")  # its HELLO is logged
    finally:
        log = b.stop()
    return log


def test_broker_logs_text_by_default(tmp_path):
    lines = _log_of_a_session(tmp_path, None).splitlines()
    assert lines and all(TEXT_LINE.match(line) for line in lines), lines
    (hello,) = [line for line in lines if TEXT_LINE.match(line)[3] == "hello"]  # type: ignore[index]
    assert re.search(r' info  hello client=[0-9a-f]{8} role=consumer channel="log test" device=cpu pid=\d+$', hello)
    assert TEXT_LINE.match(lines[-1])[3] == "shutdown"  # type: ignore[index]


def test_broker_logs_json_with_iso_time(tmp_path):
    lines = [json.loads(line) for line in _log_of_a_session(tmp_path, "json").splitlines()]
    assert [d["event"] for d in lines if d.get("event") in ("listening", "hello", "shutdown")] == \
        ["listening", "hello", "shutdown"]
    for d in lines:
        whole, ms = divmod(round(d["ts"] * 1000), 1000)
        assert time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{ms:03d}Z" == d["time"], d


# --- a restart is routine -----------------------------------------------------------------------------

def test_broker_restart_under_traffic_logs_no_warning(tmp_path):
    """SIGKILL the broker while a producer process hands buffers to a consumer, start it again:
    the clients re-register (their first messages are answered not_registered, spec §6) and carry
    on, and the new broker's log has not one warning: re-registration is normal operation."""
    b = BrokerProcess(f"ipc://{tmp_path}/b.sock", timeout=5.0, log_level="info").start()
    n, got, corrupt, done = 1500, [0], [0], threading.Event()

    def consume(c: Consumer) -> None:  # until the test says done (the count lost in the restart is unknown)
        while not done.is_set():
            try:
                h = c.receive(timeout=0.2)
            except (TimeoutError, BrokerUnavailable):
                continue
            with h:
                corrupt[0] += not workload.verify(h.numpy().reshape(-1).view(np.uint8))[2]
            got[0] += 1

    with Consumer(b.endpoint, "restart", "cpu") as c:
        th = threading.Thread(target=consume, args=(c,), daemon=True)
        th.start()
        p = Proc(workload.run_producer, endpoint=b.endpoint, channel="restart", device="cpu", count=n, size=4096,
                 env={})
        try:
            deadline = time.monotonic() + 60
            while got[0] < 200:  # handoffs under way through the first broker
                assert time.monotonic() < deadline and th.is_alive(), "no handoffs reached the consumer"
                time.sleep(0.01)
            b.stop(signal.SIGKILL)
            b.start()
            pr = p.result()
        finally:
            done.set()
            th.join(30)
    log = b.stop()
    assert pr["error"] is None, pr["error"]
    assert pr["sent"] == n and pr["released"] == n and corrupt[0] == 0 and got[0] > 200
    events = [json.loads(line) for line in log.splitlines()]
    assert {d["role"] for d in events if d.get("event") == "hello"} == {"producer", "consumer"}, log
    assert any(d.get("code") == "not_registered" for d in events), "the clients re-registered after a restart"
    (shutdown,) = [d for d in events if d.get("event") == "shutdown"]
    assert shutdown["handoffs"] > 0, "handoffs went through the restarted broker"
    assert not [d for d in events if d["level"] not in ("debug", "info")], log


def test_refusals_other_than_not_registered_stay_warnings(caplog):
    from hurray_ipc.broker.core import BrokerCore

    core = BrokerCore(host="h")
    with caplog.at_level(logging.INFO, logger="hurray.broker"):
        core.receive(b"c1", [b"PING", b"{}"], 0.0)
        core.receive(b"c1", [b"NOPE", b"{}"], 0.0)
    levels = {json.loads(r.getMessage())["code"]: r.levelname for r in caplog.records}
    assert levels == {"not_registered": "INFO", "unknown_verb": "WARNING"}, levels



def test_a_stopping_broker_ignores_another_sigterm_to_the_end(tmp_path):
    """A second SIGTERM while the broker shuts down (tests and process managers send them) must not
    kill it: Python restores SIG_DFL while the interpreter finalizes, after the broker's own handler,
    and a SIGTERM there ended it with -15. What the broker's SIGTERM disposition is at its very end
    (an atexit hook, which runs before that restore) decides it, with no race to win."""
    code = ("import atexit, signal, sys\n"
            "from hurray_ipc.broker.__main__ import main\n"
            "atexit.register(lambda: print('at exit:', signal.getsignal(signal.SIGTERM) is signal.SIG_IGN))\n"
            f"sys.exit(main(['--endpoint', 'ipc://{tmp_path}/b.sock', '--duration', '0.1']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-1] == "at exit: True", r.stdout


def test_a_test_broker_dies_with_the_test_process_that_started_it(tmp_path):
    """A test process killed outright (a timeout, a mutant run cut short) left its broker serving
    for ever; brokerproc now has the broker SIGTERMed when its starter dies."""
    starter = ("import os, pathlib, signal, sys; sys.path.insert(0, sys.argv[1]); "
               "from brokerproc import BrokerProcess; b = BrokerProcess(sys.argv[2]).start(); "
               "pathlib.Path(sys.argv[3]).write_text(str(b.proc.pid)); "
               "os.kill(os.getpid(), signal.SIGKILL)")
    pid_file = tmp_path / "pid"
    r = subprocess.run([sys.executable, "-c", starter, str(Path(__file__).parent), f"ipc://{tmp_path}/b.sock",
                        str(pid_file)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while not gone(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"the broker (pid {pid}) outlived the test process that started it")
        time.sleep(0.02)  # not our child: nothing to wait on but /proc
