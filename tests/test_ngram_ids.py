"""CPU tests of ``NgramDims`` and the hashed n-gram ids (no device needed: these run in CI).

The ids are checked three ways: hand-computed examples (the numbers are in the comments), a
brute-force reference that is literally the formula with Python ints (so it cannot overflow), and
the tail-only path against the full computation.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

import numpy as np
import pytest

from layers.ngram_embed.dims import MAX_TABLE_ROWS, NgramDims
from layers.ngram_embed.ids import ngram_ids, ngram_ids_array, ngram_ids_tail
from tests.helpers import WindowOnly


# ---- reference ------------------------------------------------------------------------------
def brute_force_ids(dims: NgramDims, tokens: Sequence[int]) -> list[list[int]]:
    """The formula, with Python big ints: id[c][p] = sum_{d<n} tokens[p-d] * V**d mod rows(c),
    stopping before the start and (d > 0) at an EOS token."""
    v = dims.vocab_size
    out = []
    for c in range(dims.num_tables()):
        n, _ = dims.order_split(c)
        rows = dims.table_rows(c)
        row = []
        for p in range(len(tokens)):
            total = 0
            for d in range(n):
                if p - d < 0:
                    break
                if d > 0 and dims.eos_id is not None and int(tokens[p - d]) == dims.eos_id:
                    break
                total += int(tokens[p - d]) * v**d
            row.append(total % rows)
        out.append(row)
    return out


def assert_ids_equal(got: list[np.ndarray], want: list[list[int]]) -> None:
    assert len(got) == len(want)
    for c, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == np.int64, f"table {c}: dtype {g.dtype}"
        assert g.shape == (len(w),), f"table {c}: shape {g.shape}"
        assert [int(x) for x in g] == w, f"table {c}: {g.tolist()} != {w}"


def random_tokens(rng: np.random.Generator, dims: NgramDims, length: int) -> np.ndarray:
    """Random ids in 0..V-1 covering both ends of the range; with an EOS id, about one token in
    four is EOS (so runs of EOS, EOS at the start and at the end all occur)."""
    tok = rng.integers(0, dims.vocab_size, size=length, dtype=np.int64)
    if length:
        tok[rng.random(length) < 0.05] = dims.vocab_size - 1
        tok[rng.random(length) < 0.05] = 0
    if dims.eos_id is not None:
        tok[rng.random(length) < 0.25] = dims.eos_id
    return tok


# ---- NgramDims ------------------------------------------------------------------------------
def test_dims_sizes_and_indexing() -> None:
    dims = NgramDims(vocab_size=1000, hidden_size=100, max_ngram=4, splits=3, base_rows=50,
                     row_bias=1)
    assert dims.num_tables() == 9
    assert dims.table_dim() == 100 // 9 == 11
    assert [dims.table_rows(c) for c in range(9)] == [50 + 2 * c + 1 for c in range(9)]
    seen = []
    for n in range(2, 5):
        for k in range(3):
            c = dims.table_index(n, k)
            assert c == (n - 2) * 3 + k
            assert dims.order_split(c) == (n, k)
            seen.append(c)
    assert seen == list(range(9))
    for bad in (-1, 9):
        with pytest.raises(IndexError):
            dims.table_rows(bad)
        with pytest.raises(IndexError):
            dims.order_split(bad)
    for n, k in ((1, 0), (5, 0), (2, -1), (2, 3)):
        with pytest.raises(IndexError):
            dims.table_index(n, k)


def test_dims_explicit_table_dim_frozen_and_replace() -> None:
    dims = NgramDims(vocab_size=10, hidden_size=8, max_ngram=2, splits=1, base_rows=3, table_dim=40)
    assert dims.table_dim() == 40  # explicit, may exceed D // T
    with pytest.raises(AttributeError):
        dims.vocab_size = 11  # type: ignore[misc]
    assert dims == NgramDims(10, 8, 2, 1, 3, table_dim=40)
    assert hash(dims) == hash(NgramDims(10, 8, 2, 1, 3, table_dim=40))
    other = dims.replace(hidden_size=16, table_dim=None)
    assert other.table_dim() == 16 and other.vocab_size == 10
    with pytest.raises(TypeError):
        dims.replace(nonsense=1)


def test_dims_published_settings() -> None:
    paper = NgramDims.over_encoding(vocab_size=32000, hidden_size=4096, max_ngram=3, splits=8,
                                    base_rows=1 << 20)
    assert (paper.row_bias, paper.eos_id) == (0, None)
    assert paper.num_tables() == 16 and paper.table_dim() == 256
    assert paper.table_rows(0) == 1 << 20 and paper.table_rows(15) == (1 << 20) + 30
    flash = NgramDims.longcat_flash(vocab_size=131072, hidden_size=3072, max_ngram=5, splits=4,
                                    ratio=78.0, eos_id=2, table_dim=128)
    assert flash.base_rows == int(78.0 * 131072) and flash.row_bias == 1 and flash.eos_id == 2
    assert flash.table_rows(3) == int(78.0 * 131072) + 2 * 3 + 1
    assert flash.table_dim() == 128
    assert NgramDims.longcat_flash(10, 64, 3, 1, 1.5, 9).table_rows(0) == 16


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_size=0), "vocab_size V must be an int >= 1, got 0"),
    (dict(hidden_size=0), "hidden_size D must be an int >= 1"),
    (dict(max_ngram=1), "max_ngram N must be >= 2"),
    (dict(splits=0), "splits K must be an int >= 1"),
    (dict(base_rows=0), "base_rows m must be an int >= 1"),
    (dict(row_bias=2), "row_bias b must be 0 or 1"),
    (dict(row_bias=-1), "row_bias b must be 0 or 1"),
    (dict(hidden_size=5, max_ngram=3, splits=3), "hidden_size D=5 too small for K*(N-1)=6 tables"),
    (dict(table_dim=0), "table_dim must be an int >= 1"),
    (dict(eos_id=100), "eos_id must be in 0..V-1"),
    (dict(eos_id=-1), "eos_id must be in 0..V-1"),
    (dict(base_rows=MAX_TABLE_ROWS), "at most 2**63 rows"),
])
def test_dims_validation(kwargs: dict, message: str) -> None:
    args = dict(vocab_size=100, hidden_size=64, max_ngram=3, splits=2, base_rows=10, row_bias=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        NgramDims(**args)


def test_dims_validation_types_and_limits() -> None:
    with pytest.raises(TypeError, match="NgramDims: vocab_size V must be an int, got float 100.0"):
        NgramDims(100.0, 64, 3, 2, 10)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hidden_size D must be an int, got bool"):
        NgramDims(100, True, 3, 2, 10)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="eos_id must be an int"):
        NgramDims(100, 64, 3, 2, 10, eos_id=1.0)  # type: ignore[arg-type]
    # numpy integers are fine; the largest legal table has exactly 2**63 rows.
    dims = NgramDims(np.int64(100), 64, 3, 2, MAX_TABLE_ROWS - 2 * 3 - 1, row_bias=1)
    assert dims.table_rows(3) == MAX_TABLE_ROWS
    with pytest.raises(ValueError, match="at most 2"):
        NgramDims(100, 64, 3, 2, MAX_TABLE_ROWS - 2 * 3, row_bias=1)
    with pytest.raises(ValueError, match="ratio"):
        NgramDims.longcat_flash(100, 64, 3, 2, 0.0, eos_id=1)
    with pytest.raises(ValueError, match="ratio"):
        NgramDims.longcat_flash(100, 64, 3, 2, float("inf"), eos_id=1)
    with pytest.raises(ValueError, match="eos_id"):
        NgramDims.longcat_flash(100, 64, 3, 2, 1.0, eos_id=100)


@pytest.mark.parametrize("args, error, message", [
    ((-1, 64, 3, 2, 0.5, None), ValueError, "vocab_size V must be an int >= 1, got -1"),
    ((0, 64, 3, 2, 0.5, None), ValueError, "vocab_size V must be an int >= 1, got 0"),
    ((100.0, 64, 3, 2, 0.5, None), TypeError, "vocab_size V must be an int, got float 100.0"),
    ((100, 64, 3, 2, 0.001, 1), ValueError, "ratio 0.001 too small for vocab_size V=100"),
    ((100, 0, 3, 2, 0.5, None), ValueError, "hidden_size D must be an int >= 1"),
    ((100, 64, 1, 2, 0.5, None), ValueError, "max_ngram N must be >= 2"),
    ((100, 64, 3, 0, 0.5, None), ValueError, "splits K must be an int >= 1"),
], ids=["V-negative", "V-zero", "V-float", "ratio-small", "D", "N", "K"])
def test_longcat_flash_names_the_argument_the_caller_passed(args, error, message) -> None:
    """``longcat_flash`` takes V and a ratio, not ``base_rows``: its messages name what the caller gave."""
    with pytest.raises(error, match=re.escape(message)) as info:
        NgramDims.longcat_flash(*args)
    assert "base_rows" not in str(info.value)


# ---- hand-computed ids ----------------------------------------------------------------------
def test_ids_over_encoding_by_hand() -> None:
    # V = 10 so the n-gram value is the decimal number the tokens spell (most recent = units).
    # N = 3, K = 2: tables c0 (n=2, 7 rows), c1 (n=2, 9 rows), c2 (n=3, 11), c3 (n=3, 13).
    dims = NgramDims.over_encoding(vocab_size=10, hidden_size=64, max_ngram=3, splits=2, base_rows=7)
    tokens = [3, 1, 4, 1, 5]
    # 2-gram values: 3, 31, 14, 41, 15; 3-gram values: 3, 31, 314, 141, 415 (zero padding).
    want = [
        [3, 31 % 7, 14 % 7, 41 % 7, 15 % 7],          # [3, 3, 0, 6, 1]
        [3, 31 % 9, 14 % 9, 41 % 9, 15 % 9],          # [3, 4, 5, 5, 6]
        [3, 31 % 11, 314 % 11, 141 % 11, 415 % 11],   # [3, 9, 6, 9, 8]
        [3, 31 % 13, 314 % 13, 141 % 13, 415 % 13],   # [3, 5, 2, 11, 12]
    ]
    assert want == [[3, 3, 0, 6, 1], [3, 4, 5, 5, 6], [3, 9, 6, 9, 8], [3, 5, 2, 11, 12]]
    assert_ids_equal(ngram_ids(dims, tokens), want)
    assert_ids_equal(ngram_ids(dims, np.array(tokens, dtype=np.uint16)), want)
    assert brute_force_ids(dims, tokens) == want
    assert ngram_ids_array(dims, tokens).tolist() == want


def test_ids_longcat_flash_eos_by_hand() -> None:
    # V = 10, N = 3, K = 1, ratio 1.5: rows 15 + 2c + 1 = 16 (2-grams), 18 (3-grams); EOS = 9.
    dims = NgramDims.longcat_flash(vocab_size=10, hidden_size=64, max_ngram=3, splits=1, ratio=1.5,
                                   eos_id=9)
    # EOS at the start, doubled (positions 2, 3), trailing (position 6).
    tokens = [9, 2, 9, 9, 3, 4, 9]
    # p0: 9 (its own token; nothing before).   p1: 2 (the 9 before it is EOS).
    # p2: 9 + 2*10 = 29, then an EOS at d=2: 29.   p3: 9 (EOS right before).   p4: 3.
    # p5: 4 + 3*10 = 34, EOS at d=2: 34.   p6: 9 + 4*10 = 49; 3-gram 49 + 3*100 = 349.
    want = [
        [9, 2, 29 % 16, 9, 3, 34 % 16, 49 % 16],      # [9, 2, 13, 9, 3, 2, 1]
        [9, 2, 29 % 18, 9, 3, 34 % 18, 349 % 18],     # [9, 2, 11, 9, 3, 16, 7]
    ]
    assert want == [[9, 2, 13, 9, 3, 2, 1], [9, 2, 11, 9, 3, 16, 7]]
    assert_ids_equal(ngram_ids(dims, tokens), want)
    assert brute_force_ids(dims, tokens) == want  # the reference agrees with the hand
    # The same tokens without the EOS rule (paper, rows 15 and 17) reach across every 9:
    # 2-grams 9, 92, 29, 99, 93, 34, 49; 3-grams 9, 92, 929, 299, 993, 934, 349.
    paper = NgramDims.over_encoding(10, 64, 3, 1, 15)
    assert_ids_equal(ngram_ids(paper, tokens), [[9, 2, 14, 9, 3, 4, 4], [9, 7, 11, 10, 7, 16, 9]])
    assert brute_force_ids(paper, tokens) == [[9, 2, 14, 9, 3, 4, 4], [9, 7, 11, 10, 7, 16, 9]]


def test_ids_eos_zero_and_eos_only_stops_looking_back() -> None:
    # EOS = 0, the same value as the padding: [7, 0, 5]. p1 is EOS and keeps its look-back
    # (0 + 7*10 = 70); p2 stops at the EOS before it: 5, not 5 + 0 + 700 = 705.
    dims = NgramDims.longcat_flash(10, 64, 3, 1, 1.5, eos_id=0)
    assert_ids_equal(ngram_ids(dims, [7, 0, 5]), [[7, 70 % 16, 5], [7, 70 % 18, 5]])
    no_eos = NgramDims(10, 64, 3, 1, 15, row_bias=1)
    assert_ids_equal(ngram_ids(no_eos, [7, 0, 5]), [[7, 70 % 16, 5], [7, 70 % 18, 705 % 18]])
    # Only EOS tokens: every position is its own token.
    dims9 = dims.replace(eos_id=9)
    assert_ids_equal(ngram_ids(dims9, [9, 9, 9, 9]), [[9] * 4, [9] * 4])


def test_ids_empty_and_single_table_row() -> None:
    dims = NgramDims.over_encoding(10, 64, 4, 2, 5)
    for empty in ([], np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float64)):
        ids = ngram_ids(dims, empty)
        assert len(ids) == 6 and all(a.shape == (0,) and a.dtype == np.int64 for a in ids)
    # base_rows 1, b = 0, one table: one row, every id 0.
    one = NgramDims(10, 8, 2, 1, 1)
    assert_ids_equal(ngram_ids(one, [1, 2, 3]), [[0, 0, 0]])


# ---- brute force on random inputs, where int64 arithmetic would overflow --------------------
@pytest.mark.parametrize("base_rows", [
    1, 2, 97, (1 << 20) + 1, (1 << 31) - 1, 1 << 31, (1 << 32) + 7, (1 << 40) + 3, (1 << 62) + 5,
    MAX_TABLE_ROWS - 2 * 15 - 1,
])
@pytest.mark.parametrize("splits", [1, 3, 4, 8])  # 4: T = 16, whose largest table reaches MAX_TABLE_ROWS exactly
def test_ids_match_big_int_reference(rng: np.random.Generator, base_rows: int, splits: int) -> None:
    v = int(rng.integers((1 << 17) - 64, (1 << 17) + 64))
    assert (v - 1) * v**4 > 1 << 63  # a 5-gram term tokens[p-4] * V**4 alone does not fit int64
    biases = [b for b in (0, 1) if base_rows + 2 * (splits * 4 - 1) + b <= MAX_TABLE_ROWS]
    if not biases:
        pytest.skip(f"K = {splits}: the largest table of base_rows {base_rows} passes MAX_TABLE_ROWS")
    for row_bias in biases:
        for eos_id in (None, int(rng.integers(0, v))):
            dims = NgramDims(v, 4096, 5, splits, base_rows, row_bias=row_bias, eos_id=eos_id)
            tokens = random_tokens(rng, dims, int(rng.integers(1, 40)))
            assert_ids_equal(ngram_ids(dims, tokens), brute_force_ids(dims, tokens.tolist()))


@pytest.mark.parametrize("vocab_bits, rows_bits", [
    (24, 40), (40, 24), (40, 40), (60, 62), (62, 30), (8, 63),
    # tokens one bit wider than a single digit (s = 64 - rows_bits): must be split or reduced
    (25, 40), (17, 48), (33, 32),
])
def test_ids_match_big_int_reference_huge_vocab(rng: np.random.Generator, vocab_bits: int,
                                                rows_bits: int) -> None:
    """Vocabularies far past any real one, so that tokens themselves must be split into digits."""
    for _ in range(3):
        v = int(rng.integers(1 << (vocab_bits - 1), 1 << vocab_bits))
        n = int(rng.integers(2, 7))
        k = int(rng.integers(1, 4))
        m = int(rng.integers(1 << (rows_bits - 1), (1 << rows_bits) - 2 * k * n))
        eos = None if rng.random() < 0.5 else int(rng.integers(0, v))
        dims = NgramDims(v, 1024, n, k, m, row_bias=int(rng.integers(0, 2)), eos_id=eos)
        tok = rng.integers(0, v, size=int(rng.integers(1, 30)), dtype=np.uint64)
        tok[rng.random(tok.shape[0]) < 0.2] = v - 1
        if eos is not None:
            tok[rng.random(tok.shape[0]) < 0.2] = eos
        assert_ids_equal(ngram_ids(dims, tok), brute_force_ids(dims, [int(x) for x in tok]))


# ---- the tail-only path ---------------------------------------------------------------------
@pytest.mark.parametrize("with_eos", [False, True])
def test_tail_equals_full(rng: np.random.Generator, with_eos: bool) -> None:
    for _ in range(60):
        n = int(rng.integers(2, 7))
        dims = NgramDims(int(rng.integers(2, 1 << 17)), 512, n, int(rng.integers(1, 5)),
                         int(rng.integers(1, 1 << 31)), row_bias=int(rng.integers(0, 2)),
                         eos_id=None)
        if with_eos:
            dims = dims.replace(eos_id=int(rng.integers(0, dims.vocab_size)))
        length = int(rng.integers(0, 3 * n + 4))  # often shorter than N, often just past it
        tokens = random_tokens(rng, dims, length)
        full = ngram_ids_array(dims, tokens)
        for seq_len in sorted({0, length, *rng.integers(0, length + 1, size=4).tolist()}):
            tail = ngram_ids_tail(dims, tokens, seq_len)
            assert len(tail) == dims.num_tables()
            for c, ids in enumerate(tail):
                assert ids.dtype == np.int64 and ids.shape == (seq_len,)
                np.testing.assert_array_equal(ids, full[c, length - seq_len:])
            # a Python list takes the same path
            list_tail = ngram_ids_tail(dims, tokens.tolist(), seq_len)
            assert all(np.array_equal(a, b) for a, b in zip(list_tail, tail))


def test_tail_reads_only_the_window() -> None:
    dims = NgramDims.longcat_flash(10, 64, 3, 1, 1.5, eos_id=9)
    tail_tokens = [9, 2, 9, 9, 3, 4, 9]  # the hand example: ids known
    ctx = WindowOnly(10**12, tail_tokens)
    # seq_len 3 reads the last 3 + N - 1 = 5 tokens: [9, 9, 3, 4, 9] -> positions p4..p6 above.
    assert_ids_equal(ngram_ids_tail(dims, ctx, 3), [[3, 2, 1], [3, 16, 7]])
    assert_ids_equal(ngram_ids_tail(dims, ctx, 0), [[], []])
    # An invalid token before the window is not read (the cost is bounded by seq_len) ...
    tokens = np.array([99, 1, 2, 3, 4], dtype=np.int64)
    # p3 = 3 + 2*10 = 23, p4 = 4 + 3*10 = 34 (mod 16); 3-grams 123, 234 (mod 18).
    assert_ids_equal(ngram_ids_tail(dims, tokens, 2), [[23 % 16, 34 % 16], [123 % 18, 234 % 18]])
    # ... but one inside it is refused, named by its position in the context.
    with pytest.raises(ValueError, match="token 99 at position 0"):
        ngram_ids_tail(dims, tokens, 3)
    with pytest.raises(ValueError, match="token 99 at position 0"):
        ngram_ids(dims, tokens)


def test_tail_decode_time_on_long_context(rng: np.random.Generator) -> None:
    """Performance sanity, not a timed assertion: a decode step after a 1M-token context."""
    dims = NgramDims.longcat_flash(131072, 4096, 3, 8, 78.0, eos_id=2, table_dim=256)
    ctx = rng.integers(0, dims.vocab_size, size=1 << 20, dtype=np.int64)
    want = ngram_ids_array(dims, ctx[-8:])[:, -1:]
    runs = []
    for _ in range(50):
        t0 = time.perf_counter()
        ids = ngram_ids_tail(dims, ctx, 1)
        runs.append(time.perf_counter() - t0)
    np.testing.assert_array_equal(np.stack(ids), want)
    t0 = time.perf_counter()
    ngram_ids_tail(dims, ctx, 2048)
    prefill = time.perf_counter() - t0
    print(f"ngram_ids_tail, 1M-token context, T={dims.num_tables()}: seq_len=1 median "
          f"{np.median(runs) * 1e6:.1f} us; seq_len=2048 {prefill * 1e6:.0f} us")


# ---- token and seq_len validation -----------------------------------------------------------
def test_token_validation() -> None:
    dims = NgramDims.over_encoding(10, 64, 3, 2, 7)
    with pytest.raises(ValueError, match="token 10 at position 2 outside 0..V-1 = 0..9"):
        ngram_ids(dims, [1, 2, 10, 11])
    with pytest.raises(ValueError, match="token -1 at position 1"):
        ngram_ids(dims, np.array([1, -1, 3], dtype=np.int8))
    with pytest.raises(ValueError, match="token 255 at position 0"):
        ngram_ids(dims, np.array([255], dtype=np.uint8))
    with pytest.raises(TypeError, match="tokens must be integers, got dtype float64"):
        ngram_ids(dims, np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="tokens must be integers, got dtype bool"):
        ngram_ids(dims, np.array([True, False]))
    with pytest.raises(TypeError, match="tokens must be integers, got dtype object"):
        ngram_ids(dims, [1, 1 << 70])
    with pytest.raises(ValueError, match="1-D"):
        ngram_ids(dims, np.array([[1, 2], [3, 4]]))
    for no_sequence in (None, 5, "abc"):  # a wrong type, not a wrong shape: TypeError naming tokens
        with pytest.raises(TypeError, match=f"ngram ids: tokens must be a 1-D sequence of token ids, got "
                                            f"{type(no_sequence).__name__}"):
            ngram_ids(dims, no_sequence)
        with pytest.raises(TypeError, match="tokens must be a 1-D sequence"):
            ngram_ids_tail(dims, no_sequence, 0)
    with pytest.raises(ValueError, match="1-D"):
        ngram_ids_tail(dims, np.array([[1, 2], [3, 4]]), 1)
    with pytest.raises(ValueError, match="1-D"):
        ngram_ids_tail(dims, [[1, 2], [3, 4]], 1)
    with pytest.raises(ValueError, match="token 12 at position 4"):
        ngram_ids_tail(dims, [1, 2, 3, 4, 12], 1)
    with pytest.raises(TypeError, match="tokens must be integers"):
        ngram_ids_tail(dims, [1.5, 2.5], 1)


def test_seq_len_validation() -> None:
    dims = NgramDims.over_encoding(10, 64, 3, 2, 7)
    tokens = np.array([1, 2, 3])
    with pytest.raises(ValueError, match="seq_len must be a non-negative int, got -1"):
        ngram_ids_tail(dims, tokens, -1)
    for bad in (4, 100):
        with pytest.raises(ValueError, match=f"seq_len {bad} exceeds the context's 3 tokens"):
            ngram_ids_tail(dims, tokens, bad)
    for bad in (1.0, True, None):
        with pytest.raises(TypeError, match="seq_len must be an int"):
            ngram_ids_tail(dims, tokens, bad)  # type: ignore[arg-type]
    assert [a.tolist() for a in ngram_ids_tail(dims, tokens, np.int64(3))] == \
        ngram_ids_array(dims, tokens).tolist()


@pytest.mark.parametrize("dims", [None, "dims", 3])
def test_dims_that_are_not_ngram_dims_are_a_type_error(dims):
    """``ngram_ids(None, ...)`` was an ``AttributeError`` from deep inside (issue 44)."""
    from layers.ngram_embed.ids import ngram_ids, ngram_ids_array, ngram_ids_tail

    for call in (lambda: ngram_ids(dims, [1, 2]), lambda: ngram_ids_array(dims, [1, 2]),
                 lambda: ngram_ids_tail(dims, [1, 2], 1)):
        with pytest.raises(TypeError, match=f"dims must be an NgramDims, got {type(dims).__name__}"):
            call()
