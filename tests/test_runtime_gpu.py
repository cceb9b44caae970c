"""The CUDA backend on a real device: memory, copies, streams, launches, refusals, teardown."""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from gpu_runtime import (ClosedError, CudaBackend, CudaError, DeviceArray, DeviceBuffer, DevicePtr,
                         KernelLaunch, KernelNotFoundError, LaunchConfig)
from gpu_runtime.signatures import Param, Signature
from tests.helpers import DEVICE_MEMORY_MEASURABLE
from layers.kernel_files import load_kernel

pytestmark = pytest.mark.gpu
TEST_KERNELS = Path(__file__).parent / "kernels"


RUNTIME_DOC = Path(__file__).resolve().parent.parent / "docs" / "RUNTIME.md"


def test_runtime_doc_example_runs(gpu):
    """docs/RUNTIME.md's "Embedding the runtime" example, run as written: out = 0.5x + 0.5x = x."""
    text = RUNTIME_DOC.read_text().split("## Embedding the runtime in an engine", 1)[1]
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(code, "docs/RUNTIME.md", "exec"), scope)
    assert scope["y"].tobytes() == scope["x"].tobytes()
    assert scope["inp"].closed and scope["out"].closed


@pytest.fixture(scope="module")
def tgpu(gpu):
    """A second backend on the same device, for the test kernels (tests/kernels/)."""
    backend = CudaBackend()
    yield backend
    backend.close()


@pytest.mark.parametrize("nbytes", [1, 7, 4097, (1 << 20) + 3])
def test_h2d_d2h_round_trip(gpu, rng, nbytes):
    host = rng.integers(0, 256, nbytes, dtype=np.uint8)
    ptr = gpu.alloc(nbytes)
    try:
        gpu.copy_h2d_async(host, ptr)
        back = np.full(nbytes, 0xA5, np.uint8)
        gpu.copy_d2h(back, ptr)
        np.testing.assert_array_equal(back, host)
        byte = int(rng.integers(0, 256))
        gpu.memset(ptr, byte, nbytes)
        gpu.copy_d2h(back, ptr)
        assert (back == byte).all()
    finally:
        gpu.free(ptr)


def test_bytes_and_memoryview_uploads(gpu, rng):
    data = rng.integers(0, 256, 1000, dtype=np.uint8)
    ptr = gpu.alloc(1000)
    try:
        for host in (data.tobytes(), bytearray(data.tobytes()), memoryview(data.tobytes())):
            gpu.memset(ptr, 0, 1000)
            gpu.copy_h2d_async(host, ptr)
            back = np.empty(1000, np.uint8)
            gpu.copy_d2h(back, ptr)
            np.testing.assert_array_equal(back, data)
    finally:
        gpu.free(ptr)


def test_every_argument_kind_reaches_the_kernel(tgpu, rng):
    k = tgpu.kernel(TEST_KERNELS / "runtime_test.cu", "arg_echo")
    out = tgpu.alloc(5 * 8)
    try:
        u = int(rng.integers(0, 2**32))
        i = int(rng.integers(-(2**31), 2**31))
        f = float(np.float32(rng.standard_normal()))
        big = int(rng.integers(0, 2**63)) * 2 + 1
        KernelLaunch(tgpu, k).arg_ptr(out).arg_u32(u).arg_i32(i).arg_f32(f).arg_u64(big).arg_ptr(out).launch(0)
        back = np.empty(5, np.uint64)
        tgpu.copy_d2h(back, out)
        assert int(back[0]) == u
        assert int(back[1]) == i % 2**64
        assert struct.unpack("<f", struct.pack("<I", int(back[2])))[0] == f
        assert int(back[3]) == big
        assert int(back[4]) == int(out)
    finally:
        tgpu.free(out)


