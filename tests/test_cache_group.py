"""CacheGroup and ids from windows: the fused path's host side of cached tables.

CPU (RowCaches on a host-memory backend): ``ngram_ids_windows`` equals ``ngram_ids_tail``; a
group resolves exactly as its members would one by one (slots, arena rows, stats, index state
and evictions, step for step through long streams under pressure); every refusal comes before
any load; ``end_batch`` (of the group or any member) unpins; groups share and take members
over; the fused runner's packed upload carries the right slots. GPU: the fused path with cached
tables is bit-identical to the resident one, batch 1 and 64, graph=True, all hits and misses.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gpu_runtime import ClosedError, KernelHandle
from layers.ngram_embed import FusedNgramEmbedding, NgramDims, NgramTable, NgramWeights
from layers.ngram_store.cache_group import CacheGroup, cache_group
from layers.ngram_embed.ids import NO_TOKEN, ngram_ids_tail, ngram_ids_windows
from layers.ngram_store.row_cache import RowCache
from layers.ngram_store.slot_index import SharedSlotIndex, SlotIndex, SlotStore
from layers.ngram_store.table_file import write_table
from layers.dense_weight import BF16
from tests.helpers.fakes import MemoryBackend
from tests.helpers import Guarded, bits
from tests.helpers.ngram import IdentityCache, device_weights, random_layer, small_dims
from tests.helpers.row_cache import (assert_consistent, assert_resident, assign_random_absent, emulate_scatter,
                                      mem_gpu, table_file)


def reference_windows(contexts, seq_lens, n: int) -> np.ndarray:
    """``[R, N]`` windows, written out the slow way (what ``FusedNgramEmbedding.windows`` makes)."""
    rows = [[int(c[p - d]) if p - d >= 0 else NO_TOKEN for d in range(n)]
            for c, s in zip(contexts, seq_lens) for p in range(len(c) - s, len(c))]
    return np.array(rows, np.uint32).reshape(-1, n)


def tail_ids(dims: NgramDims, contexts, seq_lens) -> np.ndarray:
    """``[T, R]`` ids by ``ngram_ids_tail``, context by context."""
    parts = [ngram_ids_tail(dims, c, s) for c, s in zip(contexts, seq_lens) if s]
    if not parts:
        return np.zeros((dims.num_tables(), 0), np.int64)
    return np.stack([np.concatenate(p) for p in zip(*parts)])


# -- ids from windows -------------------------------------------------------------------------------
def test_ids_from_windows_equal_ngram_ids_tail(rng):
    for trial in range(300):
        v = int(rng.choice([1, 2, int(rng.integers(3, 5000)), 131072, 2**32 - 2]))
        n, k = int(rng.integers(2, 6)), int(rng.integers(1, 4))
        eos = int(rng.integers(0, v)) if rng.random() < 0.6 else None
        # rows near 2**32 with V near 2**32: products near 2**64, the per-term reduction path
        base = int(rng.choice([1, int(rng.integers(2, 100)), int(rng.integers(100, 2**31)),
                               2**32 - 2 * n * k - 2]))
        dims = NgramDims(vocab_size=v, hidden_size=64, max_ngram=n, splits=k, base_rows=base,
                         row_bias=int(rng.integers(0, 2)), eos_id=eos)
        contexts = [rng.integers(0, v, int(rng.integers(1, 12)), dtype=np.int64)
                    for _ in range(int(rng.integers(1, 30)))]
        if eos is not None:
            for c in contexts:
                c[rng.random(c.size) < 0.3] = eos
        lens = [int(rng.integers(0, len(c) + 1)) for c in contexts]  # short contexts: NO_TOKEN windows
        windows = reference_windows(contexts, lens, n)
        want = tail_ids(dims, contexts, lens)
        tables = None
        if rng.random() < 0.5:
            tables = [int(c) for c in rng.choice(dims.num_tables(), int(rng.integers(1, dims.num_tables() + 1)),
                                                  replace=False)]
            want = want[tables]
        got = ngram_ids_windows(dims, windows, tables)
        assert got.dtype == np.int64 and got.shape == want.shape
        assert np.array_equal(got, want), (trial, dims)


def test_ids_from_windows_decode_batches(rng):
    """The fused path's shapes: R rows of one new token each, long contexts, EOS or not."""
    for eos in (None, 2):
        dims = NgramDims(vocab_size=131072, hidden_size=4096, max_ngram=3, splits=8, base_rows=1 << 20,
                         eos_id=eos)
        for batch in (1, 7, 64, 300):
            contexts = [rng.integers(0, 131072, 50) for _ in range(batch)]
            for c in contexts[::3]:
                c[-2:] = 2
            lens = [1] * batch
            assert np.array_equal(ngram_ids_windows(dims, reference_windows(contexts, lens, 3)),
                                  tail_ids(dims, contexts, lens))


