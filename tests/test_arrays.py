"""Tensors in, tensors out (issue 12): exact array metadata through a real broker, DLPack by the
array API standard, the one layout rule, the helpers, and the iterator and asyncio APIs.

Producer and consumer are threads of this process; every handoff crosses the broker process.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import emu_config
from hurray_ipc import InvalidArgument
from hurray_ipc.client import Consumer, Producer, ReceivedHandoff
from hurray_ipc.contract.meta import check_meta
from hurray_ipc.devices import CudaDevice, set_runtime
from hurray_ipc.devices.backend.emulated import EmulatedRuntime
from hurray_ipc.interop import dlpack
from hurray_ipc.wire.ipc import ProtocolError

try:
    import torch
except ImportError:  # torch is optional; CPU wheels: pip install torch==2.13.0+cpu
    torch = None
NEEDS_TORCH = pytest.mark.skipif(torch is None, reason="torch is not installed (pip install torch, CPU build)")

_IsValid = ctypes.pythonapi.PyCapsule_IsValid
_IsValid.restype = ctypes.c_int
_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def capsule_name(capsule: Any) -> str:
    for name in ("dltensor_versioned", "dltensor"):
        if _IsValid(capsule, name.encode()):
            return name
    return "?"


@pytest.fixture
def pair(broker) -> Iterator[tuple[Producer, Consumer]]:
    with Producer(broker.endpoint, "arr", "cpu") as p, Consumer(broker.endpoint, "arr", "cpu") as c:
        yield p, c


def roundtrip(p: Producer, c: Consumer, obj: Any, **kw: Any) -> ReceivedHandoff:
    """Send ``obj`` from a thread (send waits for the consumer's request) and receive it."""
    err: list[BaseException] = []

    def send() -> None:
        try:
            p.send(obj, **kw)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            err.append(e)

    th = threading.Thread(target=send, daemon=True)
    th.start()
    h = c.receive(timeout=10)
    th.join(10)
    if err:
        raise err[0]
    return h


# --- exact metadata ------------------------------------------------------------------------------
def test_zero_d_array_stays_zero_d(pair):
    p, c = pair
    with roundtrip(p, c, np.array(3.5)) as h:
        assert h.wire_meta["shape"] == [] and h.buffer.shape == ()
        a = h.numpy()
        assert a.shape == () and a.dtype == np.float64 and float(a) == 3.5
        b = np.from_dlpack(h.buffer)
        assert b.shape == () and float(b) == 3.5 and b.ctypes.data == h.buffer.ptr
        del a, b


NUMPY_DTYPES = ["?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]


@pytest.mark.parametrize("dt", NUMPY_DTYPES)
def test_every_dlpack_numpy_dtype_round_trips_exactly_and_zero_copy(pair, dt):
    p, c = pair
    src = (np.arange(24) % 7 - 3).astype(dt).reshape(2, 3, 4)
    with roundtrip(p, c, src) as h:
        a, b = h.numpy(), np.from_dlpack(h.buffer)
        for got in (a, b):
            assert got.dtype == src.dtype and got.shape == (2, 3, 4) and np.array_equal(got, src)
        assert a.ctypes.data == b.ctypes.data == h.buffer.ptr
        del a, b


def test_big_endian_keeps_its_byte_order_and_dlpack_refuses_it_with_the_reason(pair):
    p, c = pair
    src = np.arange(4, dtype=">i4")
    with roundtrip(p, c, src) as h:
        assert h.buffer.typestr == ">i4"
        a = h.numpy()
        assert a.dtype == np.dtype(">i4") and a.tolist() == [0, 1, 2, 3]
        del a
        with pytest.raises(BufferError, match="byte order"):
            np.from_dlpack(h.buffer)


NOT_CONTIGUOUS = "is not C-contiguous; Hurray hands memory off as it lies, on the host as on the GPU"


def test_non_contiguous_host_array_is_refused_with_its_strides(pair):
    p, c = pair
    with pytest.raises(InvalidArgument, match=r"strides \(32, 16\)") as e:
        p.send(np.arange(12.0).reshape(3, 4)[:, ::2], timeout=1)
    assert NOT_CONTIGUOUS in str(e.value)
    # one-sized dimensions may have any stride: still contiguous, and sent
    odd = np.lib.stride_tricks.as_strided(np.arange(4.0), shape=(1, 4), strides=(999, 8))
    with roundtrip(p, c, odd) as h:
        assert h.numpy().tolist() == [[0.0, 1.0, 2.0, 3.0]]


class StridedCai:
    """A CUDA array (CAI v3) whose rows are every other row of its allocation."""

    def __init__(self, dev: CudaDevice):
        self.buf = dev.allocate(64)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (2, 4), "typestr": "<f4", "data": (self.buf.ptr, False), "version": 3,
                "strides": (32, 4), "stream": None}


@contextmanager
def emulated() -> Iterator[CudaDevice]:
    rt = EmulatedRuntime(emu_config(op_delay_s=0.0))
    set_runtime(rt)
    try:
        yield CudaDevice(0, runtime=rt)
    finally:
        set_runtime(None)


def test_non_contiguous_cuda_array_is_refused_by_the_same_rule(broker):
    with emulated() as dev, Producer(broker.endpoint, "gpu", dev) as p:
        with pytest.raises(InvalidArgument, match=r"strides \(32, 4\)") as e:
            p.send(StridedCai(dev), timeout=1)
        assert NOT_CONTIGUOUS in str(e.value)


def test_send_shape_and_dtype_describe_a_device_layer_buffer(pair):
    p, c = pair
    buf = p.allocate(16)
    np.frombuffer(buf.host_view(), np.float32)[:] = [1, 2, 3, 4]
    with roundtrip(p, c, buf, shape=(2, 2), dtype="<f4") as h:
        assert h.numpy().tolist() == [[1.0, 2.0], [3.0, 4.0]]
    with pytest.raises(ValueError, match=r"describes 12 bytes, the buffer has 16"):
        p.send(buf, shape=(3,), dtype=np.float32, timeout=1)
    with pytest.raises(ValueError, match="is not a dtype"):
        p.send(buf, dtype="float96x", timeout=1)


@NEEDS_TORCH
def test_bfloat16_and_float8_reach_torch_exactly(pair):
    p, c = pair
    src = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) / 4
    with roundtrip(p, c, src) as h:
        assert h.wire_meta["dl_dtype"] == [4, 16, 1] and h.buffer.typestr == "|V2"
        t = h.torch()
        assert t.dtype == torch.bfloat16 and t.shape == (2, 3) and torch.equal(t, src)
        assert t.data_ptr() == h.buffer.ptr
        with pytest.raises(TypeError, match="bfloat16 has no numpy dtype"):
            h.numpy()
        del t
    f8 = torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn)
    with roundtrip(p, c, f8) as h:
        assert h.wire_meta["dl_dtype"] == [10, 8, 1]
        t = h.torch()
        assert t.dtype == torch.float8_e4m3fn and t.float().tolist() == [0.5, -2.0, 448.0]
        del t
    raw = p.allocate(8)
    with roundtrip(p, c, raw, dtype=torch.bfloat16) as h:  # a torch dtype given to send(dtype=)
        assert h.torch().dtype == torch.bfloat16 and h.buffer.shape == (4,)
    with roundtrip(p, c, raw, dtype="bfloat16", shape=(2, 2)) as h:
        assert h.torch().shape == (2, 2)


