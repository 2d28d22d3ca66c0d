"""The link between a sending and a receiving bridge (docs/spec/interchange.md §2, R2), typed.

One frozen dataclass per verb. :func:`decode` checks the framing (``ipc-protocol.md`` §2, through
:func:`hurray_ipc.wire.ipc.decode_json`) and then every field, once, so that the bridges'
cores get typed messages and never look at a JSON header. :func:`encode` gives the frames, byte
for byte those the bridges sent before these types existed (JSON key order included).

Two kinds of failure, told apart by type (never by the text):

- :class:`~hurray_ipc.wire.ipc.ProtocolError`: not a link message this side takes
  (frames, JSON, verb), or one whose field makes the receiving side drop it unanswered (e.g. a
  TENSOR_DATA whose ``transfer_id`` is not an integer: it names no transfer).
- :class:`TransferFault` (a ProtocolError): a message about a transfer that the spec answers with
  a REJECT ``reason`` (interchange.md §3 receiver rules 1 and 3): ``bad_transfer_id``, a handle's
  reason code, ``network_sync_mode``, ``size_mismatch``, ``bad_meta`` (TENSOR_DESCRIPTOR) and
  ``bad_offset`` (TENSOR_DATA, RDMA_READY). The receiver's core decides what it ends
  (:class:`hurray_ipc.interchange.receiver.ReceiverCore`).

Field rules kept from the bridges: an absent or malformed ``data_planes`` is ``["zmq"]``, an
absent or out-of-range ``window`` 1, a CREDIT ``n`` outside 1-64 adds nothing (``n`` = 0), a
LINK_WELCOME without ``data_plane`` means ``"zmq"``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from hurray_ipc.contract.meta import check_meta
from hurray_ipc.contract.sync import check_network_handle
from hurray_ipc.format.handle import BufferHandle, HandleError
from hurray_ipc.wire.ipc import Message, ProtocolError, decode_json

INTERCHANGE_VERSION: Final = 1
MAX_CREDIT_N: Final = 64
MAX_WINDOW: Final = 64  # interchange.md §3: the largest LINK_HELLO window
# The link's verbs -> the names of their binary payload frames, in order (wire/ipc.py's framing).
PAYLOAD: Final[dict[str, tuple[str, ...]]] = {
    "LINK_HELLO": (),
    "LINK_WELCOME": (),
    "LINK_PING": (),
    "LINK_PONG": (),
    "CREDIT": (),
    "TENSOR_DESCRIPTOR": ("handle",),
    "TENSOR_DATA": ("data",),
    "TENSOR_DATA_END": (),
    "REJECT": (),
    "RDMA_REGISTER": ("metadata",),  # RDMA data plane: B offers its destination
    "RDMA_READY": (),  # A observed a NIXL WRITE complete
}
FROM_SENDER: Final = frozenset(["LINK_WELCOME", "LINK_PONG", "TENSOR_DESCRIPTOR", "TENSOR_DATA", "TENSOR_DATA_END",
                                "REJECT", "RDMA_READY"])  # what a receiving bridge accepts
FROM_RECEIVER: Final = frozenset(["LINK_HELLO", "CREDIT", "LINK_PING", "REJECT",
                                  "RDMA_REGISTER"])  # what a sending bridge accepts


class _NoId(enum.Enum):
    NO_ID = "no transfer_id"


NO_ID: Final = _NoId.NO_ID  # a REJECT (or RDMA_REGISTER) without a transfer_id field


class TransferFault(ProtocolError):
    """A message about transfer ``transfer_id`` (the raw JSON value: ``bad_transfer_id`` echoes
    it) that the receiver answers with ``REJECT{reason}``. ``size``: a descriptor's handle size,
    where the handle was valid (a receiver checks ``too_large`` before ``bad_meta``, §3 rule 1)."""

    def __init__(self, verb: str, transfer_id: object, reason: str, message: str, size: int | None = None, *,
                 field: str, value: object):
        super().__init__("bad_header", message, verb=verb, reason=reason, field=field, value=str(value)[:48])
        self.verb, self.transfer_id, self.reason, self.detail, self.size = verb, transfer_id, reason, message, size


@dataclass(frozen=True)
class LinkHello:
    """B → A: set the link up (again). ``window``: partial transfers B holds at once."""

    VERB: ClassVar[str] = "LINK_HELLO"
    channel: str | None
    window: int = 1
    data_planes: tuple[str, ...] = ("zmq",)
    gpu_destination: str | None = None
    protocol: int | None = INTERCHANGE_VERSION


@dataclass(frozen=True)
class LinkWelcome:
    """A → B: the link is set up, on ``data_plane`` (R1.2)."""

    VERB: ClassVar[str] = "LINK_WELCOME"
    data_plane: str = "zmq"
    gpu_source: str | None = None
    protocol: int | None = INTERCHANGE_VERSION


@dataclass(frozen=True)
class LinkPing:
    VERB: ClassVar[str] = "LINK_PING"


@dataclass(frozen=True)
class LinkPong:
    VERB: ClassVar[str] = "LINK_PONG"


@dataclass(frozen=True)
class Credit:
    """B → A: ``n`` more transfers A may start (0: a malformed CREDIT, which adds nothing)."""

    VERB: ClassVar[str] = "CREDIT"
    n: int


@dataclass(frozen=True)
class Reject:
    """Either way. ``transfer_id``: the raw JSON value (a receiver echoes a malformed one), or
    :data:`NO_ID` when the field is absent (a REJECT of the link, not of a transfer)."""

    VERB: ClassVar[str] = "REJECT"
    reason: str
    message: str = ""
    transfer_id: object = NO_ID

    @property
    def names_transfer(self) -> bool:
        return self.transfer_id is not NO_ID

    @property
    def id(self) -> int | None:
        """The transfer it names, where that is an integer."""
        return self.transfer_id if type(self.transfer_id) is int else None


@dataclass(frozen=True)
class TensorDescriptor:
    """A → B: a transfer starts. Decoded only valid: an integer id, a network handle
    (SYNC_PRODUCER_SYNCED), ``total_bytes`` the handle's size, ``meta`` fitting it (None: bytes)."""

    VERB: ClassVar[str] = "TENSOR_DESCRIPTOR"
    transfer_id: int
    handle: BufferHandle
    meta: dict[str, Any] | None = None

    @property
    def total_bytes(self) -> int:
        return self.handle.size


