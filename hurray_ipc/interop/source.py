"""Turn what a producer hands to ``send`` into a device-layer buffer plus its array metadata.

Accepted, in this order: a device-layer :class:`Buffer`; an object with
``__cuda_array_interface__`` (CuPy, PyTorch CUDA tensors, Numba); a CUDA object with only
``__dlpack__`` (JAX); an object with ``__dlpack__`` on the CPU (converted through
``numpy.from_dlpack``, no copy); anything exposing the buffer protocol (numpy, bytes, memoryview).
For GPU objects the source also names the stream the producer must order after (see
:func:`resolve`). Host memory that is not already in our shared memory is copied once
into a shared-memory buffer, since another process can only map shared memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..devices.base import Buffer
from ..devices.cpu import CpuDevice
from ..devices.cuda import CudaDevice, CudaStream
from ..devices.errors import DeviceError
from . import dlpack


@dataclass
class Source:
    buffer: Buffer
    typestr: str = "|u1"
    shape: tuple[int, ...] = ()
    stream: CudaStream | None = None  # where the producer's writes were enqueued (GPU buffers)
    copied: bool = False  # host bytes were copied into shared memory to be shareable
    keep: Any = None  # the user's object, alive until the handoff is released
    pin: Any = None  # what else must live until then (a DLPack capsule taken from ``keep``)
    cleanup: Callable[[], None] | None = None
    user: dict[str, Any] | None = None  # the sender's own metadata

    def meta(self) -> dict[str, Any]:
        # () is a 0-d array's shape; only a source without any shape is "size items of typestr"
        shape = self.shape if self.shape or self.buffer.size == int(self.typestr[2:]) else (
            self.buffer.size // int(self.typestr[2:]),)
        m: dict[str, Any] = {"typestr": self.typestr, "shape": list(shape)}
        if self.user:
            m["user"] = self.user
        return m


def _contiguous_nbytes(shape: tuple[int, ...], typestr: str, strides: Any) -> int:
    itemsize = int(typestr[2:])
    n = itemsize
    for d in shape:
        n *= d
    if strides is not None:
        expect, acc = [], itemsize
        for d in reversed(shape):
            expect.append(acc)
            acc *= d
        if tuple(reversed(expect)) != tuple(strides) and n:
            raise DeviceError("send", f"array with strides {strides} is not C-contiguous; pass a contiguous copy")
    return n


LEGACY_DEFAULT_STREAM = 1  # cudaStreamLegacy, as CUDA Array Interface v3 and DLPack number it


def resolve(obj: Any, cpu: CpuDevice, gpu: CudaDevice | None, stream: CudaStream | None,
            own_stream: CudaStream | None) -> Source:
    """Describe ``obj`` as a shareable buffer, with the stream its GPU writes are ordered on.

    ``stream``: the caller's explicit choice (``send(stream=)``), which always wins. Without it:
    a CUDA Array Interface object names its stream itself (:func:`_cai_source`); a CUDA
    DLPack-only object is asked to order ``own_stream`` after its writes (:func:`_dlpack_source`);
    a device-layer Buffer was written on ``own_stream`` (the producer's stream).
    """
    if isinstance(obj, Buffer):
        on_gpu = isinstance(obj.device, CudaDevice)
        return Source(obj, shape=(obj.size,), stream=(stream or own_stream) if on_gpu else None, keep=obj)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        return _cai_source(obj, cai, _need_gpu(gpu), stream, own_stream)
    if hasattr(obj, "__dlpack_device__") and not _has_buffer(obj):
        dev_type, _ = obj.__dlpack_device__()
        if int(dev_type) == dlpack.KDL_CUDA:
            return _dlpack_source(obj, _need_gpu(gpu), stream or own_stream)
        if int(dev_type) not in (dlpack.KDL_CPU, dlpack.KDL_CUDA_HOST):
            raise DeviceError("send", f"a DLPack object on device type {int(dev_type)} is not supported "
                              "(CPU, CUDA host and CUDA memory are)")
        obj = np.from_dlpack(obj)
    return _host_source(obj, cpu)


def _need_gpu(gpu: CudaDevice | None) -> CudaDevice:
    if gpu is None:
        raise DeviceError("send", "a CUDA array was given to a producer without a CUDA device")
    return gpu


def _cai_source(obj: Any, cai: dict[str, Any], gpu: CudaDevice, stream: CudaStream | None,
                own_stream: CudaStream | None) -> Source:
    """A ``__cuda_array_interface__`` object, ordered per CAI v3 on the stream it exports.

    The ``stream`` entry is where the exporter's writes were enqueued: we order after it. Absent
    (v2 and earlier, or a v3 exporter that leaves it out), the writes are on the legacy default
    stream. ``None`` is the exporter's word that no synchronisation is needed: the producer's
    own stream (idle as far as ``obj`` goes) carries the record then. 0 is forbidden by v3.
    """
    shape = tuple(int(d) for d in cai["shape"])
    typestr = cai["typestr"]
    nbytes = _contiguous_nbytes(shape, typestr, cai.get("strides"))
    ptr = int(cai["data"][0])
    if stream is None:
        if "stream" not in cai:
            stream = gpu.as_stream(LEGACY_DEFAULT_STREAM)
        elif cai["stream"] is None:
            stream = own_stream
        elif cai["stream"] == 0:
            raise DeviceError("send", f"{type(obj).__name__}.__cuda_array_interface__ has stream 0, which CUDA "
                              "Array Interface v3 forbids as ambiguous (1: legacy default, 2: per-thread)")
        else:
            stream = gpu.as_stream(int(cai["stream"]))
    return Source(gpu.buffer_at(ptr, nbytes), typestr, shape, stream, keep=obj)


def _dlpack_source(obj: Any, gpu: CudaDevice, stream: CudaStream | None) -> Source:
    """A CUDA object that only speaks DLPack (e.g. a JAX array).

    Following the array API, ``__dlpack__(stream=our stream)`` makes the exporter order our
    stream after its own writes (it enqueues the wait). The capsule is kept, unconsumed, until the
    handoff is released: its destructor then returns the tensor to the exporter.
    """
    if stream is None:
        raise DeviceError("send", "a CUDA DLPack object needs a stream to be ordered on")
    capsule = obj.__dlpack__(stream=stream.handle)
    t = dlpack.read_capsule(capsule)
    if t.device_type != dlpack.KDL_CUDA:
        raise DeviceError("send", f"{type(obj).__name__}.__dlpack__ gave device type {t.device_type}, "
                          f"though __dlpack_device__ said CUDA")
    nbytes = _contiguous_nbytes(t.shape, t.typestr, t.strides)
    return Source(gpu.buffer_at(t.ptr, nbytes), t.typestr, t.shape, stream, keep=obj, pin=capsule)


def _host_source(obj: Any, cpu: CpuDevice) -> Source:
    """Host bytes, copied once into shared memory (another process can only map shared memory)."""
    try:
        arr = np.asarray(memoryview(obj)) if not isinstance(obj, np.ndarray) else obj
    except TypeError:
        raise DeviceError("send", f"cannot hand off a {type(obj).__name__}: it exposes neither a device buffer, "
                          "__cuda_array_interface__, __dlpack__ nor the buffer protocol") from None
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    buf = cpu.allocate(arr.nbytes)
    np.frombuffer(buf.host_view(), dtype=np.uint8)[:] = arr.reshape(-1).view(np.uint8)
    return Source(buf, arr.dtype.str, tuple(arr.shape), copied=True, keep=obj, cleanup=buf.close)


def _has_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
        return True
    except TypeError:
        return False
