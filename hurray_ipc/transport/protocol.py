"""The broker wire protocol, version 1 (docs/spec/ipc-protocol.md).

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
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
BLOB_SIZE = 64

# verb -> names of its binary payload frames, in order; "?" marks an optional trailing frame.
PAYLOAD: dict[str, tuple[str, ...]] = {
    # client -> broker
    "HELLO": (),
    "PING": (),
    "CAPS": (),
    "REQUEST": (),
    "READY": (),
    "HANDOFF": ("handle", "memory?", "event?"),
    "RELEASE": (),
    "EVENT_RELEASE": (),
    "BYE": (),
    # broker -> client
    "WELCOME": (),
    "PONG": (),
    "CAPS_REPLY": (),
    "GRANT": (),
    "DELIVER": ("handle", "memory?", "event?"),
    "ACCEPTED": (),
    "RELEASED": (),
    "EVENT_RELEASED": (),
    "PRODUCER_GONE": (),
    "ERROR": (),
    "SHUTDOWN": (),
    # the cross-machine link between two bridges (docs/spec/interchange.md)
    "LINK_HELLO": (),
    "LINK_WELCOME": (),
    "LINK_PING": (),
    "LINK_PONG": (),
    "CREDIT": (),
    "TENSOR_DESCRIPTOR": ("handle",),
    "TENSOR_DATA": ("data",),
    "TENSOR_DATA_END": (),
    "REJECT": (),
}
CLIENT_VERBS = frozenset(["HELLO", "PING", "CAPS", "REQUEST", "READY", "HANDOFF", "RELEASE", "EVENT_RELEASE", "BYE"])
BROKER_VERBS = frozenset(["WELCOME", "PONG", "CAPS_REPLY", "GRANT", "DELIVER", "ACCEPTED", "RELEASED",
                          "EVENT_RELEASED", "PRODUCER_GONE", "ERROR", "SHUTDOWN"])
LINK_RECEIVER_VERBS = frozenset(["LINK_HELLO", "CREDIT", "LINK_PING", "REJECT"])  # what a sending bridge accepts
LINK_SENDER_VERBS = frozenset(["LINK_WELCOME", "LINK_PONG", "TENSOR_DESCRIPTOR", "TENSOR_DATA", "TENSOR_DATA_END",
                               "REJECT"])  # what a receiving bridge accepts

# Error codes a broker sends in ERROR.code.
ERROR_CODES = frozenset({
    "bad_frames",        # not [verb, header, payload...] or wrong payload frame count/size
    "unknown_verb",
    "bad_header",        # not a JSON object, or a field missing / of the wrong type
    "protocol_version",  # HELLO with a version this broker does not speak
    "not_registered",    # a message before HELLO (or after the broker restarted): send HELLO
    "wrong_role",        # e.g. a consumer sending READY
    "bad_handle",        # the 16-byte handle is invalid (HandleError reason in `reason`)
    "mode_not_valid",    # the declared sync_mode is not valid for this producer/consumer pair
    "payload_mismatch",  # payload frames do not match the declared sync_mode
    "unknown_grant",
    "unknown_token",
    "foreign_token",     # a release of a token delivered to another consumer
    "already_released",
    "consumer_gone",     # the consumer of a grant died before the handoff arrived
    "limit_exceeded",    # a per-client or broker-wide limit (clients, held deliveries): the message is refused
    "internal",          # a broker bug cost this one message; the broker and every other client carry on
})
MAX_HEADER_DEPTH = 16  # JSON nesting of a header (objects and arrays); our deepest is 4


class ProtocolError(ValueError):
    """A message that violates the protocol. ``code`` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str, **extra: Any):
        assert code in ERROR_CODES, code
        self.code = code
        self.extra = extra  # more fields for the ERROR header, e.g. a HandleError's reason
        super().__init__(f"{code}: {message}")


@dataclass
class Message:
    verb: str
    header: dict[str, Any] = field(default_factory=dict)
    frames: dict[str, bytes] = field(default_factory=dict)

    def encode(self) -> list[bytes]:
        names = PAYLOAD[self.verb]
        out = [self.verb.encode("ascii"), json.dumps(self.header, separators=(",", ":")).encode()]
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


