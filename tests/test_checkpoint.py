"""``NgramWeights.from_pretrained`` over Hugging Face model folders.

CPU, on a host-memory backend: tiny LongCat-Flash-Lite-style checkpoints (sharded with an index
across shards that also hold unrelated tensors, or one ``model.safetensors``) load to exactly
the device bytes ``NgramWeights.from_numpy`` gives, for every placement; a ``DeviceBudget``
counts exactly the weights' device bytes (a tensor-parallel rank's share only), none of a
runner's; the EOS comes from ``eos_token_id`` or ``eos_id=``; every bad model folder, config,
index, tensor and argument is refused before anything is allocated or uploaded; the fused path
and the decoder run on loaded weights, which they borrow, and refuse bad sizes before they
allocate. GPU: ``embed`` over loaded weights equals ``embed`` over ``from_numpy``'s, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from layers import safetensors_io
from layers.ngram_embed import (CheckpointError, DeviceBudget, FusedNgramEmbedding, NgramCheckpoint, NgramDecoder,
                                NgramDims, NgramEmbedding, NgramShard, NgramTable, NgramWeights)
from layers.ngram_embed.placement import resolve_placement
from layers.dense_weight import BF16
from tests.helpers import Guarded, bits, random_bf16
from tests.helpers.checkpoint import (PROJ, SCALE, TABLE, WORD, WORD_ALT, layer_bytes, make_model, published_rows,
                                      rewrite_tensor, shard_of, tiny_config, write_model)
from tests.helpers.logging_backend import LoggingBackend


def fixed_device_bytes(dims: NgramDims, fp8_rows: int = 0, word_rows: int | None = None) -> int:
    """What DeviceBudget counts before any table: the word rows (all V, or a rank's), every
    projection, the held fp8 tables' scales. Nothing of any runner."""
    t, h, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
    word_rows = dims.vocab_size if word_rows is None else word_rows
    return word_rows * h * 2 + t * h * td * 2 + 4 * fp8_rows


def device_bytes(gpu: LoggingBackend) -> int:
    """Bytes allocated on the (fake) device, mapped host memory left out."""
    mapped = {dev for dev, _ in gpu.mapped.values()}
    return sum(buf.size for ptr, buf in gpu.mem.items() if ptr not in mapped)


def placed(weights: NgramWeights) -> list[str]:
    """Each table's place: "host" (NgramTable.Host), "absent" (another rank's) or "device"."""
    return ["host" if isinstance(tb, NgramTable.Host) else "absent" if isinstance(tb, NgramTable.Absent)
            else "device" for tb in weights.tables]


# ==== CPU: the header-only reader ===================================================================

def test_read_header_maps_nothing_and_keeps_unknown_dtypes(tmp_path, rng, monkeypatch):
    path = tmp_path / "s.safetensors"
    a, b = random_bf16(rng, (5, 3)), rng.standard_normal(4).astype(np.float32)
    safetensors_io.save(path, {"a": a, "b": b})
    raw = bytearray(path.read_bytes())
    (n,) = np.frombuffer(raw[:8], np.uint64)
    header = json.loads(raw[8:8 + int(n)])
    data = bytes(raw[8 + int(n):])
    header["x"] = {"dtype": "F8_E5M2", "shape": [2], "data_offsets": [len(data), len(data) + 2]}  # after a and b
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(np.uint64(len(blob)).tobytes() + blob + data + b"\x01\x02")
    monkeypatch.setattr(np, "memmap", lambda *a, **k: pytest.fail("read_header mapped a tensor"))
    info = safetensors_io.read_header(path)
    base = 8 + len(blob)
    assert info["a"] == safetensors_io.TensorInfo("a", "BF16", (5, 3), base, base + 30)
    assert info["x"].dtype == "F8_E5M2" and info["b"].nbytes == 16
    monkeypatch.undo()
    got = safetensors_io.load(path, ["a"])
    assert list(got) == ["a"] and bits(got["a"]).tolist() == bits(a).tolist()
    with pytest.raises(TypeError, match="unsupported dtype F8_E5M2"):
        safetensors_io.map_tensor(path, info["x"])
    with pytest.raises(KeyError, match="no tensor 'c'"):
        safetensors_io.load(path, ["c"])


def _st(header: str, data: bytes = b"") -> bytes:
    return np.uint64(len(header)).tobytes() + header.encode() + data


@pytest.mark.parametrize("raw, match", [
    (b"\x01\x02", "too short"),
    (np.uint64(1 << 40).tobytes() + b"{}", "runs past the end"),
    (_st("[1]"), "not an object"),
    (_st("{x:1"), "not valid JSON"),
    (_st('{"a": {"dtype": "BF16", "shape": [-1], "data_offsets": [0, 0]}}'), "malformed header entry"),
    (_st('{"a": {"dtype": 5, "shape": [1], "data_offsets": [0, 2]}}', b"xx"), "malformed"),
    (_st('{"a": {"dtype": "BF16", "shape": [1]}}', b"xx"), "malformed"),
    (_st('{"a": {"dtype": "BF16", "shape": [2], "data_offsets": [2, 0]}}', b"xxxx"), "malformed"),
    (_st('{"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}', b"xx"), "does not hold"),
    (_st('{"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}}', b"xxxx"), "does not hold"),
    (_st('{"a": {"dtype": "I4", "shape": [3], "data_offsets": [0, 8]}}', b"xxxx"), "does not hold"),
])
def test_read_header_refuses_malformed_headers(tmp_path, raw, match):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=match):
        safetensors_io.read_header(path)


