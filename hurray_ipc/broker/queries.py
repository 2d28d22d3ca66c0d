"""STATS and CAPS (docs/spec/ipc-protocol.md §2, §2.3, §6a): what the broker says about itself
and about pairs of devices, and what it keeps for the connections that ask.

Pure, like the core: no sockets, time passed in.
- :class:`QueryLedger` remembers the connections that asked: their ``query_bytes`` budgets, their
  unread answers and those answers' tickets, and when to probe one that never shows it read.
- :func:`caps_reply` and :func:`stats_snapshot` build the answers from the core's state.
The core (core.py) dispatches STATS and CAPS here and stamps every answer through the ledger.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hurray_ipc import __version__
from hurray_ipc.contract.sync import Transport
from hurray_ipc.transport.pairing import Endpoint, pair_modes
from hurray_ipc.wire.ipc import ERROR_CODES, PROTOCOL_VERSION, ProtocolError
from hurray_ipc.wire.messages import Caps

if TYPE_CHECKING:
    from .core import BrokerCore, Stats

# Bytes of STATS_REPLY and CAPS_REPLY headers per second (spec §6a `query_bytes`): per connection,
# registered or not, and for all together. Answers are built, encoded and queued until their peer
# reads them, so their size is what a query flood costs; small answers (a CAPS, a STATS of a small
# broker) are never limited in practice. An over-budget query gets at most one ERROR a second per
# connection; the rest are dropped unanswered.
QUERY_BYTES = 2 << 20
QUERY_BYTES_TOTAL = 16 << 20
MAX_QUERY_PEERS = 16384  # connections whose queries are remembered (the least recent idle ones are forgotten)
# What waits for a peer that does not read (spec §6a `unread_answers`, `unread_bytes_total`): every
# answer to a STATS or CAPS (reply or ERROR) carries a ticket, and a query shows which answers its
# connection read by naming the latest ticket it saw. ZeroMQ never says whether a peer reads, so
# this proof is the only bound on what a deaf peer makes the broker keep: answers are queued in
# the broker until read, and the high-water mark is counted in messages, not bytes.
MAX_UNREAD = 8                      # answers one connection may have unread; past it, no answer
UNREAD_BYTES_TOTAL = 64 << 20       # bytes of unread answers, all connections; past it, ERROR
# A connection with unread answers is sent PONG 2 s after its last proof of reading, then at
# doubling gaps (at most hourly): a send to a closed connection fails, and that frees its answers.
PROBE_FIRST_S = 2.0
PROBE_MAX_S = 3600.0
MAX_STATS_CLIENTS = 1000   # clients listed in one STATS_REPLY (the rest are counted in clients_truncated)
MAX_STATS_CHANNELS = 1000  # channels listed in one STATS_REPLY
STATS_WINDOW_S = 10.0      # the recent-rate window of STATS_REPLY


@dataclass(frozen=True)
class Sample:
    """The counters at time ``at``, one a second (``BrokerCore.tick``): STATS' recent rates."""

    at: float
    handoffs: int
    releases: int
    messages_in: int
    messages_out: int

    @property
    def counts(self) -> tuple[int, int, int, int]:
        return self.handoffs, self.releases, self.messages_in, self.messages_out


@dataclass(frozen=True)
class Unread:
    """An answer sent and not yet shown read (§6a): its ``ticket`` and its ``size`` in bytes."""

    ticket: str
    size: int


@dataclass(eq=False)
class Asker:
    """A connection that sent STATS or CAPS: its query-rate budget and its unread answers."""

    rid: bytes
    allowance: float  # query_bytes it may still be sent this second (§6a); may go negative
    at: float  # when ``allowance`` was last refilled
    refused_at: float = float("-inf")  # when it was last sent ERROR limit_exceeded query_bytes
    unread: deque[Unread] = field(default_factory=deque)  # oldest first
    probe_at: float = float("inf")  # when to check that it is still connected (while unread)
    probe_gap: float = PROBE_FIRST_S
    proved: bool = False  # its latest query named its latest unread answer: it reads, and holds nothing


def refill(allowance: float, at: float, rate: float, now: float) -> tuple[float, float]:
    """A budget of ``rate`` a second that holds at most ``rate`` (one second's worth): what
    ``allowance``, as it was at ``at``, has become at ``now``, and the time to keep with it. Time
    does not run back: a reading earlier than ``at`` neither takes allowance away nor becomes
    the new ``at``, so no interval is refilled twice (§6a)."""
    return min(rate, allowance + max(0.0, now - at) * rate), max(at, now)


