"""``CudaBackend``'s mapped and registered host memory on a scripted driver: the flags it asks
the driver for, what it tracks and releases, and refusals that come before the driver; and its
upload staging pool, which refills a pinned buffer only once the copy reading it ran."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda.bindings import driver as cu

from gpu_runtime import CudaBackend, DevicePtr, GpuError
from tests.helpers import PAGE, page_aligned
from tests.helpers.row_cache import table_file
from tests.helpers.scripted_driver import ScriptedDriver, install_scripted_driver


@pytest.fixture
def scripted(monkeypatch):
    """(make, driver): ``make()`` builds a ``CudaBackend`` on the scripted driver."""
    return CudaBackend, install_scripted_driver(monkeypatch)


def test_alloc_host_mapped_flags_and_device_pointers(scripted):
    make, driver = scripted
    gpu = make()
    plain = gpu.alloc_host(1000)
    mapped = gpu.alloc_host(8192, mapped=True)
    flags = [args[1] for args in driver.named("cuMemHostAlloc")]
    assert flags == [0, cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE]
    base = mapped.ctypes.data
    driver.calls.clear()
    assert gpu.host_device_ptr(mapped) == base + driver.DEV_OFFSET
    assert gpu.host_device_ptr(mapped[100:300]) == base + 100 + driver.DEV_OFFSET
    # the driver is asked about the buffer's own address, the offset added after
    assert [args for args in driver.named("cuMemHostGetDevicePointer")] == [(base, 0), (base, 0)]
    assert isinstance(gpu.host_device_ptr(mapped), DevicePtr)
    with pytest.raises(ValueError, match="not inside a mapped"):
        gpu.host_device_ptr(plain)  # pinned but not mapped
    with pytest.raises(ValueError, match="not inside a mapped"):
        gpu.host_device_ptr(np.zeros(16, np.uint8))  # pageable
    assert gpu.pinned_buffers == 2
    gpu.free_host(mapped)
    with pytest.raises(ValueError, match="not inside a mapped"):
        gpu.host_device_ptr(mapped)  # freed: no longer mapped
    gpu.close()
    assert driver.named("cuMemFreeHost")[-1] == (plain.ctypes.data,)


@pytest.mark.parametrize("supported, read_only, want_ro", [(1, True, True), (0, True, False), (1, False, False)])
def test_register_host_flags_and_tracking(scripted, supported, read_only, want_ro):
    make, driver = scripted
    driver.read_only_supported = supported
    gpu = make()
    keep: list = []
    a, b = page_aligned(3 * PAGE, keep), page_aligned(5000, keep)
    ptr = gpu.register_host(a, read_only=read_only)
    assert ptr == a.ctypes.data + driver.DEV_OFFSET
    gpu.register_host(b[:5000], read_only=read_only)
    (first, second) = driver.named("cuMemHostRegister")
    want = cu.CU_MEMHOSTREGISTER_DEVICEMAP | (cu.CU_MEMHOSTREGISTER_READ_ONLY if want_ro else 0)
    assert first == (a.ctypes.data, 3 * PAGE, want) and second == (b.ctypes.data, 5000, want)
    ro_attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED
    asked = [args for args in driver.named("cuDeviceGetAttribute") if args[0] == ro_attr]
    assert len(asked) == (1 if read_only else 0)  # read once, and only when it matters
    assert gpu.host_registrations == 2 and gpu.pinned_buffers == 2
    assert gpu.host_device_ptr(a[PAGE:]) == a.ctypes.data + PAGE + driver.DEV_OFFSET
    gpu.unregister_host(a)
    assert driver.named("cuMemHostUnregister") == [(a.ctypes.data,)]
    assert gpu.host_registrations == 1
    with pytest.raises(ValueError, match="not inside a mapped"):
        gpu.host_device_ptr(a)
    gpu.close()  # unregisters what is left, before the context goes
    names = [n for n, _ in driver.calls]
    assert driver.named("cuMemHostUnregister") == [(a.ctypes.data,), (b.ctypes.data,)]
    assert names.index("cuMemHostUnregister", names.index("cuCtxSynchronize")) < names.index("cuDevicePrimaryCtxRelease")
    assert gpu.host_registrations == 0


def test_register_host_accepts_a_read_only_memmap_of_a_table_file(scripted, tmp_path, rng):
    make, driver = scripted
    gpu = make()
    path, table, _ = table_file(tmp_path, rng, 300, 24, fp8=False)
    rows = np.memmap(path, np.uint8, mode="r", offset=PAGE, shape=(300, 48))
    ptr = gpu.register_host(rows)
    assert ptr == rows.ctypes.data + driver.DEV_OFFSET
    with pytest.raises(ValueError, match="overlaps"):
        gpu.register_host(rows)  # registered twice
    gpu.unregister_host(rows)
    gpu.close()


def _refusal_world(make, driver):
    keep: list = []
    gpu, closed = make(), make()
    closed.close()
    world = dict(gpu=gpu, closed=closed, keep=keep)
    world["aligned"] = page_aligned(2 * PAGE, keep)
    world["registered"] = page_aligned(2 * PAGE, keep)
    gpu.register_host(world["registered"])
    world["plain"] = gpu.alloc_host(256)
    world["mapped"] = gpu.alloc_host(256, mapped=True)
    ro = page_aligned(PAGE, keep)
    ro.flags.writeable = False
    world["readonly"] = ro
    return world


REFUSALS = [
    ("register-type", lambda w: w["gpu"].register_host(b"\0" * PAGE), TypeError, "numpy array"),
    ("register-flag", lambda w: w["gpu"].register_host(w["aligned"], read_only=1), TypeError, "bool"),
    ("register-strided", lambda w: w["gpu"].register_host(w["aligned"][::2]), ValueError, "C-contiguous"),
    ("register-empty", lambda w: w["gpu"].register_host(w["aligned"][:0]), ValueError, "0 bytes"),
    ("register-unaligned", lambda w: w["gpu"].register_host(w["aligned"][1:]), ValueError, "page"),
    ("register-readonly-rw", lambda w: w["gpu"].register_host(w["readonly"], read_only=False), ValueError,
     "read_only=True"),
    ("register-overlap", lambda w: w["gpu"].register_host(w["registered"][PAGE:]), ValueError, "overlaps"),
    ("register-closed", lambda w: w["closed"].register_host(w["aligned"]), GpuError, "closed"),
    ("unregister-type", lambda w: w["gpu"].unregister_host([1, 2]), TypeError, "numpy array"),
    ("unregister-foreign", lambda w: w["gpu"].unregister_host(w["aligned"]), ValueError, "not a whole"),
    ("unregister-part", lambda w: w["gpu"].unregister_host(w["registered"][:PAGE]), ValueError, "not a whole"),
    ("unregister-closed", lambda w: w["closed"].unregister_host(w["registered"]), GpuError, "closed"),
    ("devptr-type", lambda w: w["gpu"].host_device_ptr(memoryview(b"x")), TypeError, "numpy array"),
    ("devptr-pageable", lambda w: w["gpu"].host_device_ptr(np.zeros(16, np.uint8)), ValueError, "not inside"),
    ("devptr-unmapped", lambda w: w["gpu"].host_device_ptr(w["plain"]), ValueError, "not inside"),
    ("devptr-strided", lambda w: w["gpu"].host_device_ptr(w["mapped"][::2]), ValueError, "C-contiguous"),
    ("devptr-past-end", lambda w: w["gpu"].host_device_ptr(
        np.frombuffer((ctypes.c_uint8 * 512).from_address(w["mapped"].ctypes.data), np.uint8)),
     ValueError, "not inside"),
    ("devptr-closed", lambda w: w["closed"].host_device_ptr(w["mapped"]), GpuError, "closed"),
    ("alloc-mapped-type", lambda w: w["gpu"].alloc_host(16, mapped="yes"), TypeError, "bool"),
    ("alloc-mapped-empty", lambda w: w["gpu"].alloc_host(0, mapped=True), ValueError, "0 bytes"),
]


@pytest.mark.parametrize("case, fn, exc, match", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_host_memory_refusals_come_before_the_driver(scripted, case, fn, exc, match):
    make, driver = scripted
    world = _refusal_world(make, driver)
    held = (world["gpu"].host_registrations, world["gpu"].pinned_buffers)
    driver.strict = True  # from here every driver call raises DriverReached
    with pytest.raises(exc, match=match):
        fn(world)
    driver.strict = False
    assert (world["gpu"].host_registrations, world["gpu"].pinned_buffers) == held
    # still usable afterwards
    assert world["gpu"].host_device_ptr(world["registered"]) == world["registered"].ctypes.data + driver.DEV_OFFSET
    world["gpu"].close()


class DeferredCopies(ScriptedDriver):
    """A scripted driver whose ``cuMemcpyHtoDAsync`` reads its pinned buffer only when the event
    recorded after it is waited for (``wait``, as the GPU getting there); until then
    ``cuEventQuery`` answers not ready. ``device`` holds what each copy wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[tuple] = []  # (dst, host, nbytes), in issue order
        self.copied = 0
        self.marks: dict[int, int] = {}  # event -> copies issued before it was recorded
        self.done: set[int] = set()
        self.device: dict[int, bytes] = {}

    def __call__(self, fn, *args, detail=""):
        out = super().__call__(fn, *args, detail=detail)
        if fn.__name__ == "cuMemcpyHtoDAsync":
            self.pending.append(args[:3])
        elif fn.__name__ == "cuEventRecord":
            self.marks[args[0]] = len(self.pending)
            self.done.discard(args[0])
        return out

    def wait(self, event: int) -> None:
        for dst, host, nbytes in self.pending[self.copied:self.marks[event]]:
            self.device[dst] = ctypes.string_at(host, nbytes)
        self.copied = max(self.copied, self.marks[event])
        self.done.add(event)

    def query(self, event: int) -> tuple:
        return (cu.CUresult.CUDA_SUCCESS if event in self.done else cu.CUresult.CUDA_ERROR_NOT_READY,)


