"""GpuBackends without a GPU: ``RecordingBackend`` records launches and does nothing;
``MemoryBackend`` keeps device memory in host arrays and emulates chosen kernels, so host logic
(overlay slots, the row cache) runs end to end in CI."""

from __future__ import annotations

import bisect
import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from gpu_runtime import DevicePtr, GpuBackend, KernelHandle, KernelNotFoundError
from gpu_runtime.gpu import host_view


@dataclass
class Launch:
    kernel: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    stream: int
    kinds: str
    args: list[Any]


@dataclass
class RecordingBackend(GpuBackend):
    """Kernels are named handles 1, 2, ...; ``missing`` names (module, kernel) pairs to refuse."""

    missing: set[tuple[str, str]] = field(default_factory=set)
    launches: list[Launch] = field(default_factory=list)
    handles: dict[tuple[str, str], KernelHandle] = field(default_factory=dict)
    names: dict[int, tuple[str, str]] = field(default_factory=dict)
    ops: list[tuple[Any, ...]] = field(default_factory=list)
    next_ptr: int = 0x10000

    def kernel(self, module: str, name: str) -> KernelHandle:
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

    # Events do nothing here (nothing runs): handles only, not recorded as ops.
    def create_event(self) -> int:
        return 0xE000 + len(self.ops)

    def record_event(self, event: int, stream: int = 0) -> None:
        pass

    def event_synchronize(self, event: int) -> None:
        pass

    def destroy_event(self, event: int) -> None:
        pass

    def create_stream(self) -> int:
        return 1

    def launch(self, kernel: KernelHandle, grid: tuple[int, int, int], block: tuple[int, int, int],
               shared_mem: int, stream: int, kinds: str, args: Sequence[int | float]) -> None:
        self.launches.append(Launch(int(kernel), grid, block, shared_mem, stream, kinds, list(args)))

    def kernel_of(self, launch: Launch) -> tuple[str, str]:
        return self.names[launch.kernel]


class MemoryBackend(GpuBackend):
    """Device memory simulated in host memory (fresh allocations read 0xEE); launches are
    recorded and the kernels named in ``emulate`` run as ``fn(gpu, args)``. Work is done at
    once, so streams and events are no-ops; pinned buffers are ordinary arrays."""

    def __init__(self, module: str, names: Sequence[str],
                 emulate: dict[str, Callable[["MemoryBackend", list], None]] | None = None) -> None:
        self.module = module
        self.mem: dict[int, np.ndarray] = {}
        self.host: dict[int, np.ndarray] = {}
        self.events: set[int] = set()
        self.streams: set[int] = set()
        self.next = 0x7000_0000
        self.launches: list[dict[str, Any]] = []
        self.syncs: list[int] = []
        self.handles = {n: KernelHandle(0x100 + i) for i, n in enumerate(names)}
        self.names = {int(h): n for n, h in self.handles.items()}
        self.emulate = emulate or {}
        self._lock = threading.Lock()  # the row cache's I/O thread launches too

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

    def kernel(self, module: str, name: str) -> KernelHandle:
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

    def launch(self, kernel, grid, block, shared_mem, stream, kinds, args) -> None:
        name = self.names[int(kernel)]
        with self._lock:
            self.launches.append(dict(name=name, grid=grid, block=block, stream=stream, args=list(args)))
            if name in self.emulate:
                self.emulate[name](self, list(args))

    # pinned host memory and events: plain arrays, no-op events (work is done at once)
    def alloc_host(self, nbytes: int) -> np.ndarray:
        array = np.full(nbytes, 0xEE, np.uint8)
        with self._lock:
            self.host[array.ctypes.data] = array
        return array

    def free_host(self, array: np.ndarray) -> None:
        with self._lock:
            assert self.host.pop(array.ctypes.data) is array, "free_host of a foreign or freed buffer"

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
