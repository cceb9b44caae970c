"""Model layers on the gpu_runtime: n-gram embedding and LoRA token overlays."""

from .ops.loading import try_kernel

__all__ = ["try_kernel"]
