"""gemm.cu against the numpy reference, every path; the launcher's checks and plans on the CPU.

Tolerance (elementwise, against ``gemm_bf16``: fp32 accumulation, one bf16 rounding). Products of
two bf16 values are exact in fp32, so the kernel's fp32 sum y and numpy's z differ from the exact
sum x only by accumulation order: |y - x|, |z - x| <= k * 2^-23 * S with S = sum |a_i w_i| (the
standard gamma_k bound, with 2^-23 rather than 2^-24 per addition to allow a truncating
tensor-core adder). Rounding each to bf16 adds at most half a bf16 ulp each; y and z are close,
so both halves are within one ulp of |ref| at most twice as large. Hence
    |gpu - ref| <= 2 ulp_bf16(|ref|) + 2 k 2^-23 S.
An indexing bug moves a result by O(|x|), far outside it; the relative Frobenius error against the
fp64 product (< 1e-2) catches a dropped block of k. Small-integer inputs make every fp32 sum
exact in any order, so there the kernel must match the reference bit for bit (which also pins
round-to-nearest-even).
"""

from __future__ import annotations

import re
import weakref
from functools import partial

import numpy as np
import pytest

from gpu_runtime import ClosedError, DeviceBuffer, DevicePtr, KernelHandle, KernelLaunch, LaunchConfig
from layers.kernel_files import kernel_dir, load_kernel
from layers.reference import gemm_bf16, gemm_fp64
from layers.ops import gemm
from layers.ops.gemm import dense_gemm_bf16_pipelined
from layers.dense_weight import BF16, FP8, DenseWeight
from tests.helpers.fakes import RecordingBackend
from tests.helpers import Guarded, bf16_ulp, bits, random_bf16
from tests.helpers.gemm import MAX_SHARED_OPTIN, Sm90aBackend, TmaBackend, assert_refused, fake_tensor_map


def _p(i: int) -> DevicePtr:
    return DevicePtr(0x100000 * (i + 1))


def _weight(n: int, k: int, dtype=BF16, ptr: int = 0x200000) -> DenseWeight:
    return DenseWeight(DevicePtr(ptr), (n, k), np.dtype(dtype))


# -- CPU: launch plans -------------------------------------------------------------------------
def test_small_m_launches_the_given_kernel_with_its_plan():
    gpu = RecordingBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(4096, 256), _p(2), 16, 4096, 256, 7)
    (launch,) = gpu.launches
    assert launch.kernel == kern
    assert launch.grid == (128, 1, 1) and launch.block == (256, 1, 1)
    assert launch.shared_mem == 8 * 6 * (4 + 2) * 512
    assert launch.kinds == "PPPUUU" and launch.stream == 7
    assert launch.args == [int(_p(0)), 0x200000, int(_p(2)), 16, 4096, 256]


@pytest.mark.parametrize("m, nt", [(1, 1), (8, 1), (9, 2), (16, 2), (17, 4), (32, 4), (33, 8), (64, 8)])
def test_small_plan_sizes_by_m(m, nt):
    p = gemm.plan(m, 4096, 4096)
    assert p.kernel == gemm.KERNEL and p.path == "small"
    assert p.shared_mem == 8 * (4 if nt == 8 else 6) * (4 + nt) * 512 <= MAX_SHARED_OPTIN
    assert p.grid == 4096 // 32


