"""Per-launch host cost of every launch path against its floor: the bare driver call for
``Kernel.launch`` and prepared launches; for ``layers.ops``' launchers, their own kernel's launch
with the same arguments (``Kernel.launch``, or the GEMM's ``PreparedLaunch.run``: what a launcher
runs beyond packing and the driver call); the same chain of calls doing nothing for the seed's
``KernelLaunch`` builder; cuda.core and CuPy beside them. Every row also over the bare call.

Kernel: ``bf16_scaled_add`` (4 arguments: two pointers, an f32, a u32) on 1024 elements, so the
GPU keeps up and the loop measures the host, unless a row names another. "bare" is
``cuLaunchKernel`` with an argument array built once outside the loop: the floor for any Python
launcher on cuda-python. Its second row also builds the ``CUfunction`` and ``CUstream`` objects
once (the bindings convert an int into one at every call); the third is the one call every
launch of ours makes, ``cuLaunchKernelEx`` with its ``CUlaunchConfig`` built once.

``python -m bench.launch --stub`` runs the same rows on a ``CudaBackend`` over a stubbed driver,
without a GPU: every driver call answers at once, so the table is the Python each path costs on
top of the driver call (NVRTC still compiles the kernels). ``--bindings`` (a stub too) keeps
cuda-bindings' own launch functions (their argument conversion) over ``bench/fake_libcuda.c``, a
driver library whose every call returns at once (built with ``cc``).
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
from typing import Any, cast

import numpy as np
from cuda.bindings import driver as cu

from bench.common import bench_parser, host_time_us, print_table, run
from gpu_runtime import CudaBackend, Kernel, KernelLaunch, LaunchConfig, compiler, driver
from gpu_runtime.cuda_backend import DRIVER_MODULES
from layers.dense_weight import BF16, DenseWeight
from layers.kernel_files import kernel_dir, load_kernel
from layers.ops import gemm
from layers.ops.residual import scaled_add

N = 1024


def _packed_args(out: int, x: int) -> tuple[int, tuple[Any, Any]]:
    """``bf16_scaled_add``'s arguments (out, x, 0.5, N) packed once: the ``void*[]``'s address,
    and what must stay alive with it."""
    buf = ctypes.create_string_buffer(24)
    struct.pack_into("@QQfI", buf, 0, out, x, 0.5, N)
    base = ctypes.addressof(buf)
    ptrs = (ctypes.c_void_p * 4)(base, base + 8, base + 16, base + 20)
    return ctypes.addressof(ptrs), (buf, ptrs)


def bare_launcher(gpu: CudaBackend, kernel: int, out: int, x: int, stream: int, handles: bool = False):
    """``cuLaunchKernel`` with a prebuilt argument array; ``handles``: the kernel and the stream
    given as the bindings' ``CUfunction`` / ``CUstream`` objects, built once, instead of ints."""
    if handles:
        kernel, stream = cu.CUfunction(kernel), cu.CUstream(stream)
    params, keep = _packed_args(out, x)

    def launch(i: int) -> None:
        (err,) = cu.cuLaunchKernel(kernel, 1, 1, 1, 256, 1, 1, 0, stream, params, 0)
        if err:
            raise RuntimeError(err)

    launch.keep = keep  # type: ignore[attr-defined]
    return launch


def bare_ex_launcher(kernel: int, out: int, x: int, stream: int):
    """``cuLaunchKernelEx`` with its config, the function and the argument array built once."""
    function = cu.CUfunction(kernel)
    config = cu.CUlaunchConfig()
    config.gridDimX = config.gridDimY = config.gridDimZ = 1
    config.blockDimX, config.blockDimY, config.blockDimZ = 256, 1, 1
    config.sharedMemBytes = 0
    config.hStream = cu.CUstream(stream)
    params, keep = _packed_args(out, x)

    def launch(i: int) -> None:
        (err,) = cu.cuLaunchKernelEx(config, function, params, 0)
        if err:
            raise RuntimeError(err)

    launch.keep = (keep, config)  # type: ignore[attr-defined]
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


def own_launch(kernel: Kernel, launcher: Callable[[int], None]) -> Callable[[int], None]:
    """``kernel.launch`` with the config, stream and arguments ``launcher`` hands it (recorded from
    one call), packed at every call: the launcher's packing and driver call alone, its floor."""
    calls: list[tuple[Any, int, tuple[Any, ...]]] = []
    launch = kernel.launch
    kernel.launch = lambda config, stream, *args: calls.append((config, stream, args))
    try:
        launcher(0)
    finally:
        kernel.launch = launch
    ((config, stream, args),) = calls

    def floor(i: int) -> None:
        launch(config, stream, *args)

    return floor


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
    own launch functions to ``fake_libcuda``'s, which do nothing; returns that library."""
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
    for module in cast(tuple[Any, ...], DRIVER_MODULES):  # each has a ``call`` (a ModuleType declares none)
        module.call = call
    cu.cuFuncGetParamInfo = None  # "this driver cannot report layouts": the checks skip them
    if bindings:
        return load_fake_libcuda()
    cu.cuLaunchKernel = cu.cuLaunchKernelEx = lambda *args: (0,)
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


