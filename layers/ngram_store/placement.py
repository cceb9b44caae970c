"""Where a model's tables go: one name per table (``placements``), or a ``DeviceBudget`` that
puts tables on the device in order while they fit (``fit_budget``) and the rest in host memory.
Shared by both models' weights (``layers.ngram_embed``, ``layers.engram``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_runtime import validate


def placements(placement: str | Sequence[str], count: int, allowed: Sequence[str]) -> list[str]:
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


@dataclass(frozen=True)
class DeviceBudget:
    """``placement=DeviceBudget(nbytes)``: the weights take at most ``nbytes`` of device memory
    (what every table needs on the device, then as many tables as fit, in order); the other
    tables go to host memory. Each model's weights say what they count; runners' buffers come on
    top."""

    nbytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", validate.count(self.nbytes, "DeviceBudget: nbytes"))


def as_budget(placement: Any) -> DeviceBudget | None:
    """``placement`` as a ``DeviceBudget`` (an int is one), or None when it names places."""
    if isinstance(placement, (int, np.integer)) and not isinstance(placement, (bool, np.bool_)):
        return DeviceBudget(int(placement))
    return placement if isinstance(placement, DeviceBudget) else None


def fit_budget(budget: DeviceBudget, fixed: int, fixed_what: str, sizes: Sequence[int]) -> list[str]:
    """``"device"`` for each table of ``sizes`` bytes, in order, while ``fixed`` (the bytes the
    weights put on the device whatever the placement, ``fixed_what``) and the device tables fit
    the budget, ``"host"`` for the others; ``ValueError`` when ``fixed`` alone does not fit."""
    if fixed > budget.nbytes:
        raise ValueError(
            f"placement DeviceBudget({budget.nbytes}): {fixed_what} alone take {fixed} bytes of device memory"
        )
    used, places = fixed, []
    for size in sizes:
        if used + size > budget.nbytes:
            places.append("host")
        else:
            used += size
            places.append("device")
    return places
