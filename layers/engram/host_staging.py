"""``HostStaging``: an Engram lookup whose host-memory tables are read by the host's threads.

The GPU reads random rows of a host table in place at 6-8 GB/s over the real 101 GB footprint
(NOTES-engram.md); the host's own threads read them faster. A staged lookup is five steps in
stream order, all capturable:

1. ``engram_row_ids`` hashes every item and writes its row to ``ids`` on the device (the tables
   are not read), with the call's row count and number in ``ids[0]``;
2. ``ids`` is copied into pinned host memory;
3. a host function posts ``start``: this object's worker thread wakes, reads the call's header
   and wakes its gather threads, each of which gathers its share of each chunk of rows (a range
   of tokens, every layer) into pinned ``staging`` (``np.take`` releases the GIL) and posts; once
   every share of a chunk is in, the worker stamps it with the call's number in ``ready`` and
   posts ``done``;
4. per chunk, a host function waits for ``done`` and the chunk's stamp is copied to the device,
   then 5. ``engram_staged_rows`` dequantises the chunk's rows into ``emb`` (reading ``staging``
   in place over the link), while the gather threads work on the next chunk.

The host functions are libc's ``sem_post`` and ``sem_wait`` on this object's semaphores: the
driver's thread never runs Python, so no thread that holds the GIL while it waits on the driver
can deadlock with it. A chunk read before its stamp (a wait cut short by a signal) is written as
zeros and raises ``DecodeError.STAGING``. Layers whose tables are on the device are read in place
by the second kernel. Queued or captured calls must have run before ``close``.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from gpu_runtime import DeviceCopies, GpuBackend, HostFunctions, MappedHostMemory, PinnedHostMemory, validate

from ..ngram_store.row_block import RowBlock
from ..ops.engram import EngramLaunches
from ..resources import Resources

if TYPE_CHECKING:
    from ..backend_caps import StagingBackend

THREADS_LIMIT = 1024  # gather threads: fewer than this (EngramDecoder's host_threads too)
CHUNKS = 4  # token ranges a call's rows are staged in (the gather of one overlaps the reads of the last)
_SEM_BYTES = 64  # at least sizeof(sem_t) (32 on glibc's 64-bit targets)
_libc = ctypes.CDLL(None, use_errno=True)


def chunk_bounds(rows: int, chunks: int = CHUNKS) -> list[tuple[int, int]]:
    """The token ranges ``[r0, r1)`` of a call of ``rows >= 1`` rows, as the launches and the
    worker both split it: ``min(chunks, rows)`` ranges of near-equal length, in order."""
    n = min(chunks, rows)
    return [(c * rows // n, (c + 1) * rows // n) for c in range(n)]


class _Semaphore:
    """An unnamed POSIX semaphore in memory this object owns; ``address`` is its ``sem_t *``."""

    def __init__(self) -> None:
        self._memory = ctypes.create_string_buffer(_SEM_BYTES)  # malloc'd: 16-byte aligned
        self.address = ctypes.addressof(self._memory)
        if _libc.sem_init(ctypes.c_void_p(self.address), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def post(self) -> None:
        _libc.sem_post(ctypes.c_void_p(self.address))

    def wait(self) -> None:
        """Wait (the GIL released, as every ctypes call does) until posted; again after a signal."""
        while _libc.sem_wait(ctypes.c_void_p(self.address)) != 0:
            if ctypes.get_errno() != 4:  # EINTR
                raise OSError(ctypes.get_errno(), "sem_wait failed")

    def destroy(self) -> None:
        _libc.sem_destroy(ctypes.c_void_p(self.address))


def _function(name: str) -> int:
    return ctypes.cast(getattr(_libc, name), ctypes.c_void_p).value or 0


class HostStaging:
    """Staged lookups over ``launches`` (an ``EngramDecoder``'s) for calls of at most
    ``max_rows`` rows; ``blocks``: each Engram layer's table rows (those in host memory are
    staged, the others read in place); ``threads``: the gather threads, each of which takes a
    share of every chunk. Buffers and threads are registered with ``own`` (released on its
    ``close``)."""

    def __init__(
        self,
        gpu: GpuBackend,
        own: Resources,
        launches: EngramLaunches,
        blocks: Sequence[RowBlock],
        *,
        max_rows: int,
        threads: int,
    ) -> None:
        needs = (HostFunctions, DeviceCopies, PinnedHostMemory, MappedHostMemory)
        if not all(isinstance(gpu, need) for need in needs):
            raise TypeError(
                f"host staging needs host functions, copies and mapped pinned memory, which {type(gpu).__name__} lacks"
            )
        self.gpu = cast("StagingBackend", gpu)
        self.launches = launches
        self.tables = [None if b.host is None else b.host.reshape(-1, b.stride) for b in blocks]  # [rows, stride]
        self.threads = validate.positive(threads, "host staging threads", limit=THREADS_LIMIT)
        layers, cols, stride = launches.layers, launches.cols, launches.stride
        self.max_items = layers * max_rows * cols
        self.staged_layers = sum(1 << i for i, table in enumerate(self.tables) if table is not None)
        self.ids = own.alloc(8 * (1 + self.max_items))
        self.gen = own.alloc(4)
        gpu = self.gpu
        gpu.memset(self.gen, 0, 4)
        self.ids_host = _pinned(gpu, own, 8 * (1 + self.max_items)).view(np.uint64)
        self.staging = _pinned(gpu, own, self.max_items * stride).reshape(self.max_items, stride)
        self.ready = _pinned(gpu, own, 4 * CHUNKS).view(np.uint32)
        self.ready[:] = 0
        self.ready_copy = own.alloc(4 * CHUNKS)  # the stamps as the kernel reads them: every warp does
        self._ids_host_dev = gpu.host_device_ptr(self.ids_host)
        self._staging_dev = gpu.host_device_ptr(self.staging)
        self._ready_dev = gpu.host_device_ptr(self.ready)
        self._post, self._wait = _function("sem_post"), _function("sem_wait")
        self.start, self.done = _Semaphore(), _Semaphore()
        self.error: BaseException | None = None  # the first gather failure (check_errors raises it)
        self._stopping = False
        self._rows = 0  # the rows of the call being staged
        self._go = [_Semaphore() for _ in range(self.threads)]  # one a gather thread: a call to stage
        self._parts = [_Semaphore() for _ in range(CHUNKS)]  # chunk c's: a post a thread, its share staged
        self._worker = threading.Thread(target=self._serve, name="engram-staging", daemon=True)
        self._crew = [
            threading.Thread(target=self._gather_parts, args=(p,), name=f"engram-gather-{p}", daemon=True)
            for p in range(self.threads)
        ]
        for thread in (self._worker, *self._crew):
            thread.start()
        own.on_close(self._stop)

    # -- the stream's side ---------------------------------------------------------------------
    def lookup(
        self, tokens: int, cu_seqlens: int, slots: int, text: int, rows: int, num_seqs: int, per_seq: int, stream: int
    ) -> None:
        """``EngramLaunches.lookup`` (the same arguments, ``rows`` at most ``max_rows``), staged."""
        launches, gpu = self.launches, self.gpu
        launches.row_ids(tokens, cu_seqlens, slots, text, rows, num_seqs, per_seq, self.ids, self.gen, stream)
        gpu.copy_d2d_async(self._ids_host_dev, self.ids, 8 * (1 + launches.layers * rows * launches.cols), stream)
        gpu.launch_host_func(stream, self._post, self.start.address)
        for c, (r0, r1) in enumerate(chunk_bounds(rows)):
            gpu.launch_host_func(stream, self._wait, self.done.address)
            gpu.copy_d2d_async(self.ready_copy + 4 * c, self._ready_dev + 4 * c, 4, stream)
            launches.staged_rows(
                self.ids, self._staging_dev, self.gen, self.ready_copy, rows, r0, r1, c, self.staged_layers, stream
            )

    # -- the host's side -----------------------------------------------------------------------
    def _serve(self) -> None:
        """Each ``start``: wake the gather threads, then per chunk wait for all their parts,
        stamp it and post ``done`` (as many posts as ``lookup`` queued waits)."""
        while True:
            self.start.wait()
            if self._stopping:
                return
            header = int(self.ids_host[0])  # the call's rows and number (engram_row_ids)
            rows, gen = header & 0xFFFFFFFF, header >> 32
            self._rows = rows
            for go in self._go:
                go.post()
            for c in range(len(chunk_bounds(rows))):
                for _ in range(self.threads):
                    self._parts[c].wait()
                if self.error is None:
                    self.ready[c] = gen
                self.done.post()

    def _gather_parts(self, part: int) -> None:
        """Gather thread ``part``: each call, its share of every chunk in order, a post each."""
        while True:
            self._go[part].wait()
            if self._stopping:
                return
            rows = self._rows
            for c, (r0, r1) in enumerate(chunk_bounds(rows)):
                try:
                    if self.error is None:
                        self._take(part, rows, r0, r1)
                except BaseException as exc:  # noqa: BLE001 - kept for check_errors; the stream must go on
                    self.error = self.error or exc
                finally:
                    self._parts[c].post()

    def _take(self, part: int, rows: int, r0: int, r1: int) -> None:
        """Share ``part`` of rows ``r0 .. r1`` of every host layer of a call of ``rows`` rows:
        ``staging[item] = tables[l][ids[1 + item]]`` for ``item = (l * rows + r) * C + j``; a
        kNoRow id (-1 as int64) reads row 0, which the kernel does not use."""
        cols, n = self.launches.cols, self.threads
        for layer, table in enumerate(self.tables):
            if table is None:
                continue
            a, b = (layer * rows + r0) * cols, (layer * rows + r1) * cols
            lo, hi = a + (b - a) * part // n, a + (b - a) * (part + 1) // n
            if hi > lo:
                ids = self.ids_host[1 + lo : 1 + hi].view(np.int64)
                np.take(table, ids, axis=0, out=self.staging[lo:hi], mode="clip")

    def _stop(self) -> None:
        self._stopping = True
        self.start.post()
        for go in self._go:
            go.post()
        for thread in (self._worker, *self._crew):
            thread.join()
        for sem in (self.start, self.done, *self._parts, *self._go):
            sem.destroy()


def _pinned(gpu: StagingBackend, own: Resources, nbytes: int) -> np.ndarray:
    """A mapped pinned uint8 buffer of ``nbytes``, freed with ``own``."""
    array = gpu.alloc_host(nbytes, mapped=True)
    own.on_close(lambda: gpu.free_host(array))
    return array
