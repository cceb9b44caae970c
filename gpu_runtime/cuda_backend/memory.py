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
        self._release_all(cu.cuMemFree, self._allocs)

    def alloc(self, nbytes: int) -> DevicePtr:
        """``cuMemAlloc`` of ``nbytes`` (>= 1), recorded as this backend's until ``free`` or ``close``.
        Raises ``ValueError`` for 0 bytes, ``CudaError`` when the driver fails (out of memory)."""
        nbytes = validate.count(nbytes, "alloc size")
        if nbytes == 0:
            raise ValueError("alloc of 0 bytes")
        self._live()
        ptr = int(call(cu.cuMemAlloc, nbytes, detail=f"{nbytes} bytes"))
        with self._lock:
            self._allocs[ptr] = nbytes
        return DevicePtr(ptr)

    def free(self, ptr: int) -> None:
        """``cuMemFree`` of an address ``alloc`` returned; ``free(0)`` does nothing, even once closed.
        Raises ``ValueError`` for an address this backend did not allocate, or one freed already."""
        if not ptr:  # free(0) does nothing, as C's free(NULL), on a closed backend too
            return
        self._live()
        with self._lock:
            if int(ptr) not in self._allocs:
                raise ValueError(f"free of {DevicePtr(ptr)!r}: not allocated by this backend (or freed twice)")
            del self._allocs[int(ptr)]
        call(cu.cuMemFree, int(ptr))

    def memset(self, ptr: int, byte: int, nbytes: int, stream: int = 0) -> None:
        """Queue ``cuMemsetD8Async``: ``nbytes`` bytes at ``ptr`` set to ``byte`` (0..255) on
        ``stream``. A null ``ptr``, a bad count or stream raise ``TypeError`` / ``ValueError``
        before the driver is called."""
        ptr = validate.pointer(ptr, "memset")
        byte = validate.count(byte, "memset byte", limit=256)
        nbytes = validate.count(nbytes, "memset size")
        stream = validate.stream(stream, "memset stream")
        self._live()
        if nbytes:
            call(cu.cuMemsetD8Async, ptr, byte, nbytes, stream)

    def copy_h2d_async(self, host: Host, dst: int, stream: int = 0) -> None:
        """Upload ``host`` (an array or bytes-like) to ``dst`` on ``stream`` through a pinned staging
        buffer: ``host`` may be reused as soon as this returns."""
        dst = validate.pointer(dst, "copy_h2d_async destination")
        stream = validate.stream(stream, "copy_h2d_async stream")
        addr, nbytes, keep = host_view(host)
        self._live()
        if nbytes:
            self._staging.upload(addr, nbytes, dst, stream)
        del keep

    def copy_d2h(self, host_out: Host, src: int, stream: int = 0) -> None:
        """Fill ``host_out`` (a writable array or buffer) with its size in bytes from ``src``, after the
        work queued on ``stream``; returns once the copy is done (synchronises ``stream``)."""
        src = validate.pointer(src, "copy_d2h source")
        stream = validate.stream(stream, "copy_d2h stream")
        addr, nbytes, keep = host_view(host_out, writable=True)
        self._live()
        if nbytes:
            call(cu.cuMemcpyDtoHAsync, addr, src, nbytes, stream)
            call(cu.cuStreamSynchronize, stream)
        del keep

    def copy_d2d_async(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        """Queue a copy of ``nbytes`` from ``src`` to ``dst`` (device addresses, or the device
        addresses of mapped host memory) on ``stream``."""
        dst = validate.pointer(dst, "copy_d2d_async destination")
        src = validate.pointer(src, "copy_d2d_async source")
        nbytes = validate.count(nbytes, "copy size")
        stream = validate.stream(stream, "copy_d2d_async stream")
        self._live()
        if nbytes:
            call(cu.cuMemcpyAsync, dst, src, nbytes, stream)  # unified addressing: mapped host memory too

    def copy_2d_async(
        self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int = 0
    ) -> None:
        """Queue a device-to-device copy of ``height`` rows of ``width`` bytes, rows ``src_pitch`` /
        ``dst_pitch`` bytes apart, on ``stream``; raises ``ValueError`` for a pitch below ``width``."""
        dst = validate.pointer(dst, "copy_2d_async destination")
        src = validate.pointer(src, "copy_2d_async source")
        width, height = validate.count(width, "copy width"), validate.count(height, "copy height")
        dst_pitch = validate.count(dst_pitch, "dst_pitch")
        src_pitch = validate.count(src_pitch, "src_pitch")
        if dst_pitch < width or src_pitch < width:
            raise ValueError(f"copy_2d_async: pitches ({dst_pitch}, {src_pitch}) below the width {width}")
        stream = validate.stream(stream, "copy_2d_async stream")
        self._live()
        if width and height:
            p = cu.CUDA_MEMCPY2D()
            p.srcMemoryType = p.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
            p.srcDevice, p.srcPitch = src, src_pitch
            p.dstDevice, p.dstPitch = dst, dst_pitch
            p.WidthInBytes, p.Height = width, height
            call(cu.cuMemcpy2DAsync, p, stream)

    def pointer_device(self, ptr: int) -> int | None:
        """The ordinal of the CUDA device ``ptr`` belongs to, or None where the driver knows no
        allocation there (host memory, a stale address)."""
        self._live()
        attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        err, value = cu.cuPointerGetAttribute(attr, int(ptr))
        return int(value) if err == cu.CUresult.CUDA_SUCCESS else None

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes."""
        self._live()
        free, total = call(cu.cuMemGetInfo)
        return int(free), int(total)
