"""The word-row epilogue of gemm.cu (the fused n-gram embedding): launcher plans and refusals on
the CPU, the kernels against a numpy reference on the GPU.

c[i, j] = bf16((acc[i, j] + float(word[word_ids[i], j])) * scale), acc = sum_k a[i, k] w[j, k] in
fp32. The reference computes acc exactly (fp64) and rounds it to fp32, then does the fp32 add, the
fp32 multiply and the bf16 rounding as the kernel does (numpy float32 arithmetic rounds to nearest
even, like __fadd_rn / __fmul_rn). Only the accumulation order differs, so:
  - usually the bits agree; where the order moves the fp32 value across a bf16 rounding boundary
    the result is the neighbouring bf16 value (at most 1 ulp of |want|); this must be rare (< 1 %);
  - where acc + word nearly cancels, the accumulation error (bounded as in test_gemm.py by
    2 k 2^-23 sum|a w|, times scale) can exceed one ulp of the small result: allowed, but only
    within that bound and only for a tiny fraction (< 0.1 %) of elements.
A wrong word row, a missing scale or a second rounding breaks the rarity checks at once; with
small-integer a and w every fp32 sum is exact, and the kernel must match bit for bit.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from gpu_runtime import DevicePtr, KernelHandle, KernelLaunch
from gpu_runtime.signatures import parse_signatures
from layers.kernel_files import kernel_dir, load_kernel
from layers.ops import gemm
from layers.ops.gemm import dense_gemm_bf16_word
from layers.dense_weight import BF16, FP8, DenseWeight
from tests.helpers.fakes import RecordingBackend
from tests.helpers import Guarded, bf16_ulp, bits, random_bf16
from tests.helpers.gemm import MAX_SHARED_OPTIN, Sm90aBackend, TmaBackend, assert_refused

KINDS = "PPPUUUPPPF"
VOCAB = 1000
SCALE = 1.0 / 17


def _p(i: int) -> DevicePtr:
    return DevicePtr(0x100000 * (i + 1))


def _weight(n: int, k: int, dtype=BF16, ptr: int = 0x200000) -> DenseWeight:
    return DenseWeight(DevicePtr(ptr), (n, k), np.dtype(dtype))


def _launch(gpu, m: int, n: int, k: int, *, kernel=None, scale=0.25, stream: int = 7, **kwargs) -> None:
    kern = load_kernel(gpu, "gemm", gemm.WORD_KERNEL) if kernel is None else kernel
    dense_gemm_bf16_word(gpu, kern, _p(0), _weight(n, k), _p(2), m, n, k, _p(3), _p(4), scale,
                         stream, **kwargs)


# -- CPU: signatures and plans -------------------------------------------------------------------
def test_word_kernels_take_the_plain_signature_plus_ids_word_over_scale():
    sigs = parse_signatures((kernel_dir() / "gemm.cu").read_text())
    assert sigs[gemm.WORD_KERNEL].kinds == sigs[gemm.WORD_WGMMA_KERNEL].kinds == KINDS
    assert sigs[gemm.KERNEL].kinds + "PPPF" == KINDS


@pytest.mark.parametrize("m", [1, 8, 9, 33, 64])
def test_small_m_launches_the_given_kernel_with_the_plain_plan(m):
    gpu = RecordingBackend()
    kern = load_kernel(gpu, "gemm", gemm.WORD_KERNEL)
    _launch(gpu, m, 4096, 256, kernel=kern, scale=0.125)
    (launch,) = gpu.launches
    p = gemm.plan(m, 4096, 256)
    assert p.path == "small"
    assert launch.kernel == kern and launch.kinds == KINDS and launch.stream == 7
    assert launch.grid == (p.grid, 1, 1) and launch.block == (256, 1, 1)
    assert launch.shared_mem == p.shared_mem == gemm.small_smem(m)
    assert launch.args == [int(_p(0)), 0x200000, int(_p(2)), m, 4096, 256, int(_p(3)), int(_p(4)), 0, 0.125]


def test_a_repeated_launch_takes_each_calls_epilogue_arguments():
    """The launch worked out for the operands is reused (gemm's recipes), but word_ids, word,
    word_over and scale are the call's own, as are the stream and the overlap."""
    gpu = TmaBackend()
    kern = load_kernel(gpu, "gemm", gemm.WORD_KERNEL)
    w = _weight(4096, 4096)
    epilogues = [(_p(3), _p(4), 0, 0.25, 7), (_p(5), _p(6), int(_p(7)), 0.5, 8), (_p(3), _p(4), 0, 0.125, 9)]
    for i, (ids, word, over, scale, stream) in enumerate(epilogues):
        dense_gemm_bf16_word(gpu, kern, _p(0), w, _p(2), 64, 4096, 4096, ids, word, scale, stream,
                             word_over=over, overlap=i == 1)
    for launch, (ids, word, over, scale, stream) in zip(gpu.launches, epilogues, strict=True):
        assert gpu.kernel_of(launch) == ("gemm", "dense_gemm_bf16_word_tma_splitk")
        assert launch.args[2:] == [int(_p(0)), 0x200000, int(_p(2)), 64, 4096, 4096, int(ids), int(word), over, scale]
        assert launch.stream == stream
    assert [launch.overlap for launch in gpu.launches] == [False, True, False]


@pytest.mark.parametrize("m, n", [(65, 4096), (1000, 2048), (4096, 4096), (300, 72)])
def test_large_m_without_wgmma_runs_tiled_on_the_given_kernel(m, n):
    gpu = RecordingBackend()
    kern = load_kernel(gpu, "gemm", gemm.WORD_KERNEL)
    _launch(gpu, m, n, 64, kernel=kern)
    (launch,) = gpu.launches
    p = gemm.plan(m, n, 64)
    assert p.path.startswith("tiled_")
    assert launch.kernel == kern and launch.kinds == KINDS
    assert (launch.grid, launch.shared_mem) == ((p.grid, 1, 1), p.shared_mem)


def test_large_m_on_sm90a_runs_the_wgmma_twin():
    gpu = Sm90aBackend()
    kern = load_kernel(gpu, "gemm", gemm.WORD_KERNEL)
    _launch(gpu, 4096, 4096, 4096, kernel=kern, stream=3)
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == ("gemm", "dense_gemm_bf16_word_wgmma")
    assert launch.grid == (32 * 16, 1, 1) and launch.shared_mem == gemm.WG_SMEM
    assert launch.kinds == KINDS and launch.args[3:6] == [4096, 4096, 4096] and launch.stream == 3
    # too few 128x256 tiles, or small m: the given kernel
    for m, n in ((128, 4096), (64, 4096)):
        gpu.launches.clear()
        _launch(gpu, m, n, 64, kernel=kern)
        assert gpu.launches[0].kernel == kern, (m, n)


def test_large_m_with_tensor_maps_runs_the_tma_store_twin():
    gpu = TmaBackend()
    kern = load_kernel(gpu, "gemm", gemm.WORD_KERNEL)
    _launch(gpu, 4096, 4096, 4096, kernel=kern, stream=3, overlap=True)
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == ("gemm", "dense_gemm_bf16_word_tma_store")
    assert launch.grid == (132, 1, 1) and launch.block == (384, 1, 1)
    assert launch.shared_mem == gemm.TMA_STORE_SMEM and launch.overlap
    assert launch.kinds == "TTT" + KINDS and launch.args[6:9] == [4096, 4096, 4096]


def test_default_plan_matches_the_plain_launcher_per_shape():
    """Same grid and shared memory as dense_gemm_bf16_pipelined for every shape and target."""
    for backend in (RecordingBackend, Sm90aBackend, TmaBackend):
        for m, n, k in [(1, 4096, 4096), (64, 300, 72), (65, 300, 72), (64, 4096, 4096),
                        (128, 4096, 1024), (300, 4096, 4096), (4096, 4096, 512), (100000, 100, 8)]:
            plain, word = backend(), backend()
            gemm.dense_gemm_bf16_pipelined(plain, load_kernel(plain, "gemm", gemm.KERNEL), _p(0),
                                           _weight(n, k), _p(2), m, n, k, 0)
            _launch(word, m, n, k)
            (lp,), (lw,) = plain.launches, word.launches
            assert (lw.grid, lw.block, lw.shared_mem) == (lp.grid, lp.block, lp.shared_mem)
            twin = {gemm.KERNEL: gemm.WORD_KERNEL, "dense_gemm_bf16_wgmma": gemm.WORD_WGMMA_KERNEL,
                    "dense_gemm_bf16_tma": gemm.WORD_TMA_KERNEL,
                    "dense_gemm_bf16_tma_store": gemm.WORD_TMA_STORE_KERNEL,
                    "dense_gemm_bf16_tma_store_n128": gemm.WORD_TMA_STORE_N128_KERNEL,
                    "dense_gemm_bf16_tma_store_n192": gemm.WORD_TMA_STORE_N192_KERNEL,
                    "dense_gemm_bf16_tma_splitk": gemm.WORD_SPLITK_KERNEL}
            assert word.kernel_of(lw)[1] == twin[plain.kernel_of(lp)[1]], (backend, m, n, k)


@pytest.mark.parametrize("m, path, name, smem", [
    (17, "small", gemm.WORD_KERNEL, 8 * 6 * (4 + 4) * 512),
    (200, "tiled", gemm.WORD_KERNEL, 4 * (64 + 64) * 64),
    (200, "tiled_128x256", gemm.WORD_KERNEL, 4 * (128 + 256) * 64),
    (200, "tiled_128x128", gemm.WORD_KERNEL, 4 * (128 + 128) * 64),
    (200, "tiled_64x64", gemm.WORD_KERNEL, 4 * (64 + 64) * 64),
    (17, "wgmma", gemm.WORD_WGMMA_KERNEL, 197632),
    (200, "wgmma", gemm.WORD_WGMMA_KERNEL, 197632),
    (200, "tma", gemm.WORD_WGMMA_KERNEL, 197632),  # no tensor maps on this backend
    (17, "tma_splitk", gemm.WORD_KERNEL, 8 * 6 * (4 + 4) * 512),  # ... so path=None's plan
    (17, "simt", gemm.WORD_KERNEL, 0),   # no shared memory: the kernel's scalar fallback
    (200, "simt", gemm.WORD_KERNEL, 0),
])
def test_forced_paths(m, path, name, smem):
    gpu = RecordingBackend()
    _launch(gpu, m, 300, 72, path=path, stream=5)
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == ("gemm", name)
    assert launch.shared_mem == smem <= MAX_SHARED_OPTIN
    assert launch.grid == (gemm.plan(m, 300, 72, path).grid, 1, 1)
    assert launch.block == (256, 1, 1) and launch.kinds == KINDS and launch.stream == 5


def test_scale_is_passed_as_given():
    gpu = RecordingBackend()
    for scale in (SCALE, -3, np.float32(0.5), 0.0):
        _launch(gpu, 4, 8, 8, scale=scale)
    assert [launch.args[-1] for launch in gpu.launches] == [SCALE, -3.0, 0.5, 0.0]


# -- CPU: bad input, refused before any launch ---------------------------------------------------
_refused = partial(assert_refused, dense_gemm_bf16_word, gemm.WORD_KERNEL)


def _args(m=4, n=8, k=8, *, a=None, w=None, c=None, ids=None, word=None, scale=0.5):
    return (_p(0) if a is None else a, _weight(n, k) if w is None else w, _p(2) if c is None else c,
            m, n, k, _p(3) if ids is None else ids, _p(4) if word is None else word, scale, 0)


@pytest.mark.parametrize("which", ["a", "c", "ids", "word"])
def test_null_pointers_refused(which):
    _refused(ValueError, f"{which}: null", *_args(**{which: DevicePtr(0)}))


def test_null_weight_refused():
    _refused(ValueError, "w: null", *_args(w=_weight(8, 8, ptr=0)))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 1e39])
