"""Tensor parallelism: the runners on a shard (``collective=`` on the fused runners and the
decoder, ``embed_all``).

CPU: which runner takes which weights and collective, refused before anything is allocated; the
launch order of a rank's call, of ``embed_all`` and of a rank's decoder step, and every refusal
before any launch. On one GPU: every rank of a group run one after another and summed
(``LocalGroup``), from numpy and from a pretrained folder, and a one-rank decoder (with adapters),
each bit for bit the single-GPU fused path. The shards and their weights:
test_tensor_parallel_shards.py; ``LocalGroup`` and NCCL themselves: test_tensor_parallel_collectives.py."""

from __future__ import annotations

from contextlib import ExitStack

import numpy as np
import pytest

from gpu_runtime import ClosedError, DevicePtr
from layers.ngram_embed import FusedNgramEmbedding, NgramDecoder, NgramEmbedding, NgramWeights, embed_all
from layers.ngram_embed import NO_ADAPTER, DecodeError
from layers.dense_weight import BF16
from tests.helpers.fakes import RecordingBackend, refused
from tests.helpers import Guarded, bits, run_on_poisoned
from tests.helpers import decoder_checks
from tests.helpers.ngram import device_weights, random_layer, small_dims
from tests.helpers.tensor_parallel import (FakeCollective, FakeGroup, RankWorld, Ranks, fused_reference,
                                           local_outputs, random_batch, rank_weights)
from tests.helpers.tensor_parallel import tp_dims as _dims

OUT = DevicePtr(0x900000)


# -- CPU: which runner takes which weights and collective --------------------------------------
def _full_and_shard(rng, kinds="b"):
    """A recording backend, random host weights, the full weights and rank 1 of 2's on it."""
    gpu = RecordingBackend()
    host = random_layer(rng, _dims(eos_id=7), kinds)
    return gpu, host, device_weights(gpu, host), rank_weights(gpu, host, 1, 2)


def _decoder(weights, **kw):
    return NgramDecoder(weights, max_seqs=4, max_rows=32, **kw)


def _fused(weights, **kw):
    return FusedNgramEmbedding(weights, 8, **kw)


def _closed(collective):
    collective.closed = True
    return collective


@pytest.mark.parametrize("make, on, error, match", [
    (lambda w: NgramEmbedding(w, 8), "shard", ValueError, "NgramEmbedding: the weights are a tensor-parallel"),
    (lambda w: _decoder(w), "shard", ValueError,
     "NgramDecoder: the weights are a tensor-parallel shard; pass collective="),
    (lambda w: _fused(w, collective=FakeCollective()), "full", ValueError,
     "FusedNgramEmbedding: collective given, but the weights are not a tensor-parallel shard"),
    (lambda w: _decoder(w, collective=FakeCollective()), "full", ValueError,
     "NgramDecoder: collective given, but the weights are not a tensor-parallel shard"),
    (lambda w: _fused(w, collective=FakeCollective(0, 2)), "shard", ValueError,
     "FusedNgramEmbedding: the collective is rank 0 of 2, the weights rank 1 of 2"),
    (lambda w: _decoder(w, collective=FakeCollective(1, 3)), "shard", ValueError,
     "NgramDecoder: the collective is rank 1 of 3, the weights rank 1 of 2"),
    (lambda w: _fused(w, collective=_closed(FakeCollective(1, 2))), "shard", ClosedError,
     "FusedNgramEmbedding: its collective is closed"),
    (lambda w: _decoder(w, collective=_closed(FakeCollective(1, 2))), "shard", ClosedError,
     "NgramDecoder: its collective is closed"),
    (lambda w: _fused(w, collective=object()), "shard", TypeError, "FusedNgramEmbedding: collective must be"),
    (lambda w: _decoder(w, collective=object()), "shard", TypeError, "NgramDecoder: collective must be"),
], ids=["seed-shard", "decoder-shard-no-collective", "fused-collective-full", "decoder-collective-full",
        "fused-other-rank", "decoder-other-size", "fused-closed", "decoder-closed", "fused-not-collective",
        "decoder-not-collective"])
