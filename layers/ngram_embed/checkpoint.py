"""The n-gram embedding of a LongCat-Flash-Lite-style Hugging Face model folder, checked before
anything is uploaded (``NgramWeights.from_pretrained``; table files: ``table_manifest``).

Reads ``config.json`` (``vocab_size``, ``hidden_size``, ``emb_neighbor_num``, ``emb_split_num``,
``ngram_vocab_size_ratio``, ``eos_token_id``: an int or a list of one) and the safetensors headers
(one file or an index) of ``WORD_NAMES``, ``TABLE_NAME``, ``SCALE_NAMES``, ``PROJ_NAME``; returns
``NgramDims`` and an ``NgramCheckpoint`` mapped only on demand (F16/F32 word table and projections
rounded to bf16, nearest even). Raises ``CheckpointError`` for: a missing key or tensor, a shape the
config disagrees with, F16/F32 tables (``layers.ngram_embed.convert`` them), fp8 tables without
per-row scales, several EOS ids, LongCat-Next's ``text_vocab_size`` (unless it equals
``vocab_size``), any of LongCat-2.0's ``oe_*`` keys.
Provenance: docs/checkpoints.md
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from gpu_runtime import validate

from ..dense_weight import BF16
from ..model_folder import CONFIG, TensorRef, Tensors, expect, read_config
from ..ngram_store.errors import CheckpointError
from .dims import NgramDims

WORD_NAMES = ("model.embed_tokens.weight", "model.ngram_embeddings.word_embeddings.weight")
TABLE_NAME = "model.ngram_embeddings.embedders.{}.weight"
SCALE_NAMES = ("model.ngram_embeddings.embedders.{}.weight_scale", "model.ngram_embeddings.embedders.{}.row_scale")
PROJ_NAME = "model.ngram_embeddings.post_projs.{}.weight"

_DENSE_DTYPES = ("BF16", "F16", "F32")  # word table and projections: F16/F32 become bf16 on load
_WIDE_TABLE_DTYPES = ("F16", "F32")  # the converter reads these; from_pretrained refuses them
_SCALE_DTYPES = ("F32", "BF16", "F16")


# ---- config.json (read by layers.model_folder) -------------------------------------------------
def _config_int(config: dict, key: str, where: str, low: int) -> int:
    if key not in config or config[key] is None:
        raise CheckpointError(f"{where}: missing key {key!r}")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CheckpointError(f"{where}: {key} must be an int >= {low}, got {value!r}")
    return value


def config_eos(config: dict, where: str = CONFIG) -> int:
    """``eos_token_id`` of ``config.json``: an int, or a list of one (or of one id repeated)."""
    if config.get("eos_token_id") is None:
        raise CheckpointError(
            f"{where}: missing key 'eos_token_id' (the n-gram look-back boundary); pass eos_id= to give it"
        )
    value = config["eos_token_id"]
    ids = value if isinstance(value, list) else [value]
    if not ids or any(isinstance(v, bool) or not isinstance(v, int) for v in ids):
        raise CheckpointError(f"{where}: eos_token_id must be an int or a list of ints, got {value!r}")
    if len(set(ids)) != 1:
        raise CheckpointError(
            f"{where}: eos_token_id lists {len(set(ids))} ids {value}; the n-gram "
            "boundary is one token: pass eos_id= to choose it"
        )
    return ids[0]


def dims_from_config(
    config: dict, *, eos_id: int | None = None, where: str = CONFIG, require_eos: bool = True
) -> NgramDims:
    """``NgramDims.longcat_flash`` of a config (see the module docstring for the keys);
    ``eos_id`` overrides ``eos_token_id``. ``require_eos=False`` (the converter, which never
    hashes) does not read the EOS: the dims have ``eos_id`` (None unless given)."""
    longcat2 = sorted(key for key in config if key.startswith("oe_"))
    if longcat2:  # its n-gram settings and special-token exclusions, with or without emb_* beside them
        raise CheckpointError(f"{where}: LongCat-2.0's keys {longcat2} are not served by this loader")
    v = _config_int(config, "vocab_size", where, 1)
    d = _config_int(config, "hidden_size", where, 1)
    n = _config_int(config, "emb_neighbor_num", where, 2)
    k = _config_int(config, "emb_split_num", where, 1)
    if config.get("ngram_vocab_size_ratio") is None:
        raise CheckpointError(f"{where}: missing key 'ngram_vocab_size_ratio'")
    ratio = config["ngram_vocab_size_ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio <= 0:
        raise CheckpointError(f"{where}: ngram_vocab_size_ratio must be a number > 0, got {ratio!r}")
    text_vocab = config.get("text_vocab_size")
    if text_vocab is not None and text_vocab != v:
        raise CheckpointError(
            f"{where}: text_vocab_size {text_vocab} != vocab_size {v} (LongCat-Next's "
            "separate hash vocabulary is not supported)"
        )
    if eos_id is None and require_eos:
        eos_id = config_eos(config, where)
    try:
        return NgramDims.longcat_flash(v, d, n, k, ratio, eos_id)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: {err}") from None


# ---- the safetensors files (found and mapped by layers.model_folder) --------------------------
@dataclass(frozen=True)
class NgramCheckpoint:
    """The n-gram embedding of a model folder, every tensor found and checked against the config
    (headers only: nothing is mapped before an ``*_array`` call). ``parts`` says which tensors
    were wanted: ``"all"``, ``"tables"`` (the converter) or ``"dense"`` (word table and
    projections: the tables come from table files)."""

    model_dir: Path
    config: dict[str, Any]
    dims: NgramDims
    word: TensorRef | None
    projs: tuple[TensorRef, ...]
    tables: tuple[TensorRef, ...]
    scales: tuple[TensorRef | None, ...]
    shards: tuple[Path, ...]  # the files whose headers were read

    def __new__(cls, *args: Any, **kwargs: Any) -> NgramCheckpoint:
        if len(args) == 1 and not kwargs and isinstance(args[0], (str, os.PathLike)):
            raise TypeError(f"NgramCheckpoint({args[0]!r}): read a model folder with NgramCheckpoint.open(path)")
        return super().__new__(cls)

    @classmethod
    def open(
        cls, model_dir: str | os.PathLike, *, eos_id: int | None = None, parts: str = "all", wide_tables: bool = False
    ) -> NgramCheckpoint:
        """Read config, index and the needed shards' headers; raise ``CheckpointError`` for a
        missing tensor, a shape that disagrees with the config or a dtype that cannot be served.
        ``wide_tables`` accepts F16/F32 tables (the converter narrows them)."""
        if parts not in ("all", "tables", "dense"):
            raise ValueError(f"parts must be 'all', 'tables' or 'dense', got {parts!r}")
        model_dir = Path(model_dir)
        config = read_config(model_dir)
        where = str(model_dir / CONFIG)
        dims = dims_from_config(config, eos_id=eos_id, where=where, require_eos=parts != "tables")
        tensors = Tensors(model_dir)
        t, d, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
        word, projs, tables, scales = None, [], [], []
        if parts in ("all", "dense"):
            word = next((r for r in map(tensors.find, WORD_NAMES) if r is not None), None)
            if word is None:
                raise CheckpointError(f"{tensors.source}: no word table (tried {', '.join(WORD_NAMES)})")
            expect(word, (dims.vocab_size, d), _DENSE_DTYPES, "vocab_size, hidden_size")
            for c in range(t):
                proj = tensors.get(PROJ_NAME.format(c))
                expect(proj, (d, td), _DENSE_DTYPES, f"hidden_size, hidden_size // {t} tables")
                projs.append(proj)
        if parts in ("all", "tables"):
            table_dtypes = ("BF16", "F8_E4M3") + (_WIDE_TABLE_DTYPES if wide_tables else ())
            for c in range(t):
                rows = dims.table_rows(c)
                table = tensors.get(TABLE_NAME.format(c))
                if table.shape == (rows, td) and table.dtype in _WIDE_TABLE_DTYPES and not wide_tables:
                    raise CheckpointError(
                        f"{table.where()} is {table.dtype}: tables are served as bf16 "
                        "or fp8 with scales; convert them with python -m "
                        "layers.ngram_embed.convert MODEL_DIR OUT_DIR and load with "
                        "table_dir=OUT_DIR"
                    )
                expect(
                    table,
                    (rows, td),
                    table_dtypes,
                    f"int({config['ngram_vocab_size_ratio']} * {dims.vocab_size}) + 2*{c} + 1 rows, "
                    f"hidden_size // {t} columns",
                )
                scale = next((r for r in (tensors.find(s.format(c)) for s in SCALE_NAMES) if r is not None), None)
                if table.dtype == "F8_E4M3":
                    if scale is None:
                        raise CheckpointError(
                            f"{table.where()} is F8_E4M3 without its per-row scales "
                            f"(tried {', '.join(s.format(c) for s in SCALE_NAMES)})"
                        )
                    if scale.shape not in ((rows,), (rows, 1)):
                        raise CheckpointError(
                            f"{scale.where()} has shape {list(scale.shape)}, one scale "
                            f"per row needs [{rows}] or [{rows}, 1]"
                        )
                    if scale.dtype not in _SCALE_DTYPES:
                        raise CheckpointError(f"{scale.where()} is {scale.dtype}; served: {', '.join(_SCALE_DTYPES)}")
                elif scale is not None:
                    raise CheckpointError(
                        f"{scale.where()}: per-row scales for a {table.dtype} table (only F8_E4M3 tables have them)"
                    )
                tables.append(table)
                scales.append(scale)
        return cls(model_dir, config, dims, word, tuple(projs), tuple(tables), tuple(scales), tuple(tensors.headers))

    # -- arrays (mapped; converted where the module docstring says) ----------------------------
    # Each raises ValueError where the checkpoint was opened without those tensors (``parts``); the
    # index-taking ones TypeError for a ``c`` that is not an int (a bool neither), ValueError for one
    # outside ``0..T-1`` (negative too).
    def word_array(self) -> np.ndarray:
        """The word table ``[vocab, D]`` as bf16, mapped from its file (an F16/F32 table is converted,
        one rounding to nearest even). Needs the word table, i.e. ``parts`` other than ``"tables"``."""
        if self.word is None:
            raise ValueError("NgramCheckpoint.word_array: opened with parts='tables', without the word table")
        return _as_bf16(self.word.array())

    def proj_array(self, c: int) -> np.ndarray:
        """Projection ``c`` (``[D, table width]``) as bf16, mapped from its file (an F16/F32 one is
        converted, one rounding to nearest even). Needs ``parts`` other than ``"tables"``."""
        return _as_bf16(self.projs[self._index(c, self.projs, "proj_array", "projections", "tables")].array())

    def table_arrays(self, c: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Table ``c`` as mapped (bf16, fp8, or for the converter F16/F32) and its f32 scales.
        Needs ``parts`` other than ``"dense"``."""
        c = self._index(c, self.tables, "table_arrays", "tables", "dense")
        scale = self.scales[c]
        if scale is None:
            return self.tables[c].array(), None
        s = scale.array().reshape(-1)
        return self.tables[c].array(), np.ascontiguousarray(s, dtype=np.float32)  # exact upcast

    @staticmethod
    def _index(c: Any, refs: tuple[TensorRef, ...], method: str, kind: str, parts: str) -> int:
        """``c`` as an index of ``refs`` (the checkpoint's ``kind``, absent when opened with ``parts``)."""
        where = f"NgramCheckpoint.{method}"
        c = validate.integer(c, f"{where}: c")
        if not refs:
            raise ValueError(f"{where}: opened with parts={parts!r}, without the {kind}")
        if not 0 <= c < len(refs):
            raise ValueError(f"{where}: c = {c} outside 0..{len(refs) - 1} (the checkpoint's {len(refs)} {kind})")
        return c


def _as_bf16(array: np.ndarray) -> np.ndarray:
    if array.dtype == BF16:
        return array
    return array.astype(np.float32).astype(ml_dtypes.bfloat16)  # via exact f32; one rounding, nearest even
