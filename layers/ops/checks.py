"""Argument checks shared by the launchers: refuse bad input before anything is launched."""

from __future__ import annotations


def require_ptr(ptr: int, what: str) -> None:
    if not ptr:
        raise ValueError(f"{what}: null device pointer where a buffer is required")


def require_count(n: int, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) and not hasattr(n, "__index__"):
        raise TypeError(f"{what} must be an int, got {n!r}")
    n = int(n)
    if not 0 <= n < 1 << 32:
        raise ValueError(f"{what} must be in 0..2**32-1, got {n}")
    return n
