"""``CudaBackend``'s cases on the device: nothing written, and the backend still usable."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from tests.bad_inputs.cases import CUDA_CASES
from tests.bad_inputs.cases.runtime import run_cuda_case
from tests.bad_inputs.device import assert_backend_usable
from tests.bad_inputs.offline import Target
from tests.helpers import Guarded


@pytest.mark.gpu
@pytest.mark.parametrize("fn, exc, match, gpu_only", CUDA_CASES)
def test_gpu_cuda_backend_refusal(gpu, closed_backend, rng, fn, exc, match, gpu_only):
    """The ``CudaBackend`` cases on the device: the 4 KiB target (random bytes, in a guarded
    allocation), the pinned buffer and the host array are bit for bit unchanged afterwards."""
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(gpu.synchronize)  # runs first: nothing queued may outlive the buffers
        stream = gpu.create_stream()
        cleanup.callback(gpu.destroy_stream, stream)
        event = gpu.create_event()
        cleanup.callback(gpu.destroy_event, event)
        pinned = gpu.alloc_host(4096)
        cleanup.callback(gpu.free_host, pinned)
        buf = cleanup.enter_context(Guarded(gpu, 4096, np.uint8, rng))
        cleanup.callback(gpu.synchronize)
        pinned[:] = rng.integers(0, 256, 4096, dtype=np.uint8)
        target = Target(buf.ptr, pinned, rng.integers(0, 256, 64, dtype=np.uint8), stream, event,
                        closed_backend)
        before, pinned_before, host_before = buf.raw(), pinned.copy(), target.host.copy()
        run_cuda_case(gpu, target, fn, exc, match)
        gpu.synchronize()
        np.testing.assert_array_equal(buf.raw(), before)
        np.testing.assert_array_equal(pinned, pinned_before)
        np.testing.assert_array_equal(target.host, host_before)
        assert_backend_usable(gpu, rng)

