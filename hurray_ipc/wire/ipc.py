"""The broker wire protocol, version 2 (docs/spec/ipc-protocol.md).

A message is a ZeroMQ multipart message::

    frame 0   verb      ASCII, e.g. b"HANDOFF"
    frame 1   header    UTF-8 JSON object
    frame 2.. payload   binary frames named by the verb (see PAYLOAD)

The 16-byte buffer handle always travels verbatim in its own frame; IPC blobs (64 bytes) travel
in frames of their own, never inside the handle or the JSON. The broker's ROUTER socket adds the
sender's routing id in front; nothing here deals with it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ERROR_CODES as ERROR_CODES  # the codec's errors: ProtocolError and its codes
from ..errors import ProtocolError as ProtocolError
from .fields import FieldError, check

PROTOCOL_VERSION = 2
MAX_HEADER_BYTES = 64 * 1024
# HELLO alone may be larger (spec §2, §6): a re-registering consumer lists up to 8192 held
# handoffs (~160 bytes each) and a producer up to 4096 outstanding ones.
MAX_HELLO_BYTES = 2 * 1024 * 1024
# STATS_REPLY alone may be larger (spec §2.3): at most 1000 clients and 1000 channels, each with
# names of up to 128 / 256 characters that JSON may escape to 12 bytes each: about 8.2 MB at worst.
MAX_STATS_REPLY_BYTES = 16 * 1024 * 1024
BLOB_SIZE = 64
MAX_BATCH = 64        # entries in one binary hot-verb message
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
                          "EVENT_RELEASE", "ROUTE", "END", "BYE"])
BROKER_VERBS = frozenset(["WELCOME", "PONG", "CAPS_REPLY", "STATS_REPLY", "GRANT", "DELIVER", "ACCEPTED",
                          "RELEASED", "EVENT_RELEASED", "PRODUCER_GONE", "REVOKE", "CHANNEL_STATE", "ERROR",
                          "SHUTDOWN"])

MAX_HEADER_DEPTH = 16  # JSON nesting of a header (objects and arrays); our deepest is 4


# Built once (json.dumps builds an encoder per call). ASCII output: a lone surrogate a client put in
# a string (JSON allows "\ud800") is escaped again, never an encoding error when sending.
_JSON = json.JSONEncoder(separators=(",", ":"))


def json_bytes(obj: Any) -> bytes:
    return _JSON.encode(obj).encode()


@dataclass
class Message:
    """One message, or one entry of a binary batch (hot verbs): ``header`` holds its fields
    (for hot verbs the decoded binary fields, named as in the spec), ``frames`` its blobs."""

    verb: str
    header: dict[str, Any] = field(default_factory=dict)
    frames: dict[str, bytes] = field(default_factory=dict)

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


def decode(parts: Sequence[Any], *, allowed: frozenset[str] | None = None, views: bool = False,
           verbs: Mapping[str, tuple[str, ...]] | None = None) -> Message:
    """Parse one message (a binary hot-verb message must then carry exactly one entry)."""
    msgs = decode_all(parts, allowed=allowed, views=views, verbs=verbs)
    if len(msgs) != 1:
        raise ProtocolError("bad_frames", f"{msgs[0].verb} carries {len(msgs)} entries; use decode_all")
    return msgs[0]


def decode_all(parts: Sequence[Any], *, allowed: frozenset[str] | None = None, views: bool = False,
               verbs: Mapping[str, tuple[str, ...]] | None = None) -> list[Message]:
    """Parse and validate the shape of a message (not its meaning): a list of one Message for a
    JSON verb, of one per entry for a binary hot verb (spec §2.2).

    ``views=True`` keeps payload frames as memoryviews of the received frames (zmq.Frame from
    ``recv_multipart(copy=False)``) instead of copying them into bytes: for bulk data.
    """
    if len(parts) < 2:
        raise ProtocolError("bad_frames", f"a message has at least 2 frames (verb, header), got {len(parts)}")
    try:
        verb = bytes(parts[0]).decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("unknown_verb", f"verb frame {bytes(parts[0])[:32]!r} is not ASCII") from None
    layout = _LAYOUTS.get(verb)
    if layout is not None and verb == layout.verb:
        if allowed is not None and layout.kinds.get(1, verb) not in allowed:
            raise ProtocolError("unknown_verb", f"{verb[:32]!r} is not a verb this side accepts")
        return layout.decode(parts, allowed)
    table = PAYLOAD if verbs is None else verbs
    if verb not in table or (allowed is not None and verb not in allowed):
        raise ProtocolError("unknown_verb", f"{verb[:32]!r} is not a verb this side accepts")
    raw = bytes(parts[1])
    limit = (MAX_STATS_REPLY_BYTES if verb in ("STATS_REPLY", "CAPS_REPLY")
             else MAX_HELLO_BYTES if verb == "HELLO" else MAX_HEADER_BYTES)
    if len(raw) > limit:
        raise ProtocolError("bad_header", f"header of {len(raw)} bytes exceeds {limit}")
    header = _json_object(raw, f"{verb} header")
    names = table[verb]
    required = sum(1 for n in names if not n.endswith("?"))
    payload = parts[2:]
    if not required <= len(payload) <= len(names):
        raise ProtocolError("bad_frames", f"{verb} takes {required}-{len(names)} payload frames, got {len(payload)}")
    frames = {}
    for name, data in zip(names, payload, strict=False):
        key = name.rstrip("?")
        frames[key] = memoryview(data) if views else bytes(data)
    return [Message(verb, header, frames)]


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

BATCH = struct.Struct("<HHI")  # count, credits (HANDOFF: ready; RELEASE: credits; else 0), reserved

# Entry flags of HANDOFF and DELIVER: which frames follow the handle, and two booleans.
F_MEMORY, F_EVENT, F_REF, F_META, F_STAGED, F_ACK = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
# RELEASED reason codes (anything else travels as text in a reason frame).
REASONS = {0: "released", 1: "consumer_gone"}
REASON_TEXT = 255
_BLOBS = frozenset(["memory", "event"])


class _Layout:
    """One binary hot verb: its entry struct and how entries map to Messages."""

    def __init__(self, verb: str, fmt: str, credits: str | None, kinds: dict[int, str] | None = None):
        self.verb = verb
        self.verb_bytes = verb.encode("ascii")
        self.entry = struct.Struct(fmt)
        self.credits = credits  # the header field the batch header's credits carry, if any
        self.kinds = kinds or {1: verb}  # entry kind -> logical verb (RELEASE / EVENT_RELEASE)

    def decode(self, parts: Sequence[Any], allowed: frozenset[str] | None) -> list[Message]:
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
            return self._decode_entries(parts, allowed, head, credits, reserved)
        except ProtocolError as e:
            if v == "HANDOFF":  # refused as a whole: name every entry, none of whose grants was used (§2.2)
                e.extra.setdefault("handoff_ids", [f[1] for f in self.entry.iter_unpack(memoryview(head)[BATCH.size:])])
            raise

    def _decode_entries(self, parts: Sequence[Any], allowed: frozenset[str] | None, head: bytes, credits: int,
                        reserved: int) -> list[Message]:
        v = self.verb
        if reserved:
            raise ProtocolError("bad_header", f"{v} batch header reserved bytes 4-7 must be zero", field="reserved",
                                value=reserved)
        if credits and self.credits is None:
            raise ProtocolError("bad_header", f"{v} carries no credits; bytes 2-3 must be zero", field="credits",
                                value=credits)
        out: list[Message] = []
        it = iter(parts[2:])
        n_frames = len(parts) - 2
        used = 0
        entry, frame = self._entry, self._frame
        for i, fields in enumerate(self.entry.iter_unpack(memoryview(head)[BATCH.size:])):
            msg, wants = entry(fields, i)
            if allowed is not None and msg.verb not in allowed:
                raise ProtocolError("unknown_verb", f"{msg.verb} is not a verb this side accepts")
            used += len(wants)
            if used > n_frames:
                raise ProtocolError("bad_frames", f"{v} entry {i} needs frames {wants}; the message has "
                                    f"{n_frames} payload frames in all")
            frames = msg.frames
            for name in wants:
                data = bytes(next(it))
                if name == "handle":
                    frames[name] = data  # checked by BufferHandle.decode where it is used
                elif name in _BLOBS and len(data) == BLOB_SIZE:
                    frames[name] = data
                else:
                    frame(msg, name, data, i)
            out.append(msg)
        if used != n_frames:
            raise ProtocolError("bad_frames", f"{v} entries name {used} payload frames, the message has {n_frames}")
        if credits:
            out[-1].header[self.credits] = credits  # type: ignore[index]
        return out

    def _entry(self, f: tuple[Any, ...], i: int) -> tuple[Message, list[str]]:
        raise NotImplementedError

    def _frame(self, msg: Message, name: str, data: bytes, i: int) -> None:
        if name in ("memory", "event") and len(data) != BLOB_SIZE:
            raise ProtocolError("bad_frames", f"{msg.verb} entry {i}: '{name}' frame must be {BLOB_SIZE} bytes, "
                                f"got {len(data)}")
        if name == "ref":
            if not 1 <= len(data) <= MAX_REF_BYTES or not data.isascii():
                raise ProtocolError("bad_frames", f"{msg.verb} entry {i}: 'ref' frame must be 1-{MAX_REF_BYTES} "
                                    "ASCII bytes")
            msg.header["inproc_ref"] = data.decode("ascii")
        elif name in ("meta", "endpoint"):
            if len(data) > MAX_HEADER_BYTES:
                raise ProtocolError("bad_header", f"{msg.verb} entry {i}: '{name}' frame exceeds {MAX_HEADER_BYTES} "
                                    "bytes", field=name)
            key = "consumer" if name == "endpoint" else name  # GRANT: the consumer's endpoint
            msg.header[key] = _json_object(data, f"{msg.verb} entry {i} {name}", field=name)
            if name == "meta":
                msg.frames["meta"] = data  # forwarded as received (DELIVER), not encoded again
        elif name == "reason":
            msg.header["reason"] = data[:MAX_REASON_BYTES].decode("utf-8", "replace")
        else:
            msg.frames[name] = data

    def encode(self, msgs: Sequence[Message]) -> list[bytes]:
        credits = sum(m.header.get(self.credits) or 0 for m in msgs) if self.credits else 0
        head = [BATCH.pack(len(msgs), credits, 0)]
        out = [self.verb_bytes, b""]
        pack, entry = self._pack, self.entry.pack
        for m in msgs:
            fields, extra = pack(m)
            head.append(entry(*fields))
            out += extra
        out[1] = b"".join(head)
        return out

    def _pack(self, m: Message) -> tuple[tuple[Any, ...], list[bytes]]:
        raise NotImplementedError


def _int(h: dict[str, Any], name: str, default: int | None = None) -> int:
    v = h.get(name, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError("bad_header", f"'{name}' must be an integer, got {type(v).__name__}", field=name)
    return v


def _buffer_frames(m: Message) -> tuple[int, list[bytes]]:
    """A HANDOFF/DELIVER entry's flags and frames: handle, memory?, event?, ref?, meta?."""
    h, f = m.header, m.frames
    flags, out = 0, [bytes(f["handle"])]
    if "memory" in f:
        flags |= F_MEMORY
        out.append(bytes(f["memory"]))
    if "event" in f:
        flags |= F_EVENT
        out.append(bytes(f["event"]))
    if h.get("inproc") or h.get("inproc_ref") is not None:
        flags |= F_REF
        out.append(str(h.get("inproc_ref", "")).encode("ascii"))
    if h.get("meta") is not None:
        flags |= F_META
        raw = f.get("meta")  # as received: a broker forwards the producer's bytes
        out.append(bytes(raw) if raw is not None else json_bytes(h["meta"]))
    if h.get("staged"):
        flags |= F_STAGED
    return flags, out


