"""Argument checks shared by the launchers: refuse bad input before anything is launched."""

from __future__ import annotations

import math
import numbers

F32_MAX = 3.4028234663852886e38


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


def require_scale(scale: float, name: str) -> float:
    """A finite real that fits an f32 (the kernels multiply by it in fp32)."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name}: scale must be a real number, got {scale!r}")
    value = float(scale)
    if not math.isfinite(value) or abs(value) > F32_MAX:
        raise ValueError(f"{name}: scale must be finite and fit an f32, got {scale!r}")
    return value
