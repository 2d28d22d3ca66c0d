"""What a producer's device and a consumer's device can share: the inputs of the sync contract.

The broker (for CAPS replies and to check a declared mode) and the producer (to choose one) both
call :func:`pair_modes`, so they can never disagree.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..contract.sync import EndpointCapabilities, Transport, explain_sync_modes
from ..devices.base import DeviceCapabilities, DeviceIdentity
from ..format.handle import DeviceTag, SyncMode
from ..wire.fields import FieldError, check, obj, take


@dataclass(frozen=True)
class Endpoint:
    """One side of a handoff: its device, what that device can do, its process, its stream."""

    identity: DeviceIdentity
    caps: DeviceCapabilities
    pid: int
    stream: int | None = None

    def __hash__(self) -> int:
        # Computed once: endpoints key the mode cache on every handoff, and a frozen dataclass's
        # generated hash walks every nested field each time.
        h: int | None = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.identity, self.caps, self.pid, self.stream))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (spawn arguments, a queue) without what this process cached on it: str hashes
        # differ from process to process, so a copied _hash would file the endpoint wrongly there.
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_host_side")}

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.identity.to_dict(), "caps": self.caps.to_dict(), "pid": self.pid, "stream": self.stream}

    @classmethod
    def from_dict(cls, d: Any) -> Endpoint:
        """Parse the wire form strictly (docs/spec/ipc-protocol.md §3): ValueError naming the
        field and its value for anything of the wrong type or out of range; nothing is coerced."""
        o = obj(d, "endpoint")
        dev = obj(o.get("device"), "endpoint.device")
        caps = obj(o.get("caps"), "endpoint.caps")
        kind = take(dev, "endpoint.device.kind", str, max_len=_MAX_STR)
        if kind not in ("cpu", "cuda"):
            raise FieldError("endpoint.device.kind", f"must be 'cpu' or 'cuda', got {kind[:32]!r}", kind)
        uuid = take(dev, "endpoint.device.uuid", (str, type(None)), "", max_len=_MAX_STR)
        ident = DeviceIdentity(kind, take(dev, "endpoint.device.ordinal", int, lo=0, hi=1023),
                               uuid or "", take(dev, "endpoint.device.pci_bus_id", str, "", max_len=_MAX_STR),
                               take(dev, "endpoint.device.emulated", bool, False),
                               take(dev, "endpoint.device.host", str, "", max_len=_MAX_STR))
        peers = take(caps, "endpoint.caps.peers", list, [], max_len=64)
        for i, p in enumerate(peers):
            check(p, f"endpoint.caps.peers.{i}", str, max_len=_MAX_STR)
        why_not = take(caps, "endpoint.caps.why_not", (dict, type(None)), None) or {}
        if len(why_not) > 16:
            raise FieldError("endpoint.caps.why_not", f"must map at most 16 capabilities, got {len(why_not)}")
        for k, v in why_not.items():
            check(v, f"endpoint.caps.why_not.{k[:32]}", str, max_len=1024)
        cap = DeviceCapabilities(take(caps, "endpoint.caps.ipc_memory", bool),
                                 take(caps, "endpoint.caps.ipc_events", bool),
                                 take(caps, "endpoint.caps.ipc_streams", bool, False), tuple(peers),
                                 tuple((str(k), v) for k, v in why_not.items()))
        return cls(ident, cap, take(o, "endpoint.pid", int, lo=1, hi=2**31 - 1),
                   take(o, "endpoint.stream", (int, type(None)), None, lo=0, hi=2**64 - 1))


_MAX_STR = 256


def host_side(ep: Endpoint) -> Endpoint:
    """The endpoint as seen for a host-memory buffer it sends (a staged copy or a CPU object).

    The same object for the same ``ep`` every time (kept on ``ep``), so :class:`ModeCache`'s
    identity fast path serves a GPU producer's host-staged handoffs too."""
    if ep.identity.kind == "cpu":
        return ep
    host: Endpoint | None = ep.__dict__.get("_host_side")
    if host is None:
        ident = DeviceIdentity("cpu", 0, f"CPU-{ep.identity.host}", host=ep.identity.host)
        host = Endpoint(ident, DeviceCapabilities(ipc_memory=True, ipc_events=False), ep.pid)
        object.__setattr__(ep, "_host_side", host)
    return host


def transport_between(a: Endpoint, b: Endpoint) -> Transport:
    if a.identity.host != b.identity.host:
        return Transport.NETWORK
    return Transport.IN_PROCESS if a.pid == b.pid else Transport.IPC


def device_tag_of(identity: DeviceIdentity) -> DeviceTag:
    return DeviceTag.CPU if identity.kind == "cpu" else DeviceTag.CUDA