def decode(parts: Sequence[Any], *, allowed: frozenset[str] | None = None, views: bool = False) -> Message:
    """Parse and validate the shape of a message (not its meaning).

    ``views=True`` keeps payload frames as memoryviews of the received frames (zmq.Frame from
    ``recv_multipart(copy=False)``) instead of copying them into bytes: for bulk data.
    """
    if len(parts) < 2:
        raise ProtocolError("bad_frames", f"a message has at least 2 frames (verb, header), got {len(parts)}")
    try:
        verb = bytes(parts[0]).decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("unknown_verb", f"verb frame {bytes(parts[0])[:32]!r} is not ASCII") from None
    if verb not in PAYLOAD or (allowed is not None and verb not in allowed):
        raise ProtocolError("unknown_verb", f"{verb[:32]!r} is not a verb this side accepts")
    raw = bytes(parts[1])
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError("bad_header", f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    check_depth(raw, f"{verb} header")
    try:
        header = json.loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError("bad_header", f"{verb} header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("bad_header", f"{verb} header must be a JSON object, not {type(header).__name__}")
    names = PAYLOAD[verb]
    required = sum(1 for n in names if not n.endswith("?"))
    payload = parts[2:]
    if not required <= len(payload) <= len(names):
        raise ProtocolError("bad_frames", f"{verb} takes {required}-{len(names)} payload frames, got {len(payload)}")
    frames = {}
    for name, data in zip(names, payload, strict=False):
        key = name.rstrip("?")
        data = memoryview(data) if views else bytes(data)
        if key in ("memory", "event") and len(data) != BLOB_SIZE:
            raise ProtocolError("bad_frames", f"{verb} '{key}' frame must be {BLOB_SIZE} bytes, got {len(data)}")
        frames[key] = data
    return Message(verb, header, frames)


def check_depth(raw: bytes, what: str, limit: int = MAX_HEADER_DEPTH) -> None:
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
                raise ProtocolError("bad_header", f"{what} nests deeper than {limit} levels")
        elif ch in (0x5D, 0x7D):
            depth -= 1


# typestr of a meta: byte order, kind, item size (NumPy array-interface form), e.g. "<f4", "|u1".
_TYPESTR = re.compile(r"^[<>|=][biufcmMVSU]([1-9][0-9]{0,3})$")
MAX_NDIM = 32


def check_meta(meta: Any, size: int) -> None:
    """Check a handoff's ``meta`` ({"shape": [...], "typestr": "<f4"}, or absent: raw bytes)
    against the buffer's ``size``: prod(shape) * itemsize == size. The broker checks it on
    HANDOFF and the consumer again before building a view (spec §4.5)."""
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise ProtocolError("bad_header", f"meta must be an object, got {type(meta).__name__}", field="meta")
    shape, typestr = meta.get("shape"), meta.get("typestr")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**63 for n in shape):
        raise ProtocolError("bad_header", f"meta.shape must be a list of at most {MAX_NDIM} non-negative integers, "
                            f"got {str(shape)[:64]}", field="meta.shape")
    m = _TYPESTR.match(typestr) if isinstance(typestr, str) else None
    if m is None:
        raise ProtocolError("bad_header", f"meta.typestr {str(typestr)[:32]!r} is not a typestr such as '<f4'",
                            field="meta.typestr")
    count = 1
    for n in shape:
        count *= n
    if count * int(m.group(1)) != size:
        raise ProtocolError("payload_mismatch", f"meta shape {shape} of {typestr} is {count * int(m.group(1))} bytes, "
                            f"the buffer is {size}", field="meta", value=f"{shape} {typestr}")


def field_of(msg: Message, name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    """A typed header field, or ProtocolError('bad_header') naming it."""
    if name not in msg.header or msg.header[name] is None:
        if optional:
            return None
        raise ProtocolError("bad_header", f"{msg.verb} header lacks '{name}'")
    v = msg.header[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(v, bool) and bool not in kinds:  # JSON true is no int here, though Python says so
        raise ProtocolError("bad_header", f"{msg.verb} '{name}' must be {kind}, got a boolean")
    if not isinstance(v, kind):
        raise ProtocolError("bad_header", f"{msg.verb} '{name}' must be {getattr(kind, '__name__', kind)}, "
                            f"got {type(v).__name__}", field=name)
    return v


def error(code: str, message: str, **extra: Any) -> Message:
    return Message("ERROR", {"code": code, "message": message, **extra})


def order_key(producer_id: str, handoff_id: int, message: str) -> str:
    """The name both ends give a handoff's HANDOFF/DELIVER ("handoff") or RELEASE/RELEASED
    ("release") message in happens-before annotations (:meth:`Device.order_send`)."""
    return f"{producer_id}:{handoff_id}:{message}"
