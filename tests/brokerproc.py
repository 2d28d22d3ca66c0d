"""Start and stop a real broker process (python -m broker) for the multi-process tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


class BrokerProcess:
    def __init__(self, endpoint: str, timeout: float = 2.0):
        self.endpoint = endpoint
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    def start(self) -> "BrokerProcess":
        path = Path(self.endpoint[len("ipc://"):])
        if path.exists():
            path.unlink()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "broker", "--endpoint", self.endpoint, "--timeout", str(self.timeout),
             "--heartbeat", "0.2", "--log-level", "warning"],
            stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        while not path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"broker did not start: {self.proc.stderr.read() if self.proc.stderr else ''}")
            time.sleep(0.02)
        return self

    def stop(self, sig: int = 15) -> str:
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        self.returncode = self.proc.returncode
        self.proc = None
        return err or ""

    @property
    def rss_kib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0
