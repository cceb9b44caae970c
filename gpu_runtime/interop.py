"""Device arrays from other libraries, taken where a layer takes a device buffer.

``device_address`` accepts, in this order of preference:
  - a ``DeviceArray`` (this package's);
  - anything with ``__cuda_array_interface__`` (v3: CuPy, torch, Numba, JAX);
  - anything with ``__dlpack__`` and ``__dlpack_device__`` (torch bf16 tensors, which have no
    array interface; JAX);
  - a bare device address (an int, ``DevicePtr`` or ``DeviceBuffer``), taken on trust.
For the first three it checks, before anything is launched, that the array is on the backend's
device, C-contiguous, of an accepted dtype and long enough, and returns its address.

Streams: neither protocol's stream handshake is performed (no event, no synchronisation, so a
call stays capturable): the caller orders the producer's work before the launch, as engines that
run one stream do. A DLPack capsule is read and left unconsumed (its producer frees it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from . import dlpack, validate
from .device_array import DeviceArray
from .pointers import DevicePtr

BF16 = np.dtype(ml_dtypes.bfloat16)
INDEX = (np.dtype(np.uint32), np.dtype(np.int32))  # u32 index buffers; int32 is read as its bits


@dataclass(frozen=True)
class ArrayInfo:
    """A foreign array as this module reads it."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype | None
    contiguous: bool
    device: int | None  # CUDA ordinal; None where the protocol does not say (the array interface)
    readonly: bool
    protocol: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...] | None, item: int) -> bool:
    """``strides`` (None: C order) are C order for ``shape``, an element ``item`` stride units
    wide (bytes: the array interface; elements, so 1: DLPack); extent-1 axes may have any."""
    if strides is None:
        return True
    expect = item
    for extent, stride in zip(reversed(shape), reversed(strides)):
        if extent != 1 and stride != expect:
            return False
        expect *= extent
    return True


def _interface(obj: Any) -> dict | None:
    """``obj.__cuda_array_interface__``, or None where it has none (torch raises TypeError for
    a dtype the interface cannot spell, bf16: such a tensor is read through DLPack)."""
    try:
        return obj.__cuda_array_interface__
    except (AttributeError, TypeError):
        return None


def _from_interface(cai: Any) -> ArrayInfo:
    try:
        shape = tuple(int(s) for s in cai["shape"])
        ptr, readonly = cai["data"]
        dtype = np.dtype(cai["typestr"])
        strides = cai.get("strides")
        strides = None if strides is None else tuple(int(s) for s in strides)
    except (KeyError, TypeError, ValueError) as e:
        raise TypeError(f"malformed __cuda_array_interface__ ({e})") from None
    if cai.get("mask") is not None:
        raise TypeError("a masked __cuda_array_interface__ array (its mask would be ignored)")
    if dtype.kind == "V" and dtype.itemsize == 2:
        dtype = BF16  # the interface's only spelling of bf16 (DeviceArray exports it so)
    contiguous = _c_contiguous(shape, strides, dtype.itemsize)
    return ArrayInfo(int(ptr or 0), shape, dtype, contiguous, None, bool(readonly), "__cuda_array_interface__")


def _capsule(obj: Any) -> Any:
    """``obj.__dlpack__`` asked for no synchronisation (``stream=-1``: the call stays capturable)
    and no copy, as DLPack 1.0 where the producer takes ``max_version``; a producer that takes
    fewer keywords (TypeError) is asked with fewer."""
    try:
        return obj.__dlpack__(stream=-1, max_version=(1, 0), copy=False)
    except TypeError:
        pass
    try:
        return obj.__dlpack__(stream=-1)
    except TypeError:
        return obj.__dlpack__()


