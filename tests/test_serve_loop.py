"""The engine loop of ``examples/serve_loop.py`` for 2000 steps (60 under a sanitizer, which
slows every kernel 10-100x): padded graph batches, prefix-cache seeds, forks, drafts with
rollbacks, three adapters and injected faults at once, every row checked (the loop asserts)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

STEPS = 60 if os.environ.get("GPU_SANITIZER") else 2000


def _example():
    path = Path(__file__).resolve().parents[1] / "examples" / "serve_loop.py"
    spec = importlib.util.spec_from_file_location("serve_loop", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
def test_engine_loop(gpu, rng):
    loop = _example()
    seed = int(rng.integers(0, 2**32))
    report = loop.run(gpu, steps=STEPS, seed=seed)
    print(f"serve loop seed {seed}:", *report.lines(), sep="\n  ")
    assert report.steps == STEPS
    assert all(report.faults[kind] >= 1 for kind in loop.FAULTS), report.faults
    assert report.prefix_hits and report.forks and report.rollbacks
    assert len(report.replays) >= (3 if STEPS < 2000 else 6), "padded batches of many ladder sizes"
    assert report.rows_checked > 20 * STEPS