@dataclass(frozen=True)
class TensorData:
    """A → B: the bytes at ``offset`` of a transfer (zmq plane)."""

    VERB: ClassVar[str] = "TENSOR_DATA"
    transfer_id: int
    offset: int
    data: bytes | memoryview = field(repr=False)


@dataclass(frozen=True)
class TensorDataEnd:
    """A → B: every byte was sent. ``total_bytes`` None: not a JSON integer (so never the size)."""

    VERB: ClassVar[str] = "TENSOR_DATA_END"
    transfer_id: int
    total_bytes: int | None


@dataclass(frozen=True)
class RdmaRegister:
    """B → A: the destination of ``transfer_id`` (raw JSON value; an A without that transfer
    echoes it in its REJECT), ``offer`` its other header fields as sent (checked by
    ``Offer.from_wire``, which owns R2's rules), ``metadata`` NIXL's agent metadata."""

    VERB: ClassVar[str] = "RDMA_REGISTER"
    transfer_id: object
    offer: dict[str, Any]
    metadata: bytes = field(repr=False)

    @property
    def id(self) -> int | None:
        return self.transfer_id if type(self.transfer_id) is int else None


@dataclass(frozen=True)
class RdmaReady:
    """A → B: one completed NIXL WRITE covered ``[offset, offset + length)``."""

    VERB: ClassVar[str] = "RDMA_READY"
    transfer_id: int
    offset: int
    length: int


LinkMessage = (LinkHello | LinkWelcome | LinkPing | LinkPong | Credit | Reject | TensorDescriptor | TensorData
               | TensorDataEnd | RdmaRegister | RdmaReady)


def tensor_data_head(transfer_id: int, offset: int) -> list[bytes]:
    """The verb and header frames of a TENSOR_DATA (its data frame follows, sent zero-copy)."""
    return [b"TENSOR_DATA", json.dumps({"transfer_id": transfer_id, "byte_offset_in_buffer": offset}).encode()]


