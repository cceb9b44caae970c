"""Tensor-parallel test helpers: small dims (``tp_dims``), recording collectives, a rank's weights
from host weights, every rank of a group as ``FusedNgramEmbedding`` runners, the single-GPU fused
reference, random ragged batches, ``embed_all`` over a ``LocalGroup``, ``RankWorld`` (the decoder
``World`` with its decoder over a one-rank shard) and the body of a rank process for the NCCL
multi-process tests."""

from __future__ import annotations

from contextlib import ExitStack

import numpy as np

from layers.ngram_embed import FusedNgramEmbedding, NgramDecoder, NgramShard, NgramWeights, embed_all
from layers.tensor_parallel import LocalGroup
from layers.dense_weight import BF16
from tests.helpers import Guarded, run_on_poisoned
from tests.helpers.decoder import World
from tests.helpers.ngram import HostLayer, device_weights, small_dims


def tp_dims(**kw):
    """The tensor-parallel tests' small dims: T = 4 tables, V = 500, D = 40 (``kw`` overrides)."""
    return small_dims(max_ngram=3, splits=2, **kw)


class FakeCollective:
    """A ``Collective`` of rank ``rank`` of ``size`` that records its all-reduces (into ``calls``,
    which several ranks may share) and sums nothing: exact for a group of one."""

    def __init__(self, rank=0, size=1, calls=None):
        self.rank, self.size, self.closed = rank, size, False
        self.calls = [] if calls is None else calls

    def allreduce_bf16(self, ptr, count, stream):
        self.calls.append(("allreduce", int(ptr), count, stream))


class FakeGroup:
    """A ``CollectiveGroup`` of ``size`` that records its calls and sums nothing."""

    def __init__(self, size):
        self.size, self.closed, self.calls = size, False, []

    def allreduce_bf16_all(self, buffers):
        self.calls.append(("allreduce_all", [(int(p), c, s) for p, c, s in buffers]))


def numpy_tables(host: HostLayer, shard: NgramShard | None = None) -> list:
    """``host``'s tables as ``NgramWeights.from_numpy`` takes them (bf16, or ``(fp8, scales)``);
    with ``shard``, None for the tables another rank holds."""
    return [None if shard is not None and c not in shard.tables else t if s is None else (t, s)
            for c, (t, s) in enumerate(host.tables)]


def rank_weights(gpu, host: HostLayer, rank: int = 0, size: int = 1, stream: int = 0) -> NgramWeights:
    """Rank ``rank`` of ``size``'s share of ``host`` on ``gpu`` (only its word rows and tables)."""
    shard = NgramShard.of(host.dims, rank, size)
    return NgramWeights.from_numpy(host.dims, host.word, numpy_tables(host, shard), host.projs, gpu,
                                   stream=stream, shard=shard)


class Ranks:
    """Every rank of a group of ``size`` on ``gpus[r % len(gpus)]``: ``weights[r]`` (a shard of
    ``host``) and ``runners[r]`` (a ``FusedNgramEmbedding`` of ``max_rows`` over them, with
    ``collectives[r]`` if given). ``close()`` closes the runners, then the weights."""

    def __init__(self, gpus, host: HostLayer, size: int, max_rows: int = 64, collectives=None):
        gpus = gpus if isinstance(gpus, (list, tuple)) else [gpus]
        self.weights: list[NgramWeights] = []
        self.runners: list[FusedNgramEmbedding] = []
        try:
            for r in range(size):
                self.weights.append(rank_weights(gpus[r % len(gpus)], host, r, size))
                self.runners.append(FusedNgramEmbedding(
                    self.weights[r], max_rows, collective=None if collectives is None else collectives[r]))
        except BaseException:
            self.close()
            raise

    def close(self):
        for runner in self.runners:
            runner.close()
        for weights in self.weights:
            weights.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def fused_reference(gpu, rng, host: HostLayer, contexts, seq_lens, max_rows: int) -> np.ndarray:
    """The single-GPU fused path's output for a batch (full weights, no shard), written whole."""
    with device_weights(gpu, host) as weights, FusedNgramEmbedding(weights, max_rows) as fused:
        return run_on_poisoned(gpu, rng, lambda o: fused.embed_batch(contexts, seq_lens, o), sum(seq_lens),
                               host.dims.hidden_size)


