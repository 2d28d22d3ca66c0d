"""Hurray IPC: zero-copy, race-free handoff of GPU and host buffers between processes.

Producer side: ``Producer(endpoint, channel, device).send(obj)`` hands an array (numpy, torch,
CuPy, anything with ``__cuda_array_interface__``, ``__dlpack__`` or the buffer protocol) to the
next consumer that asks, ordered after the writes on its stream; the returned ``Ticket`` says
when the consumer released it. Consumer side: ``Consumer(...).receive()`` (or ``for h in
consumer``, or ``await consumer.areceive()``) gives a ``ReceivedHandoff``: ``h.wait(stream)``
orders your stream after the producer, ``h.numpy()`` / ``h.torch()`` / ``h.cupy()`` /
``h.buffer`` are zero-copy views, and ``h.release()`` (or ``with h:``) gives the buffer back
once your device work on it completed. See README.md and docs/spec/.

Errors: everything Hurray raises on purpose is a :class:`HurrayError`, and also the builtin a
numpy user expects (InvalidArgument is a ValueError, UnsupportedObject a TypeError, ExportRefused
a BufferError, HurrayTimeout a TimeoutError, EndOfStream an EOFError; see hurray_ipc.errors).

Layers, each importing only those below it::

    errors.py   the exception hierarchy (a leaf: imports nothing)
    notes.py    the Note a pure core reports events through (a leaf)
    format/     the 16-byte buffer handle                        (bottom)
    contract/   sync modes per transport; array metadata; the handoff object
    wire/       the messages' codecs (IPC, interchange link) and the one strict field validator
    devices/    CPU shared memory, CUDA (real or emulated backend); pools of device resources
    transport/  sockets, pairing, liveness, routes
    interop/    user objects in and out: CUDA Array Interface, DLPack, buffer protocol, staging
    interchange/ the bridge's sender and receiver rules, without I/O
    client/     Producer and Consumer
    cli/, broker/ (top)
"""

from typing import TYPE_CHECKING

from . import compiled as _compiled  # noqa: F401 - first: HURRAY_PURE must act before a compiled module loads
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
from .devices.errors import DeviceError
from .errors import (
    BrokerUnavailable,
    ClosedError,
    EndOfStream,
    ExportRefused,
    HurrayError,
    HurrayTimeout,
    InvalidArgument,
    MissingDependency,
    ProducerGone,
    RemoteError,
    UnsafeEndpoint,
    UnsupportedObject,
)
from .format import BufferHandle, DeviceTag, HandleError, ReservedSyncMode, SyncMode

__version__ = "0.1.0"

if TYPE_CHECKING:  # type checkers see the client names' real types; at run time they load lazily
    from .client import Consumer, Producer, ReceivedBuffer, ReceivedHandoff, Ticket

_CLIENT = ("Producer", "Consumer", "Ticket", "ReceivedHandoff", "ReceivedBuffer")


def __getattr__(name: str):
    # The client side pulls in ZeroMQ and the device layer; import it on first use.
    if name in _CLIENT:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'hurray_ipc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))  # help() and dir() list the lazy names too

__all__ = [
    "AlreadyReleasedError",
    "BrokerUnavailable",
    "BufferHandle",
    "ClosedError",
    "Consumer",
    "DeviceError",
    "DeviceTag",
    "EndOfStream",
    "EndpointCapabilities",
    "ExportRefused",
    "Handoff",
    "HandoffError",
    "HandleError",
    "HurrayError",
    "HurrayTimeout",
    "InvalidArgument",
    "MissingDependency",
    "Producer",
    "ProducerGone",
    "ReceivedBuffer",
    "ReceivedHandoff",
    "RemoteError",
    "ReservedSyncMode",
    "SyncMode",
    "Ticket",
    "Transport",
    "UnsafeEndpoint",
    "UnsupportedObject",
    "check_network_handle",
    "choose_sync_mode",
    "explain_sync_modes",
    "valid_sync_modes",
]
