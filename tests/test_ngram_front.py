"""The n-gram front end (``layers/ngram_embed/front.py``, ``cached_rows.py``) on the CPU.

The faithful and fused paths refuse the same bad context the same way; the ``gpu`` of the
faithful path's call must be the weights' backend (the fused path takes none: it runs on the
weights'); a failure between a cached table's ``resolve`` and its ``end_batch`` leaves no row
pinned, on both paths; the fused path's short replay of a decode step uploads what the general
path uploads, and refuses what it refuses.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gpu_runtime import ClosedError, KernelHandle
from layers.ngram_embed import (FusedNgramEmbedding, NgramDims, NgramEmbedding, NgramTable, NgramWeights, RowCache,
                                write_table)
from layers.ngram_embed.cached_rows import CachedRows
from layers.dense_weight import DenseWeight
from tests.helpers.fakes import MemoryBackend

BF16 = ml_dtypes.bfloat16
DIMS = NgramDims(vocab_size=50, hidden_size=16, max_ngram=3, splits=2, base_rows=61, row_bias=1,
                 table_dim=8, eos_id=7)


class Injected(RuntimeError):
    """The failure a test injects into a launch."""


class FakeGpu(MemoryBackend):
    """Device memory in host arrays; every kernel is known and its launches are recorded, none
    runs; ``fail_at = (name, k)`` makes the k-th launch of kernel ``name`` (from now) raise.
    Pitched copies do nothing. A graph records the pinned uploads captured into it (and runs
    nothing while capturing); a replay, counted, repeats them: what the staging then holds is
    what the captured launches would read."""

    def __init__(self) -> None:
        super().__init__("row_cache", ["scatter_rows"])
        self.fail_at: tuple[str, int] | None = None
        self.replays = 0
        self.capturing: list | None = None
        self.graphs: dict[int, list] = {}
        self.out = self.alloc(16 * DIMS.hidden_size * 2)  # every call's output

    def kernel(self, module, name):
        if name not in self.handles:
            self.handles[name] = KernelHandle(0x100 + len(self.handles))
            self.names[int(self.handles[name])] = name
        return self.handles[name]

    def launch(self, kernel, grid, block, shared_mem, stream, kinds, args, **kw) -> None:
        name = self.names[int(kernel)]
        if self.fail_at is not None and self.fail_at[0] == name:
            left = self.fail_at[1] - 1
            self.fail_at = (name, left) if left else None
            if not left:
                raise Injected(f"{name}: injected launch failure")
        self.launches.append(dict(name=name, stream=stream, args=list(args)))

    def copy_2d_async(self, *args, **kw) -> None:
        pass

    def upload_pinned_async(self, host, dst, stream=0) -> None:
        if self.capturing is not None:
            self.capturing.append((host, dst))
        else:
            super().upload_pinned_async(host, dst, stream)

    def begin_capture(self, stream: int) -> None:
        self.capturing = []

    def end_capture(self, stream: int) -> int:
        graph = 0x6000 + len(self.graphs)
        self.graphs[graph], self.capturing = self.capturing, None
        return graph

    def abort_capture(self, stream: int) -> None:
        self.capturing = None

    def launch_graph(self, graph: int, stream: int) -> None:
        self.replays += 1
        for host, dst in self.graphs[graph]:
            super().upload_pinned_async(host, dst, stream)

    def destroy_graph(self, graph: int) -> None:
        pass


def _weights(gpu, rng, tmp_path, cached: str = "", stream: int = 0) -> NgramWeights:
    """Weights on ``gpu``: table c a RowCache (capacity 8, loading on ``stream``) where
    ``cached[c] == "c"``, else bf16; they own their uploads and caches (``own``): closing them
    frees those."""
    h, td = DIMS.hidden_size, DIMS.table_dim()
    owned: list = []

    def upload(array: np.ndarray) -> DenseWeight:
        owned.append(DenseWeight.from_numpy(gpu, array))
        return owned[-1]

    tables = []
    for c in range(DIMS.num_tables()):
        rows = rng.standard_normal((DIMS.table_rows(c), td)).astype(BF16)
        if cached[c:c + 1] == "c":
            write_table(tmp_path / f"t{c}.ngt", rows)
            owned.append(RowCache(gpu, tmp_path / f"t{c}.ngt", 8, io_threads=1, stream=stream))
            tables.append(NgramTable.Cached(owned[-1]))
        else:
            tables.append(NgramTable.Bf16(upload(rows)))
    word = upload(rng.standard_normal((DIMS.vocab_size, h)).astype(BF16))
    projs = [upload(rng.standard_normal((h, td)).astype(BF16)) for _ in tables]
    weights = NgramWeights(DIMS, word, tables, projs, gpu)
    weights.own(*owned)
    return weights


def _layer(gpu, rng, tmp_path, cached: str = "", stream: int = 0) -> NgramEmbedding:
    """The seed's runner over ``_weights``; ``_close(..., layer)`` closes it, then its weights."""
    return NgramEmbedding(_weights(gpu, rng, tmp_path, cached, stream), 16)


