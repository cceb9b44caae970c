"""The loaders' cases: model folders for ``NgramWeights.from_pretrained`` and PEFT adapter folders
for ``overlay_from_peft``; each case damages a fresh copy, then loads it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from layers.ngram_embed import DeviceBudget, NgramShard, NgramWeights
from layers.ngram_embed.checkpoint import CheckpointError
from layers.peft_adapter import PeftAdapterError, overlay_from_peft
from tests.bad_inputs.matrix import GPU_TYPE, case
from tests.bad_inputs.world import World
from tests.helpers.checkpoint import PROJ, TABLE, rewrite_tensor
from tests.helpers.peft import EMBED, token_rows

def _load(w: World, damage: Callable[[Any], Any] | None = None, **keywords) -> NgramWeights:
    """``NgramWeights.from_pretrained`` of a fresh tiny model folder, ``damage``d first."""
    gpu = keywords.pop("gpu", w.gpu)
    return NgramWeights.from_pretrained(w.model(damage).path, gpu, **keywords)


CPU_CASES = [
    # -- NgramWeights.from_pretrained (the runners' from_pretrained before; their sizes are the runners') --
    case("NgramWeights.from_pretrained", "dtype", lambda w: _load(
        w, lambda m: rewrite_tensor(m, TABLE.format(0), m.tables[0][0].astype(np.float32))),
         CheckpointError, "is F32: tables are served as bf16 or fp8"),
    case("NgramWeights.from_pretrained", "dtype", lambda w: _load(w, cache_rows=2.0), TypeError,
         "cache_rows must be an int", detail="cache_rows"),
    case("NgramWeights.from_pretrained", "dtype", lambda w: _load(w, gpu="cpu"), TypeError,
         "NgramWeights.from_pretrained: " + GPU_TYPE + " str 'cpu'", detail="gpu"),
    case("NgramWeights.from_pretrained", "dtype", lambda w: _load(w, gpu=0), TypeError,
         "NgramWeights.from_pretrained: " + GPU_TYPE + " int 0", detail="gpu-int"),
    case("NgramWeights.from_pretrained", "dtype", lambda w: _load(w, placement=True), TypeError,
         "placement must be 'device' or 'host' or 'files' or a sequence of them, got bool", detail="placement"),
    case("NgramWeights.from_pretrained", "dtype", lambda w: _load(w, shard="1 of 2"), TypeError,
         r"shard must be an NgramShard or a \(rank, size\) pair, got str", detail="shard"),
    case("NgramWeights.from_pretrained", "shape", lambda w: _load(
        w, lambda m: rewrite_tensor(m, PROJ.format(0), np.ascontiguousarray(m.projs[0].T))),
         CheckpointError, r"post_projs.0.weight' has shape \[6, 24\]"),
    case("NgramWeights.from_pretrained", "shape", lambda w: _load(w, shard=(1,)), TypeError,
         r"shard must be an NgramShard or a \(rank, size\) pair, got tuple", detail="shard"),
    case("NgramWeights.from_pretrained", "length", lambda w: _load(w, placement=["device"] * 3),
         ValueError, "3 entries for 4 tables"),
    case("NgramWeights.from_pretrained", "range", lambda w: _load(w, eos_id=300),
         CheckpointError, "eos_id must be in 0..V-1"),
    case("NgramWeights.from_pretrained", "range", lambda w: _load(w, placement="gpu"),
         ValueError, "placement must be", detail="placement"),
    case("NgramWeights.from_pretrained", "range", lambda w: _load(w, placement=DeviceBudget(1000)),
         ValueError, r"placement DeviceBudget\(1000\): the word table, projections and fp8 scales alone take",
         detail="budget"),
    case("NgramWeights.from_pretrained", "range", lambda w: _load(w, cache_rows=0), ValueError,
         "cache_rows must be an int >= 1", detail="cache_rows"),
    case("NgramWeights.from_pretrained", "range", lambda w: _load(w, shard=(0, 5)), ValueError,
         "tensor-parallel size 5 over the 4 tables", detail="shard"),
    case("NgramWeights.from_pretrained", "range", lambda w: _load(w, shard=(2, 2)), ValueError,
         "tensor-parallel rank 2 out of range for size 2", detail="shard-rank"),
    case("NgramWeights.from_pretrained", "null", lambda w: _load(
        w, lambda m: rewrite_tensor(m, TABLE.format(2), None)),
         CheckpointError, "no tensor 'model.ngram_embeddings.embedders.2.weight'"),
    case("NgramWeights.from_pretrained", "null", lambda w: _load(w, gpu=None), TypeError,
         "NgramWeights.from_pretrained: " + GPU_TYPE + " None", detail="gpu"),
    case("NgramWeights.from_pretrained", "null", lambda w: _load(w, placement="files"), ValueError,
         "placement 'files' serves table files: pass table_dir=", detail="table_dir"),
    case("NgramWeights.from_pretrained", "null", lambda w: _load(w, placement=["device", "files", "host", "device"]),
         ValueError, "placement 'files' serves table files: pass table_dir=", detail="table_dir-per-table"),
    case("NgramWeights.from_pretrained", "empty", lambda w: _load(
        w, lambda m: (m.path / "config.json").unlink()), CheckpointError, "no config.json"),
    case("overlay_from_peft", "dtype", lambda w: overlay_from_peft(w.adapter(
        {f"{EMBED}.trainable_tokens_delta": np.ones((2, 16), np.int32)}), vocab=64),
         PeftAdapterError, "not a float type"),
    case("overlay_from_peft", "shape", lambda w: overlay_from_peft(w.adapter(
        {f"{EMBED}.trainable_tokens_delta": token_rows(w.rng, 3)}), vocab=64),
         PeftAdapterError, r"expected \[2, h\]"),
    case("overlay_from_peft", "id", lambda w: overlay_from_peft(w.adapter(ids=[3, 64]), vocab=64),
         PeftAdapterError, "token id 64 .* outside"),
    case("overlay_from_peft", "empty", lambda w: overlay_from_peft(w.empty_dir("adapter"), vocab=64),
         FileNotFoundError, "adapter_config.json"),
    case("overlay_from_peft", "null", lambda w: overlay_from_peft(w.tmp / "no-adapter", vocab=64),
         FileNotFoundError, "does not exist"),
]


def _after_from_pretrained(w: World) -> None:
    """The folder loads whole, and as rank 1 of 2; closing frees every upload."""
    model, mem = w.model(), set(w.gpu.mem)
    with NgramWeights.from_pretrained(model.path, w.gpu) as weights:
        assert weights.dims == model.dims and len(weights.tables) == model.dims.num_tables()
        assert weights.shard is None and weights.word.shape == model.word.shape
    with NgramWeights.from_pretrained(model.path, w.gpu, shard=(1, 2)) as rank:
        shard = NgramShard.of(model.dims, 1, 2)
        assert rank.shard == shard and rank.word.shape == (shard.word_rows, model.dims.hidden_size)
        assert [type(t).__name__ for t in rank.tables] == ["AbsentTable"] * 2 + ["Bf16Table", "Fp8Table"]
    assert set(w.gpu.mem) == mem


def _after_peft(w: World) -> None:
    overlay = overlay_from_peft(w.adapter(ids=[5, 9]), vocab=64)
    assert overlay.embed.ids.tolist() == [5, 9]


AFTER: dict[str, Callable[[World], None]] = {
    "NgramWeights.from_pretrained": _after_from_pretrained,
    "overlay_from_peft": _after_peft,
}
