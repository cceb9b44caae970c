"""``CudaBackend``'s cases on an offline backend: each refusal comes before the driver."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bad_inputs.cases import CUDA_CASES
from tests.bad_inputs.cases.runtime import run_cuda_case
from tests.bad_inputs.offline import offline_backends


@pytest.mark.parametrize("fn, exc, match, gpu_only", [p for p in CUDA_CASES if not p.values[3]])
def test_offline_cuda_backend_refuses_before_the_driver(monkeypatch, rng, fn, exc, match, gpu_only):
    """``CudaBackend``'s checks with no device: any driver call raises ``DriverReached``, so a
    passing case refused (or did nothing) without reaching the driver. (Cases that need the
    driver's answer, ``gpu_only``, run on the device only.)"""
    backend, target = offline_backends(monkeypatch, rng)
    pinned, host = target.pinned.copy(), target.host.copy()
    run_cuda_case(backend, target, fn, exc, match)
    np.testing.assert_array_equal(target.pinned, pinned)
    np.testing.assert_array_equal(target.host, host)

