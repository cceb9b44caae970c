"""FusedNgramEmbedding: two launches and one upload per call (CPU), and on the GPU: closer to the
fp64 ideal than the seed-faithful path, equal to the fused reference, graphs equal to eager,
batches equal to per-sequence calls, cached tables equal to resident ones."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_runtime import ClosedError, DevicePtr
from layers import reference as ref
from layers.ngram_embed import (
    FusedNgramEmbedding,
    NgramDims,
    NgramEmbedding,
    NgramTable,
    NgramWeights,
    RowCache,
    write_table,
)
from layers.ops.ngram_fused import NO_TOKEN
from layers.dense_weight import BF16
from tests.helpers.fakes import RecordingBackend, refused
from tests.helpers import Guarded, bits, run_on_poisoned
from tests.helpers.ngram import assert_runners_borrow_the_weights, device_weights, random_layer, small_dims

OUT = DevicePtr(0x900000)


def fused_of(gpu, dims, rng, kinds="bf", max_rows=64):
    """Random weights (owning their uploads) and the fused runner on them, on the default stream."""
    weights = device_weights(gpu, random_layer(rng, dims, kinds))
    return weights, FusedNgramEmbedding(weights, max_rows)


def close_all(fused, weights):
    """The runner first, then the weights it borrows."""
    fused.close()
    weights.close()


# -- CPU --------------------------------------------------------------------------------------
def test_two_launches_and_one_upload_per_call():
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=3, splits=2, eos_id=7)
    weights, fused = fused_of(gpu, dims, np.random.default_rng(1))
    t, td, h = dims.num_tables(), dims.table_dim(), dims.hidden_size
    copies = [op for op in gpu.ops if op[0] == "copy2d"]
    assert [(op[2], op[4], op[5], op[6]) for op in copies] == [(t * td * 2, td * 2, td * 2, h)] * t
    cat = fused.projection.projs  # the concatenated projections, built once on the weights
    assert cat is weights.concat_projections() and cat.shape == (h, t * td)
    assert [op[1] - cat.weight for op in copies] == [c * td * 2 for c in range(t)]
    assert [op[3] for op in copies] == [p.weight for p in weights.projs]
    gpu.launches.clear()
    gpu.ops.clear()
    ctx = [5, 7, 9, 11, 13]
    fused.embed(ctx, 3, OUT, stream=4)
    names = [gpu.kernel_of(launch)[1] for launch in gpu.launches]
    assert names == ["ngram_gather", "dense_gemm_bf16_word"]
    (upload,) = [op for op in gpu.ops if op[0] == "h2d"]
    packed = np.frombuffer(upload[1], np.uint32)
    windows = packed[:9].reshape(3, 3)
    assert windows.tolist() == [[9, 7, 5], [11, 9, 7], [13, 11, 9]]
    assert packed[9:].tolist() == [9, 11, 13]  # word ids
    assert all(launch.stream == 4 for launch in gpu.launches)
    gemm = gpu.launches[1]
    assert gemm.args[:3] == [fused.projection.buf, cat.weight, OUT] and gemm.args[7] == weights.word.weight
    assert gemm.args[3:6] == [3, h, t * td] and gemm.args[8] == 0 and gemm.args[9] == float(np.float32(1) / np.float32(1 + t))


def test_windows_pad_before_the_start_and_read_only_tails():
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=4, splits=1)
    _, fused = fused_of(gpu, dims, np.random.default_rng(2))
    win = fused.windows([[3, 4], np.arange(100) % 50, [], [7, 8, 9, 10, 11]], [2, 2, 0, 1])
    assert win.tolist() == [[3, NO_TOKEN, NO_TOKEN, NO_TOKEN], [4, 3, NO_TOKEN, NO_TOKEN],
                            [48, 47, 46, 45], [49, 48, 47, 46], [11, 10, 9, 8]]
    rng = np.random.default_rng(5)
    contexts = [rng.integers(0, 500, int(rng.integers(1, 30))) for _ in range(50)]
    lens = [int(rng.integers(0, len(c) + 1)) for c in contexts]
    want = [[c[p - d] if p - d >= 0 else NO_TOKEN for d in range(4)]
            for c, s in zip(contexts, lens) for p in range(len(c) - s, len(c))]
    assert fused.windows(contexts, lens).tolist() == want
    # contexts of different integer kinds in one batch (uint64 with int64 concatenates as float64)
    mixed = [np.array([3, 4], np.uint64), np.array([7, 8, 9], np.int64), [1, 2]]
    assert fused.windows(mixed, [2, 1, 1]).tolist() == fused.windows([[3, 4], [7, 8, 9], [1, 2]], [2, 1, 1]).tolist()
    bad = dims.vocab_size + 7
    with pytest.raises(ValueError, match=f"token {bad}"):
        fused.windows([np.array([3, 4], np.uint64), np.array([bad], np.int64)], [1, 1])


@pytest.mark.parametrize("call, error, match", [
    (lambda f: f.embed([1, 2, 500], 1, OUT), ValueError, "token 500 outside"),
    (lambda f: f.embed([1, 2, 3], 4, OUT), ValueError, r"seq_lens\[0\] 4 exceeds the context's 3"),
    (lambda f: f.embed([1, 2, 3], -1, OUT), ValueError, "non-negative"),
    (lambda f: f.embed([1, 2, 3], 1.0, OUT), TypeError, r"seq_lens\[0\] must be an int"),
    (lambda f: f.embed(list(range(70)), 65, OUT), ValueError, "over max_rows 64"),
    (lambda f: f.embed_batch([[1]] * 40 + [[2, 3]] * 20, [1] * 40 + [2] * 20, OUT), ValueError,
     "over max_rows"),
    (lambda f: f.embed_batch([[1, 2]], [1, 1], OUT), ValueError, "1 contexts, 2 seq_lens"),
    (lambda f: f.embed([1, 2, 3], 1, 0), ValueError, "null device pointer"),
    (lambda f: f.embed([1, 2, 3], 1, OUT, 0, graph=True), ValueError, "created stream"),
    (lambda f: f.embed([1, 2, 3], 1, OUT, 4, graph=True), TypeError, "needs a backend with CUDA graphs"),
    (lambda f: f.embed([[1, 2]], 1, OUT), ValueError, "1-D"),
    (lambda f: f.embed([1.5, 2.5], 1, OUT), TypeError, "tokens must be integers, got dtype float64"),
    (lambda f: f.embed_batch([[1, 2]], [1], OUT, adapters=[0]), ValueError,
     "adapters given, but the runner was built without adapter_slots"),
])
def test_refusals_upload_and_launch_nothing(call, error, match):
    gpu = RecordingBackend()  # no graphs
    _, fused = fused_of(gpu, small_dims(), np.random.default_rng(3))
    with refused(gpu, error, match):
        call(fused)


def test_dims_the_kernel_cannot_hash_are_refused():
    gpu = RecordingBackend()
    weights = device_weights(gpu, random_layer(np.random.default_rng(4), small_dims(), "b"))
    weights.dims = NgramDims(vocab_size=2**32, hidden_size=40, max_ngram=3, splits=2, base_rows=61,
                             row_bias=1)
    gpu.ops.clear()
    with pytest.raises(ValueError, match="vocab_size"):
        FusedNgramEmbedding(weights, 8)
    assert gpu.ops == [], "refused before anything was built"


def test_the_runner_borrows_the_weights():
    """``close()`` frees the runner's own buffers only: the weights (and the projections
    concatenated on them) serve another runner until ``weights.close()``, which frees every
    upload and what was derived from them; a runner on closed weights refuses every call."""
    gpu = RecordingBackend()
    weights = device_weights(gpu, random_layer(np.random.default_rng(6), small_dims(), "bf"))
    assert_runners_borrow_the_weights(
        gpu, weights, lambda: FusedNgramEmbedding(weights, 16), lambda: FusedNgramEmbedding(weights, 16),
        lambda first: first.embed([1, 2, 3], 2, OUT), ["ngram_gather", "dense_gemm_bf16_word"])
    third = FusedNgramEmbedding(device_weights(gpu, random_layer(np.random.default_rng(7), small_dims(), "b")), 8)
    third.weights.close()
    for call in (lambda: third.embed([1, 2], 1, OUT), lambda: third.embed_batch([[1]], [1], OUT),
                 lambda: third.stage([[1]], [1]), lambda: third.project(1, OUT)):
        with refused(gpu, ClosedError, "fused ngram embed: its NgramWeights is closed"):
            call()
    with pytest.raises(ClosedError, match="FusedNgramEmbedding: its NgramWeights is closed"):
        FusedNgramEmbedding(third.weights, 8)
    third.close()


# -- GPU --------------------------------------------------------------------------------------
def _rel(x, ideal):
    return np.linalg.norm(x.astype(np.float64) - ideal) / np.linalg.norm(ideal)



def test_cached_tables_with_adapter_slots_pack_their_slots_where_the_gather_reads_them(rng):
    """With adapter slots each row has 3 words more (its replacement row's address): the
    cached tables' slots still fill the T words after the word ids (before, the slot region
    was taken to run to the end of the buffer, and every call with adapter slots failed)."""
    from layers.overlay import OverlaySlots

    gpu = RecordingBackend()
    dims = small_dims()
    weights = device_weights(gpu, random_layer(rng, dims, "b"), cached=True)
    contexts, lens = [rng.integers(0, dims.vocab_size, 9), rng.integers(0, dims.vocab_size, 5)], [4, 3]
    with OverlaySlots(gpu, 1, dims.vocab_size, dims.hidden_size) as slots, \
            FusedNgramEmbedding(weights, 16, adapter_slots=slots) as with_slots, \
            FusedNgramEmbedding(weights, 16) as plain:
        windows = plain.windows(contexts, lens)
        rows, base = windows.shape[0], dims.max_ngram + 1 + dims.num_tables()
        with plain.batch():
            want = plain.pack(windows)
        with with_slots.batch():
            got = with_slots.pack(windows, np.zeros(rows, np.uint64))
        assert np.array_equal(got[: rows * base], want)  # windows, word ids, then the slots
        out = gpu.alloc(16 * dims.hidden_size * 2)
        with_slots.embed_batch(contexts, lens, out)  # the call that failed



def test_close_frees_everything_when_the_wait_for_the_last_call_fails(rng):
    """After a kernel fault the wait for the last call raises the sticky error: close still
    frees the runner's buffers and event, once (before, it kept them and raised at every close)."""

    class Faulted(RecordingBackend):
        fault = False

        def event_synchronize(self, event):
            if self.fault:
                raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS (sticky)")

    gpu = Faulted()
    dims = small_dims()
    weights = device_weights(gpu, random_layer(rng, dims, "b"))

    def close(fault: bool) -> tuple[FusedNgramEmbedding, list]:
        """A runner closed with or without the fault: it and the frees its close made."""
        gpu.fault = False
        fused = FusedNgramEmbedding(weights, 16)
        gpu.fault, before = fault, len(gpu.ops)
        if fault:
            with pytest.raises(RuntimeError, match="sticky"):
                fused.close()
        else:
            fused.close()
        return fused, [op for op in gpu.ops[before:] if op[0] == "free"]

    _, clean = close(False)
    fused, faulted = close(True)
    assert fused.closed and len(faulted) == len(clean) > 0
    fused.close()  # nothing left to wait for or free
    weights.close()


