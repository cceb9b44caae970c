"""References of ``token_overlay.cu``: the row-difference scan and the routed embedding and
LM-head overlays."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpu_runtime import validate

from ..ops.token_overlay import MAX_LMHEAD_OVERRIDES
from .checks import BF16, F32, U32, array, id_array, sequence
from .dense import gather

# -- token_overlay.cu ----------------------------------------------------------------------
# Per-slot tables are Python sequences indexed by slot (None = a null table entry), the host
# picture of the device pointer tables; each reference applies the kernel's skip rules
# literally. The LM-head dot product follows the kernel's own summation order (``lmhead_dot``):
# bf16 x bf16 products are exact in fp32, so the GPU's fma chain and numpy's multiply-then-add
# give the same fp32 value barring overflow or underflow of a product.
SlotTables = Sequence[np.ndarray | None]  # indexed by slot; None: a null table entry


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float32)


def _slot_tables(what: str, names: str, tables: tuple[Any, ...], n_tab: Any) -> list[int]:
    """Per-slot tables (named by the words of ``names``, then ``n_tab``) as lists or tuples of
    one length; returns ``n_tab`` as ints (negative: no row, as the kernels read it)."""
    first, *others = names.split()
    num = len(sequence(tables[0], f"{what}: {first}"))
    for name, table in zip(others, tables[1:]):
        sequence(table, f"{what}: {name}", num, f"slots ({first} has {num})")
    if not isinstance(n_tab, (list, tuple, np.ndarray)):
        raise TypeError(f"{what}: n_tab must be a list, tuple or array of ints, got {type(n_tab).__name__}")
    if len(n_tab) != num:
        raise ValueError(f"{what}: n_tab: {len(n_tab)} slots ({first} has {num})")
    return [validate.integer(n, f"{what}: n_tab[{s}]") for s, n in enumerate(n_tab)]


def _within(n: int, table: Any, what: str, s: int, name: str) -> None:
    """``n_tab[s]`` no larger than slot ``s``'s table ``name`` (when it has one)."""
    if table is not None and n > len(table):
        raise ValueError(f"{what}: n_tab[{s}] = {n} exceeds the {len(table)} entries of {name}[{s}]")


def _row_slots(what: str, seq_slot: Any, active: Any, count: int, num: int) -> np.ndarray:
    """The slot each of ``count`` rows reads: ``seq_slot[r]`` (integers below ``num``; negative:
    none), or ``active`` for every row when it is None."""
    active = validate.integer(active, f"{what}: active")
    if seq_slot is None:
        if active >= num:
            raise ValueError(f"{what}: active slot {active} outside the {num} slots (negative: none)")
        return np.full(count, active, np.int64)
    slots = np.asarray(seq_slot)
    if slots.dtype.kind not in "iu":
        raise TypeError(f"{what}: seq_slot must be integers, got {type(seq_slot).__name__} of dtype {slots.dtype}")
    if slots.shape != (count,):
        raise ValueError(f"{what}: seq_slot must be [{count}] (a slot a row), got shape {list(slots.shape)}")
    if count and slots.max() >= num:
        raise ValueError(f"{what}: seq_slot holds slot {int(slots.max())}, outside the {num} slots")
    return slots.astype(np.int64)


def _check_thresh(thresh: Any, what: str) -> None:
    """A real threshold, not NaN (it would flag every row), as ``embed_rowdiff`` takes it."""
    if isinstance(thresh, (bool, np.bool_)) or not isinstance(thresh, numbers.Real):
        raise TypeError(f"{what}: thresh must be a real number, got {type(thresh).__name__}")
    if math.isnan(thresh):
        raise ValueError(f"{what}: thresh is NaN: it would flag every row")


def rowdiff_ref(base: np.ndarray, served: np.ndarray, thresh: float) -> np.ndarray:
    """``uint8[rows]``: 1 where ``max_i |base[r,i] - served[r,i]| > thresh`` (fp32 difference),
    a NaN difference counting as greater and equal values (equal infinities) differing by 0.
    ``base`` and ``served``: bf16 ``[rows, h]``."""
    array(base, "rowdiff_ref: base", (BF16,), ("rows", "h"))
    array(served, "rowdiff_ref: served", (BF16,), base.shape)
    _check_thresh(thresh, "rowdiff_ref")
    a, b = _f32(base), _f32(served)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN; a huge difference is inf, as on the GPU
        d = np.where(a == b, np.float32(0), np.abs(a - b))
        return np.any(~(d <= np.float32(thresh)), axis=1).astype(np.uint8)


