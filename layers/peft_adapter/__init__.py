"""Token overlays from a PEFT adapter folder (``save_pretrained``), without torch or peft.

``overlay_from_peft(adapter_dir, vocab=...)`` reads ``adapter_config.json`` and
``adapter_model.safetensors`` and returns the ``AdapterOverlay`` the overlay machinery serves:
trainable-token rows (absolute replacements, rounded to bf16) as they are, full tables
(``modules_to_save`` copies, or a resized vocabulary's) through ``build_overlay`` (only rows that
differ from the served table). ``read_peft_adapter`` does the reading and every check alone (host
memory only) and returns a ``PeftAdapter`` whose ``overlay(...)`` builds. Rejected with
``PeftAdapterError`` (the full list: ``read_peft_adapter``): ``adapter_model.bin`` only, LoRA on
the embedding or LM head, nothing an overlay serves, ...

Tied embeddings (``tied``): only matters when the embedding's token rows are saved and the LM
head's are not. ``True``: the LM head overlay gets the embedding's rows; ``False``: the LM head
is the served one. ``None``: told from the adapter (a LoRA dict that lists the LM head with the
embedding's ids but saved no rows for it: tied; a standalone adapter: untied), else from the
served tables (``served_lm_head`` the same table as ``served_embed``: tied, another: untied), else
``PeftAdapterError``.

Which module is the embedding and which the LM head: by name (``embed_names``,
``lm_head_names``: the last path components, or a dotted suffix), a LoRA list form's module is
the embedding, and a lone trainable-tokens module of another name is taken for the embedding.

Modules: ``config`` (file names, ``adapter_config.json``, ``PeftAdapterError``), ``read``
(``read_peft_adapter``), ``adapter`` (``PeftAdapter`` and its ``overlay``).
Provenance: docs/adapters.md
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpu_runtime import validate
from gpu_runtime.backend import check_backend

from ..ops.token_overlay import OverlayKernels
from ..overlay import AdapterOverlay
from .adapter import PeftAdapter, PeftTable, _check_thresh
from .config import (
    BIN_NAME,
    CONFIG_NAME,
    DEFAULT_EMBED_NAMES,
    DEFAULT_LM_HEAD_NAMES,
    SAFETENSORS_NAME,
    PeftAdapterError,
)
from .read import read_peft_adapter


def overlay_from_peft(
    adapter_dir: Any,
    *,
    vocab: int,
    hidden_size: int | None = None,
    served_embed: Any = None,
    served_lm_head: Any = None,
    tied: bool | None = None,
    embed_names: str | Sequence[str] = DEFAULT_EMBED_NAMES,
    lm_head_names: str | Sequence[str] = DEFAULT_LM_HEAD_NAMES,
    gpu: Any = None,
    kernels: OverlayKernels | None = None,
    thresh: float = 0.0,
    stream: int = 0,
) -> AdapterOverlay:
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

    ``tied`` (whether the LM head shares the embedding's rows; it matters only when the
    embedding's token rows are saved and the LM head's are not): None tells it from the adapter,
    else from the served tables (the same table for both: tied), else raises ``PeftAdapterError``.
    Everything is read and checked before anything is uploaded or launched; what
    ``read_peft_adapter`` rejects, this rejects too.
    """
    check_backend(gpu, "overlay_from_peft: gpu", optional=True)
    validate.stream(stream, "overlay_from_peft: stream")
    _check_thresh(thresh)
    adapter = read_peft_adapter(
        adapter_dir,
        vocab=vocab,
        tied=tied,
        hidden_size=hidden_size,
        embed_names=embed_names,
        lm_head_names=lm_head_names,
    )
    return adapter.overlay(
        served_embed, served_lm_head, tied=tied, gpu=gpu, kernels=kernels, thresh=thresh, stream=stream
    )


__all__ = [
    "CONFIG_NAME",
    "SAFETENSORS_NAME",
    "BIN_NAME",
    "DEFAULT_EMBED_NAMES",
    "DEFAULT_LM_HEAD_NAMES",
    "PeftAdapterError",
    "PeftTable",
    "PeftAdapter",
    "read_peft_adapter",
    "overlay_from_peft",
]
