"""``FusedNgramEmbedding``: the n-gram embedding in two launches, beside the seed-faithful path.

The seed's ``embed`` makes 2 + 3T launches per call, hashes on the host and rounds the running
sum to bf16 T + 1 times. This path computes the same function as

    out = bf16((word[tok] + sum_c proj_c @ table_c[id_c]) * 1/(1+T))

with one ``ngram_gather`` (every table's id hashed on the GPU from the tokens, all T rows of each
new token gathered into one ``[R, T*td]`` bf16 buffer, td the table width; fp8 rows dequantised)
and one GEMM against the projections concatenated into ``[D, T*td]`` (``RowProjection``),
accumulating in fp32, adding the word row in its epilogue and rounding once. The host uploads one packed buffer per
call: each new token's look-back window ``[R, N]``, its word id ``[R]`` and, for cached tables,
the arena slots ``[R, T]`` that ``RowCache.resolve`` returned.

``embed_batch`` serves many sequences at once (ragged contexts, each with its own new tokens, one
output ``[sum S_i, D]``); with ``graph=True`` each shape is captured once as a CUDA graph
(upload, gather, GEMM) and replayed with only the packed host buffer rewritten: a decode step
is then one ``cuGraphLaunch``. Graphs are keyed by (rows, out, stream, whether adapters are
given) and need a created stream and a backend with graphs and pinned host memory
(``gpu_runtime.Graphs``, ``PinnedHostMemory``).

The runner borrows ``NgramWeights`` (no copies but the concatenated projections, built once on
the weights). With a tensor-parallel shard's weights it runs one rank: pass ``collective=`` to
serve ``embed``/``embed_batch`` (the all-reduce inside the call, captured with it), or drive every
rank from one process with ``embed_all``. One instance must not run on two streams at once (its
staging is shared).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from gpu_runtime import Graphs, PinnedHostMemory, PreparedLaunch, validate

from ..kernel_files import load_kernel
from ..ops.ngram_fused import NgramGather
from ..overlay.slots import OverlaySlots
from ..resources import Closing, Resources
from .cached_rows import CachedRows
from .front import check_tokens, context_tail, require_open, window_index
from .front import windows as front_windows
from .ids import ids_from_windows, window_plan
from .projection import RowProjection, check_collective, gemm_path
from .runner_checks import (
    adapter_index,
    check_adapter_slots,
    check_servable,
    check_weights,
    out_address,
)
from .weights import NgramWeights

if TYPE_CHECKING:
    from ..backend_caps import GraphBackend, RunnerBackend

_WHAT = "fused ngram embed"
_STREAM = f"{_WHAT}: stream"


class FusedNgramEmbedding(Closing):
    """The n-gram embedding of ``weights`` in two launches per call (a gather of every table's rows,
    then one GEMM that adds the word row and rounds to bf16 once), for up to ``max_rows`` new tokens
    per call; ``embed_batch`` serves many sequences, optionally replayed as CUDA graphs. Borrows the
    weights; ``close()`` frees only its own buffers. ``collective``: a shard's all-reduce for
    ``embed``/``embed_batch``; ``adapter_slots``: the ``OverlaySlots`` whose embedding rows
    ``embed_batch(..., adapters=)`` selects inside the n-gram sum; ``batch_invariant``: every
    row's bits independent of the batch it is in (``projection.gemm_path``)."""

    def __init__(
        self,
        weights: NgramWeights,
        max_rows: int,
        stream: int = 0,
        *,
        collective: Any = None,
        adapter_slots: OverlaySlots | None = None,
        batch_invariant: bool = False,
    ) -> None:
        weights = check_weights("FusedNgramEmbedding", weights)
        dims, gpu = weights.dims, cast("RunnerBackend", weights.gpu)  # check_weights checked its capabilities
        max_rows = check_servable(dims, max_rows)
        stream = validate.stream(stream, "FusedNgramEmbedding: stream")
        path = gemm_path(batch_invariant)
        check_collective("FusedNgramEmbedding", collective, weights)
        check_adapter_slots("FusedNgramEmbedding", adapter_slots, dims, gpu)
        self.weights, self.dims, self.gpu, self.max_rows = weights, dims, gpu, max_rows
        self.adapter_slots, self.collective = adapter_slots, collective
        t, n = dims.num_tables(), dims.max_ngram
        # Cached tables: ids hashed on the host from the windows in one pass (_ids_plan), the
        # RowCache ones resolved together by one CacheGroup, other RowSources one by one.
        self._rows = CachedRows(weights.tables, grouped=True)
        self.cached = self._rows.columns
        self._ids_plan = window_plan(dims, tuple(self.cached)) if self.cached else None
        # u32 words uploaded per output row: window, word id, cached tables' slots, and (with
        # adapter slots) the u64 address of its replacement word row, after an alignment word
        self._base_words = n + 1 + (t if self.cached else 0)
        self._row_words = self._base_words + (3 if adapter_slots is not None else 0)
        # graph=True's backend: graphs, and pinned memory for the upload a graph replays
        can_graph = isinstance(gpu, Graphs) and isinstance(gpu, PinnedHostMemory)
        self._graph_gpu = cast("GraphBackend", gpu) if can_graph else None
        self._graphs: dict[tuple[int, int, int, bool], int] = {}
        self._staged = 0  # the rows of the last stage() that project() has not consumed
        self._host: np.ndarray | None = None  # pinned packed-upload buffer, made with the first graph
        self._resources = own = Resources(gpu)  # every buffer, event, graph: released by close()
        try:
            self._done = done = gpu.create_event()  # recorded after every call: its buffers are free again
            own.on_close(partial(gpu.destroy_event, done))
            self.projection = proj = RowProjection(weights, max_rows, own, stream, collective=collective, path=path)
            self.staging = own.alloc(max_rows * self._row_words * 4)
            kernel = load_kernel(gpu, "ngram_fused", "ngram_gather")
            table_dims = (t, n, dims.splits, dims.table_dim(), dims.eos_id)
            self._gather_plan = NgramGather(gpu, kernel, proj.desc, proj.pows, *table_dims, proj.host_tables)
            self._gathers: dict[int, PreparedLaunch] = {}  # the gather of each row count
        except BaseException:
            own.close()
            raise

    # -- calls ------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: every call then raises ``ClosedError``."""
        return self._resources.closed

    @property
    def captured_graphs(self) -> int:
        """How many call shapes (rows, out, stream, adapters) have a captured graph (``graph=True``)."""
        return len(self._graphs)

    def captured_graph(self, rows: int, out: int, stream: int, adapters: bool = False) -> int | None:
        """The graph captured for calls of ``rows`` rows into ``out`` on ``stream`` (with or
        without adapters), if any (a benchmark replays it alone to time the GPU's work)."""
        stream = validate.stream(stream, "FusedNgramEmbedding.captured_graph: stream")
        return self._graphs.get((rows, int(out), stream, adapters))

    def embed(
        self, ctx_tokens: Sequence[int] | np.ndarray, seq_len: int, out: Any, stream: int = 0, *, graph: bool = False
    ) -> None:
        """The embedding of the last ``seq_len`` tokens of ``ctx_tokens`` into ``out``."""
        if graph and not self.cached and self._replay_tail(ctx_tokens, seq_len, out, stream):
            return
        self.embed_batch([ctx_tokens], [seq_len], out, stream, graph=graph)

    def _replay_tail(self, ctx: Sequence[int] | np.ndarray, seq_len: int, out: Any, stream: int) -> bool:
        """The decode loop's call (one context that reaches back N - 1 tokens before its new ones,
        a shape already captured, no cached tables) in a few numpy operations: the window rows
        are the context's tail read through a cached index, written straight into the pinned
        upload. Raises for a bad context as the general path does (``front``'s checks); returns
        False, having done nothing, for anything else (the general path then serves it or raises:
        a seq_len that is not a plain int, an unknown shape, closed weights or collective)."""
        plain = type(seq_len) is int and type(stream) is int and isinstance(out, int)  # (True would find stream 1)
        exe = self._graphs.get((seq_len, out, stream, False)) if plain else None
        if exe is None or self.weights.closed or (self.collective is not None and self.collective.closed):
            return False
        n = self.dims.max_ngram
        tail, start = context_tail(ctx, seq_len, n - 1, _WHAT)
        if not start and len(tail) < seq_len + n - 1:
            return False  # reaches the context start: padded windows (the general path)
        tail = check_tokens(np.asarray(tail), self.dims.vocab_size, _WHAT)
        gpu, host = self._graph_gpu, self._host
        assert gpu is not None and host is not None  # a captured graph: _replay made both
        gpu.event_synchronize(self._done)  # the previous call's upload has read the buffer
        words = host.view(np.uint32)
        words[: seq_len * n] = tail[window_index((seq_len,), n)].reshape(-1)
        words[seq_len * n : seq_len * (n + 1)] = tail[n - 1 :]
        gpu.launch_graph(exe, stream)
        gpu.record_event(self._done, stream)
        return True

    def embed_batch(
        self,
        contexts: Sequence[Sequence[int] | np.ndarray],
        seq_lens: Sequence[int],
        out: Any,
        stream: int = 0,
        *,
        graph: bool = False,
        adapters: Sequence[int] | None = None,
    ) -> None:
        """Sequence i's last ``seq_lens[i]`` tokens, rows in order, into ``out [sum S_i, D]`` bf16
        (an address, a ``DeviceArray`` or a CuPy / torch / JAX array: ``gpu_runtime.interop``).
        ``adapters[i]``: sequence i's
        adapter slot in ``adapter_slots`` (``NO_ADAPTER`` or -1: none); an overridden token's word
        row is the adapter's, inside the sum (as if the word table held it). Everything is
        validated before anything is uploaded or launched; cached tables' rows are unpinned
        after the launches, or after a failure (``CachedRows.batch``)."""
        self._require_open(serve=True)
        stream = validate.stream(stream, _STREAM)
        self._rows.check_stream(stream, _WHAT)
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
                raise ValueError("fused ngram embed: graph=True needs a created stream, not the default stream")
            if self._graph_gpu is None:
                raise TypeError(
                    f"fused ngram embed: graph=True needs a backend with CUDA graphs and pinned host memory "
                    f"(gpu_runtime.Graphs, PinnedHostMemory); {type(self.gpu).__name__} lacks them"
                )
        with self._rows.batch():
            packed = self.pack(windows, over)  # resolves cached tables: the last step before the launches
            if graph:
                self._replay(packed, rows, out, stream, over is not None)
            else:
                self.gpu.copy_h2d_async(packed, self.staging, stream)
                self._launch(rows, out, stream, over is not None)
                self.gpu.record_event(self._done, stream)

    def _word_over(
        self, adapters: Sequence[int] | None, seq_lens: Sequence[int], windows: np.ndarray
    ) -> np.ndarray | None:
        """Each row's replacement word row address (0: the base table's) for ``adapters``,
        checked; None without adapters."""
        if adapters is None:
            return None
        slots = self.adapter_slots
        if slots is None:
            raise ValueError(f"{_WHAT}: adapters given, but the runner was built without adapter_slots")
        if len(adapters) != len(seq_lens):
            raise ValueError(f"{_WHAT}: {len(adapters)} adapters for {len(seq_lens)} sequences")
        index = [adapter_index(a, slots.num_slots, f"{_WHAT}: adapters[{i}]") for i, a in enumerate(adapters)]
        over = np.zeros(windows.shape[0], np.uint64)
        start = 0
        for a, n in zip(index, seq_lens):
            if a is not None and n:
                over[start : start + n] = slots.embed_row_addresses(a, windows[start : start + n, 0])
            start += int(n)
        return over

    def prefetch_batch(self, contexts: Sequence[Sequence[int] | np.ndarray], seq_lens: Sequence[int]) -> int:
        """Start reading ahead the cached tables' rows of a later ``embed_batch`` (as soon as its
        tokens are known; checked as ``embed_batch`` checks them); returns the rows queued.
        Nothing to do without cached tables."""
        self._require_open(serve=False)
        if self._ids_plan is None:  # no cached tables
            return 0
        ids = ids_from_windows(self._ids_plan, self.windows(contexts, seq_lens))
        return sum(cache.prefetch(ids[j]) for j, cache in enumerate(self._rows.caches) if hasattr(cache, "prefetch"))

    # -- the host half of a call (public for benchmarks and tests) --------------------------------
    def windows(self, contexts: Sequence, seq_lens: Sequence[int]) -> np.ndarray:
        """``[R, N]`` u32 look-back windows of a batch (``front_windows``), raising for a bad batch
        as ``embed_batch`` does: what ``pack`` takes."""
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
        packed[: rows * n] = windows.reshape(-1)
        packed[rows * n : rows * (n + 1)] = windows[:, 0]
        if over is not None:
            at = self._over_offset(rows) // 4
            packed[at : at + 2 * rows] = over.view(np.uint32)
        if self._ids_plan is not None:  # cached tables
            # [len(cached), R] ids of every cached table in one pass over the windows, which
            # ``windows`` built and checked; each is its hash modulo the table's rows (in range).
            ids = ids_from_windows(self._ids_plan, windows)
            self._rows.resolve(ids, packed[rows * (n + 1) : rows * (n + 1 + t)].reshape(rows, t), in_range=True)
        return packed

    def batch(self):
        """A context manager that ends the cached tables' batch on leaving (``CachedRows.batch``),
        after a failure too; around ``pack``."""
        return self._rows.batch()

    # -- launches ------------------------------------------------------------------------------
    def _over_offset(self, rows: int) -> int:
        """Byte offset in the staging of a call's u64 word-row addresses (8-byte aligned)."""
        return -(-rows * self._base_words * 4 // 8) * 8

    def _gather(self, rows: int, stream: int) -> None:
        """The call's gather of the T table rows into the projection's buffer (prepared once per
        row count: every address it takes is the runner's)."""
        gather = self._gathers.get(rows)
        if gather is None:
            slots = self.staging.offset(rows * (self.dims.max_ngram + 1) * 4) if self.cached else 0
            if len(self._gathers) >= 256:
                self._gathers.clear()
            out = self.projection.rows_at(rows)
            gather = self._gathers[rows] = self._gather_plan.prepare(self.staging, slots, out, 0, rows)
        gather.run(stream)

    def _word_ids(self, rows: int) -> int:
        return self.staging.offset(rows * self.dims.max_ngram * 4)

    def _launch(self, rows: int, out: int, stream: int, over: bool = False) -> None:
        self._gather(rows, stream)
        word_over = self.staging.offset(self._over_offset(rows)) if over else 0
        self.projection.finish(rows, self._word_ids(rows), out, stream, word_over)

    def _replay(self, packed: np.ndarray, rows: int, out: int, stream: int, over: bool = False) -> None:
        gpu = self._graph_gpu
        assert gpu is not None  # embed_batch checked it
        if self._host is None:
            self._host = gpu.alloc_host(self.max_rows * self._row_words * 4)
            self._resources.on_close(partial(gpu.free_host, self._host))
        gpu.event_synchronize(self._done)  # the previous call (and its upload) is done with the buffer
        host = self._host[: packed.nbytes]
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

    # -- one process driving every rank: the phases ``embed_all`` runs -----------------------------
    def stage(self, contexts: Sequence[Any], seq_lens: Sequence[int], stream: int = 0) -> int:
        """Upload a batch and gather this rank's rows (zeros for the others') into the buffer the
        group sums (``projection.buf``, ``projection.reduce_count(rows)`` elements); returns the
        rows. Raises for a bad batch before any upload."""
        self._require_open(serve=False)
        stream = validate.stream(stream, _STREAM)
        self._rows.check_stream(stream, _WHAT)
        windows = self.windows(contexts, seq_lens)
        rows = windows.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"{_WHAT}: {rows} rows over max_rows {self.max_rows}")
        self._staged = 0
        if rows:
            self.gpu.event_synchronize(self._done)  # the previous call is done with the buffers
            with self._rows.batch():
                self.gpu.copy_h2d_async(self.pack(windows), self.staging, stream)
                self._gather(rows, stream)
                if self.weights.shard is not None:
                    self.projection.gather_words(rows, self._word_ids(rows), stream)
        self._staged = rows
        return rows

    def project(self, rows: int, out: Any, stream: int = 0) -> None:
        """The GEMM over the summed buffer into ``out [rows, D]``: the last phase, once after each
        ``stage`` and for the rows it staged (the GEMM reads word ids that ``stage`` uploaded)."""
        self._require_open(serve=False)
        stream = validate.stream(stream, _STREAM)
        rows = validate.count(rows, f"{_WHAT} rows", limit=self.max_rows + 1)
        if rows != self._staged:
            raise ValueError(f"{_WHAT}: project of {rows} rows, but stage() staged {self._staged}")
        self._staged = 0
        if rows:
            out = out_address(out, _WHAT, rows, self.dims, self.gpu)
            self.projection.project(rows, self._word_ids(rows), out, stream)
            self.gpu.record_event(self._done, stream)

    def _require_open(self, *, serve: bool) -> None:
        """Open, on open weights; ``serve``: a rank's ``embed``/``embed_batch`` needs a collective."""
        require_open(_WHAT, self, self.weights)
        if serve and self.weights.shard is not None:
            if self.collective is None:
                raise ValueError(
                    f"{_WHAT}: a tensor-parallel rank without a collective (built for embed_all); "
                    f"pass collective= to serve embed and embed_batch"
                )
            validate.require_open(self.collective.closed, f"{_WHAT}: its collective")

    def close(self) -> None:
        """Free the graphs, the staging and the gather buffer (not the weights); once."""
        try:
            if not self._resources.closed and not self.gpu.closed:
                # The last call's work is done before anything goes (its stream may be gone: wait
                # on the event; after a kernel fault it raises, and everything is released anyway).
                self.gpu.event_synchronize(self._done)
        finally:
            self._graphs.clear()
            self._host = None
            self._resources.close()  # graphs, pinned buffer, device buffers, event: the last made first
