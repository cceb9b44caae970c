"""The n-gram runners' cases: ``NgramDims``, ``ngram_ids``, the n-gram references
(``layers.reference``; its overlay references are with the overlays), then the three runners over
``NgramWeights`` (``cases.weights``), each constructed and called: ``NgramEmbedding``,
``FusedNgramEmbedding`` (a tensor-parallel rank's too), ``NgramDecoder``; and ``embed_all``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpu_runtime import ClosedError, DeviceArray
from layers import reference
from layers.ngram_embed import (FusedNgramEmbedding, NgramDecoder, NgramDims, NgramEmbedding, embed_all, ngram_ids,
                                ngram_ids_tail)
from tests.bad_inputs.matrix import GPU_TYPE, NULL, case, expect
from tests.bad_inputs.world import FakeCollective, World
from tests.helpers.fakes import ForeignArray
from tests.helpers.logging_backend import LoggingBackend


def _reference(w: World, ctx=(1, 2, 3), seq_len: int = 2, **changes) -> np.ndarray:
    """``reference.ngram_embed`` of the world's host layer, ``changes`` replacing word, tables or projs."""
    layer = {"word": w.host_layer.word, "tables": w.host_layer.tables, "projs": w.host_layer.projs} | changes
    return reference.ngram_embed(w.dims, layer["word"], layer["tables"], layer["projs"], ctx, seq_len)


