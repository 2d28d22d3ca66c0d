"""The broker wire protocol, version 2 (docs/spec/ipc-protocol.md).

A message is a ZeroMQ multipart message::

    frame 0   verb      ASCII, e.g. b"HANDOFF"
    frame 1   header    UTF-8 JSON object
    frame 2.. payload   binary frames named by the verb (see PAYLOAD)

The 16-byte buffer handle always travels verbatim in its own frame; IPC blobs (64 bytes) travel
in frames of their own, never inside the handle or the JSON. The broker's ROUTER socket adds the
sender's routing id in front; nothing here deals with it.

:func:`decode_all` gives the hot verbs' entries typed (:class:`Handoff`, :class:`Deliver`,
:class:`Release`... every field checked there) and a JSON verb framed (:class:`Message`: verb,
header object, frames), which ``wire/messages.parse`` types when its receiver is ready to judge
its fields (spec §8 gives the order). A client that announced ``bundles`` reads the broker's
bundles (several hot messages in one ZeroMQ message, spec §2.2a) with ``decode_all(bundles=True)``;
the broker groups what it sends with :func:`parcels`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ..errors import ERROR_CODES as ERROR_CODES  # the codec's errors: ProtocolError and its codes
from ..errors import ProtocolError as ProtocolError

PROTOCOL_VERSION = 2
MAX_HEADER_BYTES = 64 * 1024
# HELLO alone may be larger (spec §2, §6): a re-registering consumer lists up to 8192 held
# handoffs (~160 bytes each) and a producer up to 4096 outstanding ones.
MAX_HELLO_BYTES = 2 * 1024 * 1024
# UNMAP and UNMAPPED too (spec §4.10): 4096 labels of 16 hex digits are about 80 KB as JSON.
MAX_UNMAP_BYTES = 128 * 1024
# STATS_REPLY alone may be larger (spec §2.3): at most 1000 clients and 1000 channels, each with
# names of up to 128 / 256 characters that JSON may escape to 12 bytes each: about 8.2 MB at worst.
MAX_STATS_REPLY_BYTES = 16 * 1024 * 1024
BLOB_SIZE = 64
MAX_BATCH = 64        # entries in one binary hot-verb message
MAX_BUNDLE = 16       # binary hot-verb messages in one bundle (spec §2.2a)
TOKEN_BYTES = 24      # a delivery token: the broker session (8 bytes) and 16 random bytes
MAX_REF_BYTES = 64    # an in-process reference
MAX_REASON_BYTES = 1024

# JSON verbs: verb -> names of its binary payload frames, in order; "?" marks an optional trailing frame.
PAYLOAD: dict[str, tuple[str, ...]] = {
    # client -> broker
    "HELLO": (),
    "PING": (),
    "CAPS": (),
    "STATS": (),
    "REQUEST": (),
    "READY": (),
    "ROUTE": (),
    "END": (),
    "BYE": (),
    # both ways (§4.10): the producer's UNMAP and its forward to a consumer carry the allocation's
    # memory blob; a consumer's UNMAPPED and the broker's answer to the producer carry none
    "UNMAP": ("memory",),
    "UNMAPPED": (),
    # broker -> client
    "WELCOME": (),
    "PONG": (),
    "CAPS_REPLY": (),
    "STATS_REPLY": (),
    "PRODUCER_GONE": (),
    "REVOKE": (),
    "CHANNEL_STATE": (),
    "ERROR": (),
    "SHUTDOWN": (),
}  # the interchange link's verbs are wire/link.py's PAYLOAD
# Binary hot verbs (spec §2.2): a fixed little-endian batch header of 1..MAX_BATCH fixed-size
# entries, each entry followed by its own frames. EVENT_RELEASE and EVENT_RELEASED are entries
# (kind 2) of RELEASE and RELEASED messages; in a decoded Message they keep their own verb.
HOT_VERBS = frozenset(["HANDOFF", "RELEASE", "EVENT_RELEASE", "DELIVER", "GRANT", "ACCEPTED", "RELEASED",
                       "EVENT_RELEASED"])
CLIENT_VERBS = frozenset(["HELLO", "PING", "CAPS", "STATS", "REQUEST", "READY", "HANDOFF", "RELEASE",
                          "EVENT_RELEASE", "ROUTE", "END", "BYE", "UNMAP", "UNMAPPED"])
BROKER_VERBS = frozenset(["WELCOME", "PONG", "CAPS_REPLY", "STATS_REPLY", "GRANT", "DELIVER", "ACCEPTED",
                          "RELEASED", "EVENT_RELEASED", "PRODUCER_GONE", "REVOKE", "CHANNEL_STATE", "ERROR",
                          "SHUTDOWN", "UNMAP", "UNMAPPED"])

MAX_HEADER_DEPTH = 16  # JSON nesting of a header (objects and arrays); our deepest is 4


# Built once (json.dumps builds an encoder per call). ASCII output: a lone surrogate a client put in
# a string (JSON allows "\ud800") is escaped again, never an encoding error when sending.
_JSON = json.JSONEncoder(separators=(",", ":"))


def json_bytes(obj: Any) -> bytes:
    return _JSON.encode(obj).encode()


@dataclass
class Message:
    """A JSON-framed message as it travels: its verb, its ``header`` object and its payload
    ``frames`` by name; not yet judged (``wire/messages.parse`` types an IPC one, ``wire/link``
    a link one). Tests and fuzzers also build hot-verb entries this way, naming their fields as the
    spec does (:func:`hot_message`)."""

    verb: str
    header: dict[str, Any] = field(default_factory=dict)
    frames: dict[str, bytes] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """Its fields: the header (as :meth:`HotMessage.fields` gives a hot entry's)."""
        return self.header

    def blobs(self) -> dict[str, bytes]:
        """Its payload frames, by name."""
        return self.frames

    def encode(self, verbs: Mapping[str, tuple[str, ...]] | None = None) -> list[bytes]:
        """The frames; ``verbs``: the protocol's table of verbs and their payload frames (default:
        this one's, PAYLOAD; the link's is wire/link.py's)."""
        if self.verb in HOT_VERBS:
            return encode_batch([self])
        names = (PAYLOAD if verbs is None else verbs)[self.verb]
        out = [self.verb.encode("ascii"), json_bytes(self.header)]
        gap = False
        for name in names:
            key = name.rstrip("?")
            if key in self.frames:
                if gap:
                    raise ProtocolError("bad_frames", f"{self.verb}: '{key}' cannot follow a missing optional frame")
                out.append(bytes(self.frames[key]))
            elif name.endswith("?"):
                gap = True
            else:
                raise ProtocolError("bad_frames", f"{self.verb} needs a '{key}' frame")
        unknown = set(self.frames) - {n.rstrip("?") for n in names}
        if unknown:
            raise ProtocolError("bad_frames", f"{self.verb} has no {sorted(unknown)} frame")
        return out


def decode(parts: Sequence[Any], *, allowed: frozenset[str] | None = None) -> Decoded:
    """Parse one message (a binary hot-verb message must then carry exactly one entry)."""
    msgs = decode_all(parts, allowed=allowed)
    if len(msgs) != 1:
        raise ProtocolError("bad_frames", f"{msgs[0].verb} carries {len(msgs)} entries; use decode_all")
    return msgs[0]


def decode_all(parts: Sequence[Any], *, allowed: frozenset[str] | None = None,
               bundles: bool = False) -> list[Decoded]:
    """Parse and validate the shape of a message (not its meaning): a list of one Message for a
    JSON verb, of one typed entry per entry for a binary hot verb (spec §2.2: :class:`Handoff`,
    :class:`Release`...). ``bundles``: a binary message may be a bundle (spec §2.2a), whose
    messages' entries come back in order, as if each had been decoded alone; a malformed part
    makes the whole bundle malformed. Without it, frames past the entries' are ``bad_frames``."""
    verb = _verb_of(parts)
    layout = _hot_layout(verb, allowed)
    if layout is not None:
        out, end = layout.decode(parts, allowed, bundles)
        return out if end == len(parts) else _bundle_rest(out, parts, end, allowed)
    return [_framed(parts, verb, PAYLOAD, allowed, False)]


def _bundle_rest(out: list[Any], parts: Sequence[Any], at: int, allowed: frozenset[str] | None) -> list[Decoded]:
    """The 2nd.. messages of a bundle whose first message's entries are ``out`` and whose
    next message starts at frame ``at``."""
    n, count = len(parts), 1
    while at < n:
        count += 1
        if count > MAX_BUNDLE:
            raise ProtocolError("bad_frames", f"a bundle carries at most {MAX_BUNDLE} messages", field="bundle",
                                value=count)
        rest = parts[at:]
        verb = _verb_of(rest)
        layout = _hot_layout(verb, allowed)
        if layout is None:
            raise ProtocolError("bad_frames", f"bundle message {count}: {verb[:32]!r} is not a binary hot verb",
                                field="bundle", value=count)
        more, used = layout.decode(rest, allowed, True)
        out += more
        at += used
    return out


def _hot_layout(verb: str, allowed: frozenset[str] | None) -> _Layout | None:
    """The layout of the binary hot verb ``verb`` names as a verb frame, None for any other verb;
    ``unknown_verb`` for a hot verb that ``allowed`` (this side's verbs) does not hold."""
    layout = _LAYOUTS.get(verb)
    if layout is None or verb != layout.verb:
        return None
    if allowed is not None and layout.kinds.get(1, layout.verb) not in allowed:
        raise ProtocolError("unknown_verb", f"{layout.verb!r} is not a verb this side accepts")
    return layout


def _verb_of(parts: Sequence[Any]) -> str:
    """The verb of a message of at least two frames (verb, header)."""
    if len(parts) < 2:
        raise ProtocolError("bad_frames", f"a message has at least 2 frames (verb, header), got {len(parts)}")
    try:
        return bytes(parts[0]).decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("unknown_verb", f"verb frame {bytes(parts[0])[:32]!r} is not ASCII") from None


def decode_json(parts: Sequence[Any], verbs: Mapping[str, tuple[str, ...]], *, allowed: frozenset[str] | None = None,
                views: bool = False) -> Message:
    """Parse a JSON-framed message of a protocol whose verbs and payload frames are ``verbs``
    (this one's PAYLOAD, the link's): its verb, its header object and its named frames.

    ``views=True`` keeps payload frames as memoryviews of the received frames (zmq.Frame from
    ``recv_multipart(copy=False)``) instead of copying them into bytes: for bulk data.
    """
    return _framed(parts, _verb_of(parts), verbs, allowed, views)


def _framed(parts: Sequence[Any], verb: str, verbs: Mapping[str, tuple[str, ...]], allowed: frozenset[str] | None,
            views: bool) -> Message:
    if verb not in verbs or (allowed is not None and verb not in allowed):
        raise ProtocolError("unknown_verb", f"{verb[:32]!r} is not a verb this side accepts")
    raw = bytes(parts[1])
    limit = (MAX_STATS_REPLY_BYTES if verb in ("STATS_REPLY", "CAPS_REPLY")
             else MAX_HELLO_BYTES if verb == "HELLO"
             else MAX_UNMAP_BYTES if verb in ("UNMAP", "UNMAPPED") else MAX_HEADER_BYTES)
    if len(raw) > limit:
        raise ProtocolError("bad_header", f"header of {len(raw)} bytes exceeds {limit}")
    header = _json_object(raw, f"{verb} header")
    names = verbs[verb]
    required = sum(1 for n in names if not n.endswith("?"))
    payload = parts[2:]
    if not required <= len(payload) <= len(names):
        raise ProtocolError("bad_frames", f"{verb} takes {required}-{len(names)} payload frames, got {len(payload)}")
    frames = {}
    for name, data in zip(names, payload, strict=False):
        key = name.rstrip("?")
        frames[key] = memoryview(data) if views else bytes(data)
    return Message(verb, header, frames)


def _json_object(raw: bytes, what: str, **extra: Any) -> dict[str, Any]:
    check_depth(raw, what, field=extra.get("field"))
    try:
        obj = json.loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError("bad_header", f"{what} is not UTF-8 JSON: {e}", **extra) from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_header", f"{what} must be a JSON object, not {type(obj).__name__}", **extra)
    return obj


# --- binary hot verbs (spec §2.2) ---------------------------------------------------------------
#
# Each hot verb is a typed message, decoded from its binary entry and validated there, once: a
# handler gets fields of the right type and never looks one up by name. ``fields()`` is the
# spec's view of an entry (its named fields, as the vectors list them), ``hot_message`` builds one
# from that view (tests, vectors, fuzzers).

BATCH = struct.Struct("<HHI")  # count, credits (HANDOFF: ready; RELEASE: credits; else 0), reserved

# Entry flags of HANDOFF and DELIVER: which frames follow the handle, and three booleans.
F_MEMORY, F_EVENT, F_REF, F_META, F_STAGED, F_ACK, F_KEEP = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40
# RELEASED reason codes (anything else travels as text in a reason frame).
REASONS = {0: "released", 1: "consumer_gone"}
REASON_TEXT = 255


class HotMessage:
    """A typed entry of a binary hot-verb message (spec §2.2)."""

    __slots__ = ()

    @property
    def verb(self) -> str:
        """The verb this entry travels as. A property, not a ``ClassVar``: this module is
        compiled with mypyc (hurray_ipc/compiled.py), and mypyc 1.13 turns a dataclass's
        ``ClassVar`` into a field."""
        raise NotImplementedError

    def encode(self) -> list[bytes]:
        """The frames of a message of this one entry."""
        return encode_batch([self])

    def fields(self) -> dict[str, Any]:
        """The entry's fields as the spec names them (its frames' contents included: ``meta``,
        ``inproc_ref``, ``reason``, a GRANT's ``consumer``); its blobs are :meth:`blobs`."""
        raise NotImplementedError

    def blobs(self) -> dict[str, bytes]:
        """The binary frames the entry carries verbatim, by name."""
        return {}


@dataclass(slots=True, kw_only=True)
class Carried(HotMessage):
    """The buffer a HANDOFF carries and its DELIVER forwards unchanged (spec §2.2, §4.5)."""

    handoff_id: int
    handle: bytes  # 16 bytes, as sent: BufferHandle.decode checks it where it is used
    offset: int = 0
    memory: bytes | None = None  # the memory blob (IPC)
    event: bytes | None = None  # the event blob (SYNC_EVENT over IPC)
    inproc_ref: str | None = None  # the in-process reference (flag 0x04): an in-process handoff
    meta: dict[str, Any] | None = None  # the array metadata (contract/meta.py), parsed, not yet checked
    meta_raw: bytes | None = None  # ``meta`` as it travels: forwarded as received, never re-encoded
    staged: bool = False
    keep: bool = False  # the consumer may keep its mapping of the allocation after the release (§4.10)

    @property
    def inproc(self) -> bool:
        return self.inproc_ref is not None

    def _carry(self, handoff_id: int, handle: bytes, offset: int, memory: bytes | None, event: bytes | None,
               inproc_ref: str | None, meta: dict[str, Any] | None, meta_raw: bytes | None, staged: bool,
               keep: bool) -> None:
        """Set the fields every carried buffer has (the written __init__ of each subclass)."""
        self.handoff_id = handoff_id
        self.handle = handle
        self.offset = offset
        self.memory = memory
        self.event = event
        self.inproc_ref = inproc_ref
        self.meta = meta
        self.meta_raw = meta_raw
        self.staged = staged
        self.keep = keep

    def _flags_frames(self) -> tuple[int, list[bytes]]:
        flags, out = 0, [bytes(self.handle)]
        if self.memory is not None:
            flags |= F_MEMORY
            out.append(bytes(self.memory))
        if self.event is not None:
            flags |= F_EVENT
            out.append(bytes(self.event))
        if self.inproc_ref is not None:
            flags |= F_REF
            out.append(self.inproc_ref.encode("ascii"))
        if self.meta is not None or self.meta_raw is not None:
            flags |= F_META
            out.append(bytes(self.meta_raw) if self.meta_raw is not None else json_bytes(self.meta))
        if self.staged:
            flags |= F_STAGED
        if self.keep:
            flags |= F_KEEP
        return flags, out

    def _carried_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"handoff_id": self.handoff_id, "offset": self.offset, "staged": self.staged,
                               "inproc": self.inproc}
        if self.keep:
            out["keep"] = True
        if self.inproc_ref is not None:
            out["inproc_ref"] = self.inproc_ref
        if self.meta is not None:
            out["meta"] = self.meta
        return out

    def blobs(self) -> dict[str, bytes]:
        out = {"handle": self.handle}
        if self.memory is not None:
            out["memory"] = self.memory
        if self.event is not None:
            out["event"] = self.event
        return out


