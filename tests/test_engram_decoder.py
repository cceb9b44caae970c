"""``EngramDecoder``: the calls are launches only (CPU, a recording backend), and on the GPU every
stage equals the numpy references: row ids (``layers.engram.hashing``), the gathered rows bit for
bit (the fp8 linear's quantised operand), ``kv`` within a float64 product of those operands, the
gated residual within half a bf16 ulp of the float64 result and untouched at non-text positions;
steps, seeds, forks, rollbacks and graph replays bit for bit a one-shot prefill."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gpu_runtime import DeviceArray
from layers.engram.config import EngramConfig
from layers.engram.decoder import PAD_SLOT, DecodeError, EngramDecoder
from layers.engram.hashing import compress, row_ids
from layers.engram.token_map import TokenMap
from layers.engram.weights import EngramWeights, Shard, pack_rows, row_stride
from layers.ngram_store.placement import DeviceBudget
from layers.reference.engram import act_quant, emb_from_rows, gate_ref, wkv_fp64
from tests.helpers import random_bf16
from tests.helpers.engram import arrays, tiny, token_map
from tests.helpers.fakes import RecordingBackend

BF16 = np.dtype(ml_dtypes.bfloat16)
IMAGE = 49  # tiny()'s image_token_id


# -- CPU ----------------------------------------------------------------------------------------
def test_pack_rows_puts_the_scales_after_the_row_and_pads_to_8():
    assert [row_stride(w) for w in (32, 64, 256, 512)] == [40, 72, 264, 528]
    w = np.arange(2 * 64, dtype=np.uint8).reshape(2, 64)
    s = np.array([[7, 8], [9, 10]], np.uint8)
    packed = pack_rows(w, s, 72)
    assert packed.shape == (2, 72)
    assert (packed[:, :64] == w).all() and (packed[:, 64:66] == s).all() and (packed[:, 66:] == 0).all()


@pytest.mark.parametrize("placement", ["host", "device"])
def test_tables_are_packed_piece_by_piece_into_their_rows(rng, monkeypatch, placement):
    """Pieces of 7 rows (the last one short), a rank's range of rows: host rows packed in
    place, device rows uploaded from one reused piece; every byte as ``pack_rows`` packs it."""
    monkeypatch.setattr("layers.engram.weights.CHUNK_ROWS", 7)
    gpu, cfg, a = RecordingBackend(), tiny(), arrays(rng, tiny())
    w = EngramWeights.from_arrays(gpu, cfg, token_map(rng, cfg), a["tables"], a["wkv"], a["q"], a["k"],
                                  placement=placement, shard=Shard(1, 3))
    stride = row_stride(cfg.head_dim)
    for layer, (table, scale) in zip(w.layers, a["tables"]):
        want = pack_rows(table[layer.lo:layer.lo + layer.count], scale[layer.lo:layer.lo + layer.count], stride)
        if placement == "host":
            got = layer.table.host.reshape(-1, stride)
        else:
            at = int(layer.table.address)
            got = np.frombuffer(b"".join(op[1] for op in gpu.ops if op[0] == "h2d" and
                                         at <= op[2] < at + layer.count * stride), np.uint8).reshape(-1, stride)
        assert np.array_equal(got, want)


def test_shard_rows_split_as_the_reference_does():
    assert [Shard(r, 3).rows(10) for r in range(3)] == [(0, 4), (4, 4), (8, 2)]
    assert [Shard(r, 4).rows(2) for r in range(4)] == [(0, 1), (1, 1), (2, 0), (2, 0)]


def recording(rng, **kw):
    gpu, cfg = RecordingBackend(), tiny()
    a = arrays(rng, cfg)
    weights = EngramWeights.from_arrays(gpu, cfg, token_map(rng, cfg), a["tables"], a["wkv"], a["q"], a["k"])
    return gpu, cfg, EngramDecoder(weights, max_seqs=4, max_rows=32, **kw)


def test_calls_are_launches_only(rng):
    gpu, cfg, dec = recording(rng, max_draft=2)
    gpu.launches.clear()
    gpu.ops.clear()
    p = [0x1000 * (i + 1) for i in range(6)]
    dec.prefill(p[0], p[1], p[2], 3, 20, stream=5)
    dec.step(p[0], p[2], 4, stream=5, k=3)
    dec.apply(cfg.layer_ids[1], p[3], 12, stream=5)
    dec.rollback(p[2], p[4], 4, stream=5)
    dec.seed(p[0], p[1], p[2], 3, 300, stream=5, text=p[5])
    dec.fork(p[2], p[4], 2, stream=5)
    names = [gpu.kernel_of(launch)[1] for launch in gpu.launches]
    gemm = names[1]
    assert names == ["engram_lookup", gemm, gemm] * 2 + ["engram_gate", "token_history_rollback",
                                                         "token_history_seed", "token_history_fork"]
    assert gpu.ops == [], "no upload, allocation or memset in the hot path"
    assert all(launch.stream == 5 for launch in gpu.launches)
    lookup, gate = gpu.launches[0], gpu.launches[6]
    assert lookup.args[:4] == [p[0], p[1], p[2], 0]  # no text mask: the image id decides
    assert gate.args[:2] == [p[3], dec.kv_of(1)] and gate.args[5] == 12
    assert gpu.launches[8].args[3:5] == [int(dec.weights.token_map), p[5]]  # the seed: map and mask


def test_bad_calls_are_refused_before_any_launch(rng):
    gpu, cfg, dec = recording(rng)
    gpu.launches.clear()
    with pytest.raises(ValueError, match="over max_rows"):
        dec.prefill(0x1000, 0x2000, 0x3000, 1, 33)
    with pytest.raises(ValueError, match="over max_seqs"):
        dec.step(0x1000, 0x2000, 5)
    with pytest.raises(ValueError, match="has no Engram"):
        dec.apply(2, 0x1000, 1)
    with pytest.raises(ValueError, match="over max_rows"):
        dec.apply(1, 0x1000, 33)
    dec.close()
    with pytest.raises(Exception, match="closed"):
        dec.step(0x1000, 0x2000, 1)
    assert gpu.launches == []


@pytest.mark.parametrize(("threads", "error"), [(-1, ValueError), (1024, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_host_threads_are_refused(rng, threads, error):
    """The decoder's bound is the staging's own: a count it takes, HostStaging takes too."""
    with pytest.raises(error, match="host_threads"):
        recording(rng, host_threads=threads)


def test_a_token_map_of_the_wrong_size_is_refused(rng):
    cfg = tiny()
    a = arrays(rng, cfg)
    small = TokenMap(np.arange(cfg.vocab_size, dtype=np.int32) % (cfg.compressed_vocab_size - 1))
    with pytest.raises(ValueError, match="every hash multiplier derives"):
        EngramWeights.from_arrays(RecordingBackend(), cfg, small, a["tables"], a["wkv"], a["q"], a["k"])


def fixed_device_bytes(cfg: EngramConfig) -> int:
    """What ``DeviceBudget`` counts before any table (worked out here, apart from the code):
    each layer's wkv (bf16, and e4m3 with its e8m0 byte per 32 x 32 block) and q / k, the int32
    token map, and the hash's u64 multipliers, primes, offsets and 4-word table descriptors."""
    layers = len(cfg.layer_ids)
    wkv = cfg.kv_dim * cfg.emb_dim * 2 + cfg.kv_dim * cfg.emb_dim + -(-cfg.kv_dim // 32) * (cfg.emb_dim // 32)
    qk = 2 * cfg.hc_mult * cfg.hidden_size * 2
    hash_arrays = layers * (cfg.max_ngram + 2 * cfg.n_hash_cols + 4) * 8
    return layers * (wkv + qk) + cfg.vocab_size * 4 + hash_arrays


@pytest.mark.parametrize("room, places", [(0, ["host", "host"]), (1, ["device", "host"]), (2, ["device", "device"])])
def test_a_device_budget_puts_tables_on_the_device_in_order(rng, room, places):
    cfg, a = tiny(), arrays(rng, tiny())
    sizes = [rows * row_stride(cfg.head_dim) for rows in cfg.num_embeddings]
    budget = fixed_device_bytes(cfg) + sum(sizes[:room]) + (sizes[room] - 1 if room < 2 else 0)
    for placement in (DeviceBudget(budget), budget):
        w = EngramWeights.from_arrays(RecordingBackend(), cfg, token_map(rng, cfg), a["tables"], a["wkv"], a["q"],
                                      a["k"], placement=placement)
        assert [layer.table.where for layer in w.layers] == places


def test_a_device_budget_too_small_for_the_fixed_part_is_refused_before_any_upload(rng):
    cfg, a = tiny(), arrays(rng, tiny())
    gpu, fixed = RecordingBackend(), fixed_device_bytes(cfg)
    with pytest.raises(ValueError, match=rf"DeviceBudget\({fixed - 1}\): wkv \(bf16 and fp8\), q, k and the hash's "
                                         rf"arrays alone take {fixed} bytes"):
        EngramWeights.from_arrays(gpu, cfg, token_map(rng, cfg), a["tables"], a["wkv"], a["q"], a["k"],
                                  placement=DeviceBudget(fixed - 1))
    assert gpu.ops == [] and gpu.launches == []


# -- GPU ----------------------------------------------------------------------------------------
def u32(gpu, values, stream=0) -> DeviceArray:
    return DeviceArray.from_numpy(gpu, np.asarray(values, np.uint32), stream)


def read(gpu, address: int, shape, dtype) -> np.ndarray:
    out = np.zeros(shape, dtype)
    gpu.copy_d2h(out, address)
    return out


class Model:
    """A tiny model on the GPU and its references."""

    def __init__(self, gpu, rng, placement="device", **kw):
        self.cfg = cfg = tiny()
        self.map = token_map(rng, cfg)
        self.a = arrays(rng, cfg)
        a = self.a
        self.weights = EngramWeights.from_arrays(gpu, cfg, self.map, a["tables"], a["wkv"], a["q"], a["k"],
                                                 placement=placement)
        self.gpu = gpu

    def decoder(self, **kw) -> EngramDecoder:
        return EngramDecoder(self.weights, **kw)

    def ids(self, tokens, history=()) -> np.ndarray:
        """Row ids [T, layers, cols] of a sequence's tokens after ``history`` (raw tokens)."""
        seq = np.concatenate([np.asarray(history, np.int64), np.asarray(tokens, np.int64)])
        comp = compress(self.map.ids, seq, seq != IMAGE)
        return row_ids(self.cfg, comp, self.map.pad(self.cfg.pad_token_id))[len(history):]

    def operand(self, i: int, ids: np.ndarray) -> np.ndarray:
        """The gathered rows as the fp8 linear quantises them: bf16(q * s) [T, emb_dim]."""
        table, scale = self.a["tables"][i]
        emb = emb_from_rows(table, scale, ids[:, i, :])
        q, s = act_quant(emb)
        return (q.astype(np.float32) * np.repeat(s, 32, axis=1)).astype(BF16)

    def kv_exact(self, i: int, ids: np.ndarray) -> np.ndarray:
        table, scale = self.a["tables"][i]
        q, s = act_quant(emb_from_rows(table, scale, ids[:, i, :]))
        return wkv_fp64(q, s, *self.a["wkv"][i])


def ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """|got - exact| in bf16 ulps of the exact value."""
    ex = np.abs(exact.astype(np.float64))
    exp = np.floor(np.log2(np.maximum(ex, 2.0**-126)))
    return np.abs(got.astype(np.float64) - exact) / 2.0 ** (exp - 7)


def sequences(rng, lengths, image_rate=0.15):
    """Random token sequences (ids below vocab, ``IMAGE`` at some positions)."""
    out = []
    for n in lengths:
        t = rng.integers(0, IMAGE, n)
        t[rng.random(n) < image_rate] = IMAGE
        out.append(t)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["device", "host"])
