"""DLPack capsules as another library's producer makes them, over any address (no GPU)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from gpu_runtime import dlpack

_KEEP: list = []  # the capsules' structures: the capsules have no destructor to free them


def capsule(ptr: int, shape: tuple[int, ...], dtype: Any, *, versioned: bool = True, flags: int = 0,
            byte_offset: int = 0) -> Any:
    """A ``dltensor_versioned`` (DLPack 1.0, ``flags``) or ``dltensor`` capsule of a CUDA tensor at
    ``ptr`` (``data``) plus ``byte_offset``, C-contiguous ``shape`` of numpy ``dtype``."""
    managed = dlpack._ManagedVersioned() if versioned else dlpack._Managed()
    if versioned:
        managed.version.major, managed.version.minor, managed.flags = 1, 0, flags
    dims = (ctypes.c_int64 * len(shape))(*shape)
    t = managed.dl_tensor
    t.data, t.device, t.ndim = ptr, dlpack._Device(dlpack.KDL_CUDA, 0), len(shape)
    t.dtype = dlpack._DataType(*dlpack._DTYPES[np.dtype(dtype)], 1)
    t.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = byte_offset
    _KEEP.append((managed, dims))
    return dlpack._capsule_new(ctypes.addressof(managed), b"dltensor_versioned" if versioned else b"dltensor", None)
