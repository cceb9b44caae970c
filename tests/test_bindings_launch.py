"""Every launch path through cuda-bindings' own ``cuLaunchKernelEx``, without
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
CLUSTER = int(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)

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
    direct = ([3, 2, 1], [128, 1, 1], 0.75)  # grid, block, scale
    builder = ([5, 1, 1], [64, 2, 1], -2.5)
    none, overlap, cluster = (0, 0, 0), (1, PSS, 1), (1, CLUSTER, 3)  # attributes: count, first id, its value
    expected = {  # launch: ((grid, block, scale), n, shared memory, attributes)
        "kernel": (direct, 1001, 0, none),
        "kernel, again": (direct, 1002, 0, none),
        "kernel, overlap": (direct, 1003, 0, overlap),
        "kernel, over 48 KiB of shared memory": (direct, 1004, 64 * 1024, none),
        "kernel, cluster": (direct, 1005, 0, cluster),
        "builder": (builder, 2001, 0, none),
        "builder, again": (builder, 2002, 0, none),
        "builder, overlap": (builder, 2003, 0, overlap),
        "scaled_add": (([2, 1, 1], [256, 1, 1], 0.75), 3001, 0, none),
    }
    assert [line["launch"] for line in lines] == list(expected)
    for count, line in enumerate(lines, 1):
        (grid, block, scale), n, shared, (num_attrs, attr_id, attr_value) = expected[line["launch"]]
        assert line == {
            "launch": line["launch"],
            "count": count,  # one driver call each
            "ex": 1,
            "grid": grid,
            "block": block,
            "shared": shared,
            "function": first["kernel"],
            "stream": first["stream"],
            "args": [first["out"], first["x"], _f32_bits(scale), n, 0, 0, 0, 0],
            "num_attrs": num_attrs,
            "attr_id": attr_id,
            "attr_value": attr_value,
        }
