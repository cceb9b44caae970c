"""Tensor maps for the TMA unit: a bf16 matrix in device memory described for box loads.

``cuTensorMapEncodeTiled`` is a pure function of its arguments (no context, no allocation), so
each map is encoded once and cached: a weight's map is built at its first GEMM and then only
looked up, and so is an activation buffer's for as long as the engine reuses it.
"""

from __future__ import annotations

import functools
import struct

from cuda.bindings import driver as cu

from .. import validate
from ..driver import call
from ..launch import TENSOR_MAP_BYTES

_OPAQUE = struct.Struct(f"<{TENSOR_MAP_BYTES // 8}Q")
_BF16_BYTES = 2
_MAX_BOX = 256  # elements per box dimension
_MAX_DIM = 1 << 32  # elements per tensor dimension: below 2**32 (the driver takes up to 2**32)
_SWIZZLE_BYTES = 128  # a box's rows are at most one 128-byte swizzle span


class CudaTensorMaps:
    _closed: bool  # the backend's (CudaContext); encoding needs no context, only an open backend

    def tensor_map_2d(self, address: int, rows: int, cols: int, box_rows: int, box_cols: int) -> bytes:
        """The bf16 row-major ``[rows, cols]`` matrix at ``address`` as a ``CUtensorMap`` of
        ``[box_rows, box_cols]`` boxes, 128-byte swizzle, zeros read outside the matrix: the 128
        bytes a ``T`` kernel parameter takes. Needs ``address`` 16-byte aligned, ``cols % 8 == 0``
        (row pitch a multiple of 16 bytes), ``box_cols * 2`` a multiple of 16 and at most 128,
        and ``box_rows <= 256``."""
        validate.require_open(self._closed, "CudaBackend")
        address = validate.pointer(address, "tensor map address")
        rows = validate.positive(rows, "tensor map rows", limit=_MAX_DIM)
        cols = validate.positive(cols, "tensor map cols", limit=_MAX_DIM)
        box_rows = validate.positive(box_rows, "tensor map box rows")
        box_cols = validate.positive(box_cols, "tensor map box cols")
        if address % 16 or cols % 8:
            raise ValueError(
                f"tensor map: address {address:#x} must be 16-byte aligned and cols ({cols}) a multiple of 8"
            )
        if box_cols % 8:
            raise ValueError(f"tensor map: box cols ({box_cols}) must be a multiple of 8 (16-byte box rows)")
        if box_rows > _MAX_BOX or box_cols * _BF16_BYTES > _SWIZZLE_BYTES:
            raise ValueError(
                f"tensor map: box {box_rows}x{box_cols} beyond the TMA unit's limits "
                f"({_MAX_BOX} rows, {_SWIZZLE_BYTES} bytes a row)"
            )
        return _encode(address, rows, cols, box_rows, box_cols)


@functools.lru_cache(maxsize=4096)
def _encode(address: int, rows: int, cols: int, box_rows: int, box_cols: int) -> bytes:
    tensor_map = call(
        cu.cuTensorMapEncodeTiled,
        cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        2,
        address,
        [cu.cuuint64_t(cols), cu.cuuint64_t(rows)],  # innermost first
        [cu.cuuint64_t(cols * _BF16_BYTES)],  # the stride of dimension 1, in bytes
        [cu.cuuint32_t(box_cols), cu.cuuint32_t(box_rows)],
        [cu.cuuint32_t(1), cu.cuuint32_t(1)],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        detail=f"bf16 [{rows}, {cols}] at {address:#x}, box [{box_rows}, {box_cols}]",
    )
    return _OPAQUE.pack(*(int(word) for word in tensor_map.opaque))
