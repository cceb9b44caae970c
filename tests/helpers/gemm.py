"""GEMM tests' shared pieces: the device limit the launch plans must respect, recording backends
that compile for sm_90a (so plans may pick the wgmma and TMA kernels), and ``assert_refused`` (a
launcher's bad arguments refused before any launch)."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from layers.kernel_files import load_kernel
from tests.helpers.fakes import RecordingBackend, refused

MAX_SHARED_OPTIN = 232448  # H100/H200 per-block opt-in limit


def assert_refused(launcher: Callable[..., Any], kernel: str, error: type[Exception], match: str, *args: Any,
                   **kwargs: Any) -> None:
    """``launcher(gpu, <gemm.cu's kernel>, *args, **kwargs)`` on a fresh ``RecordingBackend``
    raises ``error`` (matching ``match``) before it launches anything or touches device memory."""
    gpu = RecordingBackend()
    handle = load_kernel(gpu, "gemm", kernel)
    with refused(gpu, error, match):
        launcher(gpu, handle, *args, **kwargs)


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
