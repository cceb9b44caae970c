"""Hashed n-gram ids (Over-Encoding, Huang et al. 2025, Algorithm 1; LongCat-Flash's variant).

For table ``c`` (order ``n = c // K + 2``, modulus ``M_c = table_rows(c)``) and position ``p``::

    id[c][p] = (sum_{d=0}^{n-1} tokens[p-d] * V**d) mod M_c

with ``tokens[p-d] = 0`` before the start and, when ``eos_id`` is set, for every ``d > 0`` at or
beyond the nearest EOS strictly before ``p`` (an EOS position keeps its own token at ``d = 0``).

Exact integer arithmetic, whatever V and N: ``V**d mod M_c`` is precomputed with Python ints, and
the numpy work is in uint64 with a proven bound on every intermediate value:

* ``NgramDims`` guarantees ``M_c <= 2**63``. Let ``s = 64 - bitlen(M_max - 1)``, so that
  ``2**s * M_max <= 2**64``. A factor below ``2**s`` times a residue below ``M_max`` never wraps.
* If every token fits in ``s`` bits (``V <= 2**s``: any V below 2**32 with any table below 2**32
  rows, the practical case), products are formed directly from the tokens. Otherwise each token
  is first reduced mod ``M_c`` and split into base-``2**s`` digits, each digit multiplied by
  ``V**d * 2**(s*j) mod M_c``.
* Products are summed while a running Python-int upper bound says the sum stays below 2**64;
  before it would not, the sum is reduced mod ``M_c``, after which sum + product is at most
  ``(M-1) + (2**s - 1)(M-1) = 2**s (M-1) < 2**64``. In the practical case (V near 2**17, tables
  below 2**32 rows: products below 2**49) there is a single reduction, at the end.

All loops are over look-back distance, digit and nothing else: each step is one numpy operation
over all ``T`` tables and all positions at once (a ``[T, len]`` uint64 array).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_runtime import validate

from .dims import NgramDims
from .front import check_seq_len, check_tokens, context_tail, sliceable

_U64_MAX = (1 << 64) - 1
_WHAT = "ngram ids"


def check_dims(dims: Any, what: str = _WHAT) -> NgramDims:
    """``dims`` if it is an ``NgramDims`` (``TypeError`` naming ``what`` otherwise)."""
    if not isinstance(dims, NgramDims):
        raise TypeError(f"{what}: dims must be an NgramDims, got {type(dims).__name__}")
    return dims


def ngram_ids(dims: NgramDims, tokens: Any) -> list[np.ndarray]:
    """T int64 arrays of ``len(tokens)`` ids, in table order ``c = (n-2)*K + k``."""
    return list(ngram_ids_array(dims, tokens))


def ngram_ids_array(dims: NgramDims, tokens: Any) -> np.ndarray:
    """The ids of every position as one ``[T, len(tokens)]`` int64 array."""
    dims = check_dims(dims)
    tok = np.asarray(sliceable(tokens, _WHAT, name="tokens"))
    tok = check_tokens(tok, dims.vocab_size, _WHAT, 0).astype(np.uint64, copy=False)
    return _hash(dims, tok).view(np.int64)  # every id < M_c <= 2**63


def ngram_ids_tail(dims: NgramDims, tokens: Any, seq_len: int) -> list[np.ndarray]:
    """The ids of the last ``seq_len`` positions only: ``ngram_ids(dims, tokens)[c][len - seq_len:]``.

    Reads (and validates) only the last ``seq_len + N - 1`` tokens, the longest look-back of the
    last ``seq_len`` positions, so a decode step costs the same after 10 or 10**6 context tokens.
    A window that reaches the start of the context is zero-padded exactly as the full computation
    pads; one that starts later holds every token the look-back (and its EOS test) can touch.
    """
    dims, seq_len = check_dims(dims), check_seq_len(seq_len, _WHAT)
    window, start = context_tail(sliceable(tokens, _WHAT, name="tokens"), seq_len, dims.max_ngram - 1, _WHAT)
    window = check_tokens(np.asarray(window), dims.vocab_size, _WHAT, start)
    return list(tail_ids(dims, window, seq_len))


def tail_ids(dims: NgramDims, tail: np.ndarray, seq_len: int) -> np.ndarray:
    """``[T, seq_len]`` int64: the ids of the last ``seq_len`` positions of ``tail``, checked
    tokens (``front.check_tokens``) that are either a whole context or its last
    ``seq_len + N - 1`` tokens (``ngram_ids_tail``'s window, ``front.tail_tokens``)."""
    tok = tail.astype(np.uint64, copy=False)
    return _hash(dims, tok)[:, tok.shape[0] - seq_len :].view(np.int64)


@dataclass(frozen=True)
class _HashPlan:
    """Everything ``_hash`` needs that depends on the dims only (cached: a decode step hashes a
    handful of tokens, so per-call Python set-up would dominate)."""

    m_col: np.ndarray  # [T, 1] uint64 moduli
    m_max: int
    s: int  # digit width in bits: (2**s - 1) * (M_max - 1) < 2**64
    reduce_first: bool  # tokens wider than s bits: reduce mod M_c before splitting
    top: int  # largest value of a (reduced) token
    n_digits: int
    # per look-back distance d, per digit j: ([T, 1] uint64 multipliers V**d * 2**(s*j) mod M_c,
    # 0 for tables of order <= d; the largest product digit * multiplier)
    mults: tuple[tuple[tuple[np.ndarray, int], ...], ...]


@functools.lru_cache(maxsize=64)
def _plan(dims: NgramDims) -> _HashPlan:
    t, k, v = dims.num_tables(), dims.splits, dims.vocab_size
    moduli = [dims.table_rows(c) for c in range(t)]
    orders = [c // k + 2 for c in range(t)]
    m_max = max(moduli)
    s = min(63, 64 - (m_max - 1).bit_length())  # 1 <= s <= 63 as m_max <= 2**63
    digit_mask = (1 << s) - 1
    # Tokens that fit one digit are used as they are: (2**s - 1) * (M - 1) < 2**64.
    reduce_first = (v - 1).bit_length() > s
    top = min(v, m_max) - 1 if reduce_first else v - 1
    n_digits = -(-top.bit_length() // s)
    mults = []
    for d in range(dims.max_ngram):
        v_pow = [pow(v, d, m) for m in moduli]
        per_digit = []
        for j in range(n_digits):
            mult = [(v_pow[c] << (s * j)) % moduli[c] if orders[c] > d else 0 for c in range(t)]
            digit_top = min(digit_mask, top >> (s * j))
            mult_col = np.array(mult, dtype=np.uint64).reshape(t, 1)
            mult_col.flags.writeable = False
            per_digit.append((mult_col, digit_top * max(mult)))
        mults.append(tuple(per_digit))
    m_col = np.array(moduli, dtype=np.uint64).reshape(t, 1)
    m_col.flags.writeable = False
    return _HashPlan(m_col, m_max, s, reduce_first, top, n_digits, tuple(mults))


def _hash(dims: NgramDims, tok: np.ndarray) -> np.ndarray:
    """``[T, len]`` uint64 ids of validated uint64 tokens (see the module docstring for the bounds)."""
    t, length = dims.num_tables(), tok.shape[0]
    plan = _plan(dims)
    if length == 0 or plan.m_max == 1:
        return np.zeros((t, length), dtype=np.uint64)
    m_col, s = plan.m_col, plan.s
    # Reduced tokens are per table ([T, len]); tokens used as they are broadcast ([len]).
    base = tok.reshape(1, length) % m_col if plan.reduce_first else tok
    digit_mask = np.uint64((1 << s) - 1)

    # In-place ops on two [T, len] buffers from np.empty: a prefill of thousands of tokens makes
    # arrays of megabytes, where fresh temporaries or np.zeros (calloc: a page fault on every
    # first write) cost more than the arithmetic. The first term initialises acc.
    acc = np.empty((t, length), dtype=np.uint64)
    term = np.empty_like(acc)
    acc_top = -1  # upper bound of every value in acc; -1 while acc holds nothing yet
    alive = None  # EOS: positions whose look-back has not yet crossed an EOS
    for d in range(min(dims.max_ngram, length)):
        look = _look_back(tok, base, d, dims.eos_id, alive)
        if look is None:
            break
        shifted, alive = look
        for j, (mult, term_top) in enumerate(plan.mults[d]):
            if term_top == 0:
                continue
            out = acc if acc_top < 0 else term
            if plan.n_digits == 1:
                np.multiply(shifted, mult, out=out)
            else:
                np.right_shift(shifted, np.uint64(s * j), out=out)
                out &= digit_mask
                out *= mult
            if acc_top < 0:
                acc_top = term_top
                continue
            if acc_top + term_top > _U64_MAX:
                # After this, acc + term <= (M-1) + (2**s - 1)(M-1) = 2**s (M-1) < 2**64.
                acc %= m_col
                acc_top = plan.m_max - 1
            acc += term
            acc_top += term_top
    if acc_top < 0:  # V = 1: every token is 0
        acc.fill(0)
    acc %= m_col
    return acc


def _look_back(
    tok: np.ndarray, base: np.ndarray, d: int, eos_id: int | None, alive: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None] | None:
    """``base`` shifted right by ``d`` positions (zeros before the start), with the terms of
    positions whose look-back crossed an EOS at distance 1..d zeroed. Returns the shifted values
    and the updated ``alive`` mask, or None when no position can reach back ``d`` any more."""
    if d == 0:
        return base, None
    length = tok.shape[0]
    shifted = np.empty_like(base)
    shifted[..., :d] = 0
    shifted[..., d:] = base[..., : length - d]
    if eos_id is None:
        return shifted, None
    step_ok = np.empty(length, dtype=bool)
    step_ok[:d] = True
    np.not_equal(tok[: length - d], np.uint64(eos_id), out=step_ok[d:])
    alive = step_ok if alive is None else alive & step_ok
    if not alive[d:].any():
        return None
    shifted *= alive  # bool -> 0/1 in uint64
    return shifted, alive


# -- ids from look-back windows (the fused path's host hashing of cached tables) -------------------
NO_TOKEN = 0xFFFFFFFF  # a window entry before the context start (``layers.ops.ngram_fused.NO_TOKEN``)


@dataclass(frozen=True)
class WindowPlan:
    """``ngram_ids_windows``'s constants for (dims, tables), taken from ``_plan``."""

    mults: np.ndarray  # [Tsel, N] uint64: V**d mod M_c, 0 for d >= order(c) (``_plan``'s mults)
    m_col: np.ndarray  # [Tsel, 1] uint64 moduli
    one_reduction: bool  # sum_d (V-1) * max mult_d < 2**64: reduce once, after the sum
    zero: bool  # V = 1 or every M_c = 1: every id is 0
    eos: int | None


@functools.lru_cache(maxsize=64)
def window_plan(dims: NgramDims, tables: tuple[int, ...]) -> WindowPlan:
    t, n = dims.num_tables(), dims.max_ngram
    if dims.vocab_size >= NO_TOKEN or any(dims.table_rows(c) >= 1 << 32 for c in range(t)):
        raise ValueError(
            "ngram ids from windows: needs vocab_size < 2**32 - 1 and every table "
            "< 2**32 rows (the fused path's limits)"
        )
    for c in tables:
        dims._check_index(c)
    plan = _plan(dims)
    # Below 2**32 rows s >= 32 and tokens below 2**32 - 1 fit one digit: no reduction first,
    # one digit (none when V = 1: every token, hence every id, is 0).
    assert not plan.reduce_first and plan.n_digits <= 1
    sel = list(tables)
    zero = plan.n_digits == 0 or plan.m_max == 1
    if zero:
        mults = np.zeros((len(sel), n), np.uint64)
        one = True
    else:
        mults = np.ascontiguousarray(np.concatenate([plan.mults[d][0][0] for d in range(n)], axis=1)[sel])
        one = sum(plan.mults[d][0][1] for d in range(n)) <= _U64_MAX  # the bound ``_hash`` keeps
    m_col = np.ascontiguousarray(plan.m_col[sel])
    for arr in (mults, m_col):
        arr.flags.writeable = False
    return WindowPlan(mults, m_col, one, zero, dims.eos_id)


def ngram_ids_windows(dims: NgramDims, windows: np.ndarray, tables: Sequence[int] | None = None) -> np.ndarray:
    """The ids of tables ``tables`` (default all, in table order) for rows given as look-back
    windows: ``[len(tables), R]`` int64, ``out[j, r]`` the id of table ``tables[j]`` at row r.

    ``windows [R, N]`` uint32 is the fused path's upload (``FusedNgramEmbedding._windows``):
    ``windows[r, d]`` is the token ``d`` positions before row r's token, ``NO_TOKEN`` before the
    context start. Equal to ``ngram_ids_tail``, rule for rule: ``d = 0`` always counts, the first
    ``d >= 1`` that is ``NO_TOKEN`` or the EOS ends the n-gram (that term and the later ones add
    0), and the same exact-integer bound as ``_hash`` (from its plan). One numpy pass over all
    rows and tables: a product with the ``[T, N]`` multipliers and one reduction.

    Limited to the fused path's case: vocab_size < 2**32 - 1 and every table < 2**32 rows
    (ValueError otherwise), so tokens and residues fit 32 bits and a product 64.
    """
    sel = (
        tuple(range(dims.num_tables()))
        if tables is None
        else tuple(validate.integer(c, "ngram ids from windows: table") for c in tables)
    )
    wp = window_plan(dims, sel)
    if not (isinstance(windows, np.ndarray) and windows.dtype == np.uint32):
        raise TypeError(
            f"ngram ids from windows: windows must be a uint32 array, got "
            f"{getattr(windows, 'dtype', type(windows).__name__)}"
        )
    if windows.ndim != 2 or windows.shape[1] != dims.max_ngram:
        raise ValueError(f"ngram ids from windows: windows must be [R, {dims.max_ngram}], got {windows.shape}")
    if windows.size:
        v = dims.vocab_size
        bad = (windows >= v) & (windows != NO_TOKEN)
        bad[:, 0] |= windows[:, 0] == NO_TOKEN  # a row's own token is always there
        if bad.any():
            r, d = (int(x[0]) for x in np.nonzero(bad))
            raise ValueError(
                f"ngram ids from windows: windows[{r}, {d}] = {int(windows[r, d])} is not a "
                f"token in 0..V-1 = 0..{v - 1}" + (" or NO_TOKEN" if d else "")
            )
    return ids_from_windows(wp, windows)


def ids_from_windows(wp: WindowPlan, windows: np.ndarray) -> np.ndarray:
    """``ngram_ids_windows`` without its checks, for windows the caller built and checked
    (``wp = window_plan(dims, tables)``). About five numpy operations whatever R and T."""
    rows = windows.shape[0]
    if wp.zero or rows == 0:
        return np.zeros((wp.mults.shape[0], rows), np.int64)
    tok = windows.astype(np.uint64)
    look = windows[:, 1:]
    # Cut look-backs: entries from the first NO_TOKEN or EOS at d >= 1 on add nothing. A decode
    # step's handful of entries is searched as a list (cheaper than numpy's reductions there).
    if look.size <= 64:
        entries = look.ravel().tolist()
        cut = NO_TOKEN in entries or (wp.eos is not None and wp.eos in entries)
    elif wp.eos is None:
        cut = int(look.max()) == NO_TOKEN  # the largest uint32
    else:
        stop = look == NO_TOKEN
        if wp.eos is not None:
            stop |= look == wp.eos
        cut = bool(stop.any())
    if cut:
        stop = look == NO_TOKEN
        if wp.eos is not None:
            stop |= look == wp.eos
        tok[:, 1:][np.logical_or.accumulate(stop, axis=1)] = 0  # tokens now < V: the bound holds
    if wp.one_reduction:  # every product and their sum below 2**64
        ids = wp.mults.dot(tok[0]).reshape(-1, 1) if rows == 1 else wp.mults @ tok.T  # [Tsel, R]
        ids %= wp.m_col
    else:  # each product below 2**64, reduced before the sum: N * (M - 1) < 2**64
        ids = (wp.mults[:, :, None] * tok.T[None, :, :] % wp.m_col[:, :, None]).sum(axis=1)
        ids %= wp.m_col
    return ids.view(np.int64)
