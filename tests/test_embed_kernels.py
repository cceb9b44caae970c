"""embed_from_argmax.cu against the numpy reference: bit-exact gathers and argmax."""

from __future__ import annotations

from contextlib import ExitStack

import ml_dtypes
import numpy as np
import pytest

from layers import reference as ref
from layers.kernel_files import load_kernel
from layers.ops.embed import ArgmaxEmbed, ShardGather, batched_embed, batched_embed_fp8
from tests.helpers import TOO_SLOW_UNDER_SANITIZER, Guarded, bits, random_bf16, random_fp8

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def kernels(gpu):
    return {name: load_kernel(gpu, "embed_from_argmax", name)
            for name in ("batched_embed", "batched_embed_fp8", "batched_embed_shard",
                         "embed_from_argmax_bf16")}


def _run_guarded(gpu, rng, inputs, outputs, launch) -> list[np.ndarray]:
    """``launch(*pointers)`` on guarded device buffers, the inputs' then the outputs': each input
    ``(array, misalign)`` uploaded, each output ``(shape, dtype, misalign)`` poisoned. Returns
    what the outputs hold afterwards, every buffer's guards checked intact."""
    with ExitStack() as stack:
        ins = [stack.enter_context(Guarded(gpu, a.shape, a.dtype, rng, mis)).upload(a) for a, mis in inputs]
        outs = [stack.enter_context(Guarded(gpu, shape, dtype, rng, mis)).poison() for shape, dtype, mis in outputs]
        launch(*(g.ptr for g in ins + outs))
        got = [g.read() for g in outs]
        for g in ins + outs:
            g.assert_guards_intact()
    return got


@pytest.mark.parametrize("dim", [1, 7, 64, 256, 4096])
@pytest.mark.parametrize("n", [1, 3, 257])
@pytest.mark.parametrize("misalign", [0, 2])
def test_batched_embed_bit_exact(gpu, kernels, rng, dim, n, misalign):
    rows = 1000
    table = random_bf16(rng, (rows, dim))
    ids = rng.integers(0, rows, n, dtype=np.uint32)
    ids[0] = rows - 1  # the last row, where an off-by-one would read past the table
    (got,) = _run_guarded(gpu, rng, [(table, misalign), (ids, 0)], [((n, dim), BF16, misalign)],
                          lambda t, i, o: batched_embed(gpu, kernels["batched_embed"], i, t, o, n, dim, 0))
    np.testing.assert_array_equal(bits(got), bits(ref.batched_embed(table, ids)))


@pytest.mark.parametrize("dim", [1, 7, 64, 4096])
@pytest.mark.parametrize("lo, count", [(0, 300), (250, 250), (999, 1), (0, 1000)])
@pytest.mark.parametrize("misalign", [0, 2])
def test_batched_embed_shard_gathers_its_rows_and_zeros_the_rest(gpu, kernels, rng, dim, lo, count, misalign):
    """Rows lo .. lo+count-1 of a 1000-row vocabulary live in the shard; every other id (below lo,
    past the shard, past the vocabulary, 0xFFFFFFFF) gives a zero row and reads nothing."""
    n = 257
    shard = random_bf16(rng, (count, dim))
    ids = rng.integers(0, 1000, n, dtype=np.uint32)
    ids[:6] = [lo, lo + count - 1, max(lo - 1, 0), lo + count, 5000, 0xFFFFFFFF]
    held = (ids >= lo) & (ids < lo + count)
    want = np.zeros((n, dim), BF16)
    want[held] = shard[ids[held] - lo]
    (got,) = _run_guarded(
        gpu, rng, [(shard, misalign), (ids, 0)], [((n, dim), BF16, misalign)],
        lambda t, i, o: ShardGather(gpu, kernels["batched_embed_shard"], t, o, dim, lo, count).run(i, n, 0))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dim", [1, 7, 64, 256, 4096])
