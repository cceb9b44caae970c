"""What the layers need from a GPU: ``GpuBackend`` (the required core) and the optional
capabilities a backend may add (pinned and mapped host memory, events, graphs, pitched and
device-to-device copies, host functions in stream order, TMA tensor maps).

The layers are written against these interfaces only, so a test can record what a launcher
builds without a GPU. A layer asks for a capability with ``isinstance(gpu, Graphs)``: a backend
has one by inheriting it, or by defining all of its methods (as ``collections.abc`` checks).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, TypeVar

import numpy as np

from .host_memory import Host
from .launch import Kernel
from .pointers import DevicePtr, KernelHandle
from .validate import _kind

_T = TypeVar("_T")

KernelSource = str | os.PathLike  # a path to a .cu file


class GpuBackend(ABC):
    """The required core. Streams are raw ``CUstream`` handles as ints, 0 = default."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once ``close()`` ran: every call but ``close`` then raises ``ClosedError``."""

    @abstractmethod
    def kernel(self, source: KernelSource, name: str) -> KernelHandle:
        """Compile ``source`` (a ``.cu`` file) if needed and return kernel ``name``; raises
        ``KernelNotFoundError`` if either is missing. For now a bare module name (no ``/``, no
        ``.cu``) is also taken, resolved against the backend's kernel directory."""

    @abstractmethod
    def bind(self, kernel: KernelHandle) -> Kernel:
        """``kernel`` (a handle ``kernel`` returned) as a ``Kernel`` to launch, made once: its
        signature read from its source and checked against the parameter layout the driver
        reports. Raises ``ValueError`` for a null handle, ``GpuError`` for one this backend did not
        load and ``ClosedError`` once the backend is closed."""

    @abstractmethod
    def alloc(self, nbytes: int) -> DevicePtr:
        """Allocate ``nbytes`` (>= 1) of device memory the backend owns until ``free`` or ``close``;
        returns its address. Raises ``ValueError`` for 0 bytes."""

    @abstractmethod
    def free(self, ptr: int) -> None:
        """Free an address ``alloc`` returned; ``free(0)`` does nothing. Raises ``ValueError`` for an
        address this backend did not allocate, or one freed already."""

    @abstractmethod
    def memset(self, ptr: int, byte: int, nbytes: int, stream: int = 0) -> None:
        """Queue a fill of ``nbytes`` bytes at ``ptr`` with ``byte`` (0..255) on ``stream``; returns
        at once."""

    @abstractmethod
    def copy_h2d_async(self, host: Host, dst: int, stream: int = 0) -> None:
        """Upload ``host``; the caller may reuse ``host`` as soon as this returns."""

    @abstractmethod
    def copy_d2h(self, host_out: Host, src: int, stream: int = 0) -> None:
        """Fill ``host_out`` from ``src`` after the work queued on ``stream``; returns when done."""

    @abstractmethod
    def synchronize(self, stream: int = 0) -> None:
        """Block the host until the work queued on ``stream`` (0: the default stream) has finished."""

    @abstractmethod
    def create_stream(self) -> int:
        """A new stream handle (not synchronising with the default stream), owned by the backend
        until ``close`` (``CudaBackend.destroy_stream`` ends one sooner)."""


class _Capability(ABC):  # noqa: B024  # abstract only through its subclasses (ABC for ABCMeta's __subclasshook__)
    """An optional part of the interface. A class has it if it inherits it or defines every
    one of its methods."""

    @classmethod
    def __subclasshook__(cls, other: type) -> Any:
        methods = cls.__abstractmethods__
        if methods and all(callable(getattr(other, m, None)) for m in methods):
            return True
        return NotImplemented


class PinnedHostMemory(_Capability):
    """Page-locked host buffers, for code that overlaps host I/O with copies (the row cache)."""

    @abstractmethod
    def alloc_host(self, nbytes: int, *, mapped: bool = False) -> np.ndarray:
        """A page-locked uint8 host buffer (the DMA engine reads it directly); ``mapped=True``
        also maps it into the device's address space (``host_device_ptr``: kernels read it in
        place, over PCIe)."""

    @abstractmethod
    def free_host(self, array: np.ndarray) -> None:
        """Free a whole buffer ``alloc_host`` returned (the same array: its address and size);
        raises ``ValueError`` for anything else, or a buffer freed already."""

    @abstractmethod
    def upload_pinned_async(self, host: np.ndarray, dst: int, stream: int = 0) -> None:
        """Copy from (a view of) an ``alloc_host`` buffer with no staging copy. The DMA reads
        ``host`` after this returns: do not touch it before an event recorded after the copy."""


