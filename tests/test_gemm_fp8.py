"""gemm.cu's fp8-weight GEMM (``layers.ops.gemm_fp8``) against the bf16 reference over the
dequantised weight, ``gemm_bf16(a, dequant_weight(w, scale, 32, bfloat16))``; ``BlockFp8Weight``'s
checks and ownership and the launcher's plans (a launch per 64 rows of a, k cut in slabs whose
partial sums meet in a workspace) and refusals on the CPU.

The kernels use each weight as that bf16 value, so the products and the fp32 sums are the bf16
GEMM's over it and ``test_gemm.check_gemm``'s tolerance (accumulation order) holds. Small-integer
data with small power-of-two scales make every partial sum exact: there the result must match bit
for bit (and a scale applied one block off changes it). Weight bytes are drawn over every non-NaN
e4m3 value (subnormals and zeros included). Every GPU call gets a workspace (``Workspace``),
checked after it: counters back to 0, exactly the partial sums of the launches over several slabs
written, nothing outside it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
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
from tests.helpers.fakes import RecordingBackend, refused
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
    """e8m0 bytes ``[ceil(n / 32), k / 32]`` in ``lo..hi``. The default range holds bytes past 134,
    which the kernel scales in two products (a warp whose item has one takes that loop), and
    items without one: both of its chunk loops run (``exact_operands`` takes the one-product loop)."""
    return rng.integers(lo, hi + 1, (-(-n // 32), k // 32), dtype=np.uint8)


def reference(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The weight as the kernels use it: bf16 ``[n, k]``."""
    return dequant_weight(w, s, 32, BF16)


