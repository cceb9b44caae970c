"""``NgramDecoder``: the n-gram embedding with its token history on the device, for serving loops
that capture their whole decode step in one CUDA graph.

``FusedNgramEmbedding`` builds each new token's look-back window on the host and uploads it per
call. Here every slot (one live request) keeps its last ``N - 1`` tokens (plus ``max_draft``, so
rejected speculative tokens can be rolled back) in device memory, and one kernel both reads the
windows from that history and appends the call's tokens to it. Every call takes device buffers
only and does no host synchronisation, allocation or upload: each can be recorded inside the
caller's stream capture and replayed with new values written to the same device buffers (for
example by ``embed_from_argmax``, whose ids feed ``step`` directly).

The calls, for what an engine does:
  ``prefill`` / ``step``  embed new tokens (ragged prompts / k tokens per sequence): the gather
                          (hash, every table's row, the word row or an adapter's, history update)
                          and the fused path's GEMM, bit for bit ``FusedNgramEmbedding``;
  ``seed``                a prefix-cache hit: the history only, no gather, no GEMM;
  ``fork``                parallel samples and beams: slot to slot copies on the device;
  ``rollback``            rejected drafts dropped; ``reset``: a new request in a slot.
A slot of ``PAD_SLOT`` is a padded entry of a graph's batch: zero rows, no history, no flag.
Per-sequence adapters (``adapters=``, ``NO_ADAPTER`` for none) take an overridden token's word
row from ``OverlaySlots`` inside the n-gram sum, before the scale and the single rounding.

Static under capture: the argument values of the captured call (addresses, ``num_seqs``,
``num_tokens``, ``k``, whether ``adapters`` is given). Token values, slots, ``cu_seqlens``,
counts and adapter indices are read on the device each replay; bad ones never make a kernel
touch memory outside its buffers: they set a flag that ``check_errors`` reads (one small copy,
outside the hot path), and the affected rows come out as zeros.

Tables: resident bf16 and fp8, and host-memory tables (read in place over PCIe). ``RowCache``
tables need the host to resolve every step and are refused: serve them with the fused path.
``gpu`` must be the backend the layer was built with (its weights live there).
Like the fused path, one decoder must not run on two streams at once (it has one gather buffer).
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from gpu_runtime import GpuBackend, interop, validate

from ..kernel_files import load_kernel
from ..ops import gemm as gemm_ops
from ..ops import ngram_decode as decode_ops
from ..ops.ngram_decode import NO_ADAPTER, NO_ADAPTERS, PAD_SLOT, AdapterTables
from ..overlay.slots import OverlaySlots
from .embedding import NgramEmbedding
from .front import require_open
from .fused import FusedNgramEmbedding, check_adapter_slots, check_layer, gemm_path, out_address
from .resources import Resources
from .tables import CachedTable

__all__ = ["DecodeError", "NO_ADAPTER", "NgramDecoder", "PAD_SLOT"]


class DecodeError(enum.IntFlag):
    """What ``check_errors`` found since the last check (``ctrl[0]`` of the kernels)."""

    NONE = 0
    TOKEN = 1     # a token >= vocab: its row was zeroed, it ends later look-backs
    SLOT = 2      # a slot >= max_seqs: that sequence's rows were zeroed, no history touched
    SEQLENS = 4   # cu_seqlens not 0 <= ... <= num_tokens, non-decreasing: rows left out zeroed
    ROLLBACK = 8  # a rollback count deeper than the history (over max_draft): slot unchanged
    ADAPTER = 16  # an adapter index >= the adapter slots (not NO_ADAPTER): its rows zeroed


# A device buffer: an address (int, DevicePtr, DeviceBuffer), a DeviceArray, or any array with
# __cuda_array_interface__ or __dlpack__ (CuPy, torch, JAX), checked by gpu_runtime.interop.
Buffer = Any

_WHAT = "NgramDecoder"
NO_ROW_CACHE = ("NgramDecoder: RowCache tables need host work every step; serve them with "
                "FusedNgramEmbedding, or hold the table in host memory (NgramTable.Host)")


def check_sizes(max_seqs: int, max_rows: int, max_draft: int) -> tuple[int, int, int]:
    """A decoder's sizes as ints (its constructor's checks, also run before a model is loaded)."""
    return (validate.positive(max_seqs, "NgramDecoder: max_seqs", limit=1 << 31),
            validate.positive(max_rows, "NgramDecoder: max_rows", limit=1 << 31),
            validate.count(max_draft, "NgramDecoder: max_draft", limit=1 << 31))


class NgramDecoder:
    """Per-slot token histories on the device and the capturable calls over them (module doc).
    ``adapter_slots``: the ``OverlaySlots`` whose embedding rows ``adapters=`` selects (its
    vocab and row width must be the model's). ``batch_invariant``: every row's bits the same
    whatever else is in its call (and equal to the fused path's alone, ``fused.gemm_path``)."""

    def __init__(self, layer: NgramEmbedding, *, max_seqs: int, max_rows: int, gpu: GpuBackend,
                 stream: int = 0, max_draft: int = 0, adapter_slots: OverlaySlots | None = None,
                 batch_invariant: bool = False) -> None:
        if any(isinstance(t, CachedTable) for t in layer.tables):
            raise ValueError(NO_ROW_CACHE)
        max_seqs, max_rows, max_draft = check_sizes(max_seqs, max_rows, max_draft)
        check_layer(_WHAT, layer, gpu)
        check_adapter_slots(_WHAT, adapter_slots, layer.dims, gpu)
        self._owned_layer: NgramEmbedding | None = None  # set by from_pretrained: closed with this
        dims = layer.dims
        self.dims, self.gpu, self.stream = dims, gpu, stream
        self.max_seqs, self.max_rows, self.max_draft = max_seqs, max_rows, max_draft
        self.adapter_slots = adapter_slots
        self.gemm_path = gemm_path(batch_invariant)
        self.hist_len = max(dims.max_ngram - 1 + max_draft, 1)
        self.gather_k = load_kernel(gpu, decode_ops.MODULE, decode_ops.GATHER)
        self.seed_k = load_kernel(gpu, decode_ops.MODULE, decode_ops.SEED)
        self.fork_k = load_kernel(gpu, decode_ops.MODULE, decode_ops.FORK)
        self.rollback_k = load_kernel(gpu, decode_ops.MODULE, decode_ops.ROLLBACK)
        self._resources = own = Resources(gpu)  # the fused layer, then the state: closed in reverse
        try:
            self.fused = own.adopt(self._make_fused(layer, max_rows, gpu, stream))  # gather buffer
            self.hist = own.alloc(max_seqs * self.hist_len * 4)
            self.state = own.alloc(max_seqs * 2 * 4)
            self.ctrl = own.alloc(2 * 4)
            self.word_ids = own.alloc(max_rows * 4)
            # each row's adapter word row (u64 address, 0: the base table's), for the GEMM
            self.word_over = own.alloc(max_rows * 8) if adapter_slots is not None else None
            gpu.memset(self.hist, 0xFF, max_seqs * self.hist_len * 4, stream)
            gpu.memset(self.state, 0, max_seqs * 2 * 4, stream)
            gpu.memset(self.ctrl, 0, 2 * 4, stream)
        except BaseException:
            own.close()
            raise

    def _make_fused(self, layer: NgramEmbedding, max_rows: int, gpu: GpuBackend, stream: int) -> FusedNgramEmbedding:
        """The fused layer whose weights, table descriptors and gather buffer the calls use."""
        return FusedNgramEmbedding(layer, max_rows, gpu, stream)

    @classmethod
    def from_pretrained(cls, model_dir: str, gpu: GpuBackend, *, max_seqs: int, max_rows: int = 8192,
                        stream: int = 0, max_draft: int = 0, **layer_args) -> "NgramDecoder":
        """``NgramEmbedding.from_pretrained(model_dir, gpu, stream=stream, **layer_args)``
        (placement, max_tokens, eos_id, table_dir) wrapped in a decoder, which then owns the
        layer: ``close()`` frees both. ``placement`` "files" is refused (``RowCache`` tables need
        the host every step), like every other refusal before any upload."""
        from .checkpoint import NgramCheckpoint
        from .pretrained import load_layer
        from .fused import check_servable

        check_sizes(max_seqs, max_rows, max_draft)
        check_servable(NgramCheckpoint.open(model_dir, eos_id=layer_args.get("eos_id"), parts="dense").dims, max_rows)
        layer = load_layer(NgramEmbedding, model_dir, gpu, stream=stream, refuse_files=NO_ROW_CACHE,
                           **layer_args)
        try:
            dec = cls(layer, max_seqs=max_seqs, max_rows=max_rows, gpu=gpu, stream=stream, max_draft=max_draft)
        except BaseException:
            layer.close()
            raise
        dec._owned_layer = layer
        return dec

    # -- calls (capturable) -----------------------------------------------------------------------
    def prefill(self, tokens: Buffer, cu_seqlens: Buffer, slots: Buffer, num_seqs: int,
                num_tokens: int, out: Buffer, stream: int = 0, *, adapters: Buffer | None = None) -> None:
        """Embed a ragged batch: sequence ``s`` is ``tokens[cu_seqlens[s]:cu_seqlens[s+1]]`` and
        continues the history of slot ``slots[s]`` (after ``reset`` for a new request; a later
        chunk of the same prompt just continues it). ``out [num_tokens, D]`` bf16, rows in order.
        ``tokens`` [num_tokens], ``cu_seqlens`` [num_seqs + 1], ``slots`` [num_seqs] and
        ``adapters`` [num_seqs] (each sequence's adapter slot, ``NO_ADAPTER`` for none) are u32
        (or int32, read as its bits)."""
        num_seqs, num_tokens = self._sizes(num_seqs, num_tokens)
        args = (self._index(tokens, num_tokens, "tokens"), self._index(cu_seqlens, num_seqs + 1, "cu_seqlens"),
                self._index(slots, num_seqs, "slots"))
        self._run(*args, num_seqs, num_tokens, 0, out, stream, adapters)

    def step(self, tokens: Buffer, slots: Buffer, num_seqs: int, out: Buffer, stream: int = 0, *,
             k: int = 1, adapters: Buffer | None = None) -> None:
        """``k`` new tokens for each of ``num_seqs`` sequences (k > 1: speculative drafts, to be
        verified and the rejected ones dropped with ``rollback``): ``tokens [num_seqs, k]``,
        ``slots [num_seqs]``, ``adapters [num_seqs]`` as in ``prefill``; ``out [num_seqs * k, D]``
        bf16. A padded entry (slot ``PAD_SLOT``) writes its k rows as zeros."""
        k = validate.positive(k, "NgramDecoder.step: k", limit=1 << 32)
        num_seqs, rows = self._sizes(num_seqs, validate.u32(num_seqs, "NgramDecoder: num_seqs") * k)
        args = (self._index(tokens, rows, "tokens"), 0, self._index(slots, num_seqs, "slots"))
        self._run(*args, num_seqs, rows, k, out, stream, adapters)

    def seed(self, tokens: Buffer, cu_seqlens: Buffer, slots: Buffer, num_seqs: int,
             num_tokens: int, stream: int = 0) -> None:
        """A prefix-cache hit: append each sequence's tokens (ragged as in ``prefill``) to its
        slot's history without embedding them, so the next call's n-grams reach back into them.
        One launch; it reads only each sequence's last ``N - 1 + max_draft`` tokens (those are
        checked), so its cost grows with the sequences, not with the tokens or D."""
        num_seqs, num_tokens = self._sizes(num_seqs, num_tokens, limit_rows=False)
        tokens = self._index(tokens, num_tokens, "tokens")
        cu_seqlens = self._index(cu_seqlens, num_seqs + 1, "cu_seqlens")
        slots = self._index(slots, num_seqs, "slots")
        self._open()
        decode_ops.ngram_decode_seed(self.gpu, self.seed_k, tokens, cu_seqlens, slots, self.hist,
                                     self.state, self.ctrl, num_tokens, num_seqs, self.max_seqs,
                                     self.hist_len, self.dims.vocab_size, stream)

    def fork(self, src_slots: Buffer, dst_slots: Buffer, num: int, stream: int = 0) -> None:
        """Slot ``dst_slots[p]`` becomes a copy of slot ``src_slots[p]`` (its history and
        position, so drafts roll back alike), ``p < num``: parallel samples, beam search. One
        launch. A pair with a ``PAD_SLOT`` is skipped; a bad slot is flagged (``SLOT``) and its
        pair skipped. A destination that is also a source or destination of another pair of the
        same call races (in bounds, result unspecified)."""
        num = validate.u32(num, "NgramDecoder.fork: num")
        src = self._index(src_slots, num, "src_slots")
        dst = self._index(dst_slots, num, "dst_slots")
        self._open()
        decode_ops.ngram_decode_fork(self.gpu, self.fork_k, src, dst, self.hist, self.state, self.ctrl,
                                     num, self.max_seqs, self.hist_len, stream)

    def rollback(self, slots: Buffer, counts: Buffer, num_seqs: int, stream: int = 0) -> None:
        """Drop the last ``counts[s]`` tokens (u32, on the device) of slot ``slots[s]``'s history;
        at most ``max_draft`` beyond what later steps wrote (deeper: ``DecodeError.ROLLBACK``).
        A ``PAD_SLOT`` entry is skipped."""
        num_seqs, _ = self._sizes(num_seqs, 0)
        slots = self._index(slots, num_seqs, "slots")
        counts = self._index(counts, num_seqs, "counts")
        self._open()
        decode_ops.ngram_decode_rollback(self.gpu, self.rollback_k, slots, counts, self.state, self.ctrl,
                                         num_seqs, self.max_seqs, self.max_draft, stream)

    def reset(self, slot: int, stream: int = 0) -> None:
        """Empty slot ``slot``'s history (a new request); a memset, so capturable too."""
        self._open()
        slot = validate.count(slot, "NgramDecoder.reset: slot", limit=self.max_seqs)
        self.gpu.memset(self.state.offset(slot * 8), 0, 8, stream)

    def reset_all(self, stream: int = 0) -> None:
        self._open()
        self.gpu.memset(self.state, 0, self.max_seqs * 8, stream)

    # -- outside the hot path ---------------------------------------------------------------------
    def check_errors(self, stream: int | None = None) -> DecodeError:
        """The flags raised by every call since the last check, then cleared. Waits for
        ``stream`` (default: the construction stream), so keep it out of the step loop."""
        self._open()
        stream = self.stream if stream is None else stream
        word = np.zeros(1, np.uint32)
        self.gpu.copy_d2h(word, self.ctrl, stream)
        if word[0]:
            self.gpu.memset(self.ctrl, 0, 4, stream)
        return DecodeError(int(word[0]))

    def history(self, slot: int, stream: int | None = None) -> np.ndarray:
        """The tokens slot ``slot`` looks back on (its last ``min(pos, N - 1)``, oldest first;
        a bad token is kept as 0xFFFFFFFF); waits for ``stream``. For tests and debugging."""
        self._open()
        slot = validate.count(slot, "NgramDecoder.history: slot", limit=self.max_seqs)
        stream = self.stream if stream is None else stream
        state = np.zeros(2, np.uint32)
        ring = np.zeros(self.hist_len, np.uint32)
        self.gpu.copy_d2h(state, self.state.offset(slot * 8), stream)
        self.gpu.copy_d2h(ring, self.hist.offset(slot * self.hist_len * 4), stream)
        pos = int(state[0])
        return ring[[q % self.hist_len for q in range(pos - min(pos, self.dims.max_ngram - 1), pos)]]

    def close(self) -> None:
        """Free the state and the fused weights it built (not the layer's weights, unless
        ``from_pretrained`` built the layer: then the layer too); once."""
        layer, self._owned_layer = self._owned_layer, None
        try:
            self._resources.close()  # the state, then the fused layer
        finally:
            if layer is not None:
                layer.close()

    def __enter__(self) -> "NgramDecoder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._resources.closed

    def _open(self) -> None:
        require_open(_WHAT, self, self.fused.layer)

    def _sizes(self, num_seqs: int, rows: int, *, limit_rows: bool = True) -> tuple[int, int]:
        num_seqs = validate.u32(num_seqs, "NgramDecoder: num_seqs")
        rows = validate.u32(rows, "NgramDecoder: num_tokens")
        if num_seqs > self.max_seqs:
            raise ValueError(f"NgramDecoder: num_seqs {num_seqs} over max_seqs {self.max_seqs}")
        if limit_rows and rows > self.max_rows:
            raise ValueError(f"NgramDecoder: {rows} rows over max_rows {self.max_rows}")
        if rows and not num_seqs:
            raise ValueError(f"NgramDecoder: {rows} tokens in no sequence")
        return num_seqs, rows

    def _index(self, buf: Buffer, count: int, what: str) -> int:
        """The address of a u32 (or int32) device buffer of at least ``count`` entries
        (``gpu_runtime.interop``: an address, a ``DeviceArray``, or a foreign array)."""
        return interop.device_address(buf, f"NgramDecoder {what}", dtypes=interop.INDEX, count=count,
                                      gpu=self.gpu)

    def _adapter_tables(self, adapters: Buffer | None, num_seqs: int) -> AdapterTables:
        """The gather's adapter arguments for a call's ``adapters`` (None: none)."""
        if adapters is None:
            return NO_ADAPTERS
        slots = self.adapter_slots
        if slots is None:
            raise ValueError("NgramDecoder: adapters given, but the decoder was built without "
                             "adapter_slots (NgramDecoder(..., adapter_slots=OverlaySlots(...)))")
        index = self._index(adapters, num_seqs, "adapters")
        assert self.word_over is not None
        return AdapterTables(index, slots.embed_slot_map_tab, slots.embed_rows_tab, slots.embed_n_tab,
                             slots.num_slots, self.dims.hidden_size, self.word_over)

    def _run(self, tokens: int, cu_seqlens: int, slots: int, num_seqs: int, rows: int,
             per_seq: int, out: Buffer, stream: int, adapters: Buffer | None) -> None:
        self._open()
        out = out_address(out, _WHAT, rows, self.dims, self.gpu)
        tables = self._adapter_tables(adapters, num_seqs)
        if rows == 0:
            return
        self.launch_gather(tokens, cu_seqlens, slots, num_seqs, rows, per_seq, stream, tables)
        self._finish(rows, out, stream, tables.word_over)

    def _gathered_rows(self, rows: int) -> int:
        """Where ``launch_gather`` writes a call's ``[rows, T*td]`` gathered rows."""
        return self.fused.gather_buf

    def _finish(self, rows: int, out: int, stream: int, word_over: int) -> None:
        """The call's second launch: the GEMM with the word-row epilogue (``word_over``: each
        row's adapter word row, 0 for none at all)."""
        dims, fused = self.dims, self.fused
        gemm_ops.dense_gemm_bf16_word(self.gpu, fused.gemm_k, fused.gather_buf, fused.projs_weight,
                                      out, rows, dims.hidden_size, dims.num_tables() * dims.table_dim(),
                                      self.word_ids, fused.layer.word.weight, fused.inv_scale, stream,
                                      overlap=True, path=self.gemm_path, word_over=word_over)

    def launch_gather(self, tokens: int, cu_seqlens: int, slots: int, num_seqs: int, rows: int,
                      per_seq: int, stream: int, adapters: AdapterTables = NO_ADAPTERS) -> None:
        """The first of a call's two launches alone: hash, gather into the fused layer's gather
        buffer, append the tokens to the histories (``prefill`` / ``step`` check their arguments
        before it; benchmarks time it by itself). Addresses as ``prefill`` takes them."""
        dims, fused = self.dims, self.fused
        decode_ops.ngram_decode_gather(
            self.gpu, self.gather_k, tokens, cu_seqlens, slots, self.hist, self.state, fused.desc,
            fused.pows, self._gathered_rows(rows), self.word_ids, self.ctrl, rows, num_seqs, per_seq,
            self.max_seqs, self.hist_len, dims.vocab_size, dims.num_tables(), dims.max_ngram,
            dims.splits, dims.table_dim(), dims.eos_id, stream, adapters)
