"""CPU tests that pin the Engram references (``layers.reference.engram``) to values worked out
without them: hand cases with the arithmetic in the comments, exhaustive sweeps against exact
products rounded by a rule written here, the fp8 GEMM against a loop over exact rationals,
properties on random inputs (the ``rng`` fixture: replayable seeds), and every refusal."""

from __future__ import annotations

import math
from fractions import Fraction
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from layers import reference as ref
from layers.reference import (
    act_quant,
    dequant_rows,
    dequant_weight,
    emb_from_rows,
    engram_layer_ref,
    gate_ref,
    wkv_fp64,
    wkv_ref,
)
from tests.helpers import bits, random_bf16, random_fp8
from tests.helpers.refusals import assert_refused

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


def bf16(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).astype(BF16)


def fp8(values) -> np.ndarray:
    """e4m3 of values it holds exactly (checked)."""
    out = np.asarray(values, dtype=np.float64).astype(FP8)
    assert (out.astype(np.float64) == np.asarray(values, dtype=np.float64)).all(), "not an e4m3 value"
    return out


def round_bf16(x: float) -> float:
    """``x`` (a float64, so exactly known) rounded to bf16 by the rule itself: nearest, ties to even,
    8 significant bits, the subnormal grid ``2**-133`` below ``2**-126``, inf from ``2**128 - 2**119``
    (half an ulp past the largest); every step below is exact in float64."""
    a = abs(x)
    if a >= 2.0**128 - 2.0**119:
        return math.copysign(math.inf, x)
    ulp = 2.0 ** (max(math.frexp(a)[1] - 1, -126) - 7)
    n = math.floor(a / ulp)
    rest = a / ulp - n
    n += rest > 0.5 or (rest == 0.5 and n % 2 == 1)
    return math.copysign(n * ulp, x)


# -- dequant_rows ----------------------------------------------------------------------------------------
def test_dequant_rows_multiplies_each_block_by_two_to_its_byte_minus_127():
    # block 0 byte 130: x 2**3 = 8; block 1 byte 127: x 1; every product is exact in bf16
    values = [1.0, -1.5, 0.5, 448.0, 2.0**-9, 0.0, -0.0, 3.25]  # 2**-9: the smallest e4m3 subnormal
    row = fp8([values * 4 + values[::-1] * 4])
    out = dequant_rows(row, np.array([[130, 127]], np.uint8)).astype(np.float64)
    np.testing.assert_array_equal(out[0, :8], [8.0, -12.0, 4.0, 3584.0, 2.0**-6, 0.0, -0.0, 26.0])
    np.testing.assert_array_equal(out[0, 32:40], values[::-1])
    assert np.signbit(out[0, 6]) and not np.signbit(out[0, 5])  # -0.0 stays -0.0


def test_dequant_rows_at_the_ends_of_the_byte_range():
    # byte 0 is 2**-127 (an f32 subnormal), not 0; bf16 keeps 8 bits down to 2**-126, then the 2**-133 grid
    values = [1.0, 448.0, 2.0**-9, 5 * 2.0**-9, 12 * 2.0**-9, 10 * 2.0**-9, 2.0, -2.0]
    row = fp8([values * 4])
    low = dequant_rows(row, np.array([[0]], np.uint8)).astype(np.float64)[0, :8]
    assert low[0] == 2.0**-127  # 64 * 2**-133: exact
    assert low[1] == 448 * 2.0**-127  # 1.75 * 2**-119: normal, exact
    assert low[2] == 0.0  # 2**-136 = 0.125 * 2**-133: rounds to 0
    assert low[3] == 2.0**-133  # 5 * 2**-136 = 0.625 * 2**-133: rounds up to 2**-133
    assert low[4] == 2 * 2.0**-133  # 12 * 2**-136 = 1.5 * 2**-133: a tie, to even (2)
    assert low[5] == 2.0**-133  # 10 * 2**-136 = 1.25 * 2**-133: rounds down
    # byte 254 is 2**127: 2 * 2**127 = 2**128 overflows the f32 product to inf
    high = dequant_rows(row, np.array([[254]], np.uint8)).astype(np.float64)[0, :8]
    assert high[0] == 2.0**127 and high[6] == math.inf and high[7] == -math.inf
    assert high[1] == math.inf  # 448 * 2**127 = 1.75 * 2**135


def test_dequant_rows_is_the_rounded_exact_product_for_every_value_and_byte():
    """All 254 finite e4m3 values (and both zeros) times all 255 finite scale bytes: bf16 of the
    exact product by ``round_bf16`` (a product past the f32 range is inf: the kernel's f32 product
    overflows before the bf16 rounding; exact products have 4 bits, so none lies in between)."""
    raw = np.arange(256, dtype=np.uint8)
    raw = raw[(raw & 0x7F) != 0x7F]  # the two NaNs out: 254 values
    weight = np.tile(raw, (255, 1))  # row b: every value, scale byte b
    scale = np.arange(255, dtype=np.uint8)[:, None]
    out = dequant_rows(weight, scale, block=254).astype(np.float64)
    values = raw.view(FP8).astype(np.float64).tolist()
    for b in range(255):
        factor = 2.0 ** (b - 127)  # v * factor is exact in float64 (4 bits, exponent within -136..136)
        expect = [round_bf16(v * factor) if abs(v * factor) < 2.0**128 else math.copysign(math.inf, v) for v in values]
        np.testing.assert_array_equal(out[b], expect, err_msg=f"byte {b}")


