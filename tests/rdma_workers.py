"""Spawned children of tests/test_rdma_engine.py: a NIXL receiver in another process. It registers a
zeroed destination, sends its offer on ``out`` and then obeys commands from ``cmd``:

* ``"check"``: the sender observed DONE (the TENSOR_DATA_END point): digest the destination and
  report it with the notifications received (polled with a deadline), then wait for the next command.
* ``"exit"``: leave at once, without releasing anything (a peer that died).
* ``"close"``: release and close the engine, report what is left registered, and return.
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback


def receiver(size: int, out, cmd) -> None:
    try:
        import numpy as np

        from hurray_ipc.broker.rdma import RdmaEngine

        eng = RdmaEngine("test-rx")
        dst = np.zeros(size, np.uint8)
        reg = eng.register_array(dst)
        out.put({"offer": eng.expose(reg), "pid": os.getpid()})
        notifs: list[bytes] = []
        while True:
            c = cmd.get(timeout=120)
            if c == "exit":
                os._exit(0)
            if c == "close":
                eng.release(reg)
                eng.close()
                out.put({"left": len(eng.registrations), "remotes": len(eng.remote_agents)})
                return
            if c == "check":
                deadline = time.monotonic() + 10
                while not notifs and time.monotonic() < deadline:
                    for msgs in eng.notifications().values():
                        notifs.extend(msgs)
                    if not notifs:
                        time.sleep(0.001)
                out.put({"sha256": hashlib.sha256(dst).hexdigest(), "notifs": list(notifs)})
                notifs.clear()
    except Exception:  # noqa: BLE001 - the traceback goes to the parent, which fails the test
        out.put({"error": traceback.format_exc()})
