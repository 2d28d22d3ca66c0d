"""Turn what a producer hands to ``send`` into a device-layer buffer plus its array metadata.

Accepted, in this order: a device-layer :class:`Buffer`; an object with
``__cuda_array_interface__`` (CuPy, PyTorch CUDA tensors, Numba); a CUDA object with only
``__dlpack__`` (JAX, or a dtype the exporter's CAI cannot express, such as torch's bfloat16); an
object with ``__dlpack__`` on the CPU (torch CPU tensors, read through its capsule, every dtype
DLPack has); anything exposing the buffer protocol (numpy, bytes, memoryview). For GPU objects the
source also names the stream the producer must order after (see :func:`resolve`). Host memory
that is not already in our shared memory is copied once into a shared-memory slot the producer
lends (:data:`HostSlot`: a recycled slot of its staging pool), since another process can only
map shared memory.

One rule for layout, host and GPU alike: memory is handed off as it lies, never re-laid out. An
array that is not C-contiguous is refused with its strides and the fix (a contiguous copy made
by the caller, who then sees what it costs).
"""

from __future__ import annotations

import ctypes
import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from ..contract.meta import check_meta
from ..devices.base import Buffer
from ..devices.cpu import CpuDevice
from ..devices.cuda import CudaDevice, CudaStream
from ..errors import InvalidArgument, UnsupportedObject, an
from ..wire.ipc import MAX_HEADER_BYTES, MAX_HEADER_DEPTH, ProtocolError, json_bytes
from . import dlpack

# The send() argument each field of the HANDOFF's meta comes from (spec §4.8), for refusals.
_ARGUMENT_OF = {"shape": "send(shape=)", "typestr": "send(dtype=)", "dl_dtype": "send(dtype=)",
                "readonly": "send(readonly=)", "user": "send(meta=)"}


