"""``BlockFp8Weight``: an e4m3 weight ``[n, k]`` on the device with its e8m0 block scales.

One scale byte per ``BLOCK x BLOCK`` block, ``[ceil(n / 32), k / 32]`` row-major: element ``(j, kk)``
means ``f32(e4m3 weight[j, kk]) * 2**(scale[j // 32, kk // 32] - 127)`` (DeepSeek's block-scaled
fp8, the Engram ``wkv``). ``k`` is a multiple of 32 and the weight 16-byte aligned (what
``gemm_fp8.dense_gemm_fp8w`` needs). ``from_numpy`` refuses the NaN bytes the kernels cannot
check: e8m0 255 in the scales, e4m3 0x7f / 0xff in the weight. The owner frees it with ``close()``
(or a ``with`` block), as a ``DenseWeight``.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from gpu_runtime import DeviceBuffer, DevicePtr, GpuBackend, validate
from gpu_runtime.backend import check_backend

from .dense_weight import FP8, DeviceOwned, WeightShape

BLOCK = 32  # rows and columns of w per scale byte (gemm.cu: kFp8Block)
ALIGN = 16  # the kernels copy 16-byte pieces of w
MAX_DIM = (1 << 31) - 1  # the kernels index with 32-bit sizes
U8 = np.dtype(np.uint8)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E8M0_NAN = 255  # the one e8m0 byte that is not a power of two


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """The scale bytes of an ``[rows, cols]`` weight: ``[ceil(rows / 32), cols / 32]``."""
    return -(-rows // BLOCK), cols // BLOCK


def _dims(shape: Any, what: str, empty: bool = False) -> tuple[int, int]:
    """``shape`` as two ints below 2**31 (>= 1, or >= 0 where ``empty``), the second a multiple
    of ``BLOCK``."""
    try:
        rows, cols = shape
    except (TypeError, ValueError):
        raise ValueError(f"{what}: shape must be (rows, cols), got {shape!r}") from None
    check = validate.count if empty else validate.positive
    rows = check(rows, f"{what}: rows", limit=MAX_DIM + 1)
    cols = check(cols, f"{what}: cols", limit=MAX_DIM + 1)
    if cols % BLOCK:
        raise ValueError(f"{what}: cols (k) = {cols} is not a multiple of {BLOCK}")
    return rows, cols


def checked_block_arrays(weight: Any, scale: Any) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of a non-empty 2-D e4m3 (or uint8) ``weight`` ``[n, k]`` (k a multiple of 32) and
    of its e8m0 (or uint8) ``scale`` ``[ceil(n / 32), k / 32]``, both uint8 and C-contiguous;
    ``ValueError`` naming the first scale byte 255 (e8m0 NaN), then the first weight byte 0x7f or
    0xff (e4m3 NaN)."""
    weight, scale = np.asarray(weight), np.asarray(scale)
    if weight.dtype not in (FP8, U8):
        raise TypeError(f"BlockFp8Weight: weight dtype must be float8_e4m3fn or uint8, got {weight.dtype}")
    if scale.dtype not in (E8M0, U8):
        raise TypeError(f"BlockFp8Weight: scale dtype must be float8_e8m0fnu or uint8, got {scale.dtype}")
    if weight.ndim != 2 or 0 in weight.shape:
        raise ValueError(f"BlockFp8Weight: weight must be a non-empty 2-D array, got shape {weight.shape}")
    n, k = _dims(weight.shape, "BlockFp8Weight: weight")
    if scale.shape != scale_shape(n, k):
        raise ValueError(f"BlockFp8Weight: scale shape {scale.shape} != {scale_shape(n, k)} for a weight of {(n, k)}")
    scale, weight = np.ascontiguousarray(scale.view(U8)), np.ascontiguousarray(weight.view(U8))
    bad = scale == E8M0_NAN
    if bad.any():
        r, c = (int(i) for i in np.unravel_index(np.argmax(bad), bad.shape))
        raise ValueError(
            f"BlockFp8Weight: scale[{r}, {c}] is {E8M0_NAN} (e8m0 NaN): the block of rows "
            f"{r * BLOCK}.. and columns {c * BLOCK}.."
        )
    bad = (weight & 0x7F) == 0x7F
    if bad.any():
        r, c = (int(i) for i in np.unravel_index(np.argmax(bad), bad.shape))
        raise ValueError(f"BlockFp8Weight: weight[{r}, {c}] is the byte 0x{int(weight[r, c]):02x} (e4m3 NaN)")
    return weight, scale


