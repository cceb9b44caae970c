"""Benchmark plumbing: CUDA-event medians, the measured physical ceilings, optional torch, tables.

Every benchmark reports against what the chip can do, measured in the same run: the
device-to-device copy bandwidth (bytes read + written) and, where torch is installed, the
bf16 matrix rate of cuBLAS on random data. torch and CuPy are only ever imported here, lazily,
and only for comparison. ``run`` is every benchmark's command line: its arguments, then the GPU
check, then its ``main``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, NoReturn

from cuda.bindings import driver as cu

from gpu_runtime import CudaBackend, NoDeviceError, cli
from gpu_runtime.driver import call, init


class Events:
    """Start/stop event pair on one stream; ``elapsed_ms`` after the stop event completed."""

    def __init__(self) -> None:
        self.start = call(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DEFAULT)
        self.stop = call(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DEFAULT)

    def elapsed_ms(self) -> float:
        call(cu.cuEventSynchronize, self.stop)
        return float(call(cu.cuEventElapsedTime, self.start, self.stop))

    def close(self) -> None:
        cu.cuEventDestroy(self.start)
        cu.cuEventDestroy(self.stop)


def gpu_time_ms(fn: Callable[[int], Any], *, stream: int = 0, warmup: int = 5, iters: int = 30) -> float:
    """Median GPU time of ``fn(i)`` (i = iteration, to rotate inputs) measured with CUDA events."""
    ev = Events()
    try:
        for i in range(warmup):
            fn(i)
        times = []
        for i in range(iters):
            call(cu.cuEventRecord, ev.start, stream)
            fn(warmup + i)
            call(cu.cuEventRecord, ev.stop, stream)
            times.append(ev.elapsed_ms())
        return statistics.median(times)
    finally:
        ev.close()


GATE_BYTES = 4 << 30  # a ~2 ms device copy: longer than the host takes to queue one batch


class Gate:
    """Holds a stream behind a large device copy on a side stream while a batch of launches is
    queued, so that the batch then runs back to back and events time the GPU, not the host's
    launch rate (which bounds any kernel of a few microseconds timed one launch at a time)."""

    def __init__(self) -> None:
        self.side = int(call(cu.cuStreamCreate, cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self.src = int(call(cu.cuMemAlloc, GATE_BYTES))
        self.dst = int(call(cu.cuMemAlloc, GATE_BYTES))
        call(cu.cuMemsetD8Async, self.src, 0x11, GATE_BYTES, self.side)
        self.event = call(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)

    def hold(self, stream: int) -> None:
        call(cu.cuMemcpyDtoDAsync, self.dst, self.src, GATE_BYTES, self.side)
        call(cu.cuEventRecord, self.event, self.side)
        call(cu.cuStreamWaitEvent, stream, self.event, 0)

    def expired(self) -> bool:
        """True when the copy had finished before the batch was queued (host time leaked in)."""
        (err,) = cu.cuEventQuery(self.event)
        return err == cu.CUresult.CUDA_SUCCESS

    def close(self) -> None:
        call(cu.cuStreamSynchronize, self.side)
        cu.cuEventDestroy(self.event)
        cu.cuMemFree(self.src)
        cu.cuMemFree(self.dst)
        cu.cuStreamDestroy(self.side)


_gate: Gate | None = None


def gate() -> Gate:
    global _gate
    if _gate is None:
        _gate = Gate()
    return _gate


def gated_gpu_us(
    fn: Callable[[int], Any], *, stream: int = 0, batch: int = 16, warmup: int = 2, iters: int = 10
) -> tuple[float, int]:
    """(median GPU us per ``fn(i)`` run back to back behind a gate, measurements whose gate
    expired). ``i`` counts calls, to rotate inputs. ``stream`` may be torch's current stream."""
    ev, g = Events(), gate()
    times, expired = [], 0
    try:
        for it in range(warmup + iters):
            g.hold(stream)
            call(cu.cuEventRecord, ev.start, stream)
            for j in range(batch):
                fn(it * batch + j)
            call(cu.cuEventRecord, ev.stop, stream)
            late = g.expired()
            ms = ev.elapsed_ms()
            if it >= warmup:
                times.append(ms * 1e3 / batch)
                expired += late
    finally:
        ev.close()
    return statistics.median(times), expired


def run(
    main: Callable[[argparse.Namespace], Any],
    parser: argparse.ArgumentParser,
    needs_gpu: Callable[[argparse.Namespace], bool] = lambda args: True,
    misuse: Callable[[argparse.Namespace], str | None] = lambda args: None,
) -> None:
    """``python -m bench.<name>``: the arguments parsed first (a usage error, or what ``misuse(args)``
    says of options that do not go together, is one line and status 2, GPU or not), then, where
    ``needs_gpu(args)`` and no CUDA device is usable, one line on stderr and status 1, before
    ``main(args)`` writes or allocates anything."""
    args = parser.parse_args()
    wrong = misuse(args)
    if wrong:
        parser.error(wrong)
    if needs_gpu(args):
        require_gpu(parser.prog)
    main(args)


def require_gpu(prog: str) -> None:
    """Exit with ``<prog>: needs a CUDA GPU: <why>`` (status 1) unless a CUDA device is usable."""
    try:
        init()
        count = int(call(cu.cuDeviceGetCount))
    except NoDeviceError as exc:
        sys.exit(f"{prog}: needs a CUDA GPU: {exc}")
    if count == 0:
        sys.exit(f"{prog}: needs a CUDA GPU: the driver sees no device")