# ==== CPU: loads ======================================================================================

@pytest.mark.parametrize("loader", ["from_numpy", "from_pretrained"])
def test_loaders_return_with_their_uploads_done(tmp_path, rng, loader):
    """A runner on a created stream (which does not wait for the loader's) may read the weights
    at once: each loader waits for its uploads before it returns."""
    from tests.helpers.fakes import RecordingBackend

    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    gpu = RecordingBackend()
    if loader == "from_numpy":
        weights = NgramWeights.from_numpy(model.dims, model.word, model.numpy_tables(), model.projs, gpu, stream=5)
    else:
        weights = NgramWeights.from_pretrained(str(model.path), gpu, stream=5)
    last_upload = max(i for i, op in enumerate(gpu.ops) if op[0] == "h2d")
    assert gpu.ops[last_upload][3] == 5 and ("sync", 5) in gpu.ops[last_upload:]
    weights.close()


@pytest.mark.parametrize("layout", ["sharded", "single"])
@pytest.mark.parametrize("kinds", ["b", "bf", "f"])
@pytest.mark.parametrize("placement", ["device", "host", "mixed", "budget"])
def test_loads_what_from_numpy_loads(tmp_path, rng, layout, kinds, placement):
    model = write_model(tmp_path / "m", make_model(rng, kinds=kinds), layout)
    dims, t = model.dims, model.dims.num_tables()
    places = {"device": ["device"] * t, "host": ["host"] * t, "mixed": ["host", "device", "device", "host"]}
    if placement == "budget":
        fp8_rows = sum(dims.table_rows(c) for c, (_, s) in enumerate(model.tables) if s is not None)
        two = sum(tb.nbytes for tb, _ in model.tables[:2])
        arg = DeviceBudget(fixed_device_bytes(dims, fp8_rows) + two)
        expect = ["device", "device", "host", "host"]
    else:
        expect = places[placement]
        arg = expect if placement == "mixed" else placement
    gpu, ref_gpu = LoggingBackend(), LoggingBackend()
    weights = NgramWeights.from_pretrained(str(model.path), gpu, placement=arg)
    ref = NgramWeights.from_numpy(dims, model.word, model.numpy_tables(), model.projs, ref_gpu, placement=expect)
    assert weights.dims == dims and weights.dims.eos_id == 2 and weights.shard is None
    assert placed(weights) == expect
    assert layer_bytes(gpu, weights) == layer_bytes(ref_gpu, ref)
    if placement == "budget":
        assert device_bytes(gpu) == arg.nbytes  # the budget is exactly what the weights took
    weights.close()
    ref.close()
    assert gpu.empty() and ref_gpu.empty()


