"""Random 512-byte row reads from device memory as the footprint grows: where the read rate falls.

An n-gram gather reads one 512-byte row (256 bf16) per (token, table), at a hashed row of a table
of millions: LongCat-Flash-Lite's 12 tables hold 63 GB. This probe reads such rows with one
kernel (``bench/row_reads.cu``), one warp a row, over footprints of 1 to 64 GiB laid out as one
table or twelve (table-major, as the gathers order their reads), for the reads of a 1024- and an
8192-token prefill (12 288 and 98 304 rows). Variants: one read a warp (the gathers' shape), 8
reads a warp all in flight, 8 a warp one after another; the memory from ``cuMemAlloc`` or from
``cuMemCreate`` mapped at 2 MiB or 1 GiB alignment (``--quick``: 1 and 64 GiB, ``cuMemAlloc``).

Columns: GPU us per call (back to back behind a gate, bench.common.gated_gpu_us, a fresh row
set every call), rows per us, and the read rate in GB/s against the copy bandwidth measured in
this run. ``--ncu FOOTPRINT_GIB`` runs one case (one table, one read a warp, 12 288 rows) for a
profiler to time (NOTES.md has the counters).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cuda.bindings import driver as cu

from bench.common import bench_parser, copy_bandwidth, gated_gpu_us, positive_int, print_table, run
from gpu_runtime import CudaBackend, CudaError, LaunchConfig
from gpu_runtime.driver import call
from gpu_runtime.launch import Kernel

SOURCE = Path(__file__).with_name("row_reads.cu")
ROW = 512  # bytes: a 256-wide bf16 table row
GIB = 1 << 30
FOOTPRINTS_GIB = (1, 4, 16, 64)
READS = (1024 * 12, 8192 * 12)  # a 1024- and an 8192-token prefill's table rows, T = 12
THREADS = 256
# (label, reads per warp, reads in flight per warp, each table's reads in address order)
SHAPES = (
    ("1 a warp", 1, 1, 0),
    ("1 a warp, address order", 1, 1, 1),
    ("8 a warp, in flight", 8, 8, 0),
    ("8 a warp, chained", 8, 1, 0),
)


def kernels(gpu: CudaBackend) -> tuple[Kernel, Kernel]:
    """The fill and the probe, bound on ``gpu``."""
    return gpu.bind(gpu.kernel(SOURCE, "fill_random_bf16")), gpu.bind(gpu.kernel(SOURCE, "read_random_rows"))


def narrow_kernel(gpu: CudaBackend) -> Kernel:
    """The probe of rows of any multiple of 8 bytes up to 1 KiB (``read_random_rows_8``), bound on
    ``gpu``: what ``Probe`` and ``read_floor_us`` take with ``row`` other than 512."""
    return gpu.bind(gpu.kernel(SOURCE, "read_random_rows_8"))


def fill_bf16(gpu: CudaBackend, fill: Kernel, ptr: int, count: int, seed: int, scale: float, stream: int) -> None:
    """``count`` bf16 at ``ptr`` set to ``scale`` * uniform [-1, 1) values, on the device."""
    blocks = min(-(-count // THREADS), int(gpu.sm_count) * 64)
    fill.launch(LaunchConfig(blocks, THREADS), stream, ptr, count, seed, scale)


class Probe:
    """``run(i)`` reads ``reads`` random rows of ``row`` bytes over ``nbytes`` at ``data``, laid out
    as ``tables`` tables; ``us()`` is the median GPU us of one such call (a fresh row set every
    call). ``kernel``: ``kernels``' probe for 512-byte rows, ``narrow_kernel`` (one read a warp,
    ``shape`` unused) for any other ``row``, a multiple of 8 up to 1024."""

    def __init__(
        self,
        kernel: Kernel,
        data: int,
        nbytes: int,
        tables: int,
        reads: int,
        sink: int,
        stream: int,
        shape: tuple[int, int, int] = (1, 1, 0),
        row: int = ROW,
    ) -> None:
        per_warp, in_flight, in_order = shape if row == ROW else (1, 1, 0)  # as SHAPES gives them
        if row != ROW and not (row % 8 == 0 and 8 <= row <= 1024):
            raise ValueError(f"Probe: rows of a multiple of 8 bytes up to 1024, got {row}")
        warps = -(-reads // per_warp)
        self.config = LaunchConfig(-(-warps * 32 // THREADS), THREADS)
        self.kernel, self.stream = kernel, stream
        table_rows = nbytes // row // tables
        if row == ROW:
            self.args: tuple[int, ...] = (data, table_rows, tables, reads, per_warp, in_flight, in_order)
        else:
            self.args = (data, table_rows, tables, reads, row // 8)
        self.sink = sink

    def run(self, i: int) -> None:
        self.kernel.launch(self.config, self.stream, *self.args, i + 1, self.sink)

    def us(self) -> float:
        return gated_gpu_us(self.run, stream=self.stream, batch=8, warmup=2, iters=7)[0]


@contextmanager
def device_memory(gpu: CudaBackend, nbytes: int, how: str) -> Iterator[int]:
    """``nbytes`` of device memory: ``malloc`` (``cuMemAlloc``), or ``vmm-2m`` / ``vmm-1g``
    (one ``cuMemCreate`` handle mapped at an address aligned to 2 MiB / 1 GiB)."""
    if how == "malloc":
        buf = gpu.alloc(nbytes)
        try:
            yield int(buf)
        finally:
            call(cu.cuCtxSynchronize)
            gpu.free(buf)
        return
    align = {"vmm-2m": 2 << 20, "vmm-1g": GIB}[how]
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(gpu.device)
    gran = int(
        call(
            cu.cuMemGetAllocationGranularity,
            prop,
            cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    )
    size = -(-nbytes // max(gran, align)) * max(gran, align)
    handle = call(cu.cuMemCreate, size, prop, 0)
    try:
        ptr = int(call(cu.cuMemAddressReserve, size, align, 0, 0))
        try:
            call(cu.cuMemMap, ptr, size, 0, handle, 0)
            try:
                access = cu.CUmemAccessDesc()
                access.location = prop.location
                access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                call(cu.cuMemSetAccess, ptr, size, [access], 1)
                yield ptr
            finally:
                call(cu.cuCtxSynchronize)
                call(cu.cuMemUnmap, ptr, size)
        finally:
            call(cu.cuMemAddressFree, ptr, size)
    finally:
        call(cu.cuMemRelease, handle)


def make_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, "bench.row_reads")
    parser.add_argument("--quick", action="store_true", help="1 and 64 GiB, cuMemAlloc only")
    parser.add_argument(
        "--ncu", type=positive_int, metavar="FOOTPRINT_GIB", help="run one case for a profiler, print nothing"
    )
    return parser


def main(args: argparse.Namespace) -> None:
    with CudaBackend() as gpu:
        stream = gpu.create_stream()
        _fill, probe = kernels(gpu)
        sink = gpu.alloc(4 << 20)
        if args.ncu is not None:
            with device_memory(gpu, args.ncu * GIB, "malloc") as data:
                for i in range(3):
                    Probe(probe, data, args.ncu * GIB, 1, READS[0], int(sink), stream).run(i)
            gpu.synchronize(stream)
            return
        bw = copy_bandwidth(gpu)
        free = gpu.mem_info()[0]
        footprints = (1, 64) if args.quick else FOOTPRINTS_GIB
        rows = []
        for how in ("malloc",) if args.quick else ("malloc", "vmm-2m", "vmm-1g"):
            for gib in footprints if how == "malloc" else (1, 64):
                if gib * GIB > free - (6 << 30):
                    print(f"{gib} GiB skipped: {free >> 30} GiB free")
                    continue
                try:
                    with device_memory(gpu, gib * GIB, how) as data:
                        rows += footprint_rows(probe, data, how, gib, int(sink), stream, bw)
                except CudaError as exc:  # a driver that will not map it: say so, go on
                    print(f"{how} {gib} GiB: {exc}")
        print(f"measured: copy {bw / 1e12:.2f} TB/s")
        print_table(
            "random 512-byte row reads (one kernel call)",
            ["memory", "GiB", "tables", "rows", "warps", "GPU us", "rows/us", "GB/s", "x copy bw"],
            rows,
            note="Each row is one call of bench/row_reads.cu's read_random_rows: a fresh random row set per call, "
            "table-major over the tables, back to back behind a gate; x copy bw: the read rate over this run's "
            "device-to-device copy bandwidth.",
        )
        gpu.free(sink)


def footprint_rows(
    probe: Kernel, data: int, how: str, gib: int, sink: int, stream: int, bw: float
) -> list[tuple[object, ...]]:
    """The table's rows for ``gib`` GiB at ``data``: every layout and prefill; reads in address
    order over twelve tables only, and 8 reads a warp only at 1 and 64 GiB over one table."""
    rows: list[tuple[object, ...]] = []
    for tables in (1, 12):
        for reads in READS:
            for label, per_warp, in_flight, in_order in SHAPES:
                if (per_warp > 1 and (gib not in (1, 64) or tables > 1)) or (in_order and tables == 1):
                    continue
                us = Probe(probe, data, gib * GIB, tables, reads, sink, stream, (per_warp, in_flight, in_order)).us()
                rate = reads * ROW / (us * 1e-6)
                rows.append((how, gib, tables, reads, label, us, reads / us, rate / 1e9, rate / bw))
    return rows


def read_floor_us(
    kernel: Kernel, data: int, nbytes: int, tables: int, reads: int, sink: int, stream: int, row: int = ROW
) -> float:
    """The cold-read floor: GPU us of ``reads`` random ``row``-byte rows, one warp each, over
    ``nbytes`` at ``data`` laid out as ``tables`` tables (the probe's first shape; ``Probe`` says
    which kernel a ``row`` takes)."""
    return Probe(kernel, data, nbytes, tables, reads, sink, stream, row=row).us()


if __name__ == "__main__":
    run(main, make_parser())