def test_non_finite_scale_refused(scale):
    _refused(ValueError, "scale", *_args(scale=scale))


@pytest.mark.parametrize("scale", [True, "0.5", None, 1j])
def test_non_real_scale_refused(scale):
    _refused(TypeError, "scale", *_args(scale=scale))


def test_weight_checks_name_the_word_kernel():
    _refused(ValueError, r"dense_gemm_bf16_word: w shape \(8, 7\).*\(8, 8\)", *_args(w=_weight(8, 7)))
    _refused(TypeError, r"dense_gemm_bf16_word: w dtype float8_e4m3fn.*bfloat16", *_args(w=_weight(8, 8, FP8)))
    _refused(TypeError, "DenseWeight", *_args(w=_p(1)))


def test_sizes_out_of_range_refused():
    big = 1 << 31
    _refused(ValueError, r"k must be in 0\.\.2\*\*31-1", *_args(4, 8, big, w=_weight(8, big)))
    _refused(ValueError, "m", *_args(-1))
    _refused(TypeError, "m", *_args(4.0))


def test_null_kernel_and_unknown_path_refused():
    gpu = RecordingBackend()
    with pytest.raises(ValueError, match="kernel"):
        dense_gemm_bf16_word(gpu, KernelHandle(0), *_args())
    assert gpu.launches == []
    _refused(ValueError, "path", *_args(), path="cublas")


