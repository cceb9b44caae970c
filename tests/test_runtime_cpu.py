"""Runtime checks that need no GPU: argument building and packing, signatures, NVRTC and its cache."""

from __future__ import annotations

import ctypes
import operator
import os
import re
import struct
import traceback
from pathlib import Path

import numpy as np
import pytest
from cuda.bindings import driver as cu_driver

from gpu_runtime import (ClosedError, CudaBackend, CudaError, DeviceBuffer, DeviceCopies, DevicePtr, Events,
                         GpuBackend, GpuError, Graphs, KernelHandle, KernelLaunch, LaunchConfig, MappedHostMemory,
                         NoDeviceError, NvrtcError, PinnedHostMemory, PitchedCopies, TensorMaps,
                         compiler, device_count, validate)
from gpu_runtime.launch import ArgLayout
from gpu_runtime.signatures import Param, Signature, parse_signatures
from layers.kernel_files import kernel_dir, kernel_files, kernel_path, load_kernel
from layers.kernel_files import try_kernel
from tests.helpers.fakes import MemoryBackend, RecordingBackend

KERNEL_FILES = sorted(kernel_dir().glob("*.cu"))
# the test kernels of the fake backends (module "m"): their signatures, no bodies
SOURCES = {"m": 'extern "C" __global__ void k(float* p, unsigned u, int i, float f, unsigned long long l) {}\n'
                'extern "C" __global__ void one(unsigned u) {}\n'
                'extern "C" __global__ void ptr(float* p) {}\n'
                'extern "C" __global__ void wide(unsigned a, unsigned b, int c, int d, unsigned long long e, '
                'float f, float g) {}\n'}


# -- KernelLaunch ---------------------------------------------------------------------------
def test_launch_records_kinds_values_and_shape():
    gpu = RecordingBackend(sources=SOURCES)
    k = gpu.kernel("m", "k")
    (KernelLaunch(gpu, k).grid([3, 2, 1]).block([128, 1, 1]).shared_mem(1024)
     .arg_ptr(DevicePtr(0x1000)).arg_u32(np.uint32(7)).arg_i32(-5).arg_f32(0.5).arg_u64(2**63)
     .launch(17))
    (launch,) = gpu.launches
    assert (launch.grid, launch.block, launch.shared_mem, launch.stream) == ((3, 2, 1), (128, 1, 1), 1024, 17)
    assert launch.kinds == "PUIFL"
    assert launch.args == [0x1000, 7, -5, 0.5, 2**63]


@pytest.mark.parametrize("build, error, match", [
    (lambda L: L.arg_u32(-1), ValueError, "-1 does not fit u32"),
    (lambda L: L.arg_u32(2**32), ValueError, "4294967296 does not fit u32"),
    (lambda L: L.arg_u32(1.0), TypeError, "u32 argument must be an int, got float"),
    (lambda L: L.arg_u32(True), TypeError, "got bool"),
    (lambda L: L.arg_u32("3"), TypeError, "got str"),
    (lambda L: L.arg_i32(2**31), ValueError, "does not fit i32"),
    (lambda L: L.arg_i32(-(2**31) - 1), ValueError, "does not fit i32"),
    (lambda L: L.arg_u64(2**64), ValueError, "does not fit u64"),
    (lambda L: L.arg_u64(-1), ValueError, "does not fit u64"),
    (lambda L: L.arg_ptr(-1), ValueError, "does not fit pointer"),
    (lambda L: L.arg_ptr(1.5), TypeError, "pointer argument must be an int"),
    (lambda L: L.arg_f32("x"), TypeError, "f32 needs a real number"),
    (lambda L: L.arg_f32(1e39), ValueError, "overflows f32"),
    (lambda L: L.grid([0, 1, 1]), ValueError, "each dimension must be in"),
    (lambda L: L.grid([1, 65536, 1]), ValueError, "each dimension must be in"),
    (lambda L: L.grid([2**31, 1, 1]), ValueError, "each dimension must be in"),
    (lambda L: L.grid([1, 1]), ValueError, "must have 3 dimensions"),
    (lambda L: L.block([1025, 1, 1]), ValueError, "each dimension must be in"),
    (lambda L: L.block([32, 32, 2]), ValueError, "more than 1024 threads"),
    (lambda L: L.block([1, 1, 65]), ValueError, "each dimension must be in"),
    (lambda L: L.block([0, 1, 1]), ValueError, "each dimension must be in"),
    (lambda L: L.shared_mem(-1), ValueError, "shared_mem must be in"),
])
def test_launch_refuses_bad_values(build, error, match):
    gpu = RecordingBackend(sources=SOURCES)
    with pytest.raises(error, match=match):
        build(KernelLaunch(gpu, gpu.kernel("m", "k")))
    assert gpu.launches == []


