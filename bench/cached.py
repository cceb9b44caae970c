"""NVMe-backed n-gram tables (``RowCache``) against the same tables resident on the device.

Configuration (as bench/ngram_embed): D = 4096, N = 3, K = 8 (T = 16 tables), table dim 256,
2^20 + 2c rows per table, bf16, vocab 128k, 4096-token context. The 16 table files (512 MiB
each, 8 GiB) live in ``--table-dir`` (default $BENCH_TABLE_DIR, else /tmp/ngram_tables); they
are written once by tiling a random 32 MiB block, and reused while their headers match. The resident reference
layer uploads the same files, so the two layers must give bit-identical outputs.

Decode table (S = 1, one new token after the context; every cache holds 65536 rows per table):
  wall us       median host time per step, synchronised
  mean wall us  mean of the same (misses are tail events: the median hides them)
  host us       median host time until embed returned (queued, not synchronised)
  GPU us        median CUDA-event time per step (includes the GPU idling while the host resolves)
  x resident    wall us / resident wall us (target: all-hit within 1.2x)
  miss rate     misses / table lookups (each step looks up one id per table)
  prefetched    rows prefetch asked the kernel to read ahead (posix_fadvise WILLNEED)
"all hits" repeats one step; the Zipf rows decode 2000 fresh tokens ~ Zipf(a=1.2), after an
untimed prefill of the context that warms the caches, with the files dropped from the page cache
first (cold NVMe). "+ prefetch" calls layer.prefetch for the next step before each embed.
"bookkeeping alone" is the host time of the caches' validate + resolve + end_batch for the
all-hit step's ids, without the layer: what a cached table adds to a step's host work.

Fused table (the last printed): FusedNgramEmbedding.embed_batch(..., graph=True) on a created
stream, B sequences of one new token each after a CONTEXT-token context (B = 1 and 64), the
same layer with RowCache tables (all hits: the same step repeated after a warming call) and
resident; the two are timed in alternation (bench.common.interleaved_times_us).
  wall us       median host time per step, synchronised
  host us       median host time until embed_batch returned
  GPU us        median CUDA-event time per step
  x res wall / x res host   the ratios to the resident step (targets: <= 1.3 at B = 1,
                <= 1.5 at B = 64, wall)
  pack us       the host time of the step's pack and end of batch alone (windows given): for the
                cached layer that is the ids hashed from the windows, the CacheGroup's resolve
                and the end_batch calls; the resident one only packs
  misses        misses during the timed steps (0: all hits)
``--only-fused`` (or CACHED_BENCH=fused) runs only this table (the table files are still written
or reused).

Miss table: one cache (capacity 65536) over table 0 resolves 65536 distinct random ids (resolve
sorts them itself) into a fresh arena, synchronised. GB/s = bytes read / wall; io frac =
stats.io_seconds / wall. Floors: pinned H2D copy rate, the file's cold sequential read rate
(8 MiB reads; rows/s = that rate over the 512 B row size), and the disk's cold random 4 KiB
read rate (rows/s = reads/s: a random row costs one page read; GB/s = rows/s x 512 B).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from cuda.bindings import driver as cu

from bench.common import (
    Events,
    bench_parser,
    gpu_time_ms,
    host_time_us,
    interleaved_times_us,
    nonempty,
    print_table,
    run,
)
from bench.ngram_embed import CONTEXT, DIMS, device_weight
from gpu_runtime import CudaBackend, DeviceBuffer
from gpu_runtime.driver import call
from layers.dense_weight import BF16, DenseWeight
from layers.ngram_embed import FusedNgramEmbedding, NgramEmbedding, NgramTable, NgramWeights
from layers.ngram_embed.ids import ngram_ids_tail
from layers.ngram_store.row_cache import RowCache
from layers.ngram_store.table_file import TableFile, TableFormatError, TableHeader, TableWriter

CAPACITY = 65536  # rows per table in each cache's device arena
FUSED_BATCHES = (1, 64)  # sequences per fused decode step, one new token each
STEPS = 2000  # decode steps of the Zipf stream
BLOCK_ROWS = 65536  # 32 MiB of 256-wide bf16: the block tiled into the files and uploads
GB = 1e9


def say(msg: str) -> None:
    print(msg, flush=True)


def ensure_tables(directory: str, rng: np.random.Generator) -> tuple[list[str], int, float]:
    """(paths, files written, seconds writing): missing files are written, table files of other
    sizes rewritten; a file there that is no table file is refused (``SystemExit``), not replaced."""
    os.makedirs(directory, exist_ok=True)
    td = DIMS.table_dim()
    block = rng.standard_normal((BLOCK_ROWS, td), np.float32).astype(BF16)
    paths, written, t0 = [], 0, time.perf_counter()
    for c in range(DIMS.num_tables()):
        path, rows = os.path.join(directory, f"table_{c:02d}.bin"), DIMS.table_rows(c)
        paths.append(path)
        try:
            with TableFile(path) as f:
                if f.header == TableHeader(BF16, rows, td):
                    continue
        except FileNotFoundError:
            pass
        except (TableFormatError, IsADirectoryError) as exc:
            sys.exit(f"python -m bench.cached: {path}: not a table file, not replaced ({exc}); try another --table-dir")
        tile = np.roll(block, 977 * c, axis=0)  # tables differ, so a mixed-up table shows
        with TableWriter(path, BF16, rows, td) as w:  # fsyncs on close
            while w.written < rows:
                w.append(tile[: min(BLOCK_ROWS, rows - w.written)])
        written += 1
    return paths, written, time.perf_counter() - t0


def upload_table(gpu: CudaBackend, path: str) -> DenseWeight:
    """The file's rows on the device, uploaded in 32 MiB pieces (small pinned staging)."""
    with TableFile(path) as f:
        buf = DeviceBuffer(gpu, f.rows * f.row_bytes)
        for a in range(0, f.rows, BLOCK_ROWS):
            gpu.copy_h2d_async(f.rows_bytes[a : a + BLOCK_ROWS], buf.ptr + a * f.row_bytes)
        gpu.synchronize()
        return DenseWeight.owning(gpu, buf, (f.rows, f.dim), BF16)