@pytest.mark.parametrize("m, k, path", [
    (1, 256, "gemv"), (2, 256, "gemv"), (3, 200, "gemv"), (4, 256, "gemv"),
    (1, 264, "small"), (1, 4096, "small"),  # k above GEMV_AUTO_MAX_K (forced: gemv, below)
    (5, 256, "small"), (1, 252, "small"),  # k % 8 != 0: rows are not 16-byte pieces
])
def test_few_rows_run_gemv_on_sm90a(m, k, path):
    """path=None takes gemv on an sm_90a backend where m, k and the operands suit it: the
    contract's kernel with GEMV_SMEM, a CTA per 32 columns; elsewhere, or misaligned, small."""
    gpu = Sm90aBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    for a in (_p(0), DevicePtr(_p(0) + 2)):
        dense_gemm_bf16_pipelined(gpu, kern, a, _weight(4100, k), _p(2), m, 4100, k, 0)
    aligned, misaligned = gpu.launches
    assert aligned.kernel == misaligned.kernel == kern
    want = gemm.GEMV_SMEM if path == "gemv" else gemm.small_smem(m)
    assert (aligned.grid, aligned.shared_mem) == (((4100 + 31) // 32 if path == "gemv" else 129, 1, 1), want)
    assert misaligned.shared_mem == gemm.small_smem(m)
    other = RecordingBackend()  # not sm_90a: small
    dense_gemm_bf16_pipelined(other, load_kernel(other, "gemm", gemm.KERNEL), _p(0), _weight(4100, k), _p(2),
                              m, 4100, k, 0)
    assert other.launches[0].shared_mem == gemm.small_smem(m)


@pytest.mark.parametrize("m, k, forced", [(1, 4096, "gemv"), (4, 4096, "gemv"), (1, 16384, "gemv"),
                                          (4, 4104, "small"), (2, 8200, "small"), (5, 64, "small")])
def test_forced_gemv_takes_any_k_its_shared_memory_holds(m, k, forced):
    gpu = Sm90aBackend()
    dense_gemm_bf16_pipelined(gpu, load_kernel(gpu, "gemm", gemm.KERNEL), _p(0), _weight(4096, k), _p(2),
                              m, 4096, k, 0, path="gemv")
    (launch,) = gpu.launches
    assert launch.shared_mem == (gemm.GEMV_SMEM if forced == "gemv" else gemm.small_smem(m))


@pytest.mark.parametrize("m, n, expected", [
    (65, 4096, (64, 64)), (128, 4096, (64, 64)), (1000, 4096, (128, 256)), (1000, 2048, (128, 128)),
    (4096, 4096, (128, 256)), (4096, 100, (64, 64)), (100000, 100, (128, 128)),
])
def test_large_m_without_wgmma_runs_tiled_on_the_given_kernel(m, n, expected):
    gpu = RecordingBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(n, 64), _p(2), m, n, 64, 0)
    (launch,) = gpu.launches
    bm, bn = expected
    assert launch.kernel == kern
    assert launch.shared_mem == 4 * (bm + bn) * 32 * 2
    assert launch.grid == (-(-m // bm) * -(-n // bn), 1, 1)


def test_large_m_on_sm90a_runs_wgmma():
    gpu = Sm90aBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(4096, 4096), _p(2), 4096, 4096, 4096, 3)
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == ("gemm", "dense_gemm_bf16_wgmma")
    assert launch.grid == (32 * 16, 1, 1) and launch.shared_mem == gemm.WG_SMEM == 197632
    assert launch.args[3:] == [4096, 4096, 4096] and launch.stream == 3
    # too few 128x256 tiles for wgmma: back to the tiled path of the given kernel
    gpu.launches.clear()
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(4096, 64), _p(2), 128, 4096, 64, 3)
    assert gpu.launches[0].kernel == kern


@pytest.mark.parametrize("m", [257, 384, 1024, 2048])
def test_a_prefill_projection_with_few_tiles_runs_the_persistent_kernel(m):
    """LongCat-Flash-Lite's projection (n = k = 3072) fills fewer than 128 tiles of 128x256 up to
    m = 1280: with TMA it still runs the persistent kernel (the tiled path measured 2-3x slower,
    NOTES.md "Prefill at real scale"), as the word GEMM does; without TMA, cp.async wgmma only
    with a full wave, else the tiled path."""
    with_tma = gemm.plan(m, 3072, 3072, wgmma=True, tma=True, tma_store=True)
    # narrow tiles where 128x256 ones leave SMs idle in their last wave: 257 and 384 rows (36 of
    # 132 SMs busy: 128x128, one wave), 1024 (96 tiles: 128 of 128x192 fill one wave) and 2048
    # (192 tiles: a second wave half full; 256 of 128x192 make two shorter ones)
    bn = 128 if m < 1024 else 192
    assert with_tma.path == f"tma_store_n{bn}"
    assert with_tma.grid == min(-(-m // 128) * (3072 // bn), 132)
    word = gemm.word_plan(m, 3072, 3072, wgmma=True, tma=True, tma_store=True).kernel
    assert word == (gemm.WORD_TMA_STORE_N128_KERNEL if bn == 128 else gemm.WORD_TMA_STORE_N192_KERNEL)
    without = gemm.plan(m, 3072, 3072, wgmma=True).path
    assert without == ("wgmma" if -(-m // 128) * 12 >= gemm.FILL_TILES else "tiled_128x128" if m >= 768 else "tiled_64x64")


@pytest.mark.parametrize("m, n, sms, bn", [
    # waves x TMA_TILE_COST: 256 wide 1.0, 192 0.72, 128 0.51; narrower only at <= 0.97x
    (1536, 3072, 132, 192),   # 144 tiles of 128x256: 2 waves (2.0); 192 of 128x192: 2 (1.44); 288 of 128x128: 3 (1.53)
    (1024, 3072, 132, 192),   # 96 tiles: 1 wave (1.0); 128 of 128x192: 1 (0.72); 192 of 128x128: 2 (1.02)
    (1280, 3072, 132, 256),   # 120 tiles: 1 wave; 160 and 240 narrow ones: 2 waves (1.44, 1.02)
    (257, 3072, 132, 128),    # 36 tiles: 72 of 128x128 still one wave, the cheapest tiles
    (2048, 4096, 132, 256),   # 256 tiles: 2 waves (2.0); 352: 3 (2.16); 512: 4 (2.04)
    (1536, 4096, 132, 192),   # 192 tiles: 2 (2.0); 264 of 128x192 (22 columns, the last part-filled): 2 (1.44)
    (2048, 4096, 114, 128),   # an H100 PCIe's 114 SMs: 3 waves (3.0); 4 (2.88); 5 (2.55)
    (8192, 4096, 132, 256),   # 1024 tiles: 8 waves (8.0); 1408: 11 (7.92), not 0.97x
    (8192, 8192, 132, 192),   # 2048 tiles: 16 waves (16.0); 2752: 21 (15.12)
])
def test_narrow_tiles_where_they_finish_sooner(m, n, sms, bn):
    """path=None takes the tile width whose waves, each at its TMA_TILE_COST, finish first; a
    forced width takes its own tiles."""
    auto = gemm.plan(m, n, 512, wgmma=True, tma=True, tma_store=True, sms=sms)
    assert gemm.tma_store_width(m, n, sms) == bn
    smem = {256: gemm.TMA_STORE_SMEM, 192: gemm.TMA_N192_SMEM, 128: gemm.TMA_N128_SMEM}
    assert (auto.path, auto.shared_mem) == ("tma_store" if bn == 256 else f"tma_store_n{bn}", smem[bn])
    assert auto.grid == min(-(-m // 128) * -(-n // bn), sms)
    for path, width in (("tma_store", 256), ("tma_store_n192", 192), ("tma_store_n128", 128)):
        forced = gemm.plan(m, n, 512, path, wgmma=True, tma=True, tma_store=True, sms=sms)
        assert forced.path == path and forced.kernel == gemm.KERNELS[path] and forced.shared_mem == smem[width]
        assert forced.grid == min(-(-m // 128) * -(-n // width), sms)
        # no TMA store (c does not suit a tensor map): tma, whatever the tiles
        assert gemm.plan(m, n, 512, path, wgmma=True, tma=True, sms=sms).path == "tma"


@pytest.mark.parametrize("m, bn", [(384, 128), (1536, 192)])
def test_narrow_launch_maps_w_in_boxes_of_its_width(m, bn):
    gpu = TmaBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(3072, 512), _p(2), m, 3072, 512, 3)
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == ("gemm", f"dense_gemm_bf16_tma_store_n{bn}")
    assert launch.grid == (min(-(-m // 128) * 3072 // bn, 132), 1, 1) and launch.block == (384, 1, 1)
    smem = gemm.TMA_N128_SMEM if bn == 128 else gemm.TMA_N192_SMEM
    assert launch.shared_mem == smem and launch.kinds == "TTTPPPUUU"
    assert launch.args[:3] == [fake_tensor_map(int(_p(0)), m, 512, 128, 64),
                               fake_tensor_map(0x200000, 3072, 512, bn, 64),
                               fake_tensor_map(int(_p(2)), m, 3072, 64, 64)]
    assert launch.args[3:] == [int(_p(0)), 0x200000, int(_p(2)), m, 3072, 512]


@pytest.mark.parametrize("path", [None, "tma_store"])
def test_large_m_with_tensor_maps_runs_tma_store_persistent(path):
    gpu = TmaBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(4096, 512), _p(2), 4096, 4096, 512, 3, path=path)
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == ("gemm", "dense_gemm_bf16_tma_store")
    assert launch.grid == (132, 1, 1) and launch.block == (384, 1, 1)  # 512 tiles, one CTA per SM
    assert launch.shared_mem == gemm.TMA_STORE_SMEM <= MAX_SHARED_OPTIN
    assert launch.kinds == "TTTPPPUUU" and launch.stream == 3
    assert launch.args[:3] == [fake_tensor_map(int(_p(0)), 4096, 512, 128, 64),
                               fake_tensor_map(0x200000, 4096, 512, 256, 64),
                               fake_tensor_map(int(_p(2)), 4096, 4096, 64, 64)]
    assert launch.args[3:] == [int(_p(0)), 0x200000, int(_p(2)), 4096, 4096, 512]
    gpu.launches.clear()  # fewer tiles than SMs: one CTA each
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(2048, 512), _p(2), 2048, 2048, 512, 3, path=path)
    assert gpu.launches[0].grid == (16 * 8, 1, 1)


@pytest.mark.parametrize("path", [None, "tma_store"])
@pytest.mark.parametrize("c_off, n", [(2, 4096), (0, 4100)])  # c misaligned, or rows of n % 8 != 0
def test_large_m_runs_tma_with_register_stores_where_c_cannot_be_a_tensor_map(c_off, n, path):
    gpu = TmaBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    c = DevicePtr(_p(2) + c_off)
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(n, 512), c, 4096, n, 512, 3, path=path)
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == ("gemm", "dense_gemm_bf16_tma")
    assert launch.grid == (132, 1, 1) and launch.block == (384, 1, 1)
    assert launch.shared_mem == gemm.TMA_SMEM == 197696 <= MAX_SHARED_OPTIN
    assert launch.kinds == "TTPPPUUU"
    assert launch.args[:2] == [fake_tensor_map(int(_p(0)), 4096, 512, 128, 64),
                               fake_tensor_map(0x200000, n, 512, 256, 64)]
    assert launch.args[2:] == [int(_p(0)), 0x200000, int(c), 4096, n, 512]


@pytest.mark.parametrize("m, k, path", [
    (32, 4096, "small"), (33, 4096, "tma_splitk"), (64, 1024, "tma_splitk"), (64, 1016, "tma_splitk"),
    (32, 512, "small"), (33, 512, "tma_splitk"), (16, 256, "small"), (17, 256, "tma_splitk"),
    (200, 8, "tma_splitk"), (128, 4096, "tma_splitk"), (256, 256, "tma_splitk"),
    # 129-256 rows with k > 256: 128x128 tiles in one wave (64 of them) over split-K's 256 CTAs
    (129, 4096, "tma_store_n128"), (256, 1024, "tma_store_n128"),
    # past split-K: the persistent kernel, few tiles or not (few: 128x128 tiles, 96 of them)
    (257, 4096, "tma_store_n128"), (257, 256, "tma_store_n128"),
    (1024, 4096, "tma_store"),  # 128 tiles of 128x256: the persistent kernel in one wave
])
def test_mid_m_runs_splitk_on_sm90a(m, k, path):
    gpu = TmaBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(4096, k), _p(2), m, 4096, k, 0)
    (launch,) = gpu.launches
    assert gemm.plan(m, 4096, k, wgmma=True, tma=True, tma_store=True).path == path
    if path == "tma_splitk":
        assert gpu.kernel_of(launch) == ("gemm", "dense_gemm_bf16_tma_splitk")
        if k <= 256:  # a CTA per 64-token tile
            ctas = 64 * -(-m // 64)
        else:  # a 2-CTA cluster per tile: 64-token tiles for m <= 64, 128-token tiles above
            ctas = 2 * 64 * (1 if m <= 128 else 2)
        assert launch.grid == (ctas, 1, 1) and launch.shared_mem == gemm.SPLIT_SMEM
    # no tensor maps (an sm_90a backend without them, or a misaligned a): never split-K
    for other, a in ((Sm90aBackend(), _p(0)), (TmaBackend(), DevicePtr(_p(0) + 2))):
        dense_gemm_bf16_pipelined(other, load_kernel(other, "gemm", gemm.KERNEL), a, _weight(4096, k),
                                  _p(2), m, 4096, k, 0)
        assert other.kernel_of(other.launches[0])[1] != "dense_gemm_bf16_tma_splitk"


@pytest.mark.parametrize("m, n, k, narrow", [
    (129, 3072, 3072, True),     # split-K: 192 CTAs, past one wave; 48 tiles of 128x128: one
    (256, 4096, 4096, True),     # 256 CTAs; 64 tiles
    (128, 8192, 4096, True),     # 256 CTAs (64-row tiles of w, one 128-token tile); 64 tiles
    (128, 3072, 3072, False),    # 96 CTAs: split-K's one wave kept
    (128, 4096, 4096, False),    # 128 CTAs
    (256, 3072, 256, False),     # short k: split-K's 64-token tiles kept
    (256, 25600, 6144, False),   # Engram's wkv: 400 tiles of 128x128 run 4 waves, 2 of 128x256
    (64, 8192, 4096, False),     # m <= 64: never the persistent kernel's 128-row tiles
    (257, 3072, 3072, False),    # past split-K's rows: tma_store_width alone decides
])
def test_narrow_tiles_take_long_k_rows_from_splitk_where_they_run_faster(m, n, k, narrow):
    assert gemm.narrow_over_splitk(m, n, k, 132) is narrow
    auto = gemm.plan(m, n, k, wgmma=True, tma=True, tma_store=True)
    if gemm.use_splitk(m, k) and not gemm.use_wgmma(m, n):
        assert auto.path == ("tma_store_n128" if narrow else "tma_splitk")
        # without a TMA store of c (c misaligned) split-K keeps its rows: 128x256 tiles lose there
        assert gemm.plan(m, n, k, wgmma=True, tma=True).path == "tma_splitk"


def test_forced_splitk_plan_is_whole_clusters_of_its_tiles():
    gpu = TmaBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(4100, 4096), _p(2), 129, 4100, 4096, 0,
                              path="tma_splitk")
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == ("gemm", "dense_gemm_bf16_tma_splitk")
    assert launch.grid == (65 * 2 * 2, 1, 1) and launch.block == (384, 1, 1)  # 65 x 2 tiles of 128 tokens, 2 CTAs each
    assert launch.shared_mem == gemm.SPLIT_SMEM <= MAX_SHARED_OPTIN and launch.kinds == "TTPPPUUU"
    assert launch.args[:2] == [fake_tensor_map(int(_p(0)), 129, 4096, 64, 64),
                               fake_tensor_map(0x200000, 4100, 4096, 64, 64)]


@pytest.mark.parametrize("m, k, ctas", [
    (129, 264, 65 * 2 * 2),  # k split over the cluster: a cluster per 128-token tile
    (129, 256, 196),         # short k: a CTA per 64-token tile (65 x 3), rounded up to whole clusters
    (64, 8, 66),
])
def test_forced_splitk_plan_short_k_takes_a_cta_per_tile(m, k, ctas):
    p = gemm.plan(m, 4100, k, "tma_splitk", tma=True)
    assert (p.kernel, p.grid, p.shared_mem) == ("dense_gemm_bf16_tma_splitk", ctas, gemm.SPLIT_SMEM)
    assert gemm.split_rows(m, k) == (64 if k <= gemm.SPLIT_SHORT_K or m <= 64 else 128)


def test_a_repeated_launch_reuses_its_prepared_launch_and_new_operands_get_their_own(monkeypatch):
    """The plan, the path's kernel and the tensor maps are worked out once per (backend, kernel,
    path, operands, sizes): a repeated launch is the same launch, and another a, c or m (another
    key) gets maps and a plan of its own."""
    monkeypatch.setattr(gemm, "_LAUNCHES", {})  # none of other tests' (and no clearing when full)
    gpu = TmaBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    planned = []
    through = gemm._launch_plan
    monkeypatch.setattr(gemm, "_launch_plan", lambda *a, **kw: (planned.append(a[4:7]), through(*a, **kw))[1])
    w = _weight(4096, 512)
    calls = [(_p(0), _p(2), 4096), (_p(0), _p(2), 4096), (_p(3), _p(2), 4096), (_p(0), _p(4), 4096),
             (_p(0), _p(2), 64), (_p(0), _p(2), 4096)]
    for a, c, m in calls:
        dense_gemm_bf16_pipelined(gpu, kern, a, w, c, m, 4096, 512, 3)
    assert planned == [(4096, 4096, 512), (4096, 4096, 512), (4096, 4096, 512), (64, 4096, 512)]
    for launch, (a, c, m) in zip(gpu.launches, calls, strict=True):
        if m == 64:
            assert gpu.kernel_of(launch) == ("gemm", "dense_gemm_bf16_tma_splitk")
            assert launch.args[:2] == [fake_tensor_map(int(a), 64, 512, 64, 64),
                                       fake_tensor_map(0x200000, 4096, 512, 64, 64)]
            assert launch.args[2:] == [int(a), 0x200000, int(c), 64, 4096, 512]
        else:
            assert gpu.kernel_of(launch) == ("gemm", "dense_gemm_bf16_tma_store")
            assert launch.args[:3] == [fake_tensor_map(int(a), 4096, 512, 128, 64),
                                       fake_tensor_map(0x200000, 4096, 512, 256, 64),
                                       fake_tensor_map(int(c), 4096, 4096, 64, 64)]
            assert launch.args[3:] == [int(a), 0x200000, int(c), 4096, 4096, 512]
    other = TmaBackend()  # the same operands on another backend: its own recipe
    dense_gemm_bf16_pipelined(other, load_kernel(other, "gemm", gemm.KERNEL), _p(0), w, _p(2), 4096, 4096, 512, 3)
    assert len(planned) == 5 and other.launches[0].args == gpu.launches[0].args


def test_a_prepared_launch_is_not_used_for_another_backend_at_its_address(monkeypatch):
    """A kept launch names the backend its kernel is bound on: one made for another backend (an
    object that may have had this one's id) is worked out again."""
    monkeypatch.setattr(gemm, "_LAUNCHES", {})
    gpu, other = TmaBackend(), TmaBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(4096, 512), _p(2), 64, 4096, 512, 3)
    (key,) = gemm._LAUNCHES
    kept = gemm._LAUNCHES[key]
    elsewhere = other.bind(load_kernel(other, "gemm", kept.kernel.name.split(".")[1]))
    gemm._LAUNCHES[key] = elsewhere.prepare(LaunchConfig(1, 384, gemm.SPLIT_SMEM), *kept.args)
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(4096, 512), _p(2), 64, 4096, 512, 3)
    first, again = gpu.launches
    assert (again.grid, again.args) == (first.grid, first.args) and other.launches == []
    assert gemm._LAUNCHES[key].kernel.backend is gpu


def test_kept_launches_are_bounded(monkeypatch):
    monkeypatch.setattr(gemm, "_LAUNCHES_MAX", 4)
    monkeypatch.setattr(gemm, "_LAUNCHES", {})
    gpu = RecordingBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    for i in range(10):
        dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(4096, 256), _p(10 + i), 16, 4096, 256, 0)
        assert len(gemm._LAUNCHES) <= 4
    assert [launch.args[2] for launch in gpu.launches] == [int(_p(10 + i)) for i in range(10)]


def test_an_operand_that_cannot_be_a_key_is_refused_as_before(monkeypatch):
    monkeypatch.setattr(gemm, "_LAUNCHES", {})
    gpu = RecordingBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    with pytest.raises(TypeError, match="dense_gemm_bf16_pipelined a must be an int, got list"):
        dense_gemm_bf16_pipelined(gpu, kern, [0x100000], _weight(4096, 256), _p(2), 16, 4096, 256, 0)
    assert gpu.launches == [] and gemm._LAUNCHES == {}


@pytest.mark.parametrize("a_off, w_off, k", [(2, 0, 512), (0, 8, 512), (0, 0, 516)])
def test_tma_falls_back_to_wgmma_for_operands_a_tensor_map_cannot_describe(a_off, w_off, k):
    """A tensor map needs 16-byte aligned bases and rows of a multiple of 16 bytes."""
    gpu = TmaBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    for path in (None, "tma"):
        gpu.launches.clear()
        dense_gemm_bf16_pipelined(gpu, kern, DevicePtr(_p(0) + a_off), _weight(4096, k, ptr=0x200000 + w_off),
                                  _p(2), 4096, 4096, k, 0, path=path)
        (launch,) = gpu.launches
        assert gpu.kernel_of(launch) == ("gemm", "dense_gemm_bf16_wgmma"), path
        assert launch.block == (256, 1, 1) and launch.kinds == "PPPUUU"


@pytest.mark.parametrize("path, name, smem", [
    ("small", "dense_gemm_bf16_small_m", 8 * 4 * (4 + 8) * 512),
    ("tiled", "dense_gemm_bf16_tiled", 4 * (64 + 64) * 64),
    ("tiled_128x256", "dense_gemm_bf16_tiled", 4 * (128 + 256) * 64),
    ("tiled_128x128", "dense_gemm_bf16_tiled", 4 * (128 + 128) * 64),
    ("tiled_64x64", "dense_gemm_bf16_tiled", 4 * (64 + 64) * 64),
    ("wgmma", "dense_gemm_bf16_wgmma", 197632),
    ("tma", "dense_gemm_bf16_wgmma", 197632),  # no tensor maps on this backend
    ("tma_store", "dense_gemm_bf16_wgmma", 197632),
    ("tma_store_n128", "dense_gemm_bf16_wgmma", 197632),
    ("tma_store_n192", "dense_gemm_bf16_wgmma", 197632),
    ("tma_splitk", "dense_gemm_bf16_pipelined", 4 * (64 + 64) * 64),  # ... so path=None's plan
    ("simt", "dense_gemm_bf16_simt", 0),
    ("gemv", "dense_gemm_bf16_pipelined", 4 * (64 + 64) * 64),  # not sm_90a: path=None's plan
])
def test_forced_paths_launch_their_kernel(path, name, smem):
    gpu = RecordingBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(300, 72), _p(2), 200, 300, 72, 5, path=path)
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == ("gemm", name)
    assert launch.shared_mem == smem <= MAX_SHARED_OPTIN
    assert launch.block == (256, 1, 1) and launch.kinds == "PPPUUU" and launch.stream == 5


def _cu_constants() -> dict[str, int]:
    """Every ``constexpr uint32_t kName = <integer expression>;`` in gemm.cu, evaluated."""
    text = re.sub(r"//[^\n]*", "", (kernel_dir() / "gemm.cu").read_text())
    values: dict[str, int] = {}
    for name, expr in re.findall(r"^constexpr\s+uint32_t\s+(k\w+)\s*=\s*([^;]+);", text, re.M):
        values[name] = int(eval(expr.replace("/", "//"), {"__builtins__": {}}, dict(values)))
    return values


def test_launcher_constants_mirror_the_kernel():
    cu = _cu_constants()
    assert cu["kThreads"] == gemm.THREADS
    assert (cu["kGemvMaxRows"], cu["kGemvCols"], cu["kGemvChunk"], cu["kGemvStages"], cu["kGemvAElems"],
            cu["kGemvSmem"]) == (gemm.GEMV_MAX_ROWS, gemm.GEMV_COLS, gemm.GEMV_CHUNK, gemm.GEMV_STAGES,
                                 gemm.GEMV_A_ELEMS, gemm.GEMV_SMEM)
    assert gemm.GEMV_SMEM <= MAX_SHARED_OPTIN
    assert (cu["kSmallMaxRows"], cu["kSmallCols"], cu["kSmallStages"], cu["kSmallStagesNT8"],
            cu["kSmallWPieces"], cu["kPieceBytes"]) == (
        gemm.SMALL_MAX_ROWS, gemm.SMALL_COLS, gemm.SMALL_STAGES, gemm.SMALL_STAGES_NT8,
        gemm.SMALL_W_PIECES, gemm.PIECE_BYTES)
    assert (cu["kTileK"], cu["kTileStages"]) == (gemm.TILE_K, gemm.TILE_STAGES)
    assert (cu["kWgBM"], cu["kWgBN"], cu["kWgBK"], cu["kWgStages"], cu["kWgSmem"]) == (
        gemm.WG_BM, gemm.WG_BN, gemm.WG_BK, gemm.WG_STAGES, gemm.WG_SMEM)
    assert (cu["kTmaThreads"], cu["kTmaConsumers"], cu["kTmaLoadStages"], cu["kTmaSmem"]) == (
        gemm.TMA_THREADS, gemm.TMA_CONSUMERS, gemm.TMA_STAGES, gemm.TMA_SMEM)
    assert (cu["kTmaStoreStages"], cu["kTmaStagingBytes"], cu["kTmaStoreSmem"]) == (
        gemm.TMA_STORE_STAGES, gemm.TMA_STAGING_BYTES, gemm.TMA_STORE_SMEM)
    assert gemm.TMA_STORE_SMEM <= MAX_SHARED_OPTIN
    assert (cu["kTmaN128"], cu["kTmaN128Stages"], cu["kTmaN128Smem"]) == (
        gemm.TMA_N128, gemm.TMA_N128_STAGES, gemm.TMA_N128_SMEM)
    assert (cu["kTmaN192"], cu["kTmaN192Stages"], cu["kTmaN192Smem"]) == (
        gemm.TMA_N192, gemm.TMA_N192_STAGES, gemm.TMA_N192_SMEM)
    assert max(gemm.TMA_N128_SMEM, gemm.TMA_N192_SMEM) <= MAX_SHARED_OPTIN
    assert (cu["kSplitK"], cu["kSplitBN"], cu["kSplitBM"], cu["kSplitWideBM"], cu["kSplitStages"],
            cu["kSplitWideStages"], cu["kSplitNarrowSmem"], cu["kSplitSmem"]) == (
        gemm.SPLIT_K, gemm.SPLIT_BN, gemm.SPLIT_BM, gemm.SPLIT_WIDE_BM, gemm.SPLIT_STAGES,
        gemm.SPLIT_WIDE_STAGES, gemm.SPLIT_NARROW_SMEM, gemm.SPLIT_SMEM)
    assert gemm.SPLIT_NARROW_SMEM < gemm.SPLIT_SMEM <= MAX_SHARED_OPTIN
    assert cu["kSplitShortK"] == gemm.SPLIT_SHORT_K
    assert "__cluster_dims__(gemm::kSplitK, 1, 1)" in (kernel_dir() / "gemm.cu").read_text()  # one size
    assert gemm.TMA_THREADS == 128 * (1 + gemm.TMA_CONSUMERS)
    # run_tiled takes the largest config the shared memory holds, largest first, as TILE_CONFIGS
    source = (kernel_dir() / "gemm.cu").read_text()
    tried = [tuple(map(int, t)) for t in re.findall(r"dyn >= tile_smem_bytes<(\d+), (\d+)>", source)]
    assert tried == list(gemm.TILE_CONFIGS)
    called = {tuple(map(int, t)) for t in re.findall(r"tiled_gemm<(\d+), (\d+)>\(", source)}
    assert called == set(gemm.TILE_CONFIGS)
    assert sorted({gemm.tile_smem(*cfg) for cfg in gemm.TILE_CONFIGS}, reverse=True) == [
        gemm.tile_smem(*cfg) for cfg in gemm.TILE_CONFIGS]  # distinct, so smem names the config


# -- CPU: bad input, refused before any launch ---------------------------------------------------
_refused = partial(assert_refused, dense_gemm_bf16_pipelined, gemm.KERNEL)


def test_wrong_weight_shape_names_both():
    _refused(ValueError, r"\(4096, 256\).*\(4096, 255\)", _p(0), _weight(4096, 256), _p(2), 4, 4096, 255, 0)
    _refused(ValueError, r"\(256, 4096\).*\(4096, 256\)", _p(0), _weight(256, 4096), _p(2), 4, 4096, 256, 0)


def test_wrong_weight_dtype_names_both():
    _refused(TypeError, r"float8_e4m3fn.*bfloat16", _p(0), _weight(8, 8, FP8), _p(2), 4, 8, 8, 0)
    _refused(TypeError, r"float32.*bfloat16", _p(0), _weight(8, 8, np.float32), _p(2), 4, 8, 8, 0)


def test_weight_must_be_a_dense_weight():
    _refused(TypeError, "DenseWeight", _p(0), _p(1), _p(2), 4, 8, 8, 0)


def test_a_closed_or_foreign_weight_is_refused_before_the_launch():
    """Its addresses would reach the kernel (freed memory, or another device's)."""
    other = RecordingBackend()
    weight = DenseWeight.from_numpy(other, random_bf16(np.random.default_rng(0), (8, 8)))
    _refused(ValueError, "on another backend", _p(0), weight, _p(2), 4, 8, 8, 0)
    weight.close()
    _refused(ClosedError, "the weight is closed", _p(0), weight, _p(2), 4, 8, 8, 0)


def test_owning_checks_the_shape_the_dtype_and_the_buffers():
    gpu = RecordingBackend()
    buf = DeviceBuffer(gpu, 64)
    with pytest.raises(ValueError, match="weight buffer of 64 bytes, the shape needs 128"):
        DenseWeight.owning(gpu, buf, (8, 8), BF16)
    with pytest.raises(ValueError, match="row_scale is needed for fp8"):
        DenseWeight.owning(gpu, buf, (8, 8), FP8)
    with pytest.raises(ValueError, match="row_scale buffer of 16 bytes, the shape needs 32"):
        DenseWeight.owning(gpu, buf, (8, 8), FP8, DeviceBuffer(gpu, 16))
    with pytest.raises(TypeError, match="float32"):
        DenseWeight.owning(gpu, buf, (4, 4), np.float32)
    with pytest.raises(ValueError, match="rows"):
        DenseWeight.owning(gpu, buf, (0, 8), BF16)
    assert DenseWeight.owning(gpu, buf, (4, 8), BF16).nbytes == 64


@pytest.mark.parametrize("which", ["a", "c", "w"])
def test_null_pointers_refused(which):
    a = DevicePtr(0) if which == "a" else _p(0)
    c = DevicePtr(0) if which == "c" else _p(2)
    w = _weight(8, 8, ptr=0) if which == "w" else _weight(8, 8)
    _refused(ValueError, "null", a, w, c, 4, 8, 8, 0)


def test_sizes_out_of_range_refused():
    big = 1 << 31
    _refused(ValueError, r"k must be in 0\.\.2\*\*31-1", _p(0), _weight(8, big), _p(2), 4, 8, big, 0)
    _refused(ValueError, "m", _p(0), _weight(8, 8), _p(2), -1, 8, 8, 0)
    _refused(TypeError, "m", _p(0), _weight(8, 8), _p(2), 4.0, 8, 8, 0)


def test_null_kernel_and_unknown_path_refused():
    gpu = RecordingBackend()
    with pytest.raises(ValueError, match="kernel"):
        dense_gemm_bf16_pipelined(gpu, KernelHandle(0), _p(0), _weight(8, 8), _p(2), 4, 8, 8, 0)
    _refused(ValueError, "path", _p(0), _weight(8, 8), _p(2), 4, 8, 8, 0, path="cublas")
    assert gpu.launches == []


@pytest.mark.parametrize("m, n, k", [(0, 8, 8), (4, 0, 8), (4, 8, 0), (0, 0, 0)])
def test_zero_sizes_launch_nothing(m, n, k):
    gpu = RecordingBackend()
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    dense_gemm_bf16_pipelined(gpu, kern, _p(0), _weight(n, k), _p(2), m, n, k, 0)
    assert gpu.launches == [] and gpu.ops == []


# -- GPU helpers -------------------------------------------------------------------------------
def check_gemm(a: np.ndarray, w: np.ndarray, got: np.ndarray) -> None:
    """Elementwise within the accumulation-order tolerance of ``gemm_bf16``, and close to fp64."""
    g = got.astype(np.float64)
    assert np.isfinite(g).all(), f"{(~np.isfinite(g)).sum()} unwritten (poisoned) or non-finite outputs"
    ref = gemm_bf16(a, w).astype(np.float64)
    k = a.shape[1]
    s = np.abs(a.astype(np.float32)) @ np.abs(w.astype(np.float32)).T
    tol = 2 * bf16_ulp(ref) + 2 * k * 2.0**-23 * s.astype(np.float64)
    err = np.abs(g - ref)
    bad = err > tol
    if bad.any():
        i, j = np.unravel_index(np.argmax(err / tol), err.shape)
        raise AssertionError(f"{bad.sum()} of {bad.size} outside tolerance; worst at ({i}, {j}): "
                             f"gpu {g[i, j]!r}, ref {ref[i, j]!r}, tol {tol[i, j]!r}")
    ideal = gemm_fp64(a, w)
    rel = np.linalg.norm(g - ideal) / np.linalg.norm(ideal)
    assert rel < 1e-2, rel


def run_gemm(gpu, rng, a: np.ndarray, w: np.ndarray, *, path: str | None = None,
             ab_misalign: int = 0, c_misalign: int = 0) -> np.ndarray:
    """c = a @ w^T through the launcher with guarded, poisoned buffers; checks the guards."""
    (m, k), n = a.shape, w.shape[0]
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    with Guarded(gpu, (m, k), BF16, rng, ab_misalign) as ga, \
         Guarded(gpu, (n, k), BF16, rng, ab_misalign) as gw, \
         Guarded(gpu, (m, n), BF16, rng, c_misalign) as gc:
        ga.upload(a)
        gw.upload(w)
        gc.poison()
        dense_gemm_bf16_pipelined(gpu, kern, ga.ptr, DenseWeight(gw.ptr, (n, k), BF16), gc.ptr,
                                  m, n, k, 0, path=path)
        got = gc.read()
        gc.assert_guards_intact()
        ga.assert_guards_intact()
        gw.assert_guards_intact()
        np.testing.assert_array_equal(bits(ga.read()), bits(a))  # inputs untouched
        np.testing.assert_array_equal(bits(gw.read()), bits(w))
    return got


# -- GPU: the whole size grid, default path --------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 7, 256, 4096])
@pytest.mark.parametrize("n", [1, 8, 100, 4096])
@pytest.mark.parametrize("m", [1, 3, 17, 64, 128, 1000])
def test_gemm_matches_reference(gpu, rng, m, n, k):
    a, w = random_bf16(rng, (m, k)), random_bf16(rng, (n, k))
    check_gemm(a, w, run_gemm(gpu, rng, a, w))


# -- GPU: every path forced, aligned and not ---------------------------------------------------
FORCED_SHAPES = [(1, 1, 1), (3, 100, 7), (2, 264, 1000), (4, 4100, 4096), (17, 264, 264), (64, 257, 1000), (130, 300, 520),
                 (1000, 520, 72), (257, 4096, 256)]
ALIGNMENTS = {"aligned": (0, 0), "c_off2": (0, 2), "all_off2": (2, 2), "ab_off8": (8, 0)}


@pytest.mark.gpu
@pytest.mark.parametrize("alignment", sorted(ALIGNMENTS))
@pytest.mark.parametrize("m, n, k", FORCED_SHAPES)
@pytest.mark.parametrize("path", [None, *gemm.PATHS])
def test_every_path_matches_reference(gpu, rng, path, m, n, k, alignment):
    ab_off, c_off = ALIGNMENTS[alignment]
    a, w = random_bf16(rng, (m, k)), random_bf16(rng, (n, k))
    check_gemm(a, w, run_gemm(gpu, rng, a, w, path=path, ab_misalign=ab_off, c_misalign=c_off))


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 40, 7), (3, 72, 4096), (5, 72, 4096), (64, 96, 1032), (200, 264, 2048),
                                     (129, 257, 4104)])