class QueryLedger:
    """The connections that asked (spec §6a): idle ones (nothing unread) in least-recently-asked
    order, the first to be forgotten; those with unread answers, forgotten only once a send to
    them fails (:meth:`forget`). Counts refusals and withheld answers in the core's ``stats``."""

    def __init__(self, stats: Stats, *, query_bytes: int = QUERY_BYTES, query_bytes_total: int = QUERY_BYTES_TOTAL,
                 unread_bytes_total: int = UNREAD_BYTES_TOTAL):
        self.stats = stats
        self.query_bytes, self.query_bytes_total = float(query_bytes), float(query_bytes_total)
        self.unread_bytes_total = unread_bytes_total
        self.unread_bytes = 0
        self._idle: OrderedDict[bytes, Asker] = OrderedDict()
        self._waiting: dict[bytes, Asker] = {}
        self._total = [self.query_bytes_total, 0.0]  # all connections' bucket: [allowance, at]
        self._probed_at = 0.0

    @property
    def unread_answers(self) -> int:
        return sum(len(a.unread) for a in self._waiting.values())

    def asker(self, rid: bytes, ticket: Any, now: float) -> Asker | None:
        """The connection ``rid``, its answers up to ``ticket`` (the query's, when a string it
        knows) taken as read; None when the query gets no answer at all: it has MAX_UNREAD
        unread (it does not read, or asks ahead of its answers), or every remembered connection
        has unread answers and none is idle to forget (steps 1-2 of §6a)."""
        a = self._waiting.get(rid)
        if a is None:
            a = self._idle.pop(rid, None)
            if a is None:
                if len(self._idle) + len(self._waiting) >= MAX_QUERY_PEERS:
                    if not self._idle:
                        self.stats.answers_withheld += 1
                        return None
                    self._idle.popitem(last=False)
                a = Asker(rid, self.query_bytes, now)
            self._idle[rid] = a  # most recently asked last
        a.proved = False
        if isinstance(ticket, str) and any(u.ticket == ticket for u in a.unread):
            while a.unread:
                u = a.unread.popleft()
                self.unread_bytes -= u.size
                if u.ticket == ticket:
                    break
            if a.unread:
                a.probe_at, a.probe_gap = now + PROBE_FIRST_S, PROBE_FIRST_S
            else:
                self._waiting.pop(rid, None)
                self._idle[rid] = a
                a.probe_at = float("inf")
                a.proved = True
        if len(a.unread) >= MAX_UNREAD:  # before any other check: a refusal is an answer too
            self.stats.answers_withheld += 1
            return None
        return a

    def admit(self, a: Asker, now: float) -> bool:
        """Steps 3-5 of §6a for a query from ``a``: raises ProtocolError (an answer, stamped like
        a reply) past ``unread_bytes_total``, and over a ``query_bytes`` budget at most once a
        second per connection; False (no answer) for the rest of those. True: answer it (its
        fields are judged next: a malformed one is answered ERROR, stamped the same), then
        :meth:`charge` its size."""
        a.allowance, a.at = refill(a.allowance, a.at, self.query_bytes, now)
        t = self._total
        t[0], t[1] = refill(t[0], t[1], self.query_bytes_total, now)
        # Past the total, a connection that just showed it read everything is still answered, from
        # a reserve of as much again: peers that stay connected and never read would otherwise
        # lock every tool out for as long as they stay (they are never forgotten).
        if self.unread_bytes >= self.unread_bytes_total * (2 if a.proved else 1):
            self.stats.limits_refused += 1
            raise ProtocolError("limit_exceeded", f"the broker holds {self.unread_bytes} bytes of STATS and CAPS "
                                f"answers that their connections have not read (at most {self.unread_bytes_total}); "
                                "ask again later", limit="unread_bytes_total", value=self.unread_bytes)
        if a.allowance > 0 and t[0] > 0:
            return True
        self.stats.limits_refused += 1
        if now - a.refused_at < 1.0:
            return False
        a.refused_at = now
        if a.allowance <= 0:
            raise ProtocolError("limit_exceeded", f"one connection is sent at most {int(self.query_bytes)} bytes of "
                                "STATS and CAPS answers a second; further queries this second are not answered",
                                limit="query_bytes", value=int(self.query_bytes))
        raise ProtocolError("limit_exceeded", f"this broker sends at most {int(self.query_bytes_total)} bytes of "
                            "STATS and CAPS answers a second to all connections; further queries from this one "
                            "this second are not answered", limit="query_bytes_total",
                            value=int(self.query_bytes_total))

    def charge(self, a: Asker, size: int) -> None:
        """An answer of ``size`` bytes went to ``a``: both ``query_bytes`` budgets pay for it."""
        a.allowance -= size
        self._total[0] -= size

    def stamp(self, a: Asker, ticket: str, size: int, now: float) -> None:
        """An answer of ``size`` bytes carrying ``ticket`` goes to ``a``: unread until named."""
        if not a.unread:
            self._idle.pop(a.rid, None)
            self._waiting[a.rid] = a
            a.probe_at, a.probe_gap = now + PROBE_FIRST_S, PROBE_FIRST_S
        a.unread.append(Unread(ticket, size))
        self.unread_bytes += size

    def forget(self, rid: bytes) -> None:
        """``rid`` is disconnected: what was queued for it is gone, so is its unread count."""
        self._idle.pop(rid, None)
        a = self._waiting.pop(rid, None)
        if a is not None:
            self.unread_bytes -= sum(u.size for u in a.unread)

    def due_probes(self, now: float) -> list[bytes]:
        """The connections to PONG now (checked at most once a second): a send that fails for a
        closed one makes the caller :meth:`forget` it. Probes back off to at most one an hour."""
        if now - self._probed_at < 1.0:
            return []
        self._probed_at = now
        due = []
        for rid, a in self._waiting.items():
            if a.probe_at <= now:
                a.probe_gap = min(PROBE_MAX_S, a.probe_gap * 2)
                a.probe_at = now + a.probe_gap
                due.append(rid)
        return due


