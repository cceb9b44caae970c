"""Reference of one Engram layer (DeepSeek-V4.1) once its row ids are known: the rows'
dequantisation, the activation quantisation and block-scaled fp8 ``wkv`` GEMM (fp64), and the gate
on the residual stream (``../shared/ENGRAM.md``, "After the gather").

Scales are e8m0 bytes (``uint8``, or ``ml_dtypes.float8_e8m0fnu``): byte ``b`` means ``2**(b-127)``,
exactly (byte 0 is the f32 subnormal ``2**-127``); byte 255 is NaN and refused, naming where it is.
Row ids and sizes come as plain arrays and ints: nothing here depends on the hash or the config.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from gpu_runtime import validate

from .checks import BF16, F32, FP8, array
from .dense import bf16_of_f64

U8 = np.dtype(np.uint8)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
F64 = np.dtype(np.float64)
SCALE_BYTES = (U8, E8M0)
FP8_BYTES = (FP8, U8)  # e4m3 values, or their raw bytes
FP8_MAX = 448.0  # the largest finite e4m3
AMAX_FLOOR = 1e-4  # act_quant's smallest amax
GATE_CLAMP = 1e-6  # the gate's smallest |dot| (under its square root)


class EngramRef(NamedTuple):
    """Every stage of ``engram_layer_ref``: ``emb`` bf16 ``[T, cols*d]``, ``kv`` bf16
    ``[T, (hc+1)*D]``, ``out`` bf16 ``[T, hc, D]`` (the updated residual), ``exact`` its float64
    value before that rounding, ``gate`` float64 ``[T, hc]``."""

    emb: np.ndarray
    kv: np.ndarray
    out: np.ndarray
    exact: np.ndarray
    gate: np.ndarray


# -- the checks ----------------------------------------------------------------------------
def _block(block: Any, what: str) -> int:
    return validate.positive(block, f"{what}: block")


def _whole_blocks(cols: int, block: int, what: str) -> None:
    if cols % block:
        raise ValueError(f"{what} has {cols} columns, not a multiple of block {block}")


def _scale_bytes(scale: Any, what: str, block: int | None) -> np.ndarray:
    """The scale bytes as uint8; ``ValueError`` where one is 255 (e8m0 NaN), naming its row, or
    its block of a ``block x block``-scaled matrix."""
    raw = np.asarray(scale).view(U8)
    bad = np.argwhere(raw == 255)
    if bad.size:
        r, c = (int(i) for i in bad[0])
        place = f"row {r}" if block is None else f"the block of rows {r * block}.. and columns {c * block}.."
        raise ValueError(f"{what}[{r}, {c}] is 255 (e8m0 NaN): {place}")
    return raw


def _rows(table: Any, scale: Any, block: int, what: str, names: tuple[str, str]) -> None:
    """An e4m3 ``[rows, d]`` table with an e8m0 scale per row and ``block`` columns."""
    array(table, f"{what}: {names[0]}", FP8_BYTES, ("rows", "d"))
    _whole_blocks(table.shape[1], block, f"{what}: {names[0]}")
    array(scale, f"{what}: {names[1]}", SCALE_BYTES, (table.shape[0], table.shape[1] // block))


def _blocks(weight: Any, scale: Any, block: int, what: str, names: tuple[str, str], shape: tuple) -> np.ndarray:
    """An e4m3 ``[n, k]`` matrix with an e8m0 scale per ``block x block`` block: its scale bytes."""
    array(weight, f"{what}: {names[0]}", FP8_BYTES, shape)
    n, k = weight.shape
    array(scale, f"{what}: {names[1]}", SCALE_BYTES, (-(-n // block), -(-k // block)))
    return _scale_bytes(scale, f"{what}: {names[1]}", block)


def _non_finite(emb: np.ndarray) -> tuple[int, int] | None:
    """The first non-finite entry's place, if any."""
    bad = np.argwhere(~np.isfinite(emb.astype(F32)))
    return (int(bad[0, 0]), int(bad[0, 1])) if bad.size else None


