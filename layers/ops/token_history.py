"""``HistoryLaunches``: ``kernels/token_history.cu``'s seed, fork and rollback planned over one
decoder's histories, the kernels every decoder shares (its own gather reads the histories and
appends its calls' tokens: ``kernels/token_history.cuh`` has the state and its rules).

Device state (the decoder owns it: ``layers.token_history.SlotHistories``): ``hist [max_seqs,
hist_len]`` u32 entry ring per slot, ``state [max_seqs, 2]`` u32 (pos, hi) per slot, ``ctrl [2]``
u32 (error flags, ``DecodeError``, and a gather's block counter; both zero between launches).
An entry is a token's code: the token itself, or ``map[token]`` (``TokenCode``), or ``NO_TOKEN``
for a token >= vocab or a non-text position. Values that only the device sees are checked by
the kernels, which flag ``ctrl[0]`` instead of reading or writing out of bounds; a slot of
``PAD_SLOT`` is a padded batch entry (no history, no flag).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from gpu_runtime import GpuBackend, LaunchConfig, validate

from ..kernel_files import load_kernel

MODULE = "token_history"
SEED = "token_history_seed"
FORK = "token_history_fork"
ROLLBACK = "token_history_rollback"
PAD_SLOT = 0xFFFFFFFF  # a padded batch entry: zero rows, no history read or written, no flag
NO_TOKEN = 0xFFFFFFFF  # a history entry no look-back reads past (and TokenCode's "no dead token")


class DecodeError(enum.IntFlag):
    """What a decoder's ``check_errors`` found since the last check (``ctrl[0]`` of the kernels)."""

    NONE = 0
    TOKEN = 1  # a token >= vocab: its row was zeroed, it ends later look-backs
    SLOT = 2  # a slot >= max_seqs: that sequence's rows were zeroed, no history touched
    SEQLENS = 4  # cu_seqlens not 0 <= ... <= num_tokens, non-decreasing: rows left out zeroed
    ROLLBACK = 8  # a rollback past max_draft below the slot's highest position: slot unchanged
    ADAPTER = 16  # (NgramDecoder) an adapter index >= the adapter slots, not NO_ADAPTER: rows zeroed
    STAGING = 32  # (EngramDecoder, host tables) rows read before the host staged them: rows zeroed


@dataclass(frozen=True)
class TokenCode:
    """What a history holds for a call's token t (``kernels/token_history.cuh``): ``NO_TOKEN`` for
    t >= ``vocab``, or for a non-text position (where a call passes a text mask: its 0 rows;
    without one: t == ``dead``); else ``map[t]`` (``map``: a device int32 ``[vocab]`` address) or
    t itself (``map`` 0). The n-gram embedding: no map, ``dead`` ``NO_TOKEN``."""

    map: int
    vocab: int
    dead: int = NO_TOKEN


_THREADS = 256  # 8 warps, one sequence (or fork pair) each


@functools.cache
def _config(blocks: int) -> LaunchConfig:
    return LaunchConfig(blocks, _THREADS)


class HistoryLaunches:
    """The three kernels over one decoder's ``hist``, ``state`` and ``ctrl`` (``max_seqs`` slots
    of ``hist_len`` entries, rollbacks at most ``max_draft`` deep) and its ``code``. The calls
    trust their arguments: the decoder checks them first."""

    def __init__(
        self,
        gpu: GpuBackend,
        hist: int,
        state: int,
        ctrl: int,
        *,
        max_seqs: int,
        hist_len: int,
        max_draft: int,
        code: TokenCode,
    ) -> None:
        self.seed_kernel, self.fork_kernel, self.rollback_kernel = (
            gpu.bind(load_kernel(gpu, MODULE, name)) for name in (SEED, FORK, ROLLBACK)
        )
        hist, state = validate.pointer(hist, f"{MODULE} hist"), validate.pointer(state, f"{MODULE} state")
        self.ctrl = validate.pointer(ctrl, f"{MODULE} ctrl")
        max_seqs, hist_len = validate.u32(max_seqs, f"{MODULE} max_seqs"), validate.u32(hist_len, f"{MODULE} hist_len")
        self.max_draft = validate.u32(max_draft, f"{MODULE} max_draft")
        if max_seqs < 1 or hist_len < 1:
            raise ValueError(f"{MODULE}: max_seqs and hist_len must be >= 1; got {max_seqs}, {hist_len}")
        vocab = validate.u32(code.vocab, f"{MODULE} vocab")
        if not 1 <= vocab < NO_TOKEN:
            raise ValueError(f"{MODULE}: vocab must be in 1..2**32-2, got {vocab}")
        self.code = code
        self.hist, self.state, self.max_seqs, self.hist_len = hist, state, max_seqs, hist_len
        self._history = (hist, state, self.ctrl)

    def seed(
        self, tokens: int, cu_seqlens: int, slots: int, rows: int, num_seqs: int, stream: int, text: int = 0
    ) -> None:
        """Append each of ``num_seqs >= 1`` sequences' tokens (ragged by ``cu_seqlens [num_seqs +
        1]`` over ``rows`` tokens; ``text``: a u8 ``[rows]`` text mask or 0) to the history of
        ``slots[s]`` without embedding them."""
        config = _config(-(-num_seqs // (_THREADS // 32)))
        code = self.code
        args = (*self._history, rows, num_seqs, self.max_seqs, self.hist_len, code.vocab, code.dead)
        self.seed_kernel.launch(config, stream, tokens, cu_seqlens, slots, code.map, text, *args)

    def fork(self, src_slots: int, dst_slots: int, num: int, stream: int) -> None:
        """Copy slot ``src_slots[p]``'s history and position to slot ``dst_slots[p]``, ``p < num``
        (``num >= 1``)."""
        config = _config(-(-num // (_THREADS // 32)))
        self.fork_kernel.launch(config, stream, src_slots, dst_slots, *self._history, num, self.max_seqs, self.hist_len)

    def rollback(self, slots: int, counts: int, num_seqs: int, stream: int) -> None:
        """Drop the last ``counts[s]`` tokens of slot ``slots[s]``'s history, ``s < num_seqs``
        (``>= 1``); a count deeper than ``max_draft`` allows flags ``ctrl[0]`` and leaves that
        slot as it was."""
        args = (num_seqs, self.max_seqs, self.max_draft)
        self.rollback_kernel.launch(
            _config(-(-num_seqs // _THREADS)), stream, slots, counts, self.state, self.ctrl, *args
        )
