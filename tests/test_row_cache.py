"""RowCache: the arena holds the file's rows at the slots ``resolve`` returns (CPU, on a
host-memory backend, through long random streams that force eviction), refusals, counters,
prefetch; and on the GPU, a layer with cached tables equals the resident layer to the bit."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from gpu_runtime import ClosedError
from layers.kernel_files import load_kernel
from layers.ngram_embed import NgramDims, NgramEmbedding, NgramTable, NgramWeights
from layers.ngram_store.row_cache import RowCache
from layers.ngram_store.slot_index import SlotIndex
from layers.ngram_store.table_file import TableFormatError, write_table
from layers.ops.row_cache import RowScatter
from layers.dense_weight import BF16, DenseWeight
from tests.helpers import Guarded, bits
from tests.helpers.ngram import device_layer, free_layer, random_layer
from tests.helpers.row_cache import (DeferredBackend, assert_consistent, assert_resident, assign_random_absent,
                                     mem_gpu, table_file)


def resolve(cache: RowCache, ids) -> np.ndarray:
    slots = np.empty(len(ids), np.uint32)
    cache.resolve(np.asarray(ids), slots)
    return slots


# -- CPU --------------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [1, 7, 300, 1000])
def test_slot_index_stays_a_bijection_and_spares_pinned_slots(rng, capacity):
    rows = 1000
    index = SlotIndex(rows, capacity)
    for _ in range(400):
        slots = assign_random_absent(rng, index)
        op = rng.integers(0, 4)
        if op == 0 and len(slots):
            index.pin(rng.choice(slots, rng.integers(0, len(slots) + 1)))  # repeats allowed
        elif op == 1 and len(slots):
            index.pin_one(int(slots[0]))
        elif op == 2:
            index.unpin_all()
        elif len(slots) and rng.random() < 0.3:
            index.forget(slots)  # their load failed
        assert_consistent(index)


@pytest.mark.parametrize("backend", ["memory", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fp8, dim, chunk, threads", [(False, 8, 8192, 8), (True, 7, 5, 1), (False, 33, 3, 4),
                                                      (True, 64, 4096, 2)])
def test_long_stream_forces_eviction_and_stays_right(request, tmp_path, rng, fp8, dim, chunk, threads, backend):
    rows, capacity = 997, 64
    path, table, scales = table_file(tmp_path, rng, rows, dim, fp8)
    gpu = mem_gpu() if backend == "memory" else request.getfixturevalue("gpu")
    with RowCache(gpu, path, capacity, chunk_rows=chunk, io_threads=threads) as cache:
        looked_up = 0
        zipf = np.minimum(rng.zipf(1.3, 20000), rows) - 1  # skewed like real n-gram ids
        for step in range(300):
            n = int(rng.integers(0, 40))
            ids = zipf[step * 40:step * 40 + n] if step % 2 else rng.integers(0, rows, n)
            slots = resolve(cache, ids)
            assert slots.size == n and (slots < capacity).all()
            assert_resident(gpu, cache, ids, slots, table, scales)
            looked_up += len(ids)
            cache.end_batch()
        st = cache.stats
        assert st.hits + st.misses == looked_up and st.misses > capacity and st.evictions > 0
        assert st.rows_read == st.misses
        assert st.bytes_read == st.rows_read * (dim * (1 if fp8 else 2) + (4 if fp8 else 0))
    if backend == "memory":
        assert not gpu.mem and not gpu.host and not gpu.events  # all returned


def test_a_cache_in_a_group_used_alone_behaves_as_before(tmp_path, rng):
    """A cache whose index moved into a CacheGroup's store, resolved on its own (as the seed
    path does), gives the slots, index state and stats of a cache never grouped; its
    end_batch ends the group's batch (the other member's pins too)."""
    from layers.ngram_store.cache_group import CacheGroup

    path, table, scales = table_file(tmp_path, rng, 700, 12, True)
    other_path, _, _ = table_file(tmp_path, rng, 50, 4, False, "other.ngt")
    gpu = mem_gpu()
    with RowCache(gpu, path, 48, chunk_rows=7) as grouped, RowCache(gpu, path, 48, chunk_rows=7) as alone, \
            RowCache(gpu, other_path, 8) as other:
        resolve(grouped, [1, 2, 3])  # state before grouping carries over, pins included
        resolve(alone, [1, 2, 3])
        group = CacheGroup([other, grouped])
        assert grouped.index.n_pinned == 3
        resolve(other, [4, 5])
        grouped.end_batch()
        alone.end_batch()
        assert other.index.n_pinned == 0 and not group.store.pinned.any()
        zipf = np.minimum(rng.zipf(1.3, 8000), 700) - 1
        for step in range(200):
            n = int(rng.integers(0, 30))
            ids = zipf[step * 30:step * 30 + n] if step % 2 else rng.integers(0, 700, n)
            a, b = resolve(grouped, ids), resolve(alone, ids)
            assert np.array_equal(a, b)
            assert_resident(gpu, grouped, ids, a, table, scales)
            for name in ("slot_of", "id_of", "ref", "pinned", "n_pinned", "n_free", "hand", "evictions"):
                assert np.array_equal(getattr(grouped.index, name), getattr(alone.index, name)), (step, name)
            grouped.end_batch()
            alone.end_batch()
        assert grouped.stats.evictions > 0
        assert dataclasses.replace(grouped.stats, io_seconds=0) == dataclasses.replace(alone.stats, io_seconds=0)


def test_pinned_rows_are_never_evicted(tmp_path, rng):
    path, table, _ = table_file(tmp_path, rng, 500, 8, False)
    gpu = mem_gpu()
    with RowCache(gpu, path, 40) as cache:
        first = rng.choice(500, 25, replace=False)
        second = rng.choice(np.setdiff1d(np.arange(500), first), 15, replace=False)
        s1, s2 = resolve(cache, first), resolve(cache, second)
        assert not set(s1) & set(s2)
        assert_resident(gpu, cache, first, s1, table, None)  # batch 1 still pinned
        absent = int(np.setdiff1d(np.arange(500), np.concatenate([first, second]))[-1])
        with pytest.raises(ValueError, match="needs 41 rows resident at once, the arena holds 40"):
            resolve(cache, [absent] + list(first[:3]))  # one row more than the 40 pinned
        cache.end_batch()
        resolve(cache, rng.choice(500, 40, replace=False))  # whole arena, now allowed


def test_validate_refuses_what_a_fully_pinned_arena_cannot_place(tmp_path, rng):
    """The open batch pins every slot: ``validate`` of a batch holding any row not resident (one
    id, a decode step's path, or several) raises what ``resolve`` raises, loading nothing and
    changing nothing; a batch of pinned rows passes; after ``end_batch`` every one passes."""
    path, _, _ = table_file(tmp_path, rng, 300, 8, False)
    gpu = mem_gpu()
    with RowCache(gpu, path, 12) as cache:
        held = rng.choice(300, 12, replace=False)
        resolve(cache, held)
        absent = rng.choice(np.setdiff1d(np.arange(300), held), 3, replace=False)
        index = cache.index

        def state():
            return (len(gpu.launches), index.n_pinned, index.slot_of.tobytes(), index.pinned.tobytes(),
                    index.ref.tobytes(), dataclasses.astuple(cache.stats))

        before = state()
        assert before[1] == 12
        for ids, need in ((absent[:1], 13), (np.append(held[:4], absent[0]), 13), (absent, 15)):
            for call in (cache.validate, lambda ids: resolve(cache, ids)):
                with pytest.raises(ValueError, match=f"needs {need} rows resident at once, the arena holds 12"):
                    call(ids)
                assert state() == before
        for ids in (held[rng.integers(0, 12, 1)], rng.permutation(held)):
            cache.validate(ids)
        cache.end_batch()
        for ids in (absent[:1], absent, np.append(held[:4], absent[0])):
            cache.validate(ids)


def test_clock_evicts_in_order_and_its_hand_moves_past_its_victim(tmp_path, rng):
    """Capacity 3, one row per batch, A B C D A C B: A B C fill slots 0 1 2; D finds every row
    referenced, clears them all and takes slot 0 (A), the hand moving on to slot 1; A takes slot
    1 (B, unreferenced since); C is a hit (referenced again); B finds C, D and A referenced,
    clears them and takes slot 2 (C). A hand left on its victim takes D's slot for B instead."""
    path, table, _ = table_file(tmp_path, rng, 200, 8, False)
    a, b, c, d = rng.choice(200, 4, replace=False)
    gpu = mem_gpu()
    with RowCache(gpu, path, 3) as cache:
        for row in (a, b, c, d, a, c, b):
            resolve(cache, [row])
            cache.end_batch()
        index = cache.index
        assert index.slot_of[[d, a, b, c]].tolist() == [0, 1, 2, -1]
        assert index.hand == 0 and index.evictions == 3
        assert cache.stats.hits == 1 and cache.stats.misses == 6
        assert_resident(gpu, cache, np.array([d, a, b]), np.arange(3, dtype=np.uint32), table, None)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_pinned_buffer_is_refilled_only_after_the_upload_reading_it_ran(tmp_path, rng, fp8):
    """Five chunks of 70 rows through the loader's two pinned buffers, on a backend whose uploads
    read their buffer only once their event is waited for: chunk 3 waits for chunk 1's upload
    before it refills chunk 1's buffer, so every slot gets its own row (refilled first, chunk 1's
    slots would get chunk 3's rows)."""
    path, table, scales = table_file(tmp_path, rng, 1000, 8, fp8)
    gpu = DeferredBackend()
    with RowCache(gpu, path, 400, chunk_rows=70, io_threads=1) as cache:
        ids = rng.choice(1000, 350, replace=False)
        slots = resolve(cache, ids)
        assert gpu.ran < len(gpu.queue)  # the last chunks' uploads still wait: nothing waited for them
        assert_resident(gpu, cache, ids, slots, table, scales)
    assert not gpu.mem and not gpu.host and not gpu.events


def test_refusals_change_nothing(tmp_path, rng):
    path, _, _ = table_file(tmp_path, rng, 100, 8, True)
    gpu = mem_gpu()
    cache = RowCache(gpu, path, 10)
    arena = gpu.read(cache.table_dev_va(), 10 * 8)
    bad_calls = [
        (ValueError, "out of range", lambda: resolve(cache, [3, 100])),
        (ValueError, "out of range", lambda: resolve(cache, [-1])),
        (TypeError, "ids must be integers, got dtype float64", lambda: resolve(cache, np.array([1.0, 2.0]))),
        (ValueError, r"ids must be 1-D, got shape \(2, 2\)",
         lambda: cache.resolve(np.zeros((2, 2), np.int64), np.empty(4, np.uint32))),
        (TypeError, "slots_out must be a uint32 array, got int32",
         lambda: cache.resolve(np.array([1, 2]), np.empty(2, np.int32))),
        (ValueError, r"slots_out must be writable and of shape \(2,\), got shape \(3,\)",
         lambda: cache.resolve(np.array([1, 2]), np.empty(3, np.uint32))),
        (ValueError, "arena holds 10", lambda: resolve(cache, np.arange(11))),
        (ValueError, "out of range", lambda: cache.prefetch(np.array([100]))),
    ]
    for error, match, call in bad_calls:
        with pytest.raises(error, match=match):
            call()
    assert gpu.launches == [] and np.array_equal(gpu.read(cache.table_dev_va(), 80), arena)
    assert cache.stats.hits == cache.stats.misses == 0
    cache.close()
    cache.close()  # idempotent
    for call in (lambda: resolve(cache, [1]), cache.end_batch, cache.table_dev_va,
                 lambda: cache.prefetch(np.array([1]))):
        with pytest.raises(ClosedError, match="RowCache is closed"):
            call()
    for value, error in ((0, ValueError), (-3, ValueError), (True, TypeError), (2.0, TypeError)):
        with pytest.raises(error, match="RowCache: capacity must be"):
            RowCache(gpu, path, value)
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):  # beyond the slot index's reach: refused before the file is opened
        with pytest.raises(ValueError, match="RowCache: capacity must be in 1..2\\*\\*31-1"):
            RowCache(gpu, path, 1 << 31)
    assert len(os.listdir("/proc/self/fd")) == fds


