"""Every case table, by area. The CPU test runs ``CPU_CASES`` (each followed by its row's good
call in ``AFTER``); ``CUDA_CASES`` run offline on CPU and on the device; ``GPU_LAUNCH_CASES`` on
the device; docs/BAD_INPUT.md's table is generated from all three."""

from __future__ import annotations

from collections.abc import Callable

from tests.bad_inputs.cases import engram, launchers, loaders, ngram, overlays, runtime, tables, weights
from tests.bad_inputs.world import World

AREAS = (runtime, launchers, weights, ngram, loaders, tables, overlays, engram)
CPU_CASES = [entry for area in AREAS for entry in area.CPU_CASES]
AFTER: dict[str, Callable[[World], None]] = {row: call for area in AREAS for row, call in area.AFTER.items()}
CUDA_CASES = runtime.CUDA_CASES
GPU_LAUNCH_CASES = launchers.GPU_LAUNCH_CASES