@dataclass
class Source:
    buffer: Buffer
    typestr: str = "|u1"
    shape: tuple[int, ...] = ()
    stream: CudaStream | None = None  # where the producer's writes were enqueued (GPU buffers)
    copied: bool = False  # host bytes were copied into shared memory to be shareable
    slot: Buffer | None = None  # the lent slot ``buffer`` lies at the start of (a copy); ``cleanup`` gives it back
    keep: Any = None  # the user's object, alive until the handoff is released
    pin: Any = None  # what else must live until then (a DLPack capsule taken from ``keep``)
    cleanup: Callable[[], None] | None = None
    user: Any = None  # the sender's own metadata (send(meta=)): any JSON value but null, delivered as is
    dl_dtype: list[int] | None = None  # a dtype numpy lacks, as its DLPack [code, bits, lanes]
    readonly: bool = False  # the consumer must not write (the sender's object was read-only)
    wire: tuple[dict[str, Any] | None, bytes | None] = (None, None)  # wire_meta(), once the source is final

    def free(self) -> None:
        """Run ``cleanup`` once (a later call does nothing): a source may be freed both where its
        handoff finished (a refusal, a release) and by the send that then raises."""
        cleanup, self.cleanup = self.cleanup, None
        if cleanup is not None:
            cleanup()

    def meta(self) -> dict[str, Any]:
        return _meta(self.typestr, self.shape, self.dl_dtype, self.readonly, self.user)

    def wire_meta(self) -> tuple[dict[str, Any] | None, bytes | None]:
        """The HANDOFF's ``meta`` (None for plain bytes without user metadata: spec §2.2) and
        its frame, encoded once and checked against the limits the broker applies (§4.8), so
        that a handoff the broker would refuse as a whole is refused here, before a grant is taken.
        The dict may be shared with other handoffs: read it, never change it."""
        if self.user is None:  # then it depends on these alone: a stream of one shape checks it once
            dl = None if self.dl_dtype is None else tuple(self.dl_dtype)
            return _plain_wire_meta(self.typestr, self.shape, dl, self.readonly, self.buffer.size)
        return _wire_meta(self.meta(), self.buffer.size)

    def describe_as(self, shape: Any = None, dtype: Any = None) -> None:
        """``send(shape=, dtype=)``: describe the bytes as ``shape`` items of ``dtype`` (defaults:
        the source's own). Raises ValueError when that is not exactly the buffer's size."""
        if dtype is not None:
            typestr, dl_dtype = parse_dtype(dtype)
            if self.typestr != "|u1" and (typestr, dl_dtype) != (self.typestr, self.dl_dtype):
                raise InvalidArgument(f"the {dlpack.dtype_name(self.typestr, self.dl_dtype)} array would travel as "
                                      f"{dlpack.dtype_name(typestr, dl_dtype)}, its bytes reinterpreted: dtype= says "
                                      "what raw bytes are (a buffer from allocate(), bytes); convert a typed array "
                                      "yourself (x.astype(...)) or view it (x.view(...))", where="send(dtype=)",
                                      value=dtype)
            self.typestr, self.dl_dtype = typestr, dl_dtype
        itemsize = int(self.typestr[2:])
        new_shape = parse_shape(shape) if shape is not None else (
            self.shape if dtype is None else (self.buffer.size // itemsize,))
        nbytes = itemsize * math.prod(new_shape)  # Python ints: no int64 wrap-around
        if nbytes != self.buffer.size:
            raise InvalidArgument(f"shape {new_shape} of {dlpack.dtype_name(self.typestr, self.dl_dtype)} describes "
                                  f"{nbytes} bytes, the buffer has {self.buffer.size}", where="send(shape=, dtype=)",
                                  value=new_shape)
        self.shape = new_shape


def _meta(typestr: str, shape: tuple[int, ...], dl_dtype: Any, readonly: bool, user: Any) -> dict[str, Any]:
    m: dict[str, Any] = {"typestr": typestr, "shape": list(shape)}
    if dl_dtype is not None:
        m["dl_dtype"] = list(dl_dtype)
    if readonly:
        m["readonly"] = True
    if user is not None:
        m["user"] = user
    return m


@functools.lru_cache(maxsize=256)
def _plain_wire_meta(typestr: str, shape: tuple[int, ...], dl_dtype: tuple[int, ...] | None, readonly: bool,
                     size: int) -> tuple[dict[str, Any] | None, bytes | None]:
    """:func:`_wire_meta` of metadata without ``user``, remembered (a refusal is not: it raises)."""
    return _wire_meta(_meta(typestr, shape, dl_dtype, readonly, None), size)


def _wire_meta(m: dict[str, Any], size: int) -> tuple[dict[str, Any] | None, bytes | None]:
    if m == {"typestr": "|u1", "shape": [size]}:
        return None, None
    try:
        check_meta(m, size)
    except ProtocolError as e:
        key = str(e.extra.get("field", "meta")).removeprefix("meta.")
        raise InvalidArgument(str(e), where=_ARGUMENT_OF.get(key, "send()"), value=m.get(key, m)) from None
    raw = json_bytes(m)
    if len(raw) > MAX_HEADER_BYTES:
        raise InvalidArgument(f"the handoff's metadata encodes to {len(raw)} bytes of JSON; the protocol allows "
                              f"{MAX_HEADER_BYTES} (ipc-protocol.md §2.2): send large data as a buffer",
                              where="send(meta=)", value=f"<{len(raw)} bytes>")
    return m, raw


def parse_shape(shape: Any) -> tuple[int, ...]:
    """``send(shape=)``: an int or a sequence of ints (numpy ints too), each >= 0; never a float,
    a bool or a string, which would be truncated or read digit by digit."""
    dims = (shape,) if not isinstance(shape, str | bytes) and not hasattr(shape, "__iter__") else shape
    if isinstance(dims, str | bytes):
        raise InvalidArgument("a shape is an int or a sequence of ints, not a string", where="send(shape=)",
                              value=shape)
    out = []
    for d in dims:
        try:
            if isinstance(d, bool | np.bool_):
                raise TypeError
            n = operator.index(d)
        except TypeError:
            raise InvalidArgument(f"dimension {d!r} is {an(type(d).__name__)}, not an int", where="send(shape=)",
                                  value=shape) from None
        if n < 0:
            raise InvalidArgument(f"dimension {n} is negative", where="send(shape=)", value=shape)
        out.append(n)
    return tuple(out)


def check_user_meta(meta: Any, path: str = "meta") -> None:
    """``send(meta=)`` must arrive exactly as sent: a JSON value made of dicts with str keys,
    lists, str, int, finite float, bool and None, at most MAX_HEADER_DEPTH levels deep (ipc-protocol.md
    §4.8). Raises InvalidArgument naming the first part that is not (e.g. ``meta['x'][2]``)."""
    stack: list[tuple[Any, str, int]] = [(meta, path, 1)]
    while stack:
        v, where, depth = stack.pop()
        if isinstance(v, dict):
            kids = []
            for k, x in v.items():
                if not isinstance(k, str):
                    raise InvalidArgument(f"{where} has the key {k!r}, {an(type(k).__name__)}; JSON keys are strings",
                                          where="send(meta=)", value=k)
                kids.append((x, f"{where}[{k!r}]"))
        elif isinstance(v, list | tuple):
            if isinstance(v, tuple):
                raise InvalidArgument(f"{where} is a tuple, which would arrive as a list; send a list",
                                      where="send(meta=)", value=v)
            kids = [(x, f"{where}[{i}]") for i, x in enumerate(v)]
        elif v is None or isinstance(v, str | bool):
            continue
        elif isinstance(v, int):
            try:
                int.__repr__(v)  # Python refuses to write an int of more than sys.get_int_max_str_digits()
            except ValueError:
                raise InvalidArgument(f"{where} is an int of {v.bit_length()} bits, more digits than Python writes "
                                      "as JSON", where="send(meta=)", value=f"<int of {v.bit_length()} bits>") from None
            continue
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise InvalidArgument(f"{where} is {v}, which JSON cannot carry", where="send(meta=)", value=v)
            continue
        else:
            raise InvalidArgument(f"{where} is {an(type(v).__name__)}, not a JSON value (dict with str keys, list, "
                                  "str, int, float, bool, None)", where="send(meta=)", value=v)
        if depth + 1 > MAX_HEADER_DEPTH:  # the HANDOFF's meta object holds `user` one level down
            raise InvalidArgument(f"{where} nests deeper than the protocol's {MAX_HEADER_DEPTH - 1} levels",
                                  where="send(meta=)", value=f"<{type(v).__name__}>")
        stack.extend((x, w, depth + 1) for x, w in kids)


def parse_dtype(dtype: Any) -> tuple[str, list[int] | None]:
    """A dtype given to ``send(dtype=)`` as (typestr, dl_dtype): anything ``numpy.dtype`` takes,
    a torch dtype, or the name of a dtype numpy lacks ('bfloat16', 'float8_e4m3fn', ...)."""
    if isinstance(dtype, bool | int | float):
        raise InvalidArgument("a dtype is a numpy dtype, a torch dtype or a name such as 'float32'",
                              where="send(dtype=)", value=dtype)
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
        raise InvalidArgument(f"{dtype!r} is not a dtype: {e}", where="send(dtype=)", value=dtype) from None
    if dt.kind not in "biufc" or dt.itemsize == 0 or dt.subdtype is not None or dt.names is not None:
        raise UnsupportedObject(f"{dt} is not a scalar number or bool dtype; only those travel as typed arrays",
                                where="send(dtype=)", value=dtype)
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
                raise InvalidArgument(f"{an(type(obj).__name__)} of shape {shape} with strides {tuple(strides)} "
                                      "(bytes) is not C-contiguous; Hurray hands memory off as it lies, on the host as "
                                      "on the GPU: send a contiguous copy (numpy.ascontiguousarray(x), x.contiguous())",
                                      where="send()", value=tuple(strides))
            acc *= d
    return n


#: Lends a shared-memory slot of at least ``nbytes`` for a host copy: (slot, give_back).
#: ``give_back()`` returns it for reuse, so it may be called only once no consumer can read it.
HostSlot: TypeAlias = Callable[[int], tuple[Buffer, Callable[[], None]]]


LEGACY_DEFAULT_STREAM = 1  # cudaStreamLegacy, as CUDA Array Interface v3 and DLPack number it


def _check_open(buf: Buffer) -> None:
    """A device-layer Buffer closed by its owner names no memory any more."""
    if buf.closed:
        raise InvalidArgument(f"{buf!r} was closed: it names no memory any more", where="send(obj=)")


def resolve(obj: Any, host_slot: HostSlot, gpu: CudaDevice | None, stream: CudaStream | None,
            own_stream: CudaStream | None) -> Source:
    """Describe ``obj`` as a shareable buffer, with the stream its GPU writes are ordered on.

    ``host_slot``: where host bytes not in our shared memory are copied (the Source's buffer is
    then the first ``nbytes`` of the slot, its ``cleanup`` the slot's give-back).

    ``stream``: the caller's explicit choice (``send(stream=)``), which always wins. Without it:
    a CUDA Array Interface object names its stream itself (:func:`_cai_source`); a CUDA
    DLPack-only object is asked to order ``own_stream`` after its writes (:func:`_dlpack_source`);
    a device-layer Buffer was written on ``own_stream`` (the producer's stream).
    """
    if isinstance(obj, Buffer):
        _check_open(obj)
        on_gpu = isinstance(obj.device, CudaDevice)
        if on_gpu and not (ours := _need_gpu(gpu)).same_device(obj.device):
            raise InvalidArgument(f"{obj!r} is memory of {obj.device.identity.spec}; this producer hands off "
                                  f"{ours.identity.spec}'s: create a Producer on that device", where="send(obj=)")
        return Source(obj, shape=(obj.size,), stream=(stream or own_stream) if on_gpu else None, keep=obj)
    try:
        cai = getattr(obj, "__cuda_array_interface__", None)
    except TypeError:  # e.g. torch's bfloat16: the dtype has no typestr; DLPack has a code for it
        cai = None
    if cai is not None:
        return _cai_source(obj, cai, _need_gpu(gpu), stream, own_stream)
    if isinstance(obj, np.ndarray):
        return _host_source(obj, host_slot)  # checks the dtype itself (numpy exports no datetime by DLPack)
    if hasattr(obj, "__dlpack_device__") and not _has_buffer(obj):
        dev_type, _ = obj.__dlpack_device__()
        if int(dev_type) == dlpack.KDL_CUDA:
            return _dlpack_source(obj, _need_gpu(gpu), stream or own_stream)
        if int(dev_type) not in (dlpack.KDL_CPU, dlpack.KDL_CUDA_HOST):
            raise UnsupportedObject(f"a DLPack object on device type {int(dev_type)} is not supported (CPU, CUDA "
                                    "host and CUDA memory are)", where="send()", value=int(dev_type))
        return _host_dlpack_source(obj, host_slot)
    return _host_source(obj, host_slot)


def _need_gpu(gpu: CudaDevice | None) -> CudaDevice:
    if gpu is None:
        raise InvalidArgument("a CUDA array was given to a producer without a CUDA device: create it with "
                              "Producer(device='cuda:N')", where="send()")
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
            raise InvalidArgument(f"{type(obj).__name__}.__cuda_array_interface__ has stream 0, which CUDA Array "
                                  "Interface v3 forbids as ambiguous (1: legacy default, 2: per-thread)",
                                  where="send()", value=0)
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
        raise InvalidArgument("a CUDA DLPack object needs a stream to be ordered on", where="send(stream=)")
    capsule = obj.__dlpack__(stream=stream.protocol_handle)
    t = dlpack.read_capsule(capsule)
    if t.device_type != dlpack.KDL_CUDA:
        raise UnsupportedObject(f"{type(obj).__name__}.__dlpack__ gave device type {t.device_type}, though "
                                "__dlpack_device__ said CUDA", where="send()", value=t.device_type)
    nbytes = _contiguous_nbytes(obj, t.shape, t.typestr, t.strides)
    return Source(gpu.buffer_at(t.ptr, nbytes), t.typestr, t.shape, stream, keep=obj, pin=capsule,
                  dl_dtype=t.dl_dtype)


def _copy_source(nbytes: int, host_slot: HostSlot) -> tuple[Buffer, Buffer, Callable[[], None], np.ndarray]:
    """The first ``nbytes`` of a lent slot, as its own Buffer (exported as the slot's segment at
    offset 0, so a consumer maps each slot once however often it comes back) and as a uint8 array
    to copy into, the slot and its give-back."""
    slot, give_back = host_slot(nbytes)
    head: tuple[int, Buffer, np.ndarray] | None = getattr(slot, "_head", None)
    if head is None or head[0] != nbytes:
        # Remembered on the slot, the last size only: a steady stream of one size builds (and
        # exports) the view once per slot; the slot lends it to one handoff at a time.
        cpu: CpuDevice = slot.device  # type: ignore[assignment]
        sub = cpu.buffer_at(slot.ptr, nbytes)
        head = (nbytes, sub, np.frombuffer(sub.host_view(), dtype=np.uint8))
        slot._head = head  # type: ignore[attr-defined]
    return head[1], slot, give_back, head[2]


def _host_dlpack_source(obj: Any, host_slot: HostSlot) -> Source:
    """A host object that speaks DLPack but not the buffer protocol (a torch CPU tensor): read
    through its capsule, so every dtype DLPack has (bfloat16, float8) keeps its code."""
    capsule = obj.__dlpack__()
    t = dlpack.read_capsule(capsule)  # the capsule stays unconsumed: its destructor frees it
    nbytes = _contiguous_nbytes(obj, t.shape, t.typestr, t.strides)
    buf, slot, give_back, _ = _copy_source(nbytes, host_slot)
    if nbytes:
        ctypes.memmove(buf.ptr, t.ptr, nbytes)
    del capsule
    return Source(buf, t.typestr, t.shape, copied=True, slot=slot, keep=obj, cleanup=give_back,
                  dl_dtype=t.dl_dtype)


def _host_source(obj: Any, host_slot: HostSlot) -> Source:
    """Host bytes, copied once into a lent shared-memory slot (another process can only map
    shared memory)."""
    try:
        arr = np.asarray(memoryview(obj)) if not isinstance(obj, np.ndarray) else obj
    except (TypeError, ValueError):
        raise UnsupportedObject(f"cannot hand off {an(type(obj).__name__)}: it exposes neither a device buffer, "
                                "__cuda_array_interface__, __dlpack__ nor the buffer protocol (convert it, e.g. "
                                "numpy.asarray(x))", where="send()", value=type(obj).__name__) from None
    if arr.dtype.kind not in "biufc" or arr.dtype.subdtype is not None:
        if arr.dtype.kind != "V" or arr.dtype.names is not None:  # raw bytes pass as |u1
            raise UnsupportedObject(f"cannot hand off {an(type(obj).__name__)} of dtype {arr.dtype}: only numbers and "
                                    "bools travel as typed arrays (send a view as uint8 to pass raw bytes)",
                                    where="send()", value=str(arr.dtype))
        arr = arr.view(np.uint8)
    if not arr.flags.c_contiguous:
        _contiguous_nbytes(obj, tuple(arr.shape), arr.dtype.str, arr.strides)  # raises, naming the strides
    buf, slot, give_back, dst = _copy_source(arr.nbytes, host_slot)
    if arr.nbytes:
        dst[:] = arr.reshape(-1).view(np.uint8)
    return Source(buf, arr.dtype.str, tuple(arr.shape), copied=True, slot=slot, keep=obj, cleanup=give_back,
                  readonly=not arr.flags.writeable)


def _has_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
        return True
    except (TypeError, ValueError):  # ValueError: numpy's datetime64 and object arrays have no buffer format
        return False
