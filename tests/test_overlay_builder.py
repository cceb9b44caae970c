"""The overlay builder and the OverlaySlots registry: building from full adapter tables and from
PEFT's trainable-tokens form, slot loading / eviction / reuse, the forward hooks, and every
refusal. CPU tests run on a host-memory backend; GPU tests check the whole path end to end."""

from __future__ import annotations

from typing import Sequence

import ml_dtypes
import numpy as np
import pytest

from gpu_runtime import ClosedError, DeviceArray, DevicePtr, KernelHandle, KernelNotFoundError
from layers.reference import gather_then_overlay_ref, logits_then_overlay_ref, rowdiff_ref
from layers.overlay import (AdapterOverlay, OverlaySlots, TableOverlay, build_overlay,
                            overlay_from_trainable_tokens)
from layers.ops.token_overlay import OVERLAY_BAD_SLOT, OverlayKernels
from layers.dense_weight import DenseWeight
from tests.helpers import bf16_ulp, bits, random_bf16
from tests.helpers.overlay import adapter_copy, check_slot_contents, overlay_backend, random_overlay

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


# -- CPU: TableOverlay and the trainable-tokens form ---------------------------------------------

def test_table_overlay_sorts_and_validates(rng):
    rows = random_bf16(rng, (4, 5))
    t = TableOverlay.of([9, 2, 7, 0], rows, vocab=10)
    np.testing.assert_array_equal(t.ids, [0, 2, 7, 9])
    np.testing.assert_array_equal(bits(t.rows), bits(rows[[3, 1, 2, 0]]))
    assert t.ids.dtype == np.int32 and (t.n, t.h) == (4, 5)
    assert not t.ids.flags.writeable and not t.rows.flags.writeable
    with pytest.raises(ValueError, match="duplicate"):
        TableOverlay.of([1, 2, 1], random_bf16(rng, (3, 5)))
    with pytest.raises(ValueError, match="negative"):
        TableOverlay.of([1, -2], random_bf16(rng, (2, 5)))
    with pytest.raises(ValueError, match="vocab"):
        TableOverlay.of([1, 10], random_bf16(rng, (2, 5)), vocab=10)
    with pytest.raises(ValueError, match="rows"):
        TableOverlay.of([1, 2, 3], random_bf16(rng, (2, 5)))
    with pytest.raises(ValueError):
        TableOverlay.of([1], np.zeros(5, BF16))
    with pytest.raises(TypeError):
        TableOverlay.of([1], np.zeros((1, 5), np.int32))
    with pytest.raises(ValueError, match="sorted"):
        TableOverlay(np.array([3, 1], np.int32), random_bf16(rng, (2, 5)))
    assert TableOverlay.empty(8).n == 0 and TableOverlay.empty(8).h == 8


