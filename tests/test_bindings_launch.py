"""Every launch path through cuda-bindings' own ``cuLaunchKernel`` / ``cuLaunchKernelEx``, without
a GPU: ``tests/bindings_probe.py`` runs in a process of its own over ``bench/fake_libcuda.c`` (a
driver library that records the last launch), so the bindings' argument conversion runs as over
the real driver. The scripted driver of the other CPU tests replaces the bindings' functions and
would accept arguments that they refuse or convert differently."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from cuda.bindings import driver as cu

from tests.bindings_probe import NO_FAKE_DRIVER

ROOT = Path(__file__).resolve().parent.parent
PSS = int(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="needs a C compiler to build bench/fake_libcuda.c"
)


def _f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def test_each_launch_path_reaches_the_driver_as_meant(tmp_path):
    env = {**os.environ, "GPU_RUNTIME_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "tests.bindings_probe"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    if run.returncode == NO_FAKE_DRIVER:
        pytest.skip(run.stderr.strip())  # a compiler was found, but it could not build the library
    assert run.returncode == 0, run.stderr
    first, *lines = (json.loads(line) for line in run.stdout.splitlines())
    spec = ([3, 2, 1], [128, 1, 1], 0.75)  # grid, block, scale
    builder = ([5, 1, 1], [64, 2, 1], -2.5)
    expected = {  # launch: ((grid, block, scale), n, shared memory, overlap)
        "spec, checked by the backend": (spec, 1001, 0, False),
        "spec, direct route": (spec, 1002, 0, False),
        "spec, overlap": (spec, 1003, 0, True),
        "spec, over 48 KiB of shared memory": (spec, 1004, 64 * 1024, False),
        "spec, over 48 KiB, direct route": (spec, 1005, 64 * 1024, False),
        "builder, checked by the backend": (builder, 2001, 0, False),
        "builder, direct route": (builder, 2002, 0, False),
        "builder, overlap": (builder, 2003, 0, True),
    }
    assert [line["launch"] for line in lines] == list(expected)
    for count, line in enumerate(lines, 1):
        (grid, block, scale), n, shared, overlap = expected[line["launch"]]
        assert line == {
            "launch": line["launch"],
            "count": count,  # one driver call each
            "ex": int(overlap),
            "grid": grid,
            "block": block,
            "shared": shared,
            "function": first["kernel"],
            "stream": first["stream"],
            "args": [first["out"], first["x"], _f32_bits(scale), n, 0, 0, 0, 0],
            "num_attrs": int(overlap),
            "attr_id": PSS if overlap else 0,
            "attr_value": int(overlap),  # programmatic stream serialisation allowed
        }