@pytest.mark.parametrize("path", [None, *gemm.PATHS])
def test_exact_sums_are_bit_exact(gpu, rng, path, m, n, k):
    """Integers in [-8, 8]: every partial sum is an integer below 2^24, exact in fp32 in any
    order, so the one bf16 rounding (nearest even) must agree bit for bit."""
    a = rng.integers(-8, 9, (m, k)).astype(np.float32).astype(BF16)
    w = rng.integers(-8, 9, (n, k)).astype(np.float32).astype(BF16)
    got = run_gemm(gpu, rng, a, w, path=path)
    np.testing.assert_array_equal(bits(got), bits(gemm_bf16(a, w)))


@pytest.mark.gpu
def test_bf16_rounding_is_nearest_even(gpu, rng):
    """k = 1: c = bf16(a * w) exactly; products with many low bits exercise every rounding case."""
    m, n = 64, 4096
    a, w = random_bf16(rng, (m, 1)), random_bf16(rng, (n, 1))
    for path in (None, "tiled_64x64", "wgmma", "simt"):
        got = run_gemm(gpu, rng, a, w, path=path)
        np.testing.assert_array_equal(bits(got), bits(gemm_bf16(a, w)), err_msg=str(path))


# -- GPU: the contract's kernel launched by others, with their own launch shapes -------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(16, 300, 264), (200, 300, 72)])
@pytest.mark.parametrize("grid, block, smem", [
    ((1, 1, 1), (256, 1, 1), "plan"),     # one CTA loops over every work item
    ((7, 3, 2), (256, 1, 1), "plan"),     # a 3-D grid, unrelated to the work
    ((5, 1, 1), (128, 1, 1), 0),          # another block size: scalar fallback
    ((3, 1, 1), (256, 1, 1), 0),          # no shared memory: scalar fallback
    ((2, 1, 1), (32, 2, 2), 1024),
])
def test_pipelined_kernel_correct_for_any_launch(gpu, rng, m, n, k, grid, block, smem):
    a, w = random_bf16(rng, (m, k)), random_bf16(rng, (n, k))
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    shared = gemm.plan(m, n, k).shared_mem if smem == "plan" else smem
    with Guarded(gpu, (m, k), BF16, rng) as ga, Guarded(gpu, (n, k), BF16, rng) as gw, \
         Guarded(gpu, (m, n), BF16, rng) as gc:
        ga.upload(a)
        gw.upload(w)
        gc.poison()
        (KernelLaunch(gpu, kern).grid(list(grid)).block(list(block)).shared_mem(shared)
         .arg_ptr(ga.ptr).arg_ptr(gw.ptr).arg_ptr(gc.ptr).arg_u32(m).arg_u32(n).arg_u32(k).launch(0))
        got = gc.read()
        gc.assert_guards_intact()
    check_gemm(a, w, got)