def test_an_int_budget_places_tables_in_order(tmp_path, rng):
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    dims = model.dims
    fixed = fixed_device_bytes(dims)
    sizes = [tb.nbytes for tb, _ in model.tables]
    for budget, expect in [(fixed, ["host"] * 4), (fixed + sizes[0], ["device"] + ["host"] * 3),
                           (fixed + sum(sizes) - 1, ["device"] * 3 + ["host"]), (fixed + sum(sizes), ["device"] * 4)]:
        gpu = LoggingBackend()
        with NgramWeights.from_pretrained(model.path, gpu, placement=budget) as weights:
            assert placed(weights) == expect
            assert device_bytes(gpu) <= budget
            # no runner's buffers count: one built on top takes device memory beyond the budget
            with NgramEmbedding(weights, 4096), FusedNgramEmbedding(weights, 4096):
                assert device_bytes(gpu) > budget
        assert resolve_placement(DeviceBudget(budget), dims, ["BF16"] * 4, range(4), dims.vocab_size) == expect
        assert gpu.empty()
    with pytest.raises(ValueError, match=rf"DeviceBudget\({fixed - 1}\): the word table, projections and fp8 "
                                         rf"scales alone take {fixed} bytes"):
        resolve_placement(fixed - 1, dims, ["BF16"] * 4, range(4), dims.vocab_size)


@pytest.mark.parametrize("kinds", ["b", "bf", "fb"])
def test_a_budget_is_never_exceeded_and_every_host_table_would_not_have_fit(tmp_path, rng, kinds):
    """Any budget from the fixed part up to everything: the weights' device bytes stay within it,
    and each table left in host memory would have overrun it (the greedy rule, in table order)."""
    model = write_model(tmp_path / "m", make_model(rng, kinds=kinds))
    dims = model.dims
    fp8_rows = sum(dims.table_rows(c) for c, (_, s) in enumerate(model.tables) if s is not None)
    fixed = fixed_device_bytes(dims, fp8_rows)
    total = fixed + sum(tb.nbytes for tb, _ in model.tables)
    for budget in sorted({fixed, total, *(int(b) for b in rng.integers(fixed, total + 1, 6))}):
        gpu = LoggingBackend()
        with NgramWeights.from_pretrained(model.path, gpu, placement=DeviceBudget(budget)) as weights:
            used = device_bytes(gpu)
            assert used <= budget
            for c, where in enumerate(placed(weights)):
                if where == "host":
                    assert used + model.tables[c][0].nbytes > budget, (budget, c)
            if budget == total:
                assert placed(weights) == ["device"] * 4 and used == total
        assert gpu.empty()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_budget_counts_its_word_rows_and_tables_only(tmp_path, rng, rank):
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    dims = model.dims
    shard = NgramShard.of(dims, rank, 2)
    held = list(shard.tables)
    fp8_rows = sum(dims.table_rows(c) for c in held if model.tables[c][1] is not None)
    fixed = fixed_device_bytes(dims, fp8_rows, shard.word_rows)
    first = model.tables[held[0]][0].nbytes
    dtypes = ["F8_E4M3" if s is not None else "BF16" for _, s in model.tables]
    for budget, held_places in [(fixed, ["host", "host"]), (fixed + first, ["device", "host"]),
                                (fixed + sum(model.tables[c][0].nbytes for c in held), ["device", "device"])]:
        # the others' tables are "device" (unused) in the resolved list, absent in the weights
        want = ["device"] * 4
        for c, where in zip(held, held_places):
            want[c] = where
        assert resolve_placement(budget, dims, dtypes, shard.tables, shard.word_rows) == want
        gpu = LoggingBackend()
        with NgramWeights.from_pretrained(model.path, gpu, placement=budget, shard=(rank, 2)) as weights:
            assert placed(weights) == [w if c in held else "absent" for c, w in enumerate(want)]
            on_device = sum(model.tables[c][0].nbytes for c, w in zip(held, held_places) if w == "device")
            assert device_bytes(gpu) == fixed + on_device <= budget
        assert gpu.empty()
    with pytest.raises(ValueError, match=rf"DeviceBudget\({fixed - 1}\)"):
        NgramWeights.from_pretrained(model.path, LoggingBackend(), placement=fixed - 1, shard=(rank, 2))


