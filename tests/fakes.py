"""A GpuBackend that records launches and does no GPU work, for CPU tests of launchers."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Sequence

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

    def create_stream(self) -> int:
        return 1

    def launch(self, kernel: KernelHandle, grid: tuple[int, int, int], block: tuple[int, int, int],
               shared_mem: int, stream: int, kinds: str, args: Sequence[int | float]) -> None:
        self.launches.append(Launch(int(kernel), grid, block, shared_mem, stream, kinds, list(args)))

    def kernel_of(self, launch: Launch) -> tuple[str, str]:
        return self.names[launch.kernel]
