"""Token overlays from a PEFT adapter folder (``save_pretrained``), without torch or peft.

``overlay_from_peft(adapter_dir, vocab=...)`` reads ``adapter_config.json`` and
``adapter_model.safetensors`` and returns the ``AdapterOverlay`` the overlay machinery serves:
trainable-token rows as they are, full ``modules_to_save`` tables through ``build_overlay``
(only rows that differ from the served table). ``read_peft_adapter`` does the reading and every
check alone (host memory only) and returns a ``PeftAdapter`` whose ``overlay(...)`` builds.

What is read, and where it was confirmed (huggingface/peft, read at commit 5d602fd
"0.20.1.dev0", and at tags v0.14.0 - v0.20.0 where a version is named):

- Files: ``PeftModel.save_pretrained`` (src/peft/peft_model.py) writes ``adapter_config.json``
  (``PeftConfig.to_dict``, sets written as lists; src/peft/config.py) and
  ``adapter_model.safetensors`` (``safetensors.torch.save_file``, metadata ``{"format": "pt"}``),
  or ``adapter_model.bin`` (a torch pickle) with ``safe_serialization=False``: refused here,
  torch is not a dependency. An adapter not named "default" goes to ``<dir>/<adapter name>/``.
  Tensors that alias (tied ones) are cloned before the safetensors save, so both are written.
- Key names: ``get_peft_model_state_dict`` (src/peft/utils/save_and_load.py) removes the
  adapter name (``...trainable_tokens_delta.default`` -> ``...trainable_tokens_delta``). Keys
  start with ``base_model.model.`` when saved from a ``PeftModel``, without it through the
  transformers integration (``set_peft_model_state_dict`` accepts both); both are read here, and
  a key that still ends in one adapter name is accepted too.
- Standalone trainable tokens, ``peft_type`` "TRAINABLE_TOKENS" (``TrainableTokensConfig``,
  src/peft/tuners/trainable_tokens/config.py): ``token_indices`` (one list for every targeted
  module), ``target_modules`` (list, regex string, or the input embedding's name filled in before
  saving). ``TrainableTokensLayer`` (src/peft/tuners/trainable_tokens/layer.py) initialises
  ``trainable_tokens_delta[adapter]`` from ``weight[token_indices]`` and writes it into the weight
  with ``index_copy`` (forward, merge): despite the name the rows are ABSOLUTE replacements. Key
  ``<module>.trainable_tokens_delta``; ``trainable_tokens_original`` is a non-persistent
  ``BufferDict`` (never saved).
- Tied, standalone: on a ``tie_word_embeddings`` model ``TrainableTokensModel.inject_adapter``
  (src/peft/tuners/trainable_tokens/model.py) puts on the LM head a layer whose
  ``trainable_tokens_delta`` IS the embedding's ``ParameterDict`` (a registered submodule), so
  the file holds ``<embed>.trainable_tokens_delta`` and ``lm_head.trainable_tokens_delta``, equal
  (same code from v0.15.0 on; with v0.20.0 and older selected by the "trainable_tokens_" key
  prefix, at 5d602fd by the tuner layers' attributes, src/peft/tuners/tuners_utils.py).
- Inside LoRA, ``LoraConfig.trainable_token_indices`` (src/peft/tuners/lora/config.py): a list
  (the input embedding) or ``{module name: ids}`` (a module matches when its name ends with the
  key, ``_set_trainable`` in src/peft/utils/other.py). ``TrainableTokensWrapper``
  (src/peft/utils/other.py) saves ``<module>.token_adapter.trainable_tokens_delta``. On a tied
  model the LM head gets a tied wrapper whose ``adapter_state_dict`` returns ``{}`` ("storing of
  weight-tied layers is not up to us"), so ONLY the embedding's rows are saved; a dict naming
  embed_tokens and lm_head with the same ids skips lm_head and ties it, with different ids wraps
  and saves both (``set_additional_trainable_modules``, src/peft/utils/other.py).
- ``modules_to_save`` (``ModulesToSaveWrapper``, src/peft/utils/other.py; v0.14.0
  save_and_load.py): a full copy saved as ``<module>.weight`` (the ``modules_to_save.<adapter>.``
  part removed; ``<module>.modules_to_save[.<adapter>].weight`` is read too). On a tied model a
  copy of the embedding unties it: the LM head keeps the original weight unless
  ``ensure_weight_tying``, and then the LM head's copy is saved as well.
- Resized vocabulary: ``save_embedding_layers="auto"`` saves the full tables when the vocabulary
  differs from the base model's: ``<embed>.base_layer.weight`` (standalone),
  ``<embed>.token_adapter.base_layer.weight`` (LoRA), ``lm_head.weight`` (save_and_load.py;
  tests/test_trainable_tokens.py ``test_save_pretrained_auto``); docs:
  docs/source/package_reference/trainable_tokens.md. Read as full tables with the token rows
  applied on top (the served table must be the resized one; rows that differ are served).
- dtype: the rows have the base weight's dtype (float32 after peft's adapter autocast); F32, F16,
  BF16 and F64 are read and rounded to bf16 as served (round to nearest even).
- LoRA on the embedding (``<embed>.lora_embedding_A`` ``[r, vocab]``, ``lora_embedding_B``
  ``[h, r]``) or on the LM head changes every row: refused, as is an adapter with nothing an
  overlay serves (attention LoRA only); other modules' tensors are listed in
  ``PeftAdapter.other_modules`` (served by something else, or not at all).

Tied embeddings (``tied``): only matters when the embedding's token rows are saved and the LM
head's are not. ``True``: the LM head overlay gets the embedding's rows; ``False``: the LM head
is the served one. ``None``: told from the adapter (a LoRA dict that lists the LM head with the
embedding's ids but saved no rows for it: tied; a standalone adapter: untied, since PEFT saves
the tied LM head's copy), else from the served tables (``served_lm_head`` the same table as
``served_embed``: tied, another table: untied), else refused: LoRA's list form saves the same
file for a tied and an untied model.

Which module is the embedding and which the LM head: by name (``embed_names``,
``lm_head_names``: the last path components, or a dotted suffix), a LoRA list form's module is
the embedding, and a lone trainable-tokens module of another name is taken for the embedding.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import ml_dtypes
import numpy as np

from . import safetensors_io
from .ops.token_overlay import OverlayKernels
from .overlay import AdapterOverlay, TableOverlay, build_overlay
from .weight_map import DenseWeight

BF16 = np.dtype(ml_dtypes.bfloat16)

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"
DEFAULT_EMBED_NAMES = ("embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings")
DEFAULT_LM_HEAD_NAMES = ("lm_head", "embed_out")
EMBED, LM_HEAD = "embedding", "LM head"

_PREFIX = "base_model.model."
_TOKENS_RE = re.compile(r"^(?P<mod>.+?)(?P<wrap>\.token_adapter)?\.trainable_tokens_delta(?:\.(?P<name>[^.]+))?$")
_COPY_RE = re.compile(r"^(?P<mod>.+?)\.modules_to_save(?:\.(?P<name>[^.]+))?\.weight$")
_BASE_RE = re.compile(r"^(?P<mod>.+?)(?:\.token_adapter)?\.base_layer\.weight$")
_ROWS_PER_CHUNK_ELEMS = 1 << 22


class PeftAdapterError(ValueError):
    """A PEFT adapter folder this loader cannot turn into an overlay (malformed, inconsistent,
    or nothing an overlay can serve); raised before anything is built or uploaded."""


# -- the safetensors file: its header checked, only the tensors used are mapped -----------------

_FLOATS = ("F16", "BF16", "F32", "F64")


class _Safetensors:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.entries = safetensors_io.read_header(path)
        except ValueError as e:  # malformed or truncated: the loader's own error type
            raise PeftAdapterError(str(e)) from None

    def float_array(self, name: str) -> np.ndarray:
        """The tensor, read-only memory-mapped, with its float dtype (others refused)."""
        info = self.entries[name]
        if info.dtype not in _FLOATS:
            raise PeftAdapterError(f"{self.path.name}: tensor {name!r} is {info.dtype}, not a float type")
        return safetensors_io.map_tensor(self.path, info)


# -- the config --------------------------------------------------------------------------------

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
    token_indices: list[int] | None          # TRAINABLE_TOKENS
    target_modules: list[str] | str | None   # TRAINABLE_TOKENS: list, or a regex string
    tt_list: list[int] | None                # trainable_token_indices as a list
    tt_dict: dict[str, list[int]] | None     # ... as {module: ids}
    modules_to_save: list[str]
    ensure_weight_tying: bool

    @classmethod
    def read(cls, path: Path) -> "_Config":
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
        return cls(peft_type, token_indices, target_modules, tt_list, tt_dict, mts,
                   bool(cfg.get("ensure_weight_tying", False)))


# -- the parsed adapter --------------------------------------------------------------------------

@dataclass(frozen=True)
class PeftTable:
    """What an adapter saved for one table (``role``: "embedding" or "LM head"): token rows
    (``tokens``, bf16, sorted) and/or a full ``[vocab, h]`` bf16 table (``full``; ``full_kind``
    "modules_to_save" or "base layer", the latter saved for a resized vocabulary, the token rows
    then go on top). ``modules``: the module paths in the file it came from."""

    role: str
    modules: tuple[str, ...]
    tokens: TableOverlay | None = None
    full: np.ndarray | None = field(default=None, repr=False)
    full_kind: str | None = None

    @property
    def h(self) -> int:
        return self.tokens.h if self.tokens is not None else int(self.full.shape[1])


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT adapter read and checked (host memory only). ``tied``: as given or told from the
    adapter (None: not told; see the module docstring); ``other_modules``: modules whose tensors
    no overlay serves (e.g. attention LoRA)."""

    path: Path
    peft_type: str
    vocab: int
    h: int
    embed: PeftTable | None
    lm_head: PeftTable | None
    tied: bool | None
    other_modules: tuple[str, ...]

    @property
    def tied_matters(self) -> bool:
        """Whether the LM head's overlay depends on ``tied``: the embedding's token rows were
        saved and the LM head's were not."""
        return (self.embed is not None and self.embed.tokens is not None
                and (self.lm_head is None or (self.lm_head.tokens is None and self.lm_head.full_kind == "base layer")))

    def overlay(self, served_embed: Any = None, served_lm_head: Any = None, *, tied: bool | None = None,
                gpu: Any = None, kernels: OverlayKernels | None = None, thresh: float = 0.0,
                stream: int = 0) -> AdapterOverlay:
        """Build the overlay; see ``overlay_from_peft``. Everything is checked before the first
        upload or launch."""
        thresh = _check_thresh(thresh)
        tied = self._resolve_tied(tied, served_embed, served_lm_head)
        emb_tokens, emb_full = _parts(self.embed)
        lm_tokens, lm_full = _parts(self.lm_head)
        lm_copies_embed = False
        if tied and self.tied_matters:
            lm_tokens = emb_tokens
            if self.lm_head is None:
                lm_full, lm_copies_embed = emb_full, True
        if tied and served_lm_head is None:
            served_lm_head = served_embed    # a tied model's LM head is the embedding's table
        # every check first: served tables, kernels, widths
        plans = []
        for role, tokens, full, served in ((EMBED, emb_tokens, emb_full, served_embed),
                                           (LM_HEAD, lm_tokens, lm_full, served_lm_head)):
            if full is not None:
                if served is None:
                    hint = (" (a tied model: the embedding's table, or tied=True)"
                            if role == LM_HEAD and tied is None else "")
                    raise PeftAdapterError(
                        f"{self.path}: the adapter ships a full {role} table ({_describe(self, role)}): "
                        f"pass served_{'embed' if role == EMBED else 'lm_head'} so only the rows that "
                        f"differ are served{hint}")
                _check_served(served, role, self.vocab, self.h)
            elif served is not None:
                _check_served(served, role, self.vocab, self.h)
            plans.append((role, tokens, full, served))
        devices = {role: _gpu_of(served, gpu, role) for role, _, full, served in plans if full is not None}
        resolved: dict[int, OverlayKernels] = {}
        for role, dev in devices.items():
            if dev is not None:
                if id(dev) not in resolved:
                    resolved[id(dev)] = kernels if kernels is not None else OverlayKernels.new(dev)
                _require_kernels(resolved[id(dev)], role)
        built: dict[str, TableOverlay | None] = {}
        for role, tokens, full, served in plans:
            if role == LM_HEAD and lm_copies_embed and _same_table(served, served_embed):
                built[role] = built[EMBED]       # the same table, the same rows: the same overlay
            elif full is None:
                built[role] = tokens
            else:
                table = full if tokens is None else _apply(full, tokens)
                dev = devices[role]
                built[role] = _diff(role, table, served, dev, resolved.get(id(dev)), thresh, stream)
        return AdapterOverlay(built[EMBED], built[LM_HEAD])

    def _resolve_tied(self, tied: bool | None, served_embed: Any, served_lm_head: Any) -> bool | None:
        if tied is not None:
            return _check_tied(tied)
        if self.tied is not None or not self.tied_matters:
            return self.tied
        if served_embed is not None and served_lm_head is not None:
            return _same_table(served_embed, served_lm_head)
        raise PeftAdapterError(
            f"{self.path}: cannot tell whether the base model ties its embeddings ({self.peft_type} "
            "saves only the embedding's trainable-token rows whether or not the LM head shares them): "
            "pass tied=True (tie_word_embeddings) or tied=False, or both served tables")


