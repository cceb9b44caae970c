"""Every launcher passes each argument where its kernel's signature (read from the ``.cu``)
puts it, checked by name: each launcher is called with a distinct value per parameter, and every
kernel parameter must receive the value of the launcher's parameter of its name (arguments go by
position, so a swap of two ``uint32_t`` would launch garbage without any error). The
token-overlay launchers pass them in exactly the seed's order. Then the one launch mechanism on
``CudaBackend`` over a scripted driver: what it packs, what it checks once, and what it refuses."""

from __future__ import annotations

import ctypes
import itertools
import re
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime import (ClosedError, CudaBackend, CudaError, DevicePtr, GpuError, KernelHandle, KernelLaunch,
                         LaunchConfig)
from gpu_runtime.launch import ArgLayout
from gpu_runtime.signatures import Param, Signature, parse_signatures
from layers.dense_weight import BF16, DenseWeight
from layers.kernel_files import kernel_dir, load_kernel
from layers.ops import (ArgmaxEmbed, DecodeLaunches, NgramGather, RowScatter, ShardGather, embed, gemm, residual,
                        token_overlay)
from layers.ops.ngram_decode import AdapterTables
from tests.helpers.fakes import RecordingBackend
from tests.helpers.scripted_driver import launch_attributes, scripted_device

SEEDS = Path(__file__).parent / "seeds"


def _sources() -> dict[str, dict[str, Signature]]:
    return {path.stem: parse_signatures(path.read_text()) for path in kernel_dir().glob("*.cu")}


class Values(dict):
    """A distinct value per parameter name, made on first use: pointers 0x100000 apart, u32s
    from 3 up, f32s halves (each exact in an f32)."""

    def __init__(self) -> None:
        super().__init__()
        self._ptrs, self._ints, self._floats = itertools.count(1), itertools.count(3), itertools.count(1)

    def ptr(self, name: str) -> DevicePtr:
        return self.setdefault(name, DevicePtr(0x100000 * next(self._ptrs)))

    def u32(self, name: str) -> int:
        return self.setdefault(name, next(self._ints))

    def f32(self, name: str) -> float:
        return self.setdefault(name, next(self._floats) + 0.5)


# Each launcher called with its parameters' values by name (``v``); the kernel parameters whose
# value comes from another name (``RENAMED``), and those the launcher computes (``COMPUTED``).
def _gemm_weight(v: Values) -> DenseWeight:
    return DenseWeight(v.ptr("w"), (v["n"], v["k"]), BF16)


