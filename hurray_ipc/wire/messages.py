"""The IPC protocol's JSON verbs, typed (docs/spec/ipc-protocol.md §2).

:func:`hurray_ipc.wire.ipc.decode_all` reads a message's frames: a JSON verb becomes a
:class:`~hurray_ipc.wire.ipc.Message` (verb, header object, frames). :func:`parse` turns that into
one of the classes here, checking every field the spec gives the verb, once: a handler gets
fields of the right type and range and never looks one up by name. A fault raises
``ProtocolError("bad_header")`` naming the field (``wire.fields``); the receiver decides when to
parse (the broker: after the registration check, and for CAPS and STATS after the query
ledger, spec §6a, because a refusal of a query is an answer too).

What the codec cannot judge stays with the receiver: a HELLO's ``endpoint``, a ROUTE's ``route``
and a CAPS's ``device`` / ``peer`` are checked JSON objects here and parsed by their owners
(``transport.pairing.Endpoint.from_dict``, ``transport.route.Route.parse``), which sit above this
layer; a ``lease`` name is judged by ``transport.liveness``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from .fields import ABSENT, FieldError, check, is_label
from .ipc import BLOB_SIZE, PROTOCOL_VERSION, HotMessage, Message, ProtocolError

__all__ = [
    "MAX_CREDITS", "MAX_HELD", "MAX_OUTSTANDING_CLAIMS", "MAX_UNMAPS", "AnyMessage", "Bye", "Caps", "CapsReply",
    "ChannelState", "End", "Error", "HeldClaim", "Hello", "JsonMessage", "Ping", "Pong", "ProducerGone", "Ready",
    "Request", "Revoke", "Route", "Shutdown", "Stats", "StatsReply", "Unmap", "Unmapped", "Welcome", "echoable",
    "parse",
]

MAX_CREDITS = 4096  # credits one REQUEST, READY or batch header asks for (spec §2: 1-4096)
MAX_HELD = 2 * MAX_CREDITS  # deliveries a re-registering consumer may list (and one consumer may hold)
MAX_OUTSTANDING_CLAIMS = MAX_CREDITS  # handoffs a re-registering producer may list
MAX_CHANNEL = 256  # characters of a channel name
MAX_NAME = 128  # characters of a client's name kept
MAX_UNMAP_CONSUMERS = 4096  # labels one UNMAP names (spec §4.10)
MAX_UNMAPS = 1024  # UNMAPs of one producer not yet answered (spec §6a)


def echoable(v: Any) -> bool:
    """Whether an ERROR may echo ``v`` as a ``request_id``, ``token`` or ``handoff_id`` (§2): a
    string of at most 64 characters or a 64-bit integer. A longer one would let a peer make
    every refusal as large as its header."""
    return (isinstance(v, str) and len(v) <= 64) or (type(v) is int and -(1 << 63) <= v < 1 << 63)


def _field(m: Message, name: str, kinds: type | tuple[type, ...], default: Any = ABSENT, **bounds: Any) -> Any:
    """Header field ``name`` of ``m``, strictly of ``kinds`` and within ``bounds``; a null field
    counts as absent (``default``, or ERROR "lacks" when there is none)."""
    v = m.header.get(name)
    if v is None:
        if default is ABSENT:
            raise ProtocolError("bad_header", f"{m.verb} header lacks '{name}'", field=name)
        return default
    try:
        return check(v, name, kinds, **bounds)
    except FieldError as e:
        raise ProtocolError("bad_header", f"{m.verb} header: {e}", field=name) from None


def _request_id(m: Message) -> str | int | None:
    v = m.header.get("request_id")
    if v is not None and not echoable(v):
        raise ProtocolError("bad_header", "request_id must be a string of at most 64 characters or a 64-bit "
                            "integer", field="request_id")
    return v


class JsonMessage:
    """A typed message of a JSON verb: :meth:`parse` from a decoded Message, :meth:`fields` its
    header, :meth:`encode` its frames."""

    __slots__ = ()
    verb: ClassVar[str]

    @classmethod
    def parse(cls, m: Message) -> Any:
        """The typed message of ``m`` (a Message of this verb), its fields checked."""
        return cls()

    def fields(self) -> dict[str, Any]:
        """The header as the spec names its fields."""
        return {}

    def blobs(self) -> dict[str, bytes]:
        return {}

    def encode(self) -> list[bytes]:
        return Message(self.verb, self.fields()).encode()


AnyMessage = Message | HotMessage | JsonMessage  # what a client and the broker send and handle

_T = TypeVar("_T", bound=JsonMessage)
_TYPES: dict[str, type[JsonMessage]] = {}


def _verb(cls: type[_T]) -> type[_T]:
    _TYPES[cls.verb] = cls
    return cls


def parse(m: Message) -> JsonMessage:
    """The typed form of JSON message ``m``; ProtocolError ``bad_header`` naming the field at fault."""
    typed: JsonMessage = _TYPES[m.verb].parse(m)
    return typed


# --- client -> broker ------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class HeldClaim:
    """An entry of a re-registering consumer's ``held`` (spec §6): a delivery it still holds."""

    token: str
    producer_id: str | None = None  # with handoff_id: the claim, for a token of an earlier broker
    handoff_id: int | None = None
    event_pending: bool = False

    def fields(self) -> dict[str, Any]:
        return {"token": self.token, "producer_id": self.producer_id, "handoff_id": self.handoff_id,
                "event_pending": self.event_pending}

    @staticmethod
    def read(item: Any) -> HeldClaim | None:
        """An entry as sent; None for one that names no token (ignored, spec §6)."""
        if not isinstance(item, dict) or not isinstance(item.get("token"), str):
            return None
        prod, hid = item.get("producer_id"), item.get("handoff_id")
        ok = isinstance(prod, str) and type(hid) is int and 0 <= hid < 2**64
        return HeldClaim(item["token"], prod if ok else None, hid if ok else None, bool(item.get("event_pending")))


