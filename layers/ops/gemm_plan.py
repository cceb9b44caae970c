"""The launch plans of ``gemm.py``'s GEMMs: from (m, n, k), which kernel of ``gemm.cu`` runs each
path and with what grid and shared memory (``plan``, ``word_plan``), and the constants behind
them, each mirroring a ``constexpr`` in ``gemm.cu`` (a CPU test compares them).

Pure functions of their arguments: what the device and the operands allow (wgmma, TMA) the
launcher works out (``gemm._launch_plan``) and passes in. ``gemm`` re-exports every name here
(``gemm.plan``, ``gemm.SPLIT_SMEM`` ...), where the tests and benchmarks read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial

KERNEL = "dense_gemm_bf16_pipelined"
KERNELS = {
    "small": "dense_gemm_bf16_small_m",
    "tiled": "dense_gemm_bf16_tiled",
    "wgmma": "dense_gemm_bf16_wgmma",
    "tma": "dense_gemm_bf16_tma",
    "tma_store": "dense_gemm_bf16_tma_store",
    "tma_store_n128": "dense_gemm_bf16_tma_store_n128",
    "tma_store_n192": "dense_gemm_bf16_tma_store_n192",
    "tma_splitk": "dense_gemm_bf16_tma_splitk",
    "simt": "dense_gemm_bf16_simt",
}
PATHS = (
    "gemv",
    "small",
    "tiled",
    "tiled_128x256",
    "tiled_128x128",
    "tiled_64x64",
    "wgmma",
    "tma",
    "tma_store",
    "tma_store_n128",
    "tma_store_n192",
    "tma_splitk",
    "simt",
)

# The word-row epilogue kernels: dense_gemm_bf16_word picks small / tiled / simt as KERNEL
# (dense_gemm_bf16_pipelined) does (from m, block and dynamic shared memory), so only the wgmma and
# TMA paths need kernels of their own (WORD_TWINS: path -> its word-epilogue kernel).
WORD_KERNEL = "dense_gemm_bf16_word"
WORD_SMALL_KERNEL = "dense_gemm_bf16_word_small_m"  # a forced small path for m > 64
WORD_WGMMA_KERNEL = "dense_gemm_bf16_word_wgmma"
WORD_TMA_KERNEL = "dense_gemm_bf16_word_tma"
WORD_SPLITK_KERNEL = "dense_gemm_bf16_word_tma_splitk"
WORD_TMA_STORE_KERNEL = "dense_gemm_bf16_word_tma_store"
WORD_TMA_STORE_N128_KERNEL = "dense_gemm_bf16_word_tma_store_n128"
WORD_TMA_STORE_N192_KERNEL = "dense_gemm_bf16_word_tma_store_n192"
WORD_TWINS = {
    "wgmma": WORD_WGMMA_KERNEL,
    "tma": WORD_TMA_KERNEL,
    "tma_store": WORD_TMA_STORE_KERNEL,
    "tma_store_n128": WORD_TMA_STORE_N128_KERNEL,
    "tma_store_n192": WORD_TMA_STORE_N192_KERNEL,
    "tma_splitk": WORD_SPLITK_KERNEL,
}

THREADS = 256
WARPS = THREADS // 32

# gemv path (gemm.cu: kGemv*): run by KERNEL (and dense_gemm_bf16_word) when launched with
# GEMV_SMEM bytes, for the shapes ``use_gemv`` allows, on a device that gives a block that much
# shared memory (the launcher's ``gemv``: sm_90a) and operands it can stream (k % 8 == 0, a and w
# 16-byte aligned). path=None takes it up to k = GEMV_AUTO_MAX_K, where it beat the small path;
# above, small (the timings: NOTES.md, "Moved from docstrings")
GEMV_MAX_ROWS = 4
GEMV_COLS = 32
GEMV_CHUNK = 256
GEMV_STAGES = 12
GEMV_A_ELEMS = 16384
GEMV_AUTO_MAX_K = 256
GEMV_SMEM = GEMV_STAGES * GEMV_COLS * GEMV_CHUNK * 2 + GEMV_A_ELEMS * 2

# small path (gemm.cu: kSmall*)
SMALL_MAX_ROWS = 64
SMALL_COLS = 32
SMALL_STAGES = 6  # ring depth for NT <= 4
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


def _tma_store_smem(bn: int, stages: int) -> int:
    """A TMA-store kernel's shared memory: its ring, a 64 x bn staging area per consumer, alignment
    slack and two mbarriers a stage (gemm.cu's kTmaStoreSmem, kTmaN128Smem, kTmaN192Smem)."""
    return stages * (WG_BM + bn) * WG_BK * 2 + TMA_CONSUMERS * 64 * bn * 2 + 1024 + 16 * stages


TMA_STORE_SMEM = _tma_store_smem(WG_BN, TMA_STORE_STAGES)
# ... with 128x128 tiles (gemm.cu: kTmaN128*): 5 stages, a 64 x 128 staging area per consumer;
# and 128x192 tiles (kTmaN192*): 4 stages, 64 x 192. path=None picks the width (``tma_store_width``).
TMA_N128, TMA_N128_STAGES = 128, 5
TMA_N192, TMA_N192_STAGES = 192, 4
TMA_N128_SMEM = _tma_store_smem(TMA_N128, TMA_N128_STAGES)
TMA_N192_SMEM = _tma_store_smem(TMA_N192, TMA_N192_STAGES)
# A wave of tiles' time over a wave of 128x256 tiles', by width: what each further wave added in
# bench.gemm --sweep-wide 3072x3072 on an H100 (128x256 ~34.5 us, 128x192 ~25, 128x128 ~17.5);
# a narrower width is taken only where it comes out at least TMA_NARROW_GAIN cheaper (NOTES-gemm.md,
# "128x192 tiles on the GPU")
TMA_TILE_COST = {WG_BN: 1.0, TMA_N192: 0.72, TMA_N128: 0.51}
TMA_NARROW_GAIN = 0.97
# the TMA-store paths by tile width: (path, shared memory)
_TMA_STORE = {
    WG_BN: ("tma_store", TMA_STORE_SMEM),
    TMA_N192: ("tma_store_n192", TMA_N192_SMEM),
    TMA_N128: ("tma_store_n128", TMA_N128_SMEM),
}
_TMA_STORE_WIDTH = {path: bn for bn, (path, _) in _TMA_STORE.items()}
SMS = 132  # H100 / H200 SXM: the persistent grid when the backend does not say

# TMA split-K path (gemm.cu: kSplit*): 64 w rows x 64 tokens a tile for m <= 64, 128 tokens above
# (``split_rows``); k over a cluster of SPLIT_K CTAs and, inside each, over its two consumers (a
# stage: one 64-wide k box of w and of a for each). One shared-memory size holds either tile.
SPLIT_K, SPLIT_BN, SPLIT_BM, SPLIT_WIDE_BM = 2, 64, 64, 128
SPLIT_STAGES, SPLIT_WIDE_STAGES = 4, 3
SPLIT_SHORT_K = 256  # up to this k the cluster does not split k: each CTA takes 64-token tiles of its own
SPLIT_BK = TMA_CONSUMERS * WG_BK
# path=None takes it for 16 < m <= 256 with k <= SPLIT_SHORT_K, and 32 < m <= 256 above, where it
# beat the small and tiled paths; below those m the small path is quicker to start (the timings:
# NOTES.md, "Moved from docstrings")
SPLIT_AUTO_ROWS, SPLIT_AUTO_SHORT_MIN_ROWS = (33, 256), 17
# ... except where its clusters need more than one wave and narrow TMA-store tiles fit in one
# (``narrow_over_splitk``; NOTES-gemm.md, "128x192 tiles on the GPU")


def _split_smem(bm: int, stages: int) -> int:
    return 1024 + stages * (SPLIT_BN + bm) * SPLIT_BK * 2 + TMA_CONSUMERS * bm * (SPLIT_BN + 4) * 4 + 16 * stages


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
    return tile_count(m, n, WG_BM, WG_BN) >= FILL_TILES and padded_area(m, n, WG_BM, WG_BN) <= PAD_SLACK * padded_area(
        m, n, *pick_tile(m, n)
    )


def tma_store_width(m: int, n: int, sms: int) -> int:
    """The tile width (256, 192 or 128 columns) whose waves on ``sms`` SMs, each costing its
    ``TMA_TILE_COST``, finish the persistent TMA-store kernel first, a narrower one only where it
    is ``TMA_NARROW_GAIN`` of the wider's or less. Narrow tiles win where the last wave of wide
    ones would leave SMs idle (1024 rows at n = 3072: 96 tiles of 128x256 on 132 SMs, 128 of
    128x192)."""
    best, cost = WG_BN, float(_cdiv(tile_count(m, n, WG_BM, WG_BN), sms))
    for bn in (TMA_N192, TMA_N128):
        narrow = _cdiv(tile_count(m, n, WG_BM, bn), sms) * TMA_TILE_COST[bn]
        if narrow <= TMA_NARROW_GAIN * cost:
            best, cost = bn, narrow
    return best


def narrow_over_splitk(m: int, n: int, k: int, sms: int) -> bool:
    """Whether ``path=None`` (with TMA stores) takes narrow TMA-store tiles over split-K for rows
    that ``use_splitk`` would give it: past ``SMALL_MAX_ROWS`` rows with k > ``SPLIT_SHORT_K``,
    where split-K's clusters need more CTAs than ``sms`` and ``tma_store_width`` is under 256 (its
    tiles then fit one wave: 256 rows at n = 3072, 128 at n = 8192)."""
    return (
        m > SMALL_MAX_ROWS
        and k > SPLIT_SHORT_K
        and use_splitk(m, k)
        and _splitk_plan(m, n, k).grid > sms
        and tma_store_width(m, n, sms) < WG_BN
    )


def use_gemv(m: int, k: int, forced: bool = False) -> bool:
    """The gemv path's shapes: a few rows of a, staged whole in its shared memory; unless
    ``forced``, only k up to GEMV_AUTO_MAX_K (above it ``path=None`` keeps the small path)."""
    return m <= GEMV_MAX_ROWS and m * k <= GEMV_A_ELEMS and (forced or k <= GEMV_AUTO_MAX_K)


def use_splitk(m: int, k: int) -> bool:
    """Whether ``path=None`` takes the split-K path: the mid-size m of ``SPLIT_AUTO_ROWS`` (from
    ``SPLIT_AUTO_SHORT_MIN_ROWS`` for k <= ``SPLIT_SHORT_K``), where it beats small and tiled."""
    lo, hi = SPLIT_AUTO_ROWS
    return (SPLIT_AUTO_SHORT_MIN_ROWS if k <= SPLIT_SHORT_K else lo) <= m <= hi


@lru_cache(maxsize=4096)  # pure in its arguments; a decode loop asks for the same few shapes
def plan(
    m: int,
    n: int,
    k: int,
    path: str | None = None,
    *,
    wgmma: bool = False,
    tma: bool = False,
    tma_store: bool = False,
    gemv: bool = False,
    sms: int = SMS,
    word: bool = False,
) -> GemmPlan:
    """The launch for ``c[m,n] = a[m,k] @ w[n,k]^T`` (all sizes >= 1).

    ``path=None`` chooses: gemv where ``use_gemv`` holds and ``gemv`` (the device and the operands
    allow it: ``gemm.gemv_available``); for m > 64 with enough 128x256 tiles (``use_wgmma``), tma_store
    (when ``tma`` and ``tma_store``: the device has TMA, a and w suit a tensor map, and so does c;
    tma_store_n128 or tma_store_n192 where ``tma_store_width`` says), tma (c does not) or wgmma
    (when ``wgmma``: no TMA); else tma_splitk where ``use_splitk`` (and ``tma``) unless, with TMA
    stores, ``narrow_over_splitk`` gives the rows to narrow tiles; else, with ``tma``, tma_store
    (or a narrow one) or tma for every m > 64 however few tiles; else small
    for m <= 64 and the tiled config ``pick_tile`` gives above, both run by ``KERNEL``
    (``dense_gemm_bf16_pipelined``) itself. A forced TMA or gemv path falls back the same way.
    ``sms``: the persistent TMA grid. ``word=True`` (``word_plan``): the same launch, run by the word-epilogue kernels
    (``_word_twin``).
    """
    if (path is None or path == "gemv") and gemv and use_gemv(m, k, forced=path == "gemv"):
        p = GemmPlan("gemv", KERNEL, _grid(_cdiv(n, GEMV_COLS)), GEMV_SMEM)
    else:
        p = _path_plan(m, n, k, None if path == "gemv" else path, wgmma, tma, tma_store, sms)
    return _word_twin(p, m, path) if word else p


word_plan = partial(plan, word=True)  # plan() for dense_gemm_bf16_word's kernels


def _path_plan(m: int, n: int, k: int, path: str | None, wgmma: bool, tma: bool, tma_store: bool, sms: int) -> GemmPlan:
    if path is None:
        # With TMA, every m > 64 that split-K passes over runs the persistent wgmma kernel, however
        # few tiles it fills: the tiled path was 2-3x slower at every such m measured (NOTES.md,
        # "Prefill at real scale").
        splitk = tma and use_splitk(m, k) and not (tma_store and narrow_over_splitk(m, n, k, sms))
        if wgmma and m > SMALL_MAX_ROWS and (use_wgmma(m, n) or (tma and not splitk)):
            return _wgmma_plan(m, n, tma, tma_store, sms)
        if splitk:
            return _splitk_plan(m, n, k)
        if m <= SMALL_MAX_ROWS:
            return GemmPlan("small", KERNEL, _small_grid(m, n), small_smem(m))
        bm, bn = pick_tile(m, n)
        return GemmPlan(f"tiled_{bm}x{bn}", KERNEL, _grid(tile_count(m, n, bm, bn)), tile_smem(bm, bn))
    if path == "small":
        return GemmPlan(path, KERNELS["small"], _small_grid(m, n), small_smem(m))
    if path == "tiled" or path.startswith("tiled_"):
        bm, bn = pick_tile(m, n) if path == "tiled" else _tile_config(path)
        return GemmPlan(f"tiled_{bm}x{bn}", KERNELS["tiled"], _grid(tile_count(m, n, bm, bn)), tile_smem(bm, bn))
    if path in ("wgmma", "tma") or path in _TMA_STORE_WIDTH:
        store = tma_store and path in _TMA_STORE_WIDTH
        return _wgmma_plan(m, n, tma and path != "wgmma", store, sms, _TMA_STORE_WIDTH.get(path, WG_BN))
    if path == "tma_splitk":
        return _splitk_plan(m, n, k) if tma else _path_plan(m, n, k, None, wgmma, False, False, sms)
    if path == "simt":
        return GemmPlan(path, KERNELS["simt"], min(_cdiv(m * n, THREADS), _SIMT_BLOCKS_MAX), 0)
    raise ValueError(f"unknown GEMM path {path!r}; one of {PATHS} or None")


def _splitk_plan(m: int, n: int, k: int) -> GemmPlan:
    """Whole clusters: one per tile (k split over it), or for a short k one CTA per tile."""
    tiles = _cdiv(n, SPLIT_BN) * _cdiv(m, split_rows(m, k))
    ctas = _cdiv(tiles, SPLIT_K) * SPLIT_K if k <= SPLIT_SHORT_K else tiles * SPLIT_K
    return GemmPlan("tma_splitk", KERNELS["tma_splitk"], min(ctas, _GRID_MAX - 1), SPLIT_SMEM, TMA_THREADS)


def _wgmma_plan(m: int, n: int, tma: bool, store: bool, sms: int, width: int | None = None) -> GemmPlan:
    """The persistent TMA kernel (with TMA stores where ``store``, then in tiles ``width`` columns
    wide, or ``tma_store_width``'s when it is None: path=None's choice), else cp.async wgmma."""
    tiles = tile_count(m, n, WG_BM, WG_BN)
    if tma and store:
        bn = tma_store_width(m, n, sms) if width is None else width
        path, smem = _TMA_STORE[bn]
        return GemmPlan(path, KERNELS[path], min(tile_count(m, n, WG_BM, bn), sms), smem, TMA_THREADS)
    if tma:
        return GemmPlan("tma", KERNELS["tma"], min(tiles, sms), TMA_SMEM, TMA_THREADS)
    return GemmPlan("wgmma", KERNELS["wgmma"], _grid(tiles), WG_SMEM)


def _tile_config(path: str) -> tuple[int, int]:
    for bm, bn in TILE_CONFIGS:
        if path == f"tiled_{bm}x{bn}":
            return bm, bn
    raise ValueError(f"unknown GEMM path {path!r}; one of {PATHS} or None")


def _word_twin(p: GemmPlan, m: int, path: str | None) -> GemmPlan:
    """``p``, a plain kernel's plan, for the word-epilogue kernels: same path, grid and shared
    memory, run by ``dense_gemm_bf16_word`` (small for m <= 64, tiled above, simt when launched
    with no shared memory) or, for the wgmma and TMA paths and a forced ``small`` with m > 64,
    their own ``dense_gemm_bf16_word_*`` kernels.

    That kernel chooses small or tiled from m, so a forced ``tiled*`` needs m > 64 and raises
    ``ValueError`` for smaller m rather than silently running another path. A forced ``small`` runs every m the
    same way (each row's sum in the same order whatever m is: batch invariance).
    """
    if p.path in WORD_TWINS:
        return GemmPlan(p.path, WORD_TWINS[p.path], p.grid, p.shared_mem, p.threads)
    small = m <= SMALL_MAX_ROWS
    if p.path == "small" and not small:
        return GemmPlan(p.path, WORD_SMALL_KERNEL, p.grid, p.shared_mem)
    if p.path.startswith("tiled_") and small:
        raise ValueError(
            f"{WORD_KERNEL}: path {path!r} cannot be forced for m = {m} (tiled needs m > {SMALL_MAX_ROWS})"
        )
    return GemmPlan(p.path, WORD_KERNEL, p.grid, p.shared_mem)


def _small_grid(m: int, n: int) -> int:
    return _grid(_cdiv(n, SMALL_COLS) * _cdiv(m, SMALL_MAX_ROWS))


def _grid(items: int) -> int:
    return min(items, _GRID_MAX)  # the kernels loop grid-stride over the rest