def _parts(table: PeftTable | None) -> tuple[TableOverlay | None, np.ndarray | None]:
    return (None, None) if table is None else (table.tokens, table.full)


def _describe(adapter: PeftAdapter, role: str) -> str:
    t = adapter.embed if role == EMBED else adapter.lm_head
    src = adapter.embed if t is None else t
    return f"{src.full_kind} of {', '.join(src.modules)}"


def _check_tied(tied: Any) -> bool | None:
    if tied is not None and not isinstance(tied, (bool, np.bool_)):
        raise TypeError(f"tied must be True, False or None, got {tied!r}")
    return None if tied is None else bool(tied)


def _check_thresh(thresh: Any) -> float:
    if isinstance(thresh, bool) or not isinstance(thresh, (int, float, np.floating, np.integer)):
        raise TypeError(f"thresh must be a real number, got {thresh!r}")
    thresh = float(thresh)
    if math.isnan(thresh) or thresh < 0:
        raise ValueError(f"thresh must be >= 0, got {thresh}")
    return thresh


# -- reading -------------------------------------------------------------------------------------

def _files(adapter_dir: Any) -> tuple[Path, Path, Path]:
    d = Path(adapter_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"PEFT adapter folder {d} does not exist (or is not a folder)")
    cfg = d / CONFIG_NAME
    if not cfg.is_file():
        subs = sorted(p.parent.name for p in d.glob(f"*/{CONFIG_NAME}"))
        more = f"; adapters saved in subfolders: {', '.join(subs)} (pass one of them)" if subs else ""
        raise FileNotFoundError(f"{d}: no {CONFIG_NAME}{more}")
    weights = d / SAFETENSORS_NAME
    if not weights.is_file():
        if (d / BIN_NAME).is_file():
            raise PeftAdapterError(
                f"{d}: only {BIN_NAME} (a torch pickle; torch is not a dependency here): re-save the "
                f"adapter with save_pretrained(..., safe_serialization=True) to get {SAFETENSORS_NAME}")
        present = ", ".join(sorted(p.name for p in d.iterdir())) or "nothing"
        raise FileNotFoundError(f"{d}: no {SAFETENSORS_NAME} (found: {present})")
    return d, cfg, weights


