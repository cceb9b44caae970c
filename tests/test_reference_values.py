"""CPU tests that pin the numpy references of ``layers.reference`` to values worked out without them.

Every GPU test compares a kernel with one of these references, so a bug in a reference would let a
kernel with the same bug pass. Here each reference is checked against values obtained another way:

* tiny hand cases: tables of small integers or exact binary fractions, so every bf16 / fp32
  rounding is known in advance; the expected values are literals, worked out in the comments;
* the n-gram ids those cases use are literals too (arithmetic in the comments), and a
  straightforward re-implementation of the hash's definition (Python ints, written here from
  ``docs/checkpoints.md`` / ``layers/ngram_embed/ids.py``'s docstring, never calling the package's
  hashing) confirms them;
* a larger random case computed with exact rationals (``fractions.Fraction``) and an explicit
  round-to-nearest-even to 24 bits (fp32) or 8 bits (bf16) at each rounding point a reference's
  docstring names.

And every reference refuses what it cannot compute (the last section): each public function
against each kind of bad argument, with the exception type and the argument named.
"""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from layers import reference as ref
from layers.ngram_embed.dims import NgramDims
from layers.reference import (
    embed_overlay_ref,
    gather_then_overlay_ref,
    lmhead_dot,
    lmhead_overlay_ref,
    logits_then_overlay_ref,
    ngram_embed,
    ngram_embed_fused,
    ngram_embed_ideal,
    rowdiff_ref,
)
from tests.helpers import random_bf16, random_fp8
from tests.helpers.ngram import random_layer
from tests.helpers.refusals import assert_refused

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
INF = float("inf")
NAN = float("nan")


def bf16(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).astype(BF16)


def as_f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


# -- an independent statement of the hash ----------------------------------------------------------------
def formula_ids(vocab: int, max_ngram: int, splits: int, base_rows: int, row_bias: int, eos, tokens) -> list:
    """``id[c][p] = sum_{d<n} tok[p-d] * V**d mod (m + 2c + b)``, ``n = c // K + 2``, in Python ints:
    nothing before the start, and for ``d > 0`` nothing at or beyond an EOS before ``p``."""
    out = []
    for c in range(splits * (max_ngram - 1)):
        n, modulus = c // splits + 2, base_rows + 2 * c + row_bias
        row = []
        for p in range(len(tokens)):
            total = 0
            for d in range(n):
                if p - d < 0 or (d > 0 and eos is not None and tokens[p - d] == eos):
                    break
                total += int(tokens[p - d]) * vocab**d
            row.append(total % modulus)
        out.append(row)
    return out


def one_hot_layer(vocab: int, hidden: int, rows: list[int], word_scale: int):
    """Weights that make the layer's output show its ids: word row v = [s*v, 0, ...], table c row r =
    [s*r] (table_dim 1), projection c a one-hot onto column c + 1; so out = [tok, id_0, id_1, ...] * s/(1+T)."""
    word = np.zeros((vocab, hidden))
    word[:, 0] = word_scale * np.arange(vocab)
    tables, projs = [], []
    for c, m in enumerate(rows):
        tables.append((bf16(word_scale * np.arange(m).reshape(m, 1)), None))
        proj = np.zeros((hidden, 1))
        proj[c + 1, 0] = 1
        projs.append(bf16(proj))
    return bf16(word), tables, projs


# -- the n-gram references: ids, padding, EOS ------------------------------------------------------------
# V=6, N=4, K=1 (tables of order 2, 3, 4), m=11, b=1: moduli 12, 14, 16; EOS 2; T=3 so 1/(1+T) = 0.25.
CTX = [4, 1, 5, 2, 3, 2, 2, 5]
# Per position p: (token, id_0 mod 12, id_1 mod 14, id_2 mod 16), with V**d = 1, 6, 36, 216.
IDS_EOS = [
    (4, 4, 4, 4),  # p0: 4; the look-back is all padding (0)
    (1, 1, 11, 9),  # p1: 1 + 6*4 = 25 -> 25%12=1, 25%14=11, 25%16=9 (d=2,3 padding)
    (5, 11, 1, 11),  # p2: 5 + 6*1 = 11; + 36*4 = 155 -> 155%14=1, 155%16=11 (d=3 padding)
    (2, 8, 12, 4),  # p3, an EOS, hashes its own look-back in full: 32%12=8, 68%14=12, 932%16=4
    (3, 3, 3, 3),  # p4: the token before is the EOS: nothing from d >= 1
    (2, 8, 6, 4),  # p5: 2 + 6*3 = 20; d=2 is an EOS: 20%12=8, 20%14=6, 20%16=4
    (2, 2, 2, 2),  # p6: the token before is the EOS
    (5, 5, 5, 5),  # p7: the token before is the EOS
]
IDS_NO_EOS = IDS_EOS[:4] + [
    (3, 3, 13, 11),  # p4: 3 + 6*2 = 15; + 36*5 = 195; + 216*1 = 411 -> 15%12=3, 195%14=13, 411%16=11
    (2, 8, 8, 4),  # p5: 2 + 6*3 = 20; + 36*2 = 92; + 216*5 = 1172 -> 8, 92%14=8, 1172%16=4
    (2, 2, 10, 10),  # p6: 2 + 6*2 = 14; + 36*3 = 122; + 216*2 = 554 -> 2, 122%14=10, 554%16=10
    (5, 5, 5, 1),  # p7: 5 + 6*2 = 17; + 36*2 = 89; + 216*3 = 737 -> 5, 89%14=5, 737%16=1
]


@pytest.mark.parametrize("eos, expected", [(2, IDS_EOS), (None, IDS_NO_EOS)], ids=["eos", "no-eos"])
def test_hand_ids_agree_with_the_hash_formula(eos, expected):
    """The hand-worked ids of the n-gram cases below equal the hash's definition evaluated with Python ints."""
    ids = formula_ids(6, 4, 1, 11, 1, eos, CTX)
    assert [tuple([tok] + [ids[c][p] for c in range(3)]) for p, tok in enumerate(CTX)] == expected


@pytest.mark.parametrize("reference", [ngram_embed, ngram_embed_fused, ngram_embed_ideal])
@pytest.mark.parametrize("seq_len", [8, 3, 1])
@pytest.mark.parametrize("eos, expected", [(2, IDS_EOS), (None, IDS_NO_EOS)], ids=["eos", "no-eos"])
def test_ngram_references_read_the_hashed_rows(reference, seq_len, eos, expected):
    """Each n-gram reference reads the word row and the table rows at the hashed ids of the context's last
    seq_len positions (zero padding before the start, no look-back across an EOS), scaled by 1/(1+T)."""
    dims = NgramDims(6, 4, 4, 1, 11, row_bias=1, table_dim=1, eos_id=eos)
    word, tables, projs = one_hot_layer(6, 4, [12, 14, 16], word_scale=1)
    out = reference(dims, word, tables, projs, np.array(CTX), seq_len)
    # Every value is an integer / 4: exact in bf16 and in fp64, so all three references agree exactly.
    want = np.array(expected[len(CTX) - seq_len :], dtype=np.float64) / 4
    assert out.shape == (seq_len, 4)
    assert out.dtype == (np.float64 if reference is ngram_embed_ideal else BF16)
    np.testing.assert_array_equal(as_f64(out), want)


