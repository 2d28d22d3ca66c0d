"""The broker's state machine, without I/O (sans-I/O, as h11 and hyper-h2 are).

:class:`BrokerCore` takes events — a client's frames (:meth:`BrokerCore.receive`), the passage of
time (:meth:`BrokerCore.tick`), a send that could not be delivered (:meth:`BrokerCore.undeliverable`)
— and returns what to do: messages to send (:class:`Send`) and effects (:class:`CleanSegments`).
It never touches a socket, a clock, a pid or a file; the caller passes ``now`` and, for same-host
clients, a liveness verdict. So every interleaving can be driven from a test, including by
hypothesis' stateful testing (tests/test_broker_core.py), and ``hurray_ipc/broker/server.py`` is a thin loop.

Invariants (:meth:`BrokerCore.check_invariants`, asserted after every step of the stateful test):

1. Credits are conserved: a consumer is in its channel's request queue (once, round robin) exactly
   when its ``credits`` is above 0 and it is not choked (``choked``: a send to it failed and no
   probe got through since, spec §1). A consumer's ``granted`` is the number of unused grants
   naming it; its deliveries, queued credits and grants together are at most MAX_HELD (grants
   coming back and a DELIVER that bounced turn into queued credits, so those alone may pass
   MAX_CREDITS); a producer's queued credits are at most MAX_CREDITS; no count is negative.
2. Every delivery is owned by exactly one registered consumer (its token is in ``deliveries`` once,
   bound to that consumer's routing id), and by at most ``MAX_HELD`` per consumer.
3. Every handoff ends exactly once: a delivery leaves ``deliveries`` either by RELEASE (RELEASED to
   its producer), by its consumer's death (RELEASED, reason consumer_gone), by its consumer's fence
   (RELEASED consumer_fenced, and PRODUCER_GONE fenced to the consumer) or by its producer's death
   (PRODUCER_GONE to its consumer), and its token is never live and released at once.
4. Tokens are never reused: each is ``<session>.<random>``, and a released token is remembered.
5. A grant is used once; every grant names a registered producer, is indexed by its producer and
   its channel, and grants are kept in issue order (so the oldest, which a tick may revoke, is first).
6. A claim a consumer makes after a broker restart for a handoff whose producer has not registered
   again is provisional (``claims``): it binds nothing until that producer's HELLO names who holds
   the handoff, so a consumer claiming first cannot shut out the real holder. Each counts against
   its consumer's ``MAX_HELD`` (the only bound, as for deliveries: a cap per handoff would let
   rivals crowd the holder's claim out).
7. An UNMAP round (§4.10) is open exactly while it awaits someone: a registered consumer it asked
   (``awaited_in``) or a label not registered here that may still register (``unseen_in``, at most
   ``MAX_UNSEEN`` per producer, expiring in ``unseen_rounds`` order); a label is never both
   registered and awaited unregistered. A consumer deregistered without proof while it held no
   delivery (silent, §5) is remembered by routing id (``left_unproven``, never a registered one):
   its later BYE proves it gone; the rounds that awaited it registered await it unregistered
   (within ``MAX_UNSEEN``).

Identity: a client is its ZeroMQ routing id, which the server's socket does not let a second
connection take over (no ROUTER_HANDOVER); a re-HELLO claims only what that routing id holds.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import math
import os
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hurray_ipc.contract.meta import check_meta
from hurray_ipc.contract.sync import Transport
from hurray_ipc.format.handle import BufferHandle, DeviceTag, HandleError, SyncMode
from hurray_ipc.notes import Note, to_logger
from hurray_ipc.transport import liveness
from hurray_ipc.transport.pairing import Endpoint, ModeCache, host_side
from hurray_ipc.transport.route import Route
from hurray_ipc.wire.fields import consumer_label, shown
from hurray_ipc.wire.ipc import (
    CLIENT_VERBS,
    Accepted,
    Deliver,
    EventRelease,
    EventReleased,
    Handoff,
    Message,
    ProtocolError,
    Release,
    Released,
    decode_all,
    is_token,
    json_bytes,
)
from hurray_ipc.wire.ipc import Grant as GrantMessage
from hurray_ipc.wire.messages import (
    MAX_CREDITS,
    MAX_HELD,
    MAX_UNMAPS,
    AnyMessage,
    Bye,
    Caps,
    CapsReply,
    ChannelState,
    End,
    Error,
    HeldClaim,
    Hello,
    Ping,
    Pong,
    ProducerGone,
    Ready,
    Request,
    Revoke,
    Shutdown,
    StatsReply,
    Unmap,
    Unmapped,
    Welcome,
    echoable,
    parse,
)
from hurray_ipc.wire.messages import Route as RouteMessage
from hurray_ipc.wire.messages import Stats as StatsQuery

from .queries import (
    QUERY_BYTES,
    QUERY_BYTES_TOTAL,
    STATS_WINDOW_S,
    UNREAD_BYTES_TOTAL,
    Asker,
    QueryLedger,
    Sample,
    caps_reply,
    refill,
    stats_snapshot,
)

log = logging.getLogger("hurray.broker")
MAX_CLIENTS = 16384             # registrations in all
MAX_CLIENTS_PER_PROCESS = 256   # registrations of one process (by lease, else by host and pid)
MAX_RATE = 50_000.0  # messages per second one registered client may send (sustained; burst of one second)
# What an ERROR answering a registered client costs its allowance beyond the entry it answers (§6a):
# a refusal costs the broker several times what a handled entry does (measured 2026-12-07: a RELEASE
# batch of 64 made-up tokens kept the broker busy at 30-45k entries/s, under MAX_RATE), so a client
# whose every entry is refused is held to MAX_RATE / (1 + ERROR_COST) of them.
ERROR_COST = 9.0
# Bytes a second of messages from peers not registered, all of them together, and the burst (§6a):
# they have no rate of their own, and a HELLO is parsed whole before anything can refuse it (a
# reviewer's 0.88 MB HELLOs cost 18 ms each and held a healthy pair at 9-10 handoffs/s). The
# burst takes the largest HELLO (2 MiB) four times over.
UNREGISTERED_BYTES = float(8 << 20)
# Past that budget, a few small messages of each routing id are still read (§6a): while peers
# flooding it spent it, a newcomer's HELLO (or a PING answered not_registered and the HELLO after
# it) was dropped with theirs, so no client could register until the flood stopped. Two a second
# per routing id, each at most NEWCOMER_BYTES (the library's HELLO is about 530 bytes; one listing
# held deliveries after a broker restart, about 150 bytes more each, may be larger and then waits
# for the budget), remembered for the MAX_NEWCOMERS routing ids read this way last. A peer chooses
# its routing id, so a flood gets this way 8 KiB a second more per connection it opens; charged to
# the budget, but no lower than -UNREGISTERED_BYTES, so that such a flood leaves at most a second
# of debt.
NEWCOMER_MESSAGES = 2.0
NEWCOMER_BYTES = 4 << 10
MAX_NEWCOMERS = 16384
FENCE_TIMEOUTS = 20  # a consumer alive but silent this many timeouts while holding buffers is fenced (§5)
MAX_ROUTING_ID = 32  # bytes: a DELIVER names its producer in a 32-byte field (spec §2.2)
_RELEASED_MEMORY = 100_000  # released (and fenced) tokens remembered, to tell "already released" from "unknown" (§6a)
_GONE_LABELS = 65536  # labels of consumers proven gone, remembered to answer UNMAP for them (§4.10)
MAX_UNSEEN = 4096  # labels one producer's open UNMAPs await unregistered in all (§4.10, §6a)
_SAMPLE_EVERY_S = 1.0      # tick() samples the counters for the recent rates at most this often
# A consumer a send to which failed (full, or disconnected) is choked (spec §1): none of its credits
# is granted until an unasked PONG to it gets through. The first probe goes this long after the
# failure, each later one twice as long after a failed one, up to CHOKE_MAX_S.
CHOKE_FIRST_S = 0.05
CHOKE_MAX_S = 2.0
# A consumer a delivery of which the hold bound fenced is benched (§5): none of the credits of its
# process on its channel is granted for one hold bound, or twice as long as that process's last
# bench there if that was to end less than this many hold bounds earlier, at most this many.
BENCH_MAX_HOLDS = 64
HOLD_MIN_S, HOLD_MAX_S = 0.001, 366 * 86400.0  # the hold bound's range: whole milliseconds, at most a year


class _Recent:
    """The latest ``bound`` keys noted, oldest forgotten first, for membership tests only.

    Holds each key's ``hash()``, not the key: str caches its hash, so noting a token costs no
    hashing, and 100,000 tokens take 8.6 MB (tracemalloc, the module run as source) instead of the
    24.8 MB of their 48-character strings in an OrderedDict, which showed as a broker RSS plateau
    27 MiB above its start once that many handoffs had been released. Two keys of one hash are one
    entry, so a key never noted can test as noted: for random tokens with odds of about
    bound / 2**64. That only changes an error code or skips a claim, never a live delivery."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._order: deque[int] = deque()
        self._hashes: set[int] = set()

    def add(self, key: Any) -> None:
        h = hash(key)
        if h in self._hashes:
            return
        self._hashes.add(h)
        self._order.append(h)
        if len(self._order) > self.bound:
            self._hashes.discard(self._order.popleft())

    def __contains__(self, key: Any) -> bool:
        return hash(key) in self._hashes

    def discard(self, key: Any) -> None:
        """Forget ``key``. Its place in the order stays until it is the oldest, so ``len`` counts
        it until then, and the key noted again would be forgotten early: for keys noted once
        (tokens), neither matters."""
        self._hashes.discard(hash(key))

    def __len__(self) -> int:
        return len(self._order)


def _remember(memory: OrderedDict[Any, Any], key: Any, value: Any, bound: int) -> None:
    """Note ``key`` (with ``value``) as the newest entry of ``memory``, forgetting the oldest past
    ``bound`` entries."""
    memory[key] = value
    memory.move_to_end(key)
    while len(memory) > bound:
        memory.popitem(last=False)


def _count_down(counts: dict[Any, int], key: Any) -> None:
    """One less of ``key`` in ``counts``; a count that reaches zero leaves the dict."""
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


def _unindex(index: dict[Any, set[Any]], key: Any, item: Any) -> None:
    """``item`` no longer under ``key`` in ``index``; an empty set leaves the dict."""
    items = index.get(key)
    if items is not None:
        items.discard(item)
        if not items:
            del index[key]


def _asked(msgs: list[Any]) -> int:
    """The credits of a lone REQUEST or READY (1..MAX_CREDITS, else 0): what its refusal names
    (none of them was applied, spec §2 ERROR)."""
    if len(msgs) == 1 and isinstance(msgs[0], Message) and msgs[0].verb in ("REQUEST", "READY"):
        n = msgs[0].header.get("credits")
        if type(n) is int and 1 <= n <= MAX_CREDITS:
            return n
    return 0


@dataclass
class Client:
    rid: bytes
    role: str
    channel: str
    endpoint: Endpoint
    name: str
    last_seen: float
    lease: str | None = None
    credits: int = 0  # consumer: requests not yet granted; producer: READY not yet granted
    epoch: int = 0  # the client's registration number, echoed in GRANT
    label: str = ""  # what other clients see of it (CAPS, GRANT): never its routing id
    unresponsive: bool = False  # heartbeat timed out but the process is alive: keeps what it holds
    held: int = 0  # consumer: deliveries bound to it
    granted: int = 0  # consumer: its credits granted to producers, the grants not yet used (§6a counts them)
    allowance: float = MAX_RATE  # token bucket for MAX_RATE
    allowance_at: float = 0.0
    # producer: handoffs it declared outstanding at its last HELLO -> the consumer label it named
    confirmed: dict[int, str | None] = field(default_factory=dict)
    # producer: the consumer endpoints its GRANTs carried (consumer rid -> the Endpoint sent)
    endpoints_sent: dict[bytes, Endpoint] = field(default_factory=dict)
    rid_text: str = ""  # the routing id as DELIVER names a producer
    route: Route | None = None  # a bridge's last ROUTE (spec §2.4): repeated in CAPS_REPLY
    ended: bool = False  # producer: it sent END (or re-registered saying so), spec §4.9
    grants: OrderedDict[int, None] = field(default_factory=OrderedDict)  # producer: its unused grants, oldest first
    # producer: a grant of it was revoked and it has neither handed off nor asked (READY) since:
    # passed over while another producer can take a grant (§4).
    revoked: bool = False
    bundles: bool = False  # its registration reads bundles (spec §2.2a): the loop may send it some
    kept_mappings: bool = False  # consumer: its registration reads ``keep`` and answers UNMAP (§4.10)
    sent_keep: bool = False  # consumer: a DELIVER with ``keep`` went to it from this broker (§4.10)

    def __post_init__(self) -> None:
        self.rid_text = self.rid.decode(errors="replace")

    @property
    def process(self) -> str:
        return self.lease or f"{self.endpoint.identity.host}/{self.endpoint.pid}"


