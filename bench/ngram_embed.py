"""The n-gram embedding, seed-faithful and fused paths: GPU and wall time per call, torch, floors.

Configuration (issue 5): D = 4096, N = 3, K = 8 (T = 16 tables), table dim 256, 2^20 + 2c rows
per table (8 GiB of bf16 tables), vocab 128k; S new tokens after a 4096-token context.
Seed-faithful table: torch eager runs the same algorithm (index, linear, add per table) on the
same device memory. Fused table: torch runs the fused form (one gather from the tables stacked
into one tensor, one linear against the concatenated projections, word row, scale). Fused GPU
us are measured back to back behind a gate (bench.common.gated_gpu_us), the graph row by
replaying the captured graph; wall us is host time per call including synchronisation.
``--only-fused`` (or NGRAM_BENCH=fused) skips the seed-faithful table.
Floors: bytes the call must move over the measured copy bandwidth (word rows, table rows, the
projections read once, out written once), and FLOPs over the measured cuBLAS bf16 rate.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from bench.common import (
    bench_parser,
    copy_bandwidth,
    gated_gpu_us,
    gpu_time_ms,
    host_time_us,
    interleaved_times_us,
    matmul_rate,
    print_table,
    run,
    torch_or_none,
    torch_stream,
    torch_time_ms,
    wall_time_us,
)
from gpu_runtime import CudaBackend, DeviceArray, DeviceBuffer
from layers.dense_weight import BF16, DenseWeight
from layers.ngram_embed import FusedNgramEmbedding, NgramDims, NgramEmbedding, NgramTable, NgramWeights, ngram_ids_tail
from layers.ngram_embed.tables import Bf16Table

SEQ_LENS = (1, 16, 128, 2048, 8192)
CONTEXT = 4096


def device_weight(gpu: CudaBackend, rng: np.random.Generator, rows: int, cols: int, scale: float) -> DenseWeight:
    """A bf16 weight filled by tiling one random 32 MiB block (cheap to make at 8 GiB)."""
    block = (rng.standard_normal(min(rows * cols, 1 << 24)) * scale).astype(np.float32).astype(BF16)
    buf = DeviceBuffer(gpu, rows * cols * 2)
    total = rows * cols
    for off in range(0, total, block.size):
        gpu.copy_h2d_async(block[: min(block.size, total - off)], buf.ptr + 2 * off)
    return DenseWeight.owning(gpu, buf, (rows, cols), BF16)


def torch_view(gpu: CudaBackend, w: DenseWeight):
    """The same device memory as a torch bf16 tensor (no copy)."""
    torch = torch_or_none()
    arr = DeviceArray(gpu, w.weight, w.shape, np.int16)
    return torch.as_tensor(arr, device="cuda").view(torch.bfloat16)


def bf16_tables(weights: NgramWeights) -> list[DenseWeight]:
    """The weights of ``weights``' tables, every one a device bf16 table (``NgramTable.Bf16``)."""
    tables = [tb.weight for tb in weights.tables if isinstance(tb, Bf16Table)]
    assert len(tables) == len(weights.tables), "device bf16 tables only"
    return tables


DIMS = NgramDims(
    vocab_size=131072,
    hidden_size=4096,
    max_ngram=3,
    splits=8,
    base_rows=1 << 20,
    row_bias=0,
    table_dim=256,
    eos_id=None,
)


def make_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, "bench.ngram_embed")
    parser.add_argument(
        "--only-fused",
        action="store_true",
        default=os.environ.get("NGRAM_BENCH", "all") == "fused",
        help="skip the seed-faithful table (default: set by NGRAM_BENCH=fused)",
    )
    return parser


