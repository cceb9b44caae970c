"""Launcher of ``kernels/gemm.cu``: the dense bf16 GEMM ``c[m,n] = a[m,k] @ w[n,k]^T``.

fp32 accumulation, one rounding to bf16. The launcher picks the path and its launch shape from
(m, n, k); the kernels re-derive what they need from the same sizes, so every constant below
mirrors a ``constexpr`` in ``gemm.cu`` (a CPU test compares them). A launch whose block or shared
memory does not match its path still computes the right answer (the kernels fall back to a
scalar loop), only slowly: a mismatch here would show in the benchmark, not in correctness.

Paths:
- ``small``  (m <= 64, the n-gram layer's decode/prefill GEMMs): 32 columns of c per CTA, the K
  loop split across its 8 warps, partials reduced in shared memory; bound by reading w once.
- ``tiled``  mma.sync tensor-core tiles 128x256, 128x128 or 64x64 (``pick_tile``).
- ``wgmma``  sm_90a wgmma 128x256 tiles fed by cp.async; chosen for large m on an sm_90a device
  when the TMA path cannot take the operands (k % 8 != 0, or a or w not 16-byte aligned).
- ``tma``    the same tiles, warp-specialised and persistent: a producer warpgroup loads a and w by
  TMA (tensor maps built here, cached by the backend) for two wgmma warpgroups, one CTA per SM;
  results stored from registers. Chosen for large m on an sm_90a backend with ``TensorMaps`` when
  c does not suit a tensor map (16-byte aligned, n % 8 == 0); a forced ``tma`` whose a or w it
  cannot take runs ``wgmma``.
- ``tma_store``  ``tma`` whose consumers stage their results in shared memory for a TMA store and
  go on to the next tile: chosen where c suits a tensor map, else it runs ``tma``.
- ``tma_splitk``  few rows of a (33 to 256, 17 to 256 for k <= 256: ``use_splitk``): swap-AB
  wgmma (w rows on the M side, 64 tokens on N, or 128 for m > 64), tiles of 64 columns of c, k
  split over a 2-CTA cluster and the two consumers of each CTA, the partials summed in fixed order
  through distributed shared memory (one rounding, no workspace). For k <= 256 the cluster does
  not split k: each CTA takes a 64-token tile of its own and sums its consumers' partials itself.
  A forced ``tma_splitk`` whose operands a tensor map cannot describe runs what ``path=None`` would.
- ``simt``   one output per thread (a check on the others, never chosen automatically).

``dense_gemm_bf16_word`` is the same GEMM with the fused n-gram embedding's epilogue,
``c[i, j] = bf16((acc[i, j] + float(word[word_ids[i], j])) * scale)`` (fp32 add, fp32 multiply, one
rounding). Its kernels share every path and launch plan with their plain twins (``word_plan``).
The paths sum a row's products in different orders, so a row's bits may depend on the path m
picks; ``path="small"`` (any m) sums every row the same way whatever m is (batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from gpu_runtime import GpuBackend, KernelHandle, TensorMaps, validate

from ..kernel_files import load_kernel
from ..weight_map import BF16, DenseWeight
from .specs import SPECS

MODULE = "gemm"
KERNEL = "dense_gemm_bf16_pipelined"
KERNELS = {
    "small": "dense_gemm_bf16_small_m",
    "tiled": "dense_gemm_bf16_tiled",
    "wgmma": "dense_gemm_bf16_wgmma",
    "tma": "dense_gemm_bf16_tma",
    "tma_store": "dense_gemm_bf16_tma_store",
    "tma_splitk": "dense_gemm_bf16_tma_splitk",
    "simt": "dense_gemm_bf16_simt",
}
PATHS = ("small", "tiled", "tiled_128x256", "tiled_128x128", "tiled_64x64", "wgmma", "tma",
         "tma_store", "tma_splitk", "simt")

# word-row epilogue twins: dense_gemm_bf16_word picks small / tiled / simt as the contract's kernel
# does (from m, block and dynamic shared memory), so only the wgmma and TMA paths need their own
# entry points (WORD_TWINS: path -> twin).
WORD_KERNEL = "dense_gemm_bf16_word"
WORD_SMALL_KERNEL = "dense_gemm_bf16_word_small_m"  # a forced small path for m > 64
WORD_WGMMA_KERNEL = "dense_gemm_bf16_word_wgmma"
WORD_TMA_KERNEL = "dense_gemm_bf16_word_tma"
WORD_SPLITK_KERNEL = "dense_gemm_bf16_word_tma_splitk"
WORD_TMA_STORE_KERNEL = "dense_gemm_bf16_word_tma_store"
WORD_TWINS = {"wgmma": WORD_WGMMA_KERNEL, "tma": WORD_TMA_KERNEL, "tma_store": WORD_TMA_STORE_KERNEL,
              "tma_splitk": WORD_SPLITK_KERNEL}

THREADS = 256
WARPS = THREADS // 32
_SPECS = SPECS[MODULE]  # every kernel of gemm.cu by name
MAX_DIM = (1 << 31) - 1  # the kernels index k with 32-bit arithmetic

# small path (gemm.cu: kSmall*)
SMALL_MAX_ROWS = 64
SMALL_COLS = 32
SMALL_STAGES = 6      # ring depth for NT <= 4
SMALL_STAGES_NT8 = 4  # ... and for NT = 8
SMALL_W_PIECES = 4
PIECE_BYTES = 32 * 16

# tiled path (gemm.cu: kTile*; the kernel takes the largest config its shared memory holds)
TILE_K = 32
TILE_STAGES = 4
TILE_CONFIGS = ((128, 256), (128, 128), (64, 64))  # largest first
FILL_TILES = 128
PAD_SLACK = 1.1

# wgmma path (gemm.cu: kWg*)
WG_BM, WG_BN, WG_BK, WG_STAGES = 128, 256, 64, 4
WG_SMEM = WG_STAGES * (WG_BM + WG_BN) * WG_BK * 2 + 1024

# TMA path (gemm.cu: kTma*): the wgmma tile, a producer and two consumer warpgroups, a persistent
# grid of one CTA per SM
TMA_THREADS, TMA_CONSUMERS, TMA_STAGES = 384, 2, 4
TMA_SMEM = TMA_STAGES * (WG_BM + WG_BN) * WG_BK * 2 + 1024 + 16 * TMA_STAGES
# ... with the TMA-store epilogue (gemm.cu: kTmaStore*): 3 stages, a 64 x 256 bf16 staging area per
# consumer; c must suit a tensor map too (16-byte aligned, n % 8 == 0), else it runs ``tma``
TMA_STORE_STAGES, TMA_STAGING_BYTES = 3, 64 * WG_BN * 2
TMA_STORE_SMEM = (TMA_STORE_STAGES * (WG_BM + WG_BN) * WG_BK * 2 + TMA_CONSUMERS * TMA_STAGING_BYTES
                  + 1024 + 16 * TMA_STORE_STAGES)
SMS = 132  # H100 / H200 SXM: the persistent grid when the backend does not say

# TMA split-K path (gemm.cu: kSplit*): 64 w rows x 64 tokens a tile for m <= 64, 128 tokens above
# (``split_rows``); k over a cluster of SPLIT_K CTAs and, inside each, over its two consumers (a
# stage: one 64-wide k box of w and of a for each). One shared-memory size holds either tile.
SPLIT_K, SPLIT_BN, SPLIT_BM, SPLIT_WIDE_BM = 2, 64, 64, 128
SPLIT_STAGES, SPLIT_WIDE_STAGES = 4, 3
SPLIT_SHORT_K = 256  # up to this k the cluster does not split k: each CTA takes 64-token tiles of its own
SPLIT_BK = TMA_CONSUMERS * WG_BK
# path=None takes it for 16 < m <= 256 with k <= SPLIT_SHORT_K, and 32 < m <= 256 above
# (bench.gemm --sweep on the H200, n = 4096, us: k = 256, m = 32: 5.47 against small's 5.83,
# m = 128: 5.80 against tiled's 6.62; k = 512, m = 64: 7.42 against 7.67; k = 4096, m = 64: 14.9
# against 21.6, m = 128: 18.3 against tiled's 40.8; below those m the small path's start wins)
SPLIT_AUTO_ROWS, SPLIT_AUTO_SHORT_MIN_ROWS = (33, 256), 17


def _split_smem(bm: int, stages: int) -> int:
    return (1024 + stages * (SPLIT_BN + bm) * SPLIT_BK * 2 + TMA_CONSUMERS * bm * (SPLIT_BN + 4) * 4
            + 16 * stages)


SPLIT_NARROW_SMEM = _split_smem(SPLIT_BM, SPLIT_STAGES)
SPLIT_SMEM = _split_smem(SPLIT_WIDE_BM, SPLIT_WIDE_STAGES)


def split_rows(m: int, k: int) -> int:
    """Tokens (rows of c) per split-K tile: gemm.cu's ``tma_splitk_gemm`` picks the same."""
    return SPLIT_BM if m <= SPLIT_BM or k <= SPLIT_SHORT_K else SPLIT_WIDE_BM


