"""token_overlay.cu and its launchers (seed 001): the kernels against the numpy references,
every skip rule, and (on CPU) the launchers' argument order, checks and no-op rules."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Sequence

import ml_dtypes
import numpy as np
import pytest

from gpu_runtime import DeviceArray, DevicePtr, KernelHandle
from gpu_runtime.signatures import module_signatures
from layers.kernel_files import load_kernel
from layers.reference import embed_overlay_ref, lmhead_dot, lmhead_overlay_ref, rowdiff_ref
from layers.ops.token_overlay import (OVERLAY_BAD_SLOT, OverlayKernels, embed_overlay_routed, embed_rowdiff,
                                      lmhead_overlay_routed)
from tests.helpers.fakes import RecordingBackend
from tests.helpers import bf16_ulp, bits, random_bf16

BF16 = np.dtype(ml_dtypes.bfloat16)
KERNEL_FILE = Path(__file__).resolve().parent.parent / "kernels" / "token_overlay.cu"
SIGNATURES = {
    "embed_rowdiff_bf16": "PPPUUF",
    "embed_overlay_routed_bf16": "PPIPPPPUUUP",  # the seed's, then num_slots and err
    "lmhead_overlay_routed_bf16": "PPIPPPPUUUP",
    "lmhead_overlay_routed_f32": "PPIPPPPUUUP",
}


# -- CPU: launches recorded by tests.helpers.fakes.RecordingBackend ----------------------------------------

def _only_rowdiff() -> RecordingBackend:
    """A backend whose token_overlay module has the rowdiff kernel and nothing else."""
    return RecordingBackend(missing={("token_overlay", n) for n in SIGNATURES if n != "embed_rowdiff_bf16"})


def _name(gpu: RecordingBackend, launch) -> str:
    return gpu.kernel_of(launch)[1]


P = [DevicePtr(0x10000 * (i + 1)) for i in range(8)]


def _rowdiff(gpu, k, **kw):
    args = dict(base=P[0], served=P[1], flags=P[2], rows=300, h=33, thresh=0.25, stream=7)
    args.update(kw)
    embed_rowdiff(gpu, k, args["base"], args["served"], args["flags"], args["rows"], args["h"],
                  args["thresh"], args["stream"])


def _embed(gpu, k, **kw):
    args = dict(ids=P[0], seq_slot=P[1], active=-1, slot_map_tab=P[2], rows_tab=P[3], n_tab=P[4],
                out=P[5], num_tokens=5, h=4095, vocab=1000, stream=3)
    args.update(kw)
    embed_overlay_routed(gpu, k, args["ids"], args["seq_slot"], args["active"], args["slot_map_tab"],
                         args["rows_tab"], args["n_tab"], args["out"], args["num_tokens"], args["h"],
                         args["vocab"], args["stream"])


def _lmhead(gpu, k, **kw):
    args = dict(hidden=P[0], seq_slot=P[1], active=2, rows_tab=P[2], ids_tab=P[3], n_tab=P[4],
                logits=P[5], m=6, max_n_override=9, h=64, vocab=131072, stream=5)
    args.update(kw)
    lmhead_overlay_routed(gpu, k, args["hidden"], args["seq_slot"], args["active"], args["rows_tab"],
                          args["ids_tab"], args["n_tab"], args["logits"], args["m"],
                          args["max_n_override"], args["h"], args["vocab"], args["stream"])


def test_kernel_signatures_are_specs():
    assert {k: sig.kinds for k, sig in module_signatures(KERNEL_FILE).items()} == SIGNATURES


def test_overlay_kernels_new_and_default():
    gpu = RecordingBackend()
    k = OverlayKernels.new(gpu)
    assert (k.rowdiff, k.embed_overlay, k.lmhead_overlay_bf16, k.lmhead_overlay_f32) == tuple(
        load_kernel(gpu, "token_overlay", n) for n in SIGNATURES)
    missing = OverlayKernels.new(_only_rowdiff())
    assert missing.rowdiff == load_kernel(gpu, "token_overlay", "embed_rowdiff_bf16")
    assert missing.embed_overlay == missing.lmhead_overlay_bf16 == missing.lmhead_overlay_f32 == 0
    d = OverlayKernels.default()
    assert d.rowdiff == d.embed_overlay == d.lmhead_overlay_bf16 == d.lmhead_overlay_f32 == 0
    assert all(isinstance(h, KernelHandle) for h in (d.rowdiff, d.embed_overlay))


def test_rowdiff_launch_matches_seed():
    gpu = RecordingBackend()
    k = OverlayKernels.new(gpu)
    _rowdiff(gpu, k.rowdiff, rows=513, h=33, thresh=0.25, stream=7)
    (rec,) = gpu.launches
    assert _name(gpu, rec) == "embed_rowdiff_bf16"
    assert (rec.grid, rec.block, rec.shared_mem, rec.stream) == ((3, 1, 1), (256, 1, 1), 0, 7)
    assert rec.kinds == SIGNATURES["embed_rowdiff_bf16"]
    assert rec.args == [P[0], P[1], P[2], 513, 33, 0.25]


def test_embed_overlay_launch_matches_seed():
    gpu = RecordingBackend()
    k = OverlayKernels.new(gpu)
    _embed(gpu, k.embed_overlay, num_tokens=77, active=-3, h=4095, vocab=1000, stream=3)
    (rec,) = gpu.launches
    assert _name(gpu, rec) == "embed_overlay_routed_bf16"
    assert (rec.grid, rec.block, rec.shared_mem, rec.stream) == ((77, 1, 1), (256, 1, 1), 0, 3)
    assert rec.kinds == SIGNATURES["embed_overlay_routed_bf16"]
    assert rec.args == [P[0], P[1], -3, P[2], P[3], P[4], P[5], 4095, 1000, 0, 0]  # unchecked: the seed's


@pytest.mark.parametrize("which", ["lmhead_overlay_bf16", "lmhead_overlay_f32"])
def test_lmhead_overlay_launch_matches_seed(which):
    gpu = RecordingBackend()
    k = getattr(OverlayKernels.new(gpu), which)
    _lmhead(gpu, k, m=6, max_n_override=9, h=64, vocab=131072, active=2, stream=5)
    (rec,) = gpu.launches
    assert _name(gpu, rec) == {"lmhead_overlay_bf16": "lmhead_overlay_routed_bf16",
                           "lmhead_overlay_f32": "lmhead_overlay_routed_f32"}[which]
    assert (rec.grid, rec.block, rec.shared_mem, rec.stream) == ((6, 9, 1), (32, 1, 1), 0, 5)
    assert rec.kinds == SIGNATURES[_name(gpu, rec)]
    assert rec.args == [P[0], P[1], 2, P[2], P[3], P[4], P[5], 64, 131072, 0, 0]


def test_null_seq_slot_is_allowed():
    gpu = RecordingBackend()
    k = OverlayKernels.new(gpu)
    _embed(gpu, k.embed_overlay, seq_slot=0, active=1)
    _lmhead(gpu, k.lmhead_overlay_f32, seq_slot=DevicePtr(0), active=-1)
    assert [r.args[1:3] for r in gpu.launches] == [[0, 1], [0, -1]]


def test_zero_handle_hooks_launch_nothing():
    gpu = RecordingBackend()
    zero = OverlayKernels.default()
    _embed(gpu, zero.embed_overlay)
    _lmhead(gpu, zero.lmhead_overlay_bf16)
    _lmhead(gpu, zero.lmhead_overlay_f32, hidden=0, logits=0)  # nothing checked: feature off
    assert gpu.launches == []
    with pytest.raises(ValueError, match="not loaded"):
        _rowdiff(gpu, zero.rowdiff)  # build-time, not a hook: a missing kernel is an error
    assert gpu.launches == []


def test_zero_counts_are_noops():
    gpu = RecordingBackend()
    k = OverlayKernels.new(gpu)
    _rowdiff(gpu, k.rowdiff, rows=0, base=0, served=0, flags=0)
    _embed(gpu, k.embed_overlay, num_tokens=0, ids=0, out=0)
    _lmhead(gpu, k.lmhead_overlay_bf16, m=0, hidden=0)
    _lmhead(gpu, k.lmhead_overlay_f32, max_n_override=0, logits=0)
    assert gpu.launches == []


@pytest.mark.parametrize("launcher,ptr", [
    ("rowdiff", "base"), ("rowdiff", "served"), ("rowdiff", "flags"),
    ("embed", "ids"), ("embed", "slot_map_tab"), ("embed", "rows_tab"), ("embed", "n_tab"),
    ("embed", "out"),
    ("lmhead", "hidden"), ("lmhead", "rows_tab"), ("lmhead", "ids_tab"), ("lmhead", "n_tab"),
    ("lmhead", "logits"),
])
def test_null_required_pointer_refused_before_launch(launcher, ptr):
    gpu = RecordingBackend()
    k = OverlayKernels.new(gpu)
    call = {"rowdiff": (_rowdiff, k.rowdiff), "embed": (_embed, k.embed_overlay),
            "lmhead": (_lmhead, k.lmhead_overlay_bf16)}[launcher]
    with pytest.raises(ValueError, match=ptr):
        call[0](gpu, call[1], **{ptr: DevicePtr(0)})
    assert gpu.launches == []


@pytest.mark.parametrize("launcher,kw", [
    ("rowdiff", dict(h=0)), ("rowdiff", dict(rows=-1)), ("rowdiff", dict(rows=1 << 32)),
    ("rowdiff", dict(thresh=float("nan"))),
    ("embed", dict(h=0)), ("embed", dict(vocab=0)), ("embed", dict(num_tokens=-1)),
    ("embed", dict(active=1 << 31)), ("embed", dict(num_tokens=1 << 31)),
    ("lmhead", dict(h=0)), ("lmhead", dict(vocab=0)), ("lmhead", dict(max_n_override=65536)),
    ("lmhead", dict(m=-2)), ("lmhead", dict(active=-(1 << 31) - 1)),
])
def test_bad_sizes_refused_before_launch(launcher, kw):
    gpu = RecordingBackend()
    k = OverlayKernels.new(gpu)
    call = {"rowdiff": (_rowdiff, k.rowdiff), "embed": (_embed, k.embed_overlay),
            "lmhead": (_lmhead, k.lmhead_overlay_f32)}[launcher]
    with pytest.raises(ValueError):
        call[0](gpu, call[1], **kw)
    assert gpu.launches == []

@pytest.mark.parametrize("thresh", ["0.5", None, True])
def test_rowdiff_threshold_must_be_a_real_number(thresh):
    gpu = RecordingBackend()
    with pytest.raises(TypeError, match="thresh must be a real number"):
        _rowdiff(gpu, OverlayKernels.new(gpu).rowdiff, thresh=thresh)
    assert gpu.launches == []


# -- GPU helpers -------------------------------------------------------------------------------

@contextlib.contextmanager
def device_arrays(gpu) -> Iterator[list[DeviceArray]]:
    """Collects DeviceArrays (append to the list) and frees them all at the end."""
    owned: list[DeviceArray] = []
    try:
        yield owned
    finally:
        gpu.synchronize()
        for a in owned:
            a.free()


def upload(gpu, owned: list, host: np.ndarray) -> DevicePtr:
    arr = DeviceArray.from_numpy(gpu, np.ascontiguousarray(host))
    owned.append(arr)
    return arr.ptr


def upload_unaligned(gpu, owned: list, host: np.ndarray) -> DevicePtr:
    """``host`` at a device address 2 bytes past a 16-byte boundary (forces the scalar paths)."""
    flat = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
    arr = DeviceArray.empty(gpu, (flat.size + 16,), np.uint8)
    owned.append(arr)
    arr.fill_bytes(0x5A)
    ptr = arr.ptr.offset(2)
    gpu.copy_h2d_async(flat, ptr)
    return ptr


def download(gpu, ptr: int, shape, dtype) -> np.ndarray:
    out = np.empty(shape, dtype)
    gpu.copy_d2h(out, ptr)
    return out


def random_bf16_bits(rng, shape) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads included): a copy must move them bit for bit."""
    return rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(BF16)