def test_every_field_of_the_overlays_is_checked(rng):
    """``AdapterOverlay(embed=5)`` was accepted: every field of both classes refuses another type or
    dtype with TypeError and another shape with ValueError, naming the field; ``empty`` and ``of``
    check their counts."""
    ids, rows = np.array([1, 4], np.int32), random_bf16(rng, (2, 5))
    for field in ("embed", "lm_head"):
        for bad in (5, "rows", rows, TableOverlay):
            with pytest.raises(TypeError, match=f"AdapterOverlay.{field} must be a TableOverlay or None, got "
                                                f"{type(bad).__name__}"):
                AdapterOverlay(**{field: bad})
    for bad, got in (([1, 4], "list"), (ids.astype(np.int64), "dtype int64"), (None, "NoneType")):
        with pytest.raises(TypeError, match=f"TableOverlay.ids must be an array of int32 .* got {got}"):
            TableOverlay(bad, rows)
    for bad, got in ((rows.tolist(), "list"), (rows.astype(np.float32), "dtype float32")):
        with pytest.raises(TypeError, match=f"TableOverlay.rows must be an array of bfloat16 .* got {got}"):
            TableOverlay(ids, bad)
    for bad_ids, bad_rows in ((ids.reshape(2, 1), rows), (ids, rows[0]), (ids[:1], rows), (ids, rows[:, :0])):
        with pytest.raises(ValueError, match=r"TableOverlay: ids \[n\] and rows \[n, h >= 1\] needed"):
            TableOverlay(bad_ids, bad_rows)
    with pytest.raises(TypeError, match="TableOverlay.empty: h must be an int"):
        TableOverlay.empty(4.0)
    with pytest.raises(ValueError, match="TableOverlay.empty: h must be an int >= 1, got 0"):
        TableOverlay.empty(0)
    with pytest.raises(TypeError, match="overlay: vocab must be an int"):
        TableOverlay.of([1], rows[:1], vocab="10")
    with pytest.raises(ValueError, match="overlay: vocab must be an int >= 1"):
        TableOverlay.of([], rows[:0], vocab=0)
    with pytest.raises(TypeError, match="overlay_from_trainable_tokens: tied must be a bool"):
        overlay_from_trainable_tokens([1], rows[:1], tied="yes")
    assert AdapterOverlay(TableOverlay(ids, rows)).embed.n == 2


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf, 3.399e38], ids=["nan", "inf", "-inf", "bf16-overflow"])
def test_a_non_finite_row_is_refused_wherever_an_overlay_is_made(rng, poison):
    """``TableOverlay.of`` accepted the NaN rows ``read_peft_adapter`` refused: the rule is now
    ``TableOverlay``'s own, which every overlay passes (``of``, the trainable-tokens form, a direct
    construction, a PEFT adapter): ValueError naming the rows' token ids."""
    rows = rng.standard_normal((3, 6)).astype(np.float32)
    rows[1, rng.integers(0, 6)] = poison  # 3.399e38 is finite in f32 and inf in bf16
    ids = [7, 2, 5]
    says = r"non-finite values \(NaN/inf, or too large for bf16\) in the rows of token ids \[2\]"
    with pytest.raises(ValueError, match=says):
        TableOverlay.of(ids, rows)
    with pytest.raises(ValueError, match=says):
        overlay_from_trainable_tokens(ids, random_bf16(rng, (3, 6)), rows)
    with pytest.raises(ValueError, match="TableOverlay.rows: " + says):
        TableOverlay(np.array([2, 5, 7], np.int32), rows[[1, 2, 0]].astype(BF16))
    rows[1] = 1.0
    assert TableOverlay.of(ids, rows).n == 3


def test_trainable_tokens_forms(rng):
    idx = np.array([5, 1, 3])
    emb = rng.standard_normal((3, 6)).astype(np.float32)  # PEFT may keep fp32: rounded to bf16
    ov = overlay_from_trainable_tokens(idx, emb, tied=True, vocab=8)
    np.testing.assert_array_equal(ov.embed.ids, [1, 3, 5])
    np.testing.assert_array_equal(bits(ov.embed.rows), bits(emb[[1, 2, 0]].astype(BF16)))
    assert ov.lm_head is ov.embed
    lm = random_bf16(rng, (3, 6))
    ov2 = overlay_from_trainable_tokens(idx, emb, lm)
    np.testing.assert_array_equal(bits(ov2.lm_head.rows), bits(lm[[1, 2, 0]]))
    ov3 = overlay_from_trainable_tokens(idx, emb)
    assert ov3.lm_head is None and ov3.embed.n == 3
    with pytest.raises(ValueError, match="tied"):
        overlay_from_trainable_tokens(idx, emb, lm, tied=True)
    with pytest.raises(ValueError, match="vocab"):
        overlay_from_trainable_tokens(idx, emb, vocab=5)
    with pytest.raises(ValueError, match="duplicate"):
        overlay_from_trainable_tokens([1, 1, 2], emb)
    with pytest.raises(ValueError):
        overlay_from_trainable_tokens(idx, emb[:2])
    with pytest.raises(ValueError, match="width"):
        overlay_from_trainable_tokens(idx, emb, random_bf16(rng, (3, 7)))


# -- CPU: build_overlay on the host-memory backend -----------------------------------------------

