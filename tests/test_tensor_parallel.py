"""Tensor parallelism: the shard arithmetic and the launch order (CPU); on one GPU, every rank of
a group run one after another and summed (``LocalGroup``) and a one-rank NCCL communicator, each
bit for bit the single-GPU fused path; on two GPUs (skipped on smaller machines), NCCL in one
process and in one process per GPU, and a failed rank that cannot hang the other."""

from __future__ import annotations

import multiprocessing as mp
import sys
from contextlib import ExitStack

import numpy as np
import pytest

from gpu_runtime import DeviceCopies, DevicePtr, device_count
from layers.ngram_embed import NgramTable
from layers.ngram_embed.fused import FusedNgramEmbedding
from layers.ngram_embed.tables import check_table, gather_entry
from layers.ops.ngram_fused import ABSENT
from layers.tensor_parallel import (LocalGroup, NgramShard, RankWeights, TensorParallelNgramDecoder,
                                    TensorParallelNgramEmbedding, embed_all, reduce_bytes)
import tests.test_ngram_decoder as decoder_tests
from tests.fakes import RecordingBackend
from layers.weight_map import BF16
from tests.helpers import Guarded, bits, run_on_poisoned
from tests.helpers.ngram import device_layer, free_layer, random_layer, small_dims

OUT = DevicePtr(0x900000)


def _ranks(gpu, host, size, max_rows=64, collectives=None):
    """Every rank of a group of ``size`` on ``gpu``, from the full host weights."""
    tables = [t if s is None else (t, s) for t, s in host.tables]
    return [TensorParallelNgramEmbedding.from_numpy(
        host.dims, NgramShard.of(host.dims, r, size), host.word, tables, host.projs, max_rows, gpu,
        collective=None if collectives is None else collectives[r]) for r in range(size)]


class FakeCollective:
    def __init__(self, rank=0, size=1, calls=None):
        self.rank, self.size, self.closed = rank, size, False
        self.calls = [] if calls is None else calls

    def allreduce_bf16(self, ptr, count, stream):
        self.calls.append(("allreduce", int(ptr), count, stream))


class FakeGroup:
    def __init__(self, size):
        self.size, self.closed, self.calls = size, False, []

    def allreduce_bf16_all(self, buffers):
        self.calls.append(("allreduce_all", [(int(p), c, s) for p, c, s in buffers]))


