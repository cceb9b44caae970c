"""``NgramTable``: where one hashed n-gram table's rows live.

Mirrors the seed's enum: ``NgramTable.Bf16(weight)`` and ``NgramTable.Fp8(weight)`` are resident
``DenseWeight`` tables (fp8 with per-row scales); ``NgramTable.Host(weight)`` is a ``HostWeight``
table in mapped pinned host memory, read in place by the gathers over PCIe (bf16, or fp8 with its
scales on the device); ``NgramTable.Cached(cache)`` is a table too big for the device, whose rows
a ``RowSource`` brings into a device arena batch by batch; ``NgramTable.Absent(rows, dim)`` is a
table another rank of a tensor-parallel group holds (``NgramWeights(shard=)``): this rank's
gathers write its rows as zeros. Use them in ``match`` statements as
the seed does: ``case NgramTable.Fp8(w): ...``. ``gather_entry`` gives any of them as the fused
gather kernel's table descriptor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from gpu_runtime import validate

from ..dense_weight import BF16, FP8, DenseWeight
from ..ngram_store.host_weight import HostWeight
from ..ops.ngram_fused import ABSENT, CACHED


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


W = TypeVar("W", DenseWeight, HostWeight)


@dataclass(frozen=True)
class _WeightTable(Generic[W]):
    """A table that is one whole weight, read where it is (device or mapped host memory)."""

    weight: W

    @property
    def shape(self) -> tuple[int, int]:
        """The table's ``(rows, cols)``: its weight's shape."""
        return self.weight.shape


@dataclass(frozen=True)
class _ResidentTable(_WeightTable[DenseWeight]):
    """A table whose rows are all on the device; the variant's class names its dtype."""


@dataclass(frozen=True)
class Bf16Table(_ResidentTable):
    """A bf16 table resident on the device (``NgramTable.Bf16(weight)``, a ``DenseWeight``)."""


@dataclass(frozen=True)
class Fp8Table(_ResidentTable):
    """An fp8 table resident on the device, with its per-row f32 scales (``NgramTable.Fp8(weight)``)."""


@dataclass(frozen=True)
class HostTable(_WeightTable[HostWeight]):
    """A table in mapped pinned host memory (``HostWeight``): bf16, or fp8 with device scales."""


@dataclass(frozen=True)
class CachedTable:
    """A table whose rows a ``RowSource`` (a ``RowCache``) brings into a device arena batch by batch
    (``NgramTable.Cached(cache)``)."""

    cache: RowSource

    @property
    def shape(self) -> tuple[int, int]:
        """The table's ``(rows, cols)``: the cache's ``(rows, dim)``."""
        return (self.cache.rows, self.cache.dim)


@dataclass(frozen=True)
class AbsentTable:
    """A table held by another rank (tensor parallelism): its shape only, no memory here."""

    rows: int
    dim: int

    @property
    def shape(self) -> tuple[int, int]:
        """The table's ``(rows, dim)`` as the dims give it."""
        return (self.rows, self.dim)


class NgramTable:
    """Where one n-gram table's rows live, as five variants to build and ``match`` on:
    ``Bf16`` / ``Fp8`` (a ``DenseWeight`` on the device), ``Host`` (a ``HostWeight`` in mapped host
    memory), ``Cached`` (a ``RowSource`` such as ``RowCache``) and ``Absent`` (another rank's table:
    its shape only). The Rust engine this package mirrors (docs/SEED.md) has the first three."""

    Bf16 = Bf16Table
    Fp8 = Fp8Table
    Host = HostTable
    Cached = CachedTable
    Absent = AbsentTable


AnyTable = Bf16Table | Fp8Table | HostTable | CachedTable | AbsentTable
_VARIANTS = (Bf16Table, Fp8Table, HostTable, CachedTable, AbsentTable)
_NAMES = "NgramTable.Bf16/Fp8/Host/Cached/Absent"


def check_table(table: AnyTable, index: int, rows: int, dim: int) -> None:
    """Raise ``TypeError`` / ``ValueError`` for a table whose variant, dtype or shape disagrees with the
    dims (before any launch)."""
    where = f"table {index}"
    if not isinstance(table, _VARIANTS):
        raise TypeError(f"{where}: expected {_NAMES}, got {type(table).__name__}")
    if isinstance(table, HostTable):
        _check_host(table.weight, where)
    elif not isinstance(table, (CachedTable, AbsentTable)) and not isinstance(table.weight, DenseWeight):
        hint = " (a HostWeight goes in NgramTable.Host)" if isinstance(table.weight, HostWeight) else ""
        raise TypeError(f"{where}: expected a DenseWeight, got {type(table.weight).__name__}{hint}")
    if table.shape != (rows, dim):
        raise ValueError(f"{where}: shape {table.shape}, dims say ({rows}, {dim})")
    if isinstance(table, Bf16Table) and table.weight.dtype != BF16:
        raise TypeError(f"{where}: NgramTable.Bf16 holds {table.weight.dtype}, not bfloat16")
    if isinstance(table, Fp8Table):
        if table.weight.dtype != FP8:
            raise TypeError(f"{where}: NgramTable.Fp8 holds {table.weight.dtype}, not float8_e4m3fn")
        if not table.weight.row_scale:
            raise ValueError(f"{where}: fp8 table without row scales")


def _check_host(weight: object, where: str) -> None:
    if not isinstance(weight, HostWeight):
        raise TypeError(f"{where}: NgramTable.Host needs a HostWeight, got {type(weight).__name__}")
    validate.require_open(weight.closed or not weight.weight, f"{where}: NgramTable.Host's HostWeight")
    if weight.dtype not in (BF16, FP8):
        raise TypeError(f"{where}: NgramTable.Host holds {weight.dtype}, not bfloat16 or float8_e4m3fn")
    if weight.dtype == FP8 and not weight.row_scale:
        raise ValueError(f"{where}: fp8 table without row scales")


def gather_entry(table: AnyTable, rows: int) -> tuple[int, int, int, int]:
    """The fused gather kernel's descriptor of one table (``layers.ops.ngram_fused``): (data
    address, scale address or 0 for bf16 rows, rows ``M_c`` (the hash modulus), flags).

    Resident and host tables are read where they are, by dtype; a cached table's kernel reads
    its arena at the slots ``resolve`` returned (``CACHED``); an absent one gives zeros
    (``ABSENT``)."""
    rows = validate.positive(rows, "gather_entry: rows", limit=1 << 64)
    match table:
        case Bf16Table(w):
            return (int(w.weight), 0, rows, 0)
        case Fp8Table(w):
            return (int(w.weight), int(w.row_scale), rows, 0)
        case HostTable(w):
            return (int(w.weight), int(w.row_scale) if w.dtype == FP8 else 0, rows, 0)
        case CachedTable(cache):
            scale = cache.scale_dev_va()
            return (int(cache.table_dev_va()), int(scale or 0), rows, CACHED)
        case AbsentTable():
            return (0, 0, rows, ABSENT)
    raise TypeError(f"gather_entry: expected {_NAMES}, got {type(table).__name__}")
