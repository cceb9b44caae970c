"""The decoder serving tests' shared pieces (test_decoder_engine.py, test_decoder_foreign_arrays.py):
made-up device pointers ``P`` and ``recording``, an ``NgramDecoder`` (optionally with adapter
slots) on a recording backend."""

from __future__ import annotations

import numpy as np

from gpu_runtime import DevicePtr
from layers.ngram_embed import NgramDecoder
from layers.overlay import OverlaySlots
from tests.helpers.fakes import RecordingBackend
from tests.helpers.ngram import device_weights, random_layer, small_dims

P = [DevicePtr(0x100000 * (i + 1)) for i in range(8)]


def recording(adapters: int = 0, h: int | None = None):
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=3, splits=2, eos_id=7)
    weights = device_weights(gpu, random_layer(np.random.default_rng(1), dims, "bf"))
    slots = OverlaySlots(gpu, adapters, dims.vocab_size, h or dims.hidden_size) if adapters else None
    return gpu, NgramDecoder(weights, max_seqs=4, max_rows=32, max_draft=2, adapter_slots=slots), slots
