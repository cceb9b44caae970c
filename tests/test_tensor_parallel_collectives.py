"""Tensor parallelism: the collectives (``LocalGroup``, the NCCL wrappers).

CPU: ``LocalGroup``'s adds and copies over a recording backend, and the NCCL wrappers over fake
nccl4py modules (the missing extra named, a bf16 sum posted, every rank inside one group call, a
wait that aborts every rank). On one GPU: a one-rank NCCL communicator, eager and in a graph. On
two GPUs (skipped on smaller machines): NCCL in one process and in one process per GPU, and a
failed rank that cannot hang the other. Each bit for bit the single-GPU fused path."""

from __future__ import annotations

import multiprocessing as mp
import sys

import numpy as np
import pytest

from gpu_runtime import DeviceCopies, device_count
from layers.ngram_embed import embed_all
from layers.tensor_parallel import LocalGroup
from tests.helpers.fakes import RecordingBackend
from tests.helpers import bits, run_on_poisoned
from tests.helpers.ngram import random_layer, small_dims
from tests.helpers.tensor_parallel import Ranks, fused_reference, random_batch, rank_process


# -- CPU: LocalGroup and the NCCL wrappers over fakes -------------------------------------------
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
        pytest.skip(f"needs 2 GPUs, this machine has {device_count()}")
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
