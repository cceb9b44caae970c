"""How a table file stores a source table's rows.

bf16 rows are kept bit for bit; F16/F32 rows are rounded to bf16 (nearest even); fp8 source rows
are dequantised as the gathers read them (``bf16(f32(q) * scale)``) unless the file is fp8 too.
An fp8 file's rows are e4m3 with one f32 scale per row: ``scale = f32(max|row|) / 448``, ``q =
e4m3(clip(f32(row) / scale, -448, 448))`` (nearest even; the clip only matters for a scale that is
an f32 subnormal); an all-zero row gets ``q = 0, scale = 0``. A NaN or infinity raises ``NonFiniteRow``."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..dense_weight import BF16, FP8

FP8_MAX = np.float32(448.0)  # largest finite e4m3fn


class NonFiniteRow(ValueError):
    """A row with a NaN or infinity, which has no fp8 form; ``row`` is its index."""

    def __init__(self, row: int, where: str = "") -> None:
        super().__init__(f"{where + ': ' if where else ''}row {row} holds a NaN or infinity; it has no fp8 form")
        self.row = row


def quantize_fp8_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(e4m3 [n, d], f32 scales [n])`` of ``rows`` (any float dtype, read as f32): the
    convention in the module docstring. Raises ``NonFiniteRow`` for a non-finite value."""
    x = np.asarray(rows).astype(np.float32, copy=False)
    amax = np.max(np.abs(x), axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    if not np.isfinite(amax).all():
        raise NonFiniteRow(int(np.flatnonzero(~np.isfinite(amax))[0]))
    scale = (amax / FP8_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    q = np.clip(x / safe[:, None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, np.where(amax > 0, scale, np.float32(0.0)).astype(np.float32)


def encode_rows(
    src: np.ndarray, src_scales: np.ndarray | None, fp8: bool, where: str, start: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """One chunk of source rows as a table file stores them (``fp8``: e4m3 with per-row scales);
    ``where`` and ``start`` (the chunk's first row) name a non-finite row."""
    if src.dtype == FP8:
        if fp8:
            return src, src_scales
        assert src_scales is not None  # an F8_E4M3 table has its scales (NgramCheckpoint checks)
        return (src.astype(np.float32) * src_scales[:, None]).astype(BF16), None
    if fp8:
        try:
            return quantize_fp8_rows(src)
        except NonFiniteRow as err:
            raise NonFiniteRow(start + err.row, where) from None
    if src.dtype == BF16:
        return src, None
    return src.astype(np.float32).astype(BF16), None
