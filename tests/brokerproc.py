"""Start and stop a real broker process (python -m hurray_ipc.broker) for the multi-process tests."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Runs first in the child, then becomes the broker (execv keeps the pid and the death signal): the
# broker gets SIGTERM when the test process that started it dies, even by SIGKILL (a timeout, a
# mutant run cut short), instead of serving on for ever. The signal follows the thread that forked,
# so it is asked for only from the main thread (pytest's, and each xdist worker's).
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                    "if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM) != 0:  # PR_SET_PDEATHSIG\n"
                    "    print('brokerproc: prctl(PR_SET_PDEATHSIG) failed: this broker may outlive its test',"
                    " file=sys.stderr)\n"
                    "if os.getppid() != int(sys.argv[1]):\n"
                    "    sys.exit('the test process died before its broker started')\n"
                    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n")


def broker_command(*args: str) -> list[str]:
    """``python -m hurray_ipc.broker ARGS``, ended with the process that runs it when called from
    the main thread."""
    cmd = [sys.executable, "-m", "hurray_ipc.broker", *args]
    if threading.current_thread() is not threading.main_thread() or not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd[1:]]


class BrokerProcess:
    def __init__(self, endpoint: str, timeout: float = 2.0, log_level: str = "warning",
                 extra_args: list[str] | None = None, log_format: str | None = "json"):
        self.endpoint = endpoint
        self.extra_args = extra_args or []  # more hurray-broker options, e.g. --metrics-port
        self.timeout = timeout
        self.log_level = log_level
        # json: tests read the log by machine; None: the broker's default (text)
        self.log_format = log_format
        self.proc: subprocess.Popen | None = None

    def start(self) -> BrokerProcess:
        path = Path(self.endpoint[len("ipc://"):])
        if path.exists():
            path.unlink()
        # The broker's log goes to a file, not a pipe: a pipe nobody drains fills at 64 KiB and
        # then blocks the broker in its next log write (a fuzz run logs an ERROR per message).
        self.log = tempfile.NamedTemporaryFile("w+", prefix="hurray-broker-", suffix=".log")
        self.proc = subprocess.Popen(
            broker_command("--endpoint", self.endpoint, "--timeout", str(self.timeout), "--heartbeat", "0.2",
                           "--log-level", self.log_level,
                           *(["--log-format", self.log_format] if self.log_format else []), *self.extra_args),
            stderr=self.log, text=True)
        deadline = time.monotonic() + 20
        while not path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"broker did not start: {self.stderr_text()}")
            time.sleep(0.02)
        return self

    def stop(self, sig: int = 15) -> str:
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.returncode = self.proc.returncode
        self.proc = None
        return self.stderr_text()

    def stderr_text(self) -> str:
        """What the broker logged so far."""
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    @property
    def rss_kib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0
