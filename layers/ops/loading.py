"""``try_kernel``: the seed's optional-kernel lookup."""

from __future__ import annotations

from gpu_runtime import GpuBackend, KernelHandle, KernelNotFoundError


def try_kernel(gpu: GpuBackend, module: str, name: str) -> KernelHandle:
    """The kernel's handle, or ``KernelHandle(0)`` when its module or the kernel is missing.

    Only absence is forgiven: a module that exists but fails to compile still raises, since
    hiding a compile error behind "feature unavailable" would silently change model output.
    """
    try:
        return gpu.kernel(module, name)
    except KernelNotFoundError:
        return KernelHandle(0)