def drop_page_cache(paths: list[str]) -> None:
    for path in paths:
        with TableFile(path) as f:
            f.advise_dontneed()


def counts(caches: list[RowCache]) -> np.ndarray:
    """[hits, misses, prefetched] summed over the caches."""
    return np.array([[c.stats.hits, c.stats.misses, c.stats.prefetched] for c in caches]).sum(axis=0)


def zipf_decode(
    gpu: CudaBackend,
    layer: NgramEmbedding,
    caches: list[RowCache],
    ctx: np.ndarray,
    out: int,
    stream: int,
    prefetch: bool,
) -> tuple[list[float], list[float], list[float], np.ndarray]:
    """Per-step wall, host and GPU us over STEPS fresh tokens, and the cache counts of those
    steps."""
    layer.embed(ctx[:CONTEXT], CONTEXT, out, gpu, stream)  # prefill: warms the caches, untimed
    gpu.synchronize(stream)
    before, ev, walls, hosts, gpus = counts(caches), Events(), [], [], []
    for k in range(STEPS):
        n = CONTEXT + k + 1
        t0 = time.perf_counter()
        if prefetch:
            layer.prefetch(ctx[: n + 1], 1)
        call(cu.cuEventRecord, ev.start, stream)
        layer.embed(ctx[:n], 1, out, gpu, stream)
        call(cu.cuEventRecord, ev.stop, stream)
        t1 = time.perf_counter()
        gpu.synchronize(stream)
        walls.append((time.perf_counter() - t0) * 1e6)
        hosts.append((t1 - t0) * 1e6)
        gpus.append(ev.elapsed_ms() * 1e3)
    ev.close()
    return walls, hosts, gpus, counts(caches) - before


def bookkeeping(caches: list[RowCache], ids: list[np.ndarray]) -> None:
    """What a cached all-hit decode step adds on the host, without the layer: each cache's
    ``validate``, ``resolve`` and ``end_batch`` for the step's one id per table (all hits)."""
    for cache, table_ids in zip(caches, ids):
        cache.validate(table_ids)
        cache.resolve(table_ids, np.empty(1, np.uint32))
        cache.end_batch()