# The entries made per handoff spell out their __init__: mypyc compiles a written one, while the
# one @dataclass generates runs interpreted (0.4 against 0.04 µs a call). Same fields, same order.
@dataclass(slots=True, kw_only=True, init=False)
class Handoff(Carried):
    """HANDOFF: a producer hands the buffer of ``grant_id`` on; ``ready`` carries a READY."""

    @property
    def verb(self) -> str:
        return "HANDOFF"

    grant_id: int
    ack: bool = False  # answer ACCEPTED
    ready: int = 0  # the batch header's READY, on the message's last entry (0: none)

    def __init__(self, *, handoff_id: int, handle: bytes, grant_id: int, offset: int = 0,
                 memory: bytes | None = None, event: bytes | None = None, inproc_ref: str | None = None,
                 meta: dict[str, Any] | None = None, meta_raw: bytes | None = None, staged: bool = False,
                 keep: bool = False, ack: bool = False, ready: int = 0) -> None:
        self._carry(handoff_id, handle, offset, memory, event, inproc_ref, meta, meta_raw, staged, keep)
        self.grant_id = grant_id
        self.ack = ack
        self.ready = ready

    def fields(self) -> dict[str, Any]:
        return {"grant_id": self.grant_id, **self._carried_fields(), "ack": self.ack,
                **({"ready": self.ready} if self.ready else {})}

    def deliver(self, token: str, producer_id: str) -> Deliver:
        """The DELIVER that hands this buffer to its consumer: the same frames, unchanged."""
        return Deliver(token=token, producer_id=producer_id, handoff_id=self.handoff_id, handle=self.handle,
                       offset=self.offset, memory=self.memory, event=self.event, inproc_ref=self.inproc_ref,
                       meta=self.meta, meta_raw=self.meta_raw, staged=self.staged, keep=self.keep)


