"""``DecodeLaunches``: ``kernels/ngram_decode.cu``'s gather (with its history update) and the
shared history-only seed, fork and rollback (``token_history.HistoryLaunches``) planned over one
decoder. The decoder's state, tables and sizes are bound once, at construction; each call passes
only what changes.

Device state (``layers/ngram_embed/decoder.py`` owns it): the histories (``token_history``: a
history entry here is the token itself), ``ctrl [2]`` u32 (error flags, ``DecodeError``, and the
gather's block counter; both zero between launches). Values that only the device sees (tokens,
slots, cu_seqlens, counts, adapter indices) are checked by the kernels, which flag ``ctrl[0]``
instead of reading or writing out of bounds. A slot of ``PAD_SLOT`` is a padded batch entry (zero
rows, no history, no flag); an adapter index of ``NO_ADAPTER`` means the base word table.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_runtime import GpuBackend, validate

from ..kernel_files import load_kernel
from .ngram_fused import NO_TOKEN, PairLaunch, check_tables
from .token_history import PAD_SLOT, DecodeError, HistoryLaunches, TokenCode

MODULE = "ngram_decode"
GATHER = "ngram_decode_gather"
NO_ADAPTER = 0xFFFFFFFF  # a sequence served by the base word table

__all__ = ["AdapterTables", "DecodeError", "DecodeLaunches", "NO_ADAPTER", "NO_ADAPTERS", "PAD_SLOT"]


@dataclass(frozen=True)
class AdapterTables:
    """The gather's adapter arguments: each sequence's adapter slot (``index`` u32 [num_seqs],
    NO_ADAPTER for none) and ``OverlaySlots``' embedding tables (``maps``, ``rows``, ``counts``
    over ``num`` slots, rows ``hidden`` wide); ``word_over`` [rows] u64 receives each row's
    replacement word row (0: the base table's) for the GEMM's epilogue."""

    index: int
    maps: int
    rows: int
    counts: int
    num: int
    hidden: int
    word_over: int

    @property
    def kernel_args(self) -> tuple[int, ...]:
        """The gather kernel's adapter parameters, in its order (its last seven)."""
        return (self.index, self.maps, self.rows, self.counts, self.num, self.hidden, self.word_over)


NO_ADAPTERS = AdapterTables(0, 0, 0, 0, 0, 0, 0)
_NONE = NO_ADAPTERS.kernel_args


class DecodeLaunches(HistoryLaunches):
    """The gather and the history kernels over one decoder's device state: ``hist [max_seqs,
    hist_len]`` u32 token ring per slot, ``state [max_seqs, 2]`` u32 (pos, hi) per slot, ``ctrl
    [2]`` u32 (error flags, ``DecodeError``, and the gather's block counter; both zero between
    launches); its tables
    (``tables``, ``pows`` and their sizes, as ``NgramGather`` takes them; ``host_tables``: some
    in host memory) and the gather's word ids ``word_ids [max rows]``.

    Values that only the device sees (tokens, slots, cu_seqlens, counts, adapter indices) are
    checked by the kernels, which flag ``ctrl[0]`` instead of reading or writing out of bounds.
    Everything else the decoder checks before it calls: the calls here trust their arguments."""

    def __init__(
        self,
        gpu: GpuBackend,
        hist: int,
        state: int,
        ctrl: int,
        word_ids: int,
        *,
        max_seqs: int,
        hist_len: int,
        vocab: int,
        max_draft: int,
        tables: int,
        pows: int,
        num_tables: int,
        max_ngram: int,
        splits: int,
        table_dim: int,
        eos: int | None,
        host_tables: bool = False,
    ) -> None:
        vocab = validate.u32(vocab, f"{MODULE} vocab")
        if not 1 <= vocab < NO_TOKEN:
            raise ValueError(f"{GATHER}: vocab must be in 1..2**32-2, got {vocab}")
        code = TokenCode(0, vocab)
        super().__init__(gpu, hist, state, ctrl, max_seqs=max_seqs, hist_len=hist_len, max_draft=max_draft, code=code)
        self.gather_kernel = gpu.bind(load_kernel(gpu, MODULE, GATHER))
        word_ids = validate.pointer(word_ids, f"{MODULE} word_ids")
        table_args = check_tables(GATHER, num_tables, max_ngram, splits, table_dim, eos)
        hist, state, max_seqs, hist_len = self.hist, self.state, self.max_seqs, self.hist_len
        if hist_len < max(table_args[1] - 1, 1):
            raise ValueError(
                f"{GATHER}: max_seqs must be >= 1 and hist_len >= max(1, max_ngram - 1); got {max_seqs}, {hist_len}"
            )
        self.pairs_per_row = table_args[0] + 1  # the T tables' and the word's
        self.launches = PairLaunch(gpu, host_tables)
        tables, pows = validate.pointer(tables, f"{GATHER} tables"), validate.pointer(pows, f"{GATHER} pows")
        # the gather's arguments around the call's: (tokens, cu_seqlens, slots), these four, out,
        # these two, (rows, num_seqs, per_seq), then the sizes and the adapters
        self._state = (hist, state, tables, pows)
        self._outputs = (word_ids, self.ctrl)
        self._sizes = (max_seqs, hist_len, vocab, *table_args)
        self.vocab = vocab

    def gather(
        self,
        tokens: int,
        cu_seqlens: int,
        slots: int,
        out: int,
        rows: int,
        num_seqs: int,
        per_seq: int,
        stream: int,
        adapters: AdapterTables = NO_ADAPTERS,
    ) -> None:
        """Gather every table's row of ``rows >= 1`` tokens (ragged by ``cu_seqlens [num_seqs +
        1]``, or ``per_seq`` each when ``cu_seqlens`` is 0) into ``out [rows, T*td]`` (td: the table
        width), their word ids into ``word_ids`` (and, with ``adapters``, their replacement word rows
        into its ``word_over``), then append each sequence's tokens to the history of ``slots[s]``."""
        self.gather_kernel.launch(
            self.launches.config(rows * self.pairs_per_row),
            stream,
            tokens,
            cu_seqlens,
            slots,
            *self._state,
            out,
            *self._outputs,
            rows,
            num_seqs,
            per_seq,
            *self._sizes,
            *(_NONE if adapters is NO_ADAPTERS else adapters.kernel_args),
        )
