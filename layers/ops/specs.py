"""Every kernel's ``KernelSpec``: its parameters by C name and kind, in the kernel's order.

One place for the launchers to bind arguments by name (``SCALED_ADD.launch(gpu, kernel, grid,
block, stream, out=..., x=..., scale=..., n=...)``); ``SPECS`` gives each kernel's spec by kernel
module and kernel name, and a CPU test checks each against its ``kernels/<module>.cu``. The order
is the kernel's, which the seed-faithful launchers also keep for their own positional arguments.
``P?``: a pointer the kernel accepts null (its launcher documents what null means there); every
other pointer must not be null.
"""

from __future__ import annotations

from gpu_runtime import KernelSpec

# -- embed_from_argmax.cu --------------------------------------------------------------------
BATCHED_EMBED = KernelSpec("batched_embed", ids="P", table="P", out="P", n="U", dim="U")
BATCHED_EMBED_SHARD = KernelSpec("batched_embed_shard", ids="P", table="P", out="P", n="U", dim="U",
                                 lo="U", count="U")
BATCHED_EMBED_FP8 = KernelSpec("batched_embed_fp8", ids="P", table="P", row_scale="P", out="P",
                               n="U", dim="U")
EMBED_FROM_ARGMAX = KernelSpec("embed_from_argmax_bf16", logits="P", vocab="U", table="P", out="P",
                               ids_out="P", m="U", dim="U")

# -- gemm.cu: every plain GEMM takes (a, w, c, m, n, k); the word GEMMs add the word epilogue --
_GEMM = dict(a="P", w="P", c="P", m="U", n="U", k="U")
_WORD = dict(_GEMM, word_ids="P", word="P", word_over="P?", scale="F")
GEMM_PIPELINED = KernelSpec("dense_gemm_bf16_pipelined", **_GEMM)
GEMM_SMALL_M = KernelSpec("dense_gemm_bf16_small_m", **_GEMM)
GEMM_TILED = KernelSpec("dense_gemm_bf16_tiled", **_GEMM)
GEMM_WGMMA = KernelSpec("dense_gemm_bf16_wgmma", **_GEMM)
GEMM_SIMT = KernelSpec("dense_gemm_bf16_simt", **_GEMM)
GEMM_WORD = KernelSpec("dense_gemm_bf16_word", **_WORD)
GEMM_WORD_WGMMA = KernelSpec("dense_gemm_bf16_word_wgmma", **_WORD)
GEMM_WORD_SMALL_M = KernelSpec("dense_gemm_bf16_word_small_m", **_WORD)
# the TMA twins take a and w as tensor maps too (and by pointer, for their fallback)
GEMM_TMA = KernelSpec("dense_gemm_bf16_tma", a_map="T", w_map="T", **_GEMM)
GEMM_WORD_TMA = KernelSpec("dense_gemm_bf16_word_tma", a_map="T", w_map="T", **_WORD)
GEMM_TMA_STORE = KernelSpec("dense_gemm_bf16_tma_store", a_map="T", w_map="T", c_map="T", **_GEMM)
GEMM_WORD_TMA_STORE = KernelSpec("dense_gemm_bf16_word_tma_store", a_map="T", w_map="T", c_map="T",
                                 **_WORD)
GEMM_TMA_SPLITK = KernelSpec("dense_gemm_bf16_tma_splitk", a_map="T", w_map="T", **_GEMM)
GEMM_WORD_TMA_SPLITK = KernelSpec("dense_gemm_bf16_word_tma_splitk", a_map="T", w_map="T", **_WORD)

# -- ngram_decode.cu -------------------------------------------------------------------------
NGRAM_DECODE_GATHER = KernelSpec(
    "ngram_decode_gather", tokens="P", cu_seqlens="P?", slots="P", hist="P", state="P", tables="P",
    pows="P", out="P", word_ids="P", ctrl="P", rows="U", num_seqs="U", per_seq="U", max_seqs="U",
    hist_len="U", vocab="U", num_tables="U", max_ngram="U", splits="U", td="U", eos="U",
    adapters="P?", adapter_maps="P?", adapter_rows="P?", adapter_counts="P?", num_adapters="U",
    hidden="U", word_over="P?")
