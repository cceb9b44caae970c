"""``NgramDecoder``'s serving calls against the plain step, in ``bench.decode``'s run (its dims,
device, stream and weights; ratios within one run). Each row states its target:

  padded 48 in 64   the batch-64 step graph replayed with 48 live entries and 16 PAD_SLOT ones,
                    over the same graph with 64 live entries (target <= 1.05x GPU time)
  adapters, B       the step with per-sequence adapters (3 adapter slots of 1024 overridden
                    rows, each sequence on one of them or none; a quarter of the tokens of a
                    sequence on an adapter are ids that adapter overrides) over the plain step,
                    B = 1 (sequence 0, on an adapter) and 64 (target <= 1.05x)
  seed 8192         a history-only prefill (``seed``) of one 8192-token prompt over its full
                    ``prefill`` (target <= 0.05x)
  fork 64           one ``fork`` of 64 slots (one launch): GPU us (target < 5 us)
  batch-invariant   the step (B = 64) and the 8192-token prefill of a ``batch_invariant``
                    decoder over the default one's (no target: what the invariance costs)
Step rows replay R captured graphs, graph r reading slice r of a random token pool, in a fixed
random order (as bench.decode's step rows), back to back behind a gate; eager rows (seed,
prefill, fork) are launched back to back behind a gate. GPU us are medians per call.
Also: the device memory each graph of a padded ladder draws when captured (one decoder and one
set of buffers serve them all), from cuMemGetInfo around COPIES captures of each size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from bench.common import gated_gpu_us, not_a_tool, print_table
from gpu_runtime import DeviceArray
from layers.dense_weight import BF16
from layers.ngram_embed import NO_ADAPTER, PAD_SLOT, DecodeError, NgramDecoder, NgramWeights
from layers.overlay import AdapterOverlay, OverlaySlots, TableOverlay

R = 16  # graphs per step row
ORDER = 1 << 10  # replay order over them (a power of two)
PROMPT = 32  # tokens prefilled per slot before the step rows
OVERRIDE = 1024  # embedding rows each adapter overrides
SEED_TOKENS = 8192
LADDER = (1, 2, 4, 8, 16, 32, 64)
COPIES = 32  # graphs captured per ladder size for its memory figure


def _gpu_us(gpu: Any, s: int, launch: Callable[[int], Any]) -> float:
    us, _ = gated_gpu_us(launch, stream=s, batch=16, warmup=2, iters=10)
    gpu.synchronize(s)
    return us


class _Steps:
    """R graphs of one ``dec.step`` shape over a token pool; ``us()`` times their replays."""

    def __init__(
        self,
        gpu: Any,
        dec: NgramDecoder,
        s: int,
        pool: DeviceArray,
        slots: DeviceArray,
        b: int,
        out: int,
        rng: np.random.Generator,
        adapters: DeviceArray | None = None,
    ) -> None:
        self.gpu, self.s = gpu, s
        tokens = [pool.ptr.offset(r * b * 4) for r in range(R)]
        dec.step(tokens[0], slots, b, out, s, adapters=adapters)  # eager first: loads kernels
        self.graphs: list[int] = []
        for r in range(R):
            gpu.begin_capture(s)
            try:
                dec.step(tokens[r], slots, b, out, s, adapters=adapters)
            except BaseException:
                gpu.abort_capture(s)
                raise
            self.graphs.append(gpu.end_capture(s))
        self.order = [self.graphs[j] for j in rng.integers(0, R, ORDER)]

    def us(self) -> float:
        seq, mask, gpu, s = self.order, ORDER - 1, self.gpu, self.s
        return _gpu_us(gpu, s, lambda i: gpu.launch_graph(seq[i & mask], s))

    def close(self) -> None:
        self.gpu.synchronize(self.s)
        for exe in self.graphs:
            self.gpu.destroy_graph(exe)


def _adapter_slots(gpu: Any, dims: Any, rng: np.random.Generator, s: int) -> OverlaySlots:
    slots = OverlaySlots(gpu, 3, dims.vocab_size, dims.hidden_size, stream=s)
    for a in range(3):
        rows = (rng.standard_normal((OVERRIDE, dims.hidden_size)) * 0.5).astype(np.float32).astype(BF16)
        slots.load(a, AdapterOverlay(TableOverlay.of(rng.choice(dims.vocab_size, OVERRIDE, replace=False), rows)), s)
    return slots


def serving_rows(gpu: Any, s: int, weights: NgramWeights, rng: np.random.Generator) -> None:
    """Print the serving rows and the ladder's graph memory for ``weights`` (device tables):
    two decoders on them side by side (adapter slots; batch invariant), closed here."""
    dims = weights.dims
    v = dims.vocab_size
    adapter_slots = _adapter_slots(gpu, dims, rng, s)
    dec = NgramDecoder(weights, max_seqs=256, max_rows=SEED_TOKENS, stream=s, adapter_slots=adapter_slots)
    inv = NgramDecoder(weights, max_seqs=256, max_rows=SEED_TOKENS, stream=s, batch_invariant=True)
    out = gpu.alloc(SEED_TOKENS * dims.hidden_size * 2)
    arrays: list[DeviceArray] = []

    def upload(values: Any) -> DeviceArray:
        arrays.append(DeviceArray.from_numpy(gpu, np.asarray(values, np.uint32), s))
        return arrays[-1]

    steps: list[_Steps] = []
    try:
        choice = rng.choice([0, 1, 2, NO_ADAPTER], 64)
        choice[0] = rng.integers(0, 3)  # B = 1 runs sequence 0 alone: on an adapter
        ids_of = []
        for slot in range(3):
            overlay = adapter_slots.loaded(slot)
            assert overlay is not None and overlay.embed is not None  # _adapter_slots loaded embedding rows in each
            ids_of.append(overlay.embed.ids)

        def token_pool(seqs: np.ndarray) -> np.ndarray:
            """[R, len(seqs)] tokens, column j sequence seqs[j]'s: a quarter of those of a
            sequence on an adapter are ids its own adapter overrides."""
            tokens = rng.integers(0, v, (R, len(seqs))).astype(np.uint32)
            for j, a in enumerate(choice[seqs]):
                if a != NO_ADAPTER:
                    hit = rng.random(R) < 0.25
                    tokens[hit, j] = rng.choice(ids_of[int(a)], int(hit.sum()))
            return tokens

        pool = upload(token_pool(np.arange(64)).reshape(-1))  # graph r of B = 64 reads row r
        pool1 = upload(token_pool(np.zeros(1, np.int64)).reshape(-1))  # graph r of B = 1: token r, sequence 0's
        live64 = upload(np.arange(64))
        pad48 = upload(np.concatenate([np.arange(48), np.full(16, PAD_SLOT)]))
        adapters = upload(choice)
        prompts = upload(rng.integers(0, v, 64 * PROMPT))
        cu = upload(np.arange(65) * PROMPT)
        dec.prefill(prompts, cu, live64, 64, 64 * PROMPT, out, s)
        rows: list[tuple[str, float, float | None, float | None, str]] = []
        steps += [_Steps(gpu, dec, s, pool, sl, 64, out, rng) for sl in (live64, pad48)]
        exact, padded = steps
        e_us, p_us = exact.us(), padded.us()
        rows.append(("padded 48 in the batch-64 graph / exact 64", p_us, e_us, p_us / e_us, "<= 1.05"))
        for b, tokens in ((1, pool1), (64, pool)):
            steps.append(_Steps(gpu, dec, s, tokens, live64, b, out, rng))
            steps.append(_Steps(gpu, dec, s, tokens, live64, b, out, rng, adapters))
            plain, routed = steps[-2:]
            a_us, b_us = routed.us(), plain.us()
            rows.append((f"adapter-routed step / plain step, B={b}", a_us, b_us, a_us / b_us, "<= 1.05"))
        tok = upload(rng.integers(0, v, SEED_TOKENS))
        cu1, slot0 = upload([0, SEED_TOKENS]), upload([0])
        seed_us = _gpu_us(gpu, s, lambda i: dec.seed(tok, cu1, slot0, 1, SEED_TOKENS, s))
        full_us = _gpu_us(gpu, s, lambda i: dec.prefill(tok, cu1, slot0, 1, SEED_TOKENS, out, s))
        rows.append(
            (
                f"seed (history only) / full prefill, {SEED_TOKENS} tokens",
                seed_us,
                full_us,
                seed_us / full_us,
                "<= 0.05",
            )
        )
        src, dst = upload(np.arange(64)), upload(np.arange(64, 128))
        fork_us = _gpu_us(gpu, s, lambda i: dec.fork(src, dst, 64, s))
        rows.append(("fork of 64 slots (one launch)", fork_us, None, None, "< 5 us"))
        inv.prefill(prompts, cu, live64, 64, 64 * PROMPT, out, s)
        steps.append(_Steps(gpu, inv, s, pool, live64, 64, out, rng))
        i_us = steps[-1].us()
        rows.append(("batch-invariant step / default step, B=64", i_us, e_us, i_us / e_us, "-"))
        inv_us = _gpu_us(gpu, s, lambda i: inv.prefill(tok, cu1, slot0, 1, SEED_TOKENS, out, s))
        rows.append(
            (f"batch-invariant prefill / default prefill, {SEED_TOKENS} tokens", inv_us, full_us, inv_us / full_us, "-")
        )
        err = dec.check_errors() | inv.check_errors()
        print(f"serving rows: decoder errors after all calls: {err!r}", flush=True)
        assert err == DecodeError.NONE
        print_table(
            "NgramDecoder serving calls (GPU us per call, back to back; ratios in this run)",
            ["row", "GPU us", "against us", "ratio", "target"],
            rows,
            note="Each row is a serving call (the module's docstring defines each): its GPU us, that of the "
            "plain call it is compared with, their ratio, and the target for that ratio.",
        )
        ladder_memory(gpu, dec, s, pool, out, rng)
    finally:
        gpu.synchronize(s)
        for st in steps:
            st.close()
        for a in arrays:
            a.free()
        gpu.free(out)
        inv.close()
        dec.close()
        adapter_slots.close(s)


def ladder_memory(gpu: Any, dec: NgramDecoder, s: int, pool: DeviceArray, out: int, rng: np.random.Generator) -> None:
    """The device memory each graph of a padded ladder draws at capture (k = 1, adapters),
    every graph over the same token, slot and adapter buffers: COPIES captures per size."""
    slots = DeviceArray.from_numpy(gpu, np.full(64, PAD_SLOT, np.uint32), s)
    adapters = DeviceArray.from_numpy(gpu, np.full(64, NO_ADAPTER, np.uint32), s)
    graphs, rows = [], []
    try:
        for size in LADDER:
            dec.step(pool, slots, size, out, s, adapters=adapters)
            gpu.synchronize(s)
            free = gpu.mem_info()[0]
            for _ in range(COPIES):
                gpu.begin_capture(s)
                dec.step(pool, slots, size, out, s, adapters=adapters)
                graphs.append(gpu.end_capture(s))
            drawn = free - gpu.mem_info()[0]
            rows.append((size, drawn, drawn / COPIES))
        print_table(
            f"padded ladder: device memory drawn by {COPIES} captures of each size (one decoder, one set of buffers)",
            ["batch size", "bytes drawn", "bytes per graph"],
            rows,
            note=f"Each row is one batch size of the ladder: the device bytes that {COPIES} captures of its "
            "graph drew together, and per graph.",
        )
    finally:
        gpu.synchronize(s)
        for exe in graphs:
            gpu.destroy_graph(exe)
        slots.free()
        adapters.free()


if __name__ == "__main__":
    not_a_tool("bench.decode_serving", "bench.decode's serving rows; python -m bench.decode prints them")