# -- CPU: the shard arithmetic ------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shards_split_tables_and_word_rows_exactly_once(size):
    dims = small_dims(max_ngram=3, splits=2)  # T = 4, V = 500
    shards = [NgramShard.of(dims, r, size) for r in range(size)]
    assert [c for s in shards for c in s.tables] == list(range(dims.num_tables()))
    assert all(len(s.tables) in (4 // size, -(-4 // size)) for s in shards)
    assert [s.word_lo for s in shards] == [r * 500 // size for r in range(size)]
    assert sum(s.word_rows for s in shards) == 500
    assert [s.holds_word(499) for s in shards] == [r == size - 1 for r in range(size)]


@pytest.mark.parametrize("rank, size, error", [(0, 5, ValueError), (2, 2, ValueError), (-1, 2, ValueError),
                                               (0, 0, ValueError), (0.0, 2, TypeError)])
def test_bad_ranks_are_refused(rank, size, error):
    with pytest.raises(error):
        NgramShard.of(small_dims(max_ngram=3, splits=2), rank, size)


def test_reduce_bytes_for_both_places():
    dims = small_dims(hidden_size=256, max_ngram=3, splits=4, table_dim=32)  # T td = 8 * 32 = D
    assert reduce_bytes(dims, 10) == {"gathered rows (bf16)": 2 * 10 * (256 + 256),
                                      "projected output (fp32)": 4 * 10 * 256}


def test_absent_tables_gather_as_zeros_and_the_seed_path_refuses_them():
    assert gather_entry(NgramTable.Absent(61, 20), 61) == (0, 0, 61, ABSENT)
    check_table(NgramTable.Absent(61, 20), 0, 61, 20)
    with pytest.raises(ValueError, match="shape"):
        check_table(NgramTable.Absent(62, 20), 0, 61, 20)
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=3, splits=2)
    host = random_layer(np.random.default_rng(0), dims, "b")
    layer = device_layer(gpu, host, max_tokens=8)
    layer.tables[1] = NgramTable.Absent(dims.table_rows(1), dims.table_dim())
    gpu.launches.clear()
    with pytest.raises(ValueError, match="table 1 is held by another rank"):
        layer.embed([1, 2, 3], 2, OUT, gpu)
    assert gpu.launches == []


def test_rank_weights_refuse_tables_on_the_wrong_rank():
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=3, splits=2)
    host = random_layer(np.random.default_rng(0), dims, "b")
    good = RankWeights.from_numpy(dims, NgramShard.of(dims, 1, 2), host.word, [t for t, _ in host.tables],
                                  host.projs, gpu)
    assert [type(t).__name__ for t in good.tables] == ["AbsentTable"] * 2 + ["Bf16Table"] * 2
    assert good.word.shape == (250, dims.hidden_size)
    with pytest.raises(ValueError, match="table 0 must be held by rank 0"):
        RankWeights(dims, NgramShard.of(dims, 0, 2), good.word, good.tables, good.projs, gpu)
    with pytest.raises(ValueError, match="table 2 must not be held by rank 0"):
        RankWeights(dims, NgramShard.of(dims, 0, 2), good.word, _all_held(good, dims), good.projs, gpu)
    with pytest.raises(ValueError, match="is rank 1's, got None"):
        RankWeights.from_numpy(dims, NgramShard.of(dims, 1, 2), host.word, [None] * 4, host.projs, gpu)


def _all_held(weights, dims):
    """Rank 1's tables with its absent ones replaced by held ones of the right shape."""
    from layers.ngram_embed.tables import Bf16Table
    from layers.weight_map import DenseWeight

    return [t if not isinstance(t, NgramTable.Absent) else
            Bf16Table(DenseWeight(DevicePtr(0x700000), (dims.table_rows(c), dims.table_dim()), np.dtype(BF16)))
            for c, t in enumerate(weights.tables)]


# -- CPU: a rank's part of a Hugging Face folder -----------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3])
def test_from_pretrained_reads_and_uploads_only_the_ranks_part(tmp_path, rng, size):
    from tests.helpers.checkpoint import make_model, weight_bytes, write_model
    from tests.helpers.logging_backend import LoggingBackend

    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    dims = model.dims
    for r in range(size):
        gpu, ref_gpu = LoggingBackend(), LoggingBackend()
        shard = NgramShard.of(dims, r, size)
        with TensorParallelNgramEmbedding.from_pretrained(str(model.path), gpu, r, size, max_rows=8) as tp, \
                RankWeights.from_numpy(dims, shard, model.word, [t if c in shard.tables else None for c, t in
                                                                 enumerate(model.numpy_tables())],
                                       model.projs, ref_gpu) as ref:
            weights = tp.layer
            assert weights.shard == shard and tp.dims == dims
            assert weight_bytes(gpu, weights.word) == weight_bytes(ref_gpu, ref.word)
            assert [type(t).__name__ for t in weights.tables] == [type(t).__name__ for t in ref.tables]
            for got, want in zip(weights.tables, ref.tables):
                if not isinstance(got, NgramTable.Absent):
                    assert weight_bytes(gpu, got.weight) == weight_bytes(ref_gpu, want.weight)
            assert [weight_bytes(gpu, p) for p in weights.projs] == [weight_bytes(ref_gpu, p) for p in ref.projs]
        assert gpu.empty() and ref_gpu.empty()
    with pytest.raises(ValueError, match="out of range"):
        TensorParallelNgramEmbedding.from_pretrained(str(model.path), LoggingBackend(), 2, 2)


# -- CPU: the launches -------------------------------------------------------------------------
def test_a_call_is_two_gathers_an_all_reduce_and_the_word_gemm():
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=3, splits=2)
    host = random_layer(np.random.default_rng(3), dims, "bf")
    calls = []
    (rank0, rank1) = _ranks(gpu, host, 2, collectives=[FakeCollective(0, 2, calls), FakeCollective(1, 2, calls)])
    h, k = dims.hidden_size, dims.num_tables() * dims.table_dim()
    gpu.launches.clear()
    rank1.embed([5, 7, 9, 11, 13], 3, OUT, gpu, stream=4)
    names = [gpu.kernel_of(launch)[1] for launch in gpu.launches]
    assert names == ["batched_embed_shard", "ngram_gather", "dense_gemm_bf16_word"]
    shard, gather, gemm = gpu.launches
    buf = int(rank1.gather_buf)
    assert shard.args[1:] == [int(rank1.word_rows.weight), buf, 3, h, 250, 250]
    assert gather.args[4] == buf + 3 * h * 2  # the gathered rows after the word rows
    assert calls == [("allreduce", buf, 3 * (h + k), 4)]
    assert gemm.args[0] == buf + 3 * h * 2 and gemm.args[2] == int(OUT)
    assert gemm.args[3:6] == [3, h, k] and gemm.args[6:8] == [int(rank1.row_ids), buf]
    assert all(launch.stream == 4 for launch in gpu.launches)
    rank0.close()
    rank1.close()