def _embed_overlay(
    what: str,
    out: np.ndarray,
    ids: np.ndarray,
    seq_slot: Any,
    active: Any,
    slot_maps: Any,
    slot_rows: Any,
    n_tab: Any,
    vocab: int,
) -> np.ndarray:
    """``embed_overlay_ref`` once ``out`` (bf16 ``[tokens, h]``), ``ids`` (int64 ``[tokens]``) and
    ``vocab`` are checked: the per-slot tables' checks, then the copy."""
    n = _slot_tables(what, "slot_maps slot_rows", (slot_maps, slot_rows), n_tab)
    for s, (slot_map, rows) in enumerate(zip(slot_maps, slot_rows)):
        if slot_map is not None:
            array(slot_map, f"{what}: slot_maps[{s}]", (np.dtype(np.int32),), (vocab,))
        if rows is not None:
            array(rows, f"{what}: slot_rows[{s}]", (BF16,), ("rows", out.shape[1]))
            _within(n[s], rows, what, s, "slot_rows")
    slots = _row_slots(what, seq_slot, active, len(ids), len(n))
    res = np.array(out, copy=True)
    for r, (s, tok) in enumerate(zip(slots, ids)):
        if s < 0 or slot_maps[s] is None or slot_rows[s] is None or tok >= vocab:
            continue
        slot = int(slot_maps[s][tok])
        if slot < 0 or slot >= n[s]:
            continue
        res[r] = slot_rows[s][slot]
    return res


def embed_overlay_ref(
    out: np.ndarray,
    ids: Any,
    seq_slot: Any,
    active: int,
    slot_maps: SlotTables,
    slot_rows: SlotTables,
    n_tab: Sequence[int],
    vocab: int,
) -> np.ndarray:
    """``embed_overlay_routed_bf16`` on a gathered ``[tokens, h]`` bf16 array: a copy of ``out``
    with each overridden token's row replaced (bit for bit) by its slot's replacement row.

    ``ids``: ``[tokens]`` u32 values (ids >= ``vocab`` are skipped); ``seq_slot``: ``[tokens]``
    slots below the tables' length (negative: none), or None for ``active`` on every row; per
    slot, ``slot_maps`` int32 ``[vocab]``, ``slot_rows`` bf16 ``[rows, h]`` (None: a null entry)
    and ``n_tab``, at most the slot's rows."""
    what = "embed_overlay_ref"
    array(out, f"{what}: out", (BF16,), ("tokens", "h"))
    ids = id_array(ids, f"{what}: ids", U32)
    if len(ids) != out.shape[0]:
        raise ValueError(f"{what}: ids: {len(ids)} ids for the {out.shape[0]} rows of out")
    vocab = validate.positive(vocab, f"{what}: vocab")
    return _embed_overlay(what, out, ids, seq_slot, active, slot_maps, slot_rows, n_tab, vocab)


def lmhead_dot(x: np.ndarray, w: np.ndarray, vector: bool) -> np.ndarray:
    """fp32 dot products of bf16 rows in the kernel's order: ``x``, ``w`` are ``[..., h]`` (the
    leading dimensions broadcast); the result is ``[...]`` float32. ``vector``: the 16-byte
    path (h % 8 == 0 and aligned rows), lane l summing 8-element chunks l, l+32, ...; otherwise
    lane l sums elements l, l+32, .... Then the xor butterfly over the 32 lane partial sums."""
    array(x, "lmhead_dot: x", (BF16,))
    array(w, "lmhead_dot: w", (BF16,))
    if not (x.ndim and w.ndim and x.shape[-1] == w.shape[-1]):
        raise ValueError(f"lmhead_dot: x and w must be [..., h] of one h, got shapes {list(x.shape)}, {list(w.shape)}")
    try:
        np.broadcast_shapes(x.shape[:-1], w.shape[:-1])
    except ValueError:
        shapes = f"x {list(x.shape)} and w {list(w.shape)}"
        raise ValueError(f"lmhead_dot: the leading dimensions of {shapes} do not broadcast") from None
    _check_vector(validate.boolean(vector, "lmhead_dot: vector"), x.shape[-1], "lmhead_dot")
    return _lmhead_dot(x, w, vector)


def _check_vector(vector: bool, h: int, what: str) -> None:
    if vector and h % 8:
        raise ValueError(f"{what}: vector=True (the 16-byte path) needs h % 8 == 0, got h = {h}")


def _lmhead_dot(x: np.ndarray, w: np.ndarray, vector: bool) -> np.ndarray:
    p = _f32(x) * _f32(w)  # exact
    h = p.shape[-1]
    lead = p.shape[:-1]
    chunk = 8 if vector else 1
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


