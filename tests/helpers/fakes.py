"""GpuBackends without a GPU: ``RecordingBackend`` records launches and does nothing;
``MemoryBackend`` keeps device memory in host arrays and emulates chosen kernels, so host logic
(overlay slots, the row cache) runs end to end in CI.

Both bind kernels (``bind``) to a ``Kernel`` whose launch checks its arguments as
``CudaBackend``'s does (by the signature read from the kernel's ``.cu``) and then hands the plain
values to the backend's ``launch``, which records them.

``refused``: a block that must raise before it records anything on a ``RecordingBackend``."""

from __future__ import annotations

import bisect
import ctypes
import struct
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pytest

from gpu_runtime import (LaunchConfig, validate, ClosedError, DevicePtr, Events, GpuBackend, GpuError, Kernel, KernelHandle,
                         KernelNotFoundError, MappedHostMemory, PinnedHostMemory, PitchedCopies, PreparedLaunch)
from gpu_runtime.host_memory import host_view
from gpu_runtime.signatures import Signature, module_signatures, parse_signatures
from layers.kernel_files import kernel_dir


def kernel_signature(module: str, name: str, sources: dict[str, str] | None = None) -> tuple[str, Signature]:
    """Kernel ``name``'s module and signature: from ``sources[module]`` (a test's own ``.cu``
    text) where given, else from ``kernels/<module>.cu``, else from whichever kernel module has it."""
    if sources and module in sources:
        return module, parse_signatures(sources[module])[name]
    path = kernel_dir() / f"{module}.cu"
    if path.is_file() and name in module_signatures(path):
        return module, module_signatures(path)[name]
    for other in sorted(kernel_dir().glob("*.cu")):
        if name in module_signatures(other):
            return other.stem, module_signatures(other)[name]
    raise KernelNotFoundError(f"{module}.{name}: no such kernel in the kernel sources")


def recorded_kernel(gpu: Any, handle: KernelHandle, module: str, name: str,
                    sources: dict[str, str] | None = None) -> Kernel:
    """A ``Kernel`` whose launch checks as ``CudaBackend``'s and then records through
    ``gpu.launch(handle, grid, block, shared_mem, stream, kinds, values, overlap=...)``."""
    module, signature = kernel_signature(module, name, sources)
    kernel = Kernel(gpu, handle, f"{module}.{name}", signature)

    def check(config, stream, args):  # what CudaBackend's launch checks, refused as it refuses
        if not isinstance(config, LaunchConfig):
            raise TypeError(f"{kernel.name}: config must be a gpu_runtime.LaunchConfig, got {type(config).__name__}")
        stream = validate.stream(stream, f"{kernel.name}: stream")
        try:
            kernel.layout.packer.pack(*args)
        except (struct.error, TypeError, ValueError, OverflowError):
            raise kernel.layout.refusal(kernel.name, args) from None
        values = [float(a) if k == "F" else bytes(a) if k == "T" else int(a) for k, a in zip(kernel.layout.kinds, args)]
        return stream, values

    def launch(config, stream, *args):
        stream, values = check(config, stream, args)
        gpu.launch(handle, config.grid, config.block, config.shared_mem, stream, kernel.layout.kinds, values,
                   overlap=config.overlap)

    def prepare(config, *args):
        check(config, 0, args)
        prepared = PreparedLaunch(kernel, config, args)
        prepared.run = lambda stream: launch(config, stream, *args)
        return prepared

    kernel.launch, kernel.prepare = launch, prepare
    return kernel


