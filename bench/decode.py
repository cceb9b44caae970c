"""Decode steps of the n-gram embedding through ``NgramDecoder``, inside the caller's CUDA graph.

Configuration: bench/ngram_embed's fused table (D = 4096, N = 3, K = 8: T = 16 tables of
2^20 + 2c rows x 256 bf16, vocab 128k), its dims imported from there. B sequences in slots
0..B-1, each reset and prefilled with a random prompt of PROMPT tokens, then one new token per
sequence and step.

Rows (every time in microseconds):
  ours          ``dec.step`` captured on its own in R graphs, graph r reading slice r of a
                pre-uploaded random token pool [R, B]; the graphs are replayed in a fixed random
                order, so the n-gram ids change every step and few rows are L2-hot.
  bare graph    a graph of one tiny kernel (residual_add's bf16_scaled_add on 1 element): the
                floor of any graph replay from Python. Target: ours host <= 1.3x this host.
  torch         its best form of the same step: token history per slot on the device
                ([B, N-1] int64), ids hashed with torch integer ops as layers/ngram_embed/ids.py
                does (V**d mod M_c precomputed, EOS and context-start cut), the history shifted
                in place, one gather from the T tables stacked into one tensor (offsets added to
                the ids), one addmm against the concatenated
                projections [D, T*td] plus the word row, both times 1/(1+T), bf16; captured in R
                torch.cuda.CUDAGraphs over the same token pool and replayed in the same order.
Columns:
  GPU us        median per replay, replays back to back behind a gate (bench.common.gated_gpu_us)
  wall us/step  a loop of 256 replays then one stream sync, divided by 256 (median of 5 loops)
  host us/step  median host time of one replay call (``gpu.launch_graph`` / ``g.replay()``),
                timed call by call; the stream is synchronised after every call, outside the
                timed call: the host cost of a launch onto an idle GPU
  floor us      bytes that must move over the copy bandwidth measured in this run: the
                concatenated projections [D, T*td] bf16 read once, the B*T gathered rows, B word
                rows read, B output rows written. Back to back, the 32 MiB of projections can stay
                in the 60 MB L2, so GPU/floor below 1 means L2 hits, not a wrong floor.
Checks (printed before the table): our first step against the numpy fused reference
(layers.reference.ngram_embed_fused, rows fetched from the device) and torch's first step
against ours, as max abs diff and that over the largest |value| (a bf16 ulp is 2^-8 relative);
every decoder's ``check_errors`` after its rows.
Without torch (with CUDA) the torch rows are skipped with a message.
Then the serving calls (padded batches, adapters, seed, fork) against the plain step:
bench/decode_serving.py.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from bench.common import (
    bench_parser,
    copy_bandwidth,
    gated_gpu_us,
    interleaved_times_us,
    print_table,
    run,
    some_of,
    torch_or_none,
)
from bench.decode_serving import serving_rows
from bench.ngram_embed import DIMS, bare_launch_us, bf16_tables, device_weight, torch_view
from gpu_runtime import CudaBackend, DeviceArray, DevicePtr
from layers import reference
from layers.dense_weight import BF16
from layers.kernel_files import load_kernel
from layers.ngram_embed import HostWeight, NgramDecoder, NgramDims, NgramTable, NgramWeights
from layers.ngram_embed.tables import Bf16Table, HostTable
from layers.ops.embed import batched_embed
from layers.ops.residual import scaled_add

if TYPE_CHECKING:
    from layers.backend_caps import MappedBackend

BATCHES = (1, 64)
PROMPT = 32  # prefill tokens per sequence
R = 64  # graphs per path, each over its own slice of the token pool
MAX_SEQS = 256
MAX_ROWS = 8192
ORDER = 1 << 12  # length of the random replay order over the R graphs (a power of two)
HOST_CHUNK = 1  # replays timed one by one, the stream synchronised (untimed) after each:
HOST_CHUNKS = 600  # the host cost of a launch onto an idle GPU, not of a queue backing up
WALL_STEPS = 256


@dataclass
class Row:
    path: str
    batch: int | None
    gpu_us: float
    late: int  # gated measurements whose gate expired (host time leaked in)
    wall_us: float
    host_us: float
    floor_us: float | None = None
    torch: bool = False


@dataclass
class Ctx:
    """What every row needs: the device, the stream, the dims, this run's copy bandwidth, the
    inputs per batch (the same for ours and torch), our first-step outputs for torch's check."""

    gpu: CudaBackend
    stream: int
    dims: NgramDims
    bw: float
    rng: np.random.Generator
    out: DevicePtr  # [MAX(B) * PROMPT, D] bf16, every row's output
    order: np.ndarray  # random replay order over the R graphs
    torch: Any = None
    _inputs: dict = field(default_factory=dict)
    first: dict = field(default_factory=dict)  # batch -> our first step's output [B, D]

    def inputs(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompts [B, PROMPT], token pool [R, B]) u32, made once per batch size."""
        if b not in self._inputs:
            v = self.dims.vocab_size
            self._inputs[b] = (
                self.rng.integers(0, v, (b, PROMPT), dtype=np.uint32),
                self.rng.integers(0, v, (R, b), dtype=np.uint32),
            )
        return self._inputs[b]


# -- measurement --------------------------------------------------------------------------------
def measure(
    ctx: Ctx,
    path: str,
    b: int | None,
    launch: Callable[[int], Any],
    stream: int,
    sync: Callable[[], Any],
    floor: float | None,
    *,
    is_torch: bool = False,
) -> Row:
    """GPU, wall and host time per replay of ``launch(i)`` (i counts calls: rotates graphs)."""
    sync()
    gpu_us, late = gated_gpu_us(launch, stream=stream, batch=16, warmup=2, iters=10)
    sync()
    host = []
    for c in range(HOST_CHUNKS + 2):  # the first two chunks warm up
        for j in range(HOST_CHUNK):
            t0 = time.perf_counter()
            launch(c * HOST_CHUNK + j)
            t1 = time.perf_counter()
            if c >= 2:
                host.append(t1 - t0)
        sync()
    walls = []
    for rep in range(6):  # the first loop warms up
        t0 = time.perf_counter()
        for i in range(WALL_STEPS):
            launch(i)
        sync()
        if rep:
            walls.append((time.perf_counter() - t0) / WALL_STEPS)
    return Row(path, b, gpu_us, late, statistics.median(walls) * 1e6, statistics.median(host) * 1e6, floor, is_torch)


def step_floor_us(dims: NgramDims, b: int, bw: float, row_bytes: int | None = None) -> float:
    """Bytes one step must move over the copy bandwidth: projections once, the B*T table rows
    (``row_bytes`` each, bf16 by default), B word rows read, B output rows written."""
    t, h, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
    row_bytes = td * 2 if row_bytes is None else row_bytes
    moved = h * t * td * 2 + b * t * row_bytes + b * h * 2 + b * h * 2
    return moved / bw * 1e6


def compare(what: str, ours: np.ndarray, ref: np.ndarray) -> None:
    a, r = ours.astype(np.float32), ref.astype(np.float32)
    diff = float(np.max(np.abs(a - r)))
    rel = diff / max(float(np.max(np.abs(r))), 1e-30)
    verdict = "ok" if rel <= 2.0**-7 else "MISMATCH (over a bf16 ulp of the largest value)"
    print(f"check {what}: max abs diff {diff:.3g}, / max |ref| {rel:.3g}: {verdict}", flush=True)


class DeviceRows:
    """A device bf16 weight for the numpy reference, which checks its ``shape`` and ``dtype``:
    indexing copies just those rows back."""

    def __init__(self, gpu: CudaBackend, weight: Any, stream: int) -> None:
        self.gpu, self.ptr, self.stream = gpu, int(weight.weight), stream
        self.shape, self.dtype = tuple(weight.shape), weight.dtype
        self.cols = self.shape[1]

    def __getitem__(self, ids: Any) -> np.ndarray:
        ids = np.asarray(ids, np.int64).reshape(-1)
        out = np.empty((ids.size, self.cols), BF16)
        for i, r in enumerate(ids):
            self.gpu.copy_d2h(out[i], DevicePtr(self.ptr + int(r) * self.cols * 2), self.stream)
        return out


def reference_check(ctx: Ctx, weights: NgramWeights, b: int, first: np.ndarray) -> None:
    """Rows 0 and B-1 of our first step against layers.reference.ngram_embed_fused (device
    bf16 tables only; other placements have no rows to fetch this way)."""
    resident = [tb.weight for tb in weights.tables if isinstance(tb, Bf16Table)]
    if len(resident) != len(weights.tables):
        return
    gpu, s, dims = ctx.gpu, ctx.stream, ctx.dims
    projs = []
    for p in weights.projs:
        host = np.empty(p.shape, BF16)
        gpu.copy_d2h(host, p.weight, s)
        projs.append(host)
    # DeviceRows stand in for the arrays: their shape, dtype and rows are all the reference reads
    word = cast(np.ndarray, DeviceRows(gpu, weights.word, s))
    tables: reference.NgramTables = [(cast(np.ndarray, DeviceRows(gpu, w, s)), None) for w in resident]
    prompts, pool = ctx.inputs(b)
    for i in sorted({0, b - 1}):
        tokens = np.concatenate([prompts[i], pool[0, i : i + 1]]).astype(np.int64)
        want = reference.ngram_embed_fused(dims, word, tables, projs, tokens, 1)[0]
        compare(f"ours B={b} row {i} vs numpy fused reference", first[i], want)


# -- rows -----------------------------------------------------------------------------------------
def bare_graph_row(ctx: Ctx) -> Row:
    """A graph of one 1-element bf16_scaled_add: the floor of a graph replay from Python."""
    gpu, s = ctx.gpu, ctx.stream
    kernel = load_kernel(gpu, "residual_add", "bf16_scaled_add")
    buf = gpu.alloc(4)  # out, x: one bf16 each
    exe = 0
    try:
        gpu.memset(buf, 0, 4, s)
        scaled_add(gpu, kernel, buf, buf.offset(2), 0.5, 1, s)  # eagerly once: checks, arg plan
        gpu.begin_capture(s)
        try:
            scaled_add(gpu, kernel, buf, buf.offset(2), 0.5, 1, s)
        except BaseException:
            gpu.abort_capture(s)
            raise
        exe = gpu.end_capture(s)
        seq = [exe] * ORDER  # indexed like the other rows, so the Python per call is the same
        mask = ORDER - 1
        return measure(
            ctx,
            "bare one-kernel graph replay",
            None,
            lambda i: gpu.launch_graph(seq[i & mask], s),
            s,
            lambda: gpu.synchronize(s),
            None,
        )
    finally:
        gpu.synchronize(s)
        if exe:
            gpu.destroy_graph(exe)
        gpu.free(buf)


def ours_rows(ctx: Ctx, weights: NgramWeights, label: str, row_bytes: int | None = None) -> list[Row]:
    """One row per batch size for ``weights``' table placement: a decoder on them, then
    ``decode_row`` for each B. ``row_bytes``: bytes per gathered table row for the floor."""
    dec = NgramDecoder(weights, max_seqs=MAX_SEQS, max_rows=MAX_ROWS, stream=ctx.stream)
    try:
        rows = [decode_row(ctx, dec, label, b, row_bytes) for b in BATCHES]
        err = dec.check_errors()
        print(f"{label}: decoder errors after all steps: {err!r}", flush=True)
        return rows
    finally:
        ctx.gpu.synchronize(ctx.stream)
        dec.close()


def decode_row(ctx: Ctx, dec: NgramDecoder, label: str, b: int, row_bytes: int | None) -> Row:
    gpu, s, dims = ctx.gpu, ctx.stream, ctx.dims
    prompts, pool = ctx.inputs(b)
    exes: list[int] = []
    with (
        DeviceArray.from_numpy(gpu, prompts.reshape(-1), s) as prompt_d,
        DeviceArray.from_numpy(gpu, np.arange(b + 1, dtype=np.uint32) * PROMPT, s) as cu_d,
        DeviceArray.from_numpy(gpu, np.arange(b, dtype=np.uint32), s) as slots_d,
        DeviceArray.from_numpy(gpu, pool.reshape(-1), s) as pool_d,
    ):
        try:
            for slot in range(b):
                dec.reset(slot, s)
            dec.prefill(prompt_d, cu_d, slots_d, b, b * PROMPT, ctx.out, s)
            tokens = [pool_d.ptr.offset(r * b * 4) for r in range(R)]
            # The first call of this shape runs eagerly (kernels loaded, shared-memory limits
            # set, which a capture must not do); its output is the step the checks compare.
            dec.step(tokens[0], slots_d, b, ctx.out, s)
            first = np.empty((b, dims.hidden_size), BF16)
            gpu.copy_d2h(first, ctx.out, s)
            ctx.first[b] = first
            reference_check(ctx, dec.weights, b, first)
            for r in range(R):
                gpu.begin_capture(s)
                try:
                    dec.step(tokens[r], slots_d, b, ctx.out, s)
                except BaseException:
                    gpu.abort_capture(s)
                    raise
                exes.append(gpu.end_capture(s))
            seq = [exes[j] for j in ctx.order]
            mask = ORDER - 1
            return measure(
                ctx,
                label,
                b,
                lambda i: gpu.launch_graph(seq[i & mask], s),
                s,
                lambda: gpu.synchronize(s),
                step_floor_us(dims, b, ctx.bw, row_bytes),
            )
        finally:
            gpu.synchronize(s)  # before the inputs are freed
            for exe in exes:
                gpu.destroy_graph(exe)


def torch_rows(ctx: Ctx, weights: NgramWeights) -> list[Row]:
    torch, gpu, dims = ctx.torch, ctx.gpu, ctx.dims
    t, n, v = dims.num_tables(), dims.max_ngram, dims.vocab_size
    moduli = [dims.table_rows(c) for c in range(t)]
    if v * max(moduli) >= 1 << 63:
        print("torch rows skipped: token * (V**d mod M_c) could overflow int64 for these dims")
        return []
    gpu.synchronize(ctx.stream)
    gpu.synchronize(0)
    t_word = torch_view(gpu, weights.word)
    stacked = torch.cat([torch_view(gpu, w) for w in bf16_tables(weights)])  # one gather, 8 GiB more
    offsets = torch.tensor(np.cumsum([0] + moduli[:-1]), dtype=torch.int64, device="cuda")
    w_cat_t = torch.cat([torch_view(gpu, p) for p in weights.projs], dim=1).t()  # [T*td, D]
    mod = torch.tensor(moduli, dtype=torch.int64, device="cuda")
    # pows[c, j] = V**(N-1-j) mod M_c for window position j (oldest first, the new token last),
    # 0 where table c's order c // K + 2 does not reach that far back.
    pows = torch.tensor(
        [[pow(v, n - 1 - j, moduli[c]) if n - 1 - j < c // dims.splits + 2 else 0 for j in range(n)] for c in range(t)],
        dtype=torch.int64,
        device="cuda",
    )
    inv = float(np.float32(1.0) / np.float32(1 + t))
    eos = dims.eos_id

    def make_step(hist):
        """One step on ``hist [B, N-1]`` (oldest first, -1 before the context start): every op
        batched over sequences and tables (products < 2**38, so the sum of N fits int64)."""

        def step(new):  # new: [B] int64
            window = torch.cat([hist, new[:, None]], dim=1)  # [B, N], the newest last
            hist.copy_(window[:, 1:])
            ok = window[:, :-1] >= 0 if eos is None else (window[:, :-1] >= 0) & (window[:, :-1] != eos)
            alive = ok.flip(1).cumprod(1).flip(1)  # position j counts if j..N-2 are all tokens
            live = torch.cat([window[:, :-1].clamp_min(0) * alive, new[:, None]], dim=1)
            ids = (live[:, None, :] * pows[None]).sum(-1) % mod  # [B, T]
            gathered = stacked[(ids + offsets).reshape(-1)].reshape(new.shape[0], -1)
            return torch.addmm(t_word[new], gathered, w_cat_t, beta=inv, alpha=inv)

        return step

    rows = []
    for b in BATCHES:
        prompts, pool = ctx.inputs(b)
        pool_t = torch.from_numpy(pool.astype(np.int64)).cuda()  # [R, B]
        hist = torch.from_numpy(prompts[:, -(n - 1) :].astype(np.int64)).cuda()  # PROMPT >= N-1
        step = make_step(hist)
        first = step(pool_t[0])
        if b in ctx.first:
            compare(f"torch B={b} vs ours, first step", ctx.first[b], first.float().cpu().numpy())
        rows.append(torch_graph_row(ctx, step, pool_t, b))
        torch.cuda.current_stream().synchronize()  # its graphs and their memory pools are gone
    return rows


def torch_graph_row(ctx: Ctx, step: Callable[[Any], Any], pool_t: Any, b: int) -> Row:
    """``step`` captured in R torch.cuda.CUDAGraphs, graph r over row r of the token pool, timed
    as ours are (replayed in ``ctx.order``). The graphs live only in this call: its return frees
    them, and their private memory pools, before the next batch size captures its own."""
    torch = ctx.torch
    side = torch.cuda.Stream()  # warm-up on a side stream before capture, as torch asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for r in range(3):
            step(pool_t[r])
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for r in range(R):  # a private memory pool each: they are replayed in random order
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step(pool_t[r])
        graphs.append((g, out))
    seq = [graphs[j][0] for j in ctx.order]
    mask = ORDER - 1
    current = torch.cuda.current_stream()
    return measure(
        ctx,
        "torch, CUDAGraph replay",
        b,
        lambda i: seq[i & mask].replay(),
        int(current.cuda_stream),
        current.synchronize,
        step_floor_us(ctx.dims, b, ctx.bw),
        is_torch=True,
    )


# -- table placements -----------------------------------------------------------------------------
# One entry per placement of the n-gram tables; each becomes one ``ours_rows`` call.
PLACEMENTS = ("device", "host")  # RowCache tables: bench.cached (the decoder refuses them)


def placement_weights(ctx: Ctx, base: NgramWeights, placement: str) -> tuple[NgramWeights, int | None] | None:
    """(weights, bytes per gathered row for the floor) with ``base``'s word and projections
    (borrowed) and its tables placed as ``placement`` says. "host": each table copied (device to
    host) into mapped pinned host memory and read in place over PCIe (``NgramTable.Host``), owned
    by the new weights; its floor stays the device floor, so GPU/floor shows what reading the
    rows over PCIe costs."""
    if placement == "device":
        return base, None
    if placement == "host":
        gpu, tables = ctx.gpu, []
        mapped = cast("MappedBackend", gpu)  # a CudaBackend: mapped pinned host memory
        for w in bf16_tables(base):
            buf = gpu.alloc_host(w.nbytes, mapped=True)
            gpu.copy_d2h(buf, w.weight, 0)
            tables.append(
                NgramTable.Host(HostWeight(gpu.host_device_ptr(buf), w.shape, w.dtype, DevicePtr(0), mapped, buf))
            )
        weights = NgramWeights(ctx.dims, base.word, tables, base.projs, gpu)
        weights.own(*(tb.weight for tb in tables))  # freed with these weights; base's stay base's
        return weights, None
    return None


PREFILL = 8192  # tokens of one prompt


def prefill_row(ctx: Ctx, weights: NgramWeights, placement: str) -> tuple:
    """One PREFILL-token prompt: GPU us of the whole prefill and of its gather kernel alone,
    and the gathered rows' GB/s (T rows of td bf16 per token) in that gather."""
    gpu, dims, s = ctx.gpu, ctx.dims, ctx.stream
    t, td = dims.num_tables(), dims.table_dim()
    dec = NgramDecoder(weights, max_seqs=1, max_rows=PREFILL, stream=s)
    tok = DeviceArray.from_numpy(gpu, ctx.rng.integers(0, dims.vocab_size, PREFILL).astype(np.uint32))
    cu = DeviceArray.from_numpy(gpu, np.array([0, PREFILL], np.uint32))
    slot = DeviceArray.from_numpy(gpu, np.zeros(1, np.uint32))
    out = gpu.alloc(PREFILL * dims.hidden_size * 2)
    gpu.synchronize(0)
    try:

        def prefill(i: int) -> None:
            dec.reset(0, s)
            dec.prefill(tok, cu, slot, 1, PREFILL, out, s)

        def gather(i: int) -> None:
            dec.launch_gather(tok.ptr, cu.ptr, slot.ptr, 1, PREFILL, 0, s)

        full_us, _ = gated_gpu_us(prefill, stream=s, batch=2, warmup=1, iters=15)
        gather_us, _ = gated_gpu_us(gather, stream=s, batch=2, warmup=1, iters=15)
        assert dec.check_errors() == 0
    finally:
        gpu.synchronize(s)
        for a in (tok, cu, slot):
            a.free()
        gpu.free(out)
        dec.close()
    moved = PREFILL * t * td * 2
    return (placement, PREFILL, full_us, gather_us, moved / (gather_us * 1e-6) / 1e9)


