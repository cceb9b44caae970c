"""``DenseWeight``: a weight matrix resident on the device, with its shape and dtype.

bf16 weights are ``[rows, cols]`` ``ml_dtypes.bfloat16``; fp8 weights are
``ml_dtypes.float8_e4m3fn`` with one f32 scale per row (``row_scale``), without which an fp8
weight is refused. The owner frees it with ``close()`` (or a ``with`` block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from gpu_runtime import DevicePtr, GpuBackend

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def checked_weight_arrays(array: Any, row_scale: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """A non-empty 2-D bf16 array, or an fp8 one with one f32 scale per row (contiguous f32,
    None for bf16): what every weight, on the device or in host memory, is built from."""
    array = np.asarray(array)
    if array.ndim != 2 or 0 in array.shape:
        raise ValueError(f"weight must be a non-empty 2-D array, got shape {array.shape}")
    if array.dtype not in (BF16, FP8):
        raise TypeError(f"weight dtype must be bfloat16 or float8_e4m3fn, got {array.dtype}")
    scale = None
    if array.dtype == FP8:
        if row_scale is None:
            raise ValueError("an fp8 weight needs row_scale (one float32 per row)")
        scale = np.ascontiguousarray(row_scale, dtype=np.float32)
        if scale.shape != (array.shape[0],):
            raise ValueError(f"row_scale shape {scale.shape} != ({array.shape[0]},)")
    elif row_scale is not None:
        raise ValueError("row_scale is only for fp8 weights")
    return array, scale


class WeightShape:
    """``rows``, ``cols`` and ``nbytes`` of a 2-D weight from its ``shape`` and ``dtype`` fields:
    the same on the device (``DenseWeight``) and in host memory (``HostWeight``)."""

    shape: tuple[int, int]
    dtype: np.dtype

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.dtype.itemsize


@dataclass
class DenseWeight(WeightShape):
    weight: DevicePtr
    shape: tuple[int, int]
    dtype: np.dtype
    row_scale: DevicePtr = DevicePtr(0)
    gpu: GpuBackend | None = field(default=None, repr=False)

    @classmethod
    def from_numpy(cls, gpu: GpuBackend, array: Any, row_scale: Any = None,
                   stream: int = 0) -> "DenseWeight":
        """Upload a 2-D bf16 array, or an fp8 array with its per-row f32 scales."""
        array, scale = checked_weight_arrays(array, row_scale)
        array = np.ascontiguousarray(array)
        weight = gpu.alloc(array.nbytes)
        scale_ptr = DevicePtr(0)
        try:
            gpu.copy_h2d_async(array, weight, stream)
            if scale is not None:
                scale_ptr = gpu.alloc(scale.nbytes)
                gpu.copy_h2d_async(scale, scale_ptr, stream)
        except BaseException:  # nothing is left allocated when the upload fails part-way
            if scale_ptr:
                gpu.free(scale_ptr)
            gpu.free(weight)
            raise
        return cls(weight, (int(array.shape[0]), int(array.shape[1])), array.dtype, scale_ptr, gpu)

    def close(self) -> None:
        """Free the device memory (once; later calls do nothing)."""
        gpu, self.gpu = self.gpu, None
        if gpu is None or getattr(gpu, "closed", False):
            return
        gpu.free(self.weight)
        if self.row_scale:
            gpu.free(self.row_scale)

    def __enter__(self) -> "DenseWeight":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