@dataclass(slots=True, kw_only=True, init=False)
class Deliver(Carried):
    """DELIVER: the broker hands a consumer a buffer; it releases it by ``token``."""

    @property
    def verb(self) -> str:
        return "DELIVER"

    token: str  # 2 x TOKEN_BYTES lowercase hex digits
    producer_id: str

    def __init__(self, *, handoff_id: int, handle: bytes, token: str, producer_id: str, offset: int = 0,
                 memory: bytes | None = None, event: bytes | None = None, inproc_ref: str | None = None,
                 meta: dict[str, Any] | None = None, meta_raw: bytes | None = None, staged: bool = False,
                 keep: bool = False) -> None:
        self._carry(handoff_id, handle, offset, memory, event, inproc_ref, meta, meta_raw, staged, keep)
        self.token = token
        self.producer_id = producer_id

    def fields(self) -> dict[str, Any]:
        return {"token": self.token, "producer_id": self.producer_id, **self._carried_fields()}


@dataclass(slots=True, init=False)
class Release(HotMessage):
    """RELEASE (kind 1): the consumer is done with ``token``; ``credits`` carries a REQUEST."""

    @property
    def verb(self) -> str:
        return "RELEASE"

    token: str
    reason: str | None = None  # None: released; else why it was refused (a reason frame)
    credits: int = 0  # the batch header's credits, on the message's last entry

    def __init__(self, token: str, reason: str | None = None, credits: int = 0) -> None:
        self.token = token
        self.reason = reason
        self.credits = credits

    def fields(self) -> dict[str, Any]:
        return {"token": self.token, **({"reason": self.reason} if self.reason is not None else {}),
                **({"credits": self.credits} if self.credits else {})}


