"""Which sync modes are valid for a device on a transport (docs/spec/sync-contract.md §5).

Pure functions over plain data: no devices, no sockets. The broker, the producer and
``hurray-caps`` all ask these functions, so there is one statement of the rules.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import InvalidArgument
from ..format.handle import BufferHandle, DeviceTag, HandleError, SyncMode


class Transport(enum.Enum):
    IN_PROCESS = "in-process"
    IPC = "ipc"
    NETWORK = "network"

    @classmethod
    def parse(cls, text: str) -> Transport:
        for t in cls:
            if text in (t.value, t.name, t.name.lower()):
                return t
        raise InvalidArgument(f"unknown transport {text!r}; expected one of {', '.join(t.value for t in cls)}")


@dataclass(frozen=True)
class EndpointCapabilities:
    """What the producer's and the consumer's ends can share, for one buffer's device.

    ``shared_memory``: the consumer can map the producer's buffer (CPU: same host; CUDA IPC:
    IPC memory supported and the consumer is on the same GPU or one with peer access).
    ``ipc_events``: the device can export events to another process.
    ``ipc_streams``: the device can export streams to another process (no CUDA device can).
    ``memory_reason``: why ``shared_memory`` is false, in words, for reports.
    """

    shared_memory: bool = True
    ipc_events: bool = False
    ipc_streams: bool = False
    memory_reason: str = ""
    events_reason: str = ""  # why ``ipc_events`` is false, when a device probe said (e.g. the CUDA error)


STREAMS_NOT_EXPORTABLE = "device streams are not IPC-exportable (CUDA streams never are)"
NO_IPC_EVENTS = "device has no IPC-exportable events"
NETWORK_ONLY_P1 = "cross-machine transports allow only SYNC_PRODUCER_SYNCED (sync-contract §5)"
CPU_ONLY_P1 = "CPU buffers MUST be SYNC_PRODUCER_SYNCED"
NO_CONSUMER_STREAM = "the consumer named no stream at request time"


def explain_sync_modes(
    device_tag: DeviceTag,
    transport: Transport,
    caps: EndpointCapabilities = EndpointCapabilities(),
    *,
    consumer_stream: bool = True,
) -> dict[SyncMode, str | None]:
    """For each mode, ``None`` when it is valid or the reason it is not.

    ``consumer_stream=False`` says the consumer named no stream, which rules out
    CONSUMER_STREAM even where the transport would allow it.
    All modes excluded means the producer MUST fall back to a host-staged copy.
    """
    out: dict[SyncMode, str | None] = {m: None for m in SyncMode}
    if device_tag is DeviceTag.CPU:
        out[SyncMode.EVENT] = out[SyncMode.CONSUMER_STREAM] = CPU_ONLY_P1
        if transport is Transport.IPC and not caps.shared_memory:
            out[SyncMode.PRODUCER_SYNCED] = caps.memory_reason or "memory is not shareable between the endpoints"
        return out
    if transport is Transport.NETWORK:
        out[SyncMode.EVENT] = out[SyncMode.CONSUMER_STREAM] = NETWORK_ONLY_P1
        return out
    if transport is Transport.IPC:
        if not caps.shared_memory:
            reason = caps.memory_reason or "device memory is not shareable between the endpoints"
            return {m: reason for m in SyncMode}
        if not caps.ipc_events:
            out[SyncMode.EVENT] = NO_IPC_EVENTS + (f" ({caps.events_reason})" if caps.events_reason else "")
        if not caps.ipc_streams:
            out[SyncMode.CONSUMER_STREAM] = STREAMS_NOT_EXPORTABLE
    if out[SyncMode.CONSUMER_STREAM] is None and not consumer_stream:
        out[SyncMode.CONSUMER_STREAM] = NO_CONSUMER_STREAM
    return out


def valid_sync_modes(
    device_tag: DeviceTag,
    transport: Transport,
    caps: EndpointCapabilities = EndpointCapabilities(),
    *,
    consumer_stream: bool = True,
) -> frozenset[SyncMode]:
    """The modes a producer may declare; empty means "host-staged copy" (sync-contract §5)."""
    reasons = explain_sync_modes(device_tag, transport, caps, consumer_stream=consumer_stream)
    return frozenset(m for m, why in reasons.items() if why is None)


# Cheapest first: EVENT never blocks the producer's stream and needs no consumer stream;
# CONSUMER_STREAM costs a device-side wait too but is only offered where asked for;
# PRODUCER_SYNCED stalls the producer's host thread.
PREFERENCE = (SyncMode.EVENT, SyncMode.CONSUMER_STREAM, SyncMode.PRODUCER_SYNCED)


def choose_sync_mode(valid: frozenset[SyncMode], preferred: SyncMode | None = None) -> SyncMode | None:
    """The mode a producer declares: ``preferred`` if valid, else the cheapest valid; None: stage."""
    if preferred is not None and preferred in valid:
        return preferred
    for mode in PREFERENCE:
        if mode in valid:
            return mode
    return None


def check_network_handle(handle: BufferHandle) -> BufferHandle:
    """Reject a cross-machine descriptor whose handle declares anything but PRODUCER_SYNCED."""
    if handle.sync_mode is not SyncMode.PRODUCER_SYNCED:
        raise HandleError(
            "network_sync_mode", "sync_mode", 13, int(handle.sync_mode),
            f"({handle.sync_mode.wire_name}) is forbidden across machines; only SYNC_PRODUCER_SYNCED is valid",
        )
    return handle


def consumer_obligation(mode: SyncMode) -> str:
    """What a consumer MUST do before and after touching a buffer declared with ``mode``."""
    return {
        SyncMode.PRODUCER_SYNCED: (
            "the producer host-waited its stream: the buffer may be accessed immediately on any stream; "
            "release the buffer once your own device work on it has completed"
        ),
        SyncMode.EVENT: (
            "retrieve the producer's event, issue a stream-wait on it on every stream that will access the "
            "buffer before enqueuing work on it, then release the event exactly once; release the buffer "
            "after your device work on it has completed"
        ),
        SyncMode.CONSUMER_STREAM: (
            "the producer made the stream you named at request time wait: access the buffer on that stream; "
            "any other stream MUST first wait on it; release the buffer after your device work has completed"
        ),
    }[mode]
