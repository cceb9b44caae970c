"""LongCat-Flash-Lite-style Hugging Face model folders: the n-gram embedding's config and tensors,
validated before anything is uploaded (``NgramEmbedding.from_pretrained``; the converter's table
files are checked in ``table_manifest``, the layer is placed and built in ``pretrained``).

What the published model code does (read through the project's code index)
==========================================================================

Sources read:

* HF reference (remote code shipped with the model): ``modeling_longcat_ngram.py`` (Meituan, MIT;
  ``NgramEmbedding``, ``NgramCache``, ``LongcatFlashNgramModel``). The index holds a copy of it
  without naming its repository (found with the string ``update_ngram_context``).
* vLLM: ``vllm-project/vllm`` ``vllm/model_executor/models/longcat_flash_ngram.py`` (the
  ``NgramEmbedding`` module, ``LongcatNgramModelState``); its kernel
  ``csrc/libtorch_stable/ngram_embedding_kernels.cu`` and a kernel test that pins the EOS rule to
  the HF reference (``compute_eos_position_ngram_ids``) were read as copies the index does not
  attribute to a repository (the stored vllm-project/vllm model file predates that function).
* sglang: ``sgl-project/sglang`` ``python/sglang/srt/layers/n_gram_embedding.py``
  (``NgramEmbedding.load_weight``), ``python/sglang/srt/models/longcat_flash.py``
  (``LongcatFlashModel``, ``load_weights``), ``python/sglang/jit_kernel/csrc/ngram_embedding.cuh``;
  the config fields ``ngram_embedding_m = int(ngram_vocab_size_ratio * vocab_size)``,
  ``ngram_embedding_n = emb_neighbor_num``, ``ngram_embedding_k = emb_split_num`` are derived in
  ``python/sglang/srt/configs/longcat_flash.py`` (seen in a version of that file quoted elsewhere
  in the index; the version stored for the repository predates them).
* mlx-lm: ``ml-explore/mlx-lm`` ``mlx_lm/models/longcat_flash_ngram.py``.

Config keys (``config.json``): ``vocab_size`` (V), ``hidden_size`` (D), ``emb_neighbor_num`` (N,
the largest n-gram order), ``emb_split_num`` (K, tables per order), ``ngram_vocab_size_ratio``
(r) under these names in all four implementations (mlx-lm's ``ModelArgs`` defaults: N = 4,
K = 4, r = 78, an int; a vLLM LongCat-2.0 test uses r = 100.567); ``eos_token_id`` below.

Tables: ``T = K*(N-1)``, table ``i`` has ``int(r*V + 2*i + 1)`` rows (HF ``_init_ngram_embeddings``,
mlx-lm, vLLM ``sizes``; sglang ``int(m + i*2 + 1)`` with ``m = int(r*V)``): for ``r*V >= 0`` that
is ``int(r*V) + 2*i + 1``, ``NgramDims.longcat_flash``'s rows. Width ``D // T`` in all of them.
Table ``i`` is order ``n`` and split ``k`` with ``i = (n-2)*K + k`` (HF and mlx-lm ``index =
(i-2)*k + j``; vLLM and sglang ``mod = m + 2*((n-2)*K + k) + 1``), ``NgramDims.table_index``. Its
hash is ``sum_d tok[p-d] * (V**d mod M_i) mod M_i`` (HF ``_precompute_vocab_mods``, sglang and
vLLM ``pow(V, delta, mod)``), and the output is ``(word + sum_i proj_i(table_i)) / (1 + T)``: the
same function as ``layers.ngram_embed.ids`` and the layers here. dims.py agrees with all of them.

Tensor names (a ``model.`` prefix, as ``LongcatFlashNgramForCausalLM.model`` saves them):

* word table ``model.embed_tokens.weight`` ``[V, D]``: the HF model's ``embed_tokens``, which its
  ``NgramEmbedding`` holds as ``word_embeddings`` (one module, saved once); vLLM and sglang load
  it by ``.embed_tokens.``, mlx-lm renames ``model.embed_tokens.weight`` to
  ``model.ngram_embeddings.word_embeddings.weight`` (the name its own saved weights carry). Both
  names are accepted here, ``model.embed_tokens.weight`` first.
* tables ``model.ngram_embeddings.embedders.{i}.weight`` ``[rows_i, D // T]`` (``nn.Embedding``).
* projections ``model.ngram_embeddings.post_projs.{i}.weight`` ``[D, D // T]`` (``nn.Linear(td,
  D)``'s weight; sglang and vLLM transpose it into their stacked ``oe_projection``): this
  project's ``[D, table_dim]`` projections as they are.

Dtype: the published weights are bf16 (``torch_dtype`` ``bfloat16``; vLLM builds the stacked
tables in the config dtype). Nothing public ships fp8 tables; an int8 variant seen in an sglang
fork stores per-row scales as ``embedders.{i}.weight_scale``. Served here: bf16 tables, and
F8_E4M3 tables with per-row scales (``embedders.{i}.weight_scale`` or ``.row_scale``, ``[rows]``
or ``[rows, 1]``, F32 or an exact upcast from BF16/F16; value = fp8 * scale). F16/F32 tables are
refused (a 63 GB table would double in RAM): convert them with ``python -m
layers.ngram_embed.convert`` and load with ``table_dir=``. The word table and projections, which
are small, are converted from F16/F32 to bf16 on load (round to nearest even).

EOS: the HF reference calls ``_shift_right_ignore_eos(context, n - 1,
eos_token_id=self.config.eos_token_id)`` (one int, compared with ``==``), which cuts the context
into segments that each end with their EOS: a position's look-back stops at an EOS before it,
and an EOS position hashes its own look-back in full. That is ``NgramDims``' ``eos_id`` rule.
vLLM reads ``int(config.eos_token_id)``, stores EOS tokens negated in its token table and its
kernel stops at a negative entry, the position's own included, so in the stored version an EOS
position's ids lose their look-back; the later test around ``compute_eos_position_ngram_ids``
fixes them up to the reference. sglang passes ``config.eos_token_id`` to its kernel (a newer one
than the stored ``ngram_embedding.cuh``, which stops at negated "ignored" tokens the same way).
So the EOS is ``config.json``'s ``eos_token_id`` (an int, or a list of one id), not
``generation_config.json``'s stop tokens, which no n-gram code reads; a list of several distinct
ids is refused: pass ``eos_id=``. mlx-lm reads no EOS and has no boundary at all (its look-back
crosses EOS tokens): it disagrees with the reference after an EOS inside a context.

Not supported (refused where the config says so): LongCat-Next's separate ``text_vocab_size``
(hash base and table sizes from the text vocabulary, a bigger word table) and LongCat-2.0's
``oe_*`` keys and special-token exclusions.

Placement (``placement=``): ``"device"`` (``DenseWeight``), ``"host"`` (``HostWeight``: a copy in
mapped pinned memory, or the table file registered in place when ``table_dir`` is given),
``"files"`` (``RowCache`` over the table files of ``table_dir``, ``cache_rows`` rows resident),
one of those per table, or a device-memory budget in bytes (``DeviceBudget(n)`` or an int):
the word table, the projections, the fp8 scales of every table and the layer's staging always
go to the device; then tables ``0, 1, ...`` go to the device while the total stays within the
budget, and the rest to host memory. ``table_dir`` (written by ``layers.ngram_embed.convert``,
found through its manifest ``ngram_tables.json``) replaces the checkpoint's tables for every
placement: the checkpoint then only supplies the word table and the projections.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import ml_dtypes
import numpy as np

from .. import safetensors_io
from ..weight_map import BF16
from .dims import NgramDims

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

WORD_NAMES = ("model.embed_tokens.weight", "model.ngram_embeddings.word_embeddings.weight")
TABLE_NAME = "model.ngram_embeddings.embedders.{}.weight"
SCALE_NAMES = ("model.ngram_embeddings.embedders.{}.weight_scale",
               "model.ngram_embeddings.embedders.{}.row_scale")
PROJ_NAME = "model.ngram_embeddings.post_projs.{}.weight"

_DENSE_DTYPES = ("BF16", "F16", "F32")  # word table and projections: F16/F32 become bf16 on load
_WIDE_TABLE_DTYPES = ("F16", "F32")  # the converter reads these; from_pretrained refuses them
_SCALE_DTYPES = ("F32", "BF16", "F16")


class CheckpointError(ValueError):
    """A model folder, config, index, tensor or table file that cannot be served, named."""


# ---- config.json ------------------------------------------------------------------------------
def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_dir) / CONFIG
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {CONFIG} (not a Hugging Face model folder?)") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: a JSON {type(config).__name__}, not an object")
    return config


def _config_int(config: dict, key: str, where: str, low: int) -> int:
    if key not in config or config[key] is None:
        hint = ""
        if key.startswith("emb_") and ("oe_neighbor_num" in config or "oe_split_num" in config):
            hint = " (it has LongCat-2.0's oe_* keys, which this loader does not serve)"
        raise CheckpointError(f"{where}: missing key {key!r}{hint}")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CheckpointError(f"{where}: {key} must be an int >= {low}, got {value!r}")
    return value


def config_eos(config: dict, where: str = CONFIG) -> int:
    """``eos_token_id`` of ``config.json``: an int, or a list of one (or of one id repeated)."""
    if config.get("eos_token_id") is None:
        raise CheckpointError(f"{where}: missing key 'eos_token_id' (the n-gram look-back "
                              "boundary); pass eos_id= to give it")
    value = config["eos_token_id"]
    ids = value if isinstance(value, list) else [value]
    if not ids or any(isinstance(v, bool) or not isinstance(v, int) for v in ids):
        raise CheckpointError(f"{where}: eos_token_id must be an int or a list of ints, got {value!r}")
    if len(set(ids)) != 1:
        raise CheckpointError(f"{where}: eos_token_id lists {len(set(ids))} ids {value}; the n-gram "
                              "boundary is one token: pass eos_id= to choose it")
    return ids[0]


def dims_from_config(config: dict, *, eos_id: int | None = None, where: str = CONFIG,
                     require_eos: bool = True) -> NgramDims:
    """``NgramDims.longcat_flash`` of a config (see the module docstring for the keys);
    ``eos_id`` overrides ``eos_token_id``. ``require_eos=False`` (the converter, which never
    hashes) does not read the EOS: the dims have ``eos_id`` (None unless given)."""
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
        raise CheckpointError(f"{where}: text_vocab_size {text_vocab} != vocab_size {v} (LongCat-Next's "
                              "separate hash vocabulary is not supported)")
    if eos_id is None and require_eos:
        eos_id = config_eos(config, where)
    try:
        return NgramDims.longcat_flash(v, d, n, k, ratio, eos_id)  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: {err}") from None


# ---- the safetensors files --------------------------------------------------------------------
@dataclass(frozen=True)
class TensorRef:
    """A tensor of the checkpoint: its file and header entry (nothing mapped until ``array``)."""

    path: Path
    info: safetensors_io.TensorInfo

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    def where(self) -> str:
        return f"{self.path}: tensor {self.name!r}"

    def array(self) -> np.ndarray:
        """A read-only memory map of the tensor."""
        return safetensors_io.map_tensor(self.path, self.info)


def weight_files(model_dir: str | os.PathLike) -> tuple[dict[str, Path] | None, Path]:
    """Where the tensors are: ``(None, model.safetensors)`` for a single file, else the index's
    ``(weight_map as {tensor: shard path}, index path)``. Shards are only named here, not opened."""
    model_dir = Path(model_dir)
    single, index = model_dir / SINGLE, model_dir / INDEX
    if single.is_file():  # as transformers: the single file wins over an index
        return None, single
    if not index.is_file():
        raise CheckpointError(f"{model_dir}: neither {SINGLE} nor {INDEX}")
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{index}: not valid JSON ({err})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
    out = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise CheckpointError(f"{index}: tensor {name!r} maps to {shard!r}, not a file name "
                                  "inside the model folder")
        out[name] = model_dir / shard
    return out, index


class _Tensors:
    """Finds tensors by name, reading each needed shard's header once (and only those)."""

    def __init__(self, model_dir: Path) -> None:
        self.weight_map, self.source = weight_files(model_dir)
        self.headers: dict[Path, dict[str, safetensors_io.TensorInfo]] = {}

    def _header(self, path: Path) -> dict[str, safetensors_io.TensorInfo]:
        if path not in self.headers:
            if not path.is_file():
                raise CheckpointError(f"{self.source}: shard {path.name} (listed in the index) does not exist")
            try:
                self.headers[path] = safetensors_io.read_header(path)
            except ValueError as err:
                text = str(err)
                text = text[len(path.name) + 2:] if text.startswith(path.name + ": ") else text
                raise CheckpointError(f"{path}: {text}") from None
        return self.headers[path]

    def find(self, name: str) -> TensorRef | None:
        if self.weight_map is None:
            header = self._header(self.source)
            return TensorRef(self.source, header[name]) if name in header else None
        path = self.weight_map.get(name)
        if path is None:
            return None
        header = self._header(path)
        if name not in header:
            raise CheckpointError(f"{path}: no tensor {name!r}, though {self.source.name} maps it there")
        return TensorRef(path, header[name])

    def get(self, name: str) -> TensorRef:
        ref = self.find(name)
        if ref is None:
            raise CheckpointError(f"{self.source}: no tensor {name!r}")
        return ref