def test_dequant_rows_takes_bytes_or_typed_arrays(rng):
    weight = random_fp8(rng, (3, 64))
    scale = rng.integers(100, 150, (3, 2), dtype=np.uint8)
    want = dequant_rows(weight, scale)
    np.testing.assert_array_equal(bits(dequant_rows(weight.view(np.uint8), scale)), bits(want))
    np.testing.assert_array_equal(bits(dequant_rows(weight, scale.view(E8M0))), bits(want))
    # in the normal range every entry is the product itself
    exact = weight.astype(np.float64) * 2.0 ** (np.repeat(scale, 32, axis=1).astype(np.float64) - 127)
    np.testing.assert_array_equal(want.astype(np.float64), exact)


def test_dequant_rows_refuses_a_nan_scale_naming_its_row(rng):
    scale = rng.integers(100, 150, (3, 2), dtype=np.uint8)
    scale[1, 1] = 255
    with pytest.raises(ValueError, match=r"dequant_rows: scale\[1, 1\] is 255 \(e8m0 NaN\): row 1"):
        dequant_rows(random_fp8(rng, (3, 64)), scale)


# -- emb_from_rows ---------------------------------------------------------------------------------------
def test_emb_from_rows_lays_out_hash_column_then_row(rng):
    table = random_fp8(rng, (7, 64))
    scale = rng.integers(110, 140, (7, 2), dtype=np.uint8)
    ids = rng.integers(0, 7, (4, 3))
    emb = emb_from_rows(table, scale, ids)
    assert emb.shape == (4, 3 * 64) and emb.dtype == BF16
    rows = dequant_rows(table, scale)
    for t in range(4):
        for c in range(3):
            np.testing.assert_array_equal(bits(emb[t, 64 * c : 64 * (c + 1)]), bits(rows[ids[t, c]]))


def test_emb_from_rows_reads_only_the_rows_named(rng):
    """A 255 byte in a row no id names is never read; one in a named row is refused, naming it."""
    table = random_fp8(rng, (6, 32))
    scale = rng.integers(110, 140, (6, 1), dtype=np.uint8)
    scale[4, 0] = 255
    ids = np.array([[0, 1], [2, 3]], np.int32)
    assert emb_from_rows(table, scale, ids).shape == (2, 64)
    with pytest.raises(ValueError, match=r"emb_from_rows: table_scale row 4 \(row_ids\[1, 0\]\) holds a 255 byte"):
        emb_from_rows(table, scale, np.array([[0, 1], [4, 3]]))


# -- act_quant -------------------------------------------------------------------------------------------
def test_act_quant_hand_blocks():
    x = np.zeros((1, 128))
    # block 0: amax 3.5 -> 3.5 / 448 = 2**-7 exactly -> scale 2**-7; q = x * 128:
    #   3.5 -> 448; 1.0 -> 128; bf16(0.3) = 0.30078125 -> 38.5 -> e4m3 steps of 4 in [32, 64) -> 40
    x[0, :3] = [3.5, 1.0, 0.30078125]
    # block 1: amax 56 = 448 * 2**-3, on the boundary -> scale 2**-3 (not 2**-2): 56 -> 448, -1 -> -8
    x[0, 32:34] = [56.0, -1.0]
    # block 2: amax 57 -> log2(57 / 448) = -2.97 -> scale 2**-2: 57 -> 228 (e4m3 steps of 16 in [128, 256): 224)
    x[0, 64] = 57.0
    # block 3: amax 1e-6 < 1e-4 -> 1e-4 / 448 = 2**-22.09 -> scale 2**-22: bf16(1e-6) * 2**22 = 4.19 -> 4.0
    x[0, 96] = 1e-6
    q, scales = act_quant(bf16(x))
    np.testing.assert_array_equal(scales, [[2.0**-7, 2.0**-3, 2.0**-2, 2.0**-22]])
    assert scales.dtype == np.float32 and q.dtype == FP8 and q.shape == (1, 128)
    np.testing.assert_array_equal(q.astype(np.float64)[0, [0, 1, 2, 32, 33, 64, 96]], [448, 128, 40, 448, -8, 224, 4])
    assert not q.astype(np.float64)[0, [3, 34, 65, 97]].any()


def test_act_quant_zero_block_gets_the_floor_scale():
    q, scales = act_quant(bf16(np.zeros((2, 32))))
    assert (scales == 2.0**-22).all() and not q.astype(np.float64).any()


