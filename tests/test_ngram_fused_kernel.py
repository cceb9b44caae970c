"""ngram_fused.cu: the fused n-gram hash-and-gather kernel and its launcher.

CPU: the launcher's launch (kinds against the C signature, grid, argument order) and refusals;
a Python model of the kernel's hash loop (windows, powers, the look-back cut) against
``ngram_ids``, so the rule the kernel implements is checked even without a GPU.
GPU: ids bit-exact against ``ngram_ids`` (cached tables: their slots) and every gathered row
bit-exact against ``layers.reference.gather_table``, over random dims, EOS-laden contexts, mixed
bf16 / fp8 / cached tables, odd and vector table widths, misaligned buffers, grid striding,
N > 32, and vocabularies and moduli near 2**32 for the 64-bit arithmetic.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gpu_runtime import DevicePtr
from gpu_runtime.signatures import parse_signatures
from layers.kernel_files import kernel_dir, load_kernel
from layers.ngram_embed.dims import NgramDims
from layers.ngram_embed.ids import ngram_ids_array
from layers.ops.ngram_fused import NO_EOS, NO_TOKEN, PairLaunch
from tests.helpers.fakes import RecordingBackend
from tests.helpers import Guarded, bits
from tests.helpers.ngram_gather import Tables, context, make_tables, ngram_gather, pows_for, windows_for

BF16 = ml_dtypes.bfloat16
MODULE, KERNEL = "ngram_fused", "ngram_gather"
TABLE_DIMS = [1, 7, 8, 16, 33, 256]


# -- the kernel's hash rule, in Python ----------------------------------------------------------
def eos_word(dims: NgramDims) -> int:
    return NO_EOS if dims.eos_id is None else dims.eos_id


def kernel_model(windows: np.ndarray, pows: np.ndarray, moduli: list[int], splits: int,
                 eos: int) -> np.ndarray:
    """The kernel's hash loop in Python ints: ``[R, T]`` ids."""
    rows, t = windows.shape[0], len(moduli)
    out = np.zeros((rows, t), np.uint64)
    for r in range(rows):
        for c in range(t):
            acc, m = 0, moduli[c]
            for d in range(c // splits + 2):
                w = int(windows[r, d])
                if d > 0 and w in (NO_TOKEN, eos):
                    break
                acc = (acc + w * int(pows[c, d]) % m) % m
            out[r, c] = acc
    return out


# -- CPU: the launch ----------------------------------------------------------------------------
def _p(i: int) -> DevicePtr:
    return DevicePtr(0x100000 * (i + 1))


def _launch(gpu, **over):
    args = dict(windows=_p(0), tables=_p(1), pows=_p(2), slots=_p(3), out=_p(4), ids_out=_p(5),
                rows=37, num_tables=6, max_ngram=4, splits=2, table_dim=33, eos=17, stream=9)
    args.update(over)
    ngram_gather(gpu, load_kernel(gpu, MODULE, KERNEL), **args)


def test_launch_matches_the_c_signature_position_for_position(rng):
    n, k = int(rng.integers(2, 9)), int(rng.integers(1, 9))
    rows, td, eos = int(rng.integers(1, 5000)), int(rng.integers(1, 300)), int(rng.integers(0, 1 << 31))
    gpu = RecordingBackend()
    _launch(gpu, rows=rows, num_tables=k * (n - 1), max_ngram=n, splits=k, table_dim=td, eos=eos)
    (launch,) = gpu.launches
    signature = parse_signatures((kernel_dir() / f"{MODULE}.cu").read_text())[KERNEL]
    assert launch.kinds == signature.kinds == "PPPPPPUUUUUU"
    assert launch.args == [int(_p(i)) for i in range(6)] + [rows, k * (n - 1), n, k, td, eos]
    assert launch.block == (256, 1, 1) and launch.stream == 9
    assert launch.grid == (min(-(-rows * k * (n - 1) // 8), 4 * 132 * 8), 1, 1)


def test_no_eos_and_optional_pointers():
    gpu = RecordingBackend()
    _launch(gpu, eos=None, slots=0, ids_out=0)
    (launch,) = gpu.launches
    assert launch.args[3] == 0 and launch.args[5] == 0 and launch.args[-1] == 0xFFFFFFFF


def test_grid_is_capped_for_many_pairs():
    gpu = RecordingBackend()
    _launch(gpu, rows=1_000_000, num_tables=32, max_ngram=5, splits=8)
    (launch,) = gpu.launches
    assert launch.grid == (4 * 132 * 8, 1, 1)


ONE_BLOCK_AN_SM = 227 * 1024 // 2 + 1024  # over half an H200 SM's 228 KiB: one block an SM


class _SizedBackend(RecordingBackend):
    """A recording backend that reports an H200's SMs and shared memory opt-in."""

    sm_count, max_shared_optin = 132, 227 * 1024


@pytest.mark.parametrize("gpu_type, rows, host, grid, shared", [
    (_SizedBackend, 2112, False, 1056, 0),
    (_SizedBackend, 2112, True, 1056, 0),  # 8448 pairs: one wave, every warp one pair already
    (_SizedBackend, 2114, True, 1057, ONE_BLOCK_AN_SM),  # past it: one pair a warp, one block an SM
    (_SizedBackend, 1_000_000, False, 4 * 132 * 8, 0),
    (_SizedBackend, 1_000_000, True, 500_000, ONE_BLOCK_AN_SM),
    (RecordingBackend, 1_000_000, True, 500_000, 0),  # no opt-in reported: in order, 8 blocks an SM
])
def test_host_tables_past_one_wave_take_one_pair_a_warp(gpu_type, rows, host, grid, shared):
    gpu = gpu_type()
    _launch(gpu, rows=rows, num_tables=4, max_ngram=3, splits=2, host_tables=host)
    (launch,) = gpu.launches
    assert (launch.grid, launch.shared_mem) == ((grid, 1, 1), shared)


def test_the_grid_never_passes_the_drivers_limit():
    assert PairLaunch(_SizedBackend(), True).config(2**40).grid == (2**31 - 1, 1, 1)  # the kernel strides past it


def test_zero_rows_launch_nothing():
    gpu = RecordingBackend()
    _launch(gpu, rows=0)
    assert gpu.launches == []


@pytest.mark.parametrize("over, error", [
    (dict(num_tables=5), ValueError),
    (dict(num_tables=8, max_ngram=5, splits=3), ValueError),
    (dict(max_ngram=1, num_tables=0), ValueError),
    (dict(splits=0, num_tables=0), ValueError),
    (dict(table_dim=0), ValueError),
    (dict(windows=0), ValueError),
    (dict(tables=0), ValueError),
    (dict(pows=0), ValueError),
    (dict(out=0), ValueError),
    (dict(eos=0xFFFFFFFF), ValueError),
    (dict(eos=-1), ValueError),
    (dict(rows=-1), ValueError),
    (dict(rows=1 << 32), ValueError),
    (dict(rows=2.0), TypeError),
    (dict(table_dim=True), TypeError),
    (dict(host_tables=1), TypeError),
])
def test_refusals_launch_nothing(over, error):
    gpu = RecordingBackend()
    with pytest.raises(error):
        _launch(gpu, **over)
    assert gpu.launches == []


def test_table_count_refused_even_with_zero_rows():
    gpu = RecordingBackend()
    with pytest.raises(ValueError, match="num_tables"):
        _launch(gpu, rows=0, num_tables=7)
    assert gpu.launches == []


# -- CPU: the hash rule the kernel implements ---------------------------------------------------
@pytest.mark.parametrize("trial", range(12))
def test_kernel_hash_model_matches_ngram_ids(rng, trial):
    big = trial % 3 == 2
    vocab = int(rng.integers(3_000_000_000, 1 << 32)) if big else int(rng.integers(1, 5000))
    n = int(rng.integers(33, 41)) if trial == 0 else int(rng.integers(2, 6))
    k = int(rng.integers(1, 3 if n > 32 else 9))
    base = int(rng.integers((1 << 32) - 4000, (1 << 32) - 2 * k * (n - 1) - 1)) if big \
        else int(rng.integers(1, 3000))
    eos = int(rng.integers(0, vocab)) if rng.random() < 0.7 else None
    dims = NgramDims(vocab, 1, n, k, base, row_bias=int(rng.integers(0, 2)), table_dim=1,
                     eos_id=eos)
    tokens = context(rng, dims, int(rng.integers(1, 120)), eos_rate=0.03 if n > 32 else 0.15)
    positions = np.arange(len(tokens))
    moduli = [dims.table_rows(c) for c in range(dims.num_tables())]
    got = kernel_model(windows_for(tokens, positions, n), pows_for(vocab, moduli, n), moduli, k,
                       eos_word(dims))
    np.testing.assert_array_equal(got.T, ngram_ids_array(dims, tokens).astype(np.uint64))


def test_windows_for_marks_the_context_start():
    w = windows_for(np.array([5, 6, 7], np.uint64), np.array([0, 2, 1]), 3)
    assert w.tolist() == [[5, NO_TOKEN, NO_TOKEN], [7, 6, 5], [6, 5, NO_TOKEN]]


# -- GPU ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernel(gpu):
    return load_kernel(gpu, MODULE, KERNEL)


def run_and_check(gpu, kernel, rng, dims: NgramDims, tokens: np.ndarray, positions: np.ndarray,
                  tables: Tables, *, write_ids: bool = True, out_misalign: int = 0) -> None:
    """Launch on guarded, poisoned buffers; ids and rows bit-exact, no poison left, guards whole."""
    rows_r, t, n, td = len(positions), dims.num_tables(), dims.max_ngram, dims.table_dim()
    moduli = [int(m) for m in tables.entries[:, 2]]
    bufs = [Guarded(gpu, (rows_r, n), np.uint32, rng).upload(windows_for(tokens, positions, n)),
            Guarded(gpu, (t, 4), np.uint64, rng).upload(tables.entries),
            Guarded(gpu, (t, n), np.uint64, rng).upload(pows_for(dims.vocab_size, moduli, n)),
            Guarded(gpu, (rows_r, t * td), BF16, rng, out_misalign).poison(),
            Guarded(gpu, (rows_r, t), np.uint32, rng).poison()]
    win, ent, pw, out, ids = bufs
    if tables.slots is not None:
        bufs.append(Guarded(gpu, (rows_r, t), np.uint32, rng).upload(tables.slots))
    try:
        ngram_gather(gpu, kernel, win.ptr, ent.ptr, pw.ptr,
                     bufs[5].ptr if tables.slots is not None else 0, out.ptr,
                     ids.ptr if write_ids else 0, rows_r, t, n, dims.splits, td, dims.eos_id, 0)
        gpu.synchronize()
        got_ids, got_out = ids.read(), out.read()
        if write_ids:
            assert not (got_ids == 0xFFFFFFFF).any(), "ids left unwritten"
            np.testing.assert_array_equal(got_ids, tables.want_ids)
        else:
            assert (got_ids == 0xFFFFFFFF).all(), "ids written although ids_out was null"
        assert not (bits(got_out) == 0xFFFF).any(), "output rows left unwritten"
        np.testing.assert_array_equal(bits(got_out), bits(tables.want_out))
        for g in bufs + tables.guarded:
            g.assert_guards_intact()
    finally:
        for g in bufs:
            g.free()


def check(gpu, kernel, rng, dims: NgramDims, tokens: np.ndarray, positions: np.ndarray, *,
          cached_rate: float, fp8_rate: float) -> None:
    """``make_tables`` then ``run_and_check``, tables freed whatever happens."""
    tables = make_tables(gpu, rng, dims, tokens, positions, cached_rate=cached_rate, fp8_rate=fp8_rate)
    try:
        run_and_check(gpu, kernel, rng, dims, tokens, positions, tables)
    finally:
        tables.close()


def random_dims(rng, td: int, **fixed) -> NgramDims:
    n, k = fixed.get("max_ngram", int(rng.integers(2, 6))), fixed.get("splits", int(rng.integers(1, 9)))
    vocab = fixed.get("vocab_size", int(rng.integers(300, 5001)))
    eos = int(rng.integers(0, vocab)) if rng.random() < 0.75 else None
    return NgramDims(vocab, k * (n - 1) * td, n, k, int(rng.integers(50, 3001)),
                     row_bias=int(rng.integers(0, 2)), table_dim=td, eos_id=fixed.get("eos_id", eos))


def _positions(rng, length: int, count: int) -> np.ndarray:
    """Random positions (repeats allowed), the first and last of the context among them."""
    pos = rng.integers(0, length, count)
    pos[0], pos[-1] = 0, length - 1
    return rng.permutation(pos)


@pytest.mark.gpu
@pytest.mark.parametrize("td", TABLE_DIMS)
@pytest.mark.parametrize("trial", range(3))
def test_random_dims_bit_exact(gpu, kernel, rng, td, trial):
    dims = random_dims(rng, td)
    tokens = context(rng, dims, int(rng.integers(1, 300)), eos_rate=0.15)
    positions = _positions(rng, len(tokens), int(rng.integers(1, 200)))
    check(gpu, kernel, rng, dims, tokens, positions, cached_rate=0.3, fp8_rate=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("td", [264, 1032])
def test_wide_rows_use_every_copy_loop(gpu, kernel, rng, td):
    """Rows wide enough for the unrolled loops: fp8 two 8-byte loads per lane (td > 256), bf16
    four 16-byte loads per lane (td > 768), each with its tail."""
    dims = random_dims(rng, td, splits=int(rng.integers(1, 4)))
    tokens = context(rng, dims, int(rng.integers(1, 100)), eos_rate=0.15)
    positions = _positions(rng, len(tokens), int(rng.integers(1, 40)))
    check(gpu, kernel, rng, dims, tokens, positions, cached_rate=0.3, fp8_rate=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("td", [8, 16, 33, 256])
def test_misaligned_buffers_and_no_ids_out(gpu, kernel, rng, td):
    """Misaligned tables and output take the element-wise paths; a null ids_out writes no ids."""
    dims = random_dims(rng, td)
    tokens = context(rng, dims, int(rng.integers(1, 200)), eos_rate=0.1)
    positions = _positions(rng, len(tokens), int(rng.integers(1, 100)))
    tables = make_tables(gpu, rng, dims, tokens, positions, cached_rate=0.0, fp8_rate=0.5,
                         misalign=4)
    try:
        assert tables.slots is None  # slots pointer null: no table may read it
        run_and_check(gpu, kernel, rng, dims, tokens, positions, tables, write_ids=False,
                      out_misalign=2)
    finally:
        tables.close()


@pytest.mark.gpu
def test_all_cached_tables(gpu, kernel, rng):
    dims = random_dims(rng, 16)
    tokens = context(rng, dims, 50, eos_rate=0.1)
    positions = _positions(rng, len(tokens), 64)
    check(gpu, kernel, rng, dims, tokens, positions, cached_rate=1.0, fp8_rate=0.5)


@pytest.mark.gpu
def test_many_rows_are_grid_strided(gpu, kernel, rng):
    """R*T far beyond the capped grid's warps: every pair is still written once."""
    dims = random_dims(rng, 8, max_ngram=5, splits=8)
    tokens = context(rng, dims, 3000, eos_rate=0.05)
    positions = _positions(rng, len(tokens), 6000)
    assert len(positions) * dims.num_tables() > 4 * 132 * 8 * 8 * 5
    check(gpu, kernel, rng, dims, tokens, positions, cached_rate=0.2, fp8_rate=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("eos", [True, False])
def test_ngrams_longer_than_a_warp(gpu, kernel, rng, eos):
    """N > 32: the hash takes its terms 32 lanes at a time; rare EOS lets look-backs pass 32."""
    vocab = int(rng.integers(300, 5001))
    dims = NgramDims(vocab, 39 * 7, 40, 1, int(rng.integers(50, 3001)), table_dim=7,
                     eos_id=int(rng.integers(0, vocab)) if eos else None)
    tokens = context(rng, dims, 200, eos_rate=0.01)
    positions = _positions(rng, len(tokens), 150)
    check(gpu, kernel, rng, dims, tokens, positions, cached_rate=0.1, fp8_rate=0.5)


@pytest.mark.gpu
def test_vocab_near_2_32(gpu, kernel, rng):
    """V = 4e9: token * V**d mod M products overflow 32 bits; tables of 3M one-column rows."""
    n, k = int(rng.integers(3, 6)), 2
    dims = NgramDims(4_000_000_000, k * (n - 1), n, k, 3_000_000 + int(rng.integers(0, 1000)),
                     row_bias=1, table_dim=1, eos_id=3_999_999_999)
    tokens = context(rng, dims, 400, eos_rate=0.05)
    high = rng.random(len(tokens)) < 0.5
    tokens[high] = rng.integers(4_000_000_000 - 1000, 4_000_000_000 - 1, int(high.sum()))
    positions = _positions(rng, len(tokens), 300)
    check(gpu, kernel, rng, dims, tokens, positions, cached_rate=0.0, fp8_rate=0.5)


@pytest.mark.gpu
def test_moduli_near_2_32(gpu, kernel, rng):
    """V and every M_c just below 2**32: products just below 2**64 (a signed or 32-bit step
    would wrap). All tables share one 8 GiB one-column buffer of the largest M_c rows, filled
    with one value, so the ids carry the check and the rows show the copy happened."""
    free, _total = gpu.mem_info()
    if free < 10 << 30:
        pytest.skip(f"needs 10 GiB of free device memory, {free >> 20} MiB free")
    vocab = (1 << 32) - int(rng.integers(2, 100))
    n, k = 3, 2
    dims = NgramDims(vocab, k * (n - 1), n, k, (1 << 32) - 64, row_bias=1, table_dim=1,
                     eos_id=vocab - 1)
    t = dims.num_tables()
    rows = dims.table_rows(t - 1)
    assert rows < 1 << 32
    tokens = context(rng, dims, 300, eos_rate=0.05)
    high = rng.random(len(tokens)) < 0.6
    tokens[high] = rng.integers(vocab - 1000, vocab - 1, int(high.sum()))
    positions = _positions(rng, len(tokens), 256)
    data = gpu.alloc(rows * 2)
    try:
        gpu.memset(data, 0x3F, rows * 2)
        want_ids = ngram_ids_array(dims, tokens)[:, positions].T.astype(np.uint32)
        assert want_ids.max() > 1 << 31  # large ids: row offsets beyond 4 GiB
        entries = np.array([(int(data), 0, dims.table_rows(c), 0) for c in range(t)], np.uint64)
        want_out = np.full((len(positions), t), 0x3F3F, np.uint16).view(BF16)
        tables = Tables(entries, want_ids, want_out, None)
        run_and_check(gpu, kernel, rng, dims, tokens, positions, tables)
    finally:
        gpu.free(data)


@pytest.mark.gpu
def test_zero_rows_write_nothing(gpu, kernel, rng):
    with Guarded(gpu, 8, BF16, rng) as out:
        out.poison()
        ngram_gather(gpu, kernel, out.ptr, out.ptr, out.ptr, 0, out.ptr, 0, 0, 2, 3, 1, 8, None, 0)
        assert (bits(out.read()) == 0xFFFF).all()
        out.assert_guards_intact()
