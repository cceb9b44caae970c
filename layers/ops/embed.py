"""Launchers of ``kernels/embed_from_argmax.cu``: row gathers and greedy argmax-then-embed."""

from __future__ import annotations

from gpu_runtime import GpuBackend, KernelHandle, KernelLaunch

from .checks import require_count, require_ptr

_BLOCK = 256  # 8 warps; the gathers copy one row per warp
_ROWS_PER_BLOCK = _BLOCK // 32
_ARGMAX_BLOCK = 512  # one block per logits row: enough loads in flight for a 128k vocab


def _gather_grid(n: int) -> list[int]:
    return [-(-n // _ROWS_PER_BLOCK), 1, 1]


def batched_embed(gpu: GpuBackend, kernel: KernelHandle, ids: int, table: int, out: int,
                  n: int, dim: int, stream: int) -> None:
    """``out[i, :] = table[ids[i], :]`` for ``i < n``; bf16 rows of ``dim``.

    The kernel cannot see the table's row count: callers validate ids on the host.
    """
    n, dim = require_count(n, "n"), require_count(dim, "dim")
    for ptr, what in ((ids, "ids"), (table, "table"), (out, "out")):
        require_ptr(ptr, f"batched_embed {what}")
    if n == 0 or dim == 0:
        return
    (KernelLaunch(gpu, kernel).grid(_gather_grid(n)).block([_BLOCK, 1, 1])
     .arg_ptr(ids).arg_ptr(table).arg_ptr(out).arg_u32(n).arg_u32(dim).launch(stream))


def batched_embed_fp8(gpu: GpuBackend, kernel: KernelHandle, ids: int, table: int,
                      row_scale: int, out: int, n: int, dim: int, stream: int) -> None:
    """``out[i, j] = bf16(float(table[ids[i], j]) * row_scale[ids[i]])``: e4m3 rows, one f32
    scale per row, rounded once to bf16."""
    n, dim = require_count(n, "n"), require_count(dim, "dim")
    for ptr, what in ((ids, "ids"), (table, "table"), (row_scale, "row_scale"), (out, "out")):
        require_ptr(ptr, f"batched_embed_fp8 {what}")
    if n == 0 or dim == 0:
        return
    (KernelLaunch(gpu, kernel).grid(_gather_grid(n)).block([_BLOCK, 1, 1])
     .arg_ptr(ids).arg_ptr(table).arg_ptr(row_scale).arg_ptr(out).arg_u32(n).arg_u32(dim)
     .launch(stream))


def embed_from_argmax(gpu: GpuBackend, kernel: KernelHandle, logits: int, vocab: int, table: int,
                      out: int, ids_out: int, m: int, dim: int, stream: int) -> None:
    """Per row of ``logits [m, vocab]`` (bf16): the argmax id (lowest index on ties, NaN never
    wins, all-NaN gives 0) to ``ids_out[m]`` and ``table[id]`` to ``out [m, dim]``."""
    vocab, m, dim = require_count(vocab, "vocab"), require_count(m, "m"), require_count(dim, "dim")
    for ptr, what in ((logits, "logits"), (table, "table"), (out, "out"), (ids_out, "ids_out")):
        require_ptr(ptr, f"embed_from_argmax {what}")
    if m == 0:
        return
    if vocab == 0:
        raise ValueError("embed_from_argmax: vocab must be >= 1")
    (KernelLaunch(gpu, kernel).grid([m, 1, 1]).block([_ARGMAX_BLOCK, 1, 1])
     .arg_ptr(logits).arg_u32(vocab).arg_ptr(table).arg_ptr(out).arg_ptr(ids_out)
     .arg_u32(m).arg_u32(dim).launch(stream))