NGRAM_DECODE_SEED = KernelSpec("ngram_decode_seed", tokens="P", cu_seqlens="P", slots="P", hist="P",
                               state="P", ctrl="P", rows="U", num_seqs="U", max_seqs="U",
                               hist_len="U", vocab="U")
NGRAM_DECODE_FORK = KernelSpec("ngram_decode_fork", src_slots="P", dst_slots="P", hist="P", state="P",
                               ctrl="P", num="U", max_seqs="U", hist_len="U")
NGRAM_DECODE_ROLLBACK = KernelSpec("ngram_decode_rollback", slots="P", counts="P", state="P",
                                   ctrl="P", num_seqs="U", max_seqs="U", max_draft="U")

# -- ngram_fused.cu --------------------------------------------------------------------------
NGRAM_GATHER = KernelSpec("ngram_gather", windows="P", tables="P", pows="P", slots="P?", out="P",
                          ids_out="P?", rows_r="U", num_tables="U", max_ngram="U", splits="U",
                          td="U", eos="U")

# -- residual_add.cu -------------------------------------------------------------------------
SCALED_ADD = KernelSpec("bf16_scaled_add", out="P", x="P", scale="F", n="U")
RESIDUAL_ADD = KernelSpec("bf16_residual_add", out="P", x="P", n="U")

# -- row_cache.cu ----------------------------------------------------------------------------
SCATTER_ROWS = KernelSpec("scatter_rows", slots="P", rows="P", scales="P?", arena="P",
                          arena_scales="P?", n="U", row_bytes="U")

# -- token_overlay.cu (the seed's order, position for position) -------------------------------
EMBED_ROWDIFF = KernelSpec("embed_rowdiff_bf16", base="P", served="P", flags="P", rows="U", h="U",
                           thresh="F")
EMBED_OVERLAY_ROUTED = KernelSpec(
    "embed_overlay_routed_bf16", ids="P", seq_slot="P?", active="I", slot_map_tab="P", rows_tab="P",
    n_tab="P", out="P", h="U", vocab="U")
# lmhead_overlay_routed_bf16 and _f32 (bf16 or f32 logits) take the same parameters, and their
# launcher cannot tell the two handles apart: one spec, named for the launcher, launches both.
LMHEAD_OVERLAY_ROUTED = KernelSpec(
    "lmhead_overlay_routed", hidden="P", seq_slot="P?", active="I", rows_tab="P", ids_tab="P",
    n_tab="P", logits="P", h="U", vocab="U")


def _by_name(*specs: KernelSpec) -> dict[str, KernelSpec]:
    return {spec.name: spec for spec in specs}


SPECS: dict[str, dict[str, KernelSpec]] = {  # kernel module -> kernel name -> its spec
    "embed_from_argmax": _by_name(BATCHED_EMBED, BATCHED_EMBED_FP8, BATCHED_EMBED_SHARD, EMBED_FROM_ARGMAX),
    "gemm": _by_name(GEMM_PIPELINED, GEMM_SMALL_M, GEMM_TILED, GEMM_WGMMA, GEMM_SIMT, GEMM_WORD,
                     GEMM_WORD_WGMMA, GEMM_WORD_SMALL_M, GEMM_TMA, GEMM_WORD_TMA, GEMM_TMA_SPLITK,
                     GEMM_WORD_TMA_SPLITK, GEMM_TMA_STORE, GEMM_WORD_TMA_STORE),
    "ngram_decode": _by_name(NGRAM_DECODE_GATHER, NGRAM_DECODE_SEED, NGRAM_DECODE_FORK,
                             NGRAM_DECODE_ROLLBACK),
    "ngram_fused": _by_name(NGRAM_GATHER),
    "residual_add": _by_name(SCALED_ADD, RESIDUAL_ADD),
    "row_cache": _by_name(SCATTER_ROWS),
    "token_overlay": {**_by_name(EMBED_ROWDIFF, EMBED_OVERLAY_ROUTED),
                      "lmhead_overlay_routed_bf16": LMHEAD_OVERLAY_ROUTED,
                      "lmhead_overlay_routed_f32": LMHEAD_OVERLAY_ROUTED},
}