def test_argument_mismatches_refused_before_launch(tgpu):
    k = tgpu.kernel(TEST_KERNELS / "runtime_test.cu", "arg_echo")
    out = tgpu.alloc(40)
    try:
        with pytest.raises(TypeError, match=r"runtime_test.arg_echo: takes 6 arguments"):
            KernelLaunch(tgpu, k).arg_ptr(out).arg_u32(1).launch(0)
        with pytest.raises(TypeError, match=r"argument 3 must be f32, launch passes u32"):
            KernelLaunch(tgpu, k).arg_ptr(out).arg_u32(1).arg_i32(2).arg_u32(3).arg_u64(4).arg_ptr(out).launch(0)
        with pytest.raises(TypeError, match=r"argument 1 must be u32, launch passes pointer"):
            KernelLaunch(tgpu, k).arg_ptr(out).arg_ptr(out).arg_i32(2).arg_f32(3).arg_u64(4).arg_ptr(out).launch(0)
    finally:
        tgpu.free(out)


def test_kernel_launch_puts_each_argument_in_its_place(tgpu, rng):
    """``Kernel.launch`` reaches the kernel with each argument where its signature puts it
    (DeviceBuffers as pointers, from a second thread too); a refused config launches nothing."""
    n = 5000
    add = tgpu.bind(tgpu.kernel(TEST_KERNELS / "runtime_test.cu", "add_u32"))
    assert add.signature.names == ("dst", "src", "add", "n") and add.name == "runtime_test.add_u32"
    host = rng.integers(0, 2**31, n, dtype=np.uint32)
    config = LaunchConfig(8, 256)
    with DeviceBuffer.upload(tgpu, host) as src, DeviceBuffer(tgpu, 4 * n) as dst:
        add.launch(config, 0, dst, src, 11, n)
        back = np.empty(n, np.uint32)
        tgpu.copy_d2h(back, dst)
        np.testing.assert_array_equal(back, host + np.uint32(11))
        thread = threading.Thread(target=lambda: add.launch(config, 0, dst, dst, 1, n))
        thread.start()
        thread.join()
        tgpu.copy_d2h(back, dst)
        np.testing.assert_array_equal(back, host + np.uint32(12))
        with pytest.raises(ValueError, match="more than 1024 threads"):
            add.launch(LaunchConfig(8, (1024, 2)), 0, dst, src, 1, n)
        with pytest.raises(ValueError, match=r"runtime_test\.add_u32 n must be in 0\.\.2\*\*32-1"):
            add.launch(config, 0, dst, src, 1, 2**32)
        tgpu.copy_d2h(back, dst)
        np.testing.assert_array_equal(back, host + np.uint32(12))  # nothing ran


def test_two_threads_each_with_its_runner_and_stream_equal_one_thread(gpu, rng):
    """An engine's scheduler and worker launching at once: two threads, each with its own
    ``NgramDecoder`` (over one shared ``NgramWeights``) and its own stream,
    thousands of launches each; every output bit for bit what one thread computes alone."""
    import ml_dtypes

    from layers.ngram_embed import NgramDecoder, NgramDims
    from tests.helpers.ngram import device_weights, random_layer

    dims = NgramDims(vocab_size=3001, hidden_size=64, max_ngram=3, splits=2, base_rows=1 << 12)
    layer = random_layer(rng, dims, "bf")
    steps, batch = 600, 4  # two launches a step: 1200 a thread
    tokens = rng.integers(0, dims.vocab_size, (2, steps, batch)).astype(np.uint32)

    def run(weights, which: int, outs: np.ndarray) -> None:
        stream = gpu.create_stream()
        try:
            with NgramDecoder(weights, max_seqs=batch, max_rows=batch, stream=stream) as dec, \
                    DeviceArray.from_numpy(gpu, tokens[which].reshape(-1), stream) as toks, \
                    DeviceArray.from_numpy(gpu, np.arange(batch, dtype=np.uint32), stream) as slots, \
                    DeviceArray.empty(gpu, (steps, batch, dims.hidden_size), outs.dtype, stream) as out:
                for step in range(steps):
                    dec.step(toks.ptr.offset(step * batch * 4), slots, batch,
                             out.ptr.offset(step * batch * dims.hidden_size * 2), stream)
                gpu.copy_d2h(outs, out.ptr, stream)
        finally:
            gpu.destroy_stream(stream)

    with device_weights(gpu, layer) as weights:
        alone = [np.empty((steps, batch, dims.hidden_size), ml_dtypes.bfloat16) for _ in range(2)]
        for which in range(2):
            run(weights, which, alone[which])
        together = [np.empty_like(a) for a in alone]
        errors: list[BaseException] = []

        def thread(which: int) -> None:
            try:
                run(weights, which, together[which])
            except BaseException as exc:  # re-raised below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=thread, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
    for a, b in zip(alone, together):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    assert alone[0].view(np.uint16).any() and (alone[0].view(np.uint16) != alone[1].view(np.uint16)).any()


