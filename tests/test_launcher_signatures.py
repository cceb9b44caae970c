"""Every launcher passes its kernel the argument kinds its C signature declares, in order; the
token-overlay launchers pass them in exactly the seed's order (arguments go by position, so a
swap would launch garbage without any error). Every kernel has a ``KernelSpec`` whose parameter
names and kinds are its source's, and a spec launch binds by name, so a swap cannot pass."""

from __future__ import annotations

import ctypes
import inspect
import itertools
import re
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from gpu_runtime import (ClosedError, CudaBackend, CudaError, DevicePtr, GpuError, KernelHandle,
                         KernelLaunch, KernelSpec, packing)
from gpu_runtime.signatures import parse_signatures
from layers.kernel_files import kernel_dir, load_kernel
from layers.ops import embed, gemm, ngram_decode, ngram_fused, residual, row_cache, token_overlay
from layers.ops.specs import (BATCHED_EMBED, EMBED_OVERLAY_ROUTED, EMBED_ROWDIFF,
                              LMHEAD_OVERLAY_ROUTED, SPECS)
from layers.dense_weight import BF16, DenseWeight
from tests.helpers.fakes import RecordingBackend
from tests.helpers.scripted_driver import scripted_device

SEEDS = Path(__file__).parent / "seeds"


def _p(i: int) -> DevicePtr:
    return DevicePtr(0x100000 * (i + 1))


LAUNCHERS = {
    ("embed_from_argmax", "batched_embed"):
        lambda g, k: embed.batched_embed(g, k, _p(0), _p(1), _p(2), 5, 7, 3),
    ("embed_from_argmax", "batched_embed_shard"):
        lambda g, k: embed.batched_embed_shard(g, k, _p(0), _p(1), _p(2), 5, 7, 100, 50, 3),
    ("embed_from_argmax", "batched_embed_fp8"):
        lambda g, k: embed.batched_embed_fp8(g, k, _p(0), _p(1), _p(2), _p(3), 5, 7, 3),
    ("embed_from_argmax", "embed_from_argmax_bf16"):
        lambda g, k: embed.embed_from_argmax(g, k, _p(0), 11, _p(1), _p(2), _p(3), 5, 7, 3),
    ("residual_add", "bf16_scaled_add"):
        lambda g, k: residual.scaled_add(g, k, _p(0), _p(1), 0.25, 9, 3),
    ("residual_add", "bf16_residual_add"):
        lambda g, k: residual.residual_add(g, k, _p(0), _p(1), 9, 3),
    ("gemm", "dense_gemm_bf16_pipelined"):
        lambda g, k: gemm.dense_gemm_bf16_pipelined(
            g, k, _p(0), DenseWeight(_p(1), (6, 8), BF16), _p(2), 5, 6, 8, 3),
    ("gemm", "dense_gemm_bf16_word"):
        lambda g, k: gemm.dense_gemm_bf16_word(
            g, k, _p(0), DenseWeight(_p(1), (6, 8), BF16), _p(2), 5, 6, 8, _p(3), _p(4), 0.25, 3),
    ("ngram_fused", "ngram_gather"):
        lambda g, k: ngram_fused.ngram_gather(g, k, _p(0), _p(1), _p(2), _p(3), _p(4), _p(5),
                                              5, 6, 4, 2, 7, 11, 3),
    ("ngram_decode", "ngram_decode_gather"):
        lambda g, k: ngram_decode.ngram_decode_gather(
            g, k, _p(0), _p(1), _p(2), _p(3), _p(4), _p(5), _p(6), _p(7), _p(8), _p(9),
            9, 2, 0, 4, 5, 500, 6, 4, 2, 7, 11, 3),
    ("ngram_decode", "ngram_decode_seed"):
        lambda g, k: ngram_decode.ngram_decode_seed(g, k, _p(0), _p(1), _p(2), _p(3), _p(4), _p(5),
                                                    9, 2, 4, 5, 500, 3),
    ("ngram_decode", "ngram_decode_fork"):
        lambda g, k: ngram_decode.ngram_decode_fork(g, k, _p(0), _p(1), _p(2), _p(3), _p(4), 3, 4, 5, 3),
    ("ngram_decode", "ngram_decode_rollback"):
        lambda g, k: ngram_decode.ngram_decode_rollback(g, k, _p(0), _p(1), _p(2), _p(3), 2, 4, 3, 3),
    ("row_cache", "scatter_rows"):
        lambda g, k: row_cache.scatter_rows(g, k, _p(0), _p(1), _p(2), _p(3), _p(4), 5, 14, 3),
    ("token_overlay", "embed_rowdiff_bf16"):
        lambda g, k: token_overlay.embed_rowdiff(g, k, _p(0), _p(1), _p(2), 300, 7, 0.5, 3),
    ("token_overlay", "embed_overlay_routed_bf16"):
        lambda g, k: token_overlay.embed_overlay_routed(
            g, k, _p(0), _p(1), 2, _p(2), _p(3), _p(4), _p(5), 5, 7, 11, 3),
    ("token_overlay", "lmhead_overlay_routed_bf16"):
        lambda g, k: token_overlay.lmhead_overlay_routed(
            g, k, _p(0), _p(1), 2, _p(2), _p(3), _p(4), _p(5), 5, 4, 7, 11, 3),
    ("token_overlay", "lmhead_overlay_routed_f32"):
        lambda g, k: token_overlay.lmhead_overlay_routed(
            g, k, _p(0), _p(1), 2, _p(2), _p(3), _p(4), _p(5), 5, 4, 7, 11, 3),
}