def test_a_staging_buffer_is_refilled_only_after_the_copy_reading_it_ran(monkeypatch, rng):
    """``copy_h2d_async``'s staging pool on a driver whose copies read their buffer only once
    waited for: an upload while the first copy is pending takes another buffer (refilled, the
    first copy would carry the second's bytes); once that copy ran, its buffer is reused."""
    from gpu_runtime import staging

    driver = DeferredCopies()
    monkeypatch.setattr(staging, "call", driver)
    monkeypatch.setattr(cu, "cuEventQuery", driver.query)
    pool = staging.PinnedStaging()
    data = [rng.integers(0, 256, int(rng.integers(100, 4096)), dtype=np.uint8) for _ in range(3)]
    dsts = [0x1000, 0x2000, 0x3000]
    pool.upload(data[0].ctypes.data, data[0].nbytes, dsts[0], 7)
    pool.upload(data[1].ctypes.data, data[1].nbytes, dsts[1], 7)  # the first copy still pending
    hosts = [args[1] for args in driver.named("cuMemcpyHtoDAsync")]
    events = [args[0] for args in driver.named("cuEventRecord")]
    assert hosts[0] != hosts[1] and events[0] != events[1] and pool.buffers == 2
    driver.wait(events[0])  # the first copy ran: its buffer may be refilled
    pool.upload(data[2].ctypes.data, data[2].nbytes, dsts[2], 7)
    assert driver.named("cuMemcpyHtoDAsync")[2][1] == hosts[0] and pool.buffers == 2
    driver.wait(driver.named("cuEventRecord")[2][0])
    assert driver.device == {dst: d.tobytes() for dst, d in zip(dsts, data)}
    pool.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(40, dtype=np.uint32),  # writable
        lambda: np.arange(40, dtype=np.uint32)[7:19],  # a view at an offset
        lambda: np.frombuffer(bytes(range(64)), np.uint8),  # read-only
        lambda: np.zeros(0, np.float32),  # empty
        lambda: bytearray(b"abcdef"),
        lambda: memoryview(bytearray(12))[4:],
        lambda: b"read-only bytes",
    ],
    ids=["writable", "offset view", "read-only", "empty", "bytearray", "memoryview", "bytes"],
)
def test_host_view_gives_the_buffers_own_address_and_size(make):
    from gpu_runtime.host_memory import host_view

    host = make()
    arr = host if isinstance(host, np.ndarray) else np.frombuffer(host, np.uint8)
    addr, nbytes, keep = host_view(host)
    assert (addr, nbytes) == (arr.ctypes.data, arr.nbytes)
    assert np.shares_memory(keep, arr) or nbytes == 0
    with pytest.raises(ValueError, match="C-contiguous"):
        host_view(np.arange(40, dtype=np.uint32)[::2])
