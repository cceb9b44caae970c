"""A PEFT adapter read and checked (``PeftAdapter``, ``PeftTable``), and its ``overlay``: token
rows as they are, full tables diffed against the served ones (``build_overlay`` on a backend, or
the same rule on the host)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpu_runtime import validate
from gpu_runtime.backend import check_backend

from ..dense_weight import DenseWeight
from ..ops.token_overlay import OverlayKernels
from ..overlay import AdapterOverlay, TableOverlay, build_overlay
from ..overlay.model import BF16
from .config import EMBED, LM_HEAD, PeftAdapterError

ROWS_PER_CHUNK_ELEMS = 1 << 22  # elements a host pass converts or compares at a time


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
        """The row width: the token rows' or the full table's columns."""
        if self.tokens is not None:
            return self.tokens.h
        assert self.full is not None  # a table has its token rows, its full table or both
        return int(self.full.shape[1])


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT adapter folder read and checked by ``read_peft_adapter`` (host memory only): its
    embedding and LM-head tables (``PeftTable``, None where it saved nothing for one) for a model of
    ``vocab`` rows of width ``h``; ``overlay(...)`` builds the ``AdapterOverlay``. ``tied``: as given,
    or told from the adapter (True when its LoRA config lists the LM head with the embedding's ids
    but saved no rows for it, False for a standalone trainable-tokens one; None: not told); ``other_modules``:
    modules whose tensors no overlay serves (e.g. attention LoRA)."""

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
        return (
            self.embed is not None
            and self.embed.tokens is not None
            and (self.lm_head is None or (self.lm_head.tokens is None and self.lm_head.full_kind == "base layer"))
        )

    def overlay(
        self,
        served_embed: Any = None,
        served_lm_head: Any = None,
        *,
        tied: bool | None = None,
        gpu: Any = None,
        kernels: OverlayKernels | None = None,
        thresh: float = 0.0,
        stream: int = 0,
    ) -> AdapterOverlay:
        """The ``AdapterOverlay`` of this adapter against the served tables (``[vocab, h]`` bf16,
        a ``DenseWeight`` or a numpy array): token rows as saved; a full table reduced to the rows
        that differ from the served one by more than ``thresh`` (on ``gpu`` / the served weight's
        backend with ``kernels``, else on the host). Raises ``PeftAdapterError`` for a full table
        without its served table, or ``tied`` left undecided where it matters; everything is
        checked before the first upload or launch."""
        check_backend(gpu, "PeftAdapter.overlay: gpu", optional=True)
        stream = validate.stream(stream, "PeftAdapter.overlay: stream")
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
            served_lm_head = served_embed  # a tied model's LM head is the embedding's table
        # every check first: served tables, kernels, widths
        plans = []
        for role, tokens, full, served in (
            (EMBED, emb_tokens, emb_full, served_embed),
            (LM_HEAD, lm_tokens, lm_full, served_lm_head),
        ):
            if full is not None:
                if served is None:
                    hint = (
                        " (a tied model: the embedding's table, or tied=True)"
                        if role == LM_HEAD and tied is None
                        else ""
                    )
                    raise PeftAdapterError(
                        f"{self.path}: the adapter ships a full {role} table ({_describe(self, role)}): "
                        f"pass served_{'embed' if role == EMBED else 'lm_head'} so only the rows that "
                        f"differ are served{hint}"
                    )
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
                built[role] = built[EMBED]  # the same table, the same rows: the same overlay
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
            "pass tied=True (tie_word_embeddings) or tied=False, or both served tables"
        )


def _parts(table: PeftTable | None) -> tuple[TableOverlay | None, np.ndarray | None]:
    return (None, None) if table is None else (table.tokens, table.full)


def _describe(adapter: PeftAdapter, role: str) -> str:
    t = adapter.embed if role == EMBED else adapter.lm_head
    src = adapter.embed if t is None else t
    assert src is not None  # called for a full table of ``role``: one of them shipped it
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
    if math.isfinite(thresh) and thresh > validate.F32_MAX:  # the GPU's rowdiff takes an f32
        raise ValueError(f"thresh {thresh} overflows f32")
    return thresh


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
            raise ValueError(
                f"the served {role} DenseWeight has no backend (closed, or not made by from_numpy) and no gpu was given"
            )
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
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and a.strides == b.strides
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        )
    return False


def _apply(full: np.ndarray, tokens: TableOverlay) -> np.ndarray:
    out = full.copy()
    out[tokens.ids] = tokens.rows
    return out


def _diff(
    role: str, table: np.ndarray, served: Any, gpu: Any, kernels: OverlayKernels | None, thresh: float, stream: int
) -> TableOverlay:
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
            found = build_overlay(gpu, ks, served, table, thresh=thresh, stream=stream).embed
        else:
            found = build_overlay(gpu, ks, None, None, served, table, thresh=thresh, stream=stream).lm_head
        assert found is not None  # build_overlay diffs every table it is given
        return found
    finally:
        if owned is not None:
            gpu.synchronize(stream)
            owned.close()


def _host_diff(table: np.ndarray, served: np.ndarray, thresh: float) -> TableOverlay:
    """``embed_rowdiff``'s rule on the host: a row differs where ``max |a - s| > thresh`` (fp32
    difference; NaN differs; equal values, equal infinities too, differ by 0)."""
    rows, h = table.shape
    step = max(1, ROWS_PER_CHUNK_ELEMS // h)
    t32 = np.float32(thresh)
    flags = np.empty(rows, bool)
    for a in range(0, rows, step):
        x = table[a : a + step].astype(np.float32)
        y = served[a : a + step].astype(np.float32)
        with np.errstate(invalid="ignore"):
            d = np.where(x == y, np.float32(0), np.abs(x - y))
            flags[a : a + step] = (~(d <= t32)).any(axis=1)
    ids = np.flatnonzero(flags).astype(np.int32)
    return TableOverlay(ids, np.ascontiguousarray(table[ids]))
