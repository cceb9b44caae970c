"""Per-launch host cost of ``KernelLaunch`` and a ``KernelSpec`` launch against the bare
driver call, cuda.core and CuPy.

Kernel: ``bf16_scaled_add`` (4 arguments: two pointers, an f32, a u32) on 1024 elements, so
the GPU keeps up and the loop measures the host. "bare" is ``cuLaunchKernel`` with an argument
array built once outside the loop: the floor for any Python launcher on cuda-python.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np
from cuda.bindings import driver as cu

from bench.common import host_time_us, print_table
from gpu_runtime import CudaBackend, KernelLaunch, compiler, validate
from layers.ops.residual import scaled_add
from layers.ops.specs import SCALED_ADD
from layers.kernel_files import kernel_dir, load_kernel

N = 1024


def bare_launcher(gpu: CudaBackend, kernel: int, out: int, x: int, stream: int):
    buf = ctypes.create_string_buffer(24)
    struct.pack_into("@QQfI", buf, 0, out, x, 0.5, N)
    base = ctypes.addressof(buf)
    ptrs = (ctypes.c_void_p * 4)(base, base + 8, base + 16, base + 20)
    params = ctypes.addressof(ptrs)

    def launch(i: int) -> None:
        (err,) = cu.cuLaunchKernel(kernel, 1, 1, 1, 256, 1, 1, 0, stream, params, 0)
        if err:
            raise RuntimeError(err)

    launch.keep = (buf, ptrs)  # type: ignore[attr-defined]
    return launch


def spec_scaled_add(gpu: CudaBackend, kernel: int, out: int, x: int, scale: float, n: int,
                    stream: int) -> None:
    """``layers.ops.scaled_add`` as a launcher on its spec: its own check (a finite scale), a
    zero count as a no-op, the spec for the rest (types, ranges, null pointers)."""
    scale = validate.real32(scale, "scaled_add scale")
    if n == 0:
        return
    SCALED_ADD.launch(gpu, kernel, (min(-(-n // 2048), 4096), 1, 1), (256, 1, 1), stream,
                      out=out, x=x, scale=scale, n=n)


def cuda_core_launcher(gpu: CudaBackend, out: int, x: int):
    try:
        from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch
    except Exception:
        return None
    dev = Device(gpu.device)
    dev.set_current()
    source = (kernel_dir() / "residual_add.cu").read_text()
    opts = ProgramOptions(arch=f"sm_{dev.arch}", std="c++17",
                          include_path=[str(kernel_dir()), compiler.cuda_include_dir()])
    kernel = Program(source, code_type="c++", options=opts).compile("cubin").get_kernel("bf16_scaled_add")
    stream = dev.create_stream()
    config = LaunchConfig(grid=1, block=256)
    args = (np.uint64(out), np.uint64(x), np.float32(0.5), np.uint32(N))  # pointers as 8-byte ints

    def go(i: int) -> None:
        launch(stream, config, kernel, *args)

    go.sync = stream.sync  # type: ignore[attr-defined]
    return go


def cupy_launcher():
    try:
        import cupy
    except Exception:
        return None
    source = (kernel_dir() / "residual_add.cu").read_text()
    kernel = cupy.RawKernel(source, "bf16_scaled_add",
                            options=("-std=c++17", f"-I{kernel_dir()}",
                                     f"-I{compiler.cuda_include_dir()}"))
    out = cupy.zeros(N, dtype=cupy.uint16)
    x = cupy.zeros(N, dtype=cupy.uint16)
    scale, n = np.float32(0.5), np.uint32(N)

    def go(i: int) -> None:
        kernel((1,), (256,), (out, x, scale, n))

    go.sync = cupy.cuda.runtime.deviceSynchronize  # type: ignore[attr-defined]
    return go


def main() -> None:
    with CudaBackend() as gpu:
        kernel = load_kernel(gpu, "residual_add", "bf16_scaled_add")
        stream = gpu.create_stream()
        out, x = gpu.alloc(2 * N), gpu.alloc(2 * N)
        gpu.memset(out, 0, 2 * N)
        gpu.memset(x, 0, 2 * N)

        def ours(i: int) -> None:
            (KernelLaunch(gpu, kernel).grid([1, 1, 1]).block([256, 1, 1])
             .arg_ptr(out).arg_ptr(x).arg_f32(0.5).arg_u32(N).launch(stream))

        def ours_launcher(i: int) -> None:
            scaled_add(gpu, kernel, out, x, 0.5, N, stream)

        def ours_spec(i: int) -> None:
            SCALED_ADD.launch(gpu, kernel, (1, 1, 1), (256, 1, 1), stream, out=out, x=x, scale=0.5, n=N)

        def ours_spec_launcher(i: int) -> None:
            spec_scaled_add(gpu, kernel, out, x, 0.5, N, stream)

        cases = [("bare cuLaunchKernel, prebuilt args", bare_launcher(gpu, kernel, out, x, stream)),
                 ("KernelLaunch builder", ours),
                 ("KernelSpec launch (SCALED_ADD)", ours_spec),
                 ("spec-based scaled_add launcher", ours_spec_launcher),
                 ("layers.ops.scaled_add launcher", ours_launcher),
                 ("cuda.core launch", cuda_core_launcher(gpu, out, x)),
                 ("CuPy RawKernel", cupy_launcher())]
        times = {}
        for name, fn in cases:
            if fn is None:
                continue
            sync = getattr(fn, "sync", lambda: gpu.synchronize(stream))
            best = []
            for _ in range(3):  # best of three medians-of-loops: host noise only adds
                best.append(host_time_us(fn))
                sync()
            times[name] = min(best)
        bare = times["bare cuLaunchKernel, prebuilt args"]
        rows = [(name, times.get(name), times[name] / bare if name in times else None)
                for name, _ in cases]
        print_table("launch cost (host us per launch, 4-argument kernel)",
                    ["path", "us/launch", "x bare"], rows)


if __name__ == "__main__":
    main()
