"""NgramDecoder as an engine drives it: padded graph batches (PAD_SLOT), forks, history-only
seeding (prefix-cache hits), per-sequence adapters inside the n-gram sum, and batch invariance. On
the CPU: the launches seed, fork and an adapter step make, and every adapter refusal before any
launch. On the GPU: every row bit for bit the fused path on the same tokens (with the same
adapters, and on weights whose word table holds the adapter's rows), padded rows zeros, flags
exactly where a bad value was, and nothing written outside the outputs. Buffers from other
libraries (the array interface, DLPack, CuPy, torch): test_decoder_foreign_arrays.py."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from gpu_runtime import ClosedError, DeviceArray
from layers import reference as ref
from layers.ngram_embed import NO_ADAPTER, PAD_SLOT, DecodeError, FusedNgramEmbedding, NgramDecoder, NgramWeights
from layers.dense_weight import BF16, DenseWeight
from tests.helpers.fakes import ForeignArray
from tests.helpers import Guarded, bits
from tests.helpers.decoder import P, World, recording, u32
from tests.helpers.overlay import random_overlay

GATHER_ADAPTERS = slice(21, 28)  # ngram_decode_gather's adapters .. word_over
GEMM_WORD_OVER = 8               # dense_gemm_bf16_word's word_over


# -- CPU ----------------------------------------------------------------------------------------
def test_pad_and_no_adapter_are_the_all_ones_word():
    assert PAD_SLOT == NO_ADAPTER == 0xFFFFFFFF == np.uint32(np.int32(-1))


def test_seed_and_fork_are_one_launch_each_with_nothing_else():
    gpu, dec, _ = recording()
    gpu.launches.clear()
    gpu.ops.clear()
    dec.seed(P[0], P[1], P[2], 3, 300, stream=5)  # more tokens than max_rows: no gather, no limit
    dec.fork(P[3], P[4], 7, stream=5)
    assert [gpu.kernel_of(launch)[1] for launch in gpu.launches] == ["token_history_seed", "token_history_fork"]
    assert gpu.ops == [], "no upload, allocation or memset"
    seed, fork = gpu.launches
    no_map, no_mask, no_dead = 0, 0, 0xFFFFFFFF  # the n-gram decoder's TokenCode: entries are the tokens
    assert seed.args == [P[0], P[1], P[2], no_map, no_mask, dec.hist, dec.state, dec.ctrl, 300, 3, 4, dec.hist_len,
                         500, no_dead]
    assert seed.grid == (1, 1, 1) and seed.stream == 5
    assert fork.args == [P[3], P[4], dec.hist, dec.state, dec.ctrl, 7, 4, dec.hist_len]
    assert fork.grid == (1, 1, 1) and fork.stream == 5


def test_adapters_route_through_the_gather_into_the_gemm():
    gpu, dec, slots = recording(adapters=3)
    gpu.launches.clear()
    dec.step(P[0], P[1], 4, P[2], stream=2, k=2, adapters=P[3])
    gather, gemm = gpu.launches
    assert gather.args[GATHER_ADAPTERS] == [P[3], slots.embed_slot_map_tab, slots.embed_rows_tab,
                                            slots.embed_n_tab, 3, dec.dims.hidden_size, dec.word_over]
    assert gemm.args[GEMM_WORD_OVER] == dec.word_over
    # one word pair per row beside the T table pairs: (8 rows * (4 + 1)) / 8 warps a block
    assert gather.grid == (5, 1, 1)
    gpu.launches.clear()
    dec.step(P[0], P[1], 4, P[2], stream=2)  # no adapters this call: nulls, the base word table
    gather, gemm = gpu.launches
    assert gather.args[GATHER_ADAPTERS] == [0, 0, 0, 0, 0, 0, 0] and gemm.args[GEMM_WORD_OVER] == 0


def test_adapter_refusals_launch_nothing():
    gpu, dec, _ = recording()
    gpu.launches.clear()
    with pytest.raises(ValueError, match="adapters given, but the decoder was built without adapter_slots"):
        dec.step(P[0], P[1], 2, P[2], adapters=P[3])
    with pytest.raises(ValueError, match="vocab 500 x 41, the model's word table is 500 x 40"):
        recording(adapters=2, h=41)
    gpu, dec, slots = recording(adapters=2)
    with pytest.raises(TypeError, match="adapters: dtype float32"):
        dec.step(P[0], P[1], 2, P[2], adapters=ForeignArray(P[3], (2,), "<f4"))
    with pytest.raises(ValueError, match="adapters: 1 entries, the call needs 2"):
        dec.step(P[0], P[1], 2, P[2], adapters=ForeignArray(P[3], (1,), "<u4"))
    with pytest.raises(ValueError, match="width 41, the served table 40"):  # a wrong adapter, at load
        slots.load(0, random_overlay(np.random.default_rng(2), 500, 41, 3, None))
    with pytest.raises(TypeError, match="adapter_slots must be an OverlaySlots"):
        NgramDecoder(dec.weights, max_seqs=2, max_rows=4, adapter_slots=object())
    gpu.launches.clear()
    slots.close()
    with pytest.raises(ClosedError, match="OverlaySlots is closed"):
        dec.step(P[0], P[1], 2, P[2], adapters=P[3])
    assert gpu.launches == []


# -- GPU: padded graph batches ------------------------------------------------------------------
LADDER = (1, 2, 4, 8, 16)


def _padded(live: list[int], size: int, fill: np.ndarray) -> np.ndarray:
    """``live`` then ``fill`` values up to ``size`` entries (u32)."""
    return np.concatenate([np.asarray(live, np.uint32), fill[:size - len(live)].astype(np.uint32)])


@pytest.mark.gpu
def test_one_decoder_serves_every_graph_of_a_padded_ladder(gpu, rng):
    """Graphs captured at every batch size of a ladder (and k = 1, 2) over one set of buffers;
    each replay pads the live batch with PAD_SLOT entries whose tokens are garbage (even >=
    vocab): their rows come out zeros, no flag is raised and no history moves."""
    w = World(gpu, rng, max_seqs=16, max_rows=64, max_draft=2, batch_invariant=True)  # padding changes m
    dec, s, v = w.dec, w.stream, w.dims.vocab_size
    tok_d, slot_d, cnt_d = (DeviceArray.empty(gpu, (32,), np.uint32, s) for _ in range(3))
    graphs: dict[tuple[int, int], int] = {}
    try:
        w.prefill(list(range(10)), [int(n) for n in rng.integers(0, 9, 10)])
        for size in LADDER:
            for k in (1, 2):
                slot_d.upload(np.full(32, PAD_SLOT, np.uint32))
                tok_d.upload(rng.integers(0, 2 * v, 32).astype(np.uint32))
                w.out.poison()
                gpu.synchronize(0)
                dec.step(tok_d, slot_d, size, w.out.ptr, s, k=k)  # eager, all padding: loads kernels
                assert not bits(w.read(size * k)).any()
                gpu.begin_capture(s)
                dec.step(tok_d, slot_d, size, w.out.ptr, s, k=k)
                graphs[size, k] = gpu.end_capture(s)
        assert dec.check_errors() == DecodeError.NONE
        for it in range(40):
            b, k = int(rng.integers(1, 11)), int(rng.integers(1, 3))
            size = next(x for x in LADDER if x >= b)
            live = [int(x) for x in rng.choice(10, b, replace=False)]
            toks = w.tokens(b * k)
            gpu.synchronize(s)
            tok_d.upload(np.concatenate([toks, rng.integers(0, 2 * v, 32 - b * k)]).astype(np.uint32))
            slot_d.upload(_padded(live, 32, np.full(32, PAD_SLOT)))
            w.out.poison()
            gpu.synchronize(0)
            gpu.launch_graph(graphs[size, k], s)
            got = w.read(size * k)
            for i, slot in enumerate(live):
                w.ctx[slot].extend(int(x) for x in toks[i * k:(i + 1) * k])
            assert np.array_equal(bits(got[:b * k]), bits(w.expect(live, [k] * b, b * k))), it
            assert not bits(got[b * k:]).any(), "padded rows are zeros"
            assert dec.check_errors() == DecodeError.NONE, it
            if k == 2:  # reject some drafts; the padded entries' garbage counts are ignored
                counts = rng.integers(0, 3, b)
                cnt_d.upload(_padded(list(counts), 32, rng.integers(0, 2**32, 32, dtype=np.uint64)))
                dec.rollback(slot_d, cnt_d, size, s)
                for slot, n in zip(live, counts):
                    del w.ctx[slot][len(w.ctx[slot]) - int(n):]
                assert dec.check_errors() == DecodeError.NONE
        for slot in range(16):
            assert dec.history(slot).tolist() == w.ctx[slot][-2:], slot
    finally:
        gpu.synchronize(s)
        for exe in graphs.values():
            gpu.destroy_graph(exe)
        for a in (tok_d, slot_d, cnt_d):
            a.free()
        w.close()


@pytest.mark.gpu
def test_padded_prefill_sequences_write_zero_rows(gpu, rng):
    w = World(gpu, rng, batch_invariant=True)
    try:
        w.prefill([0, 1], [4, 2])
        before = {s: w.dec.history(s).tolist() for s in range(6)}
        lens = [3, 5, 0, 2, 0]
        slots = [0, PAD_SLOT, PAD_SLOT, 1, 2]
        toks = w.tokens(sum(lens))
        toks[4] = w.dims.vocab_size + 9  # a bad token in a padded sequence: not looked at
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.uint32)
        w.out.poison()
        gpu.synchronize(0)
        with u32(gpu, toks) as t, u32(gpu, cu) as c, u32(gpu, slots) as sl:
            gpu.synchronize(0)
            w.dec.prefill(t, c, sl, 5, len(toks), w.out.ptr, w.stream)
            got = w.read(len(toks))
        assert w.dec.check_errors() == DecodeError.NONE
        assert not bits(got[3:8]).any()
        w.ctx[0].extend(int(x) for x in toks[:3])
        w.ctx[1].extend(int(x) for x in toks[8:10])
        want = w.expect([0, 1], [3, 2], 5)
        assert np.array_equal(bits(got[:3]), bits(want[:3])) and np.array_equal(bits(got[8:]), bits(want[3:]))
        assert w.dec.history(2).tolist() == before[2] == []
        for s in range(3, 6):
            assert w.dec.history(s).tolist() == before[s]
    finally:
        w.close()


# -- GPU: fork ---------------------------------------------------------------------------------
@pytest.mark.gpu
def test_fork_copies_history_and_position(gpu, rng):
    """A request forks into three samples (one pair padded); every sample then decodes on its
    own tokens, drafts and rollbacks (the position copied too), equal to the fused path on the
    copied context. A bad slot is flagged and its pair left alone. The fork is captured once and
    replayed with other slots."""
    w = World(gpu, rng, max_seqs=8)
    dec, s = w.dec, w.stream
    try:
        w.prefill([0, 5], [9, 4])
        w.reset(2)
        src = [0, 0, 0, PAD_SLOT]
        dst = [2, 3, 4, 1]
        with u32(gpu, src) as a, u32(gpu, dst) as b:
            gpu.synchronize(0)
            dec.fork(a, b, 4, s)
            gpu.synchronize(s)
        for d in (2, 3, 4):
            w.ctx[d] = list(w.ctx[0])
        assert dec.check_errors() == DecodeError.NONE
        assert dec.history(1).tolist() == []  # the padded pair's destination
        samples = [0, 2, 3, 4]
        for it in range(6):
            k = int(rng.integers(1, 4))
            toks = w.tokens(4 * k)
            with u32(gpu, toks) as t, u32(gpu, samples) as sl:
                w.out.poison()
                gpu.synchronize(0)
                dec.step(t, sl, 4, w.out.ptr, s, k=k)
                got = w.read(4 * k)
            for i, slot in enumerate(samples):
                w.ctx[slot].extend(int(x) for x in toks[i * k:(i + 1) * k])
            assert np.array_equal(bits(got), bits(w.expect(samples, [k] * 4, 4 * k))), it
            counts = rng.integers(0, k, 4)
            with u32(gpu, samples) as sl, u32(gpu, counts) as c:
                gpu.synchronize(0)
                dec.rollback(sl, c, 4, s)
                gpu.synchronize(s)
            for slot, n in zip(samples, counts):
                del w.ctx[slot][len(w.ctx[slot]) - int(n):]
        assert dec.check_errors() == DecodeError.NONE
        before = {x: dec.history(x).tolist() for x in range(8)}
        with u32(gpu, [5, 8, 3]) as a, u32(gpu, [6, 1, 9]) as b:  # src 8 and dst 9 are bad
            gpu.synchronize(0)
            dec.fork(a, b, 3, s)
            gpu.synchronize(s)
        assert dec.check_errors() == DecodeError.SLOT
        w.ctx[6] = list(w.ctx[5])
        assert dec.history(6).tolist() == w.ctx[5][-2:]
        assert all(dec.history(x).tolist() == before[x] for x in (0, 1, 2, 3, 4, 5, 7))
        # captured: replayed with other slots in the same buffers
        with u32(gpu, [2, 3]) as a, u32(gpu, [7, 1]) as b:
            gpu.synchronize(0)
            gpu.begin_capture(s)
            dec.fork(a, b, 2, s)
            exe = gpu.end_capture(s)
            gpu.launch_graph(exe, s)
            gpu.synchronize(s)
            a.upload(np.array([4, 4], np.uint32))
            b.upload(np.array([0, 5], np.uint32))
            gpu.synchronize(0)
            gpu.launch_graph(exe, s)
            gpu.synchronize(s)
            gpu.destroy_graph(exe)
        for d, x in ((7, 2), (1, 3), (0, 4), (5, 4)):
            w.ctx[d] = list(w.ctx[x])
        for slot in range(8):
            assert dec.history(slot).tolist() == w.ctx[slot][-2:], slot
        every = list(range(8))
        got = w.step(w.tokens(8), every)  # poisoned first: the output holds an earlier step's rows
        assert np.array_equal(bits(got), bits(w.expect(every, [1] * 8, 8)))
        assert dec.check_errors() == DecodeError.NONE
    finally:
        w.close()


# -- GPU: seed (prefix-cache hits) ----------------------------------------------------------------
@pytest.mark.gpu
def test_seed_then_prefill_equals_prefilling_everything(gpu, rng):
    """Prefixes seeded (longer and shorter than the history, empty, padded), then the suffixes
    prefilled: the rows equal the fused path on prefix + suffix; a seed in a captured graph
    replays with new tokens; bad tokens and slots are flagged."""
    w = World(gpu, rng, max_seqs=8, max_draft=3)
    dec, s = w.dec, w.stream
    try:
        for slot in range(8):
            w.reset(slot)
        prefix_lens = [40, 1, 0, 3, 7, 2]
        slots = [0, 1, 2, PAD_SLOT, 3, 4]
        prefixes = [w.tokens(n) for n in prefix_lens]
        flat = np.concatenate(prefixes)
        cu = np.concatenate([[0], np.cumsum(prefix_lens)]).astype(np.uint32)
        with u32(gpu, flat) as t, u32(gpu, cu) as c, u32(gpu, slots) as sl:
            gpu.synchronize(0)
            dec.seed(t, c, sl, len(slots), flat.size, s)
            gpu.synchronize(s)
        for slot, p in zip(slots, prefixes):
            if slot != PAD_SLOT:
                w.ctx[slot].extend(int(x) for x in p)
        assert dec.check_errors() == DecodeError.NONE
        got, want = w.prefill([0, 1, 2, 3, 4], [3, 1, 2, 5, 1])
        assert np.array_equal(bits(got), bits(want))
        # captured seed, replayed with new prefixes for slots 5 and 6
        with u32(gpu, np.zeros(12)) as t, u32(gpu, [0, 5, 12]) as c, u32(gpu, [5, 6]) as sl:
            gpu.synchronize(0)
            gpu.begin_capture(s)
            dec.seed(t, c, sl, 2, 12, s)
            exe = gpu.end_capture(s)
            for _ in range(2):
                new = w.tokens(12)
                t.upload(new)
                gpu.synchronize(0)
                gpu.launch_graph(exe, s)
                gpu.synchronize(s)
                w.ctx[5].extend(int(x) for x in new[:5])
                w.ctx[6].extend(int(x) for x in new[5:])
            gpu.destroy_graph(exe)
        got, want = w.prefill([5, 6], [2, 4])
        assert np.array_equal(bits(got), bits(want))
        assert dec.check_errors() == DecodeError.NONE
        # bad values: a token >= vocab among the last ones read (kept as "no token"), a bad slot
        before = dec.history(7).tolist()
        bad = w.tokens(6)
        bad[5] = w.dims.vocab_size
        with u32(gpu, bad) as t, u32(gpu, [0, 6, 6]) as c, u32(gpu, [7, 9]) as sl:
            gpu.synchronize(0)
            dec.seed(t, c, sl, 2, 6, s)
            gpu.synchronize(s)
        assert dec.check_errors() == DecodeError.TOKEN | DecodeError.SLOT
        assert dec.history(7).tolist() == [int(bad[4]), 0xFFFFFFFF] != before
    finally:
        w.close()


# -- GPU: adapters inside the n-gram sum ----------------------------------------------------------
@contextmanager
def _adapter_runners(w: World, count: int):
    """For each of adapters 0..count-1: the fused path (batch invariant as ``w``'s) on weights
    that borrow ``w``'s tables and projections and own a word table holding that adapter's rows;
    runners, then weights, closed on exit."""
    made = []
    try:
        for a in range(count):
            weight = DenseWeight.from_numpy(w.gpu, w.word_table(a))
            weights = NgramWeights(w.dims, weight, w.weights.tables, w.weights.projs, w.gpu)
            weights.own(weight)
            w.gpu.synchronize(0)
            made.append((FusedNgramEmbedding(weights, w.fused.max_rows, w.stream,
                                             batch_invariant=w.fused.projection.path is not None), weights))
        yield [fused for fused, _ in made]
    finally:
        w.gpu.synchronize(w.stream)
        for things in made:
            for thing in things:
                thing.close()


def _alone(w: World, fused: FusedNgramEmbedding, ctx, n: int) -> np.ndarray:
    """The last ``n`` rows of ``ctx`` embedded by ``fused`` on their own."""
    with Guarded(w.gpu, (n, w.dims.hidden_size), BF16, w.rng) as out:
        out.poison()
        w.gpu.synchronize(0)
        fused.embed_batch([np.asarray(ctx)], [n], out.ptr, w.stream)
        w.gpu.synchronize(w.stream)
        return out.read()


@pytest.mark.gpu
def test_adapter_rows_are_used_inside_the_sum(gpu, rng):
    """Each sequence on one of three adapters or none (NO_ADAPTER, or int32 -1): its rows are bit
    for bit those of weights whose word table holds that adapter's rows, and of the fused path
    with the same adapters, and within the fused contract of the numpy reference on that table."""
    # a third of the vocabulary overridden; batch invariant: rows are compared with single sequences
    w = World(gpu, rng, max_seqs=6, adapters=3, override=200, batch_invariant=True)
    dec, s = w.dec, w.stream
    try:
        with _adapter_runners(w, 3) as runners:
            seqs = [0, 1, 2, 3, 4]
            choice = [0, NO_ADAPTER, 2, 1, 0]
            lens = [7, 5, 9, 1, 4]
            got, want = w.prefill(seqs, lens, adapters=choice)
            assert np.array_equal(bits(got), bits(want))
            at = np.concatenate([[0], np.cumsum(lens)])
            for i, (slot, a) in enumerate(zip(seqs, choice)):
                rows = got[at[i]:at[i + 1]]
                if a != NO_ADAPTER:
                    assert np.array_equal(bits(rows), bits(_alone(w, runners[a], w.ctx[slot], lens[i]))), i
                x = ref.ngram_embed_fused(w.dims, w.word_table(None if a == NO_ADAPTER else a), w.host.tables,
                                          w.host.projs, np.asarray(w.ctx[slot]), lens[i]).astype(np.float64)
                assert (np.abs(rows.astype(np.float64) - x) <= np.abs(x) * 2.0**-7 + 1e-6).all(), i
            for it in range(5):  # steps of k = 2, adapters as int32 with -1 for none
                toks = w.tokens(10)
                index = np.array([-1 if a == NO_ADAPTER else a for a in choice], np.int32)
                with u32(gpu, toks) as t, u32(gpu, seqs) as sl, DeviceArray.from_numpy(gpu, index) as ad:
                    w.out.poison()
                    gpu.synchronize(0)
                    dec.step(t, sl, 5, w.out.ptr, s, k=2, adapters=ad)
                    got = w.read(10)
                for i, slot in enumerate(seqs):
                    w.ctx[slot].extend(int(x) for x in toks[2 * i:2 * i + 2])
                assert np.array_equal(bits(got), bits(w.expect(seqs, [2] * 5, 10, adapters=choice))), it
                for i, (slot, a) in enumerate(zip(seqs, choice)):
                    if a != NO_ADAPTER:
                        want = _alone(w, runners[a], w.ctx[slot], 2)
                        assert np.array_equal(bits(got[2 * i:2 * i + 2]), bits(want)), (it, i)
        assert dec.check_errors() == DecodeError.NONE
        # a bad adapter index: flagged, that sequence's rows zeros, the others unharmed
        toks = w.tokens(5)
        with u32(gpu, toks) as t, u32(gpu, seqs) as sl, u32(gpu, [0, 3, NO_ADAPTER, 7, 1]) as ad:
            w.out.poison()
            gpu.synchronize(0)
            dec.step(t, sl, 5, w.out.ptr, s, adapters=ad)
            got = w.read(5)
        for slot, x in zip(seqs, toks):
            w.ctx[slot].append(int(x))
        assert dec.check_errors() == DecodeError.ADAPTER
        assert not bits(got[[1, 3]]).any()
        want = w.expect(seqs, [1] * 5, 5, adapters=[0, 0, NO_ADAPTER, 0, 1])
        assert np.array_equal(bits(got[[0, 2, 4]]), bits(want[[0, 2, 4]]))
    finally:
        w.close()


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_fused_embed_batch_takes_adapters(gpu, rng, graph):
    """A batch of three sequences on two adapters or none: each sequence's rows bit for bit those
    of weights whose word table holds its adapter's rows, embedding it alone (batch invariant)."""
    w = World(gpu, rng, adapters=2, override=150, batch_invariant=True)
    try:
        with _adapter_runners(w, 2) as runners:
            for it in range(4):
                contexts = [w.tokens(int(n)) for n in rng.integers(1, 30, 3)]
                seq_lens = [int(rng.integers(1, len(c) + 1)) for c in contexts]
                choice = [int(x) for x in rng.choice([0, 1, NO_ADAPTER], 3)]
                rows = sum(seq_lens)
                with Guarded(gpu, (rows, w.dims.hidden_size), BF16, rng) as out:
                    out.poison()
                    gpu.synchronize(0)
                    w.fused.embed_batch(contexts, seq_lens, out.ptr, w.stream, graph=graph, adapters=choice)
                    gpu.synchronize(w.stream)
                    got = out.read()
                    out.assert_guards_intact()
                at = 0
                for ctx, n, a in zip(contexts, seq_lens, choice):
                    want = _alone(w, w.fused if a == NO_ADAPTER else runners[a], ctx, n)
                    assert np.array_equal(bits(got[at:at + n]), bits(want)), (it, a)
                    at += n
    finally:
        w.close()


# -- GPU: batch invariance --------------------------------------------------------------------------
@pytest.mark.gpu
def test_batch_invariant_rows_equal_each_request_alone(gpu, rng):
    """batch_invariant=True: a ragged prefill of 85 rows and a padded step of 48 in 64 give every
    sequence's rows bit for bit as the fused path embeds that sequence alone (1 to 30 rows)."""
    w = World(gpu, rng, max_seqs=64, max_rows=128, adapters=2, batch_invariant=True)
    try:
        lens, choice = [30, 20, 25, 1, 9], [0, NO_ADAPTER, 1, 0, NO_ADAPTER]
        got, _ = w.prefill(list(range(5)), lens, adapters=choice)
        at = 0
        for slot, (n, a) in enumerate(zip(lens, choice)):
            assert np.array_equal(bits(got[at:at + n]), bits(w.expect([slot], [n], n, adapters=[a]))), slot
            at += n
        toks = w.tokens(48)
        slots = list(range(5)) + list(range(10, 53)) + [PAD_SLOT] * 16
        with u32(gpu, np.concatenate([toks, np.zeros(16, np.uint32)])) as t, u32(gpu, slots) as sl:
            w.out.poison()
            gpu.synchronize(0)
            w.dec.step(t, sl, 64, w.out.ptr, w.stream)
            got = w.read(64)
        assert not bits(got[48:]).any()
        for i, slot in enumerate(slots[:48]):
            w.ctx[slot].append(int(toks[i]))
            assert np.array_equal(bits(got[i:i + 1]), bits(w.expect([slot], [1], 1))), slot
        assert w.dec.check_errors() == DecodeError.NONE
    finally:
        w.close()
