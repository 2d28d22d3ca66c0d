"""DLPack capsules, via ctypes: the legacy ``dltensor`` (ABI v0.8) and the versioned
``dltensor_versioned`` (DLPack 1.x) exporters, and a reader for legacy capsules we take in.

``numpy.from_dlpack``, CuPy and PyTorch ask for a versioned capsule with ``max_version=(1, 0)``
and fall back to a legacy one. A capsule keeps its owner object alive until the consumer's
deleter runs (or until the capsule is destroyed unconsumed).

dtypes: an array-interface typestr (``<f4``, ``|b1``) maps to DLPack's Int/UInt/Float/Complex/Bool
codes; dtypes numpy lacks (bfloat16, the float8 variants) travel as their DLPack code (``dl_dtype``:
``[code, bits, lanes]``) beside a ``|V<itemsize>`` typestr, so torch and CuPy get them back
exactly. DLPack has no byte order: a non-native typestr cannot be exported (BufferError), as
numpy does.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any, NamedTuple

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

_live: dict[int, tuple[Any, ...]] = {}  # address of the managed tensor -> what it keeps alive
_live_lock = threading.Lock()


@_Deleter
def _delete(ptr: Any) -> None:
    with _live_lock:
        _live.pop(ctypes.addressof(ptr.contents), None)


@_DeleterV
def _delete_versioned(ptr: Any) -> None:
    with _live_lock:
        _live.pop(ctypes.addressof(ptr.contents), None)


# The destructor gets a PyObject* of a capsule being destroyed: take it as a plain pointer (a
# py_object argument would resurrect the dying object). Limitation: a ctypes callback cannot run
# while an error is pending, so if a consumer fails after taking one of these capsules (torch
# refusing a dtype), its error becomes a SystemError. Host capsules are therefore numpy's (a C
# destructor; ReceivedBuffer.__dlpack__); these serve CUDA buffers.
_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api = ctypes.PyDLL(None)
_PyCapsule_IsValid = _api.PyCapsule_IsValid
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_PyCapsule_GetPointer = _api.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
# PyCapsule_New keeps the name pointer: these objects live as long as the module.
_NAME, _NAME_V = ctypes.c_char_p(b"dltensor"), ctypes.c_char_p(b"dltensor_versioned")


def _destroy(capsule: int, name: Any) -> None:
    # An unconsumed capsule still has its name: nobody took the tensor, so we release it. A
    # consumed one was renamed "used_..." and its consumer calls the deleter.
    if _PyCapsule_IsValid(capsule, name):
        with _live_lock:
            _live.pop(_PyCapsule_GetPointer(capsule, name), None)


@_CapsuleDestructor
def _capsule_destructor(capsule: int) -> None:
    _destroy(capsule, _NAME)


@_CapsuleDestructor
def _capsule_destructor_versioned(capsule: int) -> None:
    _destroy(capsule, _NAME_V)


def dtype_of(typestr: str, dl_dtype: list[int] | tuple[int, ...] | None = None) -> DLDataType:
    """The DLDataType of a typestr (or of the ``dl_dtype`` code a ``|V`` typestr stands for).

    Raises BufferError for what DLPack cannot express: a non-native byte order, or a kind with
    no DLPack code (datetimes, strings, raw bytes without a ``dl_dtype``)."""
    if dl_dtype is not None:
        return DLDataType(int(dl_dtype[0]), int(dl_dtype[1]), int(dl_dtype[2]))
    order, kind, size = typestr[0], typestr[1], int(typestr[2:])
    if order == _NON_NATIVE and size > 1:
        raise BufferError(f"dtype {typestr!r} is not in native byte order, which DLPack cannot express; "
                          "read it with .numpy() (byte order kept) or send a byte-swapped copy")
    if kind not in _KIND_CODE:
        raise BufferError(f"dtype {typestr!r} has no DLPack equivalent")
    return DLDataType(_KIND_CODE[kind], size * 8, 1)


def typestr_of(code: int, bits: int, lanes: int) -> tuple[str, list[int] | None]:
    """A DLDataType as (typestr, dl_dtype): dl_dtype is None where the typestr says it all.

    Raises ValueError for vector dtypes (lanes > 1), sub-byte widths and codes we do not know."""
    if lanes != 1 or bits % 8 or bits == 0:
        raise ValueError(f"DLPack dtype (code {code}, bits {bits}, lanes {lanes}) is not a whole-byte scalar")
    itemsize = bits // 8
    kind = _CODE_KIND.get(code)
    if kind is not None:
        return (f"<{kind}{itemsize}" if itemsize > 1 else f"|{kind}{itemsize}"), None
    extra = EXTRA_BY_CODE.get(code)
    if extra is not None and extra[1] == bits:
        return f"|V{itemsize}", [code, bits, 1]
    raise ValueError(f"DLPack dtype code {code} with {bits} bits is not one Hurray knows (DLPack 1.1 codes "
                     f"0-2, 4-14)")


def dtype_name(typestr: str, dl_dtype: list[int] | tuple[int, ...] | None) -> str:
    """A readable name: the DLPack-only dtype's name, or the typestr."""
    if dl_dtype is not None and int(dl_dtype[0]) in EXTRA_BY_CODE:
        return EXTRA_BY_CODE[int(dl_dtype[0])][0]
    return typestr


