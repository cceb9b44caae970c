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
is then one ``cuGraphLaunch``. Graphs are keyed by (rows, out, stream) and need a created stream
and a backend with graphs (``gpu_runtime.Graphs``).

The layer shares the ``NgramEmbedding``'s weights (no copies but the concatenated projections),
so it is built on the layer's own backend (``FusedNgramEmbedding(layer, max_rows, gpu)`` refuses
another ``gpu``, and every call's ``gpu`` must be that one too). Like the layer, one instance must
not run on two streams at once (its staging is shared).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import numpy as np

from gpu_runtime import Events, GpuBackend, Graphs, PitchedCopies, interop, validate

from ..kernel_files import load_kernel
from ..ops import gemm as gemm_ops
from ..ops import ngram_fused as fused_ops
from ..ops.ngram_decode import NO_ADAPTER
from ..overlay.slots import OverlaySlots
from ..weight_map import BF16, DenseWeight
from .front import (check_tokens, context_tail, require_backend, require_open, window_index,
                    windows as front_windows)
from .cached_rows import CachedRows
from .embedding import NgramEmbedding
from .ids import ids_from_windows, window_plan
from .resources import Resources
from .tables import gather_entry

_U32 = 1 << 32
_WHAT = "fused ngram embed"


def check_servable(dims, max_rows: int) -> int:
    """What the fused path cannot serve, refused before anything is built; ``max_rows`` as an int."""
    max_rows = validate.positive(max_rows, "max_rows")
    if dims.vocab_size >= fused_ops.NO_TOKEN:
        raise ValueError(f"fused n-gram path: vocab_size {dims.vocab_size} must be < 2**32 - 1")
    if dims.eos_id is not None and dims.eos_id >= fused_ops.NO_TOKEN:
        raise ValueError("fused n-gram path: eos_id must be < 2**32 - 1")
    if any(dims.table_rows(c) >= _U32 for c in range(dims.num_tables())):
        raise ValueError("fused n-gram path: every table must have < 2**32 rows")
    return max_rows


def check_adapter_slots(what: str, slots: OverlaySlots | None, dims: Any, gpu: GpuBackend) -> None:
    """``slots`` (None: no adapters) can route this model's word rows: open ``OverlaySlots`` on
    ``gpu`` whose vocab and row width are the model's (an adapter of another width is refused
    when it is loaded into them)."""
    if slots is None:
        return
    if not isinstance(slots, OverlaySlots):
        raise TypeError(f"{what}: adapter_slots must be an OverlaySlots, got {type(slots).__name__}")
    validate.require_open(slots.closed, f"{what}: its adapter_slots")
    if slots.gpu is not gpu:
        raise ValueError(f"{what}: adapter_slots live on another backend than the layer")
    if (slots.vocab, slots.h) != (dims.vocab_size, dims.hidden_size):
        raise ValueError(f"{what}: adapter_slots hold vocab {slots.vocab} x {slots.h}, the model's "
                         f"word table is {dims.vocab_size} x {dims.hidden_size}")


def gemm_path(batch_invariant: bool) -> str | None:
    """The word GEMM's path: the GEMM's paths sum a row in different orders, so which one m picks
    can move a row's rounding; the small path, forced for every m, sums each row the same way
    whatever else is in the batch (slower for large m: bench.decode's batch-invariant rows)."""
    return "small" if validate.boolean(batch_invariant, "batch_invariant") else None


def out_address(out: Any, what: str, rows: int, dims: Any, gpu: GpuBackend) -> int:
    """The address of an output of ``rows`` rows of D bf16, writable (an address, a
    ``DeviceArray`` or a foreign array: ``gpu_runtime.interop``)."""
    h = dims.hidden_size
    return interop.device_address(out, f"{what} out", dtypes=(interop.BF16,), count=rows * h, gpu=gpu,
                                  cols=h, writable=True)


def adapter_index(value: Any, num_slots: int, what: str) -> int | None:
    """One sequence's adapter slot as given on the host: None for ``NO_ADAPTER`` (or -1)."""
    a = validate.integer(value, what)
    if a in (NO_ADAPTER, -1):
        return None
    if not 0 <= a < num_slots:
        raise ValueError(f"{what}: adapter slot {a} outside 0..{num_slots - 1} (NO_ADAPTER: none)")
    return a


