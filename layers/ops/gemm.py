"""Launcher of ``kernels/gemm.cu``: the dense bf16 GEMM ``c[m,n] = a[m,k] @ w[n,k]^T``.

fp32 accumulation, one rounding to bf16. The launcher picks the path and its launch shape from
(m, n, k) (``plan``, in ``gemm_plan``, whose constants, re-exported here, mirror the ``constexpr``s
of ``gemm.cu``: a CPU test compares them). A launch whose block or shared memory does not match
its path still computes the right answer (the kernels fall back to a scalar loop), only slowly.

Paths (``path=`` forces one; how each one works: docs/design_notes.md):
- ``gemv``   m <= 4 and k <= 256 (the seed path's per-table projections at decode; ``use_gemv``)
  on sm_90a with operands it can stream (``gemv_available``): w through a deep cp.async ring,
  requested before a programmatic dependent launch waits; forced, any k with m * k <= 16384; a
  forced one it cannot take runs what ``path=None`` would.
- ``small``  m <= 64 (the n-gram layer's decode/prefill GEMMs): 32 columns of c per CTA.
- ``tiled``  mma.sync tensor-core tiles 128x256, 128x128 or 64x64 (``pick_tile``).
- ``wgmma``  sm_90a wgmma 128x256 tiles: large m on an sm_90a device when the TMA path cannot take
  the operands (k % 8 != 0, or a or w not 16-byte aligned).
- ``tma``    the same tiles, persistent, a and w loaded by TMA: large m on an sm_90a backend with
  ``TensorMaps`` when c does not suit a tensor map; a forced ``tma`` it cannot take runs ``wgmma``.
- ``tma_store``  ``tma`` with a TMA store of c: chosen where c suits a tensor map (16-byte aligned,
  n % 8 == 0), else ``tma``.
- ``tma_store_n128``, ``tma_store_n192``  ``tma_store`` in 128x128 or 128x192 tiles: chosen over it
  where they finish sooner on the device's SMs (``tma_store_width``: the last wave of 128x256
  tiles would leave SMs idle).
- ``tma_splitk``  few rows of a (33 to 256, 17 to 256 for k <= 256: ``use_splitk``; some go to
  narrow TMA-store tiles: ``narrow_over_splitk``): k split over a
  2-CTA cluster (its word-epilogue kernel requests its first weight stages before a programmatic
  dependent launch waits); a forced one whose operands a tensor map cannot describe runs what ``path=None``
  would.
- ``simt``   one output per thread (a check on the others, never chosen automatically).

``plan_gemm`` and ``plan_word_gemm`` work a GEMM's launch out once (checks, path, kernel, tensor
maps, its arguments packed) for runners that repeat it: a ``PreparedLaunch`` to ``run(stream)``.
The two launchers keep the prepared launches of the operands they have seen.

``dense_gemm_bf16_word`` is the same GEMM with the fused n-gram embedding's epilogue,
``c[i, j] = bf16((acc[i, j] + float(word[word_ids[i], j])) * scale)`` (fp32 add, fp32 multiply, one
rounding). Its kernels (``dense_gemm_bf16_word*``) share every path and launch plan with the plain
GEMM's kernels (``word_plan``).
The paths sum a row's products in different orders, so a row's bits may depend on the path m
picks; ``path="small"`` (any m) sums every row the same way whatever m is (batch invariance).
"""

from __future__ import annotations

from typing import Any, cast

from gpu_runtime import GpuBackend, KernelHandle, LaunchConfig, PreparedLaunch, TensorMaps, validate

from ..dense_weight import BF16, DenseWeight, DeviceOwned
from ..kernel_files import load_kernel

# The plans, their kernels and gemm.cu's constants live in gemm_plan; every public name of it
# stays importable from here, where tests and benchmarks read them (gemm.plan, gemm.SPLIT_SMEM ...).
from .gemm_plan import *  # noqa: F403  # the re-export above
from .gemm_plan import (
    KERNEL,
    PATHS,
    SMS,
    SPLIT_BM,
    SPLIT_BN,
    TMA_N128,
    TMA_N192,
    WG_BK,
    WG_BM,
    WG_BN,
    WORD_KERNEL,
    GemmPlan,
    plan,
)

MODULE = "gemm"
MAX_DIM = (1 << 31) - 1  # the kernels index k with 32-bit arithmetic


def wgmma_available(gpu: GpuBackend) -> bool:
    """wgmma exists on sm_90a only; the CUDA backend compiles for ``gpu.target``."""
    return getattr(gpu, "target", None) == "sm_90a"