def test_project_takes_the_rows_stage_staged_once(rng):
    """The GEMM reads word ids that ``stage`` uploaded: a project without a stage, or of other
    rows, or a second one, would read ids never written (refused before any launch)."""
    gpu = RecordingBackend()
    dims = small_dims()
    with device_weights(gpu, random_layer(rng, dims, "b")) as weights, FusedNgramEmbedding(weights, 16) as fused:
        out = gpu.alloc(16 * dims.hidden_size * 2)
        gpu.launches.clear()
        with pytest.raises(ValueError, match="project of 16 rows, but stage\\(\\) staged 0"):
            fused.project(16, out)
        rows = fused.stage([[1, 2, 3]], [2])
        with pytest.raises(ValueError, match="project of 9 rows, but stage\\(\\) staged 2"):
            fused.project(9, out)
        staged = len(gpu.launches)
        fused.project(rows, out)
        assert len(gpu.launches) == staged + 1  # the GEMM
        with pytest.raises(ValueError, match="staged 0"):
            fused.project(rows, out)  # once


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, kinds", [(2, 2, "b"), (3, 2, "bf"), (4, 4, "f"), (3, 8, "fb"), (5, 1, "b")])
def test_fused_rounds_less_than_the_seed_path(gpu, rng, n, k, kinds):
    vocab = int(rng.integers(300, 5000))
    dims = NgramDims(vocab_size=vocab, hidden_size=int(rng.choice([40, 64, 129, 1024])), max_ngram=n,
                     splits=k, base_rows=int(rng.integers(50, 3000)), row_bias=int(rng.integers(0, 2)),
                     table_dim=int(rng.choice([7, 16, 33, 64])),
                     eos_id=int(rng.integers(0, vocab)) if rng.random() < 0.5 else None)
    host = random_layer(rng, dims, kinds)
    weights = device_weights(gpu, host)
    layer, fused = NgramEmbedding(weights, 80), FusedNgramEmbedding(weights, 80)  # side by side
    try:
        ctx = rng.integers(0, vocab, int(rng.integers(100, 400)))
        if dims.eos_id is not None:
            ctx[rng.random(ctx.size) < 0.05] = dims.eos_id
        flips = values = 0  # rounding flips against the fused reference, over all three calls
        for seq_len in (1, 17, 80):
            h = dims.hidden_size
            got = run_on_poisoned(gpu, rng, lambda o: fused.embed(ctx, seq_len, o, 0), seq_len, h)
            seed = run_on_poisoned(gpu, rng, lambda o: layer.embed(ctx, seq_len, o, gpu, 0), seq_len, h)
            ideal = ref.ngram_embed_ideal(dims, host.word, host.tables, host.projs, ctx, seq_len)
            want = ref.ngram_embed_fused(dims, host.word, host.tables, host.projs, ctx, seq_len)
            assert _rel(got, ideal) <= _rel(seed, ideal) * 1.02 + 1e-7, (_rel(got, ideal), _rel(seed, ideal))
            # Against the fused reference: the fp32 sum's order may flip the final rounding.
            g, w = got.astype(np.float64), want.astype(np.float64)
            ulp = np.maximum(np.abs(w), np.abs(ideal)) * 2.0**-7 + 1e-6
            assert (np.abs(g - w) <= ulp).all()
            flips, values = flips + int((bits(got) != bits(want)).sum()), values + got.size
            # Against the seed-faithful path: within its T + 1 roundings.
            row = np.abs(ideal).max(axis=1, keepdims=True) * 2.0**-8
            assert (np.abs(g - seed.astype(np.float64)) <= (dims.num_tables() + 2) * row).all()
        # Rare: one output in forty of a 1 x 40 call would be 2.5%, so the rate is over all calls.
        assert flips < 0.02 * values, (flips, values)
    finally:
        fused.close()
        layer.close()
        weights.close()