def _all_kernels() -> set[tuple[str, str]]:
    found = set()
    for path in kernel_dir().glob("*.cu"):
        found |= {(path.stem, name) for name in parse_signatures(path.read_text())}
    return found


def test_every_kernel_has_a_launcher_here():
    assert _all_kernels() <= set(LAUNCHERS) | {k for k in _all_kernels() if k[0] == "gemm"}
    assert {k for k in LAUNCHERS if k[0] != "gemm"} <= _all_kernels()


@pytest.mark.parametrize("module, name", sorted(LAUNCHERS))
def test_launcher_kinds_match_c_signature(module, name):
    gpu = RecordingBackend()
    LAUNCHERS[(module, name)](gpu, load_kernel(gpu, module, name))
    assert gpu.launches, "the launcher launched nothing"
    signatures = parse_signatures((kernel_dir() / f"{module}.cu").read_text())
    for launch in gpu.launches:
        launched_module, launched_name = gpu.kernel_of(launch)
        assert launched_module == module
        assert launch.kinds == signatures[launched_name].kinds, launched_name
        assert launch.stream == 3


def _seed_launches(path: Path) -> dict[str, list[tuple[str, str]]]:
    """{function: [(kind, expression), ...]} of each ``KernelLaunch::new`` chain in a seed."""
    text = path.read_text()
    out = {}
    for fn in re.finditer(r"pub fn (\w+)\((.*?)\n\}", text, re.S):
        chain = re.findall(r"\.arg_(ptr|u32|i32|f32|u64)\(([^)]*)\)", fn.group(2))
        if chain:
            out[fn.group(1)] = chain
    return out


_KIND = {"ptr": "P", "u32": "U", "i32": "I", "f32": "F", "u64": "L"}


# What the routed kernels take past the seed's arguments (keyword-only in the launchers, 0 by
# default: the seed's contract): the slot tables' length and the error word that reports a slot
# past it (the seed's kernels trust a device seq_slot; these check it).
_PAST_THE_SEED = {"embed_overlay_routed": ("num_slots", "err"), "lmhead_overlay_routed": ("num_slots", "err")}


def test_overlay_launchers_follow_the_seed_position_for_position():
    """Each launcher's spec names the seed chain's arguments in the seed's order (then the
    checked routing's two, ``_PAST_THE_SEED``, which default to the seed's behaviour), and the
    launcher puts its positional arguments there."""
    seed = _seed_launches(SEEDS / "ops_token_overlay.rs")
    assert set(seed) == {"embed_rowdiff", "embed_overlay_routed", "lmhead_overlay_routed"}
    for fn_name, chain in seed.items():
        spec = {"embed_rowdiff": EMBED_ROWDIFF, "embed_overlay_routed": EMBED_OVERLAY_ROUTED,
                "lmhead_overlay_routed": LMHEAD_OVERLAY_ROUTED}[fn_name]
        past = _PAST_THE_SEED.get(fn_name, ())
        assert spec.params.names == (*(expr.strip() for _, expr in chain), *past), fn_name
        fn = getattr(token_overlay, fn_name)
        params = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
        assert params[:2] == ["gpu", "kernel"] and params[-1] == "stream"
        values = {p: (i + 1) * 16 for i, p in enumerate(params[2:-1])}  # distinct per parameter
        gpu = RecordingBackend()
        kernel = load_kernel(gpu, "token_overlay", "x")
        fn(gpu, kernel, *values.values(), 5)
        (launch,) = gpu.launches
        assert launch.kinds == "".join(_KIND[k] for k, _ in chain) + "UP" * bool(past), fn_name
        expected = [values[expr.strip()] for _, expr in chain] + [0, 0] * bool(past)  # the seed's contract
        assert [int(a) for a in launch.args] == expected, fn_name


# -- KernelSpec: named arguments ---------------------------------------------------------------
def _sources() -> dict[str, dict]:
    return {path.stem: parse_signatures(path.read_text()) for path in kernel_dir().glob("*.cu")}


def test_every_kernel_has_a_spec_and_every_spec_a_kernel():
    sources = _sources()
    assert set(SPECS) == set(sources)
    for module, specs in SPECS.items():
        assert set(specs) == set(sources[module]), module