def test_file_disagreeing_with_its_header_is_refused(tmp_path, rng):
    path, _, _ = table_file(tmp_path, rng, 100, 8, False)
    with open(path, "ab") as f:
        f.write(b"\0" * 16)
    gpu = mem_gpu()
    with pytest.raises(TableFormatError, match="bytes"):
        RowCache(gpu, path, 10)
    assert not gpu.mem and not gpu.host


def test_failed_read_leaves_the_index_consistent(tmp_path, rng, monkeypatch):
    path, table, _ = table_file(tmp_path, rng, 200, 8, False)
    gpu = mem_gpu()
    with RowCache(gpu, path, 16, io_threads=1) as cache:
        resolve(cache, [1, 2, 3])
        cache.end_batch()
        real = cache.file.read_rows
        monkeypatch.setattr(cache.file, "read_rows", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
        with pytest.raises(OSError, match="disk gone"):
            resolve(cache, [4, 5, 1])
        monkeypatch.setattr(cache.file, "read_rows", real)
        ids = [4, 5, 1, 2]
        slots = resolve(cache, ids)
        assert_resident(gpu, cache, ids, slots, table, None)
        assert (cache.index.slot_of >= 0).sum() == (cache.index.id_of >= 0).sum()


def test_prefetch_reads_ahead_only_what_is_missing(tmp_path, rng, monkeypatch):
    path, table, scales = table_file(tmp_path, rng, 300, 16, True)
    gpu = mem_gpu()
    with RowCache(gpu, path, 50) as cache:
        advised = []
        monkeypatch.setattr(cache.file, "advise_willneed", lambda ids: advised.append(np.array(ids)))
        resident = rng.choice(300, 10, replace=False)
        resolve(cache, resident)
        cache.end_batch()
        wanted = np.concatenate([resident, np.setdiff1d(np.arange(300), resident)[:20]])
        launches = len(gpu.launches)
        assert cache.prefetch(np.concatenate([wanted, wanted])) == 20
        assert len(gpu.launches) == launches  # readahead only: nothing queued on the GPU
        assert np.array_equal(np.sort(advised[-1]), np.setdiff1d(wanted, resident))
        slots = resolve(cache, wanted)
        assert_resident(gpu, cache, wanted, slots, table, scales)
        st = cache.stats
        assert (st.prefetched, st.misses, st.hits, st.rows_read) == (20, 30, 10, 30)


def test_advise_willneed_covers_every_page_of_the_rows(tmp_path, rng, monkeypatch):
    import os

    path, _, _ = table_file(tmp_path, rng, 5000, 3000, True)  # 3000-byte rows straddle pages
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice)))
    from layers.ngram_store.table_file import PAGE, TableFile

    with TableFile(path) as f:
        ids = np.array([0, 1, 7, 4999])
        f.advise_willneed(ids)
        covered = set()
        for off, n, advice in calls:
            assert advice == os.POSIX_FADV_WILLNEED and off % PAGE == 0
            covered |= set(range(off // PAGE, (off + n) // PAGE))
        for i in ids:
            row = f.header.rows_offset + int(i) * 3000
            assert set(range(row // PAGE, (row + 2999) // PAGE + 1)) <= covered
            scale = f.header.scales_offset + 4 * int(i)
            assert scale // PAGE in covered


# -- GPU: cached layers against resident ones -----------------------------------------------------
def _cached_layer(gpu, host, tmp_path, name: str, capacity: int, max_tokens: int) -> NgramEmbedding:
    """The seed's runner over weights whose tables are RowCaches over ``host``'s tables written
    to files; the weights own the caches and uploads (``free_layer`` closes the runner, then them)."""
    caches = []
    for c, (table, scale) in enumerate(host.tables):
        path = tmp_path / f"{name}{c}.ngt"
        write_table(path, table, scale)
        caches.append(RowCache(gpu, path, capacity, chunk_rows=64))
    word = DenseWeight.from_numpy(gpu, host.word)
    projs = [DenseWeight.from_numpy(gpu, p) for p in host.projs]
    weights = NgramWeights(host.dims, word, [NgramTable.Cached(cache) for cache in caches], projs, gpu)
    weights.own(*caches, word, *projs)
    return NgramEmbedding(weights, max_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("kinds", ["b", "f", "bf"])
def test_cached_layer_equals_resident_over_a_long_stream(gpu, rng, tmp_path, kinds):
    dims = NgramDims(vocab_size=2000, hidden_size=72, max_ngram=3, splits=2, base_rows=4000,
                     row_bias=1, table_dim=24, eos_id=7)
    host = random_layer(rng, dims, kinds)
    tokens = rng.integers(0, dims.vocab_size, 1500)
    resident = device_layer(gpu, host, max_tokens=64)
    cold = _cached_layer(gpu, host, tmp_path, "cold", 40, 64)  # prefetch never called
    warm = _cached_layer(gpu, host, tmp_path, "warm", 40, 64)
    try:
        with Guarded(gpu, (64, dims.hidden_size), BF16, rng) as out:
            pos, step = 16, 0
            while pos < tokens.size:
                seq = 32 if step % 10 == 0 else 1  # a prefill chunk now and then, else decode
                pos = min(pos + seq, tokens.size)
                seq = min(seq, pos)
                results = []
                for layer in (resident, cold, warm):
                    out.poison()
                    layer.embed(tokens[:pos], seq, out.ptr, gpu, 0)
                    results.append(bits(out.read()[:seq]).copy())
                    out.assert_guards_intact()
                assert np.array_equal(results[0], results[1]) and np.array_equal(results[0], results[2]), step
                if pos < tokens.size:
                    warm.prefetch(tokens[:pos + 1], 1)  # the next decode step's rows
                step += 1
        for layer in (cold, warm):
            stats = [t.cache.stats for t in layer.weights.tables]
            assert all(s.evictions > 0 and s.rows_read == s.misses for s in stats)
        assert sum(t.cache.stats.prefetched for t in warm.weights.tables) > 0
    finally:
        for layer in (resident, cold, warm):
            free_layer(layer)


@pytest.mark.gpu
@pytest.mark.parametrize("row_bytes, scaled", [(512, False), (48, False), (7, True), (33, True), (1, False)])
def test_scatter_rows_writes_only_its_slots(gpu, rng, row_bytes, scaled):
    capacity, n = 50, 23
    slots = rng.choice(capacity, n, replace=False).astype(np.uint32)
    rows = rng.integers(0, 256, (n, row_bytes), dtype=np.uint8)
    scales = rng.standard_normal(n).astype(np.float32)
    kernel = load_kernel(gpu, "row_cache", "scatter_rows")
    with Guarded(gpu, (capacity, row_bytes), np.uint8, rng) as arena, \
            Guarded(gpu, capacity, np.float32, rng) as arena_scales, \
            Guarded(gpu, n, np.uint32, rng) as s_dev, Guarded(gpu, (n, row_bytes), np.uint8, rng) as r_dev, \
            Guarded(gpu, n, np.float32, rng) as sc_dev:
        s_dev.upload(slots)
        r_dev.upload(rows)
        sc_dev.upload(scales)
        before, before_scales = arena.read(), arena_scales.read()
        scatter = RowScatter(gpu, kernel, arena.ptr, arena_scales.ptr if scaled else 0, row_bytes)
        scatter.run(s_dev.ptr, r_dev.ptr, sc_dev.ptr if scaled else 0, n, 0)
        want, want_scales = before.copy(), before_scales.copy()
        want[slots] = rows
        if scaled:
            want_scales[slots] = scales
        assert np.array_equal(arena.read(), want)
        assert np.array_equal(bits(arena_scales.read()), bits(want_scales))
        for g in (arena, arena_scales, s_dev, r_dev, sc_dev):
            g.assert_guards_intact()


def test_a_failed_parallel_read_waits_for_the_other_readers(tmp_path, rng):
    """One reader failing at once while another is still copying rows into the pinned buffer:
    the load raises only once every reader is done (before, the first failure was raised at
    once, and a later load could reuse the buffer the slow reader still wrote into)."""
    import threading
    import time

    path, _, _ = table_file(tmp_path, rng, 4096, 8, False)
    done = []
    with RowCache(mem_gpu(), path, 4096, chunk_rows=4096, io_threads=2) as cache:
        read = cache.file.read_rows

        def read_rows(ids, out, scales):
            if threading.current_thread() is threading.main_thread() or ids[0] == 0:
                raise OSError("read failed")  # the first reader, at once
            time.sleep(0.2)
            read(ids, out, scales)
            done.append(len(ids))

        cache.file.read_rows = read_rows
        with pytest.raises(OSError, match="read failed"):
            cache.resolve(np.arange(2048), np.empty(2048, np.uint32))
        assert done == [1024]  # the slow reader had finished
