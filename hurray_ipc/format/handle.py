"""The 16-byte buffer handle (docs/spec/buffer-handle.md).

Layout, every multi-byte field little-endian::

    offset size field       rule
    0      8    size        u64, buffer length in bytes (0 allowed)
    8      4    alignment   u32, power of two >= 1
    12     1    device_tag  DeviceTag, 0x09-0xFF rejected
    13     1    sync_mode   SyncMode, 0x03-0xFE reserved, 0xFF invalid
    14     2    _reserved   zero

This module is the bottom of the package: it imports nothing else from it but the leaf
``hurray_ipc.errors``.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from ..errors import HurrayError, InvalidArgument

HANDLE_SIZE = 16
_LAYOUT = struct.Struct("<QIBB2s")
assert _LAYOUT.size == HANDLE_SIZE

_DECODED: dict[bytes, BufferHandle] = {}  # valid encodings seen lately: a steady stream repeats a few
_DECODED_MAX = 4096
_U64_MAX = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1


class HandleError(HurrayError, ValueError):
    """A buffer handle that violates the layout rules.

    ``reason`` is machine-readable (one of :data:`HANDLE_ERROR_REASONS`); the message names the
    field, its byte offset and the offending value.
    """

    def __init__(self, reason: str, field: str, offset: int | None, value: object, detail: str):
        self.reason = reason
        self.field = field
        self.offset = offset
        self.value = value
        where = f"field '{field}'" + (f" at offset {offset}" if offset is not None else "")
        super().__init__(f"buffer handle: {where}: value {value!r} {detail} [{reason}]")


HANDLE_ERROR_REASONS = frozenset(
    {
        "length",  # not exactly 16 bytes
        "size",  # size outside u64 (encode only)
        "alignment",  # 0, not a power of two, or outside u32
        "device_tag",  # unknown / reserved device tag
        "sync_mode_reserved",  # 0x03-0xFE
        "sync_mode_invalid",  # 0xFF
        "reserved_nonzero",  # bytes 14-15 not zero
        "cpu_sync_mode",  # CPU buffer whose sync_mode is not PRODUCER_SYNCED
        "network_sync_mode",  # cross-machine handle whose sync_mode is not PRODUCER_SYNCED
    }
)


class DeviceTag(enum.IntEnum):
    """Where the buffer's bytes live (offset 12)."""

    CPU = 0x00
    CUDA = 0x01
    CUDA_HOST = 0x02  # page-locked host memory registered with CUDA
    ROCM = 0x03
    METAL = 0x04
    VULKAN = 0x05
    LEVEL_ZERO = 0x06
    OPENCL = 0x07
    WEBGPU = 0x08

    @classmethod
    def parse(cls, value: int) -> DeviceTag:
        """Return the tag for a raw byte, raising :class:`HandleError` for 0x09-0xFF."""
        try:
            return cls(value)
        except ValueError:
            raise HandleError(
                "device_tag", "device_tag", 12, value, "is reserved (0x09-0xFF); readers reject it"
            ) from None


@dataclass(frozen=True)
class ReservedSyncMode:
    """A sync_mode byte that names no mode of this format version (0x03-0xFE, or 0xFF).

    Decoders report it (``HandleError.value``) so a caller can see exactly what arrived;
    a :class:`BufferHandle` can never carry one.
    """

    value: int

    @property
    def invalid(self) -> bool:
        """True for 0xFF, which is invalid forever (not merely reserved for later versions)."""
        return self.value == 0xFF


class SyncMode(enum.IntEnum):
    """How the producer made its device writes visible before handoff (offset 13, docs/spec/buffer-handle.md)."""

    PRODUCER_SYNCED = 0x00
    EVENT = 0x01
    CONSUMER_STREAM = 0x02
    # The spec's names (what every CLI prints), as aliases: SyncMode.SYNC_EVENT is SyncMode.EVENT.
    SYNC_PRODUCER_SYNCED = 0x00
    SYNC_EVENT = 0x01
    SYNC_CONSUMER_STREAM = 0x02

    @property
    def wire_name(self) -> str:
        """The spec's name, e.g. ``SYNC_EVENT``."""
        return "SYNC_" + self.name

    @classmethod
    def parse(cls, value: int) -> SyncMode | ReservedSyncMode:
        """Map a raw byte to a mode, or to a :class:`ReservedSyncMode` carrier; never raises."""
        try:
            return cls(value)
        except ValueError:
            return ReservedSyncMode(value)

    @classmethod
    def from_name(cls, name: str, where: str | None = None) -> SyncMode:
        """Accept ``SYNC_EVENT``, ``EVENT`` or ``event``; InvalidArgument (naming ``where``) otherwise."""
        key = name.strip().upper()
        key = key[5:] if key.startswith("SYNC_") else key
        key = key.replace("-", "_")
        try:
            return cls[key]
        except KeyError:
            names = ", ".join(m.wire_name for m in cls)
            raise InvalidArgument(f"unknown sync mode {name!r}; expected one of {names}", where=where,
                                  value=name) from None


