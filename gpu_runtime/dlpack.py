"""DLPack capsules through ctypes: read one a producer made (``read``), and make one over device
memory (``export``, which ``DeviceArray.__dlpack__`` returns).

``read`` takes the unversioned ``"dltensor"`` capsule (dlpack.h's ``DLManagedTensor``) and the
versioned ``"dltensor_versioned"`` one of DLPack 1.x (``DLManagedTensorVersioned``: its read-only
and is-copied flags are reported). A capsule read here is not consumed: it keeps its name, so its
own destructor calls the producer's deleter. ``export`` makes the unversioned kind, which every
consumer takes (a producer may answer a ``max_version`` with it).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

KDL_CUDA = 2  # DLDeviceType: CUDA device memory
KDL_CUDA_MANAGED = 13  # CUDA managed memory
_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"
FLAG_READ_ONLY = 1 << 0  # DLManagedTensorVersioned.flags: the consumer must not write
FLAG_IS_COPIED = 1 << 1  # the producer copied the data for this export


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _Version),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _Tensor),
    ]


# Prototypes of their own (not ctypes.pythonapi's shared attributes, whose argtypes others set).
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi)
)
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)
_capsule_is = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
# In a capsule's destructor the capsule is being freed: take it as a bare address (no reference).
_dying_is = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_IsValid", ctypes.pythonapi))
_dying_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)

# DLPack's type codes (0 int, 1 uint, 2 float, 4 bfloat, 6 bool) and the numpy dtypes of each;
# (code, bits) <-> numpy dtype, bits being the dtype's size.
_KINDS = {
    0: (np.int8, np.int16, np.int32, np.int64),
    1: (np.uint8, np.uint16, np.uint32, np.uint64),
    2: (np.float16, np.float32, np.float64),
    4: (ml_dtypes.bfloat16,),
    6: (np.bool_,),
}
_CODES: dict[tuple[int, int], np.dtype] = {
    (code, np.dtype(t).itemsize * 8): np.dtype(t) for code, types in _KINDS.items() for t in types
}
_DTYPES = {dtype: code for code, dtype in _CODES.items()}


@dataclass(frozen=True)
class Tensor:
    """What a capsule describes: the first element's address, shape, dtype (None for one numpy
    has no name for), strides in elements (None: C-contiguous), device type and ordinal, and (a
    versioned capsule's flags) whether it is read-only and whether the producer copied it."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype | None
    strides: tuple[int, ...] | None
    device_type: int
    device_id: int
    readonly: bool = False
    copied: bool = False


def read(capsule: Any) -> Tensor:
    """The tensor a DLPack capsule holds, unversioned or of DLPack 1.x (the capsule stays
    unconsumed); a used capsule, or a versioned one of another major version, is a TypeError."""
    flags = 0
    if _capsule_is(capsule, _NAME):
        t = _Managed.from_address(_capsule_pointer(capsule, _NAME)).dl_tensor
    elif _capsule_is(capsule, _NAME_VERSIONED):
        managed = _ManagedVersioned.from_address(_capsule_pointer(capsule, _NAME_VERSIONED))
        if managed.version.major != 1:
            raise TypeError(f"__dlpack__ returned a DLPack {managed.version.major}.x capsule; 1.x is read here")
        t, flags = managed.dl_tensor, int(managed.flags)
    else:
        raise TypeError("__dlpack__ returned no 'dltensor' or 'dltensor_versioned' capsule (a used one?)")
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = tuple(int(t.strides[i]) for i in range(t.ndim)) if t.strides else None
    dtype = _CODES.get((t.dtype.code, t.dtype.bits)) if t.dtype.lanes == 1 else None
    return Tensor(
        int(t.data or 0) + int(t.byte_offset),
        shape,
        dtype,
        strides,
        int(t.device.device_type),
        int(t.device.device_id),
        bool(flags & FLAG_READ_ONLY),
        bool(flags & FLAG_IS_COPIED),
    )


# -- export ----------------------------------------------------------------------------------------
_LIVE: dict[int, tuple[Any, ...]] = {}  # managed tensor address -> what keeps it and its shape alive


@_DELETER
def _delete(managed: Any) -> None:
    _LIVE.pop(ctypes.cast(managed, ctypes.c_void_p).value or 0, None)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _destroy_capsule(capsule: int) -> None:
    """An unconsumed capsule's destructor: nobody took the tensor, so its deleter runs here."""
    if _dying_is(capsule, _NAME):
        _LIVE.pop(_dying_pointer(capsule, _NAME) or 0, None)


def export(ptr: int, shape: tuple[int, ...], dtype: np.dtype, device_id: int, owner: Any) -> Any:
    """A ``"dltensor"`` capsule over C-contiguous device memory at ``ptr``; ``owner`` is kept
    alive until the consumer's deleter (or the unconsumed capsule's destructor) runs."""
    code = _DTYPES.get(np.dtype(dtype))
    if code is None:  # the array API's error for data it cannot export
        raise BufferError(f"DLPack export: no DLPack type for {np.dtype(dtype)}")
    managed = _Managed()
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    t = managed.dl_tensor
    t.data = ptr
    t.device = _Device(KDL_CUDA, device_id)
    t.ndim = len(shape)
    t.dtype = _DataType(code[0], code[1], 1)
    t.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    t.strides = None
    t.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _delete
    address = ctypes.addressof(managed)
    _LIVE[address] = (managed, dims, owner)
    try:
        return _capsule_new(address, _NAME, ctypes.cast(_destroy_capsule, ctypes.c_void_p).value)
    except BaseException:
        _LIVE.pop(address, None)
        raise


def live_exports() -> int:
    """Capsules made by ``export`` whose tensor no consumer has released yet (for leak tests)."""
    return len(_LIVE)