class MappedHostMemory(_Capability):
    """Host memory the device reads in place (zero-copy), for tables bigger than the device."""

    @abstractmethod
    def host_device_ptr(self, array: np.ndarray) -> DevicePtr:
        """The device address of ``array``, which lies inside a mapped ``alloc_host`` buffer or
        a ``register_host`` range."""

    @abstractmethod
    def register_host(self, array: np.ndarray, *, read_only: bool = True) -> DevicePtr:
        """Page-lock a page-aligned, C-contiguous host array where it is (e.g. a read-only
        ``np.memmap`` of a file), map it for the device and return its device address.
        ``read_only``: the device only reads it (required for a read-only mapping)."""

    @abstractmethod
    def unregister_host(self, array: np.ndarray) -> None:
        """Undo ``register_host(array)`` (the same array: its address and size)."""


class Events(_Capability):
    """Events, to order streams against each other and to wait for one point of a stream."""

    @abstractmethod
    def create_event(self) -> int:
        """A new event handle (no timing), owned by the backend until ``destroy_event`` or ``close``."""

    @abstractmethod
    def record_event(self, event: int, stream: int = 0) -> None:
        """Record ``event`` at the current end of ``stream``: it completes when the work queued
        there before it has."""

    @abstractmethod
    def wait_event(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` after this waits for ``event`` (on the GPU; the host goes on)."""

    @abstractmethod
    def event_synchronize(self, event: int) -> None:
        """Block the host until the work before ``event``'s last record has finished."""

    @abstractmethod
    def event_done(self, event: int) -> bool:
        """Whether the work before ``event``'s last record has finished; the host does not wait
        (a watchdog polls it to give up on a stream that never finishes)."""

    @abstractmethod
    def destroy_event(self, event: int) -> None:
        """Destroy an event ``create_event`` returned; raises ``ValueError`` for one this backend did
        not create, or one destroyed already."""


class Graphs(_Capability):
    """CUDA graphs, to replay a captured sequence of launches with one call."""

    @abstractmethod
    def begin_capture(self, stream: int) -> None:
        """Record the work queued on ``stream`` (not the default stream) instead of running it."""

    @abstractmethod
    def end_capture(self, stream: int) -> int:
        """Stop recording; returns an executable graph handle for ``launch_graph``."""

    @abstractmethod
    def abort_capture(self, stream: int) -> None:
        """Stop recording and discard it (after an error during capture)."""

    @abstractmethod
    def launch_graph(self, graph: int, stream: int) -> None:
        """Queue one replay of ``graph`` (an ``end_capture`` handle) on ``stream``; raises
        ``ValueError`` for a handle that is not a live graph of this backend."""

    @abstractmethod
    def destroy_graph(self, graph: int) -> None:
        """Destroy a graph ``end_capture`` returned; raises ``ValueError`` for one that is not a live
        graph of this backend (or destroyed already)."""


class PitchedCopies(_Capability):
    """2-D device-to-device copies between buffers whose rows are laid out with different pitches."""

    @abstractmethod
    def copy_2d_async(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int = 0
    ) -> None:
        """Device to device: ``height`` rows of ``width`` bytes, rows ``*_pitch`` bytes apart."""


class DeviceCopies(_Capability):
    """Device-to-device copies of a byte range in stream order (``LocalGroup``'s all-reduce needs them)."""

    @abstractmethod
    def copy_d2d_async(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        """Device to device (a mapped host buffer's device address counts), ``nbytes`` from
        ``src`` to ``dst``, in stream order."""


class HostFunctions(_Capability):
    """C functions queued in stream order (``cuLaunchHostFunc``; captured, they are graph nodes)."""

    @abstractmethod
    def launch_host_func(self, stream: int, fn: int, data: int) -> None:
        """Queue the C function at address ``fn``, called as ``fn(data)`` on a driver thread once
        the work queued on ``stream`` before it has finished; work queued after it waits until it
        returns. It must not call CUDA, and should not take Python's GIL (a thread that holds
        the GIL while it waits on the driver would deadlock with it)."""


class TensorMaps(_Capability):
    """Tensor maps for the TMA unit (sm_90 and later): a matrix described for box loads."""

    @abstractmethod
    def tensor_map_2d(self, address: int, rows: int, cols: int, box_rows: int, box_cols: int) -> bytes:
        """The bf16 row-major ``[rows, cols]`` matrix at ``address`` as a ``CUtensorMap`` of
        ``[box_rows, box_cols]`` boxes (128-byte swizzle, zeros outside the matrix): the 128
        bytes a ``T`` kernel parameter takes."""


def check_backend(value: _T, what: str, *, optional: bool = False) -> _T:
    """A ``GpuBackend`` (``gpu_runtime.CudaBackend``, or a test's fake backend); with
    ``optional``, None too (``what``: "DeviceBuffer: gpu"). The backends seen pass on one set
    lookup."""
    kind = type(value)
    if kind in _BACKEND_TYPES or (optional and value is None):
        return value
    if isinstance(value, GpuBackend):
        _BACKEND_TYPES.add(kind)
        return value
    raise TypeError(
        f"{what} must be a GpuBackend (gpu_runtime.CudaBackend){' or None' if optional else ''}, got {_kind(value)}"
    )


_BACKEND_TYPES: set[type] = set()  # classes found to be GpuBackends (a handful: CudaBackend, fakes)