def test_only_the_shards_holding_ngram_tensors_are_opened(tmp_path, rng, monkeypatch):
    """Shard 4 (garbage, unrelated tensors only) is never read; each other shard's header is read
    once and only the n-gram tensors are mapped."""
    model = write_model(tmp_path / "m", make_model(rng))
    headers, mapped = [], []
    real_header, real_map = safetensors_io.read_header, safetensors_io.map_tensor
    monkeypatch.setattr(safetensors_io, "read_header", lambda p: headers.append(Path(p).name) or real_header(p))
    monkeypatch.setattr(safetensors_io, "map_tensor", lambda p, i: mapped.append(i.name) or real_map(p, i))
    ckpt = NgramCheckpoint.open(model.path)
    assert sorted(headers) == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3)] and not mapped
    assert sorted(p.name for p in ckpt.shards) == sorted(headers)
    gpu = LoggingBackend()
    NgramWeights.from_pretrained(model.path, gpu).close()
    assert set(mapped) == set(model.tensors) and len(mapped) == len(model.tensors)
    tables_only = NgramCheckpoint.open(model.path, parts="tables")
    assert tables_only.word is None and not tables_only.projs and len(tables_only.tables) == 4


def test_array_methods_refuse_a_bad_index_or_missing_part(tmp_path, rng):
    """``table_arrays(99)`` was a bare IndexError, ``table_arrays(-1)`` the last table and
    ``proj_array('a')`` a tuple-index TypeError: each index-taking method refuses a non-int (a
    bool too) with TypeError and an index outside 0..T-1 with ValueError, both naming ``c``; a
    part the checkpoint was opened without is a ValueError, not an assert."""
    path = write_model(tmp_path / "m", make_model(rng)).path
    ckpt = NgramCheckpoint.open(path)
    t = ckpt.dims.num_tables()
    for method in (ckpt.table_arrays, ckpt.proj_array):
        name = method.__name__
        for bad in ("a", 1.0, True, None, np.float64(0)):
            with pytest.raises(TypeError, match=rf"NgramCheckpoint\.{name}: c must be an int"):
                method(bad)
        for bad in (-1, -t, t, 99):
            with pytest.raises(ValueError, match=rf"NgramCheckpoint\.{name}: c = {bad} outside 0\.\.{t - 1}"):
                method(bad)
    np.testing.assert_array_equal(bits(ckpt.proj_array(np.int64(t - 1))), bits(ckpt.proj_array(t - 1)))
    tables_only = NgramCheckpoint.open(path, parts="tables")
    with pytest.raises(ValueError, match=r"proj_array: opened with parts='tables', without the projections"):
        tables_only.proj_array(0)
    with pytest.raises(ValueError, match=r"word_array: opened with parts='tables', without the word table"):
        tables_only.word_array()
    with pytest.raises(ValueError, match=r"table_arrays: opened with parts='dense', without the tables"):
        NgramCheckpoint.open(path, parts="dense").table_arrays(0)


def test_word_table_names_and_wide_dense_dtypes(tmp_path, rng):
    model = make_model(rng, kinds="b")
    word32 = rng.standard_normal(model.word.shape).astype(np.float32)
    projs16 = [p.astype(np.float16) for p in model.projs]
    model.tensors[WORD_ALT] = word32  # the mlx-lm name, beside the HF one: the HF one wins
    write_model(tmp_path / "both", model)
    gpu = LoggingBackend()
    with NgramWeights.from_pretrained(tmp_path / "both", gpu) as weights:
        assert gpu.read(weights.word.weight, weights.word.nbytes).tobytes() == model.word.tobytes()
    del model.tensors[WORD]
    for c, p in enumerate(projs16):
        model.tensors[PROJ.format(c)] = p
    write_model(tmp_path / "alt", model, "single")
    with NgramWeights.from_pretrained(tmp_path / "alt", gpu) as weights:
        want = word32.astype(ml_dtypes.bfloat16)  # round to nearest even
        assert gpu.read(weights.word.weight, weights.word.nbytes).tobytes() == want.tobytes()
        for c, proj in enumerate(weights.projs):
            want = projs16[c].astype(np.float32).astype(ml_dtypes.bfloat16)
            assert gpu.read(proj.weight, proj.nbytes).tobytes() == want.tobytes()
    assert gpu.empty()


