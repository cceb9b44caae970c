"""gemm.cu's fp8-weight GEMM (``layers.ops.gemm_fp8``) against the bf16 reference over the
dequantised weight, ``gemm_bf16(a, dequant_weight(w, scale, 32, bfloat16))``; ``BlockFp8Weight``'s
checks and ownership and the launcher's plans and refusals on the CPU.

The kernels use each weight as that bf16 value, so the products and the fp32 sums are the bf16
GEMM's over it and ``test_gemm.check_gemm``'s tolerance (accumulation order) holds. Small-integer
data with small power-of-two scales make every partial sum exact: there the result must match bit
for bit (and a scale applied one block off changes it). Weight bytes are drawn over every non-NaN
e4m3 value (subnormals and zeros included).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from gpu_runtime import ClosedError, DeviceBuffer, DevicePtr, KernelHandle, LaunchConfig
from gpu_runtime.signatures import parse_signatures
from layers.block_fp8_weight import BlockFp8Weight
from layers.dense_weight import BF16, FP8, DenseWeight
from layers.kernel_files import kernel_dir, load_kernel
from layers.ops import gemm_fp8
from layers.ops.gemm_fp8 import dense_gemm_fp8w, plan_fp8w_gemm
from layers.reference import dequant_rows, dequant_weight, gemm_bf16
from tests.helpers import Guarded, bf16_ulp, bits, random_bf16
from tests.helpers.fakes import RecordingBackend
from tests.helpers.gemm import MAX_SHARED_OPTIN, assert_refused
from tests.test_gemm import _cu_constants, check_gemm

U8 = np.dtype(np.uint8)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
SMS = 132  # what the launcher assumes of a backend that does not say


def _p(i: int) -> DevicePtr:
    return DevicePtr(0x100000 * (i + 1))


def _weight(n: int, k: int, ptr: int = 0x200000, scale: int = 0x400000) -> BlockFp8Weight:
    return BlockFp8Weight(DevicePtr(ptr), DevicePtr(scale), (n, k))


def weight_bytes(rng: np.random.Generator, shape: Any) -> np.ndarray:
    """Uniform over the 254 e4m3 bytes that are not NaN (0x7f, 0xff): zeros and subnormals too."""
    x = rng.integers(0, 254, shape, dtype=np.uint8)
    return x + (x >= 0x7F).astype(np.uint8)


def scale_bytes(rng: np.random.Generator, n: int, k: int, lo: int = 100, hi: int = 140) -> np.ndarray:
    """e8m0 bytes ``[ceil(n / 32), k / 32]`` in ``lo..hi``."""
    return rng.integers(lo, hi + 1, (-(-n // 32), k // 32), dtype=np.uint8)


def reference(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The weight as the kernels use it: bf16 ``[n, k]``."""
    return dequant_weight(w, s, 32, BF16)


# -- CPU: launch plans ---------------------------------------------------------------------------
def test_launcher_constants_mirror_the_kernel():
    cu = _cu_constants()
    assert (cu["kFp8Block"], cu["kFp8MaxRows"], cu["kFp8Smem"]) == (gemm_fp8.BLOCK, gemm_fp8.MAX_ROWS, gemm_fp8.SMEM)
    assert cu["kSmallCols"] == gemm_fp8.COLS == gemm_fp8.BLOCK  # a work item's columns: one scale block
    assert cu["kThreads"] == 256 and gemm_fp8.SMEM <= MAX_SHARED_OPTIN
    source = (kernel_dir() / "gemm.cu").read_text()
    assert "dense_gemm_fp8w_small(" in source and "dense_gemm_fp8w_simt(" in source


@pytest.mark.parametrize("name", [gemm_fp8.KERNEL, gemm_fp8.SIMT])
def test_each_kernel_parameter_gets_the_value_of_its_name(name):
    """Arguments go by position: a swap of two pointers or two sizes would launch garbage."""
    gpu = RecordingBackend()
    values = dict(a=_p(0), w=DevicePtr(0x200000), ws=DevicePtr(0x400000), c=_p(2), m=3, n=100, k=64)
    dense_gemm_fp8w(gpu, load_kernel(gpu, "gemm", gemm_fp8.KERNEL), values["a"], _weight(100, 64), values["c"],
                    3, 100, 64, 5, path="simt" if name == gemm_fp8.SIMT else None)
    (launch,) = gpu.launches
    signature = parse_signatures((kernel_dir() / "gemm.cu").read_text())[name]
    assert gpu.kernel_of(launch) == ("gemm", name) and launch.kinds == signature.kinds == "PPPPUUU"
    assert launch.args == [int(values[p.name]) for p in signature] and launch.stream == 5