def main(args: argparse.Namespace) -> None:
    only_fused = args.only_fused
    rng = np.random.default_rng(0)
    dims = DIMS
    t, h, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
    with CudaBackend() as gpu:
        bw, rate = copy_bandwidth(gpu), matmul_rate()
        bare = bare_launch_us(gpu)
        word = device_weight(gpu, rng, dims.vocab_size, h, 1.0)
        tables = [NgramTable.Bf16(device_weight(gpu, rng, dims.table_rows(c), td, 1.0)) for c in range(t)]
        projs = [device_weight(gpu, rng, h, td, td**-0.5) for _ in range(t)]
        weights = NgramWeights(dims, word, tables, projs, gpu)
        weights.own(word, *(tb.weight for tb in tables), *projs)
        layer = NgramEmbedding(weights, max(SEQ_LENS))
        gpu.synchronize(0)  # uploaded on the default stream; the fused path reads them on `stream`
        stream = gpu.create_stream()
        out = gpu.alloc(max(SEQ_LENS) * h * 2)
        torch = torch_or_none()
        if torch is not None:
            t_word = torch_view(gpu, word)
            t_tables = [torch_view(gpu, tb.weight) for tb in tables]
            t_projs = [torch_view(gpu, p) for p in projs]
            F = torch.nn.functional
        rows = []
        seed_lens = () if only_fused else SEQ_LENS
        for s in seed_lens:
            contexts = [rng.integers(0, dims.vocab_size, CONTEXT + s) for _ in range(8)]
            call = lambda i: layer.embed(contexts[i % 8], s, out, gpu, stream)  # noqa: E731
            gpu_ms = gpu_time_ms(call, stream=stream, warmup=3, iters=20)
            wall_us = wall_time_us(call, lambda: gpu.synchronize(stream), warmup=3, iters=20)
            t0 = time.perf_counter()
            for i in range(20):
                ngram_ids_tail(dims, contexts[i % 8], s)
            hash_us = (time.perf_counter() - t0) / 20 * 1e6
            moved = s * h * 2 + s * t * td * 2 + t * h * td * 2 + s * h * 2
            flops = 2 * s * h * td * t
            floor_ms = max(moved / bw, flops / rate if rate else 0.0) * 1e3
            host_floor = (2 + 3 * t) * bare + hash_us  # its launches at the bare launch's cost, and its hashing
            torch_ms = None
            if torch is not None:
                inv = 1.0 / (1 + t)

                def torch_call(i: int, contexts=contexts, s=s, inv=inv):
                    # as ours: from the tokens, hashed on the host and uploaded inside the call
                    ctx = contexts[i % 8]
                    ids = [torch.from_numpy(x.astype(np.int64)).cuda() for x in ngram_ids_tail(dims, ctx, s)]
                    new = torch.from_numpy(ctx[-s:].astype(np.int64)).cuda()
                    o = torch.zeros(s, h, device="cuda", dtype=torch.bfloat16)
                    o.add_(t_word[new], alpha=inv)
                    for c in range(t):
                        o.add_(F.linear(t_tables[c][ids[c]], t_projs[c]), alpha=inv)
                    return o

                torch_ms = torch_time_ms(torch_call, warmup=3, iters=20)
            rows.append(
                (
                    s,
                    gpu_ms * 1e3,
                    wall_us,
                    hash_us,
                    torch_ms * 1e3 if torch_ms else None,
                    torch_ms / gpu_ms if torch_ms else None,
                    floor_ms * 1e3,
                    gpu_ms / floor_ms,
                    host_floor,
                    wall_us / host_floor,
                )
            )
        print(
            f"measured: copy {bw / 1e12:.2f} TB/s, bf16 matmul "
            f"{rate / 1e12 if rate else float('nan'):.0f} TFLOP/s, bare launch {bare:.2f} us (host); "
            f"T = {t}, D = {h}, table dim {td}"
        )
        if rows:
            print_table(
                "n-gram embedding, seed-faithful path (per call)",
                [
                    "S",
                    "GPU us",
                    "wall us",
                    "hash us",
                    "torch us",
                    "torch/ours",
                    "floor us",
                    "x floor",
                    "launch floor us",
                    "wall x launch floor",
                ],
                rows,
                note="Each row is one call embedding S new tokens: GPU us (CUDA events around one call, so "
                "the host's hashing and 2 + 3T launches inside it count: this path is host-bound) and "
                "wall us (host, synchronised) per call, hash us the host's n-gram hashing alone, torch "
                "eager's time (the same events; it hashes the ids on the host and uploads them inside the call, "
                "as ours does) and torch/ours (> 1: ours is faster), the floor us and GPU us over it, and the "
                "launch floor: its 2 + 3T launches at the bare cuLaunchKernel's host cost (bench.launch's floor, "
                "measured in this run) plus its hashing, and the wall us over it.",
            )
        fused_table(gpu, rng, dims, weights, out, stream, bw, rate)
        layer.close()
        weights.close()


def bare_launch_us(gpu: CudaBackend) -> float:
    """Host us of a bare ``cuLaunchKernel`` with prebuilt arguments (bench.launch's floor), here."""
    from bench.launch import N, bare_launcher
    from layers.kernel_files import load_kernel

    stream = gpu.create_stream()
    out, x = gpu.alloc(2 * N), gpu.alloc(2 * N)
    try:
        gpu.memset(out, 0, 2 * N)
        gpu.memset(x, 0, 2 * N)
        bare = bare_launcher(gpu, load_kernel(gpu, "residual_add", "bf16_scaled_add"), out, x, stream)
        best = []
        for _ in range(3):
            best.append(host_time_us(bare))
            gpu.synchronize(stream)
        return min(best)
    finally:
        gpu.free(out)
        gpu.free(x)
        gpu.destroy_stream(stream)


def floor_us(dims: NgramDims, s: int, bw: float, rate: float | None) -> float:
    t, h, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
    moved = s * h * 2 + s * t * td * 2 + t * h * td * 2 + s * h * 2
    return max(moved / bw, 2 * s * h * td * t / rate if rate else 0.0) * 1e6