def caps_reply(core: BrokerCore, msg: Caps) -> dict[str, Any]:
    """CAPS {device: endpoint, peer?: endpoint, channel?, transport?} -> the CAPS_REPLY's fields
    but its request_id and ticket (§2)."""
    request_id = msg.request_id
    try:
        me = Endpoint.from_dict(msg.device)
        peer = Endpoint.from_dict(msg.peer) if msg.peer is not None else None
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise ProtocolError("bad_header", f"CAPS endpoint: {e!r}", field="device", request_id=request_id) from None
    transport = msg.transport
    try:
        t = Transport.parse(transport) if transport is not None else None
    except ValueError:
        raise ProtocolError("bad_header", f"transport {str(transport)[:32]!r} is not one of "
                            f"{[x.value for x in Transport]}", field="transport", request_id=request_id) from None
    channel = msg.channel
    reply: dict[str, Any] = {}
    if peer is not None:
        reply.update(pair_modes(me, peer, t).to_dict())
    elif channel is not None and channel in core.channels:
        members = [core.clients[r] for r in core.channels[channel].members]  # not every client (red team 9)
        per = [{"consumer_id": cl.label, "name": cl.name, **pair_modes(me, cl.endpoint, t).to_dict()}
               for cl in members if cl.role == "consumer"]
        reply["consumers"] = per
        reply["bridges"] = [{"client_id": cl.label, "name": cl.name, "role": cl.role, **cl.route.to_dict()}
                            for cl in members if cl.route is not None]
        if per:
            reply.update({k: per[0][k] for k in ("transport", "device_tag", "valid_sync_modes", "excluded",
                                                 "host_staged")})
    if "valid_sync_modes" not in reply:
        # No consumer named: answer for a consumer on the same device, as hurray-caps does.
        reply.update(pair_modes(me, me, t or Transport.IPC).to_dict())
    return reply


