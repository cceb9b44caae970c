"""``NgramTable``: where one hashed n-gram table's rows live.

Mirrors the seed's enum: ``NgramTable.Bf16(weight)`` and ``NgramTable.Fp8(weight)`` are resident
``DenseWeight`` tables (fp8 with per-row scales); ``NgramTable.Cached(cache)`` is a table too big
for the device, whose rows a ``RowSource`` brings into a device arena batch by batch. Use them
in ``match`` statements as the seed does: ``case NgramTable.Fp8(w): ...``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union, runtime_checkable

import numpy as np

from ..weight_map import BF16, FP8, DenseWeight


@runtime_checkable
class RowSource(Protocol):
    """What ``embed`` needs of a cached table (the seed's ``cache``)."""

    rows: int
    dim: int

    def resolve(self, ids: np.ndarray, slots_out: np.ndarray) -> None:
        """Make the rows of ``ids`` resident; ``slots_out[i]`` (uint32) gets ``ids[i]``'s slot."""

    def table_dev_va(self) -> int:
        """Device address of the arena (``[capacity, dim]``, bf16 or fp8)."""

    def scale_dev_va(self) -> int | None:
        """Device address of the arena's per-slot f32 scales, None for bf16 tables."""

    def end_batch(self) -> None:
        """The batch's rows may be evicted again."""

    # Optional: ``validate(ids)`` refuses what ``resolve`` would, loading nothing (RowCache has
    # it); layers call it for every cached table before their first launch.


@dataclass(frozen=True)
class _ResidentTable:
    """A table whose rows are all on the device; the variant's class names its dtype."""

    weight: DenseWeight

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape


@dataclass(frozen=True)
class Bf16Table(_ResidentTable):
    pass


@dataclass(frozen=True)
class Fp8Table(_ResidentTable):
    pass


@dataclass(frozen=True)
class CachedTable:
    cache: RowSource

    @property
    def shape(self) -> tuple[int, int]:
        return (self.cache.rows, self.cache.dim)


class NgramTable:
    """Namespace of the three variants, spelled as the seed spells them."""

    Bf16 = Bf16Table
    Fp8 = Fp8Table
    Cached = CachedTable


AnyTable = Union[Bf16Table, Fp8Table, CachedTable]


def check_table(table: AnyTable, index: int, rows: int, dim: int) -> None:
    """Refuse a table whose variant, dtype or shape disagrees with the dims (before any launch)."""
    where = f"table {index}"
    if not isinstance(table, (Bf16Table, Fp8Table, CachedTable)):
        raise TypeError(f"{where}: expected NgramTable.Bf16/Fp8/Cached, got {type(table).__name__}")
    if not isinstance(table, CachedTable) and not isinstance(table.weight, DenseWeight):
        raise TypeError(f"{where}: expected a DenseWeight, got {type(table.weight).__name__}")
    if table.shape != (rows, dim):
        raise ValueError(f"{where}: shape {table.shape}, dims say ({rows}, {dim})")
    if isinstance(table, Bf16Table) and table.weight.dtype != BF16:
        raise TypeError(f"{where}: NgramTable.Bf16 holds {table.weight.dtype}, not bfloat16")
    if isinstance(table, Fp8Table):
        if table.weight.dtype != FP8:
            raise TypeError(f"{where}: NgramTable.Fp8 holds {table.weight.dtype}, not float8_e4m3fn")
        if not table.weight.row_scale:
            raise ValueError(f"{where}: fp8 table without row scales")


def validate_cached(tables: list, ids: list[np.ndarray]) -> None:
    """``validate`` every cached table that has it against its ids (before any launch)."""
    for table, table_ids in zip(tables, ids):
        if isinstance(table, CachedTable) and hasattr(table.cache, "validate"):
            table.cache.validate(table_ids)