@NEEDS_TORCH
def test_torch_tensors_round_trip_including_zero_d(pair):
    p, c = pair
    for src in (torch.tensor(2.5), torch.arange(12, dtype=torch.int16).reshape(3, 4)):
        with roundtrip(p, c, src) as h:
            t = h.torch()
            assert t.shape == src.shape and t.dtype == src.dtype and torch.equal(t, src)
            del t


# --- DLPack by the array API standard ---------------------------------------------------------
class LegacyOnly:
    """A consumer's view of an exporter without max_version: forces the legacy capsule."""

    def __init__(self, buf: Any):
        self.buf = buf

    def __dlpack__(self, stream: Any = None) -> Any:
        return self.buf.__dlpack__(stream=stream)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.buf.__dlpack_device__()


def test_versioned_and_legacy_capsules_are_consumed_by_numpy_and_torch(pair):
    p, c = pair
    src = np.arange(6, dtype=np.int32)
    with roundtrip(p, c, src) as h:
        assert capsule_name(h.buffer.__dlpack__(max_version=(1, 0))) == "dltensor_versioned"
        assert capsule_name(h.buffer.__dlpack__(max_version=(0, 8))) == "dltensor"
        assert capsule_name(h.buffer.__dlpack__()) == "dltensor"
        for arr in (np.from_dlpack(h.buffer), np.from_dlpack(LegacyOnly(h.buffer))):
            assert arr.tolist() == list(range(6)) and arr.ctypes.data == h.buffer.ptr
        if torch is not None:
            for cap in (h.buffer.__dlpack__(max_version=(1, 0)), h.buffer.__dlpack__()):
                t = torch.from_dlpack(cap)
                assert t.tolist() == list(range(6)) and t.data_ptr() == h.buffer.ptr
                del t
        del arr


