"""``DenseWeight``: a weight matrix resident on the device, with its shape and dtype.

bf16 weights are ``[rows, cols]`` ``ml_dtypes.bfloat16``; fp8 weights are
``ml_dtypes.float8_e4m3fn`` with one f32 scale per row (``row_scale``), without which an fp8
weight raises ``ValueError``. The owner frees it with ``close()`` (or a ``with`` block): a weight owns the
``DeviceBuffer`` s it was built on (``from_numpy``, ``owning``). ``DeviceOwned`` holds that ownership
for every weight on the device (this one and ``block_fp8_weight.BlockFp8Weight``).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Self

import ml_dtypes
import numpy as np

from gpu_runtime import ClosedError, DeviceBuffer, DevicePtr, GpuBackend, validate
from gpu_runtime.backend import check_backend

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
        """``shape[0]``: the weight's rows."""
        return self.shape[0]

    @property
    def cols(self) -> int:
        """``shape[1]``: the elements of one row."""
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        """The bytes of the rows, ``rows * cols * dtype.itemsize`` (fp8 scales not counted)."""
        return self.rows * self.cols * self.dtype.itemsize


class DeviceOwned:
    """The ownership of a weight on the device (``DenseWeight``, ``BlockFp8Weight``): ``gpu``, the
    backend its addresses are on (None where not given, and once closed), and ``buffers``, the
    device memory it owns and ``close`` frees (none for a weight over bare addresses)."""

    gpu: GpuBackend | None
    buffers: tuple[DeviceBuffer, ...]

    @property
    def closed(self) -> bool:
        """True once ``close`` freed the memory it owned (never for a weight that owns none)."""
        return any(buf.closed for buf in self.buffers)

    def check_on(self, gpu: GpuBackend, what: str) -> None:
        """What a launcher checks before it hands the weight's addresses to a kernel on ``gpu``:
        ``ClosedError`` once the weight freed its memory, ``ValueError`` where it lives on another
        backend (a weight over bare addresses names none, and passes)."""
        check_backend(gpu, f"{what}: gpu")
        if self.gpu is gpu or (self.gpu is None and not self.buffers):
            return
        if self.gpu is None:
            raise ClosedError(f"{what}: the weight is closed (its device memory was freed)")
        raise ValueError(f"{what}: the weight is on another backend than the launch")

    def close(self) -> None:
        """Free the device memory the weight owns (once; later calls do nothing); ``gpu``
        becomes None."""
        self.gpu = None
        for buf in reversed(self.buffers):
            buf.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class DenseWeight(DeviceOwned, WeightShape):
    """``weight`` (and, fp8 only, ``row_scale``): device addresses; ``gpu``: the backend they are
    on (None where not given, and once closed). ``buffers``: the device memory the weight owns
    (``from_numpy``'s uploads, or buffers handed over with ``owning``), freed by ``close``; a
    weight made over bare addresses owns nothing and ``close`` leaves them alone."""

    weight: DevicePtr
    shape: tuple[int, int]
    dtype: np.dtype
    row_scale: DevicePtr = DevicePtr(0)
    gpu: GpuBackend | None = field(default=None, repr=False)
    buffers: tuple[DeviceBuffer, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        check_backend(self.gpu, "DenseWeight: gpu", optional=True)

    @classmethod
    def owning(
        cls,
        gpu: GpuBackend,
        weight: DeviceBuffer,
        shape: tuple[int, int],
        dtype: Any,
        row_scale: DeviceBuffer | None = None,
    ) -> DenseWeight:
        """A weight over ``weight`` (and ``row_scale``), buffers on ``gpu`` that it owns from now
        on. Raises ``TypeError`` / ``ValueError`` unless ``shape`` is two positive ints, the dtype bf16
        or fp8 (then with ``row_scale``), and each buffer holds what the shape says."""
        check_backend(gpu, "DenseWeight.owning: gpu")
        try:
            rows, cols = shape
        except (TypeError, ValueError):
            raise ValueError(f"DenseWeight.owning: shape must be (rows, cols), got {shape!r}") from None
        rows = validate.positive(rows, "DenseWeight.owning: rows")
        cols = validate.positive(cols, "DenseWeight.owning: cols")
        dtype = np.dtype(dtype)
        if dtype not in (BF16, FP8):
            raise TypeError(f"DenseWeight.owning: dtype must be bfloat16 or float8_e4m3fn, got {dtype}")
        if (dtype == FP8) != (row_scale is not None):
            raise ValueError("DenseWeight.owning: row_scale is needed for fp8 weights, and only for them")
        need = [(weight, rows * cols * dtype.itemsize, "weight")]
        if row_scale is not None:
            need.append((row_scale, rows * 4, "row_scale"))
        for buf, nbytes, what in need:
            if buf.nbytes < nbytes:
                raise ValueError(f"DenseWeight.owning: {what} buffer of {buf.nbytes} bytes, the shape needs {nbytes}")
        buffers = (weight,) if row_scale is None else (weight, row_scale)
        scale = row_scale.ptr if row_scale is not None else DevicePtr(0)
        return cls(weight.ptr, (rows, cols), dtype, scale, gpu, buffers)

    @classmethod
    def from_numpy(cls, gpu: GpuBackend, array: Any, row_scale: Any = None, stream: int = 0) -> DenseWeight:
        """Upload a 2-D bf16 array, or an fp8 array with its per-row f32 scales."""
        check_backend(gpu, "DenseWeight.from_numpy: gpu")
        stream = validate.stream(stream, "DenseWeight.from_numpy: stream")
        array, scale = checked_weight_arrays(array, row_scale)
        array = np.ascontiguousarray(array)
        with ExitStack() as undo:  # nothing is left allocated when the upload fails part-way
            weight = undo.enter_context(DeviceBuffer.upload(gpu, array, stream))
            scales = None if scale is None else undo.enter_context(DeviceBuffer.upload(gpu, scale, stream))
            undo.pop_all()
        return cls.owning(gpu, weight, array.shape, array.dtype, scales)