def _ends_with(path: str, name: str) -> bool:
    return path == name or path.endswith("." + name)


def _role_by_name(path: str, embed_names: Sequence[str], lm_head_names: Sequence[str]) -> str | None:
    if any(_ends_with(path, n) for n in lm_head_names):
        return LM_HEAD
    if any(_ends_with(path, n) for n in embed_names):
        return EMBED
    return None


def _names(value: Any, what: str) -> tuple[str, ...]:
    value = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(v, str) and v for v in value):
        raise TypeError(f"{what} must be module names (strings), got {value!r}")
    return value


def _token_rows(st: _Safetensors, key: str, ids: list[int], vocab: int, module: str) -> TableOverlay:
    arr = st.float_array(key)
    if arr.ndim != 2 or arr.shape[0] != len(ids) or arr.shape[1] == 0:
        raise PeftAdapterError(f"{st.path.name}: {key} has shape {list(arr.shape)}, expected "
                               f"[{len(ids)}, h] for the {len(ids)} token ids of {module}")
    rows = np.ascontiguousarray(arr).astype(BF16)
    bad = ~np.isfinite(rows).all(axis=1)
    if bad.any():
        raise PeftAdapterError(f"{st.path.name}: {key}: non-finite values (NaN/inf, or too large for "
                               f"bf16) in the rows of token ids {np.asarray(ids)[bad][:8].tolist()}")
    id_arr = np.asarray(ids, np.int64)
    if id_arr.min() < 0 or id_arr.max() >= vocab:
        worst = int(id_arr.min()) if id_arr.min() < 0 else int(id_arr.max())
        raise PeftAdapterError(f"{CONFIG_NAME}: token id {worst} of {module} outside the vocabulary "
                               f"0..{vocab - 1}")
    return _merge([(id_arr, rows)], f"token ids of {module}")