LAUNCHERS: dict[tuple[str, str], Any] = {
    ("embed_from_argmax", "batched_embed"): lambda g, k, v: embed.batched_embed(
        g, k, v.ptr("ids"), v.ptr("table"), v.ptr("out"), v.u32("n"), v.u32("dim"), 3),
    ("embed_from_argmax", "batched_embed_fp8"): lambda g, k, v: embed.batched_embed_fp8(
        g, k, v.ptr("ids"), v.ptr("table"), v.ptr("row_scale"), v.ptr("out"), v.u32("n"), v.u32("dim"), 3),
    ("embed_from_argmax", "batched_embed_shard"): lambda g, k, v: ShardGather(
        g, k, v.ptr("table"), v.ptr("out"), v.u32("dim"), v.u32("lo"), v.u32("count")).run(v.ptr("ids"), v.u32("n"), 3),
    ("embed_from_argmax", "embed_from_argmax_bf16"): lambda g, k, v: ArgmaxEmbed(
        g, k, v.ptr("table"), v.u32("vocab"), v.u32("dim")).run(v.ptr("logits"), v.ptr("out"), v.ptr("ids_out"),
                                                                 v.u32("m"), 3),
    ("residual_add", "bf16_scaled_add"): lambda g, k, v: residual.scaled_add(
        g, k, v.ptr("out"), v.ptr("x"), v.f32("scale"), v.u32("n"), 3),
    ("residual_add", "bf16_residual_add"): lambda g, k, v: residual.residual_add(
        g, k, v.ptr("out"), v.ptr("x"), v.u32("n"), 3),
    ("gemm", "dense_gemm_bf16_pipelined"): lambda g, k, v: gemm.dense_gemm_bf16_pipelined(
        g, k, v.ptr("a"), (v.u32("n"), v.u32("k"), _gemm_weight(v))[2], v.ptr("c"), v.u32("m"), v["n"], v["k"], 3),
    ("gemm", "dense_gemm_bf16_word"): lambda g, k, v: gemm.dense_gemm_bf16_word(
        g, k, v.ptr("a"), (v.u32("n"), v.u32("k"), _gemm_weight(v))[2], v.ptr("c"), v.u32("m"), v["n"], v["k"],
        v.ptr("word_ids"), v.ptr("word"), v.f32("scale"), 3, word_over=v.ptr("word_over")),
    ("ngram_fused", "ngram_gather"): lambda g, k, v: NgramGather(
        g, k, v.ptr("tables"), v.ptr("pows"), v.setdefault("num_tables", 6), v.setdefault("max_ngram", 4),
        v.setdefault("splits", 2), v.u32("td"), v.u32("eos")).run(
        v.ptr("windows"), v.ptr("slots"), v.ptr("out"), v.ptr("ids_out"), v.u32("rows_r"), 3),
    ("row_cache", "scatter_rows"): lambda g, k, v: RowScatter(
        g, k, v.ptr("arena"), v.ptr("arena_scales"), v.u32("row_bytes")).run(
        v.ptr("slots"), v.ptr("rows"), v.ptr("scales"), v.u32("n"), 3),
    ("token_overlay", "embed_rowdiff_bf16"): lambda g, k, v: token_overlay.embed_rowdiff(
        g, k, v.ptr("base"), v.ptr("served"), v.ptr("flags"), v.u32("rows"), v.u32("h"), v.f32("thresh"), 3),
    ("token_overlay", "embed_overlay_routed_bf16"): lambda g, k, v: token_overlay.embed_overlay_routed(
        g, k, v.ptr("ids"), v.ptr("seq_slot"), v.u32("active"), v.ptr("slot_map_tab"), v.ptr("rows_tab"),
        v.ptr("n_tab"), v.ptr("out"), 5, v.u32("h"), v.u32("vocab"), 3, num_slots=v.u32("num_slots"),
        err=v.ptr("err")),
    ("token_overlay", "lmhead_overlay_routed_bf16"): lambda g, k, v: token_overlay.lmhead_overlay_routed(
        g, k, v.ptr("hidden"), v.ptr("seq_slot"), v.u32("active"), v.ptr("rows_tab"), v.ptr("ids_tab"),
        v.ptr("n_tab"), v.ptr("logits"), 5, 4, v.u32("h"), v.u32("vocab"), 3, num_slots=v.u32("num_slots"),
        err=v.ptr("err")),
}
LAUNCHERS[("token_overlay", "lmhead_overlay_routed_f32")] = LAUNCHERS[("token_overlay", "lmhead_overlay_routed_bf16")]


def _decode(name: str) -> Any:
    """A ``DecodeLaunches`` call of kernel ``name`` (its gather and the three history kernels it
    inherits from ``HistoryLaunches``)."""
    def launch(g: Any, k: Any, v: Values) -> None:
        plan = DecodeLaunches(
            g, v.ptr("hist"), v.ptr("state"), v.ptr("ctrl"), v.ptr("word_ids"), max_seqs=v.u32("max_seqs"),
            hist_len=v.setdefault("hist_len", 40), vocab=v.u32("vocab"), max_draft=v.u32("max_draft"),
            tables=v.ptr("tables"), pows=v.ptr("pows"), num_tables=v.setdefault("num_tables", 6),
            max_ngram=v.setdefault("max_ngram", 4), splits=v.setdefault("splits", 2), table_dim=v.u32("td"),
            eos=v.u32("eos"))
        if name == "ngram_decode_gather":
            adapters = AdapterTables(*(v.ptr(p) for p in ("adapters", "adapter_maps", "adapter_rows",
                                                          "adapter_counts")), v.u32("num_adapters"),
                                     v.u32("hidden"), v.ptr("word_over"))
            plan.gather(v.ptr("tokens"), v.ptr("cu_seqlens"), v.ptr("slots"), v.ptr("out"), v.u32("rows"),
                        v.u32("num_seqs"), v.u32("per_seq"), 3, adapters)
        elif name == "token_history_seed":
            plan.seed(v.ptr("tokens"), v.ptr("cu_seqlens"), v.ptr("slots"), v.u32("rows"), v.u32("num_seqs"), 3)
            v.update(map=0, text=0, dead=0xFFFFFFFF)  # the n-gram decoder's TokenCode: no map, no mask
        elif name == "token_history_fork":
            plan.fork(v.ptr("src_slots"), v.ptr("dst_slots"), v.u32("num"), 3)
        else:
            plan.rollback(v.ptr("slots"), v.ptr("counts"), v.u32("num_seqs"), 3)
    return launch