@pytest.mark.gpu
def test_graph_replay_equals_eager_and_batches_equal_single_calls(gpu, rng):
    dims = small_dims(max_ngram=3, splits=4, table_dim=32, hidden_size=256, eos_id=3)
    weights, fused = fused_of(gpu, dims, rng, "bf", max_rows=256)
    stream = gpu.create_stream()
    h = dims.hidden_size
    try:
        contexts = [rng.integers(0, dims.vocab_size, int(rng.integers(1, 300))) for _ in range(40)]
        seq_lens = [int(rng.integers(0, min(len(c), 6) + 1)) for c in contexts]
        rows = sum(seq_lens)
        batch = run_on_poisoned(gpu, rng, lambda o: fused.embed_batch(contexts, seq_lens, o, stream), rows, h, stream)
        singles = [run_on_poisoned(gpu, rng, lambda o: fused.embed(c, s, o, stream), s, h, stream)
                   for c, s in zip(contexts, seq_lens) if s]
        single = np.concatenate(singles)
        ulp = np.abs(single.astype(np.float64)) * 2.0**-7 + 1e-6
        assert (np.abs(batch.astype(np.float64) - single.astype(np.float64)) <= ulp).all()
        with Guarded(gpu, (rows, h), BF16, rng) as out:  # one graph, replayed with new tokens
            for step in range(4):
                contexts = [np.append(c, rng.integers(0, dims.vocab_size)) for c in contexts]
                out.poison()
                gpu.synchronize(0)
                fused.embed_batch(contexts, seq_lens, out.ptr, stream, graph=True)
                gpu.synchronize(stream)
                got = out.read()
                eager = run_on_poisoned(gpu, rng, lambda o: fused.embed_batch(contexts, seq_lens, o, stream), rows, h,
                             stream)
                assert np.array_equal(bits(got), bits(eager)), step
                out.assert_guards_intact()
        assert fused.captured_graphs == 1
    finally:
        close_all(fused, weights)
        gpu.destroy_stream(stream)