def _lmhead_overlay(
    what: str,
    logits: np.ndarray,
    hidden: np.ndarray,
    seq_slot: Any,
    active: Any,
    slot_rows: Any,
    slot_ids: Any,
    n_tab: Any,
    max_n_override: Any,
    vector: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """``lmhead_overlay_ref`` once ``logits`` (``[m, vocab]``) and ``hidden`` (bf16 ``[m, h]``) are
    checked: the other arguments' checks, then the recomputed columns."""
    m, vocab = logits.shape
    h = hidden.shape[1]
    max_n = validate.count(max_n_override, f"{what}: max_n_override", limit=MAX_LMHEAD_OVERRIDES + 1)
    vec = (h % 8 == 0) if vector is None else validate.boolean(vector, f"{what}: vector")
    _check_vector(vec, h, what)
    n = _slot_tables(what, "slot_rows slot_ids", (slot_rows, slot_ids), n_tab)
    for s, (rows, ids) in enumerate(zip(slot_rows, slot_ids)):
        if rows is not None:
            array(rows, f"{what}: slot_rows[{s}]", (BF16,), ("rows", h))
            _within(n[s], rows, what, s, "slot_rows")
        if ids is not None:
            array(ids, f"{what}: slot_ids[{s}]", (np.dtype(np.int32),), ("n",))
            _within(n[s], ids, what, s, "slot_ids")
    slots = _row_slots(what, seq_slot, active, m, len(n))
    res = np.array(logits, copy=True)
    written = np.zeros(res.shape, bool)
    for r, s in enumerate(slots):
        if s < 0 or slot_rows[s] is None or slot_ids[s] is None:
            continue
        toks = np.asarray(slot_ids[s][: min(max(n[s], 0), max_n)], np.int64)
        js = np.flatnonzero((toks >= 0) & (toks < vocab))
        if js.size == 0:
            continue
        values = _lmhead_dot(np.broadcast_to(hidden[r], (js.size, h)), slot_rows[s][js], vec)
        res[r, toks[js]] = values.astype(res.dtype)
        written[r, toks[js]] = True
    return res, written


def lmhead_overlay_ref(
    logits: np.ndarray,
    hidden: np.ndarray,
    seq_slot: Any,
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
    elements the kernel writes). ``hidden``: bf16 ``[m, h]``; ``seq_slot``, ``active``: as
    ``embed_overlay_ref``'s; per slot, ``slot_rows`` bf16 ``[rows, h]``, ``slot_ids`` int32
    (ids outside ``0..vocab-1`` skipped) and ``n_tab`` (at most either's length; the first
    ``min(n_tab, max_n_override)`` are read); ``max_n_override`` at most
    ``MAX_LMHEAD_OVERRIDES``. ``vector`` defaults to ``h % 8 == 0`` (aligned device rows).
    """
    what = "lmhead_overlay_ref"
    array(logits, f"{what}: logits", (BF16, F32), ("m", "vocab"))
    array(hidden, f"{what}: hidden", (BF16,), (logits.shape[0], "h"))
    if validate.positive(vocab, f"{what}: vocab") != logits.shape[1]:
        raise ValueError(f"{what}: vocab {vocab}, but logits has {logits.shape[1]} columns")
    return _lmhead_overlay(what, logits, hidden, seq_slot, active, slot_rows, slot_ids, n_tab, max_n_override, vector)


def gather_then_overlay_ref(
    table: np.ndarray,
    ids: Any,
    seq_slot: Any,
    active: int,
    slot_maps: SlotTables,
    slot_rows: SlotTables,
    n_tab: Sequence[int],
) -> np.ndarray:
    """The adapter-routed embedding: ``table[ids]`` (the plain gather of a bf16 ``[vocab, h]``
    table, ids in ``0..vocab-1``), then the overlay (``embed_overlay_ref``, whose arguments the
    others are)."""
    what = "gather_then_overlay_ref"
    array(table, f"{what}: table", (BF16,), ("vocab", "h"))
    rows = id_array(ids, f"{what}: ids", table.shape[0])
    gathered = gather(table, None, rows)
    return _embed_overlay(what, gathered, rows, seq_slot, active, slot_maps, slot_rows, n_tab, table.shape[0])


def logits_then_overlay_ref(
    hidden: np.ndarray,
    lm_head: np.ndarray,
    seq_slot: Any,
    active: int,
    slot_rows: SlotTables,
    slot_ids: SlotTables,
    n_tab: Sequence[int],
    max_n_override: int,
    dtype: Any = BF16,
) -> tuple[np.ndarray, np.ndarray]:
    """The adapter-routed logits: ``hidden @ lm_head^T`` (bf16 ``[m, h]`` and ``[vocab, h]``) in
    fp32, cast to ``dtype`` (bf16 or float32), then the LM-head overlay (``lmhead_overlay_ref``,
    whose arguments the others are). Returns (logits, mask of the overlay's columns)."""
    what = "logits_then_overlay_ref"
    array(hidden, f"{what}: hidden", (BF16,), ("m", "h"))
    array(lm_head, f"{what}: lm_head", (BF16,), ("vocab", hidden.shape[1]))
    if dtype not in (BF16, F32):
        raise TypeError(f"{what}: dtype must be bfloat16 or float32, got {dtype!r}")
    logits = (_f32(hidden) @ _f32(lm_head).T).astype(dtype)
    return _lmhead_overlay(what, logits, hidden, seq_slot, active, slot_rows, slot_ids, n_tab, max_n_override, None)
