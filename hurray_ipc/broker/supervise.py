"""The broker's own bridges, each in a process of its own, restarted when it dies.

Why a process: a bridge runs the NIXL/UCX engine, native code that aborts its whole process on
some malformed peer input (a UCX assertion took down an exporting broker and every local client's
connection with it: issue 22, red team item 1). In a process of its own such an abort costs one
link: the broker and its clients carry on, and the supervisor starts the bridge again.

Each child is ``python -m hurray_ipc.broker.bridge out|in ...``, an ordinary client of this
broker (interchange.md), given the broker's route key in its environment (``HURRAY_ROUTE_KEY``:
/proc/<pid>/environ is readable by the same uid only) and the broker's log options. A child that
exits while the broker runs is logged (``bridge_exited``, with its exit status or signal) and
started again after a back-off: 1 s, doubling to 30 s while it keeps dying young, back to 1 s once
it ran for a minute. Whatever its exit status: the broker checked the options before it started
any bridge, so a failure is of the moment (a port its predecessor still holds, a full table).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("hurray.broker")

BACKOFF_S = (1.0, 30.0)  # first and longest wait before a restart
HEALTHY_S = 60.0  # a child that ran this long starts its back-off again from the first wait


@dataclass
class Child:
    """One bridge process: ``argv`` after ``python -m hurray_ipc.broker.bridge``."""

    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restart_at: float | None = None
    backoff: float = BACKOFF_S[0]
    restarts: int = 0


class Supervisor:
    """Start ``children``, restart those that die, stop them all with :meth:`stop`."""

    def __init__(self, children: list[Child], env: dict[str, str]):
        self.children = children
        self.env = {**os.environ, **env}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        for c in self.children:
            self._spawn(c)
        self._thread = threading.Thread(target=self._watch, name="bridge-supervisor", daemon=True)
        self._thread.start()

    def _spawn(self, c: Child) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            c.proc = subprocess.Popen([sys.executable, "-m", "hurray_ipc.broker.bridge", *c.argv], env=self.env,
                                      stdin=subprocess.DEVNULL)
            c.started = time.monotonic()
            c.restart_at = None
        log.info(json.dumps({"event": "bridge_started", "bridge": c.name, "pid": c.proc.pid,
                             "restarts": c.restarts}))

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            now = time.monotonic()
            for c in self.children:
                try:
                    if c.proc is not None and c.restart_at is None:
                        code = c.proc.poll()
                        if code is None:
                            continue
                        self._exited(c, code, now)
                    if c.restart_at is not None and now >= c.restart_at:
                        c.restarts += 1
                        self._spawn(c)
                except Exception as e:  # noqa: BLE001 - e.g. fork failing (EAGAIN): try again later
                    c.restart_at = now + c.backoff
                    log.error(json.dumps({"event": "bridge_restart_failed", "bridge": c.name,
                                          "error": f"{type(e).__name__}: {e}", "retry_in_s": c.backoff}))

    def _exited(self, c: Child, code: int, now: float) -> None:
        lived = now - c.started
        why: dict[str, object] = {"exit_status": code}
        if code < 0:
            try:
                why = {"signal": signal.Signals(-code).name}
            except ValueError:  # a real-time signal has no name
                why = {"signal": -code}
        if lived >= HEALTHY_S:
            c.backoff = BACKOFF_S[0]
        c.restart_at = now + c.backoff
        log.warning(json.dumps({"event": "bridge_exited", "bridge": c.name, **why, "lived_s": round(lived, 3),
                                "restart_in_s": c.backoff}))
        c.backoff = min(2 * c.backoff, BACKOFF_S[1])

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every bridge (each gives its handoffs back and leaves), wait up to ``timeout``
        seconds for them all, then SIGKILL what is left."""
        with self._lock:
            self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        live = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
