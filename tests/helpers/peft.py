"""PEFT adapter folders written as PEFT writes them (``adapter_config.json`` with the real keys,
``adapter_model.safetensors`` with the real tensor names, float32 rows)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
H = 16  # the adapters' row width
P = "base_model.model."
EMBED = P + "model.embed_tokens"
LM = P + "lm_head"

_ST_DTYPES = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", BF16: "BF16", np.dtype("<f8"): "F64",
              np.dtype("<i8"): "I64", np.dtype("<i4"): "I32"}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """A safetensors file as ``safetensors.torch.save_file(tensors, path, metadata)`` writes it."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    blobs, offset = [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        header[name] = {"dtype": _ST_DTYPES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        blobs.append(arr.tobytes())
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def tt_config(token_indices: list[int], target_modules: Any = ("embed_tokens",), **over: Any) -> dict:
    """``TrainableTokensConfig(...).to_dict()``: target_modules as filled in before saving."""
    cfg = {"auto_mapping": None, "base_model_name_or_path": "tiny/llama-test", "inference_mode": True,
           "init_weights": True, "peft_type": "TRAINABLE_TOKENS", "revision": None,
           "target_modules": list(target_modules) if target_modules is not None else None,
           "task_type": "CAUSAL_LM", "token_indices": token_indices}
    cfg.update(over)
    return cfg


def save_adapter(path: Path, config: dict | None, tensors: dict[str, np.ndarray] | None) -> Path:
    """An adapter folder at ``path`` with this config and these tensors (either may be left out)."""
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if tensors is not None:
        write_safetensors(path / "adapter_model.safetensors", tensors)
    return path


def token_rows(rng, n: int, h: int = H) -> np.ndarray:
    """float32 rows as PEFT saves them, not bf16-exact (so the rounding is exercised)."""
    return rng.standard_normal((n, h)).astype(np.float32)