def tma_available(gpu: GpuBackend) -> bool:
    """The TMA path needs wgmma and a backend that builds tensor maps."""
    return wgmma_available(gpu) and isinstance(gpu, TensorMaps)


def tma_operands(a: int, w: int, k: int) -> bool:
    """Tensor maps need 16-byte aligned bases and a row pitch (k bf16) that is a multiple of 16."""
    return k % 8 == 0 and int(a) % 16 == 0 and int(w) % 16 == 0


def gemv_available(gpu: GpuBackend, a: int, w: int, k: int) -> bool:
    """The gemv path needs its 224 KB of shared memory (sm_90a devices give a block 227 KB) and
    16-byte rows: the conditions of a TMA operand."""
    return wgmma_available(gpu) and tma_operands(a, w, k)


def checked_sizes(name: str, m: int, n: int, k: int) -> tuple[int, int, int]:
    """A GEMM's (m, n, k) as ints in ``0 .. MAX_DIM``, else ``TypeError`` / ``ValueError`` naming
    launcher ``name`` and the size."""
    if (
        type(m) is int
        and type(n) is int
        and type(k) is int
        and 0 <= m <= MAX_DIM
        and 0 <= n <= MAX_DIM
        and 0 <= k <= MAX_DIM
    ):  # the plain case first: the launchers run this on every call
        return m, n, k
    m, n, k = (validate.count(v, f"{name} {what}", limit=MAX_DIM + 1) for v, what in ((m, "m"), (n, "n"), (k, "k")))
    return m, n, k


def checked_operands(
    name: str, gpu: GpuBackend, kernel: KernelHandle, w: object, kind: type[DeviceOwned], m: int, n: int, k: int
) -> tuple[int, int, int]:
    """What every GEMM launcher checks first: ``kernel`` loaded, (m, n, k) as ``checked_sizes``
    takes them, ``w`` a ``kind`` usable on ``gpu``; returns (m, n, k) as ints."""
    if not kernel:
        raise ValueError(f"{name}: kernel not loaded (KernelHandle(0))")
    m, n, k = checked_sizes(name, m, n, k)
    if not isinstance(w, kind):
        raise TypeError(f"{name}: w must be a {kind.__name__}, got {type(w).__name__}")
    if w.gpu is not gpu:  # (the plain case passes on this one test)
        w.check_on(gpu, name)
    return m, n, k


def _check_gemm(
    name: str, gpu: GpuBackend, kernel: KernelHandle, w: DenseWeight, m: int, n: int, k: int, path: str | None
) -> tuple[int, int, int]:
    """The checks of every GEMM's operands but its pointers; returns (m, n, k) as ints."""
    m, n, k = checked_operands(name, gpu, kernel, w, DenseWeight, m, n, k)
    if w.dtype is not BF16 and w.dtype != BF16:
        raise TypeError(f"{name}: w dtype {w.dtype}, expected {BF16} (bfloat16)")
    if w.shape != (n, k) and tuple(w.shape) != (n, k):
        raise ValueError(f"{name}: w shape {tuple(w.shape)}, expected (n, k) = {(n, k)}")
    if path is not None and path not in PATHS:
        raise ValueError(f"unknown GEMM path {path!r}; one of {PATHS} or None")
    return m, n, k


def plan_gemm(
    gpu: GpuBackend,
    kernel: KernelHandle,
    a: int,
    w: DenseWeight,
    c: int,
    m: int,
    n: int,
    k: int,
    *,
    path: str | None = None,
) -> PreparedLaunch | None:
    """``dense_gemm_bf16_pipelined``'s launch for these operands (``c[m,n] = a[m,k] @ w[n,k]^T``),
    checked, worked out and prepared once; None where m, n or k is 0 (nothing to launch)."""
    m, n, k = _check_gemm(KERNEL, gpu, kernel, w, m, n, k, path)
    return _prepare(KERNEL, gpu, kernel, a, w, c, m, n, k, path, False, ()) if m and n and k else None