LAUNCHERS[("ngram_decode", "ngram_decode_gather")] = _decode("ngram_decode_gather")
for _name in ("token_history_seed", "token_history_fork", "token_history_rollback"):
    LAUNCHERS[("token_history", _name)] = _decode(_name)

def _engram_launches(g: Any, v: Values) -> Any:
    from layers.ops.engram import EngramLaunches
    from layers.ops.token_history import TokenCode

    return EngramLaunches(
        g, v.ptr("hist"), v.ptr("state"), v.ptr("ctrl"), max_seqs=v.u32("max_seqs"),
        hist_len=v.setdefault("hist_len", 5), max_draft=v.u32("max_draft"),
        code=TokenCode(v.ptr("map"), v.u32("vocab"), v.u32("dead")), pad=v.u32("pad"), mult=v.ptr("mult"),
        primes=v.ptr("primes"), offsets=v.ptr("offsets"), tables=v.ptr("tables"), emb=v.ptr("emb"),
        text_out=v.ptr("text_out"), max_rows=v.u32("max_rows"), layers=v.u32("layers"),
        max_ngram=v.setdefault("max_ngram", 4), heads=v.u32("heads"), width=v.setdefault("width", 256),
        stride=v.setdefault("stride", 264))


def _engram_lookup(g: Any, k: Any, v: Values) -> None:
    _engram_launches(g, v).lookup(v.ptr("tokens"), v.ptr("cu_seqlens"), v.ptr("slots"), v.ptr("text"),
                                  v.u32("rows"), v.u32("num_seqs"), v.u32("per_seq"), 3)


def _engram_row_ids(g: Any, k: Any, v: Values) -> None:
    _engram_launches(g, v).row_ids(v.ptr("tokens"), v.ptr("cu_seqlens"), v.ptr("slots"), v.ptr("text"),
                                   v.u32("rows"), v.u32("num_seqs"), v.u32("per_seq"), v.ptr("ids"), v.ptr("gen"), 3)


def _engram_staged_rows(g: Any, k: Any, v: Values) -> None:
    plan = _engram_launches(g, v)
    v["cols"] = (v["max_ngram"] - 1) * v["heads"]
    plan.staged_rows(v.ptr("ids"), v.ptr("staged"), v.ptr("gen"), v.ptr("ready"), v.u32("rows"), v.u32("r0"),
                     v.u32("r1"), v.u32("chunk"), v.u32("staged_layers"), 3)


def _engram_gate(g: Any, k: Any, v: Values) -> None:
    from layers.ops.engram import EngramGate

    gate = EngramGate(g, v.ptr("q"), v.ptr("k"), hc=v.setdefault("hc", 4), dim=v.setdefault("dim", 5120),
                      eps=v.f32("eps"))
    v["kv_stride"] = 5 * 5120
    gate.run(v.ptr("x"), v.ptr("kv"), v.ptr("text"), v.u32("rows"), 3)


LAUNCHERS[("engram", "engram_lookup")] = _engram_lookup
LAUNCHERS[("engram", "engram_row_ids")] = _engram_row_ids
LAUNCHERS[("engram", "engram_staged_rows")] = _engram_staged_rows
LAUNCHERS[("engram", "engram_gate")] = _engram_gate

# gemm.cu's other kernels run a GEMM launcher's plans: by the path each shape and backend picks
GEMM_PATH_KERNELS = {name for name in _sources()["gemm"]} - {"dense_gemm_bf16_pipelined", "dense_gemm_bf16_word"}


def test_every_kernel_has_a_launcher_here():
    kernels = {(module, name) for module, names in _sources().items() for name in names}
    assert kernels - set(LAUNCHERS) == {("gemm", name) for name in GEMM_PATH_KERNELS}
    assert set(LAUNCHERS) <= kernels


