"""The overlays' cases: the overlay references (``layers.reference``), ``build_overlay``,
``overlay_from_trainable_tokens`` and ``OverlaySlots`` (construction, ``load`` / ``replace`` /
``evict``, the forward hooks)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpu_runtime import ClosedError, KernelNotFoundError
from layers.ops.token_overlay import OverlayKernels
from layers.overlay import (AdapterOverlay, OverlaySlots, TableOverlay, build_overlay,
                            overlay_from_trainable_tokens)
from layers.dense_weight import BF16, FP8, DenseWeight
from layers.reference import embed_overlay_ref, gather_then_overlay_ref, logits_then_overlay_ref
from tests.bad_inputs.matrix import NULL, case, expect
from tests.bad_inputs.world import World
from tests.helpers import bits, random_bf16
from tests.helpers.overlay import check_slot_contents, random_overlay


def _overlay(w: World, ids: list[int], h: int = 5) -> AdapterOverlay:
    return AdapterOverlay(TableOverlay.of(ids, random_bf16(w.rng, (len(ids), h))))


def _embed_ref(w: World, **changes) -> np.ndarray:
    """``embed_overlay_ref`` on 3 of the world's served rows (vocab 30, width 4), one slot
    replacing token 3, ``changes`` replacing any argument."""
    slot_map = np.full(30, -1, np.int32)
    slot_map[3] = 0
    args = dict(out=w.served_host[:3], ids=np.array([3, 1, 29]), seq_slot=None, active=0, slot_maps=[slot_map],
                slot_rows=[random_bf16(w.rng, (1, 4))], n_tab=[1], vocab=30) | changes
    return embed_overlay_ref(*args.values())


CPU_CASES = [
    # -- layers.reference: the overlay references (the n-gram ones and the row's good call: cases.ngram) --
    case("layers.reference", "dtype", lambda w: _embed_ref(w, ids=np.array([3.0, 1.0, 29.0])), TypeError,
         "embed_overlay_ref: ids must be integers", detail="overlay-ids"),
    case("layers.reference", "shape", lambda w: _embed_ref(w, slot_rows=[random_bf16(w.rng, (1, 5))]), ValueError,
         r"embed_overlay_ref: slot_rows\[0\] must be \[rows, 4\], got shape \[1, 5\]", detail="overlay-rows"),
    case("layers.reference", "length", lambda w: _embed_ref(w, n_tab=[1, 1]), ValueError,
         r"embed_overlay_ref: n_tab: 2 slots \(slot_maps has 1\)", detail="overlay-n_tab"),
    case("layers.reference", "range", lambda w: _embed_ref(w, active=1), ValueError,
         "embed_overlay_ref: active slot 1 outside the 1 slots", detail="overlay-active"),
    case("layers.reference", "null", lambda w: logits_then_overlay_ref(None, w.served_host, None, 0, [], [], [], 1),
         TypeError, "logits_then_overlay_ref: hidden must be a numpy array, got NoneType", detail="overlay-hidden"),
    case("layers.reference", "id", lambda w: gather_then_overlay_ref(w.served_host, [10], None, -1, [], [], []),
         ValueError, r"gather_then_overlay_ref: ids\[0\] = 10 outside 0\.\.9", detail="overlay-gather"),
    # -- build_overlay --
    case("build_overlay", "dtype", lambda w: build_overlay(
        w.gpu, w.kernels, DenseWeight(w.p[0], (10, 4), FP8, w.p[1]), w.served_host), TypeError, "bfloat16"),
    case("build_overlay", "dtype", lambda w: build_overlay(
        w.gpu, w.kernels, w.served, np.ones((10, 4), np.int32)), TypeError, "bfloat16", detail="adapter"),
    case("build_overlay", "shape",
         lambda w: build_overlay(w.gpu, w.kernels, w.served, random_bf16(w.rng, (10, 5))),
         ValueError, "shape"),
    case("build_overlay", "length",
         lambda w: build_overlay(w.gpu, w.kernels, w.served, random_bf16(w.rng, (11, 4))),
         ValueError, "shape"),
    case("build_overlay", "range", lambda w: build_overlay(w.gpu, w.kernels, w.served, w.served_host,
                                                           thresh=float("nan")),
         ValueError, "NaN", temp=True),  # found in embed_rowdiff: after the adapter's upload to a temporary
    case("build_overlay", "null", lambda w: build_overlay(w.gpu, w.kernels, None, w.served_host),
         ValueError, "no served"),
    case("build_overlay", "null",
         lambda w: build_overlay(w.gpu, OverlayKernels.default(), w.served, w.served_host),
         KernelNotFoundError, "not loaded", detail="kernels"),
    case("build_overlay", "empty", lambda w: expect(
        build_overlay(w.gpu, w.kernels, w.served, None) == AdapterOverlay(None, None))),
    # -- overlay_from_trainable_tokens --
    case("overlay_from_trainable_tokens", "dtype", lambda w: overlay_from_trainable_tokens(
        [1, 2], np.ones((2, 4), np.int32)), TypeError, "bfloat16"),
    case("overlay_from_trainable_tokens", "dtype", lambda w: overlay_from_trainable_tokens(
        [1.0, 2.0], random_bf16(w.rng, (2, 4))), TypeError, "must be integers", detail="ids"),
    case("overlay_from_trainable_tokens", "shape", lambda w: overlay_from_trainable_tokens(
        [1, 2], random_bf16(w.rng, 8)), ValueError, "2-D"),
    case("overlay_from_trainable_tokens", "length", lambda w: overlay_from_trainable_tokens(
        [1, 2, 3], random_bf16(w.rng, (2, 4))), ValueError, "3 ids but 2 rows"),
    case("overlay_from_trainable_tokens", "range", lambda w: overlay_from_trainable_tokens(
        [1, -2], random_bf16(w.rng, (2, 4))), ValueError, "negative"),
    case("overlay_from_trainable_tokens", "null", lambda w: overlay_from_trainable_tokens([1, 2], None),
         ValueError, "without embedding or LM-head rows"),
    case("overlay_from_trainable_tokens", "id", lambda w: overlay_from_trainable_tokens(
        [1, 30], random_bf16(w.rng, (2, 4)), vocab=30), ValueError, ">= vocab 30"),
    case("overlay_from_trainable_tokens", "empty", lambda w: expect(overlay_from_trainable_tokens(
        [], np.zeros((0, 4), BF16)).embed.n == 0)),
    case("overlay_from_trainable_tokens", "range", lambda w: overlay_from_trainable_tokens(
        [1, 2], np.array([[1.0, np.nan, 0.0, 2.0], [1.0, 2.0, 3.0, 4.0]])), ValueError,
         r"non-finite values \(NaN/inf, or too large for bf16\) in the rows of token ids \[1\]", detail="nan"),
    case("overlay_from_trainable_tokens", "dtype", lambda w: overlay_from_trainable_tokens(
        [1, 2], random_bf16(w.rng, (2, 4)), tied="yes"), TypeError, "tied must be a bool", detail="tied"),
    # -- OverlaySlots: construction, load / replace / evict --
    case("OverlaySlots", "dtype", lambda w: OverlaySlots(w.gpu, 2, 30, 1.5, kernels=w.kernels), TypeError,
         "must be an int"),
    case("OverlaySlots", "dtype", lambda w: w.slots.load(1, "adapter"), TypeError, "expected an AdapterOverlay",
         detail="overlay"),
    case("OverlaySlots", "dtype", lambda w: w.slots.load(True, _overlay(w, [1])), TypeError,
         "slot index must be an int", detail="slot"),
    case("OverlaySlots", "dtype", lambda w: w.slots.load(1, AdapterOverlay(embed=5)), TypeError,
         "AdapterOverlay.embed must be a TableOverlay or None, got int", detail="overlay-field"),
    case("OverlaySlots", "shape", lambda w: w.slots.load(1, _overlay(w, [1, 2], h=6)), ValueError, "width 6"),
    case("OverlaySlots", "length", lambda w: OverlaySlots(w.gpu, 2, 2**31 + 1, 5, kernels=w.kernels),
         ValueError, "too large"),
    case("OverlaySlots", "range", lambda w: w.slots.load(2, _overlay(w, [1])), ValueError, "slot index 2 outside"),
    case("OverlaySlots", "range", lambda w: w.slots.replace(-1, _overlay(w, [1])), ValueError,
         "slot index -1 outside", detail="replace"),
    case("OverlaySlots", "range", lambda w: w.slots.load(0, _overlay(w, [1])), ValueError, "in use",
         detail="in-use"),
    case("OverlaySlots", "null", lambda w: w.slots_without_kernels.load(1, _overlay(w, [1])),
         KernelNotFoundError, "not loaded", needs=("slots_without_kernels",)),
    case("OverlaySlots", "closed", lambda w: w.closed_slots.load(0, _overlay(w, [1])), ClosedError,
         "OverlaySlots is closed"),
    case("OverlaySlots", "id", lambda w: w.slots.load(1, _overlay(w, [3, 30])), ValueError, "id 30 >= vocab 30"),
    case("OverlaySlots", "empty", lambda w: OverlaySlots(w.gpu, 0, 30, 5, kernels=w.kernels), ValueError,
         "num_slots"),
    case("OverlaySlots", "empty", lambda w: w.slots.evict(1), detail="evict-free"),
    # -- OverlaySlots forward hooks --
    case("OverlaySlots.hooks", "dtype",
         lambda w: w.slots.lmhead_overlay(w.p[0], None, 0, w.p[1], 3, dtype=np.float16),
         TypeError, "logits dtype"),
    case("OverlaySlots.hooks", "dtype",
         lambda w: w.slots.embed_overlay(w.p[0], np.array([0.0, 1.0]), 0, w.p[1], 2),
         TypeError, "seq_slot must be integers", detail="seq_slot"),
    case("OverlaySlots.hooks", "shape", lambda w: w.slots.embed_overlay(w.p[0], np.zeros((2, 1), np.int32), 0,
                                                                        w.p[1], 2),
         ValueError, "seq_slot shape"),
    case("OverlaySlots.hooks", "length", lambda w: w.slots.embed_overlay(w.p[0], np.array([0, 1]), 0, w.p[1], 3),
         ValueError, "seq_slot shape"),
    case("OverlaySlots.hooks", "range", lambda w: w.slots.embed_overlay(w.p[0], None, 2, w.p[1], 3),
         ValueError, "active slot 2 outside"),
    case("OverlaySlots.hooks", "range", lambda w: w.slots.lmhead_overlay(w.p[0], [0, 5, 1], -1, w.p[1], 3),
         ValueError, "holds slot 5", detail="seq_slot"),
    case("OverlaySlots.hooks", "null", lambda w: w.slots.embed_overlay(0, None, 0, w.p[1], 3), ValueError, NULL),
    case("OverlaySlots.hooks", "null", lambda w: w.slots.embed_overlay(0, np.array([0, 1, 0]), 0, w.p[1], 3),
         ValueError, NULL, detail="host-seq-slot"),
    case("OverlaySlots.hooks", "closed", lambda w: w.closed_slots.embed_overlay(w.p[0], None, 0, w.p[1], 3),
         ClosedError, "OverlaySlots is closed"),
    case("OverlaySlots.hooks", "empty",
         lambda w: w.slots.embed_overlay(w.p[0], np.zeros(0, np.int32), 0, w.p[1], 0)),
]


def _after_build_overlay(w: World) -> None:
    adapter = w.served_host.copy()
    adapter[[2, 7]] = random_bf16(w.rng, (2, 4), 5.0)
    ov = build_overlay(w.gpu, w.kernels, w.served, adapter)
    np.testing.assert_array_equal(ov.embed.ids, [2, 7])
    np.testing.assert_array_equal(bits(ov.embed.rows), bits(adapter[[2, 7]]))


def _after_trainable(w: World) -> None:
    rows = random_bf16(w.rng, (3, 4))
    ov = overlay_from_trainable_tokens([5, 1, 3], rows, vocab=8)
    np.testing.assert_array_equal(ov.embed.ids, [1, 3, 5])
    np.testing.assert_array_equal(bits(ov.embed.rows), bits(rows[[1, 2, 0]]))


def _after_slots(w: World) -> None:
    ov = random_overlay(w.rng, 30, 5, 4, 2)
    w.slots.load(1, ov)
    check_slot_contents(w.gpu, w.slots, 1, ov)


def _after_hooks(w: World) -> None:
    before = len(w.gpu.launches)
    w.slots.embed_overlay(w.p[0], np.array([0, 1, -1]), 0, w.p[1], 3)
    assert w.gpu.launched()[before:] == ["embed_overlay_routed_bf16"]


AFTER: dict[str, Callable[[World], None]] = {
    "build_overlay": _after_build_overlay,
    "overlay_from_trainable_tokens": _after_trainable,
    "OverlaySlots": _after_slots,
    "OverlaySlots.hooks": _after_hooks,
}
