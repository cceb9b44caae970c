"""``TensorParallelNgramDecoder``: the device-resident ``NgramDecoder`` over one rank of a
tensor-parallel group, for one process per GPU.

A call is the decoder's gather (hash, every table's row with zeros for the absent tables, history
update, the new tokens' word ids written on the device) into the rank's buffer after its word
block; the shard gather of the word rows for those ids; the all-reduce; and the fused GEMM over
the summed buffer. All of it is device work on device pointers, so an engine captures the whole
step, all-reduce included, in its CUDA graph. Bad device values are flagged as in
``NgramDecoder``; their rows come out as zeros on every rank (each rank runs the same gather on
the same tokens). A process driving every GPU would post the all-reduces in one group call,
which this class does not: serve that mode with ``embed_all``.
"""

from __future__ import annotations

from typing import Any

from gpu_runtime import GpuBackend

from ..ngram_embed.decoder import NgramDecoder
from ..ops import embed as embed_ops
from .collective import Collective
from .layer import RankWeights, TensorParallelNgramEmbedding, check_collective
from .shard import NgramShard


class TensorParallelNgramDecoder(NgramDecoder):
    """``NgramDecoder(weights, ...)`` on rank ``weights.shard.rank``, all-reducing through
    ``collective`` (its end of the communicator; required)."""

    def __init__(self, weights: RankWeights, *, collective: Collective, max_seqs: int, max_rows: int,
                 gpu: GpuBackend, stream: int = 0, max_draft: int = 0) -> None:
        if not isinstance(weights, RankWeights):
            raise TypeError(f"TensorParallelNgramDecoder: expected RankWeights, got {type(weights).__name__}")
        check_collective(collective, weights.shard)
        self._collective = collective
        super().__init__(weights, max_seqs=max_seqs, max_rows=max_rows, gpu=gpu, stream=stream,  # type: ignore[arg-type]
                         max_draft=max_draft)

    @classmethod
    def from_pretrained(cls, model_dir: str, gpu: GpuBackend, rank: int, size: int, *,  # type: ignore[override]
                        collective: Collective, max_seqs: int, max_rows: int = 8192, stream: int = 0,
                        max_draft: int = 0, **layer_args: Any) -> "TensorParallelNgramDecoder":
        """Rank ``rank`` of ``size`` of a model folder (``TensorParallelNgramEmbedding.from_pretrained``'s
        loading), wrapped in a decoder that owns the weights. Refusals come before any upload."""
        from ..ngram_embed.checkpoint import NgramCheckpoint
        from ..ngram_embed.decoder import NO_ROW_CACHE, check_sizes
        from ..ngram_embed.fused import check_servable
        from ..ngram_embed.pretrained import load_weights

        check_sizes(max_seqs, max_rows, max_draft)
        dims = NgramCheckpoint.open(model_dir, eos_id=layer_args.get("eos_id"), parts="dense").dims
        check_servable(dims, max_rows)
        shard = NgramShard.of(dims, rank, size)
        check_collective(collective, shard)
        weights = load_weights(model_dir, gpu, stream=stream, max_tokens=max_rows, part=lambda _: shard,
                               refuse_files=NO_ROW_CACHE,
                               build=lambda d, word, tables, projs: RankWeights(d, shard, word, tables, projs, gpu),
                               **layer_args)
        try:
            dec = cls(weights, collective=collective, max_seqs=max_seqs, max_rows=max_rows, gpu=gpu,
                      stream=stream, max_draft=max_draft)
        except BaseException:
            weights.close()
            raise
        dec._owned_layer = weights  # type: ignore[assignment]
        return dec

    def _make_fused(self, layer: Any, max_rows: int, gpu: GpuBackend, stream: int) -> TensorParallelNgramEmbedding:
        return TensorParallelNgramEmbedding(layer, max_rows, gpu, stream, collective=self._collective)

    def _open(self) -> None:
        super()._open()
        self.fused.require_collective()

    def _gathered_rows(self, rows: int) -> int:
        return self.fused.gather_buf.offset(rows * self.dims.hidden_size * 2)

    def _finish(self, rows: int, out: int, stream: int, word_over: int) -> None:  # no adapter_slots here
        fused, shard = self.fused, self.fused.shard
        embed_ops.batched_embed_shard(self.gpu, fused.shard_k, self.word_ids, fused.word_rows.weight,
                                      fused.gather_buf, rows, self.dims.hidden_size, shard.word_lo,
                                      shard.word_rows, stream)
        fused.reduce_and_project(rows, out, stream)
