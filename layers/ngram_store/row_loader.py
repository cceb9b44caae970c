"""``RowLoader``: how a ``RowCache`` brings missing rows from its table file into its arena."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from gpu_runtime import Events, KernelHandle

from ..ops.row_cache import RowScatter
from ..resources import Resources
from .table_file import TableFile

if TYPE_CHECKING:
    from ..backend_caps import PinnedEventsBackend

_PARALLEL_READ_ROWS = 1024  # below this a thread pool costs more than it saves
_SMALL_LOAD_ROWS = 64  # loads up to this many rows go through the backend's staging


def _align(n: int, to: int = 16) -> int:
    return -(-n // to) * to


class RowLoader:
    """A ``RowCache``'s loads: rows from its table file into two pinned buffers in turn (or, for a
    few rows, the backend's staging), uploaded to a device staging buffer, each chunk scattered
    into its arena slots by one ``RowScatter`` launch, all on one stream."""

    def __init__(
        self,
        gpu: PinnedEventsBackend,
        kernel: KernelHandle,
        file: TableFile,
        arena: int,
        arena_scales: int,
        stream: int,
        chunk_rows: int,
        readers: ThreadPoolExecutor | None,
        threads: int,
    ) -> None:
        self.gpu, self.kernel, self.file, self.stream = gpu, kernel, file, stream
        self.threads = threads
        self.arena, self.arena_scales = arena, arena_scales
        self.chunk_rows, self.readers = chunk_rows, readers
        self.row_bytes = file.row_bytes
        self.scatter = RowScatter(gpu, kernel, arena, arena_scales, file.row_bytes)
        nbytes = self._layout(chunk_rows)[2]
        self.host: list[np.ndarray] = []
        self.events: list[int] = []
        self._resources = own = Resources(gpu)  # released in reverse: each event waited for
        try:  # before its buffer goes, the device staging last
            self.device = own.alloc(nbytes)
            for _ in range(2):
                self.host.append(gpu.alloc_host(nbytes))
                own.on_close(partial(gpu.free_host, self.host[-1]))
                self.events.append(gpu.create_event())
                own.on_close(partial(_wait_and_destroy, gpu, self.events[-1]))
        except BaseException:
            own.close()
            raise
        self.turn = 0

    def _layout(self, n: int) -> tuple[int, int, int]:
        """Offsets of rows and scales, and the end, of a packed chunk of ``n`` rows."""
        rows_at = _align(4 * n)
        scales_at = _align(rows_at + n * self.row_bytes)
        return rows_at, scales_at, scales_at + (4 * n if self.arena_scales else 0)

    def load(self, ids: np.ndarray, slots: np.ndarray) -> float:
        """Queue the loads of rows ``ids`` into ``slots``; returns the seconds spent reading."""
        io = 0.0
        for start in range(0, len(ids), self.chunk_rows):
            chunk_ids, chunk_slots = ids[start : start + self.chunk_rows], slots[start : start + self.chunk_rows]
            n = len(chunk_ids)
            rows_at, scales_at, end = self._layout(n)
            small = n <= _SMALL_LOAD_ROWS
            if small:  # staged by copy_h2d_async, which never waits for the GPU
                buf, event = np.empty(end, np.uint8), None
            else:
                buf, event = self.host[self.turn], self.events[self.turn]
                self.turn ^= 1
                self.gpu.event_synchronize(event)  # the upload that last read this buffer is done
            buf[: 4 * n].view(np.uint32)[:] = chunk_slots
            scales = buf[scales_at:end].view(np.float32) if self.arena_scales else None
            t0 = time.perf_counter()
            self._read(chunk_ids, buf[rows_at : rows_at + n * self.row_bytes].reshape(n, self.row_bytes), scales)
            io += time.perf_counter() - t0
            if small:
                self.gpu.copy_h2d_async(buf[:end], self.device, self.stream)
            else:
                self.gpu.upload_pinned_async(buf[:end], self.device, self.stream)
            dev = self.device  # the chunk: slots, rows, scales
            self.scatter.run(
                dev, dev.offset(rows_at), dev.offset(scales_at) if self.arena_scales else 0, n, self.stream
            )
            if event is not None:
                self.gpu.record_event(event, self.stream)
        return io

    def _read(self, ids: np.ndarray, out: np.ndarray, scales: np.ndarray | None) -> None:
        if self.readers is None or len(ids) < _PARALLEL_READ_ROWS:
            self.file.read_rows(ids, out, scales)
            return
        bounds = np.linspace(0, len(ids), self.threads + 1).astype(int)
        futures = [
            self.readers.submit(self.file.read_rows, ids[a:b], out[a:b], None if scales is None else scales[a:b])
            for a, b in zip(bounds[:-1], bounds[1:])
            if b > a
        ]
        wait(futures)  # every reader done with ``out`` before a failure is raised and the buffer reused
        for future in futures:
            future.result()

    def close(self) -> None:
        self.events, self.host = [], []
        self._resources.close()


def _wait_and_destroy(gpu: Events, event: int) -> None:
    """Release an event after the work it marks (an upload reading a pinned buffer) is done;
    released even where the wait raises (a kernel fault's sticky error)."""
    try:
        gpu.event_synchronize(event)
    finally:
        gpu.destroy_event(event)
