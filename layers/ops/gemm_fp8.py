"""Launcher of ``gemm.cu``'s fp8-weight GEMM: ``c[m,n] = a[m,k] @ W^T`` for an e4m3 weight with
e8m0 32 x 32 block scales (a ``BlockFp8Weight``), ``W = bf16(f32(w) * 2^(scale - 127))``.

Each weight is used as the bf16 value ``dequant_weight(w, scale, 32, bfloat16)`` holds; fp32
accumulation, one rounding to bf16: the bf16 GEMM over that weight, up to the order of the sums.

Paths (``path=`` forces one; None: small):
- ``small``  ``dense_gemm_fp8w_small``: work items of 32 columns of c x up to 32 rows of a, one CTA
  per SM (``sm_count``) looping over them; its shared memory (``SMEM``) and 256 threads. Every row
  is summed the same way whatever m is (batch invariant).
- ``simt``   ``dense_gemm_fp8w_simt``: one output per thread (a check on the other).
The constants mirror gemm.cu's ``kFp8*`` (a CPU test compares them).
"""

from __future__ import annotations

from typing import Any

from gpu_runtime import GpuBackend, KernelHandle, LaunchConfig, PreparedLaunch, validate

from ..block_fp8_weight import BLOCK, MAX_DIM, BlockFp8Weight
from ..kernel_files import load_kernel
from .gemm_plan import SMS, THREADS

MODULE = "gemm"
NAME = "dense_gemm_fp8w"  # the launcher, as its messages name it
KERNEL = "dense_gemm_fp8w_small"
SIMT = "dense_gemm_fp8w_simt"
PATHS = ("small", "simt")
MAX_ROWS = 32  # rows of a per work item (gemm.cu: kFp8MaxRows)
COLS = BLOCK  # columns of c per work item, one 32-row scale block of w (gemm.cu: kSmallCols, kFp8Block)
SMEM = 196608  # the small path's dynamic shared memory (gemm.cu: kFp8Smem)
SIMT_BLOCKS_MAX = 1 << 16  # the simt kernel strides over the rest


def _cdiv(x: int, d: int) -> int:
    return -(-x // d)


def _check(
    gpu: GpuBackend, kernel: KernelHandle, w: BlockFp8Weight, m: int, n: int, k: int, path: str | None
) -> tuple[int, int, int]:
    """Every check but the pointers'; returns (m, n, k) as ints."""
    if not kernel:
        raise ValueError(f"{NAME}: kernel not loaded (KernelHandle(0))")
    if not (
        type(m) is int
        and type(n) is int
        and type(k) is int
        and 0 <= m <= MAX_DIM
        and 0 <= n <= MAX_DIM
        and 0 <= k <= MAX_DIM
    ):
        m, n, k = (validate.count(v, f"{NAME} {what}", limit=MAX_DIM + 1) for v, what in ((m, "m"), (n, "n"), (k, "k")))
    if not isinstance(w, BlockFp8Weight):
        raise TypeError(f"{NAME}: w must be a BlockFp8Weight, got {type(w).__name__}")
    if w.gpu is not gpu:
        w.check_on(gpu, NAME)
    if w.shape != (n, k):  # the weight's own check: k % 32 == 0
        raise ValueError(f"{NAME}: w shape {w.shape}, expected (n, k) = {(n, k)}")
    if path is not None and path not in PATHS:
        raise ValueError(f"{NAME}: unknown path {path!r}; one of {PATHS} or None")
    return m, n, k


def plan_fp8w_gemm(
    gpu: GpuBackend,
    kernel: KernelHandle,
    a: int,
    w: BlockFp8Weight,
    c: int,
    m: int,
    n: int,
    k: int,
    *,
    path: str | None = None,
    overlap: bool = False,
) -> PreparedLaunch | None:
    """``dense_gemm_fp8w``'s launch for these operands, checked, worked out and prepared once
    (``overlap=True``: a programmatic dependent launch); None where m, n or k is 0."""
    m, n, k = _check(gpu, kernel, w, m, n, k, path)
    overlap = validate.boolean(overlap, "overlap")
    return _prepare(gpu, kernel, a, w, c, m, n, k, path, overlap) if m and n and k else None


def _prepare(
    gpu: GpuBackend,
    kernel: KernelHandle,
    a: int,
    w: BlockFp8Weight,
    c: int,
    m: int,
    n: int,
    k: int,
    path: str | None,
    overlap: bool,
) -> PreparedLaunch:
    """The launch on checked sizes: the small kernel (``kernel``) with a CTA per SM at most, or
    the simt kernel with a thread per output."""
    validate.pointers(NAME, "a w.weight w.scale c", a, w.weight, w.scale, c)
    simt = path == "simt"
    bound = gpu.bind(load_kernel(gpu, MODULE, SIMT) if simt else kernel)  # (a closed backend refuses here)
    if simt:
        config = LaunchConfig(min(_cdiv(m * n, THREADS), SIMT_BLOCKS_MAX), THREADS, 0, overlap=overlap)
    else:
        items = _cdiv(n, COLS) * _cdiv(m, MAX_ROWS)
        config = LaunchConfig(min(items, getattr(gpu, "sm_count", SMS)), THREADS, SMEM, overlap=overlap)
    return bound.prepare(config, a, w.weight, w.scale, c, m, n, k)


# Prepared launches by (backend, kernel, path, a, w, scale, c, m, n, k), as gemm.py keeps its own:
# a repeated call skips the plan, the kernel lookup and the packing. Emptied when full.
_LAUNCHES: dict[tuple[Any, ...], PreparedLaunch] = {}
_LAUNCHES_MAX = 1024


def dense_gemm_fp8w(
    gpu: GpuBackend,
    kernel: KernelHandle,
    a: int,
    w: BlockFp8Weight,
    c: int,
    m: int,
    n: int,
    k: int,
    stream: int,
    *,
    path: str | None = None,
) -> None:
    """``c[m,n] = bf16(a[m,k] @ W^T)``: bf16 row-major a, c; w an (n, k) ``BlockFp8Weight``.

    ``kernel`` is ``load_kernel(gpu, "gemm", "dense_gemm_fp8w_small")``; ``path="simt"`` looks up
    the scalar kernel here. Every check runs before any launch; m, n or k == 0 is a no-op.
    """
    m, n, k = _check(gpu, kernel, w, m, n, k, path)
    if not (m and n and k):
        return
    key = (id(gpu), kernel, path, a, w.weight, w.scale, c, m, n, k)
    try:
        prepared = _LAUNCHES.get(key)
    except TypeError:  # an operand that cannot be a key: refused by _prepare
        _prepare(gpu, kernel, a, w, c, m, n, k, path, False).run(stream)
        return
    if prepared is None or prepared.kernel.backend is not gpu:
        prepared = _prepare(gpu, kernel, a, w, c, m, n, k, path, False)
        if len(_LAUNCHES) >= _LAUNCHES_MAX:
            _LAUNCHES.clear()
        _LAUNCHES[key] = prepared
    prepared.run(stream)
