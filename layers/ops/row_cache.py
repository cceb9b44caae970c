"""Launcher of ``kernels/row_cache.cu``: scatter staged table rows into arena slots."""

from __future__ import annotations

from gpu_runtime import GpuBackend, KernelHandle, KernelLaunch

from .checks import require_count, require_ptr

_BLOCK = 256  # 8 warps, one row each
_MAX_BLOCKS = 4096  # rows are grid-strided past this


def scatter_rows(gpu: GpuBackend, kernel: KernelHandle, slots: int, rows: int, scales: int,
                 arena: int, arena_scales: int, n: int, row_bytes: int, stream: int) -> None:
    """``arena[slots[i]] = rows[i]`` (``row_bytes`` each) and, when ``scales`` is not null,
    ``arena_scales[slots[i]] = scales[i]``, for ``i < n``. Slots must be distinct and in range:
    the kernel cannot see the arena's capacity."""
    n, row_bytes = require_count(n, "n"), require_count(row_bytes, "row_bytes")
    for ptr, what in ((slots, "slots"), (rows, "rows"), (arena, "arena")):
        require_ptr(ptr, f"scatter_rows {what}")
    if bool(scales) != bool(arena_scales):
        raise ValueError("scatter_rows: scales and arena_scales must both be given or both be null")
    if n == 0 or row_bytes == 0:
        return
    blocks = min(-(-n // (_BLOCK // 32)), _MAX_BLOCKS)
    (KernelLaunch(gpu, kernel).grid([blocks, 1, 1]).block([_BLOCK, 1, 1])
     .arg_ptr(slots).arg_ptr(rows).arg_ptr(scales).arg_ptr(arena).arg_ptr(arena_scales)
     .arg_u32(n).arg_u32(row_bytes).launch(stream))
