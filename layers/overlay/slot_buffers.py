"""``SlotBuffers``: the device buffers of one adapter loaded into an ``OverlaySlots`` slot."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpu_runtime import DeviceBuffer, GpuBackend

from .model import AdapterOverlay


@dataclass
class SlotBuffers:
    """Device buffers of one loaded slot (None where a table has no overlay)."""

    overlay: AdapterOverlay
    embed_map: DeviceBuffer | None = None
    embed_rows: DeviceBuffer | None = None
    lm_rows: DeviceBuffer | None = None
    lm_ids: DeviceBuffer | None = None

    @classmethod
    def upload(cls, gpu: GpuBackend, overlay: AdapterOverlay, vocab: int, stream: int) -> SlotBuffers:
        """Allocate and fill the buffers of ``overlay`` on ``stream``; tables with no rows stay
        null (n = 0). On a failure, what was allocated is freed before the error propagates."""
        buf = cls(overlay)
        try:
            emb = overlay.embed
            if emb is not None and emb.n:
                slot_map = np.full(vocab, -1, np.int32)
                slot_map[emb.ids] = np.arange(emb.n, dtype=np.int32)
                buf.embed_map = DeviceBuffer.upload(gpu, slot_map, stream)
                buf.embed_rows = DeviceBuffer.upload(gpu, emb.rows, stream)
            lm = overlay.lm_head
            if lm is not None and lm.n:
                buf.lm_rows = DeviceBuffer.upload(gpu, lm.rows, stream)
                buf.lm_ids = DeviceBuffer.upload(gpu, lm.ids, stream)
        except BaseException:
            buf.close(gpu, stream)
            raise
        return buf

    @property
    def embed_n(self) -> int:
        emb = self.overlay.embed  # not None where embed_rows is not
        return emb.n if emb is not None and self.embed_rows is not None else 0

    @property
    def lm_n(self) -> int:
        lm = self.overlay.lm_head  # not None where lm_rows is not
        return lm.n if lm is not None and self.lm_rows is not None else 0

    def entries(self) -> tuple[int, int, int, int, int, int]:
        """This slot's entry in each of ``OverlaySlots``' six tables (``OverlaySlots._host_tables`` order)."""

        def address(buf: DeviceBuffer | None) -> int:
            return 0 if buf is None else int(buf)

        return (
            address(self.embed_map),
            address(self.embed_rows),
            self.embed_n,
            address(self.lm_rows),
            address(self.lm_ids),
            self.lm_n,
        )

    def close(self, gpu: GpuBackend, stream: int | None = None) -> None:
        """Free the buffers, newest first; with ``stream``, once the work queued on it (which may
        read them) is done. Without, the caller has drained every stream that reads them."""
        if stream is not None and not gpu.closed:
            gpu.synchronize(stream)
        for buf in (self.lm_ids, self.lm_rows, self.embed_rows, self.embed_map):
            if buf is not None:
                buf.close()
