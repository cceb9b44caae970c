"""What the serving-loop examples (``serve_loop.py``, ``engram_serve_loop.py``) share: their command
line, the loop of engine steps with its fault schedule and memory check, the message for two bf16
arrays that differ, a rollback's random arguments, the count of flagged faults and the retiring of
finished requests. Import it inside ``with installed(...)`` (it needs numpy and this project)."""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from gpu_runtime import CudaBackend, NoDeviceError, cli


def diff(got: np.ndarray, want: np.ndarray) -> str:
    """Where two bf16 arrays of rows differ, for an assertion message."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    bad = got.view(np.uint16) != want.view(np.uint16)
    rows = sorted(set(np.nonzero(bad)[0].tolist()))
    return (
        f"{int(bad.sum())} of {bad.size} values in rows {rows[:8]}, max |diff| "
        f"{float(np.nanmax(np.abs(g - w))):.3g}, max |want| {float(np.nanmax(np.abs(w))):.3g}"
    )


def drive(
    gpu: CudaBackend,
    loop: Any,
    report: Any,
    steps: int,
    rng: np.random.Generator,
    rate: float,
    faults: tuple[str, ...],
    every: Callable[[int], None] | None = None,
) -> None:
    """``steps`` engine steps: ``loop.admit()``, ``loop.step(fault)``, ``loop.retire()``, ``fault``
    the next of ``faults`` (in turn) on about ``rate`` of the steps (at least 3, none of the first
    10 where there are 20 or more), else None; ``every(step)`` after each. Counts ``report.steps``;
    ``report.drawn``: the device memory drawn in the second half, which must be 0 (unless a
    sanitizer runs: it allocates device memory of its own)."""
    candidates = np.arange(min(10, steps // 2), steps)
    count = min(max(int(steps * rate), 3), candidates.size)
    fault_steps = set(rng.choice(candidates, count, replace=False).tolist())
    kinds = iter(faults * steps)
    free_mid = 0
    for step in range(steps):
        loop.admit()
        loop.step(next(kinds) if step in fault_steps else None)
        loop.retire()
        report.steps += 1
        if every is not None:
            every(step)
        if step == steps // 2:  # every kernel loaded by now (lazy loading draws memory once)
            free_mid = gpu.mem_info()[0]
    report.drawn = free_mid - gpu.mem_info()[0]
    if not os.environ.get("GPU_SANITIZER"):
        assert report.drawn == 0, f"{report.drawn} bytes of device memory drawn in the second half"


def rollback_args(
    rng: np.random.Generator, slots: np.ndarray, reqs: int, k: int, skip: int, pad: int
) -> tuple[np.ndarray, np.ndarray]:
    """A rollback's counts and slots: 0 .. k-1 drafts rejected at random for each of the first
    ``reqs`` entries, garbage counts for the others (padding, which the decoder must ignore); the
    slots copied, entry ``skip`` (where >= 0) made the padding slot ``pad``."""
    counts = rng.integers(0, 2**32, slots.size, dtype=np.uint64).astype(np.uint32)
    counts[:reqs] = rng.integers(0, k, reqs)
    slots = slots.copy()
    if skip >= 0:
        slots[skip] = pad
    return counts, slots


def count_flags(got: Any, want: Any, bits: dict[str, Any], flagged: Counter) -> None:
    """The flags a decoder's ``check_errors`` gave (``got``) are ``want``; each of ``bits`` set is
    one more flagged fault of its kind."""
    assert got == want, f"flags {got!r}, expected {want!r}"
    for kind, bit in bits.items():
        if got & bit:
            flagged[kind] += 1


def retire(live: list[Any], free: list[int], rng: np.random.Generator, finish: float) -> list[Any]:
    """The requests of ``live`` that go on: each has one step fewer ``left``; one whose steps ran
    out, or by chance ``finish``, gives its ``slot`` back to ``free``."""
    keep = []
    for req in live:
        req.left -= 1
        if req.left <= 0 or rng.random() < finish:
            free.append(req.slot)
        else:
            keep.append(req)
    return keep


def main(prog: str, doc: str, run: Callable[[CudaBackend, int, int], Any], no_gpu: str = "") -> None:
    """``prog [--steps N] [--seed S]``: ``run(gpu, steps, seed)`` on a new ``CudaBackend``, then its
    report's lines; a usage error or a machine without a GPU is one line (``no_gpu`` is added to
    the latter: where to go instead)."""
    parser = cli.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="engine steps to run (default 2000)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the weights, the requests and the faults injected (default 0)"
    )
    args = parser.parse_args()
    if args.steps < 1 or args.seed < 0:
        parser.error("--steps must be >= 1 and --seed >= 0")
    try:
        with CudaBackend() as gpu:
            report = run(gpu, args.steps, args.seed)
    except NoDeviceError as exc:  # one line, not a traceback
        sys.exit(f"{prog} needs a CUDA GPU{no_gpu}: {exc}")
    print("\n".join(report.lines()))
