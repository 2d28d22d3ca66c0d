"""The CUDA runtime surface the device layer uses, as one abstract class.

Two backends implement it: :mod:`.real` (cuda.bindings.runtime) and :mod:`.emulated` (a
cross-process emulation for machines without a GPU). :func:`hurray_ipc.devices.backend.get_runtime`
chooses between them in one place, from ``HURRAY_CUDA``.

Pointers (device and host) are ints. Streams and events are opaque objects owned by the backend;
``stream_id`` gives the integer a ``__cuda_array_interface__`` consumer expects. Every method
raises :class:`~hurray_ipc.devices.errors.DeviceError` naming the CUDA call and error on failure.
IPC blobs are exactly :data:`IPC_HANDLE_SIZE` bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from ..errors import DeviceError

IPC_HANDLE_SIZE = 64
EMULATED_MAGIC = b"HRYEMU"  # every emulated IPC blob starts with it; the real backend refuses them


class Runtime(ABC):
    name: str  # "real" or "emulated"
    emulated: bool

    # --- devices -------------------------------------------------------------------------------
    @abstractmethod
    def probe(self) -> str | None:
        """None when usable, else why not (e.g. 'cudaGetDeviceCount: cudaErrorInsufficientDriver')."""

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def set_device(self, ordinal: int) -> None: ...

    @abstractmethod
    def get_device(self) -> int:
        """The calling thread's current device (cudaGetDevice)."""

    @abstractmethod
    def device_uuid(self, ordinal: int) -> str: ...

    @abstractmethod
    def pci_bus_id(self, ordinal: int) -> str: ...

    @abstractmethod
    def ipc_memory_support(self, ordinal: int) -> bool:
        """Whether cudaIpcGetMemHandle / cudaIpcOpenMemHandle work for this device."""

    @abstractmethod
    def ipc_event_support(self, ordinal: int) -> bool:
        """Whether interprocess events work (cudaDevAttrIpcEventSupport, and an exportable event)."""

    def unsupported_reason(self, ordinal: int, capability: str) -> str | None:
        """Why ``capability`` ('ipc_memory', 'ipc_events') is unsupported, if a probe said why."""
        return None

    def host_register_support(self, ordinal: int) -> bool:
        """cudaDevAttrHostRegisterSupported: whether cudaHostRegister can page-lock memory."""
        return False

    @abstractmethod
    def can_access_peer(self, ordinal: int, peer: int) -> bool: ...

    # --- memory --------------------------------------------------------------------------------
    @abstractmethod
    def malloc(self, nbytes: int) -> int: ...

    @abstractmethod
    def free(self, ptr: int) -> None: ...

    @abstractmethod
    def mem_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation containing ``ptr``."""

    @abstractmethod
    def ipc_get_mem_handle(self, base: int) -> bytes:
        """The 64-byte cudaIpcMemHandle of the allocation starting at ``base``."""

    @abstractmethod
    def ipc_open_mem_handle(self, blob: bytes) -> int:
        """Map another process's allocation; returns its base in this process."""

    @abstractmethod
    def ipc_close_mem_handle(self, base: int) -> None: ...

    @abstractmethod
    def host_register(self, ptr: int, nbytes: int) -> None:
        """Page-lock host memory (cudaHostRegister) so copies from/to it run at DMA speed."""

    @abstractmethod
    def host_unregister(self, ptr: int) -> None: ...

    # --- streams -------------------------------------------------------------------------------
    @abstractmethod
    def stream_create(self) -> Any: ...

    @abstractmethod
    def stream_destroy(self, stream: Any) -> None: ...

    @abstractmethod
    def stream_synchronize(self, stream: Any) -> None: ...

    @abstractmethod
    def stream_query(self, stream: Any) -> bool:
        """True when all work enqueued on ``stream`` has completed."""

    @abstractmethod
    def stream_wait_event(self, stream: Any, event: Any) -> None:
        """Order later work on ``stream`` after the event's latest record at the time of this call."""

    @abstractmethod
    def stream_id(self, stream: Any) -> int: ...

    @abstractmethod
    def stream_from_id(self, ident: int) -> Any:
        """The stream a ``__cuda_array_interface__`` names by integer (1, 2: the default streams)."""

    @abstractmethod
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """cudaMemcpyAsync with cudaMemcpyDefault (unified addressing infers the direction)."""

    @abstractmethod
    def memset_async(self, ptr: int, value: int, nbytes: int, stream: Any) -> None: ...

    # --- events --------------------------------------------------------------------------------
    @abstractmethod
    def event_create(self, interprocess: bool) -> Any:
        """interprocess=True: cudaEventInterprocess | cudaEventDisableTiming."""

    @abstractmethod
    def event_destroy(self, event: Any) -> None: ...

    @abstractmethod
    def event_record(self, event: Any, stream: Any) -> None: ...

    @abstractmethod
    def event_synchronize(self, event: Any) -> None: ...

    @abstractmethod
    def event_query(self, event: Any) -> bool: ...

    @abstractmethod
    def ipc_get_event_handle(self, event: Any) -> bytes: ...

    @abstractmethod
    def ipc_open_event_handle(self, blob: bytes) -> Any: ...

    # --- GPUDirect RDMA: inbound NIC writes into device memory (interchange.md R5) ----------------
    # A NIC writing device memory (NIXL WRITE into a VRAM region) is not ordered before the
    # device's later kernels by anything the sender does: the receiver makes the writes visible
    # (cudaDeviceFlushGPUDirectRDMAWrites) before anything on the device reads them.
    def rdma_write_ordering(self, ordinal: int) -> str | None:
        """Why inbound NIC writes to ``ordinal``'s memory cannot be made visible to its kernels here
        (None: they can, the device orders them or :meth:`flush_rdma_writes` does)."""
        return "this runtime has no GPUDirect RDMA"

    def rdma_expose(self, ptr: int) -> None:
        """``ptr``'s allocation is about to be offered to a NIC for writes."""

    def rdma_source(self, ptr: int, nbytes: int) -> None:
        """A NIC is about to read ``[ptr, ptr + nbytes)`` of device memory (a NIXL WRITE's source):
        the writes to it must have retired, as for a host read (sync-contract §5). Real CUDA: nothing to do."""

    def flush_rdma_writes(self) -> None:
        """Block until every NIC write to the current device's memory issued so far is visible to
        the device (a no-op where the device orders them itself)."""
        raise DeviceError("cudaDeviceFlushGPUDirectRDMAWrites", "this runtime has no GPUDirect RDMA")

    # --- happens-before annotations ---------------------------------------------------------------
    # A message between two processes orders the receiver's later host program after the
    # sender's host program before the send. CUDA needs no help with that; the emulation's race
    # checker does, since it cannot see sockets. Real CUDA: nothing to do.
    def hb_send(self, key: str) -> None:
        """The host is about to send the message named ``key`` to another process."""

    def hb_receive(self, key: str) -> bool:
        """The message named ``key`` arrived (True when the checker knew of it)."""
        return False

    def hb_forget(self, key: str) -> None:
        """The message named ``key`` will never be received (its handoff ended another way)."""

    def hb_publish_host(self, ptr: int, nbytes: int, what: str) -> None:
        """Host memory ``[ptr, ptr + nbytes)`` leaves with the next message: the receiver's host
        reads it once that message arrives (a host-staged copy). Every device write to it must have
        retired before now, by a host wait (sync-contract §5). Real CUDA: nothing to check."""


def check_blob(blob: bytes, what: str, *, emulated: bool) -> bytes:
    """Refuse a blob of the wrong length or from the other backend."""
    from ..errors import DeviceError

    raw = bytes(blob)
    if len(raw) != IPC_HANDLE_SIZE:
        raise DeviceError(what, f"an IPC handle is {IPC_HANDLE_SIZE} bytes, got {len(raw)}")
    if raw.startswith(EMULATED_MAGIC) != emulated:
        side = "an emulated-CUDA handle given to the real CUDA runtime" if not emulated else (
            "a handle that is not from the emulated runtime (a real CUDA handle?)")
        raise DeviceError(what, side)
    return raw
