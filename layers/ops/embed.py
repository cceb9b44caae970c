"""Launchers of ``kernels/embed_from_argmax.cu``: row gathers and greedy argmax-then-embed."""

from __future__ import annotations

from gpu_runtime import GpuBackend, KernelHandle, validate

from .specs import BATCHED_EMBED, BATCHED_EMBED_FP8, BATCHED_EMBED_SHARD, EMBED_FROM_ARGMAX

_BLOCK = (256, 1, 1)  # 8 warps; the gathers copy one row per warp
_ROWS_PER_BLOCK = 256 // 32
_ARGMAX_BLOCK = (512, 1, 1)  # one block per logits row: enough loads in flight for a 128k vocab


def _gather_grid(n: int) -> tuple[int, int, int]:
    return ((n + _ROWS_PER_BLOCK - 1) // _ROWS_PER_BLOCK, 1, 1)


def batched_embed(
    gpu: GpuBackend, kernel: KernelHandle, ids: int, table: int, out: int, n: int, dim: int, stream: int
) -> None:
    """``out[i, :] = table[ids[i], :]`` for ``i < n``; bf16 rows of ``dim``. ``n`` or ``dim``
    zero launches nothing.

    The kernel cannot see the table's row count: callers validate ids on the host.
    """
    n, dim = validate.u32(n, "batched_embed n"), validate.u32(dim, "batched_embed dim")
    if n == 0 or dim == 0:
        return
    BATCHED_EMBED.launch(gpu, kernel, _gather_grid(n), _BLOCK, stream, ids=ids, table=table, out=out, n=n, dim=dim)


def batched_embed_shard(
    gpu: GpuBackend,
    kernel: KernelHandle,
    ids: int,
    table: int,
    out: int,
    n: int,
    dim: int,
    lo: int,
    count: int,
    stream: int,
) -> None:
    """A vocabulary shard's gather: ``out[i, :] = table[ids[i] - lo, :]`` where ``lo <= ids[i] <
    lo + count`` (the shard ``table [count, dim]`` holds those rows), zeros elsewhere. Any id is
    safe: the kernel bounds it by ``count``. ``n`` or ``dim`` zero launches nothing."""
    n, dim = validate.u32(n, "batched_embed_shard n"), validate.u32(dim, "batched_embed_shard dim")
    lo, count = validate.u32(lo, "batched_embed_shard lo"), validate.u32(count, "batched_embed_shard count")
    if n == 0 or dim == 0:
        return
    BATCHED_EMBED_SHARD.launch(
        gpu, kernel, _gather_grid(n), _BLOCK, stream, ids=ids, table=table, out=out, n=n, dim=dim, lo=lo, count=count
    )


def batched_embed_fp8(
    gpu: GpuBackend, kernel: KernelHandle, ids: int, table: int, row_scale: int, out: int, n: int, dim: int, stream: int
) -> None:
    """``out[i, j] = bf16(float(table[ids[i], j]) * row_scale[ids[i]])``: e4m3 rows, one f32
    scale per row, rounded once to bf16. ``n`` or ``dim`` zero launches nothing."""
    n, dim = validate.u32(n, "batched_embed_fp8 n"), validate.u32(dim, "batched_embed_fp8 dim")
    if n == 0 or dim == 0:
        return
    BATCHED_EMBED_FP8.launch(
        gpu, kernel, _gather_grid(n), _BLOCK, stream, ids=ids, table=table, row_scale=row_scale, out=out, n=n, dim=dim
    )


def embed_from_argmax(
    gpu: GpuBackend,
    kernel: KernelHandle,
    logits: int,
    vocab: int,
    table: int,
    out: int,
    ids_out: int,
    m: int,
    dim: int,
    stream: int,
) -> None:
    """Per row of ``logits [m, vocab]`` (bf16): the argmax id (lowest index on ties, NaN never
    wins, all-NaN gives 0) to ``ids_out[m]`` and ``table[id]`` to ``out [m, dim]``. ``m == 0``
    launches nothing; otherwise ``vocab`` must be >= 1."""
    m = validate.u32(m, "embed_from_argmax m")
    if m == 0:
        return
    vocab = validate.u32(vocab, "embed_from_argmax vocab")
    if vocab == 0:
        raise ValueError("embed_from_argmax: vocab must be >= 1")
    EMBED_FROM_ARGMAX.launch_from(gpu, kernel, (m, 1, 1), _ARGMAX_BLOCK, stream, locals())
