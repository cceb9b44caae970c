"""LoRA token overlays: what an adapter replaces, how it is found, and the per-slot device tables.

An adapter may change some rows of the token embedding and of the LM head (new or retrained
tokens: PEFT's ``trainable_token_indices``, or a full ``modules_to_save`` copy of
``embed_tokens`` / ``lm_head``). A multi-adapter server keeps one served table and, per adapter
slot, only the rows that differ; each token of a batch is routed to its sequence's slot. The
rows are replacements, not deltas.

- ``TableOverlay`` / ``AdapterOverlay``: the host-side description (sorted unique ids and their
  replacement rows, per table);
- ``build_overlay``: from full adapter tables, finding the differing rows on the GPU
  (``embed_rowdiff``); ``overlay_from_trainable_tokens``: from PEFT's trainable-tokens form;
- ``OverlaySlots``: a fixed number of adapter slots, each made device-resident on ``load``,
  and the device pointer tables the routed kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from gpu_runtime import DevicePtr, GpuBackend, KernelNotFoundError

from .ops.checks import require_count, require_ptr
from .ops.token_overlay import OverlayKernels, embed_overlay_routed, embed_rowdiff, lmhead_overlay_routed
from .weight_map import DenseWeight

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
_I32_MAX = (1 << 31) - 1


def _as_bf16_rows(rows: Any, what: str) -> np.ndarray:
    """A C-contiguous ``[n, h]`` bf16 copy; float16/32/64 input is rounded to bf16 (as served)."""
    arr = np.asarray(rows)
    if arr.ndim != 2:
        raise ValueError(f"{what} must be 2-D [n, h], got shape {arr.shape}")
    if arr.dtype != BF16:
        if arr.dtype.kind != "f":
            raise TypeError(f"{what} must be bfloat16 (or a float type to round), got {arr.dtype}")
        arr = arr.astype(BF16)
    return np.array(arr, dtype=BF16, order="C", copy=True)


def _as_ids(ids: Any, what: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{what}: negative token id {int(arr.min())}")
    if arr.size and arr.max() > _I32_MAX:
        raise ValueError(f"{what}: token id {int(arr.max())} does not fit int32")
    uniq, counts = np.unique(arr, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{what}: duplicate token ids {uniq[counts > 1][:8].tolist()}")
    return arr


@dataclass(frozen=True, eq=False)
class TableOverlay:
    """The rows of one vocab table (embedding or LM head) an adapter replaces: ``ids`` int32
    ``[n]`` sorted and unique, ``rows`` bf16 ``[n, h]`` (row k replaces row ``ids[k]``).
    Use ``TableOverlay.of`` to build one from unsorted input. Takes the arrays as they are (no
    copy: a full retrained table can be large) and makes them read-only."""

    ids: np.ndarray
    rows: np.ndarray

    def __post_init__(self) -> None:
        ids, rows = self.ids, self.rows
        if not (isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1):
            raise TypeError("TableOverlay.ids must be a 1-D int32 array (use TableOverlay.of)")
        if not (isinstance(rows, np.ndarray) and rows.dtype == BF16 and rows.ndim == 2):
            raise TypeError("TableOverlay.rows must be a 2-D bfloat16 array (use TableOverlay.of)")
        if rows.shape[0] != ids.shape[0] or rows.shape[1] == 0:
            raise ValueError(f"TableOverlay: {ids.shape[0]} ids for rows of shape {rows.shape}")
        if ids.size and (ids[0] < 0 or (np.diff(ids) <= 0).any()):
            raise ValueError("TableOverlay.ids must be sorted, unique and >= 0 (use TableOverlay.of)")
        for arr in (ids, rows):
            if arr.flags.writeable:
                arr.flags.writeable = False

    @classmethod
    def of(cls, ids: Any, rows: Any, vocab: int | None = None, what: str = "overlay") -> "TableOverlay":
        """Validate, sort by id and copy: refuses duplicate or negative ids, ids >= ``vocab``
        (when given), and a row count that differs from the id count."""
        id_arr = _as_ids(ids, f"{what} ids")
        row_arr = _as_bf16_rows(rows, f"{what} rows")
        if row_arr.shape[0] != id_arr.shape[0]:
            raise ValueError(f"{what}: {id_arr.shape[0]} ids but {row_arr.shape[0]} rows")
        if row_arr.shape[1] == 0:
            raise ValueError(f"{what}: rows of width 0")
        if vocab is not None and id_arr.size and id_arr.max() >= vocab:
            raise ValueError(f"{what}: token id {int(id_arr.max())} >= vocab {vocab}")
        order = np.argsort(id_arr, kind="stable")
        return cls(np.ascontiguousarray(id_arr[order], np.int32), np.ascontiguousarray(row_arr[order]))

    @classmethod
    def empty(cls, h: int) -> "TableOverlay":
        return cls(np.zeros(0, np.int32), np.zeros((0, h), BF16))

    @property
    def n(self) -> int:
        return int(self.ids.shape[0])

    @property
    def h(self) -> int:
        return int(self.rows.shape[1])


@dataclass(frozen=True)
class AdapterOverlay:
    """What one adapter replaces: embedding rows and/or LM-head rows (None: that table is the
    served one). Host-side; ``OverlaySlots.load`` makes it device-resident in a slot."""

    embed: TableOverlay | None = None
    lm_head: TableOverlay | None = None

    @property
    def is_empty(self) -> bool:
        return all(t is None or t.n == 0 for t in (self.embed, self.lm_head))


# -- building ----------------------------------------------------------------------------------

def _require_kernels(kernels: OverlayKernels, which: str, *names: str) -> None:
    missing = [n for n in names if not getattr(kernels, n)]
    if missing:
        raise KernelNotFoundError(
            f"the adapter ships {which} overlay tensors but the token-overlay kernels "
            f"{missing} are not loaded (kernels/token_overlay.cu missing or without them)")


def _table_diff(gpu: GpuBackend, rowdiff: Any, served: DenseWeight | None, adapter: Any,
                thresh: float, stream: int, which: str) -> TableOverlay:
    """The rows of ``adapter`` that differ from ``served`` by more than ``thresh``, found on the
    GPU with ``embed_rowdiff`` (only the flags come back), then gathered from the adapter table."""
    if served is None:
        raise ValueError(f"the adapter ships a full {which} table but no served {which} was given")
    if not isinstance(served, DenseWeight) or served.dtype != BF16:
        raise TypeError(f"served {which} must be a bfloat16 DenseWeight, got "
                        f"{getattr(served, 'dtype', type(served).__name__)}")
    rows, h = served.shape
    if isinstance(adapter, DenseWeight):
        if adapter.dtype != BF16:
            raise TypeError(f"adapter {which} must be bfloat16, got {adapter.dtype}")
        host = None
        shape = adapter.shape
    else:
        host = _as_bf16_rows(adapter, f"adapter {which}")
        shape = host.shape
    if tuple(shape) != (rows, h):
        raise ValueError(f"adapter {which} shape {tuple(shape)} != served {which} shape {(rows, h)}")

    owned: list[DevicePtr] = []
    try:
        if host is None:
            base = adapter.weight
        else:
            base = gpu.alloc(host.nbytes)
            owned.append(base)
            gpu.copy_h2d_async(host, base, stream)
        flags_dev = gpu.alloc(rows)
        owned.append(flags_dev)
        embed_rowdiff(gpu, rowdiff, base, served.weight, flags_dev, rows, h, thresh, stream)
        flags = np.empty(rows, np.uint8)
        gpu.copy_d2h(flags, flags_dev, stream)  # waits for the stream: temporaries are free after
        ids = np.flatnonzero(flags).astype(np.int32)
        if host is not None:
            out = host[ids]
        else:
            out = np.empty((ids.size, h), BF16)
            _gather_runs(gpu, adapter.weight, ids, h, out, stream)
    finally:
        for ptr in owned:
            gpu.free(ptr)
    return TableOverlay(ids, np.ascontiguousarray(out))


def _gather_runs(gpu: GpuBackend, table: DevicePtr, ids: np.ndarray, h: int, out: np.ndarray,
                 stream: int) -> None:
    """Download rows ``ids`` (sorted) of a device bf16 table, one copy per run of consecutive ids."""
    if ids.size == 0:
        return
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [ids.size]))
    row_bytes = h * BF16.itemsize
    for a, b in zip(starts.tolist(), ends.tolist()):
        gpu.copy_d2h(out[a:b], DevicePtr(table).offset(int(ids[a]) * row_bytes), stream)


def build_overlay(gpu: GpuBackend, kernels: OverlayKernels, served_embed: DenseWeight | None,
                  adapter_embed: np.ndarray | DenseWeight | None, served_lm_head: DenseWeight | None = None,
                  adapter_lm_head: np.ndarray | DenseWeight | None = None, thresh: float = 0.0,
                  stream: int = 0) -> AdapterOverlay:
    """The overlay of an adapter that ships full tables (``modules_to_save`` copies).

    A row is overridden where ``max_i |adapter - served| > thresh`` (a NaN counts as differing);
    the differing rows are found on the GPU and gathered from the adapter's table. Refuses an
    adapter with overlay tensors when the overlay kernels are missing (the seed), a table whose
    shape differs from the served one, and a table with no served counterpart.
    """
    if adapter_embed is not None:
        _require_kernels(kernels, "embedding", "rowdiff", "embed_overlay")
    if adapter_lm_head is not None:
        _require_kernels(kernels, "LM-head", "rowdiff", "lmhead_overlay_bf16", "lmhead_overlay_f32")
    embed = lm_head = None
    if adapter_embed is not None:
        embed = _table_diff(gpu, kernels.rowdiff, served_embed, adapter_embed, thresh, stream, "embedding")
    if adapter_lm_head is not None:
        lm_head = _table_diff(gpu, kernels.rowdiff, served_lm_head, adapter_lm_head, thresh, stream,
                              "LM head")
    return AdapterOverlay(embed, lm_head)


def overlay_from_trainable_tokens(indices: Any, embed_rows: Any, lm_head_rows: Any = None,
                                  tied: bool = False, *, vocab: int | None = None) -> AdapterOverlay:
    """The overlay of PEFT's ``trainable_token_indices`` form: token ids plus their absolute
    replacement rows (``[len(indices), h]``). With ``tied`` (embedding and LM head share one
    matrix) the LM head reuses the embedding rows, so ``lm_head_rows`` must not be given.
    ``vocab``, when known, refuses ids >= vocab here rather than at ``OverlaySlots.load``."""
    if tied and lm_head_rows is not None:
        raise ValueError("tied embeddings: the LM head reuses the embedding rows; "
                         "lm_head_rows must not be given")
    if tied and embed_rows is None:
        raise ValueError("tied embeddings need embed_rows")
    embed = TableOverlay.of(indices, embed_rows, vocab, "trainable-tokens embedding") \
        if embed_rows is not None else None
    if tied:
        lm_head = embed
    elif lm_head_rows is not None:
        lm_head = TableOverlay.of(indices, lm_head_rows, vocab, "trainable-tokens LM head")
    else:
        lm_head = None
    if embed is None and lm_head is None:
        raise ValueError("trainable tokens without embedding or LM-head rows")
    if embed is not None and lm_head is not None and embed.h != lm_head.h:
        raise ValueError(f"embedding rows width {embed.h} != LM-head rows width {lm_head.h}")
    return AdapterOverlay(embed, lm_head)


# -- device slots --------------------------------------------------------------------------------

@dataclass
class _SlotBuffers:
    """Device buffers of one loaded slot (0 where a table has no overlay)."""

    overlay: AdapterOverlay
    embed_map: DevicePtr = DevicePtr(0)
    embed_rows: DevicePtr = DevicePtr(0)
    embed_n: int = 0
    lm_rows: DevicePtr = DevicePtr(0)
    lm_ids: DevicePtr = DevicePtr(0)
    lm_n: int = 0

    def pointers(self) -> list[DevicePtr]:
        return [p for p in (self.embed_map, self.embed_rows, self.lm_rows, self.lm_ids) if p]


class OverlaySlots:
    """A fixed number of adapter slots and the device pointer tables the routed kernels read.

    Embedding set: ``embed_slot_map_tab`` (per slot a pointer to ``int32[vocab]``, -1 where the
    id is not overridden), ``embed_rows_tab`` (pointer to ``[n, h]`` bf16), ``embed_n_tab``
    (``int32[num_slots]``). LM-head set: ``lm_head_rows_tab``, ``lm_head_ids_tab`` (pointer to
    ``int32[n]``), ``lm_head_n_tab``. An empty slot, or a table an adapter does not override,
    has null entries and n = 0. Table updates are queued on the ``stream`` given to
    ``load`` / ``evict``; a forward on another stream must be ordered after them by the caller.
    """

    def __init__(self, gpu: GpuBackend, num_slots: int, vocab: int, h: int, *,
                 kernels: OverlayKernels | None = None, stream: int = 0) -> None:
        self.gpu = gpu
        self.num_slots = require_count(num_slots, "num_slots")
        self.vocab = require_count(vocab, "vocab")
        self.h = require_count(h, "h")
        if self.num_slots == 0 or self.vocab == 0 or self.h == 0:
            raise ValueError(f"OverlaySlots needs num_slots, vocab and h >= 1, got "
                             f"{num_slots}, {vocab}, {h}")
        if self.vocab > 1 << 31:
            raise ValueError(f"vocab {vocab} too large for int32 slot maps")
        self.kernels = OverlayKernels.new(gpu) if kernels is None else kernels
        ns = self.num_slots
        self._host_embed_map = np.zeros(ns, np.uint64)
        self._host_embed_rows = np.zeros(ns, np.uint64)
        self._host_embed_n = np.zeros(ns, np.int32)
        self._host_lm_rows = np.zeros(ns, np.uint64)
        self._host_lm_ids = np.zeros(ns, np.uint64)
        self._host_lm_n = np.zeros(ns, np.int32)
        self._slots: list[_SlotBuffers | None] = [None] * ns
        self._seq_scratch = DevicePtr(0)
        self._seq_capacity = 0
        self._tables: list[DevicePtr] = []
        self.closed = False
        try:
            for host in self._host_tables():
                ptr = gpu.alloc(host.nbytes)
                self._tables.append(ptr)
                gpu.copy_h2d_async(host, ptr, stream)
        except BaseException:
            for ptr in self._tables:
                gpu.free(ptr)
            raise

    def _host_tables(self) -> tuple[np.ndarray, ...]:
        return (self._host_embed_map, self._host_embed_rows, self._host_embed_n,
                self._host_lm_rows, self._host_lm_ids, self._host_lm_n)

    # -- device pointers for the launchers ---------------------------------------------------
    @property
    def embed_slot_map_tab(self) -> DevicePtr:
        return self._table(0)

    @property
    def embed_rows_tab(self) -> DevicePtr:
        return self._table(1)

    @property
    def embed_n_tab(self) -> DevicePtr:
        return self._table(2)

    @property
    def lm_head_rows_tab(self) -> DevicePtr:
        return self._table(3)

    @property
    def lm_head_ids_tab(self) -> DevicePtr:
        return self._table(4)

    @property
    def lm_head_n_tab(self) -> DevicePtr:
        return self._table(5)

    def _table(self, i: int) -> DevicePtr:
        self._live()
        return self._tables[i]

    @property
    def max_n_override(self) -> int:
        """Largest LM-head override count over the loaded slots: the lmhead grid's y extent."""
        return int(self._host_lm_n.max())

    @property
    def has_embed_overlay(self) -> bool:
        return bool((self._host_embed_n > 0).any())

    def loaded(self, slot: int) -> AdapterOverlay | None:
        """The overlay loaded in ``slot``, None when the slot is free."""
        entry = self._slots[self._check_slot(slot)]
        return None if entry is None else entry.overlay

    # -- loading and eviction ----------------------------------------------------------------
    def _live(self) -> None:
        if self.closed:
            raise ValueError("OverlaySlots is closed")

    def _check_slot(self, slot: int) -> int:
        if isinstance(slot, bool) or not hasattr(slot, "__index__"):
            raise TypeError(f"slot index must be an int, got {slot!r}")
        slot = int(slot)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot index {slot} outside 0..{self.num_slots - 1}")
        return slot

    def _check_overlay(self, overlay: AdapterOverlay) -> None:
        if not isinstance(overlay, AdapterOverlay):
            raise TypeError(f"expected an AdapterOverlay, got {type(overlay).__name__}")
        for which, table in (("embedding", overlay.embed), ("LM head", overlay.lm_head)):
            if table is None:
                continue
            if table.h != self.h:
                raise ValueError(f"{which} overlay rows have width {table.h}, the served table {self.h}")
            if table.n and int(table.ids[-1]) >= self.vocab:
                raise ValueError(f"{which} overlay id {int(table.ids[-1])} >= vocab {self.vocab}")
        if overlay.embed is not None and overlay.embed.n:
            _require_kernels(self.kernels, "embedding", "embed_overlay")
        if overlay.lm_head is not None and overlay.lm_head.n:
            _require_kernels(self.kernels, "LM-head", "lmhead_overlay_bf16", "lmhead_overlay_f32")

    def load(self, slot: int, overlay: AdapterOverlay, stream: int = 0) -> None:
        """Make ``overlay`` device-resident in the free ``slot`` (see ``replace`` for a used one).
        Tables with no rows stay null (n = 0): the kernels then skip that slot."""
        self._live()
        slot = self._check_slot(slot)
        if self._slots[slot] is not None:
            raise ValueError(f"slot {slot} is in use: evict it first, or use replace()")
        self._check_overlay(overlay)
        self._upload(slot, overlay, stream)

    def replace(self, slot: int, overlay: AdapterOverlay, stream: int = 0) -> None:
        """Evict whatever ``slot`` holds and load ``overlay`` (validated before anything changes)."""
        self._live()
        slot = self._check_slot(slot)
        self._check_overlay(overlay)
        self.evict(slot, stream)
        self._upload(slot, overlay, stream)

    def evict(self, slot: int, stream: int = 0) -> None:
        """Clear ``slot`` completely: null table entries, n = 0, its device buffers freed (after
        ``stream`` drained, so no queued kernel still reads them). A free slot is left as is."""
        self._live()
        slot = self._check_slot(slot)
        entry = self._slots[slot]
        if entry is None:
            return
        self._set_entries(slot, _SlotBuffers(entry.overlay), stream)
        self._slots[slot] = None
        self.gpu.synchronize(stream)
        for ptr in entry.pointers():
            self.gpu.free(ptr)

    def _upload(self, slot: int, overlay: AdapterOverlay, stream: int) -> None:
        gpu = self.gpu
        buf = _SlotBuffers(overlay)
        try:
            emb = overlay.embed
            if emb is not None and emb.n:
                slot_map = np.full(self.vocab, -1, np.int32)
                slot_map[emb.ids] = np.arange(emb.n, dtype=np.int32)
                buf.embed_map = gpu.alloc(slot_map.nbytes)
                gpu.copy_h2d_async(slot_map, buf.embed_map, stream)
                buf.embed_rows = gpu.alloc(emb.rows.nbytes)
                gpu.copy_h2d_async(emb.rows, buf.embed_rows, stream)
                buf.embed_n = emb.n
            lm = overlay.lm_head
            if lm is not None and lm.n:
                buf.lm_rows = gpu.alloc(lm.rows.nbytes)
                gpu.copy_h2d_async(lm.rows, buf.lm_rows, stream)
                buf.lm_ids = gpu.alloc(lm.ids.nbytes)
                gpu.copy_h2d_async(lm.ids, buf.lm_ids, stream)
                buf.lm_n = lm.n
        except BaseException:
            gpu.synchronize(stream)
            for ptr in buf.pointers():
                gpu.free(ptr)
            raise
        self._set_entries(slot, buf, stream)
        self._slots[slot] = buf

    def _set_entries(self, slot: int, buf: _SlotBuffers, stream: int) -> None:
        self._host_embed_map[slot] = int(buf.embed_map)
        self._host_embed_rows[slot] = int(buf.embed_rows)
        self._host_embed_n[slot] = buf.embed_n
        self._host_lm_rows[slot] = int(buf.lm_rows)
        self._host_lm_ids[slot] = int(buf.lm_ids)
        self._host_lm_n[slot] = buf.lm_n
        for host, ptr in zip(self._host_tables(), self._tables):
            self.gpu.copy_h2d_async(host, ptr, stream)

    def close(self, stream: int = 0) -> None:
        """Free every slot's buffers, the tables and the scratch once ``stream`` drained (once;
        later calls do nothing). Work on other streams must be finished by the caller."""
        if self.closed or getattr(self.gpu, "closed", False):
            self.closed = True
            return
        self.gpu.synchronize(stream)
        for entry in self._slots:
            for ptr in entry.pointers() if entry is not None else ():
                self.gpu.free(ptr)
        for ptr in self._tables:
            self.gpu.free(ptr)
        if self._seq_scratch:
            self.gpu.free(self._seq_scratch)
        self._slots = [None] * self.num_slots
        self._tables = []
        self._seq_scratch = DevicePtr(0)
        self.closed = True

    def __enter__(self) -> "OverlaySlots":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- forward hooks -----------------------------------------------------------------------
    def _check_active(self, active: int) -> int:
        if isinstance(active, bool) or not hasattr(active, "__index__"):
            raise TypeError(f"active slot must be an int, got {active!r}")
        active = int(active)
        if active >= self.num_slots:
            raise ValueError(f"active slot {active} outside 0..{self.num_slots - 1} "
                             "(negative: no adapter)")
        return max(active, -1)

    def _seq_slot_host(self, seq_slot: Any, count: int) -> np.ndarray | DevicePtr:
        """Check ``seq_slot``: a host int array (or list) must have ``count`` entries, each
        < num_slots (negative = no adapter), and comes back as int32; a device pointer (or
        ``DeviceArray``) is the caller's promise; None or 0 means the uniform ``active`` slot."""
        if seq_slot is None:
            return DevicePtr(0)
        if isinstance(seq_slot, (list, tuple)):
            seq_slot = np.asarray(seq_slot, dtype=np.int64)
        if not isinstance(seq_slot, np.ndarray):
            return DevicePtr(getattr(seq_slot, "ptr", seq_slot))
        if seq_slot.shape != (count,):
            raise ValueError(f"seq_slot shape {seq_slot.shape} != ({count},)")
        if seq_slot.size and seq_slot.dtype.kind not in "iu":
            raise TypeError(f"seq_slot must be integers, got {seq_slot.dtype}")
        if seq_slot.size and int(seq_slot.max()) >= self.num_slots:
            raise ValueError(f"seq_slot holds slot {int(seq_slot.max())}, outside "
                             f"0..{self.num_slots - 1}")
        return np.maximum(seq_slot.astype(np.int64), -1).astype(np.int32)

    def _seq_slot_ptr(self, seq_slot: np.ndarray | DevicePtr, stream: int) -> DevicePtr:
        """The device pointer for a checked ``seq_slot``: host arrays go to one scratch buffer
        on ``stream`` (so host-array calls must stay on one stream at a time)."""
        if not isinstance(seq_slot, np.ndarray):
            return seq_slot
        count = int(seq_slot.size)
        if count == 0:
            return DevicePtr(0)
        if count > self._seq_capacity:
            if self._seq_scratch:
                self.gpu.synchronize(stream)  # a queued kernel may still read the old scratch
                self.gpu.free(self._seq_scratch)
                self._seq_scratch, self._seq_capacity = DevicePtr(0), 0
            self._seq_scratch = self.gpu.alloc(4 * count)
            self._seq_capacity = count
        self.gpu.copy_h2d_async(seq_slot, self._seq_scratch, stream)
        return self._seq_scratch

    def embed_overlay(self, ids: int, seq_slot: Any, active: int, out: int, num_tokens: int,
                      stream: int = 0) -> None:
        """Overlay the gathered embeddings ``out`` (``[num_tokens, h]`` bf16) in place.
        ``seq_slot``: per-token slots as a device pointer, a host int array (checked and
        uploaded; one scratch buffer, so use one stream at a time), or None / 0 for ``active``."""
        self._live()
        active = self._check_active(active)
        num_tokens = require_count(num_tokens, "num_tokens")
        seq = self._seq_slot_host(seq_slot, num_tokens)
        if num_tokens == 0 or not self.has_embed_overlay or not self.kernels.embed_overlay:
            return  # nothing to launch: no rows, every slot's tables null, or no kernel (hook)
        require_ptr(ids, "embed_overlay_routed ids")  # before a host seq_slot is uploaded
        require_ptr(out, "embed_overlay_routed out")
        embed_overlay_routed(self.gpu, self.kernels.embed_overlay, ids,
                             self._seq_slot_ptr(seq, stream), active,
                             self.embed_slot_map_tab, self.embed_rows_tab, self.embed_n_tab, out,
                             num_tokens, self.h, self.vocab, stream)

    def lmhead_overlay(self, hidden: int, seq_slot: Any, active: int, logits: int, m: int,
                       stream: int = 0, *, dtype: Any = BF16) -> None:
        """Recompute the overridden columns of ``logits`` (``[m, vocab]``, ``dtype`` bf16 or
        float32, which picks the kernel) from ``hidden`` (``[m, h]`` bf16), in place."""
        self._live()
        dtype = np.dtype(dtype)
        if dtype == BF16:
            kernel = self.kernels.lmhead_overlay_bf16
        elif dtype == F32:
            kernel = self.kernels.lmhead_overlay_f32
        else:
            raise TypeError(f"logits dtype must be bfloat16 or float32, got {dtype}")
        active = self._check_active(active)
        m = require_count(m, "m")
        seq = self._seq_slot_host(seq_slot, m)
        if m == 0 or self.max_n_override == 0 or not kernel:
            return  # nothing to launch: no rows, no LM-head overrides loaded, or no kernel (hook)
        require_ptr(hidden, "lmhead_overlay_routed hidden")  # before a host seq_slot is uploaded
        require_ptr(logits, "lmhead_overlay_routed logits")
        lmhead_overlay_routed(self.gpu, kernel, hidden, self._seq_slot_ptr(seq, stream), active,
                              self.lm_head_rows_tab,
                              self.lm_head_ids_tab, self.lm_head_n_tab, logits, m,
                              self.max_n_override, self.h, self.vocab, stream)


# -- PEFT adapter folders (layers/peft_adapter.py, which imports this module) -------------------

_PEFT_EXPORTS = ("overlay_from_peft", "read_peft_adapter", "PeftAdapter", "PeftAdapterError")


def __getattr__(name: str) -> Any:
    """``overlay_from_peft`` and the rest of ``layers.peft_adapter``'s entry points are importable
    from here too (resolved on first use: that module imports this one)."""
    if name in _PEFT_EXPORTS:
        from . import peft_adapter
        return getattr(peft_adapter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
