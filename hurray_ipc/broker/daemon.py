"""``hurray-broker --daemon`` and ``--stop``: a broker in the background, started and stopped by name.

--daemon starts ``python -m hurray_ipc.broker`` with the same options as a detached child (its own
session, stdin and stdout on /dev/null, its log appended to ``PATH.log`` beside the socket or to
``--log-file``), waits until it answers STATS (hurray-top's client), prints one line and exits 0.
A broker that already answers on the endpoint is not an error: the same line says so, exit 0, so a
README or a script may always run it. A child that exits before it answers: its last log line, exit 1.

--stop signals the broker that holds the endpoint's lock file (``hurray_ipc/broker/lock.py``: the pid written
there, believed only while that process holds the file open, and only a process of this user) with
SIGTERM, the clean shutdown that tells every client, and waits until it exited.

Only ``ipc://`` endpoints: their lock file is what names the broker reliably (a TCP endpoint's
STATS pid means nothing across PID namespaces, and nothing at all across hosts).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from hurray_ipc.client.endpoint import check_socket_dir
from hurray_ipc.client.query import BrokerQuery, NoAnswer

from .lock import holder
from .logfmt import open_log

PROG = "hurray-broker"
START_TIMEOUT_S = 30.0  # a cold interpreter on a busy machine takes a few seconds to import everything
STOP_TIMEOUT_S = 20.0  # a broker's shutdown waits up to 10 s for its bridge threads
ANSWER_TIMEOUT_S = 3.0  # how long a broker that holds the endpoint may take to answer STATS


class Refused(Exception):
    """One line for stderr, and the exit status."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def socket_path(endpoint: str, option: str) -> Path:
    """The socket file of an ``ipc://`` endpoint, absolute; Refused (exit 2) for other schemes."""
    if not endpoint.startswith("ipc://"):
        raise Refused(f"{option} needs an ipc:// endpoint, not {endpoint} (only a socket file has a lock file "
                      "that names its broker); run a tcp:// broker in the foreground or under a service manager", 2)
    return Path(os.path.abspath(endpoint[len("ipc://"):]))


def _answering(endpoint: str, timeout: float) -> int | None:
    """The pid STATS_REPLY names, when a broker answers on ``endpoint`` within ``timeout``."""
    try:
        with BrokerQuery(endpoint) as q:
            return int(q.stats(timeout)["broker"]["pid"])
    except NoAnswer:
        return None


def _running(endpoint: str, sock: Path) -> int | None:
    """The pid of the broker that holds ``sock`` and answers, None when none holds it; Refused when
    one holds it but does not answer (hung, or still starting past ANSWER_TIMEOUT_S)."""
    try:
        pid = holder(sock)
    except PermissionError as e:
        raise Refused(f"{endpoint}: {e}") from None
    if pid is None:
        return None
    answered = _answering(endpoint, ANSWER_TIMEOUT_S)
    if answered is None:
        raise Refused(f"pid {pid} holds {endpoint} but did not answer STATS within {ANSWER_TIMEOUT_S:g} s; "
                      f"hurray-broker --stop --endpoint {endpoint} stops it")
    return answered


