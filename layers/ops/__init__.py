"""One Python launcher per kernel, arguments in the kernel's positional order."""

from .loading import try_kernel

__all__ = ["try_kernel"]
