"""Per-launch host cost of ``KernelLaunch`` and a ``KernelSpec`` launch against the bare
driver call, cuda.core and CuPy.

Kernel: ``bf16_scaled_add`` (4 arguments: two pointers, an f32, a u32) on 1024 elements, so
the GPU keeps up and the loop measures the host. "bare" is ``cuLaunchKernel`` with an argument
array built once outside the loop: the floor for any Python launcher on cuda-python. Its second
row also builds the ``CUfunction`` and ``CUstream`` objects once (the bindings convert an int
into one at every call); our launchers hand the driver the kernel's ``CUfunction``, the stream as
the caller's int.

``python -m bench.launch --stub`` runs the same rows (and a few more launchers) on a
``CudaBackend`` over a stubbed driver, without a GPU: every driver call answers at once, so the
table is the Python each path costs on top of the driver call (NVRTC still compiles the kernels).
``--stub --bindings`` keeps cuda-bindings' own ``cuLaunchKernel`` (its argument conversion) over
``bench/fake_libcuda.c``, a driver library whose every call returns at once (built with ``cc``).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import struct
import subprocess
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from bench.common import bench_parser, host_time_us, print_table
from gpu_runtime import CudaBackend, KernelLaunch, KernelSpec, compiler, driver
from gpu_runtime.cuda_backend import DRIVER_MODULES
from layers.dense_weight import BF16, DenseWeight
from layers.kernel_files import kernel_dir, load_kernel
from layers.ops import gemm
from layers.ops.embed import batched_embed
from layers.ops.residual import scaled_add
from layers.ops.specs import SCALED_ADD
from layers.ops.token_overlay import embed_overlay_routed

N = 1024


class BackendRoutedSpec(KernelSpec):
    """A spec that refuses the backend's direct route: every launch goes through
    ``gpu.launch_spec`` (the path a spec launch took before ``KernelSpec.allow_direct``)."""

    __slots__ = ()

    def allow_direct(self, kernel: int, backend: object, *route: Any) -> dict[int, Any]:
        return {}


SCALED_ADD_ROUTED = BackendRoutedSpec(
    SCALED_ADD.name, **{p.name: "P?" if p.name in SCALED_ADD.nullable else p.kind for p in SCALED_ADD.params}
)


def bare_launcher(gpu: CudaBackend, kernel: int, out: int, x: int, stream: int, handles: bool = False):
    """``cuLaunchKernel`` with a prebuilt argument array; ``handles``: the kernel and the stream
    given as the bindings' ``CUfunction`` / ``CUstream`` objects, built once, instead of ints."""
    if handles:
        kernel, stream = cu.CUfunction(kernel), cu.CUstream(stream)
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


class _EmptyChain:
    """``KernelLaunch``'s seven calls with bodies that do nothing, ending in a bare launch: what
    any chained builder costs in CPython before it checks or packs anything."""

    __slots__ = ("_go",)

    def __init__(self, go, kernel: int) -> None:
        self._go = go

    def grid(self, dims):
        return self

    block = arg_ptr = arg_f32 = arg_u32 = grid

    def launch(self, stream: int) -> None:
        self._go(0)


def empty_chain(bare) -> Callable[[int], None]:
    """``KernelLaunch``'s chain for ``bf16_scaled_add`` on ``_EmptyChain``, launching ``bare``."""

    def chain(i: int) -> None:
        _EmptyChain(bare, 0).grid([1, 1, 1]).block([256, 1, 1]).arg_ptr(1).arg_ptr(2).arg_f32(0.5).arg_u32(N).launch(0)

    return chain


def cuda_core_launcher(gpu: CudaBackend, out: int, x: int):
    try:
        from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch
    except Exception:
        return None
    dev = Device(gpu.device)
    dev.set_current()
    source = (kernel_dir() / "residual_add.cu").read_text()
    opts = ProgramOptions(
        arch=f"sm_{dev.arch}", std="c++17", include_path=[str(kernel_dir()), compiler.cuda_include_dir()]
    )
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
    kernel = cupy.RawKernel(
        source, "bf16_scaled_add", options=("-std=c++17", f"-I{kernel_dir()}", f"-I{compiler.cuda_include_dir()}")
    )
    out = cupy.zeros(N, dtype=cupy.uint16)
    x = cupy.zeros(N, dtype=cupy.uint16)
    scale, n = np.float32(0.5), np.uint32(N)

    def go(i: int) -> None:
        kernel((1,), (256,), (out, x, scale, n))

    go.sync = cupy.cuda.runtime.deviceSynchronize  # type: ignore[attr-defined]
    return go


