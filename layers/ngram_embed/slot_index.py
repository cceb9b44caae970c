"""``SlotIndex``: which table row sits in which slot of a fixed-size device arena.

Pure host bookkeeping for ``RowCache``, in numpy arrays so a lookup or an eviction costs a few
vectorised operations whatever the table size: ``slot_of`` (4 bytes per table row, about 1% of
a 512-byte-row table) maps id -> slot, ``id_of`` maps back. Eviction is CLOCK (second chance)
and never picks a slot that is *pinned* (read by the current batch); the hand sweeps windows of
the arena, so its cost follows the number of rows evicted, not the arena's size.
"""

from __future__ import annotations

import numpy as np

_MIN_WINDOW = 256


class SlotIndex:
    def __init__(self, rows: int, capacity: int) -> None:
        if not 1 <= capacity < 2**31:
            raise ValueError(f"capacity must be in 1..2**31-1, got {capacity}")
        self.rows, self.capacity = rows, capacity
        self.slot_of = np.full(rows, -1, np.int32)
        self.id_of = np.full(capacity, -1, np.int64)
        self.ref = np.zeros(capacity, bool)  # CLOCK's "used since the hand last passed"
        self.pinned = np.zeros(capacity, bool)
        self.free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # never-used slots, a stack
        self.n_free = capacity
        self.n_pinned = 0
        self._pinned_now: list[np.ndarray | int] = []  # so unpinning costs the batch, not the arena
        self.hand = 0
        self.evictions = 0

    def evictable(self) -> int:
        """Slots that ``assign`` may hand out now (free or holding an unpinned, loaded row)."""
        return self.capacity - self.n_pinned

    def assign(self, ids: np.ndarray) -> np.ndarray:
        """Slots for ``ids`` (distinct, none resident); evicts as needed. The caller has
        checked ``len(ids) <= evictable()``."""
        need = len(ids)
        if need > self.evictable():
            raise RuntimeError(f"assign of {need} slots, {self.evictable()} evictable")
        take = min(need, self.n_free)
        parts = [self.free[self.n_free - take:self.n_free]]
        self.n_free -= take
        if need > take:
            parts.append(self._sweep(need - take))
        slots = np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
        self.slot_of[ids] = slots
        self.id_of[slots] = ids
        self.ref[slots] = True
        return slots

    def _sweep(self, need: int) -> np.ndarray:
        """CLOCK: from the hand on, take unreferenced evictable slots and clear the bit of the
        referenced ones passed over. Two revolutions always suffice (the first clears every bit)."""
        cap, out = self.capacity, []
        for _ in range(2 * cap // _MIN_WINDOW + 3):
            window = min(cap, max(2 * need, _MIN_WINDOW))
            idx = (self.hand + np.arange(window)) % cap
            ok = ~self.pinned[idx] & (self.id_of[idx] >= 0)
            found = np.flatnonzero(ok & ~self.ref[idx])
            if len(found) >= need:
                found = found[:need]
                passed = idx[:found[-1] + 1]
                self.ref[passed[ok[:found[-1] + 1]]] = False
                self.hand = int((self.hand + found[-1] + 1) % cap)
            else:
                self.ref[idx[ok]] = False
                self.hand = int((self.hand + window) % cap)
            victims = idx[found]
            self.slot_of[self.id_of[victims]] = -1  # evicted; id_of = -1 also keeps the
            self.id_of[victims] = -1                # next window from taking them again
            self.evictions += len(victims)
            out.append(victims)
            need -= len(found)
            if need == 0:
                return np.concatenate(out)
        raise RuntimeError("CLOCK sweep found too few evictable slots")  # evictable() was wrong

    def forget(self, slots: np.ndarray) -> None:
        """Slots whose load failed: empty them and return them to the free stack."""
        ids = self.id_of[slots]
        self.slot_of[ids[ids >= 0]] = -1
        self.id_of[slots] = -1
        self.ref[slots] = False
        self.free[self.n_free:self.n_free + len(slots)] = slots
        self.n_free += len(slots)

    def pin(self, slots: np.ndarray) -> None:
        new = slots[~self.pinned[slots]]
        if len(new) > 1:
            new = np.unique(new)  # a batch may repeat a slot
        self.pinned[new] = True
        self._pinned_now.append(new)
        self.ref[slots] = True
        self.n_pinned += len(new)

    def pin_one(self, slot: int) -> None:
        """``pin`` of one slot with scalar operations: a decode step's lookup."""
        if not self.pinned[slot]:
            self.pinned[slot] = True
            self._pinned_now.append(slot)
            self.n_pinned += 1
        self.ref[slot] = True

    def unpin_all(self) -> None:
        for slots in self._pinned_now:
            self.pinned[slots] = False
        self._pinned_now.clear()
        self.n_pinned = 0