def test_ids_from_windows_refusals():
    dims = small_dims(max_ngram=3, splits=2, vocab_size=500)
    good = np.array([[1, 2, NO_TOKEN]], np.uint32)
    for windows, error, match in [
            (good.astype(np.int64), TypeError, "must be a uint32 array, got int64"),
            (good[:, :2], ValueError, r"must be \[R, 3\], got \(1, 2\)"),
            (good[0], ValueError, r"must be \[R, 3\], got \(3,\)"),
            (np.array([[500, 1, 2]], np.uint32), ValueError, "windows\\[0, 0\\] = 500"),
            (np.array([[NO_TOKEN, 1, 2]], np.uint32), ValueError, "windows\\[0, 0\\]"),
            (np.array([[1, 2, 3], [1, 777, 3]], np.uint32), ValueError, "windows\\[1, 1\\] = 777")]:
        with pytest.raises(error, match=match):
            ngram_ids_windows(dims, windows)
    with pytest.raises(TypeError, match="table must be an int"):
        ngram_ids_windows(dims, good, [1.0])
    with pytest.raises(IndexError):
        ngram_ids_windows(dims, good, [dims.num_tables()])
    with pytest.raises(ValueError, match="fused path's limits"):
        ngram_ids_windows(NgramDims(vocab_size=2**32, hidden_size=40, max_ngram=3, splits=2, base_rows=61), good)
    with pytest.raises(ValueError, match="fused path's limits"):
        ngram_ids_windows(NgramDims(vocab_size=500, hidden_size=40, max_ngram=3, splits=2, base_rows=2**32), good)
    assert ngram_ids_windows(dims, np.zeros((0, 3), np.uint32)).shape == (dims.num_tables(), 0)


# -- SharedSlotIndex behaves as a SlotIndex --------------------------------------------------------
def test_shared_slot_indexes_stay_bijections(rng):
    """Two members of one store driven at random, as the SlotIndex test drives one index: each
    stays a bijection and spares its pinned slots; a store-wide unpin clears both."""
    rows, caps = [1000, 300], [64, 7]
    store = SlotStore(rows, caps)
    members = [SharedSlotIndex(SlotIndex(r, c), store, k) for k, (r, c) in enumerate(zip(rows, caps))]
    for _ in range(600):
        index = members[int(rng.integers(0, 2))]
        slots = assign_random_absent(rng, index)
        op = rng.integers(0, 5)
        if op == 0 and len(slots):
            index.pin(rng.choice(slots, rng.integers(0, len(slots) + 1)))
        elif op == 1 and len(slots):
            index.pin_one(int(slots[0]))
        elif op == 2:
            index.unpin_all()
            assert not store.pinned.any() and all(m.n_pinned == 0 for m in members)
        elif op == 3:
            store.uncounted = True  # as a group's all-hit step leaves it: recounted on demand
        elif len(slots) and rng.random() < 0.3:
            index.forget(slots)
        for m in members:
            assert_consistent(m)


