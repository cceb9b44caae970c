"""Row-cache tests' shared pieces: ``scatter_rows`` emulated on the host-memory backend (and on
one whose stream work waits until it is waited for), random disk tables, the check that an arena holds the rows its slots claim, and the steps of a random
walk over a slot index."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from layers.ngram_store.row_cache import RowCache
from layers.ngram_store.table_file import write_table
from tests.helpers.fakes import MemoryBackend
from tests.helpers import random_bf16, random_fp8


def emulate_scatter(gpu: MemoryBackend, args: list) -> None:
    """``scatter_rows`` on a ``MemoryBackend``: row i (and its scale) to slot ``slots[i]``."""
    slots, rows, scales, arena, arena_scales, n, row_bytes = args
    src = gpu.read(rows, n * row_bytes).reshape(n, row_bytes)
    for i, slot in enumerate(gpu.read_as(slots, n, np.uint32)):
        gpu.copy_h2d_async(src[i], arena + int(slot) * row_bytes)
        if scales:
            gpu.copy_h2d_async(gpu.read(scales + 4 * i, 4), arena_scales + 4 * int(slot))


def mem_gpu() -> MemoryBackend:
    """A host-memory backend with the row-cache kernel, emulated."""
    return MemoryBackend(module="row_cache", names=["scatter_rows"], emulate={"scatter_rows": emulate_scatter})


class DeferredBackend(MemoryBackend):
    """``mem_gpu``'s backend whose stream work runs only once it is waited for, in queue order:
    ``event_synchronize(e)`` runs what was queued before ``e`` was recorded, ``synchronize`` and
    ``copy_d2h`` all of it. An ``upload_pinned_async`` reads its pinned buffer when it runs, as
    the DMA does, so a buffer refilled before its upload's event was waited for uploads the new
    rows; ``copy_h2d_async`` takes its bytes when called, as the backend's staging does. What an
    emulated kernel writes, it writes as it runs."""

    def __init__(self) -> None:
        super().__init__(module="row_cache", names=["scatter_rows"], emulate={"scatter_rows": emulate_scatter})
        self.queue: list[Callable[[], None]] = []
        self.ran = 0  # how much of the queue has run
        self.running = False
        self.marks: dict[int, int] = {}  # event -> the queue's length when it was recorded

    def run_until(self, n: int) -> None:
        while self.ran < n:
            self.ran += 1
            self.running = True
            try:
                self.queue[self.ran - 1]()
            finally:
                self.running = False

    def _queue(self, op: Callable[[], None]) -> None:
        if self.running:
            op()
        else:
            self.queue.append(op)

    def memset(self, ptr, byte, nbytes, stream=0) -> None:
        self._queue(partial(MemoryBackend.memset, self, ptr, byte, nbytes))

    def copy_h2d_async(self, host, dst, stream=0) -> None:
        data = np.array(np.ascontiguousarray(host).view(np.uint8).reshape(-1))  # a copy, taken now
        self._queue(partial(MemoryBackend.copy_h2d_async, self, data, dst))

    def upload_pinned_async(self, host: np.ndarray, dst: int, stream: int = 0) -> None:
        assert any(np.shares_memory(host, buf) for buf in self.host.values()), "not a pinned buffer"
        self._queue(partial(MemoryBackend.copy_h2d_async, self, host, dst))  # reads ``host`` when run

    def launch(self, kernel, grid, block, shared_mem, stream, kinds, args, *, overlap=False) -> None:
        self._queue(partial(MemoryBackend.launch, self, kernel, grid, block, shared_mem, stream, kinds, args))

    def record_event(self, event: int, stream: int = 0) -> None:
        super().record_event(event, stream)
        self.marks[event] = len(self.queue)

    def event_synchronize(self, event: int) -> None:
        super().event_synchronize(event)
        self.run_until(self.marks.get(event, 0))

    def synchronize(self, stream=0) -> None:
        super().synchronize(stream)
        self.run_until(len(self.queue))

    def copy_d2h(self, host_out, src, stream=0) -> None:
        self.synchronize(stream)
        super().copy_d2h(host_out, src, stream)


def table_file(tmp_path, rng, rows: int, dim: int, fp8: bool, name: str = "t.ngt"):
    """A random bf16 (or fp8 with row scales) table written to ``tmp_path / name``:
    ``(path, table, scales or None)``."""
    table = random_fp8(rng, (rows, dim)) if fp8 else random_bf16(rng, (rows, dim))
    scales = rng.uniform(0.01, 2, rows).astype(np.float32) if fp8 else None
    path = tmp_path / name
    write_table(path, table, scales)
    return path, table, scales


def assert_resident(gpu: MemoryBackend, cache: RowCache, ids, slots, table, scales) -> None:
    """Slot ``slots[i]`` of the arena holds row ``ids[i]`` of the table (and its scale)."""
    rb = cache.file.row_bytes
    arena = np.empty((cache.capacity, rb), np.uint8)
    gpu.copy_d2h(arena, cache.table_dev_va())
    assert np.array_equal(arena[slots.astype(np.int64)], table[ids].view(np.uint8).reshape(len(ids), rb))
    if scales is not None:
        arena_scales = np.empty(cache.capacity, np.float32)
        gpu.copy_d2h(arena_scales, cache.scale_dev_va())
        assert np.array_equal(arena_scales[slots.astype(np.int64)], scales[ids])


def assign_random_absent(rng, index) -> np.ndarray:
    """Assign slots to a random batch of absent ids (at most as many as are evictable) and check
    that each id got a slot of its own and no pinned slot was evicted; returns the slots."""
    held = np.flatnonzero(index.pinned)
    held_ids = index.id_of[held].copy()
    absent = np.flatnonzero(index.slot_of < 0)
    n = int(rng.integers(0, index.evictable() + 1))
    ids = rng.choice(absent, min(n, absent.size), replace=False)
    slots = index.assign(ids)
    assert len(set(slots.tolist())) == len(ids) and np.array_equal(index.id_of[slots], ids)
    assert np.array_equal(index.id_of[held], held_ids), "a pinned slot was evicted"
    return slots


def assert_consistent(index) -> None:
    """``slot_of`` and ``id_of`` are inverse on the resident rows, and the free and pinned counts
    agree with the arrays."""
    resident = np.flatnonzero(index.id_of >= 0)
    assert np.array_equal(index.slot_of[index.id_of[resident]], resident)
    assert (index.slot_of >= 0).sum() == resident.size == index.capacity - index.n_free
    assert index.n_pinned == index.pinned.sum()