def _activations(emb: Any, block: int, what: str) -> None:
    """bf16 ``[m, k]``, ``k`` whole blocks, finite (no scale quantises a non-finite block)."""
    array(emb, what, (BF16,), ("m", "k"))
    _whole_blocks(emb.shape[1], block, what)
    at = _non_finite(emb)
    if at is not None:
        raise ValueError(f"{what}[{at[0]}, {at[1]}] is {emb[at]}: act_quant takes finite values only")


def _row_ids(row_ids: Any, rows: int, what: str) -> np.ndarray:
    """``[T, cols]`` integer ids in ``0..rows-1``, as int64."""
    dtype = getattr(row_ids, "dtype", None)
    if not isinstance(dtype, np.dtype) or dtype.kind not in "iu":
        raise TypeError(f"{what}: row_ids must be a numpy array of integers, got {type(row_ids).__name__} {dtype}")
    if row_ids.ndim != 2:
        raise ValueError(f"{what}: row_ids must be [T, cols], got shape {list(row_ids.shape)}")
    bad = np.argwhere((row_ids < 0) | (row_ids >= rows))
    if bad.size:
        t, c = (int(i) for i in bad[0])
        raise ValueError(f"{what}: row_ids[{t}, {c}] = {int(row_ids[t, c])} outside 0..{rows - 1}")
    return np.asarray(row_ids, np.int64)


def _residual(x: Any, q_weight: Any, k_weight: Any, text_mask: Any, eps: Any, hc_mult: Any, what: str) -> float:
    """The gate's checks but ``kv``'s; ``eps`` as a float."""
    hc = validate.positive(hc_mult, f"{what}: hc_mult")
    array(x, f"{what}: x", (BF16,), ("T", hc, "D"))
    t, _, d = x.shape
    if d == 0:
        raise ValueError(f"{what}: x has no column (D 0)")
    array(q_weight, f"{what}: q_weight", (BF16,), (hc, d))
    array(k_weight, f"{what}: k_weight", (BF16,), (hc, d))
    array(text_mask, f"{what}: text_mask", (np.dtype(bool),), (t,))
    value = validate.real32(eps, f"{what}: eps")
    if value < 0:
        raise ValueError(f"{what}: eps must be >= 0, got {eps!r}")
    return value


