"""The weights' cases: ``NgramWeights(...)`` (and ``own``), ``NgramWeights.from_numpy`` and
``from_safetensors``, ``NgramCheckpoint``'s arrays; ``from_pretrained``, which reads model
folders, is with the loaders."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpu_runtime import ClosedError
from layers.ngram_embed import NgramCheckpoint, NgramEmbedding, NgramShard, NgramTable, NgramWeights
from layers.dense_weight import BF16, FP8, DenseWeight
from tests.bad_inputs.matrix import GPU_TYPE, case, expect
from tests.bad_inputs.world import World
from tests.helpers.ngram import small_dims

SHARD_PAIR = r"shard must be an NgramShard or a \(rank, size\) pair"


def _new(w: World, **changes) -> NgramWeights:
    """``NgramWeights`` over the world's device weights (owning nothing), ``changes`` replacing
    any of dims, word, tables, projs, gpu and shard."""
    ww = w.weights
    args = dict(dims=w.dims, word=ww.word, tables=ww.tables, projs=ww.projs, gpu=w.gpu, shard=None) | changes
    return NgramWeights(args["dims"], args["word"], args["tables"], args["projs"], args["gpu"], shard=args["shard"])


def _rank0_word(w: World) -> DenseWeight:
    """Rank 0 of 2's word rows (the first 250 of the world's word table, in place)."""
    return DenseWeight(w.weights.word.weight, (NgramShard.of(w.dims, 0, 2).word_rows, w.dims.hidden_size), BF16)


def _rank0_tables(w: World) -> list:
    """Rank 0 of 2's tables: its two, and the other rank's two absent."""
    td = w.dims.table_dim()
    return [t if c < 2 else NgramTable.Absent(w.dims.table_rows(c), td) for c, t in enumerate(w.weights.tables)]


def _from_numpy(w: World, **changes) -> NgramWeights:
    """``NgramWeights.from_numpy`` of the world's host weights, ``changes`` replacing any of
    dims, word, tables, projs and gpu or adding keywords (stream, placement, shard)."""
    h = w.host_layer
    args = dict(dims=w.dims, word=h.word, tables=w.numpy_tables, projs=h.projs, gpu=w.gpu) | changes
    positional = [args.pop(k) for k in ("dims", "word", "tables", "projs", "gpu")]
    return NgramWeights.from_numpy(*positional, **args)


def _from_file(w: World, **changes) -> NgramWeights:
    """``NgramWeights.from_safetensors`` of the world's file (prefix "ngram."), ``changes``
    replacing any of path, dims and gpu or adding keywords."""
    args = dict(path=w.st_path, dims=w.dims, gpu=w.gpu, prefix="ngram.") | changes
    positional = [args.pop(k) for k in ("path", "dims", "gpu")]
    return NgramWeights.from_safetensors(*positional, **args)



def _checkpoint(w: World, **options) -> NgramCheckpoint:
    """``NgramCheckpoint.open`` of a fresh tiny model folder (T = 4 tables)."""
    return NgramCheckpoint.open(w.model().path, **options)


CPU_CASES = [
    # -- NgramWeights(...) (what NgramEmbedding(...) checked of the weights) and own --
    case("NgramWeights", "dtype", lambda w: _new(
        w, tables=[NgramTable.Bf16(DenseWeight(w.p[0], t.shape, FP8)) for t in w.weights.tables]),
         TypeError, "NgramTable.Bf16 holds float8"),
    case("NgramWeights", "dtype", lambda w: _new(w, word=w.host_layer.word), TypeError,
         "word: expected a DenseWeight", detail="host-array"),
    case("NgramWeights", "dtype", lambda w: _new(w, tables=[t.weight for t in w.weights.tables]), TypeError,
         "table 0: expected NgramTable.Bf16/Fp8/Host/Cached/Absent, got DenseWeight", detail="table-kind"),
    case("NgramWeights", "dtype", lambda w: _new(w, dims=(500, 40, 3, 2, 61)), TypeError,
         "NgramWeights: dims must be NgramDims, got tuple", detail="dims"),
    case("NgramWeights", "dtype", lambda w: _new(w, gpu="cpu"), TypeError,
         "NgramWeights: " + GPU_TYPE + " str 'cpu'", detail="gpu"),
    case("NgramWeights", "dtype", lambda w: _new(w, gpu=0), TypeError,
         "NgramWeights: " + GPU_TYPE + " int 0", detail="gpu-int"),
    case("NgramWeights", "dtype", lambda w: _new(w, shard="0/2"), TypeError, SHARD_PAIR + ", got str",
         detail="shard"),
    case("NgramWeights", "dtype", lambda w: _new(w, shard=(0.0, 2)), TypeError,
         "tensor-parallel rank must be an int", detail="shard-rank"),
    case("NgramWeights", "shape", lambda w: _new(w, word=DenseWeight(w.p[0], (501, 40), BF16)),
         ValueError, "word embedding must be"),
    case("NgramWeights", "shape", lambda w: _new(w, projs=[DenseWeight(w.p[0], (10, 40), BF16)] * 4),
         ValueError, r"proj 0 must be \(40, 10\) bfloat16", detail="proj"),
    case("NgramWeights", "shape", lambda w: _new(w, shard=(0, 1, 2)), TypeError, SHARD_PAIR, detail="shard"),
    case("NgramWeights", "shape", lambda w: _new(w, shard=(0, 2)), ValueError,
         r"word embedding must be \(250, 40\) bfloat16, got \(500, 40\)", detail="shard-word"),
    case("NgramWeights", "length", lambda w: _new(w, tables=w.weights.tables[:-1]), ValueError, "table count"),
    case("NgramWeights", "length", lambda w: _new(w, projs=w.weights.projs[:-1]), ValueError,
         "proj count: 3 projections, dims need 4", detail="proj"),
    case("NgramWeights", "range", lambda w: _new(w, shard=(2, 2)), ValueError,
         "tensor-parallel rank 2 out of range for size 2", detail="shard"),
    case("NgramWeights", "range", lambda w: _new(w, shard=(0, 5)), ValueError,
         "tensor-parallel size 5 over the 4 tables", detail="shard-size"),
    case("NgramWeights", "range", lambda w: _new(w, shard=NgramShard.of(small_dims(vocab_size=400), 0, 2)),
         ValueError, r"is not NgramShard.of\(dims, 0, 2\)", detail="shard-dims"),
    case("NgramWeights", "range", lambda w: _new(w, word=_rank0_word(w), shard=(0, 2)), ValueError,
         r"table 2 must not be held by rank 0 \(its tables: \[0, 1\]\)", detail="shard-tables"),
    case("NgramWeights", "range", lambda w: _new(w, word=_rank0_word(w), shard=(0, 2), tables=[
        NgramTable.Absent(w.dims.table_rows(0), w.dims.table_dim()), *_rank0_tables(w)[1:]]),
         ValueError, "table 0 must be held by rank 0", detail="shard-absent"),
    case("NgramWeights", "null", lambda w: _new(
        w, tables=[NgramTable.Fp8(DenseWeight(w.p[0], t.shape, FP8)) for t in w.weights.tables]),
         ValueError, "without row scales"),
    case("NgramWeights", "null", lambda w: _new(w, gpu=None), TypeError,
         "NgramWeights: " + GPU_TYPE + " None", detail="gpu"),
    case("NgramWeights", "null", lambda w: _new(w, tables=[
        NgramTable.Absent(w.dims.table_rows(0), w.dims.table_dim()), *w.weights.tables[1:]]),
         ValueError, "table 0", detail="absent-table"),
    case("NgramWeights", "closed", lambda w: w.closed_weights.own(w.weights.word), ClosedError,
         "NgramWeights is closed"),
    case("NgramWeights", "id", lambda w: _new(
        w, tables=[NgramTable.Bf16(DenseWeight(w.p[0], (t.shape[0] - 1, t.shape[1]), BF16))
                   for t in w.weights.tables]), ValueError, "table 0: shape"),
    case("NgramWeights", "empty", lambda w: _new(w, tables=[], projs=[]), ValueError,
         "table count: 0 tables, dims need 4"),
    # -- NgramWeights.from_numpy (what NgramEmbedding.from_numpy checked) and from_safetensors --
    case("NgramWeights.from_numpy", "dtype", lambda w: _from_numpy(w, word=w.host_layer.word.astype(np.float32)),
         TypeError, "weight dtype"),
    case("NgramWeights.from_numpy", "dtype", lambda w: _from_numpy(w, gpu="cpu"), TypeError,
         "NgramWeights.from_numpy: " + GPU_TYPE + " str 'cpu'", detail="gpu"),
    case("NgramWeights.from_numpy", "dtype", lambda w: _from_numpy(w, gpu=0), TypeError,
         "NgramWeights.from_numpy: " + GPU_TYPE + " int 0", detail="gpu-int"),
    case("NgramWeights.from_numpy", "dtype", lambda w: _from_numpy(w, placement=5), TypeError,
         "placement must be 'device' or 'host' or a sequence of them, got int", detail="placement"),
    case("NgramWeights.from_numpy", "dtype", lambda w: _from_numpy(w, placement=["device", "host", 3, "device"]),
         TypeError, r"placement\[2\] must be 'device' or 'host', got int", detail="placement-entry"),
    case("NgramWeights.from_numpy", "dtype", lambda w: _from_numpy(w, shard=[0, 2]), TypeError,
         SHARD_PAIR + ", got list", detail="shard"),
    case("NgramWeights.from_numpy", "dtype", lambda w: _from_numpy(w, dims=(500, 40, 3, 2, 61)),
         TypeError, "dims must be NgramDims", detail="dims"),
    case("NgramWeights.from_numpy", "dtype", lambda w: _from_file(w, gpu="cpu"), TypeError,
         GPU_TYPE + " str 'cpu'", detail="safetensors-gpu"),
    case("NgramWeights.from_numpy", "shape", lambda w: _from_numpy(w, projs=[p[0] for p in w.host_layer.projs]),
         ValueError, "non-empty 2-D", temp=True),
    case("NgramWeights.from_numpy", "shape", lambda w: _from_numpy(w, shard=(0, 1, 2)), TypeError, SHARD_PAIR,
         detail="shard"),
    case("NgramWeights.from_numpy", "length", lambda w: _from_numpy(w, projs=w.host_layer.projs[:-1]),
         ValueError, "proj count", temp=True),
    case("NgramWeights.from_numpy", "length", lambda w: _from_numpy(w, tables=w.numpy_tables[:-1]),
         ValueError, "table count: 3 tables, dims need 4", detail="tables"),
    case("NgramWeights.from_numpy", "length", lambda w: _from_numpy(w, placement=["device"] * 3), ValueError,
         "3 entries for 4 tables", detail="placement"),
    case("NgramWeights.from_numpy", "length", lambda w: _from_file(w, placement=["host"] * 5), ValueError,
         "5 entries for 4 tables", detail="safetensors-placement"),
    case("NgramWeights.from_numpy", "range", lambda w: _from_numpy(w, placement="gpu"), ValueError,
         "placement must be 'device' or 'host'", detail="placement"),
    case("NgramWeights.from_numpy", "range", lambda w: _from_numpy(w, placement="files"), ValueError,
         "placement must be 'device' or 'host'", detail="placement-files"),
    case("NgramWeights.from_numpy", "range", lambda w: _from_numpy(w, shard=(2, 2)), ValueError,
         "rank 2 out of range for size 2", detail="shard"),
    case("NgramWeights.from_numpy", "range", lambda w: _from_numpy(w, shard=(0, 5)), ValueError,
         "size 5 over the 4 tables", detail="shard-size"),
    case("NgramWeights.from_numpy", "range", lambda w: _from_file(w, shard=(-1, 2)), ValueError,
         "tensor-parallel rank must be a non-negative int", detail="safetensors-shard"),
    case("NgramWeights.from_numpy", "null", lambda w: _from_numpy(w, gpu=None), TypeError,
         "NgramWeights.from_numpy: " + GPU_TYPE + " None", detail="gpu"),
    case("NgramWeights.from_numpy", "null", lambda w: _from_numpy(w, tables=[None, *w.numpy_tables[1:]]),
         ValueError, "table 0: None, but this weights object holds it", detail="table", temp=True),
    case("NgramWeights.from_numpy", "null", lambda w: _from_file(w, prefix="model."), KeyError,
         r"no tensor .*model\.tables\.0\.weight", detail="safetensors-tensor"),
    case("NgramWeights.from_numpy", "null", lambda w: _from_file(w, path=w.tmp / "none.safetensors"),
         FileNotFoundError, "none.safetensors", detail="safetensors-file"),
    case("NgramWeights.from_numpy", "null", lambda w: _from_file(w, gpu=None), TypeError,
         GPU_TYPE + " None", detail="safetensors-gpu"),
    case("NgramWeights.from_numpy", "id", lambda w: _from_numpy(w, tables=[w.numpy_tables[0][1:], *w.numpy_tables[1:]]),
         ValueError, r"table 0: shape \(61, 10\), dims say \(62, 10\)", temp=True),
    case("NgramWeights.from_numpy", "empty", lambda w: _from_numpy(w, word=w.host_layer.word[:0]), ValueError,
         r"non-empty 2-D array, got shape \(0, 40\)"),
    case("NgramWeights.from_numpy", "empty", lambda w: _from_file(w, path=w.empty_path), ValueError,
         "file is 0 bytes", detail="safetensors"),
    # -- NgramCheckpoint's arrays: a model folder's weights as numpy arrays (from_pretrained: cases.loaders) --
    case("NgramCheckpoint", "dtype", lambda w: _checkpoint(w).proj_array("a"), TypeError,
         "NgramCheckpoint.proj_array: c must be an int, got str 'a'"),
    case("NgramCheckpoint", "dtype", lambda w: _checkpoint(w).table_arrays(True), TypeError,
         "NgramCheckpoint.table_arrays: c must be an int, got bool True", detail="bool"),
    case("NgramCheckpoint", "range", lambda w: _checkpoint(w).table_arrays(99), ValueError,
         r"NgramCheckpoint.table_arrays: c = 99 outside 0\.\.3"),
    case("NgramCheckpoint", "range", lambda w: _checkpoint(w).table_arrays(-1), ValueError,
         r"NgramCheckpoint.table_arrays: c = -1 outside 0\.\.3", detail="negative"),
    case("NgramCheckpoint", "range", lambda w: _checkpoint(w, parts="tables").proj_array(0), ValueError,
         "NgramCheckpoint.proj_array: opened with parts='tables', without the projections", detail="parts"),
    case("NgramCheckpoint", "null", lambda w: _checkpoint(w).proj_array(None), TypeError,
         "NgramCheckpoint.proj_array: c must be an int, got NoneType None"),
]


def _weight_bytes(w: World, weight: DenseWeight) -> bytes:
    return w.gpu.read(weight.weight, weight.nbytes).tobytes()


def _after_weights(w: World) -> None:
    """Weights over the world's buffers serve a layer and, closed, free nothing (they own
    nothing); rank 0's share of them is accepted too."""
    mem, ww = set(w.gpu.mem), w.weights
    weights = _new(w)
    expect(weights.shard is None and weights.tables == ww.tables and not weights.closed)
    before = len(w.gpu.launches)
    with NgramEmbedding(weights, 4) as layer:
        layer.embed(w.rng.integers(0, 500, 5), 3, w.out, w.gpu)
    expect(len(w.gpu.launches) - before == 2 + 3 * w.dims.num_tables())
    rank0 = _new(w, word=_rank0_word(w), tables=_rank0_tables(w), shard=(0, 2))
    expect(rank0.shard == NgramShard.of(w.dims, 0, 2))
    for each in (weights, rank0):
        each.close()
    expect(weights.closed and not ww.closed and set(w.gpu.mem) == mem)


