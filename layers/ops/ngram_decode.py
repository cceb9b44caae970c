"""Launchers of ``kernels/ngram_decode.cu``: the device-resident n-gram decoder's gather (with its
history update), history-only seed, fork and rollback. Arguments in the kernels' positional order.

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
from dataclasses import dataclass

from gpu_runtime import GpuBackend, KernelHandle, validate

from .ngram_fused import NO_TOKEN, check_tables, pair_launch
from .specs import NGRAM_DECODE_FORK, NGRAM_DECODE_GATHER, NGRAM_DECODE_ROLLBACK, NGRAM_DECODE_SEED

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

    def kernel_args(self) -> dict[str, int]:
        """The gather kernel's adapter parameters, by name."""
        return {
            "adapters": self.index,
            "adapter_maps": self.maps,
            "adapter_rows": self.rows,
            "adapter_counts": self.counts,
            "num_adapters": self.num,
            "hidden": self.hidden,
            "word_over": self.word_over,
        }


NO_ADAPTERS = AdapterTables(0, 0, 0, 0, 0, 0, 0)

_BLOCK = (256, 1, 1)  # 8 warps, one sequence (or fork pair) each; the gather's: pair_launch
_PAIRS_PER_BLOCK = 256 // 32


def ngram_decode_gather(
    gpu: GpuBackend,
    kernel: KernelHandle,
    tokens: int,
    cu_seqlens: int,
    slots: int,
    hist: int,
    state: int,
    tables: int,
    pows: int,
    out: int,
    word_ids: int,
    ctrl: int,
    rows: int,
    num_seqs: int,
    per_seq: int,
    max_seqs: int,
    hist_len: int,
    vocab: int,
    num_tables: int,
    max_ngram: int,
    splits: int,
    table_dim: int,
    eos: int | None,
    stream: int,
    adapters: AdapterTables = NO_ADAPTERS,
    host_tables: bool = False,
) -> None:
    """Gather every table's row of ``rows`` tokens (ragged by ``cu_seqlens [num_seqs + 1]``, or
    ``per_seq`` each when ``cu_seqlens`` is 0) into ``out [rows, T*td]``, their word ids into
    ``word_ids [rows]`` (and, with ``adapters``, their replacement word rows into its
    ``word_over``), then append each sequence's tokens to the history of ``slots[s]``.
    ``host_tables``: some table is in host memory (the launch's shape, ``pair_launch``).
    ``rows == 0`` launches nothing."""
    rows = validate.u32(rows, f"{GATHER} rows")
    host_tables = validate.boolean(host_tables, f"{GATHER} host_tables")
    num_seqs = validate.u32(num_seqs, f"{GATHER} num_seqs")
    per_seq = validate.u32(per_seq, f"{GATHER} per_seq")
    max_seqs = validate.u32(max_seqs, f"{GATHER} max_seqs")
    hist_len = validate.u32(hist_len, f"{GATHER} hist_len")
    vocab = validate.u32(vocab, f"{GATHER} vocab")
    num_tables, max_ngram, splits, table_dim, eos = check_tables(GATHER, num_tables, max_ngram, splits, table_dim, eos)
    if max_seqs < 1 or hist_len < max_ngram - 1 or hist_len < 1:
        raise ValueError(
            f"{GATHER}: max_seqs must be >= 1 and hist_len >= max(1, max_ngram - 1); got {max_seqs}, {hist_len}"
        )
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
    grid, shared = pair_launch(gpu, rows * (num_tables + 1), host_tables)  # + the word pairs
    args = dict(locals(), td=table_dim, **adapters.kernel_args())
    NGRAM_DECODE_GATHER.launch_from(gpu, kernel, grid, _BLOCK, stream, args, shared_mem=shared)


def ngram_decode_seed(
    gpu: GpuBackend,
    kernel: KernelHandle,
    tokens: int,
    cu_seqlens: int,
    slots: int,
    hist: int,
    state: int,
    ctrl: int,
    rows: int,
    num_seqs: int,
    max_seqs: int,
    hist_len: int,
    vocab: int,
    stream: int,
) -> None:
    """Append each sequence's tokens (ragged by ``cu_seqlens [num_seqs + 1]`` over ``rows``
    tokens) to the history of ``slots[s]`` without embedding them. ``num_seqs == 0`` launches
    nothing."""
    rows = validate.u32(rows, f"{SEED} rows")
    num_seqs = validate.u32(num_seqs, f"{SEED} num_seqs")
    max_seqs = validate.u32(max_seqs, f"{SEED} max_seqs")
    hist_len = validate.u32(hist_len, f"{SEED} hist_len")
    vocab = validate.u32(vocab, f"{SEED} vocab")
    if num_seqs > max_seqs:
        raise ValueError(f"{SEED}: num_seqs {num_seqs} over max_seqs {max_seqs}")
    if rows and not num_seqs:
        raise ValueError(f"{SEED}: {rows} tokens in no sequence")
    if num_seqs == 0:
        return
    NGRAM_DECODE_SEED.launch_from(gpu, kernel, (-(-num_seqs // _PAIRS_PER_BLOCK), 1, 1), _BLOCK, stream, locals())


def ngram_decode_fork(
    gpu: GpuBackend,
    kernel: KernelHandle,
    src_slots: int,
    dst_slots: int,
    hist: int,
    state: int,
    ctrl: int,
    num: int,
    max_seqs: int,
    hist_len: int,
    stream: int,
) -> None:
    """Copy slot ``src_slots[p]``'s history and position to slot ``dst_slots[p]``, ``p < num``.
    ``num == 0`` launches nothing."""
    num = validate.u32(num, f"{FORK} num")
    max_seqs = validate.u32(max_seqs, f"{FORK} max_seqs")
    hist_len = validate.u32(hist_len, f"{FORK} hist_len")
    if num == 0:
        return
    NGRAM_DECODE_FORK.launch_from(gpu, kernel, (-(-num // _PAIRS_PER_BLOCK), 1, 1), _BLOCK, stream, locals())


def ngram_decode_rollback(
    gpu: GpuBackend,
    kernel: KernelHandle,
    slots: int,
    counts: int,
    state: int,
    ctrl: int,
    num_seqs: int,
    max_seqs: int,
    max_draft: int,
    stream: int,
) -> None:
    """Drop the last ``counts[s]`` tokens of slot ``slots[s]``'s history, ``s < num_seqs``; a
    count deeper than ``max_draft`` allows flags ``ctrl[0]`` and leaves that slot as it was.
    ``num_seqs == 0`` launches nothing."""
    num_seqs = validate.u32(num_seqs, f"{ROLLBACK} num_seqs")
    max_seqs = validate.u32(max_seqs, f"{ROLLBACK} max_seqs")
    if num_seqs > max_seqs:
        raise ValueError(f"{ROLLBACK}: num_seqs {num_seqs} over max_seqs {max_seqs}")
    if num_seqs == 0:
        return
    NGRAM_DECODE_ROLLBACK.launch_from(gpu, kernel, (-(-num_seqs // 256), 1, 1), _BLOCK, stream, locals())