# -- GPU: the TMA kernels launched directly: few CTAs (each walks many tiles, so every stage's
# barriers go through many phases), and launches they do not fit (scalar fallback) -----------------
_DIRECT = {  # path -> (rows of a and of w per box, shared memory, maps c too)
    "tma": (gemm.WG_BM, gemm.WG_BN, gemm.TMA_SMEM, False),
    "tma_store": (gemm.WG_BM, gemm.WG_BN, gemm.TMA_STORE_SMEM, True),
    "tma_store_n128": (gemm.WG_BM, gemm.TMA_N128, gemm.TMA_N128_SMEM, True),
    "tma_store_n192": (gemm.WG_BM, gemm.TMA_N192, gemm.TMA_N192_SMEM, True),
    "tma_splitk": (gemm.SPLIT_BM, gemm.SPLIT_BN, gemm.SPLIT_SMEM, False),
}


def _direct_tma_launch(gpu, rng, path, m, n, k, grid, block, smem) -> None:
    """The path's kernel launched as given on small-integer inputs: bit-exact, c fully written."""
    if not gemm.tma_available(gpu):
        pytest.skip(f"the TMA paths need sm_90a (this device compiles for {gpu.target})")
    a_rows, w_rows, plan_smem, maps_c = _DIRECT[path]
    a = rng.integers(-8, 9, (m, k)).astype(np.float32).astype(BF16)
    w = rng.integers(-8, 9, (n, k)).astype(np.float32).astype(BF16)
    kern = load_kernel(gpu, "gemm", gemm.KERNELS[path])
    with Guarded(gpu, (m, k), BF16, rng) as ga, Guarded(gpu, (n, k), BF16, rng) as gw, \
         Guarded(gpu, (m, n), BF16, rng) as gc:
        ga.upload(a)
        gw.upload(w)
        gc.poison()
        maps = [gpu.tensor_map_2d(ga.ptr, m, k, a_rows, 64), gpu.tensor_map_2d(gw.ptr, n, k, w_rows, 64)]
        if maps_c:
            maps.append(gpu.tensor_map_2d(gc.ptr, m, n, 64, 64))
        config = LaunchConfig(grid, block, plan_smem if smem == "plan" else smem)
        gpu.bind(kern).launch(config, 0, *maps, ga.ptr, gw.ptr, gc.ptr, m, n, k)
        got = gc.read()
        gc.assert_guards_intact()
    np.testing.assert_array_equal(bits(got), bits(gemm_bf16(a, w)))