def test_runners_refuse_weights_and_collectives_that_do_not_match_before_building(rng, make, on, error, match):
    gpu, _, full, shard = _full_and_shard(rng)
    gpu.ops.clear()
    gpu.launches.clear()
    with pytest.raises(error, match=match):
        make(full if on == "full" else shard)
    assert gpu.ops == [] and gpu.launches == []


def test_runners_borrow_the_weights_they_serve(rng):
    gpu, _, full, shard = _full_and_shard(rng)
    runners = [(NgramEmbedding(full, 8), full), (_fused(full), full), (_decoder(full), full), (_fused(shard), shard),
               (_fused(shard, collective=FakeCollective(1, 2)), shard),
               (_decoder(shard, collective=FakeCollective(1, 2)), shard)]
    for runner, weights in runners:
        assert runner.weights is weights and runner.dims == weights.dims
        runner.close()
    assert not full.closed and not shard.closed  # closing a runner leaves its weights open
    live = _fused(shard, collective=FakeCollective(1, 2))
    shard.close()
    gpu.launches.clear()
    with pytest.raises(ClosedError, match="fused ngram embed: its NgramWeights is closed"):
        live.embed([1, 2, 3], 2, OUT)
    with pytest.raises(ClosedError, match="FusedNgramEmbedding: its NgramWeights is closed"):
        _fused(shard)
    assert gpu.launches == []


# -- CPU: the launches -------------------------------------------------------------------------
def test_a_call_is_the_gather_the_word_shard_an_all_reduce_and_the_word_gemm(rng):
    gpu, host, _, _ = _full_and_shard(rng, "bf")
    dims = host.dims
    calls = []
    with Ranks(gpu, host, 2, collectives=[FakeCollective(0, 2, calls), FakeCollective(1, 2, calls)]) as ranks:
        rank1, w1 = ranks.runners[1], ranks.weights[1]
        h, k = dims.hidden_size, dims.num_tables() * dims.table_dim()
        gpu.launches.clear()
        rank1.embed([5, 7, 9, 11, 13], 3, OUT, stream=4)
        names = [gpu.kernel_of(launch)[1] for launch in gpu.launches]
        assert names == ["ngram_gather", "batched_embed_shard", "dense_gemm_bf16_word"]
        gather, shard, gemm = gpu.launches
        buf = int(rank1.projection.buf)
        word_ids = int(rank1.staging) + 3 * dims.max_ngram * 4  # after the windows in the upload
        assert gather.args[4] == buf + 3 * h * 2  # the gathered rows after the word rows
        assert shard.args == [word_ids, int(w1.word.weight), buf, 3, h, 250, 250]
        assert calls == [("allreduce", buf, 3 * (h + k), 4)]
        assert gemm.args[0] == buf + 3 * h * 2 and gemm.args[2] == int(OUT)
        assert gemm.args[3:6] == [3, h, k] and gemm.args[6:8] == [int(rank1.projection.row_ids), buf]
        assert all(launch.stream == 4 for launch in gpu.launches)


def test_a_rank_without_a_collective_serves_only_embed_all(rng):
    gpu, host, _, _ = _full_and_shard(rng)
    with Ranks(gpu, host, 1) as ranks:
        (rank,) = ranks.runners
        for call in (lambda: rank.embed([1, 2, 3], 2, OUT), lambda: rank.embed_batch([[1, 2, 3]], [2], OUT),
                     lambda: rank.embed([1, 2, 3], 2, OUT, 1, graph=True)):
            with refused(gpu, ValueError, "a tensor-parallel rank without a collective"):
                call()
        assert embed_all(FakeGroup(1), [rank], [[1, 2, 3]], [2], [OUT], [0]) == 2


def test_embed_all_stages_every_rank_then_sums_then_projects(rng):
    gpu, host, _, _ = _full_and_shard(rng)
    dims = host.dims
    group = FakeGroup(2)
    outs = [OUT, DevicePtr(0xA00000)]
    with Ranks(gpu, host, 2) as ranks:
        runners = ranks.runners
        gpu.launches.clear()
        assert embed_all(group, runners, [[1, 2, 3, 4]], [3], outs, [6, 7]) == 3
        names = [gpu.kernel_of(launch)[1] for launch in gpu.launches]
        assert names == ["ngram_gather", "batched_embed_shard"] * 2 + ["dense_gemm_bf16_word"] * 2
        count = 3 * (dims.hidden_size + dims.num_tables() * dims.table_dim())
        assert group.calls == [("allreduce_all", [(int(runners[0].projection.buf), count, 6),
                                                  (int(runners[1].projection.buf), count, 7)])]
        assert [launch.stream for launch in gpu.launches] == [6, 6, 7, 7, 6, 7]
        assert [launch.args[2] for launch in gpu.launches[4:]] == [int(o) for o in outs]
        gpu.launches.clear()
        assert embed_all(group, runners, [[1, 2, 3, 4]], [0], outs, [6, 7]) == 0  # no rows: nothing runs
        assert gpu.launches == [] and len(group.calls) == 1


