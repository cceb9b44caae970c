"""``NgramDims``: the shape of a hashed n-gram embedding (Over-Encoding; LongCat-Flash's variant).

There are ``T = K*(N-1)`` tables, one per n-gram order ``n in 2..N`` and split ``k in 0..K-1``, in
index order ``c = (n-2)*K + k``. Table ``c`` has ``m + 2*c + b`` rows: distinct moduli per table so
that two splits of one order hash the same n-gram to unrelated rows (``b = 0`` in the paper,
``b = 1`` in LongCat-Flash), and ``table_dim`` columns (``D // T`` unless given). With ``eos_id``
set, an n-gram never reaches back across an end-of-sequence token (LongCat-Flash).

Everything is validated at construction, so the layers can trust a ``NgramDims`` they are given
(``gpu_runtime.validate``'s policy: ``TypeError`` for a non-integer, ``ValueError`` for a value
out of range; a table order, split or index outside the dims is an ``IndexError``, as for a
sequence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from gpu_runtime import validate

# Ids are returned as int64: every table must have at most 2**63 rows (ids 0..2**63-1).
MAX_TABLE_ROWS = 1 << 63


def _positive(value: Any, name: str) -> int:
    return validate.positive(value, f"NgramDims: {name}")


def _as_int(value: Any, name: str) -> int:
    return validate.integer(value, f"NgramDims: {name}")


@dataclass(frozen=True, init=False)
class NgramDims:
    """Dims of a hashed n-gram embedding; frozen, validated, compared by its constructor arguments.

    ``table_dim`` is a constructor argument and a method (the seed calls ``dims.table_dim()``): the
    explicit value, if any, is kept in the field ``table_dim_override``.
    """

    vocab_size: int
    hidden_size: int
    max_ngram: int
    splits: int
    base_rows: int
    row_bias: int
    table_dim_override: int | None
    eos_id: int | None

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        max_ngram: int,
        splits: int,
        base_rows: int,
        row_bias: Literal[0, 1] = 0,
        table_dim: int | None = None,
        eos_id: int | None = None,
    ) -> None:
        v = _positive(vocab_size, "vocab_size V")
        d = _positive(hidden_size, "hidden_size D")
        n = _as_int(max_ngram, "max_ngram N")
        k = _positive(splits, "splits K")
        m = _positive(base_rows, "base_rows m")
        b = _as_int(row_bias, "row_bias b")
        if n < 2:
            raise ValueError(f"NgramDims: max_ngram N must be >= 2 (2-grams and up), got {n}")
        if b not in (0, 1):
            raise ValueError(f"NgramDims: row_bias b must be 0 or 1, got {b}")
        t = k * (n - 1)
        if table_dim is None:
            if d // t == 0:
                raise ValueError(
                    f"NgramDims: hidden_size D={d} too small for K*(N-1)={t} tables "
                    f"(default table_dim D // (K*(N-1)) would be 0)"
                )
            td = None
        else:
            td = _positive(table_dim, "table_dim")
        if eos_id is not None:
            eos_id = _as_int(eos_id, "eos_id")
            if not 0 <= eos_id < v:
                raise ValueError(f"NgramDims: eos_id must be in 0..V-1 = 0..{v - 1}, got {eos_id}")
        last_rows = m + 2 * (t - 1) + b
        if last_rows > MAX_TABLE_ROWS:
            raise ValueError(
                f"NgramDims: table {t - 1} would have {last_rows} rows; ids are int64, so at most 2**63 rows per table"
            )
        for name, value in (
            ("vocab_size", v),
            ("hidden_size", d),
            ("max_ngram", n),
            ("splits", k),
            ("base_rows", m),
            ("row_bias", b),
            ("table_dim_override", td),
            ("eos_id", eos_id),
        ):
            object.__setattr__(self, name, value)

    # ---- the two published settings -------------------------------------------------------
    @classmethod
    def over_encoding(
        cls,
        vocab_size: int,
        hidden_size: int,
        max_ngram: int,
        splits: int,
        base_rows: int,
        table_dim: int | None = None,
    ) -> NgramDims:
        """The Over-Encoding paper (Huang et al. 2025): rows ``m + 2*c``, no EOS boundary."""
        return cls(vocab_size, hidden_size, max_ngram, splits, base_rows, row_bias=0, table_dim=table_dim, eos_id=None)

    @classmethod
    def longcat_flash(
        cls,
        vocab_size: int,
        hidden_size: int,
        max_ngram: int,
        splits: int,
        ratio: float,
        eos_id: int | None,
        table_dim: int | None = None,
    ) -> NgramDims:
        """LongCat-Flash: rows ``int(ratio * V) + 2*c + 1``, look-back bounded by ``eos_id`` (None:
        no EOS, as the table converter, which never hashes, reads a config)."""
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.integer, np.floating)):
            raise TypeError(f"NgramDims.longcat_flash: ratio must be a number, got {ratio!r}")
        if not math.isfinite(ratio) or ratio <= 0:
            raise ValueError(f"NgramDims.longcat_flash: ratio must be finite and > 0, got {ratio}")
        v = _positive(vocab_size, "vocab_size V")
        base_rows = int(ratio * v)
        if base_rows < 1:
            raise ValueError(
                f"NgramDims.longcat_flash: ratio {ratio} too small for vocab_size V={v}: int(ratio * V) = "
                f"{base_rows} table rows; ratio * V must be >= 1"
            )
        return cls(v, hidden_size, max_ngram, splits, base_rows, row_bias=1, table_dim=table_dim, eos_id=eos_id)

    # ---- derived sizes ---------------------------------------------------------------------
    def num_tables(self) -> int:
        """T = K*(N-1): one table per order 2..N and split."""
        return self.splits * (self.max_ngram - 1)

    def table_dim(self) -> int:
        """Columns of every table: the explicit value, else ``D // T``."""
        if self.table_dim_override is not None:
            return self.table_dim_override
        return self.hidden_size // self.num_tables()

    def table_rows(self, index: int) -> int:
        """Rows of table ``index`` (its hash modulus): ``m + 2*index + b``."""
        index = self._check_index(index)
        return self.base_rows + 2 * index + self.row_bias

    def table_index(self, n: int, k: int) -> int:
        """Index of the table of order ``n`` (2..N) and split ``k`` (0..K-1): ``(n-2)*K + k``."""
        n = _as_int(n, "n")
        k = _as_int(k, "k")
        if not 2 <= n <= self.max_ngram:
            raise IndexError(f"NgramDims: order n={n} outside 2..{self.max_ngram}")
        if not 0 <= k < self.splits:
            raise IndexError(f"NgramDims: split k={k} outside 0..{self.splits - 1}")
        return (n - 2) * self.splits + k

    def order_split(self, index: int) -> tuple[int, int]:
        """Inverse of ``table_index``: ``(n, k)`` of table ``index``."""
        index = self._check_index(index)
        return index // self.splits + 2, index % self.splits

    def replace(self, **changes: Any) -> NgramDims:
        """A copy with some constructor arguments changed (``table_dim=`` included)."""
        args: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "max_ngram": self.max_ngram,
            "splits": self.splits,
            "base_rows": self.base_rows,
            "row_bias": self.row_bias,
            "table_dim": self.table_dim_override,
            "eos_id": self.eos_id,
        }
        unknown = set(changes) - set(args)
        if unknown:
            raise TypeError(f"NgramDims.replace: unknown arguments {sorted(unknown)}")
        args.update(changes)
        return NgramDims(**args)

    def _check_index(self, index: int) -> int:
        index = _as_int(index, "table index")
        t = self.num_tables()
        if not 0 <= index < t:
            raise IndexError(f"NgramDims: table index {index} outside 0..{t - 1}")
        return index