@dataclass(slots=True, init=False)
class EventRelease(HotMessage):
    """EVENT_RELEASE (RELEASE kind 2): the consumer's waits on the handoff's event were issued."""

    @property
    def verb(self) -> str:
        return "EVENT_RELEASE"

    token: str
    credits: int = 0

    def __init__(self, token: str, credits: int = 0) -> None:
        self.token = token
        self.credits = credits

    def fields(self) -> dict[str, Any]:
        return {"token": self.token, **({"credits": self.credits} if self.credits else {})}


@dataclass(slots=True, init=False)
class Released(HotMessage):
    """RELEASED (kind 1): the producer may reuse the buffer of ``handoff_id``."""

    @property
    def verb(self) -> str:
        return "RELEASED"

    handoff_id: int
    reason: str = "released"

    def __init__(self, handoff_id: int, reason: str = "released") -> None:
        self.handoff_id = handoff_id
        self.reason = reason

    def fields(self) -> dict[str, Any]:
        return {"handoff_id": self.handoff_id, "reason": self.reason}


@dataclass(slots=True, init=False)
class EventReleased(HotMessage):
    """EVENT_RELEASED (RELEASED kind 2): the producer may record the handoff's event again."""

    @property
    def verb(self) -> str:
        return "EVENT_RELEASED"

    handoff_id: int
    reason: str = "released"

    def __init__(self, handoff_id: int, reason: str = "released") -> None:
        self.handoff_id = handoff_id
        self.reason = reason

    def fields(self) -> dict[str, Any]:
        return {"handoff_id": self.handoff_id, "reason": self.reason}


@dataclass(slots=True, init=False)
class Grant(HotMessage):
    """GRANT: the producer may hand one buffer to consumer ``consumer_id``; ``consumer`` is that
    consumer's endpoint, in the first GRANT of each pairing only."""

    @property
    def verb(self) -> str:
        return "GRANT"

    grant_id: int
    epoch: int
    consumer_id: str  # the consumer's label, 16 hex digits
    consumer: dict[str, Any] | None = None  # an endpoint (transport/pairing.Endpoint.from_dict)

    def __init__(self, grant_id: int, epoch: int, consumer_id: str, consumer: dict[str, Any] | None = None) -> None:
        self.grant_id = grant_id
        self.epoch = epoch
        self.consumer_id = consumer_id
        self.consumer = consumer

    def fields(self) -> dict[str, Any]:
        return {"grant_id": self.grant_id, "epoch": self.epoch, "consumer_id": self.consumer_id,
                **({"consumer": self.consumer} if self.consumer is not None else {})}