def test_launch_refuses_null_kernel():
    with pytest.raises(ValueError, match="null kernel"):
        KernelLaunch(RecordingBackend(), KernelHandle(0))
    with pytest.raises(ValueError, match="null kernel"):
        KernelLaunch.new(RecordingBackend(), KernelHandle(0))
    gpu = RecordingBackend(sources=SOURCES)
    kernel = gpu.kernel("m", "one")
    KernelLaunch.new(gpu, kernel).grid([2, 1, 1]).block([32, 1, 1]).arg_u32(7).launch(0)
    (launch,) = gpu.launches
    assert (launch.kernel, launch.grid, launch.block, launch.args) == (kernel, (2, 1, 1), (32, 1, 1), [7])


def test_extreme_values_accepted():
    gpu = RecordingBackend(sources=SOURCES)
    (KernelLaunch(gpu, gpu.kernel("m", "wide")).grid([2**31 - 1, 65535, 65535]).block([1024, 1, 1])
     .arg_u32(0).arg_u32(2**32 - 1).arg_i32(-(2**31)).arg_i32(2**31 - 1).arg_u64(2**64 - 1)
     .arg_f32(float("inf")).arg_f32(float("nan")).launch(0))
    assert gpu.launches[0].kinds == "UUIILFF"


def test_launch_refuses_kinds_the_signature_does_not_have():
    gpu = RecordingBackend(sources=SOURCES)
    k = gpu.kernel("m", "k")
    with pytest.raises(TypeError, match=r"m\.k: takes 5 arguments \(PUIFL\), 2 given \(PU\)"):
        KernelLaunch(gpu, k).arg_ptr(1).arg_u32(2).launch(0)
    with pytest.raises(TypeError, match="argument 2 must be i32, launch passes u32"):
        KernelLaunch(gpu, k).arg_ptr(1).arg_u32(2).arg_u32(3).arg_f32(4.0).arg_u64(5).launch(0)
    assert gpu.launches == []