def test_copy_dl_device_and_stream_follow_the_standard(pair):
    p, c = pair
    with roundtrip(p, c, np.arange(4, dtype=np.float32)) as h:
        copied = np.from_dlpack(h.buffer, copy=True)
        same = np.from_dlpack(h.buffer, copy=False)
        assert copied.ctypes.data != h.buffer.ptr and same.ctypes.data == h.buffer.ptr
        assert copied.tolist() == same.tolist() == [0.0, 1.0, 2.0, 3.0]
        copied[0] = 9.0
        assert same[0] == 0.0  # a copy is the caller's own
        with pytest.raises(BufferError, match=r"lives on DLPack device \(1, 0\)"):
            h.buffer.__dlpack__(dl_device=(dlpack.KDL_CUDA, 0))
        assert np.from_dlpack(h.buffer, device="cpu").ctypes.data == h.buffer.ptr
        with pytest.raises(ValueError, match="takes only None"):
            h.buffer.__dlpack__(stream=5)
        with pytest.raises(TypeError):
            h.buffer.__dlpack__(None)  # keyword-only, as the standard says
        del copied, same


def test_read_only_sources_arrive_read_only(pair):
    p, c = pair
    with roundtrip(p, c, b"\x01\x02\x03\x04") as h:
        assert h.wire_meta["readonly"] is True
        assert not h.numpy().flags.writeable
        assert not np.from_dlpack(h.buffer).flags.writeable  # versioned capsule: READ_ONLY flag
        with pytest.raises(BufferError, match="readonly"):
            np.from_dlpack(LegacyOnly(h.buffer))  # a legacy capsule cannot say it
        assert np.asarray(h.buffer).flags.writeable is False  # __array_interface__ data (ptr, True)
    with roundtrip(p, c, b"\x01\x02", readonly=False) as h:
        assert "readonly" not in h.wire_meta and h.numpy().flags.writeable


def test_memoryview_on_the_running_python(pair):
    p, c = pair
    with roundtrip(p, c, np.arange(8, dtype=np.uint8)) as h:
        assert bytes(h.buffer.host_view()) == bytes(range(8))  # on every Python
        if sys.version_info >= (3, 12):
            assert bytes(memoryview(h.buffer)) == bytes(range(8))
        else:  # the promise (README): memoryview(buffer) from 3.12, host_view()/numpy() before
            with pytest.raises(TypeError):
                memoryview(h.buffer)


def test_cuda_buffer_copy_and_bfloat16_capsule(broker):
    """Emulated CUDA: a DLPack-only bfloat16 object (its CAI raises, as torch's does) arrives with
    its code; __dlpack__(copy=True) makes a device copy on the ordered stream."""
    with emulated() as dev, Producer(broker.endpoint, "g16", dev) as p, Consumer(broker.endpoint, "g16", dev) as c:
        src, init = dev.allocate(8), np.arange(4, dtype=np.uint16)
        p.stream.copy(src, init)

        class Bf16:
            @property
            def __cuda_array_interface__(self) -> dict[str, Any]:
                raise TypeError("dtype bfloat16 is not supported by the CUDA Array Interface")

            def __dlpack_device__(self) -> tuple[int, int]:
                return (dlpack.KDL_CUDA, 0)

            def __dlpack__(self, stream: Any = None, **_kw: Any) -> Any:
                return dlpack.make_capsule(src.ptr, (4,), "|V2", dlpack.KDL_CUDA, 0, self, dl_dtype=[4, 16, 1])

        with roundtrip(p, c, Bf16(), stream=p.stream) as h:
            h.wait()
            assert h.wire_meta["dl_dtype"] == [4, 16, 1]
            t = dlpack.read_capsule(h.buffer.__dlpack__(stream=c.stream.handle))
            assert (t.typestr, t.dl_dtype, t.ptr) == ("|V2", [4, 16, 1], h.buffer.ptr)
            capsule = h.buffer.__dlpack__(stream=c.stream.handle, copy=True)  # owns the copy while alive
            cp = dlpack.read_capsule(capsule)
            assert cp.ptr != h.buffer.ptr and cp.dl_dtype == [4, 16, 1]
            out = np.empty(4, np.uint16)
            c.stream.copy(out, dev.buffer_at(cp.ptr, 8))
            c.stream.synchronize()
            assert out.tolist() == [0, 1, 2, 3]
            del capsule
            with pytest.raises(AttributeError, match="no CUDA Array Interface typestr"):
                _ = h.buffer.__cuda_array_interface__
        p.flush(5)


# --- iteration and asyncio ----------------------------------------------------------------------
def _send_all(p: Producer, n: int) -> threading.Thread:
    th = threading.Thread(target=lambda: [p.send(np.full(4, i, np.int32)) for i in range(n)], daemon=True)
    th.start()
    return th


