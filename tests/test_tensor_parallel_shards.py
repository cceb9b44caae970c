"""Tensor parallelism: the shards (``NgramShard``) and a shard's weights (``NgramWeights(shard=)``).

CPU: the shard arithmetic; the all-reduce's size; absent tables; a shard's weights (what they must
hold, what ``from_numpy`` and ``from_pretrained`` upload: only the rank's word rows and tables),
every bad shard refused before any upload, and a rank's runner waiting for its row ids. The
runners over these weights: test_tensor_parallel_runners.py; the collectives:
test_tensor_parallel_collectives.py."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_runtime import DevicePtr
from layers.ngram_embed import FusedNgramEmbedding, NgramShard, NgramTable, NgramWeights, reduce_bytes
from layers.ngram_embed.tables import AbsentTable, Bf16Table, check_table, gather_entry
from layers.ops.ngram_fused import ABSENT
from layers.dense_weight import BF16, DenseWeight
from tests.helpers.fakes import RecordingBackend
from tests.helpers.checkpoint import weight_bytes
from tests.helpers.logging_backend import LoggingBackend
from tests.helpers.ngram import device_weights, random_layer, small_dims
from tests.helpers.tensor_parallel import numpy_tables, rank_weights
from tests.helpers.tensor_parallel import tp_dims as _dims


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
