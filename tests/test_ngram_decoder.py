"""NgramDecoder: on the CPU, two launches per call and no host work a capture could not hold, and
every host-side refusal before any launch; on the GPU, bit for bit the fused path on the same
tokens through ragged and chunked prefills, 100 graph-replayed decode steps, EOS, slot reuse,
k-token steps with rollbacks, host-memory reads of the histories, and every device-side bad
value flagged with the other rows intact and nothing written outside the outputs (those checks
live in ``tests.helpers.decoder_checks``, which test_tensor_parallel.py runs on a one-rank shard's
decoder too)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from gpu_runtime import ClosedError, DeviceArray, DevicePtr, KernelHandle
from layers import reference as ref
from layers.ngram_embed import NgramDecoder, NgramEmbedding
from layers.ngram_embed.decoder import NO_ADAPTER, NO_ROW_CACHE, PAD_SLOT, DecodeError
from layers.overlay import OverlaySlots
from tests.helpers.fakes import RecordingBackend, refused
from tests.helpers import decoder_checks
from tests.helpers import POISON, Guarded
from tests.helpers.decoder import World, u32
from tests.helpers.ngram import assert_runners_borrow_the_weights, device_weights, random_layer, small_dims

P = [DevicePtr(0x100000 * (i + 1)) for i in range(6)]


def recording_decoder(max_draft=0):
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=3, splits=2, eos_id=7)
    weights = device_weights(gpu, random_layer(np.random.default_rng(1), dims, "bf"))
    return gpu, NgramDecoder(weights, max_seqs=4, max_rows=32, max_draft=max_draft)


# -- CPU --------------------------------------------------------------------------------------
def test_calls_are_launches_only():
    gpu, dec = recording_decoder(max_draft=2)
    gpu.launches.clear()
    gpu.ops.clear()
    dec.prefill(P[0], P[1], P[2], 3, 20, P[3], stream=5)
    dec.step(P[0], P[2], 4, P[3], stream=5, k=3)
    dec.rollback(P[2], P[4], 4, stream=5)
    names = [gpu.kernel_of(launch)[1] for launch in gpu.launches]
    assert names == ["ngram_decode_gather", "dense_gemm_bf16_word"] * 2 + ["ngram_decode_rollback"]
    assert gpu.ops == [], "no upload, allocation or memset in the hot path"
    assert all(launch.stream == 5 for launch in gpu.launches)
    prefill, step = gpu.launches[0], gpu.launches[2]
    assert prefill.args[:3] == [P[0], P[1], P[2]] and prefill.args[10:15] == [20, 3, 0, 4, dec.hist_len]
    assert step.args[1] == 0 and step.args[10:13] == [12, 4, 3]
    assert dec.hist_len == 2 + 2
    gemm = gpu.launches[1]
    assert gemm.args[3] == 20 and gemm.args[6] == dec.word_ids


def test_calls_of_few_rows_are_one_kernel_where_the_device_allows():
    """On sm_90a, a call of at most eight rows whose word GEMM would take the small path is one
    launch of ngram_decode_step (the small path's grid, its shared memory plus the gathered rows, a
    programmatic dependent launch), in the batch-invariant mode too; more rows, a GEMM that would
    take another path (gemv for a few rows of k <= 256) and ``one_kernel = False`` keep the
    gather and the GEMM."""
    from layers.ops import gemm
    from layers.ops import ngram_decode as ops

    gpu = RecordingBackend()
    gpu.target = "sm_90a"  # type: ignore[attr-defined]
    dims = small_dims(max_ngram=3, splits=2, eos_id=7, table_dim=128)
    weights = device_weights(gpu, random_layer(np.random.default_rng(1), dims, "bf"))
    dec = NgramDecoder(weights, max_seqs=4, max_rows=32, max_draft=2)
    assert dec.one_kernel
    t, td, d = dims.num_tables(), dims.table_dim(), dims.hidden_size
    assert t * td > gemm.GEMV_AUTO_MAX_K  # the word GEMM takes the small path for a few rows

    def launches(decoder, call):
        gpu.launches.clear()
        call(decoder)
        return [(gpu.kernel_of(x)[1], x) for x in gpu.launches]

    ((name, one),) = launches(dec, lambda x: x.step(P[0], P[2], 4, P[3], stream=5, k=2))
    assert name == "ngram_decode_step" and one.overlap and one.stream == 5
    assert one.grid == (-(-d // gemm.SMALL_COLS), 1, 1) and one.block == (256, 1, 1)
    assert one.shared_mem == ops.step_smem(8, t, td) == gemm.small_smem(8) + 2 * 8 * t * td
    assert one.args[8:11] == [8, 4, 2] and one.args[14] == t and one.args[17] == td
    assert [n for n, _ in launches(dec, lambda x: x.prefill(P[0], P[1], P[2], 1, 3, P[3]))] == ["ngram_decode_step"]
    assert [n for n, _ in launches(dec, lambda x: x.step(P[0], P[2], 3, P[3], k=3))] == [
        "ngram_decode_gather", "dense_gemm_bf16_word"]  # nine rows
    dec.one_kernel = False
    assert [n for n, _ in launches(dec, lambda x: x.step(P[0], P[2], 1, P[3]))] == [
        "ngram_decode_gather", "dense_gemm_bf16_word"]
    invariant = NgramDecoder(weights, max_seqs=4, max_rows=32, batch_invariant=True)
    assert [n for n, _ in launches(invariant, lambda x: x.step(P[0], P[2], 1, P[3]))] == ["ngram_decode_step"]
    narrow = small_dims(max_ngram=3, splits=2, eos_id=7, table_dim=16)  # k = 64: gemv for 1-4 rows
    small_k = NgramDecoder(device_weights(gpu, random_layer(np.random.default_rng(2), narrow, "bf")),
                           max_seqs=8, max_rows=32)
    two = launches(small_k, lambda x: x.step(P[0], P[2], 2, P[3]))
    assert [n for n, _ in two] == ["ngram_decode_gather", "dense_gemm_bf16_word"]
    assert two[1][1].shared_mem == gemm.GEMV_SMEM
    assert [n for n, _ in launches(small_k, lambda x: x.step(P[0], P[2], 6, P[3]))] == ["ngram_decode_step"]


def test_the_one_kernel_step_refuses_what_it_cannot_run():
    """``ngram_decode_step`` launches only what its kernel runs: more than eight rows, a table
    dim that is not a multiple of 8, or gathered rows beyond its shared memory are refused."""
    from layers.ops import ngram_decode as ops

    gpu = RecordingBackend()
    base = dict(tokens=P[0], cu_seqlens=0, slots=P[1], hist=P[2], state=P[3], tables=P[4], pows=P[5],
                ctrl=P[0], num_seqs=1, max_seqs=4, hist_len=4, vocab=100, num_tables=4, max_ngram=3,
                splits=2, table_dim=8, eos=None, proj=P[1], word=P[2], out=P[3], scale=0.5, hidden=64,
                stream=0)
    ops.ngram_decode_step(gpu, KernelHandle(1), rows=8, per_seq=8, **base)
    assert len(gpu.launches) == 1
    for change, match in [(dict(rows=9, per_seq=9), "do not fit"),
                          (dict(rows=2, per_seq=2, table_dim=12), "do not fit"),
                          (dict(rows=2, per_seq=2, table_dim=8192), "do not fit"),
                          (dict(rows=2, per_seq=1), "rows 2 != num_seqs 1")]:
        with pytest.raises(ValueError, match=match):
            ops.ngram_decode_step(gpu, KernelHandle(1), **{**base, **change})
    assert len(gpu.launches) == 1


def test_reset_is_one_memset_of_the_slot_state():
    gpu, dec = recording_decoder()
    gpu.ops.clear()
    dec.reset(3, stream=2)
    assert gpu.ops == [("memset", dec.state + 24, 0, 8, 2)]


@pytest.mark.parametrize("call, error, match", [
    (lambda d: d.step(P[0], P[1], 5, P[2]), ValueError, "over max_seqs 4"),
    (lambda d: d.step(P[0], P[1], 4, P[2], k=9), ValueError, "36 rows over max_rows 32"),
    (lambda d: d.step(P[0], P[1], 2, P[2], k=0), ValueError, "k must be in 1..2\\*\\*32-1, got 0"),
    (lambda d: d.step(0, P[1], 2, P[2]), ValueError, "tokens: null"),
    (lambda d: d.step(P[0], P[1], 2, 0), ValueError, "out: null"),
    (lambda d: d.step(P[0], 1.5, 2, P[2]), TypeError, "slots"),
    (lambda d: d.step(P[0], P[1], 2.0, P[2]), TypeError, "num_seqs"),
    (lambda d: d.prefill(P[0], P[1], P[2], 0, 5, P[3]), ValueError, "in no sequence"),
    (lambda d: d.prefill(P[0], 0, P[2], 2, 5, P[3]), ValueError, "cu_seqlens: null"),
    (lambda d: d.prefill(P[0], P[1], P[2], 2, 33, P[3]), ValueError, "over max_rows"),
    (lambda d: d.rollback(P[0], 0, 2), ValueError, "counts: null"),
    (lambda d: d.reset(4), ValueError, r"slot must be in 0\.\.3, got 4"),
    (lambda d: d.reset(-1), ValueError, "slot"),
])
def test_refusals_launch_nothing(call, error, match):
    gpu, dec = recording_decoder()
    with refused(gpu, error, match):
        call(dec)


def test_device_arrays_are_checked_for_dtype_and_size():
    gpu, dec = recording_decoder()
    small = DeviceArray(gpu, P[0], (3,), np.uint32)
    wrong = DeviceArray(gpu, P[1], (8,), np.int64)
    with refused(gpu, ValueError, "3 entries, the call needs 4"):
        dec.step(small, P[1], 4, P[2])
    with refused(gpu, TypeError, "dtype int64, expected uint32"):
        dec.step(P[0], wrong, 2, P[2])
    dec.step(DeviceArray(gpu, P[0], (4,), np.uint32), P[1], 4, P[2])
    assert gpu.launches[0].args[0] == P[0]


def test_cached_tables_and_closed_objects_are_refused():
    gpu = RecordingBackend()
    dims = small_dims()
    cached = device_weights(gpu, random_layer(np.random.default_rng(2), dims, "b"), cached=True)
    gpu.ops.clear()
    with pytest.raises(ValueError, match=re.escape(NO_ROW_CACHE)):
        NgramDecoder(cached, max_seqs=2, max_rows=4)
    assert gpu.ops == [] and not cached.closed, "refused before anything was built; the weights stay"
    weights = device_weights(gpu, random_layer(np.random.default_rng(3), dims, "b"))
    for bad, error in ((0, ValueError), (-1, ValueError), (2**31, ValueError), (True, TypeError),
                       (1.0, TypeError)):
        with pytest.raises(error, match="max_seqs"):
            NgramDecoder(weights, max_seqs=bad, max_rows=4)
    # What a decoder serves is the weights, not a runner over them (the old argument) ...
    with NgramEmbedding(weights, 8) as runner, \
            pytest.raises(TypeError, match="NgramDecoder: weights must be NgramWeights, got NgramEmbedding"):
        NgramDecoder(runner, max_seqs=2, max_rows=4)
    # ... and there is no gpu argument to disagree with them: adapter slots on another backend do.
    with OverlaySlots(RecordingBackend(), 1, dims.vocab_size, dims.hidden_size) as elsewhere, \
            pytest.raises(ValueError, match="adapter_slots live on another backend than the weights"):
        NgramDecoder(weights, max_seqs=2, max_rows=4, adapter_slots=elsewhere)
    weights.close()
    with pytest.raises(ClosedError, match="NgramDecoder: its NgramWeights is closed"):
        NgramDecoder(weights, max_seqs=2, max_rows=4)
    gpu, dec = recording_decoder()
    dec.weights.close()
    for call in (lambda: dec.step(P[0], P[1], 1, P[2]), lambda: dec.prefill(P[0], P[1], P[2], 1, 1, P[3]),
                 lambda: dec.seed(P[0], P[1], P[2], 1, 1), lambda: dec.fork(P[0], P[1], 1),
                 lambda: dec.rollback(P[0], P[1], 1), lambda: dec.reset(0), lambda: dec.check_errors()):
        with refused(gpu, ClosedError, "NgramDecoder: its NgramWeights is closed"):
            call()
    dec.close()
    dec.close()  # idempotent
    with pytest.raises(ClosedError, match="NgramDecoder is closed"):
        dec.reset(0)


def test_the_decoder_borrows_the_weights():
    """``close()`` frees the decoder's own buffers only (histories, state, gather buffer): the
    weights serve another decoder until ``weights.close()``, which frees every upload and what
    was derived from them (the concatenated projections, the table descriptors)."""
    gpu = RecordingBackend()
    weights = device_weights(gpu, random_layer(np.random.default_rng(4), small_dims(eos_id=7), "bf"))
    word = weights.word.weight
    _, gemm = assert_runners_borrow_the_weights(
        gpu, weights, lambda: NgramDecoder(weights, max_seqs=4, max_rows=32),
        lambda: NgramDecoder(weights, max_seqs=2, max_rows=8, max_draft=1),
        lambda first: first.step(P[0], P[1], 2, P[2]), ["ngram_decode_gather", "dense_gemm_bf16_word"])
    assert gemm.args[7] == word


# -- GPU --------------------------------------------------------------------------------------
@pytest.fixture
def world(gpu, rng):
    w = World(gpu, rng)
    yield w
    w.close()


@pytest.mark.gpu
@pytest.mark.parametrize("check", decoder_checks.CHECKS)
def test_decoder_check(world, check):
    """Ragged and chunked prefills, graph-replayed steps with resets and slot reuse, k-token steps
    with rollbacks, bad device values: ``decoder_checks``' checks, run on a one-rank shard's
    decoder too (test_tensor_parallel.py)."""
    check(world)


@pytest.mark.gpu
@pytest.mark.parametrize("adapters", [0, 2])
@pytest.mark.parametrize("table_dim", [24, 96])  # T * td = 96: gemv below five rows; 384: small
def test_one_kernel_calls_match_the_two_kernel_form(gpu, rng, adapters, table_dim):
    """Calls of at most eight rows run as one kernel (``one_kernel``, sm_90a): over random steps of
    1-6 sequences and 1-2 tokens, with padded entries, bad tokens, bad slots and adapter
    indices, the output bits, every slot's history and the flags equal those of a decoder on the
    same weights that runs the gather and GEMM (as do calls of more rows, two kernels in both)."""
    w = World(gpu, rng, adapters=adapters, table_dim=table_dim)
    two = NgramDecoder(w.weights, max_seqs=6, max_rows=96, stream=w.stream, max_draft=3,
                       adapter_slots=w.slots)
    two.one_kernel = False
    outs = [w.out, Guarded(gpu, (96, w.dims.hidden_size), np.dtype(w.out.dtype), rng)]
    try:
        if not w.dec.one_kernel:
            pytest.skip("the one-kernel step needs sm_90a")
        vocab = w.dims.vocab_size
        with u32(gpu, w.tokens(40)) as prompt, u32(gpu, [0, 7, 20, 31, 40]) as cu, u32(gpu, [0, 1, 2, 3]) as sl:
            gpu.synchronize(0)
            for dec, out in zip((w.dec, two), outs):
                dec.prefill(prompt, cu, sl, 4, 40, out.ptr, w.stream)
        for _ in range(40):
            k = int(rng.integers(1, 3))
            b = int(rng.integers(1, 7)) if k == 1 else int(rng.integers(1, 6))
            slots = rng.choice(6, b, replace=False).astype(np.uint32)
            slots[rng.random(b) < 0.15] = PAD_SLOT
            slots[rng.random(b) < 0.05] = 9  # >= max_seqs
            toks = w.tokens(b * k)
            toks[rng.random(b * k) < 0.05] = vocab + 3
            idx = rng.integers(0, adapters + 1, b).astype(np.uint32) if adapters else None
            if idx is not None:
                idx[idx == adapters] = NO_ADAPTER
                idx[rng.random(b) < 0.1] = adapters + 1  # a bad adapter slot
            with u32(gpu, toks) as d_tok, u32(gpu, slots) as d_sl, u32(gpu, idx if idx is not None else [0]) as d_ad:
                gpu.synchronize(0)
                got = []
                for dec, out in zip((w.dec, two), outs):
                    out.poison()
                    dec.step(d_tok, d_sl, b, out.ptr, w.stream, k=k, adapters=None if idx is None else d_ad)
                    gpu.synchronize(w.stream)
                    got.append((out.read()[: b * k].view(np.uint16), int(dec.check_errors())))
                    out.assert_guards_intact()
            np.testing.assert_array_equal(got[0][0], got[1][0])
            assert got[0][1] == got[1][1]
            for slot in range(6):
                np.testing.assert_array_equal(w.dec.history(slot), two.history(slot))
    finally:
        gpu.synchronize(w.stream)
        outs[1].free()
        two.close()
        w.close()


@pytest.mark.gpu
def test_a_one_kernel_launch_of_the_wrong_shape_writes_nothing_and_flags_it(gpu, rng):
    """ngram_decode_step launched (past its launcher) with less shared memory than it needs
    writes no output, no history and no state, and flags DecodeError.LAUNCH."""
    from layers.ops.specs import NGRAM_DECODE_STEP

    w = World(gpu, rng, table_dim=96)
    try:
        dec, dims = w.dec, w.dims
        if not dec.one_kernel:
            pytest.skip("the one-kernel step needs sm_90a")
        w.prefill([0], [5])
        before = [dec.history(s) for s in range(6)]
        w.out.poison()
        with u32(gpu, [1]) as tok, u32(gpu, [0]) as slot:
            gpu.synchronize(0)
            args = dict(tokens=tok.ptr, cu_seqlens=0, slots=slot.ptr, hist=dec.hist, state=dec.state,
                        tables=dec.projection.desc, pows=dec.projection.pows, ctrl=dec.ctrl, rows=1, num_seqs=1,
                        per_seq=1, max_seqs=dec.max_seqs, hist_len=dec.hist_len, vocab=dims.vocab_size,
                        num_tables=dims.num_tables(), max_ngram=dims.max_ngram, splits=dims.splits,
                        td=dims.table_dim(), eos=dims.eos_id, adapters=0, adapter_maps=0, adapter_rows=0,
                        adapter_counts=0, num_adapters=0, hidden=dims.hidden_size,
                        proj=dec.projection.projs.weight, word=w.weights.word.weight, out=w.out.ptr, scale=0.5)
            NGRAM_DECODE_STEP.launch_from(gpu, dec.step_kernel, (3, 1, 1), (256, 1, 1), w.stream, args,
                                          shared_mem=1024)
            gpu.synchronize(w.stream)
        assert dec.check_errors() == DecodeError.LAUNCH
        assert (w.out.read().view(np.uint8) == POISON).all()
        w.out.assert_guards_intact()
        for s in range(6):
            np.testing.assert_array_equal(dec.history(s), before[s])
    finally:
        w.close()


@pytest.mark.gpu
def test_long_histories_take_the_unshuffled_window_path(gpu, rng):
    """max_draft 40: the ring (42 tokens) is longer than a warp, so the kernel reads the window
    from the ring token by token instead of through one shuffle; drafts of up to 40 roll back."""
    w = World(gpu, rng, max_draft=40, max_rows=160)
    try:
        decoder_checks.k_token_steps_with_rollbacks(w)
    finally:
        w.close()


@pytest.mark.gpu
def test_outputs_match_the_fused_reference(gpu, rng):
    w = World(gpu, rng, kinds="fb", max_ngram=4, splits=2, eos=False)
    try:
        got, _ = w.prefill([0, 1], [20, 3])
        for i, s in enumerate([0, 1]):
            rows = got[:20] if i == 0 else got[20:]
            want = ref.ngram_embed_fused(w.dims, w.host.word, w.host.tables, w.host.projs,
                                         np.asarray(w.ctx[s]), len(rows))
            g, x = rows.astype(np.float64), want.astype(np.float64)
            assert (np.abs(g - x) <= np.abs(x) * 2.0**-7 + 1e-6).all()
    finally:
        w.close()