def test_embed_needs_a_collective_of_its_rank():
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=3, splits=2)
    host = random_layer(np.random.default_rng(4), dims, "b")
    (rank,) = _ranks(gpu, host, 1)
    gpu.launches.clear()
    with pytest.raises(ValueError, match="no collective"):
        rank.embed([1, 2, 3], 2, OUT, gpu)
    with pytest.raises(ValueError, match="no collective"):
        rank.embed_batch([[1, 2, 3]], [2], OUT, gpu)
    assert gpu.launches == []
    tables = [t for t, _ in host.tables]
    with pytest.raises(ValueError, match="rank 1 of 2, the weights rank 0 of 1"):
        TensorParallelNgramEmbedding.from_numpy(dims, NgramShard.of(dims, 0, 1), host.word, tables,
                                                host.projs, 8, gpu, collective=FakeCollective(1, 2))
    closed = FakeCollective()
    closed.closed = True
    with pytest.raises(Exception, match="closed"):
        TensorParallelNgramEmbedding.from_numpy(dims, NgramShard.of(dims, 0, 1), host.word, tables,
                                                host.projs, 8, gpu, collective=closed)
    with pytest.raises(TypeError, match="Collective"):
        TensorParallelNgramEmbedding.from_numpy(dims, NgramShard.of(dims, 0, 1), host.word, tables,
                                                host.projs, 8, gpu, collective=object())


def test_embed_all_stages_every_rank_then_sums_then_projects():
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=3, splits=2)
    ranks = _ranks(gpu, random_layer(np.random.default_rng(5), dims, "b"), 2)
    group = FakeGroup(2)
    outs = [OUT, DevicePtr(0xA00000)]
    gpu.launches.clear()
    assert embed_all(group, ranks, [[1, 2, 3, 4]], [3], outs, [6, 7]) == 3
    names = [gpu.kernel_of(launch)[1] for launch in gpu.launches]
    assert names == ["batched_embed_shard", "ngram_gather"] * 2 + ["dense_gemm_bf16_word"] * 2
    count = 3 * (dims.hidden_size + dims.num_tables() * dims.table_dim())
    assert group.calls == [("allreduce_all", [(int(ranks[0].gather_buf), count, 6),
                                              (int(ranks[1].gather_buf), count, 7)])]
    assert [launch.args[2] for launch in gpu.launches[4:]] == [int(o) for o in outs]
    gpu.launches.clear()
    for bad, match in [((FakeGroup(3), ranks, outs, [6, 7]), "for a group of 3"),
                       ((group, ranks[::-1], outs, [6, 7]), "ranks\\[0\\] is rank 1"),
                       ((group, ranks, [OUT, 0], [6, 7]), "out")]:
        with pytest.raises((ValueError, TypeError), match=match):
            embed_all(bad[0], bad[1], [[1, 2, 3, 4]], [3], bad[2], bad[3])
    with pytest.raises(ValueError):
        embed_all(group, ranks, [[1, 2, 10**6]], [2], outs, [6, 7])  # token over the vocabulary
    assert gpu.launches == [] and len(group.calls) == 1
    for r in ranks:
        r.close()


