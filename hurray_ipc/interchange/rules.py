"""Numbers and rules both bridges of a link share (docs/spec/interchange.md)."""

from __future__ import annotations

import bisect
import enum
from typing import Final


class Plane(enum.Enum):
    """Data planes, as LINK_HELLO and LINK_WELCOME name them (R1)."""

    NIXL = "nixl"
    ZMQ = "zmq"


WINDOW: Final = 4  # transfers a receiver grants ahead and holds unended at once (LINK_HELLO "window")
MAX_BOUNCES: Final = 8  # times a receiver hands one buffer on again because its consumer went before it arrived
# A sender's REJECT reasons that end a transfer (R4.6): its NIXL request is released, the receiver's
# destination is free again at once.
SENDER_ENDED: Final = frozenset(["rdma_failed", "rdma_timeout", "link_lost"])


def transfer_bound(timeout_s: float, total_bytes: int) -> float:
    """interchange.md R4: T, a link timeout per started 64 MiB (both bridges compute the same)."""
    return timeout_s * max(1, -(-total_bytes // (64 << 20)))


class Coverage:
    """Which bytes of ``[0, size)`` a transfer has received: each TENSOR_DATA frame must land on
    bytes not yet covered, and the transfer is complete only when every byte is (a byte count
    alone would take two frames on the same half as the whole buffer)."""

    def __init__(self, size: int):
        self.size = size
        self.bytes = 0
        self._runs: list[list[int]] = []  # sorted, disjoint, non-adjacent [start, end) runs

    def add(self, off: int, n: int) -> bool:
        """Cover ``[off, off + n)``; False (nothing changes) if it is outside or overlaps."""
        end = off + n
        if off < 0 or end > self.size:
            return False
        i = bisect.bisect_right(self._runs, [off, float("inf")])
        if (i > 0 and self._runs[i - 1][1] > off) or (i < len(self._runs) and self._runs[i][0] < end):
            return False
        if n == 0:
            return True
        if i > 0 and self._runs[i - 1][1] == off:  # join the run before
            i -= 1
            self._runs[i][1] = end
        else:
            self._runs.insert(i, [off, end])
        if i + 1 < len(self._runs) and self._runs[i + 1][0] == self._runs[i][1]:  # and the one after
            self._runs[i][1] = self._runs.pop(i + 1)[1]
        self.bytes += n
        return True

    @property
    def complete(self) -> bool:
        return self.bytes == self.size

    def first_gap(self) -> str:
        start = 0
        for a, b in self._runs:
            if a > start:
                return f"[{start}, {a})"
            start = b
        return f"[{start}, {self.size})"
