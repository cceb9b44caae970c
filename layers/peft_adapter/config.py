"""A PEFT adapter folder's names and ``adapter_config.json``: the file names, the module names
taken for the embedding and the LM head, the loader's error type, and the config's fields this
loader reads (checked as they are read). Provenance: docs/adapters.md."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"
DEFAULT_EMBED_NAMES = ("embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings")
DEFAULT_LM_HEAD_NAMES = ("lm_head", "embed_out")
EMBED, LM_HEAD = "embedding", "LM head"


class PeftAdapterError(ValueError):
    """A PEFT adapter folder this loader cannot turn into an overlay (malformed, inconsistent,
    or nothing an overlay can serve); raised before anything is built or uploaded."""


def _id_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise PeftAdapterError(f"{CONFIG_NAME}: {what} must be a list of integers, got {value!r:.200}")
    if not value:
        raise PeftAdapterError(f"{CONFIG_NAME}: {what} is empty")
    return value


def _str_list(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise PeftAdapterError(f"{CONFIG_NAME}: {what} must be a list of module names, got {value!r:.200}")
    return value


@dataclass(frozen=True)
class _Config:
    peft_type: str
    token_indices: list[int] | None  # TRAINABLE_TOKENS
    target_modules: list[str] | str | None  # TRAINABLE_TOKENS: list, or a regex string
    tt_list: list[int] | None  # trainable_token_indices as a list
    tt_dict: dict[str, list[int]] | None  # ... as {module: ids}
    modules_to_save: list[str]
    ensure_weight_tying: bool

    @classmethod
    def read(cls, path: Path) -> _Config:
        try:
            cfg = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PeftAdapterError(f"malformed {path} ({e})") from None
        if not isinstance(cfg, dict):
            raise PeftAdapterError(f"{path}: not a JSON object")
        peft_type = cfg.get("peft_type")
        if not isinstance(peft_type, str) or not peft_type:
            raise PeftAdapterError(f"{path}: no peft_type (not a PEFT adapter config?)")
        peft_type = peft_type.upper()
        token_indices = target_modules = tt_list = tt_dict = None
        if peft_type == "TRAINABLE_TOKENS":
            token_indices = _id_list(cfg.get("token_indices"), "token_indices")
            target_modules = cfg.get("target_modules")
            if not (target_modules is None or isinstance(target_modules, str)):
                target_modules = _str_list(target_modules, "target_modules")
        tti = cfg.get("trainable_token_indices")
        if isinstance(tti, dict):
            if not tti:
                raise PeftAdapterError(f"{CONFIG_NAME}: trainable_token_indices is an empty dict")
            tt_dict = {}
            for k, v in tti.items():
                if not k:
                    raise PeftAdapterError(f"{CONFIG_NAME}: trainable_token_indices has an empty module name")
                tt_dict[k] = _id_list(v, f"trainable_token_indices[{k!r}]")
        elif tti is not None:
            tt_list = _id_list(tti, "trainable_token_indices")
        mts = _str_list(cfg.get("modules_to_save"), "modules_to_save")
        return cls(
            peft_type, token_indices, target_modules, tt_list, tt_dict, mts, bool(cfg.get("ensure_weight_tying", False))
        )
