"""``OverlaySlots``: a fixed number of adapter slots, each made device-resident on ``load``, and
the device pointer tables the routed kernels (``embed_overlay_routed``, ``lmhead_overlay_routed``)
read to route each token to its sequence's adapter."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu_runtime import DeviceBuffer, DevicePtr, GpuBackend, validate
from gpu_runtime.backend import check_backend

from ..ops.token_overlay import MAX_LMHEAD_OVERRIDES, OverlayKernels, embed_overlay_config, lmhead_overlay_config
from .model import BF16, F32, AdapterOverlay
from .slot_buffers import SlotBuffers


def _device_table(index: int) -> property:
    """``OverlaySlots``' device pointer table ``index`` (``_host_tables`` order); ``ClosedError`` once closed."""

    def table(self: OverlaySlots) -> DevicePtr:
        """Device address of one of the pointer tables the routed kernels read, one entry per slot
        (what each table holds: the ``OverlaySlots`` docstring); ``ClosedError`` once closed."""
        return self._table(index)

    return property(table)


_NO_ENTRIES = (0, 0, 0, 0, 0, 0)  # an empty slot's entries: null tables, n = 0


class OverlaySlots:
    """A fixed number of adapter slots and the device pointer tables the routed kernels read.

    Embedding set: ``embed_slot_map_tab`` (per slot a pointer to ``int32[vocab]``, -1 where the
    id is not overridden), ``embed_rows_tab`` (pointer to ``[n, h]`` bf16), ``embed_n_tab``
    (``int32[num_slots]``). LM-head set: ``lm_head_rows_tab``, ``lm_head_ids_tab`` (pointer to
    ``int32[n]``), ``lm_head_n_tab``. An empty slot, or a table an adapter does not override,
    has null entries and n = 0. Table updates are queued on the ``stream`` given to
    ``load`` / ``evict``; a forward on another stream must be ordered after them by the caller.
    """

    def __init__(
        self,
        gpu: GpuBackend,
        num_slots: int,
        vocab: int,
        h: int,
        *,
        kernels: OverlayKernels | None = None,
        stream: int = 0,
    ) -> None:
        self.gpu = check_backend(gpu, "OverlaySlots: gpu")
        stream = validate.stream(stream, "OverlaySlots: stream")
        self.num_slots = validate.positive(num_slots, "OverlaySlots num_slots")
        self.vocab = validate.positive(vocab, "OverlaySlots vocab")
        self.h = validate.positive(h, "OverlaySlots h")
        if self.vocab > 1 << 31:
            raise ValueError(f"OverlaySlots vocab {vocab} too large for int32 slot maps")
        self.kernels = OverlayKernels.new(gpu) if kernels is None else kernels
        ns = self.num_slots
        self._host_embed_map = np.zeros(ns, np.uint64)
        self._host_embed_rows = np.zeros(ns, np.uint64)
        self._host_embed_n = np.zeros(ns, np.int32)
        self._host_lm_rows = np.zeros(ns, np.uint64)
        self._host_lm_ids = np.zeros(ns, np.uint64)
        self._host_lm_n = np.zeros(ns, np.int32)
        self._slots: list[SlotBuffers | None] = [None] * ns
        self._seq_scratch: DeviceBuffer | None = None  # host seq_slot arrays go here
        self._tables: list[DeviceBuffer] = []
        self._closed = False
        try:
            for host in self._host_tables():
                self._tables.append(DeviceBuffer.upload(gpu, host, stream))
            # The routed kernels' error word: a device seq_slot's slot past the tables (check_errors).
            self._tables.append(DeviceBuffer.upload(gpu, np.zeros(1, np.uint32), stream))
        except BaseException:
            for table in reversed(self._tables):
                table.close()
            raise

    @property
    def kernels(self) -> OverlayKernels:
        """The token-overlay kernels; setting them binds the forward hooks' ones (a missing one:
        the hook does nothing)."""
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: OverlayKernels) -> None:
        self._kernels = kernels
        self._embed_kernel = self.gpu.bind(kernels.embed_overlay) if kernels.embed_overlay else None
        self._lm_kernels = {
            dtype: self.gpu.bind(handle) if handle else None
            for dtype, handle in ((BF16, kernels.lmhead_overlay_bf16), (F32, kernels.lmhead_overlay_f32))
        }

    @property
    def _errors(self) -> DevicePtr:
        return self._tables[-1].ptr

    def check_errors(self, stream: int = 0) -> int:
        """The routed kernels' error word since the last check, then cleared: ``OVERLAY_BAD_SLOT``
        where a device ``seq_slot`` held a slot >= ``num_slots`` (those rows were skipped), else
        0. Waits for ``stream``."""
        stream = self._live(stream, "check_errors")
        word = np.zeros(1, np.uint32)
        self.gpu.copy_d2h(word, self._errors, stream)
        if word[0]:
            self.gpu.memset(self._errors, 0, 4, stream)
        return int(word[0])

    def _host_tables(self) -> tuple[np.ndarray, ...]:
        return (
            self._host_embed_map,
            self._host_embed_rows,
            self._host_embed_n,
            self._host_lm_rows,
            self._host_lm_ids,
            self._host_lm_n,
        )

    # -- device pointers for the launchers (the order of _host_tables) -----------------------------
    embed_slot_map_tab = _device_table(0)
    embed_rows_tab = _device_table(1)
    embed_n_tab = _device_table(2)
    lm_head_rows_tab = _device_table(3)
    lm_head_ids_tab = _device_table(4)
    lm_head_n_tab = _device_table(5)

    def _table(self, i: int) -> DevicePtr:
        self._live()
        return self._tables[i].ptr

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: every call then raises ``ClosedError``."""
        return self._closed

    @property
    def max_n_override(self) -> int:
        """Largest LM-head override count over the loaded slots: the lmhead grid's y extent."""
        return int(self._host_lm_n.max())

    @property
    def has_embed_overlay(self) -> bool:
        """Whether any loaded slot overrides embedding rows (else the embedding overlay can be skipped)."""
        return bool((self._host_embed_n > 0).any())

    def loaded(self, slot: int) -> AdapterOverlay | None:
        """The overlay loaded in ``slot``, None when the slot is free."""
        entry = self._slots[self._check_slot(slot)]
        return None if entry is None else entry.overlay

    def embed_row_addresses(self, slot: int, ids: Any) -> np.ndarray:
        """``uint64`` like ``ids``: the device address of each id's replacement embedding row in
        adapter ``slot``, 0 where the slot's adapter does not override that id (or the slot is
        empty). The host half of what the n-gram decoder resolves on the device: the fused path
        hands these to its GEMM's word-row epilogue. Valid until the slot is evicted."""
        self._live()
        entry = self._slots[self._check_slot(slot)]
        ids = np.asarray(ids, np.int64)
        out = np.zeros(ids.shape, np.uint64)
        if entry is None or entry.embed_rows is None:
            return out
        table = entry.overlay.embed
        assert table is not None  # embed_rows holds its rows
        j = np.minimum(np.searchsorted(table.ids, ids), table.n - 1)
        hit = table.ids[j] == ids
        out[hit] = int(entry.embed_rows) + j[hit].astype(np.uint64) * np.uint64(self.h * 2)
        return out

    # -- loading and eviction ----------------------------------------------------------------
    def _live(self, stream: Any = 0, call: str = "") -> int:
        """Raises for a closed object, then for a bad ``stream`` (of ``OverlaySlots.<call>``)."""
        validate.require_open(self._closed, "OverlaySlots")
        if type(stream) is int and stream >= 0:
            return stream
        return validate.stream(stream, f"OverlaySlots.{call}: stream")

    def _check_slot(self, slot: int) -> int:
        slot = validate.integer(slot, "slot index")
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot index {slot} outside 0..{self.num_slots - 1}")
        return slot

    def _check_overlay(self, overlay: AdapterOverlay) -> None:
        if not isinstance(overlay, AdapterOverlay):
            raise TypeError(f"expected an AdapterOverlay, got {type(overlay).__name__}")
        for which, table in (("embedding", overlay.embed), ("LM head", overlay.lm_head)):
            if table is not None:
                table.check_fits(which, self.h, self.vocab)
        if overlay.lm_head is not None and overlay.lm_head.n > MAX_LMHEAD_OVERRIDES:
            raise ValueError(  # the LM-head overlay of every slot would be refused from then on
                f"an LM-head overlay of {overlay.lm_head.n} rows: a slot holds at most {MAX_LMHEAD_OVERRIDES}"
            )
        if overlay.embed is not None and overlay.embed.n:
            self.kernels.require("embedding overlay tensors", "embed_overlay")
        if overlay.lm_head is not None and overlay.lm_head.n:
            self.kernels.require("LM-head overlay tensors", "lmhead_overlay_bf16", "lmhead_overlay_f32")

    def load(self, slot: int, overlay: AdapterOverlay, stream: int = 0) -> None:
        """Make ``overlay`` device-resident in the free ``slot`` (see ``replace`` for a used one).
        Tables with no rows stay null (n = 0): the kernels then skip that slot."""
        stream = self._live(stream, "load")
        slot = self._check_slot(slot)
        if self._slots[slot] is not None:
            raise ValueError(f"slot {slot} is in use: evict it first, or use replace()")
        self._check_overlay(overlay)
        self._upload(slot, overlay, stream)

    def replace(self, slot: int, overlay: AdapterOverlay, stream: int = 0) -> None:
        """Load ``overlay`` into ``slot`` in place of whatever it holds (validated before anything
        changes; uploaded before the old one goes, so a failed upload leaves the slot as it was),
        then free the old buffers once ``stream`` drained."""
        stream = self._live(stream, "replace")
        slot = self._check_slot(slot)
        self._check_overlay(overlay)
        old = self._slots[slot]
        self._upload(slot, overlay, stream)
        if old is not None:
            old.close(self.gpu, stream)

    def evict(self, slot: int, stream: int = 0) -> None:
        """Clear ``slot`` completely: null table entries, n = 0, its device buffers freed (after
        ``stream`` drained, so no queued kernel still reads them). A free slot is left as is."""
        stream = self._live(stream, "evict")
        slot = self._check_slot(slot)
        entry = self._slots[slot]
        if entry is None:
            return
        self._set_entries(slot, _NO_ENTRIES, stream)
        self._slots[slot] = None
        entry.close(self.gpu, stream)

    def _upload(self, slot: int, overlay: AdapterOverlay, stream: int) -> None:
        buf = SlotBuffers.upload(self.gpu, overlay, self.vocab, stream)
        self._set_entries(slot, buf.entries(), stream)
        self._slots[slot] = buf

    def _set_entries(self, slot: int, entries: tuple[int, ...], stream: int) -> None:
        for host, value, table in zip(self._host_tables(), entries, self._tables):
            host[slot] = value
            self.gpu.copy_h2d_async(host, table.ptr, stream)

    def close(self, stream: int = 0) -> None:
        """Free every slot's buffers, the scratch and the tables once ``stream`` drained (once;
        later calls do nothing). Work on other streams must be finished by the caller."""
        if self._closed:
            return
        stream = validate.stream(stream, "OverlaySlots.close: stream")
        self._closed = True
        if not self.gpu.closed:  # a closed backend freed every allocation already
            self.gpu.synchronize(stream)
        if self._seq_scratch is not None:
            self._seq_scratch.close()
        for entry in reversed(self._slots):
            if entry is not None:
                entry.close(self.gpu)
        for table in reversed(self._tables):
            table.close()
        self._slots = [None] * self.num_slots

    def __enter__(self) -> OverlaySlots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- forward hooks -----------------------------------------------------------------------
    def _check_active(self, active: int) -> int:
        active = validate.integer(active, "active slot")
        if active >= self.num_slots:
            raise ValueError(f"active slot {active} outside 0..{self.num_slots - 1} (negative: no adapter)")
        return max(active, -1)

    def _seq_slot_host(self, seq_slot: Any, count: int) -> np.ndarray | int:
        """Check ``seq_slot``: a host int array (or list) must have ``count`` entries, each
        < num_slots (negative = no adapter), and comes back as int32; a device pointer (or
        ``DeviceArray`` / ``DeviceBuffer``) is checked by the kernels (a slot past the tables skips
        its row and is reported by ``check_errors``); None or 0 means the uniform ``active`` slot."""
        if seq_slot is None:
            return 0
        if isinstance(seq_slot, (list, tuple)):
            seq_slot = np.asarray(seq_slot, dtype=np.int64)
        if not isinstance(seq_slot, np.ndarray):
            return validate.pointer(getattr(seq_slot, "ptr", seq_slot), "seq_slot", nullable=True)
        if seq_slot.shape != (count,):
            raise ValueError(f"seq_slot shape {seq_slot.shape} != ({count},)")
        if seq_slot.size and seq_slot.dtype.kind not in "iu":
            raise TypeError(f"seq_slot must be integers, got {seq_slot.dtype}")
        if seq_slot.size and int(seq_slot.max()) >= self.num_slots:
            raise ValueError(f"seq_slot holds slot {int(seq_slot.max())}, outside 0..{self.num_slots - 1}")
        return np.maximum(seq_slot.astype(np.int64), -1).astype(np.int32)

    def _seq_slot_ptr(self, seq_slot: np.ndarray | int, stream: int) -> int:
        """The device pointer for a checked ``seq_slot``: host arrays go to one scratch buffer
        on ``stream`` (so host-array calls must stay on one stream at a time)."""
        if not isinstance(seq_slot, np.ndarray):
            return seq_slot
        if seq_slot.size == 0:
            return 0
        if self._seq_scratch is None or seq_slot.nbytes > self._seq_scratch.nbytes:
            old, self._seq_scratch = self._seq_scratch, None  # none held if the alloc fails
            if old is not None:
                old.close(stream)  # a queued kernel may still read the old scratch
            self._seq_scratch = DeviceBuffer(self.gpu, seq_slot.nbytes)
        self.gpu.copy_h2d_async(seq_slot, self._seq_scratch.ptr, stream)
        return self._seq_scratch.ptr

    def embed_overlay(self, ids: int, seq_slot: Any, active: int, out: int, num_tokens: int, stream: int = 0) -> None:
        """Overlay the gathered embeddings ``out`` (``[num_tokens, h]`` bf16) in place.
        ``seq_slot``: per-token slots as a device pointer, a host int array (checked and
        uploaded; one scratch buffer, so use one stream at a time), or None / 0 for ``active``."""
        stream = self._live(stream, "embed_overlay")
        active = self._check_active(active)
        num_tokens = validate.u32(num_tokens, "num_tokens")
        seq = self._seq_slot_host(seq_slot, num_tokens)
        kernel = self._embed_kernel
        if num_tokens == 0 or not self.has_embed_overlay or kernel is None:
            return  # nothing to launch: no rows, every slot's tables null, or no kernel (hook)
        ids = validate.pointer(ids, "embed_overlay_routed ids")  # before a host seq_slot is uploaded
        out = validate.pointer(out, "embed_overlay_routed out")
        seq_ptr = self._seq_slot_ptr(seq, stream)
        tables = (self.embed_slot_map_tab, self.embed_rows_tab, self.embed_n_tab)
        args = (ids, seq_ptr, active, *tables, out, self.h, self.vocab, self.num_slots, self._errors)
        kernel.launch(embed_overlay_config(num_tokens), stream, *args)

    def lmhead_overlay(
        self, hidden: int, seq_slot: Any, active: int, logits: int, m: int, stream: int = 0, *, dtype: Any = BF16
    ) -> None:
        """Recompute the overridden columns of ``logits`` (``[m, vocab]``, ``dtype`` bf16 or
        float32, which picks the kernel) from ``hidden`` (``[m, h]`` bf16), in place."""
        stream = self._live(stream, "lmhead_overlay")
        dtype = np.dtype(dtype)
        if dtype not in self._lm_kernels:
            raise TypeError(f"logits dtype must be bfloat16 or float32, got {dtype}")
        kernel = self._lm_kernels[dtype]
        active = self._check_active(active)
        m = validate.u32(m, "m")
        seq = self._seq_slot_host(seq_slot, m)
        if m == 0 or self.max_n_override == 0 or kernel is None:
            return  # nothing to launch: no rows, no LM-head overrides loaded, or no kernel (hook)
        hidden = validate.pointer(hidden, "lmhead_overlay_routed hidden")  # before a host seq_slot is uploaded
        logits = validate.pointer(logits, "lmhead_overlay_routed logits")
        seq_ptr = self._seq_slot_ptr(seq, stream)
        tables = (self.lm_head_rows_tab, self.lm_head_ids_tab, self.lm_head_n_tab)
        args = (hidden, seq_ptr, active, *tables, logits, self.h, self.vocab, self.num_slots, self._errors)
        kernel.launch(lmhead_overlay_config(m, self.max_n_override), stream, *args)
