"""Every kernel's ``KernelSpec``: its parameters by C name and kind, in the kernel's order.

One place for the launchers to bind arguments by name (``SCALED_ADD.launch(gpu, kernel, grid,
block, stream, out=..., x=..., scale=..., n=...)``); ``SPECS`` gives each kernel's spec by kernel
module and kernel name, and a CPU test checks each against its ``kernels/<module>.cu``. The order
is the kernel's, which the seed-faithful launchers also keep for their own positional arguments.
Each spec is written as C declares its parameters, in groups: a kind and the names of that kind
that follow one another (``_spec("bf16_scaled_add", "P out x", "F scale", "U n")``; the kinds are
``KernelSpec``'s). ``P?``: a pointer the kernel accepts null (its launcher documents what null
means there); every other pointer must not be null.
"""

from __future__ import annotations

from gpu_runtime import KernelSpec


def _spec(kernel: str, *groups: str) -> KernelSpec:
    """``kernel``'s spec from its parameters in the kernel's order, written in groups: a kind and
    the names of that kind that follow one another, as C declares them (``unsigned n, dim``).
    ``_spec("k", "P out x", "F scale", "U n")`` is ``KernelSpec("k", out="P", x="P", scale="F",
    n="U")``."""
    params: dict[str, str] = {}
    for group in groups:
        kind, *names = group.split()
        for name in names:
            if name in params:
                raise ValueError(f"KernelSpec {kernel}: parameter {name} named twice")
            params[name] = kind
    return KernelSpec(kernel, **params)


# -- embed_from_argmax.cu --------------------------------------------------------------------
BATCHED_EMBED = _spec("batched_embed", "P ids table out", "U n dim")
BATCHED_EMBED_SHARD = _spec("batched_embed_shard", "P ids table out", "U n dim lo count")
BATCHED_EMBED_FP8 = _spec("batched_embed_fp8", "P ids table row_scale out", "U n dim")
EMBED_FROM_ARGMAX = _spec("embed_from_argmax_bf16", "P logits", "U vocab", "P table out ids_out", "U m dim")

# -- gemm.cu: every plain GEMM takes (a, w, c, m, n, k); the word GEMMs add the word epilogue --
_GEMM = ("P a w c", "U m n k")
_WORD = (*_GEMM, "P word_ids word", "P? word_over", "F scale")
GEMM_PIPELINED = _spec("dense_gemm_bf16_pipelined", *_GEMM)
GEMM_SMALL_M = _spec("dense_gemm_bf16_small_m", *_GEMM)
GEMM_TILED = _spec("dense_gemm_bf16_tiled", *_GEMM)
GEMM_WGMMA = _spec("dense_gemm_bf16_wgmma", *_GEMM)
GEMM_SIMT = _spec("dense_gemm_bf16_simt", *_GEMM)
GEMM_WORD = _spec("dense_gemm_bf16_word", *_WORD)
GEMM_WORD_WGMMA = _spec("dense_gemm_bf16_word_wgmma", *_WORD)
GEMM_WORD_SMALL_M = _spec("dense_gemm_bf16_word_small_m", *_WORD)
# the TMA twins take a and w as tensor maps too (and by pointer, for their fallback)
GEMM_TMA = _spec("dense_gemm_bf16_tma", "T a_map w_map", *_GEMM)
GEMM_WORD_TMA = _spec("dense_gemm_bf16_word_tma", "T a_map w_map", *_WORD)
GEMM_TMA_STORE = _spec("dense_gemm_bf16_tma_store", "T a_map w_map c_map", *_GEMM)
GEMM_WORD_TMA_STORE = _spec("dense_gemm_bf16_word_tma_store", "T a_map w_map c_map", *_WORD)
GEMM_TMA_SPLITK = _spec("dense_gemm_bf16_tma_splitk", "T a_map w_map", *_GEMM)
GEMM_WORD_TMA_SPLITK = _spec("dense_gemm_bf16_word_tma_splitk", "T a_map w_map", *_WORD)

