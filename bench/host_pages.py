"""Probe: does the way host memory is pinned change the GPU's zero-copy gather over a large table?

Host tables (``NgramTable.Host``) are read in place over PCIe. Over 8 GiB the gather runs at about
a third of its rate over 1 GiB (NOTES.md, "Host-table misses"): the GPU's TLB reach over mapped
host memory. Larger pages would reach further, if the driver maps them as such. This probe pins
the same table ``[rows, 256]`` bf16 (``--gib``, default 8) in each of these ways in turn:

- ``hostalloc``: ``cuMemHostAlloc`` (DEVICEMAP), what ``alloc_host(mapped=True)`` does;
- ``register-4k``: an anonymous ``mmap`` with ``MADV_NOHUGEPAGE``, then ``cuMemHostRegister``;
- ``register-thp``: the same with ``MADV_HUGEPAGE`` (2 MiB pages where the kernel grants them);
- ``vmm-host``, ``vmm-numa0``: ``cuMemCreate`` of pinned host memory (location HOST, or HOST_NUMA
  node 0) at its recommended granularity, mapped for the device with ``cuMemMap``;

and times the seed's gather (``batched_embed``) of 1024 (a decode step's rows) and 65536 (a
prefill's) random rows from each, fresh rows every call, median GPU us behind a gate
(``gated_gpu_us``), against the same table in device memory. A way the machine refuses is
reported as such and skipped. Every way's gather is checked against the device table's bits.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from bench.common import bench_parser, positive_float, print_table, run, some_of
from bench.host_gather import DIM, ROW_BYTES, fill, gathered, random_block, tile, time_gather
from gpu_runtime import CudaBackend
from gpu_runtime.driver import call
from layers.kernel_files import load_kernel

HUGE = 2 << 20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
SHAPES = ((1024, 16), (65536, 4))  # (rows per call, calls per gated batch)
WAYS = ("hostalloc", "register-4k", "register-thp", "vmm-host", "vmm-numa0")

Table = tuple[int, str]  # (the table's device address, what backs it)
Way = Callable[[CudaBackend, int, np.ndarray], contextlib.AbstractContextManager[Table]]


def anon_huge_kib() -> int:
    """This process's anonymous memory in transparent huge pages, KiB (0 where not reported)."""
    with contextlib.suppress(OSError), open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def thp_mode() -> str:
    """The kernel's transparent huge page setting, as it prints it."""
    try:
        with open(THP_SETTING) as f:
            return f.read().strip()
    except OSError:
        return "not reported"


@contextlib.contextmanager
def hostalloc(gpu: CudaBackend, nbytes: int, block: np.ndarray) -> Iterator[Table]:
    host = gpu.alloc_host(nbytes, mapped=True)
    try:
        fill(host, block)
        yield int(gpu.host_device_ptr(host)), "cuMemHostAlloc"
    finally:
        gpu.free_host(host)


def advised_memory(nbytes: int, advice: int) -> np.ndarray:
    """``nbytes`` of anonymous memory as a uint8 array, 2 MiB-aligned (so that whole huge pages
    fit) and advised ``advice`` (``mmap.MADV_*``); unmapped when the last array over it goes."""
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mm, dtype=np.uint8)  # holds mm (and its arrays hold it)
    start = -whole.ctypes.data % HUGE
    mm.madvise(advice, start, nbytes)
    return whole[start : start + nbytes]


def registered(advice: int) -> Way:
    @contextlib.contextmanager
    def way(gpu: CudaBackend, nbytes: int, block: np.ndarray) -> Iterator[Table]:
        before = anon_huge_kib()
        host = advised_memory(nbytes, advice)
        fill(host, block)
        huge = (anon_huge_kib() - before) << 10
        table = int(gpu.register_host(host))
        try:
            yield table, f"mmap, {huge / nbytes:.0%} in huge pages"
        finally:
            gpu.unregister_host(host)

    return way