# -- CacheGroup against its members one by one -------------------------------------------------------
def _caches(gpu, tmp_path, rng, shapes, tag, **kw):
    files, caches = [], []
    for k, (rows, dim, fp8, cap) in enumerate(shapes):
        path, table, scales = table_file(tmp_path, rng, rows, dim, fp8, f"{tag}{k}.ngt")
        files.append((table, scales))
        caches.append(RowCache(gpu, path, cap, **kw))
    return files, caches


SHAPES = [(997, 8, False, 64), (500, 7, True, 40), (1200, 33, False, 100), (64, 16, True, 64)]


def _state(cache: RowCache) -> tuple:
    ix = cache.index
    return (ix.slot_of.tobytes(), ix.id_of.tobytes(), ix.ref.tobytes(), ix.pinned.tobytes(), ix.n_pinned,
            ix.n_free, ix.hand, ix.evictions)


def _step_ids(rng, zipf, step, shapes, r):
    rows = np.array([s[0] for s in shapes])
    if step % 3 == 0:
        return rng.integers(0, rows[:, None], (len(shapes), r))
    pos = rng.integers(0, zipf.size - r)
    return np.minimum(zipf[pos:pos + r][None, :] * (np.arange(len(shapes))[:, None] + 1), rows[:, None] - 1)


@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.uint64, np.int32])
def test_group_resolves_as_its_members_one_by_one(tmp_path, rng, dtype):
    """Step for step: the group's slots equal each member's own resolve (so the CLOCK state,
    pins and evictions evolve identically), the arena holds the right rows, the stats agree."""
    gpu = mem_gpu()
    files, grouped = _caches(gpu, tmp_path, rng, SHAPES, "g", chunk_rows=5, io_threads=2)
    _, alone = _caches(gpu, tmp_path, rng, SHAPES, "a", chunk_rows=5, io_threads=2)
    group = CacheGroup(grouped)
    zipf = np.minimum(rng.zipf(1.3, 20000), 1000) - 1
    all_hit_steps = refused = 0
    prev = np.zeros((len(SHAPES), 0), dtype)
    for step in range(400):
        r = int(rng.choice([0, 1, 1, 2, 5, 17, 40]))
        ids = prev if step % 5 == 4 else _step_ids(rng, zipf, step, SHAPES, r).astype(dtype)  # repeats: all hits
        prev, r = ids, ids.shape[1]
        slots = np.empty((r, len(SHAPES)), np.uint32)
        try:  # the layers' order: every cache validated, then resolved
            for k, ref_cache in enumerate(alone):
                ref_cache.validate(ids[k])
        except ValueError as e:  # two batches pinned at once may not fit: the group refuses alike
            before = [_state(c) for c in grouped], len(gpu.launches)
            for call in (lambda: group.validate(ids), lambda: group.resolve(ids, slots)):
                with pytest.raises(ValueError, match=str(e)):
                    call()
            assert ([_state(c) for c in grouped], len(gpu.launches)) == before
            refused += 1
        else:
            if rng.random() < 0.3:
                group.validate(ids)
            misses_before = sum(c.stats.misses for c in grouped)
            group.resolve(ids, slots, in_range=bool(step % 2))
            all_hit_steps += r > 0 and sum(c.stats.misses for c in grouped) == misses_before
            for k, (cache, ref_cache) in enumerate(zip(grouped, alone)):
                want = np.empty(r, np.uint32)
                ref_cache.resolve(ids[k], want)
                assert np.array_equal(slots[:, k], want), (step, k)
                assert_resident(gpu, cache, ids[k].astype(np.int64), slots[:, k], *files[k])
        for k, (cache, ref_cache) in enumerate(zip(grouped, alone)):
            assert _state(cache) == _state(ref_cache), (step, k)
        if step % 7 == 6:  # two batches pinned at once now and then
            continue
        if step % 2:
            group.end_batch()
        else:
            grouped[int(rng.integers(0, len(grouped)))].end_batch()  # any member ends the group's batch
        for c in alone:
            c.end_batch()
        assert all(c.index.n_pinned == 0 for c in grouped) and not group.store.pinned.any()
    assert all_hit_steps > 50 and refused < 40
    for cache, ref_cache in zip(grouped, alone):
        assert replace(cache.stats, io_seconds=0) == replace(ref_cache.stats, io_seconds=0)
        assert cache.stats.hits > 0 and cache.stats.misses > 0  # both paths taken (how many of each is chance)
        assert (cache.stats.evictions > 0) == (cache.capacity < cache.rows)  # the last one holds its table
    for c in grouped + alone:
        c.close()
    assert not gpu.mem and not gpu.host and not gpu.events


