"""A table file checked against what its writer recorded: the header's dtype and shape, and the
CRC32 of its row bytes and scales (the manifest's ``rows_crc32`` / ``scales_crc32``)."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .table_file import TableFile, TableFormatError

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
            f"crc32 rows {_hex(crc)} / scales {_hex(scales_crc)}, the manifest says "
            f"{_hex(entry.get('rows_crc32'))} / {_hex(entry.get('scales_crc32'))} (corrupt file)"
        )
    return None


def _hex(crc: object) -> str:
    """A crc32 as 0x%08x (a manifest's value that is no int as it is: None for bf16 scales)."""
    return f"{crc:#010x}" if isinstance(crc, int) and not isinstance(crc, bool) else repr(crc)
