"""A small CUDA runtime over cuda-python's driver API: memory, streams, NVRTC kernels, launches."""

from .device_array import DeviceArray
from .driver import device_count
from .errors import CudaError, GpuError, KernelNotFoundError, NoDeviceError, NvrtcError
from .gpu import CudaBackend, DevicePtr, GpuBackend, KernelHandle
from .kernel_args import KernelLaunch

__all__ = [
    "CudaBackend", "CudaError", "DeviceArray", "DevicePtr", "GpuBackend", "GpuError",
    "KernelHandle", "KernelLaunch", "KernelNotFoundError", "NoDeviceError", "NvrtcError",
    "device_count",
]