def stub_driver(bindings: bool = False) -> ctypes.CDLL | None:
    """Make ``CudaBackend()`` run on a driver that answers every call at once (this process only):
    handles from a counter, no parameter layouts to report, an H200's shared memory opt-in,
    zeroed tensor maps, launches that do nothing. ``bindings``: launches go through the bindings'
    own ``cuLaunchKernel`` to ``fake_libcuda``'s, which does nothing; returns that library."""
    handles = itertools.count(0x7F00_0000_0000, 1 << 20)
    opt_in = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN

    def call(fn, *args, detail=""):
        name = fn.__name__
        if name == "cuDeviceGetName":
            return b"stub\0"
        if name == "cuModuleGetFunction":
            return cu.CUfunction(next(handles))  # the driver's object, as the bindings return it
        if name in ("cuModuleLoadData", "cuStreamCreate", "cuMemAlloc"):
            return next(handles)
        if name == "cuDeviceGetAttribute" and args[0] == opt_in:
            return 227 * 1024
        if name == "cuTensorMapEncodeTiled":
            return types.SimpleNamespace(opaque=[0] * 16)
        return 0

    driver.init = lambda: None
    driver.device_count = lambda: 1
    driver.compute_capability = lambda device: (9, 0)
    for module in DRIVER_MODULES:
        module.call = call
    cu.cuFuncGetParamInfo = None  # "this driver cannot report layouts": the checks skip them
    if bindings:
        return load_fake_libcuda()
    cu.cuLaunchKernel = lambda *args: (0,)
    return None


