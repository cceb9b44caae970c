"""The n-gram front end: what every path does with a call before its first launch.

The seed-faithful ``NgramEmbedding.embed``, the fused ``FusedNgramEmbedding.embed`` /
``embed_batch`` and the device-resident ``NgramDecoder`` reject a closed runner or weights, a
backend other than the weights' and a null output here; the two host paths also check their
contexts and ``seq_len`` here and cut each context to the tail they read:

* ``tail_tokens``: the faithful path's last ``seq_len + N - 1`` tokens of one context (what the
  hash of its last ``seq_len`` positions can reach), checked;
* ``windows``: the fused path's ``[R, N]`` look-back windows of a batch, ``NO_TOKEN`` before a
  context's start, built in one vectorised pass.

Only each context's tail is read and converted, so a decode step costs the same after 10 or
10**6 context tokens; a ``seq_len`` of 0 reads nothing. The errors follow the one policy of
``gpu_runtime.validate`` (``TypeError`` for a wrong type: a ``seq_len`` that is not an int,
tokens that are not integers; ``ValueError`` for a wrong value; ``ClosedError`` for a closed
layer), and each message starts with ``what``, the caller's name.

``CachedRows`` (``cached_rows.py``) is the other half of the front end: the cached tables'
checks, ``resolve`` and ``end_batch``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpu_runtime import GpuBackend, validate

from ..ops.ngram_fused import NO_TOKEN
from .dims import NgramDims


# -- the call's objects ------------------------------------------------------------------------------
def require_open(what: str, owner: Any, weights: Any) -> None:
    """``ClosedError`` for a call on a closed runner ``owner`` or on closed ``weights`` under it."""
    if owner.closed:
        name = type(owner).__name__
        validate.require_open(True, name if what == name else f"{what}: {name}")
    if weights.closed:
        validate.require_open(True, f"{what}: its {type(weights).__name__}")


def require_backend(what: str, gpu: GpuBackend, own: GpuBackend) -> None:
    """The ``gpu`` of the seed's call signatures must be the backend of the weights:
    every upload and launch goes through that one (an ``embed`` that uploaded through one
    backend and launched through another would mix two contexts' queues)."""
    if gpu is not own:
        raise ValueError(f"{what}: gpu is not the backend of the weights; pass the weights' own backend (weights.gpu)")


def require_out(out: int, what: str) -> int:
    """``out``, a non-null device address, as an int."""
    return validate.pointer(out, f"{what} out")


# -- seq_len and contexts ------------------------------------------------------------------------
_PLAIN_SEQUENCES = (list, tuple)  # the common contexts, recognised without an ABC check
_SMALL = 64  # a decode step's few tokens: checked as a list, cheaper than numpy's reductions there


def _seq_name(index: int | None) -> str:
    return "seq_len" if index is None else f"seq_lens[{index}]"


def check_seq_len(value: Any, what: str, index: int | None = None) -> int:
    """A non-negative int (a numpy integer too, not a bool); ``index``: the sequence of a batch."""
    if type(value) is int and value >= 0:
        return value
    return validate.count(value, f"{what}: {_seq_name(index)}")


def sliceable(ctx: Any, what: str, index: int | None = None, name: str = "ctx_tokens") -> Any:
    """``ctx`` as something sliceable without copying the whole context: an ndarray or a list /
    tuple stays as it is (element types are checked on the tail that is read), anything else is
    converted; ``TypeError`` for what is no sequence (None, a number, a string), ``ValueError``
    for anything else that is not 1-D (naming ``name``, or context ``index``)."""
    if type(ctx) in _PLAIN_SEQUENCES:
        return ctx
    arr = ctx
    if not isinstance(ctx, np.ndarray):
        if isinstance(ctx, Sequence) and not isinstance(ctx, (str, bytes)):
            return ctx
        arr = np.asarray(ctx)
    name = name if index is None else f"context {index}"
    if arr.ndim == 0 and arr is not ctx:  # None, a number, a string: no sequence at all
        raise TypeError(f"{what}: {name} must be a 1-D sequence of token ids, got {type(ctx).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{what}: {name} must be 1-D, got shape {arr.shape}")
    return arr


def context_tail(ctx: Any, seq_len: int, lookback: int, what: str, index: int | None = None) -> tuple[Any, int]:
    """The last ``seq_len + lookback`` entries of ``ctx`` (fewer at its start), unconverted, and
    where they start; ``ValueError`` for a ``seq_len`` over the context's length."""
    ctx = sliceable(ctx, what, index)
    total = len(ctx)
    if seq_len > total:
        raise ValueError(f"{what}: {_seq_name(index)} {seq_len} exceeds the context's {total} tokens")
    start = max(total - seq_len - lookback, 0)
    return ctx[start:], start


def check_tokens(arr: np.ndarray, vocab: int, what: str, offset: int | None = None) -> np.ndarray:
    """``arr`` if it is a 1-D integer array of ids in ``0..vocab-1`` (``TypeError`` for another
    dtype); ``offset`` (where known) is its position in the context, so that an error names the
    token's context position."""
    if arr.ndim != 1:
        raise ValueError(f"{what}: tokens must be 1-D, got shape {arr.shape}")
    if arr.shape[0] == 0:
        return arr
    kind = arr.dtype.kind
    if kind not in "iu":
        raise TypeError(f"{what}: tokens must be integers, got dtype {arr.dtype}")
    if arr.shape[0] <= _SMALL:
        values = arr.tolist()
        bad = min(values) < 0 or max(values) >= vocab
    else:
        bad = (kind == "i" and arr.min() < 0) or arr.max() >= vocab
    if bad:
        pos = int(np.flatnonzero((arr < 0) | (arr >= vocab))[0])
        where = "" if offset is None else f" at position {pos + offset}"
        raise ValueError(f"{what}: token {int(arr[pos])}{where} outside 0..V-1 = 0..{vocab - 1}")
    return arr


def tail_tokens(dims: NgramDims, ctx: Any, seq_len: int, what: str) -> tuple[np.ndarray, int]:
    """The faithful path's tail: the last ``seq_len + N - 1`` tokens of ``ctx`` as a checked
    integer array, and its position in the context (empty when ``seq_len`` is 0)."""
    tail, start = context_tail(ctx, seq_len, dims.max_ngram - 1 if seq_len else 0, what)
    return check_tokens(np.asarray(tail), dims.vocab_size, what, start), start


# -- windows -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def window_index(lens: tuple[int, ...], n: int) -> np.ndarray:
    """``[sum lens, n]`` positions into the padded tails (each ``s + n - 1`` long, back to back)
    of every row's window, newest first; cached per batch shape (decode steps repeat theirs)."""
    sizes = np.asarray(lens, np.int64)
    row_seq = np.repeat(np.arange(sizes.size), sizes)
    row_pos = np.arange(row_seq.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    tail_start = np.cumsum(sizes + n - 1) - (sizes + n - 1)
    index = (tail_start[row_seq] + row_pos + n - 1)[:, None] - np.arange(n)
    index.flags.writeable = False
    return index


def windows(dims: NgramDims, contexts: Sequence, seq_lens: Sequence[int], what: str) -> np.ndarray:
    """``[R, N]`` u32: each new token of every sequence and the N - 1 before it (``NO_TOKEN``
    before the context start), rows in order. The per-sequence loop only slices and checks, the
    rest is one vectorised pass over the batch (a serving step has hundreds of sequences, a
    decode call one: both stay a handful of numpy operations). Needs ``vocab_size`` < 2**32 - 1
    (``fused.check_servable``)."""
    n = dims.max_ngram
    tails, lens = [], []
    for i, (ctx, s) in enumerate(zip(contexts, seq_lens)):
        s = check_seq_len(s, what, i)
        tail, _ = context_tail(ctx, s, n - 1, what, i)
        if s:
            tails.append(tail)
            lens.append(s)
    if not tails:
        return np.zeros((0, n), np.uint32)
    arrays = [np.asarray(tail) for tail in tails]
    if len({a.dtype for a in arrays}) > 1:  # mixed kinds: int64 with uint64 would concatenate as float64
        for a in arrays:
            check_tokens(a, dims.vocab_size, what)
        flat = np.concatenate([a.astype(np.uint32) for a in arrays])
    else:
        flat = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        check_tokens(flat, dims.vocab_size, what)
    # Each tail padded in front to s + n - 1 entries with NO_TOKEN (before the context start).
    padded = np.empty(sum(lens) + len(lens) * (n - 1), np.uint32)
    if len(lens) == 1:
        padded[: padded.size - flat.size] = NO_TOKEN
        padded[padded.size - flat.size :] = flat
    else:
        padded.fill(NO_TOKEN)
        ends = np.cumsum(np.asarray(lens, np.int64) + (n - 1))
        sizes = np.fromiter((len(tail) for tail in tails), np.int64, len(tails))
        dest = np.repeat(ends - sizes, sizes) + (np.arange(flat.size) - np.repeat(np.cumsum(sizes) - sizes, sizes))
        padded[dest] = flat
    return padded[window_index(tuple(lens), n)]
