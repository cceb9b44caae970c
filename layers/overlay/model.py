"""What an adapter replaces, on the host: ``TableOverlay`` (one vocab table's replaced rows) and
``AdapterOverlay`` (embedding and LM head), with every check of their ids and rows.

The rows are replacements, not deltas. Building them from adapter files is ``build.py``'s job,
making them device-resident ``slots.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from gpu_runtime import validate

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
_I32_MAX = (1 << 31) - 1


def as_bf16_rows(rows: Any, what: str) -> np.ndarray:
    """A C-contiguous ``[n, h]`` bf16 copy; float16/32/64 input is rounded to bf16 (as served)."""
    arr = np.asarray(rows)
    if arr.ndim != 2:
        raise ValueError(f"{what} must be 2-D [n, h], got shape {arr.shape}")
    if arr.dtype != BF16:
        if arr.dtype.kind != "f":
            raise TypeError(f"{what} must be bfloat16 (or a float type to round), got {arr.dtype}")
        arr = arr.astype(BF16)
    return np.array(arr, dtype=BF16, order="C", copy=True)


def as_ids(ids: Any, what: str) -> np.ndarray:
    """Token ids as int64 ``[n]``: integers, unique, in ``0..2**31-1`` (the kernels' int32)."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{what}: negative token id {int(arr.min())}")
    if arr.size and arr.max() > _I32_MAX:
        raise ValueError(f"{what}: token id {int(arr.max())} does not fit int32")
    uniq, counts = np.unique(arr, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{what}: duplicate token ids {uniq[counts > 1][:8].tolist()}")
    return arr


@dataclass(frozen=True, eq=False)
class TableOverlay:
    """The rows of one vocab table (embedding or LM head) an adapter replaces: ``ids`` int32
    ``[n]`` sorted and unique, ``rows`` bf16 ``[n, h]`` (row k replaces row ``ids[k]``).
    Use ``TableOverlay.of`` to build one from unsorted input. Takes the arrays as they are (no
    copy: a full retrained table can be large) and makes them read-only. ``TypeError`` for
    another type or dtype, ``ValueError`` for other shapes, unsorted ids, or a row holding NaN or
    inf (every overlay, from ``of``, a PEFT adapter or ``build_overlay``, passes here)."""

    ids: np.ndarray
    rows: np.ndarray

    def __post_init__(self) -> None:
        ids, rows = self.ids, self.rows
        for name, arr, dtype in (("ids", ids, np.dtype(np.int32)), ("rows", rows, BF16)):
            if not (isinstance(arr, np.ndarray) and arr.dtype == dtype):
                got = f"dtype {arr.dtype}" if isinstance(arr, np.ndarray) else type(arr).__name__
                raise TypeError(f"TableOverlay.{name} must be an array of {dtype} (use TableOverlay.of), got {got}")
        if ids.ndim != 1 or rows.ndim != 2 or rows.shape[0] != ids.shape[0] or rows.shape[1] == 0:
            shapes = f"{list(ids.shape)} and {list(rows.shape)}"
            raise ValueError(f"TableOverlay: ids [n] and rows [n, h >= 1] needed, got shapes {shapes}")
        if ids.size and (ids[0] < 0 or (np.diff(ids) <= 0).any()):
            raise ValueError("TableOverlay.ids must be sorted, unique and >= 0 (use TableOverlay.of)")
        bad = ((rows.view(np.uint16) & 0x7F80) == 0x7F80).any(axis=1)  # exponent all ones: inf or NaN
        if bad.any():
            raise ValueError(
                "TableOverlay.rows: non-finite values (NaN/inf, or too large for bf16) in the rows "
                f"of token ids {ids[bad][:8].tolist()}"
            )
        for arr in (ids, rows):
            if arr.flags.writeable:
                arr.flags.writeable = False

    @classmethod
    def of(cls, ids: Any, rows: Any, vocab: int | None = None, what: str = "overlay") -> TableOverlay:
        """Validate, sort by id and copy: raises for duplicate or negative ids, ids >= ``vocab``
        (when given), and a row count that differs from the id count."""
        if vocab is not None:
            vocab = validate.positive(vocab, f"{what}: vocab")
        id_arr = as_ids(ids, f"{what} ids")
        row_arr = as_bf16_rows(rows, f"{what} rows")
        if row_arr.shape[0] != id_arr.shape[0]:
            raise ValueError(f"{what}: {id_arr.shape[0]} ids but {row_arr.shape[0]} rows")
        if row_arr.shape[1] == 0:
            raise ValueError(f"{what}: rows of width 0")
        if vocab is not None and id_arr.size and id_arr.max() >= vocab:
            raise ValueError(f"{what}: token id {int(id_arr.max())} >= vocab {vocab}")
        order = np.argsort(id_arr, kind="stable")
        return cls(np.ascontiguousarray(id_arr[order], np.int32), np.ascontiguousarray(row_arr[order]))

    @classmethod
    def empty(cls, h: int) -> TableOverlay:
        """An overlay that replaces no row of a table ``h`` wide (``n == 0``)."""
        return cls(np.zeros(0, np.int32), np.zeros((0, validate.positive(h, "TableOverlay.empty: h")), BF16))

    @property
    def n(self) -> int:
        """How many rows it replaces."""
        return int(self.ids.shape[0])

    @property
    def h(self) -> int:
        """The row width (the served table's columns)."""
        return int(self.rows.shape[1])

    def check_fits(self, which: str, h: int, vocab: int) -> None:
        """``ValueError`` for rows of another width than the served table's, or an id outside its vocab."""
        if self.h != h:
            raise ValueError(f"{which} overlay rows have width {self.h}, the served table {h}")
        if self.n and int(self.ids[-1]) >= vocab:
            raise ValueError(f"{which} overlay id {int(self.ids[-1])} >= vocab {vocab}")


@dataclass(frozen=True)
class AdapterOverlay:
    """What one adapter replaces: embedding rows and/or LM-head rows (None: that table is the
    served one). Host-side; ``OverlaySlots.load`` makes it device-resident in a slot.
    ``TypeError`` for a field that is neither."""

    embed: TableOverlay | None = None
    lm_head: TableOverlay | None = None

    def __post_init__(self) -> None:
        for name in ("embed", "lm_head"):
            table = getattr(self, name)
            if table is not None and not isinstance(table, TableOverlay):
                raise TypeError(f"AdapterOverlay.{name} must be a TableOverlay or None, got {type(table).__name__}")

    @property
    def is_empty(self) -> bool:
        """True when it replaces no row of either table."""
        return all(t is None or t.n == 0 for t in (self.embed, self.lm_head))
