"""Where ``from_numpy`` and the model-folder loader put each n-gram table: on the device (a
``DenseWeight``) or in mapped pinned host memory (a ``HostWeight``), one placement per table."""

from __future__ import annotations

from typing import Sequence

import numpy as np

PLACEMENTS = ("device", "host")  # where from_numpy puts a table: a DenseWeight or a HostWeight


def placements(placement: str | Sequence[str], count: int,
               allowed: Sequence[str] = PLACEMENTS) -> list[str]:
    """One placement per table (each one of ``allowed``), from one for all or a sequence of
    ``count``; refused before anything is uploaded."""
    names = " or ".join(f"'{p}'" for p in allowed)
    if isinstance(placement, str):
        if placement not in allowed:
            raise ValueError(f"placement must be {names} (or one per table), got {placement!r}")
        return [placement] * count
    if isinstance(placement, (bool, np.bool_)) or not isinstance(placement, Sequence):
        raise TypeError(f"placement must be {names} or a sequence of them, got "
                        f"{type(placement).__name__}")
    placement = list(placement)
    if len(placement) != count:
        raise ValueError(f"placement: {len(placement)} entries for {count} tables")
    for index, where in enumerate(placement):
        if not isinstance(where, str):
            raise TypeError(f"placement[{index}] must be {names}, got {type(where).__name__} {where!r}")
        if where not in allowed:
            raise ValueError(f"placement[{index}] must be {names}, got {where!r}")
    return placement
