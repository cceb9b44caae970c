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

from typing import Any, Sequence

import numpy as np

from gpu_runtime import GpuBackend, validate

from ..kernel_files import load_kernel
from ..ops import embed as embed_ops
from ..ops import gemm as gemm_ops
from ..ops import residual as residual_ops
from ..weight_map import BF16, DenseWeight
from .cached_rows import CachedRows
from .dims import NgramDims
from .front import check_seq_len, require_backend, require_open, require_out, tail_tokens
from .host_table import HostWeight
from .ids import tail_ids
from .placement import placements
from .resources import Resources, closed_on_failure
from .tables import (AbsentTable, AnyTable, Bf16Table, CachedTable, Fp8Table, HostTable, check_table,
                     gather_entry)

U32_LIMIT = 1 << 32
_WHAT = "ngram embed"
class NgramEmbedding:
    def __init__(self, dims: NgramDims, word: DenseWeight, tables: Sequence[AnyTable],
                 projs: Sequence[DenseWeight], max_tokens: int, gpu: GpuBackend) -> None:
        t, h, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
        if len(tables) != t:
            raise ValueError(f"table count: {len(tables)} tables, dims need {t}")
        if len(projs) != t:
            raise ValueError(f"proj count: {len(projs)} projections, dims need {t}")
        for weight, what in [(word, "word"), *((p, f"proj {i}") for i, p in enumerate(projs))]:
            if not isinstance(weight, DenseWeight):
                raise TypeError(f"{what}: expected a DenseWeight (device weight), got {type(weight).__name__}")
        if word.shape != (dims.vocab_size, h) or word.dtype != BF16:
            raise ValueError(f"word embedding must be ({dims.vocab_size}, {h}) bfloat16, "
                             f"got {word.shape} {word.dtype}")
        for index, table in enumerate(tables):
            check_table(table, index, dims.table_rows(index), td)
        for index, proj in enumerate(projs):
            if proj.shape != (h, td) or proj.dtype != BF16:
                raise ValueError(f"proj {index} must be ({h}, {td}) bfloat16, got {proj.shape} {proj.dtype}")
        max_tokens = validate.positive(max_tokens, "max_tokens")
        self.dims = dims
        self.word = word
        self.tables = list(tables)
        self.projs = list(projs)
        self.gpu = gpu
        self._cached = CachedRows(self.tables)  # resolved table by table, as the seed does
        self.batched_embed_k = load_kernel(gpu, "embed_from_argmax", "batched_embed")
        self.batched_embed_fp8_k = load_kernel(gpu, "embed_from_argmax", "batched_embed_fp8")
        self.gemm_k = load_kernel(gpu, "gemm", "dense_gemm_bf16_pipelined")
        self.scaled_add_k = load_kernel(gpu, "residual_add", "bf16_scaled_add")
        self.max_tokens = max_tokens
        self._weights = Resources(gpu)  # what ``own`` hands over: closed after the staging
        self._staging = Resources(gpu)
        try:
            self.ids_dev = self._staging.alloc(max_tokens * 4)
            self.gather_buf = self._staging.alloc(max_tokens * td * 2)
            self.proj_buf = self._staging.alloc(max_tokens * h * 2)
        except BaseException:  # a failed allocation frees the buffers made before it
            self._staging.close()
            raise

    @classmethod
    def from_numpy(cls, dims: NgramDims, word: np.ndarray,
                   tables: Sequence[np.ndarray | tuple[np.ndarray, np.ndarray]],
                   projs: Sequence[np.ndarray], max_tokens: int, gpu: GpuBackend,
                   stream: int = 0, placement: str | Sequence[str] = "device") -> "NgramEmbedding":
        """Upload host weights; each table is a bf16 array or an ``(fp8 array, f32 scales)``
        pair. ``placement`` ("device", "host", or one of those per table) puts each table on
        the device (``NgramTable.Bf16``/``Fp8``) or in mapped pinned host memory
        (``NgramTable.Host``, read in place over PCIe; fp8 scales still on the device). The
        layer owns the weights it built and frees them in ``close()``."""
        places = placements(placement, len(tables))
        with closed_on_failure() as owned:

            def upload(array: np.ndarray, scale: np.ndarray | None = None) -> DenseWeight:
                owned.append(DenseWeight.from_numpy(gpu, array, scale, stream))
                return owned[-1]

            def pin(array: np.ndarray, scale: np.ndarray | None = None) -> HostWeight:
                owned.append(HostWeight.from_numpy(gpu, array, scale, stream))
                return owned[-1]

            w = upload(word)
            dev_tables: list[AnyTable] = []
            for table, where in zip(tables, places):
                parts = table if isinstance(table, tuple) else (table,)
                if where == "host":
                    dev_tables.append(HostTable(pin(*parts)))
                elif isinstance(table, tuple):
                    dev_tables.append(Fp8Table(upload(*parts)))
                else:
                    dev_tables.append(Bf16Table(upload(*parts)))
            dev_projs = [upload(p) for p in projs]
            layer = cls(dims, w, dev_tables, dev_projs, max_tokens, gpu)
        layer.own(*owned)
        return layer

    @classmethod
    def from_safetensors(cls, path: str, dims: NgramDims, max_tokens: int, gpu: GpuBackend,
                         prefix: str = "", stream: int = 0,
                         placement: str | Sequence[str] = "device") -> "NgramEmbedding":
        """Load ``{prefix}word.weight``, ``{prefix}tables.{c}.weight`` (bf16, or F8_E4M3 with
        ``{prefix}tables.{c}.row_scale`` f32) and ``{prefix}projs.{c}.weight`` (README);
        ``placement`` as in ``from_numpy``."""
        from ..safetensors_io import load

        placements(placement, dims.num_tables())  # refused before the file is opened

        tensors = load(path)

        def get(name: str) -> np.ndarray:
            try:
                return tensors[prefix + name]
            except KeyError:
                raise KeyError(f"{path}: no tensor {prefix + name!r}") from None

        tables: list[np.ndarray | tuple[np.ndarray, np.ndarray]] = []
        for c in range(dims.num_tables()):
            scale = tensors.get(f"{prefix}tables.{c}.row_scale")
            table = get(f"tables.{c}.weight")
            tables.append(table if scale is None else (table, scale))
        projs = [get(f"projs.{c}.weight") for c in range(dims.num_tables())]
        return cls.from_numpy(dims, get("word.weight"), tables, projs, max_tokens, gpu, stream, placement)

    @classmethod
    def from_pretrained(cls, model_dir: str, gpu: GpuBackend, *, placement: Any = "device",
                        max_tokens: int = 8192, eos_id: int | None = None, table_dir: str | None = None,
                        stream: int = 0, cache_rows: int = 1 << 16) -> "NgramEmbedding":
        """The n-gram embedding of a LongCat-Flash-Lite-style Hugging Face model folder:
        ``config.json`` (``vocab_size``, ``hidden_size``, ``emb_neighbor_num``,
        ``emb_split_num``, ``ngram_vocab_size_ratio``, ``eos_token_id``) and ``model.safetensors``
        or a sharded ``model.safetensors.index.json`` (only the shards holding the n-gram tensors
        are opened, tensors memory-mapped): ``model.embed_tokens.weight`` (or
        ``model.ngram_embeddings.word_embeddings.weight``), ``model.ngram_embeddings.embedders.{i}.weight``
        and ``model.ngram_embeddings.post_projs.{i}.weight`` (``[hidden, table_dim]``).

        ``placement``: "device", "host", "files" (``RowCache`` over ``table_dir``'s files,
        ``cache_rows`` rows resident per table), one of those per table, or a device-memory
        budget in bytes (``DeviceBudget(n)`` or an int: tables on the device while they fit, the
        rest in host memory). ``table_dir``: the converter's output (``python -m
        layers.ngram_embed.convert``), which then supplies every table. ``eos_id`` overrides
        ``config.json``'s ``eos_token_id``, the key the published model code reads (an int or a
        list of one; ``checkpoint.py`` says where that was checked). A missing tensor or key, a
        shape that disagrees with the config or a dtype that cannot be served raises
        ``CheckpointError`` naming the file and tensor before anything is uploaded. The layer
        owns what it built. See ``layers.ngram_embed.checkpoint`` and ``.pretrained``."""
        from .pretrained import load_layer

        return load_layer(cls, model_dir, gpu, placement=placement, max_tokens=max_tokens, eos_id=eos_id,
                          table_dir=table_dir, stream=stream, cache_rows=cache_rows)

    @property
    def closed(self) -> bool:
        return self._staging.closed

    def own(self, *things: Any) -> None:
        """Hand ``things`` (weights, caches: anything with a ``close()``) over to the layer,
        which then closes them with itself, after its staging, the last handed over first.
        ``from_numpy``, ``from_safetensors`` and ``from_pretrained`` hand over all they built."""
        validate.require_open(self.closed, "NgramEmbedding")
        for thing in things:
            self._weights.adopt(thing)

    def embed(self, ctx_tokens: Sequence[int] | np.ndarray, seq_len: int, out: int,
              gpu: GpuBackend, stream: int = 0) -> None:
        """Embedding of the last ``seq_len`` tokens of ``ctx_tokens`` into ``out``
        (``[seq_len, hidden]`` bf16). ``gpu`` is the seed's argument, kept in its place: it must
        be the backend the layer was built with, which does every upload and launch. Everything
        is validated before the first launch; a cached table's rows are unpinned after its
        gather, or after a failure (``CachedRows.batch``)."""
        require_open(_WHAT, self, self)
        require_backend(_WHAT, gpu, self.gpu)
        absent = [c for c, table in enumerate(self.tables) if isinstance(table, AbsentTable)]
        if absent:
            raise ValueError(f"ngram embed: table {absent[0]} is held by another rank (NgramTable.Absent); "
                             f"a tensor-parallel rank embeds through layers.tensor_parallel")
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
        new_tokens = tail[tail.shape[0] - seq_len:].astype(np.uint32)
        h, td = self.dims.hidden_size, self.dims.table_dim()
        inv_scale = float(np.float32(1.0) / np.float32(1 + self.dims.num_tables()))  # f32, as the seed
        gpu = self.gpu

        # Zero `out`, then add the base row and each table's projection scaled by 1 / (1 + T).
        gpu.memset(out, 0, seq_len * h * 2, stream)

        # Base word rows for the new tokens only.
        gpu.copy_h2d_async(new_tokens, self.ids_dev, stream)
        embed_ops.batched_embed(gpu, self.batched_embed_k, self.ids_dev, self.word.weight,
                                self.proj_buf, seq_len, h, stream)
        residual_ops.scaled_add(gpu, self.scaled_add_k, out, self.proj_buf, inv_scale, seq_len * h, stream)

        # Hash ids of the tail, then one table at a time.
        for index, (table, table_ids) in enumerate(zip(self.tables, ids)):
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
            gemm_ops.dense_gemm_bf16_pipelined(gpu, self.gemm_k, self.gather_buf, self.projs[index],
                                               self.proj_buf, seq_len, h, td, stream)
            residual_ops.scaled_add(gpu, self.scaled_add_k, out, self.proj_buf, inv_scale,
                                    seq_len * h, stream)

    def _gather(self, index: int, table: AnyTable, rows: int, stream: int) -> None:
        """Rows ``ids_dev[:rows]`` of table ``index`` into ``gather_buf``: bf16 rows as they are,
        fp8 rows dequantised with their scales. Resident, host (read in place from mapped host
        memory; fp8 scales on the device) and cached tables (the arena, at the resolved slots)
        alike: ``gather_entry`` says where the rows and scales are."""
        data, scale, _, _ = gather_entry(table, self.dims.table_rows(index))
        td = self.dims.table_dim()
        if scale:
            embed_ops.batched_embed_fp8(self.gpu, self.batched_embed_fp8_k, self.ids_dev, data, scale,
                                        self.gather_buf, rows, td, stream)
        else:
            embed_ops.batched_embed(self.gpu, self.batched_embed_k, self.ids_dev, data, self.gather_buf,
                                    rows, td, stream)

    def prefetch(self, ctx_tokens: Sequence[int] | np.ndarray, seq_len: int) -> int:
        """Start loading the rows that ``embed(ctx_tokens, seq_len, ...)`` will read from
        cached tables that can prefetch (``RowCache``); returns the rows queued. Call it as soon
        as the next step's tokens are known: the loads overlap whatever runs until then."""
        caches = [(c, cache) for c, cache in zip(self._cached.columns, self._cached.caches)
                  if hasattr(cache, "prefetch")]
        if not caches:
            return 0
        seq_len = check_seq_len(seq_len, "ngram prefetch")
        tail, _ = tail_tokens(self.dims, ctx_tokens, seq_len, "ngram prefetch")
        if seq_len == 0:
            return 0
        ids = tail_ids(self.dims, tail, seq_len)
        return sum(cache.prefetch(ids[c]) for c, cache in caches)

    def close(self) -> None:
        """Free the staging buffers, then what the layer owns (``own``: the weights it uploaded
        itself); once, later calls do nothing."""
        try:
            self._staging.close()
        finally:
            self._weights.close()

    def __enter__(self) -> "NgramEmbedding":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