def pointer_table(gpu, owned: list, per_slot: Sequence[np.ndarray | None]) -> DevicePtr:
    """Device array of per-slot device pointers (0 for None), like OverlaySlots' tables."""
    ptrs = np.array([0 if a is None else int(upload(gpu, owned, a)) for a in per_slot], np.uint64)
    return upload(gpu, owned, ptrs)


# -- GPU: embed_rowdiff --------------------------------------------------------------------------

def _rowdiff_tables(rng, rows: int, h: int):
    served = random_bf16(rng, (rows, h))
    base = served.copy()
    changed = rng.choice(np.arange(10, rows), size=rows // 3, replace=False)
    for r in changed:  # one or a few elements moved by assorted magnitudes
        cols = rng.choice(h, size=min(h, int(rng.integers(1, 4))), replace=False)
        delta = rng.choice([1e-3, 1e-2, 0.1, 1.0, 4.0]) * rng.uniform(0.5, 2.0, size=cols.size)
        base[r, cols] = (base[r, cols].astype(np.float32) + delta.astype(np.float32)).astype(BF16)
    base[1, h // 2] = np.nan                      # NaN on the base side
    served[2, 0] = np.nan                         # NaN on the served side
    base[3, h - 1] = served[3, h - 1] = np.inf    # equal infinities: no difference
    base[4, 0], served[4, 0] = np.float32(0.0), np.float32(-0.0)  # +0 / -0: no difference
    base[5, 0], served[5, 0] = np.inf, -np.inf    # opposite infinities: infinite difference
    return base, served


def _max_row_diff(base, served) -> np.ndarray:
    a, b = base.astype(np.float32), served.astype(np.float32)
    with np.errstate(invalid="ignore"):
        d = np.where(a == b, np.float32(0), np.abs(a - b))
    return np.where(np.isnan(d).any(axis=1), np.inf, np.nanmax(d, axis=1)).astype(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("h,unaligned", [(7, False), (33, False), (64, False), (4096, False),
                                         (4095, False), (64, True)])
def test_rowdiff_thresholds(gpu, rng, h, unaligned):
    k = OverlayKernels.new(gpu)
    rows = 300  # two blocks, the second partial
    base, served = _rowdiff_tables(rng, rows, h)
    dmax = _max_row_diff(base, served)
    finite = np.unique(dmax[np.isfinite(dmax) & (dmax > 0)])
    assert finite.size >= 3
    pivot = finite[finite.size // 2]  # an actual difference, hit exactly by some row
    threshes = [np.nextafter(pivot, np.float32(0)), pivot, np.nextafter(pivot, np.float32(np.inf)),
                np.float32(0), np.float32(-1), np.float32(np.finfo(np.float32).max),
                np.float32(np.inf)]
    expected_sets = []
    with device_arrays(gpu) as owned:
        b = (upload_unaligned if unaligned else upload)(gpu, owned, base)
        s = upload(gpu, owned, served)
        flags = DeviceArray.empty(gpu, (rows,), np.uint8)
        owned.append(flags)
        for t in threshes:
            flags.fill_bytes(0xFF)
            embed_rowdiff(gpu, k.rowdiff, b, s, flags.ptr, rows, h, float(t), 0)
            got = flags.to_numpy()
            ref = rowdiff_ref(base, served, float(t))
            np.testing.assert_array_equal(got, ref, err_msg=f"thresh {t!r}")
            expected_sets.append(ref)
    below, at, above, zero, negative, fmax, inf = expected_sets
    hit = dmax == pivot
    assert below[hit].all() and not at[hit].any() and not above[hit].any()  # the test can fail
    assert negative.all()                            # max |d| >= 0 > -1 for every row
    assert zero[1] and zero[2] and zero[5]            # NaN either side, opposite infinities
    assert not zero[3] and not zero[4]                # equal infinities, +0 / -0
    assert fmax[1] and fmax[2] and fmax[5]
    np.testing.assert_array_equal(np.flatnonzero(inf), [1, 2])  # only NaN beats an infinite thresh


# -- GPU: embed_overlay_routed -------------------------------------------------------------------

def _embed_slots(rng, vocab: int, h: int):
    """Per-slot tables exercising every skip rule. Returns (maps, rows, n_tab)."""
    def slot_map(n_rows: int, n_ids: int) -> np.ndarray:
        m = np.full(vocab, -1, np.int32)
        ids = rng.choice(vocab, size=n_ids, replace=False)
        m[ids] = rng.permutation(n_ids) % n_rows
        return m

    maps, rows, n_tab = [], [], []
    # 0: a plain adapter
    maps.append(slot_map(12, 12)); rows.append(random_bf16_bits(rng, (12, h))); n_tab.append(12)
    # 1: null slot map (rows present): no overlay
    maps.append(None); rows.append(random_bf16_bits(rng, (4, h))); n_tab.append(4)
    # 2: map entries 0..7 but n_tab 4 (entries >= n skip), and a negative entry other than -1
    m2 = slot_map(8, 16)
    m2[np.flatnonzero(m2 == -1)[:3]] = -7
    maps.append(m2); rows.append(random_bf16_bits(rng, (8, h))); n_tab.append(4)
    # 3: null rows (map present): no overlay
    maps.append(slot_map(5, 5)); rows.append(None); n_tab.append(5)
    # 4: n_tab 0 (an empty adapter) with tables present
    maps.append(slot_map(3, 3)); rows.append(random_bf16_bits(rng, (3, h))); n_tab.append(0)
    # 5: another adapter overriding many ids, overlapping slot 0's
    maps.append(slot_map(20, 20)); rows.append(random_bf16_bits(rng, (20, h))); n_tab.append(20)
    return maps, rows, n_tab


def _token_ids(rng, count: int, vocab: int) -> np.ndarray:
    ids = rng.integers(0, vocab, size=count).astype(np.uint32)
    bad = rng.choice(count, size=max(3, count // 20), replace=False)
    ids[bad] = rng.choice(np.array([vocab, vocab + 1, 0xFFFFFFFF, 0x80000000], np.uint64),
                          size=bad.size).astype(np.uint32)
    return ids


@pytest.mark.gpu
@pytest.mark.parametrize("h,unaligned", [(7, False), (33, False), (4095, False), (8, False),
                                         (64, False), (4096, False), (64, True)])
def test_embed_overlay_routed(gpu, rng, h, unaligned):
    k = OverlayKernels.new(gpu)
    vocab, tokens = 40, 400
    maps, rows, n_tab = _embed_slots(rng, vocab, h)
    ids = _token_ids(rng, tokens, vocab)
    seq_slot = rng.integers(-2, len(maps), size=tokens).astype(np.int32)
    init = random_bf16_bits(rng, (tokens, h))
    with device_arrays(gpu) as owned:
        map_tab = pointer_table(gpu, owned, maps)
        rows_tab = pointer_table(gpu, owned, rows)
        n_dev = upload(gpu, owned, np.array(n_tab, np.int32))
        ids_dev = upload(gpu, owned, ids)
        seq_dev = upload(gpu, owned, seq_slot)
        out = (upload_unaligned if unaligned else upload)(gpu, owned, init)

        # per-token routing, several adapters in one batch
        embed_overlay_routed(gpu, k.embed_overlay, ids_dev, seq_dev, 0, map_tab, rows_tab, n_dev,
                             out, tokens, h, vocab, 0)
        got = download(gpu, out, (tokens, h), BF16)
        ref = embed_overlay_ref(init, ids, seq_slot, 0, maps, rows, n_tab, vocab)
        np.testing.assert_array_equal(bits(got), bits(ref))
        written = (bits(ref) != bits(init)).any(axis=1)
        for s in (0, 2, 5):  # the test can fail: each live slot overrode some tokens
            assert written[seq_slot == s].sum() >= 2, f"slot {s} overrode too few tokens"
        assert not written[np.isin(seq_slot, [-2, -1, 1, 3, 4])].any()
        assert not written[ids >= vocab].any()

        # uniform active slot (null seq_slot), including active = -1 and the null-table slots
        for active in [-1, 0, 1, 2, 3, 4, 5]:
            gpu.copy_h2d_async(init, out)
            embed_overlay_routed(gpu, k.embed_overlay, ids_dev, DevicePtr(0), active, map_tab,
                                 rows_tab, n_dev, out, tokens, h, vocab, 0)
            got = download(gpu, out, (tokens, h), BF16)
            ref = embed_overlay_ref(init, ids, None, active, maps, rows, n_tab, vocab)
            np.testing.assert_array_equal(bits(got), bits(ref), err_msg=f"active {active}")
            changed = (bits(ref) != bits(init)).any(axis=1).sum()
            assert (changed > 0) == (active in (0, 2, 5)), f"active {active}: {changed} rows"


@pytest.mark.gpu
def test_routed_kernels_skip_and_flag_a_device_slot_past_the_tables(gpu, rng):
    """With ``num_slots``, a device ``seq_slot`` entry >= num_slots (the host cannot see it) skips
    its row, which no table lookup then reads, and sets ``OVERLAY_BAD_SLOT`` in the error word;
    every other row is as the reference gives it with that row routed to no slot. Without one
    bad entry the word stays 0."""
    k = OverlayKernels.new(gpu)
    vocab, tokens, h, m = 40, 64, 64, 48
    maps, rows, n_tab = _embed_slots(rng, vocab, h)
    lm_rows, lm_ids, lm_n = _lmhead_slots(rng, 300, h)
    ns = len(maps)
    ids = _token_ids(rng, tokens, vocab)
    good = rng.integers(-1, ns, size=tokens).astype(np.int32)
    bad = good.copy()
    bad[[3, 17, 40]] = [ns, ns + 5, (1 << 31) - 1]  # past the tables
    init = random_bf16_bits(rng, (tokens, h))
    hidden = random_bf16(rng, (m, h))
    logits0 = (rng.standard_normal((m, 300)) * 3).astype(np.float32)
    with device_arrays(gpu) as owned:
        map_tab, rows_tab = pointer_table(gpu, owned, maps), pointer_table(gpu, owned, rows)
        n_dev, ids_dev = upload(gpu, owned, np.array(n_tab, np.int32)), upload(gpu, owned, ids)
        lm_rows_tab, lm_ids_tab = pointer_table(gpu, owned, lm_rows), pointer_table(gpu, owned, lm_ids)
        lm_n_dev, hid = upload(gpu, owned, np.array(lm_n, np.int32)), upload(gpu, owned, hidden)
        err = upload(gpu, owned, np.zeros(1, np.uint32))
        out, logits = upload(gpu, owned, init), upload(gpu, owned, logits0)
        for seq, flagged in ((good, 0), (bad, OVERLAY_BAD_SLOT)):
            seq_dev = upload(gpu, owned, seq)
            gpu.copy_h2d_async(init, out)
            gpu.copy_h2d_async(logits0, logits)
            gpu.memset(err, 0, 4)
            embed_overlay_routed(gpu, k.embed_overlay, ids_dev, seq_dev, 0, map_tab, rows_tab, n_dev, out,
                                 tokens, h, vocab, 0, num_slots=ns, err=err)
            routed = np.where(seq < ns, seq, -1)  # a slot past the tables: as no slot
            ref = embed_overlay_ref(init, ids, routed, 0, maps, rows, n_tab, vocab)
            np.testing.assert_array_equal(bits(download(gpu, out, (tokens, h), BF16)), bits(ref))
            assert download(gpu, err, (1,), np.uint32)[0] == flagged
            gpu.memset(err, 0, 4)
            lmhead_overlay_routed(gpu, k.lmhead_overlay_f32, hid, seq_dev, 0, lm_rows_tab, lm_ids_tab, lm_n_dev,
                                  logits, m, 8, h, 300, 0, num_slots=ns, err=err)
            got = download(gpu, logits, (m, 300), np.float32)
            _, mask = lmhead_overlay_ref(logits0, hidden, routed[:m], 0, lm_rows, lm_ids, lm_n, 8, 300, vector=True)
            np.testing.assert_array_equal(got.view(np.uint32)[~mask], logits0.view(np.uint32)[~mask])  # skipped rows untouched
            assert download(gpu, err, (1,), np.uint32)[0] == (flagged if (seq[:m] >= ns).any() else 0)


# -- GPU: lmhead_overlay_routed ------------------------------------------------------------------

def _lmhead_slots(rng, vocab: int, h: int):
    """Per-slot LM-head tables exercising every skip rule. Returns (rows, ids, n_tab)."""
    def ids_of(n: int) -> np.ndarray:
        return rng.choice(vocab, size=n, replace=False).astype(np.int32)

    rows, ids, n_tab = [], [], []
    rows.append(random_bf16(rng, (6, h))); ids.append(ids_of(6)); n_tab.append(6)   # 0: plain
    rows.append(random_bf16(rng, (3, h))); ids.append(ids_of(3)); n_tab.append(3)   # 1: small n
    rows.append(None); ids.append(ids_of(4)); n_tab.append(4)                       # 2: null rows
    rows.append(random_bf16(rng, (4, h))); ids.append(None); n_tab.append(4)        # 3: null ids
    i4 = ids_of(7)
    i4[[1, 4, 5]] = [-1, vocab + 2, vocab]                                          # 4: bad ids
    rows.append(random_bf16(rng, (7, h))); ids.append(i4); n_tab.append(7)
    rows.append(random_bf16(rng, (2, h))); ids.append(ids_of(2)); n_tab.append(0)   # 5: n = 0
    return rows, ids, n_tab


def _abs_dot_bound(hidden, rows, ids, slots, vocab, logits_shape) -> np.ndarray:
    """sum_i |x_i w_i| at each (r, id) an overlay may write: the scale of fp32 rounding error."""
    bound = np.zeros(logits_shape, np.float64)
    for r, s in enumerate(slots):
        if s < 0 or rows[s] is None or ids[s] is None:
            continue
        for j, tok in enumerate(ids[s][: rows[s].shape[0]]):
            if 0 <= tok < vocab:
                bound[r, tok] = np.abs(hidden[r].astype(np.float64)) @ np.abs(rows[s][j].astype(np.float64))
    return bound


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)], ids=["bf16", "f32"])
@pytest.mark.parametrize("h,unaligned", [(7, False), (33, False), (4095, False), (8, False),
                                         (64, False), (4096, False), (64, True)])
def test_lmhead_overlay_routed(gpu, rng, dtype, h, unaligned):
    k = OverlayKernels.new(gpu)
    kernel = k.lmhead_overlay_bf16 if dtype == BF16 else k.lmhead_overlay_f32
    vocab, m = 300, 48
    rows, ids, n_tab = _lmhead_slots(rng, vocab, h)
    hidden = random_bf16(rng, (m, h))
    seq_slot = rng.integers(-2, len(rows), size=m).astype(np.int32)
    init = (rng.standard_normal((m, vocab)) * 3).astype(dtype)
    vector = h % 8 == 0 and not unaligned
    with device_arrays(gpu) as owned:
        rows_tab = pointer_table(gpu, owned, rows)
        ids_tab = pointer_table(gpu, owned, ids)
        n_dev = upload(gpu, owned, np.array(n_tab, np.int32))
        hid = (upload_unaligned if unaligned else upload)(gpu, owned, hidden)
        seq_dev = upload(gpu, owned, seq_slot)
        logits = upload(gpu, owned, init)

        cases = [(seq_dev, seq_slot, 0, 8),   # per-row routing; max_n_override > every n
                 (seq_dev, seq_slot, 0, 4),   # max_n_override below some slots' n
                 (0, None, 0, 8), (0, None, 4, 8), (0, None, -1, 8), (0, None, 2, 8),
                 (0, None, 3, 8), (0, None, 5, 8)]
        for seq_ptr, seq_host, active, max_n in cases:
            gpu.copy_h2d_async(init, logits)
            lmhead_overlay_routed(gpu, kernel, hid, seq_ptr, active, rows_tab, ids_tab, n_dev, logits,
                                  m, max_n, h, vocab, 0)
            got = download(gpu, logits, (m, vocab), dtype)
            ref, mask = lmhead_overlay_ref(init, hidden, seq_host, active, rows, ids, n_tab, max_n,
                                           vocab, vector=vector)
            what = f"seq_slot={'per-row' if seq_host is not None else None} active={active} max_n={max_n}"
            # untouched columns: bit for bit
            np.testing.assert_array_equal(bits(got)[~mask], bits(init)[~mask], err_msg=what)
            slots = np.full(m, active) if seq_host is None else seq_host
            live = [0, 1, 4] if seq_host is not None else ([active] if active in (0, 4) else [])
            assert mask.any() == bool(live), what
            if not mask.any():
                continue
            g = got[mask].astype(np.float64)
            e = ref[mask].astype(np.float64)
            if dtype == BF16:
                tol = bf16_ulp(np.maximum(np.abs(g), np.abs(e)))
            else:
                bound = _abs_dot_bound(hidden, rows, ids, slots, vocab, (m, vocab))[mask]
                tol = 2 * h * np.finfo(np.float32).eps * bound + 1e-30
            assert (np.abs(g - e) <= tol).all(), f"{what}: max err {np.abs(g - e).max()}"
            # and the written values are not the poison: each differs from the initial pattern
            assert (bits(got)[mask] != bits(init)[mask]).mean() > 0.9, what


@pytest.mark.gpu
@pytest.mark.parametrize("h,unaligned", [(33, False), (4096, False), (4096, True), (4095, False)])
def test_lmhead_sum_order_is_the_documented_one(gpu, rng, h, unaligned):
    """The fp32 logits equal the reference's ordered sum exactly (kernel doc comment): if this
    fails while test_lmhead_overlay_routed passes, the documented order is wrong, not the sum."""
    k = OverlayKernels.new(gpu)
    vocab, m, n = 64, 8, 16
    rows = [random_bf16(rng, (n, h))]
    ids = [rng.choice(vocab, size=n, replace=False).astype(np.int32)]
    hidden = random_bf16(rng, (m, h))
    init = rng.standard_normal((m, vocab)).astype(np.float32)
    with device_arrays(gpu) as owned:
        rows_tab = pointer_table(gpu, owned, rows)
        ids_tab = pointer_table(gpu, owned, ids)
        n_dev = upload(gpu, owned, np.array([n], np.int32))
        hid = (upload_unaligned if unaligned else upload)(gpu, owned, hidden)
        logits = upload(gpu, owned, init)
        lmhead_overlay_routed(gpu, k.lmhead_overlay_f32, hid, 0, 0, rows_tab, ids_tab, n_dev, logits,
                              m, n, h, vocab, 0)
        got = download(gpu, logits, (m, vocab), np.float32)
    vector = h % 8 == 0 and not unaligned
    expect = lmhead_dot(hidden[:, None, :], rows[0][None, :, :], vector)  # [m, n]
    np.testing.assert_array_equal(got[:, ids[0]], expect)
