"""The engine loop of ``examples/serve_loop.py`` for 2000 steps (60 under a sanitizer, which
slows every kernel 10-100x): padded graph batches, prefix-cache seeds, forks, drafts with
rollbacks, three adapters and injected faults at once, every row checked (the loop asserts).
On the CPU: the examples are user code, importing the installed package's public face only
(no ``sys.path`` edits), and they import from any directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.examples import assert_loop_report, assert_public_imports, load_example

STEPS = 60 if os.environ.get("GPU_SANITIZER") else 2000
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("serve_loop.py", "greedy_decode.py")
# What the public face has no equivalent of: greedy_decode's LM head (a GEMM) and its argmax
# feeding the decoder are the launchers', and only layers.kernel_files loads their kernels.
BEYOND_THE_FACE = {"greedy_decode.py": {"layers.ops", "layers.kernel_files"}}


def _example():
    return load_example(ROOT / "examples" / "serve_loop.py")


@pytest.mark.gpu
def test_engine_loop(gpu, rng):
    loop = _example()
    seed = int(rng.integers(0, 2**32))
    report = loop.run(gpu, steps=STEPS, seed=seed)  # asserts nothing held after its close
    print(f"serve loop seed {seed}:", *report.lines(), sep="\n  ")
    assert_loop_report(loop, report, STEPS)
    assert report.rows_checked > 20 * STEPS


# -- CPU: the examples as user code ------------------------------------------------------------------
@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_import_the_public_face_only(name):
    """Every import is the standard library, numpy / ml_dtypes, or a name a public package
    exports (``__all__``); nothing edits ``sys.path`` or needs ``# noqa: E402``."""
    assert_public_imports(ROOT / "examples" / name, BEYOND_THE_FACE.get(name, set()))


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_import_from_any_directory(name, tmp_path):
    """Run from elsewhere, with the package importable as an install makes it (here: on
    PYTHONPATH, which an installed package does not need), each example's imports resolve;
    ``serve_loop.py --help`` runs its command line up to argparse (no GPU needed)."""
    path = str(ROOT / "examples" / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if name == "serve_loop.py":
        command = [sys.executable, path, "--help"]
    else:  # no command line: import it without running main (run_path's __name__ is not __main__),
        # its folder first on the path as when run (examples/_requires.py)
        run = "import os, runpy, sys; sys.path[0] = os.path.dirname(sys.argv[1]); runpy.run_path(sys.argv[1])"
        command = [sys.executable, "-c", run, path]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if name == "serve_loop.py":
        assert "--steps" in done.stdout


# -- CPU: what the two serving loops share (examples/_serving.py) -------------------------------------
class _Memory:
    """``mem_info()`` as a backend's: free bytes, less ``leak`` each call after the first ``after``."""

    def __init__(self, leak: int = 0, after: int = 0) -> None:
        self.calls, self.leak, self.after = 0, leak, after

    def mem_info(self) -> tuple[int, int]:
        self.calls += 1
        return (1 << 30) - (self.leak if self.calls > self.after else 0), 1 << 30


class _Steps:
    """A loop that records its steps' faults."""

    def __init__(self) -> None:
        self.faults: list[str | None] = []
        self.calls: list[str] = []

    def admit(self) -> None:
        self.calls.append("admit")

    def step(self, fault: str | None) -> None:
        self.calls.append("step")
        self.faults.append(fault)

    def retire(self) -> None:
        self.calls.append("retire")


@pytest.mark.parametrize("steps", [1, 5, 19, 20, 200])
def test_drive_runs_every_step_with_faults_in_turn(rng, steps):
    serving = load_example(ROOT / "examples" / "_serving.py")
    loop, report, seen = _Steps(), _Report(), []
    serving.drive(_Memory(), loop, report, steps, rng, 0.05, ("token", "slot"), seen.append)
    assert report.steps == steps and seen == list(range(steps)) and report.drawn == 0
    assert loop.calls == ["admit", "step", "retire"] * steps
    faulted = [(i, f) for i, f in enumerate(loop.faults) if f is not None]
    assert len(faulted) == min(max(int(steps * 0.05), 3), steps - min(10, steps // 2))
    assert [f for _, f in faulted] == [("token", "slot")[i % 2] for i in range(len(faulted))]
    assert all(i >= min(10, steps // 2) for i, _ in faulted)


def test_drive_refuses_device_memory_drawn_in_the_second_half(rng, monkeypatch):
    serving = load_example(ROOT / "examples" / "_serving.py")
    monkeypatch.delenv("GPU_SANITIZER", raising=False)
    with pytest.raises(AssertionError, match="4096 bytes of device memory drawn in the second half"):
        serving.drive(_Memory(leak=4096, after=1), _Steps(), _Report(), 40, rng, 0.05, ("token",))


def test_rollback_args_draw_counts_below_k_and_pad_the_skipped_entry(rng):
    serving = load_example(ROOT / "examples" / "_serving.py")
    slots = np.arange(8, dtype=np.uint32)
    counts, got = serving.rollback_args(rng, slots, 5, 3, 2, 0xFFFFFFFF)
    assert counts.dtype == np.uint32 and counts.shape == (8,) and (counts[:5] < 3).all()
    assert got.tolist() == [0, 1, 0xFFFFFFFF, 3, 4, 5, 6, 7] and slots.tolist() == list(range(8))
    _, unskipped = serving.rollback_args(rng, slots, 5, 3, -1, 0xFFFFFFFF)
    assert unskipped.tolist() == list(range(8))


class _Report:
    steps = 0
    drawn = 0
