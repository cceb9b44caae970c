"""A continuous-batching engine loop around ``NgramDecoder``, every row of every step checked.

What an engine does, all at once, on a seeded random schedule:
  - requests arrive with prompts; some share a cached system prompt, which is seeded into the
    n-gram history (``dec.seed``: a prefix-cache hit, no embedding) instead of prefilled;
  - new requests are prefilled in one ragged ``dec.prefill`` (with a padded sequence now and
    then); some fork into 2-4 samples (``dec.fork``);
  - each live request uses one of three adapters or none (``OverlaySlots``; ``adapters=``) and
    decodes k = 1-4 tokens a step (k > 1: speculative drafts, rejected at random and dropped
    with ``dec.rollback``);
  - requests are grouped by k; each group is padded up to the next batch size of a ladder
    (1, 2, 4, ..., 64) with ``PAD_SLOT`` entries and runs as one replay of the graph captured at
    that size, all sizes sharing one set of buffers;
  - requests finish at random and their slots are reused; a few steps carry an injected bad
    token, slot or adapter index.
Checks: every row of every prefill and step bit for bit against the fused path run on that
request alone (its whole context, its adapter), and within the fused path's contract against
the numpy reference on that context and the adapter's word table; padded rows zeros; the error
flags raised in exactly the steps that had a fault; the out buffer's guard rows intact; after
the last step, no flag pending and nothing leaked (the backend's allocations, graphs and pinned
buffers, and no device memory drawn while the loop ran).

The model's weights are one ``NgramWeights``; the decoder and the fused path it is checked
against are two runners on them, side by side (closed first, then the weights).

Run it on a CUDA GPU with the package installed (``pip install .``):
``python examples/serve_loop.py [--steps 2000] [--seed 0]`` (tests/test_serve_loop.py runs
``run`` for 2000 steps).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from _requires import installed  # examples/_requires.py: a missing package is one line

with installed("serve_loop.py"):
    import _serving as serving  # examples/_serving.py: what the two serving loops share
    import ml_dtypes
    import numpy as np

    from gpu_runtime import CudaBackend, DeviceArray
    from layers.ngram_embed import (
        NO_ADAPTER,
        PAD_SLOT,
        DecodeError,
        FusedNgramEmbedding,
        NgramDecoder,
        NgramDims,
        NgramWeights,
        ngram_ids_tail,
    )
    from layers.overlay import AdapterOverlay, OverlaySlots, TableOverlay

BF16, FP8 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
DIMS = NgramDims(vocab_size=1000, hidden_size=96, max_ngram=4, splits=2, base_rows=2003,
                 row_bias=1, table_dim=16, eos_id=7)
PLACEMENT = ["device", "device", "host", "device", "device", "device"]  # one table read over PCIe
MAX_SEQS, MAX_DRAFT, MAX_ROWS = 64, 4, 256
LADDER = (1, 2, 4, 8, 16, 32, 64)
DRAFTS = (1, 1, 1, 2, 3, 4)         # k per request, drawn from these
ADAPTERS, OVERRIDE = 3, 100         # adapter slots, embedding rows each overrides
PREFIX_LENS = (2, 12, 20, 45)       # the cached system prompts
TARGET_LIVE, FINISH, PREFIX_HIT, FORK, FAULT = 60, 0.02, 0.3, 0.2, 0.015
GUARD = 4                           # guard rows on each side of the step output
FAULTS = ("token", "slot", "adapter")


@dataclass
class Request:
    slot: int
    adapter: int       # an adapter slot, or NO_ADAPTER
    k: int             # tokens a step
    left: int          # steps until it finishes
    ctx: list[int] = field(repr=False)  # every token the decoder's history has seen, in order


@dataclass
class Report:
    steps: int = 0
    requests: int = 0
    prefix_hits: int = 0
    forks: int = 0
    rows_checked: int = 0        # decoder rows compared bit for bit with the fused path
    rows_reference: int = 0      # ... and with the numpy reference
    rows_padded: int = 0         # padded rows checked to be zeros
    rollbacks: int = 0
    max_live: int = 0
    replays: Counter = field(default_factory=Counter)   # batch size -> graph replays
    faults: Counter = field(default_factory=Counter)    # kind -> injected
    flagged: Counter = field(default_factory=Counter)   # kind -> steps whose flags showed it
    graph_bytes: int = 0                                # device bytes the captures drew, all graphs
    drawn: int = 0                                      # device bytes drawn in the second half

    def lines(self) -> list[str]:
        sizes = ", ".join(f"{b}: {n}" for b, n in sorted(self.replays.items()))
        graphs = len(LADDER) * len(set(DRAFTS))
        return [f"steps {self.steps}, requests {self.requests} (prefix hits {self.prefix_hits}, "
                f"forked samples {self.forks}), most live at once {self.max_live}",
                f"rows checked bit for bit against the fused path: {self.rows_checked} "
                f"(and against the numpy reference: {self.rows_reference}); padded rows checked "
                f"zero: {self.rows_padded}; rollbacks {self.rollbacks}",
                f"graph replays by batch size: {sizes}",
                f"faults injected {dict(self.faults)}, flagged {dict(self.flagged)}",
                f"{graphs} graphs ({len(LADDER)} batch sizes x {len(set(DRAFTS))} draft lengths) over one "
                f"set of buffers: {self.graph_bytes / 2**20:.0f} MiB of device memory drawn by their "
                f"captures (cuMemGetInfo), {self.graph_bytes / graphs / 1024:.0f} KiB a graph",
                f"device memory drawn in the second half of the loop: {self.drawn} bytes; "
                f"nothing held after close"]


def fused_reference(word: np.ndarray, tables: list[tuple[np.ndarray, np.ndarray | None]],
                    projs: list[np.ndarray], ctx: list[int], n: int) -> np.ndarray:
    """What the fused path computes for the last ``n`` tokens of ``ctx``, in numpy: each table's
    rows (fp8 ones dequantised to bf16 with their scales) through its projection, summed exactly,
    then rounded to fp32, plus the word row in fp32, times fp32 1/(1+T), one rounding to bf16."""
    inv = np.float32(1.0) / np.float32(1 + DIMS.num_tables())
    acc = np.zeros((n, DIMS.hidden_size), np.float64)
    for (table, scale), proj, ids in zip(tables, projs, ngram_ids_tail(DIMS, ctx, n)):
        rows = table[ids] if scale is None else (table[ids].astype(np.float32) * scale[ids][:, None]).astype(BF16)
        acc += rows.astype(np.float64) @ proj.astype(np.float64).T
    words = word[np.asarray(ctx[len(ctx) - n:], np.int64)].astype(np.float32)
    return ((acc.astype(np.float32) + words) * inv).astype(BF16)


def random_model(rng: np.random.Generator):
    """Word table, tables (bf16 and fp8 with row scales), projections, adapter overlays."""
    dims = DIMS
    v, h, td = dims.vocab_size, dims.hidden_size, dims.table_dim()

    def bf16(shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32).astype(BF16)

    tables = []
    for c in range(dims.num_tables()):
        rows = dims.table_rows(c)
        if c % 2:
            raw = rng.integers(0, 256, (rows, td), dtype=np.uint8)
            raw[(raw & 0x7F) == 0x7F] = 0x3C  # no NaN patterns
            tables.append((raw.view(FP8), rng.uniform(0.002, 0.02, rows).astype(np.float32)))
        else:
            tables.append(bf16((rows, td)))
    projs = [bf16((h, td), td**-0.5) for _ in tables]
    overlays = [AdapterOverlay(TableOverlay.of(rng.choice(v, OVERRIDE, replace=False), bf16((OVERRIDE, h))))
                for _ in range(ADAPTERS)]
    return bf16((v, h)), tables, projs, overlays


class Engine:
    """The decoder, the buffers its graphs read, the graphs, and the checks."""

    def __init__(self, gpu: CudaBackend, rng: np.random.Generator, report: Report) -> None:
        self.gpu, self.rng, self.report = gpu, rng, report
        self.word, tables, self.projs, overlays = random_model(rng)
        self.tables = [t if isinstance(t, tuple) else (t, None) for t in tables]  # the reference's form
        self.words = [self.word] + [self._word_with(o) for o in overlays]  # index: adapter + 1
        self.s = s = gpu.create_stream()
        self.weights = NgramWeights.from_numpy(DIMS, self.word, tables, self.projs, gpu, stream=s,
                                               placement=PLACEMENT)
        self.slots = OverlaySlots(gpu, ADAPTERS, DIMS.vocab_size, DIMS.hidden_size, stream=s)
        for a, overlay in enumerate(overlays):
            self.slots.load(a, overlay, s)
        # batch invariant: a row's bits do not depend on what else is in its call, so every row
        # can be checked bit for bit against the fused path run on its request alone
        self.dec = NgramDecoder(self.weights, max_seqs=MAX_SEQS, max_rows=MAX_ROWS, stream=s,
                                max_draft=MAX_DRAFT, adapter_slots=self.slots, batch_invariant=True)
        self.fused = FusedNgramEmbedding(self.weights, MAX_ROWS, s, adapter_slots=self.slots,
                                         batch_invariant=True)
        h = DIMS.hidden_size
        u32 = lambda n: DeviceArray.empty(gpu, (n,), np.uint32, s)  # noqa: E731
        # one set of buffers for every graph (sized for the largest), and the eager calls' own
        self.tokens, self.seq_slots, self.seq_adapters, self.counts = (
            u32(MAX_SEQS * MAX_DRAFT), u32(MAX_SEQS), u32(MAX_SEQS), u32(MAX_SEQS))
        self.p_tokens, self.p_cu, self.p_slots, self.p_adapters = (
            u32(MAX_ROWS), u32(MAX_SEQS + 2), u32(MAX_SEQS + 1), u32(MAX_SEQS + 1))
        self.f_src, self.f_dst = u32(MAX_SEQS), u32(MAX_SEQS)
        self.out = DeviceArray.empty(gpu, (MAX_ROWS + 2 * GUARD, h), BF16, s)
        self.want = DeviceArray.empty(gpu, (MAX_ROWS, h), BF16, s)
        self.guard = rng.integers(0, 2**16, (MAX_ROWS + 2 * GUARD, h), dtype=np.uint64).astype(np.uint16)
        gpu.copy_h2d_async(self.guard, self.out.ptr, s)
        self.rows = self.out.ptr.offset(GUARD * h * 2)  # where every call writes
        for a in (self.tokens, self.seq_adapters):  # padded entries' values are read, never used
            a.upload(np.zeros(a.shape, np.uint32))
        self.graphs: dict[tuple[int, int], int] = {}
        self.capture_all()

    def _word_with(self, overlay: AdapterOverlay) -> np.ndarray:
        word = self.word.copy()
        word[overlay.embed.ids] = overlay.embed.rows
        return word

    # -- graphs -------------------------------------------------------------------------------
    def capture_all(self) -> None:
        """A graph per ladder size and draft length, all over the same buffers. Each shape runs
        once eagerly first (loads kernels), on padding only: no row, no history, no flag."""
        gpu, s, dec = self.gpu, self.s, self.dec
        self.seq_slots.upload(np.full(MAX_SEQS, PAD_SLOT, np.uint32))
        for k in sorted(set(DRAFTS)):  # the eager calls first: their kernels' lazy loading draws memory
            for size in LADDER:
                dec.step(self.tokens, self.seq_slots, size, self.rows, s, k=k, adapters=self.seq_adapters)
        gpu.synchronize(s)
        free = gpu.mem_info()[0]
        for k in sorted(set(DRAFTS)):
            for size in LADDER:
                gpu.begin_capture(s)
                try:
                    dec.step(self.tokens, self.seq_slots, size, self.rows, s, k=k, adapters=self.seq_adapters)
                except BaseException:
                    gpu.abort_capture(s)
                    raise
                self.graphs[size, k] = gpu.end_capture(s)
        self.report.graph_bytes = free - gpu.mem_info()[0]
        assert dec.check_errors() == DecodeError.NONE

    # -- what every row is checked against --------------------------------------------------------
    def expect(self, calls: list[tuple[Request, int]]) -> np.ndarray:
        """The fused path's rows for each (request, n): its context's last n tokens with its
        adapter, one call per request alone, stacked in order."""
        at, h = 0, DIMS.hidden_size
        for req, n in calls:
            self.fused.embed_batch([np.asarray(req.ctx, np.int64)], [n], self.want.ptr.offset(at * h * 2),
                                   self.s, adapters=[req.adapter])
            at += n
        return self.read(self.want.ptr, at)

    def reference(self, req: Request, n: int) -> np.ndarray:
        """The numpy reference of the context's last n rows with the request's word table."""
        word = self.words[0 if req.adapter == NO_ADAPTER else req.adapter + 1]
        return fused_reference(word, self.tables, self.projs, req.ctx, n)

    def read(self, ptr: int, rows: int) -> np.ndarray:
        out = np.empty((rows, DIMS.hidden_size), BF16)
        if rows:
            self.gpu.copy_d2h(out, ptr, self.s)
        return out

    def check(self, got: np.ndarray, calls: list[tuple[Request, int]]) -> None:
        """``got`` (the decoder's rows of ``calls``, stacked) against the fused path and the
        numpy reference."""
        want = self.expect(calls)
        at = 0
        for req, n in calls:
            g, f = got[at:at + n], want[at:at + n]
            assert np.array_equal(g.view(np.uint16), f.view(np.uint16)), \
                f"decoder != fused path for {req} rows {n}: {serving.diff(g, f)}"
            x = self.reference(req, n)
            assert (np.abs(g.astype(np.float64) - x.astype(np.float64))
                    <= np.abs(x.astype(np.float64)) * 2.0**-7 + 1e-6).all(), \
                f"decoder != numpy reference for {req} rows {n}: {serving.diff(g, x)}"
            at += n
        self.report.rows_checked += at
        self.report.rows_reference += at

    def poison(self, rows: int) -> None:
        self.gpu.memset(self.rows, 0xFF, rows * DIMS.hidden_size * 2, self.s)

    def guards_intact(self) -> bool:
        got = np.empty_like(self.guard)
        self.gpu.copy_d2h(got, self.out.ptr, self.s)
        h = GUARD
        return np.array_equal(got[:h], self.guard[:h]) and np.array_equal(got[-h:], self.guard[-h:])

    def close(self) -> None:
        self.gpu.synchronize(self.s)
        for exe in self.graphs.values():
            self.gpu.destroy_graph(exe)
        for a in (self.tokens, self.seq_slots, self.seq_adapters, self.counts, self.p_tokens, self.p_cu,
                  self.p_slots, self.p_adapters, self.f_src, self.f_dst, self.out, self.want):
            a.free()
        self.fused.close()  # the runners, then what they read
        self.dec.close()
        self.slots.close(self.s)
        self.weights.close()
        self.gpu.destroy_stream(self.s)


class Loop:
    """The schedule: arrivals, prefix hits, prefill, forks, padded steps, drafts, faults."""

    def __init__(self, engine: Engine, rng: np.random.Generator) -> None:
        self.e, self.rng, self.report = engine, rng, engine.report
        self.free = list(range(MAX_SEQS))[::-1]
        self.live: list[Request] = []
        self.prefixes = [self.tokens(n) for n in PREFIX_LENS]

    def tokens(self, n: int) -> list[int]:
        t = self.rng.integers(0, DIMS.vocab_size, n)
        t[self.rng.random(n) < 0.05] = DIMS.eos_id  # EOS inside prompts and decoded tokens
        return [int(x) for x in t]

    def new_request(self, ctx: list[int]) -> Request:
        self.report.requests += 1
        adapter = int(self.rng.choice([0, 1, 2, NO_ADAPTER]))
        return Request(self.free.pop(), adapter, int(self.rng.choice(DRAFTS)), int(self.rng.integers(4, 120)), ctx)

    # -- arrivals: reset, seed, prefill, fork ----------------------------------------------------
    def admit(self) -> None:
        e, rng, s = self.e, self.rng, self.e.s
        count = int(rng.integers(0, 4)) if len(self.live) < TARGET_LIVE else 0
        new, suffixes, hits = [], [], []
        for _ in range(min(count, len(self.free))):
            req = self.new_request([])
            e.dec.reset(req.slot, s)
            if rng.random() < PREFIX_HIT:
                req.ctx = list(self.prefixes[int(rng.integers(len(self.prefixes)))])
                hits.append(req)
            new.append(req)
            suffixes.append(self.tokens(int(rng.integers(1, 33))))
        if hits:
            self.seed(hits)
        if new:
            self.prefill(new, suffixes)
            for req in list(new):
                if rng.random() < FORK and len(self.free) >= 1:
                    self.fork(req, new)
        self.live += new

    def seed(self, hits: list[Request]) -> None:
        """One seed call for every prefix hit, a padded entry (garbage tokens) among them."""
        e, rng = self.e, self.rng
        seqs = [(r.slot, r.ctx) for r in hits]
        if rng.random() < 0.5:
            seqs.insert(int(rng.integers(len(seqs) + 1)), (PAD_SLOT, [int(x) for x in rng.integers(0, 2**32, 3)]))
        flat = np.array([t for _, c in seqs for t in c], np.uint32)
        cu = np.concatenate([[0], np.cumsum([len(c) for _, c in seqs])]).astype(np.uint32)
        self._upload(e.p_tokens, flat)
        self._upload(e.p_cu, cu)
        self._upload(e.p_slots, [slot for slot, _ in seqs])
        e.dec.seed(e.p_tokens, e.p_cu, e.p_slots, len(seqs), flat.size, e.s)
        self.report.prefix_hits += len(hits)

    def prefill(self, new: list[Request], suffixes: list[list[int]]) -> None:
        """One ragged prefill of every new request's suffix, a padded sequence now and then."""
        e, rng = self.e, self.rng
        seqs = [(r.slot, r.adapter, t) for r, t in zip(new, suffixes)]
        pad_at = int(rng.integers(len(seqs) + 1)) if rng.random() < 0.3 else None
        if pad_at is not None:
            seqs.insert(pad_at, (PAD_SLOT, int(rng.integers(0, 2**32)), self.tokens(int(rng.integers(0, 4)))))
        flat = np.array([t for _, _, ts in seqs for t in ts], np.uint32)
        cu = np.concatenate([[0], np.cumsum([len(ts) for _, _, ts in seqs])]).astype(np.uint32)
        self._upload(e.p_tokens, flat)
        self._upload(e.p_cu, cu)
        self._upload(e.p_slots, [slot for slot, _, _ in seqs])
        self._upload(e.p_adapters, [a for _, a, _ in seqs])
        e.poison(flat.size)
        e.dec.prefill(e.p_tokens, e.p_cu, e.p_slots, len(seqs), flat.size, e.rows, e.s, adapters=e.p_adapters)
        got = e.read(e.rows, flat.size)
        for req, t in zip(new, suffixes):
            req.ctx += t
        keep = np.ones(flat.size, bool)
        if pad_at is not None:
            keep[cu[pad_at]:cu[pad_at + 1]] = False
            assert not got[~keep].view(np.uint16).any(), "a padded sequence's rows are zeros"
            self.report.rows_padded += int((~keep).sum())
        e.check(got[keep], [(r, len(t)) for r, t in zip(new, suffixes)])
        self.expect_flags(DecodeError.NONE)

    def fork(self, req: Request, new: list[Request]) -> None:
        """``req`` forks into 2-4 samples: its slot copied to fresh slots (a padded pair too)."""
        e, rng = self.e, self.rng
        samples = [self.new_request(list(req.ctx)) for _ in range(min(int(rng.integers(1, 4)), len(self.free)))]
        for sample in samples:
            sample.adapter, sample.k = req.adapter, req.k
        pairs = [(req.slot, x.slot) for x in samples]
        if rng.random() < 0.3:
            pairs.append((PAD_SLOT, int(rng.integers(0, MAX_SEQS))))  # padding: the slot is left alone
        self._upload(e.f_src, [a for a, _ in pairs])
        self._upload(e.f_dst, [b for _, b in pairs])
        e.dec.fork(e.f_src, e.f_dst, len(pairs), e.s)
        new += samples
        self.report.forks += len(samples)

    def _upload(self, array: DeviceArray, values) -> None:
        values = np.asarray(values, np.uint32)
        if values.size:
            self.e.gpu.copy_h2d_async(values, array.ptr, self.e.s)

    # -- a decode step ----------------------------------------------------------------------------
    def step(self, fault: str | None) -> None:
        """Every live request's k tokens: one padded graph replay per draft length."""
        groups: dict[int, list[Request]] = {}
        for req in self.live:
            groups.setdefault(req.k, []).append(req)
        faulted = int(self.rng.choice(sorted(groups))) if fault and groups else None
        expected = DecodeError.NONE
        for k in sorted(groups):
            expected |= self.replay(groups[k], k, fault if k == faulted else None)
        self.expect_flags(expected)
        self.report.max_live = max(self.report.max_live, len(self.live))

    def replay(self, reqs: list[Request], k: int, fault: str | None) -> DecodeError:
        e, rng = self.e, self.rng
        b = len(reqs)
        size = next(x for x in LADDER if x >= b)
        toks = np.array([self.tokens(k) for _ in reqs], np.uint32).reshape(b, k)
        tokens = np.concatenate([toks.reshape(-1), rng.integers(0, 2 * DIMS.vocab_size, (size - b) * k)])
        slots = np.array([r.slot for r in reqs] + [PAD_SLOT] * (size - b), np.uint32)
        adapters = np.array([r.adapter for r in reqs] + list(rng.integers(0, 2**32, size - b)), np.uint32)
        victim = int(rng.integers(b)) if fault else -1
        flag = DecodeError.NONE
        if fault == "token":   # its last draft token: the rows before it are still checked
            tokens[victim * k + k - 1] = DIMS.vocab_size + int(rng.integers(0, 1000))
            flag = DecodeError.TOKEN
        elif fault == "slot":
            slots[victim] = MAX_SEQS + int(rng.integers(0, 1000))
            flag = DecodeError.SLOT
        elif fault == "adapter":
            adapters[victim] = ADAPTERS + int(rng.integers(0, 1000))
            flag = DecodeError.ADAPTER
        if fault:
            self.report.faults[fault] += 1
        self._upload(e.tokens, tokens.astype(np.uint32))
        self._upload(e.seq_slots, slots)
        self._upload(e.seq_adapters, adapters)
        e.poison(size * k)
        e.gpu.launch_graph(e.graphs[size, k], e.s)
        got = e.read(e.rows, size * k).reshape(size, k, -1)
        self.report.replays[size] += 1
        assert not got[b:].view(np.uint16).any(), "padded rows are zeros"
        self.report.rows_padded += (size - b) * k
        calls, rows = [], []
        for i, req in enumerate(reqs):
            # The faulty entry: a bad slot is not followed (no rows, no history); a bad token
            # zeroes its own row, the ones before it stand (and the engine aborts the request:
            # its history ends in "no token"); a bad adapter zeroes its rows, the history moves.
            n = 0 if i == victim and fault in ("slot", "adapter") else k - 1 if i == victim else k
            assert i != victim or not got[i, n:].view(np.uint16).any(), "the bad value's rows are zeros"
            if not (i == victim and fault == "slot"):
                req.ctx += [int(x) for x in toks[i, :k if fault != "token" or i != victim else k - 1]]
            if n:
                calls.append((req, n))
                rows.append(got[i, :n])
        if calls:
            e.check(np.concatenate(rows), calls)
        if fault == "slot":
            req = reqs[victim]
            assert e.dec.history(req.slot).tolist() == req.ctx[-(DIMS.max_ngram - 1):], "history untouched"
        if fault == "token":
            reqs[victim].left = 0
        if k > 1:
            self.rollback(reqs, k, slots, victim if fault in ("slot", "token") else -1)
        return flag

    def rollback(self, reqs: list[Request], k: int, slots: np.ndarray, skip: int) -> None:
        """Drafts rejected at random (0..k-1 of each request's k); padded and skipped entries
        carry garbage counts that must be ignored."""
        e = self.e
        counts, slots = serving.rollback_args(self.rng, slots, len(reqs), k, skip, PAD_SLOT)
        self._upload(e.counts, counts)
        self._upload(e.seq_slots, slots)
        e.dec.rollback(e.seq_slots, e.counts, slots.size, e.s)
        for i, req in enumerate(reqs):
            if i != skip and counts[i]:
                del req.ctx[len(req.ctx) - int(counts[i]):]
        self.report.rollbacks += 1

    def expect_flags(self, want: DecodeError) -> None:
        bits = {"token": DecodeError.TOKEN, "slot": DecodeError.SLOT, "adapter": DecodeError.ADAPTER}
        serving.count_flags(self.e.dec.check_errors(self.e.s), want, bits, self.report.flagged)

    def retire(self) -> None:
        self.live = serving.retire(self.live, self.free, self.rng, FINISH)


def books(gpu: CudaBackend) -> dict[str, int]:
    """What the backend holds for us (``CudaBackend.held``)."""
    return gpu.held()


def run(gpu: CudaBackend, steps: int = 2000, seed: int = 0) -> Report:
    """The loop for ``steps`` steps on the schedule of ``seed``; raises AssertionError at the
    first row, flag or leak that is wrong."""
    rng = np.random.default_rng(seed)
    report = Report()
    before = books(gpu)
    engine = Engine(gpu, rng, report)
    try:

        def guards(step: int) -> None:
            if step % 100 == 99 or step == steps - 1:
                assert engine.guards_intact(), f"a write outside the output, by step {step}"

        serving.drive(gpu, Loop(engine, rng), report, steps, rng, FAULT, FAULTS, guards)
        assert engine.dec.check_errors() == DecodeError.NONE
    finally:
        engine.close()
    assert books(gpu) == before, f"leaked: {books(gpu)} held after, {before} before"
    assert report.faults == report.flagged, (report.faults, report.flagged)
    return report


if __name__ == "__main__":
    serving.main("serve_loop.py", __doc__, run, " (examples/cpu_reference.py runs without one)")
