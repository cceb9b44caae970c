"""The table file format: its constants and ``TableHeader`` (the geometry of one table, and its
4096-byte header block packed and checked). ``table_file`` reads and writes the files.

Version 1, little-endian: a header block (magic ``b"NGRAMTBL"``, version, dtype code 1 bf16 or
2 fp8 e4m3, rows, dim, rows_offset, scales_offset, crc32 of those 48 bytes; zeros up to 4096),
the rows raw and row-major from byte 4096, and for fp8 the f32 per-row scales from the next page
boundary after them. ``TableHeader.unpack`` raises ``TableFormatError`` for a wrong magic, version,
crc, dtype code, size or offsets. The layout in full: docs/table_files.md.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_runtime import validate

from ..dense_weight import BF16, FP8

MAGIC = b"NGRAMTBL"
VERSION = 1
PAGE = 4096
HEADER_BYTES = PAGE  # the header block; rows start on the next page
SCALE_DTYPE = np.dtype("<f4")

_FIELDS = struct.Struct("<8sIIQQQQ")  # everything the crc covers (48 bytes)
_CRC = struct.Struct("<I")
_CODES = {BF16: 1, FP8: 2}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


class TableFormatError(ValueError):
    """A table file whose header or size is not what this reader writes."""


def _align_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


def _table_dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in _CODES:
        raise TypeError(f"table dtype must be bfloat16 or float8_e4m3fn, got {dtype!r}")
    return dt


@dataclass(frozen=True)
class TableHeader:
    """The geometry of one table; every offset follows from dtype, rows and dim."""

    dtype: np.dtype
    rows: int
    dim: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _table_dtype(self.dtype))
        object.__setattr__(self, "rows", validate.positive(self.rows, "rows"))
        object.__setattr__(self, "dim", validate.positive(self.dim, "dim"))

    @property
    def row_bytes(self) -> int:
        return self.dim * self.dtype.itemsize

    @property
    def rows_offset(self) -> int:
        return HEADER_BYTES

    @property
    def scales_offset(self) -> int:
        if self.dtype != FP8:
            return 0
        return self.rows_offset + _align_up(self.rows * self.row_bytes)

    @property
    def file_size(self) -> int:
        if self.dtype == FP8:
            return self.scales_offset + self.rows * SCALE_DTYPE.itemsize
        return self.rows_offset + self.rows * self.row_bytes

    def pack(self) -> bytes:
        """The 4096-byte header block."""
        fields = _FIELDS.pack(
            MAGIC, VERSION, _CODES[self.dtype], self.rows, self.dim, self.rows_offset, self.scales_offset
        )
        block = fields + _CRC.pack(zlib.crc32(fields))
        return block + bytes(HEADER_BYTES - len(block))

    @classmethod
    def unpack(cls, block: bytes, path: str = "<table>") -> TableHeader:
        """Parse and validate a header block; ``path`` only names the file in errors."""
        need = _FIELDS.size + _CRC.size
        if len(block) < need:
            raise TableFormatError(f"{path}: header is {len(block)} bytes, need at least {need}")
        fields = bytes(block[: _FIELDS.size])
        magic, version, code, rows, dim, rows_offset, scales_offset = _FIELDS.unpack(fields)
        if magic != MAGIC:
            raise TableFormatError(f"{path}: magic is {magic!r}, not {MAGIC!r} (not a table file)")
        if version != VERSION:
            raise TableFormatError(f"{path}: format version {version}, this reader knows {VERSION}")
        (crc,) = _CRC.unpack_from(block, _FIELDS.size)
        if crc != zlib.crc32(fields):
            raise TableFormatError(
                f"{path}: header crc32 is {crc:#010x}, its bytes give {zlib.crc32(fields):#010x} (corrupt header)"
            )
        if code not in _DTYPES:
            raise TableFormatError(f"{path}: unknown dtype code {code} (1 = bf16, 2 = fp8)")
        if rows < 1 or dim < 1:
            raise TableFormatError(f"{path}: header says rows={rows}, dim={dim}; both must be >= 1")
        header = cls(_DTYPES[code], rows, dim)
        if (rows_offset, scales_offset) != (header.rows_offset, header.scales_offset):
            raise TableFormatError(
                f"{path}: header offsets rows={rows_offset}, scales={scales_offset}; a "
                f"{header.dtype.name} [{rows}, {dim}] table has rows={header.rows_offset}, "
                f"scales={header.scales_offset}"
            )
        return header
