"""Launchers of ``kernels/residual_add.cu``: in-place bf16 accumulation."""

from __future__ import annotations

from gpu_runtime import GpuBackend, KernelHandle, KernelLaunch

from .checks import require_count, require_ptr, require_scale

_BLOCK = 256
_MAX_BLOCKS = 4096  # grid-stride beyond this: 1M threads cover any H200-sized tensor


def _grid(n: int) -> list[int]:
    return [min(-(-n // (8 * _BLOCK)), _MAX_BLOCKS), 1, 1]


def scaled_add(gpu: GpuBackend, kernel: KernelHandle, out: int, x: int, scale: float, n: int,
               stream: int) -> None:
    """``out[i] = bf16(float(out[i]) + scale * float(x[i]))`` for ``i < n``, in place."""
    n = require_count(n, "n")
    require_ptr(out, "scaled_add out")
    require_ptr(x, "scaled_add x")
    scale = require_scale(scale, "scaled_add")
    if n == 0:
        return
    (KernelLaunch(gpu, kernel).grid(_grid(n)).block([_BLOCK, 1, 1])
     .arg_ptr(out).arg_ptr(x).arg_f32(scale).arg_u32(n).launch(stream))


def residual_add(gpu: GpuBackend, kernel: KernelHandle, out: int, x: int, n: int,
                 stream: int) -> None:
    """``out[i] = bf16(float(out[i]) + float(x[i]))`` for ``i < n``, in place."""
    n = require_count(n, "n")
    require_ptr(out, "residual_add out")
    require_ptr(x, "residual_add x")
    if n == 0:
        return
    (KernelLaunch(gpu, kernel).grid(_grid(n)).block([_BLOCK, 1, 1])
     .arg_ptr(out).arg_ptr(x).arg_u32(n).launch(stream))