def test_all_hit_steps_load_nothing_and_count_hits(tmp_path, rng):
    gpu = mem_gpu()
    _, caches = _caches(gpu, tmp_path, rng, SHAPES, "h")
    group = cache_group(caches)
    assert cache_group(caches) is group and cache_group(caches[::-1]) is not group
    group = cache_group(caches)  # the reversed one took the caches over: a new group again
    ids = np.array([[3, 3, 5], [1, 2, 3], [7, 8, 7], [0, 63, 0]], np.int64)
    slots = np.empty((3, 4), np.uint32)
    group.resolve(ids, slots)
    group.end_batch()
    launches, before = len(gpu.launches), [c.stats.hits for c in caches]
    for step in range(5):
        again = np.empty_like(slots)
        group.resolve(ids, again)
        assert np.array_equal(again, slots)
        distinct = [len(set(row)) for row in ids.tolist()]
        assert [c.index.n_pinned for c in caches] == distinct  # counted when asked
        group.end_batch()
    assert len(gpu.launches) == launches
    assert [c.stats.hits - b for c, b in zip(caches, before)] == [15] * 4
    for c in caches:
        c.close()


def test_refusals_come_before_any_load(tmp_path, rng):
    gpu = mem_gpu()
    _, caches = _caches(gpu, tmp_path, rng, [(100, 8, False, 10), (50, 8, True, 4), (80, 8, False, 80)], "r")
    group = CacheGroup(caches)

    def state():
        return [(_state(c), c.stats) for c in caches], len(gpu.launches)

    before = state()
    misses = np.array([[0, 1], [2, 3], [4, 5]])  # cache 0 and 2 would load rows
    bad = [
        (ValueError, "cache 1: id 50 out of range", np.array([[0, 1], [2, 50], [4, 5]])),
        (ValueError, "cache 2: id -1 out of range", np.array([[0, 1], [2, 3], [4, -1]])),
        (ValueError, "needs 5 rows resident at once, the arena holds 4",
         np.array([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])),
        (TypeError, "ids must be a numpy integer array, got float64", np.array([[0.0], [1.0], [2.0]])),
        (ValueError, r"ids must be \[3, R\], got shape \(2, 2\)", misses[:2]),
        (ValueError, r"ids must be \[3, R\], got shape \(2,\)", misses[0]),
    ]
    for error, match, ids in bad:
        for call in (lambda: group.validate(ids), lambda: group.resolve(ids, np.empty(ids.shape[::-1], np.uint32))):
            with pytest.raises(error, match=match):
                call()
        assert state() == before, match
    read_only = np.empty((2, 3), np.uint32)
    read_only.flags.writeable = False
    for slots_out, error in ((np.empty((2, 3), np.int32), TypeError), (np.empty((3, 2), np.uint32), ValueError),
                             (read_only, ValueError), ([[0] * 3] * 2, TypeError)):
        with pytest.raises(error, match="slots_out"):
            group.resolve(misses, slots_out)
    assert state() == before
    # A batch that fits with what is pinned already, then one that does not with it.
    slots = np.empty((2, 3), np.uint32)
    group.resolve(misses, slots)
    with pytest.raises(ValueError, match="needs 5 rows resident at once, the arena holds 4"):
        group.resolve(np.array([[9, 9, 9], [10, 11, 12], [7, 7, 7]]), np.empty((3, 3), np.uint32))
    group.end_batch()
    group.resolve(np.array([[9, 9, 9], [10, 11, 12], [7, 7, 7]]), np.empty((3, 3), np.uint32))
    group.end_batch()
    caches[1].close()
    for call in (lambda: group.resolve(misses, slots), lambda: group.validate(misses), group.end_batch,
                 caches[1].end_batch):
        with pytest.raises(ClosedError, match="RowCache is closed"):
            call()
    for c in caches:
        c.close()
    with pytest.raises(ClosedError, match="CacheGroup: cache 0: RowCache is closed"):
        CacheGroup(caches)
    with pytest.raises(TypeError, match="not a RowCache"):
        CacheGroup([object()])
    with pytest.raises(ValueError, match="no caches"):
        CacheGroup([])


