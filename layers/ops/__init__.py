"""One launcher per kernel, over ``gpu_runtime``'s one launch mechanism (``Kernel.launch``).

The seed's launchers (``batched_embed``, ``batched_embed_fp8``, ``scaled_add``,
``dense_gemm_bf16_pipelined``, and the token-overlay ones) keep its positional signatures:
``(gpu, kernel, <the kernel's arguments in its order>, stream)``. Each checks what only it knows
(a finite scale, sizes that must agree, the pointers its kernel needs), returns without a launch
when a count is zero, and launches with a ``LaunchConfig`` made once per shape; packing checks the
rest of the values (types and ranges, the kernel and parameter named).

The launchers of the project's own kernels are planned once and run per call (flashinfer's
``plan``/``run``): a class whose constructor binds the kernel and checks what does not change
between calls (tables, sizes, buffers: ``ArgmaxEmbed``, ``ShardGather``, ``NgramGather``,
``DecodeLaunches``, ``RowScatter``), or ``plan_gemm`` / ``plan_word_gemm`` / ``plan_fp8w_gemm``, whose
``PreparedLaunch`` holds a GEMM's path, kernel, tensor maps and packed arguments. A call passes
only what changes.
"""

from .embed import ArgmaxEmbed, ShardGather, batched_embed, batched_embed_fp8
from .gemm import dense_gemm_bf16_pipelined, dense_gemm_bf16_word, plan_gemm, plan_word_gemm
from .gemm_fp8 import dense_gemm_fp8w, plan_fp8w_gemm
from .ngram_decode import DecodeLaunches
from .ngram_fused import NgramGather
from .residual import residual_add, scaled_add
from .row_cache import RowScatter
from .token_overlay import OverlayKernels, embed_overlay_routed, embed_rowdiff, lmhead_overlay_routed

__all__ = [
    "ArgmaxEmbed",
    "DecodeLaunches",
    "NgramGather",
    "OverlayKernels",
    "RowScatter",
    "ShardGather",
    "batched_embed",
    "batched_embed_fp8",
    "dense_gemm_bf16_pipelined",
    "dense_gemm_bf16_word",
    "dense_gemm_fp8w",
    "embed_overlay_routed",
    "embed_rowdiff",
    "lmhead_overlay_routed",
    "plan_fp8w_gemm",
    "plan_gemm",
    "plan_word_gemm",
    "residual_add",
    "scaled_add",
]