_KERNEL_SPECS = [(module, kernel, spec) for module, specs in SPECS.items() for kernel, spec in specs.items()]


@pytest.mark.parametrize("module, kernel, spec", _KERNEL_SPECS, ids=[k for _, k, _ in _KERNEL_SPECS])
def test_spec_matches_its_kernel_source_names_and_kinds(module, kernel, spec):
    signature = _sources()[module][kernel]
    spec.check_signature(signature, kernel)  # raises on any difference
    assert spec.params == signature and spec.params.names == signature.names
    assert spec.name == kernel or spec is LMHEAD_OVERLAY_ROUTED  # the one spec of two kernels


def test_spec_with_two_same_kind_parameters_swapped_is_refused():
    """batched_embed takes (ids, table, out, n, dim): a spec that names n and dim the other way
    round has the same kinds, and is refused by name."""
    swapped = KernelSpec("batched_embed", ids="P", table="P", out="P", dim="U", n="U")
    (signature,) = [sigs["batched_embed"] for sigs in _sources().values() if "batched_embed" in sigs]
    assert swapped.kinds == signature.kinds
    with pytest.raises(TypeError, match=r"parameter 3 is n: u32 in the source, dim: u32 in spec"):
        swapped.check_signature(signature, "embed_from_argmax.batched_embed")


def test_arguments_bound_by_name_land_in_their_positions():
    """Keywords in any order launch the kernel's order; a missing or unknown name is refused
    before anything is launched."""
    gpu = RecordingBackend()
    k = load_kernel(gpu, "embed_from_argmax", "batched_embed")
    BATCHED_EMBED.launch(gpu, k, (2, 1, 1), (256, 1, 1), 3, dim=7, n=5, out=_p(2), table=_p(1), ids=_p(0))
    (launch,) = gpu.launches
    assert launch.kinds == "PPPUU" and launch.args == [int(_p(0)), int(_p(1)), int(_p(2)), 5, 7]
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'dim'"):
        BATCHED_EMBED.launch(gpu, k, (2, 1, 1), (256, 1, 1), 3, n=5, out=_p(2), table=_p(1), ids=_p(0))
    with pytest.raises(TypeError, match="unexpected keyword argument 'count'"):
        BATCHED_EMBED.launch(gpu, k, (2, 1, 1), (256, 1, 1), 3, count=5, dim=7, out=_p(2), table=_p(1),
                             ids=_p(0))
    with pytest.raises(TypeError):  # arguments cannot be given by position
        BATCHED_EMBED.launch(gpu, k, (2, 1, 1), (256, 1, 1), 3, _p(0), _p(1), _p(2), 5, 7)
    assert len(gpu.launches) == 1


def test_launch_from_takes_each_argument_by_name_from_a_mapping():
    """``launch_from`` looks each parameter up by name (a launcher passes its ``locals()``): the
    same launch as by keywords; a missing name refused before anything is launched, names that
    are not parameters left alone."""
    gpu = RecordingBackend()
    k = load_kernel(gpu, "embed_from_argmax", "batched_embed")
    args = dict(gpu=gpu, stream=3, dim=7, n=5, out=_p(2), table=_p(1), ids=_p(0))
    BATCHED_EMBED.launch_from(gpu, k, (2, 1, 1), (256, 1, 1), 3, args)
    BATCHED_EMBED.launch(gpu, k, (2, 1, 1), (256, 1, 1), 3, dim=7, n=5, out=_p(2), table=_p(1), ids=_p(0))
    assert gpu.launches[0] == gpu.launches[1]
    assert str(inspect.signature(BATCHED_EMBED.launch_from)) == (
        "(gpu, kernel, grid, block, stream, args, /, *, shared_mem=0, overlap=False)")
    del args["dim"]
    with pytest.raises(TypeError, match="batched_embed: no value for parameter 'dim'"):
        BATCHED_EMBED.launch_from(gpu, k, (2, 1, 1), (256, 1, 1), 3, args)
    with pytest.raises(ValueError, match="batched_embed out: null device pointer"):
        BATCHED_EMBED.launch_from(gpu, k, (2, 1, 1), (256, 1, 1), 3, {**args, "dim": 7, "out": 0})
    assert len(gpu.launches) == 2


# -- KernelSpec: its own checks and CudaBackend's -----------------------------------------------------------------------------
ADD = KernelSpec("add", dst="P", src="P", scale="F", n="U")
_ADD_SOURCE = ('extern "C" __global__ void add(float* dst, const float* src, float scale, unsigned n) {\n'
               '    if (threadIdx.x < n) dst[threadIdx.x] += scale * src[threadIdx.x];\n}\n')