# -- LaunchConfig ---------------------------------------------------------------------------
def test_launch_config_normalises_and_is_immutable():
    config = LaunchConfig(5, 256)
    assert (config.grid, config.block, config.shared_mem, config.cluster, config.overlap) == (
        (5, 1, 1), (256, 1, 1), 0, None, False)
    config = LaunchConfig((4, np.int64(2)), [32, 4, 2], 1024, cluster=(2, 1), overlap=True)
    assert (config.grid, config.block, config.shared_mem, config.cluster, config.overlap) == (
        (4, 2, 1), (32, 4, 2), 1024, (2, 1, 1), True)
    assert all(type(d) is int for d in (*config.grid, *config.block))
    assert repr(config) == "LaunchConfig(grid=(4, 2, 1), block=(32, 4, 2), shared_mem=1024, cluster=(2, 1, 1), overlap=True)"
    with pytest.raises(AttributeError, match="immutable"):
        config.grid = (1, 1, 1)  # type: ignore[misc]


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((0, 32), {}, ValueError, r"grid \[0, 1, 1\]: each dimension must be in 1\.\."),
    (((1, 65536), 32), {}, ValueError, "each dimension must be in"),
    ((2**31, 32), {}, ValueError, "each dimension must be in"),
    (((1, 1, 1, 1), 32), {}, ValueError, "grid must have 1 to 3 dimensions"),
    ((1, 1025), {}, ValueError, "block"),
    ((1, (32, 32, 2)), {}, ValueError, "more than 1024 threads"),
    ((1, (1, 1, 65)), {}, ValueError, "each dimension must be in"),
    ((1.5, 32), {}, TypeError, "grid must be an int, got float"),
    (((1.5,), 32), {}, TypeError, "grid must be an int, got float"),
    ((True, 32), {}, TypeError, "got bool"),
    ((1, 32, -1), {}, ValueError, "shared_mem must be in 0"),
    ((1, 32, 2**32), {}, ValueError, "shared_mem must be in 0"),
    ((3, 32), {"cluster": 2}, ValueError, r"grid \[3, 1, 1\] is not whole clusters of \[2, 1, 1\]"),
    ((4, 32), {"cluster": 16}, ValueError, "cluster"),
    ((4, 32), {"overlap": 1}, TypeError, "overlap must be a bool"),
])
def test_launch_config_refuses_by_the_one_policy(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        LaunchConfig(*args, **kwargs)


# -- packing to the C ABI -------------------------------------------------------------------
def _layout(kinds: str) -> ArgLayout:
    return ArgLayout(Signature(Param(f"a{i}", k) for i, k in enumerate(kinds)))


@pytest.mark.parametrize("kinds, offsets, size", [
    ("PPPUU", [0, 8, 16, 24, 28], 32),
    ("PUIFL", [0, 8, 12, 16, 24], 32),
    ("UPU", [0, 8, 16], 20),
    ("PPFU", [0, 8, 16, 20], 24),
    ("PPIPPPPUU", [0, 8, 16, 24, 32, 40, 48, 56, 60], 64),
    ("ULUL", [0, 8, 16, 24], 32),
    ("TTPPPUUU", [0, 128, 256, 264, 272, 280, 284, 288], 292),  # tensor maps: 128 bytes, 64-aligned
    ("UT", [0, 64], 192),
    ("PTUT", [0, 64, 192, 256], 384),
])
def test_arg_layout_matches_c_abi_offsets(kinds, offsets, size):
    layout = _layout(kinds)
    assert layout.offsets == offsets
    assert layout.packer.size == size
    assert layout.sizes == [{"P": 8, "U": 4, "I": 4, "F": 4, "L": 8, "T": 128}[k] for k in kinds]


def test_arg_layout_packs_bytes_where_its_pointers_point():
    layout = _layout("PUIFLT")
    buffer, params, pointers = layout.buffers()
    assert params == ctypes.addressof(pointers)
    tmap = bytes(range(128))
    values = [0x1122334455667788, 0xDEADBEEF, -2, 1.25, 2**64 - 3, tmap]
    layout.packer.pack_into(buffer, 0, *values)
    raw = [ctypes.string_at(pointers[i], s) for i, s in enumerate(layout.sizes)]
    assert raw == [struct.pack("<Q", values[0]), struct.pack("<I", values[1]),
                   struct.pack("<i", values[2]), struct.pack("<f", values[3]),
                   struct.pack("<Q", values[4]), tmap]


@pytest.mark.parametrize("index, value, error, match", [
    (0, -1, ValueError, "out of range"),
    (0, 1.5, TypeError, "k a0 must be an int, got float"),
    (0, None, TypeError, "k a0 must be an int"),
    (0, np.zeros(2), TypeError, "k a0 must be an int"),
    (1, 2**32, ValueError, r"k a1 must be in 0\.\.2\*\*32-1"),
    (1, -1, ValueError, r"k a1 must be in 0\.\.2\*\*32-1"),
    (1, "3", TypeError, "k a1 must be an int"),
    (2, 2**31, ValueError, r"k a2 must be in -2\*\*31\.\.2\*\*31-1"),
    (3, 1e39, ValueError, r"k a3: 1e\+39 overflows f32"),
    (3, "x", TypeError, "k a3 must be a real number"),
    (4, 2**64, ValueError, r"k a4 must be in 0\.\.2\*\*64-1"),
    (5, bytes(127), TypeError, "k a5 must be a tensor map's 128 bytes"),
])
def test_arg_layout_refusals_name_kernel_and_parameter(index, value, error, match):
    layout = _layout("PUIFLT")
    args = [16, 3, -1, 0.5, 7, bytes(128)]
    args[index] = value
    with pytest.raises(error, match=match):
        try:
            layout.packer.pack(*args)
        except (struct.error, TypeError, ValueError, OverflowError):
            raise layout.refusal("k", args) from None
        if index == 5:  # struct pads a short tensor map: the refusal is what finds it
            raise layout.refusal("k", args)
    assert isinstance(layout.refusal("k", args[:2]), TypeError)
    assert "takes 6 arguments" in str(layout.refusal("k", args[:2]))


# -- the validation policy ------------------------------------------------------------------
@pytest.mark.parametrize("check, value, out", [
    (validate.integer, np.int64(-3), -3),
    (validate.count, 0, 0),
    (lambda v, w: validate.count(v, w, limit=10), np.uint8(9), 9),
    (validate.positive, 1, 1),
    (validate.u32, 2**32 - 1, 2**32 - 1),
    (lambda v, w: validate.pointer(v, w, nullable=True), 0, 0),
    (validate.pointer, DevicePtr(0x1000), DevicePtr(0x1000)),  # an int subclass stays itself
    (validate.real32, np.float32(0.5), 0.5),
    (validate.real32, -3, -3.0),
    (validate.boolean, False, False),
])
def test_validate_returns_the_normalised_value(check, value, out):
    got = check(value, "x")
    assert got == out and type(got) is type(out)


@pytest.mark.parametrize("check, value, error, message", [
    (validate.integer, True, TypeError, "x must be an int, got bool True"),
    (validate.integer, np.True_, TypeError, "x must be an int"),
    (validate.integer, 1.0, TypeError, "x must be an int, got float 1.0"),
    (validate.integer, "3", TypeError, "x must be an int"),
    (validate.count, -1, ValueError, "x must be a non-negative int, got -1"),
    (lambda v, w: validate.count(v, w, limit=256), 256, ValueError, r"x must be in 0\.\.255, got 256"),
    (validate.positive, 0, ValueError, "x must be an int >= 1, got 0"),
    (lambda v, w: validate.positive(v, w, limit=8), 8, ValueError, r"x must be in 1\.\.7"),
    (validate.u32, 2**32, ValueError, r"x must be in 0\.\.2\*\*32-1, got 4294967296"),
    (validate.u32, 1.5, TypeError, "must be an int"),
    (validate.pointer, 0, ValueError, "x: null device pointer"),
    (validate.pointer, 2**64, ValueError, "out of range"),
    (validate.pointer, -1, ValueError, "out of range"),
    (validate.pointer, 1.0, TypeError, "must be an int"),
    (validate.real32, "x", TypeError, "x must be a real number"),
    (validate.real32, True, TypeError, "real number"),
    (validate.real32, float("nan"), ValueError, "finite and fit an f32"),
    (validate.real32, 1e39, ValueError, "fit an f32"),
    (validate.boolean, 1, TypeError, "x must be a bool, got 1"),
])
def test_validate_refuses_by_the_one_policy(check, value, error, message):
    with pytest.raises(error, match=message):
        check(value, "x")


def test_require_open_raises_closed_error_a_gpu_error():
    validate.require_open(False, "thing")
    with pytest.raises(ClosedError, match="^thing is closed$") as info:
        validate.require_open(True, "thing")
    assert isinstance(info.value, GpuError)


# -- DeviceBuffer ---------------------------------------------------------------------------
def test_device_buffer_is_a_pointer_until_closed_then_refuses():
    gpu = MemoryBackend("m", ["ptr"], sources=SOURCES)
    buf = DeviceBuffer(gpu, 100)
    assert isinstance(buf.ptr, DevicePtr) and buf.nbytes == 100 and not buf.closed and buf.gpu is gpu
    assert int(buf) == buf.ptr == operator.index(buf) and int(buf.ptr) in gpu.mem
    gpu.memset(buf, 7, 100)  # taken wherever a pointer int is
    assert (gpu.read(buf.ptr, 100) == 7).all()
    KernelLaunch(gpu, gpu.kernel("m", "ptr")).arg_ptr(buf).launch(0)
    assert gpu.launches[-1]["args"] == [int(buf.ptr)]
    ptr = buf.ptr
    buf.close()
    buf.close()  # idempotent: freed once
    assert buf.closed and int(ptr) not in gpu.mem and "closed" in repr(buf)
    k = gpu.kernel("m", "ptr")
    for use in (lambda: buf.ptr, lambda: int(buf), lambda: KernelLaunch(gpu, k).arg_ptr(buf)):
        with pytest.raises(ClosedError, match="DeviceBuffer is closed"):
            use()


def test_device_buffer_close_on_a_stream_waits_for_it_then_frees():
    gpu = RecordingBackend()
    with DeviceBuffer(gpu, 64) as buf:
        ptr = buf.ptr
        buf.close(stream=5)
    assert gpu.ops[-2:] == [("sync", 5), ("free", ptr)]
    assert [op for op in gpu.ops if op[0] == "free"] == [("free", ptr)]  # leaving the block: no second free


def test_device_buffer_with_block_and_closed_backend():
    gpu = RecordingBackend()
    with DeviceBuffer(gpu, 64) as buf:
        ptr = buf.ptr
    assert buf.closed and gpu.ops[-1] == ("free", ptr)
    late = DeviceBuffer(gpu, 64)
    gpu.closed = True  # the backend freed everything itself
    late.close()
    assert late.closed and gpu.ops[-1][0] == "alloc"  # no free of its own


def test_device_buffer_upload_and_refusals():
    gpu = MemoryBackend("m", [])
    host = np.arange(10, dtype=np.float32)
    with DeviceBuffer.upload(gpu, host) as buf:
        assert buf.nbytes == 40
        np.testing.assert_array_equal(gpu.read_as(buf.ptr, 10, np.float32), host)
    assert gpu.mem == {}
    with pytest.raises(ValueError, match="DeviceBuffer size must be an int >= 1"):
        DeviceBuffer(gpu, 0)
    with pytest.raises(TypeError, match="DeviceBuffer size must be an int"):
        DeviceBuffer(gpu, 1.5)
    with pytest.raises(ValueError, match="C-contiguous"):
        DeviceBuffer.upload(gpu, host[::2])

    class FailingUpload(MemoryBackend):
        def copy_h2d_async(self, host, dst, stream=0):
            raise RuntimeError("upload failed")

    failing = FailingUpload("m", [])
    with pytest.raises(RuntimeError, match="upload failed"):
        DeviceBuffer.upload(failing, host)
    assert failing.mem == {}  # freed on the way out


# -- value types ----------------------------------------------------------------------------
def test_device_ptr_and_kernel_handle_are_ints():
    p = DevicePtr(0x1000)
    assert p == 0x1000 and isinstance(p, int) and repr(p) == "DevicePtr(0x1000)"
    assert p.offset(16) == 0x1010
    assert not DevicePtr(0) and not KernelHandle(0)
    with pytest.raises(ValueError):
        DevicePtr(-1)
    with pytest.raises(ValueError):
        DevicePtr(0).offset(4)


def test_capabilities_by_inheritance_or_by_methods():
    capabilities = (PinnedHostMemory, MappedHostMemory, Events, Graphs, PitchedCopies, DeviceCopies,
                    TensorMaps)
    assert all(issubclass(CudaBackend, c) for c in capabilities) and issubclass(CudaBackend, GpuBackend)
    recording = RecordingBackend()
    assert [isinstance(recording, c) for c in capabilities] == [True, True, True, False, True, False,
                                                                False]

    class WithGraphs(MemoryBackend):  # declares nothing, defines every Graphs method
        def begin_capture(self, stream): ...
        def end_capture(self, stream): ...
        def abort_capture(self, stream): ...
        def launch_graph(self, graph, stream): ...
        def destroy_graph(self, graph): ...

    assert isinstance(WithGraphs("m", []), Graphs) and not isinstance(MemoryBackend("m", []), Graphs)
    assert not recording.closed


def test_kernel_source_is_a_path_and_the_layers_find_theirs():
    assert kernel_path("gemm") == kernel_dir() / "gemm.cu" and kernel_path("gemm").is_file()
    assert kernel_files() == sorted(kernel_dir().glob("*.cu")) and kernel_path("gemm") in kernel_files()
    gpu = RecordingBackend()
    assert gpu.kernel(kernel_dir() / "gemm.cu", "k") == load_kernel(gpu, "gemm", "k")


def test_try_kernel_gives_zero_for_missing_kernels_only():
    gpu = RecordingBackend(missing={("token_overlay", "*")})
    assert try_kernel(gpu, "token_overlay", "embed_rowdiff_bf16") == KernelHandle(0)
    assert try_kernel(gpu, "gemm", "x") != 0


def test_cuda_error_names_the_result():
    err = CudaError(1, "cuMemAlloc", "64 bytes")
    assert str(err) == "CUDA_ERROR_INVALID_VALUE: cuMemAlloc (64 bytes)"
    assert CudaError(2, "cuMemAlloc").name == "CUDA_ERROR_OUT_OF_MEMORY"


def _printed(err: BaseException) -> str:
    return "".join(traceback.format_exception(err))


def _one_exception(text: str) -> bool:
    """A printed traceback of a single exception: nothing chained before it."""
    return (text.count("Traceback (most recent call last)") == 1
            and "direct cause" not in text and "During handling" not in text)


@pytest.mark.skipif(device_count() > 0, reason="needs a machine without a usable CUDA device")
def test_no_device_is_one_no_device_error_with_its_cause():
    """CudaBackend() where there is no driver (or no device): NoDeviceError, printed without the
    loader's chained traceback, and the exception that showed it kept in ``cause``."""
    with pytest.raises(NoDeviceError) as info:
        CudaBackend()
    err = info.value
    assert err.__cause__ is None and _one_exception(_printed(err)), _printed(err)
    msg = str(err)
    if msg.startswith(("no CUDA driver: ", "CUDA driver present but unusable: ")):
        assert isinstance(err.cause, Exception) and msg.endswith(str(err.cause))
        assert err.__suppress_context__ and err.__context__ is err.cause
        assert isinstance(err.cause, CudaError) == msg.startswith("CUDA driver present")
    else:  # a driver but no device: nothing underneath
        assert msg == "CUDA device 0 requested, 0 present" and err.cause is None


def test_unusable_driver_keeps_the_cuda_error(monkeypatch):
    """cuInit failing (here CUDA_ERROR_NO_DEVICE, faked) gives NoDeviceError whose ``cause`` is
    the CudaError, inspectable, and not chained into the printed traceback."""
    from cuda.bindings import driver as cu

    from gpu_runtime import driver

    def cuInit(flags):  # noqa: N802 - the name CudaError reports
        return (cu.CUresult.CUDA_ERROR_NO_DEVICE,)

    monkeypatch.setattr(cu, "cuInit", cuInit)
    monkeypatch.setattr(driver, "_initialised", False)
    with pytest.raises(NoDeviceError) as info:
        CudaBackend()
    err = info.value
    assert str(err) == "CUDA driver present but unusable: CUDA_ERROR_NO_DEVICE: cuInit"
    assert isinstance(err.cause, CudaError)
    assert (err.cause.name, err.cause.call) == ("CUDA_ERROR_NO_DEVICE", "cuInit")
    assert err.cause.result == int(cu.CUresult.CUDA_ERROR_NO_DEVICE)
    assert err.__cause__ is None and _one_exception(_printed(err)), _printed(err)
    assert device_count() == 0  # the same failure, seen as no device


# -- signatures -----------------------------------------------------------------------------
def test_parse_signatures_kinds():
    src = '''
    // extern "C" __global__ void commented_out(int x)
    extern "C" __global__ void __launch_bounds__(256) a(const bf16* __restrict__ x, uint32_t n,
        int32_t s, float f, uint64_t big, const int32_t* const* tab) {}
    extern "C" __global__ void b() {}
    '''
    assert {k: sig.kinds for k, sig in parse_signatures(src).items()} == {"a": "PUIFLP", "b": ""}


# Kernels behind comments as the compiler sees them: one in a /* */ block, one in a // comment
# a backslash continues; a comment in a parameter list; comment marks inside string literals.
_COMMENTED = r'''
/* kept for reference:
extern "C" __global__ void old_kernel(float* x, int n) {}
*/
extern "C" __global__ void scale(float* x /* , float* y: dropped */, float s, // the factor
                                 unsigned n /* count */) { if (threadIdx.x < n) x[threadIdx.x] *= s; }
// a comment that a backslash continues \
extern "C" __global__ void spliced(int x) {}
extern "C" __global__ void tagged(char* out) { out[1] = '"'; const char* t = "/* not a comment"; out[0] = t[0]; }
extern "C" __global__ void after(int a, int b) { const char* t = "*/ //"; (void)t; (void)a; (void)b; }
extern "C" __global__ void also(float* /**/ p) {}
'''


def test_signatures_are_what_the_compiler_sees_through_comments(tmp_path):
    """A commented-out kernel is not a kernel and a comment in a parameter list is not a
    parameter: the kernels and parameter counts are the PTX entries NVRTC makes of the source."""
    (tmp_path / "commented.cu").write_text(_COMMENTED)
    ptx = compiler.compile_module(tmp_path / "commented.cu", "compute_90", use_cache=False).image.decode()
    entries = {name: params.count("_param_") for name, params in re.findall(r"\.entry (\w+)\(([^)]*)\)", ptx)}
    signatures = parse_signatures(_COMMENTED)
    assert {name: len(sig) for name, sig in signatures.items()} == entries
    assert {name: sig.names for name, sig in signatures.items()} == {
        "scale": ("x", "s", "n"), "tagged": ("out",), "after": ("a", "b"), "also": ("p",)}


def test_signatures_keep_parameter_names():
    src = 'extern "C" __global__ void k(const bf16* __restrict__ x, int32_t *off, uint32_t n) {}'
    (sig,) = parse_signatures(src).values()
    assert sig == Signature([Param("x", "P"), Param("off", "P"), Param("n", "U")])
    assert sig.names == ("x", "off", "n") and sig.kinds == "PPU"
    assert sig != "PPU"  # a signature is its parameters, not its kinds string


def test_every_kernel_module_declares_kernels():
    for path in KERNEL_FILES:
        assert parse_signatures(path.read_text()), f"{path.name} declares no extern C kernels"


# -- NVRTC and the cache --------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GPU_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("target", ["compute_90", "sm_90a"])
@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.stem)
def test_every_module_compiles_without_warnings(path, target, cache):
    out = compiler.compile_module(path, target)
    assert out.log == "", out.log
    assert ord(b" ") == 32, "NVRTC wrote into an immutable (shared) bytes object"
    assert len(out.image) > 0
    if target.startswith("compute"):
        text = out.image.decode(errors="replace")
        for name in parse_signatures(path.read_text()):
            assert f".entry {name}(" in text