def vmm(location: Any, numa: int) -> Way:
    @contextlib.contextmanager
    def way(gpu: CudaBackend, nbytes: int, block: np.ndarray) -> Iterator[Table]:
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = location
        prop.location.id = numa
        gran = int(
            call(
                cu.cuMemGetAllocationGranularity,
                prop,
                cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        )
        size = -(-nbytes // gran) * gran
        handle = call(cu.cuMemCreate, size, prop, 0)
        try:
            ptr = int(call(cu.cuMemAddressReserve, size, max(gran, HUGE), 0, 0))
            try:
                call(cu.cuMemMap, ptr, size, 0, handle, 0)
                try:
                    call(
                        cu.cuMemSetAccess,
                        ptr,
                        size,
                        [_access(cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, gpu.device)],
                        1,
                    )
                    for off, n in tile(block, nbytes):
                        call(cu.cuMemcpyHtoD, ptr + off, block.ctypes.data, n)
                    cpu = cpu_access(ptr, size, location, numa, block)
                    yield ptr, f"cuMemCreate, granularity {gran >> 10} KiB; CPU: {cpu}"
                finally:
                    call(cu.cuMemUnmap, ptr, size)
            finally:
                call(cu.cuMemAddressFree, ptr, size)
        finally:
            call(cu.cuMemRelease, handle)

    return way


def _access(location: Any, ident: int) -> Any:
    access = cu.CUmemAccessDesc()
    access.location.type = location
    access.location.id = ident
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return access


def cpu_mapped(ptr: int) -> bool:
    """Whether this process's CPU page tables map the address (``/proc/self/maps``), so that a
    read of it cannot fault."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return line.split()[1].startswith("r")
    return False


def cpu_access(ptr: int, size: int, location: Any, numa: int, block: np.ndarray) -> str:
    """Whether the CPU can be given access to the host allocation at ``ptr`` (a table ``alloc_host``
    could hand out as a numpy array), and reads what the device wrote there."""
    try:
        call(cu.cuMemSetAccess, ptr, size, [_access(location, numa)], 1)
    except RuntimeError as exc:
        return f"refused ({str(exc)[:40]})"
    if not cpu_mapped(ptr):
        return "granted, not in /proc/self/maps"
    seen = np.ctypeslib.as_array((ctypes.c_uint8 * block.size).from_address(ptr))
    return "reads the table" if np.array_equal(seen, block) else "reads other bytes"


def ways() -> dict[str, Way]:
    types = cu.CUmemLocationType
    return {
        "hostalloc": hostalloc,
        "register-4k": registered(mmap.MADV_NOHUGEPAGE),
        "register-thp": registered(mmap.MADV_HUGEPAGE),
        "vmm-host": vmm(types.CU_MEM_LOCATION_TYPE_HOST, 0),
        "vmm-numa0": vmm(types.CU_MEM_LOCATION_TYPE_HOST_NUMA, 0),
    }


def make_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, "bench.host_pages")
    parser.add_argument("--gib", type=positive_float, default=8.0, help="the table's size in GiB (default 8)")
    parser.add_argument(
        "--ways", type=some_of(WAYS), default=list(WAYS), help=f"which, comma-separated (default {','.join(WAYS)})"
    )
    return parser


def main(args: argparse.Namespace) -> None:
    chosen = args.ways
    rng = np.random.default_rng(0)
    print(f"transparent huge pages: {thp_mode()}", flush=True)
    with CudaBackend() as gpu:
        k = load_kernel(gpu, "embed_from_argmax", "batched_embed")
        rows = int(args.gib * (1 << 30)) // ROW_BYTES
        nbytes = rows * ROW_BYTES
        block = random_block(rng, nbytes)
        print(f"device {gpu.name}: table [{rows}, {DIM}] bf16, {nbytes / 2**30:.2f} GiB", flush=True)
        check_ids = rng.integers(0, rows, 1024, dtype=np.uint32)
        ids_dev = gpu.alloc(check_ids.nbytes)
        out = gpu.alloc(max(n for n, _ in SHAPES) * ROW_BYTES)
        gpu.copy_h2d_async(check_ids, ids_dev)

        def timings(table: int) -> list[float]:
            return [time_gather(gpu, k, table, rows, out, n, batch, rng) for n, batch in SHAPES]

        dev_table = gpu.alloc(nbytes)
        for off, n in tile(block, nbytes):
            gpu.copy_h2d_async(block[:n], dev_table + off)
        gpu.synchronize()
        want = gathered(gpu, k, ids_dev, check_ids.size, dev_table, out)
        device = timings(dev_table)
        gpu.free(dev_table)
        print(f"device: {device[0]:.2f} us / {device[1]:.1f} us", flush=True)

        table_rows: list[tuple[Any, ...]] = [("device memory", "cuMemAlloc", *_cells(device, device))]
        for name in chosen:
            with contextlib.ExitStack() as held:
                try:
                    table, backing = held.enter_context(ways()[name](gpu, nbytes, block))
                except (OSError, ValueError, RuntimeError, AttributeError) as exc:  # CudaError, or an enum not bound
                    print(f"{name}: not available here: {exc}", flush=True)
                    table_rows.append((name, f"refused: {str(exc)[:60]}", "-", "-", "-", "-"))
                    continue
                # from here on a failure (the gather, the timing) is raised, not shown as a refusal
                same = np.array_equal(gathered(gpu, k, ids_dev, check_ids.size, table, out), want)
                assert same, f"{name}: the gather differs from the device table's"
                times = timings(table)
            print(f"{name} ({backing}): {times[0]:.2f} us / {times[1]:.1f} us", flush=True)
            table_rows.append((name, backing, *_cells(times, device)))
        gpu.free(out)
        gpu.free(ids_dev)
    (n_small, _), (n_large, _) = SHAPES
    print_table(
        f"zero-copy gather of {DIM}-wide bf16 rows ({ROW_BYTES} B) from a {nbytes / 2**30:.2f} GiB table, "
        "by how its host memory is pinned",
        ["memory", "backing", f"{n_small} rows us", "x device", f"{n_large} rows GB/s", "x device"],
        table_rows,
        note=f"Median GPU us per gather of {n_small} random rows, and GB/s of row bytes for {n_large} rows, "
        "fresh rows every call; 'x device': the time against the same table's in device memory, same run.",
    )


def _cells(times: list[float], device: list[float]) -> tuple[float, float, float, float]:
    """us of the small gather and its ratio to the device table's; GB/s of the large one and its
    time's ratio to the device table's."""
    return times[0], times[0] / device[0], SHAPES[1][0] * ROW_BYTES / (times[1] * 1e-6) / 1e9, times[1] / device[1]


if __name__ == "__main__":
    run(main, make_parser())
