"""``NgramEmbedding``: the seed's GPU n-gram embedding, step for step.

Per call: zero ``out``; gather the new tokens' word rows and add them scaled by 1/(1+T); then
for each of the T = K*(N-1) tables, upload its hashed ids, gather its rows (bf16, fp8 with
scales, or from a cached table's arena), project them to the hidden size with the bf16 GEMM and
add the projection scaled by 1/(1+T). That is 1 + T gathers, T GEMMs and T + 1 scaled adds, with
the running sum rounded to bf16 after every add, exactly as the seed does. A table in host memory
(``NgramTable.Host``) is gathered like a resident one of its dtype, through its mapped address.

Planned once: the kernels are bound and the tables' gathers worked out at construction, and each
``seq_len``'s launch configurations and GEMMs at its first call. A call uploads the new tokens
and every table's ids in one copy (the seed uploads them table by table into one buffer; a
cached table's slots are still uploaded when its rows are resolved, before its gather).

Host work per call is bounded by ``seq_len`` (only the last ``seq_len + N - 1`` tokens are
hashed and validated), not by the context length. Uploads go through the backend's pinned
staging, so the host buffers of one call are free when it returns. The device staging buffers
are reused by every call: calls on one stream are ordered, but two streams must not run the
same ``NgramEmbedding`` at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from gpu_runtime import GpuBackend, LaunchConfig, PreparedLaunch, validate
from gpu_runtime.backend import check_backend

from ..kernel_files import load_kernel
from ..ops import gemm as gemm_ops
from ..ops.embed import gather_config
from ..ops.residual import add_config
from ..resources import Closing, Resources
from .cached_rows import CachedRows
from .front import check_seq_len, require_backend, require_open, require_out, tail_tokens
from .ids import tail_ids
from .tables import gather_entry
from .weights import NgramWeights

U32_LIMIT = 1 << 32
_WHAT = "ngram embed"


class _Plan(NamedTuple):
    """One ``seq_len``'s launches, prepared: the word rows' gather, then each table's gather and
    GEMM; the adds' config, and their launches by output address (made at a call's first use)."""

    word: PreparedLaunch
    tables: list[tuple[PreparedLaunch, PreparedLaunch]]
    add: LaunchConfig
    adds: dict[int, PreparedLaunch]


class NgramEmbedding(Closing):
    """The n-gram embedding of ``weights`` launch for launch as the Rust engine it mirrors runs it:
    per table a gather, a GEMM and a bf16 add, the running sum rounded after every add; for up to
    ``max_tokens`` new tokens per call. Rejects a tensor-parallel shard's weights (``ValueError``).
    Borrows the weights; ``close()`` frees only the staging."""

    def __init__(self, weights: NgramWeights, max_tokens: int) -> None:
        if not isinstance(weights, NgramWeights):
            raise TypeError(f"NgramEmbedding: weights must be NgramWeights, got {type(weights).__name__}")
        validate.require_open(weights.closed, "NgramEmbedding: its NgramWeights")
        if weights.shard is not None:
            raise ValueError(
                "NgramEmbedding: the weights are a tensor-parallel rank's share; serve them "
                "with FusedNgramEmbedding or NgramDecoder (collective=)"
            )
        max_tokens = validate.positive(max_tokens, "max_tokens")
        gpu, dims = weights.gpu, weights.dims
        self.weights, self.dims, self.gpu, self.max_tokens = weights, dims, gpu, max_tokens
        self._cached = CachedRows(weights.tables)  # resolved table by table, as the seed does
        self.batched_embed_kernel = load_kernel(gpu, "embed_from_argmax", "batched_embed")
        self.batched_embed_fp8_kernel = load_kernel(gpu, "embed_from_argmax", "batched_embed_fp8")
        self.gemm_kernel = load_kernel(gpu, "gemm", "dense_gemm_bf16_pipelined")
        self.scaled_add_kernel = load_kernel(gpu, "residual_add", "bf16_scaled_add")
        self._embed = gpu.bind(self.batched_embed_kernel)
        self._embed_fp8 = gpu.bind(self.batched_embed_fp8_kernel)
        self._add = gpu.bind(self.scaled_add_kernel)
        self._inv_scale = float(np.float32(1.0) / np.float32(1 + dims.num_tables()))  # f32, as the seed
        self._plans: dict[int, _Plan] = {}
        self._staging = own = Resources(gpu)
        try:
            # the new tokens' ids, then each table's: [1 + T, max_tokens] u32, one upload a call
            self.ids_dev = own.alloc((1 + dims.num_tables()) * max_tokens * 4)
            self.gather_buf = own.alloc(max_tokens * dims.table_dim() * 2)
            self.proj_buf = own.alloc(max_tokens * dims.hidden_size * 2)
        except BaseException:  # a failed allocation frees the buffers made before it
            own.close()
            raise

    @property
    def closed(self) -> bool:
        """True once ``close()`` freed the staging: ``embed`` then raises ``ClosedError``."""
        return self._staging.closed

    def embed(
        self, ctx_tokens: Sequence[int] | np.ndarray, seq_len: int, out: int, gpu: GpuBackend, stream: int = 0
    ) -> None:
        """Embedding of the last ``seq_len`` tokens of ``ctx_tokens`` into ``out``
        (``[seq_len, hidden]`` bf16). ``gpu`` is the seed's argument, kept in its place: it must
        be the weights' backend, which does every upload and launch. Everything
        is validated before the first launch; a cached table's rows are unpinned after its
        gather, or after a failure (``CachedRows.batch``)."""
        require_open(_WHAT, self, self.weights)
        if gpu is not self.gpu:  # the weights' own backend passes on this one test
            check_backend(gpu, f"{_WHAT}: gpu")
            require_backend(_WHAT, gpu, self.gpu)
        if type(stream) is not int or stream < 0:
            stream = validate.stream(stream, f"{_WHAT}: stream")
        if self._cached:
            self._cached.check_stream(stream, _WHAT)
        seq_len = check_seq_len(seq_len, _WHAT)
        if seq_len > self.max_tokens:
            raise ValueError(f"ngram embed: seq_len over staging ({seq_len} > max_tokens {self.max_tokens})")
        tail, _ = tail_tokens(self.dims, ctx_tokens, seq_len, _WHAT)  # only the tail is read
        if seq_len == 0:
            return
        out = require_out(out, _WHAT)
        ids = tail_ids(self.dims, tail, seq_len)  # [T, seq_len]
        if int(ids.max()) >= U32_LIMIT:
            index = int(np.flatnonzero((ids >= U32_LIMIT).any(axis=1))[0])
            raise ValueError(f"ngram embed: table {index} id exceeds u32")
        packed = np.empty((1 + ids.shape[0], seq_len), np.uint32)  # what ids_dev receives
        packed[0] = tail[tail.shape[0] - seq_len :]
        packed[1:] = ids
        self._cached.validate(packed[1:])  # a cached table's refusal comes before any launch
        plan = self._plans.get(seq_len) or self._plan(seq_len)
        add = plan.adds.get(out) or self._add_plan(plan, out, seq_len)
        gpu = self.gpu

        # Zero `out`, then add the base row and each table's projection scaled by 1 / (1 + T).
        gpu.memset(out, 0, seq_len * self.dims.hidden_size * 2, stream)
        gpu.copy_h2d_async(packed, self.ids_dev, stream)

        # Base word rows for the new tokens only.
        plan.word.run(stream)
        add.run(stream)

        # Then one table at a time, its ids at row 1 + index of ids_dev.
        for index, (gather, gemm) in enumerate(plan.tables):
            if index in self._cached.columns:
                # An NVMe-backed table maps the ids to arena slots (`resolve`), which replace the
                # ids before the gather, and ends its batch after it.
                with self._cached.batch(index):
                    slots = self._cached.resolve_table(index, packed[1 + index])
                    gpu.copy_h2d_async(slots, self.ids_dev.offset((1 + index) * seq_len * 4), stream)
                    gather.run(stream)
            else:
                gather.run(stream)
            gemm.run(stream)
            add.run(stream)

    def _plan(self, seq_len: int) -> _Plan:
        """The launches of a call of ``seq_len`` new tokens, kept for the next such call. Each
        table's gather reads it where ``gather_entry`` says its rows are (resident, host, or a
        cached table's arena at the resolved slots; fp8 rows dequantised with their scales)."""
        dims, gpu, tables = self.dims, self.gpu, []
        h, td, config = dims.hidden_size, dims.table_dim(), gather_config(seq_len)
        word = self._embed.prepare(config, self.ids_dev, self.weights.word.weight, self.proj_buf, seq_len, h)
        for index, (table, proj) in enumerate(zip(self.weights.tables, self.weights.projs)):
            ids = self.ids_dev.offset((1 + index) * seq_len * 4)
            data, scale, _, _ = gather_entry(table, dims.table_rows(index))
            if scale:
                gather = self._embed_fp8.prepare(config, ids, data, scale, self.gather_buf, seq_len, td)
            else:
                gather = self._embed.prepare(config, ids, data, self.gather_buf, seq_len, td)
            gemm = gemm_ops.plan_gemm(gpu, self.gemm_kernel, self.gather_buf, proj, self.proj_buf, seq_len, h, td)
            assert gemm is not None  # seq_len, D and td >= 1
            tables.append((gather, gemm))
        plan = _Plan(word, tables, add_config(seq_len * h), {})
        if len(self._plans) >= 64:
            self._plans.clear()
        self._plans[seq_len] = plan
        return plan

    def _add_plan(self, plan: _Plan, out: int, seq_len: int) -> PreparedLaunch:
        """``out += proj_buf / (1 + T)``, prepared for one output address (kept: engines reuse theirs)."""
        if len(plan.adds) >= 16:
            plan.adds.clear()
        n = seq_len * self.dims.hidden_size
        add = plan.adds[out] = self._add.prepare(plan.add, out, self.proj_buf, self._inv_scale, n)
        return add

    def prefetch(self, ctx_tokens: Sequence[int] | np.ndarray, seq_len: int) -> int:
        """Start loading the rows that ``embed(ctx_tokens, seq_len, ...)`` will read from
        cached tables that can prefetch (``RowCache``); returns the rows queued. Call it as soon
        as the next step's tokens are known: the loads overlap whatever runs until then."""
        require_open(_WHAT, self, self.weights)
        caches = [
            (c, cache) for c, cache in zip(self._cached.columns, self._cached.caches) if hasattr(cache, "prefetch")
        ]
        if not caches:
            return 0
        seq_len = check_seq_len(seq_len, "ngram prefetch")
        tail, _ = tail_tokens(self.dims, ctx_tokens, seq_len, "ngram prefetch")
        if seq_len == 0:
            return 0
        ids = tail_ids(self.dims, tail, seq_len)
        return sum(cache.prefetch(ids[c]) for c, cache in caches)

    def close(self) -> None:
        """Free the staging buffers (not the weights); once, later calls do nothing."""
        self._staging.close()
