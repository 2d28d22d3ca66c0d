"""A CAPS as a barrier on a raw socket, naming the latest ticket read (spec §6a).

The broker answers a connection's messages in order (spec §2), so once the answer to a CAPS sent
after a message has arrived, every reply to that message has too. A socket that syncs so more
than 8 times must show that it reads its answers, or the broker stops answering it: each CAPS
names the ticket of the latest answer this socket read.
"""

from __future__ import annotations

import json
from typing import Any

from hurray_ipc.client.query import Tickets


class Barrier:
    """One per socket: ``frames()`` is the next CAPS (or STATS) to send, ``is_answer(parts)``
    tells its answer apart from the replies before it (and records any ticket those carry)."""

    def __init__(self, device: dict[str, Any], request_id: str = "sync"):
        self.device = device
        self.request_id = request_id
        self.tickets = Tickets()

    def frames(self, verb: str = "CAPS") -> list[bytes]:
        header: dict[str, Any] = {"request_id": self.request_id}
        if verb == "CAPS":
            header["device"] = self.device
        return [verb.encode(), json.dumps(self.tickets.stamp(header)).encode()]

    def is_answer(self, parts: list[bytes]) -> bool:
        if parts[0] not in (b"CAPS_REPLY", b"STATS_REPLY", b"ERROR") or len(parts) < 2:
            return False
        try:
            header = json.loads(parts[1])
        except ValueError:
            return False
        self.tickets.read(header)
        return (parts[0] in (b"CAPS_REPLY", b"STATS_REPLY") and isinstance(header, dict)
                and header.get("request_id") == self.request_id)