def not_a_tool(module: str, instead: str) -> NoReturn:
    """``python -m`` of a library module of the benchmarks: one line saying what to run instead,
    status 2."""
    print(f"python -m {module}: error: not a tool: {instead}", file=sys.stderr)
    raise SystemExit(2)


# ``type=`` of the benchmarks' options: a bad value is argparse's one-line usage error
def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def shape(form: str) -> Callable[[str], tuple[int, ...]]:
    """A shape written as ``form`` (``"MxNxK"``, ``"NxK"``): that many integers >= 1 joined by x."""

    def parse(text: str) -> tuple[int, ...]:
        parts = text.lower().split("x")
        if len(parts) != form.count("x") + 1 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise argparse.ArgumentTypeError(f"not {form} (integers >= 1): {text!r}")
        return tuple(int(p) for p in parts)

    return parse


def some_of(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """One or more of ``choices``, comma-separated."""

    def parse(text: str) -> list[str]:
        chosen = [c for c in text.split(",") if c]
        if not chosen or not set(chosen) <= set(choices):
            raise argparse.ArgumentTypeError(f"takes some of {','.join(choices)} (comma-separated), got {text!r}")
        return chosen

    return parse


def nonempty(text: str) -> str:
    """Any text but the empty string (a path: ``''`` would be the current directory)."""
    if not text:
        raise argparse.ArgumentTypeError("empty")
    return text


def torch_stream() -> int:
    """torch's current CUDA stream as a raw handle (to gate and time torch the same way)."""
    return int(torch_or_none().cuda.current_stream().cuda_stream)


def wall_time_us(fn: Callable[[int], Any], sync: Callable[[], Any], *, warmup: int = 20, iters: int = 200) -> float:
    """Median host wall time per call of ``fn``, each call followed by ``sync``."""
    return interleaved_times_us([fn], sync, warmup=warmup, iters=iters)[0][0]


def interleaved_times_us(
    fns: Sequence[Callable[[int], Any]], sync: Callable[[], Any], *, warmup: int = 20, iters: int = 200
) -> list[tuple[float, float]]:
    """(median wall, median host) us per call of each of ``fns``: wall until ``sync`` returned,
    host until ``fn`` returned (what the host spent queueing). The calls alternate, so the
    host's drifts (clock, other load) hit them alike: read their ratios within one call."""
    times: list[list[tuple[float, float]]] = [[] for _ in fns]
    for i in range(warmup + iters):
        for fn, fn_times in zip(fns, times):
            t0 = time.perf_counter()
            fn(i)
            t1 = time.perf_counter()
            sync()
            if i >= warmup:
                fn_times.append((time.perf_counter() - t0, t1 - t0))
    return [(statistics.median(w for w, _ in t) * 1e6, statistics.median(h for _, h in t) * 1e6) for t in times]


def host_time_us(fn: Callable[[int], Any], *, warmup: int = 200, iters: int = 5000) -> float:
    """Mean host time per call of ``fn`` in a tight loop (the launch-cost measure)."""
    for i in range(warmup):
        fn(i)
    t0 = time.perf_counter()
    for i in range(iters):
        fn(i)
    return (time.perf_counter() - t0) / iters * 1e6


@cache
def copy_bandwidth(gpu: CudaBackend, nbytes: int = 1 << 31) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src, dst = gpu.alloc(nbytes), gpu.alloc(nbytes)
    try:
        gpu.memset(src, 0x3C, nbytes)
        ms = gpu_time_ms(lambda i: gpu.copy_d2d_async(dst, src, nbytes), warmup=3, iters=10)
    finally:
        gpu.free(src)
        gpu.free(dst)
    return 2 * nbytes / (ms * 1e-3)


def torch_or_none() -> Any:
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


@cache
def matmul_rate() -> float | None:
    """cuBLAS bf16 FLOP/s at 8192^3 on random data through torch, None without torch."""
    torch = torch_or_none()
    if torch is None:
        return None
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = torch_time_ms(lambda i: a @ b)
    return 2 * n**3 / (ms * 1e-3)


def torch_time_ms(fn: Callable[[int], Any], *, warmup: int = 5, iters: int = 30) -> float:
    """Median time of a torch callable with torch's own CUDA events (its current stream)."""
    torch = torch_or_none()
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(warmup + i)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


BENCH_OUTPUT = """\
`make bench` runs every benchmark, `make bench BENCHES=<name>` one. Output: the measured
ceilings, then markdown tables, each a "## title" line, one line saying what its rows and columns
are, and the rows ("-": not measured in this run)."""
NEEDS_GPU = "Needs a CUDA GPU; torch (and CuPy) only for the comparison columns, empty without them."


def bench_parser(doc: str, module: str, epilog: str = NEEDS_GPU) -> argparse.ArgumentParser:
    """A benchmark's command line: its module docstring, whole, as the description (``--help``
    needs no GPU: ``run`` parses the arguments before it looks for one)."""
    return cli.ArgumentParser(
        prog=f"python -m {module}",
        description=doc,
        epilog=f"{epilog}\n\n{BENCH_OUTPUT}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]], *, note: str) -> None:
    """A markdown table under ``## title`` and ``note``: one line saying what the rows and the
    columns are."""

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 999.5 else f"{v:.0f}"  # (999.7 as .3g is 1e+03)
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(header)]
    print(f"\n## {title}")
    print(f"{note}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")


if __name__ == "__main__":
    not_a_tool("bench.common", "the benchmarks' shared code; python -m bench.<name> runs one (make bench: all)")
