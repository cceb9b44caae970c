"""``SlotIndex``: which table row sits in which slot of a fixed-size device arena.

Pure host bookkeeping for ``RowCache``, in numpy arrays so a lookup or an eviction costs a few
vectorised operations whatever the table size: ``slot_of`` (4 bytes per table row, about 1% of
a 512-byte-row table) maps id -> slot, ``id_of`` maps back. Eviction is CLOCK (second chance)
and never picks a slot that is *pinned* (read by the current batch); the hand sweeps windows of
the arena, so its cost follows the number of rows evicted, not the arena's size.

``SlotStore`` concatenates several indexes' arrays and ``SharedSlotIndex`` is one member's view
of it (``CacheGroup``: one lookup, one pin for every cached table of a step).
"""

from __future__ import annotations

import numpy as np

from gpu_runtime import validate

_MIN_WINDOW = 256


class SlotIndex:
    def __init__(self, rows: int, capacity: int) -> None:
        capacity = validate.positive(capacity, "capacity", limit=1 << 31)
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
        parts = [self.free[self.n_free - take : self.n_free]]
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
                passed = idx[: found[-1] + 1]
                self.ref[passed[ok[: found[-1] + 1]]] = False
                self.hand = int((self.hand + found[-1] + 1) % cap)
            else:
                self.ref[idx[ok]] = False
                self.hand = int((self.hand + window) % cap)
            victims = idx[found]
            self.slot_of[self.id_of[victims]] = -1  # evicted; id_of = -1 also keeps the
            self.id_of[victims] = -1  # next window from taking them again
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
        self.free[self.n_free : self.n_free + len(slots)] = slots
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


class SlotStore:
    """The index arrays of several ``SlotIndex`` es concatenated, for ``CacheGroup``: member
    ``k``'s ids are ``row_base[k] + id`` of ``slot_of`` and its slots ``slot_base[k] + slot`` of
    ``id_of``, ``ref`` and ``pinned``, so one numpy gather looks up every member's ids at once.
    ``n_pinned[k]`` is member k's count (``counts()``: a group's all-hit step pins without
    counting, as counting distinct slots costs more than the pins; the counts are taken from
    ``pinned`` when next needed, which only a miss or a second batch in one batch does);
    ``pins`` the global slots pinned in the current batch, which is shared: ``unpin_all`` ends it
    for every member."""

    def __init__(self, rows: list[int], capacities: list[int]) -> None:
        self.row_base = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)[:-1]]).astype(np.int64)
        self.slot_base = np.concatenate([[0], np.cumsum(capacities, dtype=np.int64)[:-1]]).astype(np.int64)
        self.slot_of = np.full(int(sum(rows)), -1, np.int32)
        total = int(sum(capacities))
        self.id_of = np.full(total, -1, np.int64)
        self.ref = np.zeros(total, bool)
        self.pinned = np.zeros(total, bool)
        self.capacities = list(capacities)
        self.n_pinned = np.zeros(len(rows), np.int64)
        self.uncounted = False  # pins were set without counting: n_pinned is stale
        self.counted = False  # n_pinned may be nonzero (else unpin_all need not clear it)
        self.pins: list[np.ndarray | int] = []
        self._scratch: np.ndarray | None = None  # one int64 per slot, for ``first_of``

    def unpin_all(self) -> None:
        if self.pins:  # nothing pinned: nothing to do (every pin appends here)
            for slots in self.pins:
                self.pinned[slots] = False
            self.pins.clear()
            if self.counted:
                self.n_pinned[:] = 0
                self.counted = False
            self.uncounted = False

    def counts(self) -> np.ndarray:
        """``n_pinned``, recounted from ``pinned`` if pins were set without counting."""
        if self.uncounted:
            for k, (base, cap) in enumerate(zip(self.slot_base.tolist(), self.capacities)):
                self.n_pinned[k] = np.count_nonzero(self.pinned[base : base + cap])
            self.uncounted = False
            self.counted = True
        return self.n_pinned

    def first_of(self, slots: np.ndarray) -> np.ndarray:
        """A mask of ``slots`` (global, flat) keeping one occurrence of each distinct slot:
        ``np.unique`` without the sort (whichever write wins, exactly one position matches)."""
        if self._scratch is None:
            self._scratch = np.zeros(self.id_of.size, np.int64)
        pos = np.arange(slots.size)
        self._scratch[slots] = pos
        return self._scratch[slots] == pos


class SharedSlotIndex(SlotIndex):
    """A ``SlotIndex`` whose arrays are member ``k``'s segments of a ``SlotStore`` (made from an
    index's current state, which it copies, pins included). Behaves as a ``SlotIndex``, except
    that ``unpin_all`` ends the batch of every member of the store."""

    def __init__(self, src: SlotIndex, store: SlotStore, k: int) -> None:
        rows, cap = src.rows, src.capacity
        self.rows, self.capacity, self.store, self.k = rows, cap, store, k
        r0, s0 = int(store.row_base[k]), int(store.slot_base[k])
        self.slot_base = s0
        self.slot_of = store.slot_of[r0 : r0 + rows]
        self.id_of, self.ref = store.id_of[s0 : s0 + cap], store.ref[s0 : s0 + cap]
        self.pinned = store.pinned[s0 : s0 + cap]
        self.slot_of[:], self.id_of[:], self.ref[:], self.pinned[:] = src.slot_of, src.id_of, src.ref, src.pinned
        store.n_pinned[k] = int(src.pinned.sum())
        store.counted = True
        if store.n_pinned[k]:  # an open batch moves over with its pins
            store.pins.append(np.flatnonzero(src.pinned) + s0)
        self.free, self.n_free = src.free.copy(), src.n_free
        self.hand, self.evictions = src.hand, src.evictions
        # RowCache.end_batch's call, one level shorter: the store's method as an instance attribute
        self.unpin_all = store.unpin_all  # type: ignore[method-assign]  # shadows the method on purpose

    @property
    def n_pinned(self) -> int:
        return int(self.store.counts()[self.k])

    @n_pinned.setter
    def n_pinned(self, value: int) -> None:
        self.store.counts()
        self.store.n_pinned[self.k] = value
        self.store.counted = True

    def pin(self, slots: np.ndarray) -> None:
        new = slots[~self.pinned[slots]]
        if len(new) > 1:
            new = np.unique(new)
        self.pinned[new] = True
        self.store.pins.append(new + self.slot_base)
        self.ref[slots] = True
        self.store.n_pinned[self.k] += len(new)
        self.store.counted = True

    def pin_one(self, slot: int) -> None:
        if not self.pinned[slot]:
            self.pinned[slot] = True
            self.store.pins.append(slot + self.slot_base)
            self.store.n_pinned[self.k] += 1
            self.store.counted = True
        self.ref[slot] = True


def refuse_slots_out(what: str, slots_out: object, shape: tuple[int, ...]) -> None:
    """Raise for a ``slots_out`` that is not a writable uint32 array of ``shape``:
    ``TypeError`` for another type or dtype, ``ValueError`` for another shape."""
    dtype = getattr(slots_out, "dtype", None)
    if not isinstance(slots_out, np.ndarray) or dtype != np.uint32:
        raise TypeError(
            f"{what}: slots_out must be a uint32 array, got {type(slots_out).__name__ if dtype is None else dtype}"
        )
    raise ValueError(
        f"{what}: slots_out must be writable and of shape {shape}, got shape "
        f"{slots_out.shape}" + ("" if slots_out.flags.writeable else ", read-only")
    )