@pytest.mark.parametrize("device_adapter", [False, True], ids=["numpy", "DenseWeight"])
def test_build_overlay_finds_rows(rng, device_adapter):
    gpu = overlay_backend()
    k = OverlayKernels.new(gpu)
    vocab, h = 70, 12
    served_e, served_l = random_bf16(rng, (vocab, h)), random_bf16(rng, (vocab, h))
    ad_e = adapter_copy(rng, served_e, [3, 4, 5, 40, 69])
    ad_l = adapter_copy(rng, served_l, [0, 17])
    se, sl = DenseWeight.from_numpy(gpu, served_e), DenseWeight.from_numpy(gpu, served_l)
    if device_adapter:
        ad_e_arg, ad_l_arg = DenseWeight.from_numpy(gpu, ad_e), DenseWeight.from_numpy(gpu, ad_l)
    else:
        ad_e_arg, ad_l_arg = ad_e, ad_l
    live = set(gpu.mem)
    ov = build_overlay(gpu, k, se, ad_e_arg, sl, ad_l_arg, thresh=0.0)
    assert set(gpu.mem) == live  # temporaries freed
    np.testing.assert_array_equal(ov.embed.ids, [3, 4, 5, 40, 69])
    np.testing.assert_array_equal(bits(ov.embed.rows), bits(ad_e[[3, 4, 5, 40, 69]]))
    np.testing.assert_array_equal(ov.lm_head.ids, [0, 17])
    np.testing.assert_array_equal(bits(ov.lm_head.rows), bits(ad_l[[0, 17]]))
    assert [x["name"] for x in gpu.launches] == ["embed_rowdiff_bf16"] * 2
    # the embedding only; an adapter identical to the served table overrides nothing
    assert build_overlay(gpu, k, se, ad_e_arg).lm_head is None
    assert build_overlay(gpu, k, se, served_e).embed.n == 0


def test_build_overlay_threshold(rng):
    gpu = overlay_backend()
    k = OverlayKernels.new(gpu)
    served = random_bf16(rng, (20, 8))
    ad = served.copy()
    ad[2, 1] = np.float32(ad[2, 1]) + np.float32(0.5)   # small change
    ad[9] = (rng.standard_normal(8) * 10).astype(BF16)  # big change
    se = DenseWeight.from_numpy(gpu, served)
    d2 = float(np.abs(ad[2].astype(np.float32) - served[2].astype(np.float32)).max())
    np.testing.assert_array_equal(build_overlay(gpu, k, se, ad, thresh=0.0).embed.ids, [2, 9])
    np.testing.assert_array_equal(build_overlay(gpu, k, se, ad, thresh=d2).embed.ids, [9])


def test_build_overlay_refusals(rng):
    gpu = overlay_backend()
    k = OverlayKernels.new(gpu)
    served = random_bf16(rng, (10, 4))
    se = DenseWeight.from_numpy(gpu, served)
    live = set(gpu.mem)
    with pytest.raises(KernelNotFoundError, match="overlay"):
        build_overlay(gpu, OverlayKernels.default(), se, served)
    no_lm = OverlayKernels(k.rowdiff, k.embed_overlay, k.lmhead_overlay_bf16, KernelHandle(0))
    with pytest.raises(KernelNotFoundError):
        build_overlay(gpu, no_lm, se, None, se, served)
    with pytest.raises(ValueError, match="shape"):
        build_overlay(gpu, k, se, random_bf16(rng, (10, 5)))
    with pytest.raises(ValueError, match="shape"):
        build_overlay(gpu, k, se, random_bf16(rng, (11, 4)))
    with pytest.raises(ValueError, match="served"):
        build_overlay(gpu, k, None, served)
    with pytest.raises(ValueError, match="served"):
        build_overlay(gpu, k, se, None, None, served)
    fp8 = DenseWeight.from_numpy(gpu, served.astype(ml_dtypes.float8_e4m3fn), np.ones(10, np.float32))
    live |= set(gpu.mem)
    with pytest.raises(TypeError):
        build_overlay(gpu, k, fp8, served)
    foreign = DenseWeight.from_numpy(overlay_backend(), served)  # its addresses mean nothing here
    with pytest.raises(ValueError, match="served embedding: the weight is on another backend"):
        build_overlay(gpu, k, foreign, served)
    closed = DenseWeight.from_numpy(gpu, served)
    closed.close()
    with pytest.raises(ClosedError, match="served embedding: the weight is closed"):
        build_overlay(gpu, k, closed, served)
    with pytest.raises(ClosedError, match="adapter embedding: the weight is closed"):
        build_overlay(gpu, k, se, closed)
    assert gpu.launches == [] and set(gpu.mem) == live
    # no adapter tensors: nothing needed, nothing launched, even without kernels
    assert build_overlay(gpu, OverlayKernels.default(), se, None) == AdapterOverlay(None, None)


