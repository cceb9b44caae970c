"""What the fused runners (``FusedNgramEmbedding``, ``NgramDecoder``) check before they build
anything or launch: the weights they serve, their sizes, adapter slots and outputs."""

from __future__ import annotations

from typing import Any

from gpu_runtime import Events, GpuBackend, PitchedCopies, interop, validate

from ..ops import ngram_fused as fused_ops
from ..ops.ngram_decode import NO_ADAPTER
from ..overlay.slots import OverlaySlots
from .dims import NgramDims
from .weights import NgramWeights

_U32 = 1 << 32


def check_weights(what: str, weights: Any) -> NgramWeights:
    """Open ``NgramWeights`` on a backend with events and pitched copies."""
    if not isinstance(weights, NgramWeights):
        raise TypeError(f"{what}: weights must be NgramWeights, got {type(weights).__name__}")
    validate.require_open(weights.closed, f"{what}: its NgramWeights")
    gpu = weights.gpu
    if not (isinstance(gpu, Events) and isinstance(gpu, PitchedCopies)):
        raise TypeError(
            f"{what}: the backend needs events and pitched copies (gpu_runtime.Events, "
            f"PitchedCopies); {type(gpu).__name__} lacks them"
        )
    return weights


NO_ROW_CACHE = (
    "NgramDecoder: RowCache tables need host work every step; serve them with "
    "FusedNgramEmbedding, or hold the table in host memory (NgramTable.Host)"
)


def check_sizes(max_seqs: int, max_rows: int, max_draft: int) -> tuple[int, int, int]:
    """A decoder's sizes as ints (its constructor's checks, also run before a model is loaded)."""
    return (
        validate.positive(max_seqs, "NgramDecoder: max_seqs", limit=1 << 31),
        validate.positive(max_rows, "NgramDecoder: max_rows", limit=1 << 31),
        validate.count(max_draft, "NgramDecoder: max_draft", limit=1 << 31),
    )


def check_servable(dims: NgramDims, max_rows: int) -> int:
    """``ValueError`` for dims the fused kernels cannot serve, before anything is built; ``max_rows`` as an int."""
    max_rows = validate.positive(max_rows, "max_rows")
    if dims.vocab_size >= fused_ops.NO_TOKEN:
        raise ValueError(f"fused n-gram path: vocab_size {dims.vocab_size} must be < 2**32 - 1")
    if dims.eos_id is not None and dims.eos_id >= fused_ops.NO_TOKEN:
        raise ValueError("fused n-gram path: eos_id must be < 2**32 - 1")
    if any(dims.table_rows(c) >= _U32 for c in range(dims.num_tables())):
        raise ValueError("fused n-gram path: every table must have < 2**32 rows")
    return max_rows


def check_adapter_slots(what: str, slots: OverlaySlots | None, dims: NgramDims, gpu: GpuBackend) -> None:
    """``slots`` (None: no adapters) can route this model's word rows: open ``OverlaySlots`` on
    ``gpu`` whose vocab and row width are the model's (an adapter of another width raises
    when it is loaded into them)."""
    if slots is None:
        return
    if not isinstance(slots, OverlaySlots):
        raise TypeError(f"{what}: adapter_slots must be an OverlaySlots, got {type(slots).__name__}")
    validate.require_open(slots.closed, f"{what}: its adapter_slots")
    if slots.gpu is not gpu:
        raise ValueError(f"{what}: adapter_slots live on another backend than the weights")
    if (slots.vocab, slots.h) != (dims.vocab_size, dims.hidden_size):
        raise ValueError(
            f"{what}: adapter_slots hold vocab {slots.vocab} x {slots.h}, the model's "
            f"word table is {dims.vocab_size} x {dims.hidden_size}"
        )


def out_address(out: Any, what: str, rows: int, dims: NgramDims, gpu: GpuBackend) -> int:
    """The address of an output of ``rows`` rows of D bf16, writable (an address, a
    ``DeviceArray`` or a foreign array: ``gpu_runtime.interop``)."""
    h = dims.hidden_size
    return interop.device_address(
        out, f"{what} out", dtypes=(interop.BF16,), count=rows * h, gpu=gpu, cols=h, writable=True
    )


def adapter_index(value: Any, num_slots: int, what: str) -> int | None:
    """One sequence's adapter slot as given on the host: None for ``NO_ADAPTER`` (or -1)."""
    a = validate.integer(value, what)
    if a in (NO_ADAPTER, -1):
        return None
    if not 0 <= a < num_slots:
        raise ValueError(f"{what}: adapter slot {a} outside 0..{num_slots - 1} (NO_ADAPTER: none)")
    return a