def _outstanding(m: Message) -> dict[int, str | None]:
    """A producer HELLO's ``outstanding``: handoff ids, or {handoff_id, consumer_id} objects."""
    raw = m.header.get("outstanding")
    if raw is None:
        return {}
    if not isinstance(raw, list) or len(raw) > MAX_OUTSTANDING_CLAIMS:
        raise ProtocolError("bad_header", f"outstanding must be a list of at most {MAX_OUTSTANDING_CLAIMS} entries",
                            field="outstanding")
    out: dict[int, str | None] = {}
    for item in raw:
        hid, label = (item.get("handoff_id"), item.get("consumer_id")) if isinstance(item, dict) else (item, None)
        if type(hid) is not int or not 0 <= hid < 2**64 or not (label is None or isinstance(label, str)):
            raise ProtocolError("bad_header", f"outstanding entry {str(item)[:64]} is not a handoff id or "
                                "{handoff_id, consumer_id}", field="outstanding")
        out[hid] = label
    return out


@_verb
@dataclass(slots=True, kw_only=True)
class Hello(JsonMessage):
    """HELLO: register as ``role`` on ``channel`` (spec §2, §6). ``protocol`` is checked first: a
    client of another version is told ``protocol_version`` whatever else its HELLO holds."""

    verb: ClassVar[str] = "HELLO"
    role: str  # "producer" or "consumer"
    channel: str
    endpoint: dict[str, Any]  # spec §3: transport.pairing.Endpoint.from_dict
    protocol: int = PROTOCOL_VERSION
    client_id: str | None = None  # informative (a client is its routing id)
    pid: int | None = None  # informative
    name: str = ""
    credits: int = 0
    epoch: int = 0
    ended: bool = False
    lease: str | None = None  # a lease name (transport.liveness)
    outstanding: dict[int, str | None] = field(default_factory=dict)  # producer: handoff id -> consumer label
    held: list[HeldClaim] = field(default_factory=list)  # consumer
    bundles: bool = False  # it reads several hot messages in one ZeroMQ message (spec §2.2a)
    kept_mappings: bool = False  # consumer: it reads ``keep`` and answers UNMAP (spec §4.10)

    @classmethod
    def parse(cls, m: Message) -> Hello:
        version = _field(m, "protocol", int)
        if version != PROTOCOL_VERSION:
            raise ProtocolError("protocol_version", f"this broker speaks protocol {PROTOCOL_VERSION}, not {version}")
        role = _field(m, "role", str)
        if role not in ("producer", "consumer"):
            raise ProtocolError("bad_header", f"role must be 'producer' or 'consumer', not {role!r}", field="role")
        channel = _field(m, "channel", str)
        if not 1 <= len(channel) <= MAX_CHANNEL:
            raise ProtocolError("bad_header", f"channel must be a non-empty string of at most {MAX_CHANNEL} "
                                "characters", field="channel")
        endpoint = _field(m, "endpoint", dict)
        credits = _field(m, "credits", int, 0)
        if not 0 <= credits <= MAX_CREDITS:
            raise ProtocolError("bad_header", f"credits must be 0..{MAX_CREDITS}, got {credits}", field="credits")
        epoch = _field(m, "epoch", int, 0)
        ended = _field(m, "ended", bool, False)
        lease = _field(m, "lease", str, None)
        bundles = _field(m, "bundles", bool, False)
        kept_mappings = _field(m, "kept_mappings", bool, False)
        outstanding = _outstanding(m) if role == "producer" else {}
        held = m.header.get("held") or []
        if not isinstance(held, list) or len(held) > MAX_HELD:
            raise ProtocolError("bad_header", f"held must be a list of at most {MAX_HELD} entries", field="held",
                                value=len(held) if isinstance(held, list) else type(held).__name__)
        client_id, pid = m.header.get("client_id"), m.header.get("pid")
        return cls(role=role, channel=channel, endpoint=endpoint, client_id=client_id if isinstance(client_id, str)
                   else None, pid=pid if type(pid) is int else None, name=str(m.header.get("name", ""))[:MAX_NAME],
                   credits=credits, epoch=epoch, ended=ended, lease=lease, outstanding=outstanding, bundles=bundles,
                   kept_mappings=kept_mappings,
                   held=[c for c in map(HeldClaim.read, held) if c is not None] if role == "consumer" else [])

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"protocol": self.protocol, "role": self.role, "channel": self.channel}
        if self.client_id is not None:
            out["client_id"] = self.client_id
        if self.pid is not None:
            out["pid"] = self.pid
        out.update({"epoch": self.epoch, "name": self.name, "endpoint": self.endpoint, "credits": self.credits})
        if self.lease is not None:
            out["lease"] = self.lease
        if self.ended:
            out["ended"] = True
        if self.bundles:
            out["bundles"] = True
        if self.kept_mappings:
            out["kept_mappings"] = True
        if self.role == "producer":
            out["outstanding"] = [{"handoff_id": h, "consumer_id": c} for h, c in self.outstanding.items()]
        else:
            out["held"] = [c.fields() for c in self.held]
        return out