def bind_recorded(gpu: Any, kernel: Any, bound: dict[int, Kernel], names: dict[int, tuple[str, str]],
                  sources: dict[str, str] | None = None) -> Kernel:
    """A fake backend's ``bind``: refused as ``CudaBackend`` refuses, made once per handle."""
    if gpu.closed:
        raise ClosedError("backend is closed")
    if isinstance(kernel, bool) or not isinstance(kernel, int):
        raise TypeError(f"bind: kernel must be a KernelHandle, got {type(kernel).__name__}")
    if not kernel:
        raise ValueError("bind: null kernel handle (the kernel was not loaded)")
    if int(kernel) not in names:
        raise GpuError(f"kernel handle 0x{int(kernel):x}: not loaded by this backend")
    if int(kernel) not in bound:
        bound[int(kernel)] = recorded_kernel(gpu, KernelHandle(kernel), *names[int(kernel)], sources)
    return bound[int(kernel)]


@dataclass
class Launch:
    kernel: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    stream: int
    kinds: str
    args: list[Any]
    overlap: bool = False  # a programmatic dependent launch


@dataclass
class RecordingBackend(GpuBackend, PinnedHostMemory, MappedHostMemory, Events, PitchedCopies):
    """Kernels are named handles 1, 2, ...; ``missing`` names (module, kernel) pairs to refuse.
    ``kernel`` takes a source path or a bare module name; both record the module name."""

    missing: set[tuple[str, str]] = field(default_factory=set)
    launches: list[Launch] = field(default_factory=list)
    handles: dict[tuple[str, str], KernelHandle] = field(default_factory=dict)
    names: dict[int, tuple[str, str]] = field(default_factory=dict)
    ops: list[tuple[Any, ...]] = field(default_factory=list)
    next_ptr: int = 0x10000
    closed: bool = False
    sources: dict[str, str] = field(default_factory=dict)  # module -> .cu text of a test's own kernels
    bound: dict[int, Kernel] = field(default_factory=dict)

    def bind(self, kernel: KernelHandle) -> Kernel:
        return bind_recorded(self, kernel, self.bound, self.names, self.sources)

    def kernel(self, source: Any, name: str) -> KernelHandle:
        module = Path(source).stem
        if (module, name) in self.missing or (module, "*") in self.missing:
            raise KernelNotFoundError(f"{module}.{name}")
        if (module, name) not in self.handles:
            handle = KernelHandle(len(self.handles) + 1)
            self.handles[(module, name)] = handle
            self.names[int(handle)] = (module, name)
        return self.handles[(module, name)]

    def alloc(self, nbytes: int) -> DevicePtr:
        ptr = self.next_ptr
        self.next_ptr += (nbytes + 255) // 256 * 256 + 256
        self.ops.append(("alloc", ptr, nbytes))
        return DevicePtr(ptr)

    def free(self, ptr: int) -> None:
        self.ops.append(("free", ptr))

    def memset(self, ptr: int, byte: int, nbytes: int, stream: int = 0) -> None:
        self.ops.append(("memset", ptr, byte, nbytes, stream))

    def copy_h2d_async(self, host: Any, dst: int, stream: int = 0) -> None:
        addr, nbytes, _keep = host_view(host)
        self.ops.append(("h2d", ctypes.string_at(addr, nbytes), dst, stream))

    def copy_d2h(self, host_out: Any, src: int, stream: int = 0) -> None:
        self.ops.append(("d2h", src, stream))

    def synchronize(self, stream: int = 0) -> None:
        self.ops.append(("sync", stream))

    def copy_2d_async(self, dst, dst_pitch, src, src_pitch, width, height, stream=0) -> None:
        self.ops.append(("copy2d", dst, dst_pitch, src, src_pitch, width, height, stream))

    # Pinned and mapped host memory: real arrays; mapped ones and registrations get fake device
    # addresses from the same counter as alloc (recorded as ops, so a refusal shows none ran).
    host_mapped: dict[int, tuple[int, int]] = field(default_factory=dict)  # host addr -> (bytes, dev)
    registered: dict[int, tuple[int, int]] = field(default_factory=dict)  # host addr -> (bytes, dev)
    host_arrays: list[np.ndarray] = field(default_factory=list)  # alloc_host's, kept alive

    def _fake_dev(self, nbytes: int) -> int:
        ptr = self.next_ptr
        self.next_ptr += (nbytes + 255) // 256 * 256 + 256
        return ptr

    def alloc_host(self, nbytes: int, *, mapped: bool = False) -> np.ndarray:
        array = np.zeros(nbytes, np.uint8)
        self.ops.append(("alloc_host", nbytes, mapped))
        if mapped:
            self.host_mapped[array.ctypes.data] = (nbytes, self._fake_dev(nbytes))
        self.host_arrays.append(array)
        return array

    def free_host(self, array: np.ndarray) -> None:
        self.host_mapped.pop(array.ctypes.data, None)
        self.ops.append(("free_host", array.ctypes.data))

    def upload_pinned_async(self, host: np.ndarray, dst: int, stream: int = 0) -> None:
        self.ops.append(("h2d", host.tobytes(), dst, stream))

    def host_device_ptr(self, array: np.ndarray) -> DevicePtr:
        addr = array.ctypes.data
        for base, (size, dev) in [*self.host_mapped.items(), *self.registered.items()]:
            if base <= addr and addr + array.nbytes <= base + size:
                return DevicePtr(dev + addr - base)
        raise ValueError(f"host_device_ptr of 0x{addr:x}: not mapped")

    def register_host(self, array: np.ndarray, *, read_only: bool = True) -> DevicePtr:
        addr = array.ctypes.data
        self.ops.append(("register_host", addr, array.nbytes, read_only))
        self.registered[addr] = (array.nbytes, self._fake_dev(array.nbytes))
        return self.host_device_ptr(array)

    def unregister_host(self, array: np.ndarray) -> None:
        addr = array.ctypes.data
        assert self.registered.pop(addr)[0] == array.nbytes, "unregister of another size"
        self.ops.append(("unregister_host", addr))

    # Events do nothing here (nothing runs): handles only, not recorded as ops.
    def create_event(self) -> int:
        return 0xE000 + len(self.ops)

    def record_event(self, event: int, stream: int = 0) -> None:
        pass

    def wait_event(self, stream: int, event: int) -> None:
        pass

    def event_synchronize(self, event: int) -> None:
        pass

    def event_done(self, event: int) -> bool:
        return True

    def destroy_event(self, event: int) -> None:
        pass

    def create_stream(self) -> int:
        return 1

    def launch(self, kernel: KernelHandle, grid: tuple[int, int, int], block: tuple[int, int, int],
               shared_mem: int, stream: int, kinds: str, args: Sequence[int | float], *,
               overlap: bool = False) -> None:
        self.launches.append(Launch(int(kernel), grid, block, shared_mem, stream, kinds, list(args),
                                    overlap))

    def kernel_of(self, launch: Launch) -> tuple[str, str]:
        return self.names[launch.kernel]


