"""References of ``embed_from_argmax.cu``, ``residual_add.cu`` and ``gemm.cu``; ``gather``,
``scaled_add_unchecked`` and ``gemm_bf16_unchecked`` are the layer references' unchecked forms."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu_runtime import validate

from .checks import BF16, F32, FP8, SCALE_DTYPES, array, id_array


# -- embed_from_argmax.cu ------------------------------------------------------------------
def gather(table: Any, scale: np.ndarray | None, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` (checked int64) of a checked table, fp8 rows times their scale in bf16."""
    return table[ids] if scale is None else dequant(table[ids], scale[ids])


def dequant(rows: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return (rows.astype(np.float32) * scales.astype(np.float32)[:, None]).astype(BF16)


def batched_embed(table: np.ndarray, ids: Any) -> np.ndarray:
    """``table[ids]``: the bf16 rows ``ids`` (integers in ``0..rows-1``) of a bf16 table."""
    array(table, "batched_embed: table", (BF16,), ("rows", "dim"))
    return gather(table, None, id_array(ids, "batched_embed: ids", table.shape[0]))


def dequant_fp8(rows: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """bf16(float(e4m3) * scale): exact upcast, one f32 product, one rounding to bf16."""
    array(rows, "dequant_fp8: rows", (FP8,), ("n", "dim"))
    array(scales, "dequant_fp8: scales", SCALE_DTYPES, (rows.shape[0],))
    return dequant(rows, scales)


def batched_embed_fp8(table: np.ndarray, row_scale: np.ndarray, ids: Any) -> np.ndarray:
    """``dequant_fp8`` of the rows ``ids`` of an fp8 table and of their scales."""
    array(table, "batched_embed_fp8: table", (FP8,), ("rows", "dim"))
    array(row_scale, "batched_embed_fp8: row_scale", SCALE_DTYPES, (table.shape[0],))
    return gather(table, row_scale, id_array(ids, "batched_embed_fp8: ids", table.shape[0]))


def _argmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float32)
    out = np.zeros(x.shape[0], dtype=np.uint32)
    for r, row in enumerate(x):
        valid = ~np.isnan(row)
        if valid.any():
            out[r] = np.argmax(row == row[valid].max())
    return out


def _check_logits(logits: Any, what: str) -> None:
    array(logits, f"{what}: logits", (BF16,), ("m", "vocab"))
    if logits.shape[1] == 0:
        raise ValueError(f"{what}: logits has no column (vocab 0)")


def argmax_ids(logits: np.ndarray) -> np.ndarray:
    """Per row of bf16 ``[m, vocab]`` logits: the lowest index of the row maximum; NaN never
    wins; an all-NaN row gives 0."""
    _check_logits(logits, "argmax_ids")
    return _argmax(logits)


def embed_from_argmax(logits: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``argmax_ids(logits)`` and those rows of the bf16 ``[vocab, dim]`` table."""
    _check_logits(logits, "embed_from_argmax")
    array(table, "embed_from_argmax: table", (BF16,), (logits.shape[1], "dim"))
    ids = _argmax(logits)
    return ids, table[ids.astype(np.int64)]


# -- residual_add.cu -----------------------------------------------------------------------
def scaled_add_unchecked(out: np.ndarray, x: np.ndarray, scale: float) -> np.ndarray:
    return (out.astype(np.float32) + np.float32(scale) * x.astype(np.float32)).astype(BF16)


def scaled_add(out: np.ndarray, x: np.ndarray, scale: float) -> np.ndarray:
    """bf16(out + f32(scale) * x) with two f32 roundings (the kernel uses no FMA): bf16 arrays
    of one shape, ``scale`` finite in f32."""
    array(out, "scaled_add: out", (BF16,))
    array(x, "scaled_add: x", (BF16,), out.shape)
    return scaled_add_unchecked(out, x, validate.real32(scale, "scaled_add: scale"))


def residual_add(out: np.ndarray, x: np.ndarray) -> np.ndarray:
    """bf16(out + x) with one f32 rounding: bf16 arrays of one shape."""
    array(out, "residual_add: out", (BF16,))
    array(x, "residual_add: x", (BF16,), out.shape)
    return (out.astype(np.float32) + x.astype(np.float32)).astype(BF16)


# -- gemm.cu -------------------------------------------------------------------------------
def _check_gemm(a: Any, w: Any, what: str) -> None:
    array(a, f"{what}: a", (BF16,), ("m", "k"))
    array(w, f"{what}: w", (BF16,), ("n", a.shape[1]))


def bf16_of_f64(x: np.ndarray) -> np.ndarray:
    """float64 to bf16 rounded once, to nearest even (subnormals and overflow as the format
    says): rounded to odd at float32 first (24 bits, exact or sticky in the last), then to bf16,
    which cannot round twice. Not ``astype``: ml_dtypes before 0.7 rounds through float32."""
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(F32)
        inexact = np.isfinite(x) & (f.astype(np.float64) != x)
        f = np.where(inexact & (np.abs(f.astype(np.float64)) > np.abs(x)), np.nextafter(f, F32.type(0)), f).astype(F32)
    return (f.view(np.uint32) | inexact.astype(np.uint32)).view(F32).astype(BF16)


def gemm_bf16_unchecked(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    return bf16_of_f64(a.astype(np.float64) @ w.astype(np.float64).T)  # one rounding: fp64 to bf16


def gemm_bf16(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``a @ w^T`` (bf16 ``[m, k]`` and ``[n, k]``) accumulated exactly enough (fp64) and rounded
    once to bf16: what an fp32 accumulating kernel gives up to accumulation-order error, far
    below a bf16 ulp."""
    _check_gemm(a, w, "gemm_bf16")
    return gemm_bf16_unchecked(a, w)


def gemm_fp64(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``a @ w^T`` of bf16 ``[m, k]`` and ``[n, k]`` in fp64, unrounded."""
    _check_gemm(a, w, "gemm_fp64")
    return a.astype(np.float64) @ w.astype(np.float64).T