CPU_CASES = [
    # -- NgramDims --
    case("NgramDims", "dtype", lambda w: NgramDims(1.5, 40, 3, 2, 61), TypeError,
         "vocab_size V must be an int"),
    case("NgramDims", "shape", lambda w: NgramDims(500, 3, 3, 2, 61), ValueError, "too small"),
    case("NgramDims", "length", lambda w: NgramDims(500, 40, 3, 0, 61), ValueError,
         "splits K must be an int >= 1"),
    case("NgramDims", "range", lambda w: NgramDims(500, 40, 3, 2, 61, row_bias=2), ValueError, "row_bias"),
    case("NgramDims", "range", lambda w: w.dims.table_index(4, 0), IndexError, "order n=4", detail="table_index"),
    case("NgramDims", "range", lambda w: NgramDims.longcat_flash(-1, 40, 3, 2, 0.5, None), ValueError,
         "vocab_size V must be an int >= 1, got -1", detail="longcat_flash"),
    case("NgramDims", "id", lambda w: NgramDims(500, 40, 3, 2, 61, eos_id=500), ValueError, "eos_id must be in"),
    case("NgramDims", "empty", lambda w: NgramDims(0, 40, 3, 2, 61), ValueError,
         "vocab_size V must be an int >= 1"),
    # -- ngram_ids / ngram_ids_tail --
    case("ngram_ids", "dtype", lambda w: ngram_ids(w.dims, np.array([1.0, 2.0])), TypeError,
         "tokens must be integers"),
    case("ngram_ids", "dtype", lambda w: ngram_ids_tail(w.dims, [1, 2, 3], 1.0), TypeError,
         "seq_len must be an int", detail="seq_len"),
    case("ngram_ids", "shape", lambda w: ngram_ids(w.dims, np.ones((2, 2), np.int64)), ValueError, "1-D"),
    case("ngram_ids", "length", lambda w: ngram_ids_tail(w.dims, [1, 2, 3], 4), ValueError,
         "seq_len 4 exceeds the context's 3 tokens"),
    case("ngram_ids", "range", lambda w: ngram_ids(w.dims, [1, -1, 3]), ValueError, "token -1 at position 1"),
    case("ngram_ids", "id", lambda w: ngram_ids_tail(w.dims, [1, 2, 500], 1), ValueError,
         "token 500 at position 2"),
    case("ngram_ids", "null", lambda w: ngram_ids(w.dims, None), TypeError,
         "ngram ids: tokens must be a 1-D sequence of token ids, got NoneType"),
    case("ngram_ids", "empty", lambda w: expect(all(a.shape == (0,) for a in ngram_ids(w.dims, [])))),
    # -- layers.reference: the numpy references check as the runners do (the overlay ones: cases.overlays) --
    case("layers.reference", "dtype", lambda w: _reference(w, ctx=[1.5, 2.0, 3.0]), TypeError,
         "ngram_embed: tokens must be integers"),
    case("layers.reference", "dtype", lambda w: _reference(w, word=w.host_layer.word.astype(np.float32)), TypeError,
         "ngram_embed: word must be bfloat16, got dtype float32", detail="word"),
    case("layers.reference", "shape", lambda w: _reference(w, projs=[p.T for p in w.host_layer.projs]), ValueError,
         r"ngram_embed: projs\[0\] must be \[40, 10\], got shape \[10, 40\]"),
    case("layers.reference", "length", lambda w: _reference(w, projs=w.host_layer.projs[:2]), ValueError,
         "ngram_embed: projs: 2 projections"),
    case("layers.reference", "range", lambda w: _reference(w, seq_len=4), ValueError,
         "ngram_embed: seq_len 4 exceeds the context's 3 tokens"),
    case("layers.reference", "null", lambda w: _reference(w, word=None), TypeError,
         "ngram_embed: word must be a numpy array, got NoneType"),
    case("layers.reference", "id", lambda w: _reference(w, ctx=[1, 2, 500]), ValueError,
         "ngram_embed: token 500 at position 2 outside"),
    case("layers.reference", "empty", lambda w: expect(_reference(w, seq_len=0).shape == (0, 40))),
    # -- NgramEmbedding(...): the seed's runner over NgramWeights --
    case("NgramEmbedding", "dtype", lambda w: NgramEmbedding(w.bare_weights, 2.0), TypeError,
         "max_tokens must be an int"),
    case("NgramEmbedding", "dtype", lambda w: NgramEmbedding(w.fused, 8), TypeError,
         "NgramEmbedding: weights must be NgramWeights, got FusedNgramEmbedding", detail="weights"),
    case("NgramEmbedding", "dtype", lambda w: NgramEmbedding(w.dims, 8), TypeError,
         "NgramEmbedding: weights must be NgramWeights, got NgramDims", detail="old-signature"),
    case("NgramEmbedding", "range", lambda w: NgramEmbedding(w.bare_weights, 0), ValueError, "max_tokens"),
    case("NgramEmbedding", "range", lambda w: NgramEmbedding(w.shard_weights[0], 8), ValueError,
         "NgramEmbedding: the weights are a tensor-parallel rank's share", detail="shard", needs=("shard_weights",)),
    case("NgramEmbedding", "null", lambda w: NgramEmbedding(None, 8), TypeError,
         "NgramEmbedding: weights must be NgramWeights, got NoneType", detail="weights"),
    case("NgramEmbedding", "closed", lambda w: NgramEmbedding(w.closed_weights, 8), ClosedError,
         "NgramEmbedding: its NgramWeights is closed"),
    # -- NgramEmbedding.embed --
    case("NgramEmbedding.embed", "dtype", lambda w: w.layer.embed([1.5, 2, 3], 1, w.out, w.gpu),
         TypeError, "tokens must be integers"),
    case("NgramEmbedding.embed", "dtype", lambda w: w.layer.embed([1, 2, 3], 1.0, w.out, w.gpu),
         TypeError, "seq_len must be an int", detail="seq_len"),
    case("NgramEmbedding.embed", "shape", lambda w: w.layer.embed([[1, 2, 3]], 1, w.out, w.gpu),
         ValueError, "1-D"),
    case("NgramEmbedding.embed", "length", lambda w: w.layer.embed(list(range(20)), 9, w.out, w.gpu),
         ValueError, "over staging"),
    case("NgramEmbedding.embed", "length", lambda w: w.layer.embed([1, 2, 3], 4, w.out, w.gpu),
         ValueError, "exceeds the context's 3 tokens", detail="context"),
    case("NgramEmbedding.embed", "length", lambda w: w.cached_layer.embed(np.arange(1, 7), 6, w.out, w.gpu),
         ValueError, "arena holds 3", detail="cached-capacity", needs=("cached_layer",)),
    case("NgramEmbedding.embed", "range", lambda w: w.layer.embed([1, 2, 3], -1, w.out, w.gpu),
         ValueError, "non-negative"),
    case("NgramEmbedding.embed", "range", lambda w: w.layer.embed([1, 2, 3], 2, w.out, LoggingBackend()),
         ValueError, "ngram embed: gpu is not the backend of the weights", detail="backend"),
    case("NgramEmbedding.embed", "null", lambda w: w.layer.embed([1, 2, 3], 2, w.out, None),
         TypeError, "ngram embed: " + GPU_TYPE + " None", detail="backend"),
    case("NgramEmbedding.embed", "null", lambda w: w.layer.embed([1, 2, 3], 2, 0, w.gpu), ValueError, NULL),
    case("NgramEmbedding.embed", "null", lambda w: w.layer.embed(None, 1, w.out, w.gpu), TypeError,
         "ngram embed: ctx_tokens must be a 1-D sequence of token ids, got NoneType", detail="tokens"),
    case("NgramEmbedding.embed", "closed", lambda w: w.closed_layer.embed([1, 2, 3], 2, w.out, w.gpu),
         ClosedError, "ngram embed: NgramEmbedding is closed"),
    case("NgramEmbedding.embed", "closed", lambda w: w.layer_on_closed.embed([1, 2, 3], 2, w.out, w.gpu),
         ClosedError, "ngram embed: its NgramWeights is closed", detail="weights-closed"),
    case("NgramEmbedding.embed", "closed", lambda w: w.layer_with_closed_cache.embed([1, 2, 3], 2, w.out, w.gpu),
         ClosedError, "RowCache is closed", detail="cached-table", needs=("layer_with_closed_cache",)),
    case("NgramEmbedding.embed", "id", lambda w: w.layer.embed([1, 2, 500], 1, w.out, w.gpu),
         ValueError, "token 500"),
    case("NgramEmbedding.embed", "empty", lambda w: w.layer.embed([1, 2, 3], 0, w.out, w.gpu)),
    # -- NgramDecoder: construction, then the capturable calls (device values are the kernels') --
    case("NgramDecoder", "dtype", lambda w: NgramDecoder(w.bare_weights, max_seqs=2.0, max_rows=8),
         TypeError, "max_seqs must be an int"),
    case("NgramDecoder", "dtype", lambda w: NgramDecoder(w.fused, max_seqs=4, max_rows=8), TypeError,
         "NgramDecoder: weights must be NgramWeights, got FusedNgramEmbedding", detail="weights"),
    case("NgramDecoder", "dtype", lambda w: NgramDecoder(w.bare_weights, max_seqs=4, max_rows=8,
                                                        adapter_slots=w.kernels),
         TypeError, "NgramDecoder: adapter_slots must be an OverlaySlots, got OverlayKernels", detail="adapter_slots"),
    case("NgramDecoder", "dtype", lambda w: NgramDecoder(w.bare_weights, max_seqs=4, max_rows=8, batch_invariant=1),
         TypeError, "batch_invariant must be a bool, got 1", detail="batch_invariant"),
    case("NgramDecoder", "dtype", lambda w: NgramDecoder(w.shard_weights[1], max_seqs=4, max_rows=8,
                                                        collective=w.weights),
         TypeError, "NgramDecoder: collective must be a layers.tensor_parallel.Collective", detail="collective",
         needs=("shard_weights",)),
    case("NgramDecoder", "range", lambda w: NgramDecoder(w.bare_weights, max_seqs=4, max_rows=0),
         ValueError, r"max_rows must be in 1\.\.2\*\*31-1"),
    case("NgramDecoder", "range", lambda w: NgramDecoder(w.bare_weights, max_seqs=4, max_rows=8, max_draft=-1),
         ValueError, r"max_draft must be in 0\.\.2\*\*31-1, got -1", detail="max_draft"),
    case("NgramDecoder", "range", lambda w: NgramDecoder(w.cached_fused.weights, max_seqs=4, max_rows=8),
         ValueError, "RowCache tables need host work", detail="cached", needs=("cached_fused",)),
    case("NgramDecoder", "range", lambda w: NgramDecoder(w.bare_weights, max_seqs=4, max_rows=8,
                                                        collective=FakeCollective(0, 1)),
         ValueError, "NgramDecoder: collective given, but the weights are not a tensor-parallel shard",
         detail="collective"),
    case("NgramDecoder", "range", lambda w: NgramDecoder(w.shard_weights[1], max_seqs=4, max_rows=8),
         ValueError, "NgramDecoder: the weights are a tensor-parallel shard; pass collective=",
         detail="shard-without-collective", needs=("shard_weights",)),
    case("NgramDecoder", "range", lambda w: NgramDecoder(w.shard_weights[1], max_seqs=4, max_rows=8,
                                                        collective=FakeCollective(0, 2)),
         ValueError, "the collective is rank 0 of 2, the weights rank 1 of 2", detail="collective-rank",
         needs=("shard_weights",)),
    case("NgramDecoder", "shape", lambda w: NgramDecoder(w.bare_weights, max_seqs=4, max_rows=8, adapter_slots=w.slots),
         ValueError, "adapter_slots hold vocab 30 x 5, the model's word table is 500 x 40", detail="adapter_slots"),
    case("NgramDecoder", "range", lambda w: NgramDecoder(w.bare_weights, max_seqs=4, max_rows=8,
                                                        adapter_slots=w.foreign_slots),
         ValueError, "adapter_slots live on another backend than the weights", detail="adapter-backend",
         needs=("foreign_slots",)),
    case("NgramDecoder", "null", lambda w: NgramDecoder(None, max_seqs=4, max_rows=8), TypeError,
         "weights must be NgramWeights, got NoneType", detail="weights"),
    case("NgramDecoder", "closed", lambda w: NgramDecoder(w.closed_weights, max_seqs=4, max_rows=8),
         ClosedError, "NgramDecoder: its NgramWeights is closed"),
    case("NgramDecoder", "closed", lambda w: NgramDecoder(w.bare_weights, max_seqs=4, max_rows=8,
                                                         adapter_slots=w.closed_slots),
         ClosedError, "NgramDecoder: its adapter_slots is closed", detail="adapter_slots"),
    case("NgramDecoder", "closed", lambda w: NgramDecoder(w.shard_weights[1], max_seqs=4, max_rows=8,
                                                         collective=w.closed_collective),
         ClosedError, "NgramDecoder: its collective is closed", detail="collective",
         needs=("shard_weights", "closed_collective")),
    case("NgramDecoder.calls", "dtype", lambda w: w.decoder.step(w.p[0], 1.5, 2, w.out), TypeError,
         "slots: expected a device address"),
    case("NgramDecoder.calls", "dtype", lambda w: w.decoder.step(DeviceArray(w.gpu, w.p[0], (8,), np.int64),
                                                                 w.p[1], 2, w.out),
         TypeError, "dtype int64, expected uint32 or int32", detail="device-array"),
    case("NgramDecoder.calls", "dtype", lambda w: w.decoder.step(w.p[0], w.p[1], 2, ForeignArray(w.out, (2, 40),
                                                                                                 "<f2")),
         TypeError, "out: dtype float16, expected bfloat16", detail="foreign-out"),
    case("NgramDecoder.calls", "dtype", lambda w: w.decoder.fork(object(), w.p[1], 2), TypeError,
         "src_slots: expected a device address", detail="fork"),
    case("NgramDecoder.calls", "shape", lambda w: w.decoder.step(ForeignArray(w.p[0], (4,), "<u4", strides=(8,)),
                                                                 w.p[1], 2, w.out),
         ValueError, "not C-contiguous", detail="strided"),
    case("NgramDecoder.calls", "shape", lambda w: w.decoder.step(w.p[0], w.p[1], 2, ForeignArray(w.out, (2, 41),
                                                                                                 "<V2")),
         ValueError, "rows of 41 values, expected 40", detail="out-cols"),
    case("NgramDecoder.calls", "length", lambda w: w.decoder.step(DeviceArray(w.gpu, w.p[0], (3,), np.uint32),
                                                                  w.p[1], 2, w.out, k=2),
         ValueError, "3 entries, the call needs 4"),
    case("NgramDecoder.calls", "range", lambda w: w.decoder.step(w.p[0], w.p[1], 5, w.out), ValueError,
         "over max_seqs 4"),
    case("NgramDecoder.calls", "range", lambda w: w.decoder.prefill(w.p[0], w.p[1], w.p[2], 2, 9, w.out),
         ValueError, "9 rows over max_rows 8", detail="rows"),
    case("NgramDecoder.calls", "length", lambda w: w.decoder.seed(ForeignArray(w.p[0], (5,), "<i4"), w.p[1],
                                                                  w.p[2], 2, 6),
         ValueError, "tokens: 5 entries, the call needs 6", detail="seed"),
    case("NgramDecoder.calls", "range", lambda w: w.decoder.reset(4), ValueError,
         r"slot must be in 0\.\.3, got 4", detail="reset"),
    case("NgramDecoder.calls", "range", lambda w: w.decoder.seed(w.p[0], w.p[1], w.p[2], 5, 6), ValueError,
         "over max_seqs 4", detail="seed"),
    case("NgramDecoder.calls", "range", lambda w: w.decoder.step(w.p[0], w.p[1], 2, w.out, adapters=w.p[2]),
         ValueError, "built without adapter_slots", detail="adapters"),
    case("NgramDecoder.calls", "range", lambda w: w.decoder.step(w.p[0], w.p[1], 2, ForeignArray(w.out, (2, 40),
                                                                                                 "<V2", True)),
         ValueError, "out: a read-only array", detail="read-only-out"),
    case("NgramDecoder.calls", "null", lambda w: w.decoder.prefill(w.p[0], 0, w.p[2], 2, 5, w.out), ValueError,
         NULL),
    case("NgramDecoder.calls", "null", lambda w: w.decoder.rollback(w.p[0], 0, 2), ValueError, NULL,
         detail="rollback"),
    case("NgramDecoder.calls", "null", lambda w: w.decoder.seed(w.p[0], w.p[1], 0, 2, 5), ValueError, NULL,
         detail="seed"),
    case("NgramDecoder.calls", "null", lambda w: w.decoder.fork(w.p[0], 0, 2), ValueError, NULL,
         detail="fork"),
    case("NgramDecoder.calls", "null", lambda w: w.decoder.step(w.p[0], w.p[1], 2, ForeignArray(0, (2, 40), "<V2")),
         ValueError, NULL, detail="foreign-out"),
    case("NgramDecoder.calls", "closed", lambda w: w.closed_decoder.step(w.p[0], w.p[1], 1, w.out),
         ClosedError, "NgramDecoder is closed"),
    case("NgramDecoder.calls", "closed", lambda w: w.decoder_on_closed.step(w.p[0], w.p[1], 1, w.out),
         ClosedError, "NgramDecoder: its NgramWeights is closed", detail="weights-closed"),
    case("NgramDecoder.calls", "closed", lambda w: w.decoder_on_closed.reset(0), ClosedError,
         "NgramDecoder: its NgramWeights is closed", detail="weights-closed-reset"),
    case("NgramDecoder.calls", "empty", lambda w: w.decoder.step(w.p[0], w.p[1], 0, w.out)),
    case("NgramDecoder.calls", "empty", lambda w: w.decoder.rollback(w.p[0], w.p[1], 0), detail="rollback"),
    case("NgramDecoder.calls", "empty", lambda w: w.decoder.seed(w.p[0], w.p[1], w.p[2], 0, 0), detail="seed"),
    case("NgramDecoder.calls", "empty", lambda w: w.decoder.fork(w.p[0], w.p[1], 0), detail="fork"),
    # -- FusedNgramEmbedding: construction over NgramWeights, then embed / embed_batch (no gpu argument) --
    case("FusedNgramEmbedding", "dtype", lambda w: FusedNgramEmbedding(w.bare_weights, 2.0), TypeError,
         "max_rows must be an int"),
    case("FusedNgramEmbedding", "dtype", lambda w: FusedNgramEmbedding(w.layer, 8), TypeError,
         "FusedNgramEmbedding: weights must be NgramWeights, got NgramEmbedding", detail="weights"),
    case("FusedNgramEmbedding", "dtype", lambda w: FusedNgramEmbedding(w.bare_weights, 8, adapter_slots=w.kernels),
         TypeError, "FusedNgramEmbedding: adapter_slots must be an OverlaySlots", detail="adapter_slots"),
    case("FusedNgramEmbedding", "dtype", lambda w: FusedNgramEmbedding(w.bare_weights, 8, batch_invariant="yes"),
         TypeError, "batch_invariant must be a bool", detail="batch_invariant"),
    case("FusedNgramEmbedding", "dtype", lambda w: FusedNgramEmbedding(w.shard_weights[1], 8, collective=object()),
         TypeError, "FusedNgramEmbedding: collective must be a layers.tensor_parallel.Collective",
         detail="collective", needs=("shard_weights",)),
    case("FusedNgramEmbedding", "dtype", lambda w: FusedNgramEmbedding(w.bare_weights, 8, w.gpu, 0),
         TypeError, "positional argument", detail="old-signature"),
    case("FusedNgramEmbedding", "range", lambda w: FusedNgramEmbedding(w.bare_weights, 0), ValueError,
         "max_rows must be an int >= 1"),
    case("FusedNgramEmbedding", "range", lambda w: FusedNgramEmbedding(w.weights_huge_vocab, 8), ValueError,
         r"vocab_size 4294967296 must be < 2\*\*32 - 1", detail="vocab", needs=("weights_huge_vocab",)),
    case("FusedNgramEmbedding", "range", lambda w: FusedNgramEmbedding(w.bare_weights, 8,
                                                                      collective=FakeCollective(0, 1)),
         ValueError, "FusedNgramEmbedding: collective given, but the weights are not a tensor-parallel shard",
         detail="collective"),
    case("FusedNgramEmbedding", "range", lambda w: FusedNgramEmbedding(w.shard_weights[1], 8,
                                                                      collective=FakeCollective(1, 4)),
         ValueError, "the collective is rank 1 of 4, the weights rank 1 of 2", detail="collective-rank",
         needs=("shard_weights",)),
    case("FusedNgramEmbedding", "range", lambda w: FusedNgramEmbedding(w.bare_weights, 8,
                                                                      adapter_slots=w.foreign_slots),
         ValueError, "adapter_slots live on another backend than the weights", detail="adapter-backend",
         needs=("foreign_slots",)),
    case("FusedNgramEmbedding", "shape", lambda w: FusedNgramEmbedding(w.bare_weights, 8, adapter_slots=w.slots),
         ValueError, "adapter_slots hold vocab 30 x 5, the model's word table is 500 x 40", detail="adapter_slots"),
    case("FusedNgramEmbedding", "null", lambda w: FusedNgramEmbedding(None, 8), TypeError,
         "weights must be NgramWeights, got NoneType", detail="weights"),
    case("FusedNgramEmbedding", "closed", lambda w: FusedNgramEmbedding(w.closed_weights, 8), ClosedError,
         "FusedNgramEmbedding: its NgramWeights is closed"),
    case("FusedNgramEmbedding", "closed", lambda w: FusedNgramEmbedding(w.bare_weights, 8,
                                                                       adapter_slots=w.closed_slots),
         ClosedError, "FusedNgramEmbedding: its adapter_slots is closed", detail="adapter_slots"),
    case("FusedNgramEmbedding", "closed", lambda w: FusedNgramEmbedding(w.shard_weights[1], 8,
                                                                       collective=w.closed_collective),
         ClosedError, "FusedNgramEmbedding: its collective is closed", detail="collective",
         needs=("shard_weights", "closed_collective")),
    case("FusedNgramEmbedding.embed", "dtype", lambda w: w.fused.embed([1.5, 2.5], 1, w.out),
         TypeError, "tokens must be integers"),
    case("FusedNgramEmbedding.embed", "dtype", lambda w: w.fused.embed([1, 2, 3], 1.0, w.out),
         TypeError, r"seq_lens\[0\] must be an int", detail="seq_len"),
    case("FusedNgramEmbedding.embed", "dtype", lambda w: w.fused.embed([1, 2, 3], 1, w.out, w.gpu, 0),
         TypeError, "positional argument", detail="old-gpu-argument"),
    case("FusedNgramEmbedding.embed", "dtype", lambda w: w.fused_with_slots.embed_batch(
        [[1, 2]], [1], w.out, adapters=[0.5]), TypeError, r"adapters\[0\] must be an int", detail="adapters",
         needs=("fused_with_slots",)),
    case("FusedNgramEmbedding.embed", "dtype", lambda w: w.fused.embed([1, 2, 3], 1, w.out, 7, graph=True),
         TypeError, "graph=True needs a backend with CUDA graphs", detail="graph"),
    case("FusedNgramEmbedding.embed", "shape", lambda w: w.fused.embed([[1, 2]], 1, w.out),
         ValueError, "1-D"),
    case("FusedNgramEmbedding.embed", "length", lambda w: w.fused.embed_batch([[1, 2]], [1, 1], w.out),
         ValueError, "1 contexts, 2 seq_lens"),
    case("FusedNgramEmbedding.embed", "length", lambda w: w.fused.embed(list(range(20)), 9, w.out),
         ValueError, "over max_rows 8", detail="max_rows"),
    case("FusedNgramEmbedding.embed", "length",
         lambda w: w.cached_fused.embed(np.arange(1, 7), 6, w.out), ValueError, "arena holds 3",
         detail="cached-capacity", needs=("cached_fused",),
         after=lambda w: w.cached_fused.embed(np.arange(20, 23), 3, w.out)),
    case("FusedNgramEmbedding.embed", "length", lambda w: w.fused_with_slots.embed_batch(
        [[1, 2]], [1], w.out, adapters=[0, 1]), ValueError, "2 adapters for 1 sequences", detail="adapters",
         needs=("fused_with_slots",)),
    case("FusedNgramEmbedding.embed", "range", lambda w: w.fused.embed([1, 2, 3], -1, w.out),
         ValueError, "non-negative"),
    case("FusedNgramEmbedding.embed", "range", lambda w: w.fused.embed_batch([[1, 2]], [1], w.out, adapters=[0]),
         ValueError, "adapters given, but the runner was built without adapter_slots", detail="adapters"),
    case("FusedNgramEmbedding.embed", "range", lambda w: w.fused_with_slots.embed_batch(
        [[1, 2]], [1], w.out, adapters=[2]), ValueError, r"adapter slot 2 outside 0\.\.1", detail="adapter-slot",
         needs=("fused_with_slots",)),
    case("FusedNgramEmbedding.embed", "range", lambda w: w.ranks[1].embed([1, 2, 3], 1, w.out), ValueError,
         "a tensor-parallel rank without a collective", detail="rank-without-collective", needs=("ranks",)),
    case("FusedNgramEmbedding.embed", "null", lambda w: w.fused.embed([1, 2, 3], 1, 0), ValueError, NULL),
    case("FusedNgramEmbedding.embed", "null", lambda w: w.fused.embed(None, 1, w.out), TypeError,
         "fused ngram embed: context 0 must be a 1-D sequence of token ids, got NoneType", detail="tokens"),
    case("FusedNgramEmbedding.embed", "null", lambda w: w.fused.embed([1, 2, 3], 1, w.out, 0, graph=True),
         ValueError, "created stream", detail="stream"),
    case("FusedNgramEmbedding.embed", "closed", lambda w: w.closed_fused.embed([1, 2, 3], 1, w.out),
         ClosedError, "FusedNgramEmbedding is closed"),
    case("FusedNgramEmbedding.embed", "closed",
         lambda w: w.fused_on_closed.embed([1, 2, 3], 2, w.out), ClosedError,
         "fused ngram embed: its NgramWeights is closed", detail="weights-closed"),
    case("FusedNgramEmbedding.embed", "closed",
         lambda w: w.fused_on_closed.embed_batch([[1, 2, 3]], [2], w.out), ClosedError,
         "fused ngram embed: its NgramWeights is closed", detail="weights-closed-batch"),
    case("FusedNgramEmbedding.embed", "closed", lambda w: w.rank_fused_closed_collective.embed([1, 2, 3], 1, w.out),
         ClosedError, "fused ngram embed: its collective is closed", detail="collective",
         needs=("rank_fused_closed_collective",)),
    case("FusedNgramEmbedding.embed", "id", lambda w: w.fused.embed([1, 2, 500], 1, w.out),
         ValueError, "token 500 outside"),
    case("FusedNgramEmbedding.embed", "id", lambda w: w.rank_fused.embed([1, 2, 500], 1, w.out),
         ValueError, "token 500 outside", detail="rank", needs=("rank_fused",)),
    case("FusedNgramEmbedding.embed", "empty", lambda w: w.fused.embed_batch([[1, 2], []], [0, 0], w.out)),
    # -- embed_all: one process driving every rank of a group --
    case("embed_all", "dtype", lambda w: embed_all(object(), w.ranks, [[1, 2]], [1], [w.out, w.p[3]], [0, 0]),
         TypeError, "embed_all: group must be a CollectiveGroup, got object", needs=("ranks",)),
    case("embed_all", "dtype", lambda w: embed_all(w.group, [w.layer, w.ranks[1]], [[1, 2]], [1], [w.out, w.p[3]],
                                                   [0, 0]),
         TypeError, r"embed_all: ranks\[0\] is a NgramEmbedding, not a FusedNgramEmbedding", detail="ranks",
         needs=("ranks", "group")),
    case("embed_all", "dtype", lambda w: embed_all(w.group, w.ranks, [[1, 2.5]], [1], [w.out, w.p[3]], [0, 0]),
         TypeError, "tokens must be integers", detail="tokens", needs=("ranks", "group")),
    case("embed_all", "length", lambda w: embed_all(w.group, w.ranks[:1], [[1, 2]], [1], [w.out], [0]),
         ValueError, "embed_all: 1 ranks, 1 outs and 1 streams for a group of 2", needs=("ranks", "group")),
    case("embed_all", "length", lambda w: embed_all(w.group, w.ranks, [[1, 2]], [1, 1], [w.out, w.p[3]], [0, 0]),
         ValueError, "1 contexts, 2 seq_lens", detail="seq_lens", needs=("ranks", "group")),
    case("embed_all", "length", lambda w: embed_all(w.group, w.ranks, [list(range(20))], [9], [w.out, w.p[3]],
                                                    [0, 0]),
         ValueError, "embed_all: 9 rows over max_rows 8", detail="max_rows", needs=("ranks", "group")),
    case("embed_all", "range", lambda w: embed_all(w.group, w.ranks[::-1], [[1, 2]], [1], [w.out, w.p[3]], [0, 0]),
         ValueError, r"embed_all: ranks\[0\]'s weights are rank 1 of 2", needs=("ranks", "group")),
    case("embed_all", "range", lambda w: embed_all(w.group, [w.fused, w.fused], [[1, 2]], [1], [w.out, w.p[3]],
                                                   [0, 0]),
         ValueError, r"embed_all: ranks\[0\]'s weights are not a shard", detail="not-shard", needs=("group",)),
    case("embed_all", "range", lambda w: embed_all(w.group, w.ranks, [[1, 2]], [-1], [w.out, w.p[3]], [0, 0]),
         ValueError, "non-negative", detail="seq_len", needs=("ranks", "group")),
    case("embed_all", "null", lambda w: embed_all(w.group, w.ranks, [[1, 2]], [1], [w.out, 0], [0, 0]),
         ValueError, NULL, needs=("ranks", "group")),
    case("embed_all", "closed", lambda w: embed_all(w.closed_group, w.ranks, [[1, 2]], [1], [w.out, w.p[3]],
                                                    [0, 0]),
         ClosedError, "embed_all: the group is closed", needs=("ranks", "closed_group")),
    case("embed_all", "closed", lambda w: embed_all(w.group, [w.ranks[0], w.closed_rank], [[1, 2]], [1],
                                                    [w.out, w.p[3]], [0, 0]),
         ClosedError, r"embed_all: ranks\[1\] is closed", detail="rank", needs=("ranks", "group", "closed_rank")),
    case("embed_all", "closed", lambda w: embed_all(w.group, [w.ranks[0], w.rank_on_closed_weights], [[1, 2]], [1],
                                                    [w.out, w.p[3]], [0, 0]),
         ClosedError, r"embed_all: ranks\[1\]'s NgramWeights is closed", detail="weights-closed",
         needs=("ranks", "group", "rank_on_closed_weights")),
    case("embed_all", "id", lambda w: embed_all(w.group, w.ranks, [[1, 500]], [1], [w.out, w.p[3]], [0, 0]),
         ValueError, "token 500 outside", needs=("ranks", "group")),
    case("embed_all", "empty", lambda w: expect(embed_all(w.group, w.ranks, [[1, 2]], [0], [w.out, w.p[3]],
                                                          [0, 0]) == 0), needs=("ranks", "group")),
]