@contextmanager
def refused(gpu: RecordingBackend, error: type[BaseException], match: str):
    """The block must raise ``error`` (its message matching ``match``) before it launches
    anything or touches device memory: ``gpu``'s records, cleared first, stay empty."""
    gpu.launches.clear()
    gpu.ops.clear()
    with pytest.raises(error, match=match):
        yield
    assert gpu.launches == [] and gpu.ops == []


class MemoryBackend(GpuBackend, PinnedHostMemory, MappedHostMemory, Events):
    """Device memory simulated in host memory (fresh allocations read 0xEE); launches are
    recorded and the kernels named in ``emulate`` run as ``fn(gpu, args)``. Work is done at
    once, so streams and events are no-ops; pinned buffers are ordinary arrays. It is never
    closed (a test may set ``closed`` to see what looks at it)."""

    closed = False

    def __init__(self, module: str, names: Sequence[str],
                 emulate: dict[str, Callable[["MemoryBackend", list], None]] | None = None,
                 sources: dict[str, str] | None = None) -> None:
        self.module = module
        self.sources = sources
        self.mem: dict[int, np.ndarray] = {}
        self.host: dict[int, np.ndarray] = {}
        self.mapped: dict[int, tuple[int, int]] = {}  # host addr -> (fake device addr, bytes)
        self.registered: dict[int, tuple[int, bool]] = {}  # host addr -> (bytes, read_only)
        self.events: set[int] = set()
        self.streams: set[int] = set()
        self.next = 0x7000_0000
        self.launches: list[dict[str, Any]] = []
        self.syncs: list[int] = []
        self.handles = {n: KernelHandle(0x100 + i) for i, n in enumerate(names)}
        self.names = {int(h): n for n, h in self.handles.items()}
        self.emulate = emulate or {}
        self._lock = threading.Lock()  # the row cache's I/O thread launches too
        self._bound: dict[int, Kernel] = {}

    def bind(self, kernel: KernelHandle) -> Kernel:
        names = {handle: (self.module, name) for handle, name in self.names.items()}
        return bind_recorded(self, kernel, self._bound, names, self.sources)

    def _find(self, ptr: int, nbytes: int) -> tuple[np.ndarray, int]:
        bases = sorted(self.mem)
        i = bisect.bisect_right(bases, int(ptr)) - 1
        if i < 0:
            raise AssertionError(f"access to unallocated 0x{int(ptr):x}")
        base = bases[i]
        buf = self.mem[base]
        off = int(ptr) - base
        if off + nbytes > buf.size:
            raise AssertionError(f"access past allocation 0x{base:x}+{buf.size}: {off}+{nbytes}")
        return buf, off

    def read(self, ptr: int, nbytes: int) -> np.ndarray:
        buf, off = self._find(ptr, nbytes)
        return buf[off:off + nbytes].copy()

    def read_as(self, ptr: int, count: int, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        return self.read(ptr, count * dtype.itemsize).view(dtype)

    def kernel(self, source: Any, name: str) -> KernelHandle:
        module = Path(source).stem
        if module != self.module or name not in self.handles:
            raise KernelNotFoundError(f"{module}.{name}")
        return self.handles[name]

    def alloc(self, nbytes: int) -> DevicePtr:
        assert nbytes > 0
        with self._lock:
            ptr = self.next
            self.mem[ptr] = np.full(nbytes, 0xEE, np.uint8)
            self.next += (nbytes + 0xFFFF) & ~0xFFF
        return DevicePtr(ptr)

    def free(self, ptr: int) -> None:
        if ptr:
            assert int(ptr) in self.mem, f"free of 0x{int(ptr):x}: not allocated (or freed twice)"
            assert all(int(ptr) != dev for dev, _ in self.mapped.values()), \
                f"free of 0x{int(ptr):x}: mapped host memory (free_host / unregister_host it)"
            del self.mem[int(ptr)]

    def memset(self, ptr, byte, nbytes, stream=0) -> None:
        buf, off = self._find(ptr, nbytes)
        buf[off:off + nbytes] = byte

    def copy_h2d_async(self, host, dst, stream=0) -> None:
        data = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
        buf, off = self._find(dst, data.size)
        buf[off:off + data.size] = data

    def copy_d2h(self, host_out, src, stream=0) -> None:
        out = host_out.view(np.uint8).reshape(-1)
        out[:] = self.read(src, out.size)

    def synchronize(self, stream=0) -> None:
        self.syncs.append(stream)

    def create_stream(self) -> int:
        stream = 0x5000 + len(self.streams) + 1
        self.streams.add(stream)
        return stream

    def destroy_stream(self, stream: int) -> None:
        self.streams.remove(stream)

    def launch(self, kernel, grid, block, shared_mem, stream, kinds, args, *, overlap=False) -> None:
        name = self.names[int(kernel)]
        with self._lock:
            self.launches.append(dict(name=name, grid=grid, block=block, stream=stream, args=list(args)))
            if name in self.emulate:
                self.emulate[name](self, list(args))

    # pinned host memory and events: plain arrays, no-op events (work is done at once). A mapped
    # buffer or registered array is also put in the fake device space (``mem``) at an address of
    # its own, as a view of the same memory: emulated kernels read it there, as the GPU reads a
    # mapped host table in place; ``free`` refuses those addresses.
    def alloc_host(self, nbytes: int, *, mapped: bool = False) -> np.ndarray:
        assert isinstance(mapped, bool)
        array = np.full(nbytes, 0xEE, np.uint8)
        with self._lock:
            self.host[array.ctypes.data] = array
            if mapped:
                self._map(array.ctypes.data, array)
        return array

    def free_host(self, array: np.ndarray) -> None:
        with self._lock:
            assert self.host.pop(array.ctypes.data) is array, "free_host of a foreign or freed buffer"
            self._unmap(array.ctypes.data)

    def _map(self, addr: int, array: np.ndarray) -> int:
        flat = array.reshape(-1).view(np.uint8)  # a view: writes through the host array show
        ptr = self.next
        self.mem[ptr] = flat
        self.next += (flat.size + 0xFFFF) & ~0xFFF
        self.mapped[addr] = (ptr, flat.size)
        return ptr

    def _unmap(self, addr: int) -> None:
        entry = self.mapped.pop(addr, None)
        if entry is not None:
            del self.mem[entry[0]]

    def host_device_ptr(self, array: np.ndarray) -> DevicePtr:
        addr, nbytes = array.ctypes.data, array.nbytes
        with self._lock:
            for base, (ptr, size) in self.mapped.items():
                if base <= addr and addr + nbytes <= base + size:
                    return DevicePtr(ptr + addr - base)
        raise ValueError(f"host_device_ptr of 0x{addr:x}: not inside a mapped alloc_host buffer "
                         "or a register_host range")

    def register_host(self, array: np.ndarray, *, read_only: bool = True) -> DevicePtr:
        assert isinstance(array, np.ndarray) and array.flags.c_contiguous and array.nbytes > 0
        assert array.ctypes.data % 4096 == 0, "register_host of an unaligned array"
        with self._lock:
            assert array.ctypes.data not in self.mapped, "registered twice"
            self.registered[array.ctypes.data] = (array.nbytes, read_only)
            self._map(array.ctypes.data, array)
        return self.host_device_ptr(array)

    def unregister_host(self, array: np.ndarray) -> None:
        with self._lock:
            entry = self.registered.pop(array.ctypes.data, None)
            assert entry is not None and entry[0] == array.nbytes, "unregister of a foreign range"
            self._unmap(array.ctypes.data)

    def upload_pinned_async(self, host: np.ndarray, dst: int, stream: int = 0) -> None:
        with self._lock:
            pinned = list(self.host.values())
        assert any(np.shares_memory(host, buf) for buf in pinned), "not a pinned buffer"
        self.copy_h2d_async(host, dst, stream)

    def create_event(self) -> int:
        with self._lock:
            event = 0x9000 + len(self.events) + 1
            while event in self.events:
                event += 1
            self.events.add(event)
        return event

    def destroy_event(self, event: int) -> None:
        with self._lock:
            self.events.remove(event)

    def record_event(self, event: int, stream: int = 0) -> None:
        assert event in self.events

    def wait_event(self, stream: int, event: int) -> None:
        assert event in self.events

    def event_synchronize(self, event: int) -> None:
        assert event in self.events

    def event_done(self, event: int) -> bool:
        assert event in self.events
        return True


class ForeignArray:
    """Another library's device array as the layers see it: only ``__cuda_array_interface__``
    (v3) over ``ptr`` (CuPy, Numba and torch export this)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, readonly: bool = False,
                 strides: tuple[int, ...] | None = None) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (int(ptr), readonly),
                                         "version": 3, "strides": strides, "stream": None}
