"""Tensor parallelism (``NgramWeights(shard=)``, ``collective=`` on the fused runners, ``embed_all``).

CPU: the shard arithmetic; a shard's weights (what they must hold, what ``from_numpy`` and
``from_pretrained`` upload: only the rank's word rows and tables); which runner takes which
weights and collective, refused before anything is allocated; the launch order of a rank's call,
of ``embed_all`` and of a rank's decoder step, and every refusal before any launch; ``LocalGroup``
and the NCCL wrappers over fakes. On one GPU: every rank of a group run one after another and
summed (``LocalGroup``), a one-rank decoder and a one-rank NCCL communicator, each bit for bit the
single-GPU fused path. On two GPUs (skipped on smaller machines): NCCL in one process and in one
process per GPU, and a failed rank that cannot hang the other."""

from __future__ import annotations

import multiprocessing as mp
import sys
from contextlib import ExitStack

import numpy as np
import pytest

from gpu_runtime import ClosedError, DeviceCopies, DevicePtr, device_count
from layers.ngram_embed import (FusedNgramEmbedding, NgramDecoder, NgramEmbedding, NgramShard, NgramTable,
                                NgramWeights, embed_all, reduce_bytes)
from layers.ngram_embed import NO_ADAPTER, DecodeError
from layers.ngram_embed.tables import AbsentTable, Bf16Table, check_table, gather_entry
from layers.ops.ngram_fused import ABSENT
from layers.tensor_parallel import LocalGroup
from layers.dense_weight import BF16, DenseWeight
from tests.helpers.fakes import RecordingBackend, refused
from tests.helpers import Guarded, bits, run_on_poisoned
from tests.helpers.checkpoint import weight_bytes
from tests.helpers import decoder_checks
from tests.helpers.logging_backend import LoggingBackend
from tests.helpers.ngram import device_weights, random_layer, small_dims
from tests.helpers.tensor_parallel import (FakeCollective, FakeGroup, RankWorld, Ranks, fused_reference,
                                           local_outputs, numpy_tables, random_batch, rank_process,
                                           rank_weights)

OUT = DevicePtr(0x900000)


def _dims(**kw):
    return small_dims(max_ngram=3, splits=2, **kw)  # T = 4 tables, V = 500, D = 40