def load_fake_libcuda() -> ctypes.CDLL:
    """Build ``fake_libcuda.c`` (``$CC``, default ``cc``) and load it as ``libcuda.so.1``, before
    the bindings look for the driver: they then find this one (the loader matches the name)."""
    source = Path(__file__).with_name("fake_libcuda.c")
    with tempfile.TemporaryDirectory() as tmp:
        lib = os.path.join(tmp, "libcuda.so.1")
        subprocess.run(
            [os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", lib, str(source)],
            check=True,
        )
        fake = ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    (err,) = cu.cuInit(0)
    if err:
        raise RuntimeError(f"the bindings did not load fake_libcuda ({err!r}): was a driver loaded first?")
    return fake


def stub_rows(gpu: CudaBackend, out: int, x: int, stream: int) -> list:
    """Two more launchers, next to their ``KernelLaunch`` chains, for the stubbed table."""
    embed = load_kernel(gpu, "embed_from_argmax", "batched_embed")
    overlay = load_kernel(gpu, "token_overlay", "embed_overlay_routed_bf16")
    ptrs = [gpu.alloc(256) for _ in range(6)]

    def embed_builder(i: int) -> None:
        (
            KernelLaunch(gpu, embed)
            .grid([1, 1, 1])
            .block([256, 1, 1])
            .arg_ptr(out)
            .arg_ptr(x)
            .arg_ptr(out)
            .arg_u32(8)
            .arg_u32(64)
            .launch(stream)
        )

    def embed_launcher(i: int) -> None:
        batched_embed(gpu, embed, out, x, out, 8, 64, stream)

    def overlay_launcher(i: int) -> None:
        embed_overlay_routed(gpu, overlay, *ptrs[:2], 1, *ptrs[2:], 8, 64, 1000, stream)

    return [
        ("KernelLaunch builder, batched_embed", embed_builder),
        ("layers.ops.batched_embed launcher", embed_launcher),
        ("layers.ops.embed_overlay_routed launcher", overlay_launcher),
        *gemm_rows(gpu, stream, [(64, 4096, 4096)]),
    ]


def gemm_rows(gpu: CudaBackend, stream: int, shapes: list[tuple[int, int, int]]) -> list:
    """The GEMM launcher at each (m, n, k), operands at fixed addresses (as an engine's are):
    the Python of its checks and launch, the plan worked out at the first call."""
    kernel = load_kernel(gpu, "gemm", gemm.KERNEL)
    rows = []
    for m, n, k in shapes:
        a, w, c = gpu.alloc(2 * m * k), gpu.alloc(2 * n * k), gpu.alloc(2 * m * n)
        weight = DenseWeight(w, (n, k), BF16)
        path = gemm.plan(
            m,
            n,
            k,
            wgmma=gemm.wgmma_available(gpu),
            tma=gemm.tma_available(gpu),
            tma_store=gemm.tma_available(gpu),
            gemv=gemm.wgmma_available(gpu),
        ).path

        def launcher(i: int, a=a, weight=weight, c=c, m=m, n=n, k=k) -> None:
            gemm.dense_gemm_bf16_pipelined(gpu, kernel, a, weight, c, m, n, k, stream)

        rows.append((f"layers.ops GEMM launcher, {m}x{n}x{k} {path}", launcher))
    return rows


def make_parser() -> argparse.ArgumentParser:
    parser = bench_parser(
        __doc__, "bench.launch", "Needs a CUDA GPU, except with --stub; CuPy and cuda.core only for their rows."
    )
    parser.add_argument(
        "--stub",
        action="store_true",
        help="no GPU: run on a stubbed driver, so the rows are the Python cost of each path",
    )
    parser.add_argument(
        "--bindings",
        action="store_true",
        help="with --stub: launch through cuda-bindings' cuLaunchKernel over bench/fake_libcuda.c "
        "(needs a C compiler), so the rows include the bindings' argument conversion",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    stub = args.stub
    if args.bindings and not stub:
        raise SystemExit("bench.launch: --bindings needs --stub")
    if stub:
        stub_driver(bindings=args.bindings)
    with CudaBackend() as gpu:
        kernel = load_kernel(gpu, "residual_add", "bf16_scaled_add")
        stream = gpu.create_stream()
        out, x = gpu.alloc(2 * N), gpu.alloc(2 * N)
        gpu.memset(out, 0, 2 * N)
        gpu.memset(x, 0, 2 * N)

        def ours(i: int) -> None:
            (
                KernelLaunch(gpu, kernel)
                .grid([1, 1, 1])
                .block([256, 1, 1])
                .arg_ptr(out)
                .arg_ptr(x)
                .arg_f32(0.5)
                .arg_u32(N)
                .launch(stream)
            )

        def ours_spec_routed(i: int) -> None:
            SCALED_ADD_ROUTED.launch(gpu, kernel, (1, 1, 1), (256, 1, 1), stream, out=out, x=x, scale=0.5, n=N)

        def ours_launcher(i: int) -> None:
            scaled_add(gpu, kernel, out, x, 0.5, N, stream)

        def ours_spec(i: int) -> None:
            SCALED_ADD.launch(gpu, kernel, (1, 1, 1), (256, 1, 1), stream, out=out, x=x, scale=0.5, n=N)

        cases = [
            ("bare cuLaunchKernel, prebuilt args", bare_launcher(gpu, kernel, out, x, stream)),
            ("bare, CUfunction and CUstream objects", bare_launcher(gpu, kernel, out, x, stream, handles=True)),
            (
                "chain floor: the builder's 7 calls, empty, then bare",
                empty_chain(bare_launcher(gpu, kernel, out, x, stream, handles=True)),
            ),
            ("KernelLaunch builder", ours),
            ("KernelSpec launch (SCALED_ADD)", ours_spec),
            ("KernelSpec launch, no direct route", ours_spec_routed),
            ("layers.ops.scaled_add launcher", ours_launcher),
            *gemm_rows(gpu, stream, [(1, 64, 64)]),  # a GEMM the GPU runs faster than the host launches it
            ("cuda.core launch", None if stub else cuda_core_launcher(gpu, out, x)),
            ("CuPy RawKernel", None if stub else cupy_launcher()),
        ]
        if stub:
            cases += stub_rows(gpu, out, x, stream)
        times = {}
        for name, fn in cases:
            if fn is None:
                continue
            sync = getattr(fn, "sync", lambda: None if stub else gpu.synchronize(stream))
            best = []
            for _ in range(3):  # best of three medians-of-loops: host noise only adds
                best.append(host_time_us(fn))
                sync()
            times[name] = min(best)
        bare = times["bare cuLaunchKernel, prebuilt args"]
        rows = [(name, times.get(name), times[name] / bare if name in times else None) for name, _ in cases]
        what = (
            "stubbed driver under the bindings' cuLaunchKernel: Python us per launch"
            if args.bindings
            else "stubbed driver: Python us per launch"
            if stub
            else "host us per launch"
        )
        launch_call = "the driver's cuLaunchKernel (which returns at once)" if args.bindings else "cuLaunchKernel"
        note = (
            "The driver is stubbed (every call returns at once): each row is a launch path, us/launch the Python "
            f"it costs on top of {launch_call}, x bare that over the bare call with prebuilt arguments "
            "(cuda.core and CuPy not run)."
            if stub
            else "Each row is a launch path of one kernel; us/launch is host time per launch (tight loop, best of 3), "
            "x bare that over the bare cuLaunchKernel with prebuilt arguments; - where not installed."
        )
        print_table(
            f"launch cost ({what}, 4-argument kernel unless named)", ["path", "us/launch", "x bare"], rows, note=note
        )


if __name__ == "__main__":
    main()
