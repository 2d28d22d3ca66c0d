"""Turn what a producer hands to ``send`` into a device-layer buffer plus its array metadata.

Accepted, in this order: a device-layer :class:`Buffer`; an object with
``__cuda_array_interface__`` (CuPy, PyTorch CUDA tensors, Numba); a CUDA object with only
``__dlpack__`` (JAX, or a dtype the exporter's CAI cannot express, such as torch's bfloat16); an
object with ``__dlpack__`` on the CPU (torch CPU tensors, read through its capsule, every dtype
DLPack has); anything exposing the buffer protocol (numpy, bytes, memoryview). For GPU objects the
source also names the stream the producer must order after (see :func:`resolve`). Host memory
that is not already in our shared memory is copied once into a shared-memory buffer, since
another process can only map shared memory.

One rule for layout, host and GPU alike: memory is handed off as it lies, never re-laid out. An
array that is not C-contiguous is refused with its strides and the fix (a contiguous copy made
by the caller, who then sees what it costs).
"""

from __future__ import annotations

import ctypes
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
    dl_dtype: list[int] | None = None  # a dtype numpy lacks, as its DLPack [code, bits, lanes]
    readonly: bool = False  # the consumer must not write (the sender's object was read-only)

    def meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {"typestr": self.typestr, "shape": list(self.shape)}
        if self.dl_dtype is not None:
            m["dl_dtype"] = list(self.dl_dtype)
        if self.readonly:
            m["readonly"] = True
        if self.user:
            m["user"] = self.user
        return m

    def describe_as(self, shape: Any = None, dtype: Any = None) -> None:
        """``send(shape=, dtype=)``: describe the bytes as ``shape`` items of ``dtype`` (defaults:
        the source's own). Raises ValueError when that is not exactly the buffer's size."""
        if dtype is not None:
            self.typestr, self.dl_dtype = parse_dtype(dtype)
        itemsize = int(self.typestr[2:])
        if shape is None:
            shape = self.shape if dtype is None else (self.buffer.size // itemsize,)
        try:
            new_shape = (int(shape),) if isinstance(shape, int) else tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise ValueError(f"send(shape={shape!r}): a shape is an int or a sequence of ints") from None
        if any(d < 0 for d in new_shape):
            raise ValueError(f"send(shape={new_shape}): dimensions must be >= 0")
        nbytes = itemsize * int(np.prod(new_shape, dtype=np.int64)) if new_shape else itemsize
        if nbytes != self.buffer.size:
            raise ValueError(f"send(shape={new_shape}, dtype={dlpack.dtype_name(self.typestr, self.dl_dtype)!r}) "
                             f"describes {nbytes} bytes, the buffer has {self.buffer.size}")
        self.shape = new_shape


def parse_dtype(dtype: Any) -> tuple[str, list[int] | None]:
    """A dtype given to ``send(dtype=)`` as (typestr, dl_dtype): anything ``numpy.dtype`` takes,
    a torch dtype, or the name of a dtype numpy lacks ('bfloat16', 'float8_e4m3fn', ...)."""
    name = str(getattr(dtype, "name", None) or dtype).removeprefix("torch.")
    if name in dlpack.EXTRA_DTYPES:
        code, bits = dlpack.EXTRA_DTYPES[name]
        return f"|V{bits // 8}", [code, bits, 1]
    if type(dtype).__module__.startswith("torch"):
        import torch  # only when given a torch dtype

        dtype = torch.empty(0, dtype=dtype).numpy().dtype
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"send(dtype={dtype!r}) is not a dtype: {e}") from None
    if dt.kind not in "biufc" or dt.itemsize == 0 or dt.subdtype is not None or dt.names is not None:
        raise ValueError(f"send(dtype={dtype!r}): {dt} is not a scalar number or bool dtype")
    return dt.str, None