def _close(*objs) -> None:
    """Close runners in order, then the weights of the last (the runners borrow them)."""
    for obj in objs:
        obj.close()
    objs[-1].weights.close()


CTX = [3, 9, 14, 27, 5, 40]


# -- the same refusals on both paths ------------------------------------------------------------------
@pytest.mark.parametrize("ctx, seq_len, error, says", [
    ([1.5, 2.0, 3.0], 1, TypeError, "tokens must be integers, got dtype float64"),
    ([[1, 2, 3]], 1, ValueError, "1-D"),
    ([1, 2, 50], 1, ValueError, "token 50"),
    ([1, 2, -1], 2, ValueError, "token -1"),
    ([1, 2, 3], 4, ValueError, "4 exceeds the context's 3 tokens"),
    ([1, 2, 3], -1, ValueError, "must be a non-negative int, got -1"),
    ([1, 2, 3], True, TypeError, "must be an int, got bool True"),
    ([1, 2, 3], 1.0, TypeError, "must be an int, got float 1.0"),
])
def test_both_host_paths_refuse_a_bad_context_alike(rng, tmp_path, ctx, seq_len, error, says):
    gpu = FakeGpu()
    layer = _layer(gpu, rng, tmp_path)
    fused = FusedNgramEmbedding(layer.weights, 16)
    gpu.launches.clear()
    try:
        messages = []
        for call in (lambda: layer.embed(ctx, seq_len, gpu.out, gpu),
                     lambda: fused.embed(ctx, seq_len, gpu.out)):
            with pytest.raises(error, match=says) as err:
                call()
            messages.append(str(err.value).split(": ", 1)[1].replace("seq_lens[0]", "seq_len")
                            .replace("context 0", "ctx_tokens"))
        if "position" not in messages[0]:  # the faithful path knows the token's context position
            assert messages[0] == messages[1]
        assert gpu.launches == []
    finally:
        _close(fused, layer)


def test_the_gpu_of_a_call_must_be_the_weights_own(rng, tmp_path):
    """The faithful path keeps the seed's ``gpu`` argument: it must be the weights' backend, and
    another one is refused before anything is uploaded or launched (on either). The fused path
    takes no backend: built on the weights, it allocates, uploads and launches on theirs only."""
    gpu, other = FakeGpu(), FakeGpu()
    layer = _layer(gpu, rng, tmp_path)
    fused = FusedNgramEmbedding(layer.weights, 16)
    assert fused.gpu is gpu and layer.gpu is gpu and layer.weights.gpu is gpu
    stream = gpu.create_stream()
    fused.embed(CTX, 1, gpu.out, stream, graph=True)  # captured: the replay path is armed
    gpu.launches.clear()
    try:
        replays = gpu.replays
        for call in (lambda: layer.embed(CTX, 2, gpu.out, other),
                     lambda: layer.embed(CTX, 1, gpu.out, other, stream)):
            with pytest.raises(ValueError, match="ngram embed: gpu is not the backend of the weights"):
                call()
            assert gpu.launches == [] and other.launches == [] and gpu.replays == replays
        layer.embed(CTX, 2, gpu.out, gpu)
        fused.embed(CTX, 1, gpu.out, stream, graph=True)
        assert gpu.replays == replays + 1
        fused.embed_batch([CTX, CTX], [1, 2], gpu.out)
        assert {l["name"] for l in gpu.launches} >= {"batched_embed", "ngram_gather"}
        assert other.launches == [] and other.replays == 0 and not other.events
        assert other.mem == {other.out: other.mem[other.out]}
    finally:
        _close(fused, layer)


