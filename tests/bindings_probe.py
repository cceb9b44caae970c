"""What the driver receives from each launch path, through cuda-bindings' own ``cuLaunchKernelEx``:
run by ``tests/test_bindings_launch.py`` in a process of its own.

The backend runs on ``bench.launch``'s stubbed driver, except that its launches go through the
bindings to ``bench/fake_libcuda.c``, which records the last one. Each launch below is printed as
one JSON line: its name and what the fake driver recorded.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from typing import Any

from bench.launch import stub_driver
from gpu_runtime import CudaBackend, KernelLaunch, LaunchConfig
from layers.kernel_files import load_kernel
from layers.ops import scaled_add

SIZES = (8, 8, 4, 4)  # bf16_scaled_add(out: pointer, x: pointer, scale: f32, n: u32)


class FakeLaunch(ctypes.Structure):
    """``struct fake_launch`` of ``bench/fake_libcuda.c``."""

    _fields_ = [
        ("count", ctypes.c_uint64),
        ("ex", ctypes.c_uint32),
        ("grid", ctypes.c_uint32 * 3),
        ("block", ctypes.c_uint32 * 3),
        ("shared", ctypes.c_uint32),
        ("function", ctypes.c_uint64),
        ("stream", ctypes.c_uint64),
        ("args", ctypes.c_uint64 * 8),
        ("num_attrs", ctypes.c_uint32),
        ("attr_id", ctypes.c_uint32),
        ("attr_value", ctypes.c_uint32),
    ]


NO_FAKE_DRIVER = 77  # the exit status when bench/fake_libcuda.c could not be built


def main() -> None:
    try:
        fake = stub_driver(bindings=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"bench/fake_libcuda.c not built: {exc}", file=sys.stderr)
        sys.exit(NO_FAKE_DRIVER)
    assert fake is not None
    (ctypes.c_uint32 * 8).in_dll(fake, "fake_arg_sizes")[: len(SIZES)] = list(SIZES)
    last = FakeLaunch.in_dll(fake, "fake_last_launch")
    gpu = CudaBackend()
    kernel = load_kernel(gpu, "residual_add", "bf16_scaled_add")
    stream = gpu.create_stream()
    out, x = gpu.alloc(4096), gpu.alloc(4096)
    print(json.dumps({"kernel": int(kernel), "stream": stream, "out": int(out), "x": int(x)}))

    bound = gpu.bind(kernel)

    def direct(n: int, shared: int = 0, **options: Any) -> None:
        bound.launch(LaunchConfig((3, 2), 128, shared, **options), stream, out, x, 0.75, n)

    def builder(n: int, overlap: bool = False) -> None:
        (KernelLaunch(gpu, kernel).grid([5, 1, 1]).block([64, 2, 1]).arg_ptr(out).arg_ptr(x).arg_f32(-2.5)
         .arg_u32(n).launch(stream, overlap=overlap))

    launches = [
        ("kernel", lambda: direct(1001)),
        ("kernel, again", lambda: direct(1002)),
        ("kernel, overlap", lambda: direct(1003, overlap=True)),
        ("kernel, over 48 KiB of shared memory", lambda: direct(1004, 64 * 1024)),
        ("kernel, cluster", lambda: direct(1005, cluster=(3, 1, 1))),
        ("builder", lambda: builder(2001)),
        ("builder, again", lambda: builder(2002)),
        ("builder, overlap", lambda: builder(2003, overlap=True)),
        ("scaled_add", lambda: scaled_add(gpu, kernel, out, x, 0.75, 3001, stream)),
    ]
    for name, launch in launches:
        launch()
        record = {field[0]: getattr(last, field[0]) for field in FakeLaunch._fields_}
        for key in ("grid", "block", "args"):
            record[key] = list(record[key])
        print(json.dumps({"launch": name, **record}))
    gpu.close()


if __name__ == "__main__":
    main()