def fused_decode(
    gpu: CudaBackend,
    resident: NgramWeights,
    cached: NgramWeights,
    caches: list[RowCache],
    out: int,
    out_ref: int,
    stream: int,
    rng: np.random.Generator,
) -> list[list]:
    """Rows of the fused table: per batch size, the resident and the all-hit cached step."""
    vocab, h = DIMS.vocab_size, DIMS.hidden_size
    rows_max = max(FUSED_BATCHES)
    fused = {
        "resident": FusedNgramEmbedding(resident, rows_max, stream),
        "cached, all hits": FusedNgramEmbedding(cached, rows_max, stream),
    }
    sync = lambda: gpu.synchronize(stream)  # noqa: E731
    table: list[list] = []
    try:
        for batch in FUSED_BATCHES:
            contexts = [rng.integers(0, vocab, CONTEXT + 1) for _ in range(batch)]
            lens = [1] * batch
            outs = {"resident": out_ref, "cached, all hits": out}  # fixed: each graph is captured once
            steps = {
                name: (lambda i, f=f, o=outs[name]: f.embed_batch(contexts, lens, o, stream, graph=True))
                for name, f in fused.items()
            }
            for step in steps.values():  # the first cached call loads the rows; both capture their graphs
                step(0)
                step(1)
            sync()
            a, b = np.empty(batch * h, np.uint16), np.empty(batch * h, np.uint16)
            gpu.copy_d2h(a, out_ref, stream)
            gpu.copy_d2h(b, out, stream)
            say(f"fused, {batch} sequences: outputs identical: {bool(np.array_equal(a, b))}")
            before = counts(caches)
            times = interleaved_times_us(list(steps.values()), sync)
            misses = int((counts(caches) - before)[1])
            windows = fused["resident"].windows(contexts, lens)

            def pack(i: int, f: FusedNgramEmbedding) -> None:
                with f.batch():  # ends the cached tables' batch
                    f.pack(windows)

            for (name, step), (wall, host) in zip(steps.items(), times):
                f = fused[name]

                def packs(i: int, f: FusedNgramEmbedding = f) -> None:  # a def: mypy cannot type ``lambda i, f=f``
                    return pack(i, f)

                table.append(
                    [
                        batch,
                        name,
                        wall,
                        host,
                        gpu_time_ms(step, stream=stream, warmup=5, iters=50) * 1e3,
                        None,
                        None,
                        host_time_us(packs, warmup=100, iters=2000),
                        misses if f.cached else None,
                    ]
                )
            for r in table[-2:]:
                r[5], r[6] = r[2] / table[-2][2], r[3] / table[-2][3]
    finally:
        sync()
        for f in fused.values():
            f.close()
    return table


def cold_sequential_read(path: str) -> float:
    """Bytes/s of reading the whole file with 8 MiB reads after dropping it from the page cache."""
    drop_page_cache([path])
    buf = memoryview(bytearray(8 << 20))
    total, t0 = 0, time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return total / (time.perf_counter() - t0)


def cold_random_reads(path: str, n: int, threads: int) -> float:
    """4 KiB reads/s at random page offsets of a cold file, ``threads`` preads in flight: the
    disk's random-read rate at distinct pages: a reference for cold misses, not a floor (the rows
    of a random batch share pages and read ahead, so a cold run may beat it)."""
    from concurrent.futures import ThreadPoolExecutor

    drop_page_cache([path])
    pages = os.path.getsize(path) // 4096
    offsets = (np.random.default_rng(1).choice(pages - 1, n, replace=False) + 1) * 4096  # distinct: all cold
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda part: [os.pread(fd, 4096, int(o)) for o in part], np.array_split(offsets, threads)))
        return n / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def pinned_h2d(gpu: CudaBackend, stream: int, nbytes: int = 256 << 20) -> float:
    """Bytes/s of one pinned host-to-device copy, timed with events."""
    host, dev = gpu.alloc_host(nbytes), gpu.alloc(nbytes)
    host[:] = 7
    ms = gpu_time_ms(lambda i: gpu.upload_pinned_async(host, dev, stream), stream=stream, warmup=2, iters=10)
    gpu.free(dev)
    gpu.free_host(host)
    return nbytes / (ms * 1e-3)


def miss_run(gpu: CudaBackend, path: str, stream: int, ids: np.ndarray, io_threads: int) -> tuple[float, float, float]:
    """(rows/s, GB/s, io fraction) of resolving ``ids`` into a fresh cache."""
    cache = RowCache(gpu, path, CAPACITY, stream=stream, io_threads=io_threads)
    slots = np.empty(ids.size, np.uint32)
    t0 = time.perf_counter()
    cache.resolve(ids, slots)
    gpu.synchronize(stream)
    wall = time.perf_counter() - t0
    cache.end_batch()
    s = cache.stats
    cache.close()
    return ids.size / wall, s.bytes_read / wall / GB, s.io_seconds / wall


