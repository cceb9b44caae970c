"""``CachedRows``: the cached tables (``NgramTable.Cached``) of one layer, for every path.

A cached table's rows are made resident by ``resolve`` and stay pinned until ``end_batch``, so
a call that fails between the two (a launch that raises, a load failing, a bad argument found late)
would leave them pinned for good, and later batches would find the arena full. ``batch()`` is
the one place that ends a batch: a context manager around everything from the first
``resolve`` to the last launch that reads the rows, which ends it on leaving, after a failure
too. The seed-faithful path ends each table's batch after its gather (``batch(column)``); the
fused path ends every table's together (``batch()``).

Bad ids raise before the first load: ``validate`` (the faithful path, table by table ids) and
``resolve`` (the fused path, every cached table's ids at once; ``RowCache`` tables through one
``CacheGroup`` when ``grouped``, the others one by one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..ngram_store.cache_group import CacheGroup, cache_group
from ..ngram_store.row_cache import RowCache
from .tables import AnyTable, CachedTable, RowSource


class CachedRows:
    """``tables``: a layer's tables (cached or not; the cached ones are ``columns``).
    ``grouped``: resolve the ``RowCache`` tables through one ``CacheGroup`` (the fused path's
    steps; it takes over their indexes, see ``cache_group``)."""

    def __init__(self, tables: Sequence[AnyTable], *, grouped: bool = False) -> None:
        self.columns = [c for c, table in enumerate(tables) if isinstance(table, CachedTable)]
        self.caches: list[RowSource] = [table.cache for table in tables if isinstance(table, CachedTable)]
        grouping = [(j, cache) for j, cache in enumerate(self.caches) if grouped and isinstance(cache, RowCache)]
        members = [j for j, _ in grouping]
        self.group: CacheGroup | None = cache_group([cache for _, cache in grouping]) if grouping else None
        self.group_all = bool(members) and len(members) == len(tables)  # the group writes every slot
        self._group_rows = members  # their rows in the ids ([len(columns), R]) ...
        self._group_cols = [self.columns[j] for j in members]  # ... and their columns in the slots
        self._others = [(j, c) for j, c in enumerate(self.columns) if j not in members]
        self._every = _Batch(self, None)  # batch(): the same (stateless) context manager each call

    def __bool__(self) -> bool:
        return bool(self.columns)

    def check_stream(self, stream: int, what: str) -> None:
        """``ValueError`` unless every cache that loads rows on a stream of its own (``RowCache``)
        loads them on ``stream``, the call's: its scatters and the call's gathers are then
        ordered on one stream (nothing else joins two streams here)."""
        for c, cache in zip(self.columns, self.caches):
            own = getattr(cache, "stream", stream)
            if own != stream:
                raise ValueError(
                    f"{what}: table {c}'s RowCache loads its rows on stream {own:#x}, this call runs on "
                    f"{stream:#x}: they must be the same stream"
                )

    # -- refusals and resolve ------------------------------------------------------------------
    def validate(self, ids: Sequence[np.ndarray] | np.ndarray) -> None:
        """Raise, loading nothing, what resolving ``ids[c]`` (the ids of table ``c``, every
        table of the layer) would raise, for each cached table that can tell (``RowCache``)."""
        for c, cache in zip(self.columns, self.caches):
            if hasattr(cache, "validate"):
                cache.validate(ids[c])

    def resolve(self, ids: np.ndarray, slots: np.ndarray, *, in_range: bool = False) -> None:
        """Every cached table's rows at once: ``ids [len(columns), R]`` (row j: table
        ``columns[j]``), ``slots [R, T]`` u32 gets each cached table's arena slots in its column
        and 0 in the others. Bad ids raise before the first load. ``in_range=True``: the
        caller guarantees every id is below its table's rows (hashed modulo them)."""
        for j, _ in self._others:
            cache = self.caches[j]
            if hasattr(cache, "validate"):
                cache.validate(ids[j])
        group = self.group
        if group is not None and self.group_all:  # the group checks all, then loads
            group.resolve(ids, slots, in_range=in_range)
            return
        slots[:] = 0
        if group is not None:
            group_slots = np.empty((ids.shape[1], len(self._group_rows)), np.uint32)
            group.resolve(ids[self._group_rows], group_slots, in_range=in_range)
            slots[:, self._group_cols] = group_slots
        column = np.empty(ids.shape[1], np.uint32)
        for j, c in self._others:
            self.caches[j].resolve(ids[j], column)
            slots[:, c] = column

    def resolve_table(self, column: int, ids: np.ndarray) -> np.ndarray:
        """Table ``column``'s rows alone (the seed's order): its arena slots for ``ids``, u32."""
        slots = np.empty(ids.size, np.uint32)
        self.caches[self.columns.index(column)].resolve(ids, slots)
        return slots

    # -- the end of a batch --------------------------------------------------------------------
    def batch(self, column: int | None = None) -> _Batch:
        """A context manager that ends the batch of table ``column`` (default: of every cached
        table) on leaving. After a failure every cache is still ended and the failure is what
        propagates; after success the first ``end_batch`` error does, once every cache has been
        ended."""
        return self._every if column is None else _Batch(self, column)

    def end_batch(self, column: int | None = None) -> None:
        self._end(column, quiet=False)

    def _end(self, column: int | None, quiet: bool) -> None:
        error: BaseException | None = None
        for end in self._enders(column):
            try:
                end()
            except Exception as exc:  # a closed cache: the others are still ended
                error = error or exc
        if error is not None and not quiet:
            raise error

    def _enders(self, column: int | None) -> list[Callable[[], None]]:
        if column is not None:
            return [self.caches[self.columns.index(column)].end_batch]
        ends = [self.group.end_batch] if self.group is not None else []
        return ends + [self.caches[j].end_batch for j, _ in self._others]


class _Batch:
    """``CachedRows.batch``'s context manager (a class: cheaper per call than a generator's)."""

    __slots__ = ("rows", "column")

    def __init__(self, rows: CachedRows, column: int | None) -> None:
        self.rows, self.column = rows, column

    def __enter__(self) -> CachedRows:
        return self.rows

    def __exit__(self, kind: type | None, *_: object) -> None:
        if self.rows.columns:
            self.rows._end(self.column, quiet=kind is not None)
