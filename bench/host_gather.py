"""Probe: what a table in host memory (``NgramTable.Host``) costs a gather, against the same table
on the device.

The gather alone, with the seed path's kernel (``batched_embed``, one warp per row): ``n`` random
512-byte rows (bf16, dim 256) from a table of ``--gib`` GiB (default ``$HOST_GATHER_GIB``, else 1: far more than
L2, so rows are not cached) in mapped pinned host memory, read in place by the kernel over PCIe
(zero-copy), and the same rows of the same table in device memory. Every call gathers rows of
its own (fresh random ids per call), so no call finds a row that an earlier one left in L2.
Times are median GPU us per call, calls run back to back behind a gate (``gated_gpu_us``), so
the host's launch rate is not in them.

Columns: rows per call; host us / device us; host/device; GB/s of row bytes gathered per second
from each; the pinned host-to-device copy rate (one 256 MiB DMA) is printed as PCIe's ceiling.
Expected (the issue's numbers): 16 rows about 1.2x the device gather (latency-bound: one PCIe
round trip), 1024 rows about 2.5x; a prefill-sized gather (65536 rows) runs at a fraction of the
PCIe copy rate (random 512-byte reads, not one DMA stream).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from bench.common import bench_parser, gated_gpu_us, gpu_time_ms, positive_float, print_table, run
from gpu_runtime import CudaBackend
from layers.kernel_files import load_kernel
from layers.ops.embed import batched_embed

DIM = 256
ROW_BYTES = DIM * 2
# (rows per call, calls per gated batch): the prefill gather is long enough that 4 fill a batch
SHAPES = ((16, 16), (1024, 16), (65536, 4))
WARMUP, ITERS = 2, 10
BLOCK = 16 << 20  # random block tiled into the table


def random_block(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    """A block of random finite bf16 values of modest size (uint8, at most 16 MiB), to tile over
    a table of ``nbytes``."""
    block = rng.integers(0, 256, min(BLOCK, nbytes), dtype=np.uint8)
    block[1::2] &= 0x3F  # high bytes: exponents well inside the finite range
    return block


def tile(block: np.ndarray, nbytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each copy of ``block`` tiled over ``nbytes``."""
    for off in range(0, nbytes, block.size):
        yield off, min(block.size, nbytes - off)


def fill(host: np.ndarray, block: np.ndarray) -> None:
    """Tile ``block`` over ``host`` (both uint8)."""
    for off, n in tile(block, host.size):
        host[off : off + n] = block[:n]


def fill_random(host: np.ndarray, rng: np.random.Generator) -> None:
    """Tile one ``random_block`` over ``host`` (uint8)."""
    fill(host, random_block(rng, host.size))


def gathered(gpu: CudaBackend, kernel: Any, ids: int, n: int, table: int, out: int) -> np.ndarray:
    """The bytes of ``batched_embed`` of the ``n`` rows of ``table`` that ``ids`` name."""
    batched_embed(gpu, kernel, ids, table, out, n, DIM, 0)
    got = np.empty(n * ROW_BYTES, np.uint8)
    gpu.copy_d2h(got, out)
    return got


def time_gather(
    gpu: CudaBackend,
    kernel: Any,
    table: int,
    rows: int,
    out: int,
    n: int,
    batch: int,
    rng: np.random.Generator,
    label: str = "",
) -> float:
    """Median GPU us of ``batched_embed`` of ``n`` rows from ``table`` (``rows`` rows) into
    ``out``, ``batch`` calls back to back behind a gate, fresh random rows for every call."""
    calls = (WARMUP + ITERS) * batch
    ids = rng.integers(0, rows, calls * n, dtype=np.uint32)
    ids_dev = gpu.alloc(ids.nbytes)
    try:
        gpu.copy_h2d_async(ids, ids_dev)
        us, expired = gated_gpu_us(
            lambda i: batched_embed(gpu, kernel, ids_dev + (i % calls) * n * 4, table, out, n, DIM, 0),
            batch=batch,
            warmup=WARMUP,
            iters=ITERS,
        )
    finally:
        gpu.synchronize()
        gpu.free(ids_dev)
    if expired:
        print(f"  note: {n} rows{label}: {expired} of {ITERS} gates expired (host time leaked into those measurements)")
    return us