def share_memory(producer: Endpoint, consumer: Endpoint, transport: Transport) -> EndpointCapabilities:
    """The capabilities of the pair for a buffer on the producer's device."""
    p, c = producer.identity, consumer.identity
    if transport is Transport.NETWORK or p.host != c.host:
        # Whatever transport was asked about: memory, events and streams never cross hosts.
        return EndpointCapabilities(False, False, False, "producer and consumer are on different hosts")
    if p.kind == "cpu":
        return EndpointCapabilities(True, False, False)
    why = ""
    if c.kind == "cpu":
        why = "consumer has no GPU"
    elif p.emulated != c.emulated:
        why = "one side runs emulated CUDA and the other real CUDA"
    elif transport is Transport.IPC and not producer.caps.ipc_memory:
        probe = dict(producer.caps.why_not).get("ipc_memory")
        why = "device has no IPC memory support" + (f" ({probe})" if probe else "")
    elif c.uuid != p.uuid and c.uuid not in producer.caps.peers:
        why = "consumer on another GPU without peer access"
    events = transport is Transport.IN_PROCESS or (producer.caps.ipc_events and consumer.caps.ipc_events)
    streams = transport is Transport.IN_PROCESS or (producer.caps.ipc_streams and consumer.caps.ipc_streams)
    # The device probe's own words (e.g. the CUDA error), from whichever side lacks IPC events.
    events_why = next((dict(ep.caps.why_not).get("ipc_events", "") for ep in (producer, consumer)
                       if not ep.caps.ipc_events), "") if not events else ""
    return EndpointCapabilities(not why, events, streams, why, events_why)


@dataclass(frozen=True)
class PairModes:
    transport: Transport
    device_tag: DeviceTag
    reasons: dict[SyncMode, str | None]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_valid", frozenset(m for m, why in self.reasons.items() if why is None))

    @property
    def valid(self) -> frozenset[SyncMode]:
        v: frozenset[SyncMode] = self.__dict__["_valid"]
        return v

    @property
    def host_staged(self) -> bool:
        """No mode valid for a GPU buffer: the producer stages through host shared memory."""
        return self.device_tag is not DeviceTag.CPU and not self.valid

    def to_dict(self) -> dict[str, Any]:
        order = [SyncMode.PRODUCER_SYNCED, SyncMode.EVENT, SyncMode.CONSUMER_STREAM]
        return {
            "transport": self.transport.value,
            "device_tag": self.device_tag.name,
            "valid_sync_modes": [m.wire_name for m in order if self.reasons[m] is None],
            "excluded": {m.wire_name: self.reasons[m] for m in order if self.reasons[m] is not None},
            "host_staged": self.host_staged,
        }


def pair_modes(producer: Endpoint, consumer: Endpoint, transport: Transport | None = None) -> PairModes:
    """Valid sync modes for a buffer on ``producer``'s device handed to ``consumer`` (sync-contract §5).

    Where the memory is not shareable at all (another host's process, a CPU-only consumer of a GPU
    buffer, another GPU without peer access) every mode is excluded and the handoff is host-staged,
    in-process too: the contract's in-process rule assumes the consumer can address the memory.
    """
    t = transport or transport_between(producer, consumer)
    tag = device_tag_of(producer.identity)
    caps = share_memory(producer, consumer, t)
    if tag is not DeviceTag.CPU and not caps.shared_memory and t is not Transport.NETWORK:
        return PairModes(t, tag, {m: caps.memory_reason for m in SyncMode})
    reasons = explain_sync_modes(tag, t, caps, consumer_stream=consumer.stream is not None)
    return PairModes(t, tag, reasons)


class ModeCache:
    """:func:`pair_modes` remembered per (producer endpoint, consumer endpoint), bounded.

    Keyed by the endpoints' values, never by object identity alone: a client that re-registers
    with another device gets a fresh answer, and two clients with equal endpoints share one. The
    value-keyed part evicts the pair least recently computed or looked up by value.

    In front of that sits a fast path keyed by the two objects' identities, because the broker
    and the producer ask once per handoff, nearly always with the same two objects, and the value
    key hashes both endpoints in Python each time. An identity entry holds its two endpoints
    alive, so no other object can take either id while it stands, and endpoints are immutable,
    so an entry can never go stale. It is bounded by the same ``size`` and emptied whenever the
    value-keyed part evicts.

    Safe from several threads (a producer's senders call it outside the session lock): a fast-path
    entry is written whole, and the value-keyed part is looked up and evicted under a lock.
    """

    def __init__(self, size: int = 4096):
        self.size = size
        self._hits: OrderedDict[tuple[Endpoint, Endpoint], PairModes] = OrderedDict()
        self._by_id: dict[tuple[int, int], tuple[Endpoint, Endpoint, PairModes]] = {}
        self._lock = threading.Lock()

    def get(self, producer: Endpoint, consumer: Endpoint) -> PairModes:
        ids = (id(producer), id(consumer))
        fast = self._by_id.get(ids)
        if fast is not None:
            return fast[2]
        key = (producer, consumer)
        with self._lock:
            pm = self._hits.get(key)
            if pm is None:
                pm = self._hits[key] = pair_modes(producer, consumer)
                if len(self._hits) > self.size:
                    self._hits.popitem(last=False)
                    self._by_id.clear()
            else:
                self._hits.move_to_end(key)
            if len(self._by_id) >= self.size:
                self._by_id.clear()
            self._by_id[ids] = (producer, consumer, pm)
        return pm