class _EmbedAll:
    """Two ranks of a group of two on a recording backend, and ``embed_all``'s arguments, which a
    refusal case edits."""

    def __init__(self, rng):
        self.rng = rng
        self.gpu, self.host, self.full, _ = _full_and_shard(rng)
        self.dims = self.host.dims
        self.stack = ExitStack()
        self.ranks = self.stack.enter_context(Ranks(self.gpu, self.host, 2, max_rows=8))
        self.args = dict(group=FakeGroup(2), ranks=list(self.ranks.runners), contexts=[[1, 2, 3, 4]], seq_lens=[3],
                         outs=[OUT, DevicePtr(0xA00000)], streams=[6, 7])

    def runner(self, weights):
        return self.stack.enter_context(FusedNgramEmbedding(weights, 8))

    def other_dims(self):
        """Rank 1 of a model whose dims differ from rank 0's only in their EOS."""
        host = random_layer(self.rng, self.dims.replace(eos_id=9), "b")
        return self.runner(self.stack.enter_context(rank_weights(self.gpu, host, 1, 2)))

    def edit(self, **changes):
        self.args.update(changes)
        return self


def _with_rank(s, r, runner):
    ranks = list(s.args["ranks"])
    ranks[r] = runner
    return s.edit(ranks=ranks)


def _closing(thing):
    thing.close()
    return thing


EMBED_ALL_REFUSALS = [
    ("not-a-group", lambda s: s.edit(group=object()), TypeError, "group must be a CollectiveGroup"),
    ("closed-group", lambda s: s.edit(group=_closed(FakeGroup(2))), ClosedError, "embed_all: the group is closed"),
    ("group-size", lambda s: s.edit(group=FakeGroup(3)), ValueError, "2 ranks, 2 outs and 2 streams for a group of 3"),
    ("outs", lambda s: s.edit(outs=[OUT]), ValueError, "2 ranks, 1 outs and 2 streams"),
    ("streams", lambda s: s.edit(streams=[6, 7, 8]), ValueError, "2 outs and 3 streams"),
    ("order", lambda s: s.edit(ranks=s.args["ranks"][::-1]), ValueError, r"ranks\[0\]'s weights are rank 1 of 2"),
    ("not-a-runner", lambda s: _with_rank(s, 1, NgramEmbedding(s.full, 8)), TypeError,
     r"ranks\[1\] is a NgramEmbedding, not a FusedNgramEmbedding"),
    ("not-a-shard", lambda s: _with_rank(s, 0, s.runner(s.full)), ValueError, r"ranks\[0\]'s weights are not a shard"),
    ("other-group", lambda s: _with_rank(s, 1, s.runner(s.stack.enter_context(rank_weights(s.gpu, s.host, 1, 3)))),
     ValueError, r"ranks\[1\]'s weights are rank 1 of 3"),
    ("other-dims", lambda s: _with_rank(s, 1, s.other_dims()), ValueError, r"ranks\[1\] has other dims than rank 0"),
    ("closed-rank", lambda s: _closing(s.args["ranks"][1]) and s, ClosedError, r"embed_all: ranks\[1\] is closed"),
    ("closed-weights", lambda s: _closing(s.ranks.weights[1]) and s, ClosedError,
     r"embed_all: ranks\[1\]'s NgramWeights is closed"),
    ("contexts", lambda s: s.edit(seq_lens=[3, 1]), ValueError, "1 contexts, 2 seq_lens"),
    ("token", lambda s: s.edit(contexts=[[1, 2, 10**6]], seq_lens=[2]), ValueError, r"token 1000000 outside 0\.\.V-1"),
    ("rows", lambda s: s.edit(contexts=[list(range(1, 12))], seq_lens=[9]), ValueError, "9 rows over max_rows 8"),
    ("null-out", lambda s: s.edit(outs=[OUT, 0]), ValueError, "embed_all out"),
]


