"""The GEMM table: ``dense_gemm_bf16_pipelined`` against torch's ``F.linear`` (cuBLAS) and the floor.

For each (m, n, k): our median time (CUDA events), TFLOP/s, torch's time on the same shapes and
bf16 data where torch is installed, the speed ratio (torch time / ours: > 1 means we are faster),
and the physical floor max(bytes / copy bandwidth, flops / cuBLAS rate at 8192^3), with our
fraction of it. Bytes are a and w read once and c written once, which is what the copy bandwidth
(read + write) measures. Shapes whose inputs fit in L2 rotate among enough input sets that their
total exceeds twice the L2, so w comes from HBM as it does in the model. The mma.sync path is
also timed alone on the large shapes, and the cp.async wgmma path, to compare with the TMA path,
and each path the automatic choice passes over where it chooses between two.
"""

from __future__ import annotations

import argparse
import math

import ml_dtypes
import numpy as np

from bench.common import (
    bench_parser,
    copy_bandwidth,
    gated_gpu_us,
    matmul_rate,
    print_table,
    run,
    shape,
    torch_or_none,
    torch_stream,
)
from gpu_runtime import CudaBackend, DevicePtr
from layers.dense_weight import BF16, DenseWeight
from layers.kernel_files import load_kernel
from layers.ops import gemm
from layers.ops.gemm import dense_gemm_bf16_pipelined

SHAPES = [
    (1, 4096, 256),
    (16, 4096, 256),
    (128, 4096, 256),
    (4096, 4096, 256),
    (1, 4096, 4096),
    (64, 4096, 4096),
    (128, 4096, 4096),
    (4096, 4096, 4096),
    (8192, 8192, 8192),
]
# the paths path=None passes over, on the shapes where it chooses between them
FORCED = [
    ("small", (1, 4096, 256)),
    ("gemv", (1, 4096, 4096)),
    ("tma_splitk", (1, 4096, 256)),
    ("tma_splitk", (16, 4096, 256)),
    ("tma_splitk", (128, 4096, 256)),
    ("tma_splitk", (1, 4096, 4096)),
    ("small", (64, 4096, 4096)),
    ("tiled", (128, 4096, 4096)),
    ("tma", (4096, 4096, 256)),
    ("tma", (4096, 4096, 4096)),
    ("tma", (8192, 8192, 8192)),
    ("wgmma", (4096, 4096, 4096)),
    ("tiled", (4096, 4096, 4096)),
]
MAX_SETS = 64
_POOL_VALUES = 1 << 23  # 16 MB of random bf16, tiled over every buffer


def _input_sets(set_bytes: int, l2_bytes: int) -> int:
    """Input sets to rotate through so that together they exceed twice the L2."""
    return max(1, min(MAX_SETS, math.ceil(2 * l2_bytes / set_bytes)))


def _fill(gpu: CudaBackend, ptr: int, nbytes: int, pool: np.ndarray) -> None:
    raw = pool.view(np.uint8)
    for off in range(0, nbytes, raw.size):
        gpu.copy_h2d_async(raw[: min(raw.size, nbytes - off)], DevicePtr(ptr + off))


def _ours_ms(gpu: CudaBackend, m: int, n: int, k: int, sets: int, pool: np.ndarray, path: str | None) -> float:
    kern = load_kernel(gpu, "gemm", gemm.KERNEL)
    bufs = []
    try:
        for _ in range(sets):
            a, w, c = gpu.alloc(m * k * 2), gpu.alloc(n * k * 2), gpu.alloc(m * n * 2)
            bufs += [a, w, c]
            _fill(gpu, a, m * k * 2, pool)
            _fill(gpu, w, n * k * 2, pool)
        gpu.synchronize()
        runs = [(bufs[3 * i], DenseWeight(bufs[3 * i + 1], (n, k), BF16), bufs[3 * i + 2]) for i in range(sets)]

        def step(i: int) -> None:
            a, w, c = runs[i % sets]
            dense_gemm_bf16_pipelined(gpu, kern, a, w, c, m, n, k, 0, path=path)

        return gated_gpu_us(step)[0] / 1e3
    finally:
        for ptr in bufs:
            gpu.free(ptr)