_PERSISTENT_LAUNCHES = [
    ((1, 1, 1), (384, 1, 1), "plan"),     # one CTA, every tile
    ((3, 1, 1), (384, 1, 1), "plan"),
    ((2, 2, 2), (384, 1, 1), "plan"),     # a 3-D grid
    ((4, 1, 1), (256, 1, 1), "plan"),     # another block size: scalar fallback
    ((4, 1, 1), (384, 1, 1), 1024),       # too little shared memory: scalar fallback
]


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1100, 600, 200), (300, 1030, 1032)])
@pytest.mark.parametrize("grid, block, smem", _PERSISTENT_LAUNCHES)
def test_tma_kernel_correct_for_any_launch(gpu, rng, m, n, k, grid, block, smem):
    _direct_tma_launch(gpu, rng, "tma", m, n, k, grid, block, smem)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1100, 600, 200), (300, 1032, 1032)])  # c maps: n % 8 == 0
@pytest.mark.parametrize("grid, block, smem", _PERSISTENT_LAUNCHES)
@pytest.mark.parametrize("path", ["tma_store", "tma_store_n128", "tma_store_n192"])
def test_tma_store_kernel_correct_for_any_launch(gpu, rng, path, m, n, k, grid, block, smem):
    _direct_tma_launch(gpu, rng, path, m, n, k, grid, block, smem)