def _contiguous_nbytes(obj: Any, shape: tuple[int, ...], typestr: str, strides: Any) -> int:
    """The byte size of a C-contiguous array; refuses any other layout (the one layout rule)."""
    itemsize = int(typestr[2:])
    n = itemsize
    for d in shape:
        n *= d
    if strides is not None and n:
        acc = itemsize
        for d, s in zip(reversed(shape), reversed(tuple(strides)), strict=True):
            if d != 1 and s != acc:  # a dimension of one may have any stride (numpy's rule too)
                raise DeviceError("send", f"a {type(obj).__name__} of shape {shape} with strides {tuple(strides)} "
                                  "(bytes) is not C-contiguous; Hurray hands memory off as it lies, on the host as "
                                  "on the GPU: send a contiguous copy (numpy.ascontiguousarray(x), x.contiguous())")
            acc *= d
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
    try:
        cai = getattr(obj, "__cuda_array_interface__", None)
    except TypeError:  # e.g. torch's bfloat16: the dtype has no typestr; DLPack has a code for it
        cai = None
    if cai is not None:
        return _cai_source(obj, cai, _need_gpu(gpu), stream, own_stream)
    if hasattr(obj, "__dlpack_device__") and not _has_buffer(obj):
        dev_type, _ = obj.__dlpack_device__()
        if int(dev_type) == dlpack.KDL_CUDA:
            return _dlpack_source(obj, _need_gpu(gpu), stream or own_stream)
        if int(dev_type) not in (dlpack.KDL_CPU, dlpack.KDL_CUDA_HOST):
            raise DeviceError("send", f"a DLPack object on device type {int(dev_type)} is not supported "
                              "(CPU, CUDA host and CUDA memory are)")
        return _host_dlpack_source(obj, cpu)
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
    nbytes = _contiguous_nbytes(obj, shape, typestr, cai.get("strides"))
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
    readonly = bool(cai["data"][1])
    return Source(gpu.buffer_at(ptr, nbytes), typestr, shape, stream, keep=obj, readonly=readonly)


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
    nbytes = _contiguous_nbytes(obj, t.shape, t.typestr, t.strides)
    return Source(gpu.buffer_at(t.ptr, nbytes), t.typestr, t.shape, stream, keep=obj, pin=capsule,
                  dl_dtype=t.dl_dtype)


def _host_dlpack_source(obj: Any, cpu: CpuDevice) -> Source:
    """A host object that speaks DLPack but not the buffer protocol (a torch CPU tensor): read
    through its capsule, so every dtype DLPack has (bfloat16, float8) keeps its code."""
    capsule = obj.__dlpack__()
    t = dlpack.read_capsule(capsule)  # the capsule stays unconsumed: its destructor frees it
    nbytes = _contiguous_nbytes(obj, t.shape, t.typestr, t.strides)
    buf = cpu.allocate(nbytes)
    if nbytes:
        ctypes.memmove(buf.ptr, t.ptr, nbytes)
    del capsule
    return Source(buf, t.typestr, t.shape, copied=True, keep=obj, cleanup=buf.close, dl_dtype=t.dl_dtype)


def _host_source(obj: Any, cpu: CpuDevice) -> Source:
    """Host bytes, copied once into shared memory (another process can only map shared memory)."""
    try:
        arr = np.asarray(memoryview(obj)) if not isinstance(obj, np.ndarray) else obj
    except TypeError:
        raise DeviceError("send", f"cannot hand off a {type(obj).__name__}: it exposes neither a device buffer, "
                          "__cuda_array_interface__, __dlpack__ nor the buffer protocol") from None
    if arr.dtype.kind not in "biufc" or arr.dtype.subdtype is not None:
        if arr.dtype.kind != "V" or arr.dtype.names is not None:  # raw bytes pass as |u1
            raise DeviceError("send", f"cannot hand off a {type(obj).__name__} of dtype {arr.dtype}: only numbers "
                              "and bools travel as typed arrays (send a view as uint8 to pass raw bytes)")
        arr = arr.view(np.uint8)
    if not arr.flags.c_contiguous:
        _contiguous_nbytes(obj, tuple(arr.shape), arr.dtype.str, arr.strides)  # raises, naming the strides
    buf = cpu.allocate(arr.nbytes)
    if arr.nbytes:
        np.frombuffer(buf.host_view(), dtype=np.uint8)[:] = arr.reshape(-1).view(np.uint8)
    return Source(buf, arr.dtype.str, tuple(arr.shape), copied=True, keep=obj, cleanup=buf.close,
                  readonly=not arr.flags.writeable)


def _has_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
        return True
    except TypeError:
        return False