@pytest.mark.parametrize("m, path", [(64, "tiled"), (1, "tiled_64x64")])
def test_path_the_word_kernel_cannot_run_is_refused(m, path):
    """dense_gemm_bf16_word picks small or tiled from m: forcing tiled for m <= 64 would silently
    run something else (tiled smem with m <= 64 runs simt)."""
    _refused(ValueError, f"{path!r}.*m = {m}", *_args(m, 300, 72), path=path)


@pytest.mark.parametrize("m", [65, 200, 8192])
def test_forced_small_above_64_rows_runs_the_small_twin(m):
    gpu = RecordingBackend()
    _launch(gpu, m, 300, 72, path="small")
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == ("gemm", gemm.WORD_SMALL_KERNEL) and launch.kinds == KINDS
    assert launch.shared_mem == gemm.small_smem(m) and launch.grid == (gemm.plan(m, 300, 72, "small").grid, 1, 1)


@pytest.mark.parametrize("m, n, k", [(0, 8, 8), (4, 0, 8), (4, 8, 0)])
def test_zero_sizes_launch_nothing(m, n, k):
    gpu = RecordingBackend()
    dense_gemm_bf16_word(gpu, load_kernel(gpu, "gemm", gemm.WORD_KERNEL), *_args(m, n, k))
    assert gpu.launches == [] and gpu.ops == []