def test_prefill_equals_the_references(gpu, rng, placement):
    m = Model(gpu, rng, placement)
    cfg = m.cfg
    seqs = sequences(rng, [7, 1, 12])
    tokens = np.concatenate(seqs)
    cu = np.cumsum([0] + [len(s) for s in seqs])
    t = len(tokens)
    with m.decoder(max_seqs=4, max_rows=32) as dec:
        for s in range(3):
            dec.reset(s)
        gpu.memset(dec.emb, 0x5A, 2 * 32 * cfg.emb_dim * 2)  # poison: every row must be written
        dec.prefill(u32(gpu, tokens), u32(gpu, cu), u32(gpu, [2, 0, 1]), 3, t)
        x = random_bf16(rng, (t, cfg.hc_mult, cfg.hidden_size))
        xs = [DeviceArray.from_numpy(gpu, x) for _ in cfg.layer_ids]
        for layer, xd in zip(cfg.layer_ids, xs):
            dec.apply(layer, xd, t)
        gpu.synchronize()
        assert dec.check_errors() == DecodeError.NONE
        ids = np.concatenate([m.ids(s) for s in seqs])
        text = tokens != IMAGE
        assert (read(gpu, dec.text, t, np.uint8) == text).all()
        for i, layer in enumerate(cfg.layer_ids):
            emb = read(gpu, dec.emb_of(i), (t, cfg.emb_dim), BF16)
            want = np.where(text[:, None], m.operand(i, ids), np.zeros((), BF16))
            assert (emb.view(np.uint16) == want.view(np.uint16)).all(), f"layer {layer} rows"
            kv = read(gpu, dec.kv_of(i), (t, cfg.kv_dim), BF16)
            err = ulps(kv[text], m.kv_exact(i, ids)[text])
            assert err.max() <= 1.0 and np.quantile(err, 0.999) <= 0.5 + 1e-9, f"layer {layer} kv"
            out, exact, _ = gate_ref(x, kv, m.a["q"][i], m.a["k"][i], text, cfg.eps, cfg.hc_mult)
            got = xs[i].to_numpy()
            assert (got[~text].view(np.uint16) == x[~text].view(np.uint16)).all(), "non-text rows untouched"
            gerr = ulps(got[text], exact[text])
            assert gerr.max() <= 1.0 and np.quantile(gerr, 0.999) <= 0.5 + 1e-9, f"layer {layer} residual"
    m.weights.close()


