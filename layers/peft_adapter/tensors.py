"""An adapter file's tensors read as overlays: token rows (``trainable_tokens_delta``), whole
tables (``modules_to_save``) and their merge, each checked (shape, finite bf16 values, ids)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .. import safetensors_io
from ..overlay import TableOverlay
from ..overlay.model import BF16
from .adapter import ROWS_PER_CHUNK_ELEMS
from .config import CONFIG_NAME, PeftAdapterError

FLOATS = ("F16", "BF16", "F32", "F64")


class AdapterFile:
    """An adapter's safetensors file: its header read and checked, a tensor mapped when asked for."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.entries = safetensors_io.read_header(path)
        except ValueError as e:  # malformed or truncated: the loader's own error type
            raise PeftAdapterError(str(e)) from None

    def float_array(self, name: str) -> np.ndarray:
        """The tensor, read-only memory-mapped, with its float dtype (``PeftAdapterError`` for any other)."""
        info = self.entries[name]
        if info.dtype not in FLOATS:
            raise PeftAdapterError(f"{self.path.name}: tensor {name!r} is {info.dtype}, not a float type")
        return safetensors_io.map_tensor(self.path, info)


def token_rows(st: AdapterFile, key: str, ids: list[int], vocab: int, module: str) -> TableOverlay:
    """Tensor ``key``'s rows for token ``ids`` of ``module`` as a bf16 overlay (shape and ids
    inside the vocabulary checked here, finite values by ``TableOverlay``, as every overlay's)."""
    arr = st.float_array(key)
    if arr.ndim != 2 or arr.shape[0] != len(ids) or arr.shape[1] == 0:
        raise PeftAdapterError(
            f"{st.path.name}: {key} has shape {list(arr.shape)}, expected "
            f"[{len(ids)}, h] for the {len(ids)} token ids of {module}"
        )
    rows = np.ascontiguousarray(arr).astype(BF16)
    limit = min(vocab, 1 << 31)  # the overlay's ids are int32
    outside = [int(i) for i in ids if not 0 <= int(i) < limit][:1]  # Python ints: none wraps or overflows
    if outside:
        raise PeftAdapterError(
            f"{CONFIG_NAME}: token id {outside[0]} of {module} outside the vocabulary 0..{limit - 1}"
        )
    id_arr = np.asarray(ids, np.int64)
    try:
        return merge_rows([(id_arr, rows)], f"token ids of {module}")
    except PeftAdapterError:
        raise
    except ValueError as err:  # TableOverlay's own rules: a NaN or inf row
        raise PeftAdapterError(f"{st.path.name}: {key}: {err}") from None


def merge_rows(parts: Iterable[tuple[np.ndarray, np.ndarray]], what: str) -> TableOverlay:
    """One sorted overlay from (ids, bf16 rows) pairs; a repeated id must carry the same row."""
    parts = list(parts)
    ids = np.concatenate([p[0] for p in parts]).astype(np.int64)
    rows = np.concatenate([p[1] for p in parts])
    order = np.argsort(ids, kind="stable")
    ids, rows = ids[order], rows[order]
    dup = np.flatnonzero(ids[1:] == ids[:-1])
    if dup.size:
        u16 = rows.view(np.uint16)
        differ = (u16[dup] != u16[dup + 1]).any(axis=1)
        if differ.any():
            raise PeftAdapterError(f"{what}: token id {int(ids[dup[differ][0]])} given twice with different rows")
        keep = np.ones(ids.size, bool)
        keep[dup + 1] = False
        ids, rows = ids[keep], rows[keep]
    return TableOverlay(np.ascontiguousarray(ids, np.int32), np.ascontiguousarray(rows))


def full_table(st: AdapterFile, key: str, vocab: int, module: str) -> np.ndarray:
    """Tensor ``key``, a whole ``[vocab, h]`` table of ``module`` (a ``modules_to_save`` copy), as
    bf16, read in chunks, every row checked finite."""
    arr = st.float_array(key)
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise PeftAdapterError(f"{st.path.name}: {key} has shape {list(arr.shape)}, not a [vocab, h] table")
    if arr.shape[0] != vocab:
        raise PeftAdapterError(
            f"{st.path.name}: {key} has {arr.shape[0]} rows but vocab is {vocab} (PEFT saves the full "
            f"table of {module} when the vocabulary was resized: serve the resized model)"
        )
    out = np.empty(arr.shape, BF16)
    step = max(1, ROWS_PER_CHUNK_ELEMS // arr.shape[1])
    for a in range(0, arr.shape[0], step):
        out[a : a + step] = arr[a : a + step]
        bad = ~np.isfinite(out[a : a + step]).all(axis=1)
        if bad.any():
            raise PeftAdapterError(
                f"{st.path.name}: {key}: non-finite values (NaN/inf, or too large "
                f"for bf16) in rows {(np.flatnonzero(bad) + a)[:8].tolist()}"
            )
    return out