def _from_dlpack(obj: Any) -> ArrayInfo:
    device_type, device_id = obj.__dlpack_device__()
    if int(device_type) not in (dlpack.KDL_CUDA, dlpack.KDL_CUDA_MANAGED):
        raise ValueError(f"a DLPack array on device type {int(device_type)}, not CUDA memory")
    t = dlpack.read(_capsule(obj))
    if t.copied:  # the copy would go with the capsule, at the end of this call
        raise BufferError("__dlpack__ exported a copy (flag IS_COPIED), not the array's own memory")
    # managed memory's device_id is 0 whatever the device (dlpack.h): the pointer's device decides
    device = None if t.device_type == dlpack.KDL_CUDA_MANAGED else t.device_id
    contiguous = _c_contiguous(t.shape, t.strides, 1)
    return ArrayInfo(t.ptr, t.shape, t.dtype, contiguous, device, t.readonly, "__dlpack__")


def array_info(obj: Any) -> ArrayInfo | None:
    """``obj`` read through the array interface or DLPack; None for anything else."""
    if isinstance(obj, DeviceArray):
        return ArrayInfo(
            int(obj.ptr), obj.shape, obj.dtype, True, getattr(obj.gpu, "device", None), False, "DeviceArray"
        )
    cai = _interface(obj)
    if cai is not None:
        return _from_interface(cai)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(obj)
    return None


def _names(dtypes: tuple[np.dtype, ...]) -> str:
    return " or ".join(str(d) for d in dtypes)


def device_address(
    obj: Any,
    what: str,
    *,
    dtypes: tuple[np.dtype, ...],
    count: int,
    gpu: Any = None,
    cols: int | None = None,
    writable: bool = False,
) -> int:
    """The device address of ``obj``, which must hold at least ``count`` elements of one of
    ``dtypes`` (the first named in errors), C-contiguous, on ``gpu``'s device; with ``cols``, a
    2-D or more array's last extent must be ``cols``; with ``writable``, the array must not be
    read-only. A bare address is taken as it is (not null). Errors name ``what``."""
    if type(obj) is int or type(obj) is DevicePtr:  # the common case, without the protocol lookups
        return validate.pointer(obj, what)
    if (
        type(obj) is DeviceArray
        and obj.dtype in dtypes
        and obj.ptr
        and math.prod(obj.shape) >= count
        and (cols is None or len(obj.shape) < 2 or obj.shape[-1] == cols)
        and (gpu is None or obj.gpu is gpu)
    ):  # this package's arrays, the plain case: on this backend (its device), long enough, writable
        return obj.ptr
    info = array_info(obj)
    if info is None:
        try:
            return validate.pointer(obj, what)
        except TypeError:
            raise TypeError(
                f"{what}: expected a device address, a DeviceArray, or an array with "
                f"__cuda_array_interface__ or __dlpack__; got {type(obj).__name__}"
            ) from None
    if info.dtype is None or info.dtype not in dtypes:  # (a dtype compares equal to None: float64)
        raise TypeError(f"{what}: dtype {info.dtype}, expected {_names(dtypes)}")
    if not info.contiguous:
        raise ValueError(f"{what}: not C-contiguous (a strided view); pass a contiguous array")
    if info.size < count:
        raise ValueError(f"{what}: {info.size} entries, the call needs {count}")
    if cols is not None and len(info.shape) >= 2 and info.shape[-1] != cols:
        raise ValueError(f"{what}: rows of {info.shape[-1]} values, expected {cols}")
    if writable and info.readonly:
        raise ValueError(f"{what}: a read-only array")
    if not info.ptr:
        if count == 0:
            return 0
        raise ValueError(f"{what}: null device pointer")
    _check_device(info, what, gpu)
    return info.ptr


def _check_device(info: ArrayInfo, what: str, gpu: Any) -> None:
    """The array lives on ``gpu``'s device: by the protocol's word, or asked of the driver."""
    want = getattr(gpu, "device", None)
    if want is None:
        return
    got = info.device
    if got is None:
        locate = getattr(gpu, "pointer_device", None)
        if locate is None:
            return
        got = locate(info.ptr)
        if got is None:
            raise ValueError(f"{what}: 0x{info.ptr:x} ({info.protocol}) is not device memory this context can use")
    if got != want:
        raise ValueError(f"{what}: the array is on CUDA device {got}, the backend on device {want}")
