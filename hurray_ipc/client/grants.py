"""A producer's grants (docs/spec/ipc-protocol.md §4): which consumer asked, and whether each grant
is still good to send on.

Pure: no socket, no clock, no lock (the caller holds its session's lock). The producer feeds it
the broker's GRANT and REVOKE and its own re-HELLO and END, and takes grants from :attr:`queue`
for its sends. A grant ends one of four ways, all decided here: a HANDOFF uses it; the broker
revokes it (spec §4.3a); a re-HELLO voids it (the broker voided it too); or a send that did not use
it gives it back to the front of the queue, unless it became void or was revoked meanwhile.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..transport.pairing import Endpoint
from ..wire.ipc import Grant as GrantMessage
from .credits import Credits

__all__ = ["Grant", "GrantBook", "Granted"]


@dataclass(frozen=True)
class Grant:
    """One GRANT (spec §2.2): the id a HANDOFF names, the registration it was issued to, the consumer."""

    grant_id: int
    epoch: int
    consumer_id: str


class Granted(Enum):
    """What became of a GRANT the broker sent."""

    QUEUED = "queued"
    VOID = "void"  # issued to an earlier registration, or after END: the broker voided it too
    UNKNOWN_CONSUMER = "unknown_consumer"  # names a consumer whose endpoint never came: register again


class GrantBook:
    """``queue``: grants to send on, oldest first. ``credits``: the READY credits asked and not
    yet granted. ``epoch``: the registration grants must belong to (the session's)."""

    def __init__(self, credits: Credits):
        self.credits = credits
        self.queue: deque[Grant] = deque()
        self.epoch = 0
        self.ended = False
        self._revoked: deque[int] = deque(maxlen=1024)  # grant ids the broker took back
        self._consumers: dict[str, Endpoint] = {}  # endpoints GRANTs carried, once per pairing and registration

    def __len__(self) -> int:
        return len(self.queue)

    def registering(self, epoch: int) -> int:
        """A HELLO of registration ``epoch`` is about to go: the grants held are void (a new
        broker, or the same one that forgot us) and are asked for again; each consumer's endpoint
        comes again with its first GRANT. Returns the credits the HELLO declares."""
        self.epoch = epoch
        self.credits.ask(len(self.queue))
        self.queue.clear()
        self._consumers.clear()
        if self.ended:
            self.credits.reset()  # an ended producer asks for nothing (spec §4.9)
        return self.credits.asked

    def granted(self, msg: GrantMessage) -> Granted:
        """A GRANT arrived."""
        if msg.epoch != self.epoch or self.ended:
            return Granted.VOID
        self.credits.answered()
        g = Grant(msg.grant_id, msg.epoch, msg.consumer_id)
        if msg.consumer is not None:  # the first GRANT of this pairing carries the consumer's endpoint
            self._consumers[g.consumer_id] = Endpoint.from_dict(msg.consumer)
        if g.consumer_id not in self._consumers:
            return Granted.UNKNOWN_CONSUMER
        self.queue.append(g)
        return Granted.QUEUED

    def revoked(self, grant_ids: Any) -> None:
        """REVOKE: these grants are the broker's again; one already on its way in a HANDOFF is
        refused unknown_grant, and one given back later is dropped."""
        ids = {g for g in grant_ids if isinstance(g, int) and not isinstance(g, bool)} \
            if isinstance(grant_ids, list) else set()
        self._revoked.extend(ids)
        kept = [g for g in self.queue if g.grant_id not in ids]
        self.queue.clear()
        self.queue.extend(kept)

    def give_back(self, g: Grant) -> None:
        """A send did not use ``g``: the next one takes it, unless it is void or revoked."""
        if self.usable(g) and g.grant_id not in self._revoked:
            self.queue.appendleft(g)

    def usable(self, g: Grant) -> bool:
        """Whether ``g`` belongs to this registration and the stream has not ended."""
        return g.epoch == self.epoch and not self.ended

    def consumer(self, g: Grant) -> Endpoint | None:
        """The endpoint of ``g``'s consumer; None when ``g`` is void (a re-HELLO came between)."""
        return self._consumers.get(g.consumer_id) if self.usable(g) else None

    def end(self) -> None:
        """END: no more handoffs; every grant held is void and nothing more is asked."""
        self.ended = True
        self.queue.clear()
        self.credits.reset()