def _merge(parts: Iterable[tuple[np.ndarray, np.ndarray]], what: str) -> TableOverlay:
    """One sorted overlay from (ids, bf16 rows) pairs; a repeated id must carry the same row."""
    parts = list(parts)
    ids = np.concatenate([p[0] for p in parts]).astype(np.int64)
    rows = np.concatenate([p[1] for p in parts])
    order = np.argsort(ids, kind="stable")
    ids, rows = ids[order], rows[order]
    dup = np.flatnonzero(ids[1:] == ids[:-1])
    if dup.size:
        u16 = rows.view(np.uint16)
        differ = (u16[dup] != u16[dup + 1]).any(axis=1)
        if differ.any():
            raise PeftAdapterError(f"{what}: token id {int(ids[dup[differ][0]])} given twice with "
                                   "different rows")
        keep = np.ones(ids.size, bool)
        keep[dup + 1] = False
        ids, rows = ids[keep], rows[keep]
    return TableOverlay(np.ascontiguousarray(ids, np.int32), np.ascontiguousarray(rows))


def _full_table(st: _Safetensors, key: str, vocab: int, module: str) -> np.ndarray:
    arr = st.float_array(key)
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise PeftAdapterError(f"{st.path.name}: {key} has shape {list(arr.shape)}, not a [vocab, h] table")
    if arr.shape[0] != vocab:
        raise PeftAdapterError(
            f"{st.path.name}: {key} has {arr.shape[0]} rows but vocab is {vocab} (PEFT saves the full "
            f"table of {module} when the vocabulary was resized: serve the resized model)")
    out = np.empty(arr.shape, BF16)
    step = max(1, _ROWS_PER_CHUNK_ELEMS // arr.shape[1])
    for a in range(0, arr.shape[0], step):
        out[a:a + step] = arr[a:a + step]
        bad = ~np.isfinite(out[a:a + step]).all(axis=1)
        if bad.any():
            raise PeftAdapterError(f"{st.path.name}: {key}: non-finite values (NaN/inf, or too large "
                                   f"for bf16) in rows {(np.flatnonzero(bad) + a)[:8].tolist()}")
    return out


def _other_module(key: str) -> str:
    """The module a tensor belongs to, for messages: without ``.weight``/``.bias`` and the
    parameter name (``q_proj.lora_A.weight`` -> ``q_proj``)."""
    k = re.sub(r"\.(weight|bias)$", "", key)
    return k.rsplit(".", 1)[0] if "." in k else k


def read_peft_adapter(adapter_dir: Any, *, vocab: int, tied: bool | None = None,
                      hidden_size: int | None = None,
                      embed_names: str | Sequence[str] = DEFAULT_EMBED_NAMES,
                      lm_head_names: str | Sequence[str] = DEFAULT_LM_HEAD_NAMES) -> PeftAdapter:
    """Read and check a PEFT adapter folder (host memory only; nothing is built or uploaded).

    Refuses, before returning: a missing folder / config / weights (``FileNotFoundError``),
    ``adapter_model.bin`` only, a malformed config or safetensors file, token ids outside
    ``0..vocab-1``, rows whose count or width does not match (``hidden_size`` when given), NaN or
    inf rows, the same id with different rows (two modules of one table, or twice in one list),
    full tables that are not ``[vocab, h]``, tensors of several adapters, LoRA on the embedding
    or LM head, and an adapter with nothing an overlay can serve (``PeftAdapterError``).
    """
    if isinstance(vocab, bool) or not isinstance(vocab, (int, np.integer)) or vocab <= 0:
        raise ValueError(f"vocab must be a positive int, got {vocab!r}")
    vocab = int(vocab)
    if hidden_size is not None and (isinstance(hidden_size, bool) or not isinstance(hidden_size, (int, np.integer))
                                    or hidden_size <= 0):
        raise ValueError(f"hidden_size must be a positive int or None, got {hidden_size!r}")
    tied = _check_tied(tied)
    embed_names, lm_head_names = _names(embed_names, "embed_names"), _names(lm_head_names, "lm_head_names")
    d, cfg_path, weights = _files(adapter_dir)
    cfg = _Config.read(cfg_path)
    st = _Safetensors(weights)

    # classify every tensor
    tokens: dict[str, str] = {}                        # module -> key
    fulls: dict[str, tuple[str, str]] = {}             # module -> (key, kind)
    others: dict[str, str] = {}                        # key -> module (for messages)
    adapter_names: set[str] = set()
    for key in st.entries:
        k = key.removeprefix(_PREFIX)
        if m := _TOKENS_RE.match(k):
            mod = m["mod"]
            if m["name"]:
                adapter_names.add(m["name"])
            if mod in tokens:
                raise PeftAdapterError(f"{weights.name}: two trainable-token tensors for {mod}: "
                                       f"{tokens[mod]!r} and {key!r}")
            tokens[mod] = key
            continue
        mod = kind = None
        if m := _COPY_RE.match(k):
            mod, kind = m["mod"], "modules_to_save"
            if m["name"]:
                adapter_names.add(m["name"])
        elif m := _BASE_RE.match(k):
            mod, kind = m["mod"], "base layer"
        elif k.endswith(".weight"):
            mod = k[: -len(".weight")]
            kind = "modules_to_save" if any(_ends_with(mod, n) for n in cfg.modules_to_save) else "base layer"
        if kind is not None and _role_by_name(mod, embed_names, lm_head_names) is not None:
            if mod in fulls:
                raise PeftAdapterError(f"{weights.name}: two full tables for {mod}: "
                                       f"{fulls[mod][0]!r} and {key!r}")
            fulls[mod] = (key, kind)
        else:
            others[key] = _other_module(k)
    if len(adapter_names) > 1:
        raise PeftAdapterError(f"{weights.name}: tensors of several adapters ({', '.join(sorted(adapter_names))}): "
                               "save one adapter per folder")

    # roles: by name; a LoRA list form's module is the embedding; a lone other one too
    roles = {mod: _role_by_name(mod, embed_names, lm_head_names) for mod in fulls}
    unnamed = []
    for mod in tokens:
        role = _role_by_name(mod, embed_names, lm_head_names)
        if role is None and cfg.tt_list is not None:
            role = EMBED
        if role is None:
            unnamed.append(mod)
        else:
            roles[mod] = role
    if unnamed:
        if len(unnamed) == 1 and EMBED not in roles.values():
            roles[unnamed[0]] = EMBED
        else:
            raise PeftAdapterError(
                f"{d}: cannot tell which of {', '.join(unnamed)} is the embedding and which the LM "
                "head: name them with embed_names= / lm_head_names=")
    for key, mod in others.items():
        parts = key.removeprefix(_PREFIX).split(".")
        hit = next((p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                    if p in roles or _role_by_name(p, embed_names, lm_head_names)), None)
        if hit is None:
            continue
        role = roles.get(hit) or _role_by_name(hit, embed_names, lm_head_names)
        if "lora_" in key:
            raise PeftAdapterError(
                f"{d}: LoRA on the {role} ({key!r}) changes every row of {hit} through a low-rank "
                "product, which a token overlay cannot serve (merge it into the served table, or train "
                "the rows with trainable_token_indices / modules_to_save instead)")
        raise PeftAdapterError(f"{d}: {key!r} on the {role} {hit}: a token overlay serves replaced rows "
                               "only, not this tensor")

    # token ids per module, from the config
    def ids_for(mod: str) -> list[int]:
        if cfg.token_indices is not None:
            return cfg.token_indices
        if cfg.tt_list is not None:
            return cfg.tt_list
        if cfg.tt_dict is not None:
            hits = {k: v for k, v in cfg.tt_dict.items() if mod.endswith(k)}
            if len({tuple(v) for v in hits.values()}) > 1:
                raise PeftAdapterError(f"{CONFIG_NAME}: trainable_token_indices entries "
                                       f"{sorted(hits)} all match {mod} with different ids")
            if hits:
                return next(iter(hits.values()))
        raise PeftAdapterError(f"{d}: {tokens[mod]!r} has trainable-token rows but {CONFIG_NAME} "
                               f"gives no token ids for {mod}")

    per_role_tokens: dict[str, list[tuple[str, TableOverlay]]] = {EMBED: [], LM_HEAD: []}
    for mod, key in tokens.items():
        per_role_tokens[roles[mod]].append((mod, _token_rows(st, key, ids_for(mod), vocab, mod)))

    # modules the config names but whose rows were not saved
    tied_by_config = None
    if cfg.tt_dict is not None:
        for name, ids in cfg.tt_dict.items():
            if any(mod.endswith(name) for mod in tokens):
                continue
            emb_ids = [ids_for(m) for m, _ in per_role_tokens[EMBED]]
            if _role_by_name(name, embed_names, lm_head_names) == LM_HEAD and \
                    any(sorted(e) == sorted(ids) for e in emb_ids) and tied is not False:
                tied_by_config = True           # PEFT skipped the tied LM head: it shares the rows
                continue
            extra = (" (PEFT leaves it out only for a tied model with the embedding's ids: pass "
                     "tied=True if so)") if tied is False else ""
            raise PeftAdapterError(f"{d}: {CONFIG_NAME} lists trainable tokens for {name!r} but "
                                   f"{weights.name} holds no trainable_tokens_delta for it{extra}")
    if isinstance(cfg.target_modules, list):
        for name in cfg.target_modules:
            if not any(_ends_with(mod, name) for mod in tokens):
                raise PeftAdapterError(f"{d}: target_modules names {name!r} but {weights.name} holds no "
                                       "trainable_tokens_delta for it")

    tables: dict[str, PeftTable] = {}
    for role in (EMBED, LM_HEAD):
        toks = per_role_tokens[role]
        full_mods = [m for m in fulls if roles.get(m) == role]
        if not toks and not full_mods:
            continue
        tok = _merge([(t.ids, t.rows) for _, t in toks], f"{role} trainable tokens of "
                     f"{', '.join(m for m, _ in toks)}") if toks else None
        full = kind = None
        for mod in full_mods:
            key, k = fulls[mod]
            arr = _full_table(st, key, vocab, mod)
            if full is not None and (arr.shape != full.shape or
                                     (arr.view(np.uint16) != full.view(np.uint16)).any()):
                raise PeftAdapterError(f"{d}: the full {role} tables of {', '.join(full_mods)} differ")
            if kind is not None and k != kind:
                raise PeftAdapterError(f"{d}: {role}: a modules_to_save copy and a saved base layer "
                                       f"({', '.join(full_mods)})")
            full, kind = arr, k
        if tok is not None and kind == "modules_to_save":
            raise PeftAdapterError(f"{d}: the {role} is both a modules_to_save copy and trainable tokens "
                                   f"({', '.join(full_mods + [m for m, _ in toks])}): conflicting")
        mods = tuple(dict.fromkeys([m for m, _ in toks] + full_mods))
        tables[role] = PeftTable(role, mods, tok, full, kind)

    if not tables:
        found = sorted(set(others.values()))
        listed = ", ".join(found[:8]) + (f", ... ({len(found)} modules)" if len(found) > 8 else "")
        raise PeftAdapterError(
            f"{d}: nothing a token overlay can serve in this {cfg.peft_type} adapter: no trainable "
            f"tokens and no modules_to_save copy of the embedding or LM head (found: {listed or 'no tensors'})")
    found_widths = [(f"{t.role} {what}", w) for t in tables.values() for what, w in
                    (("token rows", t.tokens.h if t.tokens is not None else None),
                     (f"{t.full_kind} table", t.full.shape[1] if t.full is not None else None)) if w is not None]
    if hidden_size is not None:
        found_widths.append(("hidden_size", int(hidden_size)))
    widths = {w for _, w in found_widths}
    if len(widths) != 1:
        raise PeftAdapterError(f"{d}: rows of different widths "
                               f"({', '.join(f'{what} {w}' for what, w in found_widths)})")
    if tied is None:
        if tied_by_config:
            tied = True
        elif cfg.peft_type == "TRAINABLE_TOKENS" and LM_HEAD not in tables:
            tied = False                       # PEFT saves the tied LM head's (shared) rows too
    return PeftAdapter(d, cfg.peft_type, vocab, widths.pop(), tables.get(EMBED), tables.get(LM_HEAD),
                       tied, tuple(sorted(set(others.values()))))


# -- building ------------------------------------------------------------------------------------

def _check_served(served: Any, role: str, vocab: int, h: int) -> None:
    name = "served_embed" if role == EMBED else "served_lm_head"
    if isinstance(served, DenseWeight):
        if served.dtype != BF16:
            raise TypeError(f"{name} must be a bfloat16 DenseWeight, got {served.dtype}")
        shape = tuple(served.shape)
    elif isinstance(served, np.ndarray):
        if served.dtype != BF16:
            raise TypeError(f"{name} must be bfloat16, got {served.dtype}")
        shape = served.shape
    else:
        raise TypeError(f"{name} must be a DenseWeight or a bf16 numpy array, got {type(served).__name__}")
    if shape != (vocab, h):
        raise ValueError(f"{name} shape {shape} != (vocab, h) = {(vocab, h)} of the adapter")


def _gpu_of(served: Any, gpu: Any, role: str) -> Any:
    """The backend a diff runs on: ``gpu``, or the served DenseWeight's; None: on the host."""
    if isinstance(served, DenseWeight):
        dev = gpu if gpu is not None else served.gpu
        if dev is None:
            raise ValueError(f"the served {role} DenseWeight is closed (no backend) and no gpu was given")
        return dev
    return gpu


def _require_kernels(kernels: OverlayKernels, role: str) -> None:
    names = ("rowdiff", "embed_overlay") if role == EMBED else ("rowdiff", "lmhead_overlay_bf16", "lmhead_overlay_f32")
    kernels.require(f"a full {role} table", *names)


def _same_table(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, DenseWeight) and isinstance(b, DenseWeight):
        return int(a.weight) == int(b.weight) and tuple(a.shape) == tuple(b.shape)
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return (a.shape == b.shape and a.dtype == b.dtype and a.strides == b.strides
                and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])
    return False


