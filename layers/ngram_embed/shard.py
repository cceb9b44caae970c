"""``NgramShard``: which rows of the n-gram embedding one rank of a tensor-parallel group holds.

Whole tables per rank, not rows of the tables' concatenation (sglang's and vLLM's split): a row
split puts a table on two ranks whenever a split point falls inside it, while the T tables differ
by only 2 rows each, so T/P whole tables per rank balance memory as well and keep every table's
gather on one rank. Rank r holds tables ``[r*T//P, (r+1)*T//P)`` (P need not divide T) and word
rows ``[r*V//P, (r+1)*V//P)``.

Where to reduce (S tokens, D hidden, T tables of td columns, P ranks; a ring all-reduce of B bytes
moves 2 (P-1)/P B per rank):

- **the gathered rows** (this package): each rank gathers its tables' rows and its word rows into
  one bf16 buffer ``[S, D + T*td]`` with zeros where another rank holds the row; one all-reduce
  of B = 2 S (D + T td) bytes; then every rank runs the fused GEMM (word row added in its
  epilogue, one rounding). Exactly one rank contributes each element, so the sum is exact and
  the output is the single-GPU fused path's, bit for bit.
- **the projected output** (each rank multiplies only its tables' k-slice and all-reduces the fp32
  partial ``[S, D]``): B = 4 S D, and 1/P of the GEMM per rank; the sum of P fp32 partials is
  rounded in another order than the single-GPU GEMM's (within one bf16 ulp, not bit for bit).

With T td = D (LongCat-Flash-Lite: D = 3072, T = 12, td = 256) both move 4 S D bytes, so the
exact one is taken; the other would pay only at prefill, where the GEMM dominates
(``reduce_bytes`` gives both for any shape).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_runtime import validate

from .dims import NgramDims


@dataclass(frozen=True)
class NgramShard:
    """Rank ``rank`` of ``size``: its tables ``tables`` and word rows ``[word_lo, word_lo + word_rows)``."""

    rank: int
    size: int
    tables: range
    word_lo: int
    word_rows: int

    @classmethod
    def of(cls, dims: NgramDims, rank: int, size: int) -> NgramShard:
        """The shard of rank ``rank`` of ``size`` for ``dims``: a contiguous run of the tables and of the
        word rows (rank r takes ``[r*X//size, (r+1)*X//size)`` of each). Raises ``ValueError`` for a rank
        outside ``0..size-1`` or a ``size`` over the table count."""
        size = validate.positive(size, "tensor-parallel size")
        rank = validate.count(rank, "tensor-parallel rank")
        if rank >= size:
            raise ValueError(f"tensor-parallel rank {rank} out of range for size {size}")
        t, v = dims.num_tables(), dims.vocab_size
        if size > t:
            raise ValueError(f"tensor-parallel size {size} over the {t} tables: a rank would hold none")
        lo, hi = rank * v // size, (rank + 1) * v // size
        return cls(rank, size, range(rank * t // size, (rank + 1) * t // size), lo, hi - lo)

    def holds_word(self, token: int) -> bool:
        """Whether this rank holds the word row of ``token``."""
        return self.word_lo <= token < self.word_lo + self.word_rows


def reduce_bytes(dims: NgramDims, rows: int) -> dict[str, int]:
    """The bytes one all-reduce moves for a call of ``rows`` rows at each place a rank could reduce:
    ``"gathered rows (bf16)"`` (``[rows, D + T*td]``, what the runners do) and ``"projected output
    (fp32)"`` (``[rows, D]``); the module docstring compares them."""
    d, k = dims.hidden_size, dims.num_tables() * dims.table_dim()
    return {"gathered rows (bf16)": 2 * rows * (d + k), "projected output (fp32)": 4 * rows * d}


def resolve_shard(shard: NgramShard | tuple[int, int] | None, dims: NgramDims) -> NgramShard | None:
    """``shard`` as an ``NgramShard`` of ``dims`` (from ``(rank, size)``), or None."""
    if shard is None or isinstance(shard, NgramShard):
        if shard is not None and shard != NgramShard.of(dims, shard.rank, shard.size):
            raise ValueError(f"shard {shard} is not NgramShard.of(dims, {shard.rank}, {shard.size})")
        return shard
    if not isinstance(shard, tuple) or len(shard) != 2:
        raise TypeError(f"shard must be an NgramShard or a (rank, size) pair, got {type(shard).__name__}")
    return NgramShard.of(dims, *shard)