def test_act_quant_scale_equals_deepseeks_float32_bit_trick():
    """Every finite bf16 magnitude as a block's amax: the exact ``2**ceil(log2(max(amax, 1e-4) / 448))``
    equals the reference kernel's ``fast_round_scale``: the exponent of ``f32(max(amax, f32(1e-4)) *
    f32(1/448))``, plus one where its mantissa bits are not all 0."""
    magnitudes = np.arange(0x7F80, dtype=np.uint16).view(BF16)  # +0 .. the largest finite
    x = np.zeros((magnitudes.size, 32), BF16)
    x[:, 5] = magnitudes
    x[1::2, 5] = -x[1::2, 5]  # the sign plays no part
    _, scales = act_quant(x)
    amax = np.maximum(np.abs(x[:, 5].astype(np.float32)), np.float32(1e-4))
    word = (amax * np.float32(1 / 448)).view(np.uint32)
    exponent = ((word >> 23) & 0xFF).astype(np.int64) - 127 + ((word & 0x7FFFFF) != 0)
    np.testing.assert_array_equal(scales[:, 0], np.ldexp(np.float32(1), exponent))


def test_dequantised_rows_requantise_losslessly(rng):
    """Rows from ``dequant_rows`` whose blocks have amax >= 1e-4 come back exactly: the scale is the
    row's ``2**(byte-127)`` times a power of two that keeps every 4-bit e4m3 value representable."""
    table = random_fp8(rng, (16, 256))
    table[:, ::32] = fp8(rng.choice([1.0, -1.5, 7.0, -448.0, 96.0], (16, 8)))  # every block's amax >= 1
    scale = rng.integers(114, 141, (16, 8), dtype=np.uint8)  # >= 2**-13 > 1e-4
    emb = dequant_rows(table, scale)
    q, scales = act_quant(emb)
    back = q.astype(np.float64) * np.repeat(scales.astype(np.float64), 32, axis=1)
    np.testing.assert_array_equal(back, emb.astype(np.float64))


def test_a_block_below_the_amax_floor_loses_bits():
    # byte 97: 2**-30; 1.125 * 2**-30 = 1.05e-9 < 1e-4 -> scale 2**-22, q = 1.125 * 2**-8 = 2.25 * 2**-9,
    # below the e4m3 normals (2**-6): subnormal steps of 2**-9 -> 2 * 2**-9; back: 2**-30, not 1.125 * 2**-30
    emb = dequant_rows(fp8([[1.125] + [0.0] * 31]), np.array([[97]], np.uint8))
    assert emb.astype(np.float64)[0, 0] == 1.125 * 2.0**-30
    q, scales = act_quant(emb)
    assert scales[0, 0] == 2.0**-22 and q.astype(np.float64)[0, 0] == 2 * 2.0**-9
    assert q.astype(np.float64)[0, 0] * scales[0, 0] == 2.0**-30


# -- dequant_weight --------------------------------------------------------------------------------------
def test_dequant_weight_hand_blocks():
    # [33, 40]: 2 x 2 blocks (the last row and the last 8 columns a partial block)
    weight = fp8(np.full((33, 40), 1.5))
    scale = np.array([[127, 130], [120, 0]], np.uint8)
    out = dequant_weight(weight, scale)
    assert out.dtype == np.float32 and out.shape == (33, 40)
    want = np.empty((33, 40))
    want[:32, :32] = 1.5  # x 2**0
    want[:32, 32:] = 12.0  # x 2**3
    want[32, :32] = 1.5 * 2.0**-7  # 0.01171875
    want[32, 32:] = 1.5 * 2.0**-127  # an f32 subnormal, exact (3 * 2**-128 on the 2**-149 grid)
    np.testing.assert_array_equal(out.astype(np.float64), want)
    as_bf16 = dequant_weight(weight, scale, dtype=ml_dtypes.bfloat16)
    assert as_bf16.dtype == BF16
    np.testing.assert_array_equal(as_bf16.astype(np.float64), want)  # 96 * 2**-133: exact in bf16 too