def _module(tmp_path: Path, body: str, header: str = "#define ADD 1\n") -> Path:
    (tmp_path / "helper.cuh").write_text(header)
    src = tmp_path / "tiny.cu"
    src.write_text('#include "helper.cuh"\n' + body)
    return src


_BODY = 'extern "C" __global__ void k(float* x) { x[0] += ADD; }\n'


def test_cache_hit_then_corrupt_entry_rebuilt(tmp_path, cache):
    src = _module(tmp_path, _BODY)
    first = compiler.compile_module(src, "compute_90")
    assert not first.cached
    again = compiler.compile_module(src, "compute_90")
    assert again.cached and again.image == first.image
    (entry,) = cache.glob("tiny-*.bin")
    for damage in (lambda b: b[: len(b) // 2], lambda b: b[:-1] + bytes([b[-1] ^ 1]), lambda b: b""):
        entry.write_bytes(damage(entry.read_bytes()))
        rebuilt = compiler.compile_module(src, "compute_90")
        assert not rebuilt.cached and rebuilt.image == first.image
        assert compiler.compile_module(src, "compute_90").cached


def test_cache_key_follows_source_header_options_version(tmp_path, cache):
    src = _module(tmp_path, _BODY)
    headers = compiler._headers(src.read_text(), tmp_path)
    assert [name for name, _ in headers][:1] == ["helper.cuh"]
    base = compiler.cache_key(src.read_bytes(), headers, "sm_90a", ("-O3",), (13, 0))
    variants = [
        compiler.cache_key(src.read_bytes() + b" ", headers, "sm_90a", ("-O3",), (13, 0)),
        compiler.cache_key(src.read_bytes(), [("helper.cuh", b"#define ADD 2\n")], "sm_90a", ("-O3",), (13, 0)),
        compiler.cache_key(src.read_bytes(), headers, "sm_90a", ("-O2",), (13, 0)),
        compiler.cache_key(src.read_bytes(), headers, "sm_90a", ("-O3",), (13, 1)),
        compiler.cache_key(src.read_bytes(), headers, "sm_100a", ("-O3",), (13, 0)),
    ]
    assert len({base, *variants}) == 6
    # A header change alone gives a new entry, not a stale hit.
    compiler.compile_module(src, "compute_90")
    (tmp_path / "helper.cuh").write_text("#define ADD 2\n")
    assert not compiler.compile_module(src, "compute_90").cached


def test_cache_key_follows_headers_in_the_callers_include_folders(tmp_path, cache):
    """A header found through the caller's own ``-I`` folder is keyed too: editing it compiles
    anew (before, only the module's folder and CUDA's were searched, and the stale image was
    loaded)."""
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "extra.cuh").write_text("#define ADD 1\n")
    (inc / "nested.cuh").write_text('#include "extra.cuh"\n')
    src = tmp_path / "mod.cu"
    src.write_text('#include <nested.cuh>\n' + _BODY)
    for option in (f"-I{inc}", f"--include-path={inc}"):
        names = [name for name, _ in compiler._headers(src.read_text(), tmp_path, compiler._include_dirs([option]))]
        assert names == ["nested.cuh", "extra.cuh"], option
    first = compiler.compile_module(src, "compute_90", (f"-I{inc}",))
    assert compiler.compile_module(src, "compute_90", (f"-I{inc}",)).cached
    (inc / "extra.cuh").write_text("#define ADD 2\n")
    again = compiler.compile_module(src, "compute_90", (f"-I{inc}",))
    assert not again.cached and again.image != first.image


def test_unwritable_cache_warns_and_compiles(tmp_path, monkeypatch):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    monkeypatch.setenv("GPU_RUNTIME_CACHE_DIR", str(blocker / "cache"))
    src = _module(tmp_path, _BODY)
    with pytest.warns(UserWarning, match="kernel cache not written"):
        out = compiler.compile_module(src, "compute_90")
    assert out.image


def test_nvrtc_error_carries_log_with_file_and_line(tmp_path, cache):
    src = _module(tmp_path, 'extern "C" __global__ void k(float* x) {\n  x[0] = undefined_name;\n}\n')
    with pytest.raises(NvrtcError) as info:
        compiler.compile_module(src, "compute_90")
    assert "NVRTC_ERROR_COMPILATION" in str(info.value)
    assert "tiny.cu(3)" in info.value.log and "undefined_name" in info.value.log


def test_precompile_reports_each_module(capsys, cache):
    from layers import precompile  # what make kernels runs: the runtime's, given the layers' files

    assert precompile.main(["--arch", "compute_90"]) == 0
    out = capsys.readouterr().out
    for path in KERNEL_FILES:
        assert f"ok   {path.stem}" in out


def test_runtime_precompile_needs_files(capsys):
    from gpu_runtime import precompile

    assert precompile.main(["--arch", "compute_90"]) == 2
    assert capsys.readouterr().err == "python -m gpu_runtime.precompile: error: no .cu files given\n"


def test_precompile_fails_on_error(tmp_path, cache, capsys):
    from gpu_runtime import precompile

    bad = _module(tmp_path, 'extern "C" __global__ void k(float* x) { x[0] = nope; }\n')
    assert precompile.main(["--arch", "compute_90", str(bad)]) == 1
    assert "nope" in capsys.readouterr().err


def test_target_for_device():
    assert compiler.target_for(9, 0) == "sm_90a"
    assert compiler.target_for(8, 6) == "sm_86"


def test_kernel_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("GPU_RUNTIME_KERNEL_DIR", str(tmp_path))
    assert kernel_dir() == tmp_path
    monkeypatch.delenv("GPU_RUNTIME_KERNEL_DIR")
    assert (kernel_dir() / "common.cuh").is_file()
    assert os.path.isdir(kernel_dir())


def test_param_layout_without_driver_param_count(monkeypatch):
    """Bindings newer than the driver: cuFuncGetParamCount raises; the layout is probed."""
    from cuda.bindings import driver as cu

    from gpu_runtime import CudaBackend

    def missing(kernel):
        raise RuntimeError('Function "cuFuncGetParamCount" not found')

    layout = [(0, 8), (8, 4), (12, 4)]

    def info(kernel, i):
        if i < len(layout):
            return (cu.CUresult.CUDA_SUCCESS, *layout[i])
        return (cu.CUresult.CUDA_ERROR_INVALID_VALUE, None, None)

    monkeypatch.setattr(cu, "cuFuncGetParamCount", missing, raising=False)
    monkeypatch.setattr(cu, "cuFuncGetParamInfo", info)
    assert CudaBackend._param_layout(1) == layout
    monkeypatch.setattr(cu, "cuFuncGetParamCount", lambda k: (cu.CUresult.CUDA_SUCCESS, 2), raising=False)
    assert CudaBackend._param_layout(1) == layout[:2]


# -- tensor maps: refused before the driver; the driver's 128 bytes packed as they lie; cached --------
class _FakeTensorMap:
    def __init__(self, words):
        self.opaque = [cu_driver.cuuint64_t(w) for w in words]


def test_tensor_map_encodes_once_and_packs_the_opaque_words(monkeypatch):
    from gpu_runtime.cuda_backend import tensor_maps

    calls = []

    def call(fn, *args, detail=""):
        calls.append((fn.__name__, args, detail))
        return _FakeTensorMap(range(100, 116))

    monkeypatch.setattr(tensor_maps, "call", call)
    tensor_maps._encode.cache_clear()
    maps = tensor_maps.CudaTensorMaps()
    maps._closed = False
    got = maps.tensor_map_2d(0x7000_0000_0400, 300, 72, 128, 64)
    assert got == struct.pack("<16Q", *range(100, 116)) and len(got) == 128
    assert maps.tensor_map_2d(0x7000_0000_0400, 300, 72, 128, 64) == got and len(calls) == 1  # cached
    name, args, detail = calls[0]
    assert name == "cuTensorMapEncodeTiled" and args[1] == 2 and args[2] == 0x7000_0000_0400
    assert [int(d) for d in args[3]] == [72, 300] and [int(d) for d in args[4]] == [144]
    assert [int(d) for d in args[5]] == [64, 128] and "bf16 [300, 72]" in detail
    tensor_maps._encode.cache_clear()


@pytest.mark.parametrize("args, error, message", [
    ((0x1008, 300, 72, 128, 64), ValueError, "16-byte aligned"),
    ((0x1000, 300, 70, 128, 64), ValueError, "a multiple of 8"),
    ((0x1000, 300, 72, 257, 64), ValueError, "limits"),
    ((0x1000, 300, 72, 128, 72), ValueError, "limits"),
    ((0x1000, 300, 72, 128, 4), ValueError, r"box cols \(4\) must be a multiple of 8"),  # 8-byte box rows
    ((0x1000, 300, 72, 128, 60), ValueError, r"box cols \(60\) must be a multiple of 8"),
    ((0, 300, 72, 128, 64), ValueError, "null device pointer"),
    ((0x1000, 0, 72, 128, 64), ValueError, "rows"),
    ((0x1000, 300, 72.0, 128, 64), TypeError, "cols"),
])
def test_tensor_map_refusals_come_before_the_driver(monkeypatch, args, error, message):
    from gpu_runtime.cuda_backend import tensor_maps

    def call(fn, *a, detail=""):
        raise AssertionError("the driver was reached")

    monkeypatch.setattr(tensor_maps, "call", call)
    maps = tensor_maps.CudaTensorMaps()
    maps._closed = False
    with pytest.raises(error, match=message):
        maps.tensor_map_2d(*args)