def _apply(full: np.ndarray, tokens: TableOverlay) -> np.ndarray:
    out = full.copy()
    out[tokens.ids] = tokens.rows
    return out


def _diff(role: str, table: np.ndarray, served: Any, gpu: Any, kernels: OverlayKernels | None,
          thresh: float, stream: int) -> TableOverlay:
    """The rows of ``table`` that differ from ``served``: with ``build_overlay`` on ``gpu`` (a host
    served table is uploaded for it), or on the host with the same rule when there is no gpu."""
    if gpu is None:
        return _host_diff(table, served, thresh)
    ks = kernels if kernels is not None else OverlayKernels.new(gpu)
    owned = None
    if not isinstance(served, DenseWeight):
        served = owned = DenseWeight.from_numpy(gpu, served, stream=stream)
    try:
        if role == EMBED:
            return build_overlay(gpu, ks, served, table, thresh=thresh, stream=stream).embed
        return build_overlay(gpu, ks, None, None, served, table, thresh=thresh, stream=stream).lm_head
    finally:
        if owned is not None:
            gpu.synchronize(stream)
            owned.close()


def _host_diff(table: np.ndarray, served: np.ndarray, thresh: float) -> TableOverlay:
    """``embed_rowdiff``'s rule on the host: a row differs where ``max |a - s| > thresh`` (fp32
    difference; NaN differs; equal values, equal infinities too, differ by 0)."""
    rows, h = table.shape
    step = max(1, _ROWS_PER_CHUNK_ELEMS // h)
    t32 = np.float32(thresh)
    flags = np.empty(rows, bool)
    for a in range(0, rows, step):
        x = table[a:a + step].astype(np.float32)
        y = served[a:a + step].astype(np.float32)
        with np.errstate(invalid="ignore"):
            d = np.where(x == y, np.float32(0), np.abs(x - y))
            flags[a:a + step] = (~(d <= t32)).any(axis=1)
    ids = np.flatnonzero(flags).astype(np.int32)
    return TableOverlay(ids, np.ascontiguousarray(table[ids]))


def overlay_from_peft(adapter_dir: Any, *, vocab: int, served_embed: Any = None, served_lm_head: Any = None,
                      tied: bool | None = None, gpu: Any = None, kernels: OverlayKernels | None = None,
                      thresh: float = 0.0, stream: int = 0, hidden_size: int | None = None,
                      embed_names: str | Sequence[str] = DEFAULT_EMBED_NAMES,
                      lm_head_names: str | Sequence[str] = DEFAULT_LM_HEAD_NAMES) -> AdapterOverlay:
    """The ``AdapterOverlay`` of the PEFT adapter saved in ``adapter_dir``.

    Trainable tokens (standalone, or LoRA's ``trainable_token_indices``, list or per-module
    dict) become overlays of their rows rounded to bf16. Full tables (``modules_to_save`` copies
    of the embedding / LM head, or the full tables saved for a resized vocabulary, with the
    token rows on top) are compared with ``served_embed`` / ``served_lm_head`` and only the rows
    that differ by more than ``thresh`` are kept: with ``build_overlay`` (the ``embed_rowdiff``
    kernel) on ``gpu``, or on the served ``DenseWeight``'s backend, with ``kernels`` (default
    ``OverlayKernels.new``); a served table given as a bf16 numpy array is uploaded for it, or,
    with no ``gpu``, compared on the host by the same rule. The served tables must be ``[vocab,
    h]`` bf16; a tied model passes the same table for both (or ``served_lm_head=None`` with
    ``tied=True``).

    ``tied``: see the module docstring (None: told from the adapter, else from the served
    tables, else refused). Everything is read and checked before anything is uploaded or
    launched: see ``read_peft_adapter`` for what is refused.
    """
    _check_thresh(thresh)
    adapter = read_peft_adapter(adapter_dir, vocab=vocab, tied=tied, hidden_size=hidden_size,
                                embed_names=embed_names, lm_head_names=lm_head_names)
    return adapter.overlay(served_embed, served_lm_head, tied=tied, gpu=gpu, kernels=kernels,
                           thresh=thresh, stream=stream)


__all__ = ["CONFIG_NAME", "SAFETENSORS_NAME", "BIN_NAME", "DEFAULT_EMBED_NAMES", "DEFAULT_LM_HEAD_NAMES",
           "PeftAdapterError", "PeftTable", "PeftAdapter", "read_peft_adapter", "overlay_from_peft"]