@pytest.mark.parametrize("reference", [ngram_embed, ngram_embed_fused, ngram_embed_ideal])
def test_two_splits_use_their_own_moduli_and_scale_by_a_third(reference):
    """With K=2 splits of order 2 (moduli m and m+2, table index c = k) the references scale by f32(1/3)."""
    # V=7, N=2, K=2, m=5, b=0: moduli 5 and 7; ctx 3, 6, 2: id = tok + 7*prev
    #   p0: 3 -> 3, 3;  p1: 6 + 21 = 27 -> 2, 6;  p2: 2 + 42 = 44 -> 4, 2
    # Word and table values are 3x those numbers: f32(f32(1/3) * 3k) = k exactly for these k.
    dims = NgramDims(7, 3, 2, 2, 5, table_dim=1)
    assert formula_ids(7, 2, 2, 5, 0, None, [3, 6, 2]) == [[3, 2, 4], [3, 6, 2]]
    word, tables, projs = one_hot_layer(7, 3, [5, 7], word_scale=3)
    out = reference(dims, word, tables, projs, np.array([3, 6, 2]), 3)
    np.testing.assert_array_equal(as_f64(out), [[3, 3, 3], [6, 2, 6], [2, 4, 2]])


# -- the n-gram references: rounding points --------------------------------------------------------------
def rounding_layer():
    """T=3 (scale 0.25, exact), D=2, table_dim 2; every row of a table alike, so the ids do not matter.
    Word row [256, 1]; table 0 row [1, 1] with projection [[1, 0], [1, 256]] -> [1, 257]; tables 1
    and 2 row [1, 0] with projection [[1, 0], [0, 0]] -> [1, 0]."""
    dims = NgramDims(3, 2, 4, 1, 2, table_dim=2)  # moduli 2, 4, 6
    word = bf16(np.tile([256.0, 1.0], (3, 1)))
    rows = [np.tile([1.0, 1.0], (2, 1)), np.tile([1.0, 0.0], (4, 1)), np.tile([1.0, 0.0], (6, 1))]
    projs = [bf16([[1, 0], [1, 256]]), bf16([[1, 0], [0, 0]]), bf16([[1, 0], [0, 0]])]
    return dims, word, [(bf16(r), None) for r in rows], projs


def test_seed_path_rounds_each_projection_and_after_every_add():
    """``ngram_embed`` rounds each table's projection to bf16 and the running sum to bf16 after every
    scaled add (the seed's T + 1 roundings), giving [64, 64] where the exact value is [64.75, 64.5]."""
    # column 0: bf16(256/4) = 64; then three times bf16(64 + 1/4) = 64 (a tie; 64 is even)
    # column 1: bf16(1/4) = 0.25; table 0's 257 rounds to bf16 256 (a tie; 256 is even), so
    #           bf16(0.25 + 64) = 64 (a tie); tables 1 and 2 add 0
    out = ngram_embed(*rounding_layer(), np.array([1, 2]), 1)
    assert out.dtype == BF16
    np.testing.assert_array_equal(as_f64(out), [[64.0, 64.0]])


def test_fused_path_rounds_once():
    """``ngram_embed_fused`` sums the projections in fp32, adds the word row and scales before its one bf16
    rounding, giving [65, 64.5]."""
    # column 0: (1 + 1 + 1 + 256) * 0.25 = 64.75 -> bf16 65 (a tie between 64.5 and 65; 65 is even)
    # column 1: (257 + 0 + 0 + 1) * 0.25 = 64.5, exact in bf16 (257 is kept: fp32, not bf16)
    out = ngram_embed_fused(*rounding_layer(), np.array([1, 2]), 1)
    assert out.dtype == BF16
    np.testing.assert_array_equal(as_f64(out), [[65.0, 64.5]])


def test_ideal_path_does_not_round():
    """``ngram_embed_ideal`` is the exact fp64 value (word + sum of projections) / (1 + T) = [64.75, 64.5]."""
    out = ngram_embed_ideal(*rounding_layer(), np.array([1, 2]), 1)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, [[64.75, 64.5]])


def fp8_layer():
    """T=1 (scale 0.5), D=1, one fp8 table of 5 rows (V=4, m=5): every row e4m3 1.125, row r's scale
    (1 + 2**-7) * 2**r, so the row read shows in the output's exponent; projection [[1]], word rows 0."""
    dims = NgramDims(4, 1, 2, 1, 5)
    table = np.full((5, 1), 1.125).astype(FP8)
    scale = ((1 + 2**-7) * 2.0 ** np.arange(5)).astype(np.float32)
    return dims, bf16(np.zeros((4, 1))), [(table, scale)], [bf16([[1.0]])]


# ctx 1, 3, 2, 0 (V=4, modulus 5): ids p0: 1 (padding before); p1: 3 + 4 = 7 -> 2; p2: 2 + 12 = 14 -> 4;
# p3: 0 + 8 = 8 -> 3. Row r reads 1.125 * (1 + 2**-7) * 2**r = 1.1337890625 * 2**r; bf16 keeps 8
# significant bits: 1.1328125 * 2**r (the dropped 2**-10 is below half an ulp, 2**-8). Times 0.5.
FP8_CTX = [1, 3, 2, 0]
FP8_IDS = [1, 2, 4, 3]


@pytest.mark.parametrize(
    "reference, row_value",
    [(ngram_embed, 1.1328125), (ngram_embed_fused, 1.1328125), (ngram_embed_ideal, 1.1337890625)],
    ids=["seed", "fused", "ideal"],
)
def test_fp8_table_rows_are_scaled_per_row(reference, row_value):
    """An fp8 table's row r is read as e4m3 times its own f32 scale, rounded to bf16 by the seed and fused
    paths (bf16(q * s)) and exact in the ideal one."""
    assert formula_ids(4, 2, 1, 5, 0, None, FP8_CTX) == [FP8_IDS]
    out = reference(*fp8_layer(), np.array(FP8_CTX), 4)
    want = [[row_value * 2.0**r * 0.5] for r in FP8_IDS]  # literals: seed/fused 0.56640625 * 2**r
    np.testing.assert_array_equal(as_f64(out), want)