def fused_table(
    gpu: CudaBackend,
    rng: np.random.Generator,
    dims: NgramDims,
    weights: NgramWeights,
    out: int,
    stream: int,
    bw: float,
    rate: float | None,
) -> None:
    t, td = dims.num_tables(), dims.table_dim()
    fused = FusedNgramEmbedding(weights, max(SEQ_LENS), stream)
    torch = torch_or_none()
    if torch is not None:
        stacked = torch.cat([torch_view(gpu, w) for w in bf16_tables(weights)])  # 8 GiB more
        offsets = torch.tensor(np.cumsum([0] + [dims.table_rows(c) for c in range(t - 1)]), device="cuda")
        w_cat = torch.cat([torch_view(gpu, p) for p in weights.projs], dim=1)
        t_word = torch_view(gpu, weights.word)
    rows = []
    for s in SEQ_LENS:
        contexts = [rng.integers(0, dims.vocab_size, CONTEXT + s) for _ in range(8)]
        eager = lambda i: fused.embed(contexts[i % 8], s, out, stream)  # noqa: E731
        graph = lambda i: fused.embed(contexts[i % 8], s, out, stream, graph=True)  # noqa: E731
        sync = lambda: gpu.synchronize(stream)  # noqa: E731
        eager_us, late = gated_gpu_us(eager, stream=stream)
        eager_wall = wall_time_us(eager, sync, warmup=3, iters=30)
        ((graph_wall, graph_host),) = interleaved_times_us([graph], sync, warmup=5, iters=60)
        exe = fused.captured_graph(s, out, stream)
        assert exe is not None  # captured by the graph=True calls just above
        graph_us, late2 = gated_gpu_us(lambda i: gpu.launch_graph(exe, stream), stream=stream)
        torch_us = None
        if torch is not None:
            ids = [
                torch.from_numpy(np.stack(ngram_ids_tail(dims, ctx, s), 1).astype(np.int64)).cuda() + offsets
                for ctx in contexts
            ]
            new = [torch.from_numpy(ctx[-s:].astype(np.int64)).cuda() for ctx in contexts]
            inv = 1.0 / (1 + t)

            def torch_fused(i: int):
                gathered = stacked[ids[i % 8].reshape(-1)].reshape(s, t * td)
                return (torch.nn.functional.linear(gathered, w_cat) + t_word[new[i % 8]]) * inv

            torch_us, late3 = gated_gpu_us(torch_fused, stream=torch_stream())  # as ours: back to back
            late2 += late3
        floor = floor_us(dims, s, bw, rate)
        # ratios from the eager call: it and torch rotate over the same 8 contexts, while the graph
        # replays gather one captured input's rows again and again
        rows.append(
            (
                s,
                eager_us,
                graph_us,
                eager_wall,
                graph_wall,
                graph_host,
                torch_us,
                torch_us / eager_us if torch_us else None,
                floor,
                eager_us / floor,
                eager_wall / eager_us,
                late + late2,
            )
        )
    print_table(
        "n-gram embedding, fused path (per call)",
        [
            "S",
            "GPU us",
            "graph GPU us",
            "wall us",
            "graph wall us",
            "graph host us",
            "torch fused us",
            "torch/ours",
            "floor us",
            "x floor",
            "wall/GPU",
            "gate expired",
        ],
        rows,
        note="Each row is one call embedding S new tokens: GPU us eager and as a graph replay (back to back; "
        "the replays repeat one captured input), wall us synchronised and graph host us until the call "
        "returned, torch's fused form (back to back behind the same gate, its ids hashed on the host "
        "beforehand) and torch/ours against our eager GPU us, the floor us (the 32 MiB of projections "
        "counted from HBM, though back to back they stay in L2) and the eager GPU us over it, the eager "
        "call's wall us over its GPU us, and the gates expired.",
    )

    # Batched decode: 256 sequences, one new token each, one call.
    n_seq = 256
    contexts = [rng.integers(0, dims.vocab_size, CONTEXT + int(rng.integers(0, 512))) for _ in range(n_seq)]
    batch = lambda i: fused.embed_batch(contexts, [1] * n_seq, out, stream)  # noqa: E731
    batch_graph = lambda i: fused.embed_batch(contexts, [1] * n_seq, out, stream, graph=True)  # noqa: E731
    sync = lambda: gpu.synchronize(stream)  # noqa: E731
    wall = wall_time_us(batch, sync, warmup=3, iters=30)
    gwall = wall_time_us(batch_graph, sync, warmup=3, iters=30)
    gpu_us, late = gated_gpu_us(batch, stream=stream, batch=4)
    floor = floor_us(dims, n_seq, bw, rate)
    print_table(
        f"batched decode: {n_seq} sequences x 1 token, one call",
        [
            "GPU us",
            "wall us",
            "graph wall us",
            "GPU us / seq",
            "graph wall us / seq",
            "floor us",
            "x floor",
            "gate expired",
        ],
        [(gpu_us, wall, gwall, gpu_us / n_seq, gwall / n_seq, floor, gpu_us / floor, late)],
        note=f"One row: one embed_batch call of {n_seq} sequences: GPU us, wall us eager and with graph=True, "
        "per call and per sequence, the floor us and GPU us over it, and the gates expired.",
    )
    fused.close()


if __name__ == "__main__":
    run(main, make_parser())
