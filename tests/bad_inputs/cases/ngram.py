"""The n-gram layers' cases: ``NgramDims``, ``ngram_ids``, ``NgramEmbedding`` (construction and
``embed``), ``FusedNgramEmbedding`` and ``NgramDecoder``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpu_runtime import ClosedError, DeviceArray
from layers.ngram_embed import NgramDims, NgramEmbedding, NgramTable, ngram_ids, ngram_ids_tail
from layers.ngram_embed.decoder import NgramDecoder
from layers.ngram_embed.fused import FusedNgramEmbedding
from layers.weight_map import BF16, FP8, DenseWeight
from tests.bad_inputs.matrix import NULL, case, expect
from tests.bad_inputs.world import World
from tests.fakes import ForeignArray
from tests.helpers.logging_backend import LoggingBackend

CPU_CASES = [
    # -- NgramDims --
    case("NgramDims", "dtype", lambda w: NgramDims(1.5, 40, 3, 2, 61), TypeError,
         "vocab_size V must be an int"),
    case("NgramDims", "shape", lambda w: NgramDims(500, 3, 3, 2, 61), ValueError, "too small"),
    case("NgramDims", "length", lambda w: NgramDims(500, 40, 3, 0, 61), ValueError,
         "splits K must be an int >= 1"),
    case("NgramDims", "range", lambda w: NgramDims(500, 40, 3, 2, 61, row_bias=2), ValueError, "row_bias"),
    case("NgramDims", "range", lambda w: w.dims.table_index(4, 0), IndexError, "order n=4", detail="table_index"),
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
    case("ngram_ids", "empty", lambda w: expect(all(a.shape == (0,) for a in ngram_ids(w.dims, [])))),
    # -- NgramEmbedding(...) and from_numpy --
    case("NgramEmbedding", "dtype", lambda w: NgramEmbedding(
        w.dims, w.layer.word, [NgramTable.Bf16(DenseWeight(w.p[0], t.shape, FP8)) for t in w.layer.tables],
        w.layer.projs, 8, w.gpu), TypeError, "NgramTable.Bf16 holds float8"),
    case("NgramEmbedding", "dtype", lambda w: NgramEmbedding.from_numpy(
        w.dims, w.host_layer.word.astype(np.float32), [t for t, _ in w.host_layer.tables],
        w.host_layer.projs, 8, w.gpu), TypeError, "weight dtype", detail="from_numpy"),
    case("NgramEmbedding", "dtype", lambda w: NgramEmbedding(
        w.dims, w.host_layer.word, w.layer.tables, w.layer.projs, 8, w.gpu).embed([1, 2, 3], 2, w.out, w.gpu),
        TypeError, "DenseWeight", detail="host-array"),
    case("NgramEmbedding", "shape", lambda w: NgramEmbedding(
        w.dims, DenseWeight(w.p[0], (501, 40), BF16), w.layer.tables, w.layer.projs, 8, w.gpu),
        ValueError, "word embedding must be"),
    case("NgramEmbedding", "shape", lambda w: NgramEmbedding.from_numpy(
        w.dims, w.host_layer.word, [t if s is None else (t, s) for t, s in w.host_layer.tables],
        [p[0] for p in w.host_layer.projs], 8, w.gpu), ValueError, "non-empty 2-D",
        detail="from_numpy", temp=True),
    case("NgramEmbedding", "length", lambda w: NgramEmbedding(
        w.dims, w.layer.word, w.layer.tables[:-1], w.layer.projs, 8, w.gpu), ValueError, "table count"),
    case("NgramEmbedding", "length", lambda w: NgramEmbedding.from_numpy(
        w.dims, w.host_layer.word, [t if s is None else (t, s) for t, s in w.host_layer.tables],
        w.host_layer.projs[:-1], 8, w.gpu), ValueError, "proj count", detail="from_numpy", temp=True),
    case("NgramEmbedding", "range", lambda w: NgramEmbedding(
        w.dims, w.layer.word, w.layer.tables, w.layer.projs, 0, w.gpu), ValueError, "max_tokens"),
    case("NgramEmbedding", "null", lambda w: NgramEmbedding(
        w.dims, w.layer.word, [NgramTable.Fp8(DenseWeight(w.p[0], t.shape, FP8)) for t in w.layer.tables],
        w.layer.projs, 8, w.gpu), ValueError, "without row scales"),
    case("NgramEmbedding", "id", lambda w: NgramEmbedding(
        w.dims, w.layer.word, [NgramTable.Bf16(DenseWeight(w.p[0], (t.shape[0] - 1, t.shape[1]), BF16))
                               for t in w.layer.tables], w.layer.projs, 8, w.gpu),
        ValueError, "table 0: shape"),
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
         ValueError, "not the backend this layer was built with", detail="backend"),
    case("NgramEmbedding.embed", "null", lambda w: w.layer.embed([1, 2, 3], 2, 0, w.gpu), ValueError, NULL),
    case("NgramEmbedding.embed", "closed", lambda w: w.closed_layer.embed([1, 2, 3], 2, w.out, w.gpu),
         ClosedError, "NgramEmbedding is closed"),
    case("NgramEmbedding.embed", "closed", lambda w: w.layer_with_closed_cache.embed([1, 2, 3], 2, w.out, w.gpu),
         ClosedError, "RowCache is closed", detail="cached-table", needs=("layer_with_closed_cache",)),
    case("NgramEmbedding.embed", "id", lambda w: w.layer.embed([1, 2, 500], 1, w.out, w.gpu),
         ValueError, "token 500"),
    case("NgramEmbedding.embed", "empty", lambda w: w.layer.embed([1, 2, 3], 0, w.out, w.gpu)),
    # -- NgramDecoder: construction, then the capturable calls (device values are the kernels') --
    case("NgramDecoder", "dtype", lambda w: NgramDecoder(w.layer, max_seqs=2.0, max_rows=8, gpu=w.gpu),
         TypeError, "max_seqs must be an int"),
    case("NgramDecoder", "range", lambda w: NgramDecoder(w.layer, max_seqs=4, max_rows=0, gpu=w.gpu),
         ValueError, r"max_rows must be in 1\.\.2\*\*31-1"),
    case("NgramDecoder", "range",
         lambda w: NgramDecoder(w.layer, max_seqs=4, max_rows=8, gpu=LoggingBackend()),
         ValueError, "not the backend this layer was built with", detail="backend"),
    case("NgramDecoder", "closed", lambda w: NgramDecoder(w.closed_layer, max_seqs=4, max_rows=8, gpu=w.gpu),
         ClosedError, r"the layer it serves \(NgramEmbedding\) is closed"),
    case("NgramDecoder", "range", lambda w: NgramDecoder(w.cached_fused.layer, max_seqs=4, max_rows=8,
                                                        gpu=w.gpu),
         ValueError, "RowCache tables need host work", detail="cached", needs=("cached_fused",)),
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
    case("NgramDecoder.calls", "empty", lambda w: w.decoder.step(w.p[0], w.p[1], 0, w.out)),
    case("NgramDecoder.calls", "empty", lambda w: w.decoder.rollback(w.p[0], w.p[1], 0), detail="rollback"),
    case("NgramDecoder.calls", "empty", lambda w: w.decoder.seed(w.p[0], w.p[1], w.p[2], 0, 0), detail="seed"),
    case("NgramDecoder.calls", "empty", lambda w: w.decoder.fork(w.p[0], w.p[1], 0), detail="fork"),
    # -- FusedNgramEmbedding --
    case("FusedNgramEmbedding", "dtype", lambda w: FusedNgramEmbedding(w.layer, 2.0, w.gpu), TypeError,
         "max_rows must be an int"),
    case("FusedNgramEmbedding", "range", lambda w: FusedNgramEmbedding(w.layer, 0, w.gpu), ValueError,
         "max_rows must be an int >= 1"),
    case("FusedNgramEmbedding", "range", lambda w: FusedNgramEmbedding(w.layer, 8, LoggingBackend()),
         ValueError, "not the backend this layer was built with", detail="backend"),
    case("FusedNgramEmbedding", "closed", lambda w: FusedNgramEmbedding(w.closed_layer, 8, w.gpu), ClosedError,
         r"the layer it serves \(NgramEmbedding\) is closed"),
    case("FusedNgramEmbedding", "range", lambda w: FusedNgramEmbedding(w.layer_huge_vocab, 8, w.gpu), ValueError,
         r"vocab_size 4294967296 must be < 2\*\*32 - 1", detail="vocab", needs=("layer_huge_vocab",)),
    case("FusedNgramEmbedding.embed", "dtype", lambda w: w.fused.embed([1.5, 2.5], 1, w.out, w.gpu),
         TypeError, "tokens must be integers"),
    case("FusedNgramEmbedding.embed", "dtype", lambda w: w.fused.embed([1, 2, 3], 1.0, w.out, w.gpu),
         TypeError, r"seq_lens\[0\] must be an int", detail="seq_len"),
    case("FusedNgramEmbedding.embed", "shape", lambda w: w.fused.embed([[1, 2]], 1, w.out, w.gpu),
         ValueError, "1-D"),
    case("FusedNgramEmbedding.embed", "length", lambda w: w.fused.embed_batch([[1, 2]], [1, 1], w.out, w.gpu),
         ValueError, "1 contexts, 2 seq_lens"),
    case("FusedNgramEmbedding.embed", "length", lambda w: w.fused.embed(list(range(20)), 9, w.out, w.gpu),
         ValueError, "over max_rows 8", detail="max_rows"),
    case("FusedNgramEmbedding.embed", "length",
         lambda w: w.cached_fused.embed(np.arange(1, 7), 6, w.out, w.gpu), ValueError, "arena holds 3",
         detail="cached-capacity", needs=("cached_fused",),
         after=lambda w: w.cached_fused.embed(np.arange(20, 23), 3, w.out, w.gpu)),
    case("FusedNgramEmbedding.embed", "range", lambda w: w.fused.embed([1, 2, 3], -1, w.out, w.gpu),
         ValueError, "non-negative"),
    case("FusedNgramEmbedding.embed", "null", lambda w: w.fused.embed([1, 2, 3], 1, 0, w.gpu), ValueError, NULL),
    case("FusedNgramEmbedding.embed", "null", lambda w: w.fused.embed([1, 2, 3], 1, w.out, w.gpu, 0, graph=True),
         ValueError, "created stream", detail="stream"),
    case("FusedNgramEmbedding.embed", "closed", lambda w: w.closed_fused.embed([1, 2, 3], 1, w.out, w.gpu),
         ClosedError, "FusedNgramEmbedding is closed"),
    case("FusedNgramEmbedding.embed", "closed",
         lambda w: w.fused_over_closed_layer.embed([1, 2, 3], 2, w.out, w.gpu), ClosedError,
         r"the layer it serves \(NgramEmbedding\) is closed", detail="layer-closed",
         needs=("fused_over_closed_layer",)),
    case("FusedNgramEmbedding.embed", "id", lambda w: w.fused.embed([1, 2, 500], 1, w.out, w.gpu),
         ValueError, "token 500 outside"),
    case("FusedNgramEmbedding.embed", "empty", lambda w: w.fused.embed_batch([[1, 2], []], [0, 0], w.out, w.gpu)),
]


def _after_ngram_ids(w: World) -> None:
    tokens = w.rng.integers(0, w.dims.vocab_size, 9)
    full, tail = ngram_ids(w.dims, tokens), ngram_ids_tail(w.dims, tokens, 4)
    assert len(full) == w.dims.num_tables()
    for f, t in zip(full, tail):
        np.testing.assert_array_equal(f[-4:], t)


def _after_layer_embed(w: World) -> None:
    before = len(w.gpu.launches)
    w.layer.embed(w.rng.integers(0, 500, 6), 3, w.out, w.gpu)
    assert len(w.gpu.launches) - before == 2 + 3 * w.dims.num_tables()


def _after_fused_embed(w: World) -> None:
    before = len(w.gpu.launches)
    w.fused.embed_batch([w.rng.integers(0, 500, 6), [4]], [3, 1], w.out, w.gpu)
    assert w.gpu.launched()[before:] == ["ngram_gather", "dense_gemm_bf16_word"]


def _after_decoder(w: World) -> None:
    before = len(w.gpu.launches)
    w.decoder.step(w.p[0], w.p[1], 2, w.out, k=2)
    w.decoder.seed(w.p[0], w.p[1], w.p[2], 2, 5)
    w.decoder.fork(w.p[1], w.p[2], 2)
    w.decoder.rollback(w.p[1], w.p[2], 2)
    assert w.gpu.launched()[before:] == ["ngram_decode_gather", "dense_gemm_bf16_word", "ngram_decode_seed",
                                         "ngram_decode_fork", "ngram_decode_rollback"]


AFTER: dict[str, Callable[[World], None]] = {
    "NgramDims": lambda w: expect(NgramDims(500, 40, 3, 2, 61, row_bias=1) == w.dims),
    "ngram_ids": _after_ngram_ids,
    "NgramEmbedding": lambda w: NgramEmbedding(w.dims, w.layer.word, w.layer.tables, w.layer.projs, 8,
                                               w.gpu).close(),
    "NgramEmbedding.embed": _after_layer_embed,
    "FusedNgramEmbedding": lambda w: FusedNgramEmbedding(w.layer, 8, w.gpu).close(),
    "FusedNgramEmbedding.embed": _after_fused_embed,
    "NgramDecoder": lambda w: NgramDecoder(w.layer, max_seqs=2, max_rows=4, gpu=w.gpu).close(),
    "NgramDecoder.calls": _after_decoder,
}
