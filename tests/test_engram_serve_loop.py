"""The engine loop of ``examples/engram_serve_loop.py`` for 2000 steps (60 under a sanitizer, which
slows every kernel 10-100x): Engram's decode step in padded graph batches, each graph a fork and a
join of two streams (the lookup and projection on a side stream, the gates on the main one), prefix
seeds, forks, drafts with rollbacks, text masks and injected faults at once, every row checked (the
loop asserts). On the CPU: its imports, and its command line's usage error and missing GPU, one
line each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_runtime import device_count
from tests.helpers.examples import assert_loop_report, assert_public_imports, load_example

STEPS = 60 if os.environ.get("GPU_SANITIZER") else 2000
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "engram_serve_loop.py"
# beyond layers.engram's exports: the numpy hash and reference the checks use
BEYOND_THE_FACE = {"layers.engram.hashing", "layers.reference.engram"}


def _example():
    return load_example(EXAMPLE)


@pytest.mark.gpu
def test_engine_loop(gpu, rng):
    loop = _example()
    seed = int(rng.integers(0, 2**32))
    report = loop.run(gpu, steps=STEPS, seed=seed)  # asserts nothing held after its close
    print(f"engram serve loop seed {seed}:", *report.lines(), sep="\n  ")
    assert_loop_report(loop, report, STEPS)
    assert report.rows_checked > 20 * STEPS and report.rows_image and report.rows_padded
    assert report.rows_reference > STEPS and report.values_reference > 100 * STEPS


# -- CPU: the example as user code, its command line ------------------------------------------------
def test_the_example_imports_the_public_face_only():
    assert_public_imports(EXAMPLE, BEYOND_THE_FACE)


def _run(argv: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES=""),
    )


def test_help_runs_from_any_directory(tmp_path):
    done = _run(["--help"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--steps STEPS engine steps" in " ".join(done.stdout.split())


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--seed", "-1"]])
def test_a_usage_error_is_one_line_and_status_2(argv):
    done = _run(argv)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr == "engram_serve_loop.py: error: --steps must be >= 1 and --seed >= 0\n", done.stderr


@pytest.mark.skipif(device_count() > 0, reason="a GPU is present: the example would run")
def test_without_a_gpu_it_says_so_in_one_line():
    done = _run(["--steps", "1"])
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "needs a CUDA GPU" in done.stderr, done.stderr
