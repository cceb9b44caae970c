"""Streams and events the backend creates (and destroys on ``close``)."""

from __future__ import annotations

from cuda.bindings import driver as cu

from ..driver import call
from .context import CudaContext


class CudaStreams(CudaContext):
    _streams: set[int]
    _events: set[int]

    def _init_streams(self) -> None:
        self._streams = set()
        self._events = set()

    def _release_streams(self) -> None:
        for stream in list(self._streams):
            call(cu.cuStreamDestroy, stream)
        for event in list(self._events):
            call(cu.cuEventDestroy, event)
        self._streams.clear()
        self._events.clear()

    # -- streams ----------------------------------------------------------------------------
    def create_stream(self) -> int:
        self._live()
        stream = int(call(cu.cuStreamCreate, cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        with self._lock:
            self._streams.add(stream)
        return stream

    def destroy_stream(self, stream: int) -> None:
        self._live()
        with self._lock:
            if stream not in self._streams:
                raise ValueError(f"stream 0x{stream:x} was not created by this backend")
            self._streams.discard(stream)
        call(cu.cuStreamSynchronize, stream)
        call(cu.cuStreamDestroy, stream)

    def synchronize(self, stream: int = 0) -> None:
        self._live()
        call(cu.cuStreamSynchronize, stream)

    # -- events -----------------------------------------------------------------------------
    def create_event(self) -> int:
        self._live()
        event = int(call(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        with self._lock:
            self._events.add(event)
        return event

    def record_event(self, event: int, stream: int = 0) -> None:
        self._live()
        call(cu.cuEventRecord, event, stream)

    def wait_event(self, stream: int, event: int) -> None:
        self._live()
        call(cu.cuStreamWaitEvent, stream, event, 0)

    def event_synchronize(self, event: int) -> None:
        self._live()
        call(cu.cuEventSynchronize, event)

    def destroy_event(self, event: int) -> None:
        self._live()
        with self._lock:
            if event not in self._events:
                raise ValueError(f"event 0x{event:x} was not created by this backend (or destroyed twice)")
            self._events.discard(event)
        call(cu.cuEventDestroy, event)