# -- the n-gram references against exact rational arithmetic ---------------------------------------------
def round_to(x: Fraction, bits: int) -> Fraction:
    """x rounded to nearest, ties to even, with ``bits`` significant bits (normal range only)."""
    if x == 0:
        return x
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2**e <= a < 2**(e+2)
    if Fraction(2) ** e > a:
        e -= 1
    if Fraction(2) ** (e + 1) <= a:
        e += 1
    assert Fraction(2) ** e <= a < Fraction(2) ** (e + 1)
    assert e > -126, "subnormal: outside this model"
    ulp = Fraction(2) ** (e - bits + 1)
    q = a / ulp
    n = q.numerator // q.denominator
    rest = q - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2):
        n += 1
    return (n * ulp) if x > 0 else -(n * ulp)


def f32(x: Fraction) -> Fraction:
    return round_to(x, 24)


def b16(x: Fraction) -> Fraction:
    return round_to(x, 8)


def test_round_to_matches_hand_values():
    """The exact-rational rounding used below rounds to nearest, ties to even, at 8 and 24 bits."""
    assert b16(Fraction(257)) == 256 and b16(Fraction(259)) == 260 and b16(Fraction(-259)) == -260
    assert b16(Fraction(2323, 2048)) == Fraction(1160, 1024)  # 1.1337890625 -> 1.1328125
    assert f32(Fraction(2**24 + 1)) == 2**24 and f32(Fraction(2**24 + 3)) == 2**24 + 4
    assert f32(Fraction(1, 3)) == Fraction(11184811, 2**25)


@pytest.mark.parametrize("seq_len", [5, 12])
def test_ngram_references_equal_exact_rational_models(seq_len):
    """On random bf16 / fp8 weights (T=4, scale f32(1/5), EOS, padding) the three n-gram references equal
    models of their docstrings' rounding points in exact rationals with ids from the hash's definition."""
    rng = np.random.default_rng(20240611)
    v, d, n, k, m, b, td, eos = 11, 6, 3, 2, 13, 1, 3, 4
    t = k * (n - 1)
    dims = NgramDims(v, d, n, k, m, row_bias=b, table_dim=td, eos_id=eos)
    ctx = [5, 7, 4, 1, 10, 3, 4, 4, 9, 0, 2, 6]  # EOS (4) at 2, 6 and 7
    assert len(ctx) == 12
    word = bf16(rng.standard_normal((v, d)))
    tables, projs = [], []
    for c in range(t):
        rows = rng.standard_normal((m + 2 * c + b, td))
        if c == 2:  # an fp8 table with per-row scales
            tables.append((rows.astype(FP8), rng.uniform(0.01, 0.1, m + 2 * c + b).astype(np.float32)))
        else:
            tables.append((bf16(rows), None))
        projs.append(bf16(0.5 * rng.standard_normal((d, td))))

    ids = formula_ids(v, n, k, m, b, eos, ctx)
    positions = range(len(ctx) - seq_len, len(ctx))
    fr = Fraction  # exact conversion of every float the weights hold

    def row_value(c: int, p: int, exact: bool) -> list[Fraction]:
        table, scale = tables[c]
        row = [fr(float(x)) for x in table[ids[c][p]]]
        if scale is None:
            return row
        s = fr(float(scale[ids[c][p]]))
        return [x * s if exact else b16(f32(x * s)) for x in row]  # bf16(f32(e4m3 * scale))

    def projection(c: int, row: list[Fraction], j: int) -> Fraction:
        return sum((fr(float(projs[c][j, i])) * row[i] for i in range(td)), Fraction(0))

    inv = f32(Fraction(1, 1 + t))
    seed, fused, ideal = [], [], []
    for p in positions:
        w = [fr(float(x)) for x in word[ctx[p]]]
        rows_b = [row_value(c, p, exact=False) for c in range(t)]
        rows_x = [row_value(c, p, exact=True) for c in range(t)]
        seed_row, fused_row, ideal_row = [], [], []
        for j in range(d):
            s = b16(f32(0 + f32(inv * w[j])))  # scaled_add of the word row onto zeros
            for c in range(t):
                y = b16(f32(projection(c, rows_b[c], j)))  # the bf16 GEMM: exact sum -> f32 -> bf16
                s = b16(f32(s + f32(inv * y)))
            seed_row.append(s)
            total = sum((projection(c, rows_b[c], j) for c in range(t)), Fraction(0))
            fused_row.append(b16(f32(f32(f32(total) + w[j]) * inv)))
            ideal_row.append((w[j] + sum((projection(c, rows_x[c], j) for c in range(t)), Fraction(0))) / (1 + t))
        seed.append(seed_row)
        fused.append(fused_row)
        ideal.append(ideal_row)

    def floats(rows):
        return np.array([[float(x) for x in row] for row in rows])

    ctx_arr = np.array(ctx)
    np.testing.assert_array_equal(as_f64(ngram_embed(dims, word, tables, projs, ctx_arr, seq_len)), floats(seed))
    np.testing.assert_array_equal(as_f64(ngram_embed_fused(dims, word, tables, projs, ctx_arr, seq_len)), floats(fused))
    np.testing.assert_allclose(
        ngram_embed_ideal(dims, word, tables, projs, ctx_arr, seq_len), floats(ideal), rtol=1e-13, atol=1e-15
    )
    # The three really differ on this case (the checks above are not one value three times).
    assert not np.array_equal(floats(seed), floats(fused))
    assert not np.array_equal(floats(fused), floats(ideal))


# -- rowdiff_ref ---------------------------------------------------------------------------------------------
BIG = 3.0e38  # finite in bf16 (max about 3.39e38); BIG - (-BIG) overflows fp32 to inf
ROWDIFF_BASE = [
    [1, 2],  # 0: equal
    [1, 2],  # 1: differs by exactly 0.5
    [1, 2],  # 2: second element differs by 0.515625 (2.515625 is a bf16)
    [NAN, 0],  # 3: NaN on one side
    [NAN, 0],  # 4: NaN on both sides
    [INF, -INF],  # 5: equal infinities
    [INF, 0],  # 6: opposite infinities
    [INF, 0],  # 7: infinity against a finite value
    [0.0, -0.0],  # 8: +0 against -0
    [BIG, 0],  # 9: a finite difference that overflows fp32
    [-1, 2],  # 10: |-1 - 1| = 2
]
ROWDIFF_SERVED = [
    [1, 2],
    [1.5, 2],
    [1, 2.515625],
    [1, 0],
    [NAN, 0],
    [INF, -INF],
    [-INF, 0],
    [BIG, 0],
    [-0.0, 0.0],
    [-BIG, 0],
    [1, 2],
]


@pytest.mark.parametrize(
    "thresh, expected",
    [
        (0.5, [0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1]),
        (0.0, [0, 1, 1, 1, 1, 0, 1, 1, 0, 1, 1]),
        (INF, [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0]),  # only a NaN difference is "more" than inf
    ],
)
def test_rowdiff_flags(thresh, expected):
    """``rowdiff_ref`` flags a row when some |base - served| (fp32) exceeds thresh, a NaN difference
    counting as greater and equal values (equal infinities, +0 and -0) differing by 0."""
    out = rowdiff_ref(bf16(ROWDIFF_BASE), bf16(ROWDIFF_SERVED), thresh)
    assert out.dtype == np.uint8
    assert out.tolist() == expected