# -- CPU: OverlaySlots on the host-memory backend ------------------------------------------------

def test_slots_load_evict_reuse(rng):
    gpu = overlay_backend()
    baseline = set(gpu.mem)
    slots = OverlaySlots(gpu, 3, vocab=50, h=6)
    for s in range(3):
        check_slot_contents(gpu, slots, s, None)
    a, b = random_overlay(rng, 50, 6, 7, 4), random_overlay(rng, 50, 6, 2, None)
    slots.load(1, a)
    slots.load(2, b)
    check_slot_contents(gpu, slots, 1, a)
    check_slot_contents(gpu, slots, 2, b)
    check_slot_contents(gpu, slots, 0, None)
    assert slots.max_n_override == 4 and slots.loaded(1) is a and slots.loaded(0) is None
    with pytest.raises(ValueError, match="in use"):
        slots.load(1, b)
    before_evict = set(gpu.mem)
    slots.evict(1, stream=5)
    check_slot_contents(gpu, slots, 1, None)
    assert 5 in gpu.syncs                                     # drained before freeing
    assert len(before_evict - set(gpu.mem)) == 4               # map, rows, lm rows, lm ids freed
    assert slots.max_n_override == 0
    slots.evict(1)                                             # a free slot: nothing to do
    c = random_overlay(rng, 50, 6, 3, 1)
    slots.load(1, c)                                           # reuse: only c's rows remain
    check_slot_contents(gpu, slots, 1, c)
    slots.replace(1, b)
    check_slot_contents(gpu, slots, 1, b)
    slots.replace(0, a)                                        # replace into a free slot
    check_slot_contents(gpu, slots, 0, a)
    slots.close()
    assert set(gpu.mem) == baseline
    slots.close()                                              # idempotent
    with pytest.raises(ClosedError, match="OverlaySlots is closed"):
        slots.load(0, a)


def test_slots_empty_adapter_stays_null(rng):
    gpu = overlay_backend()
    with OverlaySlots(gpu, 2, vocab=10, h=4) as slots:
        live = set(gpu.mem)
        slots.load(0, AdapterOverlay(TableOverlay.empty(4), TableOverlay.empty(4)))
        slots.load(1, AdapterOverlay())
        check_slot_contents(gpu, slots, 0, None)
        check_slot_contents(gpu, slots, 1, None)
        assert set(gpu.mem) == live and not slots.has_embed_overlay
        slots.embed_overlay(DevicePtr(0x10), np.array([0, 1]), 0, DevicePtr(0x20), 2)
        slots.lmhead_overlay(DevicePtr(0x10), None, 0, DevicePtr(0x20), 2)
        assert gpu.launches == []                              # nothing loaded: no launch