def test_kernel_spec_names_kinds_and_launch_signature():
    assert ADD.kinds == "PPFU" and ADD.params.names == ("dst", "src", "scale", "n") and not ADD.nullable
    assert (ADD.offsets, ADD.sizes) == ([0, 8, 16, 20], [8, 8, 4, 4])
    assert repr(ADD) == "KernelSpec('add', dst='P', src='P', scale='F', n='U')"
    assert str(inspect.signature(ADD.launch)) == (
        "(gpu, kernel, grid, block, stream, /, *, dst, src, scale, n, shared_mem=0, overlap=False)")
    with pytest.raises(ValueError, match="is not a kind"):
        KernelSpec("k", n="Q")
    with pytest.raises(ValueError, match="is not a kind"):
        KernelSpec("k", n="U?")
    # the launch's options, a private name, a keyword, and names the generated launcher reads: its
    # positional parameters and the builtins it calls ("type" shadowed one)
    for bad in ("overlap", "shared_mem", "_x", "lambda", "type", "len", "grid", "stream", "kernel", "args"):
        with pytest.raises(ValueError, match="cannot name a parameter"):
            KernelSpec("k", **{bad: "U"})
    # the launcher's own variables start with "_" (a parameter "bad" once launched as its False)
    for fine in ("bad", "plan", "err", "direct", "params", "buffer", "name", "out"):
        assert KernelSpec("k", **{fine: "U"}).params.names == (fine,)


def test_every_variable_of_the_generated_launcher_is_refused_as_a_parameter():
    """Found by compiling the launchers, not listed by hand: whatever the template uses."""
    from gpu_runtime.launch_spec import _launcher_names

    used = {n for n in _launcher_names() if not n.startswith("_")}
    assert {"gpu", "kernel", "grid", "block", "stream", "args", "type", "len"} <= used
    assert not used & {"bad", "plan", "err", "direct", "spec", "local"}  # its own: "_" names
    for name in used:
        with pytest.raises(ValueError, match="cannot name a parameter"):
            KernelSpec("k", **{name: "U"})


def test_a_spec_without_parameters_launches():
    spec = KernelSpec("k")
    gpu = RecordingBackend()
    k = gpu.kernel("m", "k")
    spec.launch(gpu, k, (1, 1, 1), (1, 1, 1), 0)
    spec.launch_from(gpu, k, (2, 1, 1), (1, 1, 1), 0, {})
    assert [launch.args for launch in gpu.launches] == [[], []]


def test_nullable_pointer_spec():
    spec = KernelSpec("k", a="P", b="P?", n="U")
    assert spec.kinds == "PPU" and spec.nullable == {"b"}
    assert repr(spec) == "KernelSpec('k', a='P', b='P?', n='U')"
    gpu = RecordingBackend()
    k = gpu.kernel("m", "k")
    spec.launch(gpu, k, (1, 1, 1), (1, 1, 1), 0, a=16, b=0, n=1)
    with pytest.raises(ValueError, match="k a: null device pointer"):
        spec.launch(gpu, k, (1, 1, 1), (1, 1, 1), 0, a=0, b=16, n=1)
    assert [launch.args for launch in gpu.launches] == [[16, 0, 1]]


def test_tensor_map_parameters_are_128_bytes_at_64_byte_offsets():
    """A ``CUtensorMap`` by value (``const __grid_constant__ TensorMap``): the C ABI puts it at the
    next multiple of 64; the spec takes exactly 128 bytes (``struct`` would pad or cut others)."""
    source = ('extern "C" __global__ void __launch_bounds__(384, 1)\n'
              'k(float* x, const __grid_constant__ TensorMap t, unsigned n, const __grid_constant__ '
              'TensorMap u) {}\n')
    assert parse_signatures(source)["k"].kinds == "PTUT"
    assert packing.layout("PTUT") == ([0, 64, 192, 256], [8, 128, 4, 128])
    spec = KernelSpec("k", x="P", t="T", n="U", u="T")
    assert (spec.offsets, spec.sizes) == packing.layout("PTUT")
    gpu = RecordingBackend()
    k = gpu.kernel("m", "k")
    tmap = bytes(range(128))
    spec.launch(gpu, k, (1, 1, 1), (1, 1, 1), 0, x=16, t=tmap, n=3, u=tmap[::-1])
    assert gpu.launches[0].args == [16, tmap, 3, tmap[::-1]]
    for bad, error, message in ((tmap[:127], ValueError, "k t: a tensor map is 128 bytes, got 127"),
                                (tmap + b"x", ValueError, "got 129"),
                                (bytearray(tmap), TypeError, "k t must be a tensor map's bytes"),
                                (0, TypeError, "got int")):
        with pytest.raises(error, match=re.escape(message)):
            spec.launch(gpu, k, (1, 1, 1), (1, 1, 1), 0, x=16, t=bad, n=3, u=tmap)
    assert len(gpu.launches) == 1