@pytest.mark.gpu
def test_cached_tables_equal_resident_ones(gpu, rng, tmp_path):
    dims = small_dims(max_ngram=3, splits=2, table_dim=24, hidden_size=72, base_rows=3000)
    host = random_layer(rng, dims, "bf")
    resident = device_weights(gpu, host)
    caches = []
    for c, (table, scale) in enumerate(host.tables):
        if c % 2:  # every other table from disk, through a small arena
            write_table(tmp_path / f"t{c}.ngt", table, scale)
            caches.append(RowCache(gpu, tmp_path / f"t{c}.ngt", 70, stream=0))
    tables = list(resident.tables)
    for i, c in enumerate(range(1, len(tables), 2)):
        tables[c] = NgramTable.Cached(caches[i])
    mixed = NgramWeights(dims, resident.word, tables, resident.projs, gpu)  # borrows all: owns nothing
    fused_res, fused_mix = FusedNgramEmbedding(resident, 64), FusedNgramEmbedding(mixed, 64)
    try:
        tokens = rng.integers(0, dims.vocab_size, 600)
        for pos in range(10, 600, 37):
            seq = int(rng.integers(1, min(pos, 32) + 1))
            a = run_on_poisoned(gpu, rng, lambda o: fused_res.embed(tokens[:pos], seq, o, 0), seq, 72)
            b = run_on_poisoned(gpu, rng, lambda o: fused_mix.embed(tokens[:pos], seq, o, 0), seq, 72)
            assert np.array_equal(bits(a), bits(b)), pos
        assert all(c.stats.evictions > 0 and c.index.n_pinned == 0 for c in caches)
    finally:
        fused_res.close()
        fused_mix.close()
        mixed.close()
        for cache in caches:
            cache.close()
        resident.close()


