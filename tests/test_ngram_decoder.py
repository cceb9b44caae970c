"""NgramDecoder: on the CPU, two launches per call and no host work a capture could not hold, and
every host-side refusal before any launch; on the GPU, bit for bit the fused path on the same
tokens through ragged and chunked prefills, 100 graph-replayed decode steps, EOS, slot reuse,
k-token steps with rollbacks, host-memory reads of the histories, and every device-side bad
value flagged with the other rows intact and nothing written outside the outputs."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_runtime import ClosedError, DeviceArray, DevicePtr
from layers import reference as ref
from layers.ngram_embed.decoder import DecodeError, NgramDecoder
from tests.fakes import RecordingBackend
from tests.helpers import bits
from tests.helpers.decoder import World, u32
from tests.helpers.ngram import device_layer, random_layer, small_dims

P = [DevicePtr(0x100000 * (i + 1)) for i in range(6)]


def recording_decoder(max_draft=0):
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=3, splits=2, eos_id=7)
    layer = device_layer(gpu, random_layer(np.random.default_rng(1), dims, "bf"), max_tokens=8)
    return gpu, NgramDecoder(layer, max_seqs=4, max_rows=32, gpu=gpu, max_draft=max_draft)


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
    gpu.launches.clear()
    gpu.ops.clear()
    with pytest.raises(error, match=match):
        call(dec)
    assert gpu.launches == [] and gpu.ops == []


def test_device_arrays_are_checked_for_dtype_and_size():
    gpu, dec = recording_decoder()
    small = DeviceArray(gpu, P[0], (3,), np.uint32)
    wrong = DeviceArray(gpu, P[1], (8,), np.int64)
    gpu.launches.clear()
    with pytest.raises(ValueError, match="3 entries, the call needs 4"):
        dec.step(small, P[1], 4, P[2])
    with pytest.raises(TypeError, match="dtype int64, expected uint32"):
        dec.step(P[0], wrong, 2, P[2])
    assert gpu.launches == []
    dec.step(DeviceArray(gpu, P[0], (4,), np.uint32), P[1], 4, P[2])
    assert gpu.launches[0].args[0] == P[0]


def test_cached_tables_and_closed_objects_are_refused():
    gpu = RecordingBackend()
    dims = small_dims()
    cached = device_layer(gpu, random_layer(np.random.default_rng(2), dims, "b"), 8, cached=True)
    with pytest.raises(ValueError, match="RowCache tables"):
        NgramDecoder(cached, max_seqs=2, max_rows=4, gpu=gpu)
    layer = device_layer(gpu, random_layer(np.random.default_rng(3), dims, "b"), 8)
    for bad, error in ((0, ValueError), (-1, ValueError), (2**31, ValueError), (True, TypeError),
                       (1.0, TypeError)):
        with pytest.raises(error, match="max_seqs"):
            NgramDecoder(layer, max_seqs=bad, max_rows=4, gpu=gpu)
    with pytest.raises(ValueError, match="gpu is not the backend this layer was built with"):
        NgramDecoder(layer, max_seqs=2, max_rows=4, gpu=RecordingBackend())
    layer.close()
    with pytest.raises(ClosedError, match=r"NgramDecoder: the layer it serves \(NgramEmbedding\) is closed"):
        NgramDecoder(layer, max_seqs=2, max_rows=4, gpu=gpu)
    gpu, dec = recording_decoder()
    dec.fused.layer.close()
    with pytest.raises(ClosedError, match=r"the layer it serves \(NgramEmbedding\) is closed"):
        dec.step(P[0], P[1], 1, P[2])
    dec.close()
    dec.close()  # idempotent
    with pytest.raises(ClosedError, match="NgramDecoder is closed"):
        dec.reset(0)


# -- GPU --------------------------------------------------------------------------------------
@pytest.fixture
def world(gpu, rng):
    w = World(gpu, rng)
    yield w
    w.close()


@pytest.mark.gpu
def test_ragged_and_chunked_prefill_equal_the_fused_path(world):
    lens = [7, 1, 0, 2, 30, 12]  # a slot with no tokens, sequences shorter than N - 1
    got, want = world.prefill(list(range(6)), lens)
    assert np.array_equal(bits(got), bits(want))
    assert np.isfinite(got.astype(np.float32)).all()
    # Chunked prefill: later chunks continue each slot's history.
    for _ in range(3):
        chunk = [int(world.rng.integers(0, 9)) for _ in range(3)]
        got, want = world.prefill([4, 0, 2], chunk)
        assert np.array_equal(bits(got), bits(want))
    for s in range(6):
        n = world.dims.max_ngram - 1
        assert world.dec.history(s).tolist() == world.ctx[s][-n:]
    assert world.dec.check_errors() == DecodeError.NONE


@pytest.mark.gpu
def test_graph_replayed_decode_steps_with_resets_and_reuse(world):
    gpu, dec, rng = world.gpu, world.dec, world.rng
    slots = [0, 1, 2, 3]
    world.prefill(slots, [5, 1, 9, 2])
    d_tok, d_slots = u32(gpu, np.zeros(4)), u32(gpu, slots)
    out = world.out
    gpu.synchronize(0)
    dec.step(d_tok, d_slots, 4, out.ptr, world.stream)  # eager once: loads kernels, sets attributes
    gpu.synchronize(world.stream)
    for s in slots:
        world.ctx[s].append(0)
    gpu.begin_capture(world.stream)
    dec.step(d_tok, d_slots, 4, out.ptr, world.stream)
    graph = gpu.end_capture(world.stream)
    try:
        for step in range(100):
            if step in (30, 71):  # a request ends; its slot is reused by a new one
                slot = slots[step % 4]
                world.reset(slot)
                new = world.tokens(int(rng.integers(1, 6)))
                with u32(gpu, new) as t, u32(gpu, [0, new.size]) as cu, u32(gpu, [slot]) as sl:
                    gpu.synchronize(0)
                    dec.prefill(t, cu, sl, 1, new.size, out.ptr, world.stream)
                    gpu.synchronize(world.stream)
                world.ctx[slot].extend(int(x) for x in new)
            toks = world.tokens(4)
            gpu.synchronize(world.stream)
            gpu.copy_h2d_async(toks, d_tok.ptr, world.stream)
            out.poison()
            gpu.synchronize(0)
            gpu.launch_graph(graph, world.stream)
            got = world.read(4)
            for s, t in zip(slots, toks):
                world.ctx[s].append(int(t))
            want = world.expect(slots, [1] * 4, 4)
            assert np.array_equal(bits(got), bits(want)), step
        assert dec.check_errors() == DecodeError.NONE
    finally:
        gpu.destroy_graph(graph)
        d_tok.free()
        d_slots.free()


@pytest.mark.gpu
def test_k_token_steps_with_rollbacks(world):
    _k_steps_with_rollbacks(world, max_k=3)


@pytest.mark.gpu
def test_long_histories_take_the_unshuffled_window_path(gpu, rng):
    """max_draft 40: the ring (42 tokens) is longer than a warp, so the kernel reads the window
    from the ring token by token instead of through one shuffle; drafts of up to 40 roll back."""
    w = World(gpu, rng, max_draft=40, max_rows=160)
    try:
        _k_steps_with_rollbacks(w, max_k=40)
    finally:
        w.close()


def _k_steps_with_rollbacks(world, max_k):
    gpu, dec, rng = world.gpu, world.dec, world.rng
    slots = [5, 2, 0]
    world.prefill(slots, [4, 1, 6])
    for it in range(12):
        k = int(rng.integers(1, max_k + 1))
        toks = world.tokens(3 * k)
        with u32(gpu, toks) as t, u32(gpu, slots) as sl:
            world.out.poison()
            gpu.synchronize(0)
            dec.step(t, sl, 3, world.out.ptr, world.stream, k=k)
            got = world.read(3 * k)
        for i, s in enumerate(slots):
            world.ctx[s].extend(int(x) for x in toks[i * k:(i + 1) * k])
        want = world.expect(slots, [k] * 3, 3 * k)
        assert np.array_equal(bits(got), bits(want)), it
        counts = rng.integers(0, k + 1, 3)  # drafts rejected
        with u32(gpu, slots) as sl, u32(gpu, counts) as c:
            gpu.synchronize(0)
            dec.rollback(sl, c, 3, world.stream)
            gpu.synchronize(world.stream)
        for s, n in zip(slots, counts):
            if n:
                del world.ctx[s][-int(n):]
    assert dec.check_errors() == DecodeError.NONE


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


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["token", "slot", "seqlens", "rollback"])
def test_bad_device_values_are_flagged_and_contained(world, bad):
    gpu, dec, v = world.gpu, world.dec, world.dims.vocab_size
    world.prefill([0, 1, 2], [6, 3, 4])
    before = {s: dec.history(s).tolist() for s in range(6)}
    toks = world.tokens(8)
    cu = np.array([0, 3, 5, 8], np.uint32)
    slots = np.array([0, 1, 2], np.uint32)
    if bad == "token":
        toks[4] = v + 3  # second sequence, second row
    elif bad == "slot":
        slots[1] = 6
    elif bad == "seqlens":
        cu[2:] = [7, 5]  # the last sequence runs backwards and the total is not 8
    world.out.poison()
    gpu.synchronize(0)
    if bad == "rollback":
        with u32(gpu, [0, 1, 2]) as sl, u32(gpu, [0, 3 + 4, 1]) as c:  # 7 > max_draft 3
            gpu.synchronize(0)
            dec.rollback(sl, c, 3, world.stream)
            gpu.synchronize(world.stream)
        world.ctx[2].pop()
        assert dec.check_errors() == DecodeError.ROLLBACK
        assert dec.history(1).tolist() == before[1] and dec.history(2).tolist() == world.ctx[2][-2:]
        assert dec.check_errors() == DecodeError.NONE
        return
    with u32(gpu, toks) as t, u32(gpu, cu) as c, u32(gpu, slots) as sl:
        gpu.synchronize(0)
        dec.prefill(t, c, sl, 3, 8, world.out.ptr, world.stream)
        got = world.read(8)
    want_flag = {"token": DecodeError.TOKEN, "slot": DecodeError.SLOT, "seqlens": DecodeError.SEQLENS}[bad]
    assert dec.check_errors() == want_flag
    assert dec.check_errors() == DecodeError.NONE  # cleared
    bad_rows = {"token": [4], "slot": [3, 4], "seqlens": [7]}[bad]
    assert not bits(got[bad_rows]).any(), "rows of bad input are zeros"
    good = [r for r in range(8) if r not in bad_rows]
    assert np.isfinite(got[good].astype(np.float32)).all()
    # The good sequence(s) continued normally; the bad one's slot was left alone or sanitised.
    world.ctx[0].extend(int(x) for x in toks[:3])
    want0 = world.expect([0], [3], 3)
    assert np.array_equal(bits(got[:3]), bits(want0))
    if bad == "slot":
        assert dec.history(1).tolist() == before[1]
    if bad == "seqlens":
        assert dec.history(2).tolist() == before[2]
    if bad == "token":
        assert dec.history(1).tolist() == [int(toks[3]), 0xFFFFFFFF]
    for s in range(3, 6):
        assert dec.history(s).tolist() == before[s]
