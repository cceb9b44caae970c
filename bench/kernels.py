"""Memory-bound kernels (gathers, scaled add, argmax) against the copy bandwidth, then the GEMM table.

Achieved bandwidth counts the bytes each kernel must move (every byte read once, every byte
written once) over its median time; the ratio is to a device-to-device copy measured in the
same run (also bytes read + written). torch's equivalent runs on the same data where present.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from bench.common import bench_parser, copy_bandwidth, gated_gpu_us, print_table, run, torch_or_none, torch_stream
from bench.gemm import gemm_table
from gpu_runtime import CudaBackend
from layers.kernel_files import load_kernel
from layers.ops.embed import ArgmaxEmbed, batched_embed, batched_embed_fp8
from layers.ops.residual import scaled_add

BF16 = ml_dtypes.bfloat16


def _device_random(gpu: CudaBackend, rng: np.random.Generator, nbytes: int) -> int:
    ptr = gpu.alloc(nbytes)
    chunk = rng.integers(0, 256, 1 << 24, dtype=np.uint8)
    chunk[1::2] &= 0x3F  # bf16 high bytes: finite values of modest size
    for off in range(0, nbytes, chunk.size):
        gpu.copy_h2d_async(chunk[: min(chunk.size, nbytes - off)], ptr + off)
    return ptr


def _ms(fn, stream: int = 0) -> float:
    """Median GPU ms of one call, calls run back to back behind a gate (bench.common)."""
    return gated_gpu_us(fn, stream=stream, batch=8)[0] / 1e3


def gather_rows(gpu: CudaBackend, bw: float) -> list[tuple]:
    rng = np.random.default_rng(0)
    torch = torch_or_none()
    rows = []
    n, dim, table_rows = 65536, 4096, 131072
    k_bf16 = load_kernel(gpu, "embed_from_argmax", "batched_embed")
    k_fp8 = load_kernel(gpu, "embed_from_argmax", "batched_embed_fp8")
    table = _device_random(gpu, rng, table_rows * dim * 2)
    table8 = _device_random(gpu, rng, table_rows * dim)
    scales = gpu.alloc(table_rows * 4)
    gpu.copy_h2d_async(np.ones(table_rows, np.float32), scales)
    ids_host = rng.integers(0, table_rows, n, dtype=np.uint32)
    ids = gpu.alloc(n * 4)
    gpu.copy_h2d_async(ids_host, ids)
    out = gpu.alloc(n * dim * 2)

    ms = _ms(lambda i: batched_embed(gpu, k_bf16, ids, table, out, n, dim, 0))
    moved = 2 * n * dim * 2
    t_ms = None
    if torch is not None:
        tt = torch.randn(table_rows, dim, device="cuda", dtype=torch.bfloat16)
        ti = torch.from_numpy(ids_host.astype(np.int64)).cuda()
        t_ms = _ms(lambda i: torch.index_select(tt, 0, ti), torch_stream())
        del tt
    rows.append(
        (
            f"batched_embed n={n} dim={dim}",
            ms * 1e3,
            moved / ms / 1e6,
            moved / (ms * 1e-3) / bw,
            t_ms * 1e3 if t_ms else None,
            t_ms / ms if t_ms else None,
        )
    )

    ms = _ms(lambda i: batched_embed_fp8(gpu, k_fp8, ids, table8, scales, out, n, dim, 0))
    moved = n * dim * 3 + n * 8
    rows.append(
        (f"batched_embed_fp8 n={n} dim={dim}", ms * 1e3, moved / ms / 1e6, moved / (ms * 1e-3) / bw, None, None)
    )

    small_n, small_dim = 8192, 256  # the n-gram layer's shape: 16 tables x 256, S = 8192 rows
    small_rows = table_rows * dim // small_dim  # the same 1 GiB table seen as [2M, 256]
    small_ids = gpu.alloc(32 * small_n * 4)  # 32 id sets of 4 MiB of rows: 128 MiB > L2
    gpu.copy_h2d_async(rng.integers(0, small_rows, 32 * small_n, dtype=np.uint32), small_ids)
    ms = _ms(
        lambda i: batched_embed(gpu, k_bf16, small_ids + (i % 32) * small_n * 4, table, out, small_n, small_dim, 0)
    )
    moved = 2 * small_n * small_dim * 2
    rows.append(
        (f"batched_embed n={small_n} dim={small_dim}", ms * 1e3, moved / ms / 1e6, moved / (ms * 1e-3) / bw, None, None)
    )

    k_add = load_kernel(gpu, "residual_add", "bf16_scaled_add")
    n_add = 1 << 28
    a = _device_random(gpu, rng, n_add * 2)
    ms = _ms(lambda i: scaled_add(gpu, k_add, a, table, 0.5, n_add, 0))
    moved = 3 * n_add * 2
    t_ms = None
    if torch is not None:
        ta = torch.randn(n_add, device="cuda", dtype=torch.bfloat16)
        tb = torch.randn(n_add, device="cuda", dtype=torch.bfloat16)
        t_ms = _ms(lambda i: ta.add_(tb, alpha=0.5), torch_stream())
        del ta, tb
    rows.append(
        (
            "bf16_scaled_add n=2^28",
            ms * 1e3,
            moved / ms / 1e6,
            moved / (ms * 1e-3) / bw,
            t_ms * 1e3 if t_ms else None,
            t_ms / ms if t_ms else None,
        )
    )

    k_arg = load_kernel(gpu, "embed_from_argmax", "embed_from_argmax_bf16")
    vocab, m = 131072, 64
    ids_out = gpu.alloc(m * 4)
    logits = m * vocab * 2  # 16 MiB a call, 16 of them rotated (256 MiB of a): read from HBM, not L2
    argmax = ArgmaxEmbed(gpu, k_arg, table, vocab, dim)
    ms = _ms(lambda i: argmax.run(a + (i % 16) * logits, out, ids_out, m, 0))
    moved = m * vocab * 2 + 2 * m * dim * 2
    rows.append(
        (f"embed_from_argmax m={m} vocab={vocab}", ms * 1e3, moved / ms / 1e6, moved / (ms * 1e-3) / bw, None, None)
    )
    for p in (table, table8, scales, ids, small_ids, out, a, ids_out):
        gpu.free(p)
    return rows


def make_parser() -> argparse.ArgumentParser:
    return bench_parser(__doc__, "bench.kernels")


def main(args: argparse.Namespace) -> None:
    with CudaBackend() as gpu:
        bw = copy_bandwidth(gpu)
        print(f"device {gpu.name}: measured copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
        rows = gather_rows(gpu, bw)
        print_table(
            "memory-bound kernels",
            ["kernel", "us", "GB/s", "x copy BW", "torch us", "torch/ours"],
            rows,
            note="Each row is one kernel at the shape named: us is its median GPU time (back to back), GB/s "
            "the bytes it must move over that, x copy BW that over the measured copy bandwidth, torch "
            "us and torch/ours torch's equivalent on the same data (> 1: ours is faster).",
        )
        gemm_table(gpu)


if __name__ == "__main__":
    run(main, make_parser())