def test_reference_checker_rejects_wrong_results(rng):
    """The GPU checks can fail: a wrong word row, a missing scale, or an extra rounding of acc."""
    m, n, k = 64, 256, 512
    a, w = random_bf16(rng, (m, k)), random_bf16(rng, (n, k))
    word, ids = random_bf16(rng, (VOCAB, n)), rng.integers(0, VOCAB, m).astype(np.uint32)
    want = word_gemm_ref(a, w, word, ids, SCALE)
    check_word_gemm(a, w, word, ids, SCALE, want)  # the reference passes its own check
    acc = (a.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)
    shifted = (ids + 1) % VOCAB
    wrong = {
        "ids": word_gemm_ref(a, w, word, shifted, SCALE),
        "scale": word_gemm_ref(a, w, word, ids, 1 / 16),
        "two roundings": ((acc.astype(BF16).astype(np.float32) + word[ids].astype(np.float32))
                          * np.float32(SCALE)).astype(BF16),
    }
    for what, got in wrong.items():
        with pytest.raises(AssertionError):
            check_word_gemm(a, w, word, ids, SCALE, got)
        print("rejected", what)


# -- reference and checks ------------------------------------------------------------------------
def _epilogue(acc64: np.ndarray, word: np.ndarray, ids: np.ndarray, scale: float) -> np.ndarray:
    """bf16((f32(acc) + f32(word[ids])) * f32(scale)): fp32 add, fp32 multiply, one rounding."""
    rows = word[np.asarray(ids, np.int64)].astype(np.float32)
    return ((acc64.astype(np.float32) + rows) * np.float32(scale)).astype(BF16)


def word_gemm_ref(a: np.ndarray, w: np.ndarray, word: np.ndarray, ids: np.ndarray,
                  scale: float) -> np.ndarray:
    return _epilogue(a.astype(np.float64) @ w.astype(np.float64).T, word, ids, scale)


