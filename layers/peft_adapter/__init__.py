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

Modules: ``config`` (file names, ``adapter_config.json``, ``PeftAdapterError``), ``read``
(``read_peft_adapter``: the folder read and checked), ``adapter`` (``PeftAdapter`` and its
``overlay``: turning what was read into an ``AdapterOverlay``).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..ops.token_overlay import OverlayKernels
from ..overlay import AdapterOverlay
from .adapter import PeftAdapter, PeftTable, _check_thresh
from .config import (BIN_NAME, CONFIG_NAME, DEFAULT_EMBED_NAMES, DEFAULT_LM_HEAD_NAMES, SAFETENSORS_NAME,
                     PeftAdapterError)
from .read import read_peft_adapter


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
