"""Launchers for the LoRA token-overlay kernels in ``kernels/token_overlay.cu`` (seed 001).

- ``embed_rowdiff``: at adapter build, which adapter base rows differ from the served table;
- ``embed_overlay_routed``: in the forward, replace overridden vocab rows after the embed gather;
- ``lmhead_overlay_routed``: in the forward, recompute overridden logit columns.

Arguments are passed by position, so each launcher's argument order matches its ``.cu``
signature (and the seed's ``KernelLaunch`` chain, position for position). Every check runs
before the launch; a zero count is a no-op without a launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpu_runtime import GpuBackend, KernelHandle, KernelLaunch, KernelNotFoundError

from .checks import require_count, require_ptr
from .loading import try_kernel

MODULE = "token_overlay"
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_GRID_Y_MAX = 65535


@dataclass(frozen=True)
class OverlayKernels:
    """The four token-overlay kernels, resolved once at model construction with ``try_kernel``.

    A missing kernel gives ``KernelHandle(0)``: the forward hooks then return without a launch,
    and ``build_overlay`` (and ``OverlaySlots.load``) refuse an adapter that ships overlay tensors.
    """

    rowdiff: KernelHandle
    embed_overlay: KernelHandle
    lmhead_overlay_bf16: KernelHandle
    lmhead_overlay_f32: KernelHandle

    @classmethod
    def new(cls, gpu: GpuBackend) -> "OverlayKernels":
        return cls(
            rowdiff=try_kernel(gpu, MODULE, "embed_rowdiff_bf16"),
            embed_overlay=try_kernel(gpu, MODULE, "embed_overlay_routed_bf16"),
            lmhead_overlay_bf16=try_kernel(gpu, MODULE, "lmhead_overlay_routed_bf16"),
            lmhead_overlay_f32=try_kernel(gpu, MODULE, "lmhead_overlay_routed_f32"),
        )

    @classmethod
    def default(cls) -> "OverlayKernels":
        """All handles zero, as if no overlay kernel were loaded."""
        zero = KernelHandle(0)
        return cls(zero, zero, zero, zero)

    def require(self, ships: str, *names: str) -> None:
        """Refuse an adapter that ships ``ships`` (e.g. "embedding overlay tensors") when any of
        the kernels ``names`` (field names) is not loaded: the seed's refusal, before any work."""
        missing = [n for n in names if not getattr(self, n)]
        if missing:
            raise KernelNotFoundError(
                f"the adapter ships {ships} but the token-overlay kernels {missing} are not loaded "
                "(kernels/token_overlay.cu missing or without them)")


def _require_i32(value: int, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what} must be an int, got {value!r}")
    value = int(value)
    if not _I32_MIN <= value <= _I32_MAX:
        raise ValueError(f"{what} must fit i32, got {value}")
    return value


def _require_positive(n: int, what: str) -> int:
    n = require_count(n, what)
    if n == 0:
        raise ValueError(f"{what} must be >= 1 (a zero-width table is a caller bug)")
    return n


