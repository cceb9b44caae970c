"""References of the n-gram embedding layer: the seed's roundings, the fused path's, and fp64."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ngram_embed.dims import NgramDims
from ..ngram_embed.front import check_seq_len, tail_tokens
from ..ngram_embed.ids import check_dims, tail_ids
from .checks import BF16, array, gathered_table, id_array, sequence
from .dense import gather, gemm_bf16_unchecked, scaled_add_unchecked

# -- the n-gram embedding layer ------------------------------------------------------------
# ``tables``: per table its rows and, for an fp8 table, its per-row f32 scales (None for bf16)
NgramTables = list[tuple[np.ndarray, np.ndarray | None]]


def gather_table(table: np.ndarray, scale: np.ndarray | None, ids: Any) -> np.ndarray:
    """What the gather kernel writes for one table: its bf16 rows ``ids`` (``scale`` None), or
    its fp8 rows times their scale."""
    gathered_table(table, scale, "gather_table: table")
    return gather(table, scale, id_array(ids, "gather_table: ids", table.shape[0]))


def _layer_ids(
    what: str, dims: Any, word: Any, tables: Any, projs: Any, ctx_tokens: Any, seq_len: Any
) -> tuple[np.ndarray, np.ndarray]:
    """The n-gram references' checks, then the word ids and every table's n-gram ids
    (``[T, seq_len]``) of the context's last ``seq_len`` positions."""
    dims = check_dims(dims, what)
    t, h, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
    array(word, f"{what}: word", (BF16,), (dims.vocab_size, h))
    for c, pair in enumerate(sequence(tables, f"{what}: tables", t, f"tables, dims need {t}")):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise TypeError(f"{what}: tables[{c}] must be a (table, scale) pair, got {type(pair).__name__}")
        gathered_table(pair[0], pair[1], f"{what}: tables[{c}]", dims.table_rows(c), td)
    for c, proj in enumerate(sequence(projs, f"{what}: projs", t, f"projections, dims need {t} (one a table)")):
        array(proj, f"{what}: projs[{c}]", (BF16,), (h, td))
    seq_len = check_seq_len(seq_len, what)
    tail, _ = tail_tokens(dims, ctx_tokens, seq_len, what)
    return tail[len(tail) - seq_len :].astype(np.int64), tail_ids(dims, tail, seq_len)


def ngram_embed(
    dims: NgramDims, word: np.ndarray, tables: NgramTables, projs: list[np.ndarray], ctx_tokens: Any, seq_len: int
) -> np.ndarray:
    """The seed's algorithm in numpy with its bf16 roundings: zeroed out, then ``scaled_add`` of
    the word rows, then per table gather -> bf16 GEMM -> ``scaled_add``; scale f32(1/(1+T)).

    ``word`` bf16 ``[V, D]``; ``tables`` one (table, scale) pair per table (bf16 ``[rows, td]``
    and None, or fp8 and a float scale a row); ``projs`` bf16 ``[D, td]``; the embedding of the
    last ``seq_len`` positions of ``ctx_tokens`` (ids in ``0..V-1``)."""
    words, table_ids = _layer_ids("ngram_embed", dims, word, tables, projs, ctx_tokens, seq_len)
    inv = float(np.float32(1.0) / np.float32(1 + dims.num_tables()))  # f32(1/(1+T)), exact as a float
    out = scaled_add_unchecked(np.zeros((len(words), dims.hidden_size), BF16), word[words], inv)
    for (table, scale), proj, ids in zip(tables, projs, table_ids):
        out = scaled_add_unchecked(out, gemm_bf16_unchecked(gather(table, scale, ids), proj), inv)
    return out


def ngram_embed_ideal(
    dims: NgramDims, word: np.ndarray, tables: NgramTables, projs: list[np.ndarray], ctx_tokens: Any, seq_len: int
) -> np.ndarray:
    """The same function (``ngram_embed``'s arguments) in fp64 with no intermediate rounding
    (table rows dequantised exactly)."""
    words, table_ids = _layer_ids("ngram_embed_ideal", dims, word, tables, projs, ctx_tokens, seq_len)
    acc = word[words].astype(np.float64)
    for (table, scale), proj, ids in zip(tables, projs, table_ids):
        rows = table[ids].astype(np.float64)
        if scale is not None:
            rows *= scale[ids].astype(np.float64)[:, None]
        acc += rows @ proj.astype(np.float64).T
    return acc / (1 + dims.num_tables())


def ngram_embed_fused(
    dims: NgramDims, word: np.ndarray, tables: NgramTables, projs: list[np.ndarray], ctx_tokens: Any, seq_len: int
) -> np.ndarray:
    """The fused path's roundings (``ngram_embed``'s arguments): rows gathered to bf16 (fp8
    dequantised once), one fp32 sum over all tables (here exact in fp64, then rounded to f32),
    plus the word row in f32, times f32(1/(1+T)), one rounding to bf16."""
    words, table_ids = _layer_ids("ngram_embed_fused", dims, word, tables, projs, ctx_tokens, seq_len)
    inv = np.float32(1.0) / np.float32(1 + dims.num_tables())
    acc = np.zeros((len(words), dims.hidden_size), np.float64)
    for (table, scale), proj, ids in zip(tables, projs, table_ids):
        acc += gather(table, scale, ids).astype(np.float64) @ proj.astype(np.float64).T
    return ((acc.astype(np.float32) + word[words].astype(np.float32)) * inv).astype(BF16)
