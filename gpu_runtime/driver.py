"""Raw driver calls with their status checked: the only place that unpacks ``(CUresult, ...)``.

cuda.bindings returns every result as a tuple whose first item is the status. ``call`` turns a
non-success status into a ``CudaError`` that names the call, and returns the remaining values,
so the safe API (``cuda_backend/``, one module per area) never sees a status code.
"""

from __future__ import annotations

from typing import Any

from .errors import CudaError, NoDeviceError

try:
    from cuda.bindings import driver as cu
except ImportError as exc:  # pragma: no cover - cuda-bindings is a hard dependency
    raise ImportError("gpu_runtime needs cuda-bindings (pip install cuda-bindings)") from exc


def call(fn: Any, *args: Any, detail: str = "") -> Any:
    """Call ``fn(*args)``; raise ``CudaError`` unless it succeeded; return its outputs.

    No output gives ``None``, one output gives it bare, several give a tuple.
    """
    result = fn(*args)
    if result[0]:
        raise CudaError(result[0], fn.__name__, detail)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


_initialised = False


def init() -> None:
    """``cuInit`` once per process; a missing driver becomes ``NoDeviceError``."""
    global _initialised
    if _initialised:
        return
    # ``from None``: the traceback shows NoDeviceError alone (the bindings' loader would add
    # some 20 lines); the original exception stays reachable as its ``cause``.
    try:
        call(cu.cuInit, 0)
    except CudaError as exc:
        raise NoDeviceError(f"CUDA driver present but unusable: {exc}", cause=exc) from None
    except Exception as exc:  # the driver library itself cannot be found or loaded
        raise NoDeviceError(f"no CUDA driver: {exc}", cause=exc) from None
    _initialised = True


def device_count() -> int:
    """Number of CUDA devices, 0 where there is no driver or no device."""
    try:
        init()
        return int(call(cu.cuDeviceGetCount))
    except NoDeviceError:
        return 0


def compute_capability(device: int) -> tuple[int, int]:
    init()
    dev = call(cu.cuDeviceGet, device)
    attr = cu.CUdevice_attribute
    major = call(cu.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    minor = call(cu.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    return int(major), int(minor)
