"""``CudaBackend``'s promises on a scripted driver: after ``close()`` every call raises
``ClosedError`` (zero-byte copies and graph launches too), every stream argument is checked
before the driver sees it, and a context is made current on each thread before its first call."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gpu_runtime import ClosedError, CudaBackend, CudaError
from tests.helpers.scripted_driver import ScriptedDriver, install_scripted_driver


@pytest.fixture
def gpu(monkeypatch):
    install_scripted_driver(monkeypatch)
    backend = CudaBackend()
    yield backend
    backend.close()


def _stream_calls(gpu, stream):
    """Every backend call that takes a stream, with ``stream`` and otherwise valid arguments."""
    ptr = gpu.alloc(64)
    host = gpu.alloc_host(64)
    event = gpu.create_event()
    return [
        ("memset", lambda: gpu.memset(ptr, 0, 8, stream)),
        ("copy_h2d_async", lambda: gpu.copy_h2d_async(np.zeros(8, np.uint8), ptr, stream)),
        ("copy_d2h", lambda: gpu.copy_d2h(np.zeros(8, np.uint8), ptr, stream)),
        ("copy_d2d_async", lambda: gpu.copy_d2d_async(ptr, ptr, 8, stream)),
        ("copy_2d_async", lambda: gpu.copy_2d_async(ptr, 8, ptr, 8, 8, 1, stream)),
        ("upload_pinned_async", lambda: gpu.upload_pinned_async(host[:8], ptr, stream)),
        ("synchronize", lambda: gpu.synchronize(stream)),
        ("record_event", lambda: gpu.record_event(event, stream)),
        ("wait_event", lambda: gpu.wait_event(stream, event)),
        ("begin_capture", lambda: gpu.begin_capture(stream)),
        ("end_capture", lambda: gpu.end_capture(stream)),
        ("abort_capture", lambda: gpu.abort_capture(stream)),
        ("launch_graph", lambda: gpu.launch_graph(1, stream)),
    ]


@pytest.mark.parametrize("stream, error, match", [
    (1.5, TypeError, "must be a stream handle"),  # the bindings would have taken it as stream 1
    (True, TypeError, "must be a stream handle"),
    (-1, ValueError, "must be a stream handle"),
    (2**64, ValueError, "must be a stream handle"),
])
def test_every_stream_argument_is_checked_before_the_driver(gpu, stream, error, match):
    for name, call in _stream_calls(gpu, stream):
        with pytest.raises(error, match=f"{name} stream {match}"):
            call()


def test_after_close_even_calls_with_nothing_to_do_raise_closed_error(gpu):
    ptr = gpu.alloc(64)
    host = gpu.alloc_host(64)
    empty = np.zeros(0, np.uint8)
    gpu.close()
    nothing_to_do = [
        lambda: gpu.memset(ptr, 0, 0),
        lambda: gpu.copy_h2d_async(empty, ptr),
        lambda: gpu.copy_d2h(empty, ptr),
        lambda: gpu.copy_d2d_async(ptr, ptr, 0),
        lambda: gpu.copy_2d_async(ptr, 8, ptr, 8, 0, 0),
        lambda: gpu.upload_pinned_async(host[:0], ptr),
        lambda: gpu.launch_graph(1, 0),
    ]
    for call in nothing_to_do:
        with pytest.raises(ClosedError, match="CudaBackend is closed"):
            call()
    gpu.free(0)  # free(0) does nothing, as C's free(NULL)


def test_a_graph_launched_from_a_new_thread_binds_the_context_first(monkeypatch):
    driver = install_scripted_driver(monkeypatch)
    gpu = CudaBackend()
    stream = gpu.create_stream()
    gpu.begin_capture(stream)
    graph = gpu.end_capture(stream)
    driver.calls.clear()
    worker = threading.Thread(target=gpu.launch_graph, args=(graph, stream))
    worker.start()
    worker.join()
    names = [name for name, _ in driver.calls]
    assert names == ["cuCtxSetCurrent", "cuGraphLaunch"]
    gpu.close()


def test_close_releases_everything_even_after_refusals_and_raises_the_first(monkeypatch):
    """After a kernel fault the context's wait reports the sticky error and some frees may be
    refused: close still attempts every release and gives the primary context back, then raises
    the first error (before, it stopped at the wait and held everything for good)."""
    driver = install_scripted_driver(monkeypatch)
    gpu = CudaBackend()
    ptrs = [gpu.alloc(64), gpu.alloc(128)]
    gpu.create_stream()
    gpu.create_event()
    gpu.alloc_host(4096)
    driver.refuse = {"cuCtxSynchronize", "cuMemFree", "cuStreamDestroy"}
    with pytest.raises(CudaError, match="cuCtxSynchronize"):
        gpu.close()
    assert gpu.closed and not any(gpu.held().values())
    assert [args[0] for args in driver.named("cuMemFree")] == [int(p) for p in ptrs]  # both tried
    for name in ("cuStreamDestroy", "cuEventDestroy", "cuMemFreeHost", "cuDevicePrimaryCtxRelease"):
        assert len(driver.named(name)) == 1, name
    driver.calls.clear()
    gpu.close()  # idempotent: nothing is left to release
    assert driver.calls == []


def test_staging_keeps_a_buffer_out_of_the_pool_until_its_copy_is_known_done(monkeypatch):
    """A copy queued but its event not recorded: the buffer is reused only after the stream was
    waited for (before, it went straight back while the copy might still read it), the event
    is kept for the next upload, and where even the wait is refused the buffer stays out."""
    from gpu_runtime import staging
    from gpu_runtime.errors import CudaError as Refused
    from cuda.bindings import driver as cu

    driver = ScriptedDriver()  # the pool calls the driver through its own module's call
    monkeypatch.setattr(staging, "call", driver)
    log, refuse = driver.calls, driver.refuse
    pool = staging.PinnedStaging()
    data = np.arange(64, dtype=np.uint8)
    refuse.add("cuEventRecord")
    with pytest.raises(Refused, match="cuEventRecord"):
        pool.upload(data.ctypes.data, 64, 0x1000, 7)
    names = [n for n, _ in log]
    assert names == ["cuMemHostAlloc", "cuMemcpyHtoDAsync", "cuEventCreate", "cuEventRecord", "cuStreamSynchronize"]
    host = log[1][1][1]
    refuse.clear()
    log.clear()
    pool.upload(data.ctypes.data, 64, 0x2000, 7)  # the same buffer and event, no new ones
    assert [n for n, _ in log] == ["cuMemcpyHtoDAsync", "cuEventRecord"] and log[0][1][1] == host
    monkeypatch.setattr(cu, "cuEventQuery", lambda event: (cu.CUresult.CUDA_ERROR_NOT_READY,))  # still copying
    refuse.update({"cuEventRecord", "cuStreamSynchronize"})
    with pytest.raises(Refused):
        pool.upload(data.ctypes.data, 64, 0x3000, 7)
    assert pool.buffers == 2 and not pool._free.get(4096)  # the unwaited buffer is not reused
