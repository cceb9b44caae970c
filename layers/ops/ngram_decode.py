"""Launchers of ``kernels/ngram_decode.cu``: the device-resident n-gram decoder's gather (with its
history update) and rollback. Arguments in the kernels' positional order.

Device state (``layers/ngram_embed/decoder.py`` owns it): ``hist [max_seqs, hist_len]`` u32 token
ring per slot, ``state [max_seqs, 2]`` u32 (pos, hi) per slot, ``ctrl [2]`` u32 (error flags, the
gather's block counter; both zero between launches). Values that only the device sees (tokens,
slots, cu_seqlens, counts) are checked by the kernels, which flag ``ctrl[0]`` instead of reading
or writing out of bounds.
"""

from __future__ import annotations

from gpu_runtime import GpuBackend, KernelHandle, KernelLaunch

from .checks import require_count, require_ptr
from .ngram_fused import NO_TOKEN, eos_arg

MODULE = "ngram_decode"
GATHER = "ngram_decode_gather"
ROLLBACK = "ngram_decode_rollback"

_BLOCK = 256  # 8 warps, one (row, table) pair each
_PAIRS_PER_BLOCK = _BLOCK // 32
_MAX_BLOCKS = 4 * 132 * 8  # pairs are grid-strided past this


def ngram_decode_gather(gpu: GpuBackend, kernel: KernelHandle, tokens: int, cu_seqlens: int,
                        slots: int, hist: int, state: int, tables: int, pows: int, out: int,
                        word_ids: int, ctrl: int, rows: int, num_seqs: int, per_seq: int,
                        max_seqs: int, hist_len: int, vocab: int, num_tables: int, max_ngram: int,
                        splits: int, table_dim: int, eos: int | None, stream: int) -> None:
    """Gather every table's row of ``rows`` tokens (ragged by ``cu_seqlens [num_seqs + 1]``, or
    ``per_seq`` each when ``cu_seqlens`` is 0) into ``out [rows, T*td]``, their word ids into
    ``word_ids [rows]``, then append each sequence's tokens to the history of ``slots[s]``."""
    rows, num_seqs = require_count(rows, "rows"), require_count(num_seqs, "num_seqs")
    per_seq, max_seqs = require_count(per_seq, "per_seq"), require_count(max_seqs, "max_seqs")
    hist_len, vocab = require_count(hist_len, "hist_len"), require_count(vocab, "vocab")
    num_tables, max_ngram = require_count(num_tables, "num_tables"), require_count(max_ngram, "max_ngram")
    splits, table_dim = require_count(splits, "splits"), require_count(table_dim, "table_dim")
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
    for ptr, what in ((tokens, "tokens"), (slots, "slots"), (hist, "hist"), (state, "state"),
                      (tables, "tables"), (pows, "pows"), (out, "out"), (word_ids, "word_ids"),
                      (ctrl, "ctrl")):
        require_ptr(ptr, f"{GATHER} {what}")
    if rows == 0:
        return
    if num_seqs == 0:
        raise ValueError(f"{GATHER}: {rows} rows in no sequence")
    blocks = min(-(-rows * num_tables // _PAIRS_PER_BLOCK), _MAX_BLOCKS)
    (KernelLaunch(gpu, kernel).grid([blocks, 1, 1]).block([_BLOCK, 1, 1])
     .arg_ptr(tokens).arg_ptr(cu_seqlens).arg_ptr(slots).arg_ptr(hist).arg_ptr(state)
     .arg_ptr(tables).arg_ptr(pows).arg_ptr(out).arg_ptr(word_ids).arg_ptr(ctrl)
     .arg_u32(rows).arg_u32(num_seqs).arg_u32(per_seq).arg_u32(max_seqs).arg_u32(hist_len)
     .arg_u32(vocab).arg_u32(num_tables).arg_u32(max_ngram).arg_u32(splits).arg_u32(table_dim)
     .arg_u32(eos_word).launch(stream))


def ngram_decode_rollback(gpu: GpuBackend, kernel: KernelHandle, slots: int, counts: int,
                          state: int, ctrl: int, num_seqs: int, max_seqs: int, max_draft: int,
                          stream: int) -> None:
    """Drop the last ``counts[s]`` tokens of slot ``slots[s]``'s history, ``s < num_seqs``; a
    count deeper than ``max_draft`` allows flags ``ctrl[0]`` and leaves that slot as it was."""
    num_seqs, max_seqs = require_count(num_seqs, "num_seqs"), require_count(max_seqs, "max_seqs")
    max_draft = require_count(max_draft, "max_draft")
    if num_seqs > max_seqs:
        raise ValueError(f"{ROLLBACK}: num_seqs {num_seqs} over max_seqs {max_seqs}")
    for ptr, what in ((slots, "slots"), (counts, "counts"), (state, "state"), (ctrl, "ctrl")):
        require_ptr(ptr, f"{ROLLBACK} {what}")
    if num_seqs == 0:
        return
    (KernelLaunch(gpu, kernel).grid([-(-num_seqs // _BLOCK), 1, 1]).block([_BLOCK, 1, 1])
     .arg_ptr(slots).arg_ptr(counts).arg_ptr(state).arg_ptr(ctrl).arg_u32(num_seqs)
     .arg_u32(max_seqs).arg_u32(max_draft).launch(stream))
