"""``EngramDecoder``: DeepSeek-V4.1's Engram for a serving loop that captures its step in one CUDA
graph (``docs/ENGRAM.md``).

Each slot (one live request) keeps its last ``N - 1 + max_draft`` compressed ids on the device
(``layers.token_history``). The work is split so that an engine can overlap it: ``prefill`` /
``step`` run every Engram layer's hash, row gather and ``wkv`` projection into this decoder's
``kv`` buffers (one lookup kernel and a GEMM per layer: an engine runs them on a side stream at the
start of its step), and ``apply(layer, residual, ...)`` gates layer ``layer``'s residual in place
when that layer comes. ``seed`` (a prefix-cache hit: history only), ``fork``, ``rollback``,
``reset`` as ``NgramDecoder``'s. Every call takes device buffers only and does no host
synchronisation, allocation or upload, so it can be recorded in the caller's capture; bad device
values set flags that ``check_errors`` reads. A non-text position (``text`` 0 where a call passes
a u8 text mask; without one, the config's ``image_token_id``) takes no part in any look-back and
its residual is left as it is. One decoder runs on one stream at a time (one set of buffers);
``apply`` reads the last ``prefill`` / ``step``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu_runtime import interop, validate

from ..kernel_files import load_kernel
from ..ops import gemm, gemm_fp8
from ..ops.engram import EngramGate, EngramLaunches
from ..ops.token_history import NO_TOKEN, PAD_SLOT, DecodeError, TokenCode
from ..resources import Resources
from ..tensor_parallel import check_collective
from ..token_history import HistoryCalls, SlotHistories
from .host_staging import THREADS_LIMIT, HostStaging
from .weights import EngramWeights

__all__ = ["DecodeError", "EngramDecoder", "PAD_SLOT"]

Buffer = Any  # an address, a DeviceArray, or an array with __cuda_array_interface__ / __dlpack__

_WHAT = "EngramDecoder"
FP8_ROWS = 32  # up to this many rows the projection reads wkv in fp8, above it the bf16 copy (faster from 64)
STAGED_ROWS = 3072  # calls of this many rows or more read host tables through HostStaging (NOTES-engram)
_U8 = (np.dtype(np.uint8), np.dtype(np.bool_))


class EngramDecoder(HistoryCalls):
    """Engram for ``max_seqs`` slots and calls of at most ``max_rows`` tokens (module docstring).
    ``batch_invariant``: every row's bits the same whatever else is in its call (the projection's
    fp8-weight path for every row count: a step's rows equal a prefill's; without it, calls of up
    to ``FP8_ROWS`` rows take that path and longer ones the bf16 GEMM). ``collective``: a
    tensor-parallel shard's all-reduce (one process per rank; ``lookup_all`` drives a whole
    in-process group): each rank gathers the rows it holds, zeros elsewhere, and the sum of the
    ranks' rows is exact (one rank holds each row). ``host_threads``: with tables in host memory,
    calls of ``STAGED_ROWS`` rows or more have the host gather their rows on this many threads
    (``layers.engram.host_staging``; 0, the default: the GPU reads every row in place, which is
    faster today: docs/ENGRAM.md). Borrows the weights."""

    WHAT = _WHAT
    launches: EngramLaunches

    def __init__(
        self,
        weights: EngramWeights,
        *,
        max_seqs: int,
        max_rows: int,
        max_draft: int = 0,
        stream: int = 0,
        batch_invariant: bool = False,
        collective: Any = None,
        host_threads: int = 0,
    ) -> None:
        if not isinstance(weights, EngramWeights):
            raise TypeError(f"{_WHAT}: weights must be EngramWeights, got {type(weights).__name__}")
        validate.require_open(weights.closed, f"{_WHAT}: its weights")
        how = "EngramWeights.from_arrays / from_checkpoint(..., shard=Shard(rank, size))"
        check_collective(_WHAT, collective, weights.shard, how)
        self.collective = collective
        max_seqs = validate.positive(max_seqs, f"{_WHAT}: max_seqs", limit=1 << 31)
        max_rows = validate.positive(max_rows, f"{_WHAT}: max_rows", limit=1 << 31)
        max_draft = validate.count(max_draft, f"{_WHAT}: max_draft", limit=1 << 31)
        stream = validate.stream(stream, f"{_WHAT}: stream")
        self.batch_invariant = validate.boolean(batch_invariant, f"{_WHAT}: batch_invariant")
        threads = validate.count(host_threads, f"{_WHAT}: host_threads", limit=THREADS_LIMIT)
        cfg, gpu = weights.config, weights.gpu
        self.weights, self.config, self.gpu, self.stream = weights, cfg, gpu, stream
        self.max_seqs, self.max_rows, self.max_draft = max_seqs, max_rows, max_draft
        layers = len(cfg.layer_ids)
        self._resources = own = Resources(gpu)
        try:
            self.histories = SlotHistories(
                gpu, own, max_seqs=max_seqs, back=cfg.max_ngram - 1, max_draft=max_draft, stream=stream, what=_WHAT
            )
            self.emb = own.alloc(layers * max_rows * cfg.emb_dim * 2)
            self.kv = own.alloc(layers * max_rows * cfg.kv_dim * 2)
            self.text = own.alloc(max_rows)
            dead = NO_TOKEN if cfg.image_token_id is None else cfg.image_token_id
            h = self.histories
            self.launches = EngramLaunches(
                gpu,
                h.hist,
                h.state,
                h.ctrl,
                max_seqs=max_seqs,
                hist_len=h.hist_len,
                max_draft=max_draft,
                code=TokenCode(int(weights.token_map), cfg.vocab_size, dead),
                pad=weights.pad,
                mult=weights.mult,
                primes=weights.primes,
                offsets=weights.offsets,
                tables=weights.tables,
                emb=self.emb,
                text_out=self.text,
                max_rows=max_rows,
                layers=layers,
                max_ngram=cfg.max_ngram,
                heads=cfg.n_heads,
                width=cfg.head_dim,
                stride=weights.stride,
                host_tables=weights.host_tables,
            )
            self.staging: HostStaging | None = None
            if weights.host_tables and threads and max_rows >= STAGED_ROWS:
                blocks = [layer.table for layer in weights.layers]
                self.staging = HostStaging(gpu, own, self.launches, blocks, max_rows=max_rows, threads=threads)
            self.gates = [
                EngramGate(gpu, layer.q, layer.k, hc=cfg.hc_mult, dim=cfg.hidden_size, eps=cfg.eps)
                for layer in weights.layers
            ]
            self._gemm_kernel = load_kernel(gpu, "gemm", gemm.KERNEL)
            self._fp8_kernel = load_kernel(gpu, "gemm", gemm_fp8.KERNEL)
            need = gemm_fp8.workspace_bytes(cfg.kv_dim, cfg.emb_dim, gemm_fp8.shared_optin(gpu))
            self.workspace = own.alloc(need) if need else 0  # the projections' partial sums, one layer at a time
            if need:
                gpu.memset(self.workspace, 0, need, stream)
            self._gemms: dict[int, list[Any]] = {}
        except BaseException:
            own.close()
            raise

    # -- calls (capturable) ---------------------------------------------------------------------
    def prefill(
        self,
        tokens: Buffer,
        cu_seqlens: Buffer,
        slots: Buffer,
        num_seqs: int,
        num_tokens: int,
        stream: int = 0,
        *,
        text: Buffer | None = None,
    ) -> None:
        """Look up a ragged batch: sequence ``s`` is ``tokens[cu_seqlens[s]:cu_seqlens[s+1]]`` and
        continues slot ``slots[s]``'s history (``reset`` first for a new request); every layer's
        ``kv`` rows of the ``num_tokens`` tokens, in order, for ``apply``. ``tokens``,
        ``cu_seqlens`` [num_seqs + 1] and ``slots`` are u32 (or int32); ``text``: u8 [num_tokens]."""
        num_seqs, num_tokens = self._sizes(num_seqs, num_tokens)
        indices = self._ragged(tokens, cu_seqlens, slots, num_seqs, num_tokens)
        self._run(indices, self._text(text, num_tokens), num_seqs, num_tokens, 0, stream)

    def step(self, tokens: Buffer, slots: Buffer, num_seqs: int, stream: int = 0, *, k: int = 1) -> None:
        """``k`` new tokens for each of ``num_seqs`` sequences (``tokens [num_seqs, k]``, ``slots
        [num_seqs]``; k > 1: drafts, rejected ones dropped with ``rollback``); ``kv`` rows in order.
        A ``PAD_SLOT`` entry gets zero rows and its residual is left alone."""
        k = validate.positive(k, f"{_WHAT}.step: k", limit=1 << 32)
        num_seqs, rows = self._sizes(num_seqs, validate.u32(num_seqs, f"{_WHAT}: num_seqs") * k)
        indices = (self._index(tokens, rows, "tokens"), 0, self._index(slots, num_seqs, "slots"))
        self._run(indices, 0, num_seqs, rows, k, stream)

    def apply(self, layer: int, residual: Buffer, num_tokens: int, stream: int = 0) -> None:
        """Gate decoder layer ``layer``'s residual ``[num_tokens, hc_mult, hidden]`` (bf16, in
        place; an array's last extent must be ``hidden``) with the last ``prefill`` / ``step``'s
        rows (``num_tokens`` of them): ``x = bf16(x + gate * value)`` at text positions, nothing
        elsewhere."""
        i = self.config.index(layer)
        stream = self._ready(stream)
        rows = validate.u32(num_tokens, f"{_WHAT}.apply: num_tokens")
        if rows > self.max_rows:
            raise ValueError(f"{_WHAT}.apply: {rows} rows over max_rows {self.max_rows}")
        cfg = self.config
        width = cfg.hc_mult * cfg.hidden_size
        x = interop.device_address(
            residual,
            f"{_WHAT}.apply residual",
            dtypes=(interop.BF16,),
            count=rows * width,
            gpu=self.gpu,
            cols=cfg.hidden_size,
            writable=True,
        )
        if rows:
            self.gates[i].run(x, self.kv_of(i), self.text, rows, stream)

    def seed(
        self,
        tokens: Buffer,
        cu_seqlens: Buffer,
        slots: Buffer,
        num_seqs: int,
        num_tokens: int,
        stream: int = 0,
        *,
        text: Buffer | None = None,
    ) -> None:
        """A prefix-cache hit: append each sequence's tokens (ragged as in ``prefill``) to its
        slot's history without looking anything up. One launch; it reads each sequence's last
        ``N - 1 + max_draft`` tokens only."""
        num_seqs, num_tokens = self._sizes(num_seqs, num_tokens, limit_rows=False)
        indices = self._ragged(tokens, cu_seqlens, slots, num_seqs, num_tokens)
        mask = self._text(text, num_tokens)
        stream = self._ready(stream)
        if num_seqs:
            self.launches.seed(*indices, num_tokens, num_seqs, stream, mask)

    # -- outside the hot path -------------------------------------------------------------------
    def emb_of(self, i: int) -> int:
        """The address of Engram layer ``layer_ids[i]``'s gathered rows ``[max_rows, emb_dim]`` bf16."""
        return int(self.emb) + i * self.max_rows * self.config.emb_dim * 2

    def kv_of(self, i: int) -> int:
        """The address of Engram layer ``layer_ids[i]``'s projection ``[max_rows, kv_dim]`` bf16."""
        return int(self.kv) + i * self.max_rows * self.config.kv_dim * 2

    # -- helpers --------------------------------------------------------------------------------
    def _open(self) -> None:
        validate.require_open(self.closed, _WHAT)
        validate.require_open(self.weights.closed, f"{_WHAT}: its weights")

    def _text(self, text: Buffer | None, rows: int) -> int:
        if text is None:
            return 0
        return interop.device_address(text, f"{_WHAT} text", dtypes=_U8, count=rows, gpu=self.gpu)

    def _projections(self, rows: int) -> list[Any]:
        """Each layer's prepared GEMM ``kv[:rows] = emb[:rows] @ wkv^T`` (made once per row count):
        over the fp8 ``wkv`` up to ``FP8_ROWS`` rows or when batch invariant, else the bf16 copy."""
        plans = self._gemms.get(rows)
        if plans is None:
            cfg, gpu = self.config, self.gpu
            fp8 = self.batch_invariant or rows <= FP8_ROWS
            plans = [
                gemm_fp8.plan_fp8w_gemm(
                    gpu,
                    self._fp8_kernel,
                    self.emb_of(i),
                    layer.wkv_fp8,
                    self.kv_of(i),
                    rows,
                    cfg.kv_dim,
                    cfg.emb_dim,
                    workspace=self.workspace,
                    batch_invariant=self.batch_invariant,
                )
                if fp8
                else gemm.plan_gemm(
                    gpu, self._gemm_kernel, self.emb_of(i), layer.wkv, self.kv_of(i), rows, cfg.kv_dim, cfg.emb_dim
                )
                for i, layer in enumerate(self.weights.layers)
            ]
            if len(self._gemms) >= 1024:
                self._gemms.clear()
            self._gemms[rows] = plans
        return plans

    def _run(
        self, indices: tuple[int, int, int], text: int, num_seqs: int, rows: int, per_seq: int, stream: int
    ) -> None:
        stream = self._ready(stream)
        shard = self.weights.shard
        if shard is not None and shard.size > 1 and self.collective is None:
            raise ValueError(
                f"{_WHAT}: the weights are rank {shard.rank} of a tensor-parallel group: build the decoder with "
                "collective= (its end of the communicator), or drive the group with lookup_all"
            )
        if rows == 0:
            return
        self._projections(rows)  # planned (and cached) before anything is launched
        self.gather(indices, text, num_seqs, rows, per_seq, stream)
        if self.collective is not None:
            for i in range(len(self.config.layer_ids)):
                self.collective.allreduce_bf16(self.emb_of(i), rows * self.config.emb_dim, stream)
        self.project(rows, stream)

    def gather(
        self, indices: tuple[int, int, int], text: int, num_seqs: int, rows: int, per_seq: int, stream: int
    ) -> None:
        """The lookup alone (hash, gather into ``emb``, the histories' update), on checked
        arguments (``prefill`` / ``step`` check them; ``lookup_all`` and benchmarks call it);
        staged where the decoder stages host tables and the call has ``STAGED_ROWS`` rows."""
        stream = self._ready(stream)
        if self.staging is not None and rows >= STAGED_ROWS:
            self.staging.lookup(*indices, text, rows, num_seqs, per_seq, stream)
        else:
            self.launches.lookup(*indices, text, rows, num_seqs, per_seq, stream)

    def check_errors(self, stream: int | None = None) -> DecodeError:
        """``HistoryCalls.check_errors``; first, ``RuntimeError`` if the host staging's worker
        failed (the rows of its calls since are not to be trusted)."""
        failed = None if self.staging is None else self.staging.error
        if failed is not None:
            raise RuntimeError(f"{_WHAT}: the host's gather of table rows failed: {failed!r}") from failed
        return super().check_errors(stream)

    def project(self, rows: int, stream: int) -> None:
        """Every layer's ``kv[:rows] = emb[:rows] @ wkv^T`` (the GEMMs alone; ``rows >= 1``)."""
        stream = self._ready(stream)
        for plan in self._projections(rows):
            plan.run(stream)