def make_parser() -> argparse.ArgumentParser:
    parser = bench_parser(
        __doc__,
        "bench.cached",
        "Needs a CUDA GPU and 8 GiB free in the table directory (the files are kept for the next run).",
    )
    parser.add_argument(
        "--table-dir",
        type=nonempty,
        default=os.environ.get("BENCH_TABLE_DIR") or "/tmp/ngram_tables",
        help="where the table files are written and reused (default: $BENCH_TABLE_DIR, else /tmp/ngram_tables)",
    )
    parser.add_argument(
        "--only-fused",
        action="store_true",
        default=os.environ.get("CACHED_BENCH", "all") == "fused",
        help="print only the fused table (default: set by CACHED_BENCH=fused)",
    )
    return parser


def main(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)  # seeded: the same tokens (and cache hits and misses) every run
    t, h, td, vocab = DIMS.num_tables(), DIMS.hidden_size, DIMS.table_dim(), DIMS.vocab_size
    directory = args.table_dir
    say(f"setup: {t} table files in {directory} ...")
    paths, written, secs = ensure_tables(directory, rng)
    size = sum(os.path.getsize(p) for p in paths)
    say(
        f"setup: wrote {written} of {t} files in {secs:.1f} s"
        + (f" ({written * size / t / secs / GB:.2f} GB/s incl. fsync)" if written else " (reused)")
    )

    with CudaBackend() as gpu:
        stream = gpu.create_stream()
        say("setup: uploading the resident tables from the files ...")
        word = device_weight(gpu, rng, vocab, h, 1.0)
        projs = [device_weight(gpu, rng, h, td, td**-0.5) for _ in range(t)]
        tables = [upload_table(gpu, p) for p in paths]
        # owns nothing: word and projs are the cached weights' too; release() closes them and the tables
        resident_weights = NgramWeights(DIMS, word, [NgramTable.Bf16(w) for w in tables], projs, gpu)
        resident = NgramEmbedding(resident_weights, CONTEXT)
        out = gpu.alloc(CONTEXT * h * 2)
        out_ref = gpu.alloc(max(FUSED_BATCHES) * h * 2)
        only_fused = args.only_fused

        def cached_layer() -> tuple[NgramEmbedding, list[RowCache]]:
            caches = [RowCache(gpu, p, CAPACITY, stream=stream) for p in paths]
            weights = NgramWeights(DIMS, word, [NgramTable.Cached(c) for c in caches], projs, gpu)
            weights.own(*caches)  # not word and projs: the resident weights' too
            return NgramEmbedding(weights, CONTEXT), caches

        def close(layer: NgramEmbedding) -> None:
            gpu.synchronize(stream)
            layer.close()
            layer.weights.close()  # its caches, and what the fused path derived

        def release() -> None:
            resident.close()
            resident_weights.close()
            gpu.free(out)
            gpu.free(out_ref)
            for w in [word, *projs, *tables]:
                w.close()
            gpu.destroy_stream(stream)

        say("fused decode: resident and cached all-hit, batches " + ", ".join(map(str, FUSED_BATCHES)) + " ...")
        layer, caches = cached_layer()
        fused_rows = fused_decode(gpu, resident_weights, layer.weights, caches, out, out_ref, stream, rng)
        close(layer)
        fused_title = (
            f"fused decode step, graph=True: B sequences x 1 new token after {CONTEXT} ({t} tables, "
            f"capacity {CAPACITY})"
        )
        fused_note = (
            "Each row is one fused decode step (graph=True) of B sequences, resident or cached (all hits): "
            "wall, host and GPU us per step, the wall and host ratios to resident's, pack us the host's pack "
            "and end of batch alone, and the misses during the timed steps."
        )
        fused_header = ["B", "path", "wall us", "host us", "GPU us", "x res wall", "x res host", "pack us", "misses"]
        if only_fused:
            print_table(fused_title, fused_header, fused_rows, note=fused_note)
            release()
            return

        say("decode: resident and cached all-hit ...")
        ctx = rng.integers(0, vocab, CONTEXT + 1)
        layer, caches = cached_layer()
        resident.embed(ctx, 1, out_ref, gpu, stream)
        layer.embed(ctx, 1, out, gpu, stream)
        a, b = np.empty(h, np.uint16), np.empty(h, np.uint16)
        gpu.copy_d2h(a, out_ref, stream)
        gpu.copy_d2h(b, out, stream)
        say(f"outputs identical: {bool(np.array_equal(a, b))}")
        sync = lambda: gpu.synchronize(stream)  # noqa: E731
        steps = {
            name: lambda i, lay=lay: lay.embed(ctx, 1, out, gpu, stream)  # noqa: E731
            for name, lay in (("resident", resident), ("cached, all hits", layer))
        }
        step_ids = [ids.astype(np.uint32) for ids in ngram_ids_tail(DIMS, ctx, 1)]
        times = interleaved_times_us(list(steps.values()), sync)  # the two alternate: a fair ratio
        rows: list[list] = [
            [name, wall, None, host, gpu_time_ms(step, stream=stream, warmup=5, iters=50) * 1e3, None, None, None]
            for (name, step), (wall, host) in zip(steps.items(), times)
        ]
        rows.append(
            [
                "cached: bookkeeping alone",
                None,
                None,
                host_time_us(lambda i: bookkeeping(caches, step_ids), warmup=100, iters=2000),
                None,
                None,
                None,
                None,
            ]
        )
        close(layer)

        zipf = np.minimum(rng.zipf(1.2, CONTEXT + STEPS + 1) - 1, vocab - 1)
        for name, prefetch in (("cached, Zipf", False), ("cached, Zipf + prefetch", True)):
            say(f"decode: {name}, {STEPS} steps, cold files ...")
            drop_page_cache(paths)
            layer, caches = cached_layer()
            walls, hosts, gpus, (hits, misses, fetched) = zipf_decode(gpu, layer, caches, zipf, out, stream, prefetch)
            close(layer)
            rows.append(
                [
                    name,
                    statistics.median(walls),
                    statistics.mean(walls),
                    statistics.median(hosts),
                    statistics.median(gpus),
                    None,
                    misses / (hits + misses),
                    int(fetched),
                ]
            )
        for r in rows:
            r[5] = r[1] / rows[0][1] if r[1] else None
        print_table(
            f"decode step, S = 1 after {CONTEXT} tokens ({t} tables, capacity {CAPACITY})",
            ["path", "wall us", "mean wall us", "host us", "GPU us", "x resident", "miss rate", "prefetched"],
            rows,
            note="Each row is one decode step (S = 1) with resident or cached tables: median and mean wall us "
            "(synchronised), host us until embed returned, GPU us, wall over resident's, misses per "
            "lookup, and rows prefetched.",
        )

        say("misses: floors, then 65536-row resolves on table 0 ...")
        path, row_bytes = paths[0], td * 2
        ids = rng.choice(DIMS.table_rows(0), CAPACITY, replace=False)
        h2d, seq = pinned_h2d(gpu, stream), cold_sequential_read(path)
        miss_rows = [
            ["floor: pinned H2D (256 MiB)", h2d / row_bytes, h2d / GB, None],
            ["floor: cold sequential read", seq / row_bytes, seq / GB, None],
        ]
        for threads in (16, 1):
            iops = cold_random_reads(path, 20000 if threads > 1 else 5000, threads)
            miss_rows.append(
                [f"reference: cold random 4 KiB reads, {threads} in flight", iops, iops * row_bytes / GB, None]
            )
        cold_sequential_read(path)  # leaves the whole file in the page cache: the warm condition
        miss_rows.append(["page cache, 16 threads", *miss_run(gpu, path, stream, ids, 16)])
        for threads in (16, 1):
            drop_page_cache([path])
            miss_rows.append(
                [f"cold, {threads} thread{'s' * (threads > 1)}", *miss_run(gpu, path, stream, ids, threads)]
            )
        print_table(
            f"miss throughput: {CAPACITY} random rows of {row_bytes} B into a fresh cache",
            ["condition", "rows/s", "GB/s", "io frac"],
            miss_rows,
            note="Each row is a floor or a resolve of the random rows into a fresh cache under one condition: "
            "rows/s and GB/s of rows read, and io frac the share of the wall spent reading the file.",
        )
        print_table(fused_title, fused_header, fused_rows, note=fused_note)

        release()


if __name__ == "__main__":
    run(main, make_parser())
