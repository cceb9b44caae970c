"""The n-gram embedding at LongCat-Flash-Lite's real dims and footprint: prefill and decode.

Dims: V 131072, D 3072, N 4, K 4, ratio 78 (T = 12 tables of 10.2M rows x 256 bf16: 63 GB, in
one device allocation filled on the GPU), EOS id 2, about 2 % of the prompt tokens EOS.
Where the GPU lacks the memory (about 73 GiB free, the gate included), the run says so and skips.

Prefill (``NgramDecoder.prefill``, one prompt of S tokens, eager, a fresh prompt every call from
a pool of 16): GPU us back to back behind a gate (bench.common.gated_gpu_us) and wall us
(synchronised); the gather (``launch_gather``) and the projection (the word GEMM) alone; the
engines' design in torch on the same memory (one concatenated table, ``F.embedding`` gathers
of ids hashed beforehand on the host, one ``bmm`` against the projections [T, 256, D], the
mean with the word row); the floor: cuBLAS's own time for the projection's GEMM (torch
``linear`` at that shape, measured here) plus the bytes (table rows, word rows, projections,
output) over the copy bandwidth; the cold-read floor: the same number of random 512-byte rows
read over the tables' memory by bench/row_reads.cu (one warp a row, table-major).
Decode (``NgramDecoder.step`` captured in graphs, bench.decode's rows): B = 1 and 64, with the
bytes floor and the cold-read floor of B * T rows.
``--tables vmm-1g`` puts the tables in ``cuMemCreate`` memory mapped at 1 GiB alignment.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from bench.common import (
    GATE_BYTES,
    bench_parser,
    copy_bandwidth,
    gated_gpu_us,
    print_table,
    run,
    torch_or_none,
    torch_stream,
    wall_time_us,
)
from bench.decode import ORDER, Ctx, R, compare, ours_rows
from bench.ngram_embed import torch_view
from bench.row_reads import GIB, device_memory, fill_bf16, kernels, read_floor_us
from gpu_runtime import CudaBackend, DeviceArray, DevicePtr
from layers.dense_weight import BF16, DenseWeight
from layers.ngram_embed import NgramDecoder, NgramDims, NgramTable, NgramWeights, ngram_ids

EOS = 2
DIMS = NgramDims.longcat_flash(131072, 3072, 4, 4, 78, eos_id=EOS)
PREFILLS = (1024, 8192)
POOL = 16  # prompts per prefill length, rotated: every call gathers other rows
MARGIN = 6 * GIB  # besides the weights and the gate's two buffers: decoders, torch


def table_bytes(dims: NgramDims) -> int:
    return sum(dims.table_rows(c) for c in range(dims.num_tables())) * dims.table_dim() * 2


def need_bytes(dims: NgramDims) -> int:
    """Device memory the run needs: the tables, word and projections, the gate, a margin."""
    t, d, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
    return table_bytes(dims) + dims.vocab_size * d * 2 + t * d * td * 2 + 2 * GATE_BYTES + MARGIN


def make_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, "bench.real_scale")
    parser.add_argument(
        "--tables", choices=("malloc", "vmm-2m", "vmm-1g"), default="malloc", help="the tables' device memory"
    )
    return parser


def main(args: argparse.Namespace) -> None:
    dims = DIMS
    with CudaBackend() as gpu:
        free, need = gpu.mem_info()[0], need_bytes(dims)
        if free < need:
            print(
                f"bench.real_scale: skipped: needs {need / GIB:.0f} GiB of free device memory "
                f"for LongCat-Flash-Lite's tables, {free / GIB:.0f} GiB free (run on an H100 or H200)"
            )
            return
        stream = gpu.create_stream()
        bw = copy_bandwidth(gpu)
        with device_memory(gpu, table_bytes(dims), args.tables) as base:
            weights, owned = make_weights(gpu, dims, base, stream)
            try:
                print(
                    f"measured: copy {bw / 1e12:.2f} TB/s; tables {table_bytes(dims) / 1e9:.1f} GB "
                    f"({args.tables}), T = {dims.num_tables()}, D = {dims.hidden_size}, table dim {dims.table_dim()}",
                    flush=True,
                )
                prefill_table(gpu, dims, weights, base, stream, bw)
                decode_table(gpu, dims, weights, base, stream, bw)
            finally:
                gpu.synchronize(stream)
                weights.close()
                for buf in owned:
                    gpu.free(buf)


def make_weights(gpu: CudaBackend, dims: NgramDims, base: int, stream: int) -> tuple[NgramWeights, list[Any]]:
    """Tables laid end to end at ``base`` (as one concatenated table), a word table and the
    projections, every value filled on the device."""
    fill, _probe = kernels(gpu)
    t, d, td, v = dims.num_tables(), dims.hidden_size, dims.table_dim(), dims.vocab_size
    word_buf, proj_buf = gpu.alloc(v * d * 2), gpu.alloc(t * d * td * 2)
    fill_bf16(gpu, fill, base, table_bytes(dims) // 2, 1, 1.0, stream)
    fill_bf16(gpu, fill, int(word_buf), v * d, 2, 1.0, stream)
    fill_bf16(gpu, fill, int(proj_buf), t * d * td, 3, td**-0.5, stream)
    gpu.synchronize(stream)
    tables, at = [], base
    for c in range(t):
        rows = dims.table_rows(c)
        tables.append(NgramTable.Bf16(DenseWeight(DevicePtr(at), (rows, td), BF16, gpu=gpu)))
        at += rows * td * 2
    word = DenseWeight(DevicePtr(int(word_buf)), (v, d), BF16, gpu=gpu)
    projs = [DenseWeight(DevicePtr(int(proj_buf) + c * d * td * 2), (d, td), BF16, gpu=gpu) for c in range(t)]
    return NgramWeights(dims, word, tables, projs, gpu), [word_buf, proj_buf]


def prompts(dims: NgramDims, s: int, rng: np.random.Generator) -> list[np.ndarray]:
    """POOL prompts of ``s`` u32 tokens, about 2 % of them EOS."""
    out = []
    for _ in range(POOL):
        tok = rng.integers(0, dims.vocab_size, s, dtype=np.uint32)
        tok[rng.random(s) < 0.02] = EOS
        out.append(tok)
    return out


def prefill_table(gpu: CudaBackend, dims: NgramDims, weights: NgramWeights, base: int, stream: int, bw: float) -> None:
    rng = np.random.default_rng(45)
    t, d, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
    _fill, probe = kernels(gpu)
    torch = torch_or_none()
    dec = NgramDecoder(weights, max_seqs=1, max_rows=max(PREFILLS), stream=stream)
    out, sink = gpu.alloc(max(PREFILLS) * d * 2), gpu.alloc(4 << 20)
    rows = []
    try:
        tf = TorchForm(gpu, dims, weights, base) if torch is not None else None
        for s in PREFILLS:
            pool = prompts(dims, s, rng)
            toks = [DeviceArray.from_numpy(gpu, p, stream) for p in pool]
            cu_d = DeviceArray.from_numpy(gpu, np.array([0, s], np.uint32), stream)
            slot_d = DeviceArray.from_numpy(gpu, np.zeros(1, np.uint32), stream)
            try:

                def call(i: int, toks=toks, cu_d=cu_d, slot_d=slot_d, s=s) -> None:
                    dec.prefill(toks[i % POOL], cu_d, slot_d, 1, s, out, stream)

                def gather(i: int, toks=toks, cu_d=cu_d, slot_d=slot_d, s=s) -> None:
                    dec.launch_gather(int(toks[i % POOL].ptr), int(cu_d.ptr), int(slot_d.ptr), 1, s, 0, stream)

                dec.reset(0, stream)
                call(0)  # from an empty history: the row set torch's check uses
                ours_first = np.empty((s, d), BF16)
                gpu.copy_d2h(ours_first, out, stream)
                gpu_us, late = gated_gpu_us(call, stream=stream, batch=8, warmup=2, iters=9)
                wall = wall_time_us(call, lambda: gpu.synchronize(stream), warmup=3, iters=20)
                gather_us, late2 = gated_gpu_us(gather, stream=stream, batch=8, warmup=2, iters=9)

                def project(i: int, s=s) -> None:
                    dec.projection.finish(s, dec.word_ids, out, stream)

                proj_us, late3 = gated_gpu_us(project, stream=stream)
                cold = read_floor_us(probe, base, table_bytes(dims), t, s * t, int(sink), stream)
                moved = s * t * td * 2 + 2 * s * d * 2 + t * td * d * 2
                bytes_us = moved / bw * 1e6
                torch_us = gemm_us = None
                if tf is not None:
                    torch_us, gemm_us, late4 = tf.measure(pool, ours_first)
                    late3 += late4
                floor = (gemm_us or 0.0) + bytes_us
                rows.append(
                    (
                        s,
                        gpu_us,
                        wall,
                        gather_us,
                        proj_us,
                        torch_us,
                        torch_us / gpu_us if torch_us else None,
                        gemm_us,
                        bytes_us,
                        floor if gemm_us else None,
                        gpu_us / floor if gemm_us else None,
                        cold,
                        late + late2 + late3,
                    )
                )
            finally:
                gpu.synchronize(stream)
                for a in (*toks, cu_d, slot_d):
                    a.free()
        err = dec.check_errors()
        print(f"prefill: decoder errors after all calls: {err!r}", flush=True)
    finally:
        gpu.synchronize(stream)
        dec.close()
        gpu.free(out)
        gpu.free(sink)
    print_table(
        "prefill at LongCat-Flash-Lite's dims (one prompt, eager)",
        [
            "S",
            "GPU us",
            "wall us",
            "gather us",
            "projection us",
            "torch form us",
            "torch/ours",
            "cuBLAS GEMM us",
            "bytes us",
            "floor us",
            "x floor",
            "cold reads us",
            "gate expired",
        ],
        rows,
        note="Each row is one NgramDecoder.prefill of S tokens from a pool of 16 prompts: GPU us (back to back), "
        "wall us (synchronised), its gather and projection launches alone, the torch form of the engines' design "
        "(ids hashed beforehand: its time has no hashing) and torch/ours (> 1: ours faster), cuBLAS's time for "
        "the projection GEMM alone, the bytes over the copy bandwidth, the floor (their sum) and GPU us over it, "
        "and the cold-read floor: S*T random 512-byte rows read over the tables' memory.",
    )


class TorchForm:
    """The engines' design in torch over the same device memory."""

    def __init__(self, gpu: CudaBackend, dims: NgramDims, weights: NgramWeights, base: int) -> None:
        torch = torch_or_none()
        self.torch, self.dims = torch, dims
        t, td = dims.num_tables(), dims.table_dim()
        total = sum(dims.table_rows(c) for c in range(t))
        self.stacked = torch.as_tensor(DeviceArray(gpu, DevicePtr(base), (total, td), np.int16), device="cuda").view(
            torch.bfloat16
        )
        moduli = [dims.table_rows(c) for c in range(t)]
        self.offsets = torch.tensor(np.cumsum([0] + moduli[:-1]), dtype=torch.int64, device="cuda")
        projs = [torch_view(gpu, p) for p in weights.projs]  # [D, td] each
        self.proj_t = torch.stack([p.t() for p in projs]).contiguous()  # [T, td, D]
        self.w_cat = torch.cat(projs, dim=1)  # [D, T*td]
        self.word = torch_view(gpu, weights.word)

    def measure(self, pool: list[np.ndarray], ours_first: np.ndarray) -> tuple[float, float, int]:
        """(torch form us, cuBLAS GEMM us, gates expired); checks its first prompt against ours."""
        torch, dims = self.torch, self.dims
        ids = [
            torch.from_numpy(np.stack(ngram_ids(dims, p.astype(np.int64)), 1).astype(np.int64)).cuda() + self.offsets
            for p in pool
        ]
        toks = [torch.from_numpy(p.astype(np.int64)).cuda() for p in pool]
        F = torch.nn.functional

        def form(i: int) -> Any:
            g = F.embedding(ids[i % POOL], self.stacked)  # [S, T, td]
            y = torch.bmm(g.transpose(0, 1), self.proj_t)  # [T, S, D]
            return torch.cat([self.word[toks[i % POOL]].unsqueeze(0), y]).mean(0)

        first = form(0).float().cpu().numpy()
        compare(f"torch form S={pool[0].size} vs ours", ours_first, first)
        gathered = F.embedding(ids[0], self.stacked).reshape(pool[0].size, -1)
        us, late = gated_gpu_us(form, stream=torch_stream(), batch=8, warmup=2, iters=9)
        gemm_us, late2 = gated_gpu_us(lambda i: F.linear(gathered, self.w_cat), stream=torch_stream())
        return us, gemm_us, late + late2