def stats_snapshot(core: BrokerCore, now: float) -> dict[str, Any]:
    """Everything STATS_REPLY says (spec §2.3) but its request_id and ticket, as of ``now``: a new
    dict of plain JSON values, never mutated afterwards, so another thread may read one it was
    handed (the metrics endpoint). Walks the clients, channels, grants and deliveries once:
    nothing is counted per handoff beyond the integers in the core's Stats."""
    s = core.stats
    started = core.started if core.started is not None else now
    uptime = max(0.0, now - started)
    by_producer: dict[bytes, int] = {}
    events_of: dict[bytes, int] = {}
    in_flight: dict[str, int] = {}
    events = 0
    clients = core.clients
    for d in core.deliveries.values():
        by_producer[d.producer] = by_producer.get(d.producer, 0) + 1
        if d.event_pending:
            events += 1
            events_of[d.producer] = events_of.get(d.producer, 0) + 1
            events_of[d.consumer] = events_of.get(d.consumer, 0) + 1
        holder = clients.get(d.consumer)
        if holder is not None:
            in_flight[holder.channel] = in_flight.get(holder.channel, 0) + 1
    grants_of: dict[str, int] = {}
    for g in core.grants.values():
        grants_of[g.channel] = grants_of.get(g.channel, 0) + 1
    listed: list[dict[str, Any]] = []
    producers = 0
    for c in clients.values():
        producers += c.role == "producer"
        if len(listed) < MAX_STATS_CLIENTS:
            listed.append({
                "id": c.label, "name": c.name, "role": c.role, "channel": c.channel, "pid": c.endpoint.pid,
                "device": c.endpoint.identity.spec, "credits": c.credits,
                "outstanding": c.held if c.role == "consumer" else by_producer.get(c.rid, 0),
                "events_outstanding": events_of.get(c.rid, 0), "lease": c.lease is not None,
                "state": "unresponsive" if c.unresponsive else "choked" if c.rid in core.choked
                else "benched" if c.rid in core.benched else "alive",
                "silent_s": round(max(0.0, now - c.last_seen), 3), "ended": c.ended})
    channels: list[dict[str, Any]] = []
    queued = 0
    for name, ch in core.channels.items():
        n_queued = sum(clients[r].credits for r in ch.requests)
        queued += n_queued
        if len(channels) < MAX_STATS_CHANNELS:
            channels.append({
                "name": name, "producers": len(ch.producers), "consumers": len(ch.members) - len(ch.producers),
                "queued": n_queued, "ready": sum(clients[p].credits for p in ch.producers),
                "grants": grants_of.get(name, 0), "in_flight": in_flight.get(name, 0), "ended": ch.ended})
    counts = (s.handoffs, s.releases, s.messages_in, s.messages_out)
    # The recent window: the oldest sample at most STATS_WINDOW_S old (the start counts as a
    # sample of zeros); with none that recent (no tick for a while), the newest there is.
    samples = [Sample(started, 0, 0, 0, 0), *core.samples]
    base = next((x for x in samples if now - x.at <= STATS_WINDOW_S), samples[-1])
    span = max(0.0, now - base.at)
    names = ("handoffs", "releases", "messages_in", "messages_out")
    return {
        "broker": {"version": __version__, "protocol": PROTOCOL_VERSION, "pid": core.pid, "session": core.session,
                   "uptime_s": round(uptime, 3)},
        "gauges": {"clients": len(clients), "producers": producers, "consumers": len(clients) - producers,
                   "channels": len(core.channels), "queued": queued, "grants": len(core.grants),
                   "outstanding": len(core.deliveries), "events_outstanding": events,
                   "orphans": len(core.orphans), "unresponsive": s.unresponsive,
                   "unread_answers": core.queries.unread_answers, "unread_bytes": core.queries.unread_bytes},
        "totals": {"handoffs": s.handoffs, "releases": s.releases, "rejected": s.rejected,
                   "messages_in": s.messages_in, "messages_out": s.messages_out, "wire_in": s.wire_in,
                   "wire_out": s.wire_out, "errors": s.errors, "consumers_lost": s.consumers_lost,
                   "producers_lost": s.producers_lost, "undeliverable": s.undeliverable,
                   "dropped_full": s.dropped_full, "limits_refused": s.limits_refused,
                   "answers_withheld": s.answers_withheld, "grants_revoked": s.grants_revoked,
                   "consumers_fenced": s.consumers_fenced, "consumers_choked": s.consumers_choked,
                   "holds_fenced": s.holds_fenced},
        "rates": {"life": {k: round(n / uptime, 3) if uptime > 0 else 0.0 for k, n in zip(names, counts, strict=True)},
                  "window": {k: round((n - b) / span, 3) if span > 0 else 0.0
                             for k, n, b in zip(names, counts, base.counts, strict=True)},
                  "window_s": round(span, 3)},
        "errors_by_code": {code: core.errors_by_code.get(code, 0) for code in sorted(ERROR_CODES)},
        "shm": {"segments": s.segments, "cleaned": s.segments_cleaned, "sweeps": s.sweeps},
        "clients": listed, "clients_truncated": len(clients) - len(listed),
        "channels": channels, "channels_truncated": len(core.channels) - len(channels),
    }