@pytest.mark.gpu
def test_steps_seeds_forks_rollbacks_and_graphs_equal_one_prefill(gpu, rng):
    """Slot 0: a prompt in two chunks, then steps of one token (eager, then replayed from a
    captured graph); slot 1: seeded with the same prompt, then the same steps; slot 2 forked from
    slot 1 after the first step; a k = 3 draft rolled back by 2. Every row's kv equals a one-shot
    prefill of the whole sequence (batch invariant)."""
    m = Model(gpu, rng)
    cfg = m.cfg
    prompt, more = sequences(rng, [9, 6])
    whole = np.concatenate([prompt, more])
    stream = gpu.create_stream()
    with m.decoder(max_seqs=4, max_rows=32, max_draft=3, batch_invariant=True, stream=stream) as one, \
            m.decoder(max_seqs=4, max_rows=32, max_draft=3, batch_invariant=True, stream=stream) as dec:
        one.reset(0, stream)
        one.prefill(u32(gpu, whole, stream), u32(gpu, [0, len(whole)], stream), u32(gpu, [0], stream), 1,
                    len(whole), stream)
        gpu.synchronize(stream)
        want = [read(gpu, one.kv_of(i), (len(whole), cfg.kv_dim), BF16) for i in range(2)]

        def kv_rows(rows):
            gpu.synchronize(stream)
            return [read(gpu, dec.kv_of(i), (rows, cfg.kv_dim), BF16) for i in range(2)]

        def same(got, positions):
            for i in range(2):
                assert (got[i].view(np.uint16) == want[i][positions].view(np.uint16)).all(), (i, positions)

        for s in range(3):
            dec.reset(s, stream)
        dec.prefill(u32(gpu, prompt[:4], stream), u32(gpu, [0, 4], stream), u32(gpu, [0], stream), 1, 4, stream)
        same(kv_rows(4), slice(0, 4))
        dec.prefill(u32(gpu, prompt[4:], stream), u32(gpu, [0, 5], stream), u32(gpu, [0], stream), 1, 5, stream)
        same(kv_rows(5), slice(4, 9))
        dec.seed(u32(gpu, prompt, stream), u32(gpu, [0, 9], stream), u32(gpu, [1], stream), 1, 9, stream)
        tok = u32(gpu, [more[0], more[0]], stream)
        dec.step(tok, u32(gpu, [0, 1], stream), 2, stream)
        got = kv_rows(2)
        same([g[:1] for g in got], slice(9, 10))
        same([g[1:] for g in got], slice(9, 10))
        dec.fork(u32(gpu, [1], stream), u32(gpu, [2], stream), 1, stream)
        # a k = 3 draft on slot 2: its first token is right, the two after it are rejected
        draft = u32(gpu, [more[1], 7, 8], stream)
        dec.step(draft, u32(gpu, [2], stream), 1, stream, k=3)
        same([g[:1] for g in kv_rows(3)], slice(10, 11))
        dec.rollback(u32(gpu, [2], stream), u32(gpu, [2], stream), 1, stream)
        # the rest by a captured graph over slots 0, 1, 2 and a padded entry
        slots = u32(gpu, [0, 1, 2, PAD_SLOT], stream)
        dec.step(u32(gpu, [more[1], more[1], more[2], 0], stream), slots, 4, stream)  # eager: plans the 4 rows
        tokens = DeviceArray.empty(gpu, (4,), np.uint32, stream)
        gpu.synchronize(stream)
        gpu.begin_capture(stream)
        dec.step(tokens, slots, 4, stream)
        graph = gpu.end_capture(stream)
        try:
            for pos in range(2, len(more)):
                # slots 0 and 1 at position 9 + pos, slot 2 one ahead
                nxt = more[pos + 1] if pos + 1 < len(more) else 0
                gpu.copy_h2d_async(np.array([more[pos], more[pos], nxt, 3], np.uint32), tokens.ptr, stream)
                gpu.launch_graph(graph, stream)
                got = kv_rows(4)
                same([g[:1] for g in got], slice(9 + pos, 10 + pos))
                same([g[1:2] for g in got], slice(9 + pos, 10 + pos))
                if pos + 1 < len(more):
                    same([g[2:3] for g in got], slice(10 + pos, 11 + pos))
                text = read(gpu, dec.text, 4, np.uint8)
                assert text[3] == 0, "the padded entry is no text row"
        finally:
            gpu.destroy_graph(graph)
        assert dec.check_errors(stream) == DecodeError.NONE
    m.weights.close()