def test_scale_tensor_forms(tmp_path, rng):
    """``weight_scale`` or ``row_scale``, ``[rows]`` or ``[rows, 1]``, F32 or an exact BF16 upcast."""
    model = make_model(rng, kinds="f")
    for c, (table, scale) in enumerate(model.tables):
        del model.tensors[SCALE.format(c)]
        form = [scale, scale[:, None], scale.astype(ml_dtypes.bfloat16), scale][c]
        name = (SCALE if c != 3 else "model.ngram_embeddings.embedders.{}.row_scale").format(c)
        model.tensors[name] = form
        if c == 2:
            model.tables[c] = (table, form.astype(np.float32))
    write_model(tmp_path / "m", model)
    gpu, ref_gpu = LoggingBackend(), LoggingBackend()
    with NgramWeights.from_pretrained(model.path, gpu) as weights, \
            NgramWeights.from_numpy(model.dims, model.word, model.numpy_tables(), model.projs, ref_gpu) as ref:
        assert layer_bytes(gpu, weights) == layer_bytes(ref_gpu, ref)


@pytest.mark.parametrize("config_eos, override, want", [
    (2, None, 2), (2, 7, 7), ([2], None, 2), ([5, 5], None, 5), ([2, 3], 3, 3), (..., 9, 9), (None, 0, 0),
])
def test_eos_from_config_or_override(tmp_path, rng, config_eos, override, want):
    model = write_model(tmp_path / "m", make_model(rng, tiny_config(eos_token_id=config_eos), "b"))
    gpu = LoggingBackend()
    with NgramWeights.from_pretrained(model.path, gpu, eos_id=override) as weights:
        assert weights.dims.eos_id == want
        assert weights.dims == model.dims.replace(eos_id=want)


def test_row_counts_follow_the_published_formula_for_int_and_float_ratios(tmp_path, rng):
    for ratio, vocab in [(1, 100), (78, 7), (0.37, 331), (100.567, 64)]:
        config = tiny_config(vocab_size=vocab, ngram_vocab_size_ratio=ratio, hidden_size=16)
        dims = NgramCheckpoint.open(write_model(tmp_path / f"m{ratio}", make_model(rng, config, "b")).path).dims
        assert [dims.table_rows(c) for c in range(4)] == [published_rows(config, c) for c in range(4)]
        assert dims.table_index(3, 1) == 3 and dims.table_dim() == 16 // 4


# ==== CPU: refusals before anything is uploaded ====================================================

def _drop(name):
    return lambda m: rewrite_tensor(m, name, None)


def _swap(name, make):
    return lambda m: rewrite_tensor(m, name, make(m))


def _config(**changes):
    def apply(m):
        config = {**m.config, **changes}
        (m.path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))
    return apply


def _index(edit):
    def apply(m):
        path = m.path / "model.safetensors.index.json"
        data = json.loads(path.read_text())
        path.write_text(edit(data) if callable(edit) else edit)
    return apply


def _index_map(name, value):
    return _index(lambda d: json.dumps({**d, "weight_map": {**d["weight_map"], name: value}}))


