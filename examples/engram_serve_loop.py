"""A continuous-batching engine loop around ``EngramDecoder``, every row of every step checked.

What an engine serving DeepSeek-V4.1's Engram does, all at once, on a seeded random schedule
(a tiny random model: two Engram layers, one table in device memory, one in host memory):
  - requests arrive with prompts holding image (non-text) tokens; some share a cached system
    prompt, seeded into the history (``dec.seed``: a prefix-cache hit, no lookup) instead of
    prefilled; now and then a call passes an explicit ``text=`` mask instead of the image id;
  - new requests are prefilled in one ragged ``dec.prefill`` (a padded sequence now and then)
    and each Engram layer's gate applied to its residual; some fork into 2-4 samples
    (``dec.fork``, a padded pair among them);
  - each live request decodes k = 1-4 tokens a step (k > 1: drafts, rejected at random and
    dropped with ``dec.rollback``); requests are grouped by k, each group padded up to the next
    batch size of a ladder (1, 2, 4, ..., 64) with ``PAD_SLOT`` entries and run as one replay of
    the graph captured at that size, all sizes sharing one set of buffers;
  - each graph is the engine's overlap: forked from the main stream, a side stream runs
    ``dec.step`` (both layers' hash, gather and projection) while the main stream runs stand-in
    work (the layers before the first Engram layer); the main stream then waits for the side
    stream's event and gates each Engram layer's residual (``dec.apply``);
  - requests finish at random and their slots are reused; a few steps carry an injected bad
    token or slot.
Checks: every row of every prefill and step, its ``kv`` rows and both layers' residual bit for
bit against a second decoder that prefills the request's whole context alone (both batch
invariant), and on a sample within the contract of the numpy reference (each value within one
bf16 ulp of the float64 result, give or take the fp32 sums' error; over the run, at most 0.1%
beyond half an ulp); non-text rows' residual unchanged; every other row of the residual
buffers (padding, a faulty entry's rows, past the call) left as it was, bit for bit; the error
flags raised in exactly the steps that had a fault; after the last step, no flag pending and
nothing leaked (the backend's allocations, graphs, streams, events and host buffers, and no
device memory drawn in the second half of the loop).

Run it on a CUDA GPU with the package installed (``pip install .``):
``python examples/engram_serve_loop.py [--steps 2000] [--seed 0]``
(tests/test_engram_serve_loop.py runs ``run`` for 2000 steps).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from _requires import installed  # examples/_requires.py: a missing package is one line

with installed("engram_serve_loop.py"):
    import _serving as serving  # examples/_serving.py: what the two serving loops share
    import ml_dtypes
    import numpy as np

    from gpu_runtime import CudaBackend, DeviceArray
    from layers.engram import PAD_SLOT, DecodeError, EngramConfig, EngramDecoder, EngramWeights, TokenMap
    from layers.engram.hashing import compress, row_ids
    from layers.reference.engram import act_quant, emb_from_rows, gate_ref, wkv_fp64

BF16, FP8 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
CONFIG = EngramConfig.from_dict(  # the real layout at toy size (tests/helpers/engram.py's tiny())
    {
        "engram_layer_ids": [1, 3],
        "engram_num_embeddings": [660, 864],  # the sums of the 6 primes from 101 of each layer
        "engram_max_ngram_size": 4,
        "engram_n_heads": 2,
        "engram_head_dim": 64,
        "engram_vocab_size": 100,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 40,
        "hidden_size": 32,
        "hc_mult": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": 50,
        "image_token_id": 49,
    }
)
IMAGE, VOCAB, LAYERS = 49, CONFIG.vocab_size, CONFIG.layer_ids
HC, D, KV = CONFIG.hc_mult, CONFIG.hidden_size, CONFIG.kv_dim
W = HC * D  # a residual row: hc_mult copies of the hidden state
PLACEMENT = ["device", "host"]  # layer 3's table read in place over PCIe
MAX_SEQS, MAX_DRAFT = 64, 4
MAX_ROWS = MAX_SEQS * MAX_DRAFT  # a step's rows at most (a prefill's are fewer)
LADDER = (1, 2, 4, 8, 16, 32, 64)
DRAFTS = (1, 1, 1, 2, 3, 4)  # k per request, drawn from these
PREFIX_LENS = (2, 12, 20, 45)  # the cached system prompts
MAX_SUFFIX, MAX_LIFE = 32, 64  # prompt tokens after the prefix; steps a request lives at most
REF_ROWS = MAX_SEQS * (max(PREFIX_LENS) + MAX_SUFFIX + MAX_LIFE * MAX_DRAFT)  # every context at once
TARGET_LIVE, FINISH, PREFIX_HIT, FORK, FAULT = 60, 0.02, 0.3, 0.2, 0.015
IMAGE_RATE, DRAFT_IMAGE_RATE, MASKED = 0.1, 0.03, 0.3  # image tokens; calls with an explicit text mask
SLACK, HALF_ULP_RATE = 2.0**-14, 0.001  # the fp32 sums' error (of the sum of |terms|); p99.9 <= 0.5 ulp
NO_TOKEN = 0xFFFFFFFF  # what a history holds for a non-text position
FAULTS = ("token", "slot")
STANDIN_BYTES = 1 << 20  # the stand-in work's buffer


@dataclass
class Request:
    slot: int
    k: int  # tokens a step
    left: int  # steps until it finishes
    ctx: list[int] = field(repr=False)  # every token the decoder's history has seen, in order
    text: list[bool] = field(repr=False)  # and whether each was a text position


@dataclass
class Rows:
    """A request's last ``n`` rows of a call: its context then, each Engram layer's residual
    rows before (``x``) and after (``got``) the gate, and its ``kv`` rows (``[n, ...]`` each)."""

    what: str
    ctx: list[int]
    text: list[bool]
    x: list[np.ndarray]
    got: list[np.ndarray]
    kv: list[np.ndarray]


@dataclass
class Report:
    steps: int = 0
    requests: int = 0
    prefix_hits: int = 0
    forks: int = 0
    rows_checked: int = 0  # rows compared bit for bit (kv, both residuals) with a one-shot prefill
    rows_image: int = 0  # ... of them non-text, their residual checked unchanged
    rows_reference: int = 0  # rows compared with the numpy reference
    values_reference: int = 0  # ... their values (kv and residual, text rows)
    over_half_ulp: int = 0  # ... of them more than half a bf16 ulp off the float64 result
    rows_padded: int = 0  # padded rows checked unchanged
    rollbacks: int = 0
    max_live: int = 0
    replays: Counter = field(default_factory=Counter)  # batch size -> graph replays
    faults: Counter = field(default_factory=Counter)  # kind -> injected
    flagged: Counter = field(default_factory=Counter)  # kind -> steps whose flags showed it
    graph_bytes: int = 0  # device bytes the captures drew, all graphs
    drawn: int = 0  # device bytes drawn in the second half

    def lines(self) -> list[str]:
        sizes = ", ".join(f"{b}: {n}" for b, n in sorted(self.replays.items()))
        graphs = len(LADDER) * len(set(DRAFTS))
        share = self.over_half_ulp / max(self.values_reference, 1)
        return [
            f"steps {self.steps}, requests {self.requests} (prefix hits {self.prefix_hits}, "
            f"forked samples {self.forks}), most live at once {self.max_live}",
            f"rows checked bit for bit (kv and both layers' residual) against a one-shot prefill of the "
            f"request's context: {self.rows_checked} ({self.rows_image} non-text, unchanged); padded rows "
            f"checked unchanged: {self.rows_padded}; rollbacks {self.rollbacks}",
            f"rows checked against the numpy reference: {self.rows_reference} ({self.values_reference} values, "
            f"{100 * share:.3f}% over half a bf16 ulp)",
            f"graph replays by batch size: {sizes}",
            f"faults injected {dict(self.faults)}, flagged {dict(self.flagged)}",
            f"{graphs} graphs ({len(LADDER)} batch sizes x {len(set(DRAFTS))} draft lengths, each a fork and a "
            f"join of two streams) over one set of buffers: {self.graph_bytes / 2**20:.1f} MiB of device memory "
            f"drawn by their captures (cuMemGetInfo), {self.graph_bytes / graphs / 1024:.0f} KiB a graph",
            f"device memory drawn in the second half of the loop: {self.drawn} bytes; nothing held after close",
        ]


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a.view(np.uint16), b.view(np.uint16))


def _abs_fp8(a: np.ndarray) -> np.ndarray:
    return (np.asarray(a).view(np.uint8) & 0x7F).view(FP8)


def random_model(rng: np.random.Generator):
    """A token map (several ids sharing a compressed id) and every layer's table, wkv, q and k."""
    cfg = CONFIG

    def fp8(shape):  # every finite e4m3 value
        raw = rng.integers(0, 256, shape, dtype=np.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0x3C
        return raw.view(FP8)

    def scales(shape):  # e8m0 2^-7 .. 2^7
        return rng.integers(120, 135, shape, dtype=np.uint8)

    def bf16(shape):
        return rng.standard_normal(shape).astype(np.float32).astype(BF16)

    c = cfg.compressed_vocab_size
    token_map = TokenMap(np.concatenate([np.arange(c), rng.integers(0, c, VOCAB - c)]).astype(np.int32))
    tables = [(fp8((rows, cfg.head_dim)), scales((rows, cfg.scale_cols))) for rows in cfg.num_embeddings]
    wkv = [(fp8((KV, cfg.emb_dim)), scales((-(-KV // 32), cfg.emb_dim // 32))) for _ in LAYERS]
    return token_map, tables, wkv, [bf16((HC, D)) for _ in LAYERS], [bf16((HC, D)) for _ in LAYERS]


class Engine:
    """The decoder, the reference decoder, the buffers the graphs read, the graphs, the checks."""

    def __init__(self, gpu: CudaBackend, rng: np.random.Generator, report: Report) -> None:
        self.gpu, self.rng, self.report = gpu, rng, report
        self.map, self.tables, self.wkv, self.q, self.k = random_model(rng)
        self.pad = self.map.pad(CONFIG.pad_token_id)
        s = self.s = gpu.create_stream()  # the main stream
        self.s2 = gpu.create_stream()  # the side stream
        self.forked, self.joined = gpu.create_event(), gpu.create_event()
        self.weights = EngramWeights.from_arrays(
            gpu, CONFIG, self.map, self.tables, self.wkv, self.q, self.k, placement=PLACEMENT, stream=s
        )
        # batch invariant: a row's bits do not depend on what else is in its call, so every row
        # can be checked bit for bit against the reference decoder's prefill of its context alone
        self.dec = EngramDecoder(
            self.weights, max_seqs=MAX_SEQS, max_rows=MAX_ROWS, max_draft=MAX_DRAFT, stream=s, batch_invariant=True
        )
        self.ref = EngramDecoder(self.weights, max_seqs=MAX_SEQS, max_rows=REF_ROWS, stream=s, batch_invariant=True)
        new = lambda shape, dtype=np.uint32: DeviceArray.empty(gpu, shape, dtype, s)  # noqa: E731
        # one set of buffers for every graph (sized for the largest), the eager calls' own, the reference's
        self.tokens, self.slots, self.counts = new((MAX_ROWS,)), new((MAX_SEQS,)), new((MAX_SEQS,))
        self.res = [new((MAX_ROWS, W), BF16) for _ in LAYERS]  # each Engram layer's residual
        self.standin = new((STANDIN_BYTES,), np.uint8)
        self.p_tokens, self.p_cu, self.p_slots = new((MAX_ROWS,)), new((MAX_SEQS + 2,)), new((MAX_SEQS + 1,))
        self.p_text, self.f_src, self.f_dst = new((MAX_ROWS,), np.uint8), new((MAX_SEQS,)), new((MAX_SEQS,))
        self.r_tokens, self.r_cu, self.r_slots = new((REF_ROWS,)), new((MAX_SEQS + 1,)), new((MAX_SEQS,))
        self.r_text = new((REF_ROWS,), np.uint8)
        self.r_res = [new((REF_ROWS, W), BF16) for _ in LAYERS]
        self.tokens.upload(np.zeros(MAX_ROWS, np.uint32))  # padded entries' tokens are read, never used
        self.graphs: dict[tuple[int, int], int] = {}
        self.capture_all()

    # -- graphs -------------------------------------------------------------------------------
    def overlap(self, size: int, k: int) -> None:
        """One decode step of ``size`` entries as an engine runs it (the module docstring)."""
        gpu, s, s2, dec = self.gpu, self.s, self.s2, self.dec
        gpu.record_event(self.forked, s)
        gpu.wait_event(s2, self.forked)  # the fork: s2 joins the capture
        dec.step(self.tokens, self.slots, size, s2, k=k)
        gpu.record_event(self.joined, s2)
        gpu.memset(self.standin.ptr, size % 256, STANDIN_BYTES, s)  # the layers before layer 1
        gpu.wait_event(s, self.joined)  # the join
        for i, layer in enumerate(LAYERS):
            dec.apply(layer, self.res[i].ptr, size * k, s)

    def capture_all(self) -> None:
        """A graph per ladder size and draft length, all over the same buffers. Each shape runs
        once eagerly first (loads kernels, plans the projections), on padding only."""
        gpu, s = self.gpu, self.s
        self.slots.upload(np.full(MAX_SEQS, PAD_SLOT, np.uint32))
        for k in sorted(set(DRAFTS)):
            for size in LADDER:
                self.overlap(size, k)
        gpu.synchronize(s)
        free = gpu.mem_info()[0]
        for k in sorted(set(DRAFTS)):
            for size in LADDER:
                gpu.begin_capture(s)
                try:
                    self.overlap(size, k)
                except BaseException:
                    gpu.abort_capture(s)
                    raise
                self.graphs[size, k] = gpu.end_capture(s)
        self.report.graph_bytes = free - gpu.mem_info()[0]
        assert self.dec.check_errors(s) == DecodeError.NONE

    # -- buffers --------------------------------------------------------------------------------
    def upload(self, array: DeviceArray, values) -> None:
        values = np.asarray(values, array.dtype)
        if values.size:
            self.gpu.copy_h2d_async(values, array.ptr, self.s)

    def read(self, ptr: int, rows: int, cols: int) -> np.ndarray:
        out = np.empty((rows, cols), BF16)
        if rows:
            self.gpu.copy_d2h(out, ptr, self.s)
        return out

    def inputs(self, real: np.ndarray) -> list[np.ndarray]:
        """Each layer's residual before a call, uploaded: random values in the rows ``real``
        marks, random bits in every other row of the buffer (they must come back as they went)."""
        xs = []
        for res in self.res:
            x = self.rng.integers(0, 2**16, (MAX_ROWS, W), dtype=np.uint16).view(BF16)
            x[: real.size][real] = self.rng.standard_normal((int(real.sum()), W)).astype(np.float32).astype(BF16)
            self.gpu.copy_h2d_async(x, res.ptr, self.s)
            xs.append(x)
        return xs

    def outputs(self, rows: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each layer's whole residual buffer and its first ``rows`` kv rows."""
        got = [self.read(res.ptr, MAX_ROWS, W) for res in self.res]
        return got, [self.read(self.dec.kv_of(i), rows, KV) for i in range(len(LAYERS))]

    def untouched(self, xs: list[np.ndarray], got: list[np.ndarray], checked: np.ndarray, what: str) -> None:
        """Every residual row but the ``checked`` ones is as it was uploaded."""
        keep = np.ones(MAX_ROWS, bool)
        keep[: checked.size] = ~checked
        for layer, x, g in zip(LAYERS, xs, got):
            assert _same(g[keep], x[keep]), (
                f"{what}: layer {layer} wrote rows it must leave alone: {serving.diff(g, x)}"
            )

    # -- what every row is checked against --------------------------------------------------------
    def check(self, batch: list[Rows]) -> None:
        """Each entry's rows against the reference decoder's prefill of its whole context (one
        ragged call, each sequence in a slot of its own: batch invariant, so each as if alone),
        its gates on the same input rows; one entry against the numpy reference too."""
        if not batch:
            return
        s, ref = self.s, self.ref
        n = [len(r.x[0]) for r in batch]
        cu = np.concatenate([[0], np.cumsum([len(r.ctx) for r in batch])]).astype(np.uint32)
        total = int(cu[-1])
        text = np.concatenate([np.asarray(r.text, np.uint8) for r in batch])
        self.upload(self.r_tokens, np.concatenate([np.asarray(r.ctx, np.uint32) for r in batch]))
        self.upload(self.r_cu, cu)
        self.upload(self.r_slots, np.arange(len(batch)))
        self.upload(self.r_text, text)
        ref.reset_all(s)
        ref.prefill(self.r_tokens, self.r_cu, self.r_slots, len(batch), total, s, text=self.r_text)
        last = np.concatenate([np.arange(end - m, end) for end, m in zip(cu[1:].tolist(), n)])
        owner = np.repeat(np.arange(len(batch)), n)
        dead = text[last] == 0
        for i, layer in enumerate(LAYERS):
            x = np.zeros((total, W), BF16)
            x[last] = np.concatenate([r.x[i] for r in batch])
            self.gpu.copy_h2d_async(x, self.r_res[i].ptr, s)
            ref.apply(layer, self.r_res[i].ptr, total, s)
            for name, got, want in (
                ("kv", np.concatenate([r.kv[i] for r in batch]), self.read(ref.kv_of(i), total, KV)[last]),
                ("residual", np.concatenate([r.got[i] for r in batch]), self.read(self.r_res[i].ptr, total, W)[last]),
            ):
                bad = (got.view(np.uint16) != want.view(np.uint16)).any(axis=1)
                if bad.any():
                    j = int(owner[np.argmax(bad)])
                    rows = owner == j
                    raise AssertionError(
                        f"layer {layer} {name} of {batch[j].what} != a one-shot prefill of its context alone: "
                        f"{serving.diff(got[rows], want[rows])}"
                    )
                if name == "residual":
                    assert _same(got[dead], x[last][dead]), f"layer {layer}: a non-text row's residual changed"
        assert ref.check_errors(s) == DecodeError.NONE, "the reference decoder raised a flag"
        self.report.rows_checked += last.size
        self.report.rows_image += int(dead.sum())
        self.reference(batch[int(self.rng.integers(len(batch)))])

    def reference(self, r: Rows) -> None:
        """``r``'s text rows within the contract of the numpy reference: kv against the float64
        product of the quantised operands, the residual against the float64 gate on that kv."""
        n = len(r.x[0])
        ids = row_ids(CONFIG, compress(self.map.ids, r.ctx, np.asarray(r.text, bool)), self.pad)[-n:]
        t = np.asarray(r.text[-n:], bool)
        for i, layer in enumerate(LAYERS):
            table, scale = self.tables[i]
            q, q_scale = act_quant(emb_from_rows(table, scale, ids[:, i, :]))
            weight, weight_scale = self.wkv[i]
            exact = wkv_fp64(q, q_scale, weight, weight_scale)
            size = wkv_fp64(_abs_fp8(q), q_scale, _abs_fp8(weight), weight_scale)  # the sum of |terms|
            self.contract(f"layer {layer} kv of {r.what}", r.kv[i][t], exact[t], size[t])
            x = r.x[i].reshape(n, HC, D)
            _, exact, gate = gate_ref(x, r.kv[i], self.q[i], self.k[i], t, CONFIG.eps, HC)
            value = r.kv[i][:, HC * D :].astype(np.float64)
            size = np.abs(x.astype(np.float64)) + np.abs(gate[:, :, None] * value[:, None, :])
            self.contract(f"layer {layer} residual of {r.what}", r.got[i].reshape(n, HC, D)[t], exact[t], size[t])
        self.report.rows_reference += n

    def contract(self, what: str, got: np.ndarray, exact: np.ndarray, size: np.ndarray) -> None:
        """Each value within one bf16 ulp of ``exact`` plus the fp32 sums' error (``SLACK`` of
        ``size``, the sum of the terms' magnitudes); counts those beyond half an ulp."""
        err = np.abs(got.astype(np.float64) - exact)
        ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(exact), 2.0**-126))) - 7)
        bad = err > ulp + SLACK * size
        assert not bad.any(), f"{what}: {int(bad.sum())} values off the numpy reference, max {float(err.max()):.3g}"
        self.report.values_reference += err.size
        self.report.over_half_ulp += int((err > 0.5 * ulp).sum())

    def close(self) -> None:
        gpu = self.gpu
        gpu.synchronize(self.s)
        gpu.synchronize(self.s2)
        for exe in self.graphs.values():
            gpu.destroy_graph(exe)
        buffers = [self.tokens, self.slots, self.counts, self.standin, self.p_tokens, self.p_cu, self.p_slots]
        buffers += [self.p_text, self.f_src, self.f_dst, self.r_tokens, self.r_cu, self.r_slots, self.r_text]
        for a in buffers + self.res + self.r_res:
            a.free()
        self.ref.close()  # the runners, then what they read
        self.dec.close()
        self.weights.close()
        for event in (self.forked, self.joined):
            gpu.destroy_event(event)
        gpu.destroy_stream(self.s2)
        gpu.destroy_stream(self.s)


class Loop:
    """The schedule: arrivals, prefix hits, prefill, forks, padded steps, drafts, faults."""

    def __init__(self, engine: Engine, rng: np.random.Generator) -> None:
        self.e, self.rng, self.report = engine, rng, engine.report
        self.free = list(range(MAX_SEQS))[::-1]
        self.live: list[Request] = []
        self.prefixes = [self.tokens(n, IMAGE_RATE) for n in PREFIX_LENS]

    def tokens(self, n: int, image_rate: float) -> list[int]:
        t = self.rng.integers(0, IMAGE, n)  # text ids below the image id
        t[self.rng.random(n) < image_rate] = IMAGE
        return [int(x) for x in t]

    def mask(self, tokens: list[int], explicit: bool) -> list[bool]:
        """Each token's text flag: not the image id, or (a call's explicit mask) that with one
        flag in eight flipped: an image id then counts as text, a text id as not."""
        text = np.asarray(tokens) != IMAGE
        if explicit:
            text ^= self.rng.random(len(tokens)) < 0.125
        return [bool(x) for x in text]

    def new_request(self, ctx: list[int], text: list[bool]) -> Request:
        self.report.requests += 1
        k, left = int(self.rng.choice(DRAFTS)), int(self.rng.integers(4, MAX_LIFE))
        return Request(self.free.pop(), k, left, ctx, text)

    def ragged(self, seqs: list[tuple[int, list[int], list[bool]]], explicit: bool) -> tuple[np.ndarray, np.ndarray]:
        """Upload a ragged call's tokens, cu_seqlens, slots and (``explicit``) text mask."""
        e = self.e
        flat = np.array([t for _, ts, _ in seqs for t in ts], np.uint32)
        cu = np.concatenate([[0], np.cumsum([len(ts) for _, ts, _ in seqs])]).astype(np.uint32)
        e.upload(e.p_tokens, flat)
        e.upload(e.p_cu, cu)
        e.upload(e.p_slots, [slot for slot, _, _ in seqs])
        if explicit:
            e.upload(e.p_text, [x for _, _, m in seqs for x in m])
        return flat, cu

    def padding(self) -> tuple[int, list[int], list[bool]]:
        """A padded sequence: garbage tokens (past the vocabulary too) and text flags."""
        n = int(self.rng.integers(0, 4))
        return PAD_SLOT, [int(x) for x in self.rng.integers(0, 2**32, n)], [bool(x) for x in self.rng.random(n) < 0.5]

    # -- arrivals: reset, seed, prefill, fork ----------------------------------------------------
    def admit(self) -> None:
        e, rng = self.e, self.rng
        count = int(rng.integers(0, 4)) if len(self.live) < TARGET_LIVE else 0
        new, suffixes, hits = [], [], []
        for _ in range(min(count, len(self.free))):
            req = self.new_request([], [])
            e.dec.reset(req.slot, e.s)
            if rng.random() < PREFIX_HIT:
                req.ctx = list(self.prefixes[int(rng.integers(len(self.prefixes)))])
                hits.append(req)
            new.append(req)
            suffixes.append(self.tokens(int(rng.integers(1, MAX_SUFFIX + 1)), IMAGE_RATE))
        if hits:
            self.seed(hits)
        if new:
            self.prefill(new, suffixes)
            for req in list(new):
                if rng.random() < FORK and self.free:
                    self.fork(req, new)
        self.live += new

    def seed(self, hits: list[Request]) -> None:
        """One seed call for every prefix hit, a padded entry among them now and then."""
        e, explicit = self.e, self.rng.random() < MASKED
        for req in hits:
            req.text = self.mask(req.ctx, explicit)
        seqs = [(r.slot, r.ctx, r.text) for r in hits]
        if self.rng.random() < 0.5:
            seqs.insert(int(self.rng.integers(len(seqs) + 1)), self.padding())
        flat, _ = self.ragged(seqs, explicit)
        e.dec.seed(e.p_tokens, e.p_cu, e.p_slots, len(seqs), flat.size, e.s, text=e.p_text if explicit else None)
        self.report.prefix_hits += len(hits)

    def prefill(self, new: list[Request], suffixes: list[list[int]]) -> None:
        """One ragged prefill of every new request's suffix (a padded sequence now and then),
        then each layer's gate on its residual, every row checked."""
        e, rng, explicit = self.e, self.rng, self.rng.random() < MASKED
        seqs = [(r.slot, t, self.mask(t, explicit)) for r, t in zip(new, suffixes)]
        owners: list[Request | None] = list(new)
        pad_at = int(rng.integers(len(seqs) + 1)) if rng.random() < 0.3 else None
        if pad_at is not None:
            seqs.insert(pad_at, self.padding())
            owners.insert(pad_at, None)
        flat, cu = self.ragged(seqs, explicit)
        real = np.ones(flat.size, bool)
        if pad_at is not None:
            real[cu[pad_at] : cu[pad_at + 1]] = False
            self.report.rows_padded += int((~real).sum())
        xs = e.inputs(real)
        text = e.p_text if explicit else None
        e.dec.prefill(e.p_tokens, e.p_cu, e.p_slots, len(seqs), flat.size, e.s, text=text)
        for i, layer in enumerate(LAYERS):
            e.dec.apply(layer, e.res[i].ptr, flat.size, e.s)
        got, kv = e.outputs(flat.size)
        e.untouched(xs, got, real, "prefill")
        batch = []
        for j, (req, (_, t, m)) in enumerate(zip(owners, seqs)):
            if req is None:
                continue
            req.ctx += t
            req.text += m
            a, b = int(cu[j]), int(cu[j + 1])
            rows = [[v[a:b] for v in arrays] for arrays in (xs, got, kv)]
            batch.append(Rows(f"slot {req.slot} (prefill of {b - a})", list(req.ctx), list(req.text), *rows))
        e.check(batch)
        self.expect_flags(DecodeError.NONE)

    def fork(self, req: Request, new: list[Request]) -> None:
        """``req`` forks into 2-4 samples: its slot copied to fresh slots (a padded pair too)."""
        e, rng = self.e, self.rng
        count = min(int(rng.integers(1, 4)), len(self.free))
        samples = [self.new_request(list(req.ctx), list(req.text)) for _ in range(count)]
        for sample in samples:
            sample.k = req.k
        pairs = [(req.slot, x.slot) for x in samples]
        if rng.random() < 0.3:
            pairs.append((PAD_SLOT, int(rng.integers(0, MAX_SEQS))))  # padding: the slot is left alone
        e.upload(e.f_src, [a for a, _ in pairs])
        e.upload(e.f_dst, [b for _, b in pairs])
        e.dec.fork(e.f_src, e.f_dst, len(pairs), e.s)
        new += samples
        self.report.forks += len(samples)

    # -- a decode step ----------------------------------------------------------------------------
    def step(self, fault: str | None) -> None:
        """Every live request's k tokens: one padded graph replay per draft length, then every
        row checked in one reference call."""
        groups: dict[int, list[Request]] = {}
        for req in self.live:
            groups.setdefault(req.k, []).append(req)
        faulted = int(self.rng.choice(sorted(groups))) if fault and groups else None
        expected, batch = DecodeError.NONE, []
        for k in sorted(groups):
            expected |= self.replay(groups[k], k, fault if k == faulted else None, batch)
        self.expect_flags(expected)
        self.e.check(batch)
        self.report.max_live = max(self.report.max_live, len(self.live))

    def replay(self, reqs: list[Request], k: int, fault: str | None, batch: list[Rows]) -> DecodeError:
        e, rng = self.e, self.rng
        b = len(reqs)
        size = next(x for x in LADDER if x >= b)
        toks = np.array([self.tokens(k, DRAFT_IMAGE_RATE) for _ in reqs], np.int64).reshape(b, k)
        tokens = np.concatenate([toks.reshape(-1), rng.integers(0, 2 * VOCAB, (size - b) * k)]).astype(np.uint32)
        slots = np.array([r.slot for r in reqs] + [PAD_SLOT] * (size - b), np.uint32)
        victim = int(rng.integers(b)) if fault else -1
        flag = DecodeError.NONE
        if fault == "token":  # its last draft token: the rows before it are still checked
            tokens[victim * k + k - 1] = VOCAB + int(rng.integers(0, 1000))
            flag = DecodeError.TOKEN
        elif fault == "slot":
            slots[victim] = MAX_SEQS + int(rng.integers(0, 1000))
            flag = DecodeError.SLOT
        if fault:
            self.report.faults[fault] += 1
        # The faulty entry: a bad slot is not followed (no rows, no history); a bad token's row is
        # left alone, the ones before it stand (and the engine aborts the request: its history
        # ends in "no token").
        kept = [0 if i == victim and fault == "slot" else k - 1 if i == victim else k for i in range(b)]
        checked = np.zeros(size * k, bool)
        for i, n in enumerate(kept):
            checked[i * k : i * k + n] = True
        real = np.zeros(size * k, bool)
        real[: b * k] = True
        xs = e.inputs(real)
        e.upload(e.tokens, tokens)
        e.upload(e.slots, slots)
        e.gpu.launch_graph(e.graphs[size, k], e.s)
        got, kv = e.outputs(size * k)
        self.report.replays[size] += 1
        self.report.rows_padded += (size - b) * k
        e.untouched(xs, got, checked, f"step of {b} padded to {size}, k {k}")
        for i, (req, n) in enumerate(zip(reqs, kept)):
            if n:
                req.ctx += [int(t) for t in toks[i, :n]]
                req.text += [int(t) != IMAGE for t in toks[i, :n]]
                rows = [[v[i * k : i * k + n] for v in arrays] for arrays in (xs, got, kv)]
                what = f"slot {req.slot} (step of {n} of k {k}, batch {b} padded to {size})"
                batch.append(Rows(what, list(req.ctx), list(req.text), *rows))
        if fault == "slot":
            req = reqs[victim]
            back = CONFIG.max_ngram - 1
            want = [int(e.map.ids[t]) if x else NO_TOKEN for t, x in zip(req.ctx[-back:], req.text[-back:])]
            assert e.dec.history(req.slot, e.s).tolist() == want, "a bad slot's history is untouched"
        if fault == "token":
            reqs[victim].left = 0
        if k > 1:
            self.rollback(reqs, k, slots, victim)
        return flag

    def rollback(self, reqs: list[Request], k: int, slots: np.ndarray, skip: int) -> None:
        """Drafts rejected at random (0..k-1 of each request's k); padded and skipped entries
        carry garbage counts that must be ignored."""
        e = self.e
        counts, slots = serving.rollback_args(self.rng, slots, len(reqs), k, skip, PAD_SLOT)
        e.upload(e.counts, counts)
        e.upload(e.slots, slots)
        e.dec.rollback(e.slots, e.counts, slots.size, e.s)
        for i, req in enumerate(reqs):
            if i != skip and counts[i]:
                del req.ctx[len(req.ctx) - int(counts[i]) :]
                del req.text[len(req.text) - int(counts[i]) :]
        self.report.rollbacks += 1

    def expect_flags(self, want: DecodeError) -> None:
        bits = {"token": DecodeError.TOKEN, "slot": DecodeError.SLOT}
        serving.count_flags(self.e.dec.check_errors(self.e.s), want, bits, self.report.flagged)

    def retire(self) -> None:
        self.live = serving.retire(self.live, self.free, self.rng, FINISH)


def run(gpu: CudaBackend, steps: int = 2000, seed: int = 0) -> Report:
    """The loop for ``steps`` steps on the schedule of ``seed``; raises AssertionError at the
    first row, flag or leak that is wrong."""
    rng = np.random.default_rng(seed)
    report = Report()
    before = gpu.held()
    engine = Engine(gpu, rng, report)
    try:
        serving.drive(gpu, Loop(engine, rng), report, steps, rng, FAULT, FAULTS)
        assert engine.dec.check_errors(engine.s) == DecodeError.NONE
    finally:
        engine.close()
    assert gpu.held() == before, f"leaked: {gpu.held()} held after, {before} before"
    assert report.faults == report.flagged, (report.faults, report.flagged)
    assert report.over_half_ulp <= HALF_ULP_RATE * report.values_reference, (
        f"{report.over_half_ulp} of {report.values_reference} values over half a bf16 ulp (p99.9 <= 0.5 ulp)"
    )
    return report


if __name__ == "__main__":
    serving.main("engram_serve_loop.py", __doc__, run)