@pytest.mark.parametrize("case, edit, error, match", EMBED_ALL_REFUSALS, ids=[c[0] for c in EMBED_ALL_REFUSALS])
def test_embed_all_refuses_before_any_upload_or_launch(rng, case, edit, error, match):
    s = _EmbedAll(rng)
    try:
        edit(s)
        group = s.args["group"]
        s.gpu.launches.clear()
        s.gpu.ops.clear()
        with pytest.raises(error, match=match):
            embed_all(**s.args)
        assert s.gpu.launches == [] and s.gpu.ops == []
        assert getattr(group, "calls", []) == []
    finally:
        s.stack.close()


def test_a_decoder_step_is_its_gather_the_word_shard_the_all_reduce_and_the_gemm(rng):
    gpu, host, _, weights = _full_and_shard(rng, "bf")
    dims = host.dims
    calls = []
    dec = NgramDecoder(weights, collective=FakeCollective(1, 2, calls), max_seqs=4, max_rows=32, max_draft=1)
    assert dec.collective.calls is calls and dec.projection.collective is dec.collective
    h, k = dims.hidden_size, dims.num_tables() * dims.table_dim()
    gpu.launches.clear()
    gpu.ops.clear()
    dec.step(DevicePtr(0x1000), DevicePtr(0x2000), 3, OUT, stream=5, k=2)
    names = [gpu.kernel_of(launch)[1] for launch in gpu.launches]
    assert names == ["ngram_decode_gather", "batched_embed_shard", "dense_gemm_bf16_word"]
    assert gpu.ops == [], "no upload, allocation or memset in the hot path"
    gather, shard, gemm = gpu.launches
    buf, rows = int(dec.projection.buf), 6
    assert buf + rows * h * 2 in gather.args and int(dec.word_ids) in gather.args
    assert shard.args == [int(dec.word_ids), int(weights.word.weight), buf, rows, h, 250, 250]
    assert calls == [("allreduce", buf, rows * (h + k), 5)]
    assert gemm.args[0] == buf + rows * h * 2 and gemm.args[6:8] == [int(dec.projection.row_ids), buf]
    assert all(launch.stream == 5 for launch in gpu.launches)
    calls.clear()
    dec.collective.closed = True
    gpu.launches.clear()
    with pytest.raises(ClosedError, match="NgramDecoder: its collective is closed"):
        dec.step(DevicePtr(0x1000), DevicePtr(0x2000), 3, OUT, stream=5)
    assert gpu.launches == [] and calls == []
    dec.close()
    weights.close()
    with pytest.raises(ClosedError):
        dec.step(DevicePtr(0x1000), DevicePtr(0x2000), 3, OUT, stream=5)


# -- GPU: every rank on one device, summed here (LocalGroup) ------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("size, kinds", [(1, "b"), (2, "bf"), (3, "fb"), (4, "b")])
def test_local_group_equals_the_single_gpu_fused_path(gpu, rng, size, kinds):
    dims = small_dims(max_ngram=3, splits=2, hidden_size=64, table_dim=32, eos_id=3)
    host = random_layer(rng, dims, kinds)
    contexts, seq_lens = random_batch(rng, dims, 5, 128)
    want = fused_reference(gpu, rng, host, contexts, seq_lens, 128)
    with Ranks(gpu, host, size, max_rows=128) as ranks:
        got = local_outputs(gpu, rng, ranks.runners, contexts, seq_lens, dims.hidden_size)
    for r in range(size):
        assert np.array_equal(bits(got[r]), bits(want)), f"rank {r} of {size}"