def plan_word_gemm(
    gpu: GpuBackend,
    kernel: KernelHandle,
    a: int,
    w: DenseWeight,
    c: int,
    m: int,
    n: int,
    k: int,
    word_ids: int,
    word: int,
    scale: float,
    *,
    path: str | None = None,
    overlap: bool = False,
    word_over: int = 0,
) -> PreparedLaunch | None:
    """``dense_gemm_bf16_word``'s launch (its arguments as there), checked, worked out and
    prepared once; None where m, n or k is 0."""
    m, n, k = _check_gemm(WORD_KERNEL, gpu, kernel, w, m, n, k, path)
    epilogue = _epilogue(word_ids, word, word_over, scale)
    overlap = validate.boolean(overlap, "overlap")
    return _prepare(WORD_KERNEL, gpu, kernel, a, w, c, m, n, k, path, overlap, epilogue) if m and n and k else None


def _epilogue(word_ids: int, word: int, word_over: int, scale: float) -> tuple[int, int, int, float]:
    """The word kernels' last four arguments, in their order, checked."""
    if type(scale) is not float or not -validate.F32_MAX <= scale <= validate.F32_MAX:
        scale = validate.real32(scale, f"{WORD_KERNEL} scale")
    validate.pointers(WORD_KERNEL, "word_ids word", word_ids, word)
    return word_ids, word, word_over, scale


def _prepare(
    name: str,
    gpu: GpuBackend,
    kernel: KernelHandle,
    a: int,
    w: DenseWeight,
    c: int,
    m: int,
    n: int,
    k: int,
    path: str | None,
    overlap: bool,
    epilogue: tuple[Any, ...],
) -> PreparedLaunch:
    """The launch of launcher ``name`` (``KERNEL`` or ``WORD_KERNEL``, whose ``epilogue`` ends its
    arguments) on checked sizes, prepared: ``kernel`` where the plan runs it, else the path's
    own kernel of ``gemm.cu``, with the TMA paths' tensor maps."""
    validate.pointers(name, "a w c", a, w.weight, c)
    p = _launch_plan(gpu, a, w, c, m, n, k, path, word=name == WORD_KERNEL)
    handle = kernel if p.kernel == name else load_kernel(gpu, MODULE, p.kernel)
    maps = _tensor_maps(gpu, p.path, a, w, c, m, n, k) if p.path in _TMA_BOXES else ()
    config = LaunchConfig(p.grid, p.threads, p.shared_mem, overlap=overlap)
    return gpu.bind(handle).prepare(config, *maps, a, w.weight, c, m, n, k, *epilogue)


# Prepared launches by (backend, launcher, kernel, path, overlap, a, w, c, m, n, k, epilogue): a
# launcher's call with operands seen before skips the plan, the kernel lookup, the tensor maps
# and the packing (the launch's Python work: NOTES.md, "Moved from docstrings"). Emptied when full
# (an engine whose activations move through many addresses keeps no stale ones).
_LAUNCHES: dict[tuple[Any, ...], PreparedLaunch] = {}
_LAUNCHES_MAX = 1024


def dense_gemm_bf16_pipelined(
    gpu: GpuBackend,
    kernel: KernelHandle,
    a: int,
    w: DenseWeight,
    c: int,
    m: int,
    n: int,
    k: int,
    stream: int,
    *,
    path: str | None = None,
) -> None:
    """``c[m,n] = bf16(a[m,k] @ w[n,k]^T)``: bf16 row-major a, c; w a (n, k) bf16 ``DenseWeight``.

    ``kernel`` is ``load_kernel(gpu, "gemm", "dense_gemm_bf16_pipelined")``; other paths of the module
    are looked up here (the backend caches them). ``path`` forces one (tests, benchmarks).
    Every check runs before any launch; m, n or k == 0 is a no-op.
    """
    m, n, k = _check_gemm(KERNEL, gpu, kernel, w, m, n, k, path)
    if m and n and k:
        _cached(KERNEL, gpu, kernel, a, w, c, m, n, k, path, False, ()).run(stream)


