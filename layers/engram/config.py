"""``EngramConfig``: the Engram geometry of a DeepSeek-V4.1 ``config.json`` (``docs/ENGRAM.md``), with the
hash's primes, offsets and multipliers computed as the model's reference code computes them.

Keys (in ``text_config`` where the config has one, else at the top): ``engram_layer_ids``,
``engram_num_embeddings``, ``engram_max_ngram_size``, ``engram_n_heads``, ``engram_head_dim``,
``engram_vocab_size`` (where the prime search starts, not a size), ``engram_pad_token_id`` or
``engram_pad_id``, ``engram_compressed_vocab_size``, ``hidden_size``, ``hc_mult``, ``rms_norm_eps`` or
``norm_eps``, ``vocab_size``, ``image_token_id`` (optional); ``quantization_config`` (optional) must
give 32x32 weight blocks and ue8m0 scales. A bad key is a ``TypeError`` or ``ValueError`` naming it;
``from_pretrained`` raises ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpu_runtime import validate

from ..model_folder import CONFIG, read_config
from ..ngram_store.errors import CheckpointError

BLOCK = 32  # fp8 scale block: one e8m0 scale per 32 columns of a row, per 32x32 block of wkv
_INT64_MAX = 2**63 - 1
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic for n < 3.3e24

# config key of each field (messages name the key a user can find in the file)
_KEYS = {
    "layer_ids": "engram_layer_ids",
    "num_embeddings": "engram_num_embeddings",
    "max_ngram": "engram_max_ngram_size",
    "n_heads": "engram_n_heads",
    "head_dim": "engram_head_dim",
    "engram_vocab_size": "engram_vocab_size",
    "pad_token_id": "engram_pad_token_id",
    "compressed_vocab_size": "engram_compressed_vocab_size",
    "hidden_size": "hidden_size",
    "hc_mult": "hc_mult",
    "eps": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_SPELLINGS = {"pad_token_id": ("engram_pad_token_id", "engram_pad_id"), "eps": ("rms_norm_eps", "norm_eps")}

# DeepSeek-V4.1-Flash's config.json: the Engram keys of its text_config, and its quantization_config
# (copy before changing: ``{**V41_FLASH_TEXT, ...}``)
V41_FLASH_TEXT: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_vocab_size": 16000000,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "hidden_size": 5120,
    "hc_mult": 4,
    "rms_norm_eps": 1e-20,
    "vocab_size": 129280,
    "image_token_id": 129264,
}
V41_FLASH_QUANT: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [32, 32],
}


def is_prime(n: int) -> bool:
    """Whether ``n`` is prime: Miller-Rabin over the first twelve primes, exact below 3.3e24."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_primes(after: int, count: int) -> list[int]:
    """The ``count`` smallest primes above ``after``. The reference restarts its search at
    ``engram_vocab_size - 1`` for every bucket and skips primes already taken: the same list."""
    out: list[int] = []
    n = after
    while len(out) < count:
        n += 1
        if is_prime(n):
            out.append(n)
    return out