def test_slots_refusals(rng):
    gpu = overlay_backend()
    slots = OverlaySlots(gpu, 2, vocab=30, h=5)
    good = random_overlay(rng, 30, 5, 3, 2)
    for bad in (-1, 2, 100):
        with pytest.raises(ValueError, match="slot index"):
            slots.load(bad, good)
        with pytest.raises(ValueError, match="slot index"):
            slots.evict(bad)
        with pytest.raises(ValueError, match="slot index"):
            slots.replace(bad, good)
    with pytest.raises(TypeError):
        slots.load(True, good)
    with pytest.raises(ValueError, match="width"):
        slots.load(0, random_overlay(rng, 30, 6, 3, None))
    with pytest.raises(ValueError, match="vocab"):
        slots.load(0, AdapterOverlay(TableOverlay.of([3, 30], random_bf16(rng, (2, 5)))))
    with pytest.raises(ValueError, match="vocab"):
        slots.load(0, AdapterOverlay(None, TableOverlay.of([31], random_bf16(rng, (1, 5)))))
    slots.load(0, good)
    with pytest.raises(ValueError, match="width"):
        slots.replace(0, random_overlay(rng, 30, 4, 1, None))
    check_slot_contents(gpu, slots, 0, good)                   # a refused replace changes nothing
    wide = OverlaySlots(gpu, 2, vocab=70_000, h=5)  # one slot's LM head over the grid's 65535 ids
    with pytest.raises(ValueError, match="LM-head overlay of 65536 rows: a slot holds at most 65535"):
        wide.load(1, AdapterOverlay(None, TableOverlay.of(np.arange(65536), random_bf16(rng, (65536, 5)))))
    wide.close()
    alloc = gpu.alloc

    def out_of_memory(nbytes):
        raise MemoryError("device memory exhausted")

    gpu.alloc = out_of_memory  # a replace whose upload fails keeps the adapter it had
    with pytest.raises(MemoryError):
        slots.replace(0, random_overlay(rng, 30, 5, 2, 1))
    gpu.alloc = alloc
    check_slot_contents(gpu, slots, 0, good)
    for args in ((0, 30, 5), (2, 0, 5), (2, 30, 0)):
        with pytest.raises(ValueError):
            OverlaySlots(gpu, *args)
    slots.close()


def test_slots_missing_kernels(rng):
    gpu = overlay_backend()
    k = OverlayKernels.new(gpu)
    slots = OverlaySlots(gpu, 2, vocab=30, h=5, kernels=OverlayKernels.default())
    with pytest.raises(KernelNotFoundError):
        slots.load(0, random_overlay(rng, 30, 5, 3, None))
    only_embed = OverlayKernels(k.rowdiff, k.embed_overlay, KernelHandle(0), KernelHandle(0))
    slots2 = OverlaySlots(gpu, 2, vocab=30, h=5, kernels=only_embed)
    slots2.load(0, random_overlay(rng, 30, 5, 3, None))
    with pytest.raises(KernelNotFoundError):
        slots2.load(1, random_overlay(rng, 30, 5, 3, 2))
    slots.load(1, AdapterOverlay(TableOverlay.empty(5)))       # empty: nothing needs a kernel
    # the forward hooks with missing kernels launch nothing, overlays loaded or not
    slots3 = OverlaySlots(gpu, 2, vocab=30, h=5, kernels=k)
    slots3.load(0, random_overlay(rng, 30, 5, 3, 2))
    slots3.kernels = OverlayKernels.default()
    slots3.embed_overlay(DevicePtr(0x10), None, 0, DevicePtr(0x20), 3)
    slots3.lmhead_overlay(DevicePtr(0x10), None, 0, DevicePtr(0x20), 3)
    slots3.lmhead_overlay(DevicePtr(0x10), None, 0, DevicePtr(0x20), 3, dtype=np.float32)
    assert gpu.launches == []
    for sl in (slots, slots2, slots3):
        sl.close()


