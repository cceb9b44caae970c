"""Tensor parallelism over two GPUs (NCCL, one process): per-GPU table memory; decode (batch 1 and
64 sequences, one token each) and prefill (S = 8192) at TP = 2 against TP = 1; and the
all-reduce's share of the step against its bytes at NCCL's measured bus bandwidth.

bench.ngram_embed's configuration (D = 4096, T = 16 tables of 2^20 rows x 256, vocab 128k).
Times are host wall time per step with both GPUs synchronised (median), the view an engine has
of one eager call; TP = 1 is ``FusedNgramEmbedding`` over the full ``NgramWeights`` on GPU 0,
TP = 2 one ``FusedNgramEmbedding`` per GPU over its shard's weights (``shard=``), driven by
``embed_all``. Bus bandwidth is NCCL's convention, 2 (P-1)/P x bytes / time, from a 256 MiB
all-reduce. Needs two GPUs and the ``multi-gpu`` extra; with one GPU, or without the extra, prints
why and exits 0 (without any GPU, as every benchmark, one line and status 1).
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.common import bench_parser, print_table, run, wall_time_us
from bench.ngram_embed import CONTEXT, DIMS, device_weight
from gpu_runtime import CudaBackend, device_count
from layers.ngram_embed import FusedNgramEmbedding, NgramShard, NgramTable, NgramWeights, embed_all, reduce_bytes

STEPS = (("decode, batch 1", 1, 1), ("decode, batch 64", 64, 1), ("prefill", 1, 8192))
MAX_ROWS = 8192
BUS_BYTES = 256 << 20


def _unavailable() -> str | None:
    if device_count() < 2:
        return f"needs 2 GPUs, this machine has {device_count()}"
    try:
        from layers.tensor_parallel import nccl

        nccl._nccl()
    except ImportError as exc:
        return str(exc)
    return None


def _weights(gpu: CudaBackend, rng: np.random.Generator, shard: NgramShard | None) -> NgramWeights:
    """Random weights on ``gpu`` (a rank's: its word rows and tables, Absent where another rank
    holds them), owning their device buffers."""
    dims, h, td = DIMS, DIMS.hidden_size, DIMS.table_dim()
    rows = dims.vocab_size if shard is None else shard.word_rows
    word = device_weight(gpu, rng, rows, h, 1.0)
    tables = [
        NgramTable.Bf16(device_weight(gpu, rng, dims.table_rows(c), td, 1.0))
        if shard is None or c in shard.tables
        else NgramTable.Absent(dims.table_rows(c), td)
        for c in range(dims.num_tables())
    ]
    projs = [device_weight(gpu, rng, h, td, td**-0.5) for _ in range(dims.num_tables())]
    weights = NgramWeights(dims, word, tables, projs, gpu, shard=shard)
    weights.own(word, *(t.weight for t in tables if not isinstance(t, NgramTable.Absent)), *projs)
    return weights


def _table_gib(tables) -> float:
    return (
        sum(t.weight.shape[0] * t.weight.shape[1] * 2 for t in tables if not isinstance(t, NgramTable.Absent)) / 2**30
    )


def make_parser() -> argparse.ArgumentParser:
    return bench_parser(
        __doc__,
        "bench.tensor_parallel",
        "Needs two CUDA GPUs and the multi-gpu extra (pip install '.[multi-gpu]'); with one GPU, "
        "or without the extra, it says why and exits 0.",
    )


def main(args: argparse.Namespace) -> None:
    why = _unavailable()
    if why:
        print(f"bench.tensor_parallel: skipped: {why}")
        return
    from layers.tensor_parallel import nccl

    rng = np.random.default_rng(0)
    gpus = [CudaBackend(d) for d in range(2)]
    streams = [g.create_stream() for g in gpus]
    dims = DIMS
    full = _weights(gpus[0], rng, None)
    shards = [_weights(g, rng, NgramShard.of(dims, r, 2)) for r, g in enumerate(gpus)]
    for g in gpus:
        g.synchronize(0)  # uploaded on the default stream; the runners read them on theirs
    single = FusedNgramEmbedding(full, MAX_ROWS, streams[0])
    ranks = [FusedNgramEmbedding(w, MAX_ROWS, s) for w, s in zip(shards, streams)]  # embed_all drives them
    group = nccl.NcclGroup(gpus)
    outs = [g.alloc(MAX_ROWS * dims.hidden_size * 2) for g in gpus]

    def sync() -> None:
        for g, s in zip(gpus, streams):
            g.synchronize(s)

    print(
        f"tables per GPU: TP = 1 {_table_gib(full.tables):.2f} GiB; TP = 2 "
        + ", ".join(f"rank {r} {_table_gib(w.tables):.2f} GiB" for r, w in enumerate(shards))
    )
    big = gpus[0].alloc(BUS_BYTES), gpus[1].alloc(BUS_BYTES)
    bus_us = wall_time_us(
        lambda i: group.allreduce_bf16_all([(big[r], BUS_BYTES // 2, streams[r]) for r in range(2)]),
        sync,
        warmup=3,
        iters=10,
    )
    bus_bw = 2 * (2 - 1) / 2 * BUS_BYTES / (bus_us * 1e-6)
    print(f"NCCL all-reduce of {BUS_BYTES >> 20} MiB: {bus_us:.0f} us, bus bandwidth {bus_bw / 1e9:.0f} GB/s")

    rows = []
    for label, seqs, s in STEPS:
        contexts = [rng.integers(0, dims.vocab_size, CONTEXT + s) for _ in range(seqs)]
        lens = [s] * seqs
        n = seqs * s
        tp1 = wall_time_us(lambda i: single.embed_batch(contexts, lens, outs[0], streams[0]), sync, warmup=3, iters=20)
        tp2 = wall_time_us(lambda i: embed_all(group, ranks, contexts, lens, outs, streams), sync, warmup=3, iters=20)
        count = ranks[0].projection.reduce_count(n)
        ar = wall_time_us(
            lambda i: group.allreduce_bf16_all([(int(rk.projection.buf), count, st) for rk, st in zip(ranks, streams)]),
            sync,
            warmup=3,
            iters=20,
        )
        at_bw = 2 * (2 - 1) / 2 * count * 2 / bus_bw * 1e6
        rows.append(
            (label, n, tp1, tp2, tp1 / tp2, reduce_bytes(dims, n)["gathered rows (bf16)"] >> 10, ar, ar / tp2, at_bw)
        )
    print_table(
        "TP = 2 against TP = 1 (wall us per step, both GPUs synchronised)",
        [
            "step",
            "rows",
            "TP=1 us",
            "TP=2 us",
            "TP1/TP2",
            "all-reduce KiB",
            "all-reduce us",
            "share of TP=2",
            "at bus bw us",
        ],
        rows,
        note="Each row is one step shape: rows embedded, median wall us per step at TP = 1 and TP = 2 and "
        "the speed-up, then the all-reduce: its KiB, its wall us alone, its share of the TP = 2 step, and "
        "its time at the measured bus bandwidth.",
    )
    sync()
    group.close()
    for runner in (*ranks, single):
        runner.close()
    for weights in (*shards, full):
        weights.close()
    for g, o, b in zip(gpus, outs, big):
        g.free(o)
        g.free(b)


if __name__ == "__main__":
    run(main, make_parser())