def _buffer_wants(verb: str, flags: int, allowed_flags: int, i: int) -> list[str]:
    if flags & ~allowed_flags:
        raise ProtocolError("bad_header", f"{verb} entry {i}: unknown flag bits 0x{flags & ~allowed_flags:x}",
                            field="flags", value=flags)
    wants = ["handle"]
    for bit, name in ((F_MEMORY, "memory"), (F_EVENT, "event"), (F_REF, "ref"), (F_META, "meta")):
        if flags & bit:
            wants.append(name)
    return wants


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

    def _entry(self, f: tuple[Any, ...], i: int) -> tuple[Message, list[str]]:
        gid, hid, offset, flags, reserved = f
        if reserved != bytes(6):
            raise ProtocolError("bad_header", f"HANDOFF entry {i}: reserved bytes must be zero", field="reserved",
                                value=reserved.hex())
        wants = _buffer_wants("HANDOFF", flags, F_MEMORY | F_EVENT | F_REF | F_META | F_STAGED | F_ACK, i)
        h = {"grant_id": gid, "handoff_id": hid, "offset": offset, "staged": bool(flags & F_STAGED),
             "inproc": bool(flags & F_REF), "ack": bool(flags & F_ACK)}
        return Message("HANDOFF", h), wants

    def _pack(self, m: Message) -> tuple[tuple[Any, ...], list[bytes]]:
        flags, frames = _buffer_frames(m)
        if m.header.get("ack"):
            flags |= F_ACK
        h = m.header
        return (_int(h, "grant_id"), _int(h, "handoff_id"), _int(h, "offset", 0), flags, bytes(6)), frames