def _message(msg: LinkMessage) -> Message:
    if isinstance(msg, LinkHello):
        return Message(msg.VERB, {"protocol": msg.protocol, "channel": msg.channel,
                                  "data_planes": list(msg.data_planes), "window": msg.window,
                                  **({"gpu_destination": msg.gpu_destination} if msg.gpu_destination else {})})
    if isinstance(msg, LinkWelcome):
        return Message(msg.VERB, {"protocol": msg.protocol, "data_plane": msg.data_plane,
                                  **({"gpu_source": msg.gpu_source} if msg.gpu_source is not None else {})})
    if isinstance(msg, LinkPing | LinkPong):
        return Message(msg.VERB, {})
    if isinstance(msg, Credit):
        return Message(msg.VERB, {"n": msg.n})
    if isinstance(msg, Reject):
        head = {"transfer_id": msg.transfer_id} if msg.names_transfer else {}
        return Message(msg.VERB, {**head, "reason": msg.reason, "message": msg.message})
    if isinstance(msg, TensorDescriptor):
        return Message(msg.VERB, {"transfer_id": msg.transfer_id, "meta": msg.meta, "total_bytes": msg.total_bytes},
                       {"handle": msg.handle.encode()})
    if isinstance(msg, TensorDataEnd):
        return Message(msg.VERB, {"transfer_id": msg.transfer_id, "total_bytes": msg.total_bytes})
    if isinstance(msg, RdmaRegister):
        return Message(msg.VERB, {"transfer_id": msg.transfer_id, **msg.offer}, {"metadata": msg.metadata})
    if isinstance(msg, RdmaReady):
        return Message(msg.VERB, {"transfer_id": msg.transfer_id, "byte_offset_in_buffer": msg.offset,
                                  "length": msg.length})
    raise TypeError(f"not a link message: {msg!r}")


def encode(msg: LinkMessage) -> list[bytes]:
    """The frames of ``msg`` (``[verb, JSON header, payload...]``)."""
    if isinstance(msg, TensorData):
        return [*tensor_data_head(msg.transfer_id, msg.offset), bytes(msg.data)]
    return _message(msg).encode(PAYLOAD)


def _int(v: object) -> int | None:
    """A JSON integer (not a boolean), else None."""
    return v if type(v) is int else None


def _text(v: object, limit: int = 64) -> str:
    return v if isinstance(v, str) else str(v)[:limit]


def _transfer_id(m: Message) -> int:
    """The integer ``transfer_id`` of a message about a transfer: without one it names none, and
    is dropped (ProtocolError)."""
    tid = _int(m.header.get("transfer_id"))
    if tid is None:
        raise ProtocolError("bad_header", f"{m.verb} transfer_id {str(m.header.get('transfer_id'))[:32]!r} is not "
                            "an integer", field="transfer_id", value=str(m.header.get("transfer_id"))[:32])
    return tid


def _hello(h: dict[str, Any]) -> LinkHello:
    offered = h.get("data_planes", ["zmq"])
    planes = tuple(offered) if isinstance(offered, list) and all(isinstance(x, str) for x in offered) else ("zmq",)
    window = h.get("window", 1)  # absent: a receiver holding one transfer at a time
    gpu = h.get("gpu_destination")
    protocol = h.get("protocol")
    return LinkHello(channel=h.get("channel") if isinstance(h.get("channel"), str) else None,
                     window=window if type(window) is int and 1 <= window <= MAX_WINDOW else 1,
                     data_planes=planes, gpu_destination=None if gpu is None else str(gpu)[:32],
                     protocol=protocol if isinstance(protocol, int) else None)


def _welcome(h: dict[str, Any]) -> LinkWelcome:
    gpu, protocol = h.get("gpu_source"), h.get("protocol")
    return LinkWelcome(data_plane=_text(h.get("data_plane", "zmq"), 32),
                       gpu_source=None if gpu is None else str(gpu)[:32],
                       protocol=protocol if isinstance(protocol, int) else None)