@pytest.mark.gpu
def test_pretrained_ranks_equal_the_pretrained_fused_path(gpu, rng, tmp_path):
    from tests.helpers.checkpoint import make_model, write_model

    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    dims, path = model.dims, str(model.path)
    contexts, seq_lens = random_batch(rng, dims, 4, 64)
    with NgramWeights.from_pretrained(path, gpu) as weights, FusedNgramEmbedding(weights, 64) as fused:
        want = run_on_poisoned(gpu, rng, lambda o: fused.embed_batch(contexts, seq_lens, o), sum(seq_lens),
                               dims.hidden_size)
    with ExitStack() as stack:
        shards = [stack.enter_context(NgramWeights.from_pretrained(path, gpu, shard=(r, 2))) for r in range(2)]
        runners = [stack.enter_context(FusedNgramEmbedding(w, 64)) for w in shards]
        got = local_outputs(gpu, rng, runners, contexts, seq_lens, dims.hidden_size)
    assert all(np.array_equal(bits(g), bits(want)) for g in got)


# -- GPU: a one-rank decoder (a collective of one: the all-reduce adds nothing) -----------------
@pytest.fixture
def rank_world(gpu, rng):
    """``RankWorld``: the decoder ``World`` (6 slots, 96 rows, drafts of 3) with its decoder over
    a one-rank shard and a recording collective of one."""
    w = RankWorld(gpu, rng, FakeCollective())
    yield w
    w.close()


@pytest.mark.gpu
@pytest.mark.parametrize("check", decoder_checks.CHECKS)
def test_a_one_rank_decoder_check(rank_world, check):
    """``decoder_checks``' checks of the plain decoder (test_ngram_decoder.py), on the one-rank
    decoder: bit for bit the fused path on the full weights, and one all-reduce a launch."""
    check(rank_world)


@pytest.mark.gpu
def test_a_ranks_adapters_replace_the_word_row_inside_the_sum(gpu, rng):
    """Adapters on a rank: the epilogue reads the adapter's row (``word_over``) instead of the
    reduced word row, for the decoder and the fused runner alike: bit for bit the single-GPU
    fused path with the same adapters."""
    world = RankWorld(gpu, rng, FakeCollective(), adapters=2, override=150, batch_invariant=True)
    try:
        choice = [0, NO_ADAPTER, 1, 0]
        got, want = world.prefill([0, 1, 2, 3], [6, 3, 9, 1], adapters=choice)
        assert np.array_equal(bits(got), bits(want))
        got = world.step(world.tokens(4), [0, 1, 2, 3], choice)
        assert np.array_equal(bits(got), bits(world.expect([0, 1, 2, 3], [1] * 4, 4, choice)))
        contexts = [np.asarray(world.ctx[s]) for s in range(4)]
        with FusedNgramEmbedding(world.rank_weights, 32, world.stream, collective=world.collective,
                                 adapter_slots=world.slots, batch_invariant=True) as rank:
            with Guarded(gpu, (8, world.dims.hidden_size), BF16, rng) as out:
                out.poison()
                gpu.synchronize(0)  # the poison (stream 0) before the rank's stream writes
                rank.embed_batch(contexts, [2] * 4, out.ptr, world.stream, adapters=choice)
                gpu.synchronize(world.stream)
                got = out.read()
                out.assert_guards_intact()
        assert np.array_equal(bits(got), bits(world.expect([0, 1, 2, 3], [2] * 4, 8, choice)))
    finally:
        world.close()


@pytest.mark.gpu
def test_a_bad_adapter_index_zeroes_a_ranks_rows(gpu, rng):
    """An adapter index past the adapters, in device memory: flagged, and that sequence's rows
    zeros on a rank too, whose epilogue never sees the word id kNoWord (the gather zeroes the
    n-gram rows itself now; before, the rank wrote the n-gram part alone); the other sequences
    as the single-GPU fused path gives them."""
    world = RankWorld(gpu, rng, FakeCollective(), adapters=2, override=150, batch_invariant=True)
    try:
        world.prefill([0, 1, 2, 3], [6, 3, 9, 1], adapters=[0, NO_ADAPTER, 1, 0])
        got = world.step(world.tokens(4), [0, 1, 2, 3], [0, 7, NO_ADAPTER, 1])  # 7: past the 2 adapters
        assert world.dec.check_errors() == DecodeError.ADAPTER
        assert not bits(got[1]).any()
        want = world.expect([0, 1, 2, 3], [1] * 4, 4, [0, 0, NO_ADAPTER, 1])
        assert np.array_equal(bits(got[[0, 2, 3]]), bits(want[[0, 2, 3]]))
    finally:
        world.close()
