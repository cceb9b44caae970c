"""``SlotHistories``: the per-slot token histories a decoder keeps on the device
(``kernels/token_history.cuh``), with what a decoder does to them off its kernels' hot path.

It owns ``hist [max_seqs, hist_len]`` (u32 entries), ``state [max_seqs, 2]`` (pos, hi) and
``ctrl [2]`` (the error word and a gather's block counter) in the decoder's ``Resources``, zeroed
(every entry ``NO_TOKEN``) at construction. ``reset`` / ``reset_all`` are memsets (capturable);
``check_errors`` and ``entries`` copy to the host and wait, so keep them out of a step loop.
``HistoryCalls``: the calls on them every such decoder shares (``NgramDecoder``, ``EngramDecoder``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu_runtime import DevicePtr, GpuBackend, interop, validate

from .ops.token_history import DecodeError, HistoryLaunches
from .resources import Closing, Resources


class SlotHistories:
    """``max_seqs`` slots of ``back + max_draft`` entries (at least 1): ``back`` entries a call
    looks back on (N - 1 for n-grams of N tokens), ``max_draft`` a rollback may drop. ``what``
    names the decoder in messages; ``stream`` the decoder's (the memsets run there, then wait)."""

    def __init__(
        self, gpu: GpuBackend, own: Resources, *, max_seqs: int, back: int, max_draft: int, stream: int, what: str
    ) -> None:
        self.gpu, self.what, self.stream = gpu, what, stream
        self.max_seqs, self.back = max_seqs, back
        self.hist_len = max(back + max_draft, 1)
        self.hist = own.alloc(max_seqs * self.hist_len * 4)
        self.state = own.alloc(max_seqs * 2 * 4)
        self.ctrl = own.alloc(2 * 4)
        gpu.memset(self.hist, 0xFF, max_seqs * self.hist_len * 4, stream)
        gpu.memset(self.state, 0, max_seqs * 2 * 4, stream)
        gpu.memset(self.ctrl, 0, 2 * 4, stream)
        gpu.synchronize(stream)  # ready for a first call on any stream (a created one does not wait)

    def reset(self, slot: int, stream: int) -> None:
        """Empty slot ``slot``'s history (a new request); ``stream`` checked by the caller."""
        slot = validate.count(slot, f"{self.what}.reset: slot", limit=self.max_seqs)
        self.gpu.memset(self.state.offset(slot * 8), 0, 8, stream)

    def reset_all(self, stream: int) -> None:
        """Empty every slot's history."""
        self.gpu.memset(self.state, 0, self.max_seqs * 8, stream)

    def check_errors(self, stream: int) -> DecodeError:
        """The flags raised since the last check, then cleared; waits for ``stream``."""
        word = np.zeros(1, np.uint32)
        self.gpu.copy_d2h(word, self.ctrl, stream)
        if word[0]:
            self.gpu.memset(self.ctrl, 0, 4, stream)
        return DecodeError(int(word[0]))

    def entries(self, slot: int, stream: int) -> np.ndarray:
        """The entries slot ``slot`` looks back on: its last ``min(pos, back)``, oldest first
        (``NO_TOKEN`` for a bad or non-text one); waits for ``stream``."""
        slot = validate.count(slot, f"{self.what}.history: slot", limit=self.max_seqs)
        state = np.zeros(2, np.uint32)
        ring = np.zeros(self.hist_len, np.uint32)
        self.gpu.copy_d2h(state, self.state.offset(slot * 8), stream)
        self.gpu.copy_d2h(ring, self.hist.offset(slot * self.hist_len * 4), stream)
        pos = int(state[0])
        return ring[[q % self.hist_len for q in range(pos - min(pos, self.back), pos)]]


