"""The Engram hash's numpy reference (CPU): hand-worked row ids (small primes and multipliers, the
arithmetic in the comments), one real-config row re-derived with Python ints, and properties: every
id inside its bucket and below 2**31 at the real config, a DEAD position blocking exactly the next
max_ngram - 1 look-backs, chunks with their history equal to the whole, no reset at EOS; ``compress``
and the refusals of both."""

from __future__ import annotations

import numpy as np
import pytest

from layers.engram.config import EngramConfig
from layers.engram.hashing import DEAD, compress, row_ids
from tests.helpers.engram import real_config, tiny, with_multipliers


def _hand_config() -> EngramConfig:
    """One layer, orders 2..3, 2 heads, primes from 10: P = [11, 13 | 17, 19], OFF = [0, 11 | 24, 41];
    multipliers M = [5, 3, 7]."""
    cfg = tiny(engram_layer_ids=[1], engram_vocab_size=10, engram_max_ngram_size=3, engram_n_heads=2)
    assert cfg.primes.tolist() == [[11, 13, 17, 19]] and cfg.offsets.tolist() == [[0, 11, 24, 41]]
    return with_multipliers(cfg, [5, 3, 7])


def test_hand_worked_rows_with_a_sequence_start_and_a_dead_position():
    """compressed [4, 6, DEAD, 2, 5, 7], pad 3. r = t0*5; order 2: r ^= t1*3, rows r%11, r%13+11;
    order 3: r ^= t2*7, rows r%17+24, r%19+41.
      p0: t = [4, 3, 3] (before the start: pad)  r = 20 ^ 9 = 29 -> 7, 3+11;  29 ^ 21 = 8 -> 8+24, 8+41
      p1: t = [6, 4, 3]                          r = 30 ^ 12 = 18 -> 7, 5+11; 18 ^ 21 = 7 -> 7+24, 7+41
      p2: t = [3, 3, 3] (itself DEAD)            r = 15 ^ 9 = 6 -> 6, 6+11;   6 ^ 21 = 19 -> 2+24, 0+41
      p3: t = [2, 3, 3] (k=1 DEAD; k=2 = 6 stays blocked: sticky)
                                                 r = 10 ^ 9 = 3 -> 3, 3+11;   3 ^ 21 = 22 -> 5+24, 3+41
      p4: t = [5, 2, 3] (k=2 DEAD)               r = 25 ^ 6 = 31 -> 9, 5+11;  31 ^ 21 = 10 -> 10+24, 10+41
      p5: t = [7, 5, 2]                          r = 35 ^ 15 = 44 -> 0, 5+11; 44 ^ 14 = 34 -> 0+24, 15+41"""
    rows = row_ids(_hand_config(), np.array([4, 6, DEAD, 2, 5, 7]), 3)
    assert rows.dtype == np.int64 and rows.shape == (6, 1, 4)
    assert rows[:, 0].tolist() == [[7, 14, 32, 49], [7, 16, 31, 48], [6, 17, 26, 41],
                                   [3, 14, 29, 44], [9, 16, 34, 51], [0, 16, 24, 56]]


def test_hand_worked_rows_from_a_history():
    """[6, DEAD, 2] (positions 1..3 above) hashed with history [4] (one id: the sequence starts
    there) gives p1, p2, p3's rows; [2] with history [6, DEAD] sees t = [2, pad, pad]: p3's row."""
    cfg = _hand_config()
    assert row_ids(cfg, [6, DEAD, 2], 3, history=[4])[:, 0].tolist() == [[7, 16, 31, 48], [6, 17, 26, 41],
                                                                       [3, 14, 29, 44]]
    assert row_ids(cfg, [2], 3, history=[6, DEAD])[:, 0].tolist() == [[3, 14, 29, 44]]


def test_a_real_config_row_from_python_ints(rng):
    """Orders 2..4 at the real config, both layers, re-derived with Python ints from the pinned
    primes and multipliers (``test_engram_config``) for a random 4-gram."""
    cfg = EngramConfig.from_dict(real_config())
    seq = [int(x) for x in rng.integers(0, 99092, 5)]
    rows = row_ids(cfg, seq, 2)
    for layer in range(2):
        m, p, off = (a[layer].tolist() for a in (cfg.multipliers, cfg.primes, cfg.offsets))
        t = seq[4], seq[3], seq[2], seq[1]
        r = t[0] * m[0]
        want = []
        for n in (2, 3, 4):
            r ^= t[n - 1] * m[n - 1]
            want += [r % p[(n - 2) * 8 + h] + off[(n - 2) * 8 + h] for h in range(8)]
        assert rows[4, layer].tolist() == want


def _random_sequence(rng, cfg, length, dead_fraction=0.1):
    seq = rng.integers(0, cfg.compressed_vocab_size, length)
    seq[rng.random(length) < dead_fraction] = DEAD
    return seq


def test_every_id_lies_in_its_bucket_and_below_2_31_at_the_real_config(rng):
    cfg = EngramConfig.from_dict(real_config())
    rows = row_ids(cfg, _random_sequence(rng, cfg, 4000), int(rng.integers(0, 99092)))
    lo, hi = cfg.offsets[None], cfg.offsets[None] + cfg.primes[None]
    assert ((rows >= lo) & (rows < hi)).all()
    assert rows.max() < 2**31 and (cfg.offsets[:, -1] + cfg.primes[:, -1] < 2**31).all()
    assert len(np.unique(rows[:, 0, 0])) > 3000  # the rows spread over the bucket