def _rank_weights(gpu, host, rank=0, size=1):
    return RankWeights.from_numpy(host.dims, NgramShard.of(host.dims, rank, size), host.word,
                                  [t if s is None else (t, s) for t, s in host.tables], host.projs, gpu)


def test_a_decoder_step_is_its_gather_the_word_shard_the_all_reduce_and_the_gemm():
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=3, splits=2, eos_id=7)
    calls = []
    weights = _rank_weights(gpu, random_layer(np.random.default_rng(6), dims, "bf"), 1, 2)
    dec = TensorParallelNgramDecoder(weights, collective=FakeCollective(1, 2, calls), max_seqs=4, max_rows=32,
                                     gpu=gpu, max_draft=1)
    h, k = dims.hidden_size, dims.num_tables() * dims.table_dim()
    gpu.launches.clear()
    dec.step(DevicePtr(0x1000), DevicePtr(0x2000), 3, OUT, stream=5, k=2)
    names = [gpu.kernel_of(launch)[1] for launch in gpu.launches]
    assert names == ["ngram_decode_gather", "batched_embed_shard", "dense_gemm_bf16_word"]
    gather, shard, gemm = gpu.launches
    buf, rows = int(dec.fused.gather_buf), 6
    assert buf + rows * h * 2 in gather.args and int(dec.word_ids) in gather.args
    assert shard.args == [int(dec.word_ids), int(weights.word.weight), buf, rows, h, 250, 250]
    assert calls == [("allreduce", buf, rows * (h + k), 5)]
    assert gemm.args[0] == buf + rows * h * 2 and gemm.args[6:8] == [int(dec.fused.row_ids), buf]
    with pytest.raises(TypeError, match="Collective"):
        TensorParallelNgramDecoder(weights, collective=None, max_seqs=4, max_rows=32, gpu=gpu)
    calls[-1:] = []
    dec.fused.collective.closed = True
    gpu.launches.clear()
    with pytest.raises(Exception, match="closed"):
        dec.step(DevicePtr(0x1000), DevicePtr(0x2000), 3, OUT, stream=5)
    assert gpu.launches == [] and calls == []
    dec.close()
    weights.close()


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
def _fused_reference(gpu, rng, host, contexts, seq_lens, max_rows):
    layer = device_layer(gpu, host, max_tokens=max_rows)
    fused = FusedNgramEmbedding(layer, max_rows, gpu)
    try:
        return run_on_poisoned(gpu, rng, lambda o: fused.embed_batch(contexts, seq_lens, o, gpu), sum(seq_lens),
                               host.dims.hidden_size)
    finally:
        fused.close()
        free_layer(layer)