@pytest.mark.gpu
def test_bad_device_values_are_flagged_and_read_nothing_outside(gpu, rng):
    m = Model(gpu, rng)
    cfg = m.cfg
    with m.decoder(max_seqs=2, max_rows=8) as dec:
        dec.reset(0)
        gpu.memset(dec.emb, 0x5A, 2 * 8 * cfg.emb_dim * 2)
        dec.step(u32(gpu, [cfg.vocab_size + 5, 3]), u32(gpu, [0, 7]), 2)
        gpu.synchronize()
        assert dec.check_errors() == DecodeError.TOKEN | DecodeError.SLOT
        assert (read(gpu, dec.text, 2, np.uint8) == 0).all()
        emb = read(gpu, dec.emb_of(0), (2, cfg.emb_dim), BF16)
        assert (emb.view(np.uint16) == 0).all()
        assert (dec.history(0) == 0xFFFFFFFF).all() and len(dec.history(0)) == 1  # the bad token: no look-back
    m.weights.close()


@pytest.mark.gpu
def test_a_text_mask_decides_over_the_image_id(gpu, rng):
    m = Model(gpu, rng)
    cfg = m.cfg
    (seq,) = sequences(rng, [10], image_rate=0.0)
    mask = np.ones(10, np.uint8)
    mask[[2, 7]] = 0
    with m.decoder(max_seqs=1, max_rows=16) as dec:
        dec.reset(0)
        dec.prefill(u32(gpu, seq), u32(gpu, [0, 10]), u32(gpu, [0]), 1, 10,
                    text=DeviceArray.from_numpy(gpu, mask))
        gpu.synchronize()
        assert (read(gpu, dec.text, 10, np.uint8) == mask).all()
        comp = compress(m.map.ids, seq, mask.astype(bool))
        ids = row_ids(cfg, comp, m.map.pad(cfg.pad_token_id))
        emb = read(gpu, dec.emb_of(0), (10, cfg.emb_dim), BF16)
        want = np.where(mask[:, None].astype(bool), m.operand(0, ids), np.zeros((), BF16))
        assert (emb.view(np.uint16) == want.view(np.uint16)).all()
    m.weights.close()


