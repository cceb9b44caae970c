"""Launchers for the LoRA token-overlay kernels in ``kernels/token_overlay.cu`` (seed 001).

- ``embed_rowdiff``: at adapter build, which adapter base rows differ from the served table;
- ``embed_overlay_routed``: in the forward, replace overridden vocab rows after the embed gather;
- ``lmhead_overlay_routed``: in the forward, recompute overridden logit columns.

Each launcher's positional arguments, and the kernel's parameters, are the seed's
``KernelLaunch`` chain position for position (a CPU test reads the seed: docs/SEED.md). The
launchers check widths, counts and the pointers the kernels need, and return without a launch on
a zero count; packing checks the rest (``gpu_runtime.launch``).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

from gpu_runtime import GpuBackend, KernelHandle, KernelNotFoundError, LaunchConfig, validate
from gpu_runtime.backend import check_backend

from ..kernel_files import try_kernel

MODULE = "token_overlay"
OVERLAY_BAD_SLOT = 1  # the routed kernels' error word: a row's slot index was >= num_slots (the row skipped)
MAX_LMHEAD_OVERRIDES = 65535  # ids an LM-head overlay slot may override: the kernel's grid y, one id a row


@functools.cache
def _config(x: int, y: int, threads: int) -> LaunchConfig:
    return LaunchConfig((x, y), threads)


def embed_overlay_config(num_tokens: int) -> LaunchConfig:
    """``embed_overlay_routed``'s launch over ``num_tokens >= 1`` rows: a block a row."""
    return _config(num_tokens, 1, 256)


def lmhead_overlay_config(m: int, max_n_override: int) -> LaunchConfig:
    """``lmhead_overlay_routed``'s launch: a warp per (row, override), both counts >= 1."""
    return _config(m, max_n_override, 32)


@dataclass(frozen=True)
class OverlayKernels:
    """The four token-overlay kernels, resolved once at model construction with ``try_kernel``.

    A missing kernel gives ``KernelHandle(0)``: the forward hooks then return without a launch,
    and ``build_overlay`` (and ``OverlaySlots.load``) raise ``KernelNotFoundError`` for an adapter
    that ships overlay tensors.
    """

    rowdiff: KernelHandle
    embed_overlay: KernelHandle
    lmhead_overlay_bf16: KernelHandle
    lmhead_overlay_f32: KernelHandle

    @classmethod
    def new(cls, gpu: GpuBackend) -> OverlayKernels:
        """The kernels loaded on ``gpu`` (each missing one ``KernelHandle(0)``)."""
        check_backend(gpu, "OverlayKernels.new: gpu")
        return cls(
            rowdiff=try_kernel(gpu, MODULE, "embed_rowdiff_bf16"),
            embed_overlay=try_kernel(gpu, MODULE, "embed_overlay_routed_bf16"),
            lmhead_overlay_bf16=try_kernel(gpu, MODULE, "lmhead_overlay_routed_bf16"),
            lmhead_overlay_f32=try_kernel(gpu, MODULE, "lmhead_overlay_routed_f32"),
        )

    @classmethod
    def default(cls) -> OverlayKernels:
        """All handles zero, as if no overlay kernel were loaded."""
        zero = KernelHandle(0)
        return cls(zero, zero, zero, zero)

    def require(self, ships: str, *names: str) -> None:
        """Raise ``KernelNotFoundError`` for an adapter that ships ``ships`` (e.g. "embedding overlay
        tensors") when any of the kernels ``names`` (field names) is not loaded, before any work (as
        the Rust engine this mirrors does)."""
        missing = [n for n in names if not getattr(self, n)]
        if missing:
            raise KernelNotFoundError(
                f"the adapter ships {ships} but the token-overlay kernels {missing} are not loaded "
                "(kernels/token_overlay.cu missing or without them)"
            )