_GRID_MAX = (1 << 31) - 1
_SIMT_BLOCKS_MAX = 1 << 16  # grid-stride beyond this


@dataclass(frozen=True)
class GemmPlan:
    """Which kernel of ``gemm.cu`` runs, and its launch shape."""

    path: str
    kernel: str
    grid: int
    shared_mem: int
    threads: int = THREADS


def _cdiv(x: int, d: int) -> int:
    return -(-x // d)


def small_nt(m: int) -> int:
    """n8 tiles of a rows per small-path work item (gemm.cu ``small_nt``)."""
    rows = min(m, SMALL_MAX_ROWS)
    return 1 if rows <= 8 else 2 if rows <= 16 else 4 if rows <= 32 else 8


def small_smem(m: int) -> int:
    nt = small_nt(m)
    stages = SMALL_STAGES_NT8 if nt >= 8 else SMALL_STAGES
    return WARPS * stages * (SMALL_W_PIECES + nt) * PIECE_BYTES


def tile_smem(bm: int, bn: int) -> int:
    return TILE_STAGES * (bm + bn) * TILE_K * 2


def tile_count(m: int, n: int, bm: int, bn: int) -> int:
    return _cdiv(m, bm) * _cdiv(n, bn)


def padded_area(m: int, n: int, bm: int, bn: int) -> int:
    """Outputs computed with (bm, bn) tiles, padding included: the work a config really does."""
    return _cdiv(m, bm) * bm * _cdiv(n, bn) * bn


def pick_tile(m: int, n: int) -> tuple[int, int]:
    """The tiled config for a shape: among those with >= FILL_TILES tiles (a full wave on 132
    SMs at one CTA each), the largest whose padded work is within PAD_SLACK of the least; with
    none, the smallest config (most CTAs)."""
    fills = [cfg for cfg in TILE_CONFIGS if tile_count(m, n, *cfg) >= FILL_TILES]
    if not fills:
        return TILE_CONFIGS[-1]
    least = min(padded_area(m, n, *cfg) for cfg in fills)
    return next(cfg for cfg in fills if padded_area(m, n, *cfg) <= PAD_SLACK * least)


def use_wgmma(m: int, n: int) -> bool:
    """wgmma's 128x256 tiles for shapes they fill without much more padding than the tiled pick."""
    return (tile_count(m, n, WG_BM, WG_BN) >= FILL_TILES
            and padded_area(m, n, WG_BM, WG_BN) <= PAD_SLACK * padded_area(m, n, *pick_tile(m, n)))


def use_splitk(m: int, k: int) -> bool:
    """The split-K path for the mid-size m, where it measures faster than small and tiled."""
    lo, hi = SPLIT_AUTO_ROWS
    return (SPLIT_AUTO_SHORT_MIN_ROWS if k <= SPLIT_SHORT_K else lo) <= m <= hi


def wgmma_available(gpu: GpuBackend) -> bool:
    """wgmma exists on sm_90a only; the CUDA backend compiles for ``gpu.target``."""
    return getattr(gpu, "target", None) == "sm_90a"


def tma_available(gpu: GpuBackend) -> bool:
    """The TMA path needs wgmma and a backend that builds tensor maps."""
    return wgmma_available(gpu) and isinstance(gpu, TensorMaps)


def tma_operands(a: int, w: int, k: int) -> bool:
    """Tensor maps need 16-byte aligned bases and a row pitch (k bf16) that is a multiple of 16."""
    return k % 8 == 0 and int(a) % 16 == 0 and int(w) % 16 == 0


@lru_cache(maxsize=4096)  # pure in its arguments; a decode loop asks for the same few shapes
def plan(m: int, n: int, k: int, path: str | None = None, *, wgmma: bool = False,
         tma: bool = False, tma_store: bool = False, sms: int = SMS) -> GemmPlan:
    """The launch for ``c[m,n] = a[m,k] @ w[n,k]^T`` (all sizes >= 1).

    ``path=None`` chooses: for m > 64 with enough 128x256 tiles, tma_store (when ``tma`` and
    ``tma_store``: the device has TMA, a and w suit a tensor map, and so does c), tma (c does not)
    or wgmma (when ``wgmma``: no TMA); else tma_splitk where ``use_splitk`` (and ``tma``); else
    small for m <= 64 and the tiled config ``pick_tile`` gives above, both run by the contract's
    kernel. A forced TMA path falls back the same way. ``sms``: the persistent TMA grid.
    """
    if path is None:
        if wgmma and m > SMALL_MAX_ROWS and use_wgmma(m, n):
            return _wgmma_plan(m, n, tma, tma_store, sms)
        if tma and use_splitk(m, k):
            return _splitk_plan(m, n, k)
        if m <= SMALL_MAX_ROWS:
            return GemmPlan("small", KERNEL, _small_grid(m, n), small_smem(m))
        bm, bn = pick_tile(m, n)
        return GemmPlan(f"tiled_{bm}x{bn}", KERNEL, _grid(tile_count(m, n, bm, bn)), tile_smem(bm, bn))
    if path == "small":
        return GemmPlan(path, KERNELS["small"], _small_grid(m, n), small_smem(m))
    if path == "tiled" or path.startswith("tiled_"):
        bm, bn = pick_tile(m, n) if path == "tiled" else _tile_config(path)
        return GemmPlan(f"tiled_{bm}x{bn}", KERNELS["tiled"], _grid(tile_count(m, n, bm, bn)),
                        tile_smem(bm, bn))
    if path in ("wgmma", "tma", "tma_store"):
        return _wgmma_plan(m, n, tma and path != "wgmma", tma_store and path == "tma_store", sms)
    if path == "tma_splitk":
        return _splitk_plan(m, n, k) if tma else plan(m, n, k, None, wgmma=wgmma, sms=sms)
    if path == "simt":
        return GemmPlan(path, KERNELS["simt"], min(_cdiv(m * n, THREADS), _SIMT_BLOCKS_MAX), 0)
    raise ValueError(f"unknown GEMM path {path!r}; one of {PATHS} or None")


def _splitk_plan(m: int, n: int, k: int) -> GemmPlan:
    """Whole clusters: one per tile (k split over it), or for a short k one CTA per tile."""
    tiles = _cdiv(n, SPLIT_BN) * _cdiv(m, split_rows(m, k))
    ctas = _cdiv(tiles, SPLIT_K) * SPLIT_K if k <= SPLIT_SHORT_K else tiles * SPLIT_K
    return GemmPlan("tma_splitk", KERNELS["tma_splitk"], min(ctas, _GRID_MAX - 1), SPLIT_SMEM, TMA_THREADS)


def _wgmma_plan(m: int, n: int, tma: bool, store: bool, sms: int) -> GemmPlan:
    tiles = tile_count(m, n, WG_BM, WG_BN)
    if tma and store:
        return GemmPlan("tma_store", KERNELS["tma_store"], min(tiles, sms), TMA_STORE_SMEM, TMA_THREADS)
    if tma:
        return GemmPlan("tma", KERNELS["tma"], min(tiles, sms), TMA_SMEM, TMA_THREADS)
    return GemmPlan("wgmma", KERNELS["wgmma"], _grid(tiles), WG_SMEM)


def _tile_config(path: str) -> tuple[int, int]:
    for bm, bn in TILE_CONFIGS:
        if path == f"tiled_{bm}x{bn}":
            return bm, bn
    raise ValueError(f"unknown GEMM path {path!r}; one of {PATHS} or None")


@lru_cache(maxsize=4096)
def word_plan(m: int, n: int, k: int, path: str | None = None, *, wgmma: bool = False,
              tma: bool = False, tma_store: bool = False, sms: int = SMS) -> GemmPlan:
    """``plan`` for the word-epilogue kernels: same path, grid and shared memory, run by
    ``dense_gemm_bf16_word`` (small for m <= 64, tiled above, simt when launched with no shared
    memory) or, for the wgmma and TMA paths and a forced ``small`` with m > 64, their
    ``dense_gemm_bf16_word_*`` twins.

    That kernel chooses small or tiled from m, so a forced ``tiled*`` needs m > 64 and is refused
    for smaller m rather than silently running another path. A forced ``small`` runs every m the
    same way (each row's sum in the same order whatever m is: batch invariance).
    """
    p = plan(m, n, k, path, wgmma=wgmma, tma=tma, tma_store=tma_store, sms=sms)
    if p.path in WORD_TWINS:
        return GemmPlan(p.path, WORD_TWINS[p.path], p.grid, p.shared_mem, p.threads)
    small = m <= SMALL_MAX_ROWS
    if p.path == "small" and not small:
        return GemmPlan(p.path, WORD_SMALL_KERNEL, p.grid, p.shared_mem)
    if p.path.startswith("tiled_") and small:
        raise ValueError(f"{WORD_KERNEL}: path {path!r} cannot be forced for m = {m} (tiled needs "
                         f"m > {SMALL_MAX_ROWS})")
    return GemmPlan(p.path, WORD_KERNEL, p.grid, p.shared_mem)


def _small_grid(m: int, n: int) -> int:
    return _grid(_cdiv(n, SMALL_COLS) * _cdiv(m, SMALL_MAX_ROWS))


def _grid(items: int) -> int:
    return min(items, _GRID_MAX)  # the kernels loop grid-stride over the rest


def _check_gemm(name: str, kernel: KernelHandle, w: DenseWeight, m: int, n: int, k: int,
                path: str | None) -> tuple[int, int, int]:
    """The checks every GEMM launcher runs before launching (its spec checks the pointers);
    returns (m, n, k) as ints."""
    if not kernel:
        raise ValueError(f"{name}: kernel not loaded (KernelHandle(0))")
    m, n, k = (validate.count(v, f"{name} {what}", limit=MAX_DIM + 1)
               for v, what in ((m, "m"), (n, "n"), (k, "k")))
    if not isinstance(w, DenseWeight):
        raise TypeError(f"{name}: w must be a DenseWeight, got {type(w).__name__}")
    if w.dtype != BF16:
        raise TypeError(f"{name}: w dtype {w.dtype}, expected {BF16} (bfloat16)")
    if tuple(w.shape) != (n, k):
        raise ValueError(f"{name}: w shape {tuple(w.shape)}, expected (n, k) = {(n, k)}")
    if path is not None and path not in PATHS:
        raise ValueError(f"unknown GEMM path {path!r}; one of {PATHS} or None")
    return m, n, k


def dense_gemm_bf16_pipelined(gpu: GpuBackend, kernel: KernelHandle, a: int, w: DenseWeight, c: int,
                              m: int, n: int, k: int, stream: int, *,
                              path: str | None = None) -> None:
    """``c[m,n] = bf16(a[m,k] @ w[n,k]^T)``: bf16 row-major a, c; w a (n, k) bf16 ``DenseWeight``.

    ``kernel`` is ``load_kernel(gpu, "gemm", "dense_gemm_bf16_pipelined")``; other paths of the module
    are looked up here (the backend caches them). ``path`` forces one (tests, benchmarks).
    Every check runs before any launch; m, n or k == 0 is a no-op.
    """
    m, n, k = _check_gemm(KERNEL, kernel, w, m, n, k, path)
    if m == 0 or n == 0 or k == 0:
        return
    p = _launch_plan(plan, gpu, a, w, c, m, n, k, path)
    handle = kernel if p.kernel == KERNEL else load_kernel(gpu, MODULE, p.kernel)
    maps = _tensor_maps(gpu, p.path, a, w, c, m, n, k) if p.path in _TMA_BOXES else {}
    _SPECS[p.kernel].launch(gpu, handle, (p.grid, 1, 1), (p.threads, 1, 1), stream, **maps, a=a,
                            w=w.weight, c=c, m=m, n=n, k=k, shared_mem=p.shared_mem)


def dense_gemm_bf16_word(gpu: GpuBackend, kernel: KernelHandle, a: int, w: DenseWeight, c: int,
                         m: int, n: int, k: int, word_ids: int, word: int, scale: float, stream: int,
                         *, path: str | None = None, overlap: bool = False, word_over: int = 0) -> None:
    """``c[i, j] = bf16((sum_k a[i, k] w[j, k] + float(word[word_ids[i], j])) * scale)``: the
    fused n-gram embedding (a the gathered rows [S, T*td], w the T projections concatenated
    [D, T*td], word the bf16 [vocab, n] table, word_ids u32 [m], scale 1/(1+T)), one rounding.

    ``kernel`` is ``load_kernel(gpu, "gemm", "dense_gemm_bf16_word")``; the wgmma twin is looked up here.
    ``path`` forces one as in ``dense_gemm_bf16_pipelined`` (``word_plan`` says which are allowed).
    Every check runs before any launch; m, n or k == 0 is a no-op. word_ids must be < vocab, or
    0xFFFFFFFF for a row written as zeros: the kernel cannot check them. ``overlap=True`` launches
    it as a programmatic dependent of the kernel before it on the stream (the gather that writes
    ``a`` and ``word_ids``): it streams its weights while that kernel runs. ``word_over`` (0: none)
    is ``[m]`` u64 device addresses: where one is not 0, row i adds that n-wide bf16 row (an
    adapter's replacement word row, 4-byte aligned when n is even) instead of ``word[word_ids[i]]``.
    """
    m, n, k = _check_gemm(WORD_KERNEL, kernel, w, m, n, k, path)
    scale = validate.real32(scale, f"{WORD_KERNEL} scale")
    if m == 0 or n == 0 or k == 0:
        return
    p = _launch_plan(word_plan, gpu, a, w, c, m, n, k, path)
    handle = kernel if p.kernel == WORD_KERNEL else load_kernel(gpu, MODULE, p.kernel)
    maps = _tensor_maps(gpu, p.path, a, w, c, m, n, k) if p.path in _TMA_BOXES else {}
    _SPECS[p.kernel].launch(gpu, handle, (p.grid, 1, 1), (p.threads, 1, 1), stream, **maps, a=a,
                            w=w.weight, c=c, m=m, n=n, k=k, word_ids=word_ids, word=word,
                            word_over=word_over, scale=scale, shared_mem=p.shared_mem, overlap=overlap)


def _launch_plan(planner, gpu: GpuBackend, a: int, w: DenseWeight, c: int, m: int, n: int, k: int,
                 path: str | None) -> GemmPlan:
    """``planner``'s plan for this backend and these operands (the TMA paths only where the device
    and the operands allow them: a and w for loads, c too for TMA stores)."""
    wgmma = wgmma_available(gpu)
    tma = tma_available(gpu) and tma_operands(a, w.weight, k)
    return planner(m, n, k, path, wgmma=wgmma, tma=tma, tma_store=tma and tma_operands(c, c, n),
                   sms=getattr(gpu, "sm_count", SMS))


# rows of a and of w per box of the TMA paths' maps (k: WG_BK); tma_store also maps c (64 x 64);
# tma_splitk's 128-token tiles load two a boxes
_TMA_BOXES = {"tma": (WG_BM, WG_BN), "tma_store": (WG_BM, WG_BN), "tma_splitk": (SPLIT_BM, SPLIT_BN)}
_C_BOX = 64


def _tensor_maps(gpu: TensorMaps, path: str, a: int, w: DenseWeight, c: int, m: int, n: int,
                 k: int) -> dict[str, bytes]:
    """a and w (and c for tma_store) as the TMA paths' tensor maps; the backend caches them, so a
    weight's map is encoded once."""
    a_rows, w_rows = _TMA_BOXES[path]
    maps = {"a_map": gpu.tensor_map_2d(int(a), m, k, a_rows, WG_BK),
            "w_map": gpu.tensor_map_2d(int(w.weight), n, k, w_rows, WG_BK)}
    if path == "tma_store":
        maps["c_map"] = gpu.tensor_map_2d(int(c), m, n, _C_BOX, _C_BOX)
    return maps