def test_spec_launch_records_like_a_kernel_launch():
    gpu = RecordingBackend()
    k = gpu.kernel("m", "add")
    ADD.launch(gpu, k, [3, 1, 1], (64, 1, 1), 9, n=np.uint32(7), scale=np.float32(0.5), src=DevicePtr(16),
               dst=32, shared_mem=128, overlap=True)
    KernelLaunch(gpu, k).grid([3, 1, 1]).block([64, 1, 1]).shared_mem(128).arg_ptr(32).arg_ptr(16) \
        .arg_f32(0.5).arg_u32(7).launch(9, overlap=True)
    spec_launch, builder_launch = gpu.launches
    assert spec_launch == builder_launch
    assert [type(a) for a in spec_launch.args] == [int, int, float, int]


@pytest.mark.parametrize("over, error, message", [
    (dict(n=2**32), ValueError, r"^add n must be in 0\.\.2\*\*32-1, got 4294967296$"),
    (dict(n=-1), ValueError, r"add n must be in 0\.\.2\*\*32-1, got -1"),
    (dict(n=1.5), TypeError, r"^add n must be an int, got float 1\.5$"),
    (dict(n="3"), TypeError, r"add n must be an int"),
    (dict(n=True), TypeError, r"add n must be an int, got bool"),
    (dict(dst=0), ValueError, r"^add dst: null device pointer$"),
    (dict(dst=-1), ValueError, r"add dst: device pointer out of range: -1"),
    (dict(src=None), TypeError, r"add src must be an int"),
    (dict(src=np.zeros(2)), TypeError, r"add src must be an int"),
    (dict(scale=1e39), ValueError, r"^add scale: 1e\+39 overflows f32$"),
    (dict(scale="x"), TypeError, r"add scale must be a real number"),
    (dict(grid=(0, 1, 1)), ValueError, r"each dimension must be in 1\.\."),
    (dict(block=(2048, 1, 1)), ValueError, r"each dimension must be in 1\.\."),
    (dict(block=(32, 1)), ValueError, "3 dimensions"),
    (dict(shared_mem=-1), ValueError, "shared_mem"),
    (dict(kernel=KernelHandle(0)), ValueError, "add: null kernel handle"),
])
def test_spec_launch_refusals_name_kernel_and_parameter(over, error, message):
    gpu = RecordingBackend()
    args = dict(kernel=gpu.kernel("m", "add"), grid=(1, 1, 1), block=(32, 1, 1), dst=32, src=16,
                scale=0.5, n=7)
    args.update(over)
    kernel, grid, block = args.pop("kernel"), args.pop("grid"), args.pop("block")
    with pytest.raises(error, match=message):
        ADD.launch(gpu, kernel, grid, block, 0, **args)
    assert gpu.launches == []