# -- ngram_decode.cu -------------------------------------------------------------------------
NGRAM_DECODE_GATHER = _spec(
    "ngram_decode_gather",
    "P tokens",
    "P? cu_seqlens",
    "P slots hist state tables pows out word_ids ctrl",
    "U rows num_seqs per_seq max_seqs hist_len vocab num_tables max_ngram splits td eos",
    "P? adapters adapter_maps adapter_rows adapter_counts",
    "U num_adapters hidden",
    "P? word_over",
)
NGRAM_DECODE_SEED = _spec(
    "ngram_decode_seed", "P tokens cu_seqlens slots hist state ctrl", "U rows num_seqs max_seqs hist_len vocab"
)
NGRAM_DECODE_FORK = _spec("ngram_decode_fork", "P src_slots dst_slots hist state ctrl", "U num max_seqs hist_len")
NGRAM_DECODE_ROLLBACK = _spec("ngram_decode_rollback", "P slots counts state ctrl", "U num_seqs max_seqs max_draft")

# -- ngram_fused.cu --------------------------------------------------------------------------
NGRAM_GATHER = _spec(
    "ngram_gather",
    "P windows tables pows",
    "P? slots",
    "P out",
    "P? ids_out",
    "U rows_r num_tables max_ngram splits td eos",
)

# -- residual_add.cu -------------------------------------------------------------------------
SCALED_ADD = _spec("bf16_scaled_add", "P out x", "F scale", "U n")
RESIDUAL_ADD = _spec("bf16_residual_add", "P out x", "U n")

# -- row_cache.cu ----------------------------------------------------------------------------
SCATTER_ROWS = _spec("scatter_rows", "P slots rows", "P? scales", "P arena", "P? arena_scales", "U n row_bytes")

# -- token_overlay.cu (the seed's order, position for position) -------------------------------
EMBED_ROWDIFF = _spec("embed_rowdiff_bf16", "P base served flags", "U rows h", "F thresh")
EMBED_OVERLAY_ROUTED = _spec(
    "embed_overlay_routed_bf16",
    "P ids",
    "P? seq_slot",
    "I active",
    "P slot_map_tab rows_tab n_tab out",
    "U h vocab num_slots",
    "P? err",
)
# lmhead_overlay_routed_bf16 and _f32 (bf16 or f32 logits) take the same parameters, and their
# launcher cannot tell the two handles apart: one spec, named for the launcher, launches both.
LMHEAD_OVERLAY_ROUTED = _spec(
    "lmhead_overlay_routed",
    "P hidden",
    "P? seq_slot",
    "I active",
    "P rows_tab ids_tab n_tab logits",
    "U h vocab num_slots",
    "P? err",
)


def _by_name(*specs: KernelSpec) -> dict[str, KernelSpec]:
    return {spec.name: spec for spec in specs}


SPECS: dict[str, dict[str, KernelSpec]] = {  # kernel module -> kernel name -> its spec
    "embed_from_argmax": _by_name(BATCHED_EMBED, BATCHED_EMBED_FP8, BATCHED_EMBED_SHARD, EMBED_FROM_ARGMAX),
    "gemm": _by_name(
        GEMM_PIPELINED,
        GEMM_SMALL_M,
        GEMM_TILED,
        GEMM_WGMMA,
        GEMM_SIMT,
        GEMM_WORD,
        GEMM_WORD_WGMMA,
        GEMM_WORD_SMALL_M,
        GEMM_TMA,
        GEMM_WORD_TMA,
        GEMM_TMA_SPLITK,
        GEMM_WORD_TMA_SPLITK,
        GEMM_TMA_STORE,
        GEMM_WORD_TMA_STORE,
    ),
    "ngram_decode": _by_name(NGRAM_DECODE_GATHER, NGRAM_DECODE_SEED, NGRAM_DECODE_FORK, NGRAM_DECODE_ROLLBACK),
    "ngram_fused": _by_name(NGRAM_GATHER),
    "residual_add": _by_name(SCALED_ADD, RESIDUAL_ADD),
    "row_cache": _by_name(SCATTER_ROWS),
    "token_overlay": {
        **_by_name(EMBED_ROWDIFF, EMBED_OVERLAY_ROUTED),
        "lmhead_overlay_routed_bf16": LMHEAD_OVERLAY_ROUTED,
        "lmhead_overlay_routed_f32": LMHEAD_OVERLAY_ROUTED,
    },
}