def dense_gemm_bf16_word(
    gpu: GpuBackend,
    kernel: KernelHandle,
    a: int,
    w: DenseWeight,
    c: int,
    m: int,
    n: int,
    k: int,
    word_ids: int,
    word: int,
    scale: float,
    stream: int,
    *,
    path: str | None = None,
    overlap: bool = False,
    word_over: int = 0,
) -> None:
    """``c[i, j] = bf16((sum_k a[i, k] w[j, k] + float(word[word_ids[i], j])) * scale)``: the
    fused n-gram embedding (a the gathered rows [S, T*td], td the table width; w the T projections
    concatenated [D, T*td]; word the bf16 [vocab, n] table; word_ids u32 [m]; scale 1/(1+T)), one
    rounding.

    ``kernel`` is ``load_kernel(gpu, "gemm", "dense_gemm_bf16_word")``; the other word-epilogue
    kernels a path needs (``dense_gemm_bf16_word_*``: wgmma, TMA, a forced small) are looked up here.
    ``path`` forces one as in ``dense_gemm_bf16_pipelined`` (``word_plan`` says which are allowed).
    Every check runs before any launch; m, n or k == 0 is a no-op. word_ids must be < vocab, or
    0xFFFFFFFF for a row written as zeros: the kernel cannot check them. ``overlap=True`` launches
    it as a programmatic dependent of the kernel before it on the stream (the gather that writes
    ``a`` and ``word_ids``): it streams its weights while that kernel runs. ``word_over`` (0: none)
    is ``[m]`` u64 device addresses: where one is not 0, row i adds that n-wide bf16 row (an
    adapter's replacement word row, 4-byte aligned when n is even) instead of ``word[word_ids[i]]``.
    """
    m, n, k = _check_gemm(WORD_KERNEL, gpu, kernel, w, m, n, k, path)
    epilogue = _epilogue(word_ids, word, word_over, scale)
    if m and n and k:
        overlap = validate.boolean(overlap, "overlap")
        _cached(WORD_KERNEL, gpu, kernel, a, w, c, m, n, k, path, overlap, epilogue).run(stream)


def _cached(
    name: str,
    gpu: GpuBackend,
    kernel: KernelHandle,
    a: int,
    w: DenseWeight,
    c: int,
    m: int,
    n: int,
    k: int,
    path: str | None,
    overlap: bool,
    epilogue: tuple[Any, ...],
) -> PreparedLaunch:
    """``_prepare``, kept for the next call with the same operands on the same backend."""
    key = (id(gpu), name, kernel, path, overlap, a, w.weight, c, m, n, k, *epilogue)
    try:
        prepared = _LAUNCHES.get(key)
    except TypeError:  # an operand that cannot be a key: refused by _prepare
        return _prepare(name, gpu, kernel, a, w, c, m, n, k, path, overlap, epilogue)
    if prepared is None or prepared.kernel.backend is not gpu:
        prepared = _prepare(name, gpu, kernel, a, w, c, m, n, k, path, overlap, epilogue)
        if len(_LAUNCHES) >= _LAUNCHES_MAX:
            _LAUNCHES.clear()
        _LAUNCHES[key] = prepared
    return prepared


def _launch_plan(
    gpu: GpuBackend, a: int, w: DenseWeight, c: int, m: int, n: int, k: int, path: str | None, word: bool
) -> GemmPlan:
    """``plan`` for this backend and these operands (the TMA paths only where the device and the
    operands allow them: a and w for loads, c too for TMA stores)."""
    wgmma = wgmma_available(gpu)
    gemv = wgmma and tma_operands(a, w.weight, k)  # gemv_available, without asking twice
    tma = gemv and isinstance(gpu, TensorMaps)  # tma_available and the operands
    tma_store = tma and tma_operands(c, c, n)
    sms = getattr(gpu, "sm_count", SMS)
    return plan(m, n, k, path, wgmma=wgmma, tma=tma, tma_store=tma_store, gemv=gemv, sms=sms, word=word)


# rows of a and of w per box of the TMA paths' maps (k: WG_BK); tma_store(_n128, _n192) also maps c (64 x 64);
# tma_splitk's 128-token tiles load two a boxes
_TMA_BOXES = {
    "tma": (WG_BM, WG_BN),
    "tma_store": (WG_BM, WG_BN),
    "tma_store_n128": (WG_BM, TMA_N128),
    "tma_store_n192": (WG_BM, TMA_N192),
    "tma_splitk": (SPLIT_BM, SPLIT_BN),
}
_C_BOX = 64


def _tensor_maps(
    gpu: GpuBackend, path: str, a: int, w: DenseWeight, c: int, m: int, n: int, k: int
) -> tuple[bytes, ...]:
    """a and w (and c for tma_store) as the TMA paths' tensor maps, in the kernels' order; the
    backend caches them, so a weight's map is encoded once."""
    maker = cast(TensorMaps, gpu)  # a TMA path is planned only where tma_available(gpu) held
    a_rows, w_rows = _TMA_BOXES[path]
    maps = (
        maker.tensor_map_2d(int(a), m, k, a_rows, WG_BK),
        maker.tensor_map_2d(int(w.weight), n, k, w_rows, WG_BK),
    )
    return (*maps, maker.tensor_map_2d(int(c), m, n, _C_BOX, _C_BOX)) if path.startswith("tma_store") else maps
