"""Reading a PEFT adapter folder (host memory only): its files, the safetensors header and the
tensors used (memory-mapped), each tensor classified by module and role, every check, and the
``PeftAdapter`` they make. The key forms and the PEFT behaviour they follow: docs/adapters.md."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpu_runtime import validate

from ..overlay import TableOverlay
from .adapter import PeftAdapter, PeftTable, _check_tied
from .config import (
    BIN_NAME,
    CONFIG_NAME,
    DEFAULT_EMBED_NAMES,
    DEFAULT_LM_HEAD_NAMES,
    EMBED,
    LM_HEAD,
    SAFETENSORS_NAME,
    PeftAdapterError,
    _Config,
)
from .tensors import AdapterFile, full_table, merge_rows, token_rows

_PREFIX = "base_model.model."
_TOKENS_RE = re.compile(r"^(?P<mod>.+?)(?P<wrap>\.token_adapter)?\.trainable_tokens_delta(?:\.(?P<name>[^.]+))?$")
_COPY_RE = re.compile(r"^(?P<mod>.+?)\.modules_to_save(?:\.(?P<name>[^.]+))?\.weight$")
_BASE_RE = re.compile(r"^(?P<mod>.+?)(?:\.token_adapter)?\.base_layer\.weight$")


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
                f"adapter with save_pretrained(..., safe_serialization=True) to get {SAFETENSORS_NAME}"
            )
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


def _other_module(key: str) -> str:
    """The module a tensor belongs to, for messages: without ``.weight``/``.bias`` and the
    parameter name (``q_proj.lora_A.weight`` -> ``q_proj``)."""
    k = re.sub(r"\.(weight|bias)$", "", key)
    return k.rsplit(".", 1)[0] if "." in k else k


def read_peft_adapter(
    adapter_dir: Any,
    *,
    vocab: int,
    tied: bool | None = None,
    hidden_size: int | None = None,
    embed_names: str | Sequence[str] = DEFAULT_EMBED_NAMES,
    lm_head_names: str | Sequence[str] = DEFAULT_LM_HEAD_NAMES,
) -> PeftAdapter:
    """Read and check a PEFT adapter folder (host memory only; nothing is built or uploaded).

    Raises, before returning: a missing folder / config / weights (``FileNotFoundError``),
    ``adapter_model.bin`` only, a malformed config or safetensors file, token ids outside
    ``0..vocab-1``, rows whose count or width does not match (``hidden_size`` when given), NaN or
    inf rows, the same id with different rows (two modules of one table, or twice in one list),
    full tables that are not ``[vocab, h]``, tensors of several adapters, LoRA on the embedding
    or LM head, and an adapter with nothing an overlay can serve (``PeftAdapterError``).
    """
    vocab = validate.positive(vocab, "vocab")
    if hidden_size is not None:
        hidden_size = validate.positive(hidden_size, "hidden_size")
    tied = _check_tied(tied)
    embed_names, lm_head_names = _names(embed_names, "embed_names"), _names(lm_head_names, "lm_head_names")
    d, cfg_path, weights = _files(adapter_dir)
    cfg = _Config.read(cfg_path)
    st = AdapterFile(weights)

    # classify every tensor
    tokens: dict[str, str] = {}  # module -> key
    fulls: dict[str, tuple[str, str]] = {}  # module -> (key, kind)
    others: dict[str, str] = {}  # key -> module (for messages)
    adapter_names: set[str] = set()
    for key in st.entries:
        k = key.removeprefix(_PREFIX)
        if m := _TOKENS_RE.match(k):
            mod = m["mod"]
            if m["name"]:
                adapter_names.add(m["name"])
            if mod in tokens:
                raise PeftAdapterError(
                    f"{weights.name}: two trainable-token tensors for {mod}: {tokens[mod]!r} and {key!r}"
                )
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
        if kind is not None and mod is not None and _role_by_name(mod, embed_names, lm_head_names) is not None:
            if mod in fulls:
                raise PeftAdapterError(f"{weights.name}: two full tables for {mod}: {fulls[mod][0]!r} and {key!r}")
            fulls[mod] = (key, kind)
        else:
            others[key] = _other_module(k)
    if len(adapter_names) > 1:
        raise PeftAdapterError(
            f"{weights.name}: tensors of several adapters ({', '.join(sorted(adapter_names))}): "
            "save one adapter per folder"
        )

    # roles: by name; a LoRA list form's module is the embedding; a lone other one too
    roles = {mod: role for mod in fulls if (role := _role_by_name(mod, embed_names, lm_head_names)) is not None}
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
                "head: name them with embed_names= / lm_head_names="
            )
    for key in others:
        parts = key.removeprefix(_PREFIX).split(".")
        hit = next(
            (
                p
                for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                if p in roles or _role_by_name(p, embed_names, lm_head_names)
            ),
            None,
        )
        if hit is None:
            continue
        role = roles.get(hit) or _role_by_name(hit, embed_names, lm_head_names)
        if "lora_" in key:
            raise PeftAdapterError(
                f"{d}: LoRA on the {role} ({key!r}) changes every row of {hit} through a low-rank "
                "product, which a token overlay cannot serve (merge it into the served table, or train "
                "the rows with trainable_token_indices / modules_to_save instead)"
            )
        raise PeftAdapterError(
            f"{d}: {key!r} on the {role} {hit}: a token overlay serves replaced rows only, not this tensor"
        )

    # token ids per module, from the config
    def ids_for(mod: str) -> list[int]:
        if cfg.token_indices is not None:
            return cfg.token_indices
        if cfg.tt_list is not None:
            return cfg.tt_list
        if cfg.tt_dict is not None:
            hits = {k: v for k, v in cfg.tt_dict.items() if mod.endswith(k)}
            if len({tuple(v) for v in hits.values()}) > 1:
                raise PeftAdapterError(
                    f"{CONFIG_NAME}: trainable_token_indices entries {sorted(hits)} all match {mod} with different ids"
                )
            if hits:
                return next(iter(hits.values()))
        raise PeftAdapterError(
            f"{d}: {tokens[mod]!r} has trainable-token rows but {CONFIG_NAME} gives no token ids for {mod}"
        )

    per_role_tokens: dict[str, list[tuple[str, TableOverlay]]] = {EMBED: [], LM_HEAD: []}
    for mod, key in tokens.items():
        per_role_tokens[roles[mod]].append((mod, token_rows(st, key, ids_for(mod), vocab, mod)))

    # modules the config names but whose rows were not saved
    tied_by_config = None
    if cfg.tt_dict is not None:
        for name, ids in cfg.tt_dict.items():
            if any(mod.endswith(name) for mod in tokens):
                continue
            emb_ids = [ids_for(m) for m, _ in per_role_tokens[EMBED]]
            if (
                _role_by_name(name, embed_names, lm_head_names) == LM_HEAD
                and any(sorted(e) == sorted(ids) for e in emb_ids)
                and tied is not False
            ):
                tied_by_config = True  # PEFT skipped the tied LM head: it shares the rows
                continue
            extra = (
                (" (PEFT leaves it out only for a tied model with the embedding's ids: pass tied=True if so)")
                if tied is False
                else ""
            )
            raise PeftAdapterError(
                f"{d}: {CONFIG_NAME} lists trainable tokens for {name!r} but "
                f"{weights.name} holds no trainable_tokens_delta for it{extra}"
            )
    if isinstance(cfg.target_modules, list):
        for name in cfg.target_modules:
            if not any(_ends_with(mod, name) for mod in tokens):
                raise PeftAdapterError(
                    f"{d}: target_modules names {name!r} but {weights.name} holds no trainable_tokens_delta for it"
                )

    tables: dict[str, PeftTable] = {}
    for role in (EMBED, LM_HEAD):
        toks = per_role_tokens[role]
        full_mods = [m for m in fulls if roles.get(m) == role]
        if not toks and not full_mods:
            continue
        tok = (
            merge_rows(
                [(t.ids, t.rows) for _, t in toks], f"{role} trainable tokens of {', '.join(m for m, _ in toks)}"
            )
            if toks
            else None
        )
        full = kind = None
        for mod in full_mods:
            key, k = fulls[mod]
            arr = full_table(st, key, vocab, mod)
            if full is not None and (arr.shape != full.shape or (arr.view(np.uint16) != full.view(np.uint16)).any()):
                raise PeftAdapterError(f"{d}: the full {role} tables of {', '.join(full_mods)} differ")
            if kind is not None and k != kind:
                raise PeftAdapterError(
                    f"{d}: {role}: a modules_to_save copy and a saved base layer ({', '.join(full_mods)})"
                )
            full, kind = arr, k
        if tok is not None and kind == "modules_to_save":
            raise PeftAdapterError(
                f"{d}: the {role} is both a modules_to_save copy and trainable tokens "
                f"({', '.join(full_mods + [m for m, _ in toks])}): conflicting"
            )
        mods = tuple(dict.fromkeys([m for m, _ in toks] + full_mods))
        tables[role] = PeftTable(role, mods, tok, full, kind)

    if not tables:
        found = sorted(set(others.values()))
        listed = ", ".join(found[:8]) + (f", ... ({len(found)} modules)" if len(found) > 8 else "")
        raise PeftAdapterError(
            f"{d}: nothing a token overlay can serve in this {cfg.peft_type} adapter: no trainable "
            f"tokens and no modules_to_save copy of the embedding or LM head (found: {listed or 'no tensors'})"
        )
    found_widths = [
        (f"{t.role} {what}", w)
        for t in tables.values()
        for what, w in (
            ("token rows", t.tokens.h if t.tokens is not None else None),
            (f"{t.full_kind} table", t.full.shape[1] if t.full is not None else None),
        )
        if w is not None
    ]
    if hidden_size is not None:
        found_widths.append(("hidden_size", int(hidden_size)))
    widths = {w for _, w in found_widths}
    if len(widths) != 1:
        raise PeftAdapterError(
            f"{d}: rows of different widths ({', '.join(f'{what} {w}' for what, w in found_widths)})"
        )
    if tied is None:
        if tied_by_config:
            tied = True
        elif cfg.peft_type == "TRAINABLE_TOKENS" and LM_HEAD not in tables:
            tied = False  # PEFT saves the tied LM head's (shared) rows too
    return PeftAdapter(
        d,
        cfg.peft_type,
        vocab,
        widths.pop(),
        tables.get(EMBED),
        tables.get(LM_HEAD),
        tied,
        tuple(sorted(set(others.values()))),
    )