def test_slots_forward_hooks(rng):
    gpu = overlay_backend()
    k = OverlayKernels.new(gpu)
    slots = OverlaySlots(gpu, 4, vocab=40, h=8, kernels=k, stream=0)
    slots.load(2, random_overlay(rng, 40, 8, 5, 6))
    slots.load(0, random_overlay(rng, 40, 8, 2, 3))
    ids, out, hidden, logits = (DevicePtr(0x1000 * i) for i in (1, 2, 3, 4))

    # refused before any launch: active >= num_slots, a host slot >= num_slots, wrong length
    for call in (lambda: slots.embed_overlay(ids, None, 4, out, 3),
                 lambda: slots.embed_overlay(ids, np.array([0, 4, 1]), 0, out, 3),
                 lambda: slots.embed_overlay(ids, np.array([0, 1]), 0, out, 3),
                 lambda: slots.lmhead_overlay(hidden, [0, 1, 9], -1, logits, 3),
                 lambda: slots.lmhead_overlay(hidden, None, 7, logits, 3, dtype=np.float32)):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(TypeError):
        slots.lmhead_overlay(hidden, None, 0, logits, 3, dtype=np.float16)
    assert gpu.launches == []

    seq = np.array([2, -5, 0, 3, -1])
    slots.embed_overlay(ids, seq, 0, out, 5, stream=0)
    (rec,) = gpu.launches
    assert rec["name"] == "embed_overlay_routed_bf16" and rec["grid"] == (5, 1, 1)
    scratch = rec["args"][1]
    np.testing.assert_array_equal(gpu.read_as(scratch, 5, np.int32), [2, -1, 0, 3, -1])
    assert rec["args"][:-1] == [ids, scratch, 0, slots.embed_slot_map_tab, slots.embed_rows_tab,
                                slots.embed_n_tab, out, 8, 40, slots.num_slots]  # num_slots: the kernel checks
    err = rec["args"][-1]  # the error word the kernel flags a device slot past the tables in
    assert err and gpu.read_as(err, 1, np.uint32)[0] == 0 and slots.check_errors() == 0
    gpu.copy_h2d_async(np.array([OVERLAY_BAD_SLOT], np.uint32), err)  # as the kernel would
    assert slots.check_errors() == OVERLAY_BAD_SLOT and gpu.read_as(err, 1, np.uint32)[0] == 0
    assert slots.check_errors() == 0  # read and cleared

    slots.lmhead_overlay(hidden, None, 2, logits, 7, dtype=np.float32)
    slots.lmhead_overlay(hidden, DevicePtr(0x5000), -3, logits, 7)
    f32, bf = gpu.launches[1:]
    assert f32["name"] == "lmhead_overlay_routed_f32" and bf["name"] == "lmhead_overlay_routed_bf16"
    assert f32["grid"] == (7, 6, 1)                            # max_n_override = max n = 6
    assert f32["args"] == [hidden, 0, 2, slots.lm_head_rows_tab, slots.lm_head_ids_tab,
                           slots.lm_head_n_tab, logits, 8, 40, slots.num_slots, err]
    assert bf["args"][1:3] == [DevicePtr(0x5000), -1]
    slots.close()


# -- GPU: end to end -----------------------------------------------------------------------------

def embed_ref_tables(slot_overlays: Sequence[AdapterOverlay | None], vocab: int):
    """(maps, rows, n_tab) of the embedding overlays, as the reference takes them."""
    maps, rows, n_tab = [], [], []
    for ov in slot_overlays:
        t = None if ov is None else ov.embed
        if t is None or t.n == 0:
            maps.append(None), rows.append(None), n_tab.append(0)
            continue
        m = np.full(vocab, -1, np.int32)
        m[t.ids] = np.arange(t.n)
        maps.append(m), rows.append(t.rows), n_tab.append(t.n)
    return maps, rows, n_tab


def lm_ref_tables(slot_overlays: Sequence[AdapterOverlay | None]):
    rows, ids, n_tab = [], [], []
    for ov in slot_overlays:
        t = None if ov is None else ov.lm_head
        if t is None or t.n == 0:
            rows.append(None), ids.append(None), n_tab.append(0)
        else:
            rows.append(t.rows), ids.append(t.ids), n_tab.append(t.n)
    return rows, ids, n_tab


def check_logits(got, ref, mask, init, abs_dot_max: float, h: int):
    """Untouched columns bit for bit; overlay columns within fp32-sum (bf16: 1 ulp) tolerance,
    ``abs_dot_max`` bounding sum_i |x_i w_i|."""
    np.testing.assert_array_equal(bits(got)[~mask], bits(init)[~mask])
    g, e = got[mask].astype(np.float64), ref[mask].astype(np.float64)
    if got.dtype == BF16:
        tol = bf16_ulp(np.maximum(np.abs(g), np.abs(e)))
    else:
        tol = 2 * h * np.finfo(np.float32).eps * abs_dot_max
    assert (np.abs(g - e) <= tol).all(), f"max err {np.abs(g - e).max()}"