# The records made per handoff (Grant, Delivery, Send) spell out their __init__: mypyc compiles
# a written one, while the one @dataclass generates runs interpreted (0.4 against 0.04 µs a call).
@dataclass(init=False)
class Grant:
    gid: int
    producer: bytes
    consumer: bytes
    channel: str
    issued: float = 0.0
    consumer_gone: bool = False

    def __init__(self, gid: int, producer: bytes, consumer: bytes, channel: str, issued: float = 0.0,
                 consumer_gone: bool = False) -> None:
        self.gid = gid
        self.producer = producer
        self.consumer = consumer
        self.channel = channel
        self.issued = issued
        self.consumer_gone = consumer_gone


@dataclass(init=False)
class Delivery:
    token: str
    producer: bytes
    consumer: bytes
    handoff_id: int
    event_pending: bool
    since: float

    def __init__(self, token: str, producer: bytes, consumer: bytes, handoff_id: int, event_pending: bool,
                 since: float) -> None:
        self.token = token
        self.producer = producer
        self.consumer = consumer
        self.handoff_id = handoff_id
        self.event_pending = event_pending
        self.since = since


@dataclass
class UnmapRound:
    """A producer's UNMAP (spec §4.10): the consumers still to answer, and the answers so far."""

    producer: bytes
    request: int
    memory: bytes
    waiting: set[bytes] = field(default_factory=set)
    # Labels not registered here, awaited until ``until`` to register (and then asked), in order.
    unseen: dict[str, None] = field(default_factory=dict)
    until: float = 0.0
    unmapped: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    fenced: list[str] = field(default_factory=list)


@dataclass
class Choke:
    """A choked consumer (spec §1): when to probe it next, the wait before that, and whether a
    probe went out since the last send to it that failed."""

    probe_at: float
    wait: float
    probed: bool = False


@dataclass
class Channel:
    # Consumers with queued credits (their count is Client.credits), in round-robin order (§4).
    requests: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    grants: OrderedDict[int, None] = field(default_factory=OrderedDict)  # unused grants, oldest first
    producers: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # round-robin order
    members: dict[bytes, None] = field(default_factory=dict)  # its registered clients, in registration order
    ended: bool = False  # every registered producer ended, and none registered since (spec §4.9)


@dataclass
class Stats:
    handoffs: int = 0
    releases: int = 0
    rejected: int = 0
    errors: int = 0
    consumers_lost: int = 0
    producers_lost: int = 0
    unresponsive: int = 0      # clients now past the heartbeat timeout whose process lives
    undeliverable: int = 0     # sends to a peer that had disconnected (EHOSTUNREACH)
    dropped_full: int = 0      # sends refused because the peer's queue was full (EAGAIN)
    limits_refused: int = 0
    answers_withheld: int = 0  # STATS/CAPS left unanswered: 8 unread, or the query table full (§6a)
    grants_revoked: int = 0    # grants taken back from a producer that did not use them (§4.3a)
    consumers_choked: int = 0  # times a consumer's credits were set aside because a send to it failed (§1)
    consumers_fenced: int = 0  # consumers deregistered holding buffers while they may live (§5)
    holds_fenced: int = 0      # deliveries fenced because their consumer held them past hold_s (§5)
    # Messages as the core sees them: a binary batch's entries count one each (also a message too
    # malformed to split: one). wire_in: ZeroMQ messages received; wire_out: sent (the loop counts
    # those, after batching).
    messages_in: int = 0
    messages_out: int = 0
    wire_in: int = 0
    wire_out: int = 0
    # The loop's stale-segment sweeps (hurray_ipc/broker/server.py, note_sweep): this uid's hurray segments and
    # leases seen at the last sweep, and how many sweeps removed in all.
    sweeps: int = 0
    segments: int = 0
    segments_cleaned: int = 0


@dataclass(init=False)
class Send:
    """Send ``msg`` to the client routed as ``rid`` (an output of :meth:`BrokerCore.receive`)."""

    rid: bytes
    msg: AnyMessage

    def __init__(self, rid: bytes, msg: AnyMessage) -> None:
        self.rid = rid
        self.msg = msg


@dataclass(frozen=True)
class CleanSegments:
    """A same-host client died: sweep segments and leases of dead processes."""


Out = Send | CleanSegments
Alive = Callable[[Client], "bool | None"]  # True alive, False dead, None: cannot tell