@_verb
@dataclass(slots=True)
class Ping(JsonMessage):
    """PING: a heartbeat; answered PONG."""

    verb: ClassVar[str] = "PING"


@_verb
@dataclass(slots=True)
class Bye(JsonMessage):
    """BYE: the client leaves; what it holds is released for it."""

    verb: ClassVar[str] = "BYE"


@_verb
@dataclass(slots=True)
class End(JsonMessage):
    """END: a producer sends nothing more on its channel (spec §4.9)."""

    verb: ClassVar[str] = "END"


@dataclass(slots=True)
class _Credits(JsonMessage):
    credits: int

    @classmethod
    def parse(cls, m: Message) -> Any:
        return cls(_field(m, "credits", int, lo=1, hi=MAX_CREDITS))

    def fields(self) -> dict[str, Any]:
        return {"credits": self.credits}


@_verb
@dataclass(slots=True)
class Request(_Credits):
    """REQUEST: a consumer asks for ``credits`` more deliveries."""

    verb: ClassVar[str] = "REQUEST"


@_verb
@dataclass(slots=True)
class Ready(_Credits):
    """READY: a producer asks for ``credits`` more grants."""

    verb: ClassVar[str] = "READY"


@_verb
@dataclass(slots=True)
class Route(JsonMessage):
    """ROUTE: a bridge's route across machines (spec §2.4), or None to withdraw it, announced
    with the broker's route ``key`` (None when absent or not a string: the broker refuses it
    ``not_authorized`` before looking at the route)."""

    verb: ClassVar[str] = "ROUTE"
    key: str | None
    route: dict[str, Any] | None  # transport.route.Route.parse
    has_route: bool = True  # False: the ROUTE has no 'route' field (refused once the key is judged)

    @classmethod
    def parse(cls, m: Message) -> Route:
        key = m.header.get("key")
        key = key if isinstance(key, str) else None
        if "route" not in m.header:
            return cls(key, None, False)
        return cls(key, _field(m, "route", dict, None))

    def fields(self) -> dict[str, Any]:
        return {"route": self.route, "key": self.key}


