"""``RowBlock``: rows of a fixed byte width that kernels read by index, in device memory or in
page-locked host memory mapped into the device's address space (read in place over the link).

A model packs its rows as its kernels read them (Engram: a row's fp8 bytes, then its scale
bytes) and writes them in pieces (``write``), so that no whole table passes through Python
memory. ``address`` is row 0's device-visible address. The owner frees it with ``close()`` once
no queued work reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np

from gpu_runtime import ClosedError, DeviceBuffer, DevicePtr, GpuBackend, MappedHostMemory, PinnedHostMemory, validate
from gpu_runtime.backend import check_backend

if TYPE_CHECKING:
    from ..backend_caps import PinnedMappedBackend

PLACES = ("device", "host")


class RowBlock:
    """``rows`` rows of ``stride`` bytes on ``gpu``, ``where`` in ``PLACES``; uninitialised."""

    def __init__(self, gpu: GpuBackend, rows: int, stride: int, where: str) -> None:
        check_backend(gpu, "RowBlock: gpu")
        self.rows = validate.positive(rows, "RowBlock: rows")
        self.stride = validate.positive(stride, "RowBlock: stride")
        if where not in PLACES:
            raise ValueError(f"RowBlock: where must be one of {PLACES}, got {where!r}")
        self.gpu, self.where = gpu, where
        self.nbytes = self.rows * self.stride
        self.host: np.ndarray | None = None
        self._device: DeviceBuffer | None = None
        if where == "device":
            self._device = DeviceBuffer(gpu, self.nbytes)
            self.address = self._device.ptr
            return
        if not (isinstance(gpu, PinnedHostMemory) and isinstance(gpu, MappedHostMemory)):
            raise TypeError(f"RowBlock: host rows need mapped pinned host memory, which {type(gpu).__name__} lacks")
        pinned = cast("PinnedMappedBackend", gpu)
        self.host = pinned.alloc_host(self.nbytes, mapped=True)
        try:
            self.address = pinned.host_device_ptr(self.host)
        except BaseException:
            pinned.free_host(self.host)
            raise

    def write(self, first: int, rows: np.ndarray, stream: int = 0) -> None:
        """Rows ``first ..`` of the block := ``rows`` (uint8 ``[n, stride]``, C-contiguous). Host
        rows are copied now; device rows are uploaded on ``stream`` and ``rows`` may be reused once
        the stream has run the copy (the caller synchronises)."""
        if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.ndim != 2:
            raise TypeError(f"RowBlock.write: rows must be a 2-D uint8 array, got {getattr(rows, 'dtype', type(rows))}")
        if rows.shape[1] != self.stride or not rows.flags.c_contiguous:
            raise ValueError(f"RowBlock.write: rows must be C-contiguous [n, {self.stride}], got {list(rows.shape)}")
        first = validate.count(first, "RowBlock.write: first")
        if first + rows.shape[0] > self.rows:
            raise ValueError(f"RowBlock.write: rows {first}..{first + rows.shape[0]} past the block's {self.rows}")
        if self.closed:
            raise ClosedError("RowBlock is closed")
        if rows.shape[0] == 0:
            return
        if self.host is not None:
            self.host[first * self.stride : (first + rows.shape[0]) * self.stride] = rows.reshape(-1)
        else:
            self.gpu.copy_h2d_async(rows, DevicePtr(int(self.address) + first * self.stride), stream)

    def host_rows(self, first: int, count: int) -> np.ndarray:
        """Host rows ``first .. first + count`` as a writable uint8 ``[count, stride]`` view (the
        kernels read them in place: write them before the work that reads them is queued)."""
        if self.host is None:
            raise ValueError("RowBlock.host_rows: the rows are in device memory")
        first, count = (
            validate.count(first, "RowBlock.host_rows: first"),
            validate.count(count, "RowBlock.host_rows: count"),
        )
        if first + count > self.rows:
            raise ValueError(f"RowBlock.host_rows: rows {first}..{first + count} past the block's {self.rows}")
        return self.host[first * self.stride : (first + count) * self.stride].reshape(count, self.stride)

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran."""
        return self.address == 0

    def close(self) -> None:
        """Free the rows; once (later calls do nothing)."""
        if self.closed:
            return
        self.address = DevicePtr(0)
        device, self._device = self._device, None
        host, self.host = self.host, None
        if device is not None:
            device.close()
        if host is not None and not self.gpu.closed:  # a closed backend freed all
            cast("PinnedMappedBackend", self.gpu).free_host(host)

    def __enter__(self) -> RowBlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