def test_the_layer_launcher_the_kernel_and_the_builder_each_equal_the_reference(gpu, rng):
    """``scaled_add``, the bound kernel launched by hand (plainly, prepared, in clusters of two,
    as a programmatic dependent) and the seed's positional builder, each into its own output
    from the same start, each bit for bit the numpy reference (so a wrong kernel or argument
    order cannot pass by agreeing with itself)."""
    import ml_dtypes

    from layers import reference as ref
    from layers.ops import scaled_add
    from tests.helpers import bits

    n = 3001
    kernel = load_kernel(gpu, "residual_add", "bf16_scaled_add")
    x = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    base = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    want = bits(ref.scaled_add(base, x, -0.37))
    assert (want != bits(base)).any()
    outs = [DeviceBuffer.upload(gpu, base) for _ in range(6)]
    with DeviceBuffer.upload(gpu, x) as xd:
        a, b, c, d, e, f = outs
        bound = gpu.bind(kernel)
        scaled_add(gpu, kernel, a, xd, -0.37, n, 0)
        bound.launch(LaunchConfig(2, 256), 0, b, xd, -0.37, n)
        (KernelLaunch(gpu, kernel).grid([2, 1, 1]).block([256, 1, 1])
         .arg_ptr(c.ptr).arg_ptr(xd.ptr).arg_f32(-0.37).arg_u32(n).launch(0))
        bound.prepare(LaunchConfig(2, 256), d, xd, -0.37, n).run(0)
        bound.launch(LaunchConfig(2, 256, cluster=2), 0, e, xd, -0.37, n)
        bound.launch(LaunchConfig(2, 256, overlap=True), 0, f, xd, -0.37, n)
        for buf in outs:
            got = np.empty(n, ml_dtypes.bfloat16)
            gpu.copy_d2h(got, buf)
            np.testing.assert_array_equal(bits(got), want)
            buf.close()


def test_a_source_signature_the_driver_disagrees_with_is_refused_at_bind(tgpu):
    """The driver's parameter layout (``cuFuncGetParamInfo``) refuses a signature whose sizes or
    offsets differ from the kernel's: here one read as (dst, src, add: u64, n)."""
    path = (TEST_KERNELS / "runtime_test.cu").resolve()
    k = tgpu.kernel(TEST_KERNELS / "runtime_test.cu", "add_u32")
    signatures = tgpu._signatures[path]
    saved, bound = signatures["add_u32"], tgpu._bound.pop(k, None)
    signatures["add_u32"] = Signature([Param("dst", "P"), Param("src", "P"), Param("add", "L"), Param("n", "U")])
    try:
        with pytest.raises(TypeError, match=r"argument 2 is 4 bytes at offset 16, launch packs 8"):
            tgpu.bind(k)
    finally:
        signatures["add_u32"] = saved
        if bound is not None:
            tgpu._bound[k] = bound


def test_stream_ordering_and_async_upload_from_reused_buffer(tgpu, rng):
    """Work queued on a non-default stream runs in order, and an upload issued behind a busy
    stream reads the caller's data as it was at the call, though the caller overwrites it."""
    n = 1 << 16
    stream = tgpu.create_stream()
    spin = tgpu.kernel(TEST_KERNELS / "runtime_test.cu", "spin")
    add = tgpu.kernel(TEST_KERNELS / "runtime_test.cu", "add_u32")
    a, b = tgpu.alloc(4 * n), tgpu.alloc(4 * n)
    try:
        host = rng.integers(0, 2**31, n, dtype=np.uint32)
        expected = host.copy()
        KernelLaunch(tgpu, spin).arg_u64(50_000_000).launch(stream)  # 50 ms busy
        tgpu.copy_h2d_async(host, a, stream)
        host[:] = 0xDEADBEEF  # the caller reuses its buffer right away
        for step in range(1, 6):  # a -> b -> a ... each adds `step`
            src, dst = (a, b) if step % 2 else (b, a)
            (KernelLaunch(tgpu, add).grid([64, 1, 1]).block([256, 1, 1])
             .arg_ptr(dst).arg_ptr(src).arg_u32(step).arg_u32(n).launch(stream))
        back = np.empty(n, np.uint32)
        tgpu.copy_d2h(back, b, stream)
        np.testing.assert_array_equal(back, expected + np.uint32(15))
    finally:
        tgpu.free(a)
        tgpu.free(b)
        tgpu.destroy_stream(stream)


