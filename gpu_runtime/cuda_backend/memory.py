"""Device memory: allocations the backend owns, memsets and copies.

Uploads go through pinned staging (``staging.py``), so the caller may reuse its host buffer as
soon as ``copy_h2d_async`` returns.
"""

from __future__ import annotations

from cuda.bindings import driver as cu

from .. import validate
from ..driver import call
from ..host_memory import Host, host_view
from ..pointers import DevicePtr
from ..staging import PinnedStaging
from .context import CudaContext


class CudaMemory(CudaContext):
    _allocs: dict[int, int]  # address -> bytes
    _staging: PinnedStaging

    def _init_memory(self) -> None:
        self._allocs = {}
        self._staging = PinnedStaging()

    def _release_memory(self) -> None:
        for ptr in list(self._allocs):
            call(cu.cuMemFree, ptr)
        self._allocs.clear()

    def alloc(self, nbytes: int) -> DevicePtr:
        nbytes = _size(nbytes, "alloc size")
        if nbytes == 0:
            raise ValueError("alloc of 0 bytes")
        self._live()
        ptr = int(call(cu.cuMemAlloc, nbytes, detail=f"{nbytes} bytes"))
        with self._lock:
            self._allocs[ptr] = nbytes
        return DevicePtr(ptr)

    def free(self, ptr: int) -> None:
        if not ptr:
            return
        self._live()
        with self._lock:
            if int(ptr) not in self._allocs:
                raise ValueError(f"free of {DevicePtr(ptr)!r}: not allocated by this backend (or freed twice)")
            del self._allocs[int(ptr)]
        call(cu.cuMemFree, int(ptr))

    def allocation_size(self, ptr: int) -> int | None:
        """Size of the allocation that starts at ``ptr``, None if it is not one of ours.

        To be removed: its one caller left is a check in tests/test_host_tables.py."""
        return self._allocs.get(int(ptr))

    def memset(self, ptr: int, byte: int, nbytes: int, stream: int = 0) -> None:
        ptr = validate.pointer(ptr, "memset")
        byte = _size(byte, "memset byte", limit=256)
        nbytes = _size(nbytes, "memset size")
        if nbytes:
            self._live()
            call(cu.cuMemsetD8Async, ptr, byte, nbytes, stream)

    def copy_h2d_async(self, host: Host, dst: int, stream: int = 0) -> None:
        dst = validate.pointer(dst, "copy_h2d_async destination")
        addr, nbytes, keep = host_view(host)
        if nbytes:
            self._live()
            self._staging.upload(addr, nbytes, dst, stream)
        del keep

    def copy_d2h(self, host_out: Host, src: int, stream: int = 0) -> None:
        src = validate.pointer(src, "copy_d2h source")
        addr, nbytes, keep = host_view(host_out, writable=True)
        if nbytes:
            self._live()
            call(cu.cuMemcpyDtoHAsync, addr, src, nbytes, stream)
            call(cu.cuStreamSynchronize, stream)
        del keep

    def copy_d2d_async(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        dst = validate.pointer(dst, "copy_d2d_async destination")
        src = validate.pointer(src, "copy_d2d_async source")
        nbytes = _size(nbytes, "copy size")
        if nbytes:
            self._live()
            call(cu.cuMemcpyDtoDAsync, dst, src, nbytes, stream)

    def copy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                      height: int, stream: int = 0) -> None:
        dst = validate.pointer(dst, "copy_2d_async destination")
        src = validate.pointer(src, "copy_2d_async source")
        width, height = _size(width, "copy width"), _size(height, "copy height")
        dst_pitch, src_pitch = _size(dst_pitch, "dst_pitch"), _size(src_pitch, "src_pitch")
        if dst_pitch < width or src_pitch < width:
            raise ValueError(f"copy_2d_async: pitches ({dst_pitch}, {src_pitch}) below the width {width}")
        if width and height:
            self._live()
            p = cu.CUDA_MEMCPY2D()
            p.srcMemoryType = p.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
            p.srcDevice, p.srcPitch = src, src_pitch
            p.dstDevice, p.dstPitch = dst, dst_pitch
            p.WidthInBytes, p.Height = width, height
            call(cu.cuMemcpy2DAsync, p, stream)

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes."""
        self._live()
        free, total = call(cu.cuMemGetInfo)
        return int(free), int(total)


def _size(value: object, what: str, *, limit: int | None = None) -> int:
    """``validate.count``, except that a non-integer stays the ``ValueError`` (and message) it
    was before the one policy, which the bad-input matrix expects; to become ``validate.count``
    itself once the matrix moves to ``TypeError``."""
    try:
        return validate.count(value, what, limit=limit)
    except TypeError:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}") from None
