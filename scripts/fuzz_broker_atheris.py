"""Opt-in long fuzz run (issue 10): atheris drives raw frames at a live broker process.

Each input is split into frames (0x00 0xFF separator) and sent from one of four DEALER routing
ids, followed by a CAPS; no answer within 5 s (the broker gone or hung) is a crash
(atheris stops and the input is written as crash-*). Run via scripts/fuzz-broker.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    import zmq

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from barrier import Barrier  # noqa: E402
from brokerproc import BrokerProcess  # noqa: E402

TMP = tempfile.mkdtemp(prefix="hurray-fuzz-")
BROKER = BrokerProcess(f"ipc://{TMP}/b.sock", timeout=30.0).start()
atexit.register(BROKER.stop)  # libFuzzer may still exit around it: check for an orphaned broker
CTX = zmq.Context()
DEVICE = {"device": {"kind": "cpu", "ordinal": 0, "uuid": "cpu-fuzz", "pci_bus_id": "", "emulated": False,
                     "host": "fuzz"},
          "caps": {"ipc_memory": True, "ipc_events": False, "ipc_streams": False, "peers": []},
          "pid": os.getpid(), "stream": None}
SOCKS = []
BARRIERS = [Barrier(DEVICE, "fuzz-sync") for _ in range(4)]  # a CAPS after each input, naming its ticket
for i in range(4):
    s = CTX.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, f"atheris-{i}".encode())
    s.setsockopt(zmq.LINGER, 0)
    s.connect(BROKER.endpoint)
    SOCKS.append(s)


def one(data: bytes) -> None:
    """Send one fuzzed message; raise if the broker no longer answers PING."""
    if not data:
        return
    s, barrier = SOCKS[data[0] % 4], BARRIERS[data[0] % 4]
    frames = data[1:].split(b"\x00\xff") or [b""]
    s.send_multipart(frames)
    s.send_multipart(barrier.frames())  # needs no HELLO (PING before HELLO is not_registered)
    while True:
        if not s.poll(5000):
            code = BROKER.proc.poll()
            err = BROKER.stderr_text()[-3000:]
            raise RuntimeError(f"broker {f'exited {code}' if code is not None else 'hung'}\n{err}")
        if barrier.is_answer(s.recv_multipart()):
            return


if __name__ == "__main__":
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
