"""Launchers of ``kernels/embed_from_argmax.cu``: row gathers and greedy argmax-then-embed.

``batched_embed`` and ``batched_embed_fp8`` are the seed's (arguments in the kernels' order);
``ShardGather`` and ``ArgmaxEmbed`` are planned once (the table and its sizes, checked at
construction) and ``run`` per call with what changes.
"""

from __future__ import annotations

import functools

from gpu_runtime import GpuBackend, KernelHandle, LaunchConfig, validate

_THREADS = 256  # 8 warps; the gathers copy one row per warp
_ROWS_PER_BLOCK = _THREADS // 32
_ARGMAX_THREADS = 512  # one block per logits row: enough loads in flight for a 128k vocab


@functools.cache
def gather_config(n: int) -> LaunchConfig:
    """Either gather's launch over ``n >= 1`` rows: one warp a row."""
    return LaunchConfig((n + _ROWS_PER_BLOCK - 1) // _ROWS_PER_BLOCK, _THREADS)


@functools.cache
def _argmax_config(m: int) -> LaunchConfig:
    return LaunchConfig(m, _ARGMAX_THREADS)


def _counts(what: str, n: int, dim: int) -> bool:
    """Whether a gather of ``n`` rows of ``dim`` has work (both u32; zero: no launch)."""
    if type(n) is not int or type(dim) is not int or not 0 < n < 1 << 32 or not 0 < dim < 1 << 32:
        n, dim = validate.u32(n, f"{what} n"), validate.u32(dim, f"{what} dim")
        return bool(n and dim)
    return True


def batched_embed(
    gpu: GpuBackend, kernel: KernelHandle, ids: int, table: int, out: int, n: int, dim: int, stream: int
) -> None:
    """``out[i, :] = table[ids[i], :]`` for ``i < n``; bf16 rows of ``dim``. ``n`` or ``dim``
    zero launches nothing.

    The kernel cannot see the table's row count: callers validate ids on the host.
    """
    if not _counts("batched_embed", n, dim):
        return
    validate.pointers("batched_embed", "ids table out", ids, table, out)
    gpu.bind(kernel).launch(gather_config(n), stream, ids, table, out, n, dim)


def batched_embed_fp8(
    gpu: GpuBackend, kernel: KernelHandle, ids: int, table: int, row_scale: int, out: int, n: int, dim: int, stream: int
) -> None:
    """``out[i, j] = bf16(float(table[ids[i], j]) * row_scale[ids[i]])``: e4m3 rows, one f32
    scale per row, rounded once to bf16. ``n`` or ``dim`` zero launches nothing."""
    if not _counts("batched_embed_fp8", n, dim):
        return
    validate.pointers("batched_embed_fp8", "ids table row_scale out", ids, table, row_scale, out)
    gpu.bind(kernel).launch(gather_config(n), stream, ids, table, row_scale, out, n, dim)


class ShardGather:
    """``batched_embed_shard`` planned over one vocabulary shard: ``table [count, dim]`` holds
    the rows of ids ``lo <= id < lo + count``, gathered into ``out``; any other id gives a row of
    zeros (the kernel bounds every id by ``count``)."""

    def __init__(
        self, gpu: GpuBackend, kernel: KernelHandle, table: int, out: int, dim: int, lo: int, count: int
    ) -> None:
        what = "batched_embed_shard"
        self.kernel = gpu.bind(kernel)
        self.table = validate.pointer(table, f"{what} table")
        self.out = validate.pointer(out, f"{what} out")
        self.dim = validate.u32(dim, f"{what} dim")
        self.lo, self.count = validate.u32(lo, f"{what} lo"), validate.u32(count, f"{what} count")

    def run(self, ids: int, n: int, stream: int) -> None:
        """``out[i, :]`` for ``i < n`` from ``ids`` (u32, device); ``n == 0`` launches nothing."""
        if n and self.dim:
            self.kernel.launch(gather_config(n), stream, ids, self.table, self.out, n, self.dim, self.lo, self.count)


class ArgmaxEmbed:
    """``embed_from_argmax_bf16`` planned over one embedding ``table [vocab, dim]`` (bf16):
    ``run`` takes each row of ``logits [m, vocab]`` (bf16) to its argmax id (lowest index on
    ties, NaN never wins, all-NaN gives 0) in ``ids_out [m]`` and that id's table row in
    ``out [m, dim]``."""

    def __init__(self, gpu: GpuBackend, kernel: KernelHandle, table: int, vocab: int, dim: int) -> None:
        what = "embed_from_argmax"
        self.kernel = gpu.bind(kernel)
        self.table = validate.pointer(table, f"{what} table")
        self.vocab = validate.u32(vocab, f"{what} vocab")
        self.dim = validate.u32(dim, f"{what} dim")
        if self.vocab == 0:
            raise ValueError(f"{what}: vocab must be >= 1")

    def run(self, logits: int, out: int, ids_out: int, m: int, stream: int) -> None:
        """One launch over ``m`` rows; ``m == 0`` launches nothing."""
        if validate.u32(m, "embed_from_argmax m") == 0:
            return
        validate.pointers("embed_from_argmax", "logits out ids_out", logits, out, ids_out)
        args = (logits, self.vocab, self.table, out, ids_out, m, self.dim)
        self.kernel.launch(_argmax_config(m), stream, *args)