# -- CPU: the shard arithmetic ------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shards_split_tables_and_word_rows_exactly_once(size):
    dims = _dims()
    shards = [NgramShard.of(dims, r, size) for r in range(size)]
    assert [c for s in shards for c in s.tables] == list(range(dims.num_tables()))
    assert all(len(s.tables) in (4 // size, -(-4 // size)) for s in shards)
    assert [s.word_lo for s in shards] == [r * 500 // size for r in range(size)]
    assert sum(s.word_rows for s in shards) == 500
    assert [s.holds_word(499) for s in shards] == [r == size - 1 for r in range(size)]


@pytest.mark.parametrize("rank, size, error, match", [
    (0, 5, ValueError, "size 5 over the 4 tables"), (2, 2, ValueError, "rank 2 out of range"),
    (-1, 2, ValueError, "rank must be a non-negative int"), (0, 0, ValueError, "size must be an int >= 1"),
    (0.0, 2, TypeError, "rank must be an int, got float"),
])
def test_bad_ranks_are_refused(rank, size, error, match):
    with pytest.raises(error, match=match):
        NgramShard.of(_dims(), rank, size)


def test_reduce_bytes_for_both_places():
    dims = small_dims(hidden_size=256, max_ngram=3, splits=4, table_dim=32)  # T td = 8 * 32 = D
    assert reduce_bytes(dims, 10) == {"gathered rows (bf16)": 2 * 10 * (256 + 256),
                                      "projected output (fp32)": 4 * 10 * 256}


def test_absent_tables_gather_as_zeros():
    assert gather_entry(NgramTable.Absent(61, 20), 61) == (0, 0, 61, ABSENT)
    check_table(NgramTable.Absent(61, 20), 0, 61, 20)
    with pytest.raises(ValueError, match="shape"):
        check_table(NgramTable.Absent(62, 20), 0, 61, 20)


def test_weights_without_a_shard_refuse_absent_tables(rng):
    gpu = RecordingBackend()
    dims = _dims()
    full = device_weights(gpu, random_layer(rng, dims, "b"))
    tables = list(full.tables)
    tables[1] = NgramTable.Absent(dims.table_rows(1), dims.table_dim())
    with pytest.raises(ValueError, match="table 1"):
        NgramWeights(dims, full.word, tables, full.projs, gpu)


# -- CPU: a shard's weights ---------------------------------------------------------------------
def _fake_weight(rows, cols, at=0x700000):
    """A bf16 DenseWeight of that shape at a made-up address (owns nothing)."""
    return DenseWeight(DevicePtr(at), (rows, cols), np.dtype(BF16))


def _all_held(weights, dims):
    """``weights``' tables with the absent ones replaced by held ones of the right shape."""
    return [t if not isinstance(t, NgramTable.Absent) else Bf16Table(_fake_weight(dims.table_rows(c), dims.table_dim()))
            for c, t in enumerate(weights.tables)]


def test_a_shards_weights_hold_its_tables_and_word_rows_only(rng):
    gpu = RecordingBackend()
    dims = _dims()
    host = random_layer(rng, dims, "b")
    good = rank_weights(gpu, host, 1, 2)
    assert good.shard == NgramShard.of(dims, 1, 2)
    assert [type(t).__name__ for t in good.tables] == ["AbsentTable"] * 2 + ["Bf16Table"] * 2
    assert good.word.shape == (250, dims.hidden_size)
    again = NgramWeights(dims, good.word, good.tables, good.projs, gpu, shard=(1, 2))  # a (rank, size) pair
    assert again.shard == good.shard and again.tables == good.tables
    with pytest.raises(ValueError, match="table 0 must be held by rank 0"):
        NgramWeights(dims, good.word, good.tables, good.projs, gpu, shard=(0, 2))
    with pytest.raises(ValueError, match="table 2 must not be held by rank 0"):
        NgramWeights(dims, good.word, _all_held(good, dims), good.projs, gpu, shard=(0, 2))
    with pytest.raises(ValueError, match=r"table 0 must not be held by rank 1"):
        NgramWeights(dims, good.word, _all_held(good, dims), good.projs, gpu, shard=(1, 2))
    with pytest.raises(ValueError, match=r"word embedding must be \(250, 40\) bfloat16, got \(500, 40\)"):
        NgramWeights(dims, _fake_weight(500, 40), good.tables, good.projs, gpu, shard=(1, 2))
    with pytest.raises(ValueError, match=r"word embedding must be \(167, 40\) bfloat16, got \(250, 40\)"):
        NgramWeights(dims, good.word, good.tables, good.projs, gpu, shard=(1, 3))
    with pytest.raises(ValueError, match=r"word embedding must be \(500, 40\) bfloat16, got \(250, 40\)"):
        NgramWeights(dims, good.word, _all_held(good, dims), good.projs, gpu)  # rank rows, no shard
    with pytest.raises(ValueError, match="word embedding"):  # dense rows of another dtype
        NgramWeights(dims, DenseWeight(DevicePtr(0x700000), (250, 40), np.dtype(np.float32)), good.tables,
                     good.projs, gpu, shard=(1, 2))


@pytest.mark.parametrize("shard, error, match", [
    ((2, 2), ValueError, "rank 2 out of range for size 2"),
    ((0, 5), ValueError, "size 5 over the 4 tables"),
    ((-1, 2), ValueError, "rank"),
    ((0, 0), ValueError, "size"),
    ((0.0, 2), TypeError, "rank"),
    ((0, 1, 2), TypeError, r"\(rank, size\) pair"),
    ([0, 2], TypeError, r"\(rank, size\) pair"),
    ("0/2", TypeError, r"\(rank, size\) pair"),
    (NgramShard(0, 2, range(0, 3), 0, 250), ValueError, r"is not NgramShard.of\(dims, 0, 2\)"),
    (NgramShard.of(small_dims(max_ngram=3, splits=2, vocab_size=600), 1, 2), ValueError, "is not NgramShard.of"),
])
def test_a_bad_shard_is_refused_before_any_upload(rng, shard, error, match):
    dims = _dims()
    host = random_layer(rng, dims, "bf")
    gpu = LoggingBackend()
    with pytest.raises(error, match=match):
        NgramWeights.from_numpy(dims, host.word, numpy_tables(host), host.projs, gpu, shard=shard)
    assert gpu.log == [] and gpu.empty()
    word, projs = _fake_weight(250, 40), [_fake_weight(40, dims.table_dim()) for _ in range(4)]
    tables = [NgramTable.Absent(dims.table_rows(c), dims.table_dim()) for c in range(4)]
    with pytest.raises(error, match=match):
        NgramWeights(dims, word, tables, projs, RecordingBackend(), shard=shard)


def _device_bytes(gpu: LoggingBackend) -> int:
    """Bytes allocated on the (fake) device, mapped host memory left out."""
    mapped = {dev for dev, _ in gpu.mapped.values()}
    return sum(buf.size for ptr, buf in gpu.mem.items() if ptr not in mapped)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("placement", ["device", "host"])
def test_from_numpy_uploads_only_the_shards_word_rows_and_tables(rng, size, placement):
    dims = _dims()
    host = random_layer(rng, dims, "bf")
    t, h, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
    ref_gpu = LoggingBackend()
    full = NgramWeights.from_numpy(dims, host.word, numpy_tables(host), host.projs, ref_gpu, placement=placement)
    for r in range(size):
        shard = NgramShard.of(dims, r, size)
        gpus, uploads = [], []
        for tables in (numpy_tables(host, shard), numpy_tables(host)):  # None or the full table: the same
            gpu = LoggingBackend()
            w = NgramWeights.from_numpy(dims, host.word, tables, host.projs, gpu, placement=placement, shard=shard)
            assert w.shard == shard
            word = gpu.read(w.word.weight, w.word.nbytes)
            assert word.tobytes() == host.word[shard.word_lo:shard.word_lo + shard.word_rows].tobytes()
            for c, (got, want) in enumerate(zip(w.tables, full.tables)):
                if c in shard.tables:
                    assert type(got) is type(want)
                    assert weight_bytes(gpu, got.weight) == weight_bytes(ref_gpu, want.weight)
                else:
                    assert isinstance(got, AbsentTable) and got.shape == (dims.table_rows(c), td)
            assert [weight_bytes(gpu, p) for p in w.projs] == [weight_bytes(ref_gpu, p) for p in full.projs]
            held_rows = [c for c in shard.tables]
            expect = shard.word_rows * h * 2 + t * h * td * 2  # word rows, every projection
            expect += sum(dims.table_rows(c) * 4 for c in held_rows if host.tables[c][1] is not None)  # fp8 scales
            if placement == "device":
                expect += sum(host.tables[c][0].nbytes for c in held_rows)
            assert _device_bytes(gpu) == expect
            assert len(gpu.host) == (len(held_rows) if placement == "host" else 0)
            gpus.append(gpu)
            uploads.append(gpu.ops())
            w.close()
            assert gpu.empty()
        assert uploads[0] == uploads[1]
    full.close()


def test_a_ranks_runner_waits_for_its_row_ids_upload(rng):
    """A rank's projection uploads its row ids on the construction stream; ``embed_all`` then
    launches on each rank's own (created) stream, which does not wait for it."""
    dims = _dims()
    host = random_layer(rng, dims, "bf")
    gpu = RecordingBackend()
    w = NgramWeights.from_numpy(dims, host.word, numpy_tables(host, NgramShard.of(dims, 0, 2)), host.projs, gpu,
                                shard=NgramShard.of(dims, 0, 2))
    before = len(gpu.ops)
    fused = FusedNgramEmbedding(w, 16, 7)
    ops = gpu.ops[before:]
    upload = max(i for i, op in enumerate(ops) if op[0] == "h2d")
    assert ops[upload][3] == 7 and ("sync", 7) in ops[upload:]
    fused.close()
    w.close()


def test_from_numpy_refuses_none_for_a_held_table_and_frees_what_it_uploaded(rng):
    dims = _dims()
    host = random_layer(rng, dims, "bf")
    gpu = LoggingBackend()
    tables = numpy_tables(host, NgramShard.of(dims, 1, 2))
    tables[3] = None
    with pytest.raises(ValueError, match="table 3: None, but this weights object holds it"):
        NgramWeights.from_numpy(dims, host.word, tables, host.projs, gpu, shard=(1, 2))
    assert gpu.empty()
    with pytest.raises(ValueError, match="table 0: None"):  # no shard: every table is held
        NgramWeights.from_numpy(dims, host.word, [None] * 4, host.projs, gpu)
    assert gpu.empty()


def test_from_numpy_with_a_shard_refuses_a_word_table_that_is_not_the_full_one(rng):
    dims = _dims()
    host = random_layer(rng, dims, "b")
    gpu = LoggingBackend()
    with pytest.raises(ValueError, match="word"):
        NgramWeights.from_numpy(dims, host.word[:250], numpy_tables(host), host.projs, gpu, shard=(0, 2))


# -- CPU: a rank's part of a Hugging Face folder -----------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3])
def test_from_pretrained_reads_and_uploads_only_the_ranks_part(tmp_path, rng, size):
    from tests.helpers.checkpoint import make_model, write_model

    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    dims = model.dims
    for r in range(size):
        gpu, ref_gpu = LoggingBackend(), LoggingBackend()
        shard = NgramShard.of(dims, r, size)
        tables = [t if c in shard.tables else None for c, t in enumerate(model.numpy_tables())]
        with NgramWeights.from_pretrained(str(model.path), gpu, shard=(r, size)) as weights, \
                NgramWeights.from_numpy(dims, model.word, tables, model.projs, ref_gpu, shard=shard) as ref:
            assert weights.shard == shard and weights.dims == dims
            assert weight_bytes(gpu, weights.word) == weight_bytes(ref_gpu, ref.word)
            assert [type(t).__name__ for t in weights.tables] == [type(t).__name__ for t in ref.tables]
            for got, want in zip(weights.tables, ref.tables):
                if not isinstance(got, NgramTable.Absent):
                    assert weight_bytes(gpu, got.weight) == weight_bytes(ref_gpu, want.weight)
            assert [weight_bytes(gpu, p) for p in weights.projs] == [weight_bytes(ref_gpu, p) for p in ref.projs]
            assert _device_bytes(gpu) == _device_bytes(ref_gpu)
        assert gpu.empty() and ref_gpu.empty()
    gpu = LoggingBackend()
    with pytest.raises(ValueError, match="out of range"):
        NgramWeights.from_pretrained(str(model.path), gpu, shard=(2, 2))
    assert gpu.log == [] and gpu.empty()


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


class CopyingBackend(RecordingBackend, DeviceCopies):
    def copy_d2d_async(self, dst, src, nbytes, stream=0):
        self.ops.append(("d2d", int(dst), int(src), nbytes, stream))


def test_local_group_adds_into_rank_0_in_rank_order_then_copies_back():
    gpu = CopyingBackend()
    group = LocalGroup(gpu, 3)
    bufs = [(0x100000 * (r + 1), 10, 5) for r in range(3)]
    gpu.launches.clear()
    group.allreduce_bf16_all(bufs)
    adds = [(launch.args[0], launch.args[1], launch.args[2], launch.stream) for launch in gpu.launches]
    assert [gpu.kernel_of(launch)[1] for launch in gpu.launches] == ["bf16_residual_add"] * 2
    assert adds == [(0x100000, 0x200000, 10, 5), (0x100000, 0x300000, 10, 5)]
    assert [op for op in gpu.ops if op[0] == "d2d"] == [("d2d", 0x200000, 0x100000, 20, 5),
                                                       ("d2d", 0x300000, 0x100000, 20, 5)]
    gpu.launches.clear()
    with pytest.raises(ValueError, match="same count on the same stream"):
        group.allreduce_bf16_all([(0x100000, 10, 5), (0x200000, 11, 5), (0x300000, 10, 5)])
    with pytest.raises(ValueError, match="3 buffers for a group of 2"):
        LocalGroup(gpu, 2).allreduce_bf16_all(bufs)
    with pytest.raises(ValueError, match=r"buffers\[2\] pointer"):  # before rank 1's add is queued
        group.allreduce_bf16_all([(0x100000, 10, 5), (0x200000, 10, 5), (0, 10, 5)])
    assert gpu.launches == []
    with pytest.raises(TypeError, match="device copies"):
        LocalGroup(RecordingBackend(), 2)
    group.close()
    with pytest.raises(Exception, match="closed"):
        group.allreduce_bf16_all(bufs)


def test_nccl_without_nccl4py_names_the_extra(monkeypatch):
    from layers.tensor_parallel import nccl

    monkeypatch.setitem(sys.modules, "nccl", None)
    monkeypatch.setitem(sys.modules, "nccl.core", None)
    with pytest.raises(ImportError, match=r"metrale-gpu\[multi-gpu\]"):
        nccl.unique_id()


class _FakeComm:
    def __init__(self, rank, nranks, log, error=0):
        self.rank, self.nranks, self.ptr, self.log, self.error = rank, nranks, 0xC000 + rank, log, error

    def get_async_error(self):
        return self.error

    def abort(self):
        self.log.append(("abort", self.rank))

    def destroy(self):
        self.log.append(("destroy", self.rank))


@pytest.fixture
def fake_nccl(monkeypatch):
    """nccl4py's modules as the code uses them, recording every call."""
    import types

    log = []
    core, raw = types.ModuleType("nccl.core"), types.ModuleType("nccl.bindings.nccl")

    class UniqueId:
        @staticmethod
        def from_bytes(b):
            return ("uid", bytes(b))

        def __bytes__(self):
            return b"u" * 128

    class Communicator:
        @staticmethod
        def init(size, rank, uid):
            log.append(("init", size, rank, uid[0]))
            return _FakeComm(rank, size, log)

        @staticmethod
        def init_all(devices):
            log.append(("init_all", list(devices)))
            return [_FakeComm(r, len(devices), log) for r in range(len(devices))]

    core.UniqueId, core.Communicator = UniqueId, Communicator
    core.get_unique_id = UniqueId
    core.group_start = lambda: log.append(("group_start",))
    core.group_end = lambda: log.append(("group_end",))
    raw.Comm = lambda ptr: ("Comm", ptr)
    raw.all_reduce = lambda *args: log.append(("all_reduce", *args))
    nccl_pkg, bindings = types.ModuleType("nccl"), types.ModuleType("nccl.bindings")
    nccl_pkg.core, nccl_pkg.bindings, bindings.nccl = core, bindings, raw
    for name, mod in [("nccl", nccl_pkg), ("nccl.core", core), ("nccl.bindings", bindings),
                      ("nccl.bindings.nccl", raw)]:
        monkeypatch.setitem(sys.modules, name, mod)
    return log


class _DeviceBackend(RecordingBackend):
    def __init__(self, device, done=True):
        super().__init__()
        self.device, self.done = device, done

    def event_done(self, event):
        return self.done


def test_nccl_collective_posts_a_bf16_sum_on_the_raw_communicator(fake_nccl):
    from layers.tensor_parallel import nccl

    assert len(nccl.unique_id()) == 128
    comm = nccl.NcclCollective.init(2, 1, b"x" * 128, _DeviceBackend(0))
    comm.allreduce_bf16(0x5000, 77, 9)
    assert fake_nccl == [("init", 2, 1, "uid"), ("all_reduce", 0x5000, 0x5000, 77, 9, 0, ("Comm", 0xC001), 9)]
    for bad, error in [((2, 1, b"short"), ValueError), ((2, 2, b"x" * 128), ValueError), ((0, 0, b"x" * 128), ValueError)]:
        with pytest.raises(error):
            nccl.NcclCollective.init(*bad, _DeviceBackend(0))
    comm.close()
    with pytest.raises(Exception, match="closed"):
        comm.allreduce_bf16(0x5000, 77, 9)
    assert fake_nccl[-1] == ("destroy", 1)


def test_nccl_group_posts_every_rank_inside_one_group_call(fake_nccl):
    from layers.tensor_parallel import nccl

    group = nccl.NcclGroup([_DeviceBackend(0), _DeviceBackend(1)])
    group.allreduce_bf16_all([(0x5000, 8, 1), (0x6000, 8, 2)])
    assert fake_nccl == [("init_all", [0, 1]), ("group_start",),
                         ("all_reduce", 0x5000, 0x5000, 8, 9, 0, ("Comm", 0xC000), 1),
                         ("all_reduce", 0x6000, 0x6000, 8, 9, 0, ("Comm", 0xC001), 2), ("group_end",)]
    with pytest.raises(ValueError, match="one backend per device"):
        nccl.NcclGroup([_DeviceBackend(0), _DeviceBackend(0)])
    with pytest.raises(ValueError, match="1 buffers for a group of 2"):
        group.allreduce_bf16_all([(0x5000, 8, 1)])
    # a bad rank, or counts that differ, refused before anything is posted (not after rank 0's)
    fake_nccl.clear()
    for buffers, match in [([(0x5000, 8, 1), (0, 8, 2)], r"buffers\[1\] pointer"),
                           ([(0x5000, 8, 1), (0x6000, 8, -2)], r"buffers\[1\] stream"),
                           ([(0x5000, 8, 1), (0x6000, 9, 2)], "the same count")]:
        with pytest.raises(ValueError, match=match):
            group.allreduce_bf16_all(buffers)
    assert fake_nccl == []
    with pytest.raises(ValueError, match="1 streams for a group of 2"):
        group.wait([0], timeout_s=1.0)


def test_a_wait_past_its_deadline_or_on_an_nccl_error_aborts_every_rank(fake_nccl):
    from layers.tensor_parallel import nccl

    gpus = [_DeviceBackend(0), _DeviceBackend(1, done=False)]
    group = nccl.NcclGroup(gpus)
    with pytest.raises(TimeoutError, match="did not finish in 0.05 s"):
        group.wait([0, 0], timeout_s=0.05)
    assert [e for e in fake_nccl if e[0] == "abort"] == [("abort", 0), ("abort", 1)]
    fake_nccl.clear()
    group = nccl.NcclGroup([_DeviceBackend(0), _DeviceBackend(1, done=False)])
    group.members[1].comm.error = 5  # ncclInvalidUsage, reported asynchronously
    with pytest.raises(RuntimeError, match="asynchronous error 5"):
        group.wait([0, 0], timeout_s=10.0)
    assert [e for e in fake_nccl if e[0] == "abort"] == [("abort", 0), ("abort", 1)]
    ok = nccl.NcclCollective.init(1, 0, b"x" * 128, _DeviceBackend(0))
    ok.wait(0, timeout_s=1.0)  # done at once: returns
    with pytest.raises(ValueError, match="timeout_s"):
        ok.wait(0, timeout_s=0)


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


# -- GPU: NCCL (the multi-gpu extra) --------------------------------------------------------------
def _nccl_or_skip():
    try:
        from layers.tensor_parallel import nccl

        nccl._nccl()
    except ImportError as exc:
        pytest.skip(f"NCCL tests need nccl4py and libnccl (pip install 'metrale-gpu[multi-gpu]'): {exc}")
    return nccl


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_one_rank_nccl_equals_fused_eager_and_in_a_graph(gpu, rng):
    nccl = _nccl_or_skip()
    dims = small_dims(max_ngram=3, splits=2, hidden_size=64, table_dim=32)
    host = random_layer(rng, dims, "bf")
    contexts, seq_lens = random_batch(rng, dims, 3, 64)
    want = fused_reference(gpu, rng, host, contexts, seq_lens, 64)
    comm = nccl.NcclCollective.init(1, 0, nccl.unique_id(), gpu)
    stream = gpu.create_stream()
    try:
        with Ranks(gpu, host, 1, collectives=[comm]) as ranks:
            (rank,) = ranks.runners
            rows, h = sum(seq_lens), dims.hidden_size
            eager = run_on_poisoned(gpu, rng, lambda o: rank.embed_batch(contexts, seq_lens, o, stream), rows, h,
                                    stream)
            assert np.array_equal(bits(eager), bits(want))
            for _ in range(2):  # the first call captures, the second replays (the all-reduce inside)
                graph = run_on_poisoned(gpu, rng, lambda o: rank.embed_batch(contexts, seq_lens, o, stream,
                                                                             graph=True), rows, h, stream)
                assert np.array_equal(bits(graph), bits(want))
            assert rank.captured_graphs == 1
            comm.wait(stream, timeout_s=10.0)
    finally:
        comm.close()
        gpu.destroy_stream(stream)


def _two_gpus_or_skip():
    nccl = _nccl_or_skip()
    if device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {device_count()} (run on nvidia-h200-x2)")
    return nccl


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_two_gpus_in_one_process_equal_fused_and_repeat_bit_for_bit(rng):
    nccl = _two_gpus_or_skip()
    from gpu_runtime import CudaBackend

    gpus = [CudaBackend(d) for d in range(2)]
    dims = small_dims(max_ngram=3, splits=4, hidden_size=256, table_dim=32)
    host = random_layer(rng, dims, "bf")
    contexts, seq_lens = random_batch(rng, dims, 8, 256)
    want = fused_reference(gpus[0], rng, host, contexts, seq_lens, 256)
    group = nccl.NcclGroup(gpus)
    try:
        with Ranks(gpus, host, 2, max_rows=256) as ranks:
            rows, h = sum(seq_lens), dims.hidden_size
            outs = [g.alloc(rows * h * 2) for g in gpus]
            results = []
            for _ in range(2):
                for g, o in zip(gpus, outs):  # poisoned before each run: a repeat must write again
                    g.memset(o, 0xFF, rows * h * 2)
                    g.synchronize(0)
                embed_all(group, ranks.runners, contexts, seq_lens, outs, [0, 0])
                group.wait([0, 0], timeout_s=30.0)
                for g, o in zip(gpus, outs):
                    got = np.empty((rows, h), np.uint16)
                    g.copy_d2h(got, o)
                    results.append(got)
            for g, o in zip(gpus, outs):
                g.free(o)
        assert len(results) == 4 and all(np.array_equal(r, bits(want)) for r in results)
    finally:
        group.close()
        for g in gpus:
            g.close()


def _run_two_processes(host, contexts, seq_lens, fail):
    from layers.tensor_parallel import nccl

    ctx = mp.get_context("spawn")
    uid = nccl.unique_id()
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=rank_process, args=(r, uid, host, contexts, seq_lens, pipes[r][1], fail))
             for r in range(2)]
    for p in procs:
        p.start()
    results = [pipes[r][0].recv() if pipes[r][0].poll(120) else ("no answer", None) for r in range(2)]
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    return results


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_two_gpus_one_process_each_equal_fused(gpu, rng):
    _two_gpus_or_skip()
    dims = small_dims(max_ngram=3, splits=4, hidden_size=256, table_dim=32)
    host = random_layer(rng, dims, "b")
    contexts, seq_lens = random_batch(rng, dims, 8, 256)
    want = fused_reference(gpu, rng, host, contexts, seq_lens, 256)
    results = _run_two_processes(host, contexts, seq_lens, fail=False)
    assert [kind for kind, _ in results] == ["ok", "ok"], results
    assert all(np.array_equal(got, bits(want)) for _, got in results)


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_a_failed_rank_cannot_hang_the_other(rng):
    _two_gpus_or_skip()
    dims = small_dims(max_ngram=3, splits=4, hidden_size=256, table_dim=32)
    host = random_layer(rng, dims, "b")
    contexts, seq_lens = random_batch(rng, dims, 2, 256)
    results = _run_two_processes(host, contexts, seq_lens, fail=True)
    assert results[1][0] == "exited"
    assert results[0][0] in ("TimeoutError", "RuntimeError"), results[0]
