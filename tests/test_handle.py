"""The buffer handle: spec vectors and property tests over every byte-pattern class."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hurray_ipc import BufferHandle, DeviceTag, HandleError, ReservedSyncMode, SyncMode
from hurray_ipc.format import HANDLE_ERROR_REASONS

VECTORS = json.loads((Path(__file__).parent / "vectors" / "buffer_handles.json").read_text())


@pytest.mark.parametrize("vec", VECTORS["valid"], ids=lambda v: v["name"])
def test_valid_vectors_decode_and_reencode(vec):
    h = BufferHandle.decode(bytes.fromhex(vec["hex"]))
    assert h.size == vec["size"]
    assert h.alignment == vec["alignment"]
    assert h.device_tag.name == vec["device_tag"] and int(h.device_tag) == vec["device_tag_raw"]
    assert h.sync_mode.wire_name == vec["sync_mode"] and int(h.sync_mode) == vec["sync_mode_raw"]
    assert h.encode().hex() == vec["hex"]


@pytest.mark.parametrize("vec", VECTORS["invalid"], ids=lambda v: v["name"])
def test_invalid_vectors_rejected_with_reason(vec):
    with pytest.raises(HandleError) as ei:
        BufferHandle.decode(bytes.fromhex(vec["hex"]))
    e = ei.value
    assert e.reason == vec["reason"]
    assert e.field == vec["field"]
    assert e.offset == vec["offset"]
    assert vec["field"] in str(e)
    assert e.reason in HANDLE_ERROR_REASONS


def test_byte_order_is_little_endian():
    raw = BufferHandle(0x0102030405060708, 0x10, DeviceTag.LEVEL_ZERO, SyncMode.CONSUMER_STREAM).encode()
    assert raw[:8] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert raw[8:12] == bytes([0x10, 0, 0, 0])
    assert raw[12:] == bytes([6, 2, 0, 0])


def test_error_message_names_field_offset_value():
    with pytest.raises(HandleError) as ei:
        BufferHandle.decode(struct.pack("<QIBB2s", 1, 6, 1, 0, b"\0\0"))
    msg = str(ei.value)
    assert "'alignment'" in msg and "offset 8" in msg and "6" in msg


def test_reserved_carrier_reports_what_was_seen():
    assert SyncMode.parse(0x01) is SyncMode.EVENT
    r = SyncMode.parse(0x42)
    assert r == ReservedSyncMode(0x42) and not r.invalid
    assert SyncMode.parse(0xFF).invalid
    with pytest.raises(HandleError) as ei:
        BufferHandle.decode(struct.pack("<QIBB2s", 1, 1, 1, 0x42, b"\0\0"))
    assert ei.value.value == 0x42


def test_producers_cannot_construct_reserved_or_cpu_event():
    with pytest.raises(HandleError, match="sync_mode_reserved"):
        BufferHandle(1, 1, DeviceTag.CUDA, ReservedSyncMode(3))  # type: ignore[arg-type]
    with pytest.raises(HandleError, match="sync_mode_invalid"):
        BufferHandle(1, 1, DeviceTag.CUDA, 0xFF)  # type: ignore[arg-type]
    with pytest.raises(HandleError, match="cpu_sync_mode"):
        BufferHandle(1, 1, DeviceTag.CPU, SyncMode.EVENT)
    with pytest.raises(HandleError, match="size"):
        BufferHandle(-1, 1, DeviceTag.CPU)
    with pytest.raises(HandleError, match="size"):
        BufferHandle(1 << 64, 1, DeviceTag.CPU)
    with pytest.raises(HandleError, match="device_tag"):
        BufferHandle(1, 1, 0x20)  # type: ignore[arg-type]


def test_mode_names():
    assert SyncMode.from_name("SYNC_EVENT") is SyncMode.EVENT
    assert SyncMode.from_name("consumer-stream") is SyncMode.CONSUMER_STREAM
    with pytest.raises(ValueError, match="SYNC_PRODUCER_SYNCED"):
        SyncMode.from_name("bogus")


# --- properties -------------------------------------------------------------------------------

sizes = st.integers(0, (1 << 64) - 1)
alignments = st.integers(0, 31).map(lambda k: 1 << k)
gpu_tags = st.sampled_from([t for t in DeviceTag if t is not DeviceTag.CPU])


@st.composite
def valid_handles(draw):
    tag = draw(st.sampled_from(list(DeviceTag)))
    mode = SyncMode.PRODUCER_SYNCED if tag is DeviceTag.CPU else draw(st.sampled_from(list(SyncMode)))
    return BufferHandle(draw(sizes), draw(alignments), tag, mode)


@given(valid_handles())
def test_roundtrip_every_valid_handle(h):
    raw = h.encode()
    assert len(raw) == 16
    assert BufferHandle.decode(raw) == h
    assert BufferHandle.decode(bytearray(raw)) == h
    assert BufferHandle.decode(memoryview(raw)) == h


@given(st.binary(max_size=40).filter(lambda b: len(b) != 16))
def test_wrong_length_rejected(data):
    with pytest.raises(HandleError) as ei:
        BufferHandle.decode(data)
    assert ei.value.reason == "length"


@given(valid_handles(), st.integers(0, (1 << 32) - 1).filter(lambda a: a == 0 or a & (a - 1)))
def test_bad_alignment_rejected(h, a):
    raw = bytearray(h.encode())
    raw[8:12] = struct.pack("<I", a)
    with pytest.raises(HandleError) as ei:
        BufferHandle.decode(raw)
    assert ei.value.reason == "alignment" and ei.value.value == a


@given(valid_handles(), st.integers(0x09, 0xFF))
def test_reserved_device_tag_rejected(h, tag):
    raw = bytearray(h.encode())
    raw[12] = tag
    with pytest.raises(HandleError) as ei:
        BufferHandle.decode(raw)
    assert ei.value.reason == "device_tag" and ei.value.value == tag


@given(valid_handles(), st.integers(0x03, 0xFF))
def test_reserved_sync_mode_rejected(h, mode):
    raw = bytearray(h.encode())
    raw[13] = mode
    with pytest.raises(HandleError) as ei:
        BufferHandle.decode(raw)
    assert ei.value.reason == ("sync_mode_invalid" if mode == 0xFF else "sync_mode_reserved")
    assert ei.value.value == mode


@given(valid_handles(), st.binary(min_size=2, max_size=2).filter(lambda b: b != b"\0\0"))
def test_nonzero_reserved_rejected(h, res):
    raw = bytearray(h.encode())
    raw[14:16] = res
    with pytest.raises(HandleError) as ei:
        BufferHandle.decode(raw)
    assert ei.value.reason == "reserved_nonzero"


@given(sizes, alignments, st.sampled_from([SyncMode.EVENT, SyncMode.CONSUMER_STREAM]))
def test_cpu_handle_with_gpu_mode_rejected(size, a, mode):
    raw = struct.pack("<QIBB2s", size, a, 0, int(mode), b"\0\0")
    with pytest.raises(HandleError) as ei:
        BufferHandle.decode(raw)
    assert ei.value.reason == "cpu_sync_mode"


@given(st.binary(min_size=16, max_size=16))
def test_any_16_bytes_decode_or_raise_handle_error(raw):
    try:
        h = BufferHandle.decode(raw)
    except HandleError as e:
        assert e.reason in HANDLE_ERROR_REASONS
    else:
        assert h.encode() == raw