def make_capsule(ptr: int, shape: tuple[int, ...], typestr: str, device_type: int, device_id: int, owner: Any,
                 *, dl_dtype: list[int] | tuple[int, ...] | None = None, versioned: bool = False,
                 read_only: bool = False, copied: bool = False) -> Any:
    """A capsule over C-contiguous memory at ``ptr``; ``owner`` lives until it is deleted.

    ``versioned``: a DLPack 1.x ``dltensor_versioned`` capsule carrying the READ_ONLY and
    IS_COPIED flags; else a legacy ``dltensor`` one, which cannot say read-only (BufferError
    then, as numpy does: the consumer would think it may write)."""
    dtype = dtype_of(typestr, dl_dtype)
    if read_only and not versioned:
        raise BufferError("this buffer is read-only, which a legacy (pre-1.0) DLPack capsule cannot signal; "
                          "ask for max_version=(1, 0) or later")
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    mt: DLManagedTensor | DLManagedTensorVersioned
    if versioned:
        mt = DLManagedTensorVersioned()
        mt.version = DLPackVersion(*DLPACK_VERSION)
        mt.flags = (FLAG_READ_ONLY if read_only else 0) | (FLAG_IS_COPIED if copied else 0)
        mt.deleter = _delete_versioned
    else:
        mt = DLManagedTensor()
        mt.deleter = _delete
    t = mt.dl_tensor
    t.data = ptr
    t.device = DLDevice(device_type, device_id)
    t.ndim = ndim
    t.dtype = dtype
    t.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    t.strides = None  # C-contiguous
    t.byte_offset = 0
    with _live_lock:
        _live[ctypes.addressof(mt)] = (mt, shape_arr, owner)
    if versioned:
        return _PyCapsule_New(ctypes.addressof(mt), _NAME_V, ctypes.cast(_capsule_destructor_versioned,
                                                                         ctypes.c_void_p))
    return _PyCapsule_New(ctypes.addressof(mt), _NAME, ctypes.cast(_capsule_destructor, ctypes.c_void_p))


def patch_dtype(capsule: Any, dl_dtype: list[int] | tuple[int, ...] | None) -> Any:
    """Give a fresh, unconsumed capsule (ours or numpy's) the DLPack dtype ``dl_dtype`` in place
    of the same-sized unsigned int it was built with (numpy lacks bfloat16 and float8)."""
    if dl_dtype is None:
        return capsule
    if _PyCapsule_IsValid(id(capsule), _NAME_V):
        t = DLManagedTensorVersioned.from_address(_PyCapsule_GetPointer(id(capsule), _NAME_V)).dl_tensor
    else:
        t = DLManagedTensor.from_address(_PyCapsule_GetPointer(id(capsule), _NAME)).dl_tensor
    if t.dtype.code != _KIND_CODE["u"] or t.dtype.bits != dl_dtype[1]:
        raise ValueError(f"capsule dtype (code {t.dtype.code}, bits {t.dtype.bits}) is not the stand-in for "
                         f"{list(dl_dtype)}")
    t.dtype = DLDataType(int(dl_dtype[0]), int(dl_dtype[1]), int(dl_dtype[2]))
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
        raise ValueError(f"{capsule!r} is not an unconsumed 'dltensor' DLPack capsule")
    mt = DLManagedTensor.from_address(_PyCapsule_GetPointer(id(capsule), _NAME))
    t = mt.dl_tensor
    typestr, dl_dtype = typestr_of(int(t.dtype.code), int(t.dtype.bits), int(t.dtype.lanes))
    itemsize = t.dtype.bits // 8
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = None if not t.strides else tuple(int(t.strides[i]) * itemsize for i in range(t.ndim))
    return CapsuleTensor(int(t.data or 0) + int(t.byte_offset), shape, typestr, strides,
                         int(t.device.device_type), int(t.device.device_id), dl_dtype)
