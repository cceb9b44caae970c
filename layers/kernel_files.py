"""The layers' CUDA sources: where they are, and their kernels loaded by module name.

The runtime compiles whatever ``.cu`` file it is given (``GpuBackend.kernel(path, name)``);
finding the files is the layers' job. They are read from ``$GPU_RUNTIME_KERNEL_DIR`` where it
is set (one directory holding every module's ``.cu`` and the headers they include), else the
copy installed inside this package (``layers/kernels``), else the checkout's ``kernels/``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from gpu_runtime import GpuBackend, KernelHandle, KernelNotFoundError

KERNEL_DIR_ENV = "GPU_RUNTIME_KERNEL_DIR"


def kernel_dir() -> Path:
    """The directory of the layers' ``.cu`` files (see the module docstring for the order)."""
    return _kernel_dir(os.environ.get(KERNEL_DIR_ENV) or None)


@functools.cache
def _kernel_dir(env: str | None) -> Path:
    """Found once per value of the variable: launchers look kernels up on every call (a GEMM
    picks its path's kernel per shape), and the search touches the file system."""
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no kernels/ directory in or next to the layers package; set {KERNEL_DIR_ENV}")


def kernel_path(module: str) -> Path:
    """The source file of kernel module ``module`` (``"gemm"`` -> ``.../gemm.cu``)."""
    return _kernel_path(kernel_dir(), module)


@functools.cache
def _kernel_path(directory: Path, module: str) -> Path:
    """One ``Path`` object per file, so the backend's kernel table hashes it once."""
    return directory / f"{module}.cu"


def kernel_files() -> list[Path]:
    """Every kernel module's source, sorted (what ``make kernels`` compiles)."""
    return sorted(kernel_dir().glob("*.cu"))


def load_kernel(gpu: GpuBackend, module: str, name: str) -> KernelHandle:
    """Kernel ``name`` of module ``module``, compiled and loaded by ``gpu`` on first use."""
    return gpu.kernel(kernel_path(module), name)


def try_kernel(gpu: GpuBackend, module: str, name: str) -> KernelHandle:
    """The kernel's handle, or ``KernelHandle(0)`` when its module or the kernel is missing.

    Only absence is forgiven: a module that exists but fails to compile still raises, since
    hiding a compile error behind "feature unavailable" would silently change model output.
    """
    try:
        return load_kernel(gpu, module, name)
    except KernelNotFoundError:
        return KernelHandle(0)