def embed_rowdiff(
    gpu: GpuBackend,
    kernel: KernelHandle,
    base: int,
    served: int,
    flags: int,
    rows: int,
    h: int,
    thresh: float,
    stream: int = 0,
) -> None:
    """``flags[r] = (max_i |base[r,i] - served[r,i]| > thresh)``, one thread per row.

    ``base`` and ``served`` are ``[rows, h]`` bf16; ``flags`` is ``[rows]`` u8. A NaN difference
    counts as greater than any ``thresh``; equal values (equal infinities too) differ by 0.
    Needed at adapter build, so a missing kernel is an error here, not a silent no-op.
    """
    if not kernel:
        raise ValueError("embed_rowdiff: kernel not loaded (KernelHandle(0))")
    rows = validate.u32(rows, "embed_rowdiff rows")
    h = validate.positive(h, "embed_rowdiff h")
    if isinstance(thresh, bool):  # packing's f32 takes any real, a bool too
        raise TypeError(f"embed_rowdiff thresh must be a real number, got {thresh!r}")
    if isinstance(thresh, numbers.Real) and math.isnan(thresh):  # a non-number: the spec's
        raise ValueError("embed_rowdiff thresh is NaN: it would flag every row")
    if rows == 0:
        return
    validate.pointers("embed_rowdiff", "base served flags", base, served, flags)
    gpu.bind(kernel).launch(_config(-(-rows // 256), 1, 256), stream, base, served, flags, rows, h, thresh)


def embed_overlay_routed(
    gpu: GpuBackend,
    kernel: KernelHandle,
    ids: int,
    seq_slot: int,
    active: int,
    slot_map_tab: int,
    rows_tab: int,
    n_tab: int,
    out: int,
    num_tokens: int,
    h: int,
    vocab: int,
    stream: int = 0,
    *,
    num_slots: int = 0,
    err: int = 0,
) -> None:
    """In-place replacement of overridden vocab rows in ``out`` (``[num_tokens, h]`` bf16), after
    the embed gather.

    Per row ``r``: ``s = seq_slot[r]``, or ``active`` when ``seq_slot`` is null; skip when
    ``s < 0``, when ``slot_map_tab[s]`` (or ``rows_tab[s]``) is null, or when ``ids[r] >= vocab``;
    ``slot = slot_map_tab[s][ids[r]]``; skip when ``slot < 0`` or ``slot >= n_tab[s]``; otherwise
    copy ``rows_tab[s][slot]`` over ``out[r]``. ``num_slots`` (past the seed's arguments): the
    tables' length; a row whose ``s`` is not below it is skipped and flagged in the u32 word at
    ``err`` (nullable) as ``OVERLAY_BAD_SLOT``. With the default 0 every slot index the kernel
    reads must be below the tables' length (the seed's contract). A forward hook: with
    ``KernelHandle(0)`` (overlay kernels not loaded) it returns without a launch.
    """
    if not kernel:
        return
    num_tokens = validate.u32(num_tokens, "embed_overlay_routed num_tokens")
    h = validate.positive(h, "embed_overlay_routed h")
    vocab = validate.positive(vocab, "embed_overlay_routed vocab")
    if type(active) is not int:
        active = validate.integer(active, "embed_overlay_routed active")
    if num_tokens == 0:
        return
    validate.pointers(
        "embed_overlay_routed", "ids slot_map_tab rows_tab n_tab out", ids, slot_map_tab, rows_tab, n_tab, out
    )
    args = (ids, seq_slot, active, slot_map_tab, rows_tab, n_tab, out, h, vocab, num_slots, err)
    gpu.bind(kernel).launch(embed_overlay_config(num_tokens), stream, *args)


def lmhead_overlay_routed(
    gpu: GpuBackend,
    kernel: KernelHandle,
    hidden: int,
    seq_slot: int,
    active: int,
    rows_tab: int,
    ids_tab: int,
    n_tab: int,
    logits: int,
    m: int,
    max_n_override: int,
    h: int,
    vocab: int,
    stream: int = 0,
    *,
    num_slots: int = 0,
    err: int = 0,
) -> None:
    """In-place recompute of overridden logit columns in ``logits`` (``[m, vocab]``, bf16 or fp32
    to match ``kernel``).

    One warp per ``(row, j)``, where ``j < max_n_override`` indexes the overridden ids of that
    row's adapter slot; the kernel skips ``j >= n_tab[s]``, null tables and ids outside
    ``0..vocab-1``. ``hidden`` is ``[m, h]`` bf16; ``seq_slot`` is ``[m]`` i32, or null for the
    uniform ``active`` slot. ``num_slots`` and ``err``: as ``embed_overlay_routed``'s. A forward
    hook: with ``KernelHandle(0)`` it returns without a launch.
    """
    if not kernel:
        return
    m = validate.u32(m, "lmhead_overlay_routed m")
    max_n_override = validate.u32(max_n_override, "lmhead_overlay_routed max_n_override")
    h = validate.positive(h, "lmhead_overlay_routed h")
    vocab = validate.positive(vocab, "lmhead_overlay_routed vocab")
    if max_n_override > MAX_LMHEAD_OVERRIDES:
        raise ValueError(
            f"lmhead_overlay_routed max_n_override {max_n_override} > {MAX_LMHEAD_OVERRIDES} (grid y limit)"
        )
    if type(active) is not int:
        active = validate.integer(active, "lmhead_overlay_routed active")
    if m == 0 or max_n_override == 0:
        return
    validate.pointers(
        "lmhead_overlay_routed", "hidden rows_tab ids_tab n_tab logits", hidden, rows_tab, ids_tab, n_tab, logits
    )
    args = (hidden, seq_slot, active, rows_tab, ids_tab, n_tab, logits, h, vocab, num_slots, err)
    gpu.bind(kernel).launch(lmhead_overlay_config(m, max_n_override), stream, *args)


__all__ = [
    "MAX_LMHEAD_OVERRIDES",
    "OVERLAY_BAD_SLOT",
    "OverlayKernels",
    "embed_overlay_routed",
    "embed_rowdiff",
    "lmhead_overlay_routed",
]
