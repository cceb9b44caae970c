"""Launchers of ``kernels/ngram_decode.cu``: the device-resident n-gram decoder's gather (with its
history update), history-only seed, fork and rollback. Arguments in the kernels' positional order.

Device state (``layers/ngram_embed/decoder.py`` owns it): ``hist [max_seqs, hist_len]`` u32 token
ring per slot, ``state [max_seqs, 2]`` u32 (pos, hi) per slot, ``ctrl [2]`` u32 (error flags, the
gather's block counter; both zero between launches). Values that only the device sees (tokens,
slots, cu_seqlens, counts, adapter indices) are checked by the kernels, which flag ``ctrl[0]``
instead of reading or writing out of bounds. A slot of ``PAD_SLOT`` is a padded batch entry
(zero rows, no history, no flag); an adapter index of ``NO_ADAPTER`` means the base word table.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_runtime import GpuBackend, KernelHandle, validate

from .ngram_fused import NO_TOKEN, eos_arg
from .specs import NGRAM_DECODE_FORK, NGRAM_DECODE_GATHER, NGRAM_DECODE_ROLLBACK, NGRAM_DECODE_SEED

MODULE = "ngram_decode"
GATHER = "ngram_decode_gather"
SEED = "ngram_decode_seed"
FORK = "ngram_decode_fork"
ROLLBACK = "ngram_decode_rollback"
PAD_SLOT = 0xFFFFFFFF    # a padded batch entry: zero rows, no history read or written, no flag
NO_ADAPTER = 0xFFFFFFFF  # a sequence served by the base word table


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


NO_ADAPTERS = AdapterTables(0, 0, 0, 0, 0, 0, 0)

_BLOCK = (256, 1, 1)  # 8 warps, one (row, table) pair (or sequence, or fork pair) each
_PAIRS_PER_BLOCK = 256 // 32
_MAX_BLOCKS = 4 * 132 * 8  # pairs are grid-strided past this


def ngram_decode_gather(gpu: GpuBackend, kernel: KernelHandle, tokens: int, cu_seqlens: int,
                        slots: int, hist: int, state: int, tables: int, pows: int, out: int,
                        word_ids: int, ctrl: int, rows: int, num_seqs: int, per_seq: int,
                        max_seqs: int, hist_len: int, vocab: int, num_tables: int, max_ngram: int,
                        splits: int, table_dim: int, eos: int | None, stream: int,
                        adapters: AdapterTables = NO_ADAPTERS) -> None:
    """Gather every table's row of ``rows`` tokens (ragged by ``cu_seqlens [num_seqs + 1]``, or
    ``per_seq`` each when ``cu_seqlens`` is 0) into ``out [rows, T*td]``, their word ids into
    ``word_ids [rows]`` (and, with ``adapters``, their replacement word rows into its
    ``word_over``), then append each sequence's tokens to the history of ``slots[s]``.
    ``rows == 0`` launches nothing."""
    rows, num_seqs, per_seq, max_seqs, hist_len, vocab, num_tables, max_ngram, splits, table_dim = (
        validate.u32(v, f"{GATHER} {what}") for v, what in (
            (rows, "rows"), (num_seqs, "num_seqs"), (per_seq, "per_seq"), (max_seqs, "max_seqs"),
            (hist_len, "hist_len"), (vocab, "vocab"), (num_tables, "num_tables"),
            (max_ngram, "max_ngram"), (splits, "splits"), (table_dim, "table_dim")))
    eos_word = eos_arg(eos)
    if max_ngram < 2 or splits < 1 or num_tables != splits * (max_ngram - 1):
        raise ValueError(f"{GATHER}: num_tables {num_tables} != splits {splits} * (max_ngram "
                         f"{max_ngram} - 1), or max_ngram < 2")
    if table_dim < 1 or max_seqs < 1 or hist_len < max_ngram - 1 or hist_len < 1:
        raise ValueError(f"{GATHER}: table_dim, max_seqs must be >= 1 and hist_len >= max(1, "
                         f"max_ngram - 1); got {table_dim}, {max_seqs}, {hist_len}")
    if not 1 <= vocab < NO_TOKEN:
        raise ValueError(f"{GATHER}: vocab must be in 1..2**32-2, got {vocab}")
    if num_seqs > max_seqs:
        raise ValueError(f"{GATHER}: num_seqs {num_seqs} over max_seqs {max_seqs}")
    if not cu_seqlens and rows != num_seqs * per_seq:
        raise ValueError(f"{GATHER}: rows {rows} != num_seqs {num_seqs} * per_seq {per_seq}")
    if rows == 0:
        return
    if num_seqs == 0:
        raise ValueError(f"{GATHER}: {rows} rows in no sequence")
    if adapters.index and not (adapters.maps and adapters.rows and adapters.counts and adapters.word_over):
        raise ValueError(f"{GATHER}: adapter indices need every adapter table and word_over")
    blocks = min(-(-rows * (num_tables + 1) // _PAIRS_PER_BLOCK), _MAX_BLOCKS)  # + the word pairs
    NGRAM_DECODE_GATHER.launch(
        gpu, kernel, (blocks, 1, 1), _BLOCK, stream, tokens=tokens, cu_seqlens=cu_seqlens,
        slots=slots, hist=hist, state=state, tables=tables, pows=pows, out=out, word_ids=word_ids,
        ctrl=ctrl, rows=rows, num_seqs=num_seqs, per_seq=per_seq, max_seqs=max_seqs,
        hist_len=hist_len, vocab=vocab, num_tables=num_tables, max_ngram=max_ngram, splits=splits,
        td=table_dim, eos=eos_word, adapters=adapters.index, adapter_maps=adapters.maps,
        adapter_rows=adapters.rows, adapter_counts=adapters.counts, num_adapters=adapters.num,
        hidden=adapters.hidden, word_over=adapters.word_over)


def ngram_decode_seed(gpu: GpuBackend, kernel: KernelHandle, tokens: int, cu_seqlens: int,
                      slots: int, hist: int, state: int, ctrl: int, rows: int, num_seqs: int,
                      max_seqs: int, hist_len: int, vocab: int, stream: int) -> None:
    """Append each sequence's tokens (ragged by ``cu_seqlens [num_seqs + 1]`` over ``rows``
    tokens) to the history of ``slots[s]`` without embedding them. ``num_seqs == 0`` launches
    nothing."""
    rows, num_seqs, max_seqs, hist_len, vocab = (
        validate.u32(v, f"{SEED} {what}") for v, what in (
            (rows, "rows"), (num_seqs, "num_seqs"), (max_seqs, "max_seqs"), (hist_len, "hist_len"),
            (vocab, "vocab")))
    if num_seqs > max_seqs:
        raise ValueError(f"{SEED}: num_seqs {num_seqs} over max_seqs {max_seqs}")
    if rows and not num_seqs:
        raise ValueError(f"{SEED}: {rows} tokens in no sequence")
    if num_seqs == 0:
        return
    NGRAM_DECODE_SEED.launch(gpu, kernel, (-(-num_seqs // _PAIRS_PER_BLOCK), 1, 1), _BLOCK, stream,
                             tokens=tokens, cu_seqlens=cu_seqlens, slots=slots, hist=hist, state=state,
                             ctrl=ctrl, rows=rows, num_seqs=num_seqs, max_seqs=max_seqs,
                             hist_len=hist_len, vocab=vocab)


def ngram_decode_fork(gpu: GpuBackend, kernel: KernelHandle, src_slots: int, dst_slots: int,
                      hist: int, state: int, ctrl: int, num: int, max_seqs: int, hist_len: int,
                      stream: int) -> None:
    """Copy slot ``src_slots[p]``'s history and position to slot ``dst_slots[p]``, ``p < num``.
    ``num == 0`` launches nothing."""
    num = validate.u32(num, f"{FORK} num")
    max_seqs = validate.u32(max_seqs, f"{FORK} max_seqs")
    hist_len = validate.u32(hist_len, f"{FORK} hist_len")
    if num == 0:
        return
    NGRAM_DECODE_FORK.launch(gpu, kernel, (-(-num // _PAIRS_PER_BLOCK), 1, 1), _BLOCK, stream,
                             src_slots=src_slots, dst_slots=dst_slots, hist=hist, state=state, ctrl=ctrl,
                             num=num, max_seqs=max_seqs, hist_len=hist_len)


def ngram_decode_rollback(gpu: GpuBackend, kernel: KernelHandle, slots: int, counts: int,
                          state: int, ctrl: int, num_seqs: int, max_seqs: int, max_draft: int,
                          stream: int) -> None:
    """Drop the last ``counts[s]`` tokens of slot ``slots[s]``'s history, ``s < num_seqs``; a
    count deeper than ``max_draft`` allows flags ``ctrl[0]`` and leaves that slot as it was.
    ``num_seqs == 0`` launches nothing."""
    num_seqs = validate.u32(num_seqs, f"{ROLLBACK} num_seqs")
    max_seqs = validate.u32(max_seqs, f"{ROLLBACK} max_seqs")
    if num_seqs > max_seqs:
        raise ValueError(f"{ROLLBACK}: num_seqs {num_seqs} over max_seqs {max_seqs}")
    if num_seqs == 0:
        return
    NGRAM_DECODE_ROLLBACK.launch(gpu, kernel, (-(-num_seqs // 256), 1, 1), _BLOCK, stream,
                                 slots=slots, counts=counts, state=state, ctrl=ctrl,
                                 num_seqs=num_seqs, max_seqs=max_seqs, max_draft=max_draft)
