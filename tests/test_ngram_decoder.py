"""NgramDecoder: on the CPU, two launches per call and no host work a capture could not hold, and
every host-side refusal before any launch; on the GPU, bit for bit the fused path on the same
tokens through ragged and chunked prefills, 100 graph-replayed decode steps, EOS, slot reuse,
k-token steps with rollbacks, host-memory reads of the histories, and every device-side bad
value flagged with the other rows intact and nothing written outside the outputs (those checks
live in ``tests.helpers.decoder_checks``, which test_tensor_parallel_runners.py runs on a one-rank shard's
decoder too)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from gpu_runtime import ClosedError, DeviceArray, DevicePtr
from layers import reference as ref
from layers.ngram_embed import NgramDecoder, NgramEmbedding
from layers.ngram_embed.decoder import NO_ROW_CACHE
from layers.overlay import OverlaySlots
from tests.helpers.fakes import RecordingBackend, refused
from tests.helpers import bits, decoder_checks
from tests.helpers.decoder import World
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
    assert names == ["ngram_decode_gather", "dense_gemm_bf16_word"] * 2 + ["token_history_rollback"]
    assert gpu.ops == [], "no upload, allocation or memset in the hot path"
    assert all(launch.stream == 5 for launch in gpu.launches)
    prefill, step = gpu.launches[0], gpu.launches[2]
    assert prefill.args[:3] == [P[0], P[1], P[2]] and prefill.args[10:15] == [20, 3, 0, 4, dec.hist_len]
    assert step.args[1] == 0 and step.args[10:13] == [12, 4, 3]
    assert dec.hist_len == 2 + 2
    gemm = gpu.launches[1]
    assert gemm.args[3] == 20 and gemm.args[6] == dec.word_ids


def test_the_state_is_set_before_construction_returns():
    """The histories and positions are set on the construction stream, which is waited for: a
    first call on another (non-blocking) stream finds them set."""
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=3, splits=2, eos_id=7)
    weights = device_weights(gpu, random_layer(np.random.default_rng(1), dims, "bf"))
    before = len(gpu.ops)
    dec = NgramDecoder(weights, max_seqs=4, max_rows=32, stream=9)
    ops = [op[0] for op in gpu.ops[before:]]
    assert ops[-4:] == ["memset"] * 3 + ["sync"] and gpu.ops[-1] == ("sync", 9)
    dec.close()


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
    decoder too (test_tensor_parallel_runners.py)."""
    check(world)


@pytest.mark.gpu
def test_long_histories_take_the_unshuffled_window_path(gpu, rng):
    """max_draft 40: the ring (42 tokens) is longer than a warp, so the kernel reads the window
    from the ring token by token instead of through one shuffle; drafts of up to 40 roll back."""
    w = World(gpu, rng, max_draft=40, max_rows=160)
    try:
        decoder_checks.k_token_steps_with_rollbacks(w)
    finally:
        w.close()


def _assert_near_the_fused_reference(w, got, slots, lens):
    """Each slot's prefill rows (``got``, slot after slot) against the numpy fused reference for
    its context, within the reference's rounding."""
    starts = np.cumsum([0, *lens])
    for s, lo, hi in zip(slots, starts[:-1], starts[1:]):
        want = ref.ngram_embed_fused(w.dims, w.host.word, w.host.tables, w.host.projs,
                                     np.asarray(w.ctx[s]), int(hi - lo))
        g, x = got[lo:hi].astype(np.float64), want.astype(np.float64)
        assert (np.abs(g - x) <= np.abs(x) * 2.0**-7 + 1e-6).all()


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[30, 10], [70, 30]])
def test_split_k_shapes_equal_the_fused_path_and_the_reference(gpu, rng, lens):
    """12 tables of 24 (k = 288 > 256): the word GEMM, the gather's programmatic dependent, takes
    the split-K path over a 2-CTA cluster (the second CTA one k-stage), with 64-token tiles for
    40 rows and 128-token tiles for 100; the prefill's rows equal the fused path's bit for bit
    and the fused reference within its rounding."""
    w = World(gpu, rng, max_ngram=4, splits=4, max_rows=128, eos=False)
    try:
        assert w.dims.num_tables() * w.dims.table_dim() == 288
        got, want = w.prefill([0, 1], lens)
        np.testing.assert_array_equal(bits(got), bits(want))
        _assert_near_the_fused_reference(w, got, [0, 1], lens)
    finally:
        w.close()


@pytest.mark.gpu
def test_outputs_match_the_fused_reference(gpu, rng):
    w = World(gpu, rng, kinds="fb", max_ngram=4, splits=2, eos=False)
    try:
        got, _ = w.prefill([0, 1], [20, 3])
        _assert_near_the_fused_reference(w, got, [0, 1], [20, 3])
    finally:
        w.close()
