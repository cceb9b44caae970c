"""numpy references of every kernel and of the whole n-gram layer.

Each reproduces its kernel's rounding points: float32 arithmetic where the kernel rounds to
f32 (numpy's float32 add and multiply round to nearest even, as ``__fadd_rn``/``__fmul_rn``
do), then one rounding to bf16 (``ml_dtypes`` rounds to nearest even, as
``__float2bfloat16_rn``). Where the kernel's summation order is its own (GEMM, dot products),
the reference accumulates in fp32 or fp64 and the tests use a tolerance.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


# -- embed_from_argmax.cu ------------------------------------------------------------------
def batched_embed(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return table[np.asarray(ids, dtype=np.int64)]


def dequant_fp8(rows: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """bf16(float(e4m3) * scale): exact upcast, one f32 product, one rounding to bf16."""
    return (rows.astype(np.float32) * scales.astype(np.float32)[:, None]).astype(BF16)


def batched_embed_fp8(table: np.ndarray, row_scale: np.ndarray, ids: np.ndarray) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64)
    return dequant_fp8(table[ids], row_scale[ids])


def argmax_ids(logits: np.ndarray) -> np.ndarray:
    """Lowest index of the row maximum; NaN never wins; an all-NaN row gives 0."""
    x = logits.astype(np.float32)
    out = np.zeros(x.shape[0], dtype=np.uint32)
    for r, row in enumerate(x):
        valid = ~np.isnan(row)
        if valid.any():
            out[r] = np.argmax(row == row[valid].max())
    return out


def embed_from_argmax(logits: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ids = argmax_ids(logits)
    return ids, table[ids.astype(np.int64)]


# -- residual_add.cu -----------------------------------------------------------------------
def scaled_add(out: np.ndarray, x: np.ndarray, scale: float) -> np.ndarray:
    """bf16(out + f32(scale) * x) with two f32 roundings (the kernel uses no FMA)."""
    return (out.astype(np.float32) + np.float32(scale) * x.astype(np.float32)).astype(BF16)


def residual_add(out: np.ndarray, x: np.ndarray) -> np.ndarray:
    return (out.astype(np.float32) + x.astype(np.float32)).astype(BF16)
