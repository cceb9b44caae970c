"""A host-memory backend that logs every call that allocates, frees, pins, registers, writes or
launches, so a refusal can be shown to have done none of them and a release to have undone all."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpu_runtime import DevicePtr, KernelHandle
from tests.helpers.fakes import MemoryBackend
from tests.helpers.overlay import emulate_rowdiff
from tests.helpers.row_cache import emulate_scatter


class LoggingBackend(MemoryBackend):
    """``MemoryBackend`` that hands out a handle for any kernel (names are unique across our
    modules), emulates ``scatter_rows`` and ``embed_rowdiff_bf16`` (and the kernels in
    ``emulate``), copies 2-D, and logs ``(operation, address)`` for each call that allocates,
    frees, pins, registers, writes or launches. ``fail_alloc_after``: device allocations after
    that many raise ``MemoryError``."""

    def __init__(self, fail_alloc_after: int | None = None,
                 emulate: dict[str, Callable[[MemoryBackend, list], None]] | None = None) -> None:
        super().__init__(module="*", names=[], emulate={
            "scatter_rows": emulate_scatter, "embed_rowdiff_bf16": emulate_rowdiff, **(emulate or {})})
        self.log: list[tuple[str, int]] = []
        self.fail_alloc_after = fail_alloc_after

    def ops(self) -> list[str]:
        """The operations logged, in order, without their addresses."""
        return [op for op, _ in self.log]

    def count(self, operation: str) -> int:
        """How many times ``operation`` ("alloc", "h2d", ...) is in the log."""
        return sum(op == operation for op, _ in self.log)

    def launched(self) -> list[str]:
        """The names of the kernels launched, in order."""
        return [launch["name"] for launch in self.launches]

    def empty(self) -> bool:
        """Nothing allocated, pinned, mapped or registered is left."""
        return not (self.mem or self.host or self.mapped or self.registered)

    def kernel(self, module: str, name: str) -> KernelHandle:
        if name not in self.handles:
            handle = KernelHandle(0x100 + len(self.handles) + 1)
            self.handles[name] = handle
            self.names[int(handle)] = name
        return self.handles[name]

    def alloc(self, nbytes: int) -> DevicePtr:
        if self.fail_alloc_after is not None and self.count("alloc") >= self.fail_alloc_after:
            raise MemoryError("device full (test)")
        ptr = super().alloc(nbytes)
        self.log.append(("alloc", int(ptr)))
        return ptr

    def free(self, ptr: int) -> None:
        self.log.append(("free", int(ptr)))
        super().free(ptr)

    def alloc_host(self, nbytes: int, *, mapped: bool = False) -> np.ndarray:
        array = super().alloc_host(nbytes, mapped=mapped)
        self.log.append(("alloc_host", array.ctypes.data))
        return array

    def free_host(self, array: np.ndarray) -> None:
        self.log.append(("free_host", array.ctypes.data))
        super().free_host(array)

    def register_host(self, array: np.ndarray, *, read_only: bool = True) -> DevicePtr:
        self.log.append(("register_host", array.ctypes.data))
        return super().register_host(array, read_only=read_only)

    def unregister_host(self, array: np.ndarray) -> None:
        self.log.append(("unregister_host", array.ctypes.data))
        super().unregister_host(array)

    def memset(self, ptr, byte, nbytes, stream=0) -> None:
        self.log.append(("memset", int(ptr)))
        super().memset(ptr, byte, nbytes, stream)

    def copy_h2d_async(self, host, dst, stream=0) -> None:
        self.log.append(("h2d", int(dst)))
        super().copy_h2d_async(host, dst, stream)

    def upload_pinned_async(self, host, dst, stream=0) -> None:
        self.log.append(("pinned", int(dst)))
        super().upload_pinned_async(host, dst, stream)

    def copy_2d_async(self, dst, dst_pitch, src, src_pitch, width, height, stream=0) -> None:
        self.log.append(("copy2d", int(dst)))
        for r in range(height):
            row = self.read(src + r * src_pitch, width)
            buf, off = self._find(dst + r * dst_pitch, width)
            buf[off:off + width] = row

    def launch(self, kernel, grid, block, shared_mem, stream, kinds, args, *, overlap=False) -> None:
        self.log.append(("launch", int(kernel)))
        super().launch(kernel, grid, block, shared_mem, stream, kinds, args)