class BrokerCore:
    """Pairs consumer requests with producers, routes handoffs and releases. See the module doc."""

    def __init__(self, *, host: str, timeout_s: float = 3.0, heartbeat_s: float = 0.5, session: str | None = None,
                 token: Callable[[], str] | None = None, started: float | None = None, pid: int = 0,
                 stats_cache_s: float = 0.0, query_bytes: int = QUERY_BYTES,
                 query_bytes_total: int = QUERY_BYTES_TOTAL, fence_s: float | None = None,
                 route_key: str | None = None, unread_bytes_total: int = UNREAD_BYTES_TOTAL,
                 entropy: Callable[[int], bytes] = os.urandom, note: Note | None = None,
                 hold_s: float | None = None):
        self.host = host
        # note(level, fields): where the core's events go ({"event": name, ...}); the loop's
        # logger, one JSON object per record (hurray_ipc/notes.py), unless a test collects them.
        self._note: Note = note or to_logger("hurray.broker")
        # What a ROUTE must carry (§2.4): the server writes it to an owner-only file beside the
        # socket and hands it to the broker's own bridges; a client that cannot read it cannot
        # announce a bridge.
        # entropy(n): n random bytes, the core's one source of randomness (tokens, session, route
        # key, grant ids, tickets); the OS's CSPRNG unless a test makes it reproducible. ``token``,
        # ``session`` and ``route_key``, when given, replace what would be drawn from it.
        self._entropy = entropy
        self._hex32: list[str] = []  # tokens drawn 64 at a time (one getrandom call)
        self.route_key = route_key or entropy(32).hex()
        self.started = started  # the loop's clock at start (None: the first event's ``now``)
        self.pid = pid  # the broker's pid, for STATS only (the core never uses it)
        # STATS_REPLY reuses a snapshot younger than this (0: always fresh); bounds what a STATS
        # flood costs, since a snapshot walks every client, channel and delivery.
        self.stats_cache_s = stats_cache_s
        self._snap: dict[str, Any] | None = None
        self._snap_at = 0.0
        self._snap_bytes = 0  # the cached snapshot's size as JSON (what a STATS_REPLY costs, §6a)
        self.stats = Stats()
        # The connections that asked (STATS, CAPS): budgets, unread answers, tickets (§6a).
        self.queries = QueryLedger(self.stats, query_bytes=query_bytes, query_bytes_total=query_bytes_total,
                                   unread_bytes_total=unread_bytes_total)
        self._asking: Asker | None = None  # the connection whose STATS/CAPS is being answered
        # The counters once a second: the recent rates.
        self.samples: deque[Sample] = deque(
            maxlen=int(STATS_WINDOW_S / _SAMPLE_EVERY_S) + 2)
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        # A live consumer silent this long while it holds buffers is fenced (spec §5): never sooner
        # than the timeout, which decides when it is unresponsive.
        self.fence_s = max(timeout_s, FENCE_TIMEOUTS * timeout_s if fence_s is None else fence_s)
        # A delivery bound to a consumer this long is fenced, however live the consumer (spec §5):
        # the operator's bound on what one consumer can keep from its producers. None: no bound.
        if hold_s is not None and not (math.isfinite(hold_s) and HOLD_MIN_S <= hold_s <= HOLD_MAX_S):
            raise ValueError(f"hold_s must be {HOLD_MIN_S} to {HOLD_MAX_S:.0f} seconds or None, got {hold_s!r}")
        # In whole milliseconds, so that the bound WELCOME states (hold_ms) is exactly the one applied.
        self.hold_ms = 0 if hold_s is None else round(hold_s * 1000)
        self.hold_s = None if hold_s is None else self.hold_ms / 1000
        self.session = session or entropy(8).hex()
        self._token = token or self._random_hex32
        self.clients: dict[bytes, Client] = {}
        self.channels: dict[str, Channel] = {}
        self.grants: dict[int, Grant] = {}
        self.deliveries: dict[str, Delivery] = {}  # in binding order, which is ``since`` order (_bind)
        # The same deliveries by consumer and by producer: a BYE or a death costs its own count.
        self.held_by: dict[bytes, dict[str, Delivery]] = {}
        self.handed_by: dict[bytes, dict[str, Delivery]] = {}
        self.by_handoff: dict[tuple[bytes, int], str] = {}  # (producer, handoff) -> token
        self.released = _Recent(_RELEASED_MEMORY)  # tokens
        self._unregistered = [UNREGISTERED_BYTES, 0.0]  # UNREGISTERED_BYTES' bucket: [allowance, at]
        # Routing ids read past that budget, least recently first: rid -> [allowance, at] (NEWCOMER_MESSAGES).
        self._newcomers: OrderedDict[bytes, list[float]] = OrderedDict()
        self.fenced = _Recent(_RELEASED_MEMORY)  # tokens of fenced deliveries (§5)
        # Tokens told PRODUCER_GONE while held, until their consumer's RELEASE crosses it: that
        # one refusal is not charged to its rate (§6a), a second is.
        self.gone = _Recent(2 * _RELEASED_MEMORY)  # each token, and (token, "event")
        self.orphans: dict[tuple[bytes, int], float] = {}  # (producer, handoff) -> release deadline
        # Orphans whose deadline passed (their producer got RELEASED): a late claim must not revive them.
        self.expired = _Recent(_RELEASED_MEMORY)  # (producer, handoff)
        # Provisional claims (invariant 6): producer -> handoff -> claims, and by (consumer, token).
        self.claims: dict[bytes, dict[int, list[Delivery]]] = {}
        self.claim_of: dict[tuple[bytes, str], Delivery] = {}
        self.withdrawn = _Recent(_RELEASED_MEMORY)  # (consumer, token) of claims released undecided
        self.per_process: dict[str, int] = {}
        # Random start: a grant id a client kept from a previous broker never names one of ours.
        self._gids = itertools.count(int.from_bytes(entropy(5), "little") << 8)
        self.modes = ModeCache()
        self.errors_by_code: dict[str, int] = {}
        self._out: list[Out] = []
        self._now = 0.0  # the latest time receive() or tick() was given
        self._rechecks: dict[str, float] = {}  # channel -> when a grant there will have sat a heartbeat
        # Registered consumers a send to which failed, by routing id (a re-HELLO keeps it): their
        # credits are kept but not queued until a probe gets through (spec §1, invariant 1).
        self.choked: dict[bytes, Choke] = {}
        # Registered consumers the hold bound fenced (spec §5): until when their credits are kept
        # but not queued. And the latest bench, (length, end), by the consumer's process and
        # channel, newest last, bounded: the bench of every consumer registration of that process
        # on that channel, so that a new routing id, a BYE and a HELLO, or a re-HELLO do not end it.
        self.benched: dict[bytes, float] = {}
        self.bench_of: OrderedDict[tuple[str, str], tuple[float, float]] = OrderedDict()
        # Kept mappings (§4.10): open UNMAP rounds by (producer's rid_text, request), the rounds
        # each consumer is awaited in, registered consumers by label, and the labels of consumers
        # proven gone since they last registered (newest last, bounded).
        self.unmaps: dict[tuple[str, int], UnmapRound] = {}
        self.unmaps_of: dict[bytes, int] = {}
        self.awaited_in: dict[bytes, set[tuple[str, int]]] = {}
        self.by_label: dict[str, bytes] = {}
        self.gone_labels: OrderedDict[str, None] = OrderedDict()
        # Labels awaited unregistered: the rounds each is named in, their count per producer, and
        # the rounds with any, in the order their time runs out (one timeout for all: arrival order).
        self.unseen_in: dict[str, set[tuple[str, int]]] = {}
        self.unseen_of: dict[bytes, int] = {}
        self.unseen_rounds: OrderedDict[tuple[str, int], None] = OrderedDict()
        # Consumers deregistered without proof while they held no delivery (silent, §5), by routing
        # id (newest last, bounded): a BYE of theirs afterwards proves them gone (§4.10 step 4).
        # The value: whether this broker had sent it ``keep`` (a HELLO without kept_mappings then
        # withdraws them, step 0).
        self.left_unproven: OrderedDict[bytes, bool] = OrderedDict()

    # --- outputs ---------------------------------------------------------------------------
    def _send(self, rid: bytes, msg: AnyMessage, size: int | None = None) -> int:
        """Queue ``msg`` for ``rid``. An answer to the STATS or CAPS being handled is stamped with
        a ticket and counted unread (§6a); returns its header's size in bytes (``size``: that
        size computed by the caller, ticket included), else 0."""
        a = self._asking
        if a is not None and a.rid == rid and isinstance(msg, CapsReply | StatsReply | Error):
            ticket = self._entropy(8).hex()
            msg.ticket = ticket
            if size is None:
                size = len(json_bytes(msg.fields()))
            self.queries.stamp(a, ticket, size, self._now)
        else:
            size = 0
        self._out.append(Send(rid, msg))
        self.stats.messages_out += 1
        return size

    def _random_hex32(self) -> str:
        """128 random bits as 32 hex digits (a delivery token's random part, spec §2.2)."""
        if not self._hex32:
            raw = self._entropy(16 * 64).hex()
            self._hex32.extend(raw[i:i + 32] for i in range(0, len(raw), 32))
        return self._hex32.pop()

    def _take(self) -> list[Out]:
        out, self._out = self._out, []
        return out

    def _over_rate(self, client: Client, now: float) -> bool:
        """Refill ``client``'s allowance (MAX_RATE a second, at most one second's worth) and say
        whether a message arriving now is past its rate: each entry it carries costs 1 and each
        ERROR answering it ERROR_COST more (§6a), so a message may take the allowance below 0."""
        client.allowance, client.allowance_at = refill(client.allowance, client.allowance_at, MAX_RATE, now)
        return client.allowance < 1.0

    def _unregistered_budget(self, rid: bytes, parts: list[bytes], now: float) -> bool:
        """Whether a message from a peer not registered may be read (§6a): while the budget all
        such peers share is above 0, charged in full; or else while the routing id's own bucket of
        small messages has one, charged down to -UNREGISTERED_BYTES at most."""
        b = self._unregistered
        b[0], b[1] = refill(b[0], b[1], UNREGISTERED_BYTES, now)
        size = sum(len(p) for p in parts)
        if b[0] > 0:
            b[0] -= size
            return True
        if size > NEWCOMER_BYTES:
            return False
        own = self._newcomers.get(rid) or [NEWCOMER_MESSAGES, now]  # full when first seen
        allowance, at = refill(own[0], own[1], NEWCOMER_MESSAGES, now)
        if allowance < 1.0:
            return False
        _remember(self._newcomers, rid, [allowance - 1.0, at], MAX_NEWCOMERS)
        # Never below the floor, and never up to it from a debt a big message left deeper.
        b[0] = min(b[0], max(b[0] - size, -UNREGISTERED_BYTES))
        return True

    def _rate_refusal(self, rid: bytes, ref: str, handoff_ids: list[int] | None, credits: int) -> None:
        """A message past its client's rate, refused as a whole (§6a), so that past its rate a
        client's message costs the broker little. ``credits``: a refused REQUEST's or READY's,
        named so that its client counts them as not asked (0: none)."""
        self.stats.limits_refused += 1
        self._refuse_whole(rid, "limit_exceeded", f"a client may send at most {int(MAX_RATE)} messages per second "
                           f"(an entry a refusal answers counts {1 + int(ERROR_COST)}); this one was dropped",
                           ref, handoff_ids, limit="message_rate", value=int(MAX_RATE),
                           **({"credits": credits} if credits else {}))

    def _refuse_whole(self, rid: bytes, code: str, message: str, ref: str, handoff_ids: list[int] | None,
                      **extra: Any) -> None:
        """One uncharged ERROR for a whole message, whatever it carries; a HANDOFF batch's refusal
        lists its ``handoff_ids``, whose grants stay the producer's (§2.2)."""
        self._error(rid, code, message, charge=False, ref=ref, **extra,
                    **({"handoff_ids": handoff_ids} if handoff_ids else {}))

    def _error(self, rid: bytes, code: str, message: str, *, charge: bool = True, **extra: Any) -> None:
        """ERROR ``code`` to ``rid``; a registered client's allowance pays ERROR_COST for it unless
        ``charge`` is false (§6a)."""
        c = self.clients.get(rid)
        if c is not None and charge:
            c.allowance -= ERROR_COST
        self.stats.errors += 1
        n = self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1
        if n <= 100 or n % 1000 == 0:  # every refusal is answered; a flood of them is not all logged
            # not_registered is how a restarted broker has its clients say HELLO again (spec §6):
            # routine after a restart, so info; every other refusal is an anomaly, a warning.
            level = logging.INFO if code == "not_registered" else logging.WARNING
            self._note(level, {"event": "error", "client": rid.decode(errors="replace")[:32], "code": code,
                               "message": message[:500], "count_of_code": n,
                               **{k: str(v)[:64] for k, v in extra.items()}})
        self._send(rid, Error(code, message, extra))

    @staticmethod
    def label_of(rid: bytes) -> str:
        """The name other clients see for ``rid`` (wire.fields.consumer_label)."""
        return consumer_label(rid)

    def _channel(self, name: str) -> Channel:
        ch = self.channels.get(name)
        if ch is None:
            ch = self.channels[name] = Channel()
        return ch

    # --- events ----------------------------------------------------------------------------
    def receive(self, rid: bytes, parts: list[bytes], now: float) -> list[Out]:
        """One message from ``rid`` (a binary batch is its entries, each answered on its own, in
        order). Nothing a client sends can raise out of here."""
        ref = bytes(parts[0])[:32].decode(errors="replace") if parts else ""
        if self.started is None:
            self.started = now
        self._now = now
        self.stats.wire_in += 1
        client = self.clients.get(rid)
        if client is None and not self._unregistered_budget(rid, parts, now):
            self.stats.limits_refused += 1  # dropped unread, unanswered (§6a)
            return self._take()
        over = client is not None and self._over_rate(client, now)  # judged as it arrives (§6a)
        try:
            msgs = decode_all(parts, allowed=CLIENT_VERBS)
        except ProtocolError as e:
            self.stats.messages_in += 1
            if over:
                self._rate_refusal(rid, ref, e.extra.get("handoff_ids"), 0)
            else:
                if client is not None:
                    client.allowance -= 1.0  # a message refused whole is one entry (§6a)
                self._error(rid, e.code, str(e), ref=ref, **e.extra)
            return self._take()
        except Exception as e:  # noqa: BLE001 - a bug must cost one message, never the broker
            self.stats.messages_in += 1
            log.exception("internal error decoding a message")
            if client is not None:
                client.allowance -= 1.0
            self._error(rid, "internal", f"internal error: {type(e).__name__}")
            return self._take()
        self.stats.messages_in += len(msgs)
        if over and client is not None and self._passes_rate(client, msgs, ref, now):
            return self._take()
        if over or (client is None and len(msgs) > 1):  # a batch before HELLO: one refusal too (§2)
            ids = [m.handoff_id for m in msgs if isinstance(m, Handoff)]
            if over:
                self._rate_refusal(rid, ref, ids, _asked(msgs))
            else:
                self._refuse_whole(rid, "not_registered", f"{ref} before HELLO (or the broker restarted): send "
                                   "HELLO", ref, ids)
            return self._take()
        for msg in msgs:
            self._entry(rid, msg, ref, now)
        return self._take()

    def _entry(self, rid: bytes, msg: Any, ref: str, now: float) -> None:
        """Handle one entry (a JSON message is one), answering a refusal with its ERROR."""
        self._asking = None
        try:
            self._dispatch(rid, msg, now)
        except ProtocolError as e:
            head = msg.header if isinstance(msg, Message) else msg.fields()
            extra = {k: head[k] for k in ("handoff_id", "request_id", "token", "request")
                     if k in head and echoable(head[k])}
            asked = _asked([msg])
            # A refused REQUEST or READY applied none of its credits: named, they are asked again
            # (§2). Not to a client not registered: the HELLO it sends next declares them.
            if asked and e.code != "not_registered":
                extra["credits"] = asked
            extra.update(e.extra)
            if "field" in extra and "value" not in extra:  # null: the message has no such field
                extra["value"] = shown(head, str(extra["field"]))
            self._error(rid, e.code, str(e), charge=e.charge, ref=ref, **extra)
        except Exception as e:  # noqa: BLE001 - a bug must cost one message, never the broker
            log.exception("internal error handling a message")
            self._error(rid, "internal", f"internal error: {type(e).__name__}")
        finally:
            self._asking = None

    def _passes_rate(self, c: Client, msgs: list[Any], ref: str, now: float) -> bool:
        """Handle what a client's message past its rate still does (§6a), returning True, or
        return False (it is refused whole). Only what the broker's own state bounds passes, and
        only what would be lost for good if refused: a consumer's releases of its own deliveries,
        its UNMAPPED answering a round that awaits it (each once), a producer's END (it ends
        the stream once; a second does nothing and is not answered) and a BYE (it ends the
        registration, and with it the rate). What passes costs nothing, so the allowance's floor
        stays as §6a says."""
        allowance = c.allowance
        if len(msgs) == 1 and msgs[0].verb == "BYE":
            self._entry(c.rid, msgs[0], ref, now)
            return True  # nothing is left to charge
        if c.role == "producer" and len(msgs) == 1 and msgs[0].verb == "END":
            self._entry(c.rid, msgs[0], ref, now)
        elif c.role == "consumer" and len(msgs) == 1 and msgs[0].verb == "UNMAPPED" and self._awaited(c, msgs[0]):
            self._entry(c.rid, msgs[0], ref, now)
        elif c.role == "consumer" and all(m.verb in ("RELEASE", "EVENT_RELEASE") for m in msgs):
            self._releases_past_rate(c, msgs, ref, now)
        else:
            return False
        c.allowance = allowance
        return True

    def _awaited(self, c: Client, raw: Any) -> bool:
        """Whether UNMAPPED ``raw`` from consumer ``c`` answers an UNMAP round that awaits it."""
        try:
            m = parse(raw)
        except ProtocolError:
            return False
        if not isinstance(m, Unmapped) or m.producer_id is None:
            return False
        r = self.unmaps.get((m.producer_id, m.request))
        return r is not None and c.rid in r.waiting

    def _releases_past_rate(self, c: Client, msgs: list[Any], ref: str, now: float) -> None:
        """A consumer's RELEASE / EVENT_RELEASE message past its rate (§6a): each entry that
        gives back what the broker gave it (the first RELEASE of a delivery bound to it or of its
        own claim, the first EVENT_RELEASE of one whose event is pending, credits in range) is
        handled as usual, since the broker's own deliveries bound those and a buffer must never
        stay held for its consumer's rate. Every other entry would be refused, so could repeat
        without end: it is dropped, all of them answered by one uncharged ERROR; credits it
        carries are applied, as on any RELEASE (§4)."""
        dropped = refused = 0
        for raw in msgs:
            try:
                m = parse(raw) if isinstance(raw, Message) else raw
            except ProtocolError:
                m = None
            if not isinstance(m, Release | EventRelease):
                dropped += 1
                continue
            d = self._named(c, m.token)
            if (d is not None and d.consumer == c.rid and 0 <= m.credits <= MAX_CREDITS
                    and (isinstance(m, Release) or d.event_pending)):
                self._entry(c.rid, raw, ref, now)
                continue
            dropped += 1
            if m.credits:
                try:
                    self._add_requests(c, self._credit_count(m.credits, "credits"))
                except ProtocolError:
                    self.stats.limits_refused += 1
                    refused += m.credits if 0 < m.credits <= MAX_CREDITS else 0
        if dropped:
            self._rate_refusal(c.rid, ref, None, refused)

    def _dispatch(self, rid: bytes, msg: Any, now: float) -> None:
        client = self.clients.get(rid)
        if client is not None:
            client.allowance -= 1.0
            client.last_seen = now
            if client.unresponsive:
                client.unresponsive = False
                self.stats.unresponsive -= 1
                self._note(logging.INFO, {"event": "client_responsive", "client": rid.decode(errors="replace")})
        if isinstance(msg, Message):
            if msg.verb in ("CAPS", "STATS"):
                self._query(rid, msg, now)
                return
            if msg.verb == "HELLO":
                self.on_hello(rid, Hello.parse(msg), now)
                return
        if client is None:
            if msg.verb == "BYE":
                self._bye_after_drop(rid)  # else nothing registered to end: silently done (spec §2)
                return
            raise ProtocolError("not_registered", f"{msg.verb} before HELLO (or the broker restarted): send HELLO")
        m = parse(msg) if isinstance(msg, Message) else msg  # fields after registration, before role (§2)
        if isinstance(m, Handoff):
            self.on_handoff(client, m, now)
        elif isinstance(m, Release):
            self.on_release(client, m)
        elif isinstance(m, EventRelease):
            self.on_event_release(client, m)
        elif isinstance(m, Request):
            self.on_request(client, m)
        elif isinstance(m, Ready):
            self.on_ready(client, m)
        elif isinstance(m, Ping):
            self._send(rid, Pong())
        elif isinstance(m, RouteMessage):
            self.on_route(client, m)
        elif isinstance(m, End):
            self.on_end(client)
        elif isinstance(m, Unmap):
            self.on_unmap(client, m)
        elif isinstance(m, Unmapped):
            self.on_unmapped(client, m)
        elif isinstance(m, Bye):
            self._drop(rid, "bye")

    def _query(self, rid: bytes, msg: Message, now: float) -> None:
        """CAPS or STATS: answered whether or not ``rid`` registered, within the query ledger's
        limits (§6a), which see the query before its fields are judged: a refusal is an answer."""
        a = self.queries.asker(rid, msg.header.get("ticket"), now)
        if a is None:
            return
        self._asking = a  # what is sent to rid from here on is its answer (_send)
        if not self.queries.admit(a, now):
            return
        q = parse(msg)
        assert isinstance(q, Caps | StatsQuery)  # msg.verb is CAPS or STATS
        size = self.on_caps(rid, q) if isinstance(q, Caps) else self.on_stats(rid, q, now)
        self.queries.charge(a, size)

    def tick(self, now: float, alive: Alive) -> list[Out]:
        """Time passed. ``alive(client)`` judges same-host clients by their process (a lease);
        heartbeat silence alone drops only a client ``alive`` cannot judge (None)."""
        if self.started is None:
            self.started = now
        self._now = now
        if not self.samples or now - self.samples[-1].at >= _SAMPLE_EVERY_S:
            s = self.stats
            self.samples.append(Sample(now, s.handoffs, s.releases, s.messages_in, s.messages_out))
        for rid in self.queries.due_probes(now):
            self._send(rid, Pong())
        if self.hold_s is not None:
            # First: a consumer the bound fences is benched before anything else in this tick
            # (ending a choke, a rematch) could grant it a credit; and a delivery bound during a
            # bench, fenced in the tick that bench ends, does not bench it again (§5).
            self._fence_overdue(now - self.hold_s)
            self._end_benches(now)
        self._probe_choked(now)
        granted: set[bytes] | None = None
        for rid, c in list(self.clients.items()):
            verdict = alive(c) if c.endpoint.identity.host == self.host else None
            if verdict is False:
                self._drop(rid, "process gone")
            elif now - c.last_seen > self.timeout_s:
                if verdict is True and c.held == 0 and rid not in self.handed_by:
                    if granted is None:  # producers with grants or unclaimed handoffs keep theirs
                        granted = {g.producer for g in self.grants.values()} | {k[0] for k in self.orphans}
                    if rid not in granted:
                        # Alive but silent, holding nothing: its registration must not outlive its
                        # connection (squatters fill the table so); it re-registers when it speaks.
                        self._drop(rid, "silent, holding nothing")
                        continue
                if verdict is True and c.role == "consumer" and now - c.last_seen > self.fence_s:
                    # Alive (as far as anyone can tell) but silent past the fence while holding
                    # others' buffers: they go back to their producers as consumer_fenced.
                    self._drop(rid, "fenced")
                elif verdict is True:
                    if not c.unresponsive:
                        c.unresponsive = True
                        self.stats.unresponsive += 1
                        self._note(logging.WARNING, {"event": "client_unresponsive",
                                                     "client": rid.decode(errors="replace"), "role": c.role,
                                                     "held": c.held, "silent_s": round(now - c.last_seen, 3)})
                else:
                    self._drop(rid, "heartbeat timeout")
        # Grants not used within timeout_s are revoked (§4): their consumers' credits go back to
        # the front; the producer asks again if it still wants one (grants is in issue order).
        # Channels where a producer waits while another sits on a grant are matched again once
        # that grant sat a heartbeat.
        rematch: set[str] = set()
        while self.grants:
            g = next(iter(self.grants.values()))
            if now - g.issued <= self.timeout_s:
                break
            rematch.add(g.channel)
            self._revoke(g)
        for name, at in list(self._rechecks.items()):
            if now >= at:
                del self._rechecks[name]
                rematch.add(name)
        for name in rematch:
            self._match(name)
        self._unseen_expired(now)
        for key, deadline in list(self.orphans.items()):
            if now >= deadline:
                del self.orphans[key]
                self.expired.add(key)
                if key[0] in self.clients:
                    # Nobody claimed it, but nothing proves its holder gone (stopped across the
                    # restart, it has not spoken yet): the producer retires it (§5, §6).
                    self._send(key[0], Released(key[1], "consumer_fenced"))
        # Claims to handoffs whose producer never came back to this broker.
        lost = [x for prod, by_hid in self.claims.items() if not self._is_producer(prod)
                for xs in by_hid.values() for x in xs if now - x.since > self.timeout_s]
        for x in lost:
            self._drop_claim(x)
        self._producer_gone([], lost)
        return self._take()

    def undeliverable(self, rid: bytes, msg: AnyMessage, why: str) -> list[Out]:
        """The socket could not take ``msg`` for ``rid`` ('unreachable': the peer is disconnected;
        'full': its queue is at the high-water mark). Counted and logged; the client's liveness
        (not this) decides whether it is gone, and its re-HELLO resynchronises what it holds.
        A DELIVER that did not leave never reached its consumer: the buffer goes back to its
        producer (RELEASED, reason ``undelivered: <why>``) and the consumer's credit, which it
        still counts as asked, back to the consumer. A consumer a send to which failed as full or
        unreachable is choked (:meth:`_choke`, spec §1): its credits wait unqueued for a probe."""
        d = self.deliveries.get(msg.token) if isinstance(msg, Deliver) else None
        c = self.clients.get(rid)
        if c is not None and c.role == "consumer" and why in ("full", "unreachable"):
            self._choke(c)
        if isinstance(msg, Unmap) and msg.producer_id is not None:
            # It never reached the consumer: nothing says it unmapped, so it is answered fenced.
            key = (msg.producer_id, msg.request)
            r = self.unmaps.get(key)
            if r is not None and rid in r.waiting and c is not None:
                self._settle(key, r, rid, r.fenced, c.label)
        if d is not None and d.consumer == rid:
            self._release(d, f"undelivered: {why}"[:200])
            if c is not None and c.role == "consumer":
                # Its own credit, asked and never answered, comes back: no limit applies (the
                # delivery it leaves counted as much).
                self._queue_credits(c, 1)
                self._match(c.channel)
        if why == "full":
            self.stats.dropped_full += 1
        else:
            self.stats.undeliverable += 1
            if why == "unreachable":
                self.queries.forget(rid)
        n = self.stats.dropped_full + self.stats.undeliverable
        if n & (n - 1) == 0 or n % 1000 == 0:  # 1, 2, 4, ... then every 1000th: a flood must not flood the log
            # A reply to a client that already left (a PONG crossing its BYE) is expected, not an anomaly.
            level = logging.WARNING if rid in self.clients else logging.INFO
            self._note(level, {"event": "send_failed", "why": why, "client": rid.decode(errors="replace")[:32],
                               "verb": msg.verb, "undeliverable": self.stats.undeliverable,
                               "dropped_full": self.stats.dropped_full})
        return self._take()

    def _choke(self, c: Client) -> None:
        """A send to consumer ``c`` failed (its queue is full, or it is disconnected): grant none of
        its credits until a probe gets through (spec §1), so that no other handoff is sent to
        bounce. Its unused grants are revoked (their producers are not passed over for it) and
        their credits kept with its others. A send failing after a probe doubles the wait."""
        k = self.choked.get(c.rid)
        if k is not None:
            if k.probed:
                k.wait = min(2 * k.wait, CHOKE_MAX_S)
                k.probe_at, k.probed = self._now + k.wait, False
            return
        self.choked[c.rid] = Choke(self._now + CHOKE_FIRST_S, CHOKE_FIRST_S)
        self.stats.consumers_choked += 1
        revoked = self._set_aside(c)
        n = self.stats.consumers_choked
        if n & (n - 1) == 0 or n % 1000 == 0:  # as send_failed: a client choked over and over must not flood the log
            self._note(logging.WARNING, {"event": "consumer_choked", "client": c.rid_text[:32], "channel": c.channel,
                                         "credits": c.credits, "grants_revoked": revoked, "consumers_choked": n})

    def _revoke_naming(self, c: Client) -> int:
        """Take back every unused grant naming consumer ``c`` and tell each producer (REVOKE; it
        is not passed over for it, §4.3a): how many. The credits are the caller's to keep or drop."""
        revoked: dict[bytes, list[int]] = {}
        for g in self._grants_naming(c):
            self._unlist(g)
            c.granted -= 1
            revoked.setdefault(g.producer, []).append(g.gid)
        for producer, gids in revoked.items():
            self._send(producer, Revoke(gids))
        return sum(map(len, revoked.values()))

    def _grants_naming(self, c: Client) -> list[Grant]:
        """The unused grants of ``c``'s channel that name consumer ``c`` and count in its
        ``granted`` (not yet marked ``consumer_gone``)."""
        ch = self.channels.get(c.channel)
        if ch is None or not c.granted:
            return []
        return [g for g in map(self.grants.__getitem__, ch.grants) if g.consumer == c.rid and not g.consumer_gone]

    def _probe_choked(self, now: float) -> None:
        """Send each choked consumer whose wait is over an unasked PONG (a client ignores it, §6a);
        one that went out a tick ago and did not fail (:meth:`undeliverable` would have said so
        before this tick) ends the choke: the consumer's credits are queued again."""
        for rid, k in list(self.choked.items()):
            if k.probed:
                del self.choked[rid]
                c = self.clients[rid]
                self._queue_credits(c, 0)
                self._match(c.channel)
            elif now >= k.probe_at:
                k.probed = True
                self._send(rid, Pong())

    def client_gone(self, rid: bytes, why: str) -> list[Out]:
        self._drop(rid, why)
        return self._take()

    def shutdown(self, reason: str) -> list[Out]:
        for rid in list(self.clients):
            self._send(rid, Shutdown(reason))
        return self._take()

    # --- registration ----------------------------------------------------------------------
    def on_hello(self, rid: bytes, msg: Hello, now: float) -> None:
        if not 1 <= len(rid) <= MAX_ROUTING_ID:
            raise ProtocolError("bad_header", f"the routing id (client_id) must be 1-{MAX_ROUTING_ID} bytes, got "
                                f"{len(rid)}", field="client_id")
        try:
            endpoint = Endpoint.from_dict(msg.endpoint)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ProtocolError("bad_header", f"endpoint: {e!r}", field="endpoint") from None
        role, channel, credits, ended, lease = msg.role, msg.channel, msg.credits, msg.ended, msg.lease
        if lease is not None and liveness.parse(lease) is None:
            raise ProtocolError("bad_header", f"lease {lease[:80]!r} is not a lease name", field="lease")
        # Everything that can refuse this HELLO is checked before any state changes.
        old = self.clients.get(rid)
        c = Client(rid, role, channel, endpoint, msg.name, now, lease, credits, msg.epoch,
                   label=self.label_of(rid), allowance_at=now, bundles=msg.bundles,
                   kept_mappings=msg.kept_mappings and role == "consumer")
        if old is not None:
            c.allowance = old.allowance  # a re-HELLO does not refill the bucket
        if old is None:
            if len(self.clients) >= MAX_CLIENTS:
                self._limit(f"this broker serves at most {MAX_CLIENTS} clients", "clients", len(self.clients) + 1)
            if self.per_process.get(c.process, 0) >= MAX_CLIENTS_PER_PROCESS:
                self._limit(f"one process may register at most {MAX_CLIENTS_PER_PROCESS} clients",
                            "clients_per_process", self.per_process.get(c.process, 0) + 1)
        elif old.role != role:
            raise ProtocolError("wrong_role", f"this client registered as a {old.role}; it cannot become a {role}")
        if old is not None:
            # It said HELLO again (it thought us gone): its credits and grants are void, as this
            # HELLO re-declares them; its deliveries stay bound: they are real.
            self._forget(old)
            c.held = old.held
            c.sent_keep = old.sent_keep
        self.clients[rid] = c
        if role == "consumer":
            self.by_label[c.label] = rid
            self.gone_labels.pop(c.label, None)  # it is here again: ask it, never answer for it
        if self.left_unproven.pop(rid, False) and role == "consumer":  # its BYE is an ordinary one now
            c.sent_keep = True
        self.per_process[c.process] = self.per_process.get(c.process, 0) + 1
        ch = self._channel(channel)
        ch.members[rid] = None
        if role == "producer":
            ch.producers[rid] = None
            c.ended = ended
            if ended:
                c.credits = 0  # an ended producer asks for nothing
            self._restore_outstanding(c, msg.outstanding, now)
        unqueued = 0
        if role == "consumer":
            bench = self.bench_of.get((c.process, channel))
            if bench is not None and now < bench[1]:  # its process's consumers on the channel are benched (§5)
                self.benched[rid] = bench[1]
            self._restore_held(c, msg.held, now)
            c.credits = 0  # the HELLO's credits are queued (the Client was built with them)
            unqueued = max(0, credits - (MAX_HELD - c.held))
            self._queue_credits(c, credits - unqueued)
        self._send(rid, Welcome(session=self.session, heartbeat_ms=int(self.heartbeat_s * 1000),
                                timeout_ms=int(self.timeout_s * 1000), fence_ms=int(self.fence_s * 1000),
                                hold_ms=self.hold_ms,
                                kept_mappings=True))
        if unqueued:
            # Past what it may hold: named, after the WELCOME, so that the client counts them as
            # not asked (§2, §6a); it asks again once it released some.
            self._error(rid, "limit_exceeded", f"a consumer may hold at most {MAX_HELD} deliveries and credits not "
                        f"yet delivered (it holds {c.held} and declared {credits} credits): {unqueued} of them were "
                        "not queued", charge=False, ref="HELLO", field="credits", limit="held",
                        value=c.held + credits, credits=unqueued)
        for key in list(self.awaited_in.get(rid, ())):  # it thought us gone: an UNMAP may not have reached it
            r = self.unmaps[key]
            if c.kept_mappings:
                self._send(rid, Unmap(r.request, r.memory, producer_id=key[0]))
            else:  # it withdrew kept_mappings: it will not answer, and may still keep it mapped
                self._settle(key, r, rid, r.fenced, c.label)
        if role == "consumer":
            self._registered(c)
        self._note(logging.INFO, {"event": "hello", "client": rid.decode(errors="replace"), "role": role,
                                  "channel": channel, "device": endpoint.identity.spec, "pid": endpoint.pid})
        if role == "producer":
            if not ended:
                self._set_stream(channel, False)  # a producer that registers reopens the channel
        else:
            if ended and not any(not self.clients[p].ended for p in ch.producers):
                # A restarted broker learns from its consumers that the stream had ended.
                self._set_stream(channel, True, told=rid)
            if ch.ended != ended:
                self._send(rid, ChannelState(ch.ended))
        self._match(channel)

    def _limit(self, what: str, limit: str, value: int) -> None:
        """Refuse the message: ERROR limit_exceeded naming the ``limit`` (spec §6a) and the ``value``
        the message would have reached."""
        self.stats.limits_refused += 1
        raise ProtocolError("limit_exceeded", what, limit=limit, value=value)

    def _restore_held(self, c: Client, held: list[HeldClaim], now: float) -> None:
        """A consumer re-registering (after a broker restart, or because it thought us gone) lists
        what it holds. It keeps what this broker bound to it. A token of an earlier broker is a
        claim to its (producer, handoff): refused when someone holds that handoff here or its
        producer already got it back; decided at once when the producer is registered (adopted
        if its ``outstanding`` names this consumer); otherwise kept provisional until the producer
        registers (invariant 6). A claim refused because the buffer went back to its producer is
        answered PRODUCER_GONE (reason ``reclaimed``): stop using it. Anything else is ignored:
        a re-HELLO cannot claim another consumer's delivery (which would let it release it)."""
        prefix = self.session
        for item in held[:MAX_HELD]:
            if c.held >= MAX_HELD:
                break
            token = item.token
            if token in self.fenced and token not in self.deliveries:
                self._send(c.rid, ProducerGone([token], "fenced"))
                continue
            if token in self.deliveries or token in self.released or token.startswith(prefix) or not is_token(token):
                continue  # ours: still bound to whoever it was delivered to (the same client, unchanged)
            prod, hid = item.producer_id, item.handoff_id
            if prod is None or hid is None:
                continue
            key = (prod.encode(), hid)
            if key in self.by_handoff or (c.rid, token) in self.claim_of:
                continue  # held here (by whoever the producer named), or claimed already
            producer = self.clients.get(key[0])
            if producer is not None and producer.role != "producer":
                continue
            named = producer.confirmed.get(hid, "") if producer is not None else None
            if key in self.expired or named == "":
                # Its producer already got it back, or does not count it outstanding.
                self._send(c.rid, ProducerGone([token], "reclaimed"))
                continue
            claim = Delivery(token, key[0], c.rid, hid, item.event_pending, now)
            if producer is not None:
                if named is None or named == c.label:
                    self._bind(claim)
                    self.orphans.pop(key, None)
                continue  # its producer names another holder
            rivals = self.claims.get(key[0], {}).get(hid, [])
            if all(x.consumer != c.rid for x in rivals) and (c.rid, token) not in self.withdrawn:
                self.claims.setdefault(key[0], {}).setdefault(hid, []).append(claim)
                self.claim_of[(c.rid, token)] = claim
                c.held += 1

    def _restore_outstanding(self, c: Client, outstanding: dict[int, str | None], now: float) -> None:
        """A producer re-registering lists its outstanding handoffs and who holds each. Claims
        consumers made before it came back are decided by that list: the one it names is bound,
        every other is voided (PRODUCER_GONE ``reclaimed``); with a bare handoff id the first
        claim wins. Handoffs no consumer claims within the timeout come back to it (RELEASED,
        consumer_gone)."""
        c.confirmed = outstanding
        for hid, claims in [(hid, list(xs)) for hid, xs in self.claims.get(c.rid, {}).items()]:
            for x in claims:
                self._drop_claim(x)
            named = outstanding.get(hid, "")
            winner = None if named == "" else next(
                (x for x in claims if named is None or named == self.label_of(x.consumer)), None)
            if winner is not None and winner.token in self.deliveries:
                winner = None  # its token was copied to another handoff, adopted first: bind neither twice
            if winner is not None:
                self._bind(winner)
            for x in claims:
                if x is not winner and x.consumer in self.clients:
                    self._send(x.consumer, ProducerGone([x.token], "reclaimed"))
        deadline = now + self.timeout_s
        for hid in outstanding:
            if (c.rid, hid) not in self.by_handoff:
                self.orphans[(c.rid, hid)] = deadline

    def _is_producer(self, rid: bytes) -> bool:
        c = self.clients.get(rid)
        return c is not None and c.role == "producer"

    def _drop_claim(self, x: Delivery) -> None:
        """Forget a provisional claim (decided, withdrawn, or its producer or consumer gone)."""
        by_hid = self.claims[x.producer]
        by_hid[x.handoff_id].remove(x)
        if not by_hid[x.handoff_id]:
            del by_hid[x.handoff_id]
            if not by_hid:
                del self.claims[x.producer]
        del self.claim_of[(x.consumer, x.token)]
        consumer = self.clients.get(x.consumer)
        if consumer is not None:
            consumer.held -= 1

    def _bind(self, d: Delivery) -> None:
        # Held from now (a claim adopted late too): the hold bound counts from here, and
        # ``deliveries`` stays in ``since`` order, so the tick finds the overdue ones at its front.
        d.since = self._now
        self.deliveries[d.token] = d
        self.held_by.setdefault(d.consumer, {})[d.token] = d
        self.handed_by.setdefault(d.producer, {})[d.token] = d
        self.by_handoff[(d.producer, d.handoff_id)] = d.token
        consumer = self.clients.get(d.consumer)
        if consumer is not None:
            consumer.held += 1

    def _unbind(self, d: Delivery) -> None:
        self.deliveries.pop(d.token, None)
        for index, rid in ((self.held_by, d.consumer), (self.handed_by, d.producer)):
            mine = index.get(rid)
            if mine is not None and mine.get(d.token) is d:
                del mine[d.token]
                if not mine:
                    del index[rid]
        if self.by_handoff.get((d.producer, d.handoff_id)) == d.token:
            del self.by_handoff[(d.producer, d.handoff_id)]
        consumer = self.clients.get(d.consumer)
        if consumer is not None:
            consumer.held -= 1

    # --- flow control ----------------------------------------------------------------------
    @staticmethod
    def _credit_count(n: int, name: str, least: int = 0) -> int:
        """Credits asked for: on a hot message's batch header 0 (none) or 1..MAX_CREDITS."""
        if not least <= n <= MAX_CREDITS:
            raise ProtocolError("bad_header", f"{name} must be 1..{MAX_CREDITS}, got {n}", field=name)
        return n

    def on_request(self, c: Client, msg: Request) -> None:
        if c.role != "consumer":
            raise ProtocolError("wrong_role", "REQUEST is a consumer's message")
        self._add_requests(c, msg.credits)

    def _add_requests(self, c: Client, n: int) -> None:
        self._check_queued(c, n)
        if c.held + c.credits + c.granted + n > MAX_HELD:
            self._limit(f"a consumer may hold at most {MAX_HELD} deliveries and credits not yet delivered (it holds "
                        f"{c.held}, has {c.credits} queued and {c.granted} granted and asked for {n} more): release "
                        "some first", "held", c.held + c.credits + c.granted + n)
        self._queue_credits(c, n)
        self._match(c.channel)

    def _queue_credits(self, c: Client, n: int, front: bool = False) -> None:
        """Queue ``n`` more credits of consumer ``c`` (0: queue those it has, a choke ended);
        ``front``: credits coming back (a refused HANDOFF, a voided or revoked grant), so ``c`` is
        served next. A choked or benched consumer keeps them unqueued (:meth:`_choke`, :meth:`_bench`)."""
        c.credits += max(n, 0)
        if c.credits <= 0 or c.rid in self.choked or c.rid in self.benched:
            return
        requests = self._channel(c.channel).requests
        requests[c.rid] = None
        if front:
            requests.move_to_end(c.rid, last=False)

    def on_ready(self, c: Client, msg: Ready) -> None:
        if c.role != "producer":
            raise ProtocolError("wrong_role", "READY is a producer's message")
        if c.ended:
            raise ProtocolError("ended", "this producer ended its stream (END): it sends no more handoffs")
        self._add_ready(c, msg.credits)

    def _add_ready(self, c: Client, n: int) -> None:
        self._check_queued(c, n)
        c.credits += n
        c.revoked = False  # it asks again: it takes turns as any producer
        self._match(c.channel)

    def _check_queued(self, c: Client, n: int) -> None:
        """A consumer's grants count as queued: granted, a credit is not yet answered, and would
        otherwise escape every limit (a REQUEST and a READY of 4096 each, over and over, made
        204,800 grants from 100 messages)."""
        if c.credits + c.granted + n > MAX_CREDITS:
            self._limit(f"a client may have at most {MAX_CREDITS} credits queued or granted unused (it has "
                        f"{c.credits + c.granted} and asked for {n} more); nothing was added", "queued_credits",
                        c.credits + c.granted + n)

    def _match(self, name: str) -> None:
        ch = self.channels.get(name)
        if ch is None:
            return
        idle_since = self._now - self.heartbeat_s
        while True:
            if not ch.requests:
                # No credit left: a grant a passed-over producer sits on goes to one that can use it.
                if ch.grants and self._revoke_for_an_able_producer(name, ch, idle_since):
                    continue
                return
            # Producers take turns, passing over one that sits on a grant unused for a heartbeat,
            # or let one be revoked, while another can take the grant (a hoarder, §4.3a).
            producer: bytes | None = None
            first_ready: bytes | None = None
            for rid in ch.producers:
                c = self.clients[rid]
                # At MAX_CREDITS unused grants a producer waits (they name consumers that left, or
                # it never uses them), or grants for consumers gone would pile up without bound.
                if c.credits > 0 and len(c.grants) < MAX_CREDITS:
                    if not self._passed_over(c, idle_since):
                        producer = rid
                        break
                    first_ready = first_ready or rid
            producer = producer or first_ready
            if producer is None:
                return
            ch.producers.move_to_end(producer)
            consumer_rid = next(iter(ch.requests))  # round robin over consumers too: one greedy one
            consumer = self.clients[consumer_rid]   # (4096 credits, never reading) does not starve others
            consumer.credits -= 1
            consumer.granted += 1
            if consumer.credits:
                ch.requests.move_to_end(consumer_rid)
            else:
                del ch.requests[consumer_rid]
            p = self.clients[producer]
            p.credits -= 1
            g = Grant(next(self._gids), producer, consumer_rid, name, issued=self._now)
            self.grants[g.gid] = g
            p.grants[g.gid] = None
            ch.grants[g.gid] = None
            grant = GrantMessage(g.gid, p.epoch, consumer.label)
            if p.endpoints_sent.get(consumer_rid) is not consumer.endpoint:
                # Once per pairing (per registration of either side), not per grant.
                p.endpoints_sent[consumer_rid] = consumer.endpoint
                grant.consumer = consumer.endpoint.to_dict()
            self._send(producer, grant)

    def _revoke_for_an_able_producer(self, name: str, ch: Channel, idle_since: float) -> bool:
        """No credit is queued on channel ``name``: revoke its oldest unused grant if it sat a
        heartbeat and a producer that is not passed over asks (True: match again); if it has not
        sat a heartbeat yet, look again when it will have (§4.3a)."""
        oldest = self.grants[next(iter(ch.grants))]
        if oldest.issued >= idle_since:  # scheduled whether or not a producer waits: no walk per handoff
            self._rechecks[name] = min(self._rechecks.get(name, math.inf), oldest.issued + self.heartbeat_s)
            return False
        if not any(self.clients[r].credits > 0 and len(self.clients[r].grants) < MAX_CREDITS
                   and not self._passed_over(self.clients[r], idle_since) for r in ch.producers):
            return False
        self._revoke(oldest)
        return True

    def _passed_over(self, p: Client, idle_since: float) -> bool:
        oldest = next(iter(p.grants), None)
        return p.revoked or (oldest is not None and self.grants[oldest].issued < idle_since)

    def _revoke(self, g: Grant) -> None:
        """Take back a grant its producer did not use (§4): REVOKE tells it; the consumer's credit
        goes back to the front; the producer is passed over until it hands off or asks again."""
        self.stats.grants_revoked += 1
        producer = self.clients.get(g.producer)
        if producer is not None:
            producer.revoked = True
            self._send(g.producer, Revoke([g.gid]))
        self._void_grant(g)

    # --- end of stream (spec §4.9) ------------------------------------------------------------
    def on_end(self, c: Client) -> None:
        """END: the producer sends no more handoffs. Its grants go back to their consumers (front
        of the queue) and its READY credits are void; releases still reach it. Idempotent."""
        if c.role != "producer":
            raise ProtocolError("wrong_role", "END is a producer's message")
        if c.ended:
            return
        c.ended = True
        self._return_grants(c)
        c.credits = 0
        self._note(logging.INFO, {"event": "end", "client": c.rid_text[:32], "channel": c.channel})
        ch = self._channel(c.channel)
        if all(self.clients[p].ended for p in ch.producers):
            self._set_stream(c.channel, True)
        self._match(c.channel)

    def _set_stream(self, name: str, ended: bool, told: bytes | None = None) -> None:
        """Set ``name``'s state (spec §4.9) and, when it changed, tell every consumer of the
        channel (CHANNEL_STATE) but ``told``, who said it already. Only three events call this:
        an END that leaves no registered producer un-ended, a producer registering without
        ``ended`` (a reopen), and a consumer registering with ``ended`` on a channel without an
        un-ended producer (a restarted broker learning the state). A producer that leaves, dies
        or re-registers saying it ended changes nothing: a crash never ends a stream, and nor
        does the order in which clients come back to a restarted broker."""
        ch = self._channel(name)
        if ended == ch.ended:
            return
        ch.ended = ended
        self._note(logging.INFO, {"event": "channel_ended" if ended else "channel_reopened", "channel": name})
        for c in self.clients.values():
            if c.role == "consumer" and c.channel == name and c.rid != told:
                self._send(c.rid, ChannelState(ended))

    # --- handoffs --------------------------------------------------------------------------
    def on_handoff(self, c: Client, msg: Handoff, now: float) -> None:
        if c.role != "producer":
            raise ProtocolError("wrong_role", "HANDOFF is a producer's message")
        if c.ended:
            raise ProtocolError("ended", "this producer ended its stream (END): it sends no more handoffs")
        gid, hid = msg.grant_id, msg.handoff_id
        ready = self._credit_count(msg.ready, "ready")
        if ready:
            try:
                self._add_ready(c, ready)  # before validation: a refused handoff still asked for more
            except ProtocolError as limit:  # answered on its own; the handoff goes on without it (§6a)
                self._error(c.rid, limit.code, str(limit), ref="HANDOFF", field="ready", credits=ready,
                            **limit.extra)
        g = self.grants.get(gid)
        if g is None or g.producer != c.rid:
            raise ProtocolError("unknown_grant", f"grant {gid} is not one this producer holds")
        self._unlist(g)  # a grant is used once, whatever the outcome
        c.revoked = False  # it hands off: no longer passed over
        consumer = self.clients.get(g.consumer)
        if consumer is None or g.consumer_gone:
            self.stats.rejected += 1
            raise ProtocolError("consumer_gone", f"the consumer of grant {gid} died before the handoff arrived")
        consumer.granted -= 1
        try:
            if (c.rid, hid) in self.by_handoff or (c.rid, hid) in self.orphans:
                raise ProtocolError("bad_header", f"handoff {hid} of this producer is still outstanding",
                                    field="handoff_id")
            try:
                handle = BufferHandle.decode(msg.handle)
            except HandleError as e:
                # The handle's own field and byte offset (buffer-handle.md), not a header field.
                raise ProtocolError("bad_handle", str(e), reason=e.reason, handle_field=e.field,
                                    handle_offset=e.offset, value=e.value if isinstance(e.value, int) else
                                    str(e.value)[:64]) from None
            self._check_handoff(c, consumer, msg, handle)
        except ProtocolError:
            # The consumer's request is not lost with a bad handoff: it goes back to the front,
            # and is matched at once (the producer's READY may already be waiting for it).
            self._queue_credits(consumer, 1, front=True)
            self.stats.rejected += 1
            self._match(g.channel)
            raise
        token = self.session + self._token()
        self._bind(Delivery(token, c.rid, g.consumer, hid, handle.sync_mode is SyncMode.EVENT, now))
        deliver = msg.deliver(token, c.rid_text)
        if deliver.keep and not consumer.kept_mappings:
            deliver.keep = False  # it would not read the flag: it closes its mapping at the release (§4.10)
        consumer.sent_keep = consumer.sent_keep or deliver.keep
        self._send(g.consumer, deliver)
        if msg.ack:  # acceptance is implicit (a refusal is an ERROR) unless asked for
            self._send(c.rid, Accepted(hid))
        self.stats.handoffs += 1

    def expected_modes(self, producer: Client, consumer: Client, handle: BufferHandle) -> Any:
        cpu = handle.device_tag is DeviceTag.CPU
        return self.modes.get(host_side(producer.endpoint) if cpu else producer.endpoint, consumer.endpoint)

    def _check_handoff(self, producer: Client, consumer: Client, msg: Handoff, handle: BufferHandle) -> None:
        """Spec §4.5, in this order: sync mode, transport payload, offset, meta."""
        pm = self.expected_modes(producer, consumer, handle)
        mode = handle.sync_mode
        if mode not in pm.valid:
            why = pm.reasons.get(mode) or "not valid for this pair"
            raise ProtocolError("mode_not_valid", f"{mode.wire_name} for a {handle.device_tag.name} buffer "
                                f"from {producer.endpoint.identity.spec} to {consumer.endpoint.identity.spec} "
                                f"over {pm.transport.value}: {why}")
        if pm.transport is Transport.NETWORK:  # no memory blob (shm, CUDA IPC) means anything on another host
            raise ProtocolError("payload_mismatch", f"the consumer is on host {consumer.endpoint.identity.host}, the "
                                f"producer on {producer.endpoint.identity.host}: no shared memory or CUDA IPC handle "
                                "reaches another host; carry the channel across machines with a bridge "
                                "(interchange.md)", field="endpoint.device.host")
        if msg.inproc != (pm.transport is Transport.IN_PROCESS):
            raise ProtocolError("payload_mismatch", "inproc flag does not match the endpoints' processes")
        if msg.keep and (msg.inproc or handle.device_tag is not DeviceTag.CUDA):
            raise ProtocolError("payload_mismatch", "'keep' is for an IPC handoff of a CUDA buffer only (§4.10)",
                                field="flags", value=0x40)
        if msg.inproc:
            if msg.memory is not None or msg.event is not None:
                raise ProtocolError("payload_mismatch", "an in-process handoff carries an inproc_ref and no blobs")
        else:
            if msg.memory is None:
                raise ProtocolError("payload_mismatch", "an IPC handoff needs the memory blob frame")
            if (mode is SyncMode.EVENT) != (msg.event is not None):
                raise ProtocolError("payload_mismatch", f"{mode.wire_name} "
                                    f"{'needs' if mode is SyncMode.EVENT else 'carries no'} event blob frame")
            offset = msg.offset
            if not 0 <= offset < 2**63:
                raise ProtocolError("bad_header", f"offset must be 0..2**63-1, got {offset}", field="offset",
                                    value=offset)
        check_meta(msg.meta, handle.size)

    # --- releases --------------------------------------------------------------------------
    def _named(self, c: Client, token: str) -> Delivery | None:
        """The delivery ``token`` names for consumer ``c``: a delivery (whoever holds it) or ``c``'s
        own provisional claim (§6); None when neither."""
        return self.deliveries.get(token) or self.claim_of.get((c.rid, token))

    def _delivery_of(self, c: Client, msg: Release | EventRelease) -> Delivery:
        if c.role != "consumer":
            raise ProtocolError("wrong_role", f"{msg.verb} is a consumer's message")
        token = msg.token
        d = self._named(c, token)
        if d is None:
            crossing = token if isinstance(msg, Release) else (token, "event")
            if token in self.released or (c.rid, token) in self.withdrawn:
                err = ProtocolError("already_released", f"token {token[:8]}... was already released")
            elif crossing in self.gone:
                err = ProtocolError("unknown_token", f"token {token[:8]}...'s producer is gone (PRODUCER_GONE)")
            else:
                raise ProtocolError("unknown_token", f"token {token[:8]}... is not one this broker issued")
            if crossing in self.gone:  # a RELEASE (or EVENT_RELEASE) that crossed PRODUCER_GONE: expected, once
                self.gone.discard(crossing)
                err.charge = False
            raise err
        if d.consumer != c.rid:
            raise ProtocolError("foreign_token", f"token {token[:8]}... was delivered to another consumer")
        return d

    def on_event_release(self, c: Client, msg: EventRelease) -> None:
        self._with_credits(c, msg, self._event_release)

    def _event_release(self, c: Client, msg: EventRelease) -> None:
        d = self._delivery_of(c, msg)
        if not d.event_pending:
            raise ProtocolError("already_released", "this handoff's event was already released (or it has none)")
        d.event_pending = False
        if d.producer in self.clients:
            self._send(d.producer, EventReleased(d.handoff_id))

    def on_release(self, c: Client, msg: Release) -> None:
        self._with_credits(c, msg, lambda c, m: self._release(self._delivery_of(c, m),
                                                               (m.reason or "released")[:200]))

    def _with_credits(self, c: Client, msg: Any, entry: Callable[[Client, Any], None]) -> None:
        """A RELEASE entry of either kind, then the REQUEST carried on it (a batch carries its
        credits on its last entry, whatever its kind and whatever became of it, spec §4): applied
        also when the entry is refused, since the consumer counts those credits as asked either
        way. Credits over a limit are not applied and answered on their own (§6a); after a refused
        entry only the entry's refusal is answered, and the dropped credits are logged."""
        credits = self._credit_count(msg.credits, "credits")
        try:
            entry(c, msg)
        except ProtocolError as refused:
            if credits and c.role == "consumer":
                try:
                    self._add_requests(c, credits)
                except ProtocolError as limit:
                    refused.extra["credits"] = credits  # not applied: its client asks for them again (§2)
                    self._note(logging.WARNING, {"event": "credits_refused", "client": c.rid_text[:32],
                                                 "why": str(limit)[:200]})
            raise
        if credits:
            try:
                self._add_requests(c, credits)
            except ProtocolError as limit:
                self._error(c.rid, limit.code, str(limit), ref="RELEASE", field="credits", credits=credits,
                            **limit.extra)

    def _fence_all(self, rid: bytes, ds: list[Delivery]) -> None:
        """Tell consumer ``rid`` PRODUCER_GONE ``fenced`` for ``ds``, first, then fence each (§5)."""
        self._send(rid, ProducerGone([d.token for d in ds], "fenced"))
        for d in ds:
            self._fence(d)

    def _fence(self, d: Delivery) -> None:
        """Unbind ``d`` from a consumer that may still read it: RELEASED ``consumer_fenced`` (and no
        EVENT_RELEASED, as its wait may not have been issued); remembered, so that a re-HELLO listing
        the token is told PRODUCER_GONE ``fenced`` again."""
        self.fenced.add(d.token)
        d.event_pending = False
        self._release(d, "consumer_fenced")

    def _fence_overdue(self, bound: float) -> None:
        """Fence every delivery bound before ``bound`` (held past ``hold_s``, spec §5): its consumer
        stays registered but is told PRODUCER_GONE ``fenced`` for it, first, and its producer gets
        RELEASED ``consumer_fenced`` and retires the buffer, since the consumer may still read it."""
        overdue: dict[bytes, list[Delivery]] = {}
        for d in self.deliveries.values():
            if d.since >= bound:
                break
            overdue.setdefault(d.consumer, []).append(d)
        for rid, ds in overdue.items():
            self.stats.holds_fenced += len(ds)
            for d in ds:
                # Its RELEASE (EVENT_RELEASE) crossing the PRODUCER_GONE is expected: refused, not charged (§6a).
                self.gone.add(d.token)
                if d.event_pending:
                    self.gone.add((d.token, "event"))
            self._fence_all(rid, ds)
            if rid in self.clients and rid not in self.benched:
                self._bench(self.clients[rid])
            self._note(logging.WARNING, {"event": "held_past_bound", "client": rid.decode(errors="replace")[:32],
                                         "fenced": len(ds), "hold_s": self.hold_s})

    def _bench(self, c: Client) -> None:
        """Consumer ``c`` held a delivery past the hold bound: grant none of its credits for a
        while (spec §5), or a consumer that keeps what it gets takes a producer's freed buffers
        again as soon as they come back. Its unused grants are revoked and their credits kept with
        its others, as for a choke (§1). The bench binds its process on its channel (``bench_of``,
        which later registrations there take up in :meth:`on_hello`) and lasts one hold bound, or
        twice the last one there if that was to end less than BENCH_MAX_HOLDS bounds ago, at most
        that many."""
        assert self.hold_s is not None
        span = BENCH_MAX_HOLDS * self.hold_s
        key = (c.process, c.channel)
        last = self.bench_of.get(key)
        wait = min(2 * last[0], span) if last is not None and self._now - last[1] < span else self.hold_s
        _remember(self.bench_of, key, (wait, self._now + wait), _GONE_LABELS)
        self.benched[c.rid] = self._now + wait
        self._set_aside(c)

    def _set_aside(self, c: Client) -> int:
        """Consumer ``c`` was just choked or benched: take its credits out of the queue and revoke
        the unused grants naming it, keeping their credits with its others (§1, §5); how many
        grants were revoked. The caller has already marked it, so nothing is queued again."""
        self._channel(c.channel).requests.pop(c.rid, None)
        revoked = self._revoke_naming(c)
        self._queue_credits(c, revoked)  # kept, not queued
        return revoked

    def _end_benches(self, now: float) -> None:
        """Queue the credits of every consumer whose bench is over (unless it is choked), all of
        them before any is matched, so that consumers benched together take turns (§4)."""
        ended = [rid for rid, until in self.benched.items() if now >= until]
        for rid in ended:
            del self.benched[rid]
            self._queue_credits(self.clients[rid], 0)
        for name in dict.fromkeys(self.clients[rid].channel for rid in ended):
            self._match(name)

    def _release(self, d: Delivery, reason: str) -> None:
        if self.claim_of.get((d.consumer, d.token)) is d:
            self._drop_claim(d)  # withdrawn before its producer decided: nothing to tell anyone
            self.withdrawn.add((d.consumer, d.token))
            return
        self._unbind(d)
        self.released.add(d.token)
        self.stats.releases += 1
        if d.producer in self.clients:
            if d.event_pending:
                self._send(d.producer, EventReleased(d.handoff_id, reason))
            self._send(d.producer, Released(d.handoff_id, reason))

    # --- capability queries ----------------------------------------------------------------
    def on_route(self, c: Client, msg: RouteMessage) -> None:
        """ROUTE {route: object | null}: the client's route across machines (spec §2.4), replacing
        the one it announced before; no reply. A refused one leaves the earlier route in place."""
        key = msg.key
        if key is None or not hmac.compare_digest(key.encode(), self.route_key.encode()):
            raise ProtocolError("not_authorized", "a ROUTE must carry the broker's route key ('key': the content "
                                "of the owner-only file <socket>.route-key): only the broker's user may announce "
                                "a bridge", field="key")
        if not msg.has_route:
            raise ProtocolError("bad_header", "ROUTE header lacks 'route' (an object, or null to withdraw)",
                                field="route")
        c.route = None if msg.route is None else Route.parse(msg.route, c.role)

    def on_caps(self, rid: bytes, msg: Caps) -> int:
        """CAPS -> CAPS_REPLY (queries.caps_reply); returns the answer's size (§6a)."""
        return self._send(rid, CapsReply(body=caps_reply(self, msg), request_id=msg.request_id))

    # --- observability (STATS, spec §2.3) ----------------------------------------------------
    def on_stats(self, rid: bytes, msg: StatsQuery, now: float) -> int:
        """STATS {request_id?} -> STATS_REPLY: the snapshot of :meth:`snapshot`; returns the
        answer's size (§6a)."""
        request_id = msg.request_id
        snap = self._snap
        if snap is None or not 0.0 <= now - self._snap_at < self.stats_cache_s:
            snap = self._snap = self.snapshot(now)
            self._snap_at = now
            self._snap_bytes = len(json_bytes(snap))
        # The reply's header is {"request_id":R,<the snapshot's fields>,"ticket":"<16 hex>"}: its
        # size without encoding the snapshot again (a STATS flood reuses one for 0.25 s).
        size = self._snap_bytes + len(json_bytes(request_id)) + len('"request_id":,,"ticket":""') + 16
        return self._send(rid, StatsReply(body=snap, request_id=request_id), size)

    def reads_bundles(self, rid: bytes) -> bool:
        """Whether the loop may send ``rid`` bundles (spec §2.2a): a client whose latest accepted
        HELLO said ``bundles``."""
        c = self.clients.get(rid)
        return c is not None and c.bundles

    def note_sent(self) -> None:
        """The loop sent one ZeroMQ message (a batch or a bundle counts one): ``totals.wire_out``."""
        self.stats.wire_out += 1

    def note_sweep(self, segments: int, removed: int) -> None:
        """The loop swept stale segments: ``segments`` of this uid remain, ``removed`` went."""
        self.stats.sweeps += 1
        self.stats.segments = segments
        self.stats.segments_cleaned += removed

    def snapshot(self, now: float) -> dict[str, Any]:
        """Everything STATS_REPLY says (spec §2.3) as of ``now`` (queries.stats_snapshot): a new
        dict, never mutated afterwards, that another thread may read (the metrics endpoint)."""
        return stats_snapshot(self, now)

    # --- leaving ---------------------------------------------------------------------------
    def _producer_gone(self, ds: list[Delivery], claims: list[Delivery] | None = None) -> None:
        """Unbind ``ds`` and tell their consumers, with those of ``claims`` (already dropped)."""
        by_consumer: dict[bytes, list[str]] = {}
        for d in ds:
            self._unbind(d)
            by_consumer.setdefault(d.consumer, []).append(d.token)
        for x in claims or []:
            by_consumer.setdefault(x.consumer, []).append(x.token)
        for rid, tokens in by_consumer.items():
            if rid in self.clients:
                for t in tokens:
                    self.gone.add(t)
                    self.gone.add((t, "event"))
                self._send(rid, ProducerGone(tokens))

    def _void_credits(self, c: Client) -> None:
        """Forget a client's queued credits and grants: a producer's grants give their consumers'
        credits back (front of the queue); grants *for* a consumer must go to another consumer
        (a HANDOFF on one is refused consumer_gone, and the producer sends it again)."""
        ch = self._channel(c.channel)
        ch.requests.pop(c.rid, None)
        ch.producers.pop(c.rid, None)
        self._return_grants(c)
        for g in self._grants_naming(c):
            g.consumer_gone = True
        c.credits = c.granted = 0

    def _return_grants(self, producer: Client) -> None:
        """Void ``producer``'s grants; each one's consumer gets its credit back, at the queue's front."""
        for gid in list(reversed(producer.grants)):
            self._void_grant(self.grants[gid])

    def _void_grant(self, g: Grant) -> None:
        """Forget grant ``g``; its consumer's credit goes back to the front of the queue."""
        self._unlist(g)
        consumer = self.clients.get(g.consumer)
        if consumer is not None and not g.consumer_gone:
            consumer.granted -= 1
            self._queue_credits(consumer, 1, front=True)

    def _unlist(self, g: Grant) -> None:
        """Remove grant ``g`` from the broker's grants and its producer's and channel's indexes. A
        producer at MAX_CREDITS unused grants was passed over (:meth:`_match`): with one fewer,
        its channel is matched again at the next tick."""
        del self.grants[g.gid]
        ch = self.channels.get(g.channel)
        if ch is not None:
            ch.grants.pop(g.gid, None)
        producer = self.clients.get(g.producer)
        if producer is not None:
            if len(producer.grants) == MAX_CREDITS and producer.credits:
                self._rechecks[g.channel] = min(self._rechecks.get(g.channel, math.inf), self._now)
            producer.grants.pop(g.gid, None)

    def _forget(self, c: Client) -> None:
        """Remove ``c``'s registration (credits, grants, channel membership, process count)."""
        self._void_credits(c)
        del self.clients[c.rid]
        if self.by_label.get(c.label) == c.rid:
            del self.by_label[c.label]
        _count_down(self.per_process, c.process)
        ch = self.channels.get(c.channel)
        if ch is not None:
            ch.members.pop(c.rid, None)
            if not ch.members and not ch.requests and not ch.producers and not ch.grants:
                del self.channels[c.channel]
        if c.unresponsive:
            self.stats.unresponsive -= 1

    def _drop(self, rid: bytes, why: str) -> None:
        c = self.clients.get(rid)
        if c is None:
            return
        self.choked.pop(rid, None)
        self.benched.pop(rid, None)
        if why == "process gone":  # no registration comes from it again; a new process may reuse its pid
            self.bench_of.pop((c.process, c.channel), None)
        self._note(logging.INFO, {"event": "client_gone", "client": rid.decode(errors="replace"), "role": c.role,
                                  "why": why, "pid": c.endpoint.pid})
        self._forget(c)
        if c.role == "consumer":
            self.stats.consumers_lost += why != "bye"
            # A BYE proves its mappings closed only when it held nothing: a delivery it still held
            # (taken and not released, a release waiting for its device work) may be mapped (§4.10).
            proven = why == "process gone" or (why == "bye" and not c.held)
            silent = not proven and not c.held  # a BYE it sends later proves what this could not
            self._unmap_left(c, proven, silent)
            if silent:
                _remember(self.left_unproven, rid, c.sent_keep, _GONE_LABELS)
            for x in [x for x in self.claim_of.values() if x.consumer == rid]:
                self._drop_claim(x)
            held = list(self.held_by.get(rid, {}).values())
            # Gone only when proven (its lease or pid, or its BYE); otherwise it may still read
            # what it holds: fenced (spec §5), and its producers retire those buffers.
            if why in ("bye", "process gone") or not held:
                for d in held:
                    self._release(d, "consumer_gone")
            else:
                self.stats.consumers_fenced += 1
                self._fence_all(rid, held)
        else:
            self.stats.producers_lost += why != "bye"
            for key in [k for k, r in self.unmaps.items() if r.producer == rid]:
                self._close_round(key, answer=False)
            self._producer_gone(list(self.handed_by.get(rid, {}).values()))
            self.orphans = {k: v for k, v in self.orphans.items() if k[0] != rid}
            self._match(c.channel)
        if why != "bye" and c.endpoint.identity.host == self.host:
            self._out.append(CleanSegments())

    # --- kept mappings (spec §4.10) ----------------------------------------------------------
    def on_unmap(self, c: Client, msg: Unmap) -> None:
        """A producer is about to free an allocation it sent with ``keep``: ask each consumer it
        names that is registered here and keeps mappings, answer for those proven gone or that
        never keep one, and call the rest fenced."""
        if msg.consumers is None:  # fields before role (§8)
            raise ProtocolError("bad_header", "UNMAP header lacks 'consumers'", field="consumers")
        if c.role != "producer":
            raise ProtocolError("wrong_role", "UNMAP is a producer's message")
        key = (c.rid_text, msg.request)
        if key in self.unmaps:
            raise ProtocolError("bad_header", f"UNMAP {msg.request} of this producer is still open", field="request",
                                value=msg.request)
        if self.unmaps_of.get(c.rid, 0) >= MAX_UNMAPS:
            self._limit(f"a producer may have at most {MAX_UNMAPS} UNMAPs unanswered", "unmaps", MAX_UNMAPS + 1)
        r = UnmapRound(c.rid, msg.request, msg.memory, until=self._now + self.timeout_s)
        self.unmaps[key] = r
        self.unmaps_of[c.rid] = self.unmaps_of.get(c.rid, 0) + 1
        for label in msg.consumers:
            rid = self.by_label.get(label)
            if rid is not None:
                self._ask(key, r, self.clients[rid])
            elif label in self.gone_labels:
                r.gone.append(label)
            else:
                # Never registered here (a consumer of a broker that restarted), or left without
                # proof (§5): it may register yet, and is asked then; fenced when the time runs out.
                self._await_unseen(key, r, label)  # or fenced at once, past MAX_UNSEEN
        if r.unseen:
            self.unseen_rounds[key] = None
        self._close_if_over(key, r)

    def _await_unseen(self, key: tuple[str, int], r: UnmapRound, label: str) -> bool:
        """Round ``key`` awaits ``label`` unregistered until ``r.until`` (True), or, past the
        producer's :data:`MAX_UNSEEN`, counts it fenced at once (False); the caller keeps
        ``unseen_rounds`` in order."""
        if self.unseen_of.get(r.producer, 0) >= MAX_UNSEEN:
            r.fenced.append(label)
            return False
        r.unseen[label] = None
        self.unseen_in.setdefault(label, set()).add(key)
        self.unseen_of[r.producer] = self.unseen_of.get(r.producer, 0) + 1
        return True

    def _ask(self, key: tuple[str, int], r: UnmapRound, c: Client) -> None:
        """Ask registered consumer ``c`` in round ``key``, or answer for it when it does not
        answer UNMAP: sent no ``keep`` here, it closed at each release; sent some before it
        withdrew kept_mappings, it may still keep a mapping."""
        if not c.kept_mappings:
            (r.fenced if c.sent_keep else r.unmapped).append(c.label)
            return
        r.waiting.add(c.rid)
        self.awaited_in.setdefault(c.rid, set()).add(key)
        self._send(c.rid, Unmap(r.request, r.memory, producer_id=key[0]))

    def _registered(self, c: Client) -> None:
        """Consumer ``c`` registered: each round that awaited its label unregistered asks it now."""
        for key in sorted(self.unseen_in.get(c.label, ())):
            r = self.unmaps[key]
            self._unseen_done(key, r, c.label)
            self._ask(key, r, c)
            self._close_if_over(key, r)

    def _unseen_done(self, key: tuple[str, int], r: UnmapRound, label: str) -> None:
        """``label`` is no longer awaited unregistered in round ``key``."""
        _unindex(self.unseen_in, label, key)
        del r.unseen[label]
        _count_down(self.unseen_of, r.producer)
        if not r.unseen:
            self.unseen_rounds.pop(key, None)

    def _unseen_expired(self, now: float) -> None:
        """Labels still unregistered when their round's time ran out are fenced."""
        while self.unseen_rounds:
            key = next(iter(self.unseen_rounds))
            r = self.unmaps[key]
            if now < r.until:
                return
            for label in list(r.unseen):
                self._unseen_done(key, r, label)
                r.fenced.append(label)
            self._close_if_over(key, r)

    def on_unmapped(self, c: Client, msg: Unmapped) -> None:
        """A consumer closed its mapping for an UNMAP (or had none). One it is not awaited in
        (it crossed its producer's departure, or it answers twice) changes nothing."""
        if msg.producer_id is None:  # fields before role (§8)
            raise ProtocolError("bad_header", "UNMAPPED header lacks 'producer_id'", field="producer_id")
        if c.role != "consumer":
            raise ProtocolError("wrong_role", "UNMAPPED is a consumer's message")
        key = (msg.producer_id, msg.request)
        r = self.unmaps.get(key)
        if r is None or c.rid not in r.waiting:
            return
        self._settle(key, r, c.rid, r.unmapped, c.label)

    def _settle(self, key: tuple[str, int], r: UnmapRound, rid: bytes, into: list[str], label: str) -> None:
        """``rid`` is no longer awaited in round ``key``: its ``label`` goes to ``into`` (one of
        the round's lists), and the round ends when nobody is awaited any more."""
        self._answered(key, r, rid)
        into.append(label)
        self._close_if_over(key, r)

    def _answered(self, key: tuple[str, int], r: UnmapRound, rid: bytes) -> None:
        r.waiting.discard(rid)
        _unindex(self.awaited_in, rid, key)

    def _bye_after_drop(self, rid: bytes) -> None:
        """A BYE from ``rid``, not registered: when it is a consumer deregistered without proof
        while it held no delivery (silent), it closed every idle kept mapping before this BYE
        (§4.10 step 2) and can have opened none since (nothing is delivered to an unregistered
        routing id), so its label is gone: remembered as such, and counted gone in each round
        that awaits it unregistered. Any other unregistered BYE changes nothing (§2)."""
        if rid not in self.left_unproven:
            return
        del self.left_unproven[rid]
        label = self.label_of(rid)
        _remember(self.gone_labels, label, None, _GONE_LABELS)
        for key in sorted(self.unseen_in.get(label, ())):
            r = self.unmaps[key]
            self._unseen_done(key, r, label)
            r.gone.append(label)
            self._close_if_over(key, r)

    def _unmap_left(self, c: Client, proven: bool, silent: bool) -> None:
        """Consumer ``c`` left, in every round that awaited it: gone (it closed its mappings
        before its BYE, or its process exited) when ``proven``; when ``silent`` (deregistered
        without proof while it held nothing, so a BYE or a HELLO of its own may still come), awaited
        unregistered for ``timeout_s`` from now, as if each round had named it unregistered now;
        else fenced (it may read what it held)."""
        if proven:
            _remember(self.gone_labels, c.label, None, _GONE_LABELS)
        for key in sorted(self.awaited_in.get(c.rid, ())):
            r = self.unmaps[key]
            if not silent:
                self._settle(key, r, c.rid, r.gone if proven else r.fenced, c.label)
                continue
            self._answered(key, r, c.rid)
            if self._await_unseen(key, r, c.label):  # the latest deadline of all: moved to the end
                r.until = self._now + self.timeout_s
                self.unseen_rounds.pop(key, None)
                self.unseen_rounds[key] = None
            self._close_if_over(key, r)

    def _close_if_over(self, key: tuple[str, int], r: UnmapRound) -> None:
        """Answer the producer and close round ``key`` once it awaits nobody, registered or not."""
        if not r.waiting and not r.unseen:
            self._close_round(key, answer=True)

    def _close_round(self, key: tuple[str, int], answer: bool) -> None:
        r = self.unmaps.pop(key)
        _count_down(self.unmaps_of, r.producer)
        for rid in list(r.waiting):
            self._answered(key, r, rid)
        for label in list(r.unseen):  # its producer left
            self._unseen_done(key, r, label)
        if answer:
            self._send(r.producer, Unmapped(r.request, unmapped=r.unmapped, gone=r.gone, fenced=r.fenced))

    # --- invariants ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (see the module docstring)."""
        assert len(self._newcomers) <= MAX_NEWCOMERS, "newcomers past their bound"
        for name, ch in self.channels.items():
            for rid in ch.producers:
                assert rid in self.clients and self.clients[rid].role == "producer", f"{name}: stray producer"
            for rid in ch.requests:
                c = self.clients.get(rid)
                assert c is not None and c.channel == name and c.role == "consumer", f"{name}: request of a stranger"
                assert c.credits > 0, f"{rid!r} queued with no credit"
        assert sum(len(ch.members) for ch in self.channels.values()) == len(self.clients), "channel members: count"
        for rid in [*self.choked, *self.benched]:
            assert rid in self.clients and self.clients[rid].role == "consumer", f"{rid!r}: set aside, no consumer"
        granted: dict[bytes, int] = {}
        for g in self.grants.values():
            if not g.consumer_gone:
                granted[g.consumer] = granted.get(g.consumer, 0) + 1
        for c in self.clients.values():
            assert c.credits >= 0 and c.granted == granted.get(c.rid, 0), f"credits or grants miscounted: {c}"
            if c.role == "consumer":
                assert c.held + c.credits + c.granted <= MAX_HELD, f"credits out of range: {c}"
            else:
                assert c.credits <= MAX_CREDITS and len(c.grants) <= MAX_CREDITS, f"credits out of range: {c}"
            assert c.channel in self.channels, f"{c.rid!r}: channel {c.channel!r} missing"
            assert c.rid in self.channels[c.channel].members, f"{c.rid!r}: not a member of {c.channel!r}"
            if c.role == "consumer":
                set_aside = c.rid in self.choked or c.rid in self.benched
                assert (c.credits > 0 and not set_aside) == (c.rid in self.channels[c.channel].requests), \
                    f"{c.rid!r}: credits unqueued, or queued while choked or benched"
            assert all(self.grants.get(gid) is not None and self.grants[gid].producer == c.rid for gid in c.grants), \
                f"{c.rid!r}: grant index stale"
            assert 0 <= c.held <= MAX_HELD, f"{c.rid!r} holds {c.held}"
        held: dict[bytes, int] = {}
        since = -math.inf
        for token, d in self.deliveries.items():
            assert token == d.token and token not in self.released, f"token {token} both live and released"
            assert d.since >= since, f"{token}: bound before the delivery bound ahead of it (the hold bound's order)"
            since = d.since
            assert d.consumer in self.clients and self.clients[d.consumer].role == "consumer", \
                f"delivery {token} owned by no registered consumer"
            assert self.by_handoff.get((d.producer, d.handoff_id)) == token, f"{token}: handoff index stale"
            held[d.consumer] = held.get(d.consumer, 0) + 1
        claims = [x for by_hid in self.claims.values() for xs in by_hid.values() for x in xs]
        assert len(claims) == len(self.claim_of), "claim index stale"
        for x in claims:
            assert self.claim_of.get((x.consumer, x.token)) is x, f"claim {x.token} not indexed"
            assert not self._is_producer(x.producer), f"claim {x.token}: its producer is registered, yet undecided"
            assert (x.producer, x.handoff_id) not in self.by_handoff, f"claim {x.token} to a handoff held here"
            assert x.consumer in self.clients and self.clients[x.consumer].role == "consumer", f"stray claim {x.token}"
            held[x.consumer] = held.get(x.consumer, 0) + 1
        for by_hid in self.claims.values():
            for xs in by_hid.values():
                assert xs and len({x.consumer for x in xs}) == len(xs), "a consumer claims a handoff twice"
        assert len(self.by_handoff) == len(self.deliveries), "one handoff delivered twice"
        for index, side in ((self.held_by, "consumer"), (self.handed_by, "producer")):
            assert sum(map(len, index.values())) == len(self.deliveries), f"deliveries by {side}: count"
            for rid, mine in index.items():
                assert mine and all(self.deliveries.get(t) is d and getattr(d, side) == rid for t, d in mine.items()), \
                    f"deliveries by {side} {rid!r}: stale"
        for c in self.clients.values():
            assert c.held == held.get(c.rid, 0), f"{c.rid!r}: held {c.held} != {held.get(c.rid, 0)}"
        assert sum(len(c.grants) for c in self.clients.values()) == len(self.grants), "grant index: count"
        assert sum(len(ch.grants) for ch in self.channels.values()) == len(self.grants), "channel grants: count"
        for name, ch in self.channels.items():
            assert all(self.grants[gid].channel == name for gid in ch.grants), f"{name}: grant index stale"
        issued = [g.issued for g in self.grants.values()]
        assert issued == sorted(issued), "grants out of issue order"
        for g in self.grants.values():
            assert g.producer in self.clients, f"grant {g.gid} of a gone producer"
            assert not self.clients[g.producer].ended, f"grant {g.gid} held by an ended producer"
        for name, ch in self.channels.items():  # end of stream (spec §4.9)
            live = [p for p in ch.producers if not self.clients[p].ended]
            assert not (ch.ended and live), f"{name}: ended, yet producers {live!r} have not"
        for c in self.clients.values():
            assert not (c.ended and c.credits), f"{c.rid!r}: ended with {c.credits} READY credits"
        assert sum(self.per_process.values()) == len(self.clients)
        for key, r in self.unmaps.items():  # kept mappings (§4.10)
            assert r.producer in self.clients and self.clients[r.producer].rid_text == key[0], f"UNMAP {key}: producer"
            assert r.waiting or r.unseen, f"UNMAP {key} awaits nobody, yet is open"
            for label in r.unseen:
                assert label not in self.by_label, f"UNMAP {key}: {label} registered, yet awaited unregistered"
                assert key in self.unseen_in.get(label, ()), f"UNMAP {key}: unseen index stale"
            assert (key in self.unseen_rounds) == bool(r.unseen), f"UNMAP {key}: unseen rounds stale"
            for rid in r.waiting:
                assert rid in self.clients and self.clients[rid].role == "consumer", f"UNMAP {key}: stray consumer"
                assert key in self.awaited_in.get(rid, ()), f"UNMAP {key}: index stale"
        assert sum(map(len, self.awaited_in.values())) == sum(len(r.waiting) for r in self.unmaps.values())
        assert sum(self.unmaps_of.values()) == len(self.unmaps), "UNMAP count per producer"
        assert sum(map(len, self.unseen_in.values())) == sum(len(r.unseen) for r in self.unmaps.values())
        unseen_of: dict[bytes, int] = {}
        for r in self.unmaps.values():
            if r.unseen:
                unseen_of[r.producer] = unseen_of.get(r.producer, 0) + len(r.unseen)
        assert self.unseen_of == unseen_of, "unregistered labels per producer"
        assert all(n <= MAX_UNSEEN for n in unseen_of.values()), "unregistered labels past the limit"
        assert not any(rid in self.clients for rid in self.left_unproven), "a registered client left unproven"
        untils = [self.unmaps[k].until for k in self.unseen_rounds]
        assert untils == sorted(untils), "unseen rounds out of order"
        assert self.by_label == {c.label: c.rid for c in self.clients.values() if c.role == "consumer"}, "label index"
        assert self.stats.unresponsive == sum(c.unresponsive for c in self.clients.values())