@dataclass(slots=True, init=False)
class Accepted(HotMessage):
    """ACCEPTED: the broker took HANDOFF ``handoff_id`` (only when its ``ack`` flag asked)."""

    @property
    def verb(self) -> str:
        return "ACCEPTED"

    handoff_id: int

    def __init__(self, handoff_id: int) -> None:
        self.handoff_id = handoff_id

    def fields(self) -> dict[str, Any]:
        return {"handoff_id": self.handoff_id}


class _Layout:
    """One binary hot verb: its entry struct, and how entries map to typed messages."""

    def __init__(self, verb: str, fmt: str, credits: str | None, kinds: dict[int, str] | None = None):
        self.verb = verb
        self.verb_bytes = verb.encode("ascii")
        self.entry = struct.Struct(fmt)
        self.credits = credits  # the field the batch header's credits carry, if any
        self.kinds = kinds or {1: verb}  # entry kind -> logical verb (RELEASE / EVENT_RELEASE)

    def decode(self, parts: Sequence[Any], allowed: frozenset[str] | None, bundled: bool) -> tuple[list[Any], int]:
        """The entries of the message that starts at ``parts[0]``, and the frames it spans.
        ``bundled``: frames may follow its entries' (the next message of a bundle, §2.2a)."""
        head = bytes(parts[1])
        v = self.verb
        if len(head) < BATCH.size:
            raise ProtocolError("bad_header", f"{v} header is {len(head)} bytes; the batch header alone is 8")
        count, credits, reserved = BATCH.unpack_from(head)
        if not 1 <= count <= MAX_BATCH:
            raise ProtocolError("bad_header", f"{v} entry count must be 1..{MAX_BATCH}, got {count}", field="count",
                                value=count)
        if len(head) != BATCH.size + count * self.entry.size:
            raise ProtocolError("bad_header", f"{v} header is {len(head)} bytes; {count} entries of "
                                f"{self.entry.size} make {BATCH.size + count * self.entry.size}", field="count",
                                value=count)
        try:
            return self._decode_entries(parts, allowed, head, credits, reserved, bundled)
        except ProtocolError as e:
            if v == "HANDOFF":  # refused as a whole: name every entry, none of whose grants was used (§2.2)
                e.extra.setdefault("handoff_ids", [f[1] for f in self.entry.iter_unpack(memoryview(head)[BATCH.size:])])
            raise

    def _decode_entries(self, parts: Sequence[Any], allowed: frozenset[str] | None, head: bytes, credits: int,
                        reserved: int, bundled: bool) -> tuple[list[Any], int]:
        v = self.verb
        if reserved:
            raise ProtocolError("bad_header", f"{v} batch header reserved bytes 4-7 must be zero", field="reserved",
                                value=reserved)
        if credits and self.credits is None:
            raise ProtocolError("bad_header", f"{v} carries no credits; bytes 2-3 must be zero", field="credits",
                                value=credits)
        out: list[Any] = []
        payload = parts[2:]
        n_frames = len(payload)
        used = 0
        for i, f in enumerate(self.entry.iter_unpack(memoryview(head)[BATCH.size:])):
            verb, wants = self._verb_wants(f, i)
            if allowed is not None and verb not in allowed:
                raise ProtocolError("unknown_verb", f"{verb} is not a verb this side accepts")
            if used + wants > n_frames:
                raise ProtocolError("bad_frames", f"{v} entry {i} needs {wants} frames; the message has "
                                    f"{n_frames} payload frames in all")
            out.append(self._entry(f, [bytes(x) for x in payload[used:used + wants]], i))
            used += wants
        if used != n_frames and not bundled:
            raise ProtocolError("bad_frames", f"{v} entries name {used} payload frames, the message has {n_frames}")
        if credits:
            setattr(out[-1], self.credits, credits)  # type: ignore[arg-type]
        return out, 2 + used

    def _verb_wants(self, f: tuple[Any, ...], i: int) -> tuple[str, int]:
        """The entry's logical verb and how many payload frames follow it."""
        raise NotImplementedError

    def _entry(self, f: tuple[Any, ...], frames: list[bytes], i: int) -> Any:
        raise NotImplementedError

    def encode(self, msgs: Sequence[Any]) -> list[bytes]:
        credits = sum(getattr(m, self.credits) for m in msgs) if self.credits else 0
        head = [BATCH.pack(len(msgs), credits, 0)]
        out = [self.verb_bytes, b""]
        pack, entry = self._pack, self.entry.pack
        for m in msgs:
            fields, extra = pack(m)
            head.append(entry(*fields))
            out += extra
        out[1] = b"".join(head)
        return out

    def _pack(self, m: Any) -> tuple[tuple[Any, ...], list[bytes]]:
        raise NotImplementedError


def _blob(verb: str, name: str, data: bytes, i: int) -> bytes:
    if len(data) != BLOB_SIZE:
        raise ProtocolError("bad_frames", f"{verb} entry {i}: '{name}' frame must be {BLOB_SIZE} bytes, "
                            f"got {len(data)}")
    return data


def _json_frame(verb: str, name: str, data: bytes, i: int) -> dict[str, Any]:
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError("bad_header", f"{verb} entry {i}: '{name}' frame exceeds {MAX_HEADER_BYTES} bytes",
                            field=name)
    return _json_object(data, f"{verb} entry {i} {name}", field=name)


def _reason(data: bytes) -> str:
    return data[:MAX_REASON_BYTES].decode("utf-8", "replace")


_CARRIED_FLAGS = ((F_MEMORY, "memory"), (F_EVENT, "event"), (F_REF, "ref"), (F_META, "meta"))


def _carried_wants(verb: str, flags: int, allowed_flags: int, i: int) -> int:
    if flags & ~allowed_flags:
        raise ProtocolError("bad_header", f"{verb} entry {i}: unknown flag bits 0x{flags & ~allowed_flags:x}",
                            field="flags", value=flags)
    return 1 + sum(1 for bit, _name in _CARRIED_FLAGS if flags & bit)


