"""The references' argument checks: ``TypeError`` for a wrong type or dtype, ``ValueError`` for a
wrong shape or value, each message naming the argument (``what``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
F32 = np.dtype(np.float32)
SCALE_DTYPES = (np.dtype(np.float16), F32, np.dtype(np.float64))  # fp8 row scales (read as f32)
U32 = 1 << 32


# -- the checks ----------------------------------------------------------------------------
def array(value: Any, what: str, dtypes: tuple[np.dtype, ...], shape: Sequence[int | str] | None = None) -> Any:
    """``value`` if it is an array (a ``shape`` and a ``dtype``) of one of ``dtypes`` (else
    ``TypeError``) with the dimensions ``shape`` (an int: that size, a name: any size; None: any
    shape; else ``ValueError``)."""
    dtype, got = getattr(value, "dtype", None), getattr(value, "shape", None)
    if not isinstance(dtype, np.dtype) or not isinstance(got, tuple):
        raise TypeError(f"{what} must be a numpy array, got {type(value).__name__}")
    if dtype not in dtypes:
        raise TypeError(f"{what} must be {' or '.join(d.name for d in dtypes)}, got dtype {dtype}")
    if shape is not None and (len(got) != len(shape) or any(type(s) is int and s != g for s, g in zip(shape, got))):
        raise ValueError(f"{what} must be [{', '.join(map(str, shape))}], got shape {list(got)}")
    return value


def id_array(ids: Any, what: str, limit: int) -> np.ndarray:
    """``ids`` as a 1-D int64 array of integers in ``0..limit-1``."""
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu" and not (arr.ndim == 1 and arr.size == 0):  # [] is float64
        raise TypeError(f"{what} must be integers, got {type(ids).__name__} of dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {list(arr.shape)}")
    if arr.size and (arr.min() < 0 or arr.max() >= limit):
        bad = int(np.flatnonzero((arr < 0) | (arr >= limit))[0])
        raise ValueError(f"{what}[{bad}] = {int(arr[bad])} outside 0..{limit - 1}")
    return arr.astype(np.int64)


def gathered_table(table: Any, scale: Any, what: str, rows: int | str = "rows", cols: int | str = "cols") -> None:
    """A gathered table: bf16 ``[rows, cols]`` without a scale, or fp8 with a float scale a row."""
    array(table, what, (BF16, FP8), (rows, cols))
    if table.dtype == FP8:
        array(scale, f"{what} scale", SCALE_DTYPES, (table.shape[0],))
    elif scale is not None:
        raise ValueError(f"{what}: a bfloat16 table takes no scale (None), got {type(scale).__name__}")


def sequence(value: Any, what: str, length: int | None = None, counted: str = "") -> Sequence:
    """A list or tuple (of ``length`` entries, where given: ``counted`` says of what, and why)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what} must be a list or tuple, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise ValueError(f"{what}: {len(value)} {counted}")
    return value
