"""Tiny LongCat-Flash-Lite-style model folders for the checkpoint loader's tests: their config,
random weights, the folder on disk (sharded with an index, or one file), surgery on one tensor,
and the device bytes a loaded layer holds."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from layers import safetensors_io
from layers.ngram_embed import NgramDims, NgramEmbedding
from tests.helpers.fakes import MemoryBackend
from tests.helpers import random_bf16, random_fp8

# the tensor names of the published checkpoint
WORD = "model.embed_tokens.weight"
WORD_ALT = "model.ngram_embeddings.word_embeddings.weight"
TABLE = "model.ngram_embeddings.embedders.{}.weight"
SCALE = "model.ngram_embeddings.embedders.{}.weight_scale"
PROJ = "model.ngram_embeddings.post_projs.{}.weight"


def tiny_config(**changes) -> dict:
    """LongCat-Flash-Lite's config keys at toy size: T = 2*(3-1) = 4 tables of 300 // ... rows."""
    config = {"architectures": ["LongcatFlashNgramForCausalLM"], "model_type": "longcat_flash_ngram",
              "vocab_size": 300, "hidden_size": 24, "emb_neighbor_num": 3, "emb_split_num": 2,
              "ngram_vocab_size_ratio": 0.25, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 3,
              "num_layers": 1, "torch_dtype": "bfloat16"}
    config.update(changes)
    return {k: v for k, v in config.items() if v is not ...}


def published_rows(config: dict, i: int) -> int:
    """Table i's rows as the published code computes them: ``int(m + i*2 + 1)``, m = r*V."""
    return int(config["ngram_vocab_size_ratio"] * config["vocab_size"] + i * 2 + 1)


@dataclass
class Model:
    """A tiny model's weights, and once written, the folder that holds them (``path``)."""

    path: Path
    config: dict
    dims: NgramDims
    word: np.ndarray
    tables: list  # (table, scale or None)
    projs: list
    tensors: dict = field(default_factory=dict)  # name -> array, as written

    def numpy_tables(self):
        return [t if s is None else (t, s) for t, s in self.tables]


def make_model(rng, config: dict | None = None, kinds: str = "bf") -> Model:
    """Weights of a tiny model (nothing written yet). ``kinds``: per table (cycled) 'b' bf16, 'f'
    fp8 with a ``weight_scale`` tensor."""
    config = tiny_config() if config is None else config
    v, d = config["vocab_size"], config["hidden_size"]
    t = config["emb_split_num"] * (config["emb_neighbor_num"] - 1)
    td = d // t
    eos = config.get("eos_token_id")
    dims = NgramDims.longcat_flash(v, d, config["emb_neighbor_num"], config["emb_split_num"],
                                   config["ngram_vocab_size_ratio"], eos if isinstance(eos, int) else None)
    word = random_bf16(rng, (v, d))
    tables, projs, tensors = [], [], {WORD: word}
    for c in range(t):
        rows = published_rows(config, c)
        assert rows == dims.table_rows(c)
        if kinds[c % len(kinds)] == "f":
            table, scale = random_fp8(rng, (rows, td)), rng.uniform(0.001, 0.05, rows).astype(np.float32)
            tensors[SCALE.format(c)] = scale
        else:
            table, scale = random_bf16(rng, (rows, td)), None
        tensors[TABLE.format(c)] = table
        proj = random_bf16(rng, (d, td), 1 / np.sqrt(td))
        tensors[PROJ.format(c)] = proj
        tables.append((table, scale))
        projs.append(proj)
    return Model(Path(), config, dims, word, tables, projs, tensors)


UNRELATED = {"model.layers.0.self_attn.0.q_a_proj.weight": np.float32, "lm_head.weight": np.float32,
             "model.norm.weight": np.float16}


def write_model(path: Path, model: Model, layout: str = "sharded", rng=None) -> Model:
    """Write ``model`` as a model folder: ``config.json`` and either ``model.safetensors`` or three
    shards (n-gram tensors spread over them, unrelated tensors beside them) plus a fourth shard of
    unrelated tensors only, which is garbage: a loader that opens it fails."""
    rng = np.random.default_rng(0) if rng is None else rng
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config, indent=1))
    unrelated = {name: rng.standard_normal((4, 6)).astype(dt) for name, dt in UNRELATED.items()}
    if layout == "single":
        safetensors_io.save(path / "model.safetensors", {**unrelated, **model.tensors})
    else:
        names = list(model.tensors)
        shards = [names[0::3], names[1::3], names[2::3]]
        weight_map = {}
        extra = list(unrelated)
        for i, group in enumerate(shards):
            file = f"model-{i + 1:05d}-of-00004.safetensors"
            content = {n: model.tensors[n] for n in group}
            if i < len(extra):
                content[extra[i]] = unrelated[extra[i]]
            safetensors_io.save(path / file, content)
            weight_map.update({n: file for n in content})
        garbage = "model-00004-of-00004.safetensors"
        (path / garbage).write_bytes(b"\xff" * 64)  # not a safetensors file at all
        weight_map["model.layers.1.mlp.experts.0.up_proj.weight"] = garbage
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    model.path = path
    return model


def shard_of(model: Model, name: str) -> Path:
    """The file of ``model``'s folder that holds tensor ``name``."""
    index = model.path / "model.safetensors.index.json"
    if not index.exists():
        return model.path / "model.safetensors"
    return model.path / json.loads(index.read_text())["weight_map"][name]


def rewrite_tensor(model: Model, name: str, array: np.ndarray | None, near: str | None = None) -> Path:
    """Replace, add (into the file that holds ``near``) or with None remove one tensor, keeping
    the index in step."""
    file = shard_of(model, near or name)
    tensors = {k: np.array(v) for k, v in safetensors_io.load(file).items()}
    if array is None:
        del tensors[name]
    else:
        tensors[name] = array
    file.unlink()
    safetensors_io.save(file, tensors)
    index = model.path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        if array is None:
            del data["weight_map"][name]
        else:
            data["weight_map"][name] = file.name
        index.write_text(json.dumps(data))
    return file


def weight_bytes(gpu: MemoryBackend, w) -> tuple:
    """A weight's kind, shape, dtype, device bytes and row-scale bytes: equal tuples, equal weights."""
    data = gpu.read(w.weight, w.nbytes)
    scale = gpu.read(w.row_scale, w.rows * 4) if w.row_scale else None
    return type(w).__name__, w.shape, np.dtype(w.dtype).name, data.tobytes(), None if scale is None else scale.tobytes()


def layer_bytes(gpu: MemoryBackend, layer: NgramEmbedding) -> list:
    """``weight_bytes`` of every weight of ``layer`` (tables with their kind)."""
    out = [weight_bytes(gpu, layer.word)]
    out += [(type(t).__name__, weight_bytes(gpu, t.weight)) for t in layer.tables]
    out += [weight_bytes(gpu, p) for p in layer.projs]
    return out