class _ScriptedDriver:
    """A driver for ``CudaBackend`` without a GPU (its ``call``, and the bindings' parameter
    layout and launch functions): handles from a counter, a parameter layout per kernel, and
    launches recorded with the bytes their arguments point at, and the shared memory each
    kernel was opted in to."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, sizes: list[int]) -> None:
        from cuda.bindings import driver as cu

        self.cu, self.sizes = cu, sizes
        self.handles = itertools.count(0x7F00_0000_0000, 1 << 20)
        self.launches: list[tuple] = []
        self.functions: list[object] = []  # cuModuleGetFunction's answers
        self.kernels_given: list[object] = []  # the kernel object each launch handed the driver
        self.opt_ins: list[int] = []  # cuFuncSetAttribute's values (the scripted kernels take only that one)
        self.layout_queries = 0
        self.fail_with = None
        scripted_device(monkeypatch, self.call)
        monkeypatch.setattr(cu, "cuFuncGetParamCount", lambda k: (cu.CUresult.CUDA_SUCCESS, len(sizes)),
                            raising=False)
        monkeypatch.setattr(cu, "cuFuncGetParamInfo", self.param_info)
        monkeypatch.setattr(cu, "cuLaunchKernel", self.launch)
        monkeypatch.setattr(cu, "cuLaunchKernelEx", self.launch_ex)

    def call(self, fn, *args, detail=""):
        name = fn.__name__
        if name == "cuDeviceGetName":
            return b"scripted\0"
        if name == "cuModuleGetFunction":  # the bindings' object, as the driver's answer
            self.functions.append(self.cu.CUfunction(next(self.handles)))
            return self.functions[-1]
        if name in ("cuModuleLoadData", "cuStreamCreate"):
            return next(self.handles)
        if name == "cuFuncSetAttribute":
            self.opt_ins.append(args[2])
        return 0

    def param_info(self, kernel, i):
        self.layout_queries += 1
        offsets, _ = packing.layout("".join({8: "P", 4: "U"}[s] for s in self.sizes))
        return self.cu.CUresult.CUDA_SUCCESS, offsets[i], self.sizes[i]

    def _record(self, how, kernel, config, params):
        pointers = (ctypes.c_void_p * len(self.sizes)).from_address(params)
        raw = [ctypes.string_at(pointers[i], s) for i, s in enumerate(self.sizes)]
        self.kernels_given.append(kernel)
        self.launches.append((how, int(kernel), config, raw))
        return (self.fail_with or self.cu.CUresult.CUDA_SUCCESS,)

    def launch(self, kernel, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        if not all(type(d) is int and d >= 0 for d in (gx, gy, gz, bx, by, bz)):
            raise TypeError("the bindings take unsigned ints")  # as cuda.bindings' conversion
        invalid = not (gx and gy and gz and bx and by and bz) or bx * by * bz > 1024
        if invalid:
            return (self.cu.CUresult.CUDA_ERROR_INVALID_VALUE,)
        return self._record("plain", kernel, ((gx, gy, gz), (bx, by, bz), shared, stream), params)

    def launch_ex(self, config, kernel, params, extra):
        grid = (config.gridDimX, config.gridDimY, config.gridDimZ)
        return self._record("overlap", kernel, (grid, config.sharedMemBytes), params)


@pytest.fixture
def scripted(monkeypatch, tmp_path):
    """(backend, driver, kernel): a CudaBackend on the scripted driver and the ``add`` kernel,
    compiled for real (NVRTC) from a source given by path."""
    monkeypatch.setenv("GPU_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    driver = _ScriptedDriver(monkeypatch, [8, 8, 4, 4])
    src = tmp_path / "add.cu"
    src.write_text(_ADD_SOURCE)
    gpu = CudaBackend()
    return gpu, driver, gpu.kernel(src, "add")


def _packed(dst, src, scale, n):
    return [struct.pack("<Q", dst), struct.pack("<Q", src), struct.pack("<f", scale), struct.pack("<I", n)]


def test_spec_launch_packs_the_kernel_arguments_once_checked(scripted):
    gpu, driver, k = scripted
    for n in (7, 8):
        ADD.launch(gpu, k, (2, 1, 1), (64, 1, 1), 5, n=n, scale=0.25, src=0x2000, dst=DevicePtr(0x1000))
    ADD.launch(gpu, k, (2, 1, 1), (64, 1, 1), 5, n=9, scale=0.25, src=0x2000, dst=0x1000, overlap=True)
    assert [(how, config) for how, _, config, _ in driver.launches] == [
        ("plain", ((2, 1, 1), (64, 1, 1), 0, 5))] * 2 + [("overlap", ((2, 1, 1), 0))]
    assert [raw for *_, raw in driver.launches] == [_packed(0x1000, 0x2000, 0.25, n) for n in (7, 8, 9)]
    assert driver.layout_queries == 4  # the layout is asked once per kernel and spec, not per launch


def test_spec_refused_against_the_source_at_its_first_launch(scripted):
    gpu, driver, k = scripted
    swapped = KernelSpec("add", src="P", dst="P", scale="F", n="U")  # same kinds, names swapped
    with pytest.raises(TypeError, match=r"add\.add: parameter 0 is dst: pointer in the source, "
                                        r"src: pointer in spec add"):
        swapped.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, src=1, dst=2, scale=1.0, n=3)
    short = KernelSpec("add", dst="P", src="P", scale="F")
    with pytest.raises(TypeError, match="the source has 4 parameters"):
        short.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, src=1, dst=2, scale=1.0)
    assert driver.launches == []


def test_spec_launch_refusals_on_the_cuda_backend(scripted):
    gpu, driver, k = scripted
    good = dict(dst=1, src=2, scale=1.0, n=3)
    with pytest.raises(ValueError, match=r"add n must be in 0\.\.2\*\*32-1"):
        ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, **{**good, "n": 2**32})
    with pytest.raises(ValueError, match="more than 1024 threads"):  # the driver refused; phrased
        ADD.launch(gpu, k, (1, 1, 1), (32, 32, 2), 0, **good)
    with pytest.raises(TypeError, match="grid must be an int"):  # the bindings refused; phrased
        ADD.launch(gpu, k, (1.5, 1, 1), (32, 1, 1), 0, **good)
    with pytest.raises(ValueError, match="null kernel handle"):
        ADD.launch(gpu, KernelHandle(0), (1, 1, 1), (32, 1, 1), 0, **good)
    with pytest.raises(GpuError, match="not loaded by this backend"):
        ADD.launch(gpu, KernelHandle(0xDEAD), (1, 1, 1), (32, 1, 1), 0, **good)
    driver.fail_with = driver.cu.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
    with pytest.raises(CudaError, match=r"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: cuLaunchKernel \(add\.add"):
        ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, **good)
    driver.fail_with = None
    ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, **good)  # still usable
    assert len(driver.launches) == 2


def test_spec_launch_per_thread_and_closed_backend(scripted):
    gpu, driver, k = scripted
    ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, dst=1, src=2, scale=1.0, n=3)

    def other_thread(n: int) -> None:
        for _ in range(50):
            ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, dst=1, src=2, scale=1.0, n=n)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(other_thread, (10, 20)))  # re-raises what a thread raised
    assert len(driver.launches) == 101
    assert {raw[3] for *_, raw in driver.launches} == {struct.pack("<I", n) for n in (3, 10, 20)}
    gpu.close()
    with pytest.raises(ClosedError, match="backend is closed"):
        ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, dst=1, src=2, scale=1.0, n=3)
    with pytest.raises(ClosedError, match="backend is closed"):
        KernelLaunch(gpu, k).arg_ptr(1).arg_ptr(2).arg_f32(1.0).arg_u32(3).launch(0)
    assert len(driver.launches) == 101


def test_spec_launch_takes_the_direct_route_once_checked(scripted, monkeypatch, tmp_path):
    """After the first launch of a (kernel, spec) pair on a thread, its plain launches call the
    driver from the spec's launcher: the backend's ``launch_spec`` only sees the first one, the
    overlapped ones and those over 48 KiB of shared memory beyond what it has opted the kernel
    in to. A second backend gets no route from the first's, and a closed one loses its routes."""
    gpu, driver, k = scripted
    gpu.max_shared_optin = 227 * 1024  # the scripted device reports none
    seen = []
    through = gpu.launch_spec
    monkeypatch.setattr(gpu, "launch_spec", lambda *a, **kw: (seen.append(a[0].name), through(*a, **kw)))
    args = dict(dst=1, src=2, scale=0.5, n=3)
    for _ in range(3):
        ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, **args)
    ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, **args, overlap=True)
    shared = [48 * 1024, 48 * 1024 + 4, 48 * 1024 + 4, 48 * 1024 + 2, 64 * 1024, 64 * 1024]
    for size in shared:
        ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, **args, shared_mem=size)
    # the first, the overlapped one, and the first over 48 KiB and over its opt-in (which opt in)
    assert seen == ["add"] * 4
    assert driver.opt_ins == [48 * 1024 + 4, 64 * 1024]
    assert [how for how, *_ in driver.launches] == ["plain"] * 3 + ["overlap"] + ["plain"] * len(shared)
    plain = [config[2] for how, _, config, _ in driver.launches if how == "plain"]
    assert plain == [0] * 3 + shared
    assert {tuple(raw) for *_, raw in driver.launches} == {tuple(_packed(1, 2, 0.5, 3))}

    other = CudaBackend()  # the same kernel handle value on another backend: its own checks
    with pytest.raises(GpuError, match="not loaded by this backend"):
        ADD.launch(other, k, (1, 1, 1), (32, 1, 1), 0, **args)
    gpu.close()
    with pytest.raises(ClosedError, match="backend is closed"):
        ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, **args)
    with pytest.raises(ClosedError, match="backend is closed"):  # the opted-in route is gone too
        ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, **args, shared_mem=48 * 1024 + 4)
    assert len(driver.launches) == 4 + len(shared)
    other.close()


