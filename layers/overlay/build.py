"""Building an ``AdapterOverlay``: from full adapter tables (``build_overlay``: the differing rows
found on the GPU with ``embed_rowdiff``, only the flags come back) or from PEFT's
trainable-tokens form (``overlay_from_trainable_tokens``: ids plus their rows, host only)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import numpy as np

from gpu_runtime import DeviceBuffer, DevicePtr, GpuBackend, validate
from gpu_runtime.backend import check_backend

from ..dense_weight import DenseWeight
from ..ops.token_overlay import OverlayKernels, embed_rowdiff
from .model import BF16, AdapterOverlay, TableOverlay, as_bf16_rows


def _table_diff(
    gpu: GpuBackend, rowdiff: Any, served: DenseWeight | None, adapter: Any, thresh: float, stream: int, which: str
) -> TableOverlay:
    """The rows of ``adapter`` that differ from ``served`` by more than ``thresh``, found on the
    GPU with ``embed_rowdiff`` (only the flags come back), then gathered from the adapter table."""
    if served is None:
        raise ValueError(f"the adapter ships a full {which} table but no served {which} was given")
    if not isinstance(served, DenseWeight) or served.dtype != BF16:
        raise TypeError(
            f"served {which} must be a bfloat16 DenseWeight, got {getattr(served, 'dtype', type(served).__name__)}"
        )
    served.check_on(gpu, f"served {which}")
    rows, h = served.shape
    if isinstance(adapter, DenseWeight):
        if adapter.dtype != BF16:
            raise TypeError(f"adapter {which} must be bfloat16, got {adapter.dtype}")
        adapter.check_on(gpu, f"adapter {which}")
        host = None
        shape = adapter.shape
    else:
        host = as_bf16_rows(adapter, f"adapter {which}")
        shape = host.shape
    if tuple(shape) != (rows, h):
        raise ValueError(f"adapter {which} shape {tuple(shape)} != served {which} shape {(rows, h)}")

    with ExitStack() as temporaries:  # freed once the flags are back
        base = adapter.weight if host is None else temporaries.enter_context(DeviceBuffer.upload(gpu, host, stream)).ptr
        flags_dev = temporaries.enter_context(DeviceBuffer(gpu, rows))
        embed_rowdiff(gpu, rowdiff, base, served.weight, flags_dev.ptr, rows, h, thresh, stream)
        flags = np.empty(rows, np.uint8)
        gpu.copy_d2h(flags, flags_dev.ptr, stream)  # waits for the stream: temporaries are free after
    ids = np.flatnonzero(flags).astype(np.int32)
    if host is not None:
        out = host[ids]
    else:
        out = np.empty((ids.size, h), BF16)
        _gather_runs(gpu, adapter.weight, ids, h, out, stream)
    return TableOverlay(ids, np.ascontiguousarray(out))


def _gather_runs(gpu: GpuBackend, table: DevicePtr, ids: np.ndarray, h: int, out: np.ndarray, stream: int) -> None:
    """Download rows ``ids`` (sorted) of a device bf16 table, one copy per run of consecutive ids."""
    if ids.size == 0:
        return
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [ids.size]))
    row_bytes = h * BF16.itemsize
    for a, b in zip(starts.tolist(), ends.tolist()):
        gpu.copy_d2h(out[a:b], DevicePtr(table).offset(int(ids[a]) * row_bytes), stream)


def build_overlay(
    gpu: GpuBackend,
    kernels: OverlayKernels,
    served_embed: DenseWeight | None,
    adapter_embed: np.ndarray | DenseWeight | None,
    served_lm_head: DenseWeight | None = None,
    adapter_lm_head: np.ndarray | DenseWeight | None = None,
    thresh: float = 0.0,
    stream: int = 0,
) -> AdapterOverlay:
    """The overlay of an adapter that ships full tables (``modules_to_save`` copies).

    A row is overridden where ``max_i |adapter - served| > thresh`` (a NaN counts as differing);
    the differing rows are found on the GPU and gathered from the adapter's table. Raises
    ``KernelNotFoundError`` for an adapter with overlay tensors when the overlay kernels are missing,
    and ``ValueError`` for a table whose shape differs from the served one or that has no served
    counterpart.
    """
    check_backend(gpu, "build_overlay: gpu")
    stream = validate.stream(stream, "build_overlay: stream")
    if adapter_embed is not None:
        kernels.require("embedding overlay tensors", "rowdiff", "embed_overlay")
    if adapter_lm_head is not None:
        kernels.require("LM-head overlay tensors", "rowdiff", "lmhead_overlay_bf16", "lmhead_overlay_f32")
    embed = lm_head = None
    if adapter_embed is not None:
        embed = _table_diff(gpu, kernels.rowdiff, served_embed, adapter_embed, thresh, stream, "embedding")
    if adapter_lm_head is not None:
        lm_head = _table_diff(gpu, kernels.rowdiff, served_lm_head, adapter_lm_head, thresh, stream, "LM head")
    return AdapterOverlay(embed, lm_head)


def overlay_from_trainable_tokens(
    indices: Any, embed_rows: Any, lm_head_rows: Any = None, tied: bool = False, *, vocab: int | None = None
) -> AdapterOverlay:
    """The overlay of PEFT's ``trainable_token_indices`` form: token ids plus their absolute
    replacement rows (``[len(indices), h]``). With ``tied`` (embedding and LM head share one
    matrix) the LM head reuses the embedding rows, so ``lm_head_rows`` must not be given.
    ``vocab``, when known, rejects ids >= vocab here (``ValueError``) rather than at
    ``OverlaySlots.load``."""
    if validate.boolean(tied, "overlay_from_trainable_tokens: tied") and lm_head_rows is not None:
        raise ValueError("tied embeddings: the LM head reuses the embedding rows; lm_head_rows must not be given")
    if tied and embed_rows is None:
        raise ValueError("tied embeddings need embed_rows")
    embed = (
        TableOverlay.of(indices, embed_rows, vocab, "trainable-tokens embedding") if embed_rows is not None else None
    )
    if tied:
        lm_head = embed
    elif lm_head_rows is not None:
        lm_head = TableOverlay.of(indices, lm_head_rows, vocab, "trainable-tokens LM head")
    else:
        lm_head = None
    if embed is None and lm_head is None:
        raise ValueError("trainable tokens without embedding or LM-head rows")
    if embed is not None and lm_head is not None and embed.h != lm_head.h:
        raise ValueError(f"embedding rows width {embed.h} != LM-head rows width {lm_head.h}")
    return AdapterOverlay(embed, lm_head)