# -- a failure after resolve leaves nothing pinned ----------------------------------------------------
def _caches(layer) -> list[RowCache]:
    return [t.cache for t in layer.weights.tables if isinstance(t, NgramTable.Cached)]


def _pinned(layer) -> list[int]:
    return [cache.index.n_pinned for cache in _caches(layer)]


def test_faithful_path_unpins_after_a_failed_gather(rng, tmp_path):
    gpu = FakeGpu()
    layer = _layer(gpu, rng, tmp_path, cached="cc")
    try:
        gpu.fail_at = ("batched_embed", 2)  # the word rows' gather, then table 0's: after its resolve
        with pytest.raises(Injected):
            layer.embed(CTX, 3, gpu.out, gpu)
        assert _pinned(layer) == [0, 0]
        assert _caches(layer)[0].stats.misses == 3  # resolved (loaded), then unpinned
        gpu.fail_at = ("dense_gemm_bf16_pipelined", 2)  # table 1's GEMM: after its own end_batch
        with pytest.raises(Injected):
            layer.embed(CTX, 3, gpu.out, gpu)
        assert _pinned(layer) == [0, 0]
        layer.embed(CTX, 6, gpu.out, gpu)  # the whole arena free again: 6 rows of 8
        assert _pinned(layer) == [0, 0]
    finally:
        _close(layer)


@pytest.mark.parametrize("graph", [False, True])
def test_fused_path_unpins_after_a_failed_launch(rng, tmp_path, graph):
    gpu = FakeGpu()
    stream = gpu.create_stream()  # the calls' and the RowCache's
    layer = _layer(gpu, rng, tmp_path, cached="cb", stream=stream)  # a grouped RowCache beside a resident table
    fused = FusedNgramEmbedding(layer.weights, 16)
    try:
        for _ in range(2):  # a shape's first call (eager, then captured), then a replay
            gpu.fail_at = ("ngram_gather", 1)
            with pytest.raises(Injected):
                fused.embed_batch([CTX, CTX[:4]], [3, 2], gpu.out, stream, graph=graph)
            assert _pinned(layer) == [0]
            assert _caches(layer)[0].stats.misses > 0
        fused.embed_batch([CTX, CTX[:4]], [3, 2], gpu.out, stream, graph=graph)
        assert _pinned(layer) == [0]
    finally:
        _close(fused, layer)


def test_a_call_on_another_stream_than_its_row_caches_is_refused(rng, tmp_path):
    """A RowCache scatters its rows on its own stream; a gather on another stream could read a
    slot before its rows land (nothing joins the two): refused, by both paths, before anything
    loads or launches."""
    gpu = FakeGpu()
    stream = gpu.create_stream()
    layer = _layer(gpu, rng, tmp_path, cached="cb")  # the caches load on stream 0
    fused = FusedNgramEmbedding(layer.weights, 16)
    try:
        gpu.launches.clear()
        for call in (lambda: fused.embed_batch([CTX], [2], gpu.out, stream),
                     lambda: fused.stage([CTX], [2], stream),
                     lambda: layer.embed(CTX, 2, gpu.out, gpu, stream)):
            with pytest.raises(ValueError, match=r"table 0's RowCache loads its rows on stream 0x0, this call runs on"):
                call()
        assert gpu.launches == [] and _caches(layer)[0].stats.misses == 0
        fused.embed_batch([CTX], [2], gpu.out, 0)  # its own stream: served
    finally:
        _close(fused, layer)


def test_closed_runners_and_caches_refuse_prefetch_and_stats(rng, tmp_path):
    """"Every call on a closed runner raises ClosedError" (README): the read-ahead calls too, and
    a closed RowCache's counters."""
    gpu = FakeGpu()
    layer = _layer(gpu, rng, tmp_path, cached="cb")
    fused = FusedNgramEmbedding(layer.weights, 16)
    assert layer.prefetch(CTX, 2) > 0 and fused.prefetch_batch([CTX], [2]) > 0  # rows of the cached table
    fused.close()
    layer.close()
    with pytest.raises(ClosedError):
        fused.prefetch_batch([CTX], [2])
    with pytest.raises(ClosedError):
        layer.prefetch(CTX, 2)
    cache = _caches(layer)[0]
    layer.weights.close()
    with pytest.raises(ClosedError, match="RowCache"):
        cache.stats