def test_failed_load_leaves_the_group_consistent(tmp_path, rng, monkeypatch):
    gpu = mem_gpu()
    files, caches = _caches(gpu, tmp_path, rng, [(200, 8, False, 16), (300, 8, False, 16)], "f", io_threads=1)
    group = CacheGroup(caches)
    slots = np.empty((3, 2), np.uint32)
    group.resolve(np.array([[1, 2, 3], [4, 5, 6]]), slots)
    group.end_batch()
    real = caches[1].file.read_rows
    monkeypatch.setattr(caches[1].file, "read_rows", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        group.resolve(np.array([[1, 2, 3], [4, 5, 7]]), slots)
    group.end_batch()
    monkeypatch.setattr(caches[1].file, "read_rows", real)
    ids = np.array([[1, 2, 9], [4, 7, 8]])
    group.resolve(ids, slots)
    for k, cache in enumerate(caches):
        assert_resident(gpu, cache, ids[k], slots[:, k], *files[k])
        assert (cache.index.slot_of >= 0).sum() == (cache.index.id_of >= 0).sum()
    group.end_batch()
    for c in caches:
        c.close()


def test_groups_take_members_over_and_keep_their_rows(tmp_path, rng):
    """A second group over some of the caches takes them over with their state (resident rows
    still hit, stats carried); the first takes them back when next used; members work alone."""
    gpu = mem_gpu()
    files, caches = _caches(gpu, tmp_path, rng, SHAPES, "t")
    first = CacheGroup(caches)
    ids = np.array([[1, 2], [3, 4], [5, 6], [7, 8]])
    slots = np.empty((2, 4), np.uint32)
    first.resolve(ids, slots)
    first.end_batch()
    first.resolve(ids, slots)  # all hits: credited lazily
    second = CacheGroup(caches[1:3])  # takes its members over mid-batch, pins and all
    assert [c.index.n_pinned for c in caches] == [2, 2, 2, 2]
    assert [c.stats.hits for c in caches] == [2, 2, 2, 2]
    second.end_batch()  # the second group's batch: its members only
    assert [c.index.n_pinned for c in caches] == [2, 0, 0, 2]
    first.end_batch()
    sub = np.empty((2, 2), np.uint32)
    second.resolve(ids[1:3], sub)
    assert np.array_equal(sub, slots[:, 1:3])
    second.end_batch()
    again = np.empty_like(slots)
    first.resolve(ids, again)  # takes them back
    assert np.array_equal(again, slots) and cache_group(caches) is first  # the group they form again
    first.end_batch()
    alone = np.empty(2, np.uint32)
    caches[2].resolve(np.array([5, 6]), alone)  # a member still works on its own
    assert np.array_equal(alone, slots[:, 2])
    caches[2].end_batch()
    assert [c.stats.misses for c in caches] == [2, 2, 2, 2]
    assert [c.stats.hits for c in caches] == [4, 6, 8, 4]
    for k, cache in enumerate(caches):
        assert_resident(gpu, cache, ids[k], slots[:, k], *files[k])
        cache.close()


# -- the fused runner's host side on the CPU ---------------------------------------------------------
class FusedMemoryBackend(MemoryBackend):
    """MemoryBackend with the fused path's kernels (launches recorded, scatter_rows emulated)
    and no-op pitched copies and graphs."""

    def __init__(self) -> None:
        super().__init__("row_cache", ["scatter_rows"], {"scatter_rows": emulate_scatter})

    def kernel(self, module, name):
        if name not in self.handles:
            handle = KernelHandle(0x100 + len(self.handles))
            self.handles[name] = handle
            self.names[int(handle)] = name
        return self.handles[name]

    def launch(self, kernel, grid, block, shared_mem, stream, kinds, args, **kw) -> None:
        name = self.names[int(kernel)]
        self.launches.append(dict(name=name, grid=grid, block=block, stream=stream, args=list(args)))
        if name in self.emulate:
            self.emulate[name](self, list(args))

    def copy_2d_async(self, *args, **kw) -> None:
        pass


@pytest.mark.parametrize("layout", ["all", "mixed"])
def test_fused_pack_carries_the_slots_of_every_cached_table(tmp_path, rng, layout):
    """The packed upload's slots point, in each cached table's arena, at the row of the id that
    ngram_ids_tail gives; resident and identity-cached tables go beside them. A step needing
    more rows than an arena holds is refused before anything is loaded."""
    gpu = FusedMemoryBackend()
    dims = small_dims(max_ngram=3, splits=2, table_dim=8, hidden_size=32, base_rows=300, eos_id=5)
    host = random_layer(rng, dims, "bf")
    t, n = dims.num_tables(), dims.max_ngram
    base = device_weights(gpu, host)
    tables, caches, files = list(base.tables), {}, {}
    for c, (table, scale) in enumerate(host.tables):
        if layout == "all" or c % 2:
            path = tmp_path / f"p{c}.ngt"
            write_table(path, table, scale)
            caches[c] = RowCache(gpu, path, 70, chunk_rows=16)
            files[c] = (table, scale)
            tables[c] = NgramTable.Cached(caches[c])
        elif c == 2:
            tables[c] = NgramTable.Cached(IdentityCache(base.tables[c].weight))
    weights = NgramWeights(dims, base.word, tables, base.projs, gpu)  # owns nothing: base's and the caches
    fused = FusedNgramEmbedding(weights, 64)
    grouped = [cache.index for cache in caches.values()]  # one CacheGroup: one store for them all
    assert all(isinstance(i, SharedSlotIndex) for i in grouped) and len({id(i.store) for i in grouped}) == 1
    try:
        contexts = [rng.integers(0, dims.vocab_size, int(rng.integers(1, 40))) for _ in range(64)]
        for step in range(30):
            batch = int(rng.choice([1, 3, 32]))
            picked = [contexts[int(i)] for i in rng.choice(len(contexts), batch, replace=False)]
            for c in picked[::4]:
                c[-1:] = 5  # EOS
            lens = [int(rng.integers(0, min(len(c), 2) + 1)) if batch > 1 else 1 for c in picked]
            rows = sum(lens)
            if rows == 0:
                continue
            fused.embed_batch(picked, lens, 0x1000, 0)
            words = gpu.read_as(fused.staging, rows * (n + 1 + t), np.uint32)  # windows, words, slots
            slots = words[rows * (n + 1):].reshape(rows, t)
            want = tail_ids(dims, picked, lens)
            for c, cache in caches.items():
                assert_resident(gpu, cache, want[c], slots[:, c], *files[c])
            if layout == "mixed":
                assert np.array_equal(slots[:, 2], want[2])  # the identity cache: slot = id
                assert not slots[:, 0].any()  # a resident table's slots are zero
            assert all(cache.index.n_pinned == 0 for cache in caches.values())
            contexts = [np.append(c, rng.integers(0, dims.vocab_size)) for c in contexts]
        assert all(cache.stats.evictions > 0 and cache.stats.hits > 0 for cache in caches.values())
        # With 40 rows of the last cached table pinned, 64 rows of new ids cannot fit its 70-row
        # arena: refused before any table loads anything, and the runner ends the batch.
        last = caches[max(caches)]
        last.resolve(np.arange(40), np.empty(40, np.uint32))
        before = [(cache.index.slot_of.tobytes(), cache.stats) for cache in caches.values()], len(gpu.launches)
        wide = [rng.integers(0, dims.vocab_size, 5) for _ in range(64)]
        with pytest.raises(ValueError, match="rows resident at once, the arena holds 70"):
            fused.embed_batch(wide, [1] * 64, 0x1000, 0)
        after = [(cache.index.slot_of.tobytes(), cache.stats) for cache in caches.values()], len(gpu.launches)
        assert after == before  # nothing loaded, uploaded or launched
        assert all(cache.index.n_pinned == 0 for cache in caches.values())
    finally:
        fused.close()
        weights.close()
        for cache in caches.values():
            cache.close()
        base.close()
    assert not gpu.mem and not gpu.host and not gpu.events


# -- GPU: cached tables on the fused path, bit for bit --------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["all", "mixed"])
def test_fused_cached_tables_equal_resident_with_graphs(gpu, rng, tmp_path, layout):
    """Batch 1 and 64 sequences of one new token, graph=True on a created stream: the cached
    layer's output equals the resident layer's bit for bit, on steps with misses (fresh tokens,
    evictions: 100-row arenas) and on all-hit repeats of the same step."""
    dims = small_dims(max_ngram=3, splits=2, table_dim=24, hidden_size=72, base_rows=3000, eos_id=7)
    host = random_layer(rng, dims, "bf")
    stream = gpu.create_stream()
    resident = device_weights(gpu, host)
    gpu.synchronize(0)  # uploaded on the default stream; the fused runners read them on `stream`
    tables, caches = list(resident.tables), []
    for c, (table, scale) in enumerate(host.tables):
        if layout == "all" or c % 2:
            write_table(tmp_path / f"t{c}.ngt", table, scale)
            caches.append(RowCache(gpu, tmp_path / f"t{c}.ngt", 100, stream=stream, chunk_rows=32))
            tables[c] = NgramTable.Cached(caches[-1])
    cached = NgramWeights(dims, resident.word, tables, resident.projs, gpu)  # owns nothing: resident's and the caches
    fused_res = FusedNgramEmbedding(resident, 64, stream)
    fused_cached = FusedNgramEmbedding(cached, 64, stream)
    h = dims.hidden_size
    outs = {b: (Guarded(gpu, (b, h), BF16, rng), Guarded(gpu, (b, h), BF16, rng)) for b in (1, 64)}
    try:
        contexts = [rng.integers(0, dims.vocab_size, int(rng.integers(1, 300))) for _ in range(64)]
        for c in contexts[::5]:
            c[-min(3, len(c))] = 7  # EOS in some look-backs
        hits_steps = 0
        for step in range(24):
            batch = 1 if step % 2 else 64
            ctx = contexts[:batch]
            for repeat in range(2):  # the repeat resolves all hits
                misses = sum(c.stats.misses for c in caches)
                results = []
                for fused, out in zip((fused_res, fused_cached), outs[batch]):
                    out.poison()
                    gpu.synchronize(0)
                    fused.embed_batch(ctx, [1] * batch, out.ptr, stream, graph=True)
                    gpu.synchronize(stream)
                    results.append(bits(out.read()).copy())
                    out.assert_guards_intact()
                assert np.array_equal(results[0], results[1]), (step, repeat)
                assert np.isfinite(results[1].view(BF16).astype(np.float32)).all()
                if repeat:
                    assert sum(c.stats.misses for c in caches) == misses  # all hits
                    hits_steps += 1
            contexts = [np.append(c, rng.integers(0, dims.vocab_size)) for c in contexts]
        assert hits_steps == 24
        assert all(c.stats.evictions > 0 and c.index.n_pinned == 0 for c in caches)
        assert fused_cached.captured_graphs == 2  # one per batch shape, replayed
    finally:
        for pair in outs.values():
            for g in pair:
                g.free()
        fused_res.close()
        fused_cached.close()
        cached.close()
        for cache in caches:
            cache.close()
        resident.close()
        gpu.destroy_stream(stream)