def decode_table(gpu: CudaBackend, dims: NgramDims, weights: NgramWeights, base: int, stream: int, bw: float) -> None:
    rng = np.random.default_rng(46)
    _fill, probe = kernels(gpu)
    out, sink = gpu.alloc(64 * 32 * dims.hidden_size * 2), gpu.alloc(4 << 20)
    try:
        ctx = Ctx(gpu, stream, dims, bw, rng, out, rng.integers(0, R, ORDER))
        steps = ours_rows(ctx, weights, "ours, device tables")
        rows = []
        for row in steps:
            b = int(row.batch or 0)
            cold = read_floor_us(
                probe, base, table_bytes(dims), dims.num_tables(), b * dims.num_tables(), int(sink), stream
            )
            rows.append((b, row.gpu_us, row.wall_us, row.host_us, row.floor_us, cold, row.late))
    finally:
        gpu.synchronize(stream)
        gpu.free(out)
        gpu.free(sink)
    print_table(
        "decode step at LongCat-Flash-Lite's dims (NgramDecoder.step in the caller's CUDA graph)",
        ["B", "GPU us", "wall us/step", "host us/step", "bytes floor us", "cold reads us", "gate expired"],
        rows,
        note="Each row is one graph replay of a decode step of B sequences (bench.decode's measurement): GPU us "
        "back to back, wall and host us per step, the bytes floor (projections, B*T rows, word rows, output "
        "over the copy bandwidth) and the cold-read floor: B*T random 512-byte rows read over the tables' memory.",
    )


if __name__ == "__main__":
    run(main, make_parser())