BAD = [
    # tensors
    ("missing-table", _drop(TABLE.format(2)), "no tensor 'model.ngram_embeddings.embedders.2.weight'"),
    ("missing-proj", _drop(PROJ.format(1)), "model.safetensors.index.json: no tensor 'model.ngram_embeddings.post_projs.1.weight'"),
    ("dropped-from-shard", lambda m: _index_map(PROJ.format(1), shard_of(m, WORD).name)(m),
     "no tensor 'model.ngram_embeddings.post_projs.1.weight', though"),
    ("missing-word", _drop(WORD), "no word table"),
    ("table-rows", _swap(TABLE.format(1), lambda m: m.tables[1][0][:-1]), r"embedders.1.weight' has shape \[77, 6\], config.json gives \[78, 6\]"),
    ("table-dim", _swap(TABLE.format(0), lambda m: random_bf16(np.random.default_rng(1), (76, 7))), r"has shape \[76, 7\]"),
    ("proj-transposed", _swap(PROJ.format(0), lambda m: np.ascontiguousarray(m.projs[0].T)), r"post_projs.0.weight' has shape \[6, 24\]"),
    ("word-shape", _swap(WORD, lambda m: m.word[:-1]), r"embed_tokens.weight' has shape \[299, 24\]"),
    ("table-f32", _swap(TABLE.format(0), lambda m: m.tables[0][0].astype(np.float32)), "is F32: tables are served as bf16 or fp8"),
    ("table-i32", _swap(TABLE.format(0), lambda m: np.zeros((76, 6), np.int32)), "is I32; served: BF16, F8_E4M3"),
    ("proj-i32", _swap(PROJ.format(2), lambda m: np.zeros((24, 6), np.int32)), "post_projs.2.weight' is I32"),
    ("fp8-no-scale", _drop(SCALE.format(1)), "embedders.1.weight' is F8_E4M3 without its per-row scales"),
    ("scale-for-bf16", lambda m: rewrite_tensor(m, SCALE.format(0), np.ones(76, np.float32), near=TABLE.format(0)),
     "per-row scales for a BF16 table"),
    ("scale-shape", _swap(SCALE.format(1), lambda m: np.ones(77, np.float32)), "one scale per row"),
    ("scale-i32", _swap(SCALE.format(1), lambda m: np.ones(78, np.int32)), "weight_scale' is I32"),
    ("shard-truncated", lambda m: shard_of(m, TABLE.format(0)).write_bytes(shard_of(m, TABLE.format(0)).read_bytes()[:-8]), "does not hold shape"),
    # config.json
    ("no-config", lambda m: (m.path / "config.json").unlink(), "no config.json"),
    ("config-not-json", lambda m: (m.path / "config.json").write_text("{vocab"), "config.json: not valid JSON"),
    *[(f"config-no-{key}", _config(**{key: ...}), f"missing key '{key}'") for key in
      ("vocab_size", "hidden_size", "emb_neighbor_num", "emb_split_num", "ngram_vocab_size_ratio", "eos_token_id")],
    ("config-eos-null", _config(eos_token_id=None), "missing key 'eos_token_id'"),
    ("config-eos-list", _config(eos_token_id=[2, 9]), r"eos_token_id lists 2 ids \[2, 9\].*pass eos_id="),
    ("config-eos-str", _config(eos_token_id="2"), "eos_token_id must be an int"),
    ("config-eos-range", _config(eos_token_id=300), "eos_id must be in 0..V-1"),
    ("config-ratio-neg", _config(ngram_vocab_size_ratio=-1), "ngram_vocab_size_ratio must be a number > 0"),
    ("config-ratio-str", _config(ngram_vocab_size_ratio="78"), "ngram_vocab_size_ratio must be a number > 0"),
    ("config-split-bool", _config(emb_split_num=True), "emb_split_num must be an int >= 1"),
    ("config-neighbor-1", _config(emb_neighbor_num=1), "emb_neighbor_num must be an int >= 2"),
    ("config-text-vocab", _config(text_vocab_size=256), "text_vocab_size 256 != vocab_size 300"),
    ("config-oe-keys", _config(emb_neighbor_num=..., oe_neighbor_num=3), r"LongCat-2.0's keys \['oe_neighbor_num'\]"),
    ("config-oe-beside-emb", _config(oe_split_num=4, oe_special_tokens=[1]),
     r"LongCat-2.0's keys \['oe_special_tokens', 'oe_split_num'\] are not served"),
    ("config-dims-change", _config(hidden_size=32), r"has shape \[300, 24\], config.json gives \[300, 32\]"),
    # the index
    ("index-not-json", _index("{weight"), "model.safetensors.index.json: not valid JSON"),
    ("index-no-weight-map", _index(json.dumps({"metadata": {}})), "no 'weight_map' object"),
    ("index-bad-entry", _index_map(TABLE.format(0), 5), "maps to 5, not a file name"),
    ("index-escapes", _index_map(TABLE.format(0), "../elsewhere.safetensors"), "not a file name inside the model folder"),
    ("index-missing-shard", _index_map(TABLE.format(0), "model-00009-of-00009.safetensors"), "shard model-00009-of-00009.safetensors .* does not exist"),
    ("index-wrong-shard", lambda m: _index_map(TABLE.format(0), shard_of(m, PROJ.format(0)).name)(m),
     "no tensor 'model.ngram_embeddings.embedders.0.weight', though model.safetensors.index.json maps it there"),
    ("no-weights", lambda m: (m.path / "model.safetensors.index.json").unlink(), "neither model.safetensors nor"),
]


