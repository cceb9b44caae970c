"""numpy references of every kernel and of the whole n-gram layer.

Each reproduces its kernel's rounding points: float32 arithmetic where the kernel rounds to
f32 (numpy's float32 add and multiply round to nearest even, as ``__fadd_rn``/``__fmul_rn``
do), then one rounding to bf16 (``ml_dtypes`` rounds to nearest even, as
``__float2bfloat16_rn``). Where the kernel's summation order is its own (GEMM, dot products),
the reference accumulates in fp32 or fp64 and the tests use a tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence

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


# -- gemm.cu -------------------------------------------------------------------------------
def gemm_bf16(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``a @ w^T`` accumulated exactly enough (fp64) and rounded once to bf16: what an fp32
    accumulating kernel gives up to accumulation-order error, far below a bf16 ulp."""
    return (a.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32).astype(BF16)


def gemm_fp64(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    return a.astype(np.float64) @ w.astype(np.float64).T


# -- the n-gram embedding layer ------------------------------------------------------------
# ``tables``: per table its rows and, for an fp8 table, its per-row f32 scales (None for bf16)
NgramTables = list[tuple[np.ndarray, np.ndarray | None]]


def gather_table(table: np.ndarray, scale: np.ndarray | None, ids: np.ndarray) -> np.ndarray:
    """What the gather kernel writes for one table: bf16 rows, or fp8 rows times their scale."""
    return batched_embed(table, ids) if scale is None else batched_embed_fp8(table, scale, ids)


def _last_ids(dims, ctx_tokens: np.ndarray, seq_len: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The word ids and every table's n-gram ids of the context's last ``seq_len`` positions."""
    from .ngram_embed.ids import ngram_ids

    ctx = np.asarray(ctx_tokens, dtype=np.int64)
    return ctx[len(ctx) - seq_len :], [ids[len(ids) - seq_len :] for ids in ngram_ids(dims, ctx)]


def ngram_embed(
    dims, word: np.ndarray, tables: NgramTables, projs: list[np.ndarray], ctx_tokens: np.ndarray, seq_len: int
) -> np.ndarray:
    """The seed's algorithm in numpy with its bf16 roundings: zeroed out, then ``scaled_add`` of
    the word rows, then per table gather -> bf16 GEMM -> ``scaled_add``; scale f32(1/(1+T))."""
    words, table_ids = _last_ids(dims, ctx_tokens, seq_len)
    inv = float(np.float32(1.0) / np.float32(1 + dims.num_tables()))  # f32(1/(1+T)), exact as a float
    out = scaled_add(np.zeros((seq_len, dims.hidden_size), BF16), word[words], inv)
    for (table, scale), proj, ids in zip(tables, projs, table_ids):
        out = scaled_add(out, gemm_bf16(gather_table(table, scale, ids), proj), inv)
    return out


def ngram_embed_ideal(
    dims, word: np.ndarray, tables: NgramTables, projs: list[np.ndarray], ctx_tokens: np.ndarray, seq_len: int
) -> np.ndarray:
    """The same function in fp64 with no intermediate rounding (table rows dequantised exactly)."""
    words, table_ids = _last_ids(dims, ctx_tokens, seq_len)
    acc = word[words].astype(np.float64)
    for (table, scale), proj, ids in zip(tables, projs, table_ids):
        rows = table[ids].astype(np.float64)
        if scale is not None:
            rows *= scale[ids].astype(np.float64)[:, None]
        acc += rows @ proj.astype(np.float64).T
    return acc / (1 + dims.num_tables())


def ngram_embed_fused(
    dims, word: np.ndarray, tables: NgramTables, projs: list[np.ndarray], ctx_tokens: np.ndarray, seq_len: int
) -> np.ndarray:
    """The fused path's roundings: rows gathered to bf16 (fp8 dequantised once), one fp32 sum
    over all tables (here exact in fp64, then rounded to f32), plus the word row in f32, times
    f32(1/(1+T)), one rounding to bf16."""
    words, table_ids = _last_ids(dims, ctx_tokens, seq_len)
    inv = np.float32(1.0) / np.float32(1 + dims.num_tables())
    acc = np.zeros((seq_len, dims.hidden_size), np.float64)
    for (table, scale), proj, ids in zip(tables, projs, table_ids):
        acc += gather_table(table, scale, ids).astype(np.float64) @ proj.astype(np.float64).T
    return ((acc.astype(np.float32) + word[words].astype(np.float32)) * inv).astype(BF16)


# -- token_overlay.cu ----------------------------------------------------------------------
# Per-slot tables are Python sequences indexed by slot (None = a null table entry), the host
# picture of the device pointer tables; each reference applies the kernel's skip rules
# literally. The LM-head dot product follows the kernel's own summation order (``lmhead_dot``):
# bf16 x bf16 products are exact in fp32, so the GPU's fma chain and numpy's multiply-then-add
# give the same fp32 value barring overflow or underflow of a product.
SlotTables = Sequence[np.ndarray | None]  # indexed by slot; None: a null table entry


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float32)


def rowdiff_ref(base: np.ndarray, served: np.ndarray, thresh: float) -> np.ndarray:
    """``uint8[rows]``: 1 where ``max_i |base[r,i] - served[r,i]| > thresh`` (fp32 difference),
    a NaN difference counting as greater and equal values (equal infinities) differing by 0."""
    a, b = _f32(base), _f32(served)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN; a huge difference is inf, as on the GPU
        d = np.where(a == b, np.float32(0), np.abs(a - b))
        return np.any(~(d <= np.float32(thresh)), axis=1).astype(np.uint8)


def row_slots(seq_slot: np.ndarray | None, active: int, count: int) -> np.ndarray:
    """The slot each row reads: ``seq_slot[r]``, or ``active`` for every row when it is None."""
    if seq_slot is None:
        return np.full(count, active, np.int64)
    return np.asarray(seq_slot, np.int64)


def embed_overlay_ref(
    out: np.ndarray,
    ids: np.ndarray,
    seq_slot: np.ndarray | None,
    active: int,
    slot_maps: SlotTables,
    slot_rows: SlotTables,
    n_tab: Sequence[int],
    vocab: int,
) -> np.ndarray:
    """``embed_overlay_routed_bf16`` on a gathered ``[tokens, h]`` bf16 array: a copy of ``out``
    with each overridden token's row replaced (bit for bit) by its slot's replacement row."""
    res = np.array(out, copy=True)
    ids = np.asarray(ids, np.uint64)
    slots = row_slots(seq_slot, active, len(ids))
    for r, (s, tok) in enumerate(zip(slots, ids)):
        if s < 0 or slot_maps[s] is None or slot_rows[s] is None or tok >= vocab:
            continue
        slot = int(slot_maps[s][tok])
        if slot < 0 or slot >= n_tab[s]:
            continue
        res[r] = slot_rows[s][slot]
    return res


def lmhead_dot(x: np.ndarray, w: np.ndarray, vector: bool) -> np.ndarray:
    """fp32 dot products of bf16 rows in the kernel's order: ``x``, ``w`` are ``[..., h]``; the
    result is ``[...]`` float32. ``vector``: the 16-byte path (h % 8 == 0 and aligned rows),
    lane l summing 8-element chunks l, l+32, ...; otherwise lane l sums elements l, l+32, ....
    Then the xor butterfly over the 32 lane partial sums."""
    p = _f32(x) * _f32(w)  # exact
    h = p.shape[-1]
    lead = p.shape[:-1]
    chunk = 8 if vector else 1
    if vector and h % 8:
        raise ValueError("the vector path needs h % 8 == 0")
    n_chunks = h // chunk
    steps = -(-n_chunks // 32)
    padded = np.zeros(lead + (steps * 32 * chunk,), np.float32)
    padded[..., :h] = p
    # [..., step, lane, k]: chunk c = step * 32 + lane, element c * chunk + k
    lanes = padded.reshape(lead + (steps, 32, chunk))
    acc = np.zeros(lead + (32,), np.float32)
    for t in range(steps):
        for k in range(chunk):
            acc = acc + lanes[..., t, :, k]  # zero padding adds exactly 0 (acc + 0 == acc)
    perm = np.arange(32)
    for off in (16, 8, 4, 2, 1):
        acc = acc + acc[..., perm ^ off]
    return acc[..., 0]


def lmhead_overlay_ref(
    logits: np.ndarray,
    hidden: np.ndarray,
    seq_slot: np.ndarray | None,
    active: int,
    slot_rows: SlotTables,
    slot_ids: SlotTables,
    n_tab: Sequence[int],
    max_n_override: int,
    vocab: int,
    vector: bool | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``lmhead_overlay_routed_{bf16,f32}`` on ``[m, vocab]`` logits (bf16 or float32).

    Returns (a copy of ``logits`` with the overridden columns recomputed, a bool mask of the
    elements the kernel writes). ``vector`` defaults to ``h % 8 == 0`` (aligned device rows).
    """
    res = np.array(logits, copy=True)
    written = np.zeros(res.shape, bool)
    h = hidden.shape[1]
    vec = (h % 8 == 0) if vector is None else vector
    slots = row_slots(seq_slot, active, hidden.shape[0])
    for r, s in enumerate(slots):
        if s < 0 or slot_rows[s] is None or slot_ids[s] is None:
            continue
        n = min(max(int(n_tab[s]), 0), max_n_override)
        toks = np.asarray(slot_ids[s][:n], np.int64)
        js = np.flatnonzero((toks >= 0) & (toks < vocab))
        if js.size == 0:
            continue
        values = lmhead_dot(np.broadcast_to(hidden[r], (js.size, h)), slot_rows[s][js], vec)
        res[r, toks[js]] = values.astype(res.dtype)
        written[r, toks[js]] = True
    return res, written


def gather_then_overlay_ref(
    table: np.ndarray, ids: np.ndarray, seq_slot, active, slot_maps, slot_rows, n_tab
) -> np.ndarray:
    """The adapter-routed embedding: ``table[ids]`` (the plain gather), then the overlay
    (``embed_overlay_ref``, whose arguments the others are)."""
    ids = np.asarray(ids)
    gathered = np.asarray(table)[ids.astype(np.int64)]
    return embed_overlay_ref(gathered, ids, seq_slot, active, slot_maps, slot_rows, n_tab, table.shape[0])


def logits_then_overlay_ref(
    hidden: np.ndarray, lm_head: np.ndarray, seq_slot, active, slot_rows, slot_ids, n_tab, max_n_override, dtype=BF16
) -> tuple[np.ndarray, np.ndarray]:
    """The adapter-routed logits: ``hidden @ lm_head^T`` in fp32, cast to ``dtype`` (bf16 or
    float32), then the LM-head overlay (``lmhead_overlay_ref``, whose arguments the others are).
    Returns (logits, mask of the overlay's columns)."""
    logits = (_f32(hidden) @ _f32(lm_head).T).astype(dtype)
    return lmhead_overlay_ref(
        logits, hidden, seq_slot, active, slot_rows, slot_ids, n_tab, max_n_override, lm_head.shape[0]
    )