@pytest.mark.parametrize("n", [1, 5, 129])
@pytest.mark.parametrize("table_misalign, out_misalign", [(0, 0), (4, 2)])  # bytes off 16: fp8 table, bf16 out
def test_batched_embed_fp8_bit_exact(gpu, kernels, rng, dim, n, table_misalign, out_misalign):
    rows = 600
    table = random_fp8(rng, (rows, dim))
    scale = np.exp(rng.uniform(-8, 8, rows)).astype(np.float32)
    scale[:4] = [1e-38, 3e-30, 1e30, 2.5e35]  # subnormal products, and near bf16's range end
    ids = rng.integers(0, rows, n, dtype=np.uint32)
    ids[: min(n, 4)] = np.arange(min(n, 4))
    (got,) = _run_guarded(
        gpu, rng, [(table, table_misalign), (scale, 0), (ids, 0)], [((n, dim), BF16, out_misalign)],
        lambda t, s, i, o: batched_embed_fp8(gpu, kernels["batched_embed_fp8"], i, t, s, o, n, dim, 0))
    np.testing.assert_array_equal(bits(got), bits(ref.batched_embed_fp8(table, scale, ids)))


def _logits_with_edge_rows(rng, m, vocab):
    x = rng.standard_normal((m, vocab)).astype(np.float32)
    x[rng.random((m, vocab)) < 0.05] = np.nan
    if m >= 5 and vocab >= 4:
        top = np.float32(9.0)
        x[0, [vocab - 1, 1, vocab // 2]] = top  # ties: lowest index wins
        x[1, :] = np.nan  # all NaN: id 0
        x[2, :] = -np.inf  # all -inf: lowest index, 0
        x[2, 0] = np.nan  # ... and a NaN at 0 does not win: 1
        x[3, :] = np.nan
        x[3, vocab - 1] = -5.0  # the only number, at the end
        x[4, 0] = np.inf
        x[4, 1] = np.nan
    return x.astype(BF16)


@pytest.mark.parametrize("vocab", [1, 7, 1000, 32003, 131072])
@pytest.mark.parametrize("m", [1, 5])
def test_embed_from_argmax(gpu, kernels, rng, vocab, m):
    dim = 33 if vocab % 2 else 256
    logits = _logits_with_edge_rows(rng, m, vocab)
    table = random_bf16(rng, (vocab, dim))
    want_ids, want_rows = ref.embed_from_argmax(logits, table)
    if m >= 5 and vocab >= 4:
        assert list(want_ids[:4]) == [1, 0, 1, vocab - 1] and want_ids[4] == 0
    got_rows, got_ids = _run_guarded(
        gpu, rng, [(logits, 0), (table, 0)], [((m, dim), BF16, 0), (m, np.uint32, 0)],
        lambda lg, t, o, ids: ArgmaxEmbed(gpu, kernels["embed_from_argmax_bf16"], t, vocab, dim).run(lg, o, ids, m, 0))
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(bits(got_rows), bits(want_rows))


def test_zero_rows_launch_nothing(gpu, kernels, rng):
    with Guarded(gpu, 8, BF16, rng) as o:
        o.poison()
        batched_embed(gpu, kernels["batched_embed"], o.ptr, o.ptr, o.ptr, 0, 8, 0)
        assert (bits(o.read()) == 0xFFFF).all()
        o.assert_guards_intact()


@TOO_SLOW_UNDER_SANITIZER
def test_batched_embed_of_2_to_the_27_rows(gpu, kernels, rng):
    """n = 2**27 rows: the grid (2**24 blocks of 256 threads) has 2**32 threads, which a 32-bit
    warp count read as 0, and the loop never ended. Each row its id's, bit for bit."""
    n, dim, vocab = 1 << 27, 2, 1000
    table = random_bf16(rng, (vocab, dim))
    ids = rng.integers(0, vocab, n, dtype=np.uint32)
    (got,) = _run_guarded(gpu, rng, [(table, 0), (ids, 0)], [((n, dim), BF16, 0)],
                          lambda t, i, o: batched_embed(gpu, kernels["batched_embed"], i, t, o, n, dim, 0))
    np.testing.assert_array_equal(bits(got), bits(table[ids]))
