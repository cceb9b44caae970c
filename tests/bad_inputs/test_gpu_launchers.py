"""One launcher per kernel module on the device, on guarded buffers of random bytes: the refusal
(or no-op) writes nothing, then the backend and the launcher still give the right answer."""

from __future__ import annotations

import numpy as np
import pytest

from layers.kernel_files import load_kernel
from layers.dense_weight import BF16, DenseWeight
from tests.bad_inputs.cases import GPU_LAUNCH_CASES
from tests.bad_inputs.cases.launchers import CLOSED_BACKEND
from tests.bad_inputs.device import GemmRig, assert_backend_usable


@pytest.mark.gpu
@pytest.mark.parametrize("rig_type, over, exc, match", GPU_LAUNCH_CASES)
def test_gpu_launcher_refusal(gpu, closed_backend, rng, rig_type, over, exc, match):
    rig = rig_type(gpu, rng)
    try:
        kernel = load_kernel(gpu, rig.module, rig.kernel)
        before = rig.raw()
        if over == CLOSED_BACKEND:
            backend, over = closed_backend, {}
        else:
            backend = gpu
        if over.get("w", 0) is None:
            over = {"w": DenseWeight(rig.w.ptr, (GemmRig.N, GemmRig.K + 1), BF16)}
        if exc is None:
            rig.call(backend, kernel, **over)
        else:
            with pytest.raises(exc, match=match):
                rig.call(backend, kernel, **over)
        for a, b in zip(rig.raw(), before):
            np.testing.assert_array_equal(a, b)
        assert_backend_usable(gpu, rng)
        rig.good(kernel)
        for g in rig.bufs:
            g.assert_guards_intact()
    finally:
        rig.close()