def test_staging_buffers_are_recycled(gpu, rng):
    ptr = gpu.alloc(1 << 16)
    try:
        for _ in range(3):
            gpu.copy_h2d_async(rng.integers(0, 255, 1 << 16, dtype=np.uint8), ptr)
        gpu.synchronize()
        before = gpu.pinned_buffers
        for _ in range(50):
            gpu.copy_h2d_async(rng.integers(0, 255, 1 << 16, dtype=np.uint8), ptr)
            gpu.synchronize()
        assert gpu.pinned_buffers == before
    finally:
        gpu.free(ptr)


def test_free_returns_device_memory(gpu):
    """Under compute-sanitizer cuMemGetInfo also counts the tool's own memory: the allocations
    and frees still run there (the tool checks them), only the free-memory reading stands down."""
    gpu.synchronize()
    baseline = gpu.mem_info()[0]
    ptrs = [gpu.alloc(256 << 20) for _ in range(4)]
    assert gpu.mem_info()[0] <= baseline - (1 << 30) or not DEVICE_MEMORY_MEASURABLE
    for p in ptrs:
        gpu.free(p)
    assert abs(gpu.mem_info()[0] - baseline) <= 2 << 20 or not DEVICE_MEMORY_MEASURABLE


def test_refusals_name_the_problem(gpu):
    with pytest.raises(CudaError, match="CUDA_ERROR_OUT_OF_MEMORY: cuMemAlloc"):
        gpu.alloc(1 << 50)
    with pytest.raises(ValueError, match="0 bytes"):
        gpu.alloc(0)
    with pytest.raises(ValueError, match="null device pointer"):
        gpu.memset(DevicePtr(0), 0, 4)
    with pytest.raises(ValueError, match="null device pointer"):
        gpu.copy_h2d_async(b"abcd", 0)
    with pytest.raises(ValueError, match="not allocated by this backend"):
        gpu.free(DevicePtr(0x1234))
    with pytest.raises(ValueError, match="read-only"):
        ptr = gpu.alloc(4)
        try:
            gpu.copy_d2h(b"four", ptr)
        finally:
            gpu.free(ptr)
    with pytest.raises(KernelNotFoundError, match="no kernel module"):
        gpu.kernel("no_such_module", "k")
    with pytest.raises(KernelNotFoundError, match="not in module"):
        load_kernel(gpu, "residual_add", "no_such_kernel")


def test_kernel_lookup_is_cached(gpu):
    assert load_kernel(gpu, "residual_add", "bf16_scaled_add") is load_kernel(gpu, "residual_add", "bf16_scaled_add")


def test_device_array_round_trip_and_interface(gpu, rng):
    host = rng.standard_normal((3, 5)).astype(np.float32)
    with DeviceArray.from_numpy(gpu, host) as arr:
        np.testing.assert_array_equal(arr.to_numpy(), host)
        cai = arr.__cuda_array_interface__
        assert cai["shape"] == (3, 5) and cai["typestr"] == "<f4" and cai["version"] == 3
        assert cai["data"] == (int(arr.ptr), False)
        arr.fill_bytes(0)
        assert (arr.to_numpy() == 0).all()