EAGER_PREFILL = 16


def eager_table(ctx: Ctx, weights: NgramWeights) -> None:
    """Eager calls (no graph), the inputs ``DeviceArray`` s: host us per call of a step at B = 1
    and of a 16-token prefill, the stream synchronised (untimed) after each, against their two
    launches (gather, GEMM) at the bare ``cuLaunchKernel``'s host cost measured in this run."""
    gpu, s, dims = ctx.gpu, ctx.stream, ctx.dims
    bare = bare_launch_us(gpu)
    dec = NgramDecoder(weights, max_seqs=1, max_rows=EAGER_PREFILL, stream=s)
    arrays = [
        DeviceArray.from_numpy(gpu, ctx.rng.integers(0, dims.vocab_size, EAGER_PREFILL).astype(np.uint32), s),
        DeviceArray.from_numpy(gpu, np.array([0, EAGER_PREFILL], np.uint32), s),
        DeviceArray.from_numpy(gpu, np.zeros(1, np.uint32), s),
        DeviceArray.empty(gpu, (EAGER_PREFILL, dims.hidden_size), BF16, s),
    ]
    tok, cu, slot, out = arrays
    gpu.synchronize(s)
    try:
        calls = [
            ("NgramDecoder.step, B = 1", lambda i: dec.step(tok, slot, 1, out, s)),
            (
                f"NgramDecoder.prefill, {EAGER_PREFILL} tokens",
                lambda i: dec.prefill(tok, cu, slot, 1, EAGER_PREFILL, out, s),
            ),
        ]
        times = interleaved_times_us([fn for _, fn in calls], lambda: gpu.synchronize(s), warmup=50, iters=1000)
        assert dec.check_errors() == 0
    finally:
        gpu.synchronize(s)
        for a in arrays:
            a.free()
        dec.close()
    rows = [(name, 2, host, wall, 2 * bare, host / (2 * bare)) for (name, _), (wall, host) in zip(calls, times)]
    print_table(
        "eager decoder calls (host us per call)",
        ["call", "launches", "host us", "wall us", "launch floor us", "host x floor"],
        rows,
        note=f"Each row is one eager call onto an idle GPU (median of 1000, the stream synchronised after each): "
        f"host us until it returned, wall us until the sync returned, its launches at the bare cuLaunchKernel's "
        f"host cost ({bare:.2f} us here, bench.launch's floor) and the host us over that.",
    )