# -- CPU: launch plans ---------------------------------------------------------------------------
def test_launcher_constants_mirror_the_kernel():
    cu = _cu_constants()
    assert (cu["kFp8Block"], cu["kFp8MaxRows"], cu["kFp8Chunk"], cu["kFp8RingBytes"], cu["kFp8MaxSlab"]) == (
        gemm_fp8.BLOCK, gemm_fp8.MAX_ROWS, gemm_fp8.CHUNK, gemm_fp8.RING_BYTES, gemm_fp8.MAX_SLAB)
    assert cu["kThreads"] == gemm_fp8.THREADS == 256 and gemm_fp8.SMEM_OPTIN == MAX_SHARED_OPTIN
    source = re.sub(r"\s+", " ", (kernel_dir() / "gemm.cu").read_text())
    for text in ("return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8;",  # fp8w_nt: tiles()
                 "fp8w_pitch(uint32_t ks) { return ks * 2 + 16; }",  # pitch()
                 "return kFp8RingBytes + nt * 8 * fp8w_pitch(ks);",  # fp8w_smem: smem()
                 "dense_gemm_fp8w(const bf16* a,", "dense_gemm_fp8w_simt(const bf16* a,"):
        assert text in source, text
    assert [gemm_fp8.tiles(m) for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [1, 1, 2, 2, 4, 4, 8, 8]
    assert (gemm_fp8.pitch(1024), gemm_fp8.smem(9, 64), gemm_fp8.smem(64, 1024)) == (2064, 98304 + 16 * 144, 230400)
    for k in (32, 96, 160, 1024, 1056, 4096, 6144, 8192, 25600):
        for rows in (1, 8, 9, 16, 17, 32, 33, 64):
            assert gemm_fp8.smem(rows, gemm_fp8.slab_k(k, rows)) <= MAX_SHARED_OPTIN, (k, rows)


PARTIALS_AT = {1: 256, 100: 256, 257: 256, 2048: 256, 2049: 512, 25600: 3328}  # n -> round_up(ceil(n/32)*4, 256)


@pytest.mark.parametrize("name", [gemm_fp8.KERNEL, gemm_fp8.SIMT])
def test_each_kernel_parameter_gets_the_value_of_its_name(name):
    """Arguments go by position: a swap of two pointers or two sizes would launch garbage. k =
    8256 takes two slabs of 4160 at 3 rows: work and counters are the workspace's."""
    gpu = RecordingBackend()
    values = dict(a=_p(0), w=DevicePtr(0x200000), ws=DevicePtr(0x400000), c=_p(2), m=3, n=100, k=8256, ks=4160,
                  work=_p(5) + 256, counters=_p(5))
    dense_gemm_fp8w(gpu, load_kernel(gpu, "gemm", gemm_fp8.KERNEL), values["a"], _weight(100, 8256), values["c"],
                    3, 100, 8256, 5, workspace=_p(5), path="simt" if name == gemm_fp8.SIMT else None)
    (launch,) = gpu.launches
    signature = parse_signatures((kernel_dir() / "gemm.cu").read_text())[name]
    kinds = "PPPPUUU" if name == gemm_fp8.SIMT else "PPPPUUUUPP"
    assert gpu.kernel_of(launch) == ("gemm", name) and launch.kinds == signature.kinds == kinds
    assert launch.args == [int(values[p.name]) for p in signature] and launch.stream == 5


# (rows up to, slab, slabs, shared memory) of a launch at k = 6144 on a 227 KiB device
PLAN_6144 = [(8, 6144, 1, 196736), (16, 3072, 2, 196864), (32, 2048, 3, 229888), (64, 1024, 6, 230400)]


@pytest.mark.parametrize("n", [1, 100, 25600])
@pytest.mark.parametrize("m", [1, 9, 17, 33, 64, 65, 1000])
def test_a_plan_is_a_launch_per_64_rows(m, n):
    """Launch r takes rows 64 r .. 64 r + 63 of a and c, over slabs as wide as its rows' shared
    memory allows (k = 6144: 1, 2, 3 or 6 of them), with a CTA per (slab, 32 rows of w) item but at
    most one per SM (``sm_count``, else 132), 256 threads, ``smem(rows, ks)``; the workspace's
    counters (at it) and partial sums (past the counters, 256-byte aligned) only where it has
    several slabs, else null."""
    k, ws = 6144, _p(5)
    told = RecordingBackend()
    told.sm_count = 7  # a backend that says how many SMs its device has
    for gpu, sms in ((RecordingBackend(), SMS), (told, 7)):
        kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
        w = _weight(n, k)
        dense_gemm_fp8w(gpu, kern, _p(0), w, _p(2), m, n, k, 0, workspace=ws)
        assert len(gpu.launches) == -(-m // 64)
        for r, launch in enumerate(gpu.launches):
            rows = min(64, m - 64 * r)
            ks, slabs, smem = next((ks, slabs, smem) for most, ks, slabs, smem in PLAN_6144 if rows <= most)
            assert launch.kernel == kern and launch.block == (256, 1, 1) and not launch.overlap
            assert launch.grid == (min(sms, slabs * -(-n // 32)), 1, 1) and launch.shared_mem == smem
            work, counters = (ws + PARTIALS_AT[n], ws) if slabs > 1 else (0, 0)
            assert launch.args == [_p(0) + r * 64 * k * 2, w.weight, w.scale, _p(2) + r * 64 * n * 2, rows, n, k, ks,
                                   work, counters]


@pytest.mark.parametrize("m, rows", [(1, [1]), (9, [9]), (17, [17]), (33, [33]), (64, [64]), (65, [64, 1]),
                                     (100, [64, 36])])
def test_batch_invariance_takes_the_slab_of_64_rows_for_every_m(m, rows):
    """``batch_invariant=True``: every launch sums over the slabs of 64 rows (1024 at k = 6144), so
    a row's sums are in the same order whatever m; shared memory still that of its rows."""
    gpu, k, n, ws = RecordingBackend(), 6144, 100, _p(5)
    smem = {1: 114816, 9: 131328, 17: 164352, 33: 230400, 36: 230400, 64: 230400}  # 98304 + 8 tiles 2064
    dense_gemm_fp8w(gpu, load_kernel(gpu, "gemm", gemm_fp8.KERNEL), _p(0), _weight(n, k), _p(2), m, n, k, 0,
                    workspace=ws, batch_invariant=True)
    assert [launch.args[4] for launch in gpu.launches] == rows
    for launch in gpu.launches:
        assert launch.args[5:] == [n, k, 1024, ws + 256, ws] and launch.grid == (24, 1, 1)
        assert launch.shared_mem == smem[launch.args[4]]


@pytest.mark.parametrize("k, rows, ks", [
    (32, 1, 64), (96, 64, 128), (160, 64, 192), (1024, 64, 1024), (1056, 64, 576), (4096, 64, 1024),
    (4096, 16, 4096), (4096, 17, 2048), (6144, 1, 6144), (6144, 9, 3072), (8192, 8, 8192), (8224, 8, 4160),
    (25600, 1, 6400), (25600, 64, 1024),
])
def test_a_slab_is_the_widest_the_shared_memory_holds_then_split_evenly(k, rows, ks):
    assert gemm_fp8.slab_k(k, rows) == gemm_fp8.slab_k(k, rows, MAX_SHARED_OPTIN) == ks


def test_slabs_are_as_few_as_fit_and_even():
    """For every k (multiples of 32 up to 3 * 8192) and rows: ks a multiple of 64, at most 8192
    and within the shared memory; as few slabs as the widest slab allows; no slab wider than
    needed (ks - 64 would take another slab)."""
    for optin in (MAX_SHARED_OPTIN, 166912):
        for rows in (1, 9, 17, 33):
            widest = max(w for w in range(64, 8193, 64) if gemm_fp8.smem(rows, w) <= optin)
            for k in range(32, 3 * 8192 + 1, 32):
                ks = gemm_fp8.slab_k(k, rows, optin)
                slabs = -(-k // ks)
                assert ks % 64 == 0 and ks <= widest and slabs == -(-k // widest), (optin, rows, k, ks)
                assert ks == 64 or -(-k // (ks - 64)) > slabs, (optin, rows, k, ks)


def test_a_device_of_less_shared_memory_takes_narrower_slabs():
    """``max_shared_optin`` (163 KiB here) sets the slabs: k = 6144 takes 2 at one row, 12 at 64;
    a device too small for a slab of 64 k is refused."""
    gpu = RecordingBackend()
    gpu.max_shared_optin = 166912
    kern, k, n, ws = load_kernel(gpu, "gemm", gemm_fp8.KERNEL), 6144, 100, _p(5)
    assert gemm_fp8.workspace_bytes(n, k, 166912) == 256 + 12 * 64 * n * 4
    with refused(gpu, ValueError, "k = 6144 takes 2 slabs: give a workspace of 307456 bytes"):
        dense_gemm_fp8w(gpu, kern, _p(0), _weight(n, k), _p(2), 1, n, k, 0)
    for m, ks, smem in ((1, 3072, 98304 + 8 * 6160), (64, 512, 98304 + 64 * 1040)):
        dense_gemm_fp8w(gpu, kern, _p(0), _weight(n, k), _p(2), m, n, k, 0, workspace=ws)
        assert gpu.launches[-1].args[7:] == [ks, ws + 256, ws] and gpu.launches[-1].shared_mem == smem
    assert gemm_fp8.slab_k(64, 64, 98304 + 64 * 144) == 64
    with pytest.raises(ValueError, match="dense_gemm_fp8w: 107519 bytes of shared memory hold no slab of 64 rows"):
        gemm_fp8.slab_k(64, 64, 98304 + 64 * 144 - 1)


@pytest.mark.parametrize("n, k, nbytes", [
    (100, 1024, 0), (100, 96, 0), (100, 1056, 256 + 2 * 64 * 100 * 4), (1, 4096, 256 + 4 * 64 * 4),
    (2048, 2048, 256 + 2 * 64 * 2048 * 4), (2049, 2048, 512 + 2 * 64 * 2049 * 4),
    (25600, 6144, 3328 + 6 * 64 * 25600 * 4),
])
def test_the_workspace_holds_the_counters_then_the_partials_of_64_rows(n, k, nbytes):
    """``ceil(n / 32)`` u32 counters padded to 256 bytes, then ``[slabs][64][n]`` fp32 (the slabs
    of 64 rows: the most any launch takes); nothing where one slab always does."""
    assert gemm_fp8.workspace_bytes(n, k) == gemm_fp8.workspace_bytes(n, k, MAX_SHARED_OPTIN) == nbytes


@pytest.mark.parametrize("offset", [1, 2, 3, 6])
def test_a_workspace_off_4_byte_alignment_is_refused(offset):
    """The counters and sums are 32-bit: a workspace address off 4-byte alignment is refused before
    any launch, by both launchers."""
    for launcher in (dense_gemm_fp8w, _plan):
        assert_refused(launcher, gemm_fp8.KERNEL, ValueError, "the workspace must be 4-byte aligned", _p(0),
                       _weight(100, 6144), _p(2), 9, 100, 6144, 0, workspace=int(_p(5)) + offset)


@pytest.mark.parametrize("m, k, batch_invariant, slabs, need", [
    (9, 6144, False, 2, 153856), (64, 4096, False, 4, 102656), (65, 6144, False, 6, 153856),
    (1000, 6144, False, 6, 153856), (1, 6144, True, 6, 153856), (1, 1056, True, 2, 51456),
])
def test_several_slabs_without_a_workspace_are_refused(m, k, batch_invariant, slabs, need):
    """A launch whose k takes several slabs needs the workspace: refused before any launch, the
    message naming ``workspace_bytes(n, k)``; one slab needs none."""
    for launcher in (dense_gemm_fp8w, _plan):
        assert_refused(launcher, gemm_fp8.KERNEL, ValueError, rf"k = {k} takes {slabs} slabs: give a workspace of "
                       rf"{need} bytes", _p(0), _weight(100, k), _p(2), m, 100, k, 0, batch_invariant=batch_invariant)
    gpu = RecordingBackend()
    dense_gemm_fp8w(gpu, load_kernel(gpu, "gemm", gemm_fp8.KERNEL), _p(0), _weight(100, 6144), _p(2), 8, 100, 6144, 0)
    assert gpu.launches[0].args[7:] == [6144, 0, 0]


@pytest.mark.parametrize("m, n, blocks", [(1, 1, 1), (1, 256, 1), (1, 257, 2), (17, 100, 7), (1000, 25600, 65536)])
def test_forced_simt_is_a_thread_per_output(m, n, blocks):
    gpu = RecordingBackend()
    dense_gemm_fp8w(gpu, load_kernel(gpu, "gemm", gemm_fp8.KERNEL), _p(0), _weight(n, 32), _p(2), m, n, 32, 0,
                    path="simt")
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == ("gemm", gemm_fp8.SIMT)
    assert (launch.grid, launch.block, launch.shared_mem) == ((blocks, 1, 1), (256, 1, 1), 0)


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("path, count", [(None, 2), ("fp8w", 2), ("simt", 1)])
def test_a_plan_is_the_launch_the_launcher_makes(path, count, batch_invariant):
    """``plan_fp8w_gemm``'s launches are ``dense_gemm_fp8w``'s (m = 100: two of the fp8w kernel);
    ``overlap=True`` makes the first of them a programmatic dependent launch, only the first."""
    gpu = RecordingBackend()
    kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
    w, kwargs = _weight(257, 6144), dict(workspace=_p(5), batch_invariant=batch_invariant, path=path)
    dense_gemm_fp8w(gpu, kern, _p(0), w, _p(2), 100, 257, 6144, 4, **kwargs)
    prepared = plan_fp8w_gemm(gpu, kern, _p(0), w, _p(2), 100, 257, 6144, **kwargs)
    overlapped = plan_fp8w_gemm(gpu, kern, _p(0), w, _p(2), 100, 257, 6144, overlap=True, **kwargs)
    assert prepared is not None and overlapped is not None and len(prepared.launches) == count
    prepared.run(4)
    overlapped.run(4)
    direct, planned, overlap = (gpu.launches[i * count:(i + 1) * count] for i in range(3))
    assert planned == direct and not any(launch.overlap for launch in direct)
    assert [launch.overlap for launch in overlap] == [True] + [False] * (count - 1)
    assert [(launch.grid, launch.args) for launch in overlap] == [(launch.grid, launch.args) for launch in direct]


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
    w, other_scale = _weight(64, 4096), _weight(64, 4096, scale=0x500000)
    calls = [(_p(0), w, None, 0, False), (_p(0), w, None, 0, False), (_p(3), w, None, 0, False),
             (_p(0), other_scale, None, 0, False), (_p(0), w, "simt", 0, False),
             (_p(0), w, None, _p(5), True), (_p(0), w, None, _p(6), True), (_p(0), w, None, _p(6), True)]
    for a, weight, path, workspace, batch_invariant in calls:
        dense_gemm_fp8w(gpu, kern, a, weight, _p(2), 5, 64, 4096, 0, path=path, workspace=workspace,
                        batch_invariant=batch_invariant)
    assert len(prepared) == 6 and len(gpu.launches) == 8  # the second and the last calls: earlier launches
    assert [launch.args[:3] for launch in gpu.launches] == [
        [int(a), int(weight.weight), int(weight.scale)] for a, weight, *_ in calls]
    assert [launch.args[7:] for launch in gpu.launches[5:]] == [  # 4 slabs of 1024, the workspace given
        [1024, _p(5) + 256, _p(5)], [1024, _p(6) + 256, _p(6)], [1024, _p(6) + 256, _p(6)]]
    other = RecordingBackend()  # the same operands on another backend: a launch of its own
    dense_gemm_fp8w(other, load_kernel(other, "gemm", gemm_fp8.KERNEL), _p(0), w, _p(2), 5, 64, 4096, 0)
    assert len(prepared) == 7 and other.launches[0].args == gpu.launches[0].args


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
    "c-float": (TypeError, "dense_gemm_fp8w c must be an int, got float", _p(0), _weight(8, 32), 2.5e6, 4, 8, 32, {}),
    "path": (ValueError, r"unknown path 'tiled'; one of \('fp8w', 'simt'\) or None", _p(0), _weight(8, 32), _p(2),
             4, 8, 32, {"path": "tiled"}),
    "batch-invariant-int": (TypeError, "batch_invariant must be a bool, got 1", _p(0), _weight(8, 32), _p(2),
                            4, 8, 32, {"batch_invariant": 1}),
    # the workspace is checked where one slab needs none too (k = 32 here)
    "workspace-bool": (TypeError, "dense_gemm_fp8w workspace must be an int, got bool", _p(0), _weight(8, 32),
                       _p(2), 4, 8, 32, {"workspace": True}),
    "workspace-str": (TypeError, "dense_gemm_fp8w workspace must be an int, got str", _p(0), _weight(8, 32),
                      _p(2), 4, 8, 32, {"workspace": "4096"}),
    "workspace-negative": (ValueError, "dense_gemm_fp8w workspace: device pointer out of range: -256", _p(0),
                           _weight(8, 32), _p(2), 4, 8, 32, {"workspace": -256}),
    "workspace-missing": (ValueError, "k = 2048 takes 2 slabs: give a workspace of 1048832 bytes", _p(0),
                          _weight(2048, 2048), _p(2), 64, 2048, 2048, {}),
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
class Workspace:
    """A workspace on ``gpu`` for an n x k weight: ``workspace_bytes`` bytes (or the counters and
    ``slabs`` slabs of partials) between guards, zeroed once; none where that is 0 (``ptr`` 0).
    ``arm()`` before a call poisons the partial sums (NaN bits); ``check(written)`` after it reads
    it all back: the counters 0 again (the next launch needs them so), the padding after them 0,
    the partials of exactly the (rows, slabs) ``written`` names written ([slabs][64][n]: no row
    past a launch's m, no slab past its k), nothing outside the buffer."""

    def __init__(self, gpu, rng: np.random.Generator, n: int, k: int, slabs: int | None = None) -> None:
        self.gpu, self.n = gpu, n
        self.pad = -(-(-(-n // 32) * 4) // 256) * 256  # where the partials start
        self.nbytes = gemm_fp8.workspace_bytes(n, k, gpu.max_shared_optin) if slabs is None else (
            self.pad + slabs * 64 * n * 4)
        self.buf = Guarded(gpu, self.nbytes, U8, rng) if self.nbytes else None
        if self.buf is not None:
            gpu.memset(self.buf.ptr, 0, self.nbytes)

    @property
    def ptr(self) -> int:
        return self.buf.ptr if self.buf is not None else 0

    def arm(self) -> None:
        if self.buf is not None:
            self.gpu.memset(self.buf.ptr + self.pad, 0xFF, self.nbytes - self.pad)

    def check(self, written: list[tuple[int, int]]) -> None:
        if self.buf is None:
            assert not written
            return
        raw = self.buf.read()
        self.buf.assert_guards_intact()
        counters = raw[: -(-self.n // 32) * 4].view(np.uint32)
        assert not counters.any(), f"counters left non-zero: {np.flatnonzero(counters)[:8]} ..."
        assert not raw[counters.nbytes : self.pad].any(), "a write between the counters and the partial sums"
        parts = raw[self.pad :].view(np.uint32).reshape(-1, 64, self.n)
        mask = np.zeros(parts.shape, bool)
        for rows, slabs in written:
            mask[:slabs, :rows] = True
        assert (parts[mask] != 0xFFFFFFFF).all(), f"{(parts[mask] == 0xFFFFFFFF).sum()} partial sums not written"
        assert (parts[~mask] == 0xFFFFFFFF).all(), "partial sums written past [slabs][rows][n]"

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.buf is not None:
            self.buf.free()


def written_by(*plans: gemm_fp8.Fp8wLaunch | None) -> list[tuple[int, int]]:
    """(rows, slabs) of each of the plans' launches over several slabs: the partials they write."""
    return [(launch.args[4], -(-launch.args[6] // launch.args[7])) for plan in plans if plan is not None
            for launch in plan.launches if len(launch.args) == 10 and launch.args[8]]


@contextmanager
def uploaded(gpu, rng, a: np.ndarray, w: np.ndarray, s: np.ndarray,
             misalign: int = 0) -> Iterator[tuple[Guarded, Guarded, Guarded, Guarded]]:
    """Guarded buffers (ga, gw, gs, gc) holding a (``misalign`` bytes past a 16-byte boundary), w
    and s, and a poisoned c of (m, n) bf16."""
    (m, k), n = a.shape, w.shape[0]
    with Guarded(gpu, (m, k), BF16, rng, misalign) as ga, Guarded(gpu, (n, k), U8, rng) as gw, \
         Guarded(gpu, s.shape, U8, rng) as gs, Guarded(gpu, (m, n), BF16, rng) as gc:
        ga.upload(a)
        gw.upload(w)
        gs.upload(s)
        gc.poison()
        yield ga, gw, gs, gc


def run_fp8w(gpu, rng, a: np.ndarray, w: np.ndarray, s: np.ndarray, *, path: str | None = None,
             batch_invariant: bool = False, misalign: int = 0) -> np.ndarray:
    """c = a @ W^T through the launcher with guarded, poisoned buffers (a ``misalign`` bytes past
    a 16-byte boundary) and a ``Workspace``; checks the guards, the workspace and that the inputs
    are untouched."""
    (m, k), n = a.shape, w.shape[0]
    kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
    with Workspace(gpu, rng, n, k) as ws, uploaded(gpu, rng, a, w, s, misalign) as (ga, gw, gs, gc):
        weight, kwargs = BlockFp8Weight(gw.ptr, gs.ptr, (n, k)), dict(workspace=ws.ptr, path=path,
                                                                       batch_invariant=batch_invariant)
        ws.arm()
        dense_gemm_fp8w(gpu, kern, ga.ptr, weight, gc.ptr, m, n, k, 0, **kwargs)
        got = gc.read()
        ws.check(written_by(plan_fp8w_gemm(gpu, kern, ga.ptr, weight, gc.ptr, m, n, k, **kwargs)))
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
@pytest.mark.parametrize("k", [96, 160, 4096, 6144])  # slabs by rows up to 8, 16, 32, 64: 1 1 1 1, 1 1 2 4, 1 2 3 6
@pytest.mark.parametrize("n", [1, 31, 32, 33, 100, 257])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 32, 33, 64, 65, 100, 130])
def test_matches_the_bf16_gemm_over_the_dequantised_weight(gpu, rng, m, n, k, path):
    a, w, s = random_bf16(rng, (m, k)), weight_bytes(rng, (n, k)), scale_bytes(rng, n, k)
    check_gemm(a, reference(w, s), run_fp8w(gpu, rng, a, w, s, path=path))


@pytest.mark.gpu
@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m, n, k", [(1, 33, 4096), (3, 257, 6144), (9, 31, 6144), (17, 100, 6144), (33, 64, 160),
                                     (64, 257, 6144), (65, 33, 4096), (100, 257, 4096), (130, 31, 6144)])
def test_exact_sums_are_bit_exact(gpu, rng, m, n, k, path, batch_invariant):
    a, w, s = exact_operands(rng, m, n, k)
    got = run_fp8w(gpu, rng, a, w, s, path=path, batch_invariant=batch_invariant)
    np.testing.assert_array_equal(bits(got), bits(gemm_bf16(a, reference(w, s))))


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m, k", [(17, 256), (17, 6144), (64, 4096), (100, 6144)])  # 1, 3, 4, 6 + 6 slabs
def test_a_scale_applied_one_block_off_is_caught(gpu, rng, m, k, path):
    """A scale per (32-row, 32-k) block, each block's differing from its neighbours' in both
    directions: a kernel that read the scale of the next or the previous block (in k or in n), or
    swapped the two indices, gets another answer than the reference (checked here), bit for bit;
    in every slab (its first scale block is ``s * ks / 32``)."""
    n = 257
    a, w, _ = exact_operands(rng, m, n, k)
    rows, cols = np.indices((-(-n // 32), k // 32))
    s = (125 + (rows + 2 * cols) % 5).astype(U8)  # neighbours in either direction differ
    want = bits(gemm_bf16(a, reference(w, s)))
    square = s[: min(s.shape), : min(s.shape)]
    for wrong in (np.roll(s, 1, axis=1), np.roll(s, -1, axis=1), np.roll(s, 1, axis=0), np.roll(s, -1, axis=0)):
        assert (bits(gemm_bf16(a, reference(w, wrong))) != want).any()
    assert not np.array_equal(square, square.T)
    np.testing.assert_array_equal(bits(run_fp8w(gpu, rng, a, w, s, path=path)), want)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_rows_do_not_depend_on_m(gpu, rng, path):
    """Batch invariance (``batch_invariant=True``): rows of an m = 100 call (two launches) equal,
    bit for bit, the same rows computed in calls of m = 1 and m = 17 (other n8-tile counts, other
    positions in them; 6 slabs each at k = 6144). The weight's second half of k repeats its first,
    and in the even rows of a the second half negates the first: their exact sums are 0 and what
    the kernel returns is its fp32 rounding, which another order of the sums (other slabs) changes."""
    m, n, k = 100, 1000, 6144
    w, s = weight_bytes(rng, (n, k // 2)), scale_bytes(rng, n, k // 2)
    w, s = np.concatenate([w, w], axis=1), np.concatenate([s, s], axis=1)
    a = random_bf16(rng, (m, k))
    a[::2, k // 2 :] = -a[::2, : k // 2]
    whole = run_fp8w(gpu, rng, a, w, s, path=path, batch_invariant=True)
    for lo, m in ((0, 1), (1, 1), (36, 1), (37, 1), (63, 1), (64, 1), (98, 1), (99, 1), (0, 17), (40, 17), (56, 17),
                  (83, 17)):
        part = run_fp8w(gpu, rng, np.ascontiguousarray(a[lo : lo + m]), w, s, path=path, batch_invariant=True)
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
@pytest.mark.parametrize("k, batch_invariant", [(32, False), (96, False), (1088, True)])  # 1088: two slabs
def test_every_scale_byte_including_the_extremes(gpu, rng, k, batch_invariant, path):
    """Each k-block column of the scales holds every byte 0..254 once (0: the subnormal 2^-127;
    above 134 the kernel scales twice; 247 and up overflow the larger weights to inf), and row i
    of a is +-[0.5, 2) * 2^(15 i - 120) (normal bf16 numbers), so every block is summed by rows
    whose products are normal fp32 numbers. Finite results within check_gemm's tolerance, and inf
    / NaN where IEEE puts them (through the partial sums too), wherever no fp32 sum can overflow."""
    m, n = 17, 255 * 32
    s = np.stack([rng.permutation(255) for _ in range(k // 32)], axis=1).astype(U8)
    w = weight_bytes(rng, (n, k))
    a = rng.uniform(0.5, 2.0, (m, k)) * rng.choice([-1.0, 1.0], (m, k)) * 2.0 ** (15 * np.arange(m) - 120)[:, None]
    a = a.astype(np.float32).astype(BF16)
    weight = reference(w, s)
    got = run_fp8w(gpu, rng, a, w, s, path=path, batch_invariant=batch_invariant).astype(np.float64)
    checked, kind, exact, total = _expected_classes(a, weight)
    assert checked.mean() > 0.4 and (kind[checked] == 1).any() and (kind[checked] == 2).any()  # (~0.69, ~0.48)
    for want, has in ((1, got == np.inf), (-1, got == -np.inf), (2, np.isnan(got))):
        np.testing.assert_array_equal(has[checked], (kind == want)[checked], err_msg=f"class {want}")
    fin = checked & (kind == 0)
    tol = 2 * bf16_ulp(exact) + 2 * k * 2.0**-23 * total + k * 2.0**-126  # (+ products below fp32's normals)
    with np.errstate(invalid="ignore"):  # (inf - inf where not finite)
        bad = fin & ~(np.abs(got - exact) <= tol)
    assert not bad.any(), f"{bad.sum()} of {fin.sum()} outside tolerance, first at {np.argwhere(bad)[0]}"


# variant -> (grid, block, shared memory, slab, workspace given); "plan": the plan's for these rows
LAUNCH_SHAPES = {
    "one-cta": ((1, 1, 1), (256, 1, 1), "plan", "plan", True),  # one CTA loops over every item of every slab
    "grid-7": ((7, 1, 1), (256, 1, 1), "plan", "plan", True),
    "grid-3x2": ((3, 2, 1), (256, 1, 1), "plan", "plan", True),  # 2-D and 3-D grids, unrelated to the work
    "grid-7x3x2": ((7, 3, 2), (256, 1, 1), "plan", "plan", True),
    "uneven-slabs": ((5, 1, 1), (256, 1, 1), "plan", "uneven", True),  # another slab: a short last one
    "128-threads": ((5, 1, 1), (128, 1, 1), "plan", "plan", True),  # from here on: the scalar fallback
    "32x2x2-threads": ((2, 1, 1), (32, 2, 2), "plan", "plan", True),
    "no-smem": ((3, 1, 1), (256, 1, 1), 0, "plan", True),
    "smem-16-short": ((3, 1, 1), (256, 1, 1), "short", "plan", True),
    "slab-not-64s": ((3, 1, 1), (256, 1, 1), "plan", "odd", True),
    "no-workspace": ((3, 1, 1), (256, 1, 1), "plan", "plan", False),  # (fp8w where one slab needs none)
}
RUNS_FP8W = {"one-cta", "grid-7", "grid-3x2", "grid-7x3x2", "uneven-slabs"}


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k, uneven", [(16, 300, 256, 192), (64, 300, 2048, 832), (17, 33, 6144, 1984)])
@pytest.mark.parametrize("variant", sorted(LAUNCH_SHAPES))
def test_the_kernel_is_correct_for_any_launch(gpu, rng, m, n, k, uneven, variant):
    """``dense_gemm_fp8w`` launched as given (the plan's slab: 1, 2 or 3 slabs; or a slab that
    leaves a short last one), on exact-sum data: bit-exact whichever path the launch takes, and
    the partial sums written where the fp8w path ran over several slabs, else untouched: a launch
    it does not fit (another block, too little shared memory, a slab not a multiple of 64, several
    slabs and no workspace) runs the scalar fallback."""
    grid, block, smem, slab, given = LAUNCH_SHAPES[variant]
    ks = {"plan": gemm_fp8.slab_k(k, m), "uneven": uneven, "odd": gemm_fp8.slab_k(k, m) - 32}[slab]
    smem = {"plan": gemm_fp8.smem(m, ks), "short": gemm_fp8.smem(m, ks) - 16}.get(smem, smem)
    slabs = -(-k // ks)
    fp8w = variant in RUNS_FP8W or (variant == "no-workspace" and slabs == 1)
    a, w, s = exact_operands(rng, m, n, k)
    kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
    with Workspace(gpu, rng, n, k, slabs) as ws, uploaded(gpu, rng, a, w, s) as (ga, gw, gs, gc):
        ws.arm()
        work, counters = (ws.ptr + ws.pad, ws.ptr) if given else (0, 0)
        gpu.bind(kern).launch(LaunchConfig(grid, block, smem), 0, ga.ptr, gw.ptr, gs.ptr, gc.ptr, m, n, k, ks, work,
                              counters)
        got = gc.read()
        gc.assert_guards_intact()
        ws.check([(m, slabs)] if fp8w and slabs > 1 else [])
    np.testing.assert_array_equal(bits(got), bits(gemm_bf16(a, reference(w, s))))


@pytest.mark.gpu
def test_plans_share_a_workspace_back_to_back(gpu, rng):
    """Overlapped plans (programmatic dependent launches) of several m over one workspace, run one
    after the other with no synchronisation, the first again at the end: each launch leaves the
    counters at 0 for the next, and none touches them or the partial sums before the launch
    before it is done (bit-exact on exact-sum data)."""
    n, k = 257, 6144
    _, w, s = exact_operands(rng, 1, n, k)
    kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
    with ExitStack() as stack:
        weight = stack.enter_context(BlockFp8Weight.from_numpy(gpu, w, s))
        ws = stack.enter_context(Workspace(gpu, rng, n, k))
        runs = []
        for m, batch_invariant in ((64, False), (17, False), (100, True), (9, False), (1, True)):
            a = exact_operands(rng, m, 1, k)[0]
            ga = stack.enter_context(Guarded(gpu, (m, k), BF16, rng)).upload(a)
            gc = stack.enter_context(Guarded(gpu, (m, n), BF16, rng)).poison()
            plan = plan_fp8w_gemm(gpu, kern, ga.ptr, weight, gc.ptr, m, n, k, workspace=ws.ptr,
                                  batch_invariant=batch_invariant, overlap=True)
            assert plan is not None
            runs.append((a, gc, plan))
        ws.arm()
        for _, _, plan in runs + runs[:1]:
            plan.run(0)
        for a, gc, _ in runs:
            np.testing.assert_array_equal(bits(gc.read()), bits(gemm_bf16(a, reference(w, s))), err_msg=f"m {len(a)}")
            gc.assert_guards_intact()
        ws.check(written_by(*(plan for _, _, plan in runs)))


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 100, 6144), (17, 33, 160), (64, 257, 4096), (100, 31, 6144)])
def test_an_unaligned_a_takes_the_scalar_loads(gpu, rng, m, n, k):
    """a 2 bytes past a 16-byte boundary (every row too: k % 32 == 0): the slab loader's scalar
    path, the same sums (bit-exact on exact-sum data)."""
    a, w, s = exact_operands(rng, m, n, k)
    got = run_fp8w(gpu, rng, a, w, s, misalign=2)
    np.testing.assert_array_equal(bits(got), bits(gemm_bf16(a, reference(w, s))))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
def test_real_dims(gpu, rng, m):
    """Engram's wkv at its size (25600 x 6144; 1 slab at m = 1, 6 at 64), uploaded by
    ``from_numpy``: every output written, 4096 of them, sampled, within the tolerance of a float64
    reference."""
    n, k = 25600, 6144
    a, w, s = random_bf16(rng, (m, k)), weight_bytes(rng, (n, k)), scale_bytes(rng, n, k)
    kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
    with BlockFp8Weight.from_numpy(gpu, w.view(FP8), s) as weight, Guarded(gpu, (m, k), BF16, rng) as ga, \
         Guarded(gpu, (m, n), BF16, rng) as gc, Workspace(gpu, rng, n, k) as ws:
        ga.upload(a)
        gc.poison()
        ws.arm()
        dense_gemm_fp8w(gpu, kern, ga.ptr, weight, gc.ptr, m, n, k, 0, workspace=ws.ptr)
        got = gc.read().astype(np.float64)
        gc.assert_guards_intact()
        ws.check(written_by(plan_fp8w_gemm(gpu, kern, ga.ptr, weight, gc.ptr, m, n, k, workspace=ws.ptr)))
    assert np.isfinite(got).all(), f"{(~np.isfinite(got)).sum()} outputs unwritten (poisoned) or not finite"
    rows, cols = rng.integers(0, m, 4096), rng.integers(0, n, 4096)
    wrows = dequant_rows(w[cols], s[cols // 32], 32).astype(np.float64)
    products = a[rows].astype(np.float64) * wrows
    exact = products.sum(axis=1)
    ref = exact.astype(np.float32).astype(BF16).astype(np.float64)
    tol = 2 * bf16_ulp(ref) + 2 * k * 2.0**-23 * np.abs(products).sum(axis=1)
    err = np.abs(got[rows, cols] - ref)
    assert (err <= tol).all(), f"{(err > tol).sum()} of 4096 outside tolerance, worst {np.max(err / tol)}"
