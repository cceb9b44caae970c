"""``SlotHistories``: the per-slot token histories a decoder keeps on the device
(``kernels/token_history.cuh``), with what a decoder does to them off its kernels' hot path.

It owns ``hist [max_seqs, hist_len]`` (u32 entries), ``state [max_seqs, 2]`` (pos, hi) and
``ctrl [2]`` (the error word and a gather's block counter) in the decoder's ``Resources``, zeroed
(every entry ``NO_TOKEN``) at construction. ``reset`` / ``reset_all`` are memsets (capturable);
``check_errors`` and ``entries`` copy to the host and wait, so keep them out of a step loop.
"""

from __future__ import annotations

import numpy as np

from gpu_runtime import GpuBackend, validate

from .ops.token_history import DecodeError
from .resources import Resources


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