@pytest.mark.parametrize("case, mutate, match", BAD, ids=[b[0] for b in BAD])
def test_bad_model_folders_are_refused_before_any_upload(tmp_path, rng, case, mutate, match):
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    mutate(model)
    gpu = LoggingBackend()
    with pytest.raises(CheckpointError, match=match) as err:
        NgramWeights.from_pretrained(model.path, gpu)
    assert gpu.log == [] and gpu.empty()
    if case.startswith(("table-", "proj-", "word-", "scale-", "fp8-")):  # the file that holds it
        assert "model-0000" in str(err.value)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(placement="gpu"), ValueError, "placement must be 'device' or 'host' or 'files'"),
    (dict(placement=["device"] * 3), ValueError, "3 entries for 4 tables"),
    (dict(placement=["device", "host", "disk", "host"]), ValueError, r"placement\[2\]"),
    (dict(placement="files"), ValueError, "pass table_dir="),
    (dict(placement=["files", "host", "host", "host"]), ValueError, "pass table_dir="),
    (dict(placement=True), TypeError, "placement must be"),
    (dict(placement=1000), ValueError, r"DeviceBudget\(1000\): the word table"),
    (dict(placement=-1), ValueError, "DeviceBudget: nbytes"),
    (dict(cache_rows=0), ValueError, "cache_rows"),
    (dict(shard=(2, 2)), ValueError, "rank 2 out of range for size 2"),
    (dict(shard=(0, 5)), ValueError, "size 5 over the 4 tables"),
    (dict(shard="0/2"), TypeError, r"\(rank, size\) pair"),
    (dict(shard=(0, 2), placement=1000), ValueError, r"DeviceBudget\(1000\): the word table"),
    (dict(shard=(1, 2), placement="files"), ValueError, "pass table_dir="),
    (dict(eos_id=300), CheckpointError, "eos_id must be in 0..V-1"),
    (dict(table_dir="nowhere"), CheckpointError, "no manifest"),
])
def test_bad_arguments_are_refused_before_any_upload(tmp_path, rng, kwargs, exc, match):
    model = write_model(tmp_path / "m", make_model(rng))
    gpu = LoggingBackend()
    with pytest.raises(exc, match=match):
        NgramWeights.from_pretrained(model.path, gpu, **kwargs)
    assert gpu.log == [] and gpu.empty()


def test_a_bad_gpu_is_refused_before_anything_is_read(tmp_path, rng, monkeypatch):
    model = write_model(tmp_path / "m", make_model(rng))
    monkeypatch.setattr(NgramCheckpoint, "open", lambda *a, **k: pytest.fail("the checkpoint was opened"))
    with pytest.raises(TypeError, match="gpu must be a GpuBackend"):
        NgramWeights.from_pretrained(model.path, object())


def test_a_failure_after_the_first_upload_frees_everything(tmp_path, rng):
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    placement = ["host", "device", "device", "host"]
    # device allocations: the word, 4 projections, table 1 (fp8) and its scales, table 2, table 3's scales
    for after in (1, 3, 5, 6, 8):  # in the projections, a table, its scales, a host table's scales
        gpu = LoggingBackend(fail_alloc_after=after)
        with pytest.raises(MemoryError):
            NgramWeights.from_pretrained(model.path, gpu, placement=placement)
        assert gpu.empty() and gpu.count("alloc") == after
    gpu = LoggingBackend(fail_alloc_after=9)
    NgramWeights.from_pretrained(model.path, gpu, placement=placement).close()
    assert gpu.count("alloc") == 9 and gpu.empty()


# ==== CPU: the fused path and the decoder ============================================================

def test_fused_and_decoder_borrow_loaded_weights(tmp_path, rng):
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    gpu = LoggingBackend()
    weights = NgramWeights.from_pretrained(model.path, gpu, placement="host")
    assert all(isinstance(tb, NgramTable.Host) for tb in weights.tables)
    fused = FusedNgramEmbedding(weights, 16)
    assert fused.weights is weights and fused.max_rows == 16
    # the concatenated projections are the checkpoint's, side by side
    cat = gpu.read(fused.projection.projs.weight, 24 * 4 * 6 * 2).view(BF16).reshape(24, 24)
    np.testing.assert_array_equal(bits(cat), bits(np.concatenate(model.projs, axis=1)))
    fused.close()
    assert not weights.closed and not gpu.empty()  # the runner frees its buffers, not the weights
    weights.close()
    assert gpu.empty()
    weights = NgramWeights.from_pretrained(model.path, gpu, eos_id=5)
    dec = NgramDecoder(weights, max_seqs=4, max_rows=8, max_draft=2)
    assert dec.dims.eos_id == 5 and dec.weights is weights
    dec.close()
    assert not weights.closed
    weights.close()
    assert gpu.empty()


