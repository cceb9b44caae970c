"""``DeviceBuffer``: one device allocation that frees itself, once.

Layers hold their scratch and weights in these instead of bare pointers, and close them in
reverse order of creation (an ``ExitStack`` does it). A buffer passes wherever a pointer int is
taken (``int(buf)``, ``operator.index``: ``KernelLaunch.arg_ptr``, the backend's copies, a
``Kernel.launch``); once closed, every such use raises ``ClosedError`` instead of handing a
freed address to a kernel.
"""

from __future__ import annotations

from typing import Any

from . import validate
from .backend import GpuBackend, check_backend
from .errors import ClosedError
from .host_memory import Host, host_view
from .pointers import DevicePtr


class DeviceBuffer:
    """``DeviceBuffer(gpu, nbytes)`` allocates ``nbytes`` on ``gpu``; ``close()`` frees them."""

    __slots__ = ("_gpu", "_ptr", "nbytes", "__weakref__")

    def __init__(self, gpu: GpuBackend, nbytes: int) -> None:
        check_backend(gpu, "DeviceBuffer: gpu")
        nbytes = validate.positive(nbytes, "DeviceBuffer size")
        self._gpu = gpu
        self._ptr: DevicePtr | None = None
        self.nbytes = nbytes
        self._ptr = DevicePtr(gpu.alloc(nbytes))

    @classmethod
    def upload(cls, gpu: GpuBackend, array: Host, stream: int = 0) -> DeviceBuffer:
        """A buffer holding a copy of ``array`` (C-contiguous; not empty), queued on ``stream``;
        ``array`` may be reused as soon as this returns."""
        check_backend(gpu, "DeviceBuffer.upload: gpu")
        stream = validate.stream(stream, "DeviceBuffer.upload: stream")
        _, nbytes, _ = host_view(array)
        buf = cls(gpu, nbytes)
        try:
            gpu.copy_h2d_async(array, buf.ptr, stream)
        except BaseException:
            buf.close()
            raise
        return buf

    @property
    def ptr(self) -> DevicePtr:
        """The buffer's device address; ``ClosedError`` once closed."""
        ptr = self._ptr
        if ptr is None:
            raise ClosedError("DeviceBuffer is closed")
        return ptr

    def __index__(self) -> int:
        return int(self.ptr)

    __int__ = __index__

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran (or began): ``ptr`` and ``int(buffer)`` then raise ``ClosedError``."""
        return self._ptr is None

    @property
    def gpu(self) -> GpuBackend:
        """The backend the buffer was allocated on (what an owner of buffers computes on)."""
        return self._gpu

    def close(self, stream: int | None = None) -> None:
        """Free the allocation (once; later calls do nothing). With ``stream``: only after the
        work queued on it so far is done (this waits for it). A closed backend has freed every
        allocation already, so the buffer then only marks itself closed. If waiting fails the
        allocation is left to the backend's own ``close``: the queued work may still use it."""
        if stream is not None:
            stream = validate.stream(stream, "DeviceBuffer.close: stream")
        ptr, self._ptr = self._ptr, None
        if ptr is None or self._gpu.closed:
            return
        if stream is not None:
            self._gpu.synchronize(stream)
        self._gpu.free(ptr)

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._ptr is None:
            return f"DeviceBuffer(closed, {self.nbytes} bytes)"
        return f"DeviceBuffer({self._ptr!r}, {self.nbytes} bytes)"
