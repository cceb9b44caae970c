"""``TensorParallelNgramEmbedding``: one rank of the n-gram embedding split over a group of GPUs.

Each rank holds the tables and word rows of its ``NgramShard`` (the others' tables are
``NgramTable.Absent``) and every projection. A call is the fused path's two launches with an
all-reduce between them:

1. the fused gather writes this rank's T gathered rows, zeros for the absent tables, into
   ``[S, T*td]``, and the shard gather its word rows, zeros for the others', into ``[S, D]``
   just before it (one buffer, ``[S, D + T*td]``);
2. the group sums that buffer (bf16, exact: one contributor per element);
3. the fused GEMM multiplies the summed rows by the concatenated projections and adds the summed
   word row in its epilogue (row i's word row is row i of the buffer), rounding once.

So every rank's output is the single-GPU fused path's, bit for bit. One process per GPU calls
``embed``/``embed_batch`` on its rank (``collective``: an ``NcclCollective``; with
``graph=True`` the all-reduce is captured with the gather and the GEMM); one process driving
every GPU calls ``embed_all`` with a ``CollectiveGroup`` (NCCL group calls, or ``LocalGroup``:
every rank on one device, which checks the sharding arithmetic on a single GPU).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from gpu_runtime import GpuBackend, validate

from ..kernel_files import load_kernel
from ..ngram_embed.dims import NgramDims
from ..ngram_embed.front import require_open, require_out
from ..ngram_embed.fused import FusedNgramEmbedding
from ..ngram_embed.resources import Resources, closed_on_failure
from ..ngram_embed.tables import AbsentTable, AnyTable, Bf16Table, Fp8Table, check_table
from ..ops import embed as embed_ops
from ..ops import gemm as gemm_ops
from ..ops import ngram_fused as fused_ops
from ..weight_map import BF16, DenseWeight
from .collective import Collective, CollectiveGroup
from .shard import NgramShard

_WHAT = "tensor-parallel ngram embed"


class RankWeights:
    """One rank's weights: word rows ``[shard.word_rows, D]``, its tables (``NgramTable.Absent``
    for the others') and all T projections; shaped like the ``NgramEmbedding`` the fused path
    is built on. Closes what it was handed (``own``) with itself."""

    def __init__(self, dims: NgramDims, shard: NgramShard, word: DenseWeight,
                 tables: Sequence[AnyTable], projs: Sequence[DenseWeight], gpu: GpuBackend) -> None:
        t, h, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
        if shard != NgramShard.of(dims, shard.rank, shard.size):
            raise ValueError(f"rank weights: shard {shard} is not NgramShard.of(dims, {shard.rank}, {shard.size})")
        if not isinstance(word, DenseWeight) or word.shape != (shard.word_rows, h) or word.dtype != BF16:
            raise ValueError(f"rank weights: word rows must be a ({shard.word_rows}, {h}) bfloat16 DenseWeight, "
                             f"got {getattr(word, 'shape', type(word).__name__)}")
        if len(tables) != t or len(projs) != t:
            raise ValueError(f"rank weights: {len(tables)} tables and {len(projs)} projections, dims need {t}")
        for c, table in enumerate(tables):
            check_table(table, c, dims.table_rows(c), td)
            if isinstance(table, AbsentTable) == (c in shard.tables):
                raise ValueError(f"rank weights: table {c} {'must' if c in shard.tables else 'must not'} be "
                                 f"held by rank {shard.rank} (its tables: {list(shard.tables)})")
        for c, proj in enumerate(projs):
            if not isinstance(proj, DenseWeight) or proj.shape != (h, td) or proj.dtype != BF16:
                raise ValueError(f"rank weights: proj {c} must be a ({h}, {td}) bfloat16 DenseWeight")
        self.dims, self.shard, self.word, self.gpu = dims, shard, word, gpu
        self.tables, self.projs = list(tables), list(projs)
        self._owned = Resources(gpu)

    @classmethod
    def from_numpy(cls, dims: NgramDims, shard: NgramShard, word: np.ndarray,
                   tables: Sequence[np.ndarray | tuple[np.ndarray, np.ndarray] | None],
                   projs: Sequence[np.ndarray], gpu: GpuBackend, stream: int = 0) -> "RankWeights":
        """Upload this rank's part of full host weights (``word [V, D]``; each table bf16 or
        ``(fp8, f32 scales)``, or None where another rank holds it; every projection)."""
        if len(tables) != dims.num_tables():
            raise ValueError(f"rank weights: {len(tables)} tables, dims need {dims.num_tables()}")
        with closed_on_failure() as owned:

            def upload(array: Any, scale: Any = None) -> DenseWeight:
                owned.append(DenseWeight.from_numpy(gpu, array, scale, stream))
                return owned[-1]

            lo = shard.word_lo
            word_rows = upload(np.asarray(word)[lo:lo + shard.word_rows])
            rank_tables: list[AnyTable] = []
            for c, table in enumerate(tables):
                if c not in shard.tables:
                    rank_tables.append(AbsentTable(dims.table_rows(c), dims.table_dim()))
                elif table is None:
                    raise ValueError(f"rank weights: table {c} is rank {shard.rank}'s, got None")
                elif isinstance(table, tuple):
                    rank_tables.append(Fp8Table(upload(*table)))
                else:
                    rank_tables.append(Bf16Table(upload(table)))
            weights = cls(dims, shard, word_rows, rank_tables, [upload(p) for p in projs], gpu)
        weights.own(*owned)
        return weights

    @property
    def closed(self) -> bool:
        return self._owned.closed

    def own(self, *things: Any) -> None:
        validate.require_open(self.closed, "RankWeights")
        for thing in things:
            self._owned.adopt(thing)

    def close(self) -> None:
        self._owned.close()

    def __enter__(self) -> "RankWeights":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorParallelNgramEmbedding(FusedNgramEmbedding):
    """Rank ``weights.shard.rank`` of the group; ``collective`` (its end of the communicator)
    serves ``embed``/``embed_batch``; ``embed_all`` needs none. Owns ``weights`` when built by
    ``from_numpy``."""

    def __init__(self, weights: RankWeights, max_rows: int, gpu: GpuBackend, stream: int = 0, *,
                 collective: Collective | None = None) -> None:
        if not isinstance(weights, RankWeights):
            raise TypeError(f"{_WHAT}: expected RankWeights, got {type(weights).__name__}")
        self.shard = weights.shard
        if collective is not None:
            check_collective(collective, self.shard)
        self.collective = collective
        super().__init__(weights, max_rows, gpu, stream)  # type: ignore[arg-type]  (shaped like a layer)
        self.word_rows = weights.word
        self.shard_k = load_kernel(gpu, "embed_from_argmax", "batched_embed_shard")
        self.row_ids = self._resources.upload(np.arange(self.max_rows, dtype=np.uint32), stream)

    @classmethod
    def from_numpy(cls, dims: NgramDims, shard: NgramShard, word: np.ndarray, tables: Sequence[Any],
                   projs: Sequence[np.ndarray], max_rows: int, gpu: GpuBackend, stream: int = 0, *,
                   collective: Collective | None = None) -> "TensorParallelNgramEmbedding":
        """``RankWeights.from_numpy`` wrapped in a rank, which owns them: ``close()`` frees both."""
        weights = RankWeights.from_numpy(dims, shard, word, tables, projs, gpu, stream)
        return cls._owning(weights, max_rows, gpu, stream, collective)

    @classmethod
    def from_pretrained(cls, model_dir: str, gpu: GpuBackend, rank: int, size: int, *, max_rows: int = 8192,
                        stream: int = 0, collective: Collective | None = None,
                        **layer_args: Any) -> "TensorParallelNgramEmbedding":
        """Rank ``rank`` of ``size`` from a Hugging Face model folder (``NgramEmbedding.from_pretrained``'s
        folders and ``layer_args``: placement, eos_id, table_dir, cache_rows): only its word rows
        and tables are read and uploaded (a ``DeviceBudget`` counts only those). Owns them:
        ``close()`` frees both. Refusals come before any upload."""
        from ..ngram_embed.checkpoint import NgramCheckpoint
        from ..ngram_embed.fused import check_servable
        from ..ngram_embed.pretrained import load_weights

        dims = NgramCheckpoint.open(model_dir, eos_id=layer_args.get("eos_id"), parts="dense").dims
        check_servable(dims, max_rows)
        shard = NgramShard.of(dims, rank, size)
        if collective is not None:
            check_collective(collective, shard)
        weights = load_weights(model_dir, gpu, stream=stream, max_tokens=max_rows, part=lambda _: shard,
                               build=lambda d, word, tables, projs: RankWeights(d, shard, word, tables, projs, gpu),
                               **layer_args)
        return cls._owning(weights, max_rows, gpu, stream, collective)

    @classmethod
    def _owning(cls, weights: RankWeights, max_rows: int, gpu: GpuBackend, stream: int,
                collective: Collective | None) -> "TensorParallelNgramEmbedding":
        """A rank over ``weights`` that closes them with itself (they are closed if it cannot be built)."""
        try:
            rank = cls(weights, max_rows, gpu, stream, collective=collective)
        except BaseException:
            weights.close()
            raise
        rank._owned_layer = weights  # type: ignore[assignment]
        return rank

    def _gather_row_bytes(self) -> int:
        return (self.dims.hidden_size + self.dims.num_tables() * self.dims.table_dim()) * 2

    def reduce_count(self, rows: int) -> int:
        """bf16 elements the all-reduce sums for a call of ``rows`` rows: ``[rows, D + T*td]``."""
        return rows * self._gather_row_bytes() // 2

    # -- one process per GPU: the fused path's calls, with the all-reduce in ``_launch`` --------
    def embed(self, *args: Any, **kwargs: Any) -> None:
        self.require_collective()
        super().embed(*args, **kwargs)

    def embed_batch(self, *args: Any, **kwargs: Any) -> None:
        self.require_collective()
        super().embed_batch(*args, **kwargs)

    def require_collective(self) -> None:
        if self.collective is None:
            raise ValueError(f"{_WHAT}: this rank has no collective (built for embed_all); pass "
                             f"collective= to serve embed and embed_batch")
        validate.require_open(self.collective.closed, f"{_WHAT}: its collective")

    def _launch(self, rows: int, out: int, stream: int, over: bool = False) -> None:  # no adapter_slots here
        self._gather_rows(rows, stream)
        self.reduce_and_project(rows, out, stream)

    def reduce_and_project(self, rows: int, out: int, stream: int) -> None:
        """A gathered call's all-reduce through this rank's collective, then its GEMM (the
        decoder's second half too)."""
        self.collective.allreduce_bf16(int(self.gather_buf), self.reduce_count(rows), stream)
        self._project(rows, out, stream)

    # -- one process driving every GPU: the phases ``embed_all`` runs --------------------------
    def stage(self, contexts: Sequence[Any], seq_lens: Sequence[int], stream: int = 0) -> int:
        """Upload a batch and gather this rank's rows (zeros for the others') into the buffer the
        group sums; returns its rows. Refuses a bad batch before any upload."""
        require_open(_WHAT, self, self.layer)
        windows = self.windows(contexts, seq_lens)
        rows = windows.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"{_WHAT}: {rows} rows over max_rows {self.max_rows}")
        if rows:
            self.gpu.event_synchronize(self._done)  # the previous call is done with the buffers
            with self._rows.batch():
                self.gpu.copy_h2d_async(self.pack(windows), self.staging, stream)
                self._gather_rows(rows, stream)
        return rows

    def project(self, rows: int, out: int, stream: int = 0) -> None:
        """The GEMM over the summed buffer into ``out [rows, D]``: the last phase."""
        require_open(_WHAT, self, self.layer)
        rows = validate.count(rows, f"{_WHAT} rows", limit=self.max_rows + 1)
        if rows:
            require_out(out, _WHAT)
            self._project(rows, out, stream)
            self.gpu.record_event(self._done, stream)

    # -- launches ------------------------------------------------------------------------------
    def _gather_rows(self, rows: int, stream: int) -> None:
        """Word rows into ``[rows, D]`` at the buffer's start, the T gathered rows after them."""
        dims, h = self.dims, self.dims.hidden_size
        words = self.staging.offset(rows * dims.max_ngram * 4)
        slots = self.staging.offset(rows * (dims.max_ngram + 1) * 4) if self.cached else 0
        embed_ops.batched_embed_shard(self.gpu, self.shard_k, words, self.word_rows.weight, self.gather_buf,
                                      rows, h, self.shard.word_lo, self.shard.word_rows, stream)
        fused_ops.ngram_gather(self.gpu, self.gather_k, self.staging, self.desc, self.pows, slots,
                               self.gather_buf.offset(rows * h * 2), 0, rows, dims.num_tables(),
                               dims.max_ngram, dims.splits, dims.table_dim(), dims.eos_id, stream)

    def _project(self, rows: int, out: int, stream: int) -> None:
        h, k = self.dims.hidden_size, self.dims.num_tables() * self.dims.table_dim()
        gemm_ops.dense_gemm_bf16_word(self.gpu, self.gemm_k, self.gather_buf.offset(rows * h * 2),
                                      self.projs_weight, out, rows, h, k, self.row_ids, self.gather_buf,
                                      self.inv_scale, stream)


