"""residual_add.cu against the numpy reference: bit-exact, aligned and unaligned."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from layers import reference as ref
from layers.kernel_files import load_kernel
from layers.ops.residual import residual_add, scaled_add
from tests.helpers import Guarded, bits, random_bf16

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, (1 << 20) + 5])
@pytest.mark.parametrize("scale", [1 / 17, -0.37, 1e-30, 0.0, 3.0])
@pytest.mark.parametrize("misalign", [0, 2])
def test_scaled_add_bit_exact(gpu, rng, n, scale, misalign):
    kernel = load_kernel(gpu, "residual_add", "bf16_scaled_add")
    out0, x = random_bf16(rng, n, 4.0), random_bf16(rng, n)
    # every 4th element from -0.0 with a positive x: the result's bits differ from out0's at any
    # scale (+0.0 at scale 0, scale * x otherwise), so an element left unwritten cannot pass
    out0[::4] = -0.0
    x[::4] = np.maximum(np.abs(x[::4].astype(np.float32)), 0.5).astype(BF16)
    want = ref.scaled_add(out0, x, scale)
    assert (bits(want)[::4] != bits(out0)[::4]).all()
    with Guarded(gpu, n, BF16, rng, misalign) as o, Guarded(gpu, n, BF16, rng) as g:
        o.upload(out0), g.upload(x)
        scaled_add(gpu, kernel, o.ptr, g.ptr, scale, n, 0)
        np.testing.assert_array_equal(bits(o.read()), bits(want))
        o.assert_guards_intact()
        g.assert_guards_intact()


@pytest.mark.parametrize("n", [1, 15, 4096, 100003])
@pytest.mark.parametrize("misalign", [0, 6])
def test_residual_add_bit_exact(gpu, rng, n, misalign):
    kernel = load_kernel(gpu, "residual_add", "bf16_residual_add")
    out0, x = random_bf16(rng, n, 3.0), random_bf16(rng, n)
    with Guarded(gpu, n, BF16, rng, misalign) as o, Guarded(gpu, n, BF16, rng, misalign) as g:
        o.upload(out0), g.upload(x)
        residual_add(gpu, kernel, o.ptr, g.ptr, n, 0)
        np.testing.assert_array_equal(bits(o.read()), bits(ref.residual_add(out0, x)))
        o.assert_guards_intact()
