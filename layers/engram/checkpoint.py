"""``EngramCheckpoint``: the Engram tensors of a DeepSeek-V4.1 model folder, found by name and checked
against its ``config.json`` before anything is mapped (``docs/ENGRAM.md``).

Per Engram layer ``L`` (``EngramConfig``: R rows, width W = head_dim, E = emb_dim, K = kv_dim, H =
hidden_size): ``layers.L.engram.embed.weight`` F8_E4M3 ``[R, W]`` and ``.embed.scale`` F8_E8M0
``[R, W/32]``; ``.wkv.weight`` F8_E4M3 ``[K, E]`` and ``.wkv.scale`` F8_E8M0 ``[ceil(K/32), E/32]``;
``.q_weight`` and ``.k_weight`` BF16 ``[hc_mult, H]``. Every array is a read-only memory map of its
file (e8m0 scales as their raw bytes, ``uint8``): no table is read into memory. A missing tensor,
a wrong dtype or shape is a ``CheckpointError`` naming the tensor and its file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpu_runtime import validate

from ..model_folder import TensorRef, Tensors, as_path, expect
from ..ngram_store.errors import CheckpointError
from .config import BLOCK, EngramConfig

EMBED = "layers.{}.engram.embed.weight"
EMBED_SCALE = "layers.{}.engram.embed.scale"
WKV = "layers.{}.engram.wkv.weight"
WKV_SCALE = "layers.{}.engram.wkv.scale"
Q_WEIGHT = "layers.{}.engram.q_weight"
K_WEIGHT = "layers.{}.engram.k_weight"

E8M0_NAN = 255  # the one e8m0 byte that is not a power of two


@dataclass(frozen=True)
class EngramCheckpoint:
    """The Engram tensors of a model folder (see the module docstring), every one found and checked
    by ``open``; ``tensors`` maps each name to its file and header entry, ``shards`` lists the files
    whose headers were read. The array methods take a decoder layer of ``config.layer_ids``."""

    model_dir: Path
    config: EngramConfig
    tensors: dict[str, TensorRef]
    shards: tuple[Path, ...]

    @classmethod
    def open(cls, model_dir: str | os.PathLike) -> EngramCheckpoint:
        """Read ``config.json``, the index or single file and the headers of the shards holding
        Engram tensors; ``CheckpointError`` for anything missing or not as the config gives it."""
        model_dir = as_path(model_dir, "model_dir")
        cfg = EngramConfig.from_pretrained(model_dir)
        found = Tensors(model_dir)
        k, e = cfg.kv_dim, cfg.emb_dim
        refs = {}
        for i, layer in enumerate(cfg.layer_ids):
            rows = f"engram_num_embeddings[{i}]"
            wkv = "(hc_mult + 1) * hidden_size, (engram_max_ngram_size - 1) * engram_n_heads * engram_head_dim"
            specs = (
                (EMBED, (cfg.num_embeddings[i], cfg.head_dim), "F8_E4M3", f"{rows}, engram_head_dim"),
                (EMBED_SCALE, (cfg.num_embeddings[i], cfg.scale_cols), "F8_E8M0", f"{rows}, engram_head_dim / 32"),
                (WKV, (k, e), "F8_E4M3", wkv),
                (WKV_SCALE, (-(-k // BLOCK), e // BLOCK), "F8_E8M0", f"{wkv}, in {BLOCK}x{BLOCK} blocks"),
                (Q_WEIGHT, (cfg.hc_mult, cfg.hidden_size), "BF16", "hc_mult, hidden_size"),
                (K_WEIGHT, (cfg.hc_mult, cfg.hidden_size), "BF16", "hc_mult, hidden_size"),
            )
            for pattern, shape, dtype, why in specs:
                ref = found.get(pattern.format(layer))
                expect(ref, shape, (dtype,), why)
                if dtype == "F8_E8M0":
                    ref.check_bytes(1)
                refs[ref.name] = ref
        return cls(model_dir, cfg, refs, tuple(found.headers))

    def _ref(self, pattern: str, layer: int) -> TensorRef:
        self.config.index(layer)  # TypeError / ValueError for a layer without Engram
        return self.tensors[pattern.format(layer)]

    def table(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer ``layer``'s table: rows ``float8_e4m3fn [R, head_dim]`` and their scale bytes
        ``uint8 [R, head_dim / 32]`` (scale ``2^(byte - 127)``), both memory-mapped."""
        return self._ref(EMBED, layer).array(), self._ref(EMBED_SCALE, layer).byte_array()

    def wkv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer ``layer``'s projection: ``float8_e4m3fn [kv_dim, emb_dim]`` and its 32x32 block
        scale bytes ``uint8 [kv_dim / 32, emb_dim / 32]``, both memory-mapped."""
        return self._ref(WKV, layer).array(), self._ref(WKV_SCALE, layer).byte_array()

    def q_weight(self, layer: int) -> np.ndarray:
        """Layer ``layer``'s gate query weight, bf16 ``[hc_mult, hidden_size]``, memory-mapped."""
        return self._ref(Q_WEIGHT, layer).array()

    def k_weight(self, layer: int) -> np.ndarray:
        """Layer ``layer``'s gate key weight, bf16 ``[hc_mult, hidden_size]``, memory-mapped."""
        return self._ref(K_WEIGHT, layer).array()

    def scan_scales(self, layer: int, *, chunk_bytes: int = 1 << 24) -> None:
        """``CheckpointError`` naming the tensor, its file and the first row where layer ``layer``'s
        table or ``wkv`` scales hold the e8m0 byte 255 (NaN). Reads at most ``chunk_bytes`` (whole
        rows, one row at least) at a time into one buffer: nothing is mapped."""
        chunk_bytes = validate.positive(chunk_bytes, "EngramCheckpoint.scan_scales: chunk_bytes")
        for ref in (self._ref(EMBED_SCALE, layer), self._ref(WKV_SCALE, layer)):
            _scan(ref, chunk_bytes)


def _scan(ref: TensorRef, chunk_bytes: int) -> None:
    rows, cols = ref.shape
    step = max(1, chunk_bytes // max(cols, 1))
    buf = np.empty(step * cols, np.uint8)
    with ref.path.open("rb") as f:
        f.seek(ref.info.start)
        for first in range(0, rows, step):
            n = min(step, rows - first)
            chunk = buf[: n * cols]
            if f.readinto(chunk.data) != chunk.nbytes:
                raise CheckpointError(f"{ref.where()}: the file ends inside the tensor (truncated since opened?)")
            bad = chunk.reshape(n, cols) == E8M0_NAN
            if bad.any():
                r = int(np.argmax(bad.any(axis=1)))
                raise CheckpointError(
                    f"{ref.where()}: row {first + r} holds the e8m0 byte {E8M0_NAN} (NaN) in column "
                    f"{int(np.argmax(bad[r]))} (a scale is 2^(byte - 127); 255 is no power of two)"
                )
