"""What a producer's device and a consumer's device can share: the inputs of the sync contract.

The broker (for CAPS replies and to check a declared mode) and the producer (to choose one) both
call :func:`pair_modes`, so they can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..contract.sync import EndpointCapabilities, Transport, explain_sync_modes
from ..devices.base import DeviceCapabilities, DeviceIdentity
from ..format.handle import DeviceTag, SyncMode


@dataclass(frozen=True)
class Endpoint:
    """One side of a handoff: its device, what that device can do, its process, its stream."""

    identity: DeviceIdentity
    caps: DeviceCapabilities
    pid: int
    stream: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.identity.to_dict(), "caps": self.caps.to_dict(), "pid": self.pid, "stream": self.stream}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Endpoint":
        stream = d.get("stream")
        return cls(DeviceIdentity.from_dict(d["device"]), DeviceCapabilities.from_dict(d["caps"]), int(d["pid"]),
                   None if stream is None else int(stream))


def host_side(ep: Endpoint) -> Endpoint:
    """The endpoint as seen for a host-memory buffer it sends (a staged copy or a CPU object)."""
    if ep.identity.kind == "cpu":
        return ep
    ident = DeviceIdentity("cpu", 0, f"CPU-{ep.identity.host}", host=ep.identity.host)
    return Endpoint(ident, DeviceCapabilities(ipc_memory=True, ipc_events=False), ep.pid)


def transport_between(a: Endpoint, b: Endpoint) -> Transport:
    if a.identity.host != b.identity.host:
        return Transport.NETWORK
    return Transport.IN_PROCESS if a.pid == b.pid else Transport.IPC


def device_tag_of(identity: DeviceIdentity) -> DeviceTag:
    return DeviceTag.CPU if identity.kind == "cpu" else DeviceTag.CUDA


def share_memory(producer: Endpoint, consumer: Endpoint, transport: Transport) -> EndpointCapabilities:
    """The capabilities of the pair for a buffer on the producer's device."""
    p, c = producer.identity, consumer.identity
    if transport is Transport.NETWORK:
        return EndpointCapabilities(False, False, False, "producer and consumer are on different hosts")
    if p.kind == "cpu":
        return EndpointCapabilities(True, False, False)
    why = ""
    if c.kind == "cpu":
        why = "consumer has no GPU"
    elif p.emulated != c.emulated:
        why = "one side runs emulated CUDA and the other real CUDA"
    elif transport is Transport.IPC and not producer.caps.ipc_memory:
        why = "device has no IPC memory support"
    elif c.uuid != p.uuid and c.uuid not in producer.caps.peers:
        why = "consumer on another GPU without peer access"
    events = transport is Transport.IN_PROCESS or (producer.caps.ipc_events and consumer.caps.ipc_events)
    streams = transport is Transport.IN_PROCESS or (producer.caps.ipc_streams and consumer.caps.ipc_streams)
    return EndpointCapabilities(not why, events, streams, why)


@dataclass(frozen=True)
class PairModes:
    transport: Transport
    device_tag: DeviceTag
    reasons: dict[SyncMode, str | None]

    @property
    def valid(self) -> frozenset[SyncMode]:
        return frozenset(m for m, why in self.reasons.items() if why is None)

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
    """Valid sync modes for a buffer on ``producer``'s device handed to ``consumer`` (ADR-018 §6).

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