@pytest.mark.gpu
# k = 64 and 8: the cluster's second CTA has no k-stage, the second consumer only zero-filled boxes;
# m > 64: 128-token tiles (m = 100: the second a box half past m; 130: a second tile row); k <= 256:
# a CTA per 64-token tile
@pytest.mark.parametrize("m, n, k", [(64, 1030, 1032), (3, 300, 200), (130, 264, 4104), (5, 70, 64),
                                     (2, 130, 8), (100, 200, 520), (65, 70, 64), (130, 200, 256)])
@pytest.mark.parametrize("grid, block, smem", [
    ((2, 1, 1), (384, 1, 1), "plan"),     # one cluster, every tile
    ((6, 1, 1), (384, 1, 1), "plan"),     # three clusters
    ((8, 2, 1), (384, 1, 1), "plan"),     # a 2-D grid of clusters
    ((4, 1, 1), (256, 1, 1), "plan"),     # another block size: scalar fallback
    ((4, 1, 1), (384, 1, 1), 1024),       # too little shared memory: scalar fallback
])
def test_tma_splitk_kernel_correct_for_any_launch(gpu, rng, m, n, k, grid, block, smem):
    _direct_tma_launch(gpu, rng, "tma_splitk", m, n, k, grid, block, smem)


# -- GPU: zero sizes write nothing -----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(0, 8, 16), (4, 0, 16), (4, 8, 0)])
def test_zero_sizes_leave_c_untouched(gpu, rng, m, n, k):
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    before = random_bf16(rng, (4, 8))
    with Guarded(gpu, (4, 16), BF16, rng) as ga, Guarded(gpu, (8, 16), BF16, rng) as gw, \
         Guarded(gpu, (4, 8), BF16, rng) as gc:
        ga.upload(random_bf16(rng, (4, 16)))
        gw.upload(random_bf16(rng, (8, 16)))
        gc.upload(before)
        dense_gemm_bf16_pipelined(gpu, kern, ga.ptr, DenseWeight(gw.ptr, (n, k), BF16), gc.ptr,
                                  m, n, k, 0)
        gpu.synchronize()
        np.testing.assert_array_equal(bits(gc.read()), bits(before))
        gc.assert_guards_intact()