def zero_copy_probe(ctx: Ctx, weights: NgramWeights, out_per_table: bool = False) -> float:
    """GB/s of the seed's gather kernel (batched_embed) reading PREFILL random rows of every host
    table in place, one launch per table (the same rows, tables and footprint as the prefill's
    gather): the zero-copy rate the host-table prefill is compared with. Every launch writes the
    same 4 MiB, which stays in L2; ``out_per_table``: each its own, as the prefill's gather does."""
    gpu, tables = ctx.gpu, [tb.weight for tb in weights.tables if isinstance(tb, HostTable)]
    assert len(tables) == len(weights.tables)  # placement "host": every table a HostTable
    k = load_kernel(gpu, "embed_from_argmax", "batched_embed")
    ids = [DeviceArray.from_numpy(gpu, ctx.rng.integers(0, w.rows, PREFILL).astype(np.uint32)) for w in tables]
    cols = tables[0].cols
    step = PREFILL * cols * 2 if out_per_table else 0
    out = gpu.alloc(PREFILL * cols * 2 + step * (len(tables) - 1))
    gpu.synchronize(0)

    def gather(i: int) -> None:
        for c, (w, d) in enumerate(zip(tables, ids)):
            batched_embed(gpu, k, d.ptr, w.weight, out + c * step, PREFILL, cols, ctx.stream)

    try:
        us, _ = gated_gpu_us(gather, stream=ctx.stream, batch=2, warmup=1, iters=15)
    finally:
        gpu.synchronize(ctx.stream)
        for d in ids:
            d.free()
        gpu.free(out)
    return len(tables) * PREFILL * cols * 2 / (us * 1e-6) / 1e9