def check_word_gemm(a: np.ndarray, w: np.ndarray, word: np.ndarray, ids: np.ndarray, scale: float,
                    got: np.ndarray) -> None:
    """See the module docstring: neighbours only, rarely; beyond that only at cancellations."""
    g = got.astype(np.float64)
    assert np.isfinite(g).all(), f"{(~np.isfinite(g)).sum()} unwritten (poisoned) or non-finite outputs"
    acc64 = a.astype(np.float64) @ w.astype(np.float64).T
    want = _epilogue(acc64, word, ids, scale)
    r = want.astype(np.float64)
    err = np.abs(g - r)
    ulp = bf16_ulp(r)
    k = a.shape[1]
    s = (np.abs(a.astype(np.float32)) @ np.abs(w.astype(np.float32)).T).astype(np.float64)
    tol = ulp + abs(np.float32(scale)) * 2 * k * 2.0**-23 * s
    bad = err > tol
    if bad.any():
        i, j = np.unravel_index(np.argmax(err / tol), err.shape)
        raise AssertionError(f"{bad.sum()} of {bad.size} outside tolerance; worst at ({i}, {j}): "
                             f"gpu {g[i, j]!r}, want {r[i, j]!r}, tol {tol[i, j]!r}")
    # rare: < 1 % (< 0.1 %) of outputs, with a few allowed for outputs too small for a percentage
    differ = int((bits(got) != bits(want)).sum())
    assert differ <= max(1e-2 * got.size, 3), \
        f"{differ} of {got.size} outputs differ from the reference (rounding flips are rare)"
    beyond = int((err > ulp).sum())
    assert beyond <= max(1e-3 * got.size, 1), \
        f"{beyond} of {got.size} outputs more than 1 ulp off (only cancellations may be)"
    ideal = (acc64 + word[np.asarray(ids, np.int64)].astype(np.float64)) * scale
    rel = np.linalg.norm(g - ideal) / np.linalg.norm(ideal)
    assert rel < 1e-2, rel


def run_word(gpu, rng, a: np.ndarray, w: np.ndarray, word: np.ndarray, ids: np.ndarray,
             scale: float, *, path: str | None = None, ab_misalign: int = 0, c_misalign: int = 0,
             word_misalign: int = 0, over: np.ndarray | None = None) -> np.ndarray:
    """The launcher on guarded buffers (c poisoned); checks every guard and that inputs are intact.
    ``over`` [m] int: row i adds row ``over[i]`` of ``word`` through ``word_over`` (a separate
    allocation, as an adapter's rows are) instead of ``word[ids[i]]``; -1: no replacement."""
    (m, k), n = a.shape, w.shape[0]
    kern = load_kernel(gpu, "gemm", gemm.WORD_KERNEL)
    with Guarded(gpu, (m, k), BF16, rng, ab_misalign) as ga, \
         Guarded(gpu, (n, k), BF16, rng, ab_misalign) as gw, \
         Guarded(gpu, (m, n), BF16, rng, c_misalign) as gc, \
         Guarded(gpu, (m,), np.uint32, rng) as gi, \
         Guarded(gpu, word.shape, BF16, rng, word_misalign) as gt, \
         Guarded(gpu, word.shape, BF16, rng) as gr, Guarded(gpu, (m,), np.uint64, rng) as go:
        ga.upload(a)
        gw.upload(w)
        gi.upload(ids)
        gt.upload(word)
        gr.upload(word)
        if over is not None:
            go.upload(np.where(over >= 0, int(gr.ptr) + np.maximum(over, 0) * n * 2, 0).astype(np.uint64))
        gc.poison()
        dense_gemm_bf16_word(gpu, kern, ga.ptr, DenseWeight(gw.ptr, (n, k), BF16), gc.ptr, m, n, k,
                             gi.ptr, gt.ptr, scale, 0, path=path, word_over=0 if over is None else go.ptr)
        got = gc.read()
        for g in (gc, ga, gw, gi, gt, gr, go):
            g.assert_guards_intact()
        for g, host in ((ga, a), (gw, w), (gi, ids), (gt, word), (gr, word)):
            np.testing.assert_array_equal(bits(g.read()), bits(host))
    return got


def _inputs(rng, m: int, n: int, k: int):
    a, w = random_bf16(rng, (m, k)), random_bf16(rng, (n, k))
    word = random_bf16(rng, (VOCAB, n))
    ids = rng.integers(0, VOCAB, m).astype(np.uint32)
    return a, w, word, ids


# -- GPU: the n-gram shapes, default path ----------------------------------------------------------
SHAPES = [(1, 4096, 4096), (1, 37, 129), (5, 64, 33), (64, 4096, 256), (65, 300, 72),
          (100, 1000, 2048), (300, 4096, 4096), (4096, 4096, 512)]  # 100 x .. x 2048: split-K on sm_90a


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_word_gemm_matches_reference(gpu, rng, m, n, k):
    a, w, word, ids = _inputs(rng, m, n, k)
    check_word_gemm(a, w, word, ids, SCALE, run_word(gpu, rng, a, w, word, ids, SCALE))