def _after_from_numpy(w: World) -> None:
    """The file and the arrays (two tables in host memory) upload the host weights' bytes; closing
    frees every upload."""
    mem, h = set(w.gpu.mem), w.host_layer
    with _from_file(w) as a, _from_numpy(w, placement=["device", "host", "device", "host"]) as b:
        for weights in (a, b):
            expect(_weight_bytes(w, weights.word) == h.word.tobytes())
            for proj, want in zip(weights.projs, h.projs):
                expect(_weight_bytes(w, proj) == want.tobytes())
        for table, (want, _) in zip(a.tables, h.tables):
            expect(_weight_bytes(w, table.weight) == want.tobytes())
        expect([type(t).__name__ for t in b.tables] == ["Bf16Table", "HostTable", "Bf16Table", "HostTable"])
    expect(set(w.gpu.mem) == mem)


def _after_checkpoint(w: World) -> None:
    """Every table and projection of a fresh model folder, as the folder holds them."""
    model = w.model()
    ckpt = NgramCheckpoint.open(model.path)
    for c, (table, scale) in enumerate(model.tables):
        got, got_scale = ckpt.table_arrays(c)
        expect(got.tobytes() == table.tobytes() and (got_scale is None) == (scale is None))
        expect(ckpt.proj_array(c).tobytes() == model.projs[c].tobytes())


AFTER: dict[str, Callable[[World], None]] = {
    "NgramWeights": _after_weights,
    "NgramWeights.from_numpy": _after_from_numpy,
    "NgramCheckpoint": _after_checkpoint,
}