# -- the overlay references ------------------------------------------------------------------------------
def overlay_slots():
    """Four adapter slots over a vocabulary of 4: slot 0 maps token 1 -> 0 and 3 -> 1 (2 rows); slot 1
    maps token 0 -> 2 but has n_tab 2 (slot 2 is past its rows); slot 2 has no map; slot 3 no rows."""
    maps = [np.array([-1, 0, -1, 1], np.int32), np.array([2, -1, -1, -1], np.int32), None, np.zeros(4, np.int32)]
    rows = [bf16([[100, 101], [102, 103]]), bf16([[200, 201], [202, 203], [204, 205]]), bf16([[300, 301]]), None]
    return maps, rows, [2, 2, 1, 1]


def test_gather_then_overlay_applies_each_skip_rule():
    """``gather_then_overlay_ref`` gathers table[ids] and replaces a row only where its slot, map, rows,
    mapped slot (0 <= slot < n_tab) all allow it."""
    table = bf16([[v, 10 + v] for v in range(4)])  # row v = [v, 10 + v]
    ids = np.array([1, 3, 0, 2, 1, 3, 2], np.uint32)
    seq_slot = np.array([0, 0, 1, -1, 2, 3, 0], np.int32)
    maps, rows, n_tab = overlay_slots()
    out = gather_then_overlay_ref(table, ids, seq_slot, 5, maps, rows, n_tab)
    assert out.dtype == BF16
    want = [
        [100, 101],  # token 1, slot 0: mapped to its row 0
        [102, 103],  # token 3, slot 0: row 1
        [0, 10],  # token 0, slot 1: mapped to 2 >= n_tab 2, kept
        [2, 12],  # slot -1: kept
        [1, 11],  # slot 2: no map, kept
        [3, 13],  # slot 3: no rows, kept
        [2, 12],  # token 2, slot 0: mapped to -1, kept
    ]
    np.testing.assert_array_equal(as_f64(out), want)


def test_embed_overlay_routes_by_active_slot_and_copies_bits():
    """``embed_overlay_ref`` with no seq_slot routes every row to ``active``, skips ids >= vocab, copies
    the replacement row bit for bit (-0 and a NaN payload), and leaves its input untouched."""
    maps, rows, n_tab = overlay_slots()
    rows[0] = np.array([[0x8000, 0x40A0], [0x7FC1, 0x40C0]], np.uint16).view(BF16)  # [-0, 5], [NaN, 6]
    out_in = bf16(np.full((4, 2), 7.0))
    ids = np.array([1, 3, 4, 2], np.uint32)  # 4 >= vocab 4: skipped before the map is read
    out = embed_overlay_ref(out_in, ids, None, 0, maps, rows, n_tab, 4)
    want_bits = np.full((4, 2), bf16(7.0).view(np.uint16), np.uint16)
    want_bits[0] = [0x8000, 0x40A0]  # -0.0, 5.0
    want_bits[1] = [0x7FC1, 0x40C0]  # the NaN's own payload, 6.0
    np.testing.assert_array_equal(out.view(np.uint16), want_bits)
    np.testing.assert_array_equal(as_f64(out_in), np.full((4, 2), 7.0))  # a copy, not in place
    same = embed_overlay_ref(out_in, ids, None, -1, maps, rows, n_tab, 4)  # active -1: no overlay
    np.testing.assert_array_equal(same.view(np.uint16), out_in.view(np.uint16))


# lmhead_dot: eight products [2**24, 1, 1, 1, 1, 1, 1, 1] (hidden = w = [4096, 1, ..., 1]); exact sum
# 2**24 + 7, which fp32 rounds to 2**24 + 8.
#   vector path: lane 0 adds its 8-element chunk in order; each + 1 is a tie at 2**24 -> 2**24.
#   scalar path: lane i holds element i; butterfly off=4: lane 0 = 2**24 + 1 -> 2**24, lanes 1..3 = 2;
#     off=2: lane 0 = 2**24 + 2, lane 1 = 4; off=1: 2**24 + 6 (off=16, 8 add zeros).
# h = 40 (scalar only): products 2**24 at 0, 1 at 1, 32 and 33 (exact 2**24 + 3, fp32 2**24 + 4);
#   lane 0 = 2**24 + 1 -> 2**24 (elements 0 and 32), lane 1 = 2 (1 and 33); butterfly: 2**24 + 2
#   (a left-to-right sum would give 2**24).
# Butterfly order: products 2**24 at lane 0 and 1 at lanes 16 and 17 (scalar h = 24: elements 16, 17;
#   vector h = 144: chunks 16 and 17, elements 128 and 136). off=16 first: lane 0 = 2**24 + 1 -> 2**24,
#   lane 1 = 1; off=1: 2**24 + 1 -> 2**24. (Starting at off=1 would give 2**24 + 2, the exact sum.)
# Vector h = 264 (33 chunks: lane 0 takes chunks 0 and 32): 2**24 at 0, 1 at 256 and 257 (chunk 32), all
#   added in lane 0 after the 2**24 -> 2**24 (contiguous chunks per lane would put them in lane 16: 2**24 + 2).
def dot_case(h: int, ones: list[int]) -> tuple[np.ndarray, np.ndarray]:
    x = np.zeros(h)
    x[0] = 4096
    x[ones] = 1
    return bf16(x), bf16(x)


@pytest.mark.parametrize(
    "h, ones, vector, expected",
    [
        (8, list(range(1, 8)), True, 2**24),
        (8, list(range(1, 8)), False, 2**24 + 6),
        (40, [1, 32, 33], False, 2**24 + 2),
        (24, [16, 17], False, 2**24),
        (144, [128, 136], True, 2**24),
        (264, [256, 257], True, 2**24),
    ],
    ids=["vector", "scalar", "scalar-strided", "scalar-butterfly", "vector-butterfly", "vector-strided"],
)
def test_lmhead_dot_sums_in_the_kernels_order(h, ones, vector, expected):
    """``lmhead_dot`` (the LM-head overlay's dot product) sums fp32 products per lane in the kernel's order
    then by the xor butterfly, which the hand-worked fp32 results show."""
    x, w = dot_case(h, ones)
    out = lmhead_dot(x, w, vector)
    assert out.dtype == np.float32
    assert float(out) == expected


