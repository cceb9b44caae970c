"""Where ``NgramWeights`` puts each n-gram table: on the device (a ``DenseWeight``), in mapped
pinned host memory (a ``HostWeight``) or, from a model folder, behind a ``RowCache`` over the
converter's files; one placement per table, or a ``DeviceBudget``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..ngram_store.placement import DeviceBudget, as_budget, fit_budget, placements
from .dims import NgramDims

__all__ = ["PLACEMENTS", "PLACES", "DeviceBudget", "placements", "resolve_placement"]

PLACEMENTS = ("device", "host")  # where from_numpy puts a table: a DenseWeight or a HostWeight


PLACES = ("device", "host", "files")  # where the model-folder loader puts a table


def resolve_placement(
    placement: Any, dims: NgramDims, table_dtypes: Sequence[str], held: Sequence[int] | range, word_rows: int
) -> list[str]:
    """One of ``PLACES`` per table, from a name, one name per table, or a ``DeviceBudget`` (an
    int is one) that counts only the ``held`` tables and ``word_rows`` word rows (a
    tensor-parallel rank's share); a bad one raises before any upload."""
    t = dims.num_tables()
    budget = as_budget(placement)
    if budget is None:
        return placements(placement, t, PLACES)
    h, td = dims.hidden_size, dims.table_dim()
    fixed = word_rows * h * 2 + t * h * td * 2  # word rows, projections (bf16)
    fixed += sum(dims.table_rows(c) * 4 for c in held if table_dtypes[c] == "F8_E4M3")
    sizes = [dims.table_rows(c) * td * (1 if table_dtypes[c] == "F8_E4M3" else 2) if c in held else 0 for c in range(t)]
    return fit_budget(budget, fixed, "the word table, projections and fp8 scales", sizes)