def gemm_rows(gpu: CudaBackend, stream: int, shapes: list[tuple[int, int, int]]) -> list:
    """The seed's GEMM launcher at each (m, n, k), operands at fixed addresses (as an engine's
    are): the Python of its checks and launch, the launch worked out at the first call."""
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

        prepared = gemm.plan_gemm(gpu, kernel, a, weight, c, m, n, k)
        assert prepared is not None  # m, n, k >= 1

        def floor(i: int, run=prepared.run) -> None:
            run(stream)

        name = f"layers.ops.dense_gemm_bf16_pipelined, {m}x{n}x{k} {path}"
        rows += [(f"{name}: its PreparedLaunch.run", floor, BARE), (name, launcher, f"{name}: its PreparedLaunch.run")]
    return rows


def planned_rows(gpu: CudaBackend, stream: int, stub: bool) -> list:
    """The planned launchers of the n-gram runners, one decode row each: a fused runner's gather
    (``NgramGather.run``) and a decoder's (``DecodeLaunches.gather``) over a small model's tables
    (T = 4), with the decoder's state zeroed and one token of one slot. On a stubbed driver (no
    memory to upload to, nothing runs) the plans are made over bare allocations instead."""
    from layers.ngram_embed import FusedNgramEmbedding, NgramDecoder, NgramDims, NgramWeights
    from layers.ops import DecodeLaunches, NgramGather

    dims = NgramDims(vocab_size=1000, hidden_size=64, max_ngram=3, splits=2, base_rows=1 << 10)
    table_dims = (dims.num_tables(), dims.max_ngram, dims.splits, dims.table_dim(), dims.eos_id)
    tokens = gpu.alloc(64)
    gpu.memset(tokens, 0, 64, stream)  # token 0 of slot 0, a window of token 0
    keep: tuple[Any, ...] = ()
    if stub:
        ptrs = [gpu.alloc(64) for _ in range(8)]
        kernel = load_kernel(gpu, "ngram_fused", "ngram_gather")
        gather = NgramGather(gpu, kernel, ptrs[0], ptrs[1], *table_dims)
        num_tables, max_ngram, splits, table_dim, eos = table_dims
        launches = DecodeLaunches(
            gpu,
            *ptrs[2:6],
            max_seqs=4,
            hist_len=2,
            vocab=dims.vocab_size,
            max_draft=0,
            tables=ptrs[0],
            pows=ptrs[1],
            num_tables=num_tables,
            max_ngram=max_ngram,
            splits=splits,
            table_dim=table_dim,
            eos=eos,
        )
        windows, fused_out, decode_out = tokens, ptrs[6], ptrs[7]
    else:
        rng = np.random.default_rng(0)
        word = rng.standard_normal((dims.vocab_size, dims.hidden_size)).astype(BF16)
        tables = [rng.standard_normal((dims.table_rows(c), dims.table_dim())).astype(BF16) for c in range(4)]
        projs = [rng.standard_normal((dims.hidden_size, dims.table_dim())).astype(BF16) for _ in range(4)]
        weights = NgramWeights.from_numpy(dims, word, tables, projs, gpu, stream=stream)
        fused = FusedNgramEmbedding(weights, 16, stream)
        decoder = NgramDecoder(weights, max_seqs=4, max_rows=16, stream=stream)
        keep = (weights, fused, decoder)
        gather, launches, windows = fused._gather_plan, decoder.launches, tokens
        fused_out, decode_out = fused.projection.rows_at(1), decoder.projection.rows_at(1)

    def fused_gather(i: int) -> None:
        gather.run(windows, 0, fused_out, 0, 1, stream)

    prepared = gather.prepare(windows, 0, fused_out, 0, 1).run

    def fused_prepared(i: int) -> None:
        prepared(stream)

    def decode_gather(i: int) -> None:
        launches.gather(tokens, 0, tokens, decode_out, 1, 1, 1, stream)

    fused_gather.keep = decode_gather.keep = keep  # type: ignore[attr-defined]
    fused_row = "NgramGather.run (a fused runner's gather), 1 row"
    decode_row = "DecodeLaunches.gather (the decoder's gather), 1 row"
    fused_own, decode_own = f"{fused_row}: its Kernel.launch", f"{decode_row}: its Kernel.launch"
    return [
        (fused_own, own_launch(gather.kernel, fused_gather), BARE),
        (fused_row, fused_gather, fused_own),
        ("NgramGather.prepare(...).run (as the fused runner calls it), 1 row", fused_prepared, BARE),
        (decode_own, own_launch(launches.gather_kernel, decode_gather), BARE),
        (decode_row, decode_gather, decode_own),
    ]


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
        help="--stub, launching through cuda-bindings' launch functions over bench/fake_libcuda.c "
        "(needs a C compiler), so the rows include the bindings' argument conversion",
    )
    return parser


