"""``CudaBackend``: the ``GpuBackend`` interface and every capability, on cuda.bindings' driver
API, composed from one class per area (context, memory, host memory, streams and events, graphs,
kernels and launches). Each area keeps its own state and releases it on ``close``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import backend
from ..errors import attempt_each
from . import context, graphs, host, kernels, launch, memory, streams, tensor_maps
from .graphs import CudaGraphs
from .host import CudaHostMemory
from .launch import CudaLaunch
from .memory import CudaMemory
from .streams import CudaStreams
from .tensor_maps import CudaTensorMaps

# The modules that call the driver, each through its own ``cu`` (and ``call``, where it checks a
# status): a test that replaces the driver sets both in each (tests/helpers/scripted_driver.py).
DRIVER_MODULES = (context, memory, host, streams, graphs, kernels, launch, tensor_maps)


class CudaBackend(
    CudaLaunch,
    CudaMemory,
    CudaHostMemory,
    CudaStreams,
    CudaGraphs,
    CudaTensorMaps,
    backend.GpuBackend,  # the interface, and every optional capability of it
    backend.PinnedHostMemory,
    backend.MappedHostMemory,
    backend.Events,
    backend.Graphs,
    backend.PitchedCopies,
    backend.DeviceCopies,
    backend.HostFunctions,
    backend.TensorMaps,
):
    """``GpuBackend`` on the CUDA driver API, on one device's primary context.

    Owns what it hands out: allocations, streams, events, graphs, pinned and registered host
    memory, loaded modules and the pinned staging pool are released by ``close()`` (or leaving
    a ``with`` block). Safe to use from several threads, each with its own streams: the context
    is made current on each thread at its first call.
    """

    def __init__(self, device: int = 0, *, target: str | None = None, options: Sequence[str] = ()) -> None:
        super().__init__(device, target=target, options=options)
        self._init_kernels()
        self._init_launches()
        self._init_memory()
        self._init_host_memory()
        self._init_streams()
        self._init_graphs()

    @property
    def pinned_buffers(self) -> int:
        """Page-locked host buffers held: the staging pool's, ``alloc_host``'s and the
        ``register_host`` ranges (for leak tests)."""
        return self._staging.buffers + len(self._host) + len(self._registered)

    def held(self) -> dict[str, int]:
        """What this backend holds for its callers now, for leak checks: device allocations and
        their bytes, graphs, streams, events, and host buffers from ``alloc_host`` and
        ``register_host`` (not the upload staging pool, which is recycled and kept until close)."""
        with self._lock:
            return {
                "allocations": len(self._allocs),
                "bytes": sum(self._allocs.values()),
                "graphs": len(self._graphs),
                "streams": len(self._streams),
                "events": len(self._events),
                "host buffers": len(self._host) + len(self._registered),
            }

    def close(self) -> None:
        """Wait for the device, then free everything this backend handed out; idempotent. Every
        step runs even where one fails (after a kernel fault the wait reports the sticky error,
        and frees may fail too), the primary context is released in any case, and the
        first error is raised at the end."""
        if self._closed:
            return
        self._bind()
        with self._lock:
            self._closed = True
            attempt_each(
                (
                    self._synchronize_context,
                    self._release_memory,
                    self._release_streams,
                    self._release_graphs,
                    self._release_host_memory,
                    self._release_launches,
                    self._release_kernels,
                    self._staging.close,
                    self._release_context,
                )
            )

    def __enter__(self) -> CudaBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CudaBackend", "DRIVER_MODULES"]