_NO_FRAMES: tuple[bytes | None, bytes | None, str | None, dict[str, Any] | None, bytes | None] = \
    (None, None, None, None, None)


def _carried(verb: str, flags: int, frames: list[bytes], i: int) \
        -> tuple[bytes | None, bytes | None, str | None, dict[str, Any] | None, bytes | None]:
    """What a HANDOFF / DELIVER entry's frames after its handle carry: (memory, event, inproc_ref,
    meta, meta_raw), each None when its flag is off. A tuple, not keyword arguments: the caller
    passes each by name to a compiled __init__, which a ``**`` call would reach through the
    interpreter's argument parsing."""
    if not flags & (F_MEMORY | F_EVENT | F_REF | F_META):
        return _NO_FRAMES
    it = iter(frames[1:])
    memory = _blob(verb, "memory", next(it), i) if flags & F_MEMORY else None
    event = _blob(verb, "event", next(it), i) if flags & F_EVENT else None
    inproc_ref = None
    if flags & F_REF:
        ref = next(it)
        if not 1 <= len(ref) <= MAX_REF_BYTES or not ref.isascii():
            raise ProtocolError("bad_frames", f"{verb} entry {i}: 'ref' frame must be 1-{MAX_REF_BYTES} ASCII bytes")
        inproc_ref = ref.decode("ascii")
    meta, meta_raw = None, None
    if flags & F_META:
        meta_raw = next(it)
        meta = _json_frame(verb, "meta", meta_raw, i)
    return memory, event, inproc_ref, meta, meta_raw


def _u64(v: Any, name: str) -> int:
    if type(v) is not int or not 0 <= v < 2**64:
        raise ProtocolError("bad_header", f"'{name}' must be an integer 0..2**64-1, got {str(v)[:64]}", field=name)
    return v


def _token_bytes(token: Any) -> bytes:
    try:
        raw = bytes.fromhex(token)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != TOKEN_BYTES:
        raise ProtocolError("bad_header", f"a token is {2 * TOKEN_BYTES} hex digits, got {str(token)[:64]!r}",
                            field="token")
    return raw


class _Handoff(_Layout):
    # grant_id, handoff_id, offset, flags, reserved[6]
    def __init__(self) -> None:
        super().__init__("HANDOFF", "<QQQH6s", "ready")

    def _verb_wants(self, f: tuple[Any, ...], i: int) -> tuple[str, int]:
        if f[4] != bytes(6):
            raise ProtocolError("bad_header", f"HANDOFF entry {i}: reserved bytes must be zero", field="reserved",
                                value=f[4].hex())
        return "HANDOFF", _carried_wants("HANDOFF", f[3],
                                         F_MEMORY | F_EVENT | F_REF | F_META | F_STAGED | F_ACK | F_KEEP, i)

    def _entry(self, f: tuple[Any, ...], frames: list[bytes], i: int) -> Handoff:
        gid, hid, offset, flags, _reserved = f
        memory, event, ref, meta, raw = _carried("HANDOFF", flags, frames, i)
        return Handoff(grant_id=gid, handoff_id=hid, offset=offset, ack=bool(flags & F_ACK), handle=frames[0],
                       memory=memory, event=event, inproc_ref=ref, meta=meta, meta_raw=raw,
                       staged=bool(flags & F_STAGED), keep=bool(flags & F_KEEP))

    def _pack(self, m: Handoff) -> tuple[tuple[Any, ...], list[bytes]]:
        flags, frames = m._flags_frames()
        if m.ack:
            flags |= F_ACK
        return (_u64(m.grant_id, "grant_id"), _u64(m.handoff_id, "handoff_id"), _u64(m.offset, "offset"), flags,
                bytes(6)), frames


class _Deliver(_Layout):
    # token[24], handoff_id, offset, flags, producer_id length, reserved[5], producer_id[32]
    def __init__(self) -> None:
        super().__init__("DELIVER", "<24sQQHB5s32s", None)

    def _verb_wants(self, f: tuple[Any, ...], i: int) -> tuple[str, int]:
        return "DELIVER", _carried_wants("DELIVER", f[3], F_MEMORY | F_EVENT | F_REF | F_META | F_STAGED | F_KEEP, i)

    def _entry(self, f: tuple[Any, ...], frames: list[bytes], i: int) -> Deliver:
        token, hid, offset, flags, plen, _r, pid = f
        memory, event, ref, meta, raw = _carried("DELIVER", flags, frames, i)
        return Deliver(token=token.hex(), handoff_id=hid, offset=offset,
                       producer_id=pid[:min(plen, 32)].decode("utf-8", "replace"), handle=frames[0], memory=memory,
                       event=event, inproc_ref=ref, meta=meta, meta_raw=raw, staged=bool(flags & F_STAGED),
                       keep=bool(flags & F_KEEP))

    def _pack(self, m: Deliver) -> tuple[tuple[Any, ...], list[bytes]]:
        flags, frames = m._flags_frames()
        pid = m.producer_id.encode()[:32]
        return (_token_bytes(m.token), _u64(m.handoff_id, "handoff_id"), _u64(m.offset, "offset"), flags, len(pid),
                bytes(5), pid), frames