def lmhead_slots():
    """Slot 0: 4 rows for ids [4, 0, 9, 2] (9 >= vocab 5), n_tab 4; slot 1: ids [-1, 3]; slot 2: n_tab -1;
    slot 3: no rows."""
    rows = [bf16([[1, 1], [2, 0], [7, 7], [5, 5]]), bf16([[9, 9], [256, 1]]), bf16([[1, 1]]), None]
    ids = [np.array([4, 0, 9, 2], np.int32), np.array([-1, 3], np.int32), np.array([1], np.int32), np.array([0], np.int32)]
    return rows, ids, [4, 2, -1, 1]


@pytest.mark.parametrize("dtype, logit_769", [(BF16, 768.0), (np.dtype(np.float32), 769.0)], ids=["bf16", "f32"])
def test_lmhead_overlay_writes_the_allowed_columns(dtype, logit_769):
    """``lmhead_overlay_ref`` recomputes logits[r, ids[j]] = hidden[r] . rows[j] for j < min(n_tab,
    max_n_override) and 0 <= id < vocab of each row's slot, rounded to the logits' dtype, with its mask."""
    rows, ids, n_tab = lmhead_slots()
    hidden = bf16([[1, 2], [3, 1], [1, 1], [1, 1], [1, 1]])
    seq_slot = np.array([0, 1, 2, -1, 3], np.int32)
    logits = np.full((5, 5), -1.0).astype(dtype)
    out, written = lmhead_overlay_ref(logits, hidden, seq_slot, 0, rows, ids, n_tab, 3, 5)
    want = np.full((5, 5), -1.0)
    want[0, 4] = 3  # slot 0, j=0: [1, 2] . [1, 1]
    want[0, 0] = 2  # j=1: [1, 2] . [2, 0]; j=2's id 9 >= vocab; j=3 is cut by max_n_override 3
    want[1, 3] = logit_769  # slot 1, j=1: [3, 1] . [256, 1] = 769 (bf16: 768); j=0's id -1 skipped
    # row 2: slot 2's n_tab -1; row 3: slot -1; row 4: slot 3 has no rows
    assert out.dtype == dtype
    np.testing.assert_array_equal(as_f64(out), want)
    mask = np.zeros((5, 5), bool)
    mask[0, 4] = mask[0, 0] = mask[1, 3] = True
    np.testing.assert_array_equal(written, mask)
    np.testing.assert_array_equal(as_f64(logits), np.full((5, 5), -1.0))  # its input untouched


def test_lmhead_overlay_default_path_follows_h():
    """``lmhead_overlay_ref`` takes the vector order when h % 8 == 0 unless told otherwise (f32 logits
    keep the difference: 2**24 against 2**24 + 6)."""
    x, w = dot_case(8, list(range(1, 8)))
    args = (np.zeros((1, 3), np.float32), x.reshape(1, 8), None, 0, [w.reshape(1, 8)], [np.array([1], np.int32)], [1], 1, 3)
    assert lmhead_overlay_ref(*args)[0].tolist() == [[0.0, 2.0**24, 0.0]]
    assert lmhead_overlay_ref(*args, vector=False)[0].tolist() == [[0.0, 2.0**24 + 6, 0.0]]


@pytest.mark.parametrize("dtype, logit_257", [(BF16, 256.0), (np.dtype(np.float32), 257.0)], ids=["bf16", "f32"])
def test_logits_then_overlay(dtype, logit_257):
    """``logits_then_overlay_ref`` is hidden @ lm_head^T in fp32 cast to dtype, with the active slot's
    columns then recomputed from its rows."""
    hidden = bf16([[1, 2], [0.5, -1]])
    lm_head = bf16([[1, 0], [0, 1], [1, 1], [256, 0.5]])
    # logits: row 0 = [1, 2, 3, 256 + 1 = 257], row 1 = [0.5, -1, -0.5, 128 - 0.5 = 127.5]
    rows, ids = [bf16([[2, 2]])], [np.array([1], np.int32)]  # slot 0 overrides token 1 with [2, 2]
    out, mask = logits_then_overlay_ref(hidden, lm_head, None, 0, rows, ids, [1], 1, dtype=dtype)
    assert out.dtype == dtype
    np.testing.assert_array_equal(as_f64(out), [[1, 6, 3, logit_257], [0.5, -1, -0.5, 127.5]])
    np.testing.assert_array_equal(mask, [[False, True, False, False]] * 2)


# -- every reference refuses what it cannot compute ------------------------------------------------------
def good_arguments(rng) -> SimpleNamespace:
    """Valid arguments of every reference, fresh random values: each refusal case spoils one."""
    dims = NgramDims(20, 8, 3, 2, 7)  # T = 4 tables of 7, 9, 11, 13 rows; table_dim 2
    layer = random_layer(rng, dims, "bf")  # tables 0 and 2 bf16, 1 and 3 fp8 with their scales
    maps = [np.full(10, -1, np.int32), None]
    maps[0][rng.choice(10, 3, replace=False)] = [0, 1, 2]
    return SimpleNamespace(
        dims=dims, word=layer.word, tables=layer.tables, projs=layer.projs,
        ctx=rng.integers(0, 20, 9), seq_len=4,
        table=random_bf16(rng, (12, 3)), fp8=random_fp8(rng, (12, 3)),
        scale=rng.uniform(0.5, 2.0, 12).astype(np.float32), ids=rng.integers(0, 12, 5).astype(np.uint32),
        logits=random_bf16(rng, (3, 12)), a=random_bf16(rng, (3, 5)), w=random_bf16(rng, (4, 5)),
        x=random_bf16(rng, 6), y=random_bf16(rng, 6), base=random_bf16(rng, (4, 8)), served=random_bf16(rng, (4, 8)),
        # overlays: vocab 10, rows of 8, two slots
        out=random_bf16(rng, (5, 8)), tokens=rng.integers(0, 10, 5).astype(np.uint32),
        seq=rng.integers(-1, 2, 5).astype(np.int32), maps=maps,
        rows=[random_bf16(rng, (3, 8)), random_bf16(rng, (2, 8))], n=[3, 2],
        lm_logits=rng.standard_normal((3, 10)).astype(np.float32), hidden=random_bf16(rng, (3, 8)),
        lm_rows=[random_bf16(rng, (2, 8))], lm_ids=[rng.choice(10, 2, replace=False).astype(np.int32)], lm_n=[2],
        lm_head=random_bf16(rng, (10, 8)),
    )


def _swap(items, index: int, value) -> list:
    """A copy of ``items`` with entry ``index`` replaced."""
    out = list(items)
    out[index] = value
    return out


def _layer(g, **change) -> tuple:
    """An n-gram reference's positional arguments from ``g``, ``change`` replacing some."""
    args = dict(dims=g.dims, word=g.word, tables=g.tables, projs=g.projs, ctx_tokens=g.ctx, seq_len=g.seq_len)
    args.update(change)
    return tuple(args.values())


