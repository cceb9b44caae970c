"""One Python launcher per kernel, its arguments in the kernel's positional order.

A launcher checks what only it knows (a finite scale, sizes >= 1, shapes that must agree, pairs
of pointers given together), returns without a launch when a count is zero, computes the launch
shape, and launches through its kernel's ``KernelSpec`` (``specs``), arguments bound by name:
the spec refuses a value of the wrong type or range and a null pointer where the kernel needs
one, naming the kernel and the parameter (``gpu_runtime.validate``'s policy). A launcher whose
argument list would not fit a line launches with ``spec.launch_from(..., locals())``: its
parameters carry the kernel's names (any other name is passed explicitly, as ``td=table_dim``),
and a value it checks or converts is rebound to the same name, so the kernel gets that one. The
GEMM launchers instead keep each operand set's launch (plan, kernel, tensor maps, arguments) as
a recipe, so a repeated GEMM costs its checks and one spec launch (``gemm._launch``).
"""

from .embed import batched_embed, batched_embed_fp8, embed_from_argmax
from .gemm import dense_gemm_bf16_pipelined, dense_gemm_bf16_word
from .ngram_decode import ngram_decode_gather, ngram_decode_rollback
from .ngram_fused import ngram_gather
from .residual import residual_add, scaled_add
from .row_cache import scatter_rows
from .token_overlay import OverlayKernels, embed_overlay_routed, embed_rowdiff, lmhead_overlay_routed

__all__ = [
    "OverlayKernels",
    "batched_embed",
    "batched_embed_fp8",
    "dense_gemm_bf16_pipelined",
    "dense_gemm_bf16_word",
    "embed_from_argmax",
    "embed_overlay_routed",
    "embed_rowdiff",
    "lmhead_overlay_routed",
    "ngram_decode_gather",
    "ngram_decode_rollback",
    "ngram_gather",
    "residual_add",
    "scaled_add",
    "scatter_rows",
]