class _Deliver(_Layout):
    # token[24], handoff_id, offset, flags, producer_id length, reserved[5], producer_id[32]
    def __init__(self) -> None:
        super().__init__("DELIVER", "<24sQQHB5s32s", None)

    def _entry(self, f: tuple[Any, ...], i: int) -> tuple[Message, list[str]]:
        token, hid, offset, flags, plen, _r, pid = f
        wants = _buffer_wants("DELIVER", flags, F_MEMORY | F_EVENT | F_REF | F_META | F_STAGED, i)
        h = {"token": token.hex(), "handoff_id": hid, "offset": offset, "staged": bool(flags & F_STAGED),
             "inproc": bool(flags & F_REF), "producer_id": pid[:min(plen, 32)].decode("utf-8", "replace")}
        return Message("DELIVER", h), wants

    def _pack(self, m: Message) -> tuple[tuple[Any, ...], list[bytes]]:
        flags, frames = _buffer_frames(m)
        h = m.header
        pid = str(h.get("producer_id", "")).encode()[:32]
        return (_token_bytes(h["token"]), _int(h, "handoff_id"), _int(h, "offset", 0), flags, len(pid), bytes(5),
                pid), frames


class _Release(_Layout):
    # token[24], kind (1 RELEASE, 2 EVENT_RELEASE), flags (1: a reason frame follows), reserved[6]
    def __init__(self) -> None:
        super().__init__("RELEASE", "<24sBB6s", "credits", {1: "RELEASE", 2: "EVENT_RELEASE"})

    def _entry(self, f: tuple[Any, ...], i: int) -> tuple[Message, list[str]]:
        token, kind, flags, reserved = f
        if kind not in self.kinds or flags & ~1 or reserved != bytes(6):
            raise ProtocolError("bad_header", f"RELEASE entry {i}: kind {kind} / flags 0x{flags:x} / reserved bytes "
                                "are not 1-2 / 0-1 / zero", field="kind", value=kind)
        return Message(self.kinds[kind], {"token": token.hex()}), ["reason"] if flags else []

    def _pack(self, m: Message) -> tuple[tuple[Any, ...], list[bytes]]:
        reason = m.header.get("reason")
        frames = [] if reason is None else [str(reason).encode()[:MAX_REASON_BYTES]]
        kind = 2 if m.verb == "EVENT_RELEASE" else 1
        return (_token_bytes(m.header.get("token")), kind, 1 if frames else 0, bytes(6)), frames