def _torch_ms(m: int, n: int, k: int, sets: int) -> float | None:
    torch = torch_or_none()
    if torch is None:
        return None
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    try:
        return (
            gated_gpu_us(lambda i: torch.nn.functional.linear(xs[i % sets], ws[i % sets]), stream=torch_stream())[0]
            / 1e3
        )
    finally:
        xs.clear()
        ws.clear()
        torch.cuda.empty_cache()


def gemm_rows(gpu: CudaBackend, bw: float, rate: float | None) -> list[tuple]:
    rng = np.random.default_rng(0)
    pool = rng.standard_normal(_POOL_VALUES).astype(np.float32).astype(ml_dtypes.bfloat16)
    wgmma, tma = gemm.wgmma_available(gpu), gemm.tma_available(gpu)
    rows = []
    for path, (m, n, k) in [(None, s) for s in SHAPES] + FORCED:
        set_bytes = (m * k + n * k + m * n) * 2
        sets = _input_sets(set_bytes, gpu.l2_bytes)
        chosen = gemm.plan(
            m,
            n,
            k,
            path,
            wgmma=wgmma,
            tma=tma,
            tma_store=tma,
            gemv=wgmma,  # aligned buffers
            sms=gpu.sm_count,
        ).path
        ms = _ours_ms(gpu, m, n, k, sets, pool, path)
        t_ms = _torch_ms(m, n, k, sets) if path is None else None
        flops = 2 * m * n * k
        floor_s = max(set_bytes / bw, flops / rate if rate else 0.0)
        rows.append(
            (
                f"{m}x{n}x{k}",
                chosen,
                sets,
                ms * 1e3,
                flops / (ms * 1e-3) / 1e12,
                t_ms * 1e3 if t_ms else None,
                t_ms / ms if t_ms else None,
                floor_s * 1e6,
                floor_s / (ms * 1e-3),
            )
        )
    return rows


def gemm_table(gpu: CudaBackend) -> None:
    """Print the GEMM table (torch columns empty without torch)."""
    bw = copy_bandwidth(gpu)
    rate = matmul_rate()
    rate_txt = f"{rate / 1e12:.0f} TFLOP/s" if rate else "n/a (no torch: floor is bytes only)"
    print(
        f"device {gpu.name}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write), "
        f"cuBLAS bf16 at 8192^3 {rate_txt}; L2 {gpu.l2_bytes >> 20} MB"
    )
    print_table(
        "dense_gemm_bf16_pipelined (bf16, fp32 accumulation)",
        ["m x n x k", "path", "sets", "us", "TFLOP/s", "torch us", "torch/ours", "floor us", "floor/ours"],
        gemm_rows(gpu, bw, rate),
        note="Each row is one GEMM m x n x k on the path chosen (forced rows: the path named) over sets input "
        "sets: median GPU us, TFLOP/s, cuBLAS's us and torch/ours (> 1: ours is faster), the floor us "
        "and our fraction of it.",
    )


def one_shape(spec: tuple[int, ...], path: str | None) -> None:
    """``--shape MxNxK [--path P]``: that GEMM alone, timed as in the table (and a target for a
    profiler: ``ncu --kernel-name regex:dense_gemm python3 -m bench.gemm --shape ...``)."""
    m, n, k = spec
    rng = np.random.default_rng(0)
    pool = rng.standard_normal(_POOL_VALUES).astype(np.float32).astype(ml_dtypes.bfloat16)
    with CudaBackend() as gpu:
        sets = _input_sets((m * k + n * k + m * n) * 2, gpu.l2_bytes)
        wgmma, tma = gemm.wgmma_available(gpu), gemm.tma_available(gpu)
        chosen = gemm.plan(m, n, k, path, wgmma=wgmma, tma=tma, tma_store=tma, gemv=wgmma, sms=gpu.sm_count)
        us = _ours_ms(gpu, m, n, k, sets, pool, path) * 1e3
        print(
            f"{m}x{n}x{k} {chosen.path} ({chosen.kernel}, grid {chosen.grid}, block "
            f"{chosen.threads}, {chosen.shared_mem} B): {us:.2f} us, "
            f"{2 * m * n * k / us / 1e6:.1f} TFLOP/s"
        )
        if chosen.path == "tma_splitk":
            print(
                f"clusters of {gemm.SPLIT_K} resident at once: "
                f"{_max_active_clusters(gpu, chosen)} (the launch has {chosen.grid // gemm.SPLIT_K})"
            )


