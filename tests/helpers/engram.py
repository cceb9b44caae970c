"""Engram configs and model folders for tests: DeepSeek-V4.1-Flash's real ``config.json`` (Engram keys,
in both spellings), tiny geometries whose table sizes are computed from their primes, and tiny
synthetic checkpoint folders written with the ``safetensors`` package (real tensor names and dtypes,
random finite fp8 bytes, e8m0 scale bytes in 120..134)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from layers.engram.checkpoint import EMBED, EMBED_SCALE, K_WEIGHT, Q_WEIGHT, WKV, WKV_SCALE
from layers.engram.config import BLOCK, V41_FLASH_QUANT, V41_FLASH_TEXT, EngramConfig, next_primes
from layers.engram.token_map import TokenMap
from tests.helpers import random_bf16, random_fp8

REAL_TEXT_CONFIG = V41_FLASH_TEXT  # DeepSeek-V4.1-Flash's (docs/ENGRAM.md); copied before use
QUANTIZATION = V41_FLASH_QUANT
_INFERENCE_SPELLING = {"engram_pad_token_id": "engram_pad_id", "rms_norm_eps": "norm_eps"}


def real_config(spelling: str = "hf") -> dict:
    """The real ``config.json`` (Engram part) with ``text_config``; ``spelling="inference"`` names
    the pad and eps keys as the reference's inference config does (``engram_pad_id``, ``norm_eps``)."""
    text = dict(REAL_TEXT_CONFIG)
    if spelling == "inference":
        text = {_INFERENCE_SPELLING.get(k, k): v for k, v in text.items()}
    elif spelling != "hf":
        raise ValueError(f"spelling must be 'hf' or 'inference', got {spelling!r}")
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
            "quantization_config": dict(QUANTIZATION)}


def tiny_config(**changes) -> dict:
    """A ``config.json`` of the real layout at toy size (``changes`` replace text_config keys):
    layers 1 and 3, orders 2..4, 2 heads of 64 columns, primes from 100; ``engram_num_embeddings``
    is computed from the primes unless ``changes`` gives it."""
    text = {"model_type": "deepseek_v41_text", "engram_layer_ids": [1, 3], "engram_max_ngram_size": 4,
            "engram_n_heads": 2, "engram_head_dim": 64, "engram_vocab_size": 100, "engram_pad_token_id": 2,
            "engram_compressed_vocab_size": 40, "hidden_size": 32, "hc_mult": 2, "rms_norm_eps": 1e-6,
            "vocab_size": 50, "image_token_id": 49, **changes}
    if "engram_num_embeddings" not in changes:
        cols = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"]
        primes = next_primes(text["engram_vocab_size"] - 1, len(text["engram_layer_ids"]) * cols)
        layers = len(text["engram_layer_ids"])
        text["engram_num_embeddings"] = [sum(primes[i * cols:(i + 1) * cols]) for i in range(layers)]
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
            "quantization_config": dict(QUANTIZATION)}


def tiny(**changes) -> EngramConfig:
    """``EngramConfig`` of ``tiny_config(**changes)``."""
    return EngramConfig.from_dict(tiny_config(**changes))


def with_multipliers(cfg: EngramConfig, multipliers) -> EngramConfig:
    """A copy of ``cfg`` whose hash multipliers are ``multipliers`` ([layers, max_ngram]): small
    ones for hashes worked out by hand."""
    out = copy.copy(cfg)
    m = np.array(multipliers, np.int64).reshape(cfg.multipliers.shape)
    m.flags.writeable = False
    object.__setattr__(out, "multipliers", m)
    return out


def scale_bytes(rng: np.random.Generator, shape) -> np.ndarray:
    """e8m0 scales 2^-7 .. 2^7 (bytes 120..134) as ``ml_dtypes.float8_e8m0fnu``."""
    return rng.integers(120, 135, shape, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)


