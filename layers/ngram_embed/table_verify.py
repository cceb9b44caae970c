"""The converter's table files checked against what it recorded (``layers.ngram_embed.convert``):
each file's header and size, and the CRC32 of its row bytes and scales, which the manifest
(``ngram_tables.json``) keeps. ``verify_tables(OUT_DIR)`` rechecks a whole conversion."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ..dense_weight import BF16, FP8
from .checkpoint import CheckpointError
from .dims import NgramDims
from .table_file import TableFile, TableFormatError
from .table_manifest import MANIFEST, open_table_files, read_manifest

_CRC_CHUNK = 64 << 20


class VerifyError(ValueError):
    """A table file that does not hold what its manifest (or its source) says."""


def crc_file(f: TableFile) -> tuple[int, int | None]:
    # crc32 of an array's ``.data`` (its buffer as a memoryview, no copy) here and in _write_table
    rows = f.rows_bytes.reshape(-1)
    crc = 0
    for at in range(0, rows.size, _CRC_CHUNK):
        crc = zlib.crc32(rows[at : at + _CRC_CHUNK].data, crc)
    scales = f.scales
    return crc, (zlib.crc32(scales.view(np.uint8).data) if scales is not None else None)


def check_table_file(path: Path, entry: dict[str, Any], dtype: np.dtype, rows: int, dim: int) -> str | None:
    """Why ``path`` is not the table ``entry`` describes (None: it is)."""
    try:
        with TableFile(path) as f:
            if (f.dtype, f.rows, f.dim) != (dtype, rows, dim):
                return f"header says {f.dtype.name} [{f.rows}, {f.dim}], expected {dtype.name} [{rows}, {dim}]"
            crc, scales_crc = crc_file(f)
    except FileNotFoundError:
        return "file missing"
    except TableFormatError as err:
        return str(err)
    if crc != entry.get("rows_crc32") or scales_crc != entry.get("scales_crc32"):
        return (
            f"crc32 rows {crc:#010x} / scales {scales_crc}, the manifest says "
            f"{entry.get('rows_crc32')} / {entry.get('scales_crc32')} (corrupt file)"
        )
    return None


def verify_tables(out_dir: str | os.PathLike) -> None:
    """Recheck a whole conversion: every table the manifest's dims call for is listed, inside
    OUT_DIR, with a header that fits (``open_table_files``), and holds the CRC32 of rows and scales
    its entry records; raises ``VerifyError`` naming the first problem (an unfinished conversion
    among them)."""
    out_dir = Path(out_dir)
    try:
        manifest = read_manifest(out_dir)
        missing = [key for key in _DIM_KEYS if key not in manifest]
        if missing:
            raise CheckpointError(f"no {', '.join(missing)}")
        dims = NgramDims(**{key: manifest[key] for key in _DIM_KEYS})
        files = open_table_files(out_dir, dims)
    except (CheckpointError, TypeError, ValueError) as err:
        raise VerifyError(f"{out_dir / MANIFEST}: {err}") from None
    dtype = FP8 if manifest.get("dtype") == "fp8" else BF16
    entries = {e.get("index"): e for e in manifest["tables"] if isinstance(e, dict)}
    for c, path in enumerate(files.paths):
        problem = check_table_file(path, entries[c], dtype, dims.table_rows(c), dims.table_dim())
        if problem:
            raise VerifyError(f"{path}: {problem}")


_DIM_KEYS = ("vocab_size", "hidden_size", "max_ngram", "splits", "base_rows", "row_bias", "table_dim")
