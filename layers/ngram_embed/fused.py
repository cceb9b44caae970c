"""``FusedNgramEmbedding``: the n-gram embedding in two launches, beside the seed-faithful path.

The seed's ``embed`` makes 2 + 3T launches per call, hashes on the host and rounds the running
sum to bf16 T + 1 times. This path computes the same function as

    out = bf16((word[tok] + sum_c proj_c @ table_c[id_c]) * 1/(1+T))

with one ``ngram_gather`` (every table's id hashed on the GPU from the tokens, all T rows of each
new token gathered into one ``[R, T*td]`` bf16 buffer; fp8 rows dequantised) and one GEMM
against the projections concatenated into ``[D, T*td]`` (built once, here), accumulating in fp32,
adding the word row in its epilogue and rounding once. The host uploads one packed buffer per
call: each new token's look-back window ``[R, N]``, its word id ``[R]`` and, for cached tables,
the arena slots ``[R, T]`` that ``RowCache.resolve`` returned.

``embed_batch`` serves many sequences at once (ragged contexts, each with its own new tokens, one
output ``[sum S_i, D]``); with ``graph=True`` each shape is captured once as a CUDA graph
(upload, gather, GEMM) and replayed with only the packed host buffer rewritten: a decode step
is then one ``cuGraphLaunch``. Graphs are keyed by (rows, out, stream) and need a created stream.

The layer shares the ``NgramEmbedding``'s weights (no copies but the concatenated projections).
Like it, one instance must not run on two streams at once (its staging is shared).
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from gpu_runtime import DevicePtr, GpuBackend

from ..ops import gemm as gemm_ops
from ..ops import ngram_fused as fused_ops
from ..weight_map import BF16, DenseWeight
from .embedding import NgramEmbedding
from .cache_group import cache_group
from .ids import ids_from_windows, window_plan
from .row_cache import RowCache
from .tables import CachedTable, gather_entry

_U32 = 1 << 32


@functools.lru_cache(maxsize=64)
def _window_index(lens: tuple[int, ...], n: int) -> np.ndarray:
    """``[sum lens, n]`` positions into the padded tails (each ``s + n - 1`` long, back to back)
    of every row's window, newest first; cached per batch shape (decode steps repeat theirs)."""
    sizes = np.asarray(lens, np.int64)
    row_seq = np.repeat(np.arange(sizes.size), sizes)
    row_pos = np.arange(row_seq.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    tail_start = np.cumsum(sizes + n - 1) - (sizes + n - 1)
    index = (tail_start[row_seq] + row_pos + n - 1)[:, None] - np.arange(n)
    index.flags.writeable = False
    return index


def check_servable(dims, max_rows: int) -> None:
    """What the fused path cannot serve, refused before anything is built."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
    if dims.vocab_size >= fused_ops.NO_TOKEN:
        raise ValueError(f"fused n-gram path: vocab_size {dims.vocab_size} must be < 2**32 - 1")
    if dims.eos_id is not None and dims.eos_id >= fused_ops.NO_TOKEN:
        raise ValueError("fused n-gram path: eos_id must be < 2**32 - 1")
    if any(dims.table_rows(c) >= _U32 for c in range(dims.num_tables())):
        raise ValueError("fused n-gram path: every table must have < 2**32 rows")


class FusedNgramEmbedding:
    def __init__(self, layer: NgramEmbedding, max_rows: int, gpu: GpuBackend, stream: int = 0) -> None:
        dims = layer.dims
        check_servable(dims, max_rows)
        t, n, h, td = dims.num_tables(), dims.max_ngram, dims.hidden_size, dims.table_dim()
        self._owned_layer: NgramEmbedding | None = None  # set by from_pretrained: closed with this
        self.layer, self.dims, self.gpu, self.max_rows = layer, dims, gpu, max_rows
        self.inv_scale = float(np.float32(1.0) / np.float32(1 + t))
        self.gather_k = gpu.kernel("ngram_fused", "ngram_gather")
        self.gemm_k = gpu.kernel("gemm", gemm_ops.WORD_KERNEL)
        self.cached = [i for i, tb in enumerate(layer.tables) if isinstance(tb, CachedTable)]
        # Cached tables: ids hashed on the host from the windows in one pass (_ids_plan), the
        # RowCache ones resolved together by one CacheGroup, other RowSources one by one.
        self._ids_plan = window_plan(dims, tuple(self.cached)) if self.cached else None
        grouped = [j for j, c in enumerate(self.cached) if isinstance(layer.tables[c].cache, RowCache)]
        self._group_rows = grouped  # rows of the ids (positions in self.cached) of the group's members
        self._group_cols = [self.cached[j] for j in grouped]  # their tables: columns of the slots
        self._group_all = len(grouped) == t  # every table in the group: it writes the packed slots itself
        self._cache_group = cache_group([layer.tables[self.cached[j]].cache for j in grouped]) if grouped else None
        self._other_cached = [(j, self.cached[j]) for j in range(len(self.cached)) if j not in grouped]
        self._row_words = n + 1 + (t if self.cached else 0)  # u32 words uploaded per output row
        self._graphs: dict[tuple[int, int, int], int] = {}
        self._host = None  # pinned packed-upload buffer, made with the first graph
        self._done = 0  # event recorded after every call: its buffers are free again
        self.projs_cat = self.desc = self.pows = self.gather_buf = self.staging = DevicePtr(0)
        try:
            self._done = gpu.create_event()
            self.projs_cat = self._concat_projections(layer, stream)
            self.desc = self._upload(self._table_entries(), stream)
            self.pows = self._upload(np.array([[pow(dims.vocab_size, d, dims.table_rows(c)) for d in range(n)]
                                               for c in range(t)], np.uint64), stream)
            self.gather_buf = gpu.alloc(max_rows * t * td * 2)
            self.staging = gpu.alloc(max_rows * self._row_words * 4)
        except BaseException:
            self.close()
            raise
        self.projs_weight = DenseWeight(self.projs_cat, (h, t * td), np.dtype(BF16), DevicePtr(0), gpu)

    @classmethod
    def from_pretrained(cls, model_dir: str, gpu: GpuBackend, *, max_rows: int = 8192, stream: int = 0,
                        **layer_args) -> "FusedNgramEmbedding":
        """``NgramEmbedding.from_pretrained(model_dir, gpu, stream=stream, **layer_args)``
        (placement, max_tokens, eos_id, table_dir, cache_rows) wrapped in the fused path, which
        then owns the layer: ``close()`` frees both. Refusals come before any upload."""
        from .checkpoint import NgramCheckpoint

        dims = NgramCheckpoint.open(model_dir, eos_id=layer_args.get("eos_id"), parts="dense").dims
        check_servable(dims, max_rows)
        layer = NgramEmbedding.from_pretrained(model_dir, gpu, stream=stream, **layer_args)
        try:
            fused = cls(layer, max_rows, gpu, stream)
        except BaseException:
            layer.close()
            raise
        fused._owned_layer = layer
        return fused

    # -- construction helpers ---------------------------------------------------------------------
    def _concat_projections(self, layer: NgramEmbedding, stream: int) -> DevicePtr:
        """``[D, T*td]``: row j is proj_0[j] ++ proj_1[j] ++ ...; one pitched copy per table."""
        t, h, td = self.dims.num_tables(), self.dims.hidden_size, self.dims.table_dim()
        cat = self.gpu.alloc(h * t * td * 2)
        for c, proj in enumerate(layer.projs):
            self.gpu.copy_2d_async(cat.offset(c * td * 2), t * td * 2, proj.weight, td * 2, td * 2, h, stream)
        return cat

    def _table_entries(self) -> np.ndarray:
        return np.array([gather_entry(table, self.dims.table_rows(c))
                         for c, table in enumerate(self.layer.tables)], np.uint64).reshape(-1, 4)

    def _upload(self, array: np.ndarray, stream: int) -> DevicePtr:
        ptr = self.gpu.alloc(array.nbytes)
        self.gpu.copy_h2d_async(array, ptr, stream)
        return ptr

    # -- calls ------------------------------------------------------------------------------------
    def embed(self, ctx_tokens: Sequence[int] | np.ndarray, seq_len: int, out: int, gpu: GpuBackend,
              stream: int = 0, *, graph: bool = False) -> None:
        """The embedding of the last ``seq_len`` tokens of ``ctx_tokens`` into ``out``."""
        if graph and not self.cached and self._replay_tail(ctx_tokens, seq_len, out, stream):
            return
        self.embed_batch([ctx_tokens], [seq_len], out, gpu, stream, graph=graph)

    def _replay_tail(self, ctx: Sequence[int] | np.ndarray, seq_len: int, out: int, stream: int) -> bool:
        """The decode loop's call (one context, a shape already captured, no cached tables) in a
        few numpy operations: the window rows are the context's tail read through a cached
        index. Returns False, having done nothing, for anything else (the general path then
        serves or refuses it)."""
        if isinstance(seq_len, (bool, np.bool_)) or not isinstance(seq_len, (int, np.integer)):
            return False
        exe = self._graphs.get((seq_len, out, stream))
        n = self.dims.max_ngram
        want = seq_len + n - 1
        if exe is None or not hasattr(ctx, "__len__") or getattr(ctx, "ndim", 1) != 1 or len(ctx) < want:
            return False
        tail = np.asarray(ctx[len(ctx) - want:])
        if (tail.ndim != 1 or tail.dtype.kind not in "iu" or (tail.dtype.kind == "i" and tail.min() < 0)
                or tail.max() >= self.dims.vocab_size or not self.staging or not self.layer.ids_dev):
            return False
        self.gpu.event_synchronize(self._done)  # the previous call's upload has read the buffer
        words = self._host.view(np.uint32)
        words[:seq_len * n] = tail[_window_index((int(seq_len),), n)].reshape(-1)
        words[seq_len * n:seq_len * (n + 1)] = tail[n - 1:]
        self.gpu.launch_graph(exe, stream)
        self.gpu.record_event(self._done, stream)
        return True

    def embed_batch(self, contexts: Sequence[Sequence[int] | np.ndarray], seq_lens: Sequence[int],
                    out: int, gpu: GpuBackend, stream: int = 0, *, graph: bool = False) -> None:
        """Sequence i's last ``seq_lens[i]`` tokens, rows in order, into ``out [sum S_i, D]`` bf16.
        Everything is validated before anything is uploaded or launched."""
        if self.staging == 0:
            raise ValueError("fused ngram embed: closed")
        if self.layer.ids_dev == 0:
            raise ValueError("fused ngram embed: its NgramEmbedding is closed")
        if len(contexts) != len(seq_lens):
            raise ValueError(f"fused ngram embed: {len(contexts)} contexts, {len(seq_lens)} seq_lens")
        windows = self._windows(contexts, seq_lens)
        rows = windows.shape[0]
        if rows == 0:
            return
        if rows > self.max_rows:
            raise ValueError(f"fused ngram embed: {rows} rows over max_rows {self.max_rows}")
        if not out:
            raise ValueError("fused ngram embed out: null device pointer")
        if graph and not stream:
            raise ValueError("fused ngram embed: graph=True needs a created stream, not the default stream")
        try:
            packed = self._pack(windows, contexts, seq_lens)  # resolves cached tables: the last step
            if graph:
                self._replay(packed, rows, out, stream)
            else:
                gpu.copy_h2d_async(packed, self.staging, stream)
                self._launch(rows, out, stream)
                gpu.record_event(self._done, stream)
        finally:
            if self._cache_group is not None:
                self._cache_group.end_batch()
            for _, c in self._other_cached:
                self.layer.tables[c].cache.end_batch()

    def prefetch_batch(self, contexts: Sequence[Sequence[int] | np.ndarray], seq_lens: Sequence[int]) -> int:
        """Start reading ahead the cached tables' rows of a later ``embed_batch`` (as soon as its
        tokens are known); returns the rows queued. Nothing to do without cached tables."""
        if not self.cached:
            return 0
        return sum(self.layer.prefetch(ctx, s) for ctx, s in zip(contexts, seq_lens))

    def _windows(self, contexts: Sequence, seq_lens: Sequence[int]) -> np.ndarray:
        """``[R, N]`` u32: each new token and the N - 1 before it (``NO_TOKEN`` before the start).
        Only each context's tail is read and converted; the per-sequence loop only slices and
        checks, the rest is one vectorised pass over the batch (a serving step has hundreds of
        sequences, a decode call one: both stay a handful of numpy operations)."""
        n, v = self.dims.max_ngram, self.dims.vocab_size
        tails, lens = [], []
        for i, (ctx, s) in enumerate(zip(contexts, seq_lens)):
            if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)) or s < 0:
                raise ValueError(f"fused ngram embed: seq_lens[{i}] must be a non-negative int, got {s!r}")
            if not hasattr(ctx, "__len__") or getattr(ctx, "ndim", 1) != 1:
                raise ValueError(f"fused ngram embed: context {i} must be 1-D")
            if s > len(ctx):
                raise ValueError(f"fused ngram embed: seq_lens[{i}] = {s} over its {len(ctx)} tokens")
            if s:
                tails.append(ctx[max(len(ctx) - s - n + 1, 0):])
                lens.append(int(s))
        if not tails:
            return np.zeros((0, n), np.uint32)
        flat = np.asarray(tails[0]) if len(tails) == 1 else np.concatenate(tails)
        if flat.ndim != 1:
            raise ValueError(f"fused ngram embed: contexts must be 1-D, got rows of shape {flat.shape[1:]}")
        if flat.dtype.kind not in "iu":
            raise ValueError("fused ngram embed: contexts must hold integer token ids")
        if (flat.dtype.kind == "i" and flat.min() < 0) or flat.max() >= v:
            bad = flat[(flat < 0) | (flat >= v)][0]
            raise ValueError(f"fused ngram embed: token {int(bad)} outside 0..V-1 = 0..{v - 1}")
        # Each tail padded in front to s + n - 1 entries with NO_TOKEN (before the context start).
        padded = np.empty(sum(lens) + len(lens) * (n - 1), np.uint32)
        if len(lens) == 1:
            padded[:padded.size - flat.size] = fused_ops.NO_TOKEN
            padded[padded.size - flat.size:] = flat
        else:
            padded.fill(fused_ops.NO_TOKEN)
            ends = np.cumsum(np.asarray(lens, np.int64) + (n - 1))
            sizes = np.fromiter((len(tail) for tail in tails), np.int64, len(tails))
            dest = np.repeat(ends - sizes, sizes) + (np.arange(flat.size) - np.repeat(np.cumsum(sizes) - sizes, sizes))
            padded[dest] = flat
        return padded[_window_index(tuple(lens), n)]

    def _pack(self, windows: np.ndarray, contexts: Sequence, seq_lens: Sequence[int]) -> np.ndarray:
        """One u32 buffer: windows [R, N], word ids [R], then (cached tables) slots [R, T]."""
        rows, n, t = windows.shape[0], self.dims.max_ngram, self.dims.num_tables()
        packed = np.empty(rows * self._row_words, np.uint32)
        packed[:rows * n] = windows.reshape(-1)
        packed[rows * n:rows * (n + 1)] = windows[:, 0]
        if self.cached:
            slots = packed[rows * (n + 1):].reshape(rows, t)
            # [len(cached), R] ids of every cached table in one pass over the windows, which
            # _windows built and checked; each is its hash modulo the table's rows (in range).
            ids = ids_from_windows(self._ids_plan, windows)
            tables = self.layer.tables
            for j, c in self._other_cached:  # every refusal before the first load
                if hasattr(tables[c].cache, "validate"):
                    tables[c].cache.validate(ids[j])
            group = self._cache_group
            if group is not None and self._group_all:  # the group checks all, then loads
                group.resolve(ids, slots, in_range=True)
            else:
                slots[:] = 0
                if group is not None:
                    group_slots = np.empty((rows, len(self._group_rows)), np.uint32)
                    group.resolve(ids[self._group_rows], group_slots, in_range=True)
                    slots[:, self._group_cols] = group_slots
                column = np.empty(rows, np.uint32)
                for j, c in self._other_cached:
                    tables[c].cache.resolve(ids[j], column)
                    slots[:, c] = column
        return packed

    def _launch(self, rows: int, out: int, stream: int) -> None:
        dims, n, t, td = self.dims, self.dims.max_ngram, self.dims.num_tables(), self.dims.table_dim()
        words = self.staging.offset(rows * n * 4)
        slots = self.staging.offset(rows * (n + 1) * 4) if self.cached else 0
        fused_ops.ngram_gather(self.gpu, self.gather_k, self.staging, self.desc, self.pows, slots,
                               self.gather_buf, 0, rows, t, n, dims.splits, td, dims.eos_id, stream)
        gemm_ops.dense_gemm_bf16_word(self.gpu, self.gemm_k, self.gather_buf, self.projs_weight, out, rows,
                                      dims.hidden_size, t * td, words, self.layer.word.weight,
                                      self.inv_scale, stream, overlap=True)

    def _replay(self, packed: np.ndarray, rows: int, out: int, stream: int) -> None:
        gpu = self.gpu
        if self._host is None:
            self._host = gpu.alloc_host(self.max_rows * self._row_words * 4)
        gpu.event_synchronize(self._done)  # the previous call (and its upload) is done with the buffer
        host = self._host[:packed.nbytes]
        host.view(np.uint32)[:] = packed
        key = (rows, int(out), int(stream))
        exe = self._graphs.get(key)
        if exe is None:
            # A new shape runs eagerly once (loading kernels and setting their attributes,
            # which a capture must not do), then is captured for the next calls.
            gpu.upload_pinned_async(host, self.staging, stream)
            self._launch(rows, out, stream)
            gpu.record_event(self._done, stream)
            gpu.begin_capture(stream)
            try:
                gpu.upload_pinned_async(host, self.staging, stream)
                self._launch(rows, out, stream)
            except BaseException:
                gpu.abort_capture(stream)
                raise
            self._graphs[key] = gpu.end_capture(stream)
            return
        gpu.launch_graph(exe, stream)
        gpu.record_event(self._done, stream)

    def close(self) -> None:
        """Free the graphs, the concatenated projections and the staging (not the layer's weights,
        unless ``from_pretrained`` built the layer: then the layer too)."""
        layer, self._owned_layer = self._owned_layer, None
        try:
            self._close()
        finally:
            if layer is not None:
                layer.close()

    def _close(self) -> None:
        gpu = self.gpu
        if getattr(gpu, "closed", False):
            return
        if self._done:  # the last call's work is done (its stream may be gone: wait on the event)
            gpu.event_synchronize(self._done)
        for exe in self._graphs.values():
            gpu.destroy_graph(exe)
        self._graphs.clear()
        if self._host is not None:
            gpu.free_host(self._host)
            self._host = None
        if self._done:
            gpu.destroy_event(self._done)
            self._done = 0
        for name in ("projs_cat", "desc", "pows", "gather_buf", "staging"):
            ptr = getattr(self, name)
            if ptr:
                gpu.free(ptr)
            setattr(self, name, DevicePtr(0))

    def __enter__(self) -> "FusedNgramEmbedding":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
