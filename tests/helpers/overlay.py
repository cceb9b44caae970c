"""Overlay tests' shared pieces: the token_overlay kernels on the host-memory backend
(``embed_rowdiff`` emulated with the reference), random adapters and overlays, and the check that
a slot's device tables describe an overlay."""

from __future__ import annotations

from typing import Sequence

import ml_dtypes
import numpy as np

from layers.overlay import AdapterOverlay, OverlaySlots, TableOverlay
from layers.reference import rowdiff_ref
from tests.helpers.fakes import MemoryBackend
from tests.helpers import bits, random_bf16

BF16 = np.dtype(ml_dtypes.bfloat16)
NAMES = ("embed_rowdiff_bf16", "embed_overlay_routed_bf16", "lmhead_overlay_routed_bf16",
         "lmhead_overlay_routed_f32")


def emulate_rowdiff(gpu: MemoryBackend, args: list) -> None:
    """``embed_rowdiff_bf16`` on a ``MemoryBackend``, by the reference."""
    base, served, flags, rows, h, thresh = args
    a = gpu.read_as(base, rows * h, BF16).reshape(rows, h)
    b = gpu.read_as(served, rows * h, BF16).reshape(rows, h)
    gpu.copy_h2d_async(rowdiff_ref(a, b, thresh), flags)


def overlay_backend() -> MemoryBackend:
    """The token_overlay kernels, ``embed_rowdiff`` emulated with the reference."""
    return MemoryBackend(module="token_overlay", names=NAMES,
                         emulate={"embed_rowdiff_bf16": emulate_rowdiff})


def adapter_copy(rng, served: np.ndarray, rows: Sequence[int], scale: float = 1.0) -> np.ndarray:
    """``served`` with ``rows`` replaced by fresh random rows."""
    out = served.copy()
    out[list(rows)] = (rng.standard_normal((len(rows), served.shape[1])) * scale).astype(BF16)
    return out


def random_overlay(rng, vocab: int, h: int, n_embed: int, n_lm: int | None) -> AdapterOverlay:
    """``n_embed`` embedding rows and (unless None) ``n_lm`` LM-head rows at random distinct ids."""
    emb = TableOverlay.of(rng.choice(vocab, n_embed, replace=False), random_bf16(rng, (n_embed, h)))
    lm = None if n_lm is None else TableOverlay.of(rng.choice(vocab, n_lm, replace=False),
                                                   random_bf16(rng, (n_lm, h)))
    return AdapterOverlay(emb, lm)


def read_tables(gpu: MemoryBackend, slots: OverlaySlots) -> dict[str, np.ndarray]:
    """The slots' six per-slot device tables, read back."""
    ns = slots.num_slots
    return dict(
        embed_map=gpu.read_as(slots.embed_slot_map_tab, ns, np.uint64),
        embed_rows=gpu.read_as(slots.embed_rows_tab, ns, np.uint64),
        embed_n=gpu.read_as(slots.embed_n_tab, ns, np.int32),
        lm_rows=gpu.read_as(slots.lm_head_rows_tab, ns, np.uint64),
        lm_ids=gpu.read_as(slots.lm_head_ids_tab, ns, np.uint64),
        lm_n=gpu.read_as(slots.lm_head_n_tab, ns, np.int32),
    )


def check_slot_contents(gpu: MemoryBackend, slots: OverlaySlots, slot: int, ov: AdapterOverlay | None):
    """The device tables of ``slot`` describe ``ov`` exactly (or nothing when ``ov`` is None)."""
    t = read_tables(gpu, slots)
    emb = None if ov is None else ov.embed
    if emb is None or emb.n == 0:
        assert t["embed_map"][slot] == 0 and t["embed_rows"][slot] == 0 and t["embed_n"][slot] == 0
    else:
        expect = np.full(slots.vocab, -1, np.int32)
        expect[emb.ids] = np.arange(emb.n)
        np.testing.assert_array_equal(gpu.read_as(int(t["embed_map"][slot]), slots.vocab, np.int32), expect)
        got_rows = gpu.read_as(int(t["embed_rows"][slot]), emb.n * slots.h, np.uint16)
        np.testing.assert_array_equal(got_rows, bits(emb.rows).reshape(-1))
        assert t["embed_n"][slot] == emb.n
    lm = None if ov is None else ov.lm_head
    if lm is None or lm.n == 0:
        assert t["lm_rows"][slot] == 0 and t["lm_ids"][slot] == 0 and t["lm_n"][slot] == 0
    else:
        np.testing.assert_array_equal(gpu.read_as(int(t["lm_ids"][slot]), lm.n, np.int32), lm.ids)
        got_rows = gpu.read_as(int(t["lm_rows"][slot]), lm.n * slots.h, np.uint16)
        np.testing.assert_array_equal(got_rows, bits(lm.rows).reshape(-1))
        assert t["lm_n"][slot] == lm.n