def test_dequant_weight_matches_a_loop_over_blocks(rng):
    weight = random_fp8(rng, (70, 45))
    scale = rng.integers(90, 160, (3, 2), dtype=np.uint8)
    out = dequant_weight(weight.view(np.uint8), scale.view(E8M0))
    for n in range(70):
        for k in range(45):
            assert out[n, k] == float(weight[n, k]) * 2.0 ** (int(scale[n // 32, k // 32]) - 127)


def test_dequant_weight_refuses_a_nan_scale_naming_its_block(rng):
    scale = rng.integers(100, 150, (2, 2), dtype=np.uint8)
    scale[1, 0] = 255
    with pytest.raises(ValueError, match=r"scale\[1, 0\] is 255 \(e8m0 NaN\): the block of rows 32.. and columns 0.."):
        dequant_weight(random_fp8(rng, (40, 64)), scale)


# -- wkv -------------------------------------------------------------------------------------------------
def loop_wkv(q: np.ndarray, q_scales: np.ndarray, weight: np.ndarray, weight_scales: np.ndarray) -> list:
    """``kv[m][n]`` as exact rationals, straight from the definition, with the sum of the terms'
    magnitudes (what bounds a float64 sum's error)."""
    m, k = q.shape
    n = weight.shape[0]
    out = []
    for i in range(m):
        row = []
        for j in range(n):
            total, magnitude = Fraction(0), Fraction(0)
            for c in range(k):
                a = Fraction(float(q[i, c])) * Fraction(float(q_scales[i, c // 32]))
                w = Fraction(float(weight[j, c])) * Fraction(2) ** (int(weight_scales[j // 32, c // 32]) - 127)
                total += a * w
                magnitude += abs(a * w)
            row.append((total, magnitude))
        out.append(row)
    return out


def test_wkv_fp64_matches_the_exact_sum(rng):
    q, q_scales = act_quant(random_bf16(rng, (3, 64), scale=5.0))
    weight = random_fp8(rng, (40, 64))
    weight_scales = rng.integers(0, 255, (2, 2), dtype=np.uint8)  # the whole range: fp64 never overflows here
    got = wkv_fp64(q, q_scales, weight, weight_scales)
    exact = loop_wkv(q, q_scales, weight, weight_scales)
    assert got.dtype == np.float64 and got.shape == (3, 40)
    for i in range(3):
        for j in range(40):
            total, magnitude = exact[i][j]
            assert abs(Fraction(got[i, j]) - total) <= magnitude * Fraction(64, 2**53), (i, j)


def test_wkv_ref_rounds_the_float64_sum_once():
    # block 0: 1 and 2**-8, amax 1 -> scale 2**ceil(log2(1/448)) = 2**-8: q = 256 and 1
    # block 1: 2**-14 (6.1e-5 < 1e-4) -> scale 2**-22: q = 256, exact
    emb = np.zeros((1, 64))
    emb[0, [0, 1, 32]] = [1.0, 2.0**-8, 2.0**-14]
    weight = np.zeros((1, 64))
    weight[0, [0, 1, 32]] = 1.0
    weight_scales = np.array([[127, 111]], np.uint8)  # block 1 x 2**-16
    # kv = 256 * 2**-8 + 1 * 2**-8 + 256 * 2**-22 * 2**-16 = 1 + 2**-8 + 2**-30: just above the bf16 midpoint
    # of 1 and 1 + 2**-7, so bf16 is 1 + 2**-7; via float32 (1 + 2**-8, a tie, to even) it would be 1.0
    exact = wkv_fp64(*act_quant(bf16(emb)), fp8(weight), weight_scales)
    assert exact[0, 0] == 1 + 2.0**-8 + 2.0**-30
    assert wkv_ref(bf16(emb), fp8(weight), weight_scales).astype(np.float64)[0, 0] == 1 + 2.0**-7


@pytest.mark.parametrize("scale", [1.0, 2.0**-130, 2.0**120])  # normal, subnormal, near the overflow
def test_float64_to_bf16_rounds_once(rng, scale):
    """``bf16_of_f64`` (which ``wkv_ref`` and ``gate_ref`` round with) is one rounding, not two via
    float32, whatever ml_dtypes' version: near-midpoints of random bf16 pairs, each checked by
    ``round_bf16``, with exact values, ties, zeros, infinities and NaN among them."""
    base = random_bf16(rng, 4000, scale=100.0).astype(np.float64) * scale
    spacing = np.where(np.abs(base) < 2.0**-126, 2.0**-133, 2.0 ** (np.floor(np.log2(np.abs(base) + 1e-300)) - 7))
    nudge = rng.choice([-1.0, 0.0, 1.0], base.size) * 2.0 ** -rng.integers(17, 40, base.size)
    x = base + spacing * (0.5 + nudge)
    x[:40] = base[:40]  # exact
    x[40:50] = [0.0, -0.0, np.inf, -np.inf, 2.0**128, -(2.0**128 - 2.0**119), 2.0**128 - 2.0**120, 1e-300, -1e-300, 3.0]
    got = ref.bf16_of_f64(x).astype(np.float64)
    np.testing.assert_array_equal(got, [round_bf16(v) for v in x.tolist()])
    assert np.isnan(ref.bf16_of_f64(np.array([np.nan])).astype(np.float64)).all()
    if scale != 2.0**120:
        with np.errstate(over="ignore"):  # through float32: two roundings (2**128 overflows there)
            twice = x.astype(np.float32).astype(BF16).astype(np.float64)
        assert (got != twice).any()  # the case the test is for


# -- gate_ref --------------------------------------------------------------------------------------------
def sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


def test_gate_hand_cases():
    """D = 2, hc_mult = 1, w = q_weight * k_weight = [2 * 0.5, 0.5 * 4] = [1, 2], value = [2, -4]."""
    x = bf16([[[1, 1]], [[1, -1]], [[2, -1]], [[-0.0, -0.0]], [[-0.0, 3]]])
    kv = bf16([[1, 1, 2, -4], [2, 2, 2, -4], [1, 1, 2, -4], [1, 1, 2, -4], [5, 5, 5, 5]])
    mask = np.array([True, True, True, True, False])
    out, exact, gate = gate_ref(x, kv, bf16([[2, 0.5]]), bf16([[0.5, 4]]), mask, 1e-20, 1)
    # token 0: sum = 1*1*1 + 1*2*1 = 3, both rms 1: dot = 3 / sqrt(2) = 2.1213; gate = sigmoid(sqrt(2.1213))
    #   = sigmoid(1.45648) = 0.81099; x + g * value = [2.62199, -2.24397] -> bf16 (steps of 2**-6) [2.625, -2.25]
    g0 = sigmoid(math.sqrt(3 / math.sqrt(2)))
    # token 1: sum = 1*1*2 + (-1)*2*2 = -2; mean(key^2) = 4 -> rsqrt 1/2; dot = -2 * 1/2 / sqrt(2) = -0.70711;
    #   gate = sigmoid(-sqrt(0.70711)) = sigmoid(-0.84090) = 0.30135; [1.60269, -2.20538] -> [1.6015625, -2.203125]
    g1 = sigmoid(-math.sqrt(1 / math.sqrt(2)))
    # token 2: sum = 2*1*1 + (-1)*2*1 = 0: dot +0 -> sqrt(max(0, 1e-6)) = 1e-3, gate = sigmoid(+1e-3) = 0.50025
    #   (not 0.5); [3.0005, -3.001] -> [3, -3]
    # token 3: x = -0.0: every term -0.0, but the sum starts at +0 -> +0: sigmoid(+1e-3) again;
    #   [1.0005, -2.001] -> [1, -2]
    # token 4: masked: gate 0, x kept bit for bit (its -0.0 too), kv ignored
    g2 = sigmoid(1e-3)
    np.testing.assert_allclose(gate[:, 0], [g0, g1, g2, g2, 0.0], rtol=1e-15, atol=0)
    assert gate[2, 0] > 0.5002 and gate[4, 0] == 0.0
    np.testing.assert_allclose(
        exact[:4, 0],
        [[1 + 2 * g0, 1 - 4 * g0], [1 + 2 * g1, -1 - 4 * g1], [2 + 2 * g2, -1 - 4 * g2], [2 * g2, -4 * g2]],
        rtol=1e-15,
    )
    np.testing.assert_array_equal(
        out.astype(np.float64)[:4, 0], [[2.625, -2.25], [1.6015625, -2.203125], [3, -3], [1, -2]]
    )
    np.testing.assert_array_equal(bits(out[4]), bits(x[4]))
    assert np.signbit(exact[4, 0, 0])


def loop_gate(x, kv, q_weight, k_weight, mask, eps):
    """The gate by its definition, one token and copy at a time, in Python floats."""
    t, hc, d = x.shape
    xs, kvs = x.astype(np.float64), kv.astype(np.float64)
    w = q_weight.astype(np.float64) * k_weight.astype(np.float64)
    gate = np.zeros((t, hc))
    exact = xs.copy()
    for i in range(t):
        for h in range(hc):
            key = kvs[i, h * d : (h + 1) * d]
            dot = math.fsum(xs[i, h] * w[h] * key)
            dot /= math.sqrt(math.fsum(xs[i, h] ** 2) / d + eps) * math.sqrt(math.fsum(key**2) / d + eps) * math.sqrt(d)
            if mask[i]:
                gate[i, h] = sigmoid(math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot))
                exact[i, h] = xs[i, h] + gate[i, h] * kvs[i, hc * d :]
    return gate, exact


def test_gate_matches_a_loop_over_tokens_and_copies(rng):
    t, hc, d = 6, 3, 16
    x = random_bf16(rng, (t, hc, d), scale=2.0)
    kv = random_bf16(rng, (t, (hc + 1) * d))
    q_weight, k_weight = random_bf16(rng, (hc, d)), random_bf16(rng, (hc, d))
    mask = rng.random(t) < 0.7
    mask[:2] = [True, False]
    out, exact, gate = gate_ref(x, kv, q_weight, k_weight, mask, 1e-20, hc)
    want_gate, want_exact = loop_gate(x, kv, q_weight, k_weight, mask, 1e-20)
    np.testing.assert_allclose(gate, want_gate, rtol=1e-13, atol=1e-12)
    np.testing.assert_allclose(exact, want_exact, rtol=1e-13, atol=1e-12)
    assert ((gate > 0) & (gate < 1) | ~mask[:, None]).all()
    np.testing.assert_array_equal(bits(out[mask]), bits(exact[mask].astype(BF16)))
    np.testing.assert_array_equal(bits(out[~mask]), bits(x[~mask]))


# -- the whole layer -------------------------------------------------------------------------------------
def random_engram(rng, t: int = 5, hc: int = 2, d_model: int = 32, cols: int = 3, head_dim: int = 64, rows: int = 11):
    """A small layer whose rows requantise losslessly (every block's amax >= 1, bytes >= 114)."""
    table = random_fp8(rng, (rows, head_dim))
    table[:, ::32] = fp8(rng.choice([1.0, -2.0, 448.0, -20.0], (rows, head_dim // 32)))
    return SimpleNamespace(
        x=random_bf16(rng, (t, hc, d_model)),
        row_ids=rng.integers(0, rows, (t, cols)),
        table=table,
        table_scale=rng.integers(114, 134, (rows, head_dim // 32), dtype=np.uint8),
        wkv_weight=random_fp8(rng, ((hc + 1) * d_model, cols * head_dim)),
        wkv_scale=rng.integers(110, 125, (-(-(hc + 1) * d_model // 32), cols * head_dim // 32), dtype=np.uint8),
        q_weight=random_bf16(rng, (hc, d_model)),
        k_weight=random_bf16(rng, (hc, d_model)),
        text_mask=rng.random(t) < 0.8,
        eps=1e-20,
        hc_mult=hc,
    )


def test_engram_layer_is_gather_then_wkv_then_gate(rng):
    g = random_engram(rng)
    got = engram_layer_ref(**vars(g))
    emb = emb_from_rows(g.table, g.table_scale, g.row_ids)
    kv = wkv_ref(emb, g.wkv_weight, g.wkv_scale)
    np.testing.assert_array_equal(bits(got.emb), bits(emb))
    np.testing.assert_array_equal(bits(got.kv), bits(kv))
    for a, b in zip(got[2:], gate_ref(g.x, kv, g.q_weight, g.k_weight, g.text_mask, g.eps, g.hc_mult)):
        np.testing.assert_array_equal(a, b)
    # the rows requantise losslessly, so kv is the bf16 of emb @ W^T itself (W dequantised exactly)
    plain = emb.astype(np.float64) @ dequant_weight(g.wkv_weight, g.wkv_scale).astype(np.float64).T
    np.testing.assert_array_equal(bits(kv), bits(plain.astype(BF16)))


def test_engram_layer_refuses_a_row_that_dequantises_past_the_f32_range(rng):
    g = random_engram(rng, rows=11)
    g.row_ids[g.row_ids == 10] = 9
    g.row_ids[3, 1] = 10  # the only place row 10 is read
    g.table_scale[10, 1] = 254  # 2**127: -4 * 2**127 = -2**129 is past the f32 range
    g.table[10, 33] = fp8(-4.0)
    with pytest.raises(ValueError, match=r"engram_layer_ref: table row 10 \(row_ids\[3, 1\]\) dequantises to -inf"):
        engram_layer_ref(**vars(g))


# -- every reference refuses what it cannot compute ------------------------------------------------------
def good_arguments(rng) -> SimpleNamespace:
    g = random_engram(rng, t=3, hc=2, d_model=8, cols=2, head_dim=64, rows=4)
    g.emb = emb_from_rows(g.table, g.table_scale, g.row_ids)
    g.q, g.q_scales = act_quant(g.emb)
    g.kv = wkv_ref(g.emb, g.wkv_weight, g.wkv_scale)
    g.w = random_fp8(rng, (40, 128))
    g.ws = rng.integers(100, 150, (2, 4), dtype=np.uint8)
    return g


def _layer(g, **change) -> dict:
    args = dict(vars(g))
    for name in ("emb", "q", "q_scales", "kv", "w", "ws"):
        del args[name]
    return {**args, **change}


def _gate(g, **change) -> dict:
    return {
        **dict(
            x=g.x,
            kv=g.kv,
            q_weight=g.q_weight,
            k_weight=g.k_weight,
            text_mask=g.text_mask,
            eps=g.eps,
            hc_mult=g.hc_mult,
        ),
        **change,
    }


def _nan_at(a: np.ndarray, index: tuple) -> np.ndarray:
    out = a.copy()
    out[index] = 255
    return out


def _case(name: str, kind: str, call, exc: type[Exception], arg: str):
    return pytest.param(name, call, exc, arg, id=f"{name}-{kind}")


F32 = np.float32
REFUSALS = [
    _case("dequant_rows", "weight-dtype", lambda f, g: f(g.table.astype(F32), g.table_scale), TypeError, "weight"),
    _case("dequant_rows", "weight-None", lambda f, g: f(None, g.table_scale), TypeError, "weight"),
    _case("dequant_rows", "weight-shape", lambda f, g: f(g.table[0], g.table_scale), ValueError, "weight"),
    _case("dequant_rows", "weight-columns", lambda f, g: f(g.table[:, :40], g.table_scale), ValueError, "weight"),
    _case("dequant_rows", "scale-dtype", lambda f, g: f(g.table, g.table_scale.astype(F32)), TypeError, "scale"),
    _case("dequant_rows", "scale-shape", lambda f, g: f(g.table, g.table_scale[:, :1]), ValueError, "scale"),
    _case(
        "dequant_rows", "scale-nan", lambda f, g: f(g.table, _nan_at(g.table_scale, (2, 1))), ValueError, "scale[2, 1]"
    ),
    _case("dequant_rows", "block-float", lambda f, g: f(g.table, g.table_scale, 32.0), TypeError, "block"),
    _case("dequant_rows", "block-zero", lambda f, g: f(g.table, g.table_scale, 0), ValueError, "block"),
    _case("emb_from_rows", "table-None", lambda f, g: f(None, g.table_scale, g.row_ids), TypeError, "table"),
    _case(
        "emb_from_rows",
        "table_scale-shape",
        lambda f, g: f(g.table, g.table_scale[1:], g.row_ids),
        ValueError,
        "table_scale",
    ),
    _case(
        "emb_from_rows",
        "row_ids-float",
        lambda f, g: f(g.table, g.table_scale, g.row_ids.astype(float)),
        TypeError,
        "row_ids",
    ),
    _case(
        "emb_from_rows",
        "row_ids-list",
        lambda f, g: f(g.table, g.table_scale, g.row_ids.tolist()),
        TypeError,
        "row_ids",
    ),
    _case(
        "emb_from_rows", "row_ids-shape", lambda f, g: f(g.table, g.table_scale, g.row_ids[0]), ValueError, "row_ids"
    ),
    _case(
        "emb_from_rows",
        "row_ids-range",
        lambda f, g: f(g.table, g.table_scale, _nan_at(g.row_ids, (1, 0))),
        ValueError,
        "row_ids[1, 0]",
    ),
    _case(
        "emb_from_rows",
        "row_ids-negative",
        lambda f, g: f(g.table, g.table_scale, -g.row_ids - 1),
        ValueError,
        "row_ids[0, 0]",
    ),
    _case(
        "emb_from_rows",
        "scale-nan",
        lambda f, g: f(g.table, _nan_at(g.table_scale, (g.row_ids[2, 1], 0)), g.row_ids),
        ValueError,
        "table_scale",
    ),
    _case("act_quant", "x-dtype", lambda f, g: f(g.emb.astype(F32)), TypeError, "x"),
    _case("act_quant", "x-shape", lambda f, g: f(g.emb[0]), ValueError, "x"),
    _case("act_quant", "x-columns", lambda f, g: f(g.emb[:, :40]), ValueError, "x"),
    _case(
        "act_quant", "x-inf", lambda f, g: f(np.where(np.arange(128) == 3, bf16(np.inf), g.emb)), ValueError, "x[0, 3]"
    ),
    _case("act_quant", "block-None", lambda f, g: f(g.emb, None), TypeError, "block"),
    _case("dequant_weight", "weight-dtype", lambda f, g: f(g.w.astype(BF16), g.ws), TypeError, "weight"),
    _case("dequant_weight", "scale-shape", lambda f, g: f(g.w[:32], g.ws), ValueError, "scale"),
    _case("dequant_weight", "scale-nan", lambda f, g: f(g.w, _nan_at(g.ws, (0, 3))), ValueError, "scale[0, 3]"),
    _case("dequant_weight", "dtype-float16", lambda f, g: f(g.w, g.ws, 32, np.float16), TypeError, "dtype"),
    _case("dequant_weight", "dtype-None", lambda f, g: f(g.w, g.ws, 32, None), TypeError, "dtype"),
    _case("wkv_fp64", "q-dtype", lambda f, g: f(g.emb, g.q_scales, g.w, g.ws), TypeError, "q"),
    _case(
        "wkv_fp64",
        "q_scales-dtype",
        lambda f, g: f(g.q, g.q_scales.astype(np.float64), g.w, g.ws),
        TypeError,
        "q_scales",
    ),
    _case("wkv_fp64", "q_scales-shape", lambda f, g: f(g.q, g.q_scales[:, :2], g.w, g.ws), ValueError, "q_scales"),
    _case("wkv_fp64", "weight-shape", lambda f, g: f(g.q, g.q_scales, g.w[:, :96], g.ws), ValueError, "weight"),
    _case(
        "wkv_fp64",
        "weight_scales-nan",
        lambda f, g: f(g.q, g.q_scales, g.w, _nan_at(g.ws, (1, 2))),
        ValueError,
        "weight_scales[1, 2]",
    ),
    _case("wkv_ref", "emb-dtype", lambda f, g: f(g.q, g.w, g.ws), TypeError, "emb"),
    _case("wkv_ref", "weight-shape", lambda f, g: f(g.emb, g.w.T, g.ws), ValueError, "weight"),
    _case(
        "wkv_ref", "weight_scales-dtype", lambda f, g: f(g.emb, g.w, g.ws.astype(np.int8)), TypeError, "weight_scales"
    ),
    _case("gate_ref", "x-dtype", lambda f, g: f(**_gate(g, x=g.x.astype(F32))), TypeError, "x"),
    _case("gate_ref", "x-copies", lambda f, g: f(**_gate(g, hc_mult=3)), ValueError, "x"),
    _case("gate_ref", "x-empty", lambda f, g: f(**_gate(g, x=g.x[:, :, :0])), ValueError, "x"),
    _case("gate_ref", "kv-shape", lambda f, g: f(**_gate(g, kv=g.kv[:, :-1])), ValueError, "kv"),
    _case("gate_ref", "kv-None", lambda f, g: f(**_gate(g, kv=None)), TypeError, "kv"),
    _case("gate_ref", "q_weight-shape", lambda f, g: f(**_gate(g, q_weight=g.q_weight[:1])), ValueError, "q_weight"),
    _case(
        "gate_ref", "k_weight-dtype", lambda f, g: f(**_gate(g, k_weight=g.k_weight.astype(F32))), TypeError, "k_weight"
    ),
    _case(
        "gate_ref",
        "text_mask-dtype",
        lambda f, g: f(**_gate(g, text_mask=g.text_mask.astype(np.int8))),
        TypeError,
        "text_mask",
    ),
    _case(
        "gate_ref", "text_mask-shape", lambda f, g: f(**_gate(g, text_mask=g.text_mask[1:])), ValueError, "text_mask"
    ),
    _case("gate_ref", "eps-str", lambda f, g: f(**_gate(g, eps="1e-20")), TypeError, "eps"),
    _case("gate_ref", "eps-negative", lambda f, g: f(**_gate(g, eps=-1e-20)), ValueError, "eps"),
    _case("gate_ref", "eps-nan", lambda f, g: f(**_gate(g, eps=math.nan)), ValueError, "eps"),
    _case("gate_ref", "hc_mult-zero", lambda f, g: f(**_gate(g, hc_mult=0)), ValueError, "hc_mult"),
    _case("gate_ref", "hc_mult-float", lambda f, g: f(**_gate(g, hc_mult=2.0)), TypeError, "hc_mult"),
    _case("engram_layer_ref", "x-dtype", lambda f, g: f(**_layer(g, x=g.x.astype(F32))), TypeError, "x"),
    _case(
        "engram_layer_ref", "table-dtype", lambda f, g: f(**_layer(g, table=g.table.astype(F32))), TypeError, "table"
    ),
    _case(
        "engram_layer_ref", "row_ids-tokens", lambda f, g: f(**_layer(g, row_ids=g.row_ids[1:])), ValueError, "row_ids"
    ),
    _case(
        "engram_layer_ref",
        "row_ids-range",
        lambda f, g: f(**_layer(g, row_ids=g.row_ids + 4)),
        ValueError,
        "row_ids[0, 0]",
    ),
    _case(
        "engram_layer_ref",
        "wkv_weight-shape",
        lambda f, g: f(**_layer(g, wkv_weight=g.wkv_weight[:-1])),
        ValueError,
        "wkv_weight",
    ),
    _case(
        "engram_layer_ref",
        "wkv_scale-dtype",
        lambda f, g: f(**_layer(g, wkv_scale=g.wkv_scale.astype(F32))),
        TypeError,
        "wkv_scale",
    ),
    _case(
        "engram_layer_ref",
        "wkv_scale-nan",
        lambda f, g: f(**_layer(g, wkv_scale=_nan_at(g.wkv_scale, (0, 1)))),
        ValueError,
        "wkv_scale[0, 1]",
    ),
    _case(
        "engram_layer_ref",
        "table_scale-nan",
        lambda f, g: f(**_layer(g, table_scale=_nan_at(g.table_scale, (g.row_ids[1, 1], 0)))),
        ValueError,
        "table_scale",
    ),
    _case("engram_layer_ref", "eps-None", lambda f, g: f(**_layer(g, eps=None)), TypeError, "eps"),
    _case("engram_layer_ref", "block-shape", lambda f, g: f(**_layer(g, block=48)), ValueError, "table"),
]


@pytest.mark.parametrize("name, call, exc, arg", REFUSALS)
def test_each_engram_reference_refuses_a_bad_argument_naming_it(rng, name, call, exc, arg):
    """The exception type (TypeError for a wrong type or dtype, ValueError for a wrong value or shape)
    and a message that starts with the function's name and names the argument."""
    assert_refused(lambda: call(getattr(ref, name), good_arguments(rng)), exc, name, arg)


def test_the_refusals_spoil_good_arguments(rng):
    """Every reference accepts the arguments the refusal cases spoil (so each case fails for its own reason)."""
    g = good_arguments(rng)
    assert dequant_rows(g.table, g.table_scale).shape == (4, 64)
    assert emb_from_rows(g.table, g.table_scale, g.row_ids).shape == (3, 128)
    assert act_quant(g.emb)[0].shape == (3, 128)
    assert dequant_weight(g.w, g.ws).shape == (40, 128)
    assert wkv_fp64(g.q, g.q_scales, g.w, g.ws).shape == wkv_ref(g.emb, g.w, g.ws).shape == (3, 40)
    assert gate_ref(**_gate(g))[0].shape == (3, 2, 8)
    assert engram_layer_ref(**_layer(g)).out.shape == (3, 2, 8)
