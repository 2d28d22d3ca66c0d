"""Hurray IPC: zero-copy, race-free handoff of GPU and host buffers between processes.

Layers, each importing only those below it::

    format/     the 16-byte buffer handle                        (bottom)
    contract/   sync modes per transport; the handoff object
    devices/    CPU shared memory, CUDA (real or emulated backend)
    transport/  the IPC wire protocol: messages, sockets, pairing, liveness
    interop/    user objects in and out: CUDA Array Interface, DLPack, buffer protocol, staging
    client/     Producer and Consumer
    cli/, broker/ (top; broker/ installs as hurray_ipc.broker)
"""

from .contract import (
    AlreadyReleasedError,
    EndpointCapabilities,
    Handoff,
    HandoffError,
    Transport,
    check_network_handle,
    choose_sync_mode,
    explain_sync_modes,
    valid_sync_modes,
)
from .format import BufferHandle, DeviceTag, HandleError, ReservedSyncMode, SyncMode

__version__ = "0.1.0"


def __getattr__(name: str):
    # Producer and Consumer pull in ZeroMQ and the device layer; import them on first use.
    if name in ("Producer", "Consumer", "BrokerUnavailable", "ProducerGone", "RemoteError"):
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'hurray_ipc' has no attribute {name!r}")

__all__ = [
    "AlreadyReleasedError",
    "BrokerUnavailable",
    "BufferHandle",
    "Consumer",
    "DeviceTag",
    "EndpointCapabilities",
    "Handoff",
    "HandoffError",
    "HandleError",
    "Producer",
    "ProducerGone",
    "RemoteError",
    "ReservedSyncMode",
    "SyncMode",
    "Transport",
    "check_network_handle",
    "choose_sync_mode",
    "explain_sync_modes",
    "valid_sync_modes",
]