def test_device_buffer_round_trip_launch_and_free_on_a_stream(tgpu, rng):
    """A buffer uploads, is launched on as a pointer, frees itself after its stream's work, and
    gives the memory back; a closed buffer refuses to be a pointer."""
    n = 1 << 16
    stream = tgpu.create_stream()
    add = tgpu.kernel(TEST_KERNELS / "runtime_test.cu", "add_u32")
    host = rng.integers(0, 2**31, n, dtype=np.uint32)
    try:
        with DeviceBuffer.upload(tgpu, host, stream) as src, DeviceBuffer(tgpu, 4 * n) as dst:
            (KernelLaunch(tgpu, add).grid([64, 1, 1]).block([256, 1, 1])
             .arg_ptr(dst).arg_ptr(src).arg_u32(7).arg_u32(n).launch(stream))
            back = np.empty(n, np.uint32)
            tgpu.copy_d2h(back, dst, stream)
            np.testing.assert_array_equal(back, host + np.uint32(7))
            KernelLaunch(tgpu, add).grid([64, 1, 1]).block([256, 1, 1]) \
                .arg_ptr(dst).arg_ptr(src).arg_u32(1).arg_u32(n).launch(stream)
            src_ptr = src.ptr
            src.close(stream)  # waits for the launch that reads it, then frees
            assert src.closed
            with pytest.raises(ValueError, match="not allocated by this backend"):
                tgpu.free(src_ptr)  # already freed, once
        assert dst.closed
        with pytest.raises(ClosedError):
            KernelLaunch(tgpu, add).arg_ptr(dst)
    finally:
        tgpu.destroy_stream(stream)


