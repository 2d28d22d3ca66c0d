"""A minimal DLPack (v0.8 ABI, legacy ``dltensor`` capsule) exporter, via ctypes.

``numpy.from_dlpack``, CuPy and PyTorch accept a legacy capsule when the producer does not offer a
versioned one. The capsule keeps the owner object alive until the consumer's deleter runs.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, NamedTuple

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST = 1, 2, 3
_KIND_CODE = {"i": 0, "u": 1, "f": 2, "b": 6, "c": 5}  # DLDataTypeCode: Int, UInt, Float, Bool, Complex


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


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_live: dict[int, tuple[Any, ...]] = {}  # address of the DLManagedTensor -> what it keeps alive
_live_lock = threading.Lock()


@_Deleter
def _delete(ptr: Any) -> None:
    with _live_lock:
        _live.pop(ctypes.addressof(ptr.contents), None)


# The destructor gets a PyObject* of a capsule being destroyed: take it as a plain pointer (a
# py_object argument would resurrect the dying object).
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
_NAME = b"dltensor"


@_CapsuleDestructor
def _capsule_destructor(capsule: Any) -> None:
    # A consumer renames a consumed capsule to "used_dltensor" and owns the deleter from then on.
    if _PyCapsule_IsValid(capsule, _NAME):
        addr = _PyCapsule_GetPointer(capsule, _NAME)
        mt = DLManagedTensor.from_address(addr)
        mt.deleter(ctypes.pointer(mt))


def dtype_of(typestr: str) -> DLDataType:
    kind, size = typestr[1], int(typestr[2:])
    if kind not in _KIND_CODE:
        raise ValueError(f"dtype {typestr!r} has no DLPack equivalent")
    return DLDataType(_KIND_CODE[kind], size * 8, 1)


def make_capsule(ptr: int, shape: tuple[int, ...], typestr: str, device_type: int, device_id: int, owner: Any) -> Any:
    """A ``dltensor`` capsule over C-contiguous memory at ``ptr``; ``owner`` lives until deletion."""
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    mt = DLManagedTensor()
    mt.dl_tensor.data = ptr
    mt.dl_tensor.device = DLDevice(device_type, device_id)
    mt.dl_tensor.ndim = ndim
    mt.dl_tensor.dtype = dtype_of(typestr)
    mt.dl_tensor.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    mt.dl_tensor.strides = None  # C-contiguous
    mt.dl_tensor.byte_offset = 0
    mt.deleter = _delete
    with _live_lock:
        _live[ctypes.addressof(mt)] = (mt, shape_arr, owner)
    return _PyCapsule_New(ctypes.addressof(mt), _NAME, ctypes.cast(_capsule_destructor, ctypes.c_void_p))


class CapsuleTensor(NamedTuple):
    """What a ``dltensor`` capsule describes (the capsule itself stays unconsumed)."""

    ptr: int  # data + byte_offset
    shape: tuple[int, ...]
    typestr: str
    strides: tuple[int, ...] | None  # in bytes, as the CUDA Array Interface writes them
    device_type: int
    device_id: int


_CODE_KIND = {v: k for k, v in _KIND_CODE.items()}


def read_capsule(capsule: Any) -> CapsuleTensor:
    """Read a legacy ``dltensor`` capsule without consuming it (its destructor still frees it).

    Raises ValueError for anything else (a used or versioned capsule, a vector dtype).
    """
    if not _PyCapsule_IsValid(id(capsule), _NAME):
        raise ValueError(f"{capsule!r} is not an unconsumed 'dltensor' DLPack capsule")
    mt = DLManagedTensor.from_address(_PyCapsule_GetPointer(id(capsule), _NAME))
    t = mt.dl_tensor
    kind = _CODE_KIND.get(int(t.dtype.code))
    if kind is None or t.dtype.lanes != 1 or t.dtype.bits % 8:
        raise ValueError(f"DLPack dtype (code {t.dtype.code}, bits {t.dtype.bits}, lanes {t.dtype.lanes}) "
                         "has no array-interface equivalent")
    itemsize = t.dtype.bits // 8
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = None if not t.strides else tuple(int(t.strides[i]) * itemsize for i in range(t.ndim))
    return CapsuleTensor(int(t.data or 0) + int(t.byte_offset), shape, f"<{kind}{itemsize}" if itemsize > 1 else
                         f"|{kind}{itemsize}", strides, int(t.device.device_type), int(t.device.device_id))
