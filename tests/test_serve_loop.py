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

import pytest

from gpu_runtime import dlpack
from tests.helpers.examples import assert_public_imports, load_example

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
    assert dlpack.live_exports() == 0, "DLPack capsules left alive"
    assert report.steps == STEPS
    assert all(report.faults[kind] >= 1 for kind in loop.FAULTS), report.faults
    assert report.prefix_hits and report.forks and report.rollbacks
    assert len(report.replays) >= (3 if STEPS < 2000 else 6), "padded batches of many ladder sizes"
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