# -- the unchecked forms -------------------------------------------------------------------
def _pow2(raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``2**(byte-127)`` exactly (byte 0: ``2**-127``, an f32 subnormal), in ``dtype``."""
    return np.ldexp(np.ones((), dtype), raw.astype(np.int32) - 127)


def _dequant(values: np.ndarray, raw: np.ndarray, block: int) -> np.ndarray:
    """bf16(f32(e4m3) * f32(2**(byte-127))) per ``block`` columns (an f32 overflow is inf)."""
    scale = np.repeat(_pow2(raw, F32), block, axis=1)
    with np.errstate(over="ignore"):
        return (values.view(FP8).astype(F32) * scale).astype(BF16)


def _expand(raw: np.ndarray, shape: tuple[int, ...], block: int, dtype: np.dtype) -> np.ndarray:
    """The ``[n, k]`` (``shape``) matrix of the block scales ``2**(byte-127)``."""
    n, k = shape
    return np.repeat(np.repeat(_pow2(raw, dtype), block, axis=0)[:n], block, axis=1)[:, :k]


def _gather(table: Any, scale: Any, ids: np.ndarray, block: int, what: str) -> np.ndarray:
    t, cols = ids.shape
    flat = ids.reshape(-1)
    raw = np.asarray(scale[flat]).view(U8)
    bad = np.flatnonzero((raw == 255).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{what}: table_scale row {flat[i]} (row_ids[{i // cols}, {i % cols}]) holds a 255 byte (e8m0 NaN)"
        )
    return _dequant(np.asarray(table[flat]), raw, block).reshape(t, cols * table.shape[1])


def _act_quant(emb: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    m, k = emb.shape
    x = emb.astype(F32).reshape(m, k // block, block)
    amax = np.maximum(np.abs(x).max(axis=2, initial=0.0).astype(F64), AMAX_FLOOR)
    # exact for every bf16 amax (no amax / 448 lies near a power of two but on it: a test sweeps them all)
    scales = np.ldexp(np.ones((), F32), np.ceil(np.log2(amax / FP8_MAX)).astype(np.int32))
    return (x / scales[:, :, None]).astype(FP8).reshape(m, k), scales


def _wkv_fp64(q: np.ndarray, q_scales: np.ndarray, weight: Any, raw: np.ndarray, block: int) -> np.ndarray:
    a = q.astype(F64) * np.repeat(q_scales.astype(F64), block, axis=1)
    w = np.asarray(weight).view(FP8).astype(F64) * _expand(raw, weight.shape, block, F64)
    return a @ w.T


def _gate(
    x: np.ndarray, kv: np.ndarray, q_weight: np.ndarray, k_weight: np.ndarray, mask: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t, hc, d = x.shape
    xf = x.astype(F64)
    key = kv[:, : hc * d].astype(F64).reshape(t, hc, d)
    value = kv[:, hc * d :].astype(F64)[:, None, :]
    w = q_weight.astype(F64) * k_weight.astype(F64)  # exact (8 x 8 bits), in f32 too
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        rsqrt_x = 1.0 / np.sqrt((xf * xf).mean(axis=2) + eps)
        rsqrt_key = 1.0 / np.sqrt((key * key).mean(axis=2) + eps)
        dot = ((xf * w * key).sum(axis=2) + 0.0) * rsqrt_x * rsqrt_key / np.sqrt(d)  # a sum from +0: never -0.0
        signed = np.copysign(np.sqrt(np.maximum(np.abs(dot), GATE_CLAMP)), dot)
        gate = np.where(mask[:, None], 1.0 / (1.0 + np.exp(-signed)), 0.0)
        exact = np.where(mask[:, None, None], xf + gate[:, :, None] * value, xf)
    return np.where(mask[:, None, None], bf16_of_f64(exact), x), exact, gate


# -- the references ------------------------------------------------------------------------
def dequant_rows(weight: np.ndarray, scale: np.ndarray, block: int = 32) -> np.ndarray:
    """bf16 ``[n, d]`` of e4m3 rows ``weight`` ``[n, d]`` (or their uint8 bytes) and their e8m0
    scale bytes ``scale`` ``[n, d // block]``: ``bf16(f32(e4m3) * 2**(byte - 127))`` per ``block``
    columns: what a kernel's ``__float2bfloat16_rn(float(v) * exp2f(byte - 127))`` gives without
    ftz, where ``exp2f`` of the integer is exact (byte 0: the subnormal ``2**-127``; ftz, or the
    ``byte << 23`` bit trick, makes that scale 0).

    Every e4m3 value is a multiple of ``2**-9`` with 4 significant bits, so the f32 product is exact
    for every byte 0..254, or inf where ``|v| * 2**(byte-127) >= 2**128`` (bytes >= 247 only); the
    bf16 rounding (8 bits) is exact unless the product is below ``2**-126`` (bf16 subnormals: then
    to nearest even on the ``2**-133`` grid). A 255 byte (NaN) is refused, naming its row."""
    block = _block(block, "dequant_rows")
    _rows(weight, scale, block, "dequant_rows", ("weight", "scale"))
    return _dequant(np.asarray(weight), _scale_bytes(scale, "dequant_rows: scale", None), block)


def emb_from_rows(table: np.ndarray, table_scale: np.ndarray, row_ids: np.ndarray, block: int = 32) -> np.ndarray:
    """The gather: bf16 ``[T, cols * d]`` of the rows ``row_ids`` (integers ``[T, cols]``) of an
    e4m3 ``[rows, d]`` table (``table_scale``: its e8m0 bytes ``[rows, d // block]``), each row
    dequantised as ``dequant_rows`` does; columns in order hash column, then within the row. Only the
    rows named are read (a memory map serves); a 255 scale byte in one is refused, naming it."""
    block = _block(block, "emb_from_rows")
    _rows(table, table_scale, block, "emb_from_rows", ("table", "table_scale"))
    ids = _row_ids(row_ids, table.shape[0], "emb_from_rows")
    return _gather(table, table_scale, ids, block, "emb_from_rows")


def act_quant(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """The reference's activation quantisation of bf16 ``x`` ``[m, k]`` along ``k`` per ``block``:
    ``scale = 2**ceil(log2(max(amax, 1e-4) / 448))`` (exact for bf16), ``q = e4m3(x / scale)``
    rounded to nearest even (``|x / scale| <= 448`` by construction); returns ``q`` e4m3 ``[m, k]``
    and the scales float32 ``[m, k // block]``. For bf16 ``x`` the scale equals DeepSeek's float32
    bit trick (the exponent of ``f32(amax * f32(1/448))``, plus one if its mantissa is not 0). A
    non-finite ``x`` is refused: no scale quantises it.

    Rows from ``dequant_rows`` (whole blocks of them) requantise losslessly, ``q * scale == x``, but
    for blocks whose amax is below ``448 * 2**-23`` (< 1e-4): the floor raises their scale and
    drops low bits."""
    block = _block(block, "act_quant")
    _activations(x, block, "act_quant: x")
    return _act_quant(x, block)


def dequant_weight(weight: np.ndarray, scale: np.ndarray, block: int = 32, dtype: Any = F32) -> np.ndarray:
    """An e4m3 weight ``[n, k]`` (or its bytes) times its e8m0 block scales ``scale``
    ``[ceil(n / block), ceil(k / block)]``, in ``dtype``: float32 (exact, or inf past the f32 range)
    or bfloat16 (one rounding of that product, exact unless below ``2**-126``), the bf16 fallback's
    weight. A 255 byte (NaN) is refused, naming its block."""
    block = _block(block, "dequant_weight")
    raw = _blocks(weight, scale, block, "dequant_weight", ("weight", "scale"), ("n", "k"))
    try:
        out = np.dtype(dtype)
    except TypeError:
        out = None
    if dtype is None or out not in (F32, BF16):
        raise TypeError(f"dequant_weight: dtype must be float32 or bfloat16, got {dtype!r}")
    with np.errstate(over="ignore"):
        product = np.asarray(weight).view(FP8).astype(F32) * _expand(raw, weight.shape, block, F32)
    return product.astype(out)


def wkv_fp64(
    q: np.ndarray, q_scales: np.ndarray, weight: np.ndarray, weight_scales: np.ndarray, block: int = 32
) -> np.ndarray:
    """The block-scaled fp8 GEMM in float64, unrounded: ``kv[m, n] = sum_k (q[m, k] *
    q_scales[m, k // block]) * (weight[n, k] * 2**(weight_scales[n // block, k // block] - 127))``
    for e4m3 ``q`` ``[m, k]`` with float32 ``q_scales`` ``[m, k // block]`` (``act_quant``'s) and an
    e4m3 ``weight`` ``[n, k]`` (or its bytes) with e8m0 ``weight_scales`` ``[ceil(n / block), k // block]``.
    Every product is exact in float64; only the sum rounds (far below a bf16 ulp)."""
    block = _block(block, "wkv_fp64")
    array(q, "wkv_fp64: q", (FP8,), ("m", "k"))
    _whole_blocks(q.shape[1], block, "wkv_fp64: q")
    array(q_scales, "wkv_fp64: q_scales", (F32,), (q.shape[0], q.shape[1] // block))
    raw = _blocks(weight, weight_scales, block, "wkv_fp64", ("weight", "weight_scales"), ("n", q.shape[1]))
    return _wkv_fp64(q, q_scales, weight, raw, block)


def wkv_ref(emb: np.ndarray, weight: np.ndarray, weight_scales: np.ndarray, block: int = 32) -> np.ndarray:
    """``kv`` bf16 ``[m, n]``: ``wkv_fp64`` over ``act_quant(emb)`` (bf16 ``[m, k]``), rounded once
    from float64 to bf16, to nearest even (``bf16_of_f64``)."""
    block = _block(block, "wkv_ref")
    _activations(emb, block, "wkv_ref: emb")
    raw = _blocks(weight, weight_scales, block, "wkv_ref", ("weight", "weight_scales"), ("n", emb.shape[1]))
    return bf16_of_f64(_wkv_fp64(*_act_quant(emb, block), weight, raw, block))


def gate_ref(
    x: np.ndarray,
    kv: np.ndarray,
    q_weight: np.ndarray,
    k_weight: np.ndarray,
    text_mask: np.ndarray,
    eps: float,
    hc_mult: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gate on the residual ``x`` bf16 ``[T, hc_mult, D]`` from ``kv`` bf16
    ``[T, (hc_mult + 1) * D]``, in float64: ``key = kv[:, :hc_mult*D]`` as ``[T, hc_mult, D]``,
    ``value = kv[:, hc_mult*D:]``, ``w = q_weight * k_weight`` (bf16 ``[hc_mult, D]``); per token
    and copy ``dot = sum(x*w*key) * rsqrt(mean(x^2) + eps) * rsqrt(mean(key^2) + eps) / sqrt(D)``,
    ``gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot))``, 0 where ``text_mask`` (bool ``[T]``)
    is False. Returns ``bf16(x + gate * value)`` rounded once from float64, that float64 value, and
    ``gate`` float64 ``[T, hc_mult]``; a masked token's rows are ``x`` itself, bit for bit.

    vLLM's ``_fused_engram_post_wkv_kernel`` computes this in fp32. It and the Megatron form
    ``sigmoid(copysign(dot.abs().clamp_min(clamp).sqrt(), dot))`` (as here and ENGRAM.md) differ at
    ``dot = -0.0`` only (vLLM's ``where(dot < 0, -g, g)`` gives ``sigmoid(+1e-3)``, copysign
    ``sigmoid(-1e-3)``), which a sum started from +0.0, as here and in a kernel's accumulator, never
    gives: a zero dot gates by ``sigmoid(+1e-3)``, not 0.5. vLLM masks by a 0 gate and still adds
    ``0 * value`` (``-0.0`` in ``x`` becomes ``+0.0``; an inf value gives NaN)."""
    eps = _residual(x, q_weight, k_weight, text_mask, eps, hc_mult, "gate_ref")
    array(kv, "gate_ref: kv", (BF16,), (x.shape[0], (x.shape[1] + 1) * x.shape[2]))
    return _gate(x, kv, q_weight, k_weight, text_mask, eps)


def engram_layer_ref(
    x: np.ndarray,
    row_ids: np.ndarray,
    table: np.ndarray,
    table_scale: np.ndarray,
    wkv_weight: np.ndarray,
    wkv_scale: np.ndarray,
    q_weight: np.ndarray,
    k_weight: np.ndarray,
    text_mask: np.ndarray,
    eps: float,
    hc_mult: int,
    block: int = 32,
) -> EngramRef:
    """One Engram layer after the hash: ``emb = emb_from_rows(table, table_scale, row_ids)``
    (``[T, cols * d]``), ``kv = wkv_ref(emb, wkv_weight, wkv_scale)`` (``wkv_weight`` e4m3
    ``[(hc_mult + 1) * D, cols * d]``), then ``gate_ref(x, kv, q_weight, k_weight, text_mask, eps,
    hc_mult)``; every argument is checked before anything is computed (a non-finite gathered row
    is refused, naming its token)."""
    what = "engram_layer_ref"
    eps = _residual(x, q_weight, k_weight, text_mask, eps, hc_mult, what)
    block = _block(block, what)
    _rows(table, table_scale, block, what, ("table", "table_scale"))
    ids = _row_ids(row_ids, table.shape[0], what)
    t, hc, d = x.shape
    if ids.shape[0] != t:
        raise ValueError(f"{what}: row_ids has {ids.shape[0]} tokens, x has {t}")
    shape = ((hc + 1) * d, ids.shape[1] * table.shape[1])
    raw = _blocks(wkv_weight, wkv_scale, block, what, ("wkv_weight", "wkv_scale"), shape)
    emb = _gather(table, table_scale, ids, block, what)
    at = _non_finite(emb)
    if at is not None:
        r, c = at[0], at[1] // table.shape[1]
        raise ValueError(f"{what}: table row {ids[r, c]} (row_ids[{r}, {c}]) dequantises to {emb[at]}: not quantisable")
    kv = bf16_of_f64(_wkv_fp64(*_act_quant(emb, block), wkv_weight, raw, block))
    return EngramRef(emb, kv, *_gate(x, kv, q_weight, k_weight, text_mask, eps))
