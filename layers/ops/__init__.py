"""One Python launcher per kernel, arguments in the kernel's positional order."""

from .embed import batched_embed, batched_embed_fp8, embed_from_argmax
from .gemm import dense_gemm_bf16_pipelined
from .loading import try_kernel
from .residual import residual_add, scaled_add
from .row_cache import scatter_rows
from .token_overlay import OverlayKernels, embed_overlay_routed, embed_rowdiff, lmhead_overlay_routed

__all__ = [
    "OverlayKernels", "batched_embed", "batched_embed_fp8", "dense_gemm_bf16_pipelined",
    "embed_from_argmax", "embed_overlay_routed", "embed_rowdiff", "lmhead_overlay_routed",
    "residual_add", "scaled_add", "scatter_rows", "try_kernel",
]