class HistoryCalls(Closing):
    """The calls of a decoder whose slots keep histories, which every such decoder shares:
    ``fork``, ``rollback``, ``reset``, ``reset_all`` (capturable: launches or memsets only),
    ``check_errors`` and ``history`` (off the hot path), and the checks of a call's sizes and
    device buffers. A decoder sets ``gpu``, ``stream``, ``max_seqs``, ``max_rows``,
    ``histories`` (``SlotHistories``), ``launches`` (a ``HistoryLaunches``) and ``_resources``,
    and names itself in ``WHAT``; ``_open`` raises ``ClosedError`` for anything closed it uses."""

    WHAT = "decoder"
    gpu: GpuBackend
    stream: int
    max_seqs: int
    max_rows: int
    histories: SlotHistories
    launches: HistoryLaunches
    _resources: Resources

    def fork(self, src_slots: Any, dst_slots: Any, num: int, stream: int = 0) -> None:
        """Slot ``dst_slots[p]`` becomes a copy of slot ``src_slots[p]`` (its history and
        position, so drafts roll back alike), ``p < num``: parallel samples, beam search; a fork's
        first tokens keep their predecessors' n-grams. One launch. A pair with a ``PAD_SLOT`` is
        skipped; a bad slot is flagged (``SLOT``) and its pair skipped. A destination that is also
        a source or destination of another pair of the same call races (in bounds, result
        unspecified)."""
        num = validate.u32(num, f"{self.WHAT}.fork: num")
        src = self._index(src_slots, num, "src_slots")
        dst = self._index(dst_slots, num, "dst_slots")
        stream = self._ready(stream)
        if num:
            self.launches.fork(src, dst, num, stream)

    def rollback(self, slots: Any, counts: Any, num_seqs: int, stream: int = 0) -> None:
        """Drop the last ``counts[s]`` tokens (u32, on the device) of slot ``slots[s]``'s history;
        down to at most ``max_draft`` below the highest position the slot has held: always the
        last call's tokens, further only within that bound (deeper: ``DecodeError.ROLLBACK``,
        the slot untouched). A ``PAD_SLOT`` entry is skipped."""
        num_seqs, _ = self._sizes(num_seqs, 0)
        slots = self._index(slots, num_seqs, "slots")
        counts = self._index(counts, num_seqs, "counts")
        stream = self._ready(stream)
        if num_seqs:
            self.launches.rollback(slots, counts, num_seqs, stream)

    def reset(self, slot: int, stream: int = 0) -> None:
        """Empty slot ``slot``'s history (a new request); a memset, so capturable too."""
        self.histories.reset(slot, self._ready(stream))

    def reset_all(self, stream: int = 0) -> None:
        """Empty every slot's history (a memset on ``stream``, capturable too)."""
        self.histories.reset_all(self._ready(stream))

    def check_errors(self, stream: int | None = None) -> DecodeError:
        """The flags raised by every call since the last check, then cleared. Waits for
        ``stream`` (default: the construction stream), so keep it out of the step loop."""
        return self.histories.check_errors(self._host_stream(stream))

    def history(self, slot: int, stream: int | None = None) -> np.ndarray:
        """The entries slot ``slot`` looks back on (its last ``min(pos, N - 1)``, oldest first;
        a bad or non-text token is kept as 0xFFFFFFFF); waits for ``stream``. For tests and
        debugging."""
        return self.histories.entries(slot, self._host_stream(stream))

    @property
    def hist(self) -> DevicePtr:
        """The histories' entries (``SlotHistories.hist``)."""
        return self.histories.hist

    @property
    def state(self) -> DevicePtr:
        """The slots' (pos, hi) pairs (``SlotHistories.state``)."""
        return self.histories.state

    @property
    def ctrl(self) -> DevicePtr:
        """The error word and the gather's block counter (``SlotHistories.ctrl``)."""
        return self.histories.ctrl

    @property
    def hist_len(self) -> int:
        """Entries a slot keeps: ``N - 1 + max_draft`` (at least 1)."""
        return self.histories.hist_len

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: every call then raises ``ClosedError``."""
        return self._resources.closed

    def close(self) -> None:
        """Free the histories and the decoder's buffers (not its weights); once."""
        self._resources.close()

    # -- checks ---------------------------------------------------------------------------------
    def _open(self) -> None:
        validate.require_open(self.closed, self.WHAT)

    def _ready(self, stream: int) -> int:
        """``stream``, checked, once the decoder (and what it uses) are known to be open."""
        self._open()
        return validate.stream(stream, f"{self.WHAT}: stream")

    def _host_stream(self, stream: int | None) -> int:
        self._open()
        return validate.stream(self.stream if stream is None else stream, f"{self.WHAT}: stream")

    def _sizes(self, num_seqs: int, rows: int, *, limit_rows: bool = True) -> tuple[int, int]:
        num_seqs = validate.u32(num_seqs, f"{self.WHAT}: num_seqs")
        rows = validate.u32(rows, f"{self.WHAT}: num_tokens")
        if num_seqs > self.max_seqs:
            raise ValueError(f"{self.WHAT}: num_seqs {num_seqs} over max_seqs {self.max_seqs}")
        if limit_rows and rows > self.max_rows:
            raise ValueError(f"{self.WHAT}: {rows} rows over max_rows {self.max_rows}")
        if rows and not num_seqs:
            raise ValueError(f"{self.WHAT}: {rows} tokens in no sequence")
        return num_seqs, rows

    def _index(self, buf: Any, count: int, what: str) -> int:
        """The address of a u32 (or int32) device buffer of at least ``count`` entries
        (``gpu_runtime.interop``: an address, a ``DeviceArray``, or a foreign array)."""
        return interop.device_address(buf, f"{self.WHAT} {what}", dtypes=interop.INDEX, count=count, gpu=self.gpu)

    def _ragged(self, tokens: Any, cu_seqlens: Any, slots: Any, num_seqs: int, num_tokens: int) -> tuple[int, int, int]:
        """The addresses of a ragged batch's ``tokens``, ``cu_seqlens`` and ``slots``."""
        return (
            self._index(tokens, num_tokens, "tokens"),
            self._index(cu_seqlens, num_seqs + 1, "cu_seqlens"),
            self._index(slots, num_seqs, "slots"),
        )
