"""DLPack capsules: the legacy ``dltensor`` (ABI v0.8) and the versioned ``dltensor_versioned``
(DLPack 1.x) exporters, and a reader for legacy capsules we take in.

``numpy.from_dlpack``, CuPy and PyTorch ask for a versioned capsule with ``max_version=(1, 0)``
and fall back to a legacy one. A capsule keeps its owner object alive until the consumer's
deleter runs (or until the capsule is destroyed unconsumed).

Every capsule we export is built by numpy (over a numpy array that wraps the memory and is never
read by us) and then patched in place to the buffer's device and DLPack dtype. Why: a capsule's
destructor and a DLPack deleter run when the consumer drops them, often while the consumer's
own error is pending (``numpy.from_dlpack`` refusing a CUDA capsule, torch refusing a dtype, an
array freed during exception unwinding). A ctypes callback cannot run then: CPython turns the
consumer's clean error into "Exception ignored on calling ctypes callback" and a SystemError.
numpy's deleter and destructor are C functions that never call Python code.

dtypes: an array-interface typestr (``<f4``, ``|b1``) maps to DLPack's Int/UInt/Float/Complex/Bool
codes; dtypes numpy lacks (bfloat16, the float8 variants) travel as their DLPack code (``dl_dtype``:
``[code, bits, lanes]``) beside a ``|V<itemsize>`` typestr, so torch and CuPy get them back
exactly. DLPack has no byte order: a non-native typestr cannot be exported (BufferError), as
numpy does.
"""

from __future__ import annotations

import ctypes
import math
import sys
from typing import Any, NamedTuple

import numpy as np

from ..errors import ExportRefused, UnsupportedObject

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST = 1, 2, 3
DLPACK_VERSION = (1, 1)  # what versioned capsules we build declare (1.1 added the float8 codes)
FLAG_READ_ONLY, FLAG_IS_COPIED = 1 << 0, 1 << 1

_KIND_CODE = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}  # DLDataTypeCode: Int, UInt, Float, Complex, Bool
_CODE_KIND = {v: k for k, v in _KIND_CODE.items()}
# DLDataTypeCodes with no array-interface kind (DLPack 1.1), each with its one valid bit width.
EXTRA_DTYPES: dict[str, tuple[int, int]] = {
    "bfloat16": (4, 16),
    "float8_e3m4": (7, 8), "float8_e4m3": (8, 8), "float8_e4m3b11fnuz": (9, 8), "float8_e4m3fn": (10, 8),
    "float8_e4m3fnuz": (11, 8), "float8_e5m2": (12, 8), "float8_e5m2fnuz": (13, 8), "float8_e8m0fnu": (14, 8),
}
EXTRA_BY_CODE = {code: (name, bits) for name, (code, bits) in EXTRA_DTYPES.items()}
_NON_NATIVE = ">" if sys.byteorder == "little" else "<"


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]
_DeleterV = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                                     ("deleter", _DeleterV), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]

_api = ctypes.PyDLL(None)
_PyCapsule_IsValid = _api.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_PyCapsule_GetPointer = _api.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_NAME, _NAME_V = b"dltensor", b"dltensor_versioned"


def dtype_of(typestr: str, dl_dtype: list[int] | tuple[int, ...] | None = None) -> DLDataType:
    """The DLDataType of a typestr (or of the ``dl_dtype`` code a ``|V`` typestr stands for).

    Raises BufferError for what DLPack cannot express: a non-native byte order, or a kind with
    no DLPack code (datetimes, strings, raw bytes without a ``dl_dtype``)."""
    if dl_dtype is not None:
        return DLDataType(int(dl_dtype[0]), int(dl_dtype[1]), int(dl_dtype[2]))
    order, kind, size = typestr[0], typestr[1], int(typestr[2:])
    if order == _NON_NATIVE and size > 1:
        raise ExportRefused(f"dtype {typestr!r} is not in native byte order, which DLPack cannot express; "
                            "read it with .numpy() (byte order kept) or send a byte-swapped copy", value=typestr)
    if kind not in _KIND_CODE:
        raise ExportRefused(f"dtype {typestr!r} has no DLPack equivalent", value=typestr)
    return DLDataType(_KIND_CODE[kind], size * 8, 1)


def typestr_of(code: int, bits: int, lanes: int) -> tuple[str, list[int] | None]:
    """A DLDataType as (typestr, dl_dtype): dl_dtype is None where the typestr says it all.

    Raises ValueError for vector dtypes (lanes > 1), sub-byte widths and codes we do not know."""
    if lanes != 1 or bits % 8 or bits == 0:
        raise UnsupportedObject(f"DLPack dtype (code {code}, bits {bits}, lanes {lanes}) is not a whole-byte scalar",
                                value=(code, bits, lanes))
    itemsize = bits // 8
    kind = _CODE_KIND.get(code)
    if kind is not None:
        return (f"<{kind}{itemsize}" if itemsize > 1 else f"|{kind}{itemsize}"), None
    extra = EXTRA_BY_CODE.get(code)
    if extra is not None and extra[1] == bits:
        return f"|V{itemsize}", [code, bits, 1]
    raise UnsupportedObject(f"DLPack dtype code {code} with {bits} bits is not one Hurray knows (DLPack 1.1 codes "
                            "0-2, 4-14)", value=(code, bits))


