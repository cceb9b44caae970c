"""``RowProjection``: the second half of both fused runners (``FusedNgramEmbedding``,
``NgramDecoder``), after their gather kernels.

A call's gather writes its rows' T table rows ``[R, T*td]`` bf16 (td: the table width) into
``rows_at(R)``; ``finish`` multiplies them by the concatenated projections ``[D, T*td]`` in fp32,
adds each row's word row (or its adapter's, ``word_over``) in the epilogue, scales by 1/(1+T) and
rounds once into ``out [R, D]``. On a tensor-parallel rank (``weights.shard``) the buffer is ``[R, D + T*td]``:
``finish`` first gathers the rank's word rows (zeros for the others') in front of the table rows,
sums the buffer over the group through ``collective`` (exact: one contributor per element), then
projects; every rank's output is the single-GPU one, bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu_runtime import DevicePtr, PreparedLaunch, validate

from ..kernel_files import load_kernel
from ..ops import gemm as gemm_ops
from ..ops.embed import ShardGather
from ..resources import Resources
from ..tensor_parallel import check_collective as check_shard_collective
from .tables import HostTable
from .weights import NgramWeights


def gemm_path(batch_invariant: bool) -> str | None:
    """The word GEMM's path: the GEMM's paths sum a row in different orders, so which one m picks
    can move a row's rounding; the small path, forced for every m, sums each row the same way
    whatever else is in the batch (slower for large m: bench.decode's batch-invariant rows)."""
    return "small" if validate.boolean(batch_invariant, "batch_invariant") else None


def check_collective(what: str, collective: Any, weights: NgramWeights) -> None:
    """``collective`` (None: no all-reduce of its own) suits ``weights``: an open ``Collective``
    of the shard's rank and size, and only for a shard's weights."""
    check_shard_collective(what, collective, weights.shard, "NgramWeights.from_pretrained(..., shard=(rank, size))")


class RowProjection:
    """The gather buffer for ``max_rows`` rows of the T table rows and the GEMM that projects them,
    adds the word row and rounds once into ``out``; its buffers are ``own``'s, released with the
    runner. ``path``: the GEMM path (``gemm_path``)."""

    def __init__(
        self,
        weights: NgramWeights,
        max_rows: int,
        own: Resources,
        stream: int,
        *,
        collective: Any = None,
        path: str | None = None,
    ) -> None:
        dims, gpu = weights.dims, weights.gpu
        self.weights, self.dims, self.gpu = weights, dims, gpu
        self.shard, self.collective = weights.shard, collective
        self.path = path
        self.cols = dims.num_tables() * dims.table_dim()  # the GEMM's inner dimension, T*td
        self.inv_scale = float(np.float32(1.0) / np.float32(1 + dims.num_tables()))
        self.word_cols = dims.hidden_size if self.shard is not None else 0
        self.gemm_kernel = load_kernel(gpu, "gemm", gemm_ops.WORD_KERNEL)
        self.projs = weights.concat_projections(stream)
        self.desc, self.pows = weights.table_descriptors(stream)
        self.host_tables = any(isinstance(t, HostTable) for t in weights.tables)  # the gathers' shape
        self.buf = own.alloc(max_rows * (self.word_cols + self.cols) * 2)
        self.row_ids: DevicePtr | None = None
        self._gemms: dict[tuple[int, int, int, int], PreparedLaunch] = {}  # (rows, word_ids, out, word_over)
        if self.shard is not None:
            shard, kernel = self.shard, load_kernel(gpu, "embed_from_argmax", "batched_embed_shard")
            word = weights.word.weight
            self._shard = ShardGather(gpu, kernel, word, self.buf, dims.hidden_size, shard.word_lo, shard.word_rows)
            self.row_ids = own.upload(np.arange(max_rows, dtype=np.uint32), stream)
            gpu.synchronize(stream)  # read by a first call on any stream (a created one does not wait)

    def rows_at(self, rows: int) -> DevicePtr:
        """Where a call of ``rows`` rows gathers its table rows (after the word rows on a rank)."""
        return self.buf.offset(rows * self.word_cols * 2) if self.word_cols else self.buf

    def reduce_count(self, rows: int) -> int:
        """bf16 elements a rank's all-reduce sums for a call of ``rows`` rows: ``[rows, D + T*td]``."""
        return rows * (self.word_cols + self.cols)

    def gather_words(self, rows: int, word_ids: int, stream: int) -> None:
        """A rank's word rows for ``word_ids`` into the buffer's front (zeros for the others')."""
        self._shard.run(word_ids, rows, stream)

    def finish(self, rows: int, word_ids: int, out: int, stream: int, word_over: int = 0) -> None:
        """After the gather: (a rank) its word rows and the all-reduce, then ``project``."""
        if self.shard is not None:
            self.gather_words(rows, word_ids, stream)
            self.collective.allreduce_bf16(int(self.buf), self.reduce_count(rows), stream)
        self.project(rows, word_ids, out, stream, word_over)

    def project(self, rows: int, word_ids: int, out: int, stream: int, word_over: int = 0) -> None:
        """The GEMM with the word-row epilogue into ``out [rows, D]`` (a rank: over the summed
        buffer, whose row i holds row i's word row), planned once per (rows, word ids, out,
        word_over) and kept."""
        key = (rows, int(word_ids), int(out), int(word_over))
        gemm = self._gemms.get(key)
        if gemm is None:
            if len(self._gemms) >= 256:
                self._gemms.clear()
            gemm = self._gemms[key] = self._plan(rows, word_ids, out, word_over)
        gemm.run(stream)

    def _plan(self, rows: int, word_ids: int, out: int, word_over: int) -> PreparedLaunch:
        if self.row_ids is None:  # the word rows are the word table's, at the rows' word ids
            a, ids, word = self.buf, word_ids, self.weights.word.weight
        else:  # a rank: row i's word row is row i of the summed buffer's front
            a, ids, word = self.rows_at(rows), self.row_ids, self.buf
        # Programmatic dependent launch only behind the gather: a rank's GEMM follows the all-reduce.
        gemm = gemm_ops.plan_word_gemm(
            self.gpu,
            self.gemm_kernel,
            a,
            self.projs,
            out,
            rows,
            self.dims.hidden_size,
            self.cols,
            ids,
            word,
            self.inv_scale,
            overlap=self.shard is None,
            path=self.path,
            word_over=word_over,
        )
        assert gemm is not None  # rows >= 1, D >= 1, T*td >= 1
        return gemm