def make_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, "bench.decode")
    parser.add_argument(
        "--steps-only",
        action="store_true",
        help="only the decode-step rows (bare graph and ours): no torch, prefill or serving calls "
        "(A/B runs of a kernel change, e.g. under GPU_RUNTIME_KERNEL_DIR)",
    )
    parser.add_argument(
        "--placements",
        type=some_of(PLACEMENTS),
        default=",".join(PLACEMENTS),
        help=f"table placements, comma-separated (default {','.join(PLACEMENTS)})",
    )
    return parser


def main(args: argparse.Namespace) -> None:
    placements = args.placements
    torch = None if args.steps_only else torch_or_none()
    rng = np.random.default_rng(0)
    dims = DIMS
    t, h, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
    assert dims.max_ngram - 1 <= PROMPT
    with CudaBackend() as gpu:
        if torch is None and not args.steps_only:
            print("torch with CUDA not available: the torch rows are skipped", flush=True)
        stream = gpu.create_stream()
        bw = copy_bandwidth(gpu)
        word = device_weight(gpu, rng, dims.vocab_size, h, 1.0)
        tables = [NgramTable.Bf16(device_weight(gpu, rng, dims.table_rows(c), td, 1.0)) for c in range(t)]
        projs = [device_weight(gpu, rng, h, td, td**-0.5) for _ in range(t)]
        gpu.synchronize(0)  # uploaded on the default stream; the decoder reads them on `stream`
        weights = NgramWeights(dims, word, tables, projs, gpu)
        weights.own(word, *(tb.weight for tb in tables), *projs)  # freed by weights.close()
        out = gpu.alloc(max(BATCHES) * PROMPT * h * 2)
        ctx = Ctx(gpu, stream, dims, bw, rng, out, rng.integers(0, R, ORDER), torch)
        print(
            f"measured: copy {bw / 1e12:.2f} TB/s; T = {t}, D = {h}, table dim {td}, "
            f"prompt {PROMPT}, {R} graphs per path",
            flush=True,
        )
        try:
            rows = [bare_graph_row(ctx)]
            prefills, probe, probe_own_out = [], None, None
            for placement in placements:
                placed = placement_weights(ctx, weights, placement)
                if placed is None:
                    print(f"placement {placement!r}: not written yet, skipped")
                    continue
                p_weights, row_bytes = placed
                try:
                    rows += ours_rows(ctx, p_weights, f"ours, {placement} tables, step in caller's graph", row_bytes)
                    if args.steps_only:
                        continue
                    prefills.append(prefill_row(ctx, p_weights, placement))
                    if placement == "host":
                        probe = zero_copy_probe(ctx, p_weights)
                        probe_own_out = zero_copy_probe(ctx, p_weights, out_per_table=True)
                finally:
                    if p_weights is not weights:
                        gpu.synchronize(stream)
                        p_weights.close()  # its host tables and what it derived, not the shared weights
            if torch is not None:
                rows += torch_rows(ctx, weights)
                torch.cuda.synchronize()
            if not args.steps_only:
                serving_rows(gpu, stream, weights, rng)
                eager_table(ctx, weights)
        finally:
            gpu.synchronize(stream)
            weights.close()
            gpu.free(out)
        report(rows)
        if args.steps_only:
            return
        print_table(
            f"prefill of one {PREFILL}-token prompt (GPU us, back to back)",
            [
                "tables",
                "tokens",
                "prefill us",
                "gather us",
                "gathered GB/s",
                "x zero-copy probe",
                "x probe, own outputs",
            ],
            [
                (
                    *r,
                    r[4] / probe if probe and r[0] == "host" else None,
                    r[4] / probe_own_out if probe_own_out and r[0] == "host" else None,
                )
                for r in prefills
            ],
            note="Each row is the prefill of one prompt with device or host tables: the whole call's and its "
            "gather's GPU us, the gathered GB/s, and that over the zero-copy probe's rate: its launches "
            "all write one 4 MiB output, which stays in L2 (issue 29's anchor, the harder one), and "
            "each table's rows to its own output, as the prefill's gather writes them (like for like).",
        )
        if probe:
            print(
                f"zero-copy probe: batched_embed of {PREFILL} random rows from each host table: "
                f"{probe:.1f} GB/s; writing each table's rows to its own output: {probe_own_out:.1f} GB/s"
            )