def random_batch(rng, dims, sequences: int, max_rows: int):
    """Random contexts of 1-39 tokens; each sequence embeds at most max_rows // sequences of them,
    so the batch always fits a runner of ``max_rows`` rows."""
    contexts = [rng.integers(0, dims.vocab_size, int(rng.integers(1, 40))) for _ in range(sequences)]
    seq_lens = [int(rng.integers(1, min(len(c), max_rows // sequences) + 1)) for c in contexts]
    return contexts, seq_lens


def local_outputs(gpu, rng, runners, contexts, seq_lens, h: int) -> list[np.ndarray]:
    """Every rank's output of one ``embed_all`` over a ``LocalGroup`` (each into its own poisoned,
    guarded buffer, checked to be written inside it)."""
    rows, size = sum(seq_lens), len(runners)
    with ExitStack() as stack:
        outs = [stack.enter_context(Guarded(gpu, (rows, h), BF16, rng)) for _ in range(size)]
        for o in outs:
            o.poison()
        gpu.synchronize(0)
        group = LocalGroup(gpu, size)
        assert embed_all(group, runners, contexts, seq_lens, [o.ptr for o in outs], [0] * size) == rows
        group.close()
        gpu.synchronize(0)
        got = [o.read() for o in outs]
        for o in outs:
            o.assert_guards_intact()
    return got


class RankWorld(World):
    """The decoder ``World`` with its decoder replaced by one over a one-rank shard of the same
    host weights (``shard=(0, 1)``, ``collective``: a group of one, whose sum adds nothing), of the
    same sizes, adapter slots and batch invariance; the fused reference stays on the full weights. Every decoder row must still equal
    the fused path's, bit for bit: the word rows come through the shard gather and the GEMM reads
    them from the reduced buffer."""

    def __init__(self, gpu, rng, collective, **kw):
        super().__init__(gpu, rng, **kw)
        sizes = dict(max_seqs=self.dec.max_seqs, max_rows=self.dec.max_rows, max_draft=self.dec.max_draft)
        self.dec.close()
        self.collective = collective
        self.rank_weights = rank_weights(gpu, self.host)
        gpu.synchronize(0)  # uploaded on the default stream; the decoder reads them on the world's
        self.dec = NgramDecoder(self.rank_weights, collective=collective, stream=self.stream, adapter_slots=self.slots,
                                batch_invariant=kw.get("batch_invariant", False), **sizes)

    def close(self):
        super().close()
        self.rank_weights.close()


def rank_process(rank, uid, host, contexts, seq_lens, conn, fail):
    """One process of a two-GPU NCCL group (spawned): rank ``rank``'s fused runner embeds the
    batch through its ``NcclCollective`` and sends ``("ok", output bits)``, or the exception's
    kind and message; with ``fail``, rank 1 leaves without posting its all-reduce."""
    from gpu_runtime import CudaBackend
    from layers.tensor_parallel import nccl

    gpu = CudaBackend(rank)
    comm = nccl.NcclCollective.init(2, rank, uid, gpu)
    if fail and rank == 1:
        conn.send(("exited", None))  # a failed rank: gone without posting its all-reduce
        return
    weights = rank_weights(gpu, host, rank, 2)
    runner = FusedNgramEmbedding(weights, 256, collective=comm)
    rows, h = sum(seq_lens), host.dims.hidden_size
    out = gpu.alloc(rows * h * 2)
    try:
        gpu.memset(out, 0xFF, rows * h * 2)  # poison: a row the rank leaves unwritten cannot match
        gpu.synchronize(0)
        runner.embed_batch(contexts, seq_lens, out)
        comm.wait(0, timeout_s=5.0 if fail else 60.0)
        got = np.empty((rows, h), np.uint16)
        gpu.copy_d2h(got, out)
        conn.send(("ok", got))
    except Exception as exc:  # noqa: BLE001 - the parent asserts on the kind
        conn.send((type(exc).__name__, str(exc)))
