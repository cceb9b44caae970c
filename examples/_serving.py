"""What the serving-loop examples (``serve_loop.py``, ``engram_serve_loop.py``) share: their command
line, the message for two bf16 arrays that differ, and the retiring of finished requests. Import
it inside ``with installed(...)`` (it needs numpy and this project)."""

from __future__ import annotations

import sys
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