def check_layer(what: str, layer: NgramEmbedding, gpu: GpuBackend) -> None:
    """A layer the fused path (or the decoder over it) can be built on, with ``gpu``: open, on
    this very backend (every upload and launch goes through the one given at construction: the
    layer's weights live in its context), which has events and pitched copies."""
    validate.require_open(layer.closed, f"{what}: the layer it serves ({type(layer).__name__})")
    require_backend(what, gpu, layer.gpu)
    if not (isinstance(gpu, Events) and isinstance(gpu, PitchedCopies)):
        raise TypeError(f"{what}: the backend needs events and pitched copies (gpu_runtime.Events, "
                        f"PitchedCopies); {type(gpu).__name__} lacks them")


class FusedNgramEmbedding:
    """The fused path over ``layer`` (module doc); ``adapter_slots``: the ``OverlaySlots`` whose
    embedding rows ``embed_batch(..., adapters=)`` selects inside the n-gram sum;
    ``batch_invariant``: every row's bits independent of the batch it is in (``gemm_path``)."""

    def __init__(self, layer: NgramEmbedding, max_rows: int, gpu: GpuBackend, stream: int = 0, *,
                 adapter_slots: OverlaySlots | None = None, batch_invariant: bool = False) -> None:
        dims = layer.dims
        max_rows = check_servable(dims, max_rows)
        check_layer("FusedNgramEmbedding", layer, gpu)
        check_adapter_slots("FusedNgramEmbedding", adapter_slots, dims, gpu)
        self.adapter_slots = adapter_slots
        self.gemm_path = gemm_path(batch_invariant)
        t, n, h, td = dims.num_tables(), dims.max_ngram, dims.hidden_size, dims.table_dim()
        self._owned_layer: NgramEmbedding | None = None  # set by from_pretrained: closed with this
        self.layer, self.dims, self.gpu, self.max_rows = layer, dims, gpu, max_rows
        self.inv_scale = float(np.float32(1.0) / np.float32(1 + t))
        self.gather_k = load_kernel(gpu, "ngram_fused", "ngram_gather")
        self.gemm_k = load_kernel(gpu, "gemm", gemm_ops.WORD_KERNEL)
        # Cached tables: ids hashed on the host from the windows in one pass (_ids_plan), the
        # RowCache ones resolved together by one CacheGroup, other RowSources one by one.
        self._rows = CachedRows(layer.tables, grouped=True)
        self.cached = self._rows.columns
        self._ids_plan = window_plan(dims, tuple(self.cached)) if self.cached else None
        # u32 words uploaded per output row: window, word id, cached tables' slots, and (with
        # adapter slots) the u64 address of its replacement word row, after an alignment word
        self._base_words = n + 1 + (t if self.cached else 0)
        self._row_words = self._base_words + (3 if adapter_slots is not None else 0)
        self._can_graph = isinstance(gpu, Graphs)
        self._graphs: dict[tuple[int, int, int, bool], int] = {}
        self._host = None  # pinned packed-upload buffer, made with the first graph
        self._resources = own = Resources(gpu)  # every buffer, event, graph: released by close()
        try:
            self._done = done = gpu.create_event()  # recorded after every call: its buffers are free again
            own.on_close(partial(gpu.destroy_event, done))
            self.projs_cat = self._concat_projections(layer, stream)
            self.desc = own.upload(self._table_entries(), stream)
            self.pows = own.upload(np.array([[pow(dims.vocab_size, d, dims.table_rows(c)) for d in range(n)]
                                             for c in range(t)], np.uint64), stream)
            self.gather_buf = own.alloc(max_rows * self._gather_row_bytes())
            self.staging = own.alloc(max_rows * self._row_words * 4)
        except BaseException:
            own.close()
            raise
        self.projs_weight = DenseWeight(self.projs_cat, (h, t * td), np.dtype(BF16), gpu=gpu)  # owns nothing

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
    def _concat_projections(self, layer: NgramEmbedding, stream: int) -> int:
        """``[D, T*td]``: row j is proj_0[j] ++ proj_1[j] ++ ...; one pitched copy per table."""
        t, h, td = self.dims.num_tables(), self.dims.hidden_size, self.dims.table_dim()
        cat = self._resources.alloc(h * t * td * 2)
        for c, proj in enumerate(layer.projs):
            self.gpu.copy_2d_async(cat.offset(c * td * 2), t * td * 2, proj.weight, td * 2, td * 2, h, stream)
        return cat

    def _gather_row_bytes(self) -> int:
        """Bytes of ``gather_buf`` per output row: the T gathered rows (a tensor-parallel rank
        keeps its word rows there too)."""
        return self.dims.num_tables() * self.dims.table_dim() * 2

    def _table_entries(self) -> np.ndarray:
        return np.array([gather_entry(table, self.dims.table_rows(c))
                         for c, table in enumerate(self.layer.tables)], np.uint64).reshape(-1, 4)

    # -- calls ------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._resources.closed

    @property
    def captured_graphs(self) -> int:
        """How many call shapes (rows, out, stream, adapters) have a captured graph (``graph=True``)."""
        return len(self._graphs)

    def captured_graph(self, rows: int, out: int, stream: int, adapters: bool = False) -> int | None:
        """The graph captured for calls of ``rows`` rows into ``out`` on ``stream`` (with or
        without adapters), if any (a benchmark replays it alone to time the GPU's work)."""
        return self._graphs.get((rows, int(out), int(stream), adapters))

    def embed(self, ctx_tokens: Sequence[int] | np.ndarray, seq_len: int, out: int, gpu: GpuBackend,
              stream: int = 0, *, graph: bool = False) -> None:
        """The embedding of the last ``seq_len`` tokens of ``ctx_tokens`` into ``out``; ``gpu``
        must be the backend the layer was built with (as for ``NgramEmbedding.embed``)."""
        if graph and not self.cached and self._replay_tail(ctx_tokens, seq_len, out, gpu, stream):
            return
        self.embed_batch([ctx_tokens], [seq_len], out, gpu, stream, graph=graph)

    def _replay_tail(self, ctx: Sequence[int] | np.ndarray, seq_len: int, out: int, gpu: GpuBackend,
                     stream: int) -> bool:
        """The decode loop's call (one context that reaches back N - 1 tokens before its new ones,
        a shape already captured, no cached tables) in a few numpy operations: the window rows
        are the context's tail read through a cached index, written straight into the pinned
        upload. Refuses a bad context as the general path does (``front``'s checks); returns
        False, having done nothing, for anything else (the general path then serves or refuses
        it: a seq_len that is not a plain int, an unknown shape, a foreign backend, a closed
        layer)."""
        exe = self._graphs.get((seq_len, out, stream, False)) if type(seq_len) is int and isinstance(out, int) else None
        if exe is None or gpu is not self.gpu or self.layer.closed:
            return False
        n = self.dims.max_ngram
        tail, start = context_tail(ctx, seq_len, n - 1, _WHAT)
        if not start and len(tail) < seq_len + n - 1:
            return False  # reaches the context start: padded windows (the general path)
        tail = check_tokens(np.asarray(tail), self.dims.vocab_size, _WHAT)
        self.gpu.event_synchronize(self._done)  # the previous call's upload has read the buffer
        words = self._host.view(np.uint32)
        words[:seq_len * n] = tail[window_index((seq_len,), n)].reshape(-1)
        words[seq_len * n:seq_len * (n + 1)] = tail[n - 1:]
        self.gpu.launch_graph(exe, stream)
        self.gpu.record_event(self._done, stream)
        return True

    def embed_batch(self, contexts: Sequence[Sequence[int] | np.ndarray], seq_lens: Sequence[int],
                    out: Any, gpu: GpuBackend, stream: int = 0, *, graph: bool = False,
                    adapters: Sequence[int] | None = None) -> None:
        """Sequence i's last ``seq_lens[i]`` tokens, rows in order, into ``out [sum S_i, D]`` bf16
        (an address, a ``DeviceArray`` or a CuPy / torch / JAX array: ``gpu_runtime.interop``);
        ``gpu`` must be the backend the layer was built with. ``adapters[i]``: sequence i's
        adapter slot in ``adapter_slots`` (``NO_ADAPTER`` or -1: none); an overridden token's word
        row is the adapter's, inside the sum (as if the word table held it). Everything is
        validated before anything is uploaded or launched; cached tables' rows are unpinned
        after the launches, or after a failure (``CachedRows.batch``)."""
        require_open(_WHAT, self, self.layer)
        require_backend(_WHAT, gpu, self.gpu)
        windows = self.windows(contexts, seq_lens)
        over = self._word_over(adapters, seq_lens, windows)
        rows = windows.shape[0]
        if rows == 0:
            return
        if rows > self.max_rows:
            raise ValueError(f"fused ngram embed: {rows} rows over max_rows {self.max_rows}")
        out = out_address(out, _WHAT, rows, self.dims, self.gpu)
        if graph:
            if not stream:
                raise ValueError("fused ngram embed: graph=True needs a created stream, not the default "
                                 "stream")
            if not self._can_graph:
                raise TypeError(f"fused ngram embed: graph=True needs a backend with CUDA graphs "
                                f"(gpu_runtime.Graphs); {type(self.gpu).__name__} has none")
        with self._rows.batch():
            packed = self.pack(windows, over)  # resolves cached tables: the last step before the launches
            if graph:
                self._replay(packed, rows, out, stream, over is not None)
            else:
                self.gpu.copy_h2d_async(packed, self.staging, stream)
                self._launch(rows, out, stream, over is not None)
                self.gpu.record_event(self._done, stream)

    def _word_over(self, adapters: Sequence[int] | None, seq_lens: Sequence[int],
                   windows: np.ndarray) -> np.ndarray | None:
        """Each row's replacement word row address (0: the base table's) for ``adapters``,
        checked; None without adapters."""
        if adapters is None:
            return None
        slots = self.adapter_slots
        if slots is None:
            raise ValueError(f"{_WHAT}: adapters given, but the layer was built without adapter_slots")
        if len(adapters) != len(seq_lens):
            raise ValueError(f"{_WHAT}: {len(adapters)} adapters for {len(seq_lens)} sequences")
        index = [adapter_index(a, slots.num_slots, f"{_WHAT}: adapters[{i}]") for i, a in enumerate(adapters)]
        over = np.zeros(windows.shape[0], np.uint64)
        start = 0
        for a, n in zip(index, seq_lens):
            if a is not None and n:
                over[start:start + n] = slots.embed_row_addresses(a, windows[start:start + n, 0])
            start += int(n)
        return over

    def prefetch_batch(self, contexts: Sequence[Sequence[int] | np.ndarray], seq_lens: Sequence[int]) -> int:
        """Start reading ahead the cached tables' rows of a later ``embed_batch`` (as soon as its
        tokens are known; checked as ``embed_batch`` checks them); returns the rows queued.
        Nothing to do without cached tables."""
        if not self.cached:
            return 0
        ids = ids_from_windows(self._ids_plan, self.windows(contexts, seq_lens))
        return sum(cache.prefetch(ids[j]) for j, cache in enumerate(self._rows.caches)
                   if hasattr(cache, "prefetch"))

    # -- the host half of a call (public for benchmarks and tests) --------------------------------
    def windows(self, contexts: Sequence, seq_lens: Sequence[int]) -> np.ndarray:
        """``[R, N]`` u32 look-back windows of a batch (``front_windows``), refused as
        ``embed_batch`` refuses a bad batch: what ``pack`` takes."""
        if len(contexts) != len(seq_lens):
            raise ValueError(f"fused ngram embed: {len(contexts)} contexts, {len(seq_lens)} seq_lens")
        return front_windows(self.dims, contexts, seq_lens, _WHAT)

    def pack(self, windows: np.ndarray, over: np.ndarray | None = None) -> np.ndarray:
        """What a call uploads, as one u32 buffer: ``windows`` [R, N], word ids [R], then (cached
        tables) the arena slots [R, T], resolved here: their rows stay pinned until the
        ``batch()`` this is called in ends; then (``over``, with adapter slots) each row's
        replacement word row address, u64 [R] at ``_over_offset(R)``."""
        rows, n, t = windows.shape[0], self.dims.max_ngram, self.dims.num_tables()
        packed = np.empty(rows * self._row_words, np.uint32)
        packed[:rows * n] = windows.reshape(-1)
        packed[rows * n:rows * (n + 1)] = windows[:, 0]
        if over is not None:
            at = self._over_offset(rows) // 4
            packed[at:at + 2 * rows] = over.view(np.uint32)
        if self.cached:
            # [len(cached), R] ids of every cached table in one pass over the windows, which
            # ``windows`` built and checked; each is its hash modulo the table's rows (in range).
            ids = ids_from_windows(self._ids_plan, windows)
            self._rows.resolve(ids, packed[rows * (n + 1):].reshape(rows, t), in_range=True)
        return packed

    def batch(self):
        """A context manager that ends the cached tables' batch on leaving (``CachedRows.batch``),
        after a failure too; around ``pack``."""
        return self._rows.batch()

    # -- launches ------------------------------------------------------------------------------
    def _over_offset(self, rows: int) -> int:
        """Byte offset in the staging of a call's u64 word-row addresses (8-byte aligned)."""
        return -(-rows * self._base_words * 4 // 8) * 8

    def _launch(self, rows: int, out: int, stream: int, over: bool = False) -> None:
        dims, n, t, td = self.dims, self.dims.max_ngram, self.dims.num_tables(), self.dims.table_dim()
        words = self.staging.offset(rows * n * 4)
        slots = self.staging.offset(rows * (n + 1) * 4) if self.cached else 0
        fused_ops.ngram_gather(self.gpu, self.gather_k, self.staging, self.desc, self.pows, slots,
                               self.gather_buf, 0, rows, t, n, dims.splits, td, dims.eos_id, stream)
        gemm_ops.dense_gemm_bf16_word(self.gpu, self.gemm_k, self.gather_buf, self.projs_weight, out, rows,
                                      dims.hidden_size, t * td, words, self.layer.word.weight,
                                      self.inv_scale, stream, overlap=True, path=self.gemm_path,
                                      word_over=self.staging.offset(self._over_offset(rows)) if over else 0)

    def _replay(self, packed: np.ndarray, rows: int, out: int, stream: int, over: bool = False) -> None:
        gpu = self.gpu
        if self._host is None:
            self._host = gpu.alloc_host(self.max_rows * self._row_words * 4)
            self._resources.on_close(partial(gpu.free_host, self._host))
        gpu.event_synchronize(self._done)  # the previous call (and its upload) is done with the buffer
        host = self._host[:packed.nbytes]
        host.view(np.uint32)[:] = packed
        key = (rows, int(out), int(stream), over)
        exe = self._graphs.get(key)
        if exe is None:
            # A new shape runs eagerly once (loading kernels and setting their attributes,
            # which a capture must not do), then is captured for the next calls.
            gpu.upload_pinned_async(host, self.staging, stream)
            self._launch(rows, out, stream, over)
            gpu.record_event(self._done, stream)
            gpu.begin_capture(stream)
            try:
                gpu.upload_pinned_async(host, self.staging, stream)
                self._launch(rows, out, stream, over)
            except BaseException:
                gpu.abort_capture(stream)
                raise
            self._graphs[key] = exe = gpu.end_capture(stream)
            self._resources.on_close(partial(gpu.destroy_graph, exe))
            return
        gpu.launch_graph(exe, stream)
        gpu.record_event(self._done, stream)

    def close(self) -> None:
        """Free the graphs, the concatenated projections and the staging (not the layer's weights,
        unless ``from_pretrained`` built the layer: then the layer too); once."""
        layer, self._owned_layer = self._owned_layer, None
        try:
            if not self._resources.closed and not self.gpu.closed:
                # The last call's work is done before anything goes (its stream may be gone:
                # wait on the event).
                self.gpu.event_synchronize(self._done)
            self._graphs.clear()
            self._host = None
            self._resources.close()  # graphs, pinned buffer, device buffers, event: the last made first
        finally:
            if layer is not None:
                layer.close()

    def __enter__(self) -> "FusedNgramEmbedding":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