class _Released(_Layout):
    # handoff_id, kind (1 RELEASED, 2 EVENT_RELEASED), reason (REASONS; 255: a reason frame), reserved[6]
    def __init__(self) -> None:
        super().__init__("RELEASED", "<QBB6s", None, {1: "RELEASED", 2: "EVENT_RELEASED"})

    def _entry(self, f: tuple[Any, ...], i: int) -> tuple[Message, list[str]]:
        hid, kind, reason, _r = f
        if kind not in self.kinds or (reason not in REASONS and reason != REASON_TEXT):
            raise ProtocolError("bad_header", f"RELEASED entry {i}: kind {kind} / reason {reason} unknown")
        h: dict[str, Any] = {"handoff_id": hid}
        if reason in REASONS:
            h["reason"] = REASONS[reason]
        return Message(self.kinds[kind], h), ["reason"] if reason == REASON_TEXT else []

    def _pack(self, m: Message) -> tuple[tuple[Any, ...], list[bytes]]:
        reason = m.header.get("reason", "released")
        code = next((c for c, r in REASONS.items() if r == reason), REASON_TEXT)
        frames = [str(reason).encode()[:MAX_REASON_BYTES]] if code == REASON_TEXT else []
        return (_int(m.header, "handoff_id"), 2 if m.verb == "EVENT_RELEASED" else 1, code, bytes(6)), frames


