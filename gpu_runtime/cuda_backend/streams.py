"""Streams and events the backend creates (and destroys on ``close``)."""

from __future__ import annotations

import ctypes
import functools
from functools import partial
from typing import Any

from cuda.bindings import driver as cu

from .. import validate
from ..driver import call
from ..errors import CudaError, attempt_each
from .context import CudaContext


@functools.cache
def _driver_launch_host_func() -> Any:
    """The driver's own ``cuLaunchHostFunc`` (ctypes releases the GIL around the call)."""
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class CudaStreams(CudaContext):
    _streams: set[int]
    _events: set[int]

    def _init_streams(self) -> None:
        self._streams = set()
        self._events = set()

    def _release_streams(self) -> None:
        attempt_each(  # the events are destroyed even where a stream's destruction was refused
            (
                partial(self._release_all, cu.cuStreamDestroy, self._streams),
                partial(self._release_all, cu.cuEventDestroy, self._events),
            )
        )

    def _own(self, handles: set[int], handle: int) -> int:
        with self._lock:
            handles.add(handle)
        return handle

    def _disown(self, handles: set[int], handle: int, refusal: str) -> None:
        """Take ``handle`` out of ``handles`` before destroying it; ``ValueError(refusal)`` if it
        is not there (not ours, or destroyed already)."""
        with self._lock:
            if handle not in handles:
                raise ValueError(refusal)
            handles.discard(handle)

    # -- streams ----------------------------------------------------------------------------
    def create_stream(self) -> int:
        """A new non-blocking stream (it does not synchronise with the default stream), destroyed by
        ``destroy_stream`` or ``close``."""
        self._live()
        stream = call(cu.cuStreamCreate, cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        return self._own(self._streams, int(stream))

    def destroy_stream(self, stream: int) -> None:
        """Wait for ``stream`` to finish, then destroy it; raises ``ValueError`` for a stream this
        backend did not create (or destroyed already)."""
        self._live()
        self._disown(self._streams, stream, f"stream 0x{stream:x} was not created by this backend")
        call(cu.cuStreamSynchronize, stream)
        call(cu.cuStreamDestroy, stream)

    def synchronize(self, stream: int = 0) -> None:
        """Block the host until the work queued on ``stream`` (0: the default stream) has finished;
        a fault in that work raises ``CudaError``."""
        stream = validate.stream(stream, "synchronize stream")
        self._live()
        call(cu.cuStreamSynchronize, stream)

    # -- events -----------------------------------------------------------------------------
    def create_event(self) -> int:
        """A new event without timing, destroyed by ``destroy_event`` or ``close``."""
        self._live()
        event = call(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        return self._own(self._events, int(event))

    def record_event(self, event: int, stream: int = 0) -> None:
        """Record ``event`` at the current end of ``stream``."""
        stream = validate.stream(stream, "record_event stream")
        self._live()
        call(cu.cuEventRecord, event, stream)

    def wait_event(self, stream: int, event: int) -> None:
        """Make the work queued on ``stream`` from now on wait for ``event`` (on the GPU; the host goes on)."""
        stream = validate.stream(stream, "wait_event stream")
        self._live()
        call(cu.cuStreamWaitEvent, stream, event, 0)

    def launch_host_func(self, stream: int, fn: int, data: int) -> None:
        """Queue the C function ``fn(data)`` (addresses) on ``stream`` (``HostFunctions``).
        Called through ctypes, not cuda.bindings: its wrapper calls ``fn`` from Python with the
        GIL held, which is what a host function here must not need."""
        stream = validate.stream(stream, "launch_host_func stream")
        fn = validate.pointer(fn, "launch_host_func fn")
        data = validate.pointer(data, "launch_host_func data", nullable=True)
        self._live()
        result = _driver_launch_host_func()(stream or None, fn, data or None)
        if result:
            raise CudaError(result, "cuLaunchHostFunc")

    def event_synchronize(self, event: int) -> None:
        """Block the host until the work before ``event``'s last record has finished."""
        self._live()
        call(cu.cuEventSynchronize, event)

    def event_done(self, event: int) -> bool:
        """Whether the work before ``event``'s last record has finished, without waiting; a fault
        raises ``CudaError``."""
        self._live()
        (err,) = cu.cuEventQuery(event)
        if err == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if err:
            raise CudaError(err, "cuEventQuery")
        return True

    def destroy_event(self, event: int) -> None:
        """Destroy ``event``; raises ``ValueError`` for one this backend did not create (or destroyed
        already)."""
        self._live()
        self._disown(self._events, event, f"event 0x{event:x} was not created by this backend (or destroyed twice)")
        call(cu.cuEventDestroy, event)