@pytest.mark.gpu
@pytest.mark.parametrize("device_adapter", [False, True], ids=["numpy", "DenseWeight"])
@pytest.mark.parametrize("h", [33, 64])
def test_build_overlay_on_gpu(gpu, rng, device_adapter, h):
    k = OverlayKernels.new(gpu)
    vocab = 700
    served_e, served_l = random_bf16(rng, (vocab, h)), random_bf16(rng, (vocab, h))
    changed_e = rng.choice(np.setdiff1d(np.arange(vocab), [5]), 37, replace=False)
    changed_l = rng.choice(vocab, 11, replace=False)
    ad_e, ad_l = adapter_copy(rng, served_e, changed_e), adapter_copy(rng, served_l, changed_l)
    ad_e[5, 0] = np.float32(served_e[5, 0]) + np.float32(abs(float(served_e[5, 0])) * 0.02 + 1e-3)
    owned = [DenseWeight.from_numpy(gpu, served_e), DenseWeight.from_numpy(gpu, served_l)]
    try:
        if device_adapter:
            owned += [DenseWeight.from_numpy(gpu, ad_e), DenseWeight.from_numpy(gpu, ad_l)]
            args = (owned[2], owned[3])
        else:
            args = (ad_e, ad_l)
        for thresh in (0.0, 0.5):
            ov = build_overlay(gpu, k, owned[0], args[0], owned[1], args[1], thresh=thresh)
            exp_e = np.flatnonzero(rowdiff_ref(ad_e, served_e, thresh))
            exp_l = np.flatnonzero(rowdiff_ref(ad_l, served_l, thresh))
            np.testing.assert_array_equal(ov.embed.ids, exp_e)
            np.testing.assert_array_equal(ov.lm_head.ids, exp_l)
            np.testing.assert_array_equal(bits(ov.embed.rows), bits(ad_e[exp_e]))
            np.testing.assert_array_equal(bits(ov.lm_head.rows), bits(ad_l[exp_l]))
            if thresh == 0.0:
                assert 5 in exp_e and set(changed_e) <= set(exp_e)
            else:
                assert 5 not in exp_e
    finally:
        for w in owned:
            w.close()


def _load_mixed_adapters(gpu, rng, k, vocab, h, slots):
    """Slot 0: built from full tables; 1: trainable tokens, tied; 2: trainable tokens, embedding
    only; 3: empty. Returns (served embed, served lm head, overlays per slot)."""
    served_e, served_l = random_bf16(rng, (vocab, h)), random_bf16(rng, (vocab, h))
    se, sl = DenseWeight.from_numpy(gpu, served_e), DenseWeight.from_numpy(gpu, served_l)
    try:
        a = build_overlay(gpu, k, se, adapter_copy(rng, served_e, rng.choice(vocab, 40, replace=False)),
                          sl, adapter_copy(rng, served_l, rng.choice(vocab, 9, replace=False)))
    finally:
        se.close()
        sl.close()
    idx = rng.choice(vocab, 25, replace=False)
    b = overlay_from_trainable_tokens(idx, random_bf16(rng, (25, h)), tied=True, vocab=vocab)
    idx = rng.choice(vocab, 30, replace=False)
    c = overlay_from_trainable_tokens(idx, random_bf16(rng, (30, h)), vocab=vocab)
    d = AdapterOverlay(TableOverlay.empty(h), TableOverlay.empty(h))
    overlays = [a, b, c, d]
    for s, ov in enumerate(overlays):
        slots.load(s, ov)
    return served_e, served_l, overlays