def _after_ngram_ids(w: World) -> None:
    tokens = w.rng.integers(0, w.dims.vocab_size, 9)
    full, tail = ngram_ids(w.dims, tokens), ngram_ids_tail(w.dims, tokens, 4)
    assert len(full) == w.dims.num_tables()
    for f, t in zip(full, tail):
        np.testing.assert_array_equal(f[-4:], t)


def _after_reference(w: World) -> None:
    """The seed's and the fused path's references are the exact value up to their bf16 roundings."""
    h, ctx = w.host_layer, w.rng.integers(0, 500, 6)
    ideal = reference.ngram_embed_ideal(w.dims, h.word, h.tables, h.projs, ctx, 3)
    for path in (reference.ngram_embed, reference.ngram_embed_fused):
        got = path(w.dims, h.word, h.tables, h.projs, ctx, 3).astype(np.float64)
        expect(got.shape == (3, 40) and np.linalg.norm(got - ideal) <= 2.0**-6 * np.linalg.norm(ideal))


def _after_layer_embed(w: World) -> None:
    before = len(w.gpu.launches)
    w.layer.embed(w.rng.integers(0, 500, 6), 3, w.out, w.gpu)
    assert len(w.gpu.launches) - before == 2 + 3 * w.dims.num_tables()


def _after_fused_embed(w: World) -> None:
    before = len(w.gpu.launches)
    w.fused.embed_batch([w.rng.integers(0, 500, 6), [4]], [3, 1], w.out)
    assert w.gpu.launched()[before:] == ["ngram_gather", "dense_gemm_bf16_word"]


