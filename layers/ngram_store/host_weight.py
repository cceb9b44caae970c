"""``HostWeight``: an n-gram table in page-locked host memory that the GPU reads in place.

The rows stay in host memory, page-locked and mapped into the device's address space: the gather
kernels read them through ``weight`` over PCIe (zero-copy), exactly as they read a device table.
Only an fp8 table's per-row scales (4 bytes a row) are copied to the device (``row_scale``).

Two ways to build one:

* ``HostWeight.from_numpy(gpu, array, row_scale)``: copies the rows into a mapped pinned buffer
  (``alloc_host(..., mapped=True)``).
* ``HostWeight.from_table_file(gpu, path)``: memory-maps a table file (``table_file``) read-only
  and page-locks the rows' mapping where it is (``register_host``): nothing is copied, but the
  whole row block is read into the page cache and locked there while the weight lives.

It has the fields the gathers read from a ``DenseWeight`` (``weight``, ``shape``, ``dtype``,
``row_scale``) and is used through ``NgramTable.Host(weight)``; it is not a ``DenseWeight`` (a
layer's word embedding and projections must stay on the device). The owner frees it with
``close()`` (or a ``with`` block) once no queued work reads it any more. Why: docs/design_notes.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from gpu_runtime import DeviceBuffer, DevicePtr, GpuBackend, MappedHostMemory, PinnedHostMemory, validate
from gpu_runtime.backend import check_backend

from ..dense_weight import WeightShape, checked_weight_arrays
from .table_file import TableFile

if TYPE_CHECKING:
    from ..backend_caps import MappedBackend, PinnedMappedBackend


@dataclass(eq=False)
class HostWeight(WeightShape):
    """``weight``: the device-visible address of row 0 (mapped host memory); ``row_scale``:
    device memory (fp8 only), owned as ``buffers``. ``host`` is the rows' host view (uint8
    ``[rows, row_bytes]`` for a table file, the pinned buffer otherwise); ``file`` the table
    file it maps, if any; ``gpu`` the backend that pinned or registered ``host``."""

    weight: DevicePtr
    shape: tuple[int, int]
    dtype: np.dtype
    row_scale: DevicePtr = DevicePtr(0)
    gpu: MappedBackend | None = field(default=None, repr=False)  # with PinnedHostMemory unless ``file``
    host: np.ndarray | None = field(default=None, repr=False)
    file: TableFile | None = field(default=None, repr=False)
    buffers: tuple[DeviceBuffer, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        check_backend(self.gpu, "HostWeight: gpu", optional=True)

    @classmethod
    def from_numpy(cls, gpu: GpuBackend, array: Any, row_scale: Any = None, stream: int = 0) -> HostWeight:
        """Copy a 2-D bf16 array (or fp8 with its per-row f32 scales) into a mapped pinned host
        buffer; the scales are uploaded to the device on ``stream``."""
        check_backend(gpu, "HostWeight.from_numpy: gpu")
        stream = validate.stream(stream, "HostWeight.from_numpy: stream")
        array, scale = checked_weight_arrays(array, row_scale)
        _require_mapping(gpu, "HostWeight.from_numpy", PinnedHostMemory)
        gpu = cast("PinnedMappedBackend", gpu)  # the capabilities checked just above
        rows, cols = int(array.shape[0]), int(array.shape[1])
        buf = gpu.alloc_host(array.nbytes, mapped=True)
        try:
            buf.view(array.dtype).reshape(rows, cols)[:] = array  # copied now: the GPU reads it later
            ptr = gpu.host_device_ptr(buf)
            scales = _upload_scales(gpu, scale, stream)
        except BaseException:
            gpu.free_host(buf)
            raise
        return cls(ptr, (rows, cols), np.dtype(array.dtype), _address(scales), gpu, buf, buffers=scales)

    @classmethod
    def from_table_file(cls, gpu: GpuBackend, path: str | os.PathLike, stream: int = 0) -> HostWeight:
        """Map a table file read-only and register its rows (page-aligned, from byte 4096) with
        the device where they are; an fp8 table's scales are uploaded to the device on
        ``stream``. The file stays mapped (and its rows locked in RAM) until ``close()``."""
        check_backend(gpu, "HostWeight.from_table_file: gpu")
        stream = validate.stream(stream, "HostWeight.from_table_file: stream")
        _require_mapping(gpu, "HostWeight.from_table_file")
        gpu = cast("MappedBackend", gpu)  # checked just above
        file = TableFile(path)  # validates the header and the size
        rows, registered = file.rows_bytes, False
        try:
            ptr = gpu.register_host(rows, read_only=True)
            registered = True
            scales = _upload_scales(gpu, file.scales, stream)
        except BaseException:
            if registered:
                gpu.unregister_host(rows)
            del rows  # the last view of the map but the file's own: the map can close
            file.close()
            raise
        return cls(ptr, (file.rows, file.dim), np.dtype(file.dtype), _address(scales), gpu, rows, file, buffers=scales)

    @property
    def closed(self) -> bool:
        """True once ``close()`` released the memory (``gpu`` is then None): a layer given it raises ``ClosedError``."""
        return self.gpu is None

    def close(self) -> None:
        """Free the device scales and the pinned buffer (or unregister the file's rows and unmap
        the file); once, later calls do nothing. ``weight`` and ``row_scale`` become null."""
        gpu, self.gpu = self.gpu, None
        host, self.host = self.host, None
        file, self.file = self.file, None
        buffers, self.buffers = self.buffers, ()
        self.weight = self.row_scale = DevicePtr(0)
        try:
            for buf in reversed(buffers):
                buf.close()
            if gpu is not None and host is not None and not gpu.closed:  # a closed backend freed all
                if file is not None:
                    gpu.unregister_host(host)
                else:
                    assert isinstance(gpu, PinnedHostMemory)  # from_numpy checked it
                    gpu.free_host(host)
        finally:
            host = None  # the last view of the map but the file's own: the map can close
            if file is not None:
                file.close()

    def __enter__(self) -> HostWeight:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _require_mapping(gpu: GpuBackend, what: str, *more: type) -> None:
    """``TypeError`` unless ``gpu`` maps host memory for the device (and has ``more``)."""
    needed = (MappedHostMemory, *more)
    if not all(isinstance(gpu, capability) for capability in needed):
        names = ", ".join(c.__name__ for c in needed)
        raise TypeError(f"{what}: the backend needs {names} (gpu_runtime); {type(gpu).__name__} lacks them")


def _upload_scales(gpu: GpuBackend, scales: np.ndarray | None, stream: int) -> tuple[DeviceBuffer, ...]:
    """An fp8 table's per-row scales on the device (nothing for a bf16 table)."""
    return () if scales is None else (DeviceBuffer.upload(gpu, scales, stream),)


def _address(buffers: tuple[DeviceBuffer, ...]) -> DevicePtr:
    return buffers[0].ptr if buffers else DevicePtr(0)