# -- GPU: every path forced, aligned and not -------------------------------------------------------
def _paths(m: int) -> list[str | None]:
    """The paths the word launcher runs for this m (small needs m <= 64, tiled m > 64)."""
    fixed = ["gemv", "small"] if m <= gemm.SMALL_MAX_ROWS else [
        "small", "tiled", "tiled_128x256", "tiled_128x128", "tiled_64x64"]
    return [None, *fixed, "wgmma", "tma", "tma_store", "tma_store_n128", "tma_store_n192", "tma_splitk", "simt"]


FORCED = [(m, n, k, path) for m, n, k in [(1, 1, 1), (3, 100, 7), (2, 264, 1000), (4, 4100, 4096),
                                          (17, 264, 264), (64, 257, 1000),
                                          (130, 300, 520), (512, 4096, 512), (257, 520, 72)]
          for path in _paths(m) if not (path == "simt" and m * n * k > 1 << 28)]
# word_off8: pairs of 4 bytes, but rows not 16-byte aligned (the TMA-store twin loads them when
# applied instead of staging them in shared memory)
ALIGNMENTS = {"aligned": (0, 0, 0), "c_off2": (0, 2, 0), "word_off2": (0, 0, 2), "word_off8": (0, 0, 8),
              "all_off2": (2, 2, 2), "ab_off8": (8, 0, 0)}


@pytest.mark.gpu
@pytest.mark.parametrize("alignment", sorted(ALIGNMENTS))
@pytest.mark.parametrize("m, n, k, path", FORCED)
def test_every_path_matches_reference(gpu, rng, m, n, k, path, alignment):
    ab_off, c_off, word_off = ALIGNMENTS[alignment]
    a, w, word, ids = _inputs(rng, m, n, k)
    got = run_word(gpu, rng, a, w, word, ids, SCALE, path=path, ab_misalign=ab_off,
                   c_misalign=c_off, word_misalign=word_off)
    check_word_gemm(a, w, word, ids, SCALE, got)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, path", [(m, n, k, p) for m, n, k in
                                           [(1, 40, 7), (3, 72, 4096), (5, 72, 4096), (64, 96, 1032),
                                            (200, 264, 2048), (129, 257, 4104)]
                                           for p in _paths(m)])
@pytest.mark.parametrize("word_off, replaced", [(0, False), (2, False), (0, True), (8, True)])
def test_exact_sums_are_bit_exact(gpu, rng, m, n, k, path, word_off, replaced):
    """Integers in [-8, 8]: acc is exact in fp32 in any order, so the epilogue (fp32 add, fp32
    multiply, one nearest-even rounding) must reproduce the reference bit for bit. ``replaced``:
    about half the rows take a replacement word row through ``word_over`` (an adapter's row), bit
    for bit as if the word table held it at their id (with ``word_off`` 8, a mix of rows staged
    in shared memory and rows loaded when applied, on the TMA-store twin)."""
    a = rng.integers(-8, 9, (m, k)).astype(np.float32).astype(BF16)
    w = rng.integers(-8, 9, (n, k)).astype(np.float32).astype(BF16)
    word = random_bf16(rng, (VOCAB, n), scale=8.0)
    ids = rng.integers(0, VOCAB, m).astype(np.uint32)
    over = np.where(rng.random(m) < 0.5, rng.integers(0, VOCAB, m), -1) if replaced else None
    got = run_word(gpu, rng, a, w, word, ids, SCALE, path=path, word_misalign=word_off, over=over)
    used = ids if over is None else np.where(over >= 0, over, ids)
    np.testing.assert_array_equal(bits(got), bits(word_gemm_ref(a, w, word, used, SCALE)))


@pytest.mark.gpu
@pytest.mark.parametrize("path", _paths(200))
def test_rows_without_a_word_are_zeros_beside_exact_rows(gpu, rng, path):
    """Word id 0xFFFFFFFF (a bad or padded row) writes the row as zeros; the rows beside it stay
    bit for bit (on the TMA-store twin: warps that mix staged rows and zero rows, n a whole tile)."""
    m, n, k = 200, 512, 256
    a = rng.integers(-8, 9, (m, k)).astype(np.float32).astype(BF16)
    w = rng.integers(-8, 9, (n, k)).astype(np.float32).astype(BF16)
    word = random_bf16(rng, (VOCAB, n), scale=8.0)
    ids = rng.integers(0, VOCAB, m).astype(np.uint32)
    zero = rng.random(m) < 0.3
    ids[zero] = 0xFFFFFFFF
    got = run_word(gpu, rng, a, w, word, ids, SCALE, path=path)
    assert not bits(got[zero]).any()
    np.testing.assert_array_equal(bits(got[~zero]), bits(word_gemm_ref(a[~zero], w, word, ids[~zero], SCALE)))


