"""LoRA token overlays: what an adapter replaces, how it is found, and the per-slot device tables.

An adapter may change some rows of the token embedding and of the LM head (new or retrained
tokens: PEFT's ``trainable_token_indices``, or a full ``modules_to_save`` copy of
``embed_tokens`` / ``lm_head``). A multi-adapter server keeps one served table and, per adapter
slot, only the rows that differ; each token of a batch is routed to its sequence's slot. The
rows are replacements, not deltas.

- ``model``: ``TableOverlay`` / ``AdapterOverlay``, the host-side description (sorted unique ids
  and their replacement rows, per table) and its checks;
- ``build``: ``build_overlay``, from full adapter tables, finding the differing rows on the GPU
  (``embed_rowdiff``); ``overlay_from_trainable_tokens``, from PEFT's trainable-tokens form;
- ``slots``: ``OverlaySlots``, a fixed number of adapter slots, each made device-resident on
  ``load``, and the device pointer tables the routed kernels read.

PEFT adapter folders: ``layers.peft_adapter`` (``overlay_from_peft``).
"""

from __future__ import annotations

from .build import build_overlay, overlay_from_trainable_tokens
from .model import AdapterOverlay, TableOverlay
from .slots import OverlaySlots

__all__ = ["AdapterOverlay", "OverlaySlots", "TableOverlay", "build_overlay", "overlay_from_trainable_tokens"]