def _last_line(log: Path, offset: int) -> str:
    """Why the child did not start, from what it wrote to ``log`` (from ``offset`` on): its last
    one-line refusal ("hurray-broker: ..."; its shutdown may be logged after it), else its last line
    (a traceback's ends with the exception)."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read()[-65536:].decode(errors="replace")
    except OSError as e:
        return f"(its log {log} is unreadable: {e.strerror})"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = [line.removeprefix(f"{PROG}: ") for line in lines if line.startswith(f"{PROG}: ")]
    return said[-1] if said else lines[-1] if lines else "(it logged nothing)"


def start(argv: list[str], endpoint: str, log_file: str | None, group: bool) -> str:
    """Start a detached broker (or find one running); the line to print. Refused otherwise."""
    sock = socket_path(endpoint, "--daemon")
    endpoint = f"ipc://{sock}"
    pid = _running(endpoint, sock)
    if pid is not None:
        return f"{PROG}: already running at {endpoint} (pid {pid})"
    try:
        check_socket_dir(sock.parent, group)
        sock.parent.mkdir(parents=True, exist_ok=True, mode=0o750 if group else 0o700)
    except (RuntimeError, OSError) as e:
        raise Refused(f"{endpoint}: {e}") from None
    log = Path(os.path.abspath(log_file)) if log_file else Path(f"{sock}.log")
    try:
        fd = open_log(log)
    except OSError as e:
        raise Refused(f"log file {log}: {e.strerror}") from None
    offset = os.fstat(fd).st_size
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "hurray_ipc.broker", *argv, "--detached-child", "--endpoint", endpoint,
             "--log-file", str(log)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=fd, start_new_session=True)
    finally:
        os.close(fd)
    client = BrokerQuery(endpoint)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            rc = child.poll()
            if rc is not None:
                # Lost a race with another broker starting on this endpoint? Then it is running.
                pid = _answering(endpoint, ANSWER_TIMEOUT_S) if sock.exists() else None
                if pid is not None:
                    return f"{PROG}: already running at {endpoint} (pid {pid})"
                raise Refused(f"the broker did not start (exit {rc}): {_last_line(log, offset)} (log {log})")
            try:
                pid = int(client.stats(0.25)["broker"]["pid"])
            except NoAnswer:
                pid = None
            if pid == child.pid:
                return f"{PROG}: running at {endpoint} (pid {pid}, log {log})"
            if time.monotonic() > deadline:
                child.terminate()
                raise Refused(f"the broker (pid {child.pid}) did not answer within {START_TIMEOUT_S:g} s, stopped it: "
                              f"{_last_line(log, offset)} (log {log})")
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(0.05)  # the pause between two polls; ends early when the child exits
    finally:
        client.close()


def _pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (Linux 5.3+), which names that process even if its pid is reused."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None  # no pidfd here (old kernel, seccomp): signal by pid, poll by lock


def stop(endpoint: str) -> str:
    """SIGTERM the broker of ``endpoint`` and wait until it exited; the line to print, also when
    none runs there (nothing to stop: as ``start`` of a running one, so scripts may always call
    it). Refused if it is another user's, one answers that no lock names, or it does not exit
    within STOP_TIMEOUT_S."""
    sock = socket_path(endpoint, "--stop")
    endpoint = f"ipc://{sock}"
    try:
        pid = holder(sock)
    except PermissionError as e:
        raise Refused(f"{endpoint}: {e}: not stopping it") from None
    if pid is None:
        answered = _answering(endpoint, 1.0) if sock.exists() else None
        if answered is not None:  # e.g. another implementation, which wrote no pid; or another PID namespace's
            raise Refused(f"a broker answers at {endpoint} (pid {answered} in its own view) but {sock}.lock names "
                          "no process of this user that holds it: not stopping it")
        return _none_running(endpoint)
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return _none_running(endpoint, pid)
    if uid != os.getuid():
        raise Refused(f"the broker at {endpoint} is pid {pid} of uid {uid}, not this user's (uid {os.getuid()}): "
                      "not stopping it")
    pidfd = _pidfd(pid)
    try:
        if pidfd is not None and (now := holder(sock)) != pid:  # the pidfd names the process verified to hold it
            if now is None:
                return _none_running(endpoint, pid)
            raise Refused(f"the broker at {endpoint} changed while stopping it (pid {pid} exited, pid {now} "
                          "holds it now): not stopping that one; run --stop again")
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGTERM)
            else:
                os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return _none_running(endpoint, pid)
        if not _wait_exit(pid, pidfd, sock, STOP_TIMEOUT_S):
            raise Refused(f"the broker at {endpoint} (pid {pid}) did not exit within {STOP_TIMEOUT_S:g} s of SIGTERM")
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return f"{PROG}: stopped the broker at {endpoint} (pid {pid})"


def _none_running(endpoint: str, exited: int | None = None) -> str:
    just = f", pid {exited} just exited" if exited is not None else ""
    return f"{PROG}: no broker running at {endpoint} (nothing to stop{just})"


def _wait_exit(pid: int, pidfd: int | None, sock: Path, timeout: float) -> bool:
    """True once the process exited (its pidfd turns readable), or, without a pidfd, once it no
    longer holds the lock file; False after ``timeout``."""
    if pidfd is not None:
        p = select.poll()
        p.register(pidfd, select.POLLIN)
        return bool(p.poll(int(timeout * 1000)))
    deadline = time.monotonic() + timeout
    while holder(sock) == pid:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # no pidfd: nothing to wait on but the lock, so poll it
    return True