@pytest.mark.parametrize("module, name", sorted(LAUNCHERS))
def test_each_kernel_parameter_gets_the_launchers_value_of_its_name(module, name):
    gpu, values = RecordingBackend(), Values()
    LAUNCHERS[(module, name)](gpu, load_kernel(gpu, module, name), values)
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == (module, name) and launch.stream == 3
    signature = _sources()[module][name]
    assert launch.kinds == signature.kinds
    want = [int(values[p.name]) if p.kind != "F" else values[p.name] for p in signature]
    assert launch.args == want, name


@pytest.mark.parametrize("path, name", [("tma", "dense_gemm_bf16_tma"), ("tma_store", "dense_gemm_bf16_tma_store"),
                                        ("tma_store_n128", "dense_gemm_bf16_tma_store_n128"),
                                        ("tma_store_n192", "dense_gemm_bf16_tma_store_n192"),
                                        ("tma_splitk", "dense_gemm_bf16_tma_splitk"),
                                        ("wgmma", "dense_gemm_bf16_wgmma"), ("small", "dense_gemm_bf16_small_m"),
                                        ("tiled", "dense_gemm_bf16_tiled"), ("simt", "dense_gemm_bf16_simt")])
def test_the_gemm_paths_kernels_get_their_operands_by_name(path, name):
    """Each path's kernel gets a, w, c, m, n, k where its signature puts them (after the tensor
    maps of the TMA paths), on a backend that builds maps and compiles for sm_90a."""
    from tests.test_gemm import TmaBackend

    gpu, values = TmaBackend(), Values()
    values.update(a=DevicePtr(0x100000), w=DevicePtr(0x200000), c=DevicePtr(0x300000), m=256, n=512, k=256)
    w = DenseWeight(values["w"], (512, 256), BF16)
    gemm.dense_gemm_bf16_pipelined(gpu, load_kernel(gpu, "gemm", gemm.KERNEL), values["a"], w, values["c"], 256, 512,
                                   256, 3, path=path)
    (launch,) = gpu.launches
    assert gpu.kernel_of(launch) == ("gemm", name)
    signature = _sources()["gemm"][name]
    maps = [p for p in signature if p.kind == "T"]
    assert launch.args[len(maps):] == [int(values[p.name]) for p in signature if p.kind != "T"]


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
_KERNEL_OF = {"embed_rowdiff": "embed_rowdiff_bf16", "embed_overlay_routed": "embed_overlay_routed_bf16",
              "lmhead_overlay_routed": "lmhead_overlay_routed_bf16"}


def test_overlay_launchers_follow_the_seed_position_for_position():
    """Each kernel's parameters (its source) are the seed chain's arguments in the seed's order
    (then the checked routing's two, ``_PAST_THE_SEED``, which default to the seed's behaviour),
    and the launcher puts its positional arguments there."""
    seed = _seed_launches(SEEDS / "ops_token_overlay.rs")
    assert set(seed) == set(_KERNEL_OF)
    for fn_name, chain in seed.items():
        signature = _sources()["token_overlay"][_KERNEL_OF[fn_name]]
        past = _PAST_THE_SEED.get(fn_name, ())
        assert signature.names == (*(expr.strip() for _, expr in chain), *past), fn_name
        fn = getattr(token_overlay, fn_name)
        params = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
        assert params[:2] == ["gpu", "kernel"] and params[-1] == "stream"
        values = {p: (i + 1) * 16 for i, p in enumerate(params[2:-1])}  # distinct per parameter
        gpu = RecordingBackend()
        fn(gpu, load_kernel(gpu, "token_overlay", _KERNEL_OF[fn_name]), *values.values(), 5)
        (launch,) = gpu.launches
        assert launch.kinds == "".join(_KIND[k] for k, _ in chain) + "UP" * bool(past), fn_name
        expected = [values[expr.strip()] for _, expr in chain] + [0, 0] * bool(past)  # the seed's contract
        assert launch.args == expected, fn_name


# -- the mechanism on CudaBackend, over a scripted driver ----------------------------------------
_ADD_SOURCE = ('extern "C" __global__ void add(float* dst, const float* src, float scale, unsigned n) {\n'
               '    if (threadIdx.x < n) dst[threadIdx.x] += scale * src[threadIdx.x];\n}\n')
_ADD = Signature([Param("dst", "P"), Param("src", "P"), Param("scale", "F"), Param("n", "U")])


