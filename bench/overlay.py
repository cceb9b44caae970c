"""LoRA token-overlay benchmark: the embed overlay and the LM-head overlay at serving size.

h = 4096, 256 tokens, 4 adapters of 64 override rows each (embedding and LM head), vocab 128k,
tokens routed round-robin to the 4 adapters (one batch, several adapters). Reported against the
measured device copy bandwidth, and the embed overlay against the plain embed gather
(``batched_embed``) it follows.

The kernels take microseconds, less than a Python launch, so timing each launch between two
events would measure the host. Instead each measurement first holds the stream behind a large
device copy on a side stream (which also flushes L2), queues ``BATCH`` launches, records the
events around them, and releases: the GPU then runs them back to back, as in an engine's
forward. Each launch in a batch uses another of ``BATCH`` input sets (more bytes than L2).

    python -m bench.overlay
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from bench.common import bench_parser, copy_bandwidth, gated_gpu_us, matmul_rate, print_table, run
from gpu_runtime import CudaBackend, DevicePtr
from layers.kernel_files import try_kernel
from layers.ops.token_overlay import OverlayKernels
from layers.overlay import AdapterOverlay, OverlaySlots, TableOverlay

BF16 = np.dtype(ml_dtypes.bfloat16)
H, TOKENS, ADAPTERS, OVERRIDES, VOCAB = 4096, 256, 4, 64, 131072
BATCH = 32  # launches per measurement, one input set each
ITERS, WARMUP = 15, 3


@dataclass
class Timing:
    us: float  # median GPU time per launch (or per launch group)
    gate_expired: int  # measurements whose gate ran out before the batch was queued


def batched_time(stream: int, launch: Callable[[int], None]) -> Timing:
    """Median GPU time of one ``launch(i)`` (i = input set), launches run back to back."""
    us, expired = gated_gpu_us(lambda i: launch(i % BATCH), stream=stream, batch=BATCH, warmup=WARMUP, iters=ITERS)
    return Timing(us, expired)


@dataclass
class InputSet:
    slots: OverlaySlots
    seq_slot: DevicePtr  # int32[TOKENS], round-robin over the adapters
    ids_hit: DevicePtr  # uint32[TOKENS], every token an overridden id, each row read once
    ids_miss: DevicePtr  # uint32[TOKENS], random ids (overrides hit by chance only)
    out: DevicePtr  # bf16 [TOKENS, H]
    hidden: DevicePtr  # bf16 [TOKENS, H]
    logits_bf16: DevicePtr  # bf16 [TOKENS, VOCAB]
    logits_f32: DevicePtr  # f32 [TOKENS, VOCAB]


def make_set(
    gpu: CudaBackend, rng: np.random.Generator, kernels: OverlayKernels, owned: list[DevicePtr], stream: int
) -> InputSet:
    def upload(host: np.ndarray) -> DevicePtr:
        ptr = gpu.alloc(host.nbytes)
        owned.append(ptr)
        gpu.copy_h2d_async(host, ptr, stream)
        return ptr

    def alloc(nbytes: int) -> DevicePtr:
        ptr = gpu.alloc(nbytes)
        owned.append(ptr)
        return ptr

    slots = OverlaySlots(gpu, ADAPTERS, VOCAB, H, kernels=kernels, stream=stream)
    seq = np.arange(TOKENS, dtype=np.int32) % ADAPTERS
    ids_hit = np.empty(TOKENS, np.uint32)
    for s in range(ADAPTERS):
        emb_ids = rng.choice(VOCAB, OVERRIDES, replace=False)
        lm_ids = rng.choice(VOCAB, OVERRIDES, replace=False)
        rows = lambda: rng.standard_normal((OVERRIDES, H), np.float32).astype(BF16)  # noqa: E731
        slots.load(s, AdapterOverlay(TableOverlay.of(emb_ids, rows()), TableOverlay.of(lm_ids, rows())), stream)
        mine = np.flatnonzero(seq == s)
        ids_hit[mine] = rng.permutation(emb_ids)[: mine.size]
    return InputSet(
        slots=slots,
        seq_slot=upload(seq),
        ids_hit=upload(ids_hit),
        ids_miss=upload(rng.integers(0, VOCAB, TOKENS).astype(np.uint32)),
        out=alloc(TOKENS * H * 2),
        hidden=upload(rng.standard_normal((TOKENS, H), np.float32).astype(BF16)),
        logits_bf16=alloc(TOKENS * VOCAB * 2),
        logits_f32=alloc(TOKENS * VOCAB * 4),
    )


def make_parser() -> argparse.ArgumentParser:
    return bench_parser(__doc__, "bench.overlay")


def main(args: argparse.Namespace) -> None:
    gpu = CudaBackend()
    rng = np.random.default_rng(0)
    kernels = OverlayKernels.new(gpu)
    if not kernels.embed_overlay:
        raise SystemExit("kernels/token_overlay.cu is missing: nothing to benchmark")
    gather_kernel = try_kernel(gpu, "embed_from_argmax", "batched_embed")
    stream = gpu.create_stream()
    owned: list[DevicePtr] = []
    copy_bw = copy_bandwidth(gpu)
    sets = [make_set(gpu, rng, kernels, owned, stream) for _ in range(BATCH)]
    table = gpu.alloc(VOCAB * H * 2)  # the served embedding (1 GiB); contents irrelevant
    owned.append(table)
    gpu.memset(table, 0x3C, VOCAB * H * 2, stream)
    gpu.synchronize(stream)

    def embed_overlay(ids_of: Callable[[InputSet], DevicePtr]) -> Callable[[int], None]:
        return lambda i: sets[i].slots.embed_overlay(ids_of(sets[i]), sets[i].seq_slot, 0, sets[i].out, TOKENS, stream)

    def lmhead(dtype: np.dtype, logits_of: Callable[[InputSet], DevicePtr]) -> Callable[[int], None]:
        return lambda i: sets[i].slots.lmhead_overlay(
            sets[i].hidden, sets[i].seq_slot, 0, logits_of(sets[i]), TOKENS, stream, dtype=dtype
        )

    gather = None
    if gather_kernel:
        from layers.ops.embed import batched_embed

        def gather(i: int) -> None:
            batched_embed(gpu, gather_kernel, sets[i].ids_hit, table, sets[i].out, TOKENS, H, stream)

    row_bytes = H * 2
    routing_bytes = TOKENS * (4 + 4 + 4)  # id, seq slot, slot-map entry per token
    copy_bytes = TOKENS * 2 * row_bytes  # every token: read its row, write it
    gather_bytes = TOKENS * (4 + 2 * row_bytes)
    timings: dict[str, Timing] = {
        "embed overlay, no token overridden": batched_time(stream, embed_overlay(lambda s: s.ids_miss)),
        "embed overlay, every token overridden": batched_time(stream, embed_overlay(lambda s: s.ids_hit)),
    }
    if gather is not None:
        hit = embed_overlay(lambda s: s.ids_hit)
        timings["batched_embed gather"] = batched_time(stream, gather)

        def both(i: int) -> None:
            gather(i)
            hit(i)

        timings["gather + overlay (every token)"] = batched_time(stream, both)

    rows = []
    gather_us = timings["batched_embed gather"].us if "batched_embed gather" in timings else None
    for name, nbytes in (
        ("batched_embed gather", gather_bytes),
        ("embed overlay, no token overridden", routing_bytes),
        ("embed overlay, every token overridden", routing_bytes + copy_bytes),
        ("gather + overlay (every token)", gather_bytes + routing_bytes + copy_bytes),
    ):
        if name not in timings:
            rows.append([name, None, nbytes / 1e6, None, None, None, None])
            continue
        t = timings[name]
        bw = nbytes / (t.us * 1e-6)
        rows.append(
            [
                name,
                t.us,
                nbytes / 1e6,
                bw / 1e9,
                bw / copy_bw,
                None if gather_us is None else t.us / gather_us,
                t.gate_expired,
            ]
        )
    print_table(
        f"Embed overlay: h={H}, {TOKENS} tokens, {ADAPTERS} adapters x {OVERRIDES} rows, "
        f"vocab {VOCAB} (copy bandwidth {copy_bw / 1e9:.0f} GB/s, read + write)",
        ["kernel", "us", "MB moved", "GB/s", "of copy bw", "x gather", "gate expired"],
        rows,
        note="Each row is a kernel (or the pair) over the tokens: median GPU us per launch back to back, the "
        "MB it must move, that rate and its share of the copy bandwidth, its time over the plain "
        "gather's, and the measurements whose gate expired (those include host time).",
    )

    pairs = TOKENS * OVERRIDES
    mm = matmul_rate()
    lm_gemm_us = None if mm is None else 2 * TOKENS * VOCAB * H / mm * 1e6
    rows = []
    for dtype, name, logits_of in (
        (BF16, "lmhead overlay bf16", lambda s: s.logits_bf16),
        (np.dtype(np.float32), "lmhead overlay f32", lambda s: s.logits_f32),
    ):
        t = batched_time(stream, lmhead(dtype, logits_of))
        unique = TOKENS * row_bytes + ADAPTERS * OVERRIDES * (row_bytes + 4) + TOKENS * 4 + pairs * dtype.itemsize
        l2_reads = pairs * 2 * row_bytes  # each warp reads its hidden row and its override row
        bw = unique / (t.us * 1e-6)
        rows.append(
            [
                name,
                t.us,
                unique / 1e6,
                bw / 1e9,
                bw / copy_bw,
                l2_reads / (t.us * 1e-6) / 1e9,
                None if lm_gemm_us is None else t.us / lm_gemm_us,
                t.gate_expired,
            ]
        )
    print_table(
        f"LM-head overlay: {TOKENS} rows x {OVERRIDES} overrides (one warp each), h={H}, vocab {VOCAB}",
        ["kernel", "us", "unique MB", "GB/s", "of copy bw", "L2 read GB/s", "x LM-head GEMM", "gate expired"],
        rows,
        note="Each row is the LM-head overlay writing bf16 or f32 logits: median GPU us per launch, the "
        "distinct MB it touches, that rate and its share of the copy bandwidth, the rate of every warp's "
        "L2 reads, its time over the LM-head GEMM's at the cuBLAS rate, and the gates expired.",
    )
    if lm_gemm_us is not None:
        print(
            f"LM-head GEMM at the measured cuBLAS bf16 rate: {lm_gemm_us:.0f} us "
            f"({2 * TOKENS * VOCAB * H / 1e9:.0f} GFLOP)"
        )
    print(
        "'gate expired' counts measurements where the host queued the batch slower than the "
        "gate copy ran: those include host time."
    )

    gpu.synchronize(stream)
    for s in sets:
        s.slots.close(stream)
    for ptr in owned:
        gpu.free(ptr)
    gpu.close()


if __name__ == "__main__":
    run(main, make_parser())