def pinned_copy_rate(gpu: CudaBackend, nbytes: int = 256 << 20) -> float:
    """Bytes/s of one pinned host-to-device DMA (PCIe's ceiling), timed with events."""
    host, dev = gpu.alloc_host(nbytes), gpu.alloc(nbytes)
    try:
        host[:] = 7
        ms = gpu_time_ms(lambda i: gpu.upload_pinned_async(host, dev, 0), warmup=2, iters=10)
    finally:
        gpu.free(dev)
        gpu.free_host(host)
    return nbytes / (ms * 1e-3)


def make_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, "bench.host_gather")
    parser.add_argument(
        "--gib",
        type=positive_float,
        default=os.environ.get("HOST_GATHER_GIB") or "1",
        help="the table's size in GiB (default: $HOST_GATHER_GIB, else 1)",
    )
    return parser


def main(args: argparse.Namespace) -> None:
    gib = args.gib
    rng = np.random.default_rng(0)
    with CudaBackend() as gpu:
        k = load_kernel(gpu, "embed_from_argmax", "batched_embed")
        rows = int(gib * (1 << 30)) // ROW_BYTES
        nbytes = rows * ROW_BYTES
        print(
            f"device {gpu.name}: table [{rows}, {DIM}] bf16, {nbytes / 2**30:.2f} GiB, in mapped "
            "pinned host memory and in device memory",
            flush=True,
        )
        host = gpu.alloc_host(nbytes, mapped=True)
        fill_random(host, rng)
        host_weight = gpu.host_device_ptr(host)
        dev_table = gpu.alloc(nbytes)
        gpu.upload_pinned_async(host, dev_table, 0)  # the same bytes, by one DMA
        out = gpu.alloc(max(n for n, _ in SHAPES) * ROW_BYTES)
        gpu.synchronize()
        pcie = pinned_copy_rate(gpu)
        print(f"pinned host-to-device copy: {pcie / 1e9:.1f} GB/s (one 256 MiB DMA)", flush=True)

        for n, _ in SHAPES:  # the two tables give the same bits (one call checked)
            ids = rng.integers(0, rows, n, dtype=np.uint32)
            ids_dev = gpu.alloc(ids.nbytes)
            gpu.copy_h2d_async(ids, ids_dev)
            same = np.array_equal(
                gathered(gpu, k, ids_dev, n, host_weight, out), gathered(gpu, k, ids_dev, n, dev_table, out)
            )
            gpu.free(ids_dev)
            assert same, "host and device gathers differ"
        table_rows = []
        for n, batch in SHAPES:
            # fresh rows for every call (the gate's copy also flushes L2 before each batch)
            host_us = time_gather(gpu, k, host_weight, rows, out, n, batch, rng, " from host")
            dev_us = time_gather(gpu, k, dev_table, rows, out, n, batch, rng, " from device")
            moved = n * ROW_BYTES
            table_rows.append(
                (
                    n,
                    moved,
                    host_us,
                    dev_us,
                    host_us / dev_us,
                    moved / (host_us * 1e-6) / 1e9,
                    moved / (dev_us * 1e-6) / 1e9,
                )
            )
            print(f"{n} rows: host {host_us:.2f} us, device {dev_us:.2f} us", flush=True)

        gpu.free(out)
        gpu.free(dev_table)
        gpu.free_host(host)
        prefill = table_rows[-1]
        print(
            f"prefill gather ({prefill[0]} rows) from host memory: {prefill[5]:.1f} GB/s of rows, "
            f"{prefill[5] * 1e9 / pcie:.2f}x the pinned copy rate"
        )
        print_table(
            f"zero-copy gather, {DIM}-wide bf16 rows ({ROW_BYTES} B) from a {nbytes / 2**30:.2f} GiB "
            "table: mapped pinned host memory vs device memory",
            ["rows", "bytes", "host us", "device us", "host/device", "host GB/s", "device GB/s"],
            table_rows,
            note="Each row is one gather size: rows per call and their bytes, median GPU us per call from host "
            "and from device memory, their ratio, and the row bytes gathered per second from each.",
        )


if __name__ == "__main__":
    run(main, make_parser())
