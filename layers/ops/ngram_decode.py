"""Launchers of ``kernels/ngram_decode.cu``: the device-resident n-gram decoder's gather (with its
history update), its one-kernel step (gather and projection together, for a few rows),
history-only seed, fork and rollback. Arguments in the kernels' positional order.

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
from typing import Any

from gpu_runtime import GpuBackend, KernelHandle, validate

from .gemm_plan import SMALL_COLS, small_smem
from .ngram_fused import NO_TOKEN, check_tables
from .specs import (
    NGRAM_DECODE_FORK,
    NGRAM_DECODE_GATHER,
    NGRAM_DECODE_ROLLBACK,
    NGRAM_DECODE_SEED,
    NGRAM_DECODE_STEP,
)

MODULE = "ngram_decode"
GATHER = "ngram_decode_gather"
STEP = "ngram_decode_step"
SEED = "ngram_decode_seed"
FORK = "ngram_decode_fork"
ROLLBACK = "ngram_decode_rollback"
STEP_MAX_ROWS = 8  # ngram_decode_step's rows per call (ngram_decode.cu: kStepMaxRows)
STEP_MAX_SMEM = 232448  # the dynamic shared memory an H100 / H200 block may opt in to
PAD_SLOT = 0xFFFFFFFF  # a padded batch entry: zero rows, no history read or written, no flag
NO_ADAPTER = 0xFFFFFFFF  # a sequence served by the base word table


class DecodeError(enum.IntFlag):
    """What ``NgramDecoder.check_errors`` found since the last check (``ctrl[0]`` of the kernels)."""

    NONE = 0
    TOKEN = 1  # a token >= vocab: its row was zeroed, it ends later look-backs
    SLOT = 2  # a slot >= max_seqs: that sequence's rows were zeroed, no history touched
    SEQLENS = 4  # cu_seqlens not 0 <= ... <= num_tokens, non-decreasing: rows left out zeroed
    ROLLBACK = 8  # a rollback count deeper than the history (over max_draft): slot unchanged
    ADAPTER = 16  # an adapter index >= the adapter slots (not NO_ADAPTER): its rows zeroed
    LAUNCH = 32  # ngram_decode_step launched with a shape it cannot run (a launcher bug): nothing written


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

_BLOCK = (256, 1, 1)  # 8 warps, one (row, table) pair (or sequence, or fork pair) each
_PAIRS_PER_BLOCK = 256 // 32
_MAX_BLOCKS = 4 * 132 * 8  # pairs are grid-strided past this


def _check_call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The checks of a gather call's arguments (by name, as the launcher received them), shared by
    ``ngram_decode_gather`` and ``ngram_decode_step``; returns them checked, the table arguments
    under the kernels' names."""
    checked = {
        what: validate.u32(args[what], f"{name} {what}")
        for what in ("rows", "num_seqs", "per_seq", "max_seqs", "hist_len", "vocab")
    }
    num_tables, max_ngram, splits, td, eos = check_tables(
        name, args["num_tables"], args["max_ngram"], args["splits"], args["table_dim"], args["eos"]
    )
    rows, num_seqs, max_seqs, hist_len = (checked[w] for w in ("rows", "num_seqs", "max_seqs", "hist_len"))
    if max_seqs < 1 or hist_len < max_ngram - 1 or hist_len < 1:
        raise ValueError(
            f"{name}: max_seqs must be >= 1 and hist_len >= max(1, max_ngram - 1); got {max_seqs}, {hist_len}"
        )
    if not 1 <= checked["vocab"] < NO_TOKEN:
        raise ValueError(f"{name}: vocab must be in 1..2**32-2, got {checked['vocab']}")
    if num_seqs > max_seqs:
        raise ValueError(f"{name}: num_seqs {num_seqs} over max_seqs {max_seqs}")
    if not args["cu_seqlens"] and rows != num_seqs * checked["per_seq"]:
        raise ValueError(f"{name}: rows {rows} != num_seqs {num_seqs} * per_seq {checked['per_seq']}")
    if rows and num_seqs == 0:
        raise ValueError(f"{name}: {rows} rows in no sequence")
    adapters: AdapterTables = args["adapters"]
    if adapters.index and not (adapters.maps and adapters.rows and adapters.counts and adapters.word_over):
        raise ValueError(f"{name}: adapter indices need every adapter table and word_over")
    tables = {"num_tables": num_tables, "max_ngram": max_ngram, "splits": splits, "td": td, "eos": eos}
    return {**args, **checked, **tables, **adapters.kernel_args()}


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
) -> None:
    """Gather every table's row of ``rows`` tokens (ragged by ``cu_seqlens [num_seqs + 1]``, or
    ``per_seq`` each when ``cu_seqlens`` is 0) into ``out [rows, T*td]``, their word ids into
    ``word_ids [rows]`` (and, with ``adapters``, their replacement word rows into its
    ``word_over``), then append each sequence's tokens to the history of ``slots[s]``.
    ``rows == 0`` launches nothing."""
    args = _check_call(GATHER, locals())
    rows, num_tables = args["rows"], args["num_tables"]
    if rows:
        grid = (min(-(-rows * (num_tables + 1) // _PAIRS_PER_BLOCK), _MAX_BLOCKS), 1, 1)  # + the word pairs
        NGRAM_DECODE_GATHER.launch_from(gpu, kernel, grid, _BLOCK, stream, args)


def step_smem(rows: int, num_tables: int, table_dim: int) -> int:
    """``ngram_decode_step``'s dynamic shared memory: the small path's ring, then the gathered rows."""
    return small_smem(rows) + 2 * rows * num_tables * table_dim


def step_fits(rows: int, num_tables: int, table_dim: int) -> bool:
    """Whether ``ngram_decode_step`` runs a call of ``rows`` rows: 1..STEP_MAX_ROWS rows, td % 8 ==
    0, and its shared memory (``step_smem``) within STEP_MAX_SMEM. The caller also makes sure the
    word GEMM would run the small path (the sums the kernel reproduces) on a device with the
    shared memory (sm_90: ``NgramDecoder.one_kernel``)."""
    return 1 <= rows <= STEP_MAX_ROWS and table_dim % 8 == 0 and step_smem(rows, num_tables, table_dim) <= STEP_MAX_SMEM


def ngram_decode_step(
    gpu: GpuBackend,
    kernel: KernelHandle,
    tokens: int,
    cu_seqlens: int,
    slots: int,
    hist: int,
    state: int,
    tables: int,
    pows: int,
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
    proj: int,
    word: int,
    out: int,
    scale: float,
    hidden: int,
    stream: int,
    adapters: AdapterTables = NO_ADAPTERS,
) -> None:
    """``ngram_decode_gather`` and the word GEMM in one kernel (its rows and histories as the
    gather's): ``out [rows, hidden] = bf16((gathered rows @ proj^T + word row) * scale)``, proj
    the concatenated projections ``[hidden, T*td]`` bf16, word the word table ``[vocab, hidden]``
    (or, with ``adapters``, a row's replacement row): the small path's bits. Only where
    ``step_fits``: anything else is a ``ValueError`` here. A programmatic dependent launch: it
    streams proj while the kernel before runs and waits for it before reading the tokens.
    ``rows == 0`` launches nothing."""
    args = _check_call(STEP, locals())
    rows = args["rows"]
    if rows == 0:
        return
    hidden = validate.count(hidden, f"{STEP} hidden", limit=1 << 32)
    if adapters.index and adapters.hidden != hidden:
        raise ValueError(f"{STEP}: adapter rows {adapters.hidden} wide, the output {hidden}")
    scale = validate.real32(scale, f"{STEP} scale")
    tables, td = args["num_tables"], args["td"]
    if not step_fits(rows, tables, td):
        raise ValueError(
            f"{STEP}: {rows} rows of {tables} x {td} do not fit the one-kernel step (1..{STEP_MAX_ROWS} rows, "
            f"td % 8 == 0, shared memory {step_smem(rows, tables, td)} <= {STEP_MAX_SMEM})"
        )
    args.update(hidden=hidden, scale=scale)
    grid = (-(-hidden // SMALL_COLS), 1, 1)
    smem = step_smem(rows, tables, td)
    NGRAM_DECODE_STEP.launch_from(gpu, kernel, grid, _BLOCK, stream, args, shared_mem=smem, overlap=True)


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
