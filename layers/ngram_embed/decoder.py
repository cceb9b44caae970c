"""``NgramDecoder``: the n-gram embedding with each slot's token history on the device, for
serving loops that capture their whole decode step in one CUDA graph (``docs/NGRAM.md``).

Each slot (one live request) keeps its last ``N - 1 + max_draft`` tokens in device memory; one
kernel reads the windows from that history, gathers every table's row and the word row (or an
adapter's), and appends the tokens; the fused path's GEMM then rounds once, bit for bit
``FusedNgramEmbedding``. Every call takes device buffers only and does no host synchronisation,
allocation or upload, so it can be recorded in the caller's capture: ``prefill`` / ``step``
(ragged prompts / k tokens per sequence), ``seed`` (a prefix-cache hit: history only), ``fork``
(samples, beams), ``rollback`` (rejected drafts), ``reset``. A ``PAD_SLOT`` entry writes zero
rows and touches no history.

Static under capture: the call's addresses, ``num_seqs``, ``num_tokens``, ``k`` and whether
``adapters`` is given. Tokens, slots, ``cu_seqlens``, counts and adapter indices are read on the
device each replay; bad ones set a flag that ``check_errors`` reads and zero the affected rows,
never making a kernel touch memory outside its buffers.

``RowCache`` tables need the host every step and are rejected (``ValueError``). With a tensor-parallel shard's
weights and ``collective=`` it runs one rank, the all-reduce inside the same call. One decoder
must not run on two streams at once (it has one gather buffer).
"""

from __future__ import annotations

from typing import Any

from gpu_runtime import validate

from ..ops.ngram_decode import NO_ADAPTER, NO_ADAPTERS, PAD_SLOT, AdapterTables, DecodeError, DecodeLaunches
from ..overlay.slots import OverlaySlots
from ..resources import Resources
from ..token_history import HistoryCalls, SlotHistories
from .front import require_open
from .projection import RowProjection, check_collective, gemm_path
from .runner_checks import (
    NO_ROW_CACHE,
    check_adapter_slots,
    check_servable,
    check_sizes,
    check_weights,
    out_address,
)
from .tables import CachedTable
from .weights import NgramWeights

__all__ = ["DecodeError", "NO_ADAPTER", "NgramDecoder", "PAD_SLOT"]


# A device buffer: an address (int, DevicePtr, DeviceBuffer), a DeviceArray, or any array with
# __cuda_array_interface__ or __dlpack__ (CuPy, torch, JAX), checked by gpu_runtime.interop.
Buffer = Any

_WHAT = "NgramDecoder"
_STREAM = f"{_WHAT}: stream"


