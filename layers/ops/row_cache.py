"""Launcher of ``kernels/row_cache.cu``: scatter staged table rows into arena slots."""

from __future__ import annotations

from gpu_runtime import GpuBackend, KernelHandle, validate

from .specs import SCATTER_ROWS

_BLOCK = (256, 1, 1)  # 8 warps, one row each
_ROWS_PER_BLOCK = 256 // 32
_MAX_BLOCKS = 4096  # rows are grid-strided past this


def scatter_rows(
    gpu: GpuBackend,
    kernel: KernelHandle,
    slots: int,
    rows: int,
    scales: int,
    arena: int,
    arena_scales: int,
    n: int,
    row_bytes: int,
    stream: int,
) -> None:
    """``arena[slots[i]] = rows[i]`` (``row_bytes`` each) and, when ``scales`` is not null,
    ``arena_scales[slots[i]] = scales[i]``, for ``i < n``: ``scales`` and ``arena_scales`` are
    both given or both null. Slots must be distinct and in range: the kernel cannot see the
    arena's capacity. ``n`` or ``row_bytes`` zero launches nothing."""
    n, row_bytes = validate.u32(n, "scatter_rows n"), validate.u32(row_bytes, "scatter_rows row_bytes")
    if bool(scales) != bool(arena_scales):
        raise ValueError("scatter_rows: scales and arena_scales must both be given or both be null")
    if n == 0 or row_bytes == 0:
        return
    grid = (min(-(-n // _ROWS_PER_BLOCK), _MAX_BLOCKS), 1, 1)
    SCATTER_ROWS.launch_from(gpu, kernel, grid, _BLOCK, stream, locals())