def test_a_dead_position_blocks_exactly_the_next_max_ngram_minus_1_lookbacks(rng):
    cfg = tiny()
    pad = 2
    seq = rng.integers(3, cfg.compressed_vocab_size, 40)  # no pad in it: a look-back at pad would hide a block
    d = int(rng.integers(5, 30))
    dead, alive = seq.copy(), seq.copy()
    dead[d] = DEAD
    rows_dead, rows_alive = row_ids(cfg, dead, pad), row_ids(cfg, alive, pad)
    after = cfg.max_ngram - 1  # positions d+1 .. d+3 look back at d
    assert (rows_dead[:d] == rows_alive[:d]).all()
    assert (rows_dead[d + 1 + after :] == rows_alive[d + 1 + after :]).all()
    assert all((rows_dead[p] != rows_alive[p]).any() for p in range(d, d + 1 + after))
    # after the DEAD the sequence starts over: the rows of the tail hashed with no history
    assert (rows_dead[d + 1 :] == row_ids(cfg, dead[d + 1 :], pad)).all()
    # the DEAD position itself is all pad
    assert (rows_dead[d] == row_ids(cfg, [pad], pad)[0]).all()


def test_hashing_in_chunks_with_the_history_equals_hashing_whole(rng):
    cfg = tiny()
    seq = _random_sequence(rng, cfg, 200)
    whole = row_ids(cfg, seq, 2)
    cuts = sorted({0, 200, *map(int, rng.integers(0, 200, 12))})
    chunks = [row_ids(cfg, seq[a:b], 2, history=seq[max(0, a - 3) : a]) for a, b in zip(cuts, cuts[1:])]
    assert (np.concatenate(chunks) == whole).all()
    for a, b in zip(cuts, cuts[1:]):  # a longer history: only its last max_ngram - 1 ids count
        assert (row_ids(cfg, seq[a:b], 2, history=seq[:a]) == whole[a:b]).all()
    assert row_ids(cfg, seq[:0], 2, history=seq).shape == (0, 2, 6)


def test_no_reset_at_eos(rng):
    """An EOS (any compressed id) is a token like any other: the token after it sees past it."""
    cfg = tiny()
    eos = 1
    seq = rng.integers(3, cfg.compressed_vocab_size, 6)
    seq[3] = eos
    other = seq.copy()
    other[2] = (seq[2] + 1 - 3) % (cfg.compressed_vocab_size - 3) + 3  # the token before the EOS changes
    a, b = row_ids(cfg, seq, 2), row_ids(cfg, other, 2)
    n = cfg.n_heads
    assert (a[4, :, :n] == b[4, :, :n]).all()  # order 2 at p4: [seq[4], EOS]
    assert (a[4, :, n:] != b[4, :, n:]).any()  # orders 3, 4 reach across the EOS


def test_compress_maps_tokens_and_marks_non_text_dead(rng):
    token_map = rng.integers(0, 40, 50)
    tokens = rng.integers(0, 50, 30)
    mask = rng.random(30) < 0.7
    out = compress(token_map, tokens, mask)
    assert out.dtype == np.int64
    assert out.tolist() == [int(token_map[t]) if m else DEAD for t, m in zip(tokens, mask)]
    assert compress(token_map, tokens).tolist() == token_map[tokens].tolist()
    assert compress(token_map, []).shape == (0,)


@pytest.mark.parametrize(
    "tokens, mask, error, match",
    [
        ([1, 50, 2], None, ValueError, r"tokens\[1\] = 50 is outside the token map's 50 ids"),
        ([1, -1], None, ValueError, r"tokens\[1\] = -1 is outside"),
        ([1, 60], [True, False], ValueError, r"tokens\[1\] = 60"),  # masked ids are checked too
        ([1.0, 2.0], None, TypeError, "tokens must hold integers"),
        ([[1, 2]], None, ValueError, "tokens must be 1-D"),
        ([1, 2], [1, 0], TypeError, "text_mask must be bool"),
        ([1, 2], [True], ValueError, r"text_mask has shape \[1\], tokens \[2\]"),
    ],
)
def test_compress_refuses(tokens, mask, error, match, rng):
    with pytest.raises(error, match=match):
        compress(rng.integers(0, 40, 50), tokens, mask)


@pytest.mark.parametrize(
    "compressed, pad, history, error, match",
    [
        ([1, 40], 2, None, ValueError, r"compressed id 40 .* is neither DEAD \(-1\) nor in 0..39"),
        ([1, -2], 2, None, ValueError, "compressed id -2"),
        ([1], 2, [45], ValueError, "compressed id 45"),
        ([1], 40, None, ValueError, r"pad = 40 is not a compressed id \(0..39\)"),
        ([1], DEAD, None, ValueError, "pad = -1 is not a compressed id"),
        ([1], True, None, TypeError, "pad must be an int, got bool"),
        ([1.5], 2, None, TypeError, "compressed must hold integers"),
        ([[1]], 2, None, ValueError, "compressed must be 1-D"),
        ([1], 2, [[1]], ValueError, "history must be 1-D"),
    ],
)
def test_row_ids_refuses(compressed, pad, history, error, match):
    with pytest.raises(error, match=match):
        row_ids(tiny(), compressed, pad, history=history)


def test_row_ids_refuses_a_config_dict():
    with pytest.raises(TypeError, match="cfg must be an EngramConfig, got dict"):
        row_ids(real_config(), [1], 2)
