"""Launcher of ``kernels/row_cache.cu``: scatter staged table rows into a device arena's slots."""

from __future__ import annotations

import functools

from gpu_runtime import GpuBackend, KernelHandle, LaunchConfig, validate

_THREADS = 256  # 8 warps, one row each
_ROWS_PER_BLOCK = _THREADS // 32
_MAX_BLOCKS = 4096  # rows are grid-strided past this


@functools.cache
def _config(blocks: int) -> LaunchConfig:
    return LaunchConfig(blocks, _THREADS)


class RowScatter:
    """``scatter_rows`` planned over one arena of ``row_bytes`` rows (and, for fp8 tables, its
    f32 scales ``arena_scales``; 0 for none): ``run`` writes ``arena[slots[i]] = rows[i]`` (and
    ``arena_scales[slots[i]] = scales[i]``) for ``i < n``. Slots must be distinct and in range:
    the kernel cannot see the arena's capacity."""

    def __init__(self, gpu: GpuBackend, kernel: KernelHandle, arena: int, arena_scales: int, row_bytes: int) -> None:
        self.kernel = gpu.bind(kernel)
        self.arena = validate.pointer(arena, "scatter_rows arena")
        self.arena_scales = validate.pointer(arena_scales, "scatter_rows arena_scales", nullable=True)
        self.row_bytes = validate.u32(row_bytes, "scatter_rows row_bytes")

    def run(self, slots: int, rows: int, scales: int, n: int, stream: int) -> None:
        """One launch over ``n`` staged rows at ``rows`` (their slots at ``slots``, their scales
        at ``scales``: given exactly when the arena has scales); ``n == 0`` launches nothing."""
        n = validate.u32(n, "scatter_rows n")
        if bool(scales) != bool(self.arena_scales):
            raise ValueError("scatter_rows: scales and arena_scales must both be given or both be null")
        if n == 0 or self.row_bytes == 0:
            return
        validate.pointers("scatter_rows", "slots rows", slots, rows)
        config = _config(min(-(-n // _ROWS_PER_BLOCK), _MAX_BLOCKS))
        self.kernel.launch(config, stream, slots, rows, scales, self.arena, self.arena_scales, n, self.row_bytes)