@dataclass
class BlockFp8Weight(DeviceOwned, WeightShape):
    """``weight`` (e4m3 bytes ``[n, k]``) and ``scale`` (e8m0 bytes ``[ceil(n / 32), k / 32]``):
    device addresses; ``shape`` ``(n, k)``, k a multiple of 32 (``ValueError`` otherwise, and for a
    weight address not 16-byte aligned); ``gpu``: the backend they are on (None where not given,
    and once closed). ``buffers``: the device memory the weight owns (``from_numpy``'s uploads, or
    buffers handed over with ``owning``), freed by ``close``; a weight made over bare addresses owns
    nothing and ``close`` leaves them alone. ``dtype`` is always ``float8_e4m3fn``."""

    weight: DevicePtr
    scale: DevicePtr
    shape: tuple[int, int]
    gpu: GpuBackend | None = field(default=None, repr=False)
    buffers: tuple[DeviceBuffer, ...] = field(default=(), repr=False)
    dtype: np.dtype = field(default=FP8, init=False)

    def __post_init__(self) -> None:
        check_backend(self.gpu, "BlockFp8Weight: gpu", optional=True)
        self.shape = _dims(self.shape, "BlockFp8Weight", empty=True)
        weight = validate.pointer(self.weight, "BlockFp8Weight: weight", nullable=True)
        validate.pointer(self.scale, "BlockFp8Weight: scale", nullable=True)
        if weight % ALIGN:
            raise ValueError(f"BlockFp8Weight: weight address 0x{weight:x} is not {ALIGN}-byte aligned")

    @property
    def scale_shape(self) -> tuple[int, int]:
        """The scale bytes' shape, ``(ceil(rows / 32), cols / 32)``."""
        return scale_shape(*self.shape)

    @property
    def scale_nbytes(self) -> int:
        """The bytes of the scales (``nbytes`` counts the weight's only)."""
        rows, cols = self.scale_shape
        return rows * cols

    @classmethod
    def owning(
        cls, gpu: GpuBackend, weight: DeviceBuffer, scale: DeviceBuffer, shape: tuple[int, int]
    ) -> BlockFp8Weight:
        """A weight over ``weight`` and ``scale``, buffers on ``gpu`` that it owns from now on.
        Raises ``TypeError`` / ``ValueError`` unless ``shape`` is two positive ints (the second a
        multiple of 32) and each is a ``DeviceBuffer`` holding what the shape says."""
        check_backend(gpu, "BlockFp8Weight.owning: gpu")
        rows, cols = _dims(shape, "BlockFp8Weight.owning")
        srows, scols = scale_shape(rows, cols)
        for buf, nbytes, what in ((weight, rows * cols, "weight"), (scale, srows * scols, "scale")):
            if not isinstance(buf, DeviceBuffer):
                raise TypeError(f"BlockFp8Weight.owning: {what} must be a DeviceBuffer, got {type(buf).__name__}")
            if buf.nbytes < nbytes:
                raise ValueError(
                    f"BlockFp8Weight.owning: {what} buffer of {buf.nbytes} bytes, the shape needs {nbytes}"
                )
        return cls(weight.ptr, scale.ptr, (rows, cols), gpu, (weight, scale))

    @classmethod
    def from_numpy(cls, gpu: GpuBackend, weight: Any, scale: Any, stream: int = 0) -> BlockFp8Weight:
        """Upload an e4m3 (or uint8) ``weight`` ``[n, k]`` and its e8m0 (or uint8) ``scale``
        bytes ``[ceil(n / 32), k / 32]``, every check first (``checked_block_arrays``)."""
        check_backend(gpu, "BlockFp8Weight.from_numpy: gpu")
        stream = validate.stream(stream, "BlockFp8Weight.from_numpy: stream")
        weight, scale = checked_block_arrays(weight, scale)
        with ExitStack() as undo:  # nothing is left allocated when the upload fails part-way
            weights = undo.enter_context(DeviceBuffer.upload(gpu, weight, stream))
            scales = undo.enter_context(DeviceBuffer.upload(gpu, scale, stream))
            undo.pop_all()
        return cls.owning(gpu, weights, scales, (weight.shape[0], weight.shape[1]))