def test_every_launch_path_hands_the_driver_its_function_object(scripted):
    """The backend's path, both direct routes and the overlapped launch all give the driver the
    ``CUfunction`` that ``cuModuleGetFunction`` returned (which the bindings need not convert),
    not the ``KernelHandle`` int."""
    gpu, driver, k = scripted
    args = dict(dst=1, src=2, scale=0.5, n=3)
    for _ in range(2):  # the first through the backend, the second on the route
        ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, **args)
        KernelLaunch(gpu, k).arg_ptr(1).arg_ptr(2).arg_f32(0.5).arg_u32(3).launch(0)
    ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, **args, overlap=True)
    (function,) = driver.functions
    assert int(function) == int(k) and len(driver.kernels_given) == 5
    assert all(given is function for given in driver.kernels_given)


def test_a_source_whose_signature_is_refused_loads_nothing(monkeypatch, tmp_path):
    """A kernel parameter the runtime cannot pack is refused before the module is compiled or
    loaded, at every ask (before, the module stayed loaded without signatures, and the second
    ``kernel()`` returned a handle whose launch failed with a bare ``KeyError``)."""
    monkeypatch.setenv("GPU_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    driver = _ScriptedDriver(monkeypatch, [8, 8])
    loads = []
    through = driver.call
    scripted_device(monkeypatch, lambda fn, *a, detail="": (loads.append(fn.__name__), through(fn, *a))[1])
    src = tmp_path / "m.cu"
    src.write_text('extern "C" __global__ void f(float* o, double x) { o[0] = (float)x; }\n')
    gpu = CudaBackend()
    for _ in range(2):
        with pytest.raises(ValueError, match="unsupported kernel parameter type in 'double x'"):
            gpu.kernel(src, "f")
    assert "cuModuleLoadData" not in loads
    gpu.close()


def test_two_threads_opting_in_leave_the_driver_and_the_table_agreeing(scripted, monkeypatch):
    """Thread A asks for 60000 bytes while thread B's opt-in to 80000 is inside the driver: A
    waits for it and then needs none, so the driver and the backend's table both hold 80000
    (before, A's smaller opt-in reached the driver in between, the table kept B's value, and
    every later 80000-byte launch failed)."""
    gpu, driver, k = scripted
    gpu.max_shared_optin = 227 * 1024
    b_inside, a_launching = threading.Event(), threading.Event()
    through = driver.call

    def call(fn, *args, detail=""):
        if fn.__name__ == "cuFuncSetAttribute" and args[2] == 80000:  # B, inside the driver
            b_inside.set()
            a_launching.wait(5)
            time.sleep(0.1)  # room for A to reach the driver, if nothing stops it
        return through(fn, *args, detail=detail)

    scripted_device(monkeypatch, call)
    args = dict(dst=1, src=2, scale=0.5, n=3)

    def launch(shared: int) -> None:
        ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, **args, shared_mem=shared)

    b = threading.Thread(target=launch, args=(80000,))
    b.start()
    assert b_inside.wait(5)
    a_launching.set()
    launch(60000)  # A
    b.join()
    assert driver.opt_ins == [80000] and gpu._shared_set[int(k)] == 80000


