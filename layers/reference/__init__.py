"""numpy references of every kernel and of the whole n-gram layer (``dense``, ``ngram``,
``overlay``; their argument checks in ``checks``), exported here.

Each reproduces its kernel's rounding points: float32 arithmetic where the kernel rounds to
f32 (numpy's float32 add and multiply round to nearest even, as ``__fadd_rn``/``__fmul_rn``
do), then one rounding to bf16 (``ml_dtypes`` rounds to nearest even, as
``__float2bfloat16_rn``). Where the kernel's summation order is its own (GEMM, dot products),
the reference accumulates in fp32 or fp64 and the tests use a tolerance.

Every function checks its arguments as the kernels' runners and launchers do, before computing:
``TypeError`` for a wrong type or dtype (a non-array, float ids), ``ValueError`` for a wrong
value (a shape the others disagree with, an id or count out of range), each message starting
with the function's name and naming the argument. The n-gram references check the context and
``seq_len`` with the runners' own checks (``layers.ngram_embed.front``). An array argument is a
numpy array, or anything with its ``shape`` and ``dtype`` that numpy indexing reads rows from
(an n-gram reference only reads the word and table rows it needs).
"""

from .checks import BF16, FP8
from .dense import (
    argmax_ids,
    batched_embed,
    batched_embed_fp8,
    bf16_of_f64,
    dequant_fp8,
    embed_from_argmax,
    gemm_bf16,
    gemm_fp64,
    residual_add,
    scaled_add,
)
from .engram import (
    EngramRef,
    act_quant,
    dequant_rows,
    dequant_weight,
    emb_from_rows,
    engram_layer_ref,
    gate_ref,
    wkv_fp64,
    wkv_ref,
)
from .ngram import NgramTables, gather_table, ngram_embed, ngram_embed_fused, ngram_embed_ideal
from .overlay import (
    SlotTables,
    embed_overlay_ref,
    gather_then_overlay_ref,
    lmhead_dot,
    lmhead_overlay_ref,
    logits_then_overlay_ref,
    rowdiff_ref,
)

__all__ = [
    "BF16",
    "FP8",
    "EngramRef",
    "NgramTables",
    "SlotTables",
    "act_quant",
    "argmax_ids",
    "batched_embed",
    "batched_embed_fp8",
    "bf16_of_f64",
    "dequant_fp8",
    "dequant_rows",
    "dequant_weight",
    "emb_from_rows",
    "embed_from_argmax",
    "embed_overlay_ref",
    "engram_layer_ref",
    "gate_ref",
    "gather_table",
    "gather_then_overlay_ref",
    "gemm_bf16",
    "gemm_fp64",
    "lmhead_dot",
    "lmhead_overlay_ref",
    "logits_then_overlay_ref",
    "ngram_embed",
    "ngram_embed_fused",
    "ngram_embed_ideal",
    "residual_add",
    "rowdiff_ref",
    "scaled_add",
    "wkv_fp64",
    "wkv_ref",
]