def report(rows: list[Row]) -> None:
    bare = next(r.host_us for r in rows if r.batch is None)
    torch_by_b = {r.batch: r for r in rows if r.torch}
    ours = [r for r in rows if r.batch is not None and not r.torch]
    for r in ours:
        print(
            f"target host <= 1.3x bare graph replay: {r.path} B={r.batch}: "
            f"{r.host_us / bare:.2f}x ({'met' if r.host_us <= 1.3 * bare else 'not met'})"
        )
    table = []
    for r in rows:
        # torch reads its tables from device memory: paired with our device-table rows only
        tr = torch_by_b.get(r.batch) if not r.torch and "device tables" in r.path else None
        table.append(
            (
                r.path,
                r.batch,
                r.gpu_us,
                r.wall_us,
                r.host_us,
                r.floor_us,
                r.gpu_us / r.floor_us if r.floor_us else None,
                tr.gpu_us / r.gpu_us if tr else None,
                tr.wall_us / r.wall_us if tr else None,
                tr.host_us / r.host_us if tr else None,
                r.host_us / bare,
                r.late,
            )
        )
    print_table(
        "n-gram decode step (one new token per sequence), graph replays",
        [
            "path",
            "B",
            "GPU us",
            "wall us/step",
            "host us/step",
            "floor us",
            "GPU/floor",
            "torch/ours GPU",
            "torch/ours wall",
            "torch/ours host",
            "host/bare",
            "gate expired",
        ],
        table,
        note="Each row is one step of B sequences replayed from a graph (the module's help defines each "
        "path and column): GPU, wall and host us, the floor, torch/ours (> 1: ours is faster; device "
        "tables only, as torch's), "
        "host over a bare graph replay, and the gates expired.",
    )


if __name__ == "__main__":
    run(main, make_parser())
