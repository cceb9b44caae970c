"""``try_kernel``: the seed's optional-kernel lookup (``layers.kernel_files`` holds it)."""

from ..kernel_files import try_kernel

__all__ = ["try_kernel"]