class _ScriptedDriver:
    """A driver for ``CudaBackend`` without a GPU (its ``call``, and the bindings' parameter
    layout and launch functions): handles from a counter, a parameter layout per kernel, and
    launches recorded with their config and the bytes their arguments point at."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, sizes: list[int], max_shared: int = 227 * 1024) -> None:
        from cuda.bindings import driver as cu

        self.cu, self.sizes, self.max_shared = cu, sizes, max_shared
        self.handles = itertools.count(0x7F00_0000_0000, 1 << 20)
        self.launches: list[tuple] = []
        self.functions: list[object] = []  # cuModuleGetFunction's answers
        self.kernels_given: list[object] = []  # the kernel object each launch handed the driver
        self.opt_ins: list[int] = []  # cuFuncSetAttribute's values
        self.configs: list[object] = []  # the CUlaunchConfig objects launched with
        self.attributes: list[dict[str, Any]] = []  # each launch's attributes (launch_attributes)
        self.layout_queries = 0
        self.fail_with: list[Any] = []  # statuses the next launches return, in turn
        self.context_sets = 0
        scripted_device(monkeypatch, self.call)
        monkeypatch.setattr(cu, "cuFuncGetParamCount", lambda k: (cu.CUresult.CUDA_SUCCESS, len(sizes)),
                            raising=False)
        monkeypatch.setattr(cu, "cuFuncGetParamInfo", self.param_info)
        monkeypatch.setattr(cu, "cuLaunchKernelEx", self.launch_ex)

    def call(self, fn, *args, detail=""):
        name = fn.__name__
        if name == "cuDeviceGetName":
            return b"scripted\0"
        if name == "cuDeviceGetAttribute":
            optin = self.cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
            return self.max_shared if args[0] == optin else 0
        if name == "cuModuleGetFunction":  # the bindings' object, as the driver's answer
            self.functions.append(self.cu.CUfunction(next(self.handles)))
            return self.functions[-1]
        if name in ("cuModuleLoadData", "cuStreamCreate"):
            return next(self.handles)
        if name == "cuFuncGetAttribute":
            return 1024  # static shared memory
        if name == "cuFuncSetAttribute":
            self.opt_ins.append(args[2])
        if name == "cuCtxSetCurrent":
            self.context_sets += 1
        return 0

    def param_info(self, kernel, i):
        self.layout_queries += 1
        layout = ArgLayout(Signature(Param(f"a{j}", {8: "P", 4: "U"}[s]) for j, s in enumerate(self.sizes)))
        return self.cu.CUresult.CUDA_SUCCESS, layout.offsets[i], self.sizes[i]

    def launch_ex(self, config, kernel, params, extra):
        pointers = (ctypes.c_void_p * len(self.sizes)).from_address(params)
        raw = [ctypes.string_at(pointers[i], s) for i, s in enumerate(self.sizes)]
        self.kernels_given.append(kernel)
        self.configs.append(config)
        self.attributes.append(launch_attributes(config))
        grid = (config.gridDimX, config.gridDimY, config.gridDimZ)
        block = (config.blockDimX, config.blockDimY, config.blockDimZ)
        self.launches.append((grid, block, config.sharedMemBytes, int(config.hStream), config.numAttrs, raw))
        return (self.fail_with.pop(0) if self.fail_with else self.cu.CUresult.CUDA_SUCCESS,)


def _scripted_add(monkeypatch, tmp_path, max_shared: int = 227 * 1024):
    """(backend, driver, kernel handle): a CudaBackend on the scripted driver (a device allowing
    ``max_shared`` bytes of shared memory per block) and the ``add`` kernel, compiled for real
    (NVRTC) from a source given by path."""
    monkeypatch.setenv("GPU_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    driver = _ScriptedDriver(monkeypatch, [8, 8, 4, 4], max_shared)
    src = tmp_path / "add.cu"
    src.write_text(_ADD_SOURCE)
    gpu = CudaBackend()
    return gpu, driver, gpu.kernel(src, "add")


@pytest.fixture
def scripted(monkeypatch, tmp_path):
    """``_scripted_add`` on a device allowing 227 KiB of shared memory per block (sm_90's)."""
    return _scripted_add(monkeypatch, tmp_path)


def _packed(dst, src, scale, n):
    return [struct.pack("<Q", dst), struct.pack("<Q", src), struct.pack("<f", scale), struct.pack("<I", n)]


def test_a_bound_kernel_packs_its_arguments_and_is_checked_once(scripted):
    """``bind`` reads the signature from the source and checks it against the driver's layout
    once; each launch packs its arguments where the ``void*[]`` points, and a config's driver
    form is made once per stream."""
    gpu, driver, k = scripted
    kernel = gpu.bind(k)
    assert gpu.bind(k) is kernel and kernel.signature == _ADD and kernel.name == "add.add"
    assert driver.layout_queries == 4 and driver.opt_ins == []
    config = LaunchConfig((2, 3), 64, 100)
    for n in (7, 8):
        kernel.launch(config, 5, DevicePtr(0x1000), 0x2000, 0.25, n)
    kernel.launch(config, 6, 0x1000, 0x2000, 0.25, 9)
    assert [launch[:5] for launch in driver.launches] == [((2, 3, 1), (64, 1, 1), 100, s, 0) for s in (5, 5, 6)]
    assert [launch[5] for launch in driver.launches] == [_packed(0x1000, 0x2000, 0.25, n) for n in (7, 8, 9)]
    assert driver.configs[0] is driver.configs[1] is config.driver[5] and config.driver[6] is driver.configs[2]
    assert driver.layout_queries == 4  # not per launch


def test_a_prepared_launch_packs_once_and_runs_on_any_stream(scripted):
    gpu, driver, k = scripted
    prepared = gpu.bind(k).prepare(LaunchConfig(4, 32, overlap=True), 0x10, 0x20, -1.5, 11)
    assert prepared.args == (0x10, 0x20, -1.5, 11) and prepared.config.overlap
    for stream in (0, 7, 0):
        prepared.run(stream)
    assert [(launch[3], launch[4]) for launch in driver.launches] == [(0, 1), (7, 1), (0, 1)]  # PDL attribute
    assert {tuple(launch[5]) for launch in driver.launches} == {tuple(_packed(0x10, 0x20, -1.5, 11))}


@pytest.mark.parametrize("args, error, message", [
    ((0x10, 0x20, 0.5, 2**32), ValueError, r"^add\.add n must be in 0\.\.2\*\*32-1, got 4294967296$"),
    ((0x10, 0x20, 0.5, 1.5), TypeError, r"^add\.add n must be an int, got float 1\.5$"),
    ((0x10, -1, 0.5, 3), ValueError, r"add\.add src: device pointer out of range: -1"),
    ((None, 0x20, 0.5, 3), TypeError, r"add\.add dst must be an int"),
    ((0x10, 0x20, 1e39, 3), ValueError, r"^add\.add scale: 1e\+39 overflows f32$"),
    ((0x10, 0x20, "x", 3), TypeError, r"add\.add scale must be a real number"),
    ((0x10, 0x20, 0.5), TypeError, r"add\.add takes 4 arguments \(dst: pointer, src: pointer, scale: f32, n: u32\)"),
])
def test_arguments_that_do_not_pack_are_refused_by_name_before_the_driver(scripted, args, error, message):
    gpu, driver, k = scripted
    kernel = gpu.bind(k)
    with pytest.raises(error, match=message):
        kernel.launch(LaunchConfig(1, 32), 0, *args)
    with pytest.raises(error, match=message):
        kernel.prepare(LaunchConfig(1, 32), *args)
    assert driver.launches == []


def test_bind_and_launch_refusals(scripted, tmp_path):
    gpu, driver, k = scripted
    kernel = gpu.bind(k)
    with pytest.raises(ValueError, match="null kernel handle"):
        gpu.bind(KernelHandle(0))
    with pytest.raises(GpuError, match="not loaded by this backend"):
        gpu.bind(KernelHandle(0xDEAD))
    with pytest.raises(TypeError, match="kernel must be a KernelHandle, got str"):
        gpu.bind("add")
    with pytest.raises(TypeError, match="config must be a gpu_runtime.LaunchConfig, got tuple"):
        kernel.launch((1, 32), 0, 1, 2, 0.5, 3)
    for stream, error in ((-1, ValueError), (True, TypeError), ("s", TypeError)):
        with pytest.raises(error, match="add.add: stream must be a stream handle|launch: stream must be"):
            kernel.launch(LaunchConfig(1, 32), stream, 1, 2, 0.5, 3)
    driver.fail_with = [driver.cu.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES]
    with pytest.raises(CudaError, match=r"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: cuLaunchKernelEx \(add\.add "
                                        r"LaunchConfig\(grid=\(1, 1, 1\), block=\(32, 1, 1\)"):
        kernel.launch(LaunchConfig(1, 32), 0, 1, 2, 0.5, 3)
    with pytest.raises(ValueError, match=r"add\.add: 300000 bytes of shared memory, device allows 232448"):
        kernel.launch(LaunchConfig(1, 32, 300000), 0, 1, 2, 0.5, 3)
    kernel.launch(LaunchConfig(1, 32), 0, 1, 2, 0.5, 3)  # still usable
    assert len(driver.launches) == 2


def test_a_kernel_is_opted_in_to_the_shared_memory_a_launch_asks_for_only_up(scripted):
    """Past 48 KiB of dynamic shared memory a kernel is opted in, once, to what the launch (or
    prepared launch) asks; a smaller launch after a larger one leaves the opt-in where it is,
    and so do two threads asking for different sizes at once."""
    gpu, driver, k = scripted
    kernel = gpu.bind(k)
    for shared in (48 * 1024, 64 * 1024, 50 * 1024, 64 * 1024):
        kernel.launch(LaunchConfig(1, 32, shared), 0, 1, 2, 0.5, 3)
    kernel.prepare(LaunchConfig(1, 32, 80 * 1024), 1, 2, 0.5, 3)
    assert driver.opt_ins == [64 * 1024, 80 * 1024]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda s: kernel.launch(LaunchConfig(1, 32, s), 0, 1, 2, 0.5, 3), (100_000, 90_000)))
    assert driver.opt_ins[-1] == 100_000 and sorted(driver.opt_ins) == driver.opt_ins