def _embed(g, **change) -> tuple:
    args = dict(out=g.out, ids=g.tokens, seq_slot=g.seq, active=0, slot_maps=g.maps, slot_rows=g.rows,
                n_tab=g.n, vocab=10)
    args.update(change)
    return tuple(args.values())


def _lmhead(g, **change) -> tuple:
    args = dict(logits=g.lm_logits, hidden=g.hidden, seq_slot=None, active=0, slot_rows=g.lm_rows,
                slot_ids=g.lm_ids, n_tab=g.lm_n, max_n_override=2, vocab=10)
    args.update(change)
    return tuple(args.values())


def _case(name: str, kind: str, call, exc: type[Exception], arg: str):
    """``ref.<name>`` called by ``call(function, good arguments)`` raises ``exc`` naming ``arg``."""
    return pytest.param(name, call, exc, arg, id=f"{name}-{kind}")


NGRAM_REFUSALS = [
    ("projs-count", lambda g: dict(projs=g.projs[:2]), ValueError, "projs"),
    ("tables-count", lambda g: dict(tables=g.tables[:3]), ValueError, "tables"),
    ("tables-pair", lambda g: dict(tables=_swap(g.tables, 0, g.tables[0][0])), TypeError, "tables[0]"),
    ("float-ids", lambda g: dict(ctx_tokens=g.ctx.astype(np.float64)), TypeError, "tokens"),
    ("id-range", lambda g: dict(ctx_tokens=np.append(g.ctx, 20)), ValueError, "token"),
    ("id-negative", lambda g: dict(ctx_tokens=np.append(g.ctx, -1)), ValueError, "token"),
    ("seq_len-past-context", lambda g: dict(seq_len=len(g.ctx) + 1), ValueError, "seq_len"),
    ("seq_len-float", lambda g: dict(seq_len=2.0), TypeError, "seq_len"),
    ("seq_len-negative", lambda g: dict(seq_len=-1), ValueError, "seq_len"),
    ("dims-None", lambda g: dict(dims=None), TypeError, "dims"),
    ("word-None", lambda g: dict(word=None), TypeError, "word"),
    ("ctx-None", lambda g: dict(ctx_tokens=None), TypeError, "ctx_tokens"),
    ("projs-None", lambda g: dict(projs=None), TypeError, "projs"),
    ("word-dtype", lambda g: dict(word=g.word.astype(np.float32)), TypeError, "word"),
    ("table-dtype", lambda g: dict(tables=_swap(g.tables, 0, (g.tables[0][0].astype(np.float32), None))),
     TypeError, "tables[0]"),
    ("proj-dtype", lambda g: dict(projs=_swap(g.projs, 0, g.projs[0].astype(np.float32))), TypeError, "projs[0]"),
    ("word-shape", lambda g: dict(word=g.word[:-1]), ValueError, "word"),
    ("table-shape", lambda g: dict(tables=_swap(g.tables, 2, (g.tables[2][0][:-1], None))), ValueError, "tables[2]"),
    ("proj-shape", lambda g: dict(projs=_swap(g.projs, 1, g.projs[1].T)), ValueError, "projs[1]"),
    ("ctx-shape", lambda g: dict(ctx_tokens=g.ctx.reshape(3, 3)), ValueError, "ctx_tokens"),
    ("fp8-without-scale", lambda g: dict(tables=_swap(g.tables, 1, (g.tables[1][0], None))), TypeError,
     "tables[1] scale"),
    ("scale-shape", lambda g: dict(tables=_swap(g.tables, 1, (g.tables[1][0], g.tables[1][1][:-1]))), ValueError,
     "tables[1] scale"),
    ("bf16-with-scale", lambda g: dict(tables=_swap(g.tables, 0, (g.tables[0][0], g.tables[1][1][:7]))), ValueError,
     "tables[0]"),
]

