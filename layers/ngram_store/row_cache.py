"""``RowCache``: an n-gram table kept on disk (a table file), its hot rows in a device arena; the
seed's ``NgramTable::Cached(cache)``.

``resolve(ids, slots_out)`` maps a batch's ids to arena slots, loading the missing rows (read from
the file's memory map, uploaded in chunks of at most ``chunk_rows`` rows, each scattered into its
slots by one ``scatter_rows`` launch); the gather then reads ``table_dev_va()`` (and
``scale_dev_va()`` for fp8) at those slots; ``end_batch()`` lets the batch's rows be evicted.
``prefetch(ids)`` starts the kernel's readahead of a later batch's rows and returns at once. The
fused layer resolves all its caches through one ``CacheGroup`` (``cache_group.py``); a cache in a
group still works alone.

Every upload and scatter runs on the ``stream`` given at construction, which must be the stream
the gathers run on (the layer's stream): loads and gathers are then ordered, and a slot is never
overwritten before the gathers queued earlier have read it. Design: docs/design_notes.md.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar, Protocol, cast

import numpy as np

from gpu_runtime import DevicePtr, Events, GpuBackend, PinnedHostMemory, validate
from gpu_runtime.backend import check_backend

from ..kernel_files import load_kernel
from ..resources import Resources
from .row_loader import RowLoader
from .slot_index import SlotIndex, refuse_slots_out
from .table_file import TableFile

if TYPE_CHECKING:
    from ..backend_caps import PinnedEventsBackend

_log = logging.getLogger(__name__)


@dataclass
class CacheStats:
    """Counters since construction. ``misses`` counts the rows ``resolve`` loaded, ``hits``
    the other ids it was given (repeats included), so ``hits + misses`` is every id resolved;
    ``rows_read = misses``; ``bytes_read`` includes fp8 scales."""

    hits: int = 0
    misses: int = 0
    prefetched: int = 0  # rows ``prefetch`` asked the kernel to read ahead
    rows_read: int = 0
    bytes_read: int = 0
    io_seconds: float = 0.0  # reading rows from the file into host memory
    evictions: int = 0


class GroupOfCaches(Protocol):
    """What a ``RowCache`` asks of the ``CacheGroup`` it belongs to (``cache_group.py``)."""

    def flush_stats(self) -> None:
        """Credit the group's all-hit steps to its members' counters."""

    def member_closed(self) -> None:
        """One of its caches was closed: the group stops serving."""


class RowCache:
    """A ``RowSource`` over a table file (``layers.ngram_store.table_file``).

    ``capacity`` rows (and, for fp8 tables, their scales) are resident in a device arena;
    ``chunk_rows`` bounds the pinned and device staging of one load; ``io_threads`` read large
    loads in parallel (1 reads on the calling thread only).
    """

    # A resolve whose misses are over miss_warn_fraction of its ids and at least miss_warn_rows rows (a cache
    # too small for the traffic, or a cold cache's first prefill) logs a WARNING on this module's logger, at
    # most once per miss_warn_seconds across every cache (set them on the class or on one cache).
    miss_warn_fraction: float = 0.5
    miss_warn_rows: int = 64
    miss_warn_seconds: float = 60.0
    _miss_warned_at: ClassVar[float] = float("-inf")

    def __init__(
        self,
        gpu: GpuBackend,
        path: str | os.PathLike,
        capacity: int,
        *,
        stream: int = 0,
        chunk_rows: int = 8192,
        io_threads: int = 16,
    ) -> None:
        check_backend(gpu, "RowCache: gpu")
        stream = validate.stream(stream, "RowCache: stream")
        capacity = validate.positive(capacity, "RowCache: capacity", limit=1 << 31)  # the slot index's
        chunk_rows = validate.positive(chunk_rows, "RowCache: chunk_rows")
        io_threads = validate.positive(io_threads, "RowCache: io_threads")
        if not (isinstance(gpu, PinnedHostMemory) and isinstance(gpu, Events)):
            raise TypeError(
                f"RowCache: the backend needs pinned host memory and events "
                f"(gpu_runtime.PinnedHostMemory, Events); {type(gpu).__name__} lacks them"
            )
        self.file = TableFile(path)
        self.gpu = gpu = cast("PinnedEventsBackend", gpu)  # the capabilities checked just above
        self.stream = stream
        self.rows, self.dim, self.dtype = self.file.rows, self.file.dim, self.file.dtype
        self.capacity = min(capacity, self.rows)
        self._stats = CacheStats()
        try:
            self.index = SlotIndex(self.rows, self.capacity)  # 4 bytes a row of the table: may not fit
        except BaseException:
            self.file.close()  # nothing else is made yet
            raise
        self._group: GroupOfCaches | None = None  # the CacheGroup whose index store this cache's index lives in, if any
        self._arena_scales = DevicePtr(0)
        self._readers = ThreadPoolExecutor(io_threads, "rowcache-read") if io_threads > 1 else None
        self._resources = own = Resources(gpu)  # the arena, then the loader's staging
        self.closed = False
        try:
            self.kernel = load_kernel(gpu, "row_cache", "scatter_rows")
            # Zeroed once: a slot never loaded then reads as zeros, not as whatever was there.
            self._arena = own.alloc(self.capacity * self.file.row_bytes)
            gpu.memset(self._arena, 0, self.capacity * self.file.row_bytes, stream)
            if self.file.scales is not None:
                self._arena_scales = own.alloc(self.capacity * 4)
                gpu.memset(self._arena_scales, 0, self.capacity * 4, stream)
            chunk = min(chunk_rows, self.capacity)
            loader = RowLoader(
                gpu, self.kernel, self.file, self._arena, self._arena_scales, stream, chunk, self._readers, io_threads
            )
            self._loader = own.adopt(loader)
            # Released first: the gathers queued on the stream may still read the arena.
            own.on_close(partial(gpu.synchronize, stream))
        except BaseException:
            self.close()
            raise

    # -- the RowSource protocol -----------------------------------------------------------------
    def resolve(self, ids: np.ndarray, slots_out: np.ndarray) -> None:
        """Make the rows of ``ids`` resident and pinned until ``end_batch``; ``slots_out[i]``
        (uint32, same length) gets the arena slot of ``ids[i]``. Raises ``ValueError``, before
        loading anything, for ids >= rows and batches needing more rows resident than the arena
        holds."""
        ids = self._check_ids(ids, "resolve")
        if not (
            isinstance(slots_out, np.ndarray)
            and slots_out.dtype == np.uint32
            and slots_out.shape == ids.shape
            and slots_out.flags.writeable
        ):
            refuse_slots_out("RowCache.resolve", slots_out, ids.shape)
        if ids.size == 1:  # a decode step: scalar operations only
            slot = int(self.index.slot_of[ids[0]])
            if slot >= 0:
                self.index.pin_one(slot)
                slots_out[0] = slot
                self._stats.hits += 1
                return
        elif ids.size == 0:
            return
        index = self.index
        uniq, inverse = np.unique(ids, return_inverse=True)
        slots = index.slot_of[uniq].astype(np.int64)
        hit = slots >= 0
        self._require_room(slots, hit)
        index.pin(slots[hit])  # before assigning: the batch's hits must not be evicted for its misses
        missing = uniq[~hit]
        if len(missing):
            new = index.assign(missing)
            try:
                io = self._loader.load(missing, new)
            except BaseException:
                index.forget(new)
                raise
            slots[~hit] = new
            index.pin(new)
            stats = self._stats
            stats.rows_read += len(missing)
            stats.bytes_read += len(missing) * (self.file.row_bytes + (4 if self._arena_scales else 0))
            stats.io_seconds += io
            if len(missing) >= self.miss_warn_rows and len(missing) > self.miss_warn_fraction * ids.size:
                self._warn_misses(len(missing), ids.size, io)
        slots_out[:] = slots[inverse]
        self._stats.hits += ids.size - len(missing)
        self._stats.misses += len(missing)
        self._stats.evictions = index.evictions

    def _warn_misses(self, misses: int, batch: int, io: float) -> None:
        if time.monotonic() - RowCache._miss_warned_at >= self.miss_warn_seconds:
            RowCache._miss_warned_at = time.monotonic()
            _log.warning(
                f"RowCache {self.file.path}: {misses} of a batch's {batch} ids missed, read from the file in "
                f"{io:.3f} s; the arena holds {self.capacity} of {self.rows} rows (a larger capacity, or the table "
                f"on the device or in host memory, avoids this; no such notice for {self.miss_warn_seconds:g} s)"
            )

    def validate(self, ids: np.ndarray) -> None:
        """Raise, loading nothing, what ``resolve(ids, ...)`` would raise for: a closed cache, ids
        out of range, more rows resident at once than the arena holds. A layer checks every
        cached table this way before its first launch."""
        ids = self._check_ids(ids, "resolve")
        if ids.size <= 1 and self.index.n_pinned < self.capacity:
            return
        slots = self.index.slot_of[np.unique(ids)].astype(np.int64)
        self._require_room(slots, slots >= 0)

    def _require_room(self, slots: np.ndarray, hit: np.ndarray) -> None:
        index = self.index
        need = index.n_pinned + int((~index.pinned[slots[hit]]).sum()) + int((~hit).sum())
        if need > self.capacity:
            raise ValueError(
                f"RowCache.resolve: the batch needs {need} rows resident at once, the arena holds {self.capacity}"
            )

    def table_dev_va(self) -> int:
        """Device address of the arena, ``[capacity, dim]`` rows of the table's dtype (bf16 or fp8);
        ``ClosedError`` once closed."""
        validate.require_open(self.closed, "RowCache")
        return int(self._arena)

    def scale_dev_va(self) -> int | None:
        """Device address of the arena's per-slot f32 scales for an fp8 table, None for bf16;
        ``ClosedError`` once closed."""
        validate.require_open(self.closed, "RowCache")
        return int(self._arena_scales) if self._arena_scales else None

    def end_batch(self) -> None:
        """The batch's rows may be evicted again (loads of later batches are queued on the same
        stream, so they land after the gathers that read the old rows). In a ``CacheGroup`` the
        batch is the group's: this ends it for every member (at once, so the layer's end_batch
        of each member costs a call after the first)."""
        if self.closed:
            validate.require_open(True, "RowCache")
        self.index.unpin_all()

    @property
    def stats(self) -> CacheStats:
        """The counters (a ``CacheGroup`` credits its all-hit steps' hits here when read)."""
        validate.require_open(self.closed, "RowCache")
        if self._group is not None:
            self._group.flush_stats()
        return self._stats

    @stats.setter
    def stats(self, value: CacheStats) -> None:
        if self._group is not None:
            self._group.flush_stats()
        self._stats = value

    def prefetch(self, ids: np.ndarray) -> int:
        """Start reading the rows of ``ids`` that are not resident into the page cache, without
        waiting; returns how many. Call it as soon as a later batch's ids are known."""
        ids = self._check_ids(ids, "prefetch")
        if ids.size == 0:
            return 0
        uniq = np.unique(ids)
        todo = uniq[self.index.slot_of[uniq] < 0]
        self.file.advise_willneed(todo)
        self._stats.prefetched += len(todo)
        return len(todo)

    def _check_ids(self, ids: np.ndarray, what: str) -> np.ndarray:
        """``ids`` as a 1-D integer array of ids < rows, in its own dtype (every use indexes
        with it or widens it first). A decode step's one uint32 id costs a few scalar checks:
        they run twice per cached table and step (``validate``, ``resolve``)."""
        if self.closed:
            validate.require_open(True, "RowCache")
        arr = ids if type(ids) is np.ndarray else np.asarray(ids)
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"RowCache.{what}: ids must be integers, got dtype {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"RowCache.{what}: ids must be 1-D, got shape {arr.shape}")
        if arr.size == 1:
            if not 0 <= int(arr[0]) < self.rows:
                raise ValueError(f"RowCache.{what}: id {int(arr[0])} out of range for a table of {self.rows} rows")
        elif arr.size and (arr.min() < 0 or arr.max() >= self.rows):
            bad = arr[(arr < 0) | (arr >= self.rows)][0]
            raise ValueError(f"RowCache.{what}: id {int(bad)} out of range for a table of {self.rows} rows")
        return arr

    def close(self) -> None:
        """Wait for the work queued on the stream, then free the staging, the arena and the file
        map; once."""
        if self.closed:
            return
        self.closed = True
        if self._group is not None:
            self._group.member_closed()
        try:
            if self._readers is not None:
                self._readers.shutdown(wait=True)
            self._resources.close()
        finally:
            self.file.close()

    def __enter__(self) -> RowCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