def check_collective(collective: Any, shard: NgramShard) -> None:
    """``collective`` is an open ``Collective`` of the shard's rank and size."""
    if not isinstance(collective, Collective):
        raise TypeError(f"{_WHAT}: collective must be a Collective (allreduce_bf16, rank, size), "
                        f"got {type(collective).__name__}")
    validate.require_open(collective.closed, f"{_WHAT}: its collective")
    if (collective.rank, collective.size) != (shard.rank, shard.size):
        raise ValueError(f"{_WHAT}: the collective is rank {collective.rank} of {collective.size}, "
                         f"the weights rank {shard.rank} of {shard.size}")


def embed_all(group: CollectiveGroup, ranks: Sequence[TensorParallelNgramEmbedding],
              contexts: Sequence[Any], seq_lens: Sequence[int], outs: Sequence[int],
              streams: Sequence[int]) -> int:
    """One process driving every rank: rank r embeds the batch into ``outs[r]`` on its
    ``streams[r]`` (every rank's output is the same). Each rank stages its rows, the group sums
    the buffers, each rank projects. Returns the rows. Everything is checked before any upload."""
    if not isinstance(group, CollectiveGroup):
        raise TypeError(f"embed_all: group must be a CollectiveGroup, got {type(group).__name__}")
    validate.require_open(group.closed, "embed_all: the group")
    if not (len(ranks) == len(outs) == len(streams) == group.size):
        raise ValueError(f"embed_all: {len(ranks)} ranks, {len(outs)} outs and {len(streams)} streams "
                         f"for a group of {group.size}")
    for r, rank in enumerate(ranks):
        if not isinstance(rank, TensorParallelNgramEmbedding):
            raise TypeError(f"embed_all: ranks[{r}] is a {type(rank).__name__}")
        if (rank.shard.rank, rank.shard.size) != (r, group.size):
            raise ValueError(f"embed_all: ranks[{r}] is rank {rank.shard.rank} of {rank.shard.size}")
        if rank.dims != ranks[0].dims:
            raise ValueError(f"embed_all: ranks[{r}] has other dims than rank 0")
        require_open(_WHAT, rank, rank.layer)
        require_out(outs[r], _WHAT)
    ranks[0].windows(contexts, seq_lens)  # every rank's own check then passes: same dims, same batch
    rows = [rank.stage(contexts, seq_lens, s) for rank, s in zip(ranks, streams)]
    if rows[0]:
        group.allreduce_bf16_all([(int(rank.gather_buf), rank.reduce_count(rows[0]), s)
                                  for rank, s in zip(ranks, streams)])
        for rank, out, s in zip(ranks, outs, streams):
            rank.project(rows[0], out, s)
    return rows[0]