class NgramDecoder(HistoryCalls):
    """The n-gram embedding for a serving loop's captured decode step: each of ``max_seqs`` slots
    keeps its token history on the device, and every call (``prefill``, ``step``, ``seed``, ``fork``,
    ``rollback``, ``reset``) takes device buffers only, with no host synchronisation, so it can be
    recorded in a CUDA graph; bad device inputs set flags that ``check_errors`` reads. Rejects
    ``RowCache`` tables (``ValueError``). Borrows the weights. ``adapter_slots``: the
    ``OverlaySlots`` whose embedding rows ``adapters=`` selects (its vocab and row width must be
    the model's). ``batch_invariant``: every row's bits the same
    whatever else is in its call (and equal to the fused path's alone, ``projection.gemm_path``).
    ``collective``: a tensor-parallel shard's all-reduce (required for a shard's weights)."""

    WHAT = _WHAT
    launches: DecodeLaunches

    def __init__(
        self,
        weights: NgramWeights,
        *,
        max_seqs: int,
        max_rows: int,
        max_draft: int = 0,
        stream: int = 0,
        collective: Any = None,
        adapter_slots: OverlaySlots | None = None,
        batch_invariant: bool = False,
    ) -> None:
        weights = check_weights(_WHAT, weights)
        if any(isinstance(t, CachedTable) for t in weights.tables):
            raise ValueError(NO_ROW_CACHE)
        max_seqs, max_rows, max_draft = check_sizes(max_seqs, max_rows, max_draft)
        dims, gpu = weights.dims, weights.gpu
        check_servable(dims, max_rows)
        stream = validate.stream(stream, _STREAM)
        path = gemm_path(batch_invariant)
        if weights.shard is not None and collective is None:
            raise ValueError(
                f"{_WHAT}: the weights are a tensor-parallel shard; pass collective= (its end of the communicator)"
            )
        check_collective(_WHAT, collective, weights)
        check_adapter_slots(_WHAT, adapter_slots, dims, gpu)
        self.weights, self.dims, self.gpu, self.stream = weights, dims, gpu, stream
        self.max_seqs, self.max_rows, self.max_draft = max_seqs, max_rows, max_draft
        self.adapter_slots, self.collective = adapter_slots, collective
        self._resources = own = Resources(gpu)  # every buffer: released by close()
        try:
            self.projection = RowProjection(weights, max_rows, own, stream, collective=collective, path=path)
            self.word_ids = own.alloc(max_rows * 4)
            # each row's adapter word row (u64 address, 0: the base table's), for the GEMM
            self.word_over = own.alloc(max_rows * 8) if adapter_slots is not None else None
            self.histories = SlotHistories(
                gpu, own, max_seqs=max_seqs, back=dims.max_ngram - 1, max_draft=max_draft, stream=stream, what=_WHAT
            )
            proj = self.projection
            self.launches = DecodeLaunches(
                gpu,
                self.hist,
                self.state,
                self.ctrl,
                self.word_ids,
                max_seqs=max_seqs,
                hist_len=self.hist_len,
                vocab=dims.vocab_size,
                max_draft=max_draft,
                tables=proj.desc,
                pows=proj.pows,
                num_tables=dims.num_tables(),
                max_ngram=dims.max_ngram,
                splits=dims.splits,
                table_dim=dims.table_dim(),
                eos=dims.eos_id,
                host_tables=proj.host_tables,
            )
        except BaseException:
            own.close()
            raise

    # -- calls (capturable) -----------------------------------------------------------------------
    def prefill(
        self,
        tokens: Buffer,
        cu_seqlens: Buffer,
        slots: Buffer,
        num_seqs: int,
        num_tokens: int,
        out: Buffer,
        stream: int = 0,
        *,
        adapters: Buffer | None = None,
    ) -> None:
        """Embed a ragged batch: sequence ``s`` is ``tokens[cu_seqlens[s]:cu_seqlens[s+1]]`` and
        continues the history of slot ``slots[s]`` (after ``reset`` for a new request; a later
        chunk of the same prompt just continues it). ``out [num_tokens, D]`` bf16, rows in order.
        ``tokens`` [num_tokens], ``cu_seqlens`` [num_seqs + 1], ``slots`` [num_seqs] and
        ``adapters`` [num_seqs] (each sequence's adapter slot, ``NO_ADAPTER`` for none) are u32
        (or int32, read as its bits)."""
        num_seqs, num_tokens = self._sizes(num_seqs, num_tokens)
        indices = self._ragged(tokens, cu_seqlens, slots, num_seqs, num_tokens)
        self._run(indices, num_seqs, num_tokens, 0, out, stream, adapters)

    def step(
        self,
        tokens: Buffer,
        slots: Buffer,
        num_seqs: int,
        out: Buffer,
        stream: int = 0,
        *,
        k: int = 1,
        adapters: Buffer | None = None,
    ) -> None:
        """``k`` new tokens for each of ``num_seqs`` sequences (k > 1: speculative drafts, to be
        verified and the rejected ones dropped with ``rollback``): ``tokens [num_seqs, k]``,
        ``slots [num_seqs]``, ``adapters [num_seqs]`` as in ``prefill``; ``out [num_seqs * k, D]``
        bf16. A padded entry (slot ``PAD_SLOT``) writes its k rows as zeros."""
        k = validate.positive(k, "NgramDecoder.step: k", limit=1 << 32)
        num_seqs, rows = self._sizes(num_seqs, validate.u32(num_seqs, "NgramDecoder: num_seqs") * k)
        indices = (self._index(tokens, rows, "tokens"), 0, self._index(slots, num_seqs, "slots"))
        self._run(indices, num_seqs, rows, k, out, stream, adapters)

    def seed(
        self, tokens: Buffer, cu_seqlens: Buffer, slots: Buffer, num_seqs: int, num_tokens: int, stream: int = 0
    ) -> None:
        """A prefix-cache hit: append each sequence's tokens (ragged as in ``prefill``) to its
        slot's history without embedding them, so the next call's n-grams reach back into them.
        One launch; it reads only each sequence's last ``N - 1 + max_draft`` tokens (those are
        checked), so its cost grows with the sequences, not with the tokens or D."""
        num_seqs, num_tokens = self._sizes(num_seqs, num_tokens, limit_rows=False)
        indices = self._ragged(tokens, cu_seqlens, slots, num_seqs, num_tokens)
        stream = self._ready(stream)
        if num_seqs:
            self.launches.seed(*indices, num_tokens, num_seqs, stream)

    # -- helpers ----------------------------------------------------------------------------------
    def _open(self) -> None:
        require_open(_WHAT, self, self.weights)
        if self.collective is not None:
            validate.require_open(self.collective.closed, f"{_WHAT}: its collective")

    def _adapter_tables(self, adapters: Buffer | None, num_seqs: int) -> AdapterTables:
        """The gather's adapter arguments for a call's ``adapters`` (None: none)."""
        if adapters is None:
            return NO_ADAPTERS
        slots = self.adapter_slots
        if slots is None:
            raise ValueError(
                "NgramDecoder: adapters given, but the decoder was built without "
                "adapter_slots (NgramDecoder(..., adapter_slots=OverlaySlots(...)))"
            )
        index = self._index(adapters, num_seqs, "adapters")
        assert self.word_over is not None
        return AdapterTables(
            index,
            slots.embed_slot_map_tab,
            slots.embed_rows_tab,
            slots.embed_n_tab,
            slots.num_slots,
            self.dims.hidden_size,
            self.word_over,
        )

    def _run(
        self,
        indices: tuple[int, int, int],
        num_seqs: int,
        rows: int,
        per_seq: int,
        out: Buffer,
        stream: int,
        adapters: Buffer | None,
    ) -> None:
        """``prefill`` and ``step`` once their sizes and ``indices`` (the addresses of ``tokens``,
        ``cu_seqlens`` and ``slots``) are checked: the gather, then the projection into ``out``."""
        stream = self._ready(stream)
        out = out_address(out, _WHAT, rows, self.dims, self.gpu)
        tables = self._adapter_tables(adapters, num_seqs)
        if rows == 0:
            return
        self.launches.gather(*indices, self.projection.rows_at(rows), rows, num_seqs, per_seq, stream, tables)
        self.projection.finish(rows, self.word_ids, out, stream, tables.word_over)

    def launch_gather(
        self,
        tokens: int,
        cu_seqlens: int,
        slots: int,
        num_seqs: int,
        rows: int,
        per_seq: int,
        stream: int,
        adapters: AdapterTables = NO_ADAPTERS,
    ) -> None:
        """The first of a call's two launches alone: hash, gather into the projection's
        buffer, append the tokens to the histories (``prefill`` / ``step`` check their arguments
        before it; benchmarks time it by itself). Addresses as ``prefill`` takes them."""
        stream = validate.stream(stream, _STREAM)
        if rows:
            self.launches.gather(
                tokens, cu_seqlens, slots, self.projection.rows_at(rows), rows, num_seqs, per_seq, stream, adapters
            )