class _Grant(_Layout):
    # grant_id, epoch, flags (1: an endpoint frame follows), reserved[2], consumer label[8]
    def __init__(self) -> None:
        super().__init__("GRANT", "<QIH2s8s", None)

    def _entry(self, f: tuple[Any, ...], i: int) -> tuple[Message, list[str]]:
        gid, epoch, flags, _r, label = f
        if flags & ~1:
            raise ProtocolError("bad_header", f"GRANT entry {i}: unknown flag bits 0x{flags:x}")
        return Message("GRANT", {"grant_id": gid, "epoch": epoch, "consumer_id": label.hex()}), \
            ["endpoint"] if flags else []

    def _pack(self, m: Message) -> tuple[tuple[Any, ...], list[bytes]]:
        h = m.header
        ep = h.get("consumer")
        frames = [] if ep is None else [json_bytes(ep)]
        return (_int(h, "grant_id"), _int(h, "epoch", 0) & 0xFFFFFFFF, 1 if frames else 0, bytes(2),
                bytes.fromhex(h["consumer_id"])), frames


class _Accepted(_Layout):
    def __init__(self) -> None:
        super().__init__("ACCEPTED", "<Q", None)

    def _entry(self, f: tuple[Any, ...], i: int) -> tuple[Message, list[str]]:
        return Message("ACCEPTED", {"handoff_id": f[0]}), []

    def _pack(self, m: Message) -> tuple[tuple[Any, ...], list[bytes]]:
        return (_int(m.header, "handoff_id"),), []


_LAYOUTS: dict[str, _Layout] = {}
for _l in (_Handoff(), _Deliver(), _Release(), _Released(), _Grant(), _Accepted()):
    for _v in _l.kinds.values():
        _LAYOUTS[_v] = _l
    _LAYOUTS[_l.verb] = _l


def wire_verb(verb: str) -> str:
    """The verb frame a Message of ``verb`` travels under (EVENT_RELEASE -> RELEASE)."""
    layout = _LAYOUTS.get(verb)
    return layout.verb if layout is not None else verb


def encode_batch(msgs: Sequence[Message]) -> list[bytes]:
    """Frames of one binary message carrying ``msgs`` (1..MAX_BATCH entries of one wire verb;
    the batch header carries the sum of the entries' ``ready`` / ``credits``, which a decoder
    attaches to the last entry)."""
    layout = _LAYOUTS[msgs[0].verb]
    if not 1 <= len(msgs) <= MAX_BATCH or any(_LAYOUTS.get(m.verb) is not layout for m in msgs):
        raise ProtocolError("bad_frames", f"a batch is 1..{MAX_BATCH} entries of one wire verb")
    return layout.encode(msgs)


def encode_group(group: Sequence[Message]) -> list[bytes]:
    """Frames of one group of :func:`coalesce`: a batch of hot entries, or one JSON message."""
    return encode_batch(group) if group[0].verb in HOT_VERBS else group[0].encode()


def is_token(text: str) -> bool:
    """A token as JSON writes it (HELLO ``held``): 2 x TOKEN_BYTES lowercase hex digits."""
    return len(text) == 2 * TOKEN_BYTES and all(ch in "0123456789abcdef" for ch in text)


def coalesce(msgs: Sequence[Message]) -> list[list[Message]]:
    """Group one peer's outgoing messages into batches, in order: between two JSON messages,
    hot messages of one wire verb share a batch (at most MAX_BATCH), batches in the order of
    their first message. Safe because a client never depends on the order of two different
    hot verbs of one such run (a GRANT and a RELEASED), while a JSON message (an ERROR, a
    PRODUCER_GONE) is never moved across a hot one."""
    out: list[list[Message]] = []
    run: dict[str, list[Message]] = {}
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


def field_of(msg: Message, name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    """Header field ``name``, checked strictly (``wire.fields.check``); a null field counts as
    absent. ProtocolError('bad_header') naming the field otherwise."""
    v = msg.header.get(name)
    if v is None:
        if optional:
            return None
        raise ProtocolError("bad_header", f"{msg.verb} header lacks '{name}'", field=name)
    try:
        return check(v, name, kind)
    except FieldError as e:
        raise ProtocolError("bad_header", f"{msg.verb} header: {e}", field=name) from None


def error(code: str, message: str, **extra: Any) -> Message:
    return Message("ERROR", {"code": code, "message": message, **extra})

