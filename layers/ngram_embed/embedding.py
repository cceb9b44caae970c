"""``NgramEmbedding``: the seed's GPU n-gram embedding, step for step.

Per call: zero ``out``; gather the new tokens' word rows and add them scaled by 1/(1+T); then
for each of the T = K*(N-1) tables, upload its hashed ids, gather its rows (bf16, fp8 with
scales, or from a cached table's arena), project them to the hidden size with the bf16 GEMM and
add the projection scaled by 1/(1+T). That is 1 + T gathers, T GEMMs and T + 1 scaled adds, with
the running sum rounded to bf16 after every add, exactly as the seed does. A table in host memory
(``NgramTable.Host``) is gathered like a resident one of its dtype, through its mapped address.

Host work per call is bounded by ``seq_len`` (only the last ``seq_len + N - 1`` tokens are
hashed and validated), not by the context length. Uploads go through the backend's pinned
staging, so the host buffers of one call are free when it returns. The device staging buffers
are reused by every call: calls on one stream are ordered, but two streams must not run the
same ``NgramEmbedding`` at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpu_runtime import GpuBackend, validate
from gpu_runtime.backend import check_backend

from ..kernel_files import load_kernel
from ..ops import embed as embed_ops
from ..ops import gemm as gemm_ops
from ..ops import residual as residual_ops
from .cached_rows import CachedRows
from .front import check_seq_len, require_backend, require_open, require_out, tail_tokens
from .ids import tail_ids
from .resources import Closing, Resources
from .tables import AnyTable, CachedTable, gather_entry
from .weights import NgramWeights

U32_LIMIT = 1 << 32
_WHAT = "ngram embed"


class NgramEmbedding(Closing):
    """The seed's ``embed`` over ``weights`` (module doc), with staging for ``max_tokens`` new
    tokens per call. Borrows the weights; ``close()`` frees only the staging."""

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
        self._staging = own = Resources(gpu)
        try:
            self.ids_dev = own.alloc(max_tokens * 4)
            self.gather_buf = own.alloc(max_tokens * dims.table_dim() * 2)
            self.proj_buf = own.alloc(max_tokens * dims.hidden_size * 2)
        except BaseException:  # a failed allocation frees the buffers made before it
            own.close()
            raise

    @property
    def closed(self) -> bool:
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
        require_out(out, _WHAT)
        ids = tail_ids(self.dims, tail, seq_len)  # [T, seq_len]
        if int(ids.max()) >= U32_LIMIT:
            index = int(np.flatnonzero((ids >= U32_LIMIT).any(axis=1))[0])
            raise ValueError(f"ngram embed: table {index} id exceeds u32")
        ids = ids.astype(np.uint32)
        self._cached.validate(ids)  # a cached table's refusal comes before any launch
        new_tokens = tail[tail.shape[0] - seq_len :].astype(np.uint32)
        h, td = self.dims.hidden_size, self.dims.table_dim()
        inv_scale = float(np.float32(1.0) / np.float32(1 + self.dims.num_tables()))  # f32, as the seed
        gpu = self.gpu

        # Zero `out`, then add the base row and each table's projection scaled by 1 / (1 + T).
        gpu.memset(out, 0, seq_len * h * 2, stream)

        # Base word rows for the new tokens only.
        gpu.copy_h2d_async(new_tokens, self.ids_dev, stream)
        embed_ops.batched_embed(
            gpu, self.batched_embed_kernel, self.ids_dev, self.weights.word.weight, self.proj_buf, seq_len, h, stream
        )
        residual_ops.scaled_add(gpu, self.scaled_add_kernel, out, self.proj_buf, inv_scale, seq_len * h, stream)

        # Hash ids of the tail, then one table at a time.
        for index, (table, table_ids) in enumerate(zip(self.weights.tables, ids)):
            if isinstance(table, CachedTable):
                # An NVMe-backed table maps the ids to arena slots (`resolve`), which replace the
                # ids before the gather, and ends its batch after it. (The seed uploads the ids
                # first and then the slots over them; the first copy is skipped here, as nothing
                # reads it: one upload less per cached table and call.)
                with self._cached.batch(index):
                    gpu.copy_h2d_async(self._cached.resolve_table(index, table_ids), self.ids_dev, stream)
                    self._gather(index, table, seq_len, stream)
            else:
                gpu.copy_h2d_async(table_ids, self.ids_dev, stream)
                self._gather(index, table, seq_len, stream)
            gemm_ops.dense_gemm_bf16_pipelined(
                gpu, self.gemm_kernel, self.gather_buf, self.weights.projs[index], self.proj_buf, seq_len, h, td, stream
            )
            residual_ops.scaled_add(gpu, self.scaled_add_kernel, out, self.proj_buf, inv_scale, seq_len * h, stream)

    def _gather(self, index: int, table: AnyTable, rows: int, stream: int) -> None:
        """Rows ``ids_dev[:rows]`` of table ``index`` into ``gather_buf``: bf16 rows as they are,
        fp8 rows dequantised with their scales. Resident, host (read in place from mapped host
        memory; fp8 scales on the device) and cached tables (the arena, at the resolved slots)
        alike: ``gather_entry`` says where the rows and scales are."""
        data, scale, _, _ = gather_entry(table, self.dims.table_rows(index))
        td = self.dims.table_dim()
        if scale:
            embed_ops.batched_embed_fp8(
                self.gpu, self.batched_embed_fp8_kernel, self.ids_dev, data, scale, self.gather_buf, rows, td, stream
            )
        else:
            embed_ops.batched_embed(
                self.gpu, self.batched_embed_kernel, self.ids_dev, data, self.gather_buf, rows, td, stream
            )

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