@pytest.mark.gpu
def test_single_context_graph_replays_equal_eager(gpu, rng):
    """``embed(..., graph=True)`` replays a captured shape through its own short path (the
    context's tail through a cached window index): equal to eager calls, for list and array
    contexts, and contexts shorter than the look-back still go through the general path."""
    dims = small_dims(max_ngram=4, splits=2, table_dim=16, hidden_size=64, eos_id=9)
    weights, fused = fused_of(gpu, dims, rng, "bf", max_rows=16)
    stream = gpu.create_stream()
    h = dims.hidden_size
    try:
        ctx = list(rng.integers(0, dims.vocab_size, 2))
        with Guarded(gpu, (3, h), BF16, rng) as out:  # one output: every shape's graph is reused
            for step in range(40):
                ctx.append(int(rng.integers(0, dims.vocab_size)) if step % 7 else 9)
                for s, c in ((1, ctx), (3, np.asarray(ctx))):
                    out.poison()
                    gpu.synchronize(0)
                    fused.embed(c, s, out.ptr, stream, graph=True)
                    gpu.synchronize(stream)
                    got = out.read()[:s]
                    want = run_on_poisoned(gpu, rng, lambda o: fused.embed(c, s, o, stream), s, h, stream)
                    assert np.array_equal(bits(got), bits(want)), (step, s)
            out.assert_guards_intact()
            assert fused.captured_graphs == 2
            with pytest.raises(ValueError, match="outside"):
                fused.embed(ctx[:-1] + [dims.vocab_size], 1, out.ptr, stream, graph=True)
    finally:
        close_all(fused, weights)
        gpu.destroy_stream(stream)