REFUSALS = [
    _case(name, kind, lambda f, g, spoil=spoil: f(*_layer(g, **spoil(g))), exc, arg)
    for name in ("ngram_embed", "ngram_embed_fused", "ngram_embed_ideal")
    for kind, spoil, exc, arg in NGRAM_REFUSALS
] + [
    _case("batched_embed", "table-None", lambda f, g: f(None, g.ids), TypeError, "table"),
    _case("batched_embed", "table-dtype", lambda f, g: f(g.table.astype(np.float32), g.ids), TypeError, "table"),
    _case("batched_embed", "table-shape", lambda f, g: f(g.table[0], g.ids), ValueError, "table"),
    _case("batched_embed", "ids-None", lambda f, g: f(g.table, None), TypeError, "ids"),
    _case("batched_embed", "ids-float", lambda f, g: f(g.table, g.ids.astype(np.float32)), TypeError, "ids"),
    _case("batched_embed", "ids-shape", lambda f, g: f(g.table, g.ids.reshape(5, 1)), ValueError, "ids"),
    _case("batched_embed", "ids-range", lambda f, g: f(g.table, _swap(g.ids, 2, 12)), ValueError, "ids[2]"),
    _case("batched_embed", "ids-negative", lambda f, g: f(g.table, _swap(g.ids, 4, -1)), ValueError, "ids[4]"),
    _case("batched_embed_fp8", "table-dtype", lambda f, g: f(g.table, g.scale, g.ids), TypeError, "table"),
    _case("batched_embed_fp8", "scale-None", lambda f, g: f(g.fp8, None, g.ids), TypeError, "row_scale"),
    _case("batched_embed_fp8", "scale-dtype", lambda f, g: f(g.fp8, g.ids, g.ids), TypeError, "row_scale"),
    _case("batched_embed_fp8", "scale-shape", lambda f, g: f(g.fp8, g.scale[:-1], g.ids), ValueError, "row_scale"),
    _case("batched_embed_fp8", "ids-range", lambda f, g: f(g.fp8, g.scale, _swap(g.ids, 0, 99)), ValueError,
          "ids[0]"),
    _case("dequant_fp8", "rows-dtype", lambda f, g: f(g.table, g.scale), TypeError, "rows"),
    _case("dequant_fp8", "rows-shape", lambda f, g: f(g.fp8[0], g.scale), ValueError, "rows"),
    _case("dequant_fp8", "scales-None", lambda f, g: f(g.fp8, None), TypeError, "scales"),
    _case("dequant_fp8", "scales-shape", lambda f, g: f(g.fp8, g.scale[:3]), ValueError, "scales"),
    _case("gather_table", "scale-missing", lambda f, g: f(g.fp8, None, g.ids), TypeError, "table scale"),
    _case("gather_table", "scale-extra", lambda f, g: f(g.table, g.scale, g.ids), ValueError, "table"),
    _case("gather_table", "ids-float", lambda f, g: f(g.table, None, [1.5]), TypeError, "ids"),
    _case("gather_table", "ids-range", lambda f, g: f(g.fp8, g.scale, [12]), ValueError, "ids[0]"),
    _case("argmax_ids", "logits-None", lambda f, g: f(None), TypeError, "logits"),
    _case("argmax_ids", "logits-dtype", lambda f, g: f(g.logits.astype(np.float32)), TypeError, "logits"),
    _case("argmax_ids", "logits-shape", lambda f, g: f(g.logits[0]), ValueError, "logits"),
    _case("argmax_ids", "logits-empty", lambda f, g: f(g.logits[:, :0]), ValueError, "logits"),
    _case("embed_from_argmax", "table-shape", lambda f, g: f(g.logits, g.table[:-1]), ValueError, "table"),
    _case("embed_from_argmax", "table-dtype", lambda f, g: f(g.logits, g.fp8), TypeError, "table"),
    _case("scaled_add", "out-dtype", lambda f, g: f(g.x.astype(np.float32), g.y, 0.5), TypeError, "out"),
    _case("scaled_add", "x-shape", lambda f, g: f(g.x, g.y[:-1], 0.5), ValueError, "x"),
    _case("scaled_add", "scale-dtype", lambda f, g: f(g.x, g.y, "0.5"), TypeError, "scale"),
    _case("scaled_add", "scale-range", lambda f, g: f(g.x, g.y, float("nan")), ValueError, "scale"),
    _case("residual_add", "out-None", lambda f, g: f(None, g.y), TypeError, "out"),
    _case("residual_add", "x-shape", lambda f, g: f(g.x, g.y.reshape(2, 3)), ValueError, "x"),
    *(_case(name, "a-dtype", lambda f, g: f(g.a.astype(np.float32), g.w), TypeError, "a")
      for name in ("gemm_bf16", "gemm_fp64")),
    *(_case(name, "a-shape", lambda f, g: f(g.a[0], g.w), ValueError, "a") for name in ("gemm_bf16", "gemm_fp64")),
    *(_case(name, "w-shape", lambda f, g: f(g.a, g.w[:, :-1]), ValueError, "w") for name in ("gemm_bf16", "gemm_fp64")),
    *(_case(name, "w-None", lambda f, g: f(g.a, None), TypeError, "w") for name in ("gemm_bf16", "gemm_fp64")),
    _case("rowdiff_ref", "base-dtype", lambda f, g: f(g.base.astype(np.float32), g.served, 0.0), TypeError, "base"),
    _case("rowdiff_ref", "served-shape", lambda f, g: f(g.base, g.served[:-1], 0.0), ValueError, "served"),
    _case("rowdiff_ref", "thresh-dtype", lambda f, g: f(g.base, g.served, True), TypeError, "thresh"),
    _case("rowdiff_ref", "thresh-range", lambda f, g: f(g.base, g.served, float("nan")), ValueError, "thresh"),
    _case("embed_overlay_ref", "out-None", lambda f, g: f(*_embed(g, out=None)), TypeError, "out"),
    _case("embed_overlay_ref", "ids-float", lambda f, g: f(*_embed(g, ids=g.tokens.astype(float))), TypeError, "ids"),
    _case("embed_overlay_ref", "ids-count", lambda f, g: f(*_embed(g, ids=g.tokens[:-1])), ValueError, "ids"),
    _case("embed_overlay_ref", "ids-range", lambda f, g: f(*_embed(g, ids=_swap(g.tokens, 1, -3))), ValueError,
          "ids[1]"),
    _case("embed_overlay_ref", "seq_slot-float", lambda f, g: f(*_embed(g, seq_slot=g.seq.astype(float))), TypeError,
          "seq_slot"),
    _case("embed_overlay_ref", "seq_slot-count", lambda f, g: f(*_embed(g, seq_slot=g.seq[:2])), ValueError,
          "seq_slot"),
    _case("embed_overlay_ref", "seq_slot-range", lambda f, g: f(*_embed(g, seq_slot=_swap(g.seq, 0, 2))), ValueError,
          "seq_slot"),
    _case("embed_overlay_ref", "active-range", lambda f, g: f(*_embed(g, seq_slot=None, active=2)), ValueError,
          "active"),
    _case("embed_overlay_ref", "active-float", lambda f, g: f(*_embed(g, active=0.0)), TypeError, "active"),
    _case("embed_overlay_ref", "vocab-range", lambda f, g: f(*_embed(g, vocab=0)), ValueError, "vocab"),
    _case("embed_overlay_ref", "slot_maps-None", lambda f, g: f(*_embed(g, slot_maps=None)), TypeError, "slot_maps"),
    _case("embed_overlay_ref", "slot_rows-count", lambda f, g: f(*_embed(g, slot_rows=g.rows[:1])), ValueError,
          "slot_rows"),
    _case("embed_overlay_ref", "n_tab-count", lambda f, g: f(*_embed(g, n_tab=[3])), ValueError, "n_tab"),
    _case("embed_overlay_ref", "n_tab-range", lambda f, g: f(*_embed(g, n_tab=[3, 3])), ValueError, "n_tab[1]"),
    _case("embed_overlay_ref", "n_tab-dtype", lambda f, g: f(*_embed(g, n_tab=[3, 2.0])), TypeError, "n_tab[1]"),
    _case("embed_overlay_ref", "slot_map-dtype", lambda f, g: f(*_embed(g, slot_maps=_swap(
        g.maps, 0, g.maps[0].astype(np.float32)))), TypeError, "slot_maps[0]"),
    _case("embed_overlay_ref", "slot_map-shape", lambda f, g: f(*_embed(g, slot_maps=_swap(g.maps, 0, g.maps[0][:9]))),
          ValueError, "slot_maps[0]"),
    _case("embed_overlay_ref", "slot_rows-shape", lambda f, g: f(*_embed(g, slot_rows=_swap(
        g.rows, 1, g.rows[1][:, :4]))), ValueError, "slot_rows[1]"),
    _case("lmhead_dot", "x-dtype", lambda f, g: f(g.base.astype(np.float32), g.served, True), TypeError, "x"),
    _case("lmhead_dot", "w-shape", lambda f, g: f(g.base, g.served[:, :4], True), ValueError, "w"),
    _case("lmhead_dot", "vector-dtype", lambda f, g: f(g.base, g.served, 1), TypeError, "vector"),
    _case("lmhead_dot", "vector-range", lambda f, g: f(g.base[:, :7], g.served[:, :7], True), ValueError, "vector"),
    _case("lmhead_overlay_ref", "logits-dtype", lambda f, g: f(*_lmhead(g, logits=g.lm_logits.astype(np.float16))),
          TypeError, "logits"),
    _case("lmhead_overlay_ref", "hidden-shape", lambda f, g: f(*_lmhead(g, hidden=g.hidden[:2])), ValueError,
          "hidden"),
    _case("lmhead_overlay_ref", "vocab-range", lambda f, g: f(*_lmhead(g, vocab=11)), ValueError, "vocab"),
    _case("lmhead_overlay_ref", "max_n_override-range", lambda f, g: f(*_lmhead(g, max_n_override=70000)),
          ValueError, "max_n_override"),
    _case("lmhead_overlay_ref", "slot_ids-dtype", lambda f, g: f(*_lmhead(g, slot_ids=[g.lm_ids[0].astype(np.int64)])),
          TypeError, "slot_ids[0]"),
    _case("lmhead_overlay_ref", "slot_ids-count", lambda f, g: f(*_lmhead(g, slot_ids=g.lm_ids * 2)), ValueError,
          "slot_ids"),
    _case("lmhead_overlay_ref", "n_tab-range", lambda f, g: f(*_lmhead(g, slot_ids=[g.lm_ids[0][:1]])), ValueError,
          "n_tab[0]"),
    _case("lmhead_overlay_ref", "vector-range", lambda f, g: f(*_lmhead(g, hidden=g.hidden[:, :7], slot_rows=[
        g.lm_rows[0][:, :7]]), vector=True), ValueError, "vector"),
    _case("lmhead_overlay_ref", "seq_slot-range", lambda f, g: f(*_lmhead(g, seq_slot=[0, 1, 0])), ValueError,
          "seq_slot"),
    _case("gather_then_overlay_ref", "table-dtype", lambda f, g: f(g.lm_head.astype(np.float32), g.tokens, g.seq, 0,
                                                                   g.maps, g.rows, g.n), TypeError, "table"),
    _case("gather_then_overlay_ref", "ids-range", lambda f, g: f(g.lm_head, _swap(g.tokens, 3, 10), g.seq, 0,
                                                                 g.maps, g.rows, g.n), ValueError, "ids[3]"),
    _case("gather_then_overlay_ref", "n_tab-count", lambda f, g: f(g.lm_head, g.tokens, g.seq, 0, g.maps, g.rows,
                                                                   g.n[:1]), ValueError, "n_tab"),
    _case("logits_then_overlay_ref", "hidden-None", lambda f, g: f(None, g.lm_head, None, 0, g.lm_rows, g.lm_ids,
                                                                   g.lm_n, 2), TypeError, "hidden"),
    _case("logits_then_overlay_ref", "lm_head-shape", lambda f, g: f(g.hidden, g.lm_head[:, :4], None, 0, g.lm_rows,
                                                                     g.lm_ids, g.lm_n, 2), ValueError, "lm_head"),
    _case("logits_then_overlay_ref", "dtype-dtype", lambda f, g: f(g.hidden, g.lm_head, None, 0, g.lm_rows, g.lm_ids,
                                                                   g.lm_n, 2, np.float16), TypeError, "dtype"),
    _case("logits_then_overlay_ref", "active-range", lambda f, g: f(g.hidden, g.lm_head, None, 1, g.lm_rows,
                                                                    g.lm_ids, g.lm_n, 2), ValueError, "active"),
]


