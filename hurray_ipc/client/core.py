"""The consumer's state machine, without I/O (the h11 / hyper-h2 pattern).

Pure: no socket, no thread, no lock, no device, no clock (none of its rules depends on time: a
release waits on fence *events*, not on a timeout; heartbeats and timeouts are the session's). The
:class:`~hurray_ipc.client.consumer.Consumer` holds the session lock around every call, feeds it
what happened (a DELIVER accepted or rejected, ``receive()`` taking a delivery, the application
releasing an event or a buffer, a fence event found complete, PRODUCER_GONE, CHANNEL_STATE, a
re-HELLO) and carries out what each call returns, in order: :class:`Unmap` (close the
handoff's memory mapping), :class:`Release` and :class:`EventRelease` (a RELEASE / EVENT_RELEASE
entry: queued for the next batch, or sent at once when ``now``), :class:`Flush` (send what is
queued now).

The rules it keeps (docs/spec/ipc-protocol.md §4, §6; sync-contract.md §3; ARCHITECTURE "Release"):

* every delivery is given back exactly once: one RELEASE, or none when its producer is gone
  (nobody to give it to) or its mapping would not close (kept, declared held for ever); a
  rejected delivery is refused with one RELEASE carrying a ``reason``;
* a RELEASE goes only after every fence recorded for it completed, and after its mapping was
  closed (:class:`Unmap` comes first: the mapping of an allocation must be gone before its
  producer may reuse or free the memory);
* an EVENT_RELEASE owed is sent before the RELEASE of the same token, never after it;
* RELEASEs given back while more deliveries wait in the inbox are queued without a :class:`Flush`
  (the consumer comes back for those, and the RELEASEs then travel as one batch): the inbox
  emptying flushes them, as does the session's next pump round before it waits on the socket
  (the session's outbox is where every verb is batched); with nothing in the inbox they go at once;
* credits: the REQUEST / RELEASE ``credits`` arithmetic is :class:`~.credits.Credits`'; the
  deliveries waiting in the inbox plus the credits asked never exceed ``max(prefetch, 1)``;
* a re-HELLO (a new broker, or the same one that forgot us) declares the credits asked and every
  delivery whose RELEASE was not sent and whose producer is not known gone (spec §6), so a
  RELEASE sent after it names a token that registration was told of.

The producer side needs no such core: its pure state is already :class:`~.grants.GrantBook` and
:class:`~.credits.Credits`; what remains there is device work and the send path.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..wire.messages import HeldClaim
from .credits import Credits

__all__ = ["Action", "ConsumerCore", "Delivery", "EventRelease", "Flush", "Release", "Stage", "Unmap"]


@dataclass(frozen=True)
class Delivery:
    """A DELIVER the consumer accepted (its handle and memory opened)."""

    token: str
    producer_id: str
    handoff_id: int
    event: bool  # SYNC_EVENT: an EVENT_RELEASE is owed


@dataclass(frozen=True)
class Unmap:
    """Close this delivery's memory mapping now (before its RELEASE, which follows). If it will not
    close, tell :meth:`ConsumerCore.unmap_failed` and send no RELEASE for it."""

    token: str
    delivery: Delivery


@dataclass(frozen=True)
class Release:
    """A RELEASE entry. ``now``: send it at once (with anything queued before it); else queue it
    for the next batch. ``credits``: REQUEST credits carried on it (0: none); ``reason``: a
    rejected delivery's."""

    token: str
    producer_id: str
    handoff_id: int
    credits: int = 0
    reason: str | None = None
    now: bool = False


@dataclass(frozen=True)
class EventRelease:
    """An EVENT_RELEASE entry, queued: it travels with the next flush (only the producer's event
    pool waits on it)."""

    token: str


@dataclass(frozen=True)
class Flush:
    """Send every queued message now: nothing is about to follow that could join the batch."""


Action = Unmap | Release | EventRelease | Flush


class Stage(Enum):
    """Where one delivery is: waiting in the inbox, held by the application, or released by it
    and waiting on its fences (``FENCED``). Once they completed it is given back and forgotten."""

    INBOX = "inbox"
    HELD = "held"
    FENCED = "fenced"
    KEPT = "kept"  # its mapping would not close: never given back, still declared held


@dataclass
class _Entry:
    delivery: Delivery
    stage: Stage = Stage.INBOX
    event_pending: bool = False
    gone: bool = False  # PRODUCER_GONE named it: nothing is sent for it any more
    fences: set[int] = field(default_factory=set)