@pytest.mark.gpu
@pytest.mark.parametrize("h", [33, 64])
def test_slots_end_to_end(gpu, rng, h):
    k = OverlayKernels.new(gpu)
    vocab, tokens = 120, 256
    with OverlaySlots(gpu, 5, vocab, h, kernels=k) as slots:
        served_e, served_l, overlays = _load_mixed_adapters(gpu, rng, k, vocab, h, slots)
        per_slot = overlays + [None]  # slot 4 never loaded
        ids = rng.integers(0, vocab, tokens).astype(np.uint32)
        seq = rng.integers(-1, 5, tokens).astype(np.int32)
        maps, rows, n_tab = embed_ref_tables(per_slot, vocab)
        with DeviceArray.from_numpy(gpu, ids) as ids_dev, \
                DeviceArray.from_numpy(gpu, seq) as seq_dev, \
                DeviceArray.empty(gpu, (tokens, h), BF16) as out:
            gathered = served_e[ids.astype(np.int64)]
            for seq_arg, seq_host, active in ((seq, seq, 0), (seq_dev.ptr, seq, 0),
                                              (None, None, 2), (None, None, -1)):
                out.upload(gathered)
                slots.embed_overlay(ids_dev.ptr, seq_arg, active, out.ptr, tokens)
                got = out.to_numpy()
                ref = gather_then_overlay_ref(served_e, ids, seq_host, active, maps, rows, n_tab)
                np.testing.assert_array_equal(bits(got), bits(ref))
                changed = (bits(ref) != bits(gathered)).any(axis=1)
                assert changed.any() == (seq_host is not None or active == 2)

        lm_rows, lm_ids, lm_n = lm_ref_tables(per_slot)
        m = 64
        hidden = random_bf16(rng, (m, h))
        seq = rng.integers(-1, 5, m).astype(np.int32)
        for dtype in (BF16, F32):
            ref, mask = logits_then_overlay_ref(hidden, served_l, seq, 0, lm_rows, lm_ids, lm_n,
                                                slots.max_n_override, dtype)
            init = (hidden.astype(np.float32) @ served_l.astype(np.float32).T).astype(dtype)
            with DeviceArray.from_numpy(gpu, hidden) as hid, DeviceArray.from_numpy(gpu, init) as lg:
                slots.lmhead_overlay(hid.ptr, seq, 0, lg.ptr, m, dtype=dtype)
                got = lg.to_numpy()
            assert mask.any()
            abs_dot_max = max(float((np.abs(hidden.astype(np.float64)) @ np.abs(r.astype(np.float64)).T).max())
                              for r in lm_rows if r is not None)
            check_logits(got, ref, mask, init, abs_dot_max, h)


@pytest.mark.gpu
def test_evict_then_reuse_leaves_nothing(gpu, rng):
    k = OverlayKernels.new(gpu)
    vocab, h, slot = 80, 40, 1
    a = overlay_from_trainable_tokens(np.arange(0, 40), random_bf16(rng, (40, h)), tied=True)
    b = overlay_from_trainable_tokens(np.arange(30, 35), random_bf16(rng, (5, h)), tied=True)
    ids = np.arange(vocab, dtype=np.uint32)
    table = random_bf16(rng, (vocab, h))
    hidden = random_bf16(rng, (vocab, h))
    with OverlaySlots(gpu, 3, vocab, h, kernels=k) as slots, \
            DeviceArray.from_numpy(gpu, ids) as ids_dev, \
            DeviceArray.empty(gpu, (vocab, h), BF16) as out, \
            DeviceArray.from_numpy(gpu, hidden) as hid, \
            DeviceArray.empty(gpu, (vocab, vocab), np.float32) as logits:
        slots.load(slot, a)
        slots.evict(slot)
        tabs = {name: np.empty(3, dt) for name, dt in (
            ("embed_slot_map_tab", np.uint64), ("embed_rows_tab", np.uint64), ("embed_n_tab", np.int32),
            ("lm_head_rows_tab", np.uint64), ("lm_head_ids_tab", np.uint64), ("lm_head_n_tab", np.int32))}
        for name, host in tabs.items():
            gpu.copy_d2h(host, getattr(slots, name))
            assert not host.any(), f"{name} after evict: {host}"
        slots.load(slot, b)
        seq = np.full(vocab, slot, np.int32)
        out.upload(table)
        slots.embed_overlay(ids_dev.ptr, seq, 0, out.ptr, vocab)
        got = out.to_numpy()
        np.testing.assert_array_equal(bits(got[30:35]), bits(b.embed.rows))
        keep = np.r_[0:30, 35:vocab]
        np.testing.assert_array_equal(bits(got[keep]), bits(table[keep]))  # nothing of a
        init = rng.standard_normal((vocab, vocab)).astype(np.float32)
        logits.upload(init)
        slots.lmhead_overlay(hid.ptr, seq, 0, logits.ptr, vocab, dtype=F32)
        got = logits.to_numpy()
        np.testing.assert_array_equal(bits(got[:, keep]), bits(init[:, keep]))
        expect = hidden.astype(np.float64) @ b.lm_head.rows.astype(np.float64).T
        np.testing.assert_allclose(got[:, 30:35], expect, rtol=1e-4, atol=1e-4 * np.abs(expect).max())
