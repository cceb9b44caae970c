"""The launcher rows of the matrix: the function under test and the kernel it launches, and the
kernel the backend checks use for their good launch. A planned launcher (a class whose
constructor takes what is fixed and whose ``run`` takes what changes) is called here with every
argument at once, planned and run in one go: each refusal comes from whichever half holds the
argument."""

from __future__ import annotations

from gpu_runtime import GpuBackend, KernelHandle
from layers.kernel_files import load_kernel
from layers.ops import embed, gemm, gemm_fp8, residual, row_cache, token_overlay
from tests.helpers.ngram_gather import ngram_gather

LAUNCH_KERNEL = {
    "batched_embed": "batched_embed", "batched_embed_fp8": "batched_embed_fp8",
    "embed_from_argmax": "embed_from_argmax_bf16", "scaled_add": "bf16_scaled_add",
    "residual_add": "bf16_residual_add", "dense_gemm_bf16_pipelined": "dense_gemm_bf16_pipelined",
    "dense_gemm_bf16_word": "dense_gemm_bf16_word", "dense_gemm_fp8w": "dense_gemm_fp8w",
    "embed_rowdiff": "embed_rowdiff_bf16",
    "embed_overlay_routed": "embed_overlay_routed_bf16",
    "lmhead_overlay_routed": "lmhead_overlay_routed_bf16", "scatter_rows": "scatter_rows",
    "ngram_gather": "ngram_gather",
}


def embed_from_argmax(gpu: GpuBackend, kernel: KernelHandle, logits: int, vocab: int, table: int, out: int,
                      ids_out: int, m: int, dim: int, stream: int) -> None:
    embed.ArgmaxEmbed(gpu, kernel, table, vocab, dim).run(logits, out, ids_out, m, stream)


def scatter_rows(gpu: GpuBackend, kernel: KernelHandle, slots: int, rows: int, scales: int, arena: int,
                 arena_scales: int, n: int, row_bytes: int, stream: int) -> None:
    row_cache.RowScatter(gpu, kernel, arena, arena_scales, row_bytes).run(slots, rows, scales, n, stream)


LAUNCH_FN = {
    "batched_embed": embed.batched_embed, "batched_embed_fp8": embed.batched_embed_fp8,
    "embed_from_argmax": embed_from_argmax, "scaled_add": residual.scaled_add,
    "residual_add": residual.residual_add, "dense_gemm_bf16_pipelined": gemm.dense_gemm_bf16_pipelined,
    "dense_gemm_bf16_word": gemm.dense_gemm_bf16_word, "dense_gemm_fp8w": gemm_fp8.dense_gemm_fp8w,
    "embed_rowdiff": token_overlay.embed_rowdiff,
    "embed_overlay_routed": token_overlay.embed_overlay_routed,
    "lmhead_overlay_routed": token_overlay.lmhead_overlay_routed,
    "scatter_rows": scatter_rows, "ngram_gather": ngram_gather,
}


def scaled_add_kernel(gpu: GpuBackend) -> KernelHandle:
    """``bf16_scaled_add``: a kernel every backend check can launch for a known answer."""
    return load_kernel(gpu, "residual_add", "bf16_scaled_add")