def dtype_name(typestr: str, dl_dtype: list[int] | tuple[int, ...] | None) -> str:
    """A readable name: the DLPack-only dtype's name, or the typestr."""
    if dl_dtype is not None and int(dl_dtype[0]) in EXTRA_BY_CODE:
        return EXTRA_BY_CODE[int(dl_dtype[0])][0]
    return typestr


def host_array(ptr: int, shape: tuple[int, ...], typestr: str, owner: Any,
               dl_dtype: list[int] | tuple[int, ...] | None = None, read_only: bool = False) -> np.ndarray:
    """A numpy array over the C-contiguous memory at ``ptr`` that keeps ``owner`` alive (its base
    holds it). A dtype numpy lacks is viewed as unsigned ints of its size (``patch`` renames it).
    For device memory the array only carries the address into a capsule: nothing here reads it."""
    itemsize = int(typestr[2:])
    raw = (ctypes.c_char * (itemsize * math.prod(shape))).from_address(ptr)
    raw._owner = owner  # type: ignore[attr-defined]  # the array's base keeps the owner alive
    arr = np.frombuffer(memoryview(raw), dtype=np.dtype(typestr if dl_dtype is None else f"u{itemsize}"))
    arr = arr.reshape(shape)
    if read_only:
        arr.flags.writeable = False
    return arr


def make_capsule(ptr: int, shape: tuple[int, ...], typestr: str, device_type: int, device_id: int, owner: Any,
                 *, dl_dtype: list[int] | tuple[int, ...] | None = None, versioned: bool = False,
                 read_only: bool = False, copied: bool = False) -> Any:
    """A capsule over C-contiguous memory at ``ptr`` on (``device_type``, ``device_id``);
    ``owner`` lives until the consumer deletes the tensor (or the capsule is dropped unconsumed).

    ``versioned``: a DLPack 1.x ``dltensor_versioned`` capsule carrying the READ_ONLY and
    IS_COPIED flags; else a legacy ``dltensor`` one, which cannot say read-only (BufferError
    then, as numpy does: the consumer would think it may write)."""
    dtype_of(typestr, dl_dtype)  # BufferError for what DLPack cannot express
    if read_only and not versioned:
        raise ExportRefused("this buffer is read-only, which a legacy (pre-1.0) DLPack capsule cannot signal; "
                            "ask for max_version=(1, 0) or later", where="__dlpack__(max_version=)")
    arr = host_array(ptr, shape, typestr, owner, dl_dtype, read_only)
    capsule = arr.__dlpack__(max_version=(1, 0) if versioned else None)
    return patch(capsule, dl_dtype=dl_dtype, device=(device_type, device_id), copied=copied)


def patch(capsule: Any, *, dl_dtype: list[int] | tuple[int, ...] | None = None,
          device: tuple[int, int] | None = None, copied: bool = False) -> Any:
    """Patch a fresh, unconsumed capsule (numpy's) in place: the DLPack dtype ``dl_dtype`` in place
    of the same-sized unsigned int it was built with (numpy lacks bfloat16 and float8), the
    ``device`` the memory really lives on, and for a versioned one our DLPack version and the
    IS_COPIED flag."""
    if _PyCapsule_IsValid(id(capsule), _NAME_V):
        mv = DLManagedTensorVersioned.from_address(_PyCapsule_GetPointer(id(capsule), _NAME_V))
        mv.version = DLPackVersion(*DLPACK_VERSION)
        if copied:
            mv.flags |= FLAG_IS_COPIED
        t = mv.dl_tensor
    else:
        t = DLManagedTensor.from_address(_PyCapsule_GetPointer(id(capsule), _NAME)).dl_tensor
    if dl_dtype is not None:
        if t.dtype.code != _KIND_CODE["u"] or t.dtype.bits != dl_dtype[1]:
            raise ValueError(f"capsule dtype (code {t.dtype.code}, bits {t.dtype.bits}) is not the stand-in for "
                             f"{list(dl_dtype)}")
        t.dtype = DLDataType(int(dl_dtype[0]), int(dl_dtype[1]), int(dl_dtype[2]))
    if device is not None:
        t.device = DLDevice(*device)
    return capsule


class CapsuleTensor(NamedTuple):
    """What a ``dltensor`` capsule describes (the capsule itself stays unconsumed)."""

    ptr: int  # data + byte_offset
    shape: tuple[int, ...]
    typestr: str
    strides: tuple[int, ...] | None  # in bytes, as the CUDA Array Interface writes them
    device_type: int
    device_id: int
    dl_dtype: list[int] | None = None  # for a dtype numpy lacks (typestr is then |V<itemsize>)


def read_capsule(capsule: Any) -> CapsuleTensor:
    """Read a legacy ``dltensor`` capsule without consuming it (its destructor still frees it).

    Raises ValueError for anything else (a used or versioned capsule, a vector dtype).
    """
    if not _PyCapsule_IsValid(id(capsule), _NAME):
        raise UnsupportedObject(f"{capsule!r} is not an unconsumed 'dltensor' DLPack capsule")
    mt = DLManagedTensor.from_address(_PyCapsule_GetPointer(id(capsule), _NAME))
    t = mt.dl_tensor
    typestr, dl_dtype = typestr_of(int(t.dtype.code), int(t.dtype.bits), int(t.dtype.lanes))
    itemsize = t.dtype.bits // 8
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = None if not t.strides else tuple(int(t.strides[i]) * itemsize for i in range(t.ndim))
    return CapsuleTensor(int(t.data or 0) + int(t.byte_offset), shape, typestr, strides,
                         int(t.device.device_type), int(t.device.device_id), dl_dtype)
