"""residual_add.cu against the numpy reference: bit-exact, aligned and unaligned."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from layers import reference as ref
from layers.kernel_files import load_kernel
from layers.ops.residual import residual_add, scaled_add
from tests.helpers import TOO_SLOW_UNDER_SANITIZER, Guarded, bits, random_bf16

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


@TOO_SLOW_UNDER_SANITIZER
@pytest.mark.parametrize("misalign", [0, 2])
def test_scaled_add_near_the_u32_limit_adds_each_element_once(gpu, rng, misalign):
    """n = 2**32 - 5 (8 GiB a tensor): each element added exactly once. A 32-bit index plus the
    grid stride (2**20) wrapped below n there, and the threads added again for good (a hang)."""
    n = (1 << 32) - 5
    kernel = load_kernel(gpu, "residual_add", "bf16_scaled_add")
    o_byte, x_byte = (int(b) for b in rng.choice(np.arange(0x38, 0x40), 2))  # bf16 0x3838..0x3f3f: 4e-5..0.75
    nbytes = 2 * n + 16
    out, x = gpu.alloc(nbytes), gpu.alloc(nbytes)
    try:
        o_ptr, x_ptr = out.offset(misalign), x.offset(misalign)
        gpu.memset(out, o_byte, nbytes)
        gpu.memset(x, x_byte, nbytes)
        scaled_add(gpu, kernel, o_ptr, x_ptr, 1.0, n, 0)
        got = np.empty(n + 4, np.uint16)  # and 4 past the end, which stay as they were
        gpu.copy_d2h(got, o_ptr)
        one = lambda byte: np.array([byte * 0x101], np.uint16).view(BF16)  # noqa: E731
        want = bits(ref.scaled_add(one(o_byte), one(x_byte), 1.0))[0]
        assert want != o_byte * 0x101 and (got[n:] == o_byte * 0x101).all()
        assert (got[:n] == want).all(), f"{np.count_nonzero(got[:n] != want)} elements not added exactly once"
    finally:
        gpu.synchronize(0)
        gpu.free(out)
        gpu.free(x)
