"""Launchers of ``kernels/residual_add.cu``: in-place bf16 accumulation."""

from __future__ import annotations

from gpu_runtime import GpuBackend, KernelHandle, validate

from .specs import RESIDUAL_ADD, SCALED_ADD

_BLOCK = (256, 1, 1)
_ELEMS_PER_BLOCK = 8 * 256  # each thread adds 8 elements
_MAX_BLOCKS = 4096  # grid-stride beyond this: 1M threads cover any H200-sized tensor


def _grid(n: int) -> tuple[int, int, int]:
    blocks = (n + _ELEMS_PER_BLOCK - 1) // _ELEMS_PER_BLOCK  # not min(): this runs every launch
    return (blocks if blocks < _MAX_BLOCKS else _MAX_BLOCKS, 1, 1)


def scaled_add(gpu: GpuBackend, kernel: KernelHandle, out: int, x: int, scale: float, n: int, stream: int) -> None:
    """``out[i] = bf16(float(out[i]) + scale * float(x[i]))`` for ``i < n``, in place; ``scale``
    finite. ``n == 0`` launches nothing."""
    scale = validate.real32(scale, "scaled_add scale")
    n = validate.u32(n, "scaled_add n")
    if n == 0:
        return
    SCALED_ADD.launch(gpu, kernel, _grid(n), _BLOCK, stream, out=out, x=x, scale=scale, n=n)


def residual_add(gpu: GpuBackend, kernel: KernelHandle, out: int, x: int, n: int, stream: int) -> None:
    """``out[i] = bf16(float(out[i]) + float(x[i]))`` for ``i < n``, in place. ``n == 0``
    launches nothing."""
    n = validate.u32(n, "residual_add n")
    if n == 0:
        return
    RESIDUAL_ADD.launch(gpu, kernel, _grid(n), _BLOCK, stream, out=out, x=x, n=n)