SWEEP_ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
SWEEP_PATHS = ("gemv", "small", "tiled", "tma_splitk")
# --sweep-wide: a prefill's rows, on the paths for m > 64
WIDE_ROWS = (128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048, 3072, 4096, 8192)
WIDE_PATHS = ("tiled", "tma_splitk", "wgmma", "tma", "tma_store", "tma_store_n128", "tma_store_n192")


def sweep(spec: tuple[int, ...], wide: bool = False) -> None:
    """``--sweep NxK``: m from SWEEP_ROWS at that n and k, the automatic choice and each skinny
    path against cuBLAS (microseconds), to place ``use_splitk``'s bounds. ``--sweep-wide NxK``:
    m from WIDE_ROWS on the paths for m > 64 (a prefill's projection)."""
    n, k = spec
    rows_m, paths = (WIDE_ROWS, WIDE_PATHS) if wide else (SWEEP_ROWS, SWEEP_PATHS)
    rng = np.random.default_rng(0)
    pool = rng.standard_normal(_POOL_VALUES).astype(np.float32).astype(ml_dtypes.bfloat16)
    rows = []
    with CudaBackend() as gpu:
        wgmma, tma = gemm.wgmma_available(gpu), gemm.tma_available(gpu)
        for m in rows_m:
            sets = _input_sets((m * k + n * k + m * n) * 2, gpu.l2_bytes)
            chosen = gemm.plan(m, n, k, None, wgmma=wgmma, tma=tma, tma_store=tma, gemv=wgmma, sms=gpu.sm_count).path
            auto = _ours_ms(gpu, m, n, k, sets, pool, None) * 1e3
            forced = [
                _ours_ms(gpu, m, n, k, sets, pool, p) * 1e3 if p != "gemv" or gemm.use_gemv(m, k, True) else None
                for p in paths
            ]  # gemv: only where it runs when forced
            t_ms = _torch_ms(m, n, k, sets)
            rows.append((m, chosen, auto, *forced, t_ms * 1e3 if t_ms else None, t_ms * 1e3 / auto if t_ms else None))
    print_table(
        f"m sweep at n = {n}, k = {k} (us)",
        ["m", "auto path", "auto", *paths, "cuBLAS", "cuBLAS/auto"],
        rows,
        note="Each row is one m at this n and k: the path chosen and its us, each skinny path forced (us), "
        "cuBLAS's us and cuBLAS/auto (> 1: ours is faster).",
    )


def _max_active_clusters(gpu: CudaBackend, p: gemm.GemmPlan) -> str:
    """``cuOccupancyMaxActiveClusters`` for a split-K plan: fewer than its clusters means waves."""
    from cuda.bindings import driver as cu

    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = p.grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = p.threads, 1, 1
    config.sharedMemBytes = p.shared_mem
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = gemm.SPLIT_K, 1, 1
    config.attrs = [attr]
    config.numAttrs = 1
    err, count = cu.cuOccupancyMaxActiveClusters(load_kernel(gpu, "gemm", p.kernel), config)
    return str(count) if not err else f"not known ({err})"


def make_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, "bench.gemm")
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--shape", type=shape("MxNxK"), metavar="MxNxK", help="one GEMM alone instead of the table (a target for ncu)"
    )
    parser.add_argument(
        "--path",
        choices=gemm.PATHS,
        metavar="PATH",
        help=f"with --shape, force a path: {', '.join(gemm.PATHS)} (default: the automatic choice)",
    )
    what.add_argument(
        "--sweep",
        type=shape("NxK"),
        metavar="NxK",
        help="m from 1 to 256 at this n and k on each skinny path, against cuBLAS",
    )
    what.add_argument(
        "--sweep-wide",
        type=shape("NxK"),
        metavar="NxK",
        help="m from 128 to 8192 at this n and k on each path for m > 64, against cuBLAS",
    )
    return parser


def misuse(args: argparse.Namespace) -> str | None:
    """What is wrong with options that parse but do not go together."""
    return "--path goes with --shape (it forces that one GEMM's path)" if args.path and not args.shape else None


def main(args: argparse.Namespace) -> None:
    if args.sweep or args.sweep_wide:
        sweep(args.sweep or args.sweep_wide, wide=not args.sweep)
        return
    if args.shape:
        one_shape(args.shape, args.path)
        return
    with CudaBackend() as gpu:
        gemm_table(gpu)


if __name__ == "__main__":
    run(main, make_parser(), misuse=misuse)