@pytest.mark.gpu
def test_repeated_and_extreme_ids(gpu, rng):
    """Every row the same id, then the first and last table rows: ids index rows of n values."""
    m, n, k = 130, 300, 64
    a, w, word, _ = _inputs(rng, m, n, k)
    for ids in (np.full(m, 7, np.uint32), np.where(np.arange(m) % 2, VOCAB - 1, 0).astype(np.uint32)):
        for path in (None, "wgmma", "tma", "tma_store", "tma_store_n128", "tma_store_n192", "tma_splitk", "simt"):
            got = run_word(gpu, rng, a, w, word, ids, SCALE, path=path)
            check_word_gemm(a, w, word, ids, SCALE, got)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [96, 4096])
def test_the_small_path_is_batch_invariant(gpu, rng, k):
    """path="small": every row's bits are the same whatever m (and so whatever rows share its
    launch): rows of m = 1, 7, 64 and 300 against the same rows of one m = 300 launch."""
    n, m = 264, 300
    a, w, word, ids = _inputs(rng, m, n, k)
    over = np.where(rng.random(m) < 0.3, rng.integers(0, VOCAB, m), -1)
    whole = run_word(gpu, rng, a, w, word, ids, SCALE, path="small", over=over)
    check_word_gemm(a, w, word, np.where(over >= 0, over, ids), SCALE, whole)
    for lo, hi in ((0, 1), (5, 12), (100, 164), (0, 300)):
        part = run_word(gpu, rng, a[lo:hi], w, word, ids[lo:hi], SCALE, path="small", over=over[lo:hi])
        np.testing.assert_array_equal(bits(part), bits(whole[lo:hi]), err_msg=f"rows {lo}..{hi}")


# -- GPU: the word kernel launched with other launch shapes (scalar fallback honours the epilogue) --
@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(3, 300, 264), (16, 300, 264), (200, 300, 72)])
@pytest.mark.parametrize("grid, block, smem", [
    ((1, 1, 1), (256, 1, 1), "plan"),
    ((7, 3, 2), (256, 1, 1), "plan"),
    ((1, 1, 1), (256, 1, 1), gemm.GEMV_SMEM),  # the gemv path for m <= 4
    ((7, 3, 2), (256, 1, 1), gemm.GEMV_SMEM),
    ((5, 1, 1), (128, 1, 1), 0),
    ((2, 1, 1), (32, 2, 2), 1024),
])
def test_word_kernel_correct_for_any_launch(gpu, rng, m, n, k, grid, block, smem):
    a = rng.integers(-8, 9, (m, k)).astype(np.float32).astype(BF16)
    w = rng.integers(-8, 9, (n, k)).astype(np.float32).astype(BF16)
    word, ids = random_bf16(rng, (VOCAB, n)), rng.integers(0, VOCAB, m).astype(np.uint32)
    kern = load_kernel(gpu, "gemm", gemm.WORD_KERNEL)
    shared = gemm.word_plan(m, n, k).shared_mem if smem == "plan" else smem
    with Guarded(gpu, (m, k), BF16, rng) as ga, Guarded(gpu, (n, k), BF16, rng) as gw, \
         Guarded(gpu, (m, n), BF16, rng) as gc, Guarded(gpu, (m,), np.uint32, rng) as gi, \
         Guarded(gpu, word.shape, BF16, rng) as gt:
        ga.upload(a)
        gw.upload(w)
        gi.upload(ids)
        gt.upload(word)
        gc.poison()
        (KernelLaunch(gpu, kern).grid(list(grid)).block(list(block)).shared_mem(shared)
         .arg_ptr(ga.ptr).arg_ptr(gw.ptr).arg_ptr(gc.ptr).arg_u32(m).arg_u32(n).arg_u32(k)
         .arg_ptr(gi.ptr).arg_ptr(gt.ptr).arg_ptr(0).arg_f32(SCALE).launch(0))
        got = gc.read()
        gc.assert_guards_intact()
    np.testing.assert_array_equal(bits(got), bits(word_gemm_ref(a, w, word, ids, SCALE)))
