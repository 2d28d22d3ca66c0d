"""Wire formats: the 16-byte buffer handle. The bottom layer; imports nothing else of the package."""

from .handle import (
    HANDLE_ERROR_REASONS,
    HANDLE_SIZE,
    BufferHandle,
    DeviceTag,
    HandleError,
    ReservedSyncMode,
    SyncMode,
)

__all__ = [
    "HANDLE_ERROR_REASONS",
    "HANDLE_SIZE",
    "BufferHandle",
    "DeviceTag",
    "HandleError",
    "ReservedSyncMode",
    "SyncMode",
]
