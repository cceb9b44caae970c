"""``CacheGroup``: every ``RowCache`` table of a layer resolved in one call per step.

The group keeps its members' id -> slot indexes in one ``SlotStore`` (the members' arrays
concatenated, member ``k``'s ids at ``row_base[k] + id``, its slots at ``slot_base[k] + slot``;
each member's ``SlotIndex`` becomes a ``SharedSlotIndex`` over its segments, so a member still
works on its own), and resolves ``ids [Tc, R]`` for all members at once:

* all hits: the pins and CLOCK reference bits of every slot set in a few vectorised operations,
  whatever Tc and R; the hits are credited to every member's stats when ``RowCache.stats`` is read.
* some misses: the members with a miss go through their own ``resolve`` (which loads rows), after
  every check of the batch has passed (ids out of range for any member, then room in the arena
  of every member with a miss), so nothing is loaded before an error is raised.

Members share one batch: ``end_batch`` of the group, or of any member (``RowCache.end_batch``
calls ``SharedSlotIndex.unpin_all``), unpins every member's rows. Why the index stays on the
host: docs/design_notes.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpu_runtime import validate

from .row_cache import RowCache
from .slot_index import SharedSlotIndex, SlotStore, refuse_slots_out

_U32 = np.dtype(np.uint32)


def cache_group(caches: Sequence[RowCache]) -> CacheGroup:
    """The group of exactly these caches (in this order): the one they already form, if they
    do (so two layers over the same tables share it), else a new one."""
    caches = list(caches)
    if caches and all(isinstance(c, RowCache) for c in caches):
        group = caches[0]._group
        if (
            isinstance(group, CacheGroup)
            and group._ok
            and len(group.caches) == len(caches)
            and all(a is b for a, b in zip(group.caches, caches))
        ):
            return group
    return CacheGroup(caches)


class CacheGroup:
    """``validate`` / ``resolve`` / ``end_batch`` of several ``RowCache`` s in one call each.

    ``ids`` are ``[Tc, R]`` integer arrays, row ``k`` the ids of ``caches[k]``; ``resolve``
    writes the arena slots to ``slots_out [R, Tc]`` uint32 (the fused path's slot layout).
    A cache belongs to one group at a time: a new group over it takes its index over (the old
    group takes it back, copying, the next time it is used).
    """

    def __init__(self, caches: Sequence[RowCache]) -> None:
        caches = list(caches)
        if not caches:
            raise ValueError("CacheGroup: no caches")
        for k, cache in enumerate(caches):
            if not isinstance(cache, RowCache):
                raise TypeError(f"CacheGroup: cache {k} is a {type(cache).__name__}, not a RowCache")
            validate.require_open(cache.closed, f"CacheGroup: cache {k}: RowCache")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("CacheGroup: a cache appears twice")
        self.caches = caches
        self._tc = len(caches)
        self.rows = np.array([c.rows for c in caches], np.int64)
        self.capacity = np.array([c.capacity for c in caches], np.int64)
        self._rows_col = {"i": self.rows[:, None], "u": self.rows.astype(np.uint64)[:, None]}
        self._pending_hits = 0  # hits of all-hit steps, credited to every member when stats are read
        self._ok = False  # False: a member closed or taken by another group (checked on each call)
        self._adopt()

    # -- membership -------------------------------------------------------------------------------
    def _adopt(self) -> None:
        """Move every member's index into a fresh store (copying its state)."""
        for cache in self.caches:
            old = cache._group
            if isinstance(old, CacheGroup) and old is not self:
                old.flush_stats()
                old._ok = False
        self.flush_stats()
        store = SlotStore([c.rows for c in self.caches], [c.capacity for c in self.caches])
        for k, cache in enumerate(self.caches):
            cache.index = SharedSlotIndex(cache.index, store, k)
            cache._group = self
        self.store = store
        self._row_off_i, self._row_off_u = store.row_base[:, None], store.row_base.astype(np.uint64)[:, None]
        self._slot_off = store.slot_base[:, None]
        self._ok = True

    def _refresh(self) -> None:
        for k, cache in enumerate(self.caches):
            validate.require_open(cache.closed, f"CacheGroup: cache {k}: RowCache")
        self._adopt()  # another group took members over: take them back

    def member_closed(self) -> None:
        """Called by a member ``RowCache`` as it closes: the next call checks every member again (and
        raises ``ClosedError`` naming the closed one) instead of taking the fast path."""
        self._ok = False

    def flush_stats(self) -> None:
        """Credit the all-hit steps' hits to every member's ``stats``."""
        if self._pending_hits:
            hits, self._pending_hits = self._pending_hits, 0
            for cache in self.caches:
                if cache._group is self:
                    cache._stats.hits += hits

    # -- the batch ----------------------------------------------------------------------------------
    def _checked(self, ids: np.ndarray, what: str) -> np.ndarray:
        if not self._ok:
            self._refresh()
        if type(ids) is not np.ndarray or (ids.dtype.kind not in "iu" and ids.size):
            raise TypeError(
                f"CacheGroup.{what}: ids must be a numpy integer array, got {getattr(ids, 'dtype', type(ids).__name__)}"
            )
        if ids.ndim != 2 or ids.shape[0] != len(self.caches):
            raise ValueError(f"CacheGroup.{what}: ids must be [{len(self.caches)}, R], got shape {ids.shape}")
        return ids

    def _check_range(self, ids: np.ndarray, what: str) -> None:
        kind = ids.dtype.kind
        bad = ids >= self._rows_col[kind]
        if kind == "i":
            bad |= ids < 0
        if bad.any():
            k, r = (int(x[0]) for x in np.nonzero(bad))
            raise ValueError(
                f"CacheGroup.{what}: cache {k}: id {int(ids[k, r])} out of range for a table "
                f"of {int(self.rows[k])} rows"
            )

    def validate(self, ids: np.ndarray) -> None:
        """Raise, loading nothing, what ``resolve(ids, ...)`` would raise for: a closed member, ids
        out of range, a member needing more rows resident at once than its arena holds."""
        ids = self._checked(ids, "validate")
        if ids.size == 0:
            return
        self._check_range(ids, "validate")
        tight = np.flatnonzero(ids.shape[1] + self.store.counts() > self.capacity)
        for k in tight:  # only members whose arena a batch of R ids could overfill
            self.caches[k].validate(ids[k])

    def resolve(self, ids: np.ndarray, slots_out: np.ndarray, *, in_range: bool = False) -> None:
        """Make the rows of ``ids [Tc, R]`` resident and pinned until ``end_batch``;
        ``slots_out[r, k]`` gets the slot of ``ids[k, r]`` in ``caches[k]``'s arena. Every
        error (``validate``'s) is raised before the first load. ``in_range=True``: the caller
        guarantees ``0 <= ids[k] < caches[k].rows`` (ids hashed modulo the table's rows), and
        the range test is skipped."""
        if not (self._ok and type(ids) is np.ndarray and ids.ndim == 2 and ids.dtype.kind in "iu"):
            ids = self._checked(ids, "resolve")
        tc, r = ids.shape
        if tc != self._tc or not (
            type(slots_out) is np.ndarray
            and slots_out.dtype == _U32
            and slots_out.shape == (r, tc)
            and slots_out.flags.writeable
        ):
            self._checked(ids, "resolve")
            refuse_slots_out("CacheGroup.resolve", slots_out, (r, tc))
        if r == 0:
            return
        if not in_range:
            self._check_range(ids, "resolve")
        store = self.store
        kind = ids.dtype.kind
        slots = store.slot_of[ids + (self._row_off_i if kind == "i" else self._row_off_u)]  # -1: absent
        if (min(slots.ravel().tolist()) if r == 1 else slots.min()) < 0:
            self._resolve_misses(ids, slots, slots_out)
            return
        # All hits: pin every slot and set its CLOCK bit, across all members at once.
        glob = slots + self._slot_off
        store.ref[glob] = True
        store.pinned[glob] = True
        store.uncounted = True  # counted when next needed (SlotStore.counts)
        store.pins.append(glob)
        self._pending_hits += r
        slots_out[...] = slots.T

    def _count_pins(self, glob: np.ndarray, members: np.ndarray) -> None:
        """Pin the global slots ``glob [m, R]`` of ``members``, counted: each newly pinned slot
        once (a batch may repeat an id, and an open batch may hold it already)."""
        store = self.store
        store.counts()
        was = store.pinned[glob]
        store.pinned[glob] = True
        if glob.shape[1] == 1:
            new = ~was[:, 0]
        else:
            new = (store.first_of(glob.ravel()) & ~was.ravel()).reshape(glob.shape).sum(axis=1)
        store.n_pinned[members] += new
        store.counted = True

    def _resolve_misses(self, ids: np.ndarray, slots: np.ndarray, slots_out: np.ndarray) -> None:
        """The slow path: members with a miss resolve (and load) on their own, the others as hits."""
        r = ids.shape[1]
        missing = (slots < 0).any(axis=1)
        slow, fast = np.flatnonzero(missing), np.flatnonzero(~missing)
        for k in slow:  # every refusal before the first load (hit-only members always have room)
            self.caches[k].validate(ids[k])
        if fast.size:
            glob = slots[fast] + self._slot_off[fast]
            self.store.ref[glob] = True
            self._count_pins(glob, fast)
            self.store.pins.append(glob)
            slots_out[:, fast] = slots[fast].T
            for k in fast:
                self.caches[k]._stats.hits += r
        column = np.empty(r, np.uint32)
        for k in slow:
            self.caches[k].resolve(ids[k], column)
            slots_out[:, k] = column

    def end_batch(self) -> None:
        """Every member's rows may be evicted again."""
        if not self._ok:
            self._refresh()
        self.store.unpin_all()