# -- tensor parallelism ---------------------------------------------------------------------------
def rank_weights(gpu, cfg, tmap, a, size, placement="device"):
    return [EngramWeights.from_arrays(gpu, cfg, tmap, a["tables"], a["wkv"], a["q"], a["k"], placement=placement,
                                      shard=Shard(r, size)) for r in range(size)]


def test_a_shard_without_a_collective_is_refused_at_its_first_call(rng):
    gpu, cfg = RecordingBackend(), tiny()
    a = arrays(rng, cfg)
    (w0, _) = rank_weights(gpu, cfg, token_map(rng, cfg), a, 2)
    dec = EngramDecoder(w0, max_seqs=2, max_rows=8)
    gpu.launches.clear()
    with pytest.raises(ValueError, match="collective= .* or drive the group with lookup_all"):
        dec.step(0x1000, 0x2000, 1)
    assert gpu.launches == []


class RecordingGroup:
    """A ``CollectiveGroup`` of ``size`` that records its all-reduces beside the backend's launches."""

    def __init__(self, gpu: RecordingBackend, size: int) -> None:
        self.gpu, self.size, self.closed, self.calls = gpu, size, False, []

    def allreduce_bf16_all(self, buffers) -> None:
        self.calls.append((len(self.gpu.launches), list(buffers)))


