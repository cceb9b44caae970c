"""GEMM tests' shared pieces: the device limit the launch plans must respect, and recording
backends that compile for sm_90a (so plans may pick the wgmma and TMA kernels)."""

from __future__ import annotations

import struct

from tests.fakes import RecordingBackend

MAX_SHARED_OPTIN = 232448  # H100/H200 per-block opt-in limit


class Sm90aBackend(RecordingBackend):
    """A recording backend that says it compiles for sm_90a (wgmma available, no tensor maps)."""

    target = "sm_90a"


def fake_tensor_map(address: int, rows: int, cols: int, box_rows: int, box_cols: int) -> bytes:
    """128 bytes that say what they describe, in place of a driver-encoded ``CUtensorMap``."""
    return struct.pack("<5Q", address, rows, cols, box_rows, box_cols).ljust(128, b"\0")


class TmaBackend(Sm90aBackend):
    """``Sm90aBackend`` with ``TensorMaps`` (fake maps): plans may pick the TMA kernels."""

    sm_count = 132

    def tensor_map_2d(self, address: int, rows: int, cols: int, box_rows: int, box_cols: int) -> bytes:
        return fake_tensor_map(address, rows, cols, box_rows, box_cols)