class _Release(_Layout):
    # token[24], kind (1 RELEASE, 2 EVENT_RELEASE), flags (1: a reason frame follows), reserved[6]
    def __init__(self) -> None:
        super().__init__("RELEASE", "<24sBB6s", "credits", {1: "RELEASE", 2: "EVENT_RELEASE"})

    def _verb_wants(self, f: tuple[Any, ...], i: int) -> tuple[str, int]:
        _token, kind, flags, reserved = f
        if kind not in self.kinds or flags & ~1 or reserved != bytes(6):
            raise ProtocolError("bad_header", f"RELEASE entry {i}: kind {kind} / flags 0x{flags:x} / reserved bytes "
                                "are not 1-2 / 0-1 / zero", field="kind", value=kind)
        return self.kinds[kind], flags

    def _entry(self, f: tuple[Any, ...], frames: list[bytes], i: int) -> Release | EventRelease:
        token = f[0].hex()
        if f[1] == 2:
            return EventRelease(token)  # a reason frame, which only a RELEASE has, is ignored
        return Release(token, _reason(frames[0]) if frames else None)

    def _pack(self, m: Release | EventRelease) -> tuple[tuple[Any, ...], list[bytes]]:
        if isinstance(m, EventRelease):
            return (_token_bytes(m.token), 2, 0, bytes(6)), []
        frames = [] if m.reason is None else [m.reason.encode()[:MAX_REASON_BYTES]]
        return (_token_bytes(m.token), 1, 1 if frames else 0, bytes(6)), frames


class _Released(_Layout):
    # handoff_id, kind (1 RELEASED, 2 EVENT_RELEASED), reason (REASONS; 255: a reason frame), reserved[6]
    def __init__(self) -> None:
        super().__init__("RELEASED", "<QBB6s", None, {1: "RELEASED", 2: "EVENT_RELEASED"})

    def _verb_wants(self, f: tuple[Any, ...], i: int) -> tuple[str, int]:
        _hid, kind, reason, _r = f
        if kind not in self.kinds or (reason not in REASONS and reason != REASON_TEXT):
            raise ProtocolError("bad_header", f"RELEASED entry {i}: kind {kind} / reason {reason} unknown")
        return self.kinds[kind], 1 if reason == REASON_TEXT else 0

    def _entry(self, f: tuple[Any, ...], frames: list[bytes], i: int) -> Released | EventReleased:
        hid, kind, code, _r = f
        reason = _reason(frames[0]) if frames else REASONS[code]
        return EventReleased(hid, reason) if kind == 2 else Released(hid, reason)

    def _pack(self, m: Released | EventReleased) -> tuple[tuple[Any, ...], list[bytes]]:
        code = _REASON_CODES.get(m.reason, REASON_TEXT)
        frames = [m.reason.encode()[:MAX_REASON_BYTES]] if code == REASON_TEXT else []
        return (_u64(m.handoff_id, "handoff_id"), 2 if isinstance(m, EventReleased) else 1, code, bytes(6)), frames


_REASON_CODES = {r: c for c, r in REASONS.items()}


class _Grant(_Layout):
    # grant_id, epoch, flags (1: an endpoint frame follows), reserved[2], consumer label[8]
    def __init__(self) -> None:
        super().__init__("GRANT", "<QIH2s8s", None)

    def _verb_wants(self, f: tuple[Any, ...], i: int) -> tuple[str, int]:
        if f[2] & ~1:
            raise ProtocolError("bad_header", f"GRANT entry {i}: unknown flag bits 0x{f[2]:x}")
        return "GRANT", f[2]

    def _entry(self, f: tuple[Any, ...], frames: list[bytes], i: int) -> Grant:
        gid, epoch, _flags, _r, label = f
        return Grant(gid, epoch, label.hex(), _json_frame("GRANT", "endpoint", frames[0], i) if frames else None)

    def _pack(self, m: Grant) -> tuple[tuple[Any, ...], list[bytes]]:
        frames = [] if m.consumer is None else [json_bytes(m.consumer)]
        return (_u64(m.grant_id, "grant_id"), m.epoch & 0xFFFFFFFF, 1 if frames else 0, bytes(2),
                bytes.fromhex(m.consumer_id)), frames


class _Accepted(_Layout):
    def __init__(self) -> None:
        super().__init__("ACCEPTED", "<Q", None)

    def _verb_wants(self, f: tuple[Any, ...], i: int) -> tuple[str, int]:
        return "ACCEPTED", 0

    def _entry(self, f: tuple[Any, ...], frames: list[bytes], i: int) -> Accepted:
        return Accepted(f[0])

    def _pack(self, m: Accepted) -> tuple[tuple[Any, ...], list[bytes]]:
        return (_u64(m.handoff_id, "handoff_id"),), []


_LAYOUTS: dict[str, _Layout] = {}
for _l in (_Handoff(), _Deliver(), _Release(), _Released(), _Grant(), _Accepted()):
    for _v in _l.kinds.values():
        _LAYOUTS[_v] = _l
    _LAYOUTS[_l.verb] = _l

Decoded = Message | HotMessage  # what decode_all gives: a JSON verb framed, hot entries typed


def hot_message(verb: str, fields: Mapping[str, Any], blobs: Mapping[str, bytes] | None = None) -> HotMessage:
    """A typed hot-verb entry from the spec's view of it (:meth:`HotMessage.fields` and
    :meth:`~HotMessage.blobs`): for tests, vectors and fuzzers, which name fields as the spec does.
    Fields the verb does not have are ignored, as an encoder ignores them."""
    f, b = dict(fields), dict(blobs or {})
    if verb in ("HANDOFF", "DELIVER"):
        kw: dict[str, Any] = {"handoff_id": f["handoff_id"], "handle": b["handle"], "offset": f.get("offset", 0),
                              "memory": b.get("memory"), "event": b.get("event"), "staged": bool(f.get("staged")),
                              "keep": bool(f.get("keep")),
                              "inproc_ref": (str(f.get("inproc_ref", "")) if f.get("inproc")
                                             or f.get("inproc_ref") is not None else None),
                              "meta": f.get("meta"), "meta_raw": b.get("meta")}
        if verb == "HANDOFF":
            return Handoff(grant_id=f["grant_id"], ack=bool(f.get("ack")), ready=f.get("ready") or 0, **kw)
        return Deliver(token=f["token"], producer_id=str(f.get("producer_id", "")), **kw)
    if verb == "RELEASE":
        return Release(f.get("token", ""), f.get("reason"), f.get("credits") or 0)
    if verb == "EVENT_RELEASE":
        return EventRelease(f.get("token", ""), f.get("credits") or 0)
    if verb in ("RELEASED", "EVENT_RELEASED"):
        kind = EventReleased if verb == "EVENT_RELEASED" else Released
        return kind(f["handoff_id"], str(f.get("reason", "released")))
    if verb == "GRANT":
        return Grant(f["grant_id"], f.get("epoch", 0), f["consumer_id"], f.get("consumer"))
    if verb == "ACCEPTED":
        return Accepted(f["handoff_id"])
    raise ProtocolError("unknown_verb", f"{verb[:32]!r} is not a hot verb")