def _after_embed_all(w: World) -> None:
    """Every rank stages (its gather and word rows), the group sums once, every rank projects."""
    before, reduces = len(w.gpu.launches), len(w.group.calls)
    rows = embed_all(w.group, w.ranks, [w.rng.integers(0, 500, 6), [4]], [3, 1], [w.out, w.p[3]], [0, 0])
    assert rows == 4 and len(w.group.calls) == reduces + 1
    assert [count for _, count, _ in w.group.calls[-1]] == [r.projection.reduce_count(4) for r in w.ranks]
    stage = ["ngram_gather", "batched_embed_shard"]
    assert w.gpu.launched()[before:] == stage * 2 + ["dense_gemm_bf16_word"] * 2


def _after_fused(w: World) -> None:
    """A runner over the world's weights, and rank 1's with its collective, built and closed."""
    FusedNgramEmbedding(w.bare_weights, 8).close()
    FusedNgramEmbedding(w.shard_weights[1], 8, collective=FakeCollective(1, 2)).close()


def _after_decoder_new(w: World) -> None:
    NgramDecoder(w.bare_weights, max_seqs=2, max_rows=4).close()
    NgramDecoder(w.shard_weights[1], max_seqs=2, max_rows=4, collective=FakeCollective(1, 2)).close()


def _after_decoder(w: World) -> None:
    before = len(w.gpu.launches)
    w.decoder.step(w.p[0], w.p[1], 2, w.out, k=2)
    w.decoder.seed(w.p[0], w.p[1], w.p[2], 2, 5)
    w.decoder.fork(w.p[1], w.p[2], 2)
    w.decoder.rollback(w.p[1], w.p[2], 2)
    assert w.gpu.launched()[before:] == ["ngram_decode_gather", "dense_gemm_bf16_word", "token_history_seed",
                                         "token_history_fork", "token_history_rollback"]


AFTER: dict[str, Callable[[World], None]] = {
    "NgramDims": lambda w: expect(NgramDims(500, 40, 3, 2, 61, row_bias=1) == w.dims),
    "ngram_ids": _after_ngram_ids,
    "layers.reference": _after_reference,
    "NgramEmbedding": lambda w: NgramEmbedding(w.bare_weights, 8).close(),
    "NgramEmbedding.embed": _after_layer_embed,
    "FusedNgramEmbedding": _after_fused,
    "FusedNgramEmbedding.embed": _after_fused_embed,
    "NgramDecoder": _after_decoder_new,
    "NgramDecoder.calls": _after_decoder,
    "embed_all": _after_embed_all,
}