@dataclass(slots=True, kw_only=True)
class _Query(JsonMessage):
    request_id: str | int | None = None  # echoed in the answer
    ticket: str | None = None  # the latest answer this connection read (§6a)

    def _query_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"request_id": self.request_id}
        if self.ticket is not None:
            out["ticket"] = self.ticket
        return out


def _ticket(m: Message) -> str | None:
    ticket: str | None = _field(m, "ticket", str, None)
    return ticket


@_verb
@dataclass(slots=True, kw_only=True)
class Stats(_Query):
    """STATS: the broker's counters and clients (spec §2.3); answered STATS_REPLY."""

    verb: ClassVar[str] = "STATS"

    @classmethod
    def parse(cls, m: Message) -> Stats:
        return cls(ticket=_ticket(m), request_id=_request_id(m))

    def fields(self) -> dict[str, Any]:
        return self._query_fields()


@_verb
@dataclass(slots=True, kw_only=True)
class Caps(_Query):
    """CAPS: the sync modes valid from ``device`` to ``peer``, or to the consumers of
    ``channel`` (spec §2); answered CAPS_REPLY."""

    verb: ClassVar[str] = "CAPS"
    device: dict[str, Any]  # an endpoint (§3)
    peer: dict[str, Any] | None = None
    channel: str | None = None  # a channel name; anything else is ignored
    transport: str | None = None  # "in-process" / "ipc" / "network" (contract.sync.Transport)

    @classmethod
    def parse(cls, m: Message) -> Caps:
        ticket, request_id = _ticket(m), _request_id(m)
        try:
            device = _field(m, "device", dict)
            peer = _field(m, "peer", dict, None)
        except ProtocolError as e:
            raise ProtocolError("bad_header", f"CAPS endpoint: {e}", field="device", request_id=request_id) from None
        try:
            transport = _field(m, "transport", str, None)
        except ProtocolError as e:
            e.extra["request_id"] = request_id
            raise
        channel = m.header.get("channel")
        return cls(ticket=ticket, request_id=request_id, device=device, peer=peer,
                   channel=channel if isinstance(channel, str) else None, transport=transport)

    def fields(self) -> dict[str, Any]:
        out = {**self._query_fields(), "device": self.device}
        for k in ("peer", "channel", "transport"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out


# --- broker -> client ------------------------------------------------------------------------


@_verb
@dataclass(slots=True, kw_only=True)
class Welcome(JsonMessage):
    """WELCOME: registered; the broker's ``session`` prefixes every token it issues."""

    verb: ClassVar[str] = "WELCOME"
    session: str
    heartbeat_ms: int
    timeout_ms: int
    fence_ms: int
    protocol: int = PROTOCOL_VERSION
    kept_mappings: bool = False  # the broker carries ``keep`` and UNMAP rounds (spec §4.10)
    hold_ms: int = 0  # a delivery held this long is fenced (spec §5); 0: no bound (absent on the wire)

    @classmethod
    def parse(cls, m: Message) -> Welcome:
        return cls(protocol=_field(m, "protocol", int), session=_field(m, "session", str),
                   heartbeat_ms=_field(m, "heartbeat_ms", int), timeout_ms=_field(m, "timeout_ms", int),
                   fence_ms=_field(m, "fence_ms", int, 0), kept_mappings=_field(m, "kept_mappings", bool, False),
                   hold_ms=_field(m, "hold_ms", int, 0, lo=1, hi=(1 << 63) - 1))

    def fields(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "session": self.session, "heartbeat_ms": self.heartbeat_ms,
                "timeout_ms": self.timeout_ms, "fence_ms": self.fence_ms,
                **({"kept_mappings": True} if self.kept_mappings else {}),
                **({"hold_ms": self.hold_ms} if self.hold_ms else {})}


@_verb
@dataclass(slots=True)
class Pong(JsonMessage):
    """PONG: a heartbeat's answer (also sent unasked to a connection with unread answers, §6a)."""

    verb: ClassVar[str] = "PONG"


@dataclass(slots=True, kw_only=True)
class _Reply(JsonMessage):
    body: dict[str, Any]  # the answer's fields (spec §2, §2.3) but request_id and ticket
    request_id: str | int | None = None
    ticket: str | None = None

    @classmethod
    def parse(cls, m: Message) -> Any:
        body = {k: v for k, v in m.header.items() if k not in ("request_id", "ticket")}
        ticket = m.header.get("ticket")
        return cls(body=body, request_id=m.header.get("request_id"),
                   ticket=ticket if isinstance(ticket, str) else None)

    def fields(self) -> dict[str, Any]:
        return {"request_id": self.request_id, **self.body, **({"ticket": self.ticket} if self.ticket else {})}


@_verb
@dataclass(slots=True, kw_only=True)
class CapsReply(_Reply):
    """CAPS_REPLY: the modes valid for the pair(s) a CAPS named."""

    verb: ClassVar[str] = "CAPS_REPLY"


@_verb
@dataclass(slots=True, kw_only=True)
class StatsReply(_Reply):
    """STATS_REPLY: the broker's snapshot (spec §2.3)."""

    verb: ClassVar[str] = "STATS_REPLY"


@_verb
@dataclass(slots=True)
class ProducerGone(JsonMessage):
    """PRODUCER_GONE: the buffers of ``tokens`` went back to their producer; stop using them.
    ``reason``: None (the producer left), "reclaimed" (§6) or "fenced" (§5)."""

    verb: ClassVar[str] = "PRODUCER_GONE"
    tokens: list[str]
    reason: str | None = None

    @classmethod
    def parse(cls, m: Message) -> ProducerGone:
        tokens = _field(m, "tokens", list)
        reason = _field(m, "reason", str, None)
        return cls([t for t in tokens if isinstance(t, str)], reason)

    def fields(self) -> dict[str, Any]:
        return {"tokens": self.tokens, **({"reason": self.reason} if self.reason is not None else {})}


@_verb
@dataclass(slots=True)
class Revoke(JsonMessage):
    """REVOKE: the broker took these grants back (spec §4.3a)."""

    verb: ClassVar[str] = "REVOKE"
    grant_ids: list[int]

    @classmethod
    def parse(cls, m: Message) -> Revoke:
        return cls([g for g in _field(m, "grant_ids", list) if type(g) is int])

    def fields(self) -> dict[str, Any]:
        return {"grant_ids": self.grant_ids}


@_verb
@dataclass(slots=True)
class ChannelState(JsonMessage):
    """CHANNEL_STATE: the consumer's channel ended (True) or was reopened (spec §4.9)."""

    verb: ClassVar[str] = "CHANNEL_STATE"
    ended: bool

    @classmethod
    def parse(cls, m: Message) -> ChannelState:
        return cls(_field(m, "ended", bool))

    def fields(self) -> dict[str, Any]:
        return {"ended": self.ended}


@_verb
@dataclass(slots=True)
class Shutdown(JsonMessage):
    """SHUTDOWN: the broker is stopping."""

    verb: ClassVar[str] = "SHUTDOWN"
    reason: str = "broker shut down"

    @classmethod
    def parse(cls, m: Message) -> Shutdown:
        return cls(_field(m, "reason", str, "broker shut down"))

    def fields(self) -> dict[str, Any]:
        return {"reason": self.reason}


@_verb
@dataclass(slots=True)
class Error(JsonMessage):
    """ERROR: a message was refused: ``code`` (errors.ERROR_CODES) and why; ``extra`` holds the
    rest the spec lists (ref, the echoed handoff_id / token / request_id, handoff_ids, field,
    value, ticket...)."""

    verb: ClassVar[str] = "ERROR"
    code: str
    message: str
    extra: dict[str, Any] = field(default_factory=dict)
    ticket: str | None = None  # when it answers a STATS or CAPS (§6a)

    @classmethod
    def parse(cls, m: Message) -> Error:
        extra = {k: v for k, v in m.header.items() if k not in ("code", "message", "ticket")}
        ticket = m.header.get("ticket")
        return cls(_field(m, "code", str), str(m.header.get("message", "")), extra,
                   ticket if isinstance(ticket, str) else None)

    @property
    def handoff_id(self) -> int | None:
        v = self.extra.get("handoff_id")
        return v if type(v) is int else None

    @property
    def handoff_ids(self) -> list[int]:
        v = self.extra.get("handoff_ids")
        return [i for i in v if type(i) is int] if isinstance(v, list) else []

    @property
    def token(self) -> str | None:
        v = self.extra.get("token")
        return v if isinstance(v, str) else None

    @property
    def refused_credits(self) -> int:
        """Credits this ERROR says were not applied (spec §2: a refused REQUEST or READY's, or
        those a RELEASE or HANDOFF carried over a limit of §6a): never applied, so no longer
        asked. 0: none named."""
        v = self.extra.get("credits")
        return v if type(v) is int and 0 < v <= MAX_CREDITS else 0

    def fields(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, **self.extra,
                **({"ticket": self.ticket} if self.ticket is not None else {})}



# --- both ways: kept mappings (spec §4.10) ------------------------------------------------------


def _labels(m: Message, name: str, least: int) -> list[str] | None:
    v = _field(m, name, list, None)
    if v is None:
        return None
    if not least <= len(v) <= MAX_UNMAP_CONSUMERS or not all(is_label(x) for x in v) or len(set(v)) != len(v):
        raise ProtocolError("bad_header", f"{m.verb} header: '{name}' must list {least}-{MAX_UNMAP_CONSUMERS} "
                            "distinct consumer labels (16 lowercase hex digits)", field=name)
    return list(v)


@_verb
@dataclass(slots=True)
class Unmap(JsonMessage):
    """UNMAP, with the allocation's ``memory`` frame. From a producer: it is about to free that
    allocation, which it sent with ``keep`` to the consumers labelled ``consumers``; from the
    broker to one of them: ``producer_id`` asks it to close its mapping of it and answer
    UNMAPPED. ``request`` names the round in both."""

    verb: ClassVar[str] = "UNMAP"
    request: int
    memory: bytes
    consumers: list[str] | None = None  # a producer's UNMAP
    producer_id: str | None = None  # the broker's forward

    @classmethod
    def parse(cls, m: Message) -> Unmap:
        memory = bytes(m.frames.get("memory", b""))
        if len(memory) != BLOB_SIZE:
            raise ProtocolError("bad_frames", f"UNMAP 'memory' frame must be {BLOB_SIZE} bytes, got {len(memory)}")
        return cls(_field(m, "request", int, lo=1, hi=(1 << 63) - 1), memory, _labels(m, "consumers", 1),
                   _field(m, "producer_id", str, None, max_len=64))

    def fields(self) -> dict[str, Any]:
        return {"request": self.request, **({"consumers": self.consumers} if self.consumers is not None else {}),
                **({"producer_id": self.producer_id} if self.producer_id is not None else {})}

    def blobs(self) -> dict[str, bytes]:
        return {"memory": self.memory}

    def encode(self) -> list[bytes]:
        return Message(self.verb, self.fields(), self.blobs()).encode()


@_verb
@dataclass(slots=True)
class Unmapped(JsonMessage):
    """UNMAPPED. From a consumer: it closed its mapping of the allocation of ``producer_id``'s
    UNMAP ``request`` (or had none). From the broker to the producer: round ``request`` is over;
    the consumers of ``unmapped`` answered, those of ``gone`` left proven gone, those of
    ``fenced`` cannot be answered for: while any is listed there, the allocation stays allocated
    for as long as the producer lives."""

    verb: ClassVar[str] = "UNMAPPED"
    request: int
    producer_id: str | None = None  # a consumer's UNMAPPED
    unmapped: list[str] | None = None  # the broker's answer, the three lists
    gone: list[str] | None = None
    fenced: list[str] | None = None

    @classmethod
    def parse(cls, m: Message) -> Unmapped:
        return cls(_field(m, "request", int, lo=1, hi=(1 << 63) - 1), _field(m, "producer_id", str, None, max_len=64),
                   _labels(m, "unmapped", 0), _labels(m, "gone", 0), _labels(m, "fenced", 0))

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"request": self.request}
        if self.producer_id is not None:
            out["producer_id"] = self.producer_id
        for name in ("unmapped", "gone", "fenced"):
            v = getattr(self, name)
            if v is not None:
                out[name] = v
        return out