@pytest.mark.parametrize("make, match", [
    (lambda w: FusedNgramEmbedding(w, 0), "max_rows"),
    (lambda w: NgramDecoder(w, max_seqs=0, max_rows=8), "max_seqs"),
    (lambda w: NgramDecoder(w, max_seqs=2, max_rows=8, max_draft=-1), "max_draft"),
    (lambda w: NgramDecoder(w, max_seqs=2, max_rows=0), "max_rows"),
    (lambda w: NgramEmbedding(w, 0), "max_tokens"),
])
def test_runner_refusals_come_before_the_runner_allocates(tmp_path, rng, make, match):
    """The runners' sizes are refused before they allocate, upload or launch anything; the loaded
    weights stay as they were (their refusals before any upload are above)."""
    model = write_model(tmp_path / "m", make_model(rng))
    gpu = LoggingBackend()
    with NgramWeights.from_pretrained(model.path, gpu) as weights:
        mark = len(gpu.log)
        with pytest.raises(ValueError, match=match):
            make(weights)
        assert gpu.log[mark:] == [] and not weights.closed
    assert gpu.empty()


# ==== GPU ============================================================================================

@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["device", "mixed", "files"])
def test_from_pretrained_on_the_gpu_embeds_as_from_numpy(gpu, rng, tmp_path, placement):
    """A sharded tiny checkpoint (bf16 and fp8 tables; bf16 only for the converted files) loaded by
    ``NgramWeights.from_pretrained`` gives the same ``NgramEmbedding.embed`` output bits as
    ``NgramWeights.from_numpy`` on the same weights, prefill and decode, with EOS tokens in the
    context."""
    from layers.ngram_embed.convert import convert

    config = tiny_config(vocab_size=500, hidden_size=48, ngram_vocab_size_ratio=0.5, eos_token_id=7)
    model = write_model(tmp_path / "m", make_model(rng, config, "b" if placement == "files" else "bf"))
    t = model.dims.num_tables()
    places = ["device"] * t if placement != "mixed" else ["device", "host"] * (t // 2)
    kwargs = dict(placement=places)
    if placement == "files":
        convert(model.path, tmp_path / "tables", progress=False)
        kwargs = dict(placement="files", table_dir=str(tmp_path / "tables"), cache_rows=256)
    ctx = rng.integers(0, 500, 60)
    ctx[[5, 6, 30]] = 7  # EOS boundaries, one doubled
    results = []
    for make in (lambda: NgramWeights.from_pretrained(str(model.path), gpu, **kwargs),
                 lambda: NgramWeights.from_numpy(model.dims, model.word, model.numpy_tables(), model.projs, gpu,
                                                 placement=places)):
        with make() as weights, NgramEmbedding(weights, 64) as layer, Guarded(gpu, (60, 48), BF16, rng) as out:
            assert layer.dims == model.dims
            got = []
            for seq_len in (60, 1, 17):
                out.poison()
                layer.embed(ctx, seq_len, out.ptr, gpu, 0)
                got.append(out.read()[:seq_len].copy())
            out.assert_guards_intact()
            results.append(got)
    for a, b in zip(*results):
        assert np.isfinite(a.astype(np.float32)).all()
        np.testing.assert_array_equal(bits(a), bits(b))


def test_a_checkpoint_made_from_a_path_points_to_open(tmp_path):
    """``NgramCheckpoint(path)`` said "missing 7 required positional arguments" (issue 44)."""
    from layers.ngram_embed.checkpoint import NgramCheckpoint

    for path in (str(tmp_path), tmp_path):
        with pytest.raises(TypeError, match=r"read a model folder with NgramCheckpoint\.open\(path\)"):
            NgramCheckpoint(path)