def _int(value: Any, key: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{key} must be an int, got {type(value).__name__} {value!r}")
    if not low <= value <= _INT64_MAX:
        raise ValueError(f"{key} must be an int in [{low}, 2**63), got {value}")
    return value


def _ints(value: Any, key: str, low: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{key} must be a list of ints, got {type(value).__name__} {value!r}")
    if not value:
        raise ValueError(f"{key} is empty")
    return tuple(_int(v, f"{key}[{i}]", low) for i, v in enumerate(value))


@dataclass(frozen=True)
class EngramConfig:
    """The Engram geometry (see the module docstring for the keys), checked when built; the derived
    arrays (read-only int64) are ``primes`` and ``offsets`` ``[layers, n_hash_cols]`` (column order:
    n-gram order 2..max_ngram, then head) and ``multipliers`` ``[layers, max_ngram]``."""

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]
    max_ngram: int
    n_heads: int
    head_dim: int
    engram_vocab_size: int
    pad_token_id: int
    compressed_vocab_size: int
    hidden_size: int
    hc_mult: int
    eps: float
    vocab_size: int
    image_token_id: int | None = None
    block_size: int = BLOCK
    primes: np.ndarray = field(init=False, repr=False, compare=False)
    offsets: np.ndarray = field(init=False, repr=False, compare=False)
    multipliers: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        k = _KEYS
        layer_ids = _ints(self.layer_ids, k["layer_ids"], 0)
        rows = _ints(self.num_embeddings, k["num_embeddings"], 1)
        object.__setattr__(self, "layer_ids", layer_ids)
        object.__setattr__(self, "num_embeddings", rows)
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"{k['layer_ids']} {list(layer_ids)} names a layer twice")
        if len(rows) != len(layer_ids):
            raise ValueError(
                f"{k['num_embeddings']} has {len(rows)} entries, {k['layer_ids']} {len(layer_ids)}: one table per layer"
            )
        _int(self.max_ngram, k["max_ngram"], 2)
        for name in ("n_heads", "head_dim", "engram_vocab_size", "compressed_vocab_size", "hidden_size", "hc_mult"):
            _int(getattr(self, name), k[name], 1)
        vocab = _int(self.vocab_size, k["vocab_size"], 1)
        if self.head_dim % BLOCK:
            raise ValueError(f"{k['head_dim']} = {self.head_dim} is not a multiple of the {BLOCK}-column scale block")
        if self.compressed_vocab_size > vocab:
            raise ValueError(
                f"{k['compressed_vocab_size']} = {self.compressed_vocab_size} exceeds vocab_size = {vocab} "
                "(compression maps the vocabulary onto fewer ids)"
            )
        if _int(self.pad_token_id, k["pad_token_id"], 0) >= vocab:
            raise ValueError(f"{k['pad_token_id']} = {self.pad_token_id} is not below vocab_size = {vocab}")
        if self.image_token_id is not None and _int(self.image_token_id, "image_token_id", 0) >= vocab:
            raise ValueError(f"image_token_id = {self.image_token_id} is not below vocab_size = {vocab}")
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"{k['eps']} must be a number, got {type(eps).__name__} {eps!r}")
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"{k['eps']} must be a finite number > 0, got {eps}")
        if _int(self.block_size, "quantization_config.weight_block_size", 1) != BLOCK:
            raise ValueError(f"quantization_config.weight_block_size: blocks of {self.block_size}; served: {BLOCK}")

        cols = self.n_hash_cols
        flat = next_primes(self.engram_vocab_size - 1, len(layer_ids) * cols)
        for i, (layer, want) in enumerate(zip(layer_ids, rows)):
            got = sum(flat[i * cols : (i + 1) * cols])  # Python ints: checked before int64 holds them
            if got != want:
                raise ValueError(
                    f"{k['num_embeddings']}[{i}] = {want} rows for layer {layer}, but its {cols} prime buckets "
                    f"(from {k['engram_vocab_size']} = {self.engram_vocab_size}) sum to {got}"
                )
        primes = np.array(flat, np.int64).reshape(len(layer_ids), cols)
        offsets = np.zeros_like(primes)
        offsets[:, 1:] = np.cumsum(primes, axis=1)[:, :-1]
        bound = max(1, _INT64_MAX // self.compressed_vocab_size // 2)  # t * multiplier cannot overflow int64
        multipliers = np.stack(
            [
                np.random.default_rng(10007 * layer).integers(0, bound, size=self.max_ngram, dtype=np.int64) * 2 + 1
                for layer in layer_ids
            ]
        )
        for name, array in (("primes", primes), ("offsets", offsets), ("multipliers", multipliers)):
            array.flags.writeable = False
            object.__setattr__(self, name, array)

    # ---- derived sizes ------------------------------------------------------------------------
    @property
    def n_hash_cols(self) -> int:
        """Rows per token per layer: ``(max_ngram - 1) * n_heads``."""
        return (self.max_ngram - 1) * self.n_heads

    @property
    def emb_dim(self) -> int:
        """Width of a token's gathered rows, the ``wkv`` input: ``n_hash_cols * head_dim``."""
        return self.n_hash_cols * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of ``wkv``'s output: ``hc_mult`` keys and one value, ``(hc_mult + 1) * hidden_size``."""
        return (self.hc_mult + 1) * self.hidden_size

    @property
    def scale_cols(self) -> int:
        """e8m0 scales per table row: ``head_dim // 32``."""
        return self.head_dim // BLOCK

    def index(self, layer: int) -> int:
        """The position of decoder layer ``layer`` in ``layer_ids`` (the row of ``primes`` ...)."""
        layer = validate.integer(layer, "layer")
        if layer not in self.layer_ids:
            raise ValueError(f"layer {layer} has no Engram ({_KEYS['layer_ids']} {list(self.layer_ids)})")
        return self.layer_ids.index(layer)

    # ---- reading ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> EngramConfig:
        """The geometry of a parsed ``config.json``: its ``text_config`` where it has one."""
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        section = config.get("text_config", config)
        if not isinstance(section, dict):
            raise TypeError(f"text_config must be an object, got {type(section).__name__}")

        def lookup(*keys: str, required: bool = True) -> Any:
            found = {key: section[key] for key in keys if section.get(key) is not None}
            if len({repr(v) for v in found.values()}) > 1:
                raise ValueError(f"{' and '.join(f'{k} = {v!r}' for k, v in found.items())} disagree")
            if not found and required:
                raise ValueError(f"missing key {' or '.join(map(repr, keys))}")
            return next(iter(found.values()), None)

        values = {name: lookup(*_SPELLINGS.get(name, (key,))) for name, key in _KEYS.items()}
        for name in ("layer_ids", "num_embeddings"):
            if isinstance(values[name], list):
                values[name] = tuple(values[name])
        image = section.get("image_token_id", config.get("image_token_id"))
        quant = section.get("quantization_config", config.get("quantization_config"))
        return cls(**values, image_token_id=image, block_size=_block_size(quant))

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> EngramConfig:
        """The geometry of a model folder's ``config.json``; ``CheckpointError`` naming the file."""
        config = read_config(model_dir)
        try:
            return cls.from_dict(config)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"{Path(model_dir) / CONFIG}: {err}") from None


def _block_size(quant: Any) -> int:
    """The fp8 block of ``quantization_config`` (32 where it is absent or gives none)."""
    if quant is None:
        return BLOCK
    if not isinstance(quant, dict):
        raise TypeError(f"quantization_config must be an object, got {type(quant).__name__}")
    scale_fmt = quant.get("scale_fmt")
    if scale_fmt is not None and scale_fmt != "ue8m0":
        raise ValueError(f"quantization_config.scale_fmt = {scale_fmt!r}; served: 'ue8m0' (power-of-two scales)")
    block = quant.get("weight_block_size")
    if block is None:
        return BLOCK
    if not isinstance(block, list) or len(block) != 2 or any(type(b) is not int for b in block):
        raise TypeError(f"quantization_config.weight_block_size must be a list of two ints, got {block!r}")
    if block != [BLOCK, BLOCK]:
        raise ValueError(f"quantization_config.weight_block_size = {block}; served: [{BLOCK}, {BLOCK}]")
    return BLOCK
