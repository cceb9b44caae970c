"""The public surface the walks of ``test_public_surface`` and ``test_docstrings`` read: the
names in each module's ``__all__``, and a few names public packages use from inner modules."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from typing import Any

MODULES = ["gpu_runtime", "layers.engram", "layers.ngram_embed", "layers.overlay", "layers.peft_adapter", "layers.tensor_parallel",
           "layers.tensor_parallel.nccl"]
MORE = {"layers.dense_weight": ["DenseWeight"], "layers.block_fp8_weight": ["BlockFp8Weight"],
        "layers.ops.token_overlay": ["OverlayKernels"]}


def exported(modules: Sequence[str] = MODULES) -> Iterator[tuple[str, str, Any]]:
    """(module, name, object) for every name of ``modules``' ``__all__`` and of ``MORE``, in order;
    an object two modules export comes once per module."""
    names = [(m, n) for m in modules for n in importlib.import_module(m).__all__]
    names += [(m, n) for m, ns in MORE.items() for n in ns]
    for module, name in names:
        yield module, name, getattr(importlib.import_module(module), name)
