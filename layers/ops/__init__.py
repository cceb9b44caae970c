"""One Python launcher per kernel, arguments in the kernel's positional order."""

from .embed import batched_embed, batched_embed_fp8, embed_from_argmax
from .gemm import dense_gemm_bf16_pipelined, dense_gemm_bf16_word
from .loading import try_kernel
from .ngram_decode import ngram_decode_gather, ngram_decode_rollback
from .ngram_fused import ngram_gather
from .residual import residual_add, scaled_add
from .row_cache import scatter_rows
from .token_overlay import OverlayKernels, embed_overlay_routed, embed_rowdiff, lmhead_overlay_routed

__all__ = [
    "OverlayKernels", "batched_embed", "batched_embed_fp8", "dense_gemm_bf16_pipelined",
    "dense_gemm_bf16_word", "embed_from_argmax", "embed_overlay_routed", "embed_rowdiff",
    "lmhead_overlay_routed", "ngram_decode_gather", "ngram_decode_rollback", "ngram_gather",
    "residual_add", "scaled_add", "scatter_rows", "try_kernel",
]