def test_for_h_in_consumer_until_closed(pair):
    p, c = pair
    th = _send_all(p, 3)
    seen = []
    for h in c:
        with h:
            seen.append(int(h.numpy()[0]))
        if len(seen) == 3:
            break
    th.join(10)
    assert seen == [0, 1, 2]
    ended = threading.Event()

    def drain() -> None:
        for h in c:
            h.release()
        ended.set()

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    c.close()  # from another thread: the loop ends instead of raising
    t.join(10)
    assert ended.is_set()


def test_areceive_and_async_for(pair):
    p, c = pair
    th = _send_all(p, 3)

    async def main() -> list[int]:
        got = []
        h = await c.areceive(timeout=10)
        with h:
            got.append(int(h.numpy()[0]))
        async for h in c:
            with h:
                got.append(int(h.numpy()[0]))
            if len(got) == 3:
                break
        with pytest.raises(TimeoutError):
            await c.areceive(timeout=0.3)
        return got

    assert asyncio.run(main()) == [0, 1, 2]
    th.join(10)


def test_areceive_is_woken_when_the_pump_thread_took_the_delivery(pair):
    """Only the pump thread's wake-up can end this wait in time: the socket watch is switched off
    and the heartbeat bound is far beyond the timeout. Without the wake-up it times out every run."""
    p, c = pair
    c.session.heartbeat_s = 60.0
    th = _send_all(p, 1)  # blocks until areceive's first attempt asks for a handoff

    async def main() -> int:
        loop = asyncio.get_running_loop()
        loop.add_reader = lambda fd, cb, *a: None  # type: ignore[method-assign]
        loop.remove_reader = lambda fd: True  # type: ignore[method-assign]
        h = await c.areceive(timeout=15)
        with h:
            return int(h.numpy()[0])

    assert asyncio.run(main()) == 0
    th.join(10)


# --- the spec's vectors ----------------------------------------------------------------------------
VECTORS = json.loads((Path(__file__).parent / "vectors" / "array_meta.json").read_text())["cases"]


@pytest.mark.parametrize("case", VECTORS, ids=[c["name"] for c in VECTORS])
def test_array_meta_vectors(case):
    if case.get("ok"):
        check_meta(case["meta"], case["size"])
        return
    with pytest.raises(ProtocolError) as e:
        check_meta(case["meta"], case["size"])
    assert (e.value.code, e.value.extra.get("field")) == (case["code"], case["field"])


def test_a_waker_whose_loop_closed_does_not_stop_the_pump_thread(pair):
    """areceive's waker calls call_soon_threadsafe, which raises once its loop closed; the pump
    thread must go on (heartbeats, deferred releases) instead of dying with it."""
    _, c = pair
    called = threading.Event()

    def closed_loop_waker() -> None:
        called.set()
        raise RuntimeError("Event loop is closed")

    c.session.wakers.append(closed_loop_waker)
    try:
        assert called.wait(10), "the pump thread received nothing (PONGs come every heartbeat)"
        c.session.wakers.remove(closed_loop_waker)
        called.clear()
        c.session.wakers.append(called.set)
        assert called.wait(10) and c.session._bg.is_alive(), "the pump thread died"
    finally:
        if called.set in c.session.wakers:
            c.session.wakers.remove(called.set)


def test_remembered_metadata_follows_every_field_it_depends_on():
    """A source's wire metadata without send(meta=) is checked and encoded once per kind of
    array, not per send: each field it depends on must still change it (read-only or not, a
    DLPack dtype, the buffer's size), and a shape that does not fit its buffer is refused every
    time, never remembered as fitting."""
    from hurray_ipc.devices import CpuDevice
    from hurray_ipc.interop.source import Source

    cpu = CpuDevice()
    eight, sixteen = cpu.allocate(8), cpu.allocate(16)
    try:
        def sent(src: Source) -> Any:
            meta, raw = src.wire_meta()
            assert raw is not None and json.loads(raw) == meta
            return meta

        assert sent(Source(eight, "<f4", (2,))) == {"typestr": "<f4", "shape": [2]}
        assert sent(Source(eight, "<f4", (2,), readonly=True)) == {"typestr": "<f4", "shape": [2], "readonly": True}
        assert sent(Source(eight, "|V2", (4,))) == {"typestr": "|V2", "shape": [4]}
        assert sent(Source(eight, "|V2", (4,), dl_dtype=[4, 16, 1])) == \
            {"typestr": "|V2", "shape": [4], "dl_dtype": [4, 16, 1]}
        for _ in range(2):
            with pytest.raises(InvalidArgument, match="the buffer is 16"):
                Source(sixteen, "<f4", (2,)).wire_meta()
        assert Source(eight, "|u1", (8,)).wire_meta() == (None, None)  # plain bytes travel without meta
    finally:
        eight.close()
        sixteen.close()