def _require_mode(value: object) -> SyncMode:
    if isinstance(value, SyncMode):
        return value
    raw = value.value if isinstance(value, ReservedSyncMode) else value
    if not isinstance(raw, int) or isinstance(raw, bool):
        raise HandleError("sync_mode_invalid", "sync_mode", 13, value, "is not a sync mode")
    parsed = SyncMode.parse(raw)
    if isinstance(parsed, ReservedSyncMode):
        if parsed.invalid:
            raise HandleError("sync_mode_invalid", "sync_mode", 13, raw, "is invalid (0xFF)")
        raise HandleError(
            "sync_mode_reserved", "sync_mode", 13, raw, "is reserved (0x03-0xFE) in format version 1"
        )
    return parsed


def _check_alignment(a: object) -> None:
    if not isinstance(a, int) or isinstance(a, bool) or not 1 <= a <= _U32_MAX or a & (a - 1):
        raise HandleError("alignment", "alignment", 8, a, "is not a power of two >= 1 that fits a u32")


@dataclass(frozen=True)
class BufferHandle:
    """Size, alignment, device and synchronisation declaration of one buffer.

    Constructing a handle validates it, so a handle that exists is always encodable and every
    decoder that follows the spec accepts its encoding.
    """

    size: int
    alignment: int
    device_tag: DeviceTag
    sync_mode: SyncMode = SyncMode.PRODUCER_SYNCED

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or not 0 <= self.size <= _U64_MAX:
            raise HandleError("size", "size", 0, self.size, "is not a u64")
        _check_alignment(self.alignment)
        tag = self.device_tag if isinstance(self.device_tag, DeviceTag) else DeviceTag.parse(self.device_tag)
        mode = _require_mode(self.sync_mode)
        if tag is DeviceTag.CPU and mode is not SyncMode.PRODUCER_SYNCED:
            raise HandleError(
                "cpu_sync_mode", "sync_mode", 13, int(mode),
                "is not allowed for a CPU buffer (CPU buffers MUST be SYNC_PRODUCER_SYNCED)",
            )
        object.__setattr__(self, "device_tag", tag)
        object.__setattr__(self, "sync_mode", mode)

    def encode(self) -> bytes:
        """The 16 wire bytes."""
        raw: bytes | None = self.__dict__.get("_raw")
        if raw is None:
            raw = _LAYOUT.pack(self.size, self.alignment, int(self.device_tag), int(self.sync_mode), b"\0\0")
            object.__setattr__(self, "_raw", raw)
        return raw

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> BufferHandle:
        """Parse 16 bytes, rejecting every pattern the spec makes invalid (see HandleError.reason)."""
        raw = bytes(data)
        hit = _DECODED.get(raw)
        if hit is not None:  # handles are immutable and decoding is a pure function of the bytes
            return hit
        if len(raw) != HANDLE_SIZE:
            raise HandleError("length", "handle", None, len(raw), f"bytes given; a handle is exactly {HANDLE_SIZE}")
        size, alignment, tag, mode, reserved = _LAYOUT.unpack(raw)
        # The order of the checks (field order, then the CPU rule) is part of the spec, so every
        # reader reports the same reason for the same bytes.
        _check_alignment(alignment)
        device_tag = DeviceTag.parse(tag)
        sync_mode = _require_mode(mode)
        if reserved != b"\0\0":
            raise HandleError("reserved_nonzero", "_reserved", 14, reserved.hex(), "must be zero")
        handle = cls(size, alignment, device_tag, sync_mode)
        if len(_DECODED) >= _DECODED_MAX:
            _DECODED.clear()
        _DECODED[raw] = handle
        return handle

    def with_sync_mode(self, mode: SyncMode) -> BufferHandle:
        return BufferHandle(self.size, self.alignment, self.device_tag, mode)

    def to_dict(self) -> dict[str, object]:
        return {
            "size": self.size,
            "alignment": self.alignment,
            "device_tag": self.device_tag.name,
            "device_tag_raw": int(self.device_tag),
            "sync_mode": self.sync_mode.wire_name,
            "sync_mode_raw": int(self.sync_mode),
        }