BARE, CHAIN = "bare cuLaunchKernel, prebuilt args", "chain floor: the builder's 7 calls, empty, then bare"
ONE = "Kernel.launch (the one mechanism)"


def stubbed(args: argparse.Namespace) -> bool:
    """Whether the driver is stubbed (no GPU needed): ``--stub``, or ``--bindings`` (a stub too)."""
    return bool(args.stub or args.bindings)


def main(args: argparse.Namespace) -> None:
    stub = stubbed(args)
    if stub:
        stub_driver(bindings=args.bindings)
    with CudaBackend() as gpu:
        kernel = load_kernel(gpu, "residual_add", "bf16_scaled_add")
        stream = gpu.create_stream()
        out, x = gpu.alloc(2 * N), gpu.alloc(2 * N)
        gpu.memset(out, 0, 2 * N)
        gpu.memset(x, 0, 2 * N)
        bound, config = gpu.bind(kernel), LaunchConfig(1, 256)

        def builder(i: int) -> None:
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

        def planned(i: int) -> None:
            bound.launch(config, stream, out, x, 0.5, N)

        prepared = bound.prepare(config, out, x, 0.5, N).run

        def prepared_run(i: int) -> None:
            prepared(stream)

        def launcher(i: int) -> None:
            scaled_add(gpu, kernel, out, x, 0.5, N, stream)

        # (row, launch, its floor's row)
        cases = [
            (BARE, bare_launcher(gpu, kernel, out, x, stream), None),
            ("bare, CUfunction and CUstream objects", bare_launcher(gpu, kernel, out, x, stream, handles=True), BARE),
            ("bare cuLaunchKernelEx, prebuilt config", bare_ex_launcher(kernel, out, x, stream), BARE),
            ("cuda.core launch", None if stub else cuda_core_launcher(gpu, out, x), BARE),
            ("CuPy RawKernel", None if stub else cupy_launcher(), BARE),
            (ONE, planned, BARE),
            ("PreparedLaunch.run (arguments packed once)", prepared_run, BARE),
            ("layers.ops.scaled_add", launcher, ONE),
            *gemm_rows(gpu, stream, [(1, 64, 64)]),
            *planned_rows(gpu, stream, stub),
            (CHAIN, empty_chain(bare_launcher(gpu, kernel, out, x, stream, handles=True)), BARE),
            ("KernelLaunch builder", builder, CHAIN),
        ]
        times: dict[str, float] = {}
        for _round in range(3):  # best of three rounds over every row (host noise only adds; a drift of
            for name, fn, _ in cases:  # the host's clock during the run reaches each row alike)
                if fn is None:
                    continue
                us = host_time_us(fn)
                getattr(fn, "sync", lambda: None if stub else gpu.synchronize(stream))()
                times[name] = min(us, times.get(name, us))
        bare = times[BARE]
        rows = []
        for name, _, floor in cases:
            t = times.get(name)
            floor_us = times[floor] if floor else None
            rows.append((name, t, floor or "-", t / floor_us if t and floor_us else None, t / bare if t else None))
        what = (
            "stubbed driver under the bindings' launch functions: Python us per launch"
            if args.bindings
            else "stubbed driver: Python us per launch"
            if stub
            else "host us per launch"
        )
        note = (
            "The driver is stubbed (every call returns at once): us/launch is the Python a path costs on top of "
            "the driver call, x floor that over its floor's row (cuda.core and CuPy not run)."
            if stub
            else "Each row is a launch path: us/launch is host time per launch (tight loop, best of 3 rounds over "
            "every row), x floor that over its floor's row (measured in this run), x bare over the bare "
            "cuLaunchKernel; - where not installed."
        )
        print_table(
            f"launch cost ({what}, 4-argument kernel unless named)",
            ["path", "us/launch", "floor", "x floor", "x bare"],
            rows,
            note=note,
        )


if __name__ == "__main__":
    run(main, make_parser(), needs_gpu=lambda args: not stubbed(args))