def test_a_launch_may_ask_for_exactly_the_devices_shared_memory_opt_in_maximum(monkeypatch, tmp_path, rng):
    """The device's opt-in maximum (a random one) is granted, to a launch and to a prepared one;
    one byte more is refused by both, before the driver is asked to opt in or launch."""
    most = int(rng.integers(48 * 1024 + 1, 256 * 1024))
    gpu, driver, k = _scripted_add(monkeypatch, tmp_path, most)
    kernel = gpu.bind(k)
    refused = rf"add\.add: {most + 1} bytes of shared memory, device allows {most}$"
    with pytest.raises(ValueError, match=refused):
        kernel.launch(LaunchConfig(1, 32, most + 1), 0, 1, 2, 0.5, 3)
    with pytest.raises(ValueError, match=refused):
        kernel.prepare(LaunchConfig(1, 32, most + 1), 1, 2, 0.5, 3)
    assert driver.opt_ins == [] and driver.launches == []
    kernel.launch(LaunchConfig(1, 32, most), 0, 1, 2, 0.5, 3)
    kernel.prepare(LaunchConfig(2, 32, most), 1, 2, 0.5, 3).run(0)
    assert driver.opt_ins == [most] and [launch[2] for launch in driver.launches] == [most, most]


def test_a_cluster_launch_with_overlap_hands_the_driver_both_attributes(scripted, monkeypatch):
    """A config with a cluster and ``overlap=True`` reaches the driver with both attributes
    (each launch path), not one of them; either alone gives that one."""
    from gpu_runtime.cuda_backend import launch as cuda_launch

    monkeypatch.setattr(cuda_launch, "OVERLAP", True)  # whatever GPU_RUNTIME_OVERLAP said at import
    gpu, driver, k = scripted
    kernel = gpu.bind(k)
    kernel.launch(LaunchConfig((4, 2), 32, cluster=(2, 1), overlap=True), 0, 1, 2, 0.5, 3)
    kernel.prepare(LaunchConfig(6, 32, cluster=3, overlap=True), 1, 2, 0.5, 3).run(0)
    kernel.launch(LaunchConfig(4, 32, cluster=4), 0, 1, 2, 0.5, 3)
    kernel.launch(LaunchConfig(4, 32, overlap=True), 0, 1, 2, 0.5, 3)
    kernel.launch(LaunchConfig(4, 32), 0, 1, 2, 0.5, 3)
    assert driver.attributes == [
        {"overlap": 1, "cluster": (2, 1, 1)},
        {"overlap": 1, "cluster": (3, 1, 1)},
        {"cluster": (4, 1, 1)},
        {"overlap": 1},
        {},
    ]
    assert [launch[4] for launch in driver.launches] == [2, 2, 1, 1, 0]  # numAttrs