def make_tensors(rng: np.random.Generator, cfg: EngramConfig) -> dict[str, np.ndarray]:
    """Every Engram tensor of ``cfg`` by its checkpoint name, random (finite fp8, sane scales)."""
    out = {}
    k, e = cfg.kv_dim, cfg.emb_dim
    for rows, layer in zip(cfg.num_embeddings, cfg.layer_ids):
        out[EMBED.format(layer)] = random_fp8(rng, (rows, cfg.head_dim))
        out[EMBED_SCALE.format(layer)] = scale_bytes(rng, (rows, cfg.scale_cols))
        out[WKV.format(layer)] = random_fp8(rng, (k, e))
        out[WKV_SCALE.format(layer)] = scale_bytes(rng, (-(-k // BLOCK), e // BLOCK))
        out[Q_WEIGHT.format(layer)] = random_bf16(rng, (cfg.hc_mult, cfg.hidden_size))
        out[K_WEIGHT.format(layer)] = random_bf16(rng, (cfg.hc_mult, cfg.hidden_size))
    return out


@dataclass
class EngramModel:
    """A written folder: its path, config dict and the tensors it holds (by name)."""

    path: Path
    config: dict
    tensors: dict[str, np.ndarray]


def write_model(path: Path, rng: np.random.Generator, config: dict | None = None, *, sharded: bool = True,
                tensors: dict[str, np.ndarray] | None = None) -> EngramModel:
    """Write a model folder: ``config.json`` and either ``model.safetensors`` or, with an index,
    three shards: layer 1's tensors beside an unrelated one, the other layers', and a third that
    is not a safetensors file (only an unrelated tensor maps there: a loader must not open it).
    ``tensors`` (default: ``make_tensors`` of the config) is written as given: drop or replace
    entries to break it."""
    from safetensors.numpy import save_file  # the test extra: an independent writer, F8_E8M0 included

    config = copy.deepcopy(config or tiny_config())
    if tensors is None:
        tensors = make_tensors(rng, EngramConfig.from_dict(config))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    unrelated = {"embed.weight": random_bf16(rng, (4, 8))}
    if not sharded:
        save_file({**unrelated, **tensors}, str(path / "model.safetensors"))
        return EngramModel(path, config, tensors)
    layer_1 = {n: a for n, a in tensors.items() if n.startswith("layers.1.")}
    shards = {"model-00001-of-00003.safetensors": {**unrelated, **layer_1},
              "model-00002-of-00003.safetensors": {n: a for n, a in tensors.items() if n not in layer_1}}
    for name, content in shards.items():
        save_file(content, str(path / name))
    weight_map = {n: f for f, content in shards.items() for n in content}
    garbage = "model-00003-of-00003.safetensors"
    (path / garbage).write_bytes(b"\xff" * 64)
    weight_map["head.weight"] = garbage
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return EngramModel(path, config, tensors)


def token_map(rng: np.random.Generator, cfg: EngramConfig) -> TokenMap:
    """A map of ``cfg.vocab_size`` ids onto ``compressed_vocab_size``: the first ids in order, the
    rest random (several ids share a compressed id, as normalised tokens do)."""
    c = cfg.compressed_vocab_size
    ids = np.concatenate([np.arange(c), rng.integers(0, c, cfg.vocab_size - c)]).astype(np.int32)
    return TokenMap(ids)


def arrays(rng: np.random.Generator, cfg: EngramConfig) -> dict:
    """Every Engram tensor of ``cfg`` (``make_tensors``) grouped as ``EngramWeights.from_arrays``
    takes them: tables, wkv, q, k, one entry per layer."""
    t = make_tensors(rng, cfg)
    layers = cfg.layer_ids
    return {
        "tables": [(t[f"layers.{L}.engram.embed.weight"], t[f"layers.{L}.engram.embed.scale"]) for L in layers],
        "wkv": [(t[f"layers.{L}.engram.wkv.weight"], t[f"layers.{L}.engram.wkv.scale"]) for L in layers],
        "q": [t[f"layers.{L}.engram.q_weight"] for L in layers],
        "k": [t[f"layers.{L}.engram.k_weight"] for L in layers],
    }
