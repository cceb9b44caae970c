"""Engram's ``wkv`` projection at the real dims (n 25600, k 6144): the fp8-weight GEMM against torch.

For each m: our fp8-weight path (``dense_gemm_fp8w``: e4m3 weights with 32 x 32 e8m0 block scales,
read once, dequantised in registers), our bf16 GEMM over the dequantised weights (what the decoder
runs above ``FP8_ROWS`` rows), cuBLAS bf16 (``F.linear``) over dequantised weights and torch's fp8
``_scaled_mm`` with row-wise scales (less scaling work than 32 x 32 blocks), in microseconds (CUDA
events, medians, warm-up excluded; three weight sets rotated, 472 MB of fp8: w comes from HBM), and
the floor: the fp8 weight bytes over the measured copy bandwidth (read + write), or, where larger,
the FLOPs at cuBLAS's bf16 rate at 8192^3.
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.common import (
    bench_parser,
    copy_bandwidth,
    gated_gpu_us,
    matmul_rate,
    print_table,
    run,
    torch_or_none,
    torch_stream,
)
from gpu_runtime import CudaBackend, PreparedLaunch
from layers.block_fp8_weight import BlockFp8Weight
from layers.dense_weight import DenseWeight
from layers.engram.weights import dequant_blocks
from layers.kernel_files import load_kernel
from layers.ops import gemm, gemm_fp8
from layers.ops.gemm_fp8 import Fp8wLaunch

N, K = 25600, 6144
ROWS = (1, 16, 64, 256, 1024, 8192)
SETS = 3


def _weights(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random e4m3 bytes (no NaN) and realistic scale bytes, [N, K] and [N/32, K/32]."""
    w = rng.integers(0, 256, (N, K), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0x38
    s = rng.integers(112, 122, (N // 32, K // 32), dtype=np.uint8)
    return w, s


def _ours(gpu: CudaBackend, weights: list, m: int, fp8: bool) -> float:
    """Median us of our projection at m rows, rotating the weight sets."""
    a, c = gpu.alloc(m * K * 2), gpu.alloc(m * N * 2)
    need = gemm_fp8.workspace_bytes(N, K, gpu.max_shared_optin)
    work = gpu.alloc(need)
    try:
        gpu.memset(work, 0, need)
        gpu.memset(a, 0x3C, m * K * 2)
        planned: list[Fp8wLaunch | PreparedLaunch | None]
        if fp8:
            kern = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
            planned = [gemm_fp8.plan_fp8w_gemm(gpu, kern, a, w8, c, m, N, K, workspace=work) for w8, _ in weights]
        else:
            kern = load_kernel(gpu, "gemm", gemm.KERNEL)
            planned = [gemm.plan_gemm(gpu, kern, a, wb, c, m, N, K) for _, wb in weights]
        plans = [plan for plan in planned if plan is not None]
        assert len(plans) == len(planned)  # m, N and K >= 1: a launch each
        return gated_gpu_us(lambda i: plans[i % SETS].run(0), batch=4)[0]
    finally:
        gpu.free(a)
        gpu.free(c)
        gpu.free(work)


def _torch(m: int) -> tuple[float | None, float | None]:
    """(cuBLAS bf16 us, _scaled_mm fp8 row-wise us) at m rows, or None without torch."""
    torch = torch_or_none()
    if torch is None:
        return None, None
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(SETS)]
    bf16 = gated_gpu_us(lambda i: torch.nn.functional.linear(x, ws[i % SETS]), stream=torch_stream(), batch=4)[0]
    ws.clear()
    x8 = x.to(torch.float8_e4m3fn)
    w8 = [torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn) for _ in range(SETS)]
    sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, N, device="cuda") + 0.5
    fp8 = gated_gpu_us(
        lambda i: torch._scaled_mm(x8, w8[i % SETS].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
        stream=torch_stream(),
        batch=4,
    )[0]
    w8.clear()
    torch.cuda.empty_cache()
    return bf16, fp8


def main(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    with CudaBackend() as gpu:
        bw, rate = copy_bandwidth(gpu), matmul_rate()
        print(f"device {gpu.name}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
        weights = []
        try:
            for _ in range(SETS):
                w, s = _weights(rng)
                weights.append(
                    (BlockFp8Weight.from_numpy(gpu, w, s), DenseWeight.from_numpy(gpu, dequant_blocks(w, s)))
                )
            rows = []
            for m in ROWS:
                fp8, bf16 = _ours(gpu, weights, m, True), _ours(gpu, weights, m, False)
                t_bf16, t_fp8 = _torch(m)
                floor = max(N * K / bw, 2 * m * N * K / rate if rate else 0.0) * 1e6
                rows.append(
                    (
                        m,
                        fp8,
                        bf16,
                        t_bf16,
                        t_fp8,
                        floor,
                        fp8 / floor,
                        t_bf16 / fp8 if t_bf16 else None,
                        t_fp8 / fp8 if t_fp8 else None,
                    )
                )
        finally:
            for w8, wb in weights:
                w8.close()
                wb.close()
    print_table(
        f"Engram wkv projection, n {N} x k {K} (us)",
        [
            "m",
            "fp8w",
            "bf16 (ours)",
            "cuBLAS bf16",
            "_scaled_mm fp8",
            "floor",
            "fp8w/floor",
            "cuBLAS/fp8w",
            "scaled_mm/fp8w",
        ],
        rows,
        note="Each row is one m: our fp8-weight path, our bf16 GEMM over dequantised weights, cuBLAS bf16 and "
        "torch's row-wise fp8 _scaled_mm (us), the floor (fp8 weight bytes over the copy bandwidth, or the FLOPs "
        "at cuBLAS's bf16 rate), fp8w over the floor (< 1.15 is the target at m <= 64), and torch over ours "
        "(> 1: ours is faster).",
    )


def make_parser() -> argparse.ArgumentParser:
    return bench_parser(__doc__, "bench.engram_gemm")


if __name__ == "__main__":
    run(main, make_parser())