def _batch(rng, dims, sequences, max_rows):
    """Random contexts of 1-39 tokens; each sequence embeds at most max_rows // sequences of them,
    so the batch always fits a layer of ``max_rows`` rows."""
    contexts = [rng.integers(0, dims.vocab_size, int(rng.integers(1, 40))) for _ in range(sequences)]
    seq_lens = [int(rng.integers(1, min(len(c), max_rows // sequences) + 1)) for c in contexts]
    return contexts, seq_lens


def _local_outputs(gpu, rng, ranks, contexts, seq_lens, h):
    """Every rank's output of one ``embed_all`` over a ``LocalGroup``, each written whole."""
    rows, size = sum(seq_lens), len(ranks)
    with ExitStack() as stack:
        outs = [stack.enter_context(Guarded(gpu, (rows, h), BF16, rng)) for _ in range(size)]
        for o in outs:
            o.poison()
        gpu.synchronize(0)
        assert embed_all(LocalGroup(gpu, size), ranks, contexts, seq_lens, [o.ptr for o in outs], [0] * size) == rows
        gpu.synchronize(0)
        got = [o.read() for o in outs]
        for o in outs:
            o.assert_guards_intact()
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("size, kinds", [(1, "b"), (2, "bf"), (3, "fb"), (4, "b")])
def test_local_group_equals_the_single_gpu_fused_path(gpu, rng, size, kinds):
    dims = small_dims(max_ngram=3, splits=2, hidden_size=64, table_dim=32, eos_id=3)
    host = random_layer(rng, dims, kinds)
    contexts, seq_lens = _batch(rng, dims, 5, 128)
    want = _fused_reference(gpu, rng, host, contexts, seq_lens, 128)
    ranks = _ranks(gpu, host, size, max_rows=128)
    try:
        got = _local_outputs(gpu, rng, ranks, contexts, seq_lens, dims.hidden_size)
        for r in range(size):
            assert np.array_equal(bits(got[r]), bits(want)), f"rank {r} of {size}"
    finally:
        for r in ranks:
            r.close()


@pytest.mark.gpu
def test_pretrained_ranks_equal_the_pretrained_fused_path(gpu, rng, tmp_path):
    from tests.helpers.checkpoint import make_model, write_model

    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    dims, path = model.dims, str(model.path)
    contexts, seq_lens = _batch(rng, dims, 4, 64)
    with FusedNgramEmbedding.from_pretrained(path, gpu, max_rows=64) as fused:
        want = run_on_poisoned(gpu, rng, lambda o: fused.embed_batch(contexts, seq_lens, o, gpu), sum(seq_lens),
                               dims.hidden_size)
    ranks = [TensorParallelNgramEmbedding.from_pretrained(path, gpu, r, 2, max_rows=64) for r in range(2)]
    try:
        got = _local_outputs(gpu, rng, ranks, contexts, seq_lens, dims.hidden_size)
        assert all(np.array_equal(bits(g), bits(want)) for g in got)
    finally:
        for r in ranks:
            r.close()


class _RankWorld(decoder_tests.World):
    """``test_ngram_decoder``'s world with its decoder replaced by a one-rank tensor-parallel one
    (a collective of one: the all-reduce adds nothing), checked against the same fused path."""

    def __init__(self, gpu, rng, collective):
        super().__init__(gpu, rng)
        self.dec.close()
        self.weights = _rank_weights(gpu, self.host)
        gpu.synchronize(0)
        self.dec = TensorParallelNgramDecoder(self.weights, collective=collective, max_seqs=6, max_rows=96, gpu=gpu,
                                              stream=self.stream, max_draft=3)

    def close(self):
        super().close()
        self.weights.close()


@pytest.mark.gpu
@pytest.mark.parametrize("body", ["test_ragged_and_chunked_prefill_equal_the_fused_path",
                                  "test_graph_replayed_decode_steps_with_resets_and_reuse",
                                  "test_k_token_steps_with_rollbacks"])
def test_a_one_rank_decoder_is_the_decoder(gpu, rng, body):
    world = _RankWorld(gpu, rng, FakeCollective())
    try:
        getattr(decoder_tests, body)(world)
    finally:
        world.close()


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["token", "slot", "seqlens", "rollback"])
def test_a_one_rank_decoder_contains_bad_device_values(gpu, rng, bad):
    world = _RankWorld(gpu, rng, FakeCollective())
    try:
        decoder_tests.test_bad_device_values_are_flagged_and_contained(world, bad)
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
    contexts, seq_lens = _batch(rng, dims, 3, 64)
    want = _fused_reference(gpu, rng, host, contexts, seq_lens, 64)
    comm = nccl.NcclCollective.init(1, 0, nccl.unique_id(), gpu)
    (rank,) = _ranks(gpu, host, 1, collectives=[comm])
    stream = gpu.create_stream()
    try:
        rows, h = sum(seq_lens), dims.hidden_size
        eager = run_on_poisoned(gpu, rng, lambda o: rank.embed_batch(contexts, seq_lens, o, gpu, stream), rows, h,
                                stream)
        assert np.array_equal(bits(eager), bits(want))
        for _ in range(2):  # the first call captures, the second replays (the all-reduce inside)
            graph = run_on_poisoned(gpu, rng, lambda o: rank.embed_batch(contexts, seq_lens, o, gpu, stream,
                                                                         graph=True), rows, h, stream)
            assert np.array_equal(bits(graph), bits(want))
        assert rank.captured_graphs == 1
        comm.wait(stream, timeout_s=10.0)
    finally:
        rank.close()
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
    contexts, seq_lens = _batch(rng, dims, 8, 256)
    want = _fused_reference(gpus[0], rng, host, contexts, seq_lens, 256)
    group = nccl.NcclGroup(gpus)
    ranks = [TensorParallelNgramEmbedding.from_numpy(dims, NgramShard.of(dims, r, 2), host.word,
                                                     [t if s is None else (t, s) for t, s in host.tables],
                                                     host.projs, 256, gpus[r]) for r in range(2)]
    try:
        rows, h = sum(seq_lens), dims.hidden_size
        outs = [g.alloc(rows * h * 2) for g in gpus]
        results = []
        for _ in range(2):
            embed_all(group, ranks, contexts, seq_lens, outs, [0, 0])
            group.wait([0, 0], timeout_s=30.0)
            for g, o in zip(gpus, outs):
                got = np.empty((rows, h), np.uint16)
                g.copy_d2h(got, o)
                results.append(got)
        assert all(np.array_equal(r, bits(want)) for r in results)
    finally:
        for r in ranks:
            r.close()
        group.close()
        for g in gpus:
            g.close()


def _rank_process(rank, uid, host, contexts, seq_lens, conn, fail):
    from gpu_runtime import CudaBackend
    from layers.tensor_parallel import nccl

    gpu = CudaBackend(rank)
    comm = nccl.NcclCollective.init(2, rank, uid, gpu)
    if fail and rank == 1:
        conn.send(("exited", None))  # a failed rank: gone without posting its all-reduce
        return
    layer = TensorParallelNgramEmbedding.from_numpy(host.dims, NgramShard.of(host.dims, rank, 2), host.word,
                                                    [t if s is None else (t, s) for t, s in host.tables],
                                                    host.projs, 256, gpu, collective=comm)
    rows, h = sum(seq_lens), host.dims.hidden_size
    out = gpu.alloc(rows * h * 2)
    try:
        layer.embed_batch(contexts, seq_lens, out, gpu)
        comm.wait(0, timeout_s=5.0 if fail else 60.0)
        got = np.empty((rows, h), np.uint16)
        gpu.copy_d2h(got, out)
        conn.send(("ok", got))
    except Exception as exc:  # noqa: BLE001 - the parent asserts on the kind
        conn.send((type(exc).__name__, str(exc)))


def _run_two_processes(host, contexts, seq_lens, fail):
    from layers.tensor_parallel import nccl

    ctx = mp.get_context("spawn")
    uid = nccl.unique_id()
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_rank_process, args=(r, uid, host, contexts, seq_lens, pipes[r][1], fail))
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
    contexts, seq_lens = _batch(rng, dims, 8, 256)
    want = _fused_reference(gpu, rng, host, contexts, seq_lens, 256)
    results = _run_two_processes(host, contexts, seq_lens, fail=False)
    assert [kind for kind, _ in results] == ["ok", "ok"], results
    assert all(np.array_equal(got, bits(want)) for _, got in results)


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_a_failed_rank_cannot_hang_the_other(rng):
    _two_gpus_or_skip()
    dims = small_dims(max_ngram=3, splits=4, hidden_size=256, table_dim=32)
    host = random_layer(rng, dims, "b")
    contexts, seq_lens = _batch(rng, dims, 2, 256)
    results = _run_two_processes(host, contexts, seq_lens, fail=True)
    assert results[1][0] == "exited"
    assert results[0][0] in ("TimeoutError", "RuntimeError"), results[0]
