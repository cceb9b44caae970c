"""``DecodeLaunches``: ``kernels/ngram_decode.cu``'s four kernels planned over one decoder: the
gather (with its history update), the history-only seed, fork and rollback. The decoder's state,
tables and sizes are bound once, at construction; each call passes only what changes.

Device state (``layers/ngram_embed/decoder.py`` owns it): ``hist [max_seqs, hist_len]`` u32 token
ring per slot, ``state [max_seqs, 2]`` u32 (pos, hi) per slot, ``ctrl [2]`` u32 (error flags,
``DecodeError``, and the gather's block counter; both zero between launches). Values that only
the device sees (tokens, slots, cu_seqlens, counts, adapter indices) are checked by the kernels,
which flag ``ctrl[0]`` instead of reading or writing out of bounds. A slot of ``PAD_SLOT`` is a
padded batch entry (zero rows, no history, no flag); an adapter index of ``NO_ADAPTER`` means the
base word table.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from gpu_runtime import GpuBackend, LaunchConfig, validate

from ..kernel_files import load_kernel
from .ngram_fused import NO_TOKEN, PairLaunch, check_tables

MODULE = "ngram_decode"
GATHER = "ngram_decode_gather"
SEED = "ngram_decode_seed"
FORK = "ngram_decode_fork"
ROLLBACK = "ngram_decode_rollback"
PAD_SLOT = 0xFFFFFFFF  # a padded batch entry: zero rows, no history read or written, no flag
NO_ADAPTER = 0xFFFFFFFF  # a sequence served by the base word table


class DecodeError(enum.IntFlag):
    """What ``NgramDecoder.check_errors`` found since the last check (``ctrl[0]`` of the kernels)."""

    NONE = 0
    TOKEN = 1  # a token >= vocab: its row was zeroed, it ends later look-backs
    SLOT = 2  # a slot >= max_seqs: that sequence's rows were zeroed, no history touched
    SEQLENS = 4  # cu_seqlens not 0 <= ... <= num_tokens, non-decreasing: rows left out zeroed
    ROLLBACK = 8  # a rollback past max_draft below the slot's highest position: slot unchanged
    ADAPTER = 16  # an adapter index >= the adapter slots (not NO_ADAPTER): its rows zeroed


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

_THREADS = 256  # 8 warps, one sequence (or fork pair) each; the gather's: PairLaunch


@functools.cache
def _config(blocks: int) -> LaunchConfig:
    return LaunchConfig(blocks, _THREADS)


class DecodeLaunches:
    """The four kernels over one decoder's device state: ``hist [max_seqs, hist_len]`` u32 token
    ring per slot, ``state [max_seqs, 2]`` u32 (pos, hi) per slot, ``ctrl [2]`` u32 (error flags,
    ``DecodeError``, and the gather's block counter; both zero between launches); its tables
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
        self.gather_kernel, self.seed_kernel, self.fork_kernel, self.rollback_kernel = (
            gpu.bind(load_kernel(gpu, MODULE, name)) for name in (GATHER, SEED, FORK, ROLLBACK)
        )
        hist, state = validate.pointer(hist, f"{MODULE} hist"), validate.pointer(state, f"{MODULE} state")
        self.ctrl, word_ids = validate.pointer(ctrl, f"{MODULE} ctrl"), validate.pointer(word_ids, f"{MODULE} word_ids")
        max_seqs, hist_len = validate.u32(max_seqs, f"{MODULE} max_seqs"), validate.u32(hist_len, f"{MODULE} hist_len")
        vocab, max_draft = validate.u32(vocab, f"{MODULE} vocab"), validate.u32(max_draft, f"{MODULE} max_draft")
        table_args = check_tables(GATHER, num_tables, max_ngram, splits, table_dim, eos)
        if max_seqs < 1 or hist_len < max(table_args[1] - 1, 1):
            raise ValueError(
                f"{GATHER}: max_seqs must be >= 1 and hist_len >= max(1, max_ngram - 1); got {max_seqs}, {hist_len}"
            )
        if not 1 <= vocab < NO_TOKEN:
            raise ValueError(f"{GATHER}: vocab must be in 1..2**32-2, got {vocab}")
        self.pairs_per_row = table_args[0] + 1  # the T tables' and the word's
        self.launches = PairLaunch(gpu, host_tables)
        tables, pows = validate.pointer(tables, f"{GATHER} tables"), validate.pointer(pows, f"{GATHER} pows")
        # the gather's arguments around the call's: (tokens, cu_seqlens, slots), these four, out,
        # these two, (rows, num_seqs, per_seq), then the sizes and the adapters
        self._state = (hist, state, tables, pows)
        self._outputs = (word_ids, self.ctrl)
        self._sizes = (max_seqs, hist_len, vocab, *table_args)
        self._history = (hist, state, self.ctrl)
        self.max_seqs, self.hist_len, self.vocab, self.max_draft = max_seqs, hist_len, vocab, max_draft

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

    def seed(self, tokens: int, cu_seqlens: int, slots: int, rows: int, num_seqs: int, stream: int) -> None:
        """Append each of ``num_seqs >= 1`` sequences' tokens (ragged by ``cu_seqlens [num_seqs +
        1]`` over ``rows`` tokens) to the history of ``slots[s]`` without embedding them."""
        config = _config(-(-num_seqs // (_THREADS // 32)))
        args = (*self._history, rows, num_seqs, self.max_seqs, self.hist_len, self.vocab)
        self.seed_kernel.launch(config, stream, tokens, cu_seqlens, slots, *args)

    def fork(self, src_slots: int, dst_slots: int, num: int, stream: int) -> None:
        """Copy slot ``src_slots[p]``'s history and position to slot ``dst_slots[p]``, ``p < num``
        (``num >= 1``)."""
        config = _config(-(-num // (_THREADS // 32)))
        self.fork_kernel.launch(config, stream, src_slots, dst_slots, *self._history, num, self.max_seqs, self.hist_len)

    def rollback(self, slots: int, counts: int, num_seqs: int, stream: int) -> None:
        """Drop the last ``counts[s]`` tokens of slot ``slots[s]``'s history, ``s < num_seqs``
        (``>= 1``); a count deeper than ``max_draft`` allows flags ``ctrl[0]`` and leaves that
        slot as it was."""
        state, ctrl = self._state[1], self.ctrl
        args = (num_seqs, self.max_seqs, self.max_draft)
        self.rollback_kernel.launch(_config(-(-num_seqs // _THREADS)), stream, slots, counts, state, ctrl, *args)
