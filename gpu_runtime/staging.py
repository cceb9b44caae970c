"""Pinned host staging for ``copy_h2d_async``.

A copy from pageable memory is not truly asynchronous, and the caller may free or overwrite its
buffer as soon as the call returns. So each upload is first copied into a page-locked buffer, the
DMA reads from there, and an event recorded right after the copy marks when the buffer is free
again. Buffers come in power-of-two size classes and are recycled, never freed, until ``close``.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from functools import partial

from cuda.bindings import driver as cu

from .driver import call
from .errors import CudaError, attempt_each

_MIN_CLASS = 4096


def _size_class(nbytes: int) -> int:
    return max(_MIN_CLASS, 1 << (nbytes - 1).bit_length())


class PinnedStaging:
    """A pool of page-locked host buffers, each reused once the stream that read it got past it."""

    def __init__(self) -> None:
        self._free: dict[int, list[int]] = {}
        self._busy: deque[tuple[int, int, int]] = deque()  # (event, size class, host), oldest first
        self._events: list[int] = []
        self._owned: list[int] = []
        self._lock = threading.Lock()

    @property
    def buffers(self) -> int:
        """How many pinned buffers the pool owns (for leak tests)."""
        return len(self._owned)

    def upload(self, src_addr: int, nbytes: int, dst: int, stream: int) -> None:
        """Copy ``nbytes`` at host address ``src_addr`` to device ``dst`` on ``stream``, asynchronously."""
        cls = _size_class(nbytes)
        with self._lock:
            host = self._acquire(cls)
            ctypes.memmove(host, src_addr, nbytes)
            try:
                call(cu.cuMemcpyHtoDAsync, dst, host, nbytes, stream)
            except BaseException:
                self._free.setdefault(cls, []).append(host)  # not queued: nothing reads it
                raise
            event = 0
            try:
                event = (
                    self._events.pop()
                    if self._events
                    else int(call(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
                )
                call(cu.cuEventRecord, event, stream)
            except BaseException:
                if event:
                    self._events.append(event)
                self._untracked(cls, host, stream)
                raise
            self._busy.append((event, cls, host))

    def _untracked(self, cls: int, host: int, stream: int) -> None:
        """A queued copy whose end no event marks: its buffer goes back to the pool only once the
        stream has finished with it, and stays out (freed at close) if even that wait fails."""
        try:
            call(cu.cuStreamSynchronize, stream)
        except CudaError:
            return
        self._free.setdefault(cls, []).append(host)

    def _acquire(self, cls: int) -> int:
        free = self._free.get(cls)
        if not free:
            self._reclaim()
            free = self._free.get(cls)
        if free:
            return free.pop()
        host = int(call(cu.cuMemHostAlloc, cls, 0))
        self._owned.append(host)
        return host

    def _reclaim(self) -> None:
        """Free the buffers whose copies are done, oldest first, stopping at the first pending
        one: uploads complete in issue order on a stream, so this costs O(1) per upload (a
        buffer behind a slower stream's pending copy just waits for a later reclaim)."""
        busy = self._busy
        while busy:
            event, cls, host = busy[0]
            (err,) = cu.cuEventQuery(event)
            if err == cu.CUresult.CUDA_ERROR_NOT_READY:
                return
            if err:
                call(cu.cuEventQuery, event)  # raises with the CUresult named
            busy.popleft()
            self._events.append(event)
            self._free.setdefault(cls, []).append(host)

    def close(self) -> None:
        """Free every buffer and event; the caller has synchronised the context first."""
        with self._lock:
            for event, _, _ in self._busy:
                self._events.append(event)
            releases = [partial(call, cu.cuEventDestroy, e) for e in self._events]
            releases += [partial(call, cu.cuMemFreeHost, h) for h in self._owned]
            try:
                attempt_each(releases, CudaError)  # every one asked for, as the backend's own release
            finally:
                self._free.clear()
                self._busy.clear()
                self._events.clear()
                self._owned.clear()
