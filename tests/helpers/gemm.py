"""GEMM tests' shared pieces: the device limit the launch plans must respect, and a recording
backend that compiles for sm_90a (so plans may pick the wgmma kernels)."""

from __future__ import annotations

from tests.fakes import RecordingBackend

MAX_SHARED_OPTIN = 232448  # H100/H200 per-block opt-in limit


class Sm90aBackend(RecordingBackend):
    """A recording backend that says it compiles for sm_90a (wgmma available)."""

    target = "sm_90a"
