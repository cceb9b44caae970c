"""DeepSeek-V4.1-Flash's Engram at its real dims and footprint: decode steps and prefills, ours
against the torch form of the engines' design on the same memory, beside the floors (issue 50).

Dims: hidden 5120, hc_mult 4, orders 2..4, 8 heads of 256 (24 rows of 264 bytes per token),
compressed vocab 99092, vocab 129280; one Engram layer (layer 1) whose table is the real one:
384,006,168 rows, 101 GB (``--rows`` takes another size: the 24 primes from rows / 24 on). Synthetic
weights: the table's rows repeat a random pool of 65521 rows (finite fp8, scale bytes 120..134),
read by ``EngramWeights.from_arrays`` a piece at a time (its time is printed); a random token map,
wkv, q and k. Tokens are random text ids (no image id): every position is text.

Placements (``--placements``, in this order, one table in memory at a time): ``host`` (mapped
pinned host memory, read in place: what a user with one GPU runs; skipped, saying why, where host
memory lacks room) and ``device`` (skipped where the GPU lacks room: an H100; an H200 holds it).

Rows (every time GPU us, the median of calls run back to back behind a gate, bench.common):
  decode B      B = 1 and 64 sequences, one token each (k = 1): ours are graph replays of the lookup
                alone (``dec.gather``) and of the whole step (``dec.step`` + ``dec.apply`` on a
                [B, 4, 5120] bf16 residual), 32 graphs over a random token pool replayed in a
                random order, so every call gathers other rows
  prefill S     one prompt of S = 1024 and 8192 tokens, eager (``dec.prefill`` + ``dec.apply``),
                a fresh prompt every call from a pool of 8
  lookup        the hash, the gather and the dequantisation into ``emb`` (and the requantisation
                as the fp8 linear quantises its input)
  whole         the lookup, the wkv projection (decode: over the fp8 weights, ``FP8_ROWS`` rows at
                most; prefill: over their bf16 copy) and the gate applied to the residual
  overlapped    (decode) an engine's step: forked from the main stream, a side stream runs
                ``dec.step`` while the main stream runs a stand-in for the layers before (a
                ``STANDIN_BYTES`` memset, about 45 us: HBM work, as a decode layer's weight reads
                are), then joins and gates; its floor column is the stand-in alone
Columns: ours us; the torch form's us: the engines' design in torch on the same table memory:
compressed ids and the hash in torch from a device token history as SGLang hashes (int64), a gather
``index_select`` over a view of the table (the host table through its device-visible UVA address),
the dequantisation and the per-32 activation quantisation in torch, ``matmul`` over wkv dequantised
to bf16 (the DenseWeight ours reads), the gate in torch (fp32), at decode captured in
torch.cuda.CUDAGraphs as ours; torch/ours (> 1: ours faster); the floor: for the lookup, tokens x 24
random 264-byte rows read by bench/row_reads.cu's ``read_random_rows_8`` over the same table's
memory (host or device; its read rate in GB/s beside it), for the whole step that plus the
projection (decode: the fp8 wkv bytes over the copy bandwidth measured in this run; prefill: cuBLAS's
time for the same GEMM, torch ``matmul``) plus the residual read and written over the copy
bandwidth; ours/floor. Checks (printed, and summed up in each table's note): the first call of each
row, ours against the torch form from the same history: emb bit for bit, kv and the residual within
2 bf16 ulps of their largest value (max |diff| / max |value| <= 2^-6). Then issue 50's targets, met
or missed, and issue 51's overlap target. Without torch the torch columns and checks are "-".
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from bench.common import (
    bench_parser,
    copy_bandwidth,
    gate,
    gated_gpu_us,
    positive_int,
    print_table,
    run,
    some_of,
    torch_or_none,
    torch_stream,
)
from bench.ngram_embed import torch_view
from bench.row_reads import GIB, narrow_kernel, read_floor_us
from gpu_runtime import CudaBackend, CudaError, DeviceArray, DevicePtr
from layers.dense_weight import BF16
from layers.engram.config import V41_FLASH_QUANT, V41_FLASH_TEXT, EngramConfig, next_primes
from layers.engram.decoder import EngramDecoder
from layers.engram.token_map import TokenMap
from layers.engram.weights import CHUNK_ROWS, EngramWeights, row_stride

# DeepSeek-V4.1-Flash's config (Engram keys) with layer 1's table only
TEXT_CONFIG = {**V41_FLASH_TEXT, "engram_layer_ids": [1], "engram_num_embeddings": [384006168]}
QUANTIZATION = V41_FLASH_QUANT
LAYER = 1
REAL_ROWS = 384006168
REAL_PRIMES = (16000057, 16000463)  # layer 1's first and last bucket
PLACEMENTS = ("host", "device")
BATCHES = (1, 64)
PREFILLS = (1024, 8192)
MAX_ROWS = max(PREFILLS)
PROMPT = 4  # tokens each decode sequence is prefilled with (its look-back)
R = 32  # graphs per decode path, each over its own slice of the token pool
ORDER = 1 << 10  # the random replay order over the R graphs (a power of two)
POOL = 8  # prompts per prefill length
PERIOD = 65521  # rows of the random pool the table repeats
TABLE_SCALES = (120, 135)  # e8m0 bytes: 2^-7 .. 2^7
WKV_SCALES = (104, 111)  # 2^-23 .. 2^-17: kv of tens, as a trained projection's
HOST_MARGIN = 8 * GIB  # host memory besides the table: the pools, wkv's dequantisation, torch
DEVICE_MARGIN = 8 * GIB  # device memory besides the table and the gate: decoder, wkv, torch's temporaries
BOUND = 2.0**-6  # kv and residual: max |diff| / max |value| (2 bf16 ulps of the largest value)
LOOKUP_X_TORCH = 3.0  # issue 50's targets
OVERLAP_X_DEVICE = 1.1  # issue 51's: the overlapped step with host tables over that with device tables
STANDIN_BYTES = 128 << 20  # the overlapped step's stand-in for the layers before the Engram layer
LOOKUP_X_FLOOR = 1.1
HOST_ROWS_GBS = 13.0  # issue 51's host reads at the real footprint: GB/s of rows, prefill lookups ...
HOST_X_SMALL = 0.7  # ... and that over the GPU's read rate of a small table (SMALL_BYTES of the same memory)
SMALL_BYTES = 1 << 30
HOST_THREADS = min(8, os.cpu_count() or 1)  # the staged lookup's gather threads (NOTES-engram: fastest)
STAGED, BUSY = "lookup staged", "lookup staged, busy Python"  # the host table's extra prefill rows


# -- the config and the synthetic weights ----------------------------------------------------------
def engram_config(rows: int) -> EngramConfig:
    """The real config with layer 1's table of ``rows`` rows: the real primes for REAL_ROWS, else
    the 24 primes from ``rows // 24`` on (the table then holds their sum, about ``rows``)."""
    real = EngramConfig.from_dict({"text_config": TEXT_CONFIG, "quantization_config": QUANTIZATION})
    if rows == REAL_ROWS:
        return real
    cols, start = real.n_hash_cols, max(2, rows // real.n_hash_cols)
    text = {**TEXT_CONFIG, "engram_vocab_size": start, "engram_num_embeddings": [sum(next_primes(start - 1, cols))]}
    return EngramConfig.from_dict({"text_config": text, "quantization_config": QUANTIZATION})


class Repeating:
    """A ``[rows, cols]`` array-like whose row ``r`` is row ``r % len(base)`` of ``base`` (``[period,
    cols]``). ``pool`` holds ``base`` repeated over ``period + CHUNK_ROWS`` rows: a slice of at most
    CHUNK_ROWS rows, as ``EngramWeights.from_arrays`` reads a table, is a view of it, so a 101 GB
    table costs no more than its packing."""

    def __init__(self, base: np.ndarray, rows: int) -> None:
        self.period = len(base)
        self.pool = base[np.arange(self.period + CHUNK_ROWS) % self.period]
        self.shape = (rows, base.shape[1])
        self.dtype = base.dtype

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError(f"Repeating takes row slices, got {type(key).__name__}")
        start, stop, step = key.indices(self.shape[0])
        at = start % self.period
        if step == 1 and stop - start <= self.pool.shape[0] - at:
            return self.pool[at : at + max(stop - start, 0)]
        return self.pool[np.arange(start, stop, step) % self.period]


def fp8_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random e4m3 bytes, NaN (0x7F, 0xFF) made 448 (0x7E, 0xFE)."""
    out = rng.integers(0, 256, shape, dtype=np.uint8)
    out[(out & 0x7F) == 0x7F] -= 1
    return out


@dataclass
class Synthetic:
    """What ``EngramWeights.from_arrays`` takes for one layer, and the token map."""

    table: tuple[Any, Any]  # two Repeating: array-likes, as from_arrays reads a table
    wkv: tuple[np.ndarray, np.ndarray]
    q: np.ndarray
    k: np.ndarray
    token_map: TokenMap


def synthetic(cfg: EngramConfig, rng: np.random.Generator) -> Synthetic:
    rows = cfg.num_embeddings[0]
    table = (
        Repeating(fp8_bytes(rng, (PERIOD, cfg.head_dim)), rows),
        Repeating(rng.integers(*TABLE_SCALES, (PERIOD, cfg.scale_cols), dtype=np.uint8), rows),
    )
    wkv = (
        fp8_bytes(rng, (cfg.kv_dim, cfg.emb_dim)),
        rng.integers(*WKV_SCALES, (-(-cfg.kv_dim // 32), cfg.emb_dim // 32), dtype=np.uint8),
    )
    qk = [rng.standard_normal((cfg.hc_mult, cfg.hidden_size), np.float32).astype(BF16) for _ in range(2)]
    c = cfg.compressed_vocab_size
    ids = np.concatenate([np.arange(c), rng.integers(0, c, cfg.vocab_size - c)]).astype(np.int32)
    return Synthetic(table, wkv, qk[0], qk[1], TokenMap(ids))


def host_available() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def no_room(gpu: CudaBackend, placement: str, nbytes: int) -> str | None:
    """Why a table of ``nbytes`` cannot be placed (None: it can)."""
    if placement == "host":
        avail = host_available()
        if avail is not None and avail < nbytes + HOST_MARGIN:
            return (
                f"needs {(nbytes + HOST_MARGIN) / GIB:.0f} GiB of available host memory, "
                f"{avail / GIB:.0f} GiB available"
            )
        return None
    free = gpu.mem_info()[0]
    if free < nbytes + DEVICE_MARGIN:
        return (
            f"needs {(nbytes + DEVICE_MARGIN) / GIB:.0f} GiB of free device memory, {free / GIB:.0f} GiB free "
            f"on {gpu.name} (an H200 holds the real table; an H100 does not)"
        )
    return None


# -- measurement ---------------------------------------------------------------------------------
@dataclass
class Row:
    """One measured call: ``part`` "lookup", "whole" or "overlapped"; times in GPU us; ``read_gbs``:
    the floor's read rate (lookup rows)."""

    placement: str
    call: str  # "decode" or "prefill"
    tokens: int
    part: str
    ours: float
    torch: float | None
    floor: float
    late: int
    read_gbs: float | None = None


@dataclass
class Check:
    """Ours against the torch form, first call of a row: emb values whose bits differ (of
    ``values``), and max |diff| / max |value| of emb, kv and the residual."""

    placement: str
    call: str
    tokens: int
    emb_differ: int
    values: int
    emb_rel: float
    kv_rel: float
    residual_rel: float

    @property
    def ok(self) -> bool:
        return self.emb_differ == 0 and self.kv_rel <= BOUND and self.residual_rel <= BOUND


@dataclass
class Results:
    """One placement's rows and checks, and its table's rows and bytes."""

    where: str
    table_rows: int
    table_bytes: int
    rows: list[Row] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    small_gbs: dict[int, float] = field(default_factory=dict)  # prefill S -> the GPU's rate over a small table


@dataclass
class Ctx:
    """What every row needs: the device, the stream, the inputs, this run's copy bandwidth."""

    gpu: CudaBackend
    stream: int
    rng: np.random.Generator
    bw: float
    x0: np.ndarray  # [MAX_ROWS, hc, D] bf16: every row's residual before its first call
    x: DeviceArray  # ours, the same shape
    sink: DevicePtr
    probe: Any
    torch: Any
    order: np.ndarray
    gemm_us: dict[int, float] = field(default_factory=dict)  # prefill S -> cuBLAS us


def capture(gpu: CudaBackend, stream: int, fn: Callable[[], Any]) -> int:
    """``fn``'s launches on ``stream`` as a graph."""
    gpu.begin_capture(stream)
    try:
        fn()
    except BaseException:
        gpu.abort_capture(stream)
        raise
    return gpu.end_capture(stream)


def replay_us(launch: Callable[[Any], Any], graphs: Sequence[Any], order: np.ndarray, stream: int) -> tuple[float, int]:
    """``gated_gpu_us`` of ``launch(graph)``, the graphs taken in ``order`` (indices into them)."""
    mask = len(order) - 1
    return gated_gpu_us(lambda i: launch(graphs[order[i & mask]]), stream=stream, batch=16, warmup=2, iters=10)


def eager_us(fn: Callable[[int], Any], stream: int) -> tuple[float, int]:
    """``gated_gpu_us`` of a prefill-sized call (a few calls a batch: each takes milliseconds)."""
    return gated_gpu_us(fn, stream=stream, batch=4, warmup=1, iters=5)


class TorchForm:
    """The engines' design in torch over the memory ``weights`` hold (module docstring): token map,
    hash, ``index_select`` of whole rows (as int64 words), dequantisation, activation quantisation,
    ``matmul`` over wkv (bf16), the gate. Scales are made as ``2^(byte - 127)`` by their bits:
    exact for bytes 1..254 (the synthetic ones are 120..134)."""

    def __init__(self, gpu: CudaBackend, weights: EngramWeights) -> None:
        torch = torch_or_none()
        cfg, layer = weights.config, weights.layers[0]
        self.torch, self.cfg, self.pad = torch, cfg, weights.pad

        def cuda(a: np.ndarray) -> Any:
            return torch.from_numpy(np.array(a, np.int64)).cuda()

        self.map = cuda(weights.token_map_host.ids)
        self.mult = cuda(cfg.multipliers[0])
        self.primes = cuda(cfg.primes[0].reshape(cfg.max_ngram - 1, cfg.n_heads))
        self.offsets = cuda(cfg.offsets[0].reshape(cfg.max_ngram - 1, cfg.n_heads))
        self.none = cuda(np.full(cfg.max_ngram - 1, -1))  # an empty history
        rows = DeviceArray(gpu, layer.table.address, (layer.table.rows, weights.stride // 8), np.int64)
        try:
            self.table = torch.as_tensor(rows, device="cuda")
        except RuntimeError:  # a torch that will not take a host address from the array interface
            self.table = torch.from_dlpack(rows)
        self.wkv_t = torch_view(gpu, layer.wkv).t()  # [emb_dim, kv_dim]
        hc, d = cfg.hc_mult, cfg.hidden_size
        q, k = (torch.as_tensor(DeviceArray(gpu, p, (hc, d), np.int16), device="cuda") for p in (layer.q, layer.k))
        self.w = q.view(torch.bfloat16).float() * k.view(torch.bfloat16).float()  # exact in f32

    def hash(self, ext: Any, n: int) -> Any:
        """Row ids int64 ``[tokens, cols]`` of the last ``n`` entries of ``ext`` (``[..., N - 1 + n]``
        compressed ids, the look-back first, -1 where there is none), as layers/engram/hashing.py."""
        torch, back = self.torch, self.cfg.max_ngram - 1
        blocked, r, orders = None, None, []
        for k in range(self.cfg.max_ngram):
            src = ext[..., back - k : back - k + n]
            blocked = src < 0 if blocked is None else blocked | (src < 0)
            term = torch.where(blocked, self.pad, src) * self.mult[k]
            r = term if r is None else r ^ term
            if k:
                orders.append(r)
        ids = torch.stack(orders, -1)[..., None] % self.primes + self.offsets  # [..., n, N - 1, heads]
        return ids.reshape(-1, self.cfg.n_hash_cols)

    def emb(self, ids: Any) -> Any:
        """bf16 ``[tokens, emb_dim]``: the rows gathered, dequantised, then quantised per 32 as the fp8
        linear quantises its input (scale ``2^ceil(log2(max(amax, 1e-4) / 448))``) and back."""
        torch, w = self.torch, self.cfg.head_dim
        raw = self.table.index_select(0, ids.reshape(-1)).view(torch.uint8)  # [tokens * cols, stride]
        values = raw[:, :w].view(torch.float8_e4m3fn).float().view(-1, w // 32, 32)
        scales = (raw[:, w : w + w // 32].int() << 23).view(torch.float32)
        x = (values * scales[..., None]).to(torch.bfloat16).float()
        mant, exp = torch.frexp(x.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0)
        s = ((exp - (mant == 0.5).int() + 127) << 23).view(torch.float32)
        return ((x / s).to(torch.float8_e4m3fn).float() * s).to(torch.bfloat16).view(ids.shape[0], -1)

    def gate(self, x: Any, kv: Any) -> None:
        """``x [T, hc, D]`` bf16 := bf16(x + gate * value), the gate in fp32 (gate_ref's math)."""
        torch, hc, d, eps = self.torch, self.cfg.hc_mult, self.cfg.hidden_size, self.cfg.eps
        xf = x.float()
        key = kv[:, : hc * d].float().view(-1, hc, d)
        value = kv[:, hc * d :].float()[:, None, :]
        dot = (xf * self.w * key).sum(-1)
        dot = dot * torch.rsqrt(xf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps) / math.sqrt(d)
        g = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        x.copy_((xf + g[..., None] * value).to(torch.bfloat16))

    def run(self, ext: Any, n: int, x: Any = None) -> tuple[Any, Any]:
        """(emb, kv) of the last ``n`` entries of ``ext``; with the residual ``x``, kv and the gate
        (kv None without)."""
        emb = self.emb(self.hash(ext, n))
        if x is None:
            return emb, None
        kv = emb @ self.wkv_t
        self.gate(x, kv)
        return emb, kv

    def step(self, hist: Any, tokens: Any, x: Any = None) -> tuple[Any, Any]:
        """One token per sequence (``tokens`` int64 ``[B]`` raw ids) after ``hist`` (int64
        ``[B, N - 1]`` compressed ids, updated)."""
        ext = self.torch.cat([hist, self.map[tokens][:, None]], 1)
        hist.copy_(ext[:, 1:])
        return self.run(ext, 1, x)

    def prefill(self, tokens: Any, x: Any = None) -> tuple[Any, Any]:
        """A new sequence of raw ids (int64 ``[S]``)."""
        return self.run(self.torch.cat([self.none, self.map[tokens]]), tokens.shape[0], x)


def torch_graphs(torch: Any, fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """Each of ``fns`` captured in its own torch.cuda.CUDAGraph (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns[:3]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        graphs.append(g)
    return graphs


def compare(ctx: Ctx, where: str, call: str, n: int, ours: tuple[int, int, int], theirs: tuple[Any, Any, Any]) -> Check:
    """Ours (addresses of emb, kv and the residual's first ``n`` rows) against the torch form's."""
    torch, gpu = ctx.torch, ctx.gpu

    def rel(a: Any, b: Any) -> float:
        return float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-30)

    def view(ptr: int, like: Any) -> Any:
        return torch.as_tensor(DeviceArray(gpu, ptr, tuple(like.shape), np.int16), device="cuda")

    gpu.synchronize(ctx.stream)
    torch.cuda.synchronize()
    emb, kv, x = theirs
    mine = [view(p, t).view(torch.bfloat16) for p, t in zip(ours, theirs)]
    differ = int((mine[0].view(torch.int16) != emb.view(torch.int16)).sum())
    check = Check(where, call, n, differ, emb.numel(), rel(mine[0], emb), rel(mine[1], kv), rel(mine[2], x))
    print(
        f"check {where} {call} {n}: ours vs the torch form: emb {differ} of {emb.numel()} values differ "
        f"(max |diff| / max |emb| {check.emb_rel:.3g}), kv {check.kv_rel:.3g}, residual {check.residual_rel:.3g} "
        f"(max |diff| / max |value|, bound {BOUND:.3g}): {'ok' if check.ok else 'MISMATCH'}",
        flush=True,
    )
    return check


class Placement:
    """The rows of one table placement (``out``): a decoder on ``weights``, the torch form on the
    same memory."""

    def __init__(self, ctx: Ctx, weights: EngramWeights, where: str) -> None:
        self.ctx, self.weights, self.where = ctx, weights, where
        self.cfg = cfg = weights.config
        self.table = weights.layers[0].table
        self.width = cfg.hc_mult * cfg.hidden_size
        self.out = Results(where, self.table.rows, self.table.nbytes)
        self.tf = TorchForm(ctx.gpu, weights) if ctx.torch is not None else None

    def floors(self, n: int, gemm_us: float | None = None) -> tuple[float, float, float]:
        """(lookup floor us, whole floor us, the floor's read GB/s) for ``n`` tokens."""
        ctx, cols, stride = self.ctx, self.cfg.n_hash_cols, self.weights.stride
        t = self.table
        rows_us = read_floor_us(
            ctx.probe, int(t.address), t.rows * stride, cols, n * cols, int(ctx.sink), ctx.stream, row=stride
        )
        proj_us = gemm_us if gemm_us is not None else self.cfg.kv_dim * self.cfg.emb_dim / ctx.bw * 1e6
        residual_us = 2 * n * self.width * 2 / ctx.bw * 1e6
        return rows_us, rows_us + proj_us + residual_us, n * cols * stride / (rows_us * 1e-6) / 1e9

    def add(
        self,
        call: str,
        n: int,
        ours: list[tuple[float, int]],
        theirs: list[tuple[float, int]] | None,
        gemm_us: float | None = None,
    ) -> None:
        """The lookup's and the whole call's rows: ``ours`` and ``theirs`` (None: no torch) as
        (us, gates expired) each, beside their floors."""
        lookup_floor, whole_floor, gbs = self.floors(n, gemm_us)
        for i, (part, floor) in enumerate((("lookup", lookup_floor), ("whole", whole_floor))):
            (us, late), (t_us, t_late) = ours[i], theirs[i] if theirs else (None, 0)
            self.out.rows.append(Row(self.where, call, n, part, us, t_us, floor, late + t_late, None if i else gbs))

    # -- decode ----------------------------------------------------------------------------------
    def decode(self, dec: EngramDecoder, b: int) -> None:
        ctx, gpu, s, cfg = self.ctx, self.ctx.gpu, self.ctx.stream, self.cfg
        text_ids = cfg.image_token_id or cfg.vocab_size
        prompts = ctx.rng.integers(0, text_ids, (b, PROMPT), dtype=np.uint32)
        pool = ctx.rng.integers(0, text_ids, (R, b), dtype=np.uint32)
        exes: list[list[int]] = []  # the graphs of the lookup, the whole step, the overlapped step, the stand-in
        side, forked, joined = gpu.create_stream(), gpu.create_event(), gpu.create_event()
        standin = gpu.alloc(STANDIN_BYTES)
        with (
            DeviceArray.from_numpy(gpu, prompts.reshape(-1), s) as prompt_d,
            DeviceArray.from_numpy(gpu, np.arange(b + 1, dtype=np.uint32) * PROMPT, s) as cu_d,
            DeviceArray.from_numpy(gpu, np.arange(b, dtype=np.uint32), s) as slots_d,
            DeviceArray.from_numpy(gpu, pool.reshape(-1), s) as pool_d,
        ):
            try:
                for slot in range(b):
                    dec.reset(slot, s)
                dec.prefill(prompt_d, cu_d, slots_d, b, b * PROMPT, s)
                tokens = [int(pool_d.ptr) + r * b * 4 for r in range(R)]
                slots = int(slots_d.ptr)
                gpu.copy_h2d_async(ctx.x0[:b], ctx.x.ptr, s)

                def whole(r: int) -> None:
                    dec.step(tokens[r], slots, b, s)
                    dec.apply(LAYER, ctx.x, b, s)

                def lookup(r: int) -> None:
                    dec.gather((tokens[r], 0, slots), 0, b, b, 1, s)

                def overlapped(r: int) -> None:  # the engine's step (module docstring)
                    gpu.record_event(forked, s)
                    gpu.wait_event(side, forked)
                    dec.step(tokens[r], slots, b, side)
                    gpu.record_event(joined, side)
                    gpu.memset(standin, r & 0xFF, STANDIN_BYTES, s)
                    gpu.wait_event(s, joined)
                    dec.apply(LAYER, ctx.x, b, s)

                def standin_alone(r: int) -> None:
                    gpu.memset(standin, r & 0xFF, STANDIN_BYTES, s)

                whole(0)  # eagerly first (the checks' step; kernels loaded, the GEMM planned), then captured
                theirs = self.torch_decode(dec, prompts, pool) if self.tf is not None else None
                lookup(1)
                for fn in (lookup, whole, overlapped, standin_alone):
                    exes.append([])
                    for r in range(R):
                        exes[-1].append(capture(gpu, s, partial(fn, r)))
                ours = [replay_us(partial(gpu.launch_graph, stream=s), graphs, ctx.order, s) for graphs in exes]
            finally:
                gpu.synchronize(s)  # before the inputs are freed
                for exe in (e for graphs in exes for e in graphs):
                    gpu.destroy_graph(exe)
                gpu.free(standin)
                gpu.destroy_event(forked)
                gpu.destroy_event(joined)
                gpu.destroy_stream(side)
        self.add("decode", b, ours[:2], theirs)
        (us, late), (standin_us, standin_late) = ours[2], ours[3]
        self.out.rows.append(Row(self.where, "decode", b, "overlapped", us, None, standin_us, late + standin_late))

    def torch_decode(self, dec: EngramDecoder, prompts: np.ndarray, pool: np.ndarray) -> list[tuple[float, int]]:
        """The torch form's first step checked against ours (which ran it just before), then its
        graphs timed: (lookup, whole) as ``replay_us`` gives them."""
        ctx, tf, torch = self.ctx, self.tf, self.ctx.torch
        assert tf is not None
        b = len(prompts)
        hist = tf.map[torch.from_numpy(prompts[:, 1 - self.cfg.max_ngram :].astype(np.int64)).cuda()]
        pool_t = torch.from_numpy(pool.astype(np.int64)).cuda()
        x = torch.from_numpy(ctx.x0[:b].view(np.int16)).cuda().view(torch.bfloat16)  # [b, hc, D]
        emb, kv = tf.step(hist, pool_t[0], x)
        self.out.checks.append(
            compare(ctx, self.where, "decode", b, (dec.emb_of(0), dec.kv_of(0), int(ctx.x.ptr)), (emb, kv, x))
        )
        out = []
        for with_x in (None, x):  # the lookup, then the whole step
            graphs = torch_graphs(torch, [partial(tf.step, hist, pool_t[r], with_x) for r in range(R)])
            out.append(replay_us(lambda g: g.replay(), graphs, ctx.order, torch_stream()))
            torch.cuda.synchronize()
            del graphs  # with their memory pools
        torch.cuda.empty_cache()
        return out

    # -- prefill ---------------------------------------------------------------------------------
    def prefill(self, dec: EngramDecoder, n: int, staged: EngramDecoder | None = None) -> None:
        """Prefill rows of ``n`` tokens; with ``staged`` (host tables: a decoder that stages them),
        its lookup too, alone and beside a thread that keeps the interpreter busy, and the GPU's
        read rate over a small table for the targets."""
        ctx, gpu, s, cfg = self.ctx, self.ctx.gpu, self.ctx.stream, self.cfg
        text_ids = cfg.image_token_id or cfg.vocab_size
        pool = [ctx.rng.integers(0, text_ids, n, dtype=np.uint32) for _ in range(POOL)]
        toks = [DeviceArray.from_numpy(gpu, p, s) for p in pool]
        cu_d = DeviceArray.from_numpy(gpu, np.array([0, n], np.uint32), s)
        slot_d = DeviceArray.from_numpy(gpu, np.zeros(1, np.uint32), s)
        try:

            def whole(i: int) -> None:
                dec.prefill(toks[i % POOL], cu_d, slot_d, 1, n, s)
                dec.apply(LAYER, ctx.x, n, s)

            def lookup(i: int) -> None:
                dec.gather((int(toks[i % POOL].ptr), int(cu_d.ptr), int(slot_d.ptr)), 0, 1, n, 0, s)

            dec.reset(0, s)  # from an empty history, as the torch form's check
            gpu.copy_h2d_async(ctx.x0[:n], ctx.x.ptr, s)
            whole(0)
            theirs = self.torch_prefill(dec, pool) if self.tf is not None else None
            ours = [eager_us(fn, s) for fn in (lookup, whole)]
            if staged is not None:
                staged.reset(0, s)
                staging = staged.staging  # called directly: the decoder stages only from STAGED_ROWS
                assert staging is not None

                def staged_lookup(i: int) -> None:
                    staging.lookup(int(toks[i % POOL].ptr), int(cu_d.ptr), int(slot_d.ptr), 0, n, 1, 0, s)

                alone = eager_us(staged_lookup, s)
                with busy_interpreter():
                    busy = eager_us(staged_lookup, s)
        finally:
            gpu.synchronize(s)
            for a in (*toks, cu_d, slot_d):
                a.free()
        self.add("prefill", n, ours, theirs, ctx.gemm_us.get(n))
        if staged is not None:
            floor, _, gbs = self.floors(n)
            for part, (us, late) in ((STAGED, alone), (BUSY, busy)):
                self.out.rows.append(Row(self.where, "prefill", n, part, us, None, floor, late, gbs))
            cols, stride = self.cfg.n_hash_cols, self.weights.stride
            small = min(SMALL_BYTES, self.table.nbytes)
            small_us = read_floor_us(
                ctx.probe, int(self.table.address), small, cols, n * cols, int(ctx.sink), s, row=stride
            )
            self.out.small_gbs[n] = n * cols * stride / small_us / 1e3

    def torch_prefill(self, dec: EngramDecoder, pool: list[np.ndarray]) -> list[tuple[float, int]]:
        """The torch form's first prompt checked against ours, the cuBLAS GEMM at this shape timed
        (once per length), then its lookup and whole call timed."""
        ctx, tf, torch = self.ctx, self.tf, self.ctx.torch
        assert tf is not None
        n = len(pool[0])
        toks = [torch.from_numpy(p.astype(np.int64)).cuda() for p in pool]
        x = torch.from_numpy(ctx.x0[:n].view(np.int16)).cuda().view(torch.bfloat16)  # [n, hc, D]
        emb, kv = tf.prefill(toks[0], x)
        self.out.checks.append(
            compare(ctx, self.where, "prefill", n, (dec.emb_of(0), dec.kv_of(0), int(ctx.x.ptr)), (emb, kv, x))
        )
        stream = torch_stream()
        if n not in ctx.gemm_us:
            k, m = self.cfg.emb_dim, self.cfg.kv_dim
            us = ctx.gemm_us[n] = eager_us(lambda i: emb @ tf.wkv_t, stream)[0]
            print(
                f"cuBLAS bf16 GEMM [{n} x {k}] @ [{k} x {m}] (torch matmul): {us:.0f} us, "
                f"{2 * n * k * m / us / 1e6:.0f} TFLOP/s",
                flush=True,
            )
        out = [
            eager_us(lambda i: tf.prefill(toks[i % POOL]), stream),
            eager_us(lambda i: tf.prefill(toks[i % POOL], x), stream),
        ]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return out


def run_placement(ctx: Ctx, data: Synthetic, cfg: EngramConfig, where: str) -> Results | None:
    """Build the table in ``where``, measure every row, free it; None where it has no room."""
    gpu, s = ctx.gpu, ctx.stream
    nbytes = cfg.num_embeddings[0] * row_stride(cfg.head_dim)
    why = no_room(gpu, where, nbytes)
    if why is not None:
        print(f"bench.engram: {where} table skipped: {why}", flush=True)
        return None
    t0 = time.perf_counter()
    try:
        weights = EngramWeights.from_arrays(
            gpu, cfg, data.token_map, [data.table], [data.wkv], [data.q], [data.k], placement=where, stream=s
        )
    except CudaError as exc:  # a driver that will not pin or allocate it: say so, go on
        print(f"bench.engram: {where} table skipped: {exc}", flush=True)
        return None
    built = time.perf_counter() - t0
    table = weights.layers[0].table
    print(
        f"{where} table built in {built:.1f} s by EngramWeights.from_arrays: {table.rows} rows, "
        f"{table.nbytes / 1e9:.1f} GB at {table.nbytes / built / 1e9:.2f} GB/s (allocation, packing, copies; "
        f"wkv dequantised and uploaded){' (over 60 s)' if built > 60 else ''}",
        flush=True,
    )
    place = Placement(ctx, weights, where)
    dec = EngramDecoder(weights, max_seqs=max(BATCHES), max_rows=MAX_ROWS, stream=s)
    staged = (
        EngramDecoder(weights, max_seqs=1, max_rows=MAX_ROWS, stream=s, host_threads=HOST_THREADS)
        if where == "host"
        else None
    )
    try:
        for b in BATCHES:
            place.decode(dec, b)
        for n in PREFILLS:
            place.prefill(dec, n, staged)
        print(f"{where} table: decoder errors after all calls: {dec.check_errors()!r}", flush=True)
    finally:
        gpu.synchronize(s)
        if ctx.torch is not None:
            place.tf = None
            ctx.torch.cuda.synchronize()
            ctx.torch.cuda.empty_cache()
        dec.close()
        if staged is not None:
            print(f"{where} table: staged decoder errors after all calls: {staged.check_errors()!r}", flush=True)
            staged.close()
        t0 = time.perf_counter()
        weights.close()
        print(f"{where} table freed in {time.perf_counter() - t0:.1f} s", flush=True)
    return place.out


# -- report --------------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(rows: Sequence[Row]) -> list[tuple[str, str, str, int, float | None, str]]:
    """Issue 50's targets over ``rows``: (target, table, call, tokens, value, "met" / "missed" / "-")."""

    out = []
    for r in rows:
        faster = ratio(r.torch, r.ours)
        if r.part in ("overlapped", STAGED, BUSY):
            continue  # issue 51's (overlap_targets, host_read_targets)
        if r.part == "whole":
            what, value, met = "whole step never slower than the torch form", faster, (faster or 0) >= 1
        elif r.placement != "host":
            continue  # the lookup's targets are for host tables
        elif r.call == "decode":
            what, value, met = (
                f"lookup >= {LOOKUP_X_TORCH:g}x the torch form's",
                faster,
                (faster or 0) >= LOOKUP_X_TORCH,
            )
        else:
            what, value = f"lookup <= {LOOKUP_X_FLOOR:g}x its rows' read floor", r.ours / r.floor
            met = r.ours <= LOOKUP_X_FLOOR * r.floor
        out.append((what, r.placement, r.call, r.tokens, value, "-" if value is None else "met" if met else "missed"))
    return out


def overlap_targets(rows: Sequence[Row]) -> list[tuple[str, str, str, int, float | None, str]]:
    """Issue 51's overlap target: at each B, the overlapped step with host tables within
    ``OVERLAP_X_DEVICE`` x of it with device tables (value: host / device; "-" where either table
    did not run)."""
    step = {(r.placement, r.tokens): r.ours for r in rows if r.part == "overlapped"}
    out = []
    for b in sorted({tokens for _, tokens in step}):
        value = ratio(step.get(("host", b)), step.get(("device", b)))
        met = "-" if value is None else "met" if value <= OVERLAP_X_DEVICE else "missed"
        out.append((f"overlapped step, host <= {OVERLAP_X_DEVICE:g}x device", "both", "decode", b, value, met))
    return out


@contextlib.contextmanager
def busy_interpreter() -> Iterator[None]:
    """A thread that runs Python bytecodes (a counting loop) until the block ends: an engine's main
    thread busy in Python, which holds the GIL between its switch intervals."""
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def host_read_targets(places: Sequence[Results]) -> list[tuple[str, str, str, int, float | None, str]]:
    """Issue 51's host reads: each prefill lookup with the host table (staged: the host's threads
    gather the rows) at least ``HOST_ROWS_GBS`` GB/s of rows, and at least ``HOST_X_SMALL`` x the
    GPU's read rate over a small table of the same memory."""
    out: list[tuple[str, str, str, int, float | None, str]] = []
    for p in places:
        for r in p.rows:
            if p.where != "host" or r.call != "prefill" or r.part != STAGED:
                continue
            assert r.read_gbs is not None  # a lookup row: its floor's rate over the same rows' bytes
            gbs = r.read_gbs * r.floor / r.ours
            small = p.small_gbs.get(r.tokens)
            out.append(
                (
                    f"host lookup >= {HOST_ROWS_GBS:g} GB/s of rows",
                    "host",
                    "prefill",
                    r.tokens,
                    gbs,
                    "met" if gbs >= HOST_ROWS_GBS else "missed",
                )
            )
            value = ratio(gbs, small)
            met = "-" if value is None else "met" if value >= HOST_X_SMALL else "missed"
            out.append(
                (f"host lookup >= {HOST_X_SMALL:g}x the small-table rate", "host", "prefill", r.tokens, value, met)
            )
    return out


def report(places: Sequence[Results]) -> None:
    """Each placement's table, then issue 50's targets."""
    for p in places:
        checks = p.checks
        if checks:
            kv, residual = max(c.kv_rel for c in checks), max(c.residual_rel for c in checks)
            worst = (
                f"emb {sum(c.emb_differ for c in checks)} of {sum(c.values for c in checks)} values differ, "
                f"max |diff| / max |value| of kv {kv:.3g} and of the residual {residual:.3g} "
                f"(bound {BOUND:.3g}): {'ok' if all(c.ok for c in checks) else 'MISMATCH'}"
            )
        else:
            worst = "not checked (no torch)"
        print_table(
            f"Engram layer {LAYER} at DeepSeek-V4.1-Flash's dims, table in {p.where} memory "
            f"({p.table_rows} rows, {p.table_bytes / 1e9:.1f} GB)",
            [
                "call",
                "tokens",
                "part",
                "ours us",
                "torch us",
                "torch/ours",
                "floor us",
                "ours/floor",
                "floor GB/s",
                "gate expired",
            ],
            [
                (
                    r.call,
                    r.tokens,
                    r.part,
                    r.ours,
                    r.torch,
                    ratio(r.torch, r.ours),
                    r.floor,
                    r.ours / r.floor,
                    r.read_gbs,
                    r.late,
                )
                for r in p.rows
            ],
            note="Each row is one call (the module's help defines them): decode = graph replays of B sequences' steps, "
            "prefill = one eager prompt of S tokens; lookup = hash, gather, dequantisation; whole = lookup, wkv "
            "projection, gate; overlapped = the step on a side stream beside a stand-in, then the gate (floor: the "
            "stand-in alone); ours and the torch form's GPU us, torch/ours (> 1: ours faster), the floor (lookup: "
            "the rows read at random over this table's memory, at the GB/s beside it; whole: that, the projection "
            "and the residual's bytes) and ours over it. Checked against the torch form, every row's first call: "
            + worst,
        )
    rows = [r for p in places for r in p.rows]
    found = targets(rows)
    print_table(
        "issue 50's targets",
        ["target", "table", "call", "tokens", "value", "met"],
        found,
        note=f"Each row is one target over one row above: the lookup with host tables at B = 1 and 64 at least "
        f"{LOOKUP_X_TORCH:g}x faster than the torch form's (value: torch/ours), at 1024 and 8192 tokens within "
        f"{LOOKUP_X_FLOOR:g}x of its rows' read floor (value: ours/floor), the whole step never slower than the "
        "torch form's (value: torch/ours); '-': not measured (no torch).",
    )
    print_table(
        "issue 51's overlap target",
        ["target", "table", "call", "tokens", "value", "met"],
        overlap_targets(rows),
        note=f"Each row is one B: the overlapped step (a side stream's step beside a {STANDIN_BYTES >> 20} MiB "
        f"memset, then the gate) with the host table over the same with the device table, at most "
        f"{OVERLAP_X_DEVICE:g}x; '-': one of the tables did not run (the device table needs an H200 at the real "
        "dims; --rows makes a table both hold).",
    )
    reads = host_read_targets(places)
    small = {n: gbs for p in places for n, gbs in p.small_gbs.items()}
    print_table(
        "issue 51's host-read targets",
        ["target", "table", "call", "tokens", "value", "met"],
        reads,
        note=f"Each row is one prefill lookup with the host table, staged (the host's {HOST_THREADS} threads "
        f"gather the rows, engram.HostStaging): its GB/s of rows (the rows' bytes, as its floor counts them, "
        f"over its us) at least {HOST_ROWS_GBS:g}, and that over the GPU's random-read rate of a "
        f"{SMALL_BYTES >> 30} GiB table of the same memory "
        f"({', '.join(f'{n} tokens: {g:.1f} GB/s' for n, g in small.items()) or 'not measured'}) at least "
        f"{HOST_X_SMALL:g}. The rows 'lookup' above read them in place (the GPU); '{BUSY}': staged while "
        "another thread runs a Python loop.",
    )
    found = found + reads
    counts = {v: sum(t[-1] == v for t in found) for v in ("met", "missed", "-")}
    print(f"targets: {counts['met']} met, {counts['missed']} missed, {counts['-']} not measured", flush=True)
    if not any(r.placement == "host" for r in rows):
        print("targets: the host table did not run: its lookup targets were not measured", flush=True)


# -- the command line ----------------------------------------------------------------------------
def make_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, "bench.engram")
    parser.add_argument(
        "--rows",
        type=positive_int,
        default=REAL_ROWS,
        help=f"about this many table rows (default the real {REAL_ROWS}; others: a quick check)",
    )
    parser.add_argument(
        "--placements",
        type=some_of(PLACEMENTS),
        default=",".join(PLACEMENTS),
        help=f"table placements, comma-separated, run in this order (default {','.join(PLACEMENTS)})",
    )
    return parser


def main(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    cfg = engram_config(args.rows)
    ends = (int(cfg.primes[0, 0]), int(cfg.primes[0, -1]))
    says = "a smaller table" if args.rows != REAL_ROWS else "the real ones" if ends == REAL_PRIMES else "MISMATCH"
    print(
        f"config: layer {LAYER}: {cfg.n_hash_cols} prime buckets {ends[0]}..{ends[1]} summing to "
        f"{cfg.num_embeddings[0]} rows ({says}; the real: {REAL_PRIMES[0]}..{REAL_PRIMES[1]}, {REAL_ROWS})",
        flush=True,
    )
    rng = np.random.default_rng(50)
    t0 = time.perf_counter()
    data = synthetic(cfg, rng)
    residual = (MAX_ROWS, cfg.hc_mult, cfg.hidden_size)
    x0 = rng.standard_normal(residual, np.float32).astype(BF16)
    print(f"synthetic pools, wkv, token map and residual made in {time.perf_counter() - t0:.1f} s", flush=True)
    torch = torch_or_none()
    if torch is None:
        print("torch with CUDA not available: the torch form's columns and the checks are skipped", flush=True)
    with CudaBackend() as gpu:
        stream = gpu.create_stream()
        bw = copy_bandwidth(gpu)
        gate()  # its device buffers held before any room is counted
        avail = host_available()
        print(
            f"measured: copy {bw / 1e12:.2f} TB/s; {gpu.name}, {gpu.mem_info()[0] / GIB:.0f} GiB free; host memory "
            f"{'unknown' if avail is None else f'{avail / GIB:.0f} GiB'} available",
            flush=True,
        )
        sink = gpu.alloc(4 << 20)
        x = DeviceArray.empty(gpu, residual, BF16, stream)
        ctx = Ctx(gpu, stream, rng, bw, x0, x, sink, narrow_kernel(gpu), torch, rng.integers(0, R, ORDER))
        places = []
        try:
            for where in args.placements:
                place = run_placement(ctx, data, cfg, where)
                if place is not None:
                    places.append(place)
        finally:
            gpu.synchronize(stream)
            x.free()
            gpu.free(sink)
    report(places)
    print(f"bench.engram: {time.perf_counter() - start:.0f} s in all", flush=True)


if __name__ == "__main__":
    run(main, make_parser())