def _descriptor(m: Message) -> TensorDescriptor:
    """§3 receiver rule 1, in its order (``too_large``, which depends on the receiver, is its core's)."""
    h, raw_tid = m.header, m.header.get("transfer_id")
    tid = _int(raw_tid)
    if tid is None:
        raise TransferFault(m.verb, raw_tid, "bad_transfer_id", f"transfer_id {str(raw_tid)[:32]!r} is not an integer",
                            field="transfer_id", value=raw_tid)
    try:
        handle = check_network_handle(BufferHandle.decode(m.frames["handle"]))
    except HandleError as e:
        raise TransferFault(m.verb, tid, e.reason, str(e), field=f"handle.{e.field}", value=e.value) from None
    total = h.get("total_bytes")
    if _int(total) != handle.size:
        raise TransferFault(m.verb, tid, "size_mismatch", f"total_bytes {total!r} is not the handle's size "
                            f"{handle.size}", field="total_bytes", value=total)
    meta = h.get("meta") or None
    try:
        check_meta(meta, handle.size)
    except ProtocolError as e:
        raise TransferFault(m.verb, tid, "bad_meta", str(e), size=handle.size, field=str(e.extra.get("field", "meta")),
                            value=e.extra.get("value", meta)) from None
    return TensorDescriptor(tid, handle, meta)


def _data(m: Message) -> TensorData:
    tid, raw, data = _transfer_id(m), m.header.get("byte_offset_in_buffer"), m.frames["data"]
    off = _int(raw)
    if off is None:
        raise TransferFault(m.verb, tid, "bad_offset", f"TENSOR_DATA at {raw!r}+{len(data)} is outside the buffer "
                            "or overlaps bytes already received", field="byte_offset_in_buffer", value=raw)
    return TensorData(tid, off, data)


def _ready(m: Message) -> RdmaReady:
    tid, off, n = _transfer_id(m), _int(m.header.get("byte_offset_in_buffer")), _int(m.header.get("length"))
    if off is None or n is None or n <= 0:
        raise TransferFault(m.verb, tid, "bad_offset",
                            f"RDMA_READY {m.header.get('byte_offset_in_buffer')!r}+{m.header.get('length')!r} is "
                            "outside the buffer, overlaps, or is for a transfer without an offer",
                            field="byte_offset_in_buffer" if off is None else "length",
                            value=m.header.get("byte_offset_in_buffer") if off is None else m.header.get("length"))
    return RdmaReady(tid, off, n)


def _reject(h: dict[str, Any]) -> Reject:
    return Reject(reason=_text(h.get("reason")), message=_text(h.get("message"), 400),
                  transfer_id=h["transfer_id"] if "transfer_id" in h else NO_ID)


def _credit(h: dict[str, Any]) -> Credit:
    n = h.get("n")
    return Credit(int(n) if isinstance(n, int) and 0 < n <= MAX_CREDIT_N else 0)


def decode(parts: Sequence[Any], allowed: frozenset[str]) -> LinkMessage:
    """One link message from its frames (``zmq.Frame`` or bytes; payloads stay views of them),
    of a verb in ``allowed`` (:data:`FROM_SENDER` or :data:`FROM_RECEIVER`). Raises ProtocolError
    (dropped) or TransferFault (answered), see the module's docstring."""
    m = decode_json(parts, PAYLOAD, allowed=allowed, views=True)
    h = m.header
    if m.verb == "LINK_HELLO":
        return _hello(h)
    if m.verb == "LINK_WELCOME":
        return _welcome(h)
    if m.verb == "LINK_PING":
        return LinkPing()
    if m.verb == "LINK_PONG":
        return LinkPong()
    if m.verb == "CREDIT":
        return _credit(h)
    if m.verb == "REJECT":
        return _reject(h)
    if m.verb == "TENSOR_DESCRIPTOR":
        return _descriptor(m)
    if m.verb == "TENSOR_DATA":
        return _data(m)
    if m.verb == "TENSOR_DATA_END":
        return TensorDataEnd(_transfer_id(m), _int(h.get("total_bytes")))
    if m.verb == "RDMA_REGISTER":
        return RdmaRegister(h.get("transfer_id"), {k: v for k, v in h.items() if k != "transfer_id"},
                            bytes(m.frames["metadata"]))
    if m.verb == "RDMA_READY":
        return _ready(m)
    raise ProtocolError("unknown_verb", f"{m.verb!r} is not a link verb")