def _expect(ref: TensorRef, shape: tuple[int, ...], dtypes: Sequence[str], why: str) -> None:
    if ref.shape != shape:
        raise CheckpointError(f"{ref.where()} has shape {list(ref.shape)}, {CONFIG} gives "
                              f"{list(shape)} ({why})")
    if ref.dtype not in dtypes:
        raise CheckpointError(f"{ref.where()} is {ref.dtype}; served: {', '.join(dtypes)}")


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

    @classmethod
    def open(cls, model_dir: str | os.PathLike, *, eos_id: int | None = None, parts: str = "all",
             wide_tables: bool = False) -> "NgramCheckpoint":
        """Read config, index and the needed shards' headers; refuse (``CheckpointError``) a
        missing tensor, a shape that disagrees with the config or a dtype that cannot be served.
        ``wide_tables`` accepts F16/F32 tables (the converter narrows them)."""
        if parts not in ("all", "tables", "dense"):
            raise ValueError(f"parts must be 'all', 'tables' or 'dense', got {parts!r}")
        model_dir = Path(model_dir)
        config = read_config(model_dir)
        where = str(model_dir / CONFIG)
        dims = dims_from_config(config, eos_id=eos_id, where=where, require_eos=parts != "tables")
        tensors = _Tensors(model_dir)
        t, d, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
        word, projs, tables, scales = None, [], [], []
        if parts in ("all", "dense"):
            word = next((r for r in map(tensors.find, WORD_NAMES) if r is not None), None)
            if word is None:
                raise CheckpointError(f"{tensors.source}: no word table (tried {', '.join(WORD_NAMES)})")
            _expect(word, (dims.vocab_size, d), _DENSE_DTYPES, "vocab_size, hidden_size")
            for c in range(t):
                proj = tensors.get(PROJ_NAME.format(c))
                _expect(proj, (d, td), _DENSE_DTYPES, f"hidden_size, hidden_size // {t} tables")
                projs.append(proj)
        if parts in ("all", "tables"):
            table_dtypes = ("BF16", "F8_E4M3") + (_WIDE_TABLE_DTYPES if wide_tables else ())
            for c in range(t):
                rows = dims.table_rows(c)
                table = tensors.get(TABLE_NAME.format(c))
                if table.shape == (rows, td) and table.dtype in _WIDE_TABLE_DTYPES and not wide_tables:
                    raise CheckpointError(f"{table.where()} is {table.dtype}: tables are served as bf16 "
                                          "or fp8 with scales; convert them with python -m "
                                          "layers.ngram_embed.convert MODEL_DIR OUT_DIR and load with "
                                          "table_dir=OUT_DIR")
                _expect(table, (rows, td), table_dtypes,
                        f"int({config['ngram_vocab_size_ratio']} * {dims.vocab_size}) + 2*{c} + 1 rows, "
                        f"hidden_size // {t} columns")
                scale = next((r for r in (tensors.find(s.format(c)) for s in SCALE_NAMES) if r is not None), None)
                if table.dtype == "F8_E4M3":
                    if scale is None:
                        raise CheckpointError(f"{table.where()} is F8_E4M3 without its per-row scales "
                                              f"(tried {', '.join(s.format(c) for s in SCALE_NAMES)})")
                    if scale.shape not in ((rows,), (rows, 1)):
                        raise CheckpointError(f"{scale.where()} has shape {list(scale.shape)}, one scale "
                                              f"per row needs [{rows}] or [{rows}, 1]")
                    if scale.dtype not in _SCALE_DTYPES:
                        raise CheckpointError(f"{scale.where()} is {scale.dtype}; served: "
                                              f"{', '.join(_SCALE_DTYPES)}")
                elif scale is not None:
                    raise CheckpointError(f"{scale.where()}: per-row scales for a {table.dtype} table "
                                          "(only F8_E4M3 tables have them)")
                tables.append(table)
                scales.append(scale)
        return cls(model_dir, config, dims, word, tuple(projs), tuple(tables), tuple(scales),
                   tuple(tensors.headers))

    # -- arrays (mapped; converted where the module docstring says) ----------------------------
    def word_array(self) -> np.ndarray:
        assert self.word is not None, "opened without the word table"
        return _as_bf16(self.word.array())

    def proj_array(self, c: int) -> np.ndarray:
        return _as_bf16(self.projs[c].array())

    def table_arrays(self, c: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Table ``c`` as mapped (bf16, fp8, or for the converter F16/F32) and its f32 scales."""
        scale = self.scales[c]
        if scale is None:
            return self.tables[c].array(), None
        s = scale.array().reshape(-1)
        return self.tables[c].array(), np.ascontiguousarray(s, dtype=np.float32)  # exact upcast


def _as_bf16(array: np.ndarray) -> np.ndarray:
    if array.dtype == BF16:
        return array
    return array.astype(np.float32).astype(ml_dtypes.bfloat16)  # via exact f32; one rounding, nearest even