def embed_rowdiff(gpu: GpuBackend, kernel: KernelHandle, base: int, served: int, flags: int,
                  rows: int, h: int, thresh: float, stream: int = 0) -> None:
    """``flags[r] = (max_i |base[r,i] - served[r,i]| > thresh)``, one thread per row.

    ``base`` and ``served`` are ``[rows, h]`` bf16; ``flags`` is ``[rows]`` u8. A NaN difference
    counts as greater than any ``thresh``; equal values (equal infinities too) differ by 0.
    Needed at adapter build, so a missing kernel is an error here, not a silent no-op.
    """
    if not kernel:
        raise ValueError("embed_rowdiff: kernel not loaded (KernelHandle(0))")
    rows = require_count(rows, "embed_rowdiff rows")
    h = _require_positive(h, "embed_rowdiff h")
    if isinstance(thresh, bool) or not isinstance(thresh, (int, float)) and not hasattr(thresh, "__float__"):
        raise TypeError(f"embed_rowdiff thresh must be a real number, got {thresh!r}")
    if math.isnan(float(thresh)):
        raise ValueError("embed_rowdiff thresh is NaN: it would flag every row")
    if rows == 0:
        return
    require_ptr(base, "embed_rowdiff base")
    require_ptr(served, "embed_rowdiff served")
    require_ptr(flags, "embed_rowdiff flags")
    (KernelLaunch.new(gpu, kernel)
        .grid([(rows + 255) // 256, 1, 1])
        .block([256, 1, 1])
        .arg_ptr(base)
        .arg_ptr(served)
        .arg_ptr(flags)
        .arg_u32(rows)
        .arg_u32(h)
        .arg_f32(thresh)
        .launch(stream))


def embed_overlay_routed(gpu: GpuBackend, kernel: KernelHandle, ids: int, seq_slot: int,
                         active: int, slot_map_tab: int, rows_tab: int, n_tab: int, out: int,
                         num_tokens: int, h: int, vocab: int, stream: int = 0) -> None:
    """In-place replacement of overridden vocab rows in ``out`` (``[num_tokens, h]`` bf16), after
    the embed gather.

    Per row ``r``: ``s = seq_slot[r]``, or ``active`` when ``seq_slot`` is null; skip when
    ``s < 0``, when ``slot_map_tab[s]`` (or ``rows_tab[s]``) is null, or when ``ids[r] >= vocab``;
    ``slot = slot_map_tab[s][ids[r]]``; skip when ``slot < 0`` or ``slot >= n_tab[s]``; otherwise
    copy ``rows_tab[s][slot]`` over ``out[r]``. Every slot index the kernel reads must be below
    the tables' length: the caller (``OverlaySlots``) guarantees it. A forward hook: with
    ``KernelHandle(0)`` (overlay kernels not loaded) it returns without a launch.
    """
    if not kernel:
        return
    num_tokens = require_count(num_tokens, "embed_overlay_routed num_tokens")
    h = _require_positive(h, "embed_overlay_routed h")
    vocab = _require_positive(vocab, "embed_overlay_routed vocab")
    active = _require_i32(active, "embed_overlay_routed active")
    if num_tokens == 0:
        return
    require_ptr(ids, "embed_overlay_routed ids")
    require_ptr(slot_map_tab, "embed_overlay_routed slot_map_tab")
    require_ptr(rows_tab, "embed_overlay_routed rows_tab")
    require_ptr(n_tab, "embed_overlay_routed n_tab")
    require_ptr(out, "embed_overlay_routed out")
    (KernelLaunch.new(gpu, kernel)
        .grid([num_tokens, 1, 1])
        .block([256, 1, 1])
        .arg_ptr(ids)
        .arg_ptr(seq_slot)
        .arg_i32(active)
        .arg_ptr(slot_map_tab)
        .arg_ptr(rows_tab)
        .arg_ptr(n_tab)
        .arg_ptr(out)
        .arg_u32(h)
        .arg_u32(vocab)
        .launch(stream))


def lmhead_overlay_routed(gpu: GpuBackend, kernel: KernelHandle, hidden: int, seq_slot: int,
                          active: int, rows_tab: int, ids_tab: int, n_tab: int, logits: int,
                          m: int, max_n_override: int, h: int, vocab: int, stream: int = 0) -> None:
    """In-place recompute of overridden logit columns in ``logits`` (``[m, vocab]``, bf16 or fp32
    to match ``kernel``).

    One warp per ``(row, j)``, where ``j < max_n_override`` indexes the overridden ids of that
    row's adapter slot; the kernel skips ``j >= n_tab[s]``, null tables and ids outside
    ``0..vocab-1``. ``hidden`` is ``[m, h]`` bf16; ``seq_slot`` is ``[m]`` i32, or null for the
    uniform ``active`` slot. A forward hook: with ``KernelHandle(0)`` it returns without a launch.
    """
    if not kernel:
        return
    m = require_count(m, "lmhead_overlay_routed m")
    max_n_override = require_count(max_n_override, "lmhead_overlay_routed max_n_override")
    h = _require_positive(h, "lmhead_overlay_routed h")
    vocab = _require_positive(vocab, "lmhead_overlay_routed vocab")
    active = _require_i32(active, "lmhead_overlay_routed active")
    if max_n_override > _GRID_Y_MAX:
        raise ValueError(f"lmhead_overlay_routed max_n_override {max_n_override} > {_GRID_Y_MAX} "
                         "(grid y limit)")
    if m == 0 or max_n_override == 0:
        return
    require_ptr(hidden, "lmhead_overlay_routed hidden")
    require_ptr(rows_tab, "lmhead_overlay_routed rows_tab")
    require_ptr(ids_tab, "lmhead_overlay_routed ids_tab")
    require_ptr(n_tab, "lmhead_overlay_routed n_tab")
    require_ptr(logits, "lmhead_overlay_routed logits")
    (KernelLaunch.new(gpu, kernel)
        .grid([m, max_n_override, 1])
        .block([32, 1, 1])
        .arg_ptr(hidden)
        .arg_ptr(seq_slot)
        .arg_i32(active)
        .arg_ptr(rows_tab)
        .arg_ptr(ids_tab)
        .arg_ptr(n_tab)
        .arg_ptr(logits)
        .arg_u32(h)
        .arg_u32(vocab)
        .launch(stream))


__all__ = ["OverlayKernels", "embed_overlay_routed", "embed_rowdiff", "lmhead_overlay_routed"]