@pytest.mark.parametrize("name, call, exc, arg", REFUSALS)
def test_each_reference_refuses_a_bad_argument_naming_it(rng, name, call, exc, arg):
    """What a reference cannot compute is refused at its entry, as the runners refuse it: the exception
    type (TypeError for a wrong type or dtype, ValueError for a wrong value or shape) and a message that
    starts with the function's name and names the argument."""
    assert_refused(lambda: call(getattr(ref, name), good_arguments(rng)), exc, name, arg)


def test_the_refusals_spoil_good_arguments(rng):
    """Every reference accepts the arguments the refusal cases spoil (so each case fails for its own reason)."""
    g = good_arguments(rng)
    for f in (ngram_embed, ngram_embed_fused, ngram_embed_ideal):
        assert f(*_layer(g)).shape == (g.seq_len, 8)
    assert ref.batched_embed(g.table, g.ids).shape == (5, 3)
    assert ref.batched_embed_fp8(g.fp8, g.scale, g.ids).shape == (5, 3)
    assert ref.dequant_fp8(g.fp8, g.scale).shape == (12, 3)
    assert ref.gather_table(g.fp8, g.scale, g.ids).shape == ref.gather_table(g.table, None, list(g.ids)).shape
    assert ref.argmax_ids(g.logits).shape == (3,) and ref.embed_from_argmax(g.logits, g.table)[1].shape == (3, 3)
    assert ref.scaled_add(g.x, g.y, 0.5).shape == ref.residual_add(g.x, g.y).shape == (6,)
    assert ref.gemm_bf16(g.a, g.w).shape == ref.gemm_fp64(g.a, g.w).shape == (3, 4)
    assert rowdiff_ref(g.base, g.served, 0.0).shape == (4,)
    assert embed_overlay_ref(*_embed(g)).shape == (5, 8)
    assert embed_overlay_ref(*_embed(g, seq_slot=None, active=1)).shape == (5, 8)
    assert lmhead_dot(g.base, g.served, True).shape == (4,)
    assert lmhead_overlay_ref(*_lmhead(g))[1].any()
    assert gather_then_overlay_ref(g.lm_head, g.tokens, g.seq, 0, g.maps, g.rows, g.n).shape == (5, 8)
    assert logits_then_overlay_ref(g.hidden, g.lm_head, None, 0, g.lm_rows, g.lm_ids, g.lm_n, 2)[1].any()


class Rows:
    """A table known by its ``shape`` and ``dtype`` whose rows come on indexing (as a device
    table's would): the n-gram references read the rows they need and check the rest."""

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.shape, self.dtype = array, array.shape, array.dtype

    def __getitem__(self, ids):
        return self.array[ids]


@pytest.mark.parametrize("reference", [ngram_embed, ngram_embed_fused, ngram_embed_ideal])
def test_ngram_references_read_rows_of_an_array_like(rng, reference):
    g = good_arguments(rng)
    word, tables = Rows(g.word), [(Rows(t), s) for t, s in g.tables]
    want = reference(*_layer(g))
    got = reference(*_layer(g, word=word, tables=tables))
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    with pytest.raises(ValueError, match=r"word must be \[20, 8\], got shape \[19, 8\]"):
        reference(*_layer(g, word=Rows(g.word[:-1])))


@pytest.mark.parametrize("below", [False, True])
def test_gemm_bf16_rounds_the_exact_sum_once(below):
    """1 + 2^-8 +- 2^-30 lies just off the midpoint of bf16's 1 and 1 + 2^-7: rounded once it goes to
    the nearer, where rounding to fp32 first would land on the midpoint and go to the even 1."""
    a = np.array([[1.0, 2.0**-8, 2.0**-30]], dtype=np.float32).astype(BF16)
    w = np.array([[1.0, 1.0, -1.0 if below else 1.0]], dtype=np.float32).astype(BF16)
    got = ref.gemm_bf16(a, w)
    assert got.dtype == BF16 and got.shape == (1, 1)
    assert float(got[0, 0]) == (1.0 if below else 1.0 + 2.0**-7)