def test_tables_of_threads_that_ended_are_dropped(scripted):
    """Each thread that launches leaves the backend its checked-launch tables and a launcher's
    route tables; those of threads that ended are dropped when the next thread binds (they grew
    with every thread an engine ever started)."""
    gpu, driver, k = scripted

    def launch() -> None:
        ADD.launch(gpu, k, (1, 1, 1), (32, 1, 1), 0, dst=1, src=2, scale=0.5, n=3)
        KernelLaunch(gpu, k).arg_ptr(1).arg_ptr(2).arg_f32(0.5).arg_u32(3).launch(0)

    for _ in range(40):
        worker = threading.Thread(target=launch)
        worker.start()
        worker.join()
    last = threading.Thread(target=launch)
    last.start()
    last.join()
    assert len(gpu._thread_tables) <= 2 * 2  # the last two threads' (the one that ended is dropped later)
    assert len(gpu._direct_tables) <= 2 * 2
    assert len(driver.launches) == 2 * 41
    launch()  # this thread: bound anew, its routes work
    assert len(driver.launches) == 2 * 42


def test_builder_launch_takes_the_direct_route_once_checked(scripted, monkeypatch):
    """As a spec launch: after a (kernel, kinds) shape's first launch on a thread, the builder's
    plain launches call the driver themselves, with the same packed bytes; overlapped ones and
    those over 48 KiB beyond the kernel's opt-in still go through the backend. A driver refusal
    on the route is phrased by the backend; a second backend gets no route from the first's, and
    a closed one loses its."""
    gpu, driver, k = scripted
    gpu.max_shared_optin = 227 * 1024
    seen = []
    through = gpu.launch
    monkeypatch.setattr(gpu, "launch", lambda *a, **kw: (seen.append(a[5]), through(*a, **kw)))

    def built(backend, n):
        return KernelLaunch(backend, k).grid([2, 1, 1]).block([32, 1, 1]).arg_ptr(1).arg_ptr(2).arg_f32(0.5).arg_u32(n)

    for n in (3, 4, 5):
        built(gpu, n).launch(7)
    built(gpu, 6).launch(7, overlap=True)
    built(gpu, 7).shared_mem(48 * 1024).launch(7)
    built(gpu, 8).shared_mem(48 * 1024 + 4).launch(7)
    assert seen == ["PPFU"] * 3  # the first, the overlapped one, the one over 48 KiB
    assert [how for how, *_ in driver.launches] == ["plain"] * 3 + ["overlap"] + ["plain"] * 2
    plain = [config for how, _, config, _ in driver.launches if how == "plain"]
    assert plain == [((2, 1, 1), (32, 1, 1), shared, 7) for shared in (0, 0, 0, 48 * 1024, 48 * 1024 + 4)]
    assert [raw for *_, raw in driver.launches] == [_packed(1, 2, 0.5, n) for n in range(3, 9)]

    driver.fail_with = driver.cu.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
    with pytest.raises(CudaError, match=r"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: cuLaunchKernel \(add\.add grid"):
        built(gpu, 9).launch(7)
    driver.fail_with = None
    assert seen == ["PPFU"] * 3 and len(driver.launches) == 7  # the refused one is recorded too
    built(gpu, 10).shared_mem(48 * 1024 + 4).launch(7)  # within the kernel's opt-in: direct
    built(gpu, 11).shared_mem(64 * 1024).launch(7)  # beyond it: the backend opts in again
    assert seen == ["PPFU"] * 4 and driver.opt_ins == [48 * 1024 + 4, 64 * 1024]
    assert [config[2] for _, _, config, _ in driver.launches[7:]] == [48 * 1024 + 4, 64 * 1024]

    other = CudaBackend()  # the same kernel handle value on another backend: its own checks
    with pytest.raises(GpuError, match="not loaded by this backend"):
        built(other, 3).launch(0)
    gpu.close()
    with pytest.raises(ClosedError, match="backend is closed"):
        built(gpu, 3).launch(0)
    assert len(driver.launches) == 9
    other.close()
