"""``World``: an ``NgramDecoder`` beside the fused path fed each slot's full context on the host
(every decoder row must equal the fused path's rows for the same tokens, bit for bit), with
optional adapter slots, and ``u32`` uploads. For the decoder's GPU tests and the engine loop; and
for its CPU tests ``recording``, a decoder (optionally with adapter slots) on a recording backend,
with made-up device pointers ``P``."""

from __future__ import annotations

import numpy as np

from gpu_runtime import DeviceArray, DevicePtr
from layers.ngram_embed import FusedNgramEmbedding, NgramDecoder
from layers.overlay import OverlaySlots
from layers.dense_weight import BF16
from tests.helpers import Guarded
from tests.helpers.fakes import RecordingBackend
from tests.helpers.ngram import device_weights, random_layer, small_dims
from tests.helpers.overlay import random_overlay


def u32(gpu, values, stream=0):
    return DeviceArray.from_numpy(gpu, np.asarray(values, np.uint32), stream)


class World:
    """A decoder and, beside it, the fused path fed the full host-side context of every slot:
    every decoder output must equal the fused path's rows for the same tokens, bit for bit.
    ``adapters``: that many adapter slots, each loaded with a random overlay of ``override``
    embedding rows (``overlays[a]``), given to both; ``batch_invariant`` given to both too.
    ``collective``: the decoder's recording collective (None: a plain decoder has none)."""

    collective = None

    def __init__(self, gpu, rng, *, max_seqs=6, max_rows=96, max_draft=3, kinds="bf", eos=True,
                 max_ngram=3, splits=2, adapters=0, override=60, batch_invariant=False):
        dims = small_dims(max_ngram=max_ngram, splits=splits, table_dim=24, hidden_size=72,
                          base_rows=997, vocab_size=600, eos_id=5 if eos else None)
        self.gpu, self.rng, self.dims = gpu, rng, dims
        self.host = random_layer(rng, dims, kinds)
        self.weights = device_weights(gpu, self.host)
        self.slots = None
        self.overlays = [random_overlay(rng, dims.vocab_size, dims.hidden_size, override, None)
                         for _ in range(adapters)]
        if adapters:
            self.slots = OverlaySlots(gpu, adapters, dims.vocab_size, dims.hidden_size)
            for a, overlay in enumerate(self.overlays):
                self.slots.load(a, overlay)
        gpu.synchronize(0)  # uploaded on the default stream; the decoder and fused path read them on ours
        self.stream = gpu.create_stream()
        self.dec = NgramDecoder(self.weights, max_seqs=max_seqs, max_rows=max_rows, stream=self.stream,
                                max_draft=max_draft, adapter_slots=self.slots, batch_invariant=batch_invariant)
        self.fused = FusedNgramEmbedding(self.weights, max_rows, self.stream, adapter_slots=self.slots,
                                         batch_invariant=batch_invariant)
        self.ctx: dict[int, list[int]] = {s: [] for s in range(max_seqs)}
        self.out = Guarded(gpu, (max_rows, dims.hidden_size), BF16, rng)

    def word_table(self, adapter: int | None) -> np.ndarray:
        """The word table with adapter ``adapter``'s rows written in (None: the base table)."""
        if adapter is None:
            return self.host.word
        word = self.host.word.copy()
        emb = self.overlays[adapter].embed
        word[emb.ids] = emb.rows
        return word

    def tokens(self, n):
        t = self.rng.integers(0, self.dims.vocab_size, n)
        t[self.rng.random(n) < 0.1] = 5  # EOS inside prompts and among decoded tokens
        return t.astype(np.uint32)

    def step(self, tokens, slots, adapters=None):
        """One decode step (k = 1) of ``slots`` (real ones) on ``tokens`` into the poisoned
        output: its rows, read back; each slot's context then holds its token."""
        with u32(self.gpu, tokens) as t, u32(self.gpu, slots) as sl, \
                u32(self.gpu, adapters if adapters is not None else [0]) as ad:
            self.out.poison()  # it may hold an earlier call's rows
            self.gpu.synchronize(0)
            self.dec.step(t, sl, len(slots), self.out.ptr, self.stream, adapters=None if adapters is None else ad)
            got = self.read(len(slots))
        for slot, token in zip(slots, tokens):
            self.ctx[slot].append(int(token))
        return got

    def read(self, rows):
        self.gpu.synchronize(self.stream)
        got = self.out.read()[:rows]
        self.out.assert_guards_intact()
        return got

    def expect(self, slots, lens, rows, adapters=None):
        """The fused path's rows for the last lens[i] tokens of each slot's context (``rows`` =
        sum(lens)), every one written: a decoder output equal to them bit for bit was written too
        (its poison is not finite)."""
        contexts = [np.asarray(self.ctx[s], np.int64) for s in slots]
        with Guarded(self.gpu, (max(rows, 1), self.dims.hidden_size), BF16, self.rng) as want:
            want.poison()
            self.gpu.synchronize(0)
            self.fused.embed_batch(contexts, lens, want.ptr, self.stream, adapters=adapters)
            self.gpu.synchronize(self.stream)
            rows_out = want.read()[:rows]
            want.assert_guards_intact()
        assert np.isfinite(rows_out.astype(np.float32)).all(), "the fused path left rows unwritten"
        return rows_out

    def prefill(self, slots, lens, adapters=None):
        toks = [self.tokens(n) for n in lens]
        flat = np.concatenate(toks) if toks else np.zeros(0, np.uint32)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.uint32)
        for s, t in zip(slots, toks):
            self.ctx[s].extend(int(x) for x in t)
        self.out.poison()
        self.gpu.synchronize(0)
        with u32(self.gpu, flat if flat.size else [0]) as d_tok, u32(self.gpu, cu) as d_cu, \
                u32(self.gpu, slots) as d_slots, u32(self.gpu, adapters if adapters is not None else [0]) as d_ad:
            self.gpu.synchronize(0)
            self.dec.prefill(d_tok, d_cu, d_slots, len(slots), int(flat.size), self.out.ptr, self.stream,
                             adapters=None if adapters is None else d_ad)
            got = self.read(flat.size)
        return got, self.expect(slots, lens, flat.size, adapters)

    def reset(self, slot):
        self.dec.reset(slot, self.stream)
        self.ctx[slot] = []

    def close(self):
        self.gpu.synchronize(self.stream)
        self.out.free()
        self.fused.close()
        self.dec.close()
        if self.slots is not None:
            self.slots.close()
        self.weights.close()
        self.gpu.destroy_stream(self.stream)


P = [DevicePtr(0x100000 * (i + 1)) for i in range(8)]


def recording(adapters: int = 0, h: int | None = None):
    """(backend, decoder, adapter slots or None): an ``NgramDecoder`` on a ``RecordingBackend``."""
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=3, splits=2, eos_id=7)
    weights = device_weights(gpu, random_layer(np.random.default_rng(1), dims, "bf"))
    slots = OverlaySlots(gpu, adapters, dims.vocab_size, h or dims.hidden_size) if adapters else None
    return gpu, NgramDecoder(weights, max_seqs=4, max_rows=32, max_draft=2, adapter_slots=slots), slots
