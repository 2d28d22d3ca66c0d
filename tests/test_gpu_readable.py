"""A received GPU buffer is readable without CuPy or torch (issue 21).

``h.buffer.copy_to_host()`` and ``consumer.stream.copy(dst, h.buffer)`` order their copy after
the producer's writes; the emulation's happens-before checker reports a read that is not ordered
after its write as a race every time, at any op delay (devices/DESIGN.md), so the broken twins
(a copy on a stream nobody ordered) fail every run. ``numpy.from_dlpack`` on a CUDA buffer is
refused with a clean BufferError naming the fix, and a consumer that fails after taking a CUDA
capsule keeps its own error (no SystemError, no "Exception ignored").
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from conftest import emu_config
from hurray_ipc import Consumer, ExportRefused, InvalidArgument, Producer, SyncMode, workload
from hurray_ipc.devices import CudaDevice, RaceError, set_runtime
from hurray_ipc.devices.backend.emulated import EmulatedRuntime

SIZE = 4096
DELAYS = [0.0, 0.05]


@contextmanager
def handoff(broker: Any, delay: float, mode: SyncMode, seq: int = 3) -> Iterator[tuple[Consumer, Any]]:
    """A GPU producer writes pattern(7, seq) on its stream (still in flight at op delay > 0) and
    hands it off in ``mode``; yields the consumer and the received handoff (released after)."""
    rt = EmulatedRuntime(emu_config(op_delay_s=delay))
    set_runtime(rt)
    try:
        dev = CudaDevice(0, runtime=rt)
        with Producer(broker.endpoint, "read", dev) as p, Consumer(broker.endpoint, "read", dev) as c:
            buf = p.allocate(SIZE)
            p.stream.copy(buf, workload.pattern(7, seq, SIZE))  # type: ignore[union-attr]
            th = threading.Thread(target=lambda: p.send(buf, mode, shape=(SIZE // 4,), dtype="<u4"), daemon=True)
            th.start()
            h = c.receive(timeout=10)
            try:
                yield c, h
            finally:
                if not h.released:
                    h.release()
                th.join(10)
                p.flush(10)
    finally:
        set_runtime(None)


@pytest.mark.parametrize("mode", [SyncMode.EVENT, SyncMode.PRODUCER_SYNCED])
@pytest.mark.parametrize("delay", DELAYS)
def test_copy_to_host_is_ordered_after_the_producer(broker, delay, mode):
    with handoff(broker, delay, mode) as (_c, h):
        arr = h.buffer.copy_to_host()
        assert arr.dtype == np.dtype("<u4") and arr.shape == (SIZE // 4,)
        assert workload.verify(arr.view(np.uint8)) == (7, 3, True)
        out = bytearray(SIZE)
        view = h.buffer.copy_to_host(out)  # into a buffer the caller owns
        assert view.nbytes == SIZE and workload.verify(np.frombuffer(out, np.uint8)) == (7, 3, True)


@pytest.mark.parametrize("delay", DELAYS)
def test_stream_copy_takes_a_received_buffer(broker, delay):
    with handoff(broker, delay, SyncMode.EVENT) as (c, h):
        out = np.empty(SIZE, np.uint8)
        c.stream.copy(out, h.buffer)  # type: ignore[union-attr]
        c.stream.synchronize()  # type: ignore[union-attr]
        assert workload.verify(out) == (7, 3, True)


@pytest.mark.races_expected
@pytest.mark.parametrize("delay", DELAYS)
def test_broken_twin_a_copy_on_a_stream_nobody_ordered_races(broker, delay):
    """What copy_to_host and stream.copy must not do: read the buffer on a stream that was not
    made to wait for the producer. The checker calls it a race whatever the timing."""
    with handoff(broker, delay, SyncMode.EVENT) as (c, h):
        h.wait()  # orders c.stream, not the stray stream below
        stray = c.gpu.create_stream()  # type: ignore[union-attr]
        out = np.empty(SIZE, np.uint8)
        stray.copy(out, h.buffer.device_buffer)
        with pytest.raises(RaceError):
            stray.synchronize()


@pytest.mark.parametrize(("cdev", "staged"), [("cuda:0", False), ("cpu", True)])
def test_copy_to_host_in_a_consumer_process(broker, cdev, staged):
    """Across processes: an imported CUDA mapping and event (EVENT), or a host-staged copy for a
    CPU consumer; copy_to_host reads both, ordered, with no race in either process."""
    from conftest import run_child
    from workers import copy_to_host_consumer

    cfg = emu_config(op_delay_s=0.02)
    rt = EmulatedRuntime(cfg)
    set_runtime(rt)
    try:
        dev = CudaDevice(0, runtime=rt)
        res: list[Any] = []
        args = (copy_to_host_consumer, broker.endpoint, "xproc", cdev, 3, cfg.to_env())
        th = threading.Thread(target=lambda: res.append(run_child(*args)), daemon=True)
        th.start()
        with Producer(broker.endpoint, "xproc", dev) as p:
            for i in range(3):
                buf = p.allocate(SIZE)
                p.stream.copy(buf, workload.pattern(7, i, SIZE))  # type: ignore[union-attr]
                p.send(buf, on_release=lambda t, b=buf: b.close(), timeout=30)
        th.join(60)
        (out, races), = res
        assert out == [((7, i, True), staged) for i in range(3)] and races == 0 and not rt.races
    finally:
        set_runtime(None)


def test_a_read_only_buffer_is_no_copy_destination(broker):
    rt = EmulatedRuntime(emu_config(op_delay_s=0.0))
    set_runtime(rt)
    try:
        dev = CudaDevice(0, runtime=rt)
        with Producer(broker.endpoint, "ro", dev) as p, Consumer(broker.endpoint, "ro", dev) as c:
            buf = p.allocate(SIZE)
            p.stream.copy(buf, workload.pattern(7, 1, SIZE))  # type: ignore[union-attr]
            th = threading.Thread(target=lambda: p.send(buf, readonly=True), daemon=True)
            th.start()
            with c.receive(timeout=10) as h:
                with pytest.raises(InvalidArgument, match=r"read-only .* cannot be a copy's destination"):
                    c.stream.copy(h.buffer, np.zeros(SIZE, np.uint8))  # type: ignore[union-attr]
                assert workload.verify(h.buffer.copy_to_host()) == (7, 1, True)  # reading it is fine
            th.join(10)
    finally:
        set_runtime(None)


def test_copy_to_host_refuses_a_wrong_out(broker):
    with handoff(broker, 0.0, SyncMode.EVENT) as (_c, h):
        with pytest.raises(InvalidArgument, match=r"exactly 4096 bytes; it is 16 bytes"):
            h.buffer.copy_to_host(bytearray(16))
        with pytest.raises(InvalidArgument, match="writable=False"):
            h.buffer.copy_to_host(_readonly(SIZE))
        with pytest.raises(InvalidArgument, match="not a writable buffer"):
            h.buffer.copy_to_host(object())


def _readonly(n: int) -> np.ndarray:
    a = np.zeros(n, np.uint8)
    a.flags.writeable = False
    return a


def test_numpy_from_dlpack_is_refused_cleanly_naming_the_fix(broker, capfd):
    with handoff(broker, 0.0, SyncMode.EVENT) as (_c, h):
        with pytest.raises(ExportRefused, match=r"CUDA memory .* copy it to the host with buffer.copy_to_host\(\)"):
            np.from_dlpack(h.buffer)
        assert workload.verify(h.buffer.copy_to_host().view(np.uint8))[2]  # still usable
    assert "Exception ignored" not in capfd.readouterr().err


class _TakesThenFails:
    """A consumer's view of our buffer that names a stream (as GPU libraries do), so the export
    goes through; numpy then refuses the CUDA capsule (RuntimeError) and drops it with that
    error pending."""

    def __init__(self, buf: Any):
        self.buf = buf

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.buf.__dlpack_device__()

    def __dlpack__(self, **kw: Any) -> Any:
        kw.pop("dl_device", None)
        return self.buf.__dlpack__(stream=None, **kw)


def test_a_consumer_failing_after_taking_a_capsule_keeps_its_own_error(broker, capfd):
    """Before, CUDA capsules had a ctypes destructor: dropped while numpy's BufferError was
    pending it printed "Exception ignored on calling ctypes callback" and the caller got a
    SystemError. Now every capsule is built by numpy (a C destructor)."""
    with handoff(broker, 0.0, SyncMode.EVENT) as (_c, h):
        with pytest.raises(RuntimeError, match="Unsupported device in DLTensor"):  # numpy's own, intact
            np.from_dlpack(_TakesThenFails(h.buffer))
        h.release()  # the dropped capsule let go of the buffer: the release goes through
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "SystemError" not in err