def test_two_threads_with_their_own_streams(tgpu, rng):
    n = 1 << 14
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def work(tag: int) -> None:
        try:
            stream = tgpu.create_stream()
            add = tgpu.kernel(TEST_KERNELS / "runtime_test.cu", "add_u32")
            a, b = tgpu.alloc(4 * n), tgpu.alloc(4 * n)
            tgpu.copy_h2d_async(np.arange(n, dtype=np.uint32), a, stream)
            for _ in range(200):
                (KernelLaunch(tgpu, add).grid([16, 1, 1]).block([256, 1, 1])
                 .arg_ptr(b).arg_ptr(a).arg_u32(tag).arg_u32(n).launch(stream))
                (KernelLaunch(tgpu, add).grid([16, 1, 1]).block([256, 1, 1])
                 .arg_ptr(a).arg_ptr(b).arg_u32(0).arg_u32(n).launch(stream))
            out = np.empty(n, np.uint32)
            tgpu.copy_d2h(out, a, stream)
            results[tag] = out
            tgpu.free(a)
            tgpu.free(b)
            tgpu.destroy_stream(stream)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(tag,)) for tag in (1, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for tag in (1, 3):
        np.testing.assert_array_equal(results[tag], np.arange(n, dtype=np.uint32) + 200 * tag)


def test_closed_backend_refuses_and_close_is_idempotent(gpu):
    backend = CudaBackend()
    ptr = backend.alloc(1024)
    backend.memset(ptr, 0, 1024)  # the kernel reads it (initcheck)
    k = backend.kernel(TEST_KERNELS / "runtime_test.cu", "add_u32")
    add = backend.bind(k)
    add.launch(LaunchConfig(1, 32), 0, ptr, ptr, 1, 1)
    prepared = add.prepare(LaunchConfig(1, 32), ptr, ptr, 1, 1)
    backend.close()
    backend.close()
    with pytest.raises(ClosedError, match="CudaBackend is closed"):
        backend.alloc(16)
    with pytest.raises(ClosedError, match="CudaBackend is closed"):
        backend.memset(ptr, 0, 16)
    with pytest.raises(ClosedError):
        KernelLaunch(backend, backend.kernel(TEST_KERNELS / "runtime_test.cu", "add_u32"))
    for launch in (lambda: add.launch(LaunchConfig(1, 32), 0, ptr, ptr, 1, 1), lambda: prepared.run(0),
                   lambda: backend.bind(k)):
        with pytest.raises(ClosedError, match="backend is closed"):
            launch()


def test_pinned_upload_events_and_cross_stream_wait(gpu, rng):
    n = 1 << 20
    host = gpu.alloc_host(n)
    dev = gpu.alloc(n)
    s1, s2 = gpu.create_stream(), gpu.create_stream()
    event = gpu.create_event()
    try:
        host[:] = rng.integers(0, 256, n, dtype=np.uint8)
        want = host.copy()
        gpu.upload_pinned_async(host, dev, s1)
        gpu.record_event(event, s1)
        gpu.wait_event(s2, event)  # s2's read is ordered after s1's upload
        back = np.empty(n, np.uint8)
        gpu.copy_d2h(back, dev, s2)
        np.testing.assert_array_equal(back, want)
        gpu.event_synchronize(event)
        with pytest.raises(ValueError, match="not inside an alloc_host buffer"):
            gpu.upload_pinned_async(np.zeros(16, np.uint8), dev, s1)
        with pytest.raises(ValueError, match="not a whole buffer"):
            gpu.free_host(host[16:])
    finally:
        gpu.destroy_event(event)
        gpu.free_host(host)
        gpu.free(dev)
        gpu.destroy_stream(s1)
        gpu.destroy_stream(s2)
    with pytest.raises(ValueError, match="destroyed twice"):
        gpu.destroy_event(event)


def test_host_functions_run_in_stream_order_and_from_graphs(gpu):
    """libc's ``sem_wait`` queued on a stream holds the work after it until the host posts; a
    ``sem_post`` queued after a memset runs once the memset is done; a captured one runs at each
    replay; bad arguments raise before anything is queued."""
    import ctypes
    import time

    libc = ctypes.CDLL(None)
    fn = {name: ctypes.cast(getattr(libc, name), ctypes.c_void_p).value for name in ("sem_post", "sem_wait")}
    sems = [ctypes.create_string_buffer(64) for _ in range(2)]
    for sem in sems:
        assert libc.sem_init(sem, 0, 0) == 0
    posted, release = (ctypes.c_void_p(ctypes.addressof(sem)) for sem in sems)
    n, s = 1 << 22, gpu.create_stream()
    dev = gpu.alloc(n)
    try:
        for value in (7, 9):
            gpu.launch_host_func(s, fn["sem_wait"], release.value)
            gpu.memset(dev, value, n, s)
            gpu.launch_host_func(s, fn["sem_post"], posted.value)
            time.sleep(0.05)
            assert libc.sem_trywait(posted) != 0, "the work after the wait ran before the host released it"
            libc.sem_post(release)
            assert libc.sem_wait(posted) == 0
            back = np.zeros(n, np.uint8)
            gpu.copy_d2h(back, dev, s)
            assert (back == value).all()
        gpu.begin_capture(s)
        gpu.launch_host_func(s, fn["sem_post"], posted.value)
        graph = gpu.end_capture(s)
        for _ in range(3):
            gpu.launch_graph(graph, s)
            assert libc.sem_wait(posted) == 0
        gpu.synchronize(s)
        gpu.destroy_graph(graph)
        with pytest.raises(ValueError, match="launch_host_func fn: null"):
            gpu.launch_host_func(s, 0, posted.value)
        with pytest.raises(TypeError):
            gpu.launch_host_func("s", fn["sem_post"], posted.value)
    finally:
        libc.sem_post(release)  # a failure above may have left the stream held
        gpu.synchronize(s)
        gpu.free(dev)
        gpu.destroy_stream(s)
        for sem in sems:
            libc.sem_destroy(sem)


def test_graph_replays_with_new_pinned_input(gpu, rng):
    from layers.ops import scaled_add
    import ml_dtypes

    n = 4099
    kernel = load_kernel(gpu, "residual_add", "bf16_scaled_add")
    stream = gpu.create_stream()
    host = gpu.alloc_host(n * 2)
    x, out = gpu.alloc(n * 2), gpu.alloc(n * 2)
    try:
        with pytest.raises(ValueError, match="default stream"):
            gpu.begin_capture(0)
        gpu.begin_capture(stream)
        gpu.upload_pinned_async(host, x, stream)
        gpu.memset(out, 0, n * 2, stream)
        scaled_add(gpu, kernel, out, x, 0.5, n, stream)
        graph = gpu.end_capture(stream)
        for _ in range(3):
            values = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
            host.view(ml_dtypes.bfloat16)[:] = values
            gpu.launch_graph(graph, stream)
            got = np.empty(n, ml_dtypes.bfloat16)
            gpu.copy_d2h(got, out, stream)
            want = (values.astype(np.float32) * np.float32(0.5)).astype(ml_dtypes.bfloat16)
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        gpu.destroy_graph(graph)
        with pytest.raises(ValueError, match="not a live graph"):
            gpu.launch_graph(graph, stream)
    finally:
        gpu.free_host(host)
        gpu.free(x)
        gpu.free(out)
        gpu.destroy_stream(stream)
