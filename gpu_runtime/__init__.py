"""A small CUDA runtime over cuda-python's driver API: memory, streams, NVRTC kernels, launches.

Slow paths are logged on the ``gpu_runtime`` logger (its modules' loggers are its children: a
kernel module compiled by NVRTC on first use is INFO on ``gpu_runtime.compiler``). The package
only adds a ``NullHandler``: nothing is printed unless the application configures logging, e.g.
``logging.basicConfig(level=logging.INFO)``.
"""

import logging

from . import cli  # the command-line tools' argument parser (usage errors in one line)
from .backend import (
    DeviceCopies,
    Events,
    GpuBackend,
    Graphs,
    HostFunctions,
    MappedHostMemory,
    PinnedHostMemory,
    PitchedCopies,
    TensorMaps,
)
from .buffer import DeviceBuffer
from .cuda_backend import CudaBackend
from .device_array import DeviceArray
from .driver import device_count
from .errors import ClosedError, CudaError, GpuError, KernelNotFoundError, NoDeviceError, NvrtcError
from .kernel_args import KernelLaunch
from .launch import Kernel, LaunchConfig, PreparedLaunch
from .pointers import DevicePtr, KernelHandle

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.2.0"  # the distribution's version (pyproject.toml reads it from here)

__all__ = [
    "__version__",
    "cli",
    "ClosedError",
    "CudaBackend",
    "CudaError",
    "DeviceArray",
    "DeviceBuffer",
    "DeviceCopies",
    "DevicePtr",
    "Events",
    "GpuBackend",
    "GpuError",
    "Graphs",
    "HostFunctions",
    "Kernel",
    "KernelHandle",
    "KernelLaunch",
    "KernelNotFoundError",
    "LaunchConfig",
    "MappedHostMemory",
    "NoDeviceError",
    "NvrtcError",
    "PinnedHostMemory",
    "PitchedCopies",
    "PreparedLaunch",
    "TensorMaps",
    "device_count",
]