def test_a_source_signature_the_driver_disagrees_with_is_refused_at_bind(monkeypatch, tmp_path):
    """The source says (float*, float*, float, unsigned); a driver that reports a u64 third
    parameter refuses the kernel when it is bound, before any launch."""
    monkeypatch.setenv("GPU_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    driver = _ScriptedDriver(monkeypatch, [8, 8, 8, 4])
    src = tmp_path / "add.cu"
    src.write_text(_ADD_SOURCE)
    gpu = CudaBackend()
    k = gpu.kernel(src, "add")
    with pytest.raises(TypeError, match=r"add\.add: argument 2 is 8 bytes at offset 16, launch packs 4"):
        gpu.bind(k)
    with pytest.raises(TypeError, match=r"add\.add: argument 2"):
        KernelLaunch(gpu, k).arg_ptr(1).arg_ptr(2).arg_f32(0.5).arg_u32(3).launch(0)
    assert driver.launches == []


def test_threads_each_pack_into_their_own_buffer_and_closing_refuses(scripted):
    """Launches from several threads at once land with their own arguments (each thread packs
    into its own buffer; one thread's launch between another's pack and its driver call cannot
    change it); a closed backend's kernels and prepared launches refuse."""
    gpu, driver, k = scripted
    kernel = gpu.bind(k)
    config = LaunchConfig(1, 32)
    barrier = threading.Barrier(4)

    def other_thread(n: int) -> None:
        barrier.wait()
        for _ in range(200):
            kernel.launch(config, 0, 1, 2, 1.0, n)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(other_thread, (10, 20, 30, 40)))  # re-raises what a thread raised
    assert len(driver.launches) == 800
    counts = {n: sum(launch[5][3] == struct.pack("<I", n) for launch in driver.launches) for n in (10, 20, 30, 40)}
    assert counts == {10: 200, 20: 200, 30: 200, 40: 200}
    assert all(launch[5][:3] == _packed(1, 2, 1.0, 0)[:3] for launch in driver.launches)
    prepared = kernel.prepare(config, 1, 2, 1.0, 3)
    gpu.close()
    for launch in (lambda: kernel.launch(config, 0, 1, 2, 1.0, 3), lambda: prepared.run(0),
                   lambda: kernel.prepare(config, 1, 2, 1.0, 3), lambda: gpu.bind(k),
                   lambda: KernelLaunch(gpu, k).arg_ptr(1).arg_ptr(2).arg_f32(1.0).arg_u32(3).launch(0)):
        with pytest.raises(ClosedError, match="the backend is closed"):
            launch()
    assert len(driver.launches) == 800


