"""Probe: random Engram rows from a host table of real size, read by the GPU in place or gathered
by the CPU into a pinned staging buffer and sent in one copy a chunk.

An Engram lookup reads 24 random 264-byte rows (256 e4m3 values, 8 e8m0 scales) per token from a
table of ~101 GB. Read in place over PCIe by the GPU (what host tables do now), the rate falls
with the footprint: about 45 GB/s of rows over 1 GiB, 6-8 GB/s over 101 GB (NOTES-engram.md).
The host's own caches and page walks are another path: CPU threads gather the rows into pinned
memory (``np.take``, which releases the GIL), and each chunk goes to the device in one DMA while
the next chunk is gathered.

For the rows of a 1024- and an 8192-token prefill (24 576 and 196 608 rows), fresh random rows
every call, this prints GB/s of row bytes for: the GPU reading the table in place (the
``read_random_rows_8`` floor kernel of ``bench.row_reads``, median GPU us behind a gate) over
``--gib`` and over 1 GiB of the same memory (the small-table rate); the CPU gather alone by
thread count (median wall time); the pinned copy alone; the gather and the copies pipelined in
chunks (wall time from the first gather to the stream's end). The table is an anonymous mapping
with ``MADV_HUGEPAGE`` registered with ``cuMemHostRegister``, as an engine shares one host copy.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.common import bench_parser, gpu_time_ms, positive_float, positive_int, print_table, run
from bench.host_gather import random_block, tile
from bench.host_pages import advised_memory
from bench.row_reads import narrow_kernel, read_floor_us
from gpu_runtime import CudaBackend

ROW = 264  # bytes: 256 e4m3 values and 8 e8m0 scales
ROWS_PER_TOKEN = 24
TOKENS = (1024, 8192)
HUGE = 2 << 20
SMALL_GIB = 1
REPEATS = 7


@contextlib.contextmanager
def host_table(gpu: CudaBackend, nbytes: int, threads: int) -> Iterator[tuple[np.ndarray, int]]:
    """(``[rows, ROW]`` uint8 view, its device pointer): anonymous memory advised
    ``MADV_HUGEPAGE``, filled with random bytes by ``threads`` threads, registered for the device."""
    flat = advised_memory(nbytes, mmap.MADV_HUGEPAGE)
    block = random_block(np.random.default_rng(1), nbytes)

    def fill_span(span: tuple[int, int]) -> None:
        off, n = span
        flat[off : off + n] = block[:n]

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill_span, tile(block, nbytes)))
    ptr = int(gpu.register_host(flat))
    try:
        yield flat.reshape(-1, ROW), ptr
    finally:
        gpu.unregister_host(flat)


def split(n: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices covering ``range(n)``."""
    return [slice(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def cpu_gather_s(pool: ThreadPoolExecutor, threads: int, table: np.ndarray, ids: np.ndarray, out: np.ndarray) -> float:
    """Wall seconds of ``out[:] = table[ids]`` split over ``threads`` threads."""

    def part(s: slice) -> None:
        np.take(table, ids[s], axis=0, out=out[s])

    t0 = time.perf_counter()
    list(pool.map(part, split(ids.size, threads)))
    return time.perf_counter() - t0


def pipelined_s(
    gpu: CudaBackend,
    pool: ThreadPoolExecutor,
    threads: int,
    table: np.ndarray,
    ids: np.ndarray,
    staging: np.ndarray,
    dev: int,
    chunks: int,
) -> float:
    """Wall seconds of the gather of ``ids`` into ``staging`` chunk by chunk, each chunk copied to
    ``dev`` on the stream while the next is gathered, to the stream's end."""
    t0 = time.perf_counter()
    for s in split(ids.size, chunks):
        cpu_gather_s(pool, threads, table, ids[s], staging[s])
        gpu.upload_pinned_async(staging[s], dev + s.start * ROW, 0)
    gpu.synchronize()
    return time.perf_counter() - t0


def make_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, "bench.host_staging")
    parser.add_argument(
        "--gib", type=positive_float, default=94.4, help="the table's size in GiB (default 94.4: 101.4 GB)"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        nargs="+",
        default=None,
        help="CPU gather threads (default 1, 4, 8 and all cores)",
    )
    parser.add_argument("--chunks", type=positive_int, default=8, help="chunks of the pipelined gather (default 8)")
    return parser


def main(args: argparse.Namespace) -> None:
    cores = os.cpu_count() or 1
    threads = args.threads or sorted({1, min(4, cores), min(8, cores), cores})
    nbytes = int(args.gib * (1 << 30)) // ROW * ROW
    rng = np.random.default_rng(0)
    rows_out: list[tuple[object, ...]] = []
    with CudaBackend() as gpu, ThreadPoolExecutor(max(threads)) as pool:
        probe = narrow_kernel(gpu)
        most = TOKENS[-1] * ROWS_PER_TOKEN
        sink = gpu.alloc(most * 4)
        dev = gpu.alloc(most * ROW)
        pinned = gpu.alloc_host(most * ROW)
        staging = pinned.reshape(-1, ROW)
        t0 = time.perf_counter()
        with host_table(gpu, nbytes, cores) as (table, ptr):
            print(
                f"device {gpu.name}; host table {nbytes / 1e9:.1f} GB filled and registered in "
                f"{time.perf_counter() - t0:.1f} s; {cores} cores",
                flush=True,
            )
            for tokens in TOKENS:
                n = tokens * ROWS_PER_TOKEN
                gb = n * ROW / 1e9

                def rate(seconds: float) -> float:
                    return gb / seconds  # noqa: B023 (used within the iteration)

                gpu_big = read_floor_us(probe, ptr, nbytes, 1, n, sink, 0, row=ROW) * 1e-6
                gpu_small = read_floor_us(probe, ptr, SMALL_GIB << 30, 1, n, sink, 0, row=ROW) * 1e-6
                copy = gpu_time_ms(lambda i: gpu.upload_pinned_async(staging[:n], dev, 0), warmup=2, iters=10) * 1e-3  # noqa: B023
                rows_out.append((tokens, "GPU reads in place", f"{args.gib:.1f} GiB", rate(gpu_big), 1.0))
                rows_out.append(
                    (tokens, "GPU reads in place", f"{SMALL_GIB} GiB", rate(gpu_small), gpu_big / gpu_small)
                )
                rows_out.append((tokens, "pinned copy alone", "-", rate(copy), gpu_big / copy))
                for t in threads:
                    times, pipes = [], []
                    for _ in range(REPEATS):
                        ids = rng.integers(0, table.shape[0], n)
                        times.append(cpu_gather_s(pool, t, table, ids, staging[:n]))
                        ids = rng.integers(0, table.shape[0], n)
                        pipes.append(pipelined_s(gpu, pool, t, table, ids, staging[:n], dev, args.chunks))
                    assert np.array_equal(staging[:n], table[ids]), "the staged rows differ from the table's"
                    cpu, pipe = float(np.median(times)), float(np.median(pipes))
                    rows_out.append(
                        (tokens, f"CPU gather, {t} threads", f"{args.gib:.1f} GiB", rate(cpu), gpu_big / cpu)
                    )
                    rows_out.append(
                        (
                            tokens,
                            f"CPU gather + copy in {args.chunks} chunks, {t} threads",
                            f"{args.gib:.1f} GiB",
                            rate(pipe),
                            gpu_big / pipe,
                        )
                    )
                print(f"{tokens} tokens done", flush=True)
        gpu.free_host(pinned)
        gpu.free(dev)
        gpu.free(sink)
    print_table(
        f"random {ROW}-byte rows from a host table: the GPU in place against a CPU gather into pinned staging",
        ["tokens", "how", "footprint", "GB/s of rows", "x GPU in place"],
        rows_out,
        note=f"{ROWS_PER_TOKEN} random rows a token, fresh rows every call; GPU rows: median GPU time behind a "
        "gate; CPU rows: median wall time of "
        f"{REPEATS} calls; 'x GPU in place': the rate against the GPU's over the whole table, same run.",
    )


if __name__ == "__main__":
    run(main, make_parser())
