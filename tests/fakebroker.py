"""A fake broker: a ROUTER a test drives by hand, to put one client session in states a real
broker reaches only by timing (silent, answering only some messages)."""

from __future__ import annotations

import time

import zmq

from hurray_ipc.wire.ipc import decode_all
from hurray_ipc.wire.messages import JsonMessage


class FakeBroker:
    def __init__(self, tmp_path) -> None:
        self.ctx = zmq.Context.instance()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"ipc://{tmp_path}/fake.sock"
        self.router.bind(self.endpoint)
        self.rid = b""

    def next(self, timeout_s: float = 10.0) -> list[bytes]:
        """The next message's frames (the routing id kept for :meth:`say`)."""
        assert self.router.poll(int(timeout_s * 1000)), "the fake broker got nothing"
        rid, *frames = self.router.recv_multipart()
        self.rid = rid
        return frames

    def next_verbs(self, timeout_s: float = 10.0) -> list[str]:
        """The verbs of the next message (a batch's entries each)."""
        return [m.verb for m in decode_all(self.next(timeout_s), bundles=True)]

    def say(self, msg: JsonMessage) -> None:
        self.router.send_multipart([self.rid, *msg.encode()])

    def close(self) -> None:
        self.router.close()


def spin_until(cond, what: str) -> None:
    """Spin (bounded) until another thread (a session's pump, a waiting caller) reached a state
    the test observes."""
    limit = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < limit, what
        time.sleep(0.001)