@pytest.mark.parametrize("n", [1, 100, 25600])
@pytest.mark.parametrize("m", [1, 9, 17, 33, 1000])
def test_small_plan_is_a_cta_per_sm_at_most(m, n):
    """Work items of 32 columns x 32 rows; a CTA per item, at most one per SM (``sm_count``, else
    132), each with 256 threads and the ring's shared memory."""
    items = -(-n // 32) * -(-m // 32)
    told = RecordingBackend()
    told.sm_count = 7  # a backend that says how many SMs its device has
    for gpu, sms in ((RecordingBackend(), SMS), (told, 7)):
        kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
        dense_gemm_fp8w(gpu, kern, _p(0), _weight(n, 64), _p(2), m, n, 64, 0)
        (launch,) = gpu.launches
        assert launch.kernel == kern and launch.grid == (min(items, sms), 1, 1)
        assert launch.block == (256, 1, 1) and launch.shared_mem == gemm_fp8.SMEM and not launch.overlap


@pytest.mark.parametrize("m, n, blocks", [(1, 1, 1), (1, 256, 1), (1, 257, 2), (17, 100, 7), (1000, 25600, 65536)])
def test_forced_simt_is_a_thread_per_output(m, n, blocks):
    gpu = RecordingBackend()
    dense_gemm_fp8w(gpu, load_kernel(gpu, "gemm", gemm_fp8.KERNEL), _p(0), _weight(n, 32), _p(2), m, n, 32, 0,
                    path="simt")
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == ("gemm", gemm_fp8.SIMT)
    assert (launch.grid, launch.block, launch.shared_mem) == ((blocks, 1, 1), (256, 1, 1), 0)


@pytest.mark.parametrize("path", [None, "small", "simt"])
def test_a_plan_is_the_launch_the_launcher_makes(path):
    gpu = RecordingBackend()
    kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
    w = _weight(257, 96)
    dense_gemm_fp8w(gpu, kern, _p(0), w, _p(2), 40, 257, 96, 4, path=path)
    prepared = plan_fp8w_gemm(gpu, kern, _p(0), w, _p(2), 40, 257, 96, path=path)
    overlapped = plan_fp8w_gemm(gpu, kern, _p(0), w, _p(2), 40, 257, 96, path=path, overlap=True)
    assert prepared is not None and overlapped is not None
    prepared.run(4)
    overlapped.run(4)
    direct, planned, overlap = gpu.launches
    assert planned == direct and not direct.overlap
    assert overlap.overlap and (overlap.grid, overlap.args) == (direct.grid, direct.args)


@pytest.mark.parametrize("m, n, k", [(0, 8, 32), (4, 0, 32), (4, 8, 0), (0, 0, 0)])
def test_zero_sizes_launch_nothing(m, n, k):
    gpu = RecordingBackend()
    kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
    dense_gemm_fp8w(gpu, kern, _p(0), _weight(n, k), _p(2), m, n, k, 0)
    assert plan_fp8w_gemm(gpu, kern, _p(0), _weight(n, k), _p(2), m, n, k) is None
    assert gpu.launches == [] and gpu.ops == []


def test_a_repeated_launch_reuses_its_prepared_launch(monkeypatch):
    monkeypatch.setattr(gemm_fp8, "_LAUNCHES", {})
    prepared = []
    through = gemm_fp8._prepare
    monkeypatch.setattr(gemm_fp8, "_prepare", lambda *a: (prepared.append(a[2:]), through(*a))[1])
    gpu = RecordingBackend()
    kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
    w, other_scale = _weight(64, 64), _weight(64, 64, scale=0x500000)
    calls = [(_p(0), w, None), (_p(0), w, None), (_p(3), w, None), (_p(0), other_scale, None), (_p(0), w, "simt")]
    for a, weight, path in calls:
        dense_gemm_fp8w(gpu, kern, a, weight, _p(2), 5, 64, 64, 0, path=path)
    assert len(prepared) == 4 and len(gpu.launches) == 5  # the second call is the first one's launch
    assert [launch.args[:3] for launch in gpu.launches] == [
        [int(a), int(weight.weight), int(weight.scale)] for a, weight, _ in calls]
    other = RecordingBackend()  # the same operands on another backend: a launch of its own
    dense_gemm_fp8w(other, load_kernel(other, "gemm", gemm_fp8.KERNEL), _p(0), w, _p(2), 5, 64, 64, 0)
    assert len(prepared) == 5 and other.launches[0].args == gpu.launches[0].args


# -- CPU: bad input, refused before any launch ---------------------------------------------------------
def _plan(gpu, kernel, a, w, c, m, n, k, stream, **kwargs):
    """``plan_fp8w_gemm`` called as the launcher is (its stream unused), then run."""
    prepared = plan_fp8w_gemm(gpu, kernel, a, w, c, m, n, k, **kwargs)
    assert prepared is not None
    prepared.run(stream)


def _foreign(closed: bool) -> BlockFp8Weight:
    rng = np.random.default_rng(0)
    weight = BlockFp8Weight.from_numpy(RecordingBackend(), weight_bytes(rng, (8, 32)), scale_bytes(rng, 8, 32))
    if closed:
        weight.close()
    return weight


REFUSALS = {  # name -> (error, match, a, w (or a maker), c, m, n, k, keywords)
    "dense-weight": (TypeError, "w must be a BlockFp8Weight, got DenseWeight",
                     _p(0), DenseWeight(_p(1), (8, 32), FP8), _p(2), 4, 8, 32, {}),
    "host-array": (TypeError, "w must be a BlockFp8Weight, got ndarray",
                   _p(0), np.zeros((8, 32), U8), _p(2), 4, 8, 32, {}),
    "w-shape": (ValueError, r"w shape \(8, 64\), expected \(n, k\) = \(8, 32\)", _p(0), _weight(8, 64), _p(2),
                4, 8, 32, {}),
    "w-rows": (ValueError, r"w shape \(9, 32\)", _p(0), _weight(9, 32), _p(2), 4, 8, 32, {}),
    "k-not-whole-blocks": (ValueError, r"w shape \(8, 32\), expected \(n, k\) = \(8, 40\)", _p(0), _weight(8, 32),
                           _p(2), 4, 8, 40, {}),
    "closed": (ClosedError, "dense_gemm_fp8w: the weight is closed", _p(0), lambda: _foreign(True), _p(2),
               4, 8, 32, {}),
    "foreign": (ValueError, "dense_gemm_fp8w: the weight is on another backend", _p(0), lambda: _foreign(False),
                _p(2), 4, 8, 32, {}),
    "null-a": (ValueError, "dense_gemm_fp8w a: null", DevicePtr(0), _weight(8, 32), _p(2), 4, 8, 32, {}),
    "null-c": (ValueError, "dense_gemm_fp8w c: null", _p(0), _weight(8, 32), DevicePtr(0), 4, 8, 32, {}),
    "null-w": (ValueError, "dense_gemm_fp8w w.weight: null", _p(0), _weight(8, 32, ptr=0), _p(2), 4, 8, 32, {}),
    "null-scale": (ValueError, "dense_gemm_fp8w w.scale: null", _p(0), _weight(8, 32, scale=0), _p(2),
                   4, 8, 32, {}),
    "a-list": (TypeError, "a must be an int, got list", [0x100000], _weight(8, 32), _p(2), 4, 8, 32, {}),
    "path": (ValueError, r"unknown path 'tiled'; one of \('small', 'simt'\)", _p(0), _weight(8, 32), _p(2),
             4, 8, 32, {"path": "tiled"}),
    "m-float": (TypeError, "dense_gemm_fp8w m must be an int, got float", _p(0), _weight(8, 32), _p(2),
                4.0, 8, 32, {}),
    "m-negative": (ValueError, r"dense_gemm_fp8w m must be in 0\.\.2\*\*31-1, got -1", _p(0), _weight(8, 32),
                   _p(2), -1, 8, 32, {}),
    "m-too-large": (ValueError, r"dense_gemm_fp8w m must be in 0\.\.2\*\*31-1", _p(0), _weight(8, 32), _p(2),
                    2**31, 8, 32, {}),
}


@pytest.mark.parametrize("launcher", [dense_gemm_fp8w, _plan], ids=["launch", "plan"])
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_operands_are_refused_before_any_launch(launcher, case):
    error, match, a, w, c, m, n, k, kwargs = REFUSALS[case]
    assert_refused(launcher, gemm_fp8.KERNEL, error, match, a, w() if callable(w) else w, c, m, n, k, 0, **kwargs)


def test_a_null_kernel_and_a_bad_overlap_are_refused():
    gpu = RecordingBackend()
    for launcher in (dense_gemm_fp8w, _plan):
        with pytest.raises(ValueError, match="dense_gemm_fp8w: kernel not loaded"):
            launcher(gpu, KernelHandle(0), _p(0), _weight(8, 32), _p(2), 4, 8, 32, 0)
    kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
    with pytest.raises(TypeError, match="overlap"):
        plan_fp8w_gemm(gpu, kern, _p(0), _weight(8, 32), _p(2), 4, 8, 32, overlap=1)
    assert gpu.launches == [] and gpu.ops == []


# -- CPU: BlockFp8Weight ---------------------------------------------------------------------------------
@pytest.mark.parametrize("wtype", [U8, FP8])
@pytest.mark.parametrize("stype", [U8, E8M0])
def test_from_numpy_uploads_the_bytes_it_is_given(rng, wtype, stype):
    gpu = RecordingBackend()
    w, s = weight_bytes(rng, (33, 64)), scale_bytes(rng, 33, 64, 0, 254)
    weight = BlockFp8Weight.from_numpy(gpu, w.view(wtype), s.view(stype), stream=7)
    (_, wptr, wn), (_, wdata, wdst, wstream), (_, sptr, sn), (_, sdata, sdst, sstream) = gpu.ops
    assert (wn, wdata, wdst, wstream) == (33 * 64, w.tobytes(), wptr, 7)
    assert (sn, sdata, sdst, sstream) == (2 * 2, s.tobytes(), sptr, 7)
    assert (weight.weight, weight.scale, weight.gpu) == (wptr, sptr, gpu)
    assert weight.shape == (33, 64) and (weight.rows, weight.cols) == (33, 64) and weight.dtype == FP8
    assert (weight.nbytes, weight.scale_shape, weight.scale_nbytes) == (33 * 64, (2, 2), 4)


def test_from_numpy_takes_non_contiguous_arrays(rng):
    gpu = RecordingBackend()
    w, s = weight_bytes(rng, (40, 128)), scale_bytes(rng, 40, 64)
    BlockFp8Weight.from_numpy(gpu, w[:, ::2], s)  # every other column: a strided view
    assert gpu.ops[1][1] == np.ascontiguousarray(w[:, ::2]).tobytes()


@pytest.mark.parametrize("weight, scale, error, match", [
    (np.zeros((8, 32), BF16), np.zeros((1, 1), U8), TypeError, "weight dtype must be float8_e4m3fn or uint8, got bfloat16"),
    (np.zeros((8, 32), U8), np.zeros((1, 1), np.float32), TypeError,
     "scale dtype must be float8_e8m0fnu or uint8, got float32"),
    (np.zeros(32, U8), np.zeros((1, 1), U8), ValueError, r"non-empty 2-D array, got shape \(32,\)"),
    (np.zeros((0, 32), U8), np.zeros((0, 1), U8), ValueError, r"non-empty 2-D array, got shape \(0, 32\)"),
    (np.zeros((8, 40), U8), np.zeros((1, 1), U8), ValueError, r"cols \(k\) = 40 is not a multiple of 32"),
    (np.zeros((33, 64), U8), np.zeros((1, 2), U8), ValueError, r"scale shape \(1, 2\) != \(2, 2\)"),
    (np.zeros((33, 64), U8), np.zeros((2, 2, 1), U8), ValueError, r"scale shape \(2, 2, 1\) != \(2, 2\)"),
])
def test_from_numpy_refuses_wrong_dtypes_and_shapes(weight, scale, error, match):
    gpu = RecordingBackend()
    with pytest.raises(error, match=match):
        BlockFp8Weight.from_numpy(gpu, weight, scale)
    assert gpu.ops == []


def test_from_numpy_names_the_first_nan_scale_block(rng):
    gpu = RecordingBackend()
    w, s = weight_bytes(rng, (100, 128)), scale_bytes(rng, 100, 128, 0, 254)
    s[3, 1] = s[2, 3] = 255
    with pytest.raises(ValueError, match=r"scale\[2, 3\] is 255 \(e8m0 NaN\): the block of rows 64\.\. and columns 96\.\."):
        BlockFp8Weight.from_numpy(gpu, w, s.view(E8M0))
    assert gpu.ops == []


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_from_numpy_names_the_first_nan_weight_byte(rng, byte):
    gpu = RecordingBackend()
    w, s = weight_bytes(rng, (100, 128)), scale_bytes(rng, 100, 128)
    w[70, 5] = w[71, 0] = byte
    with pytest.raises(ValueError, match=rf"weight\[70, 5\] is the byte 0x{byte:02x} \(e4m3 NaN\)"):
        BlockFp8Weight.from_numpy(gpu, w.view(FP8), s)
    assert gpu.ops == []


def test_a_bare_weight_checks_its_shape_and_alignment():
    assert _weight(0, 0).shape == (0, 0)  # nothing to launch, as a zero-size GEMM
    assert BlockFp8Weight(DevicePtr(0x1000), DevicePtr(0x2001), [np.int64(3), 64]).shape == (3, 64)
    with pytest.raises(ValueError, match=r"BlockFp8Weight: cols \(k\) = 48 is not a multiple of 32"):
        _weight(8, 48)
    with pytest.raises(ValueError, match="BlockFp8Weight: weight address 0x200008 is not 16-byte aligned"):
        _weight(8, 32, ptr=0x200008)
    with pytest.raises(ValueError, match=r"shape must be \(rows, cols\), got 8"):
        BlockFp8Weight(DevicePtr(0x1000), DevicePtr(0x2000), 8)
    with pytest.raises(ValueError, match=r"BlockFp8Weight: rows must be in 0\.\.2\*\*31-1, got -1"):
        _weight(-1, 32)
    with pytest.raises(TypeError, match="BlockFp8Weight: weight must be an int, got str"):
        BlockFp8Weight("0x1000", DevicePtr(0x2000), (8, 32))
    with pytest.raises(TypeError, match="BlockFp8Weight: gpu must be a GpuBackend"):
        BlockFp8Weight(DevicePtr(0x1000), DevicePtr(0x2000), (8, 32), gpu="cuda")


def test_owning_checks_the_buffers_and_the_shape():
    gpu = RecordingBackend()
    w, s = DeviceBuffer(gpu, 65 * 96), DeviceBuffer(gpu, 4)
    with pytest.raises(ValueError, match="weight buffer of 6240 bytes, the shape needs 6336"):
        BlockFp8Weight.owning(gpu, w, s, (66, 96))
    with pytest.raises(ValueError, match="scale buffer of 4 bytes, the shape needs 9"):
        BlockFp8Weight.owning(gpu, w, s, (65, 96))
    with pytest.raises(TypeError, match="scale must be a DeviceBuffer, got DevicePtr"):
        BlockFp8Weight.owning(gpu, w, s.ptr, (64, 64))
    with pytest.raises(ValueError, match=r"BlockFp8Weight.owning: rows must be in 1\.\.2\*\*31-1, got 0"):
        BlockFp8Weight.owning(gpu, w, s, (0, 64))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        BlockFp8Weight.owning(gpu, w, s, (64, 16))
    weight = BlockFp8Weight.owning(gpu, w, s, (64, 64))
    assert weight.buffers == (w, s) and (weight.weight, weight.scale) == (w.ptr, s.ptr)


def test_close_frees_both_buffers_once_and_a_with_block_closes(rng):
    gpu = RecordingBackend()
    with BlockFp8Weight.from_numpy(gpu, weight_bytes(rng, (40, 64)), scale_bytes(rng, 40, 64)) as weight:
        assert not weight.closed and weight.gpu is gpu
        weight.check_on(gpu, "x")
        with pytest.raises(ValueError, match="x: the weight is on another backend than the launch"):
            weight.check_on(RecordingBackend(), "x")
        wptr, sptr = int(weight.weight), int(weight.scale)
    assert weight.closed and weight.gpu is None
    assert [op for op in gpu.ops if op[0] == "free"] == [("free", sptr), ("free", wptr)]
    weight.close()  # again: nothing
    assert len([op for op in gpu.ops if op[0] == "free"]) == 2
    with pytest.raises(ClosedError, match="x: the weight is closed"):
        weight.check_on(gpu, "x")
    bare = _weight(8, 32)
    bare.check_on(gpu, "x")  # names no backend: passes
    bare.close()
    assert not bare.closed


# -- GPU ---------------------------------------------------------------------------------------------------
def run_fp8w(gpu, rng, a: np.ndarray, w: np.ndarray, s: np.ndarray, *, path: str | None = None) -> np.ndarray:
    """c = a @ W^T through the launcher with guarded, poisoned buffers; checks the guards and that
    the inputs are untouched."""
    (m, k), n = a.shape, w.shape[0]
    kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
    with Guarded(gpu, (m, k), BF16, rng) as ga, Guarded(gpu, (n, k), U8, rng) as gw, \
         Guarded(gpu, s.shape, U8, rng) as gs, Guarded(gpu, (m, n), BF16, rng) as gc:
        ga.upload(a)
        gw.upload(w)
        gs.upload(s)
        gc.poison()
        dense_gemm_fp8w(gpu, kern, ga.ptr, BlockFp8Weight(gw.ptr, gs.ptr, (n, k)), gc.ptr, m, n, k, 0, path=path)
        got = gc.read()
        for guarded in (gc, ga, gw, gs):
            guarded.assert_guards_intact()
        np.testing.assert_array_equal(bits(ga.read()), bits(a))
        np.testing.assert_array_equal(gw.read(), w)
        np.testing.assert_array_equal(gs.read(), s)
    return got


def exact_operands(rng: np.random.Generator, m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """a integers in [-8, 8]; w e4m3 integers in [-8, 8]; scales 2^-2 .. 2^2 per block: every
    product a multiple of 2^-2 below 2^8, every partial sum exact in fp32 for k <= 2^14."""
    a = rng.integers(-8, 9, (m, k)).astype(np.float32).astype(BF16)
    w = rng.integers(-8, 9, (n, k)).astype(np.float32).astype(FP8).view(U8)
    return a, w, scale_bytes(rng, n, k, 125, 129)


PATHS = [None, "simt"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k", [32, 64, 96, 4096, 6144])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 100, 257])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 32, 33, 64, 100])
def test_matches_the_bf16_gemm_over_the_dequantised_weight(gpu, rng, m, n, k, path):
    a, w, s = random_bf16(rng, (m, k)), weight_bytes(rng, (n, k)), scale_bytes(rng, n, k)
    check_gemm(a, reference(w, s), run_fp8w(gpu, rng, a, w, s, path=path))


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m, n, k", [(1, 33, 4096), (3, 257, 6144), (17, 100, 96), (33, 64, 64), (100, 257, 4096)])
def test_exact_sums_are_bit_exact(gpu, rng, m, n, k, path):
    a, w, s = exact_operands(rng, m, n, k)
    np.testing.assert_array_equal(bits(run_fp8w(gpu, rng, a, w, s, path=path)), bits(gemm_bf16(a, reference(w, s))))


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_a_scale_applied_one_block_off_is_caught(gpu, rng, path):
    """A scale per (32-row, 32-k) block, each block's differing from its neighbours' in both
    directions: a kernel that read the scale of the next or the previous block (in k or in n), or
    swapped the two indices, gets another answer than the reference (checked here), bit for bit."""
    m, n, k = 17, 257, 256
    a, w, _ = exact_operands(rng, m, n, k)
    rows, cols = np.indices((-(-n // 32), k // 32))
    s = (125 + (rows + 2 * cols) % 5).astype(U8)  # neighbours in either direction differ
    want = bits(gemm_bf16(a, reference(w, s)))
    square = s[:, : s.shape[0]]
    for wrong in (np.roll(s, 1, axis=1), np.roll(s, -1, axis=1), np.roll(s, 1, axis=0), np.roll(s, -1, axis=0)):
        assert (bits(gemm_bf16(a, reference(w, wrong))) != want).any()
    assert not np.array_equal(square, square.T)
    np.testing.assert_array_equal(bits(run_fp8w(gpu, rng, a, w, s, path=path)), want)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_rows_do_not_depend_on_m(gpu, rng, path):
    """Batch invariance: rows of an m = 100 call equal, bit for bit, the same rows computed in
    calls of m = 1 and m = 17 (other positions in the work items and other n8-tile counts). The
    weight's second half of k repeats its first, and in the even rows of a the second half negates
    the first: their exact sums are 0 and what the kernel returns is its fp32 rounding, which any
    other order of the sums changes."""
    m, n, k = 100, 1000, 6144
    w, s = weight_bytes(rng, (n, k // 2)), scale_bytes(rng, n, k // 2)
    w, s = np.concatenate([w, w], axis=1), np.concatenate([s, s], axis=1)
    a = random_bf16(rng, (m, k))
    a[::2, k // 2 :] = -a[::2, : k // 2]
    whole = run_fp8w(gpu, rng, a, w, s, path=path)
    for lo, m in ((0, 1), (1, 1), (36, 1), (37, 1), (98, 1), (99, 1), (0, 17), (40, 17), (83, 17)):
        part = run_fp8w(gpu, rng, np.ascontiguousarray(a[lo : lo + m]), w, s, path=path)
        np.testing.assert_array_equal(bits(part), bits(whole[lo : lo + m]), err_msg=f"rows {lo}..{lo + m - 1}")


def _expected_classes(a: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For bf16 a (no zeros) and the bf16 weight (infinities where the scale overflows it):
    (checked, kind, finite reference, S). ``kind`` is 0 (finite), 1 (+inf), -1 (-inf) or 2 (NaN, inf
    products of both signs): IEEE's answer for any order of the sums wherever the finite products'
    sum S = sum |a w| stays below 2^126 (no fp32 product or partial sum can overflow); elsewhere
    the order decides, unchecked."""
    a64, w64 = a.astype(np.float64), weight.astype(np.float64)
    pinf, ninf = (w64 == np.inf).astype(np.float64), (w64 == -np.inf).astype(np.float64)
    apos, aneg = (a64 > 0).astype(np.float64), (a64 < 0).astype(np.float64)
    up, down = apos @ pinf.T + aneg @ ninf.T, apos @ ninf.T + aneg @ pinf.T  # +inf and -inf products
    finite = np.where(np.isinf(w64), 0.0, w64)
    total = np.abs(a64) @ np.abs(finite).T
    kind = np.where((up > 0) & (down > 0), 2, np.where(up > 0, 1, np.where(down > 0, -1, 0)))
    with np.errstate(over="ignore"):  # (past f32 where unchecked)
        exact = (a64 @ finite.T).astype(np.float32).astype(BF16).astype(np.float64)
    return total < 2.0**126, kind, exact, total


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k", [32, 96])
def test_every_scale_byte_including_the_extremes(gpu, rng, k, path):
    """Each k-block column of the scales holds every byte 0..254 once (0: the subnormal 2^-127;
    above 134 the kernel scales twice; 247 and up overflow the larger weights to inf), and row i
    of a is +-[0.5, 2) * 2^(15 i - 120) (normal bf16 numbers), so every block is summed by rows
    whose products are normal fp32 numbers. Finite results within check_gemm's tolerance, and inf
    / NaN where IEEE puts them, wherever no fp32 sum can overflow."""
    m, n = 17, 255 * 32
    s = np.stack([rng.permutation(255) for _ in range(k // 32)], axis=1).astype(U8)
    w = weight_bytes(rng, (n, k))
    a = rng.uniform(0.5, 2.0, (m, k)) * rng.choice([-1.0, 1.0], (m, k)) * 2.0 ** (15 * np.arange(m) - 120)[:, None]
    a = a.astype(np.float32).astype(BF16)
    weight = reference(w, s)
    got = run_fp8w(gpu, rng, a, w, s, path=path).astype(np.float64)
    checked, kind, exact, total = _expected_classes(a, weight)
    assert checked.mean() > 0.5 and (kind[checked] == 1).any() and (kind[checked] == 2).any()
    for want, has in ((1, got == np.inf), (-1, got == -np.inf), (2, np.isnan(got))):
        np.testing.assert_array_equal(has[checked], (kind == want)[checked], err_msg=f"class {want}")
    fin = checked & (kind == 0)
    tol = 2 * bf16_ulp(exact) + 2 * k * 2.0**-23 * total + k * 2.0**-126  # (+ products below fp32's normals)
    with np.errstate(invalid="ignore"):  # (inf - inf where not finite)
        bad = fin & ~(np.abs(got - exact) <= tol)
    assert not bad.any(), f"{bad.sum()} of {fin.sum()} outside tolerance, first at {np.argwhere(bad)[0]}"


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(16, 300, 256), (100, 257, 96)])
@pytest.mark.parametrize("grid, block, smem", [
    ((1, 1, 1), (256, 1, 1), "plan"),     # one CTA loops over every work item
    ((7, 3, 2), (256, 1, 1), "plan"),     # a 3-D grid, unrelated to the work
    ((5, 1, 1), (128, 1, 1), 0),          # another block size: scalar fallback
    ((3, 1, 1), (256, 1, 1), 0),          # no shared memory: scalar fallback
    ((3, 1, 1), (256, 1, 1), 65536),      # too little shared memory: scalar fallback
    ((2, 1, 1), (32, 2, 2), 1024),
])
def test_the_small_kernel_is_correct_for_any_launch(gpu, rng, m, n, k, grid, block, smem):
    """Launched as given, on exact-sum data: bit-exact whichever path the launch shape takes."""
    a, w, s = exact_operands(rng, m, n, k)
    kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
    with Guarded(gpu, (m, k), BF16, rng) as ga, Guarded(gpu, (n, k), U8, rng) as gw, \
         Guarded(gpu, s.shape, U8, rng) as gs, Guarded(gpu, (m, n), BF16, rng) as gc:
        ga.upload(a)
        gw.upload(w)
        gs.upload(s)
        gc.poison()
        config = LaunchConfig(grid, block, gemm_fp8.SMEM if smem == "plan" else smem)
        gpu.bind(kern).launch(config, 0, ga.ptr, gw.ptr, gs.ptr, gc.ptr, m, n, k)
        got = gc.read()
        gc.assert_guards_intact()
    np.testing.assert_array_equal(bits(got), bits(gemm_bf16(a, reference(w, s))))


@pytest.mark.gpu
def test_a_prepared_overlapped_launch(gpu, rng):
    """``plan_fp8w_gemm(overlap=True)``: a programmatic dependent launch, run twice."""
    a, w, s = exact_operands(rng, 9, 100, 4096)
    kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
    with BlockFp8Weight.from_numpy(gpu, w, s) as weight, Guarded(gpu, a.shape, BF16, rng) as ga, \
         Guarded(gpu, (9, 100), BF16, rng) as gc:
        ga.upload(a)
        prepared = plan_fp8w_gemm(gpu, kern, ga.ptr, weight, gc.ptr, 9, 100, 4096, overlap=True)
        assert prepared is not None
        for _ in range(2):
            gc.poison()
            prepared.run(0)
            np.testing.assert_array_equal(bits(gc.read()), bits(gemm_bf16(a, reference(w, s))))
        gc.assert_guards_intact()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
def test_real_dims(gpu, rng, m):
    """Engram's wkv at its size (25600 x 6144), uploaded by ``from_numpy``: every output written,
    4096 of them, sampled, within the tolerance of a float64 reference."""
    n, k = 25600, 6144
    a, w, s = random_bf16(rng, (m, k)), weight_bytes(rng, (n, k)), scale_bytes(rng, n, k)
    kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
    with BlockFp8Weight.from_numpy(gpu, w.view(FP8), s) as weight, Guarded(gpu, (m, k), BF16, rng) as ga, \
         Guarded(gpu, (m, n), BF16, rng) as gc:
        ga.upload(a)
        gc.poison()
        dense_gemm_fp8w(gpu, kern, ga.ptr, weight, gc.ptr, m, n, k, 0)
        got = gc.read().astype(np.float64)
        gc.assert_guards_intact()
    assert np.isfinite(got).all(), f"{(~np.isfinite(got)).sum()} outputs unwritten (poisoned) or not finite"
    rows, cols = rng.integers(0, m, 4096), rng.integers(0, n, 4096)
    wrows = dequant_rows(w[cols], s[cols // 32], 32).astype(np.float64)
    products = a[rows].astype(np.float64) * wrows
    exact = products.sum(axis=1)
    ref = exact.astype(np.float32).astype(BF16).astype(np.float64)
    tol = 2 * bf16_ulp(ref) + 2 * k * 2.0**-23 * np.abs(products).sum(axis=1)
    err = np.abs(got[rows, cols] - ref)
    assert (err <= tol).all(), f"{(err > tol).sum()} of 4096 outside tolerance, worst {np.max(err / tol)}"
