"""Transitional: the names ``gpu_runtime.gpu`` held before the runtime was split by concept
(``pointers``, ``host_memory``, ``backend``, ``cuda_backend``). Import them from there.

Tests replace the driver by setting ``gpu_runtime.gpu.call`` / ``.cu``; as the calls now live in
the ``cuda_backend`` modules, setting either here sets it in each of them.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from cuda.bindings import driver as cu  # noqa: F401  (re-exported, see above)

from . import driver  # noqa: F401
from .backend import GpuBackend
from .cuda_backend import DRIVER_MODULES, CudaBackend
from .driver import call  # noqa: F401
from .host_memory import HOST_PAGE, Host, host_view
from .pointers import DevicePtr, KernelHandle


class _DriverSeam(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("call", "cu"):
            for module in DRIVER_MODULES:
                setattr(module, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _DriverSeam

__all__ = ["CudaBackend", "DevicePtr", "GpuBackend", "HOST_PAGE", "Host", "KernelHandle", "host_view"]