class _Source:
    """A ``RowSource`` that counts its pinned rows; ``closed`` makes ``end_batch`` raise."""

    rows, dim = 100, 4

    def __init__(self, closed: bool = False) -> None:
        self.pinned, self.closed = 0, closed

    def resolve(self, ids, slots_out) -> None:
        slots_out[:] = ids
        self.pinned += ids.size

    def table_dev_va(self) -> int:
        return 0x1000

    def scale_dev_va(self) -> None:
        return None

    def end_batch(self) -> None:
        if self.closed:
            raise ValueError("source is closed")
        self.pinned = 0


def test_batch_ends_every_cache_and_keeps_the_first_error():
    sources = [_Source(), _Source(closed=True), _Source()]
    rows = CachedRows([NgramTable.Cached(s) for s in sources])
    slots = np.empty((2, 3), np.uint32)
    with pytest.raises(Injected):
        with rows.batch():
            rows.resolve(np.array([[1, 2], [3, 4], [5, 6]]), slots)
            raise Injected("the body's failure propagates, not the closed source's")
    assert [s.pinned for s in sources] == [0, 2, 0]
    with pytest.raises(ValueError, match="source is closed"):
        with rows.batch():
            rows.resolve(np.array([[1, 2], [3, 4], [5, 6]]), slots)
    assert [s.pinned for s in sources] == [0, 4, 0]
    with rows.batch(0):
        assert rows.resolve_table(0, np.array([7, 8])).tolist() == [7, 8]
        assert sources[0].pinned == 2
    assert sources[0].pinned == 0


# -- the fused path's short replay ------------------------------------------------------------------------
def test_replayed_decode_step_uploads_what_the_general_path_packs(rng, tmp_path):
    gpu = FakeGpu()
    layer = _layer(gpu, rng, tmp_path)
    fused = FusedNgramEmbedding(layer.weights, 16)
    stream = gpu.create_stream()
    n = DIMS.max_ngram
    words = 2 * (n + 1)  # what one call of 2 rows uploads: windows [2, N], word ids [2]
    try:
        fused.embed(CTX[:3], 2, gpu.out, stream, graph=True)  # captures the (2, gpu.out, stream) shape
        for ctx in (CTX, np.array(CTX, np.int32), CTX[:3], CTX[:2]):
            fused.embed(ctx, 2, gpu.out, stream)  # the general path, eager
            want = gpu.read_as(fused.staging, words, np.uint32)
            gpu.memset(fused.staging, 0xAB, words * 4)
            replays = gpu.replays
            fused.embed(ctx, 2, gpu.out, stream, graph=True)
            assert gpu.replays == replays + 1
            assert np.array_equal(gpu.read_as(fused.staging, words, np.uint32), want), ctx
            assert want[:2 * n].reshape(2, n)[:, 0].tolist() == list(ctx[-2:])
        for ctx, error, says in (([1, 2, 3, 50], ValueError, "token 50 outside"),
                                 ([1.0, 2.0, 3.0, 4.0], TypeError, "integers"),
                                 ([[1, 2], [3, 4]], ValueError, "1-D"),
                                 ([1], ValueError, "exceeds the context's 1 tokens")):
            replays = gpu.replays
            with pytest.raises(error, match=says):
                fused.embed(ctx, 2, gpu.out, stream, graph=True)
            assert gpu.replays == replays
    finally:
        _close(fused, layer)


def test_prefetch_batch_checks_its_batch_as_embed_batch_does(rng, tmp_path):
    gpu = FakeGpu()
    layer = _layer(gpu, rng, tmp_path, cached="cb")
    fused = FusedNgramEmbedding(layer.weights, 16)
    try:
        with pytest.raises(ValueError, match="2 contexts, 1 seq_lens"):
            fused.prefetch_batch([CTX, CTX], [1])
        with pytest.raises(ValueError, match="token 50 outside"):
            fused.prefetch_batch([[1, 50]], [1])
        assert fused.prefetch_batch([CTX, CTX[:2]], [3, 2]) > 0
        assert _pinned(layer) == [0]
    finally:
        _close(fused, layer)
