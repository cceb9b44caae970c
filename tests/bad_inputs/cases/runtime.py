"""The runtime's cases: ``KernelLaunch``'s own checks (CPU), and ``CudaBackend``'s, which run on
an offline backend on CPU and on the device."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from gpu_runtime import ClosedError, CudaBackend, CudaError, GpuError, KernelHandle, KernelLaunch, KernelNotFoundError
from tests.bad_inputs.cases.launchers import after_launcher
from tests.bad_inputs.launcher_rows import scaled_add_kernel
from tests.bad_inputs.matrix import NULL, case, cuda
from tests.bad_inputs.offline import Target
from tests.bad_inputs.world import World
from layers.kernel_files import load_kernel


def _kl(w: World, name: str = "bf16_scaled_add") -> KernelLaunch:
    return KernelLaunch(w.gpu, load_kernel(w.gpu, "residual_add", name))


CPU_CASES = [  # the backend's own checks are in CUDA_CASES
    case("KernelLaunch", "dtype", lambda w: _kl(w).arg_u32(1.0), TypeError, "must be an int"),
    case("KernelLaunch", "shape", lambda w: _kl(w).grid([1, 1]), ValueError, "3 dimensions"),
    case("KernelLaunch", "length", lambda w: _kl(w).block([32, 32, 2]), ValueError, "more than 1024 threads"),
    case("KernelLaunch", "range", lambda w: _kl(w).arg_u32(2**32), ValueError, "does not fit u32"),
    case("KernelLaunch", "range", lambda w: _kl(w).arg_f32(1e39), ValueError, "overflows f32", detail="f32"),
    case("KernelLaunch", "null", lambda w: KernelLaunch(w.gpu, KernelHandle(0)), ValueError, "null kernel handle"),
]

AFTER: dict[str, Callable[[World], None]] = {
    "KernelLaunch": lambda w: after_launcher("scaled_add")(w),
}

CUDA_CASES = [
    cuda("CudaBackend.alloc", "dtype", lambda b, t: b.alloc(1.5), TypeError, "alloc size must be an int"),
    cuda("CudaBackend.alloc", "length", lambda b, t: b.alloc(1 << 50), CudaError, "CUDA_ERROR_OUT_OF_MEMORY",
         gpu_only=True),
    cuda("CudaBackend.alloc", "range", lambda b, t: b.alloc(-1), ValueError, "non-negative int"),
    cuda("CudaBackend.alloc", "range", lambda b, t: b.free(t.ptr), ValueError, "not allocated by this backend",
         detail="free-interior"),
    cuda("CudaBackend.alloc", "null", lambda b, t: b.free(0)),
    cuda("CudaBackend.alloc", "closed", lambda b, t: t.closed.alloc(16), ClosedError, "closed"),
    cuda("CudaBackend.alloc", "closed", lambda b, t: t.closed.free(t.ptr), ClosedError, "closed", detail="free"),
    cuda("CudaBackend.alloc", "empty", lambda b, t: b.alloc(0), ValueError, "alloc of 0 bytes"),
    cuda("CudaBackend.memset", "dtype", lambda b, t: b.memset(t.ptr, 0, "16"), TypeError,
         "memset size must be an int"),
    cuda("CudaBackend.memset", "dtype", lambda b, t: b.memset(t.ptr, 1.5, 16), TypeError,
         "memset byte must be an int", detail="float-byte"),
    cuda("CudaBackend.memset", "length", lambda b, t: b.memset(t.ptr, 0, -1), ValueError, "memset size"),
    cuda("CudaBackend.memset", "range", lambda b, t: b.memset(t.ptr, 256, 16), ValueError, "0..255"),
    cuda("CudaBackend.memset", "null", lambda b, t: b.memset(0, 0, 16), ValueError, NULL),
    cuda("CudaBackend.memset", "closed", lambda b, t: t.closed.memset(t.ptr, 0, 16), ClosedError, "closed"),
    cuda("CudaBackend.memset", "empty", lambda b, t: b.memset(t.ptr, 7, 0)),
    cuda("CudaBackend.copy", "dtype", lambda b, t: b.copy_h2d_async("abcd", t.ptr), TypeError, "bytes-like"),
    cuda("CudaBackend.copy", "dtype", lambda b, t: b.copy_d2h(b"four", t.ptr), ValueError, "read-only",
         detail="d2h"),
    cuda("CudaBackend.copy", "shape", lambda b, t: b.copy_h2d_async(np.arange(32, dtype=np.uint8)[::2], t.ptr),
         ValueError, "C-contiguous"),
    cuda("CudaBackend.copy", "shape", lambda b, t: b.copy_d2h(t.host[::2], t.ptr), ValueError, "C-contiguous",
         detail="d2h"),
    cuda("CudaBackend.copy", "null", lambda b, t: b.copy_h2d_async(b"abcd", 0), ValueError, NULL),
    cuda("CudaBackend.copy", "null", lambda b, t: b.copy_d2h(t.host, 0), ValueError, NULL, detail="d2h"),
    cuda("CudaBackend.copy", "closed", lambda b, t: t.closed.copy_h2d_async(b"abcd", t.ptr), ClosedError, "closed"),
    cuda("CudaBackend.copy", "closed", lambda b, t: t.closed.copy_d2h(t.host, t.ptr), ClosedError, "closed",
         detail="d2h"),
    cuda("CudaBackend.copy", "empty", lambda b, t: b.copy_h2d_async(b"", t.ptr)),
    cuda("CudaBackend.copy", "empty", lambda b, t: b.copy_d2h(t.host[:0], t.ptr), detail="d2h"),
    cuda("CudaBackend.copy_d2d", "dtype", lambda b, t: b.copy_d2d_async(t.ptr, t.ptr.offset(64), 1.5),
         TypeError, "copy size must be an int"),
    cuda("CudaBackend.copy_d2d", "shape", lambda b, t: b.copy_2d_async(t.ptr, 32, t.ptr.offset(1024), 64, 64, 2),
         ValueError, "pitches"),
    cuda("CudaBackend.copy_d2d", "length", lambda b, t: b.copy_d2d_async(t.ptr, t.ptr.offset(64), -1),
         ValueError, "copy size"),
    cuda("CudaBackend.copy_d2d", "length", lambda b, t: b.copy_2d_async(t.ptr, 64, t.ptr.offset(1024), 64, 64, -1),
         ValueError, "copy height", detail="2d"),
    cuda("CudaBackend.copy_d2d", "null", lambda b, t: b.copy_d2d_async(t.ptr, 0, 16), ValueError, NULL),
    cuda("CudaBackend.copy_d2d", "null", lambda b, t: b.copy_2d_async(0, 64, t.ptr, 64, 64, 1), ValueError, NULL,
         detail="2d"),
    cuda("CudaBackend.copy_d2d", "closed", lambda b, t: t.closed.copy_d2d_async(t.ptr, t.ptr.offset(64), 16),
         ClosedError, "closed"),
    cuda("CudaBackend.copy_d2d", "empty", lambda b, t: b.copy_d2d_async(t.ptr, t.ptr.offset(64), 0)),
    cuda("CudaBackend.copy_d2d", "empty", lambda b, t: b.copy_2d_async(t.ptr, 64, t.ptr.offset(1024), 64, 64, 0),
         detail="2d"),
    cuda("CudaBackend.pinned", "dtype", lambda b, t: b.free_host(np.zeros(4096, np.uint8)), ValueError,
         "not a whole buffer"),
    cuda("CudaBackend.pinned", "shape", lambda b, t: b.free_host(t.pinned[16:]), ValueError, "not a whole buffer"),
    cuda("CudaBackend.pinned", "range", lambda b, t: b.upload_pinned_async(np.zeros(16, np.uint8), t.ptr),
         ValueError, "not inside an alloc_host buffer"),
    cuda("CudaBackend.pinned", "range", lambda b, t: b.alloc_host(-1), ValueError, "alloc_host size",
         detail="alloc_host"),
    cuda("CudaBackend.pinned", "null", lambda b, t: b.upload_pinned_async(t.pinned, 0), ValueError, NULL),
    cuda("CudaBackend.pinned", "closed", lambda b, t: t.closed.alloc_host(16), ClosedError, "closed"),
    cuda("CudaBackend.pinned", "empty", lambda b, t: b.alloc_host(0), ValueError, "alloc_host of 0 bytes"),
    cuda("CudaBackend.pinned", "empty", lambda b, t: b.upload_pinned_async(t.pinned[:0], t.ptr), detail="upload"),
    cuda("CudaBackend.handles", "range", lambda b, t: b.destroy_stream(0x1234), ValueError,
         "not created by this backend"),
    cuda("CudaBackend.handles", "range", lambda b, t: b.destroy_event(0x1234), ValueError,
         "not created by this backend", detail="event"),
    cuda("CudaBackend.handles", "range", lambda b, t: b.launch_graph(0x1234, t.stream), ValueError,
         "not a live graph", detail="graph"),
    cuda("CudaBackend.handles", "range", lambda b, t: b.destroy_graph(0x1234), ValueError, "not a live graph",
         detail="destroy-graph"),
    cuda("CudaBackend.handles", "null", lambda b, t: b.begin_capture(0), ValueError, "default stream"),
    cuda("CudaBackend.handles", "closed", lambda b, t: t.closed.create_stream(), ClosedError, "closed"),
    cuda("CudaBackend.handles", "closed", lambda b, t: t.closed.create_event(), ClosedError, "closed",
         detail="event"),
    cuda("CudaBackend.kernel", "range", lambda b, t: b.kernel("no_such_module", "k"), KernelNotFoundError,
         "no kernel module"),
    cuda("CudaBackend.kernel", "range", lambda b, t: load_kernel(b, "residual_add", "no_such_kernel"),
         KernelNotFoundError, "not in module", detail="kernel", gpu_only=True),
    cuda("CudaBackend.kernel", "closed", lambda b, t: scaled_add_kernel(t.closed), ClosedError, "closed"),
    cuda("CudaBackend.tensor_map", "dtype", lambda b, t: b.tensor_map_2d(t.ptr, 64, 72.0, 64, 64), TypeError,
         "tensor map cols must be an int"),
    cuda("CudaBackend.tensor_map", "shape", lambda b, t: b.tensor_map_2d(t.ptr, 64, 70, 64, 64), ValueError,
         "a multiple of 8"),
    cuda("CudaBackend.tensor_map", "range", lambda b, t: b.tensor_map_2d(t.ptr, 64, 72, 257, 64), ValueError,
         "beyond the TMA unit's limits"),
    cuda("CudaBackend.tensor_map", "range", lambda b, t: b.tensor_map_2d(t.ptr.offset(8), 64, 72, 64, 64),
         ValueError, "16-byte aligned", detail="misaligned"),
    cuda("CudaBackend.tensor_map", "null", lambda b, t: b.tensor_map_2d(0, 64, 72, 64, 64), ValueError, NULL),
    cuda("CudaBackend.tensor_map", "closed", lambda b, t: t.closed.tensor_map_2d(t.ptr, 64, 72, 64, 64),
         ClosedError, "closed"),
    cuda("CudaBackend.tensor_map", "empty", lambda b, t: b.tensor_map_2d(t.ptr, 0, 72, 64, 64), ValueError,
         "tensor map rows"),
    cuda("KernelLaunch", "dtype", lambda b, t: KernelLaunch(b, scaled_add_kernel(b)).arg_ptr(t.ptr).arg_ptr(t.ptr)
         .arg_u32(1).arg_u32(8).launch(), TypeError, "argument 2 must be f32", detail="kinds", gpu_only=True),
    cuda("KernelLaunch", "length", lambda b, t: KernelLaunch(b, scaled_add_kernel(b)).arg_ptr(t.ptr).arg_ptr(t.ptr)
         .arg_f32(1.0).arg_u32(8).arg_u32(1).launch(), TypeError, "takes 4 arguments", detail="arguments",
         gpu_only=True),
    cuda("KernelLaunch", "range", lambda b, t: KernelLaunch(b, KernelHandle(0xDEAD)).launch(), GpuError,
         "not loaded by this backend", detail="foreign-kernel"),
    cuda("KernelLaunch", "closed", lambda b, t: KernelLaunch(t.closed, KernelHandle(0xDEAD)).arg_u32(1).launch(),
         ClosedError, "backend is closed"),
    cuda("KernelLaunch", "empty", lambda b, t: KernelLaunch(b, scaled_add_kernel(b)).launch(), TypeError,
         "takes 4 arguments", gpu_only=True),
]


def run_cuda_case(backend: CudaBackend, target: Target, fn, exc, match) -> None:
    """A ``CUDA_CASES`` entry on ``backend``: it raises ``exc`` matching ``match``, or returns."""
    if exc is None:
        fn(backend, target)
    else:
        with pytest.raises(exc, match=match):
            fn(backend, target)
