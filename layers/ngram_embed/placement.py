"""Where ``NgramWeights`` puts each n-gram table: on the device (a ``DenseWeight``), in mapped
pinned host memory (a ``HostWeight``) or, from a model folder, behind a ``RowCache`` over the
converter's files; one placement per table, or a ``DeviceBudget``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_runtime import validate

from .dims import NgramDims

PLACEMENTS = ("device", "host")  # where from_numpy puts a table: a DenseWeight or a HostWeight


def placements(placement: str | Sequence[str], count: int, allowed: Sequence[str] = PLACEMENTS) -> list[str]:
    """One placement per table (each one of ``allowed``), from one for all or a sequence of
    ``count``; a bad one raises before anything is uploaded."""
    names = " or ".join(f"'{p}'" for p in allowed)
    if isinstance(placement, str):
        if placement not in allowed:
            raise ValueError(f"placement must be {names} (or one per table), got {placement!r}")
        return [placement] * count
    if isinstance(placement, (bool, np.bool_)) or not isinstance(placement, Sequence):
        raise TypeError(f"placement must be {names} or a sequence of them, got {type(placement).__name__}")
    placement = list(placement)
    if len(placement) != count:
        raise ValueError(f"placement: {len(placement)} entries for {count} tables")
    for index, where in enumerate(placement):
        if not isinstance(where, str):
            raise TypeError(f"placement[{index}] must be {names}, got {type(where).__name__} {where!r}")
        if where not in allowed:
            raise ValueError(f"placement[{index}] must be {names}, got {where!r}")
    return placement


PLACES = ("device", "host", "files")  # where the model-folder loader puts a table


@dataclass(frozen=True)
class DeviceBudget:
    """``placement=DeviceBudget(nbytes)``: the weights take at most ``nbytes`` of device memory
    (word rows, projections, fp8 scales and as many tables as fit, in order); the other tables
    go to host memory. The runners' buffers and the fused runners' concatenated projections
    (``D * T*td * 2`` bytes, td the table width, built on the weights at first use) come on top."""

    nbytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", validate.count(self.nbytes, "DeviceBudget: nbytes"))


def resolve_placement(
    placement: Any, dims: NgramDims, table_dtypes: Sequence[str], held: Sequence[int] | range, word_rows: int
) -> list[str]:
    """One of ``PLACES`` per table, from a name, one name per table, or a ``DeviceBudget`` (an
    int is one) that counts only the ``held`` tables and ``word_rows`` word rows (a
    tensor-parallel rank's share); a bad one raises before any upload."""
    t = dims.num_tables()
    if isinstance(placement, (int, np.integer)) and not isinstance(placement, (bool, np.bool_)):
        placement = DeviceBudget(int(placement))
    if not isinstance(placement, DeviceBudget):
        return placements(placement, t, PLACES)
    h, td = dims.hidden_size, dims.table_dim()
    used = word_rows * h * 2 + t * h * td * 2  # word rows, projections (bf16)
    used += sum(dims.table_rows(c) * 4 for c in held if table_dtypes[c] == "F8_E4M3")
    if used > placement.nbytes:
        raise ValueError(
            f"placement DeviceBudget({placement.nbytes}): the word table, projections and "
            f"fp8 scales alone take {used} bytes of device memory"
        )
    places = []
    for c in range(t):
        rows_bytes = dims.table_rows(c) * td * (1 if table_dtypes[c] == "F8_E4M3" else 2)
        if c in held and used + rows_bytes > placement.nbytes:
            places.append("host")
        else:
            used += rows_bytes if c in held else 0
            places.append("device")
    return places
