"""Turn what a producer hands to ``send`` into a device-layer buffer plus its array metadata.

Accepted, in this order: a device-layer :class:`Buffer`; an object with
``__cuda_array_interface__`` (CuPy, PyTorch CUDA tensors, Numba); an object with ``__dlpack__`` on
the CPU (converted through ``numpy.from_dlpack``, no copy); anything exposing the buffer protocol
(numpy, bytes, memoryview). Host memory that is not already in our shared memory is copied once
into a shared-memory buffer, since another process can only map shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..devices.base import Buffer
from ..devices.cpu import CpuDevice
from ..devices.cuda import CudaDevice, CudaStream
from ..devices.errors import DeviceError


@dataclass
class Source:
    buffer: Buffer
    typestr: str = "|u1"
    shape: tuple[int, ...] = ()
    stream: CudaStream | None = None  # where the producer's writes were enqueued (GPU buffers)
    copied: bool = False  # host bytes were copied into shared memory to be shareable
    keep: Any = None  # the user's object, alive until the handoff is released
    cleanup: Callable[[], None] | None = None
    user: dict[str, Any] | None = None  # the sender's own metadata

    def meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {"typestr": self.typestr, "shape": list(self.shape or (self.buffer.size,))}
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


def resolve(obj: Any, cpu: CpuDevice, gpu: CudaDevice | None, stream: CudaStream | None) -> Source:
    """Describe ``obj`` as a shareable buffer. ``stream``: the stream its GPU writes were on."""
    if isinstance(obj, Buffer):
        return Source(obj, shape=(obj.size,), stream=stream if isinstance(obj.device, CudaDevice) else None, keep=obj)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        if gpu is None:
            raise DeviceError("send", "a CUDA array was given to a producer without a CUDA device")
        shape = tuple(int(d) for d in cai["shape"])
        typestr = cai["typestr"]
        nbytes = _contiguous_nbytes(shape, typestr, cai.get("strides"))
        ptr = int(cai["data"][0])
        s = stream
        if s is None and cai.get("stream") is not None:
            s = gpu.wrap_stream(gpu.rt.stream_from_id(int(cai["stream"])))
        return Source(gpu.buffer_at(ptr, nbytes), typestr, shape, s or None, keep=obj)
    if hasattr(obj, "__dlpack_device__") and not _has_buffer(obj):
        dev_type, _ = obj.__dlpack_device__()
        if int(dev_type) not in (1, 3):  # kDLCPU, kDLCUDAHost
            raise DeviceError("send", f"a DLPack object on device type {int(dev_type)} without "
                              "__cuda_array_interface__ is not supported; pass a CuPy/PyTorch array")
        obj = np.from_dlpack(obj)
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