class ConsumerCore:
    """One consumer's deliveries, from DELIVER to RELEASE.

    ``inbox``: tokens delivered and not yet taken by ``receive()``, oldest first (read, never
    written, by the caller). ``credits``: REQUEST credits asked and not yet delivered. ``ended``:
    the broker said the channel's stream ended (CHANNEL_STATE, §4.9). ``epoch``: the registration
    last declared. Not thread-safe: the caller holds its session's lock around every call."""

    def __init__(self, prefetch: int):
        self.credits = Credits(prefetch)
        self.inbox: deque[str] = deque()
        self.ended = False
        self.epoch = 0
        # Every delivery not given back yet, in arrival order; the FENCED ones are the release
        # queue, each given back as soon as its own fences completed.
        self._entries: dict[str, _Entry] = {}
        self._fence_of: dict[int, str] = {}  # pending fence id -> the token it guards
        # Counts kept as they change: the pump asks every round, and a consumer may hold thousands.
        self._fenced = 0
        self._gone = 0  # entries marked gone
        # A RELEASE was queued (not flushed) since the last Flush: the inbox emptying flushes it.
        self._unflushed = False
        self._gone_tokens: deque[str] = deque(maxlen=4096)  # told PRODUCER_GONE: a RELEASE may cross it

    # --- what the consumer reads ------------------------------------------------------------
    @property
    def held(self) -> int:
        """Deliveries whose RELEASE is still owed (in the inbox, held, or released and waiting)."""
        return len(self._entries) - self._gone

    @property
    def releasing(self) -> int:
        """Deliveries released by the application whose RELEASE waits on their fences."""
        return self._fenced

    def pending_fences(self) -> list[int]:
        """Fence ids not yet reported complete, oldest release first: the caller queries them."""
        return list(self._fence_of)

    def want_request(self) -> int:
        """REQUEST credits to ask for while a ``receive()`` waits: at least one (prefetch 0 asks
        one per call), counting the inbox as ready answers."""
        return self.credits.want(len(self.inbox), at_least=1)

    def requested(self, n: int) -> None:
        """A REQUEST of ``n`` credits was sent."""
        self.credits.ask(n)

    def crossed(self, token: Any) -> bool:
        """A refusal of ``token``'s RELEASE is expected: PRODUCER_GONE named it (the two crossed)."""
        return token in self._gone_tokens

    def stage(self, token: str) -> Stage | None:
        """Where ``token`` is; None once it was given back (or never delivered)."""
        e = self._entries.get(token)
        return None if e is None else e.stage

    # --- registration -----------------------------------------------------------------------
    def registering(self, epoch: int) -> dict[str, Any]:
        """A HELLO of registration ``epoch`` is about to go: its consumer fields (spec §6). ``held``
        lists every delivery whose RELEASE was not sent, unless its producer is gone (the broker
        answers a listed gone one PRODUCER_GONE again, and nothing proves it ours); ``credits``
        re-declares what was asked, since a REQUEST sent to a broker that lost us is lost with it."""
        self.epoch = epoch
        held = [HeldClaim(t, e.delivery.producer_id, e.delivery.handoff_id, e.event_pending)
                for t, e in self._entries.items() if not e.gone]
        return {"held": held, "credits": self.credits.asked, "ended": self.ended}

    # --- the broker's messages --------------------------------------------------------------
    def delivered(self, d: Delivery) -> None:
        """A DELIVER was accepted: it answers one credit and waits in the inbox for ``receive()``."""
        self.credits.answered()
        self._entries[d.token] = _Entry(d, event_pending=d.event)
        self.inbox.append(d.token)

    def rejected(self, token: str | None, reason: str) -> list[Action]:
        """A DELIVER could not be accepted (bad handle, memory that does not open): refuse it at
        once with a RELEASE carrying ``reason``; the credit it used is asked for again on it, or
        ``receive()`` would starve. ``token`` None: the DELIVER named none; nothing to refuse."""
        self.credits.answered()
        if token is None:
            return []
        return [Release(token, "", 0, self.credits.ask_for(len(self.inbox)), reason, now=True)]

    def producer_gone(self, tokens: Iterable[Any]) -> tuple[list[str], list[Action]]:
        """PRODUCER_GONE: these deliveries are over; nothing more is sent for them (their mappings
        still close when released). Those still in the inbox leave it, and are returned: no
        ``receive()`` will hand them out, and their owner releases them."""
        dropped: list[str] = []
        for t in tokens:
            if not isinstance(t, str):
                continue
            self._gone_tokens.append(t)
            e = self._entries.get(t)
            if e is None:
                continue
            if not e.gone:
                e.gone = True
                self._gone += 1
            if e.stage is Stage.INBOX:
                e.stage = Stage.HELD  # still to be released (its mapping closed) by its owner
                dropped.append(t)
        if dropped:
            kept = [t for t in self.inbox if t not in dropped]
            self.inbox.clear()  # in place: a waiting receive() watches this deque
            self.inbox.extend(kept)
        return dropped, self._inbox_shrank() if dropped else []

    def channel_state(self, ended: bool) -> None:
        """CHANNEL_STATE: whether every producer of the channel ended (§4.9)."""
        self.ended = ended

    # --- the application and the devices ----------------------------------------------------
    def taken(self) -> tuple[str, list[Action]]:
        """``receive()`` takes the oldest delivery (the inbox is not empty). When it was the last,
        the releases held back for the inbox go now."""
        token = self.inbox.popleft()
        self._entries[token].stage = Stage.HELD
        return token, self._inbox_shrank()

    def event_released(self, token: str) -> list[Action]:
        """The application's stream-waits on the producer's event are issued: EVENT_RELEASE, queued
        (it travels with the next flush), unless its producer is gone."""
        e = self._entries.get(token)
        if e is None or not e.event_pending:
            return []
        e.event_pending = False
        return [] if e.gone else [EventRelease(token)]

    def released(self, token: str, fences: Iterable[int] = ()) -> list[Action]:
        """The application released the buffer; ``fences``: ids of the events recorded on the
        streams it used, each reported through :meth:`fence_completed`. The RELEASE goes once all
        completed (at once when there are none); a second call does nothing."""
        e = self._entries.get(token)
        if e is None or e.stage in (Stage.FENCED, Stage.KEPT):
            return []  # given back already (exactly once), or never to be
        out: list[Action] = self.event_released(token)  # the event before the buffer
        was_queued = e.stage is Stage.INBOX  # released without being received (close())
        if was_queued:
            self.inbox.remove(token)
        e.stage = Stage.FENCED
        self._fenced += 1
        e.fences = set(fences)
        for f in e.fences:
            self._fence_of[f] = token
        out += self._advance(e)
        return out + self._inbox_shrank() if was_queued else out

    def fence_completed(self, fence: int) -> list[Action]:
        """The fence event ``fence`` completed (a successful query): its work on the buffer is done."""
        token = self._fence_of.pop(fence, None)
        if token is None:
            return []
        e = self._entries[token]
        e.fences.discard(fence)
        return self._advance(e)

    def unmap_failed(self, d: Delivery) -> None:
        """Closing ``d``'s mapping failed (its :class:`Unmap`): the memory may still be mapped here,
        so its producer must never get it back. No RELEASE goes (the caller drops the one that
        followed the Unmap, and the credits it carried); it stays owed, and a re-HELLO keeps
        declaring it held, so that no restarted broker hands it back to its producer either."""
        self._entries[d.token] = _Entry(d, stage=Stage.KEPT)

    # --- internals --------------------------------------------------------------------------
    def _advance(self, e: _Entry) -> list[Action]:
        """When ``e``'s fences all completed: close its mapping, then give it back. Its RELEASE is
        queued, and flushed at once unless more deliveries wait in the inbox: the consumer comes
        back for those, and the RELEASEs then leave as one batch (at the latest when the inbox
        empties, or when the session's next pump round flushes before it waits)."""
        if e.stage is not Stage.FENCED or e.fences:
            return []
        d = e.delivery
        del self._entries[d.token]
        self._fenced -= 1
        unmap: list[Action] = [Unmap(d.token, d)]
        if e.gone:
            self._gone -= 1
            return unmap  # nobody to give it back to
        # Ask for the next buffers on this message instead of a REQUEST of its own.
        release = Release(d.token, d.producer_id, d.handoff_id, self.credits.ask_for(len(self.inbox)))
        self._unflushed = True
        return unmap + [release] + self._inbox_shrank()

    def _inbox_shrank(self) -> list[Action]:
        """With nothing left in the inbox, the RELEASEs held back for it go now."""
        if self.inbox or not self._unflushed:
            return []
        self._unflushed = False
        return [Flush()]