def wire_verb(verb: str) -> str:
    """The verb frame a message of ``verb`` travels under (EVENT_RELEASE -> RELEASE)."""
    layout = _LAYOUTS.get(verb)
    return layout.verb if layout is not None else verb


def encode_batch(msgs: Sequence[Any]) -> list[bytes]:
    """Frames of one binary message carrying ``msgs`` (1..MAX_BATCH typed entries of one wire
    verb, or Messages naming their fields as the spec does; the batch header carries the sum of
    the entries' ``ready`` / ``credits``, which a decoder gives the last entry)."""
    msgs = [hot_message(m.verb, m.header, m.frames) if isinstance(m, Message) else m for m in msgs]
    layout = _LAYOUTS[msgs[0].verb]
    if not 1 <= len(msgs) <= MAX_BATCH or any(_LAYOUTS.get(m.verb) is not layout for m in msgs):
        raise ProtocolError("bad_frames", f"a batch is 1..{MAX_BATCH} entries of one wire verb")
    return layout.encode(msgs)


def encode_group(group: Sequence[Any]) -> list[bytes]:
    """Frames of one group of :func:`coalesce`: a batch of hot entries, or one JSON message."""
    return encode_batch(group) if group[0].verb in HOT_VERBS else group[0].encode()


def is_token(text: str) -> bool:
    """A token as JSON writes it (HELLO ``held``): 2 x TOKEN_BYTES lowercase hex digits."""
    return len(text) == 2 * TOKEN_BYTES and all(ch in "0123456789abcdef" for ch in text)


class Outgoing(Protocol):
    """Anything that travels as a message: a Message, a typed hot entry, a typed JSON message."""

    @property
    def verb(self) -> str: ...

    def encode(self) -> list[bytes]: ...


_O = TypeVar("_O", bound=Outgoing)


def coalesce(msgs: Sequence[_O]) -> list[list[_O]]:
    """Group one peer's outgoing messages into batches, in order: between two JSON messages,
    hot messages of one wire verb share a batch (at most MAX_BATCH), batches in the order of
    their first message. Safe because a client never depends on the order of two different
    hot verbs of one such run (a GRANT and a RELEASED), while a JSON message (an ERROR, a
    PRODUCER_GONE) is never moved across a hot one."""
    out: list[list[_O]] = []
    run: dict[str, list[_O]] = {}
    for m in msgs:
        w = wire_verb(m.verb)
        if w not in _HOT_WIRE:
            run = {}
            out.append([m])
            continue
        cur = run.get(w)
        if cur is None or len(cur) >= MAX_BATCH:
            cur = run[w] = []
            out.append(cur)
        cur.append(m)
    return out


_HOT_WIRE = frozenset(wire_verb(v) for v in HOT_VERBS)  # the verb frames of binary messages


def bundle(groups: Sequence[Sequence[_O]]) -> list[list[Sequence[_O]]]:
    """Group :func:`coalesce`'s groups for a client that accepts bundles (spec §2.2a): consecutive
    binary messages share one bundle (at most MAX_BUNDLE), a JSON message travels alone. The order
    is kept: a bundle means what its messages sent one after another mean."""
    out: list[list[Sequence[_O]]] = []
    cur: list[Sequence[_O]] | None = None
    for g in groups:
        if wire_verb(g[0].verb) not in _HOT_WIRE:
            cur = None
            out.append([g])
        elif cur is None or len(cur) >= MAX_BUNDLE:
            cur = [g]
            out.append(cur)
        else:
            cur.append(g)
    return out


def parcels(msgs: Sequence[_O], bundles: bool) -> list[list[Sequence[_O]]]:
    """One peer's outgoing messages as the ZeroMQ messages they travel in: :func:`coalesce`'s
    batches, each alone, or for a peer that reads bundles (``bundles``) consecutive ones together
    (:func:`bundle`). A parcel's frames are its batches' frames, one batch after another."""
    groups = coalesce(msgs)
    return bundle(groups) if bundles else [[g] for g in groups]


def check_depth(raw: bytes, what: str, limit: int = MAX_HEADER_DEPTH, field: str | None = None) -> None:
    """Refuse JSON nested deeper than ``limit`` before parsing it (json.loads recurses: a
    100,000-deep array raises RecursionError). Brackets inside strings are skipped."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return  # cannot be deeper: the common case costs two C-speed scans
    depth, in_str, esc = 0, False, False
    for ch in raw:
        if in_str:
            if esc:
                esc = False
            elif ch == 0x5C:  # backslash
                esc = True
            elif ch == 0x22:  # quote
                in_str = False
        elif ch == 0x22:
            in_str = True
        elif ch in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                raise ProtocolError("bad_header", f"{what} nests deeper than {limit} levels",
                                    **({"field": field} if field else {}))
        elif ch in (0x5D, 0x7D):
            depth -= 1