def test_lookup_all_gathers_on_every_rank_sums_then_projects(rng):
    from layers.engram.rank_group import lookup_all

    gpu, cfg = RecordingBackend(), tiny()
    a = arrays(rng, cfg)
    ranks = [EngramDecoder(w, max_seqs=2, max_rows=8) for w in rank_weights(gpu, cfg, token_map(rng, cfg), a, 2)]
    gpu.launches.clear()
    group = RecordingGroup(gpu, 2)
    lookup_all(group, ranks, [0x1000] * 2, [0x2000] * 2, [0x3000] * 2, 2, 5, [7, 8])
    names = [gpu.kernel_of(launch)[1] for launch in gpu.launches]
    assert names[:2] == ["engram_lookup"] * 2 and len(names) == 6  # then a GEMM per rank and layer
    count = 5 * cfg.emb_dim
    assert group.calls == [(2, [(r.emb_of(i), count, s) for r, s in zip(ranks, (7, 8))]) for i in range(2)]
    assert [launch.stream for launch in gpu.launches] == [7, 8, 7, 7, 8, 8]


@pytest.mark.gpu
def test_two_ranks_on_one_device_give_the_single_gpu_rows(gpu, rng):
    from layers.engram.rank_group import lookup_all
    from layers.tensor_parallel import LocalGroup

    m = Model(gpu, rng)
    cfg = m.cfg
    ranks_w = rank_weights(gpu, cfg, m.map, m.a, 2)
    seqs = sequences(rng, [6, 9])
    tokens = np.concatenate(seqs)
    cu, slots = np.cumsum([0, 6, 15]), [0, 1]
    t = len(tokens)
    with m.decoder(max_seqs=2, max_rows=16) as one:
        ranks = [EngramDecoder(w, max_seqs=2, max_rows=16) for w in ranks_w]
        one.prefill(u32(gpu, tokens), u32(gpu, cu), u32(gpu, slots), 2, t)
        group = LocalGroup(gpu, 2)
        args = [[u32(gpu, v) for _ in range(2)] for v in (tokens, cu, slots)]
        lookup_all(group, ranks, *args, 2, t, [0, 0])
        gpu.synchronize()
        for i in range(len(cfg.layer_ids)):
            want = read(gpu, one.kv_of(i), (t, cfg.kv_dim), BF16)
            for r, rank in enumerate(ranks):
                got = read(gpu, rank.kv_of(i), (t, cfg.kv_dim), BF16)
                assert (got.view(np.uint16) == want.view(np.uint16)).all(), (i, r)
        for rank, w in zip(ranks, ranks_w):
            rank.close()
            w.close()
    m.weights.close()