def test_a_launch_on_a_thread_where_another_context_is_current_is_retried_once_bound(scripted):
    """The driver refuses a launch whose context is not current (a thread that last used another
    backend): the launch makes its context current and goes again, once."""
    gpu, driver, k = scripted
    prepared = gpu.bind(k).prepare(LaunchConfig(1, 32), 1, 2, 1.0, 3)
    from gpu_runtime.cuda_backend import context

    context._CURRENT.ctx = object()  # as if another backend's context were current here
    before = driver.context_sets
    driver.fail_with = [driver.cu.CUresult.CUDA_ERROR_INVALID_CONTEXT]
    prepared.run(0)
    assert len(driver.launches) == 2 and driver.context_sets == before + 1


def test_every_launch_hands_the_driver_its_function_object(scripted):
    """``Kernel.launch``, a prepared launch and the builder all give the driver the
    ``CUfunction`` that ``cuModuleGetFunction`` returned (which the bindings need not convert),
    not the ``KernelHandle`` int."""
    gpu, driver, k = scripted
    kernel = gpu.bind(k)
    kernel.launch(LaunchConfig(1, 32), 0, 1, 2, 0.5, 3)
    kernel.prepare(LaunchConfig(1, 32), 1, 2, 0.5, 3).run(0)
    KernelLaunch(gpu, k).arg_ptr(1).arg_ptr(2).arg_f32(0.5).arg_u32(3).launch(0, overlap=True)
    (function,) = driver.functions
    assert int(function) == int(k) and len(driver.kernels_given) == 3
    assert all(given is function for given in driver.kernels_given)
    assert driver.launches[2][4] == 1  # the builder's overlap: the PDL attribute


def test_a_source_whose_signature_is_refused_loads_nothing(monkeypatch, tmp_path):
    """A kernel parameter the runtime cannot pack is refused before the module is compiled or
    loaded, at every ask."""
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
