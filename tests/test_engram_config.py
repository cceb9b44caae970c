"""``EngramConfig`` (CPU): the real DeepSeek-V4.1-Flash config's 48 primes, offsets, table sizes and 8
multipliers pinned (numpy's generator stream is not promised stable), both spellings of the pad and
eps keys, the prime test against a sieve, and every refusal naming its config key."""

from __future__ import annotations

import json

import numpy as np
import pytest

from layers.engram.config import EngramConfig, is_prime, next_primes
from layers.ngram_store.errors import CheckpointError
from tests.helpers.engram import REAL_TEXT_CONFIG, real_config, tiny, tiny_config

# 16000057 .. 16000889: the 48 consecutive primes above engram_vocab_size - 1 = 15999999
REAL_PRIMES = [
    [16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
     16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321,
     16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463],
    [16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627,
     16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769,
     16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889],
]
# numpy 2.x: default_rng(10007 * layer).integers(0, (2**63 - 1) // 99092 // 2, size=4, dtype=int64) * 2 + 1
REAL_MULTIPLIERS = [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
                    [67716810739261, 51510806800915, 30921347202721, 82619226485591]]


def _sieve(lo: int, hi: int) -> list[int]:
    """The primes in [lo, hi) by trial division up to sqrt(hi): independent of ``is_prime``."""
    small = [p for p in range(2, int(hi**0.5) + 1) if all(p % q for q in range(2, int(p**0.5) + 1))]
    return [n for n in range(max(lo, 2), hi) if all(n % p for p in small if p * p <= n)]


@pytest.mark.parametrize("spelling", ["hf", "inference"])
def test_the_real_config_pins_primes_offsets_sums_and_multipliers(spelling):
    cfg = EngramConfig.from_dict(real_config(spelling))
    assert cfg.primes.tolist() == REAL_PRIMES
    assert cfg.multipliers.tolist() == REAL_MULTIPLIERS
    assert cfg.primes.dtype == cfg.offsets.dtype == cfg.multipliers.dtype == np.int64
    assert cfg.num_embeddings == (384006168, 384016682) == tuple(sum(p) for p in REAL_PRIMES)
    assert cfg.offsets[:, :3].tolist() == [[0, 16000057, 32000136], [0, 16000477, 32000964]]
    assert cfg.offsets[:, -1].tolist() == [384006168 - 16000463, 384016682 - 16000889]  # the last bucket ends the table
    for layer in range(2):  # exclusive cumulative sums of the pinned primes
        assert cfg.offsets[layer].tolist() == [sum(REAL_PRIMES[layer][:c]) for c in range(24)]
    assert (cfg.pad_token_id, cfg.eps, cfg.vocab_size, cfg.image_token_id) == (2, 1e-20, 129280, 129264)
    assert (cfg.n_hash_cols, cfg.emb_dim, cfg.kv_dim, cfg.scale_cols, cfg.block_size) == (24, 6144, 25600, 8, 32)
    assert cfg.layer_ids == (1, 14) and cfg.index(14) == 1


def test_the_pinned_primes_are_the_consecutive_primes_from_the_search_start():
    """Checked against trial division, not the module's Miller-Rabin."""
    assert [p for layer in REAL_PRIMES for p in layer] == _sieve(16000000, 16000890)


def test_both_spellings_and_a_flat_config_read_alike():
    hf, inference = EngramConfig.from_dict(real_config("hf")), EngramConfig.from_dict(real_config("inference"))
    assert hf == inference == EngramConfig.from_dict(dict(REAL_TEXT_CONFIG))  # no text_config: the top level
    assert "engram_pad_id" in real_config("inference")["text_config"]
    assert "norm_eps" in real_config("inference")["text_config"]


def test_is_prime_against_a_sieve_and_strong_pseudoprimes():
    primes = set(_sieve(0, 20000))
    assert [n for n in range(20000) if is_prime(n)] == sorted(primes)
    # strong pseudoprimes to the first bases (2047: base 2; 3215031751: bases 2, 3, 5, 7;
    # 3825123056546413051: bases 2 .. 23), a Carmichael number, and Mersenne primes
    for n in (2047, 3215031751, 3825123056546413051, 561, 2**61 + 1, (2**31 - 1) * (2**61 - 1)):
        assert not is_prime(n), n
    for n in (2**31 - 1, 2**61 - 1, 16000057):
        assert is_prime(n), n
    assert next_primes(9, 4) == [11, 13, 17, 19] and next_primes(1, 3) == [2, 3, 5]


def test_multipliers_are_odd_and_bounded_so_no_product_overflows(rng):
    cfg = tiny(engram_layer_ids=[int(x) for x in rng.choice(1000, 3, replace=False)])
    bound = (2**63 - 1) // cfg.compressed_vocab_size // 2
    m = cfg.multipliers
    assert m.shape == (3, 4) and (m % 2 == 1).all() and (m > 0).all() and (m < 2 * bound).all()
    assert all(int(x) * (cfg.compressed_vocab_size - 1) < 2**63 for x in m.ravel())  # t * M fits int64
    for i, layer in enumerate(cfg.layer_ids):  # the reference's rule, per layer, independent of the others
        assert m[i].tolist() == tiny(engram_layer_ids=[layer]).multipliers[0].tolist()


def test_the_tiny_geometry_sums_its_primes_and_its_arrays_are_read_only():
    cfg = tiny()
    assert cfg.primes.tolist() == [[101, 103, 107, 109, 113, 127], [131, 137, 139, 149, 151, 157]]
    assert cfg.num_embeddings == (660, 864)
    assert cfg.offsets.tolist() == [[0, 101, 204, 311, 420, 533], [0, 131, 268, 407, 556, 707]]
    for array in (cfg.primes, cfg.offsets, cfg.multipliers):
        with pytest.raises(ValueError, match="read-only"):
            array[0, 0] = 1
    # the search starts above engram_vocab_size - 1: a prime engram_vocab_size is the first bucket
    assert tiny(engram_vocab_size=101).primes[0, :2].tolist() == [101, 103]
    assert tiny(engram_vocab_size=1).primes[0, :2].tolist() == [2, 3]


def _text(**changes) -> dict:
    config = real_config()
    config["text_config"].update(changes)
    return config


def _without(key: str) -> dict:
    config = real_config()
    del config["text_config"][key]
    return config


REFUSALS = [
    *[(_without(k), ValueError, rf"missing key '{k}'") for k in REAL_TEXT_CONFIG
      if k not in ("model_type", "image_token_id", "engram_pad_token_id", "rms_norm_eps")],
    (_without("engram_pad_token_id"), ValueError, "missing key 'engram_pad_token_id' or 'engram_pad_id'"),
    (_without("rms_norm_eps"), ValueError, "missing key 'rms_norm_eps' or 'norm_eps'"),
    (_text(engram_pad_id=3), ValueError, "engram_pad_token_id = 2 and engram_pad_id = 3 disagree"),
    (_text(engram_n_heads="8"), TypeError, "engram_n_heads must be an int, got str"),
    (_text(hc_mult=True), TypeError, "hc_mult must be an int, got bool"),
    (_text(engram_head_dim=256.0), TypeError, "engram_head_dim must be an int, got float"),
    (_text(engram_layer_ids=1), TypeError, "engram_layer_ids must be a list of ints"),
    (_text(engram_num_embeddings=[384006168, "384016682"]), TypeError, r"engram_num_embeddings\[1\] must be an int"),
    (_text(rms_norm_eps="1e-20"), TypeError, "rms_norm_eps must be a number"),
    (_text(rms_norm_eps=0.0), ValueError, "rms_norm_eps must be a finite number > 0"),
    (_text(engram_n_heads=0), ValueError, r"engram_n_heads must be an int in \[1, 2\*\*63\), got 0"),
    (_text(hidden_size=-5120), ValueError, "hidden_size must be an int in"),
    (_text(engram_vocab_size=0), ValueError, "engram_vocab_size must be an int in"),
    (_text(engram_compressed_vocab_size=0), ValueError, "engram_compressed_vocab_size must be an int in"),
    (_text(engram_max_ngram_size=1), ValueError, r"engram_max_ngram_size must be an int in \[2,"),
    (_text(engram_layer_ids=[1, -14]), ValueError, r"engram_layer_ids\[1\] must be an int in \[0,"),
    (_text(engram_layer_ids=[]), ValueError, "engram_layer_ids is empty"),
    (_text(engram_num_embeddings=[384006168, 0]), ValueError, r"engram_num_embeddings\[1\] must be an int in \[1,"),
    (_text(engram_head_dim=48), ValueError, "engram_head_dim = 48 is not a multiple of the 32-column scale block"),
    (_text(engram_layer_ids=[1, 14, 20]), ValueError, "engram_num_embeddings has 2 entries, engram_layer_ids 3"),
    (_text(engram_layer_ids=[14, 14]), ValueError, r"engram_layer_ids \[14, 14\] names a layer twice"),
    (_text(engram_num_embeddings=[384006168, 384016683]), ValueError,
     r"engram_num_embeddings\[1\] = 384016683 rows for layer 14, but its 24 prime buckets .* sum to 384016682"),
    # a search from 16000058 skips 16000057 and takes 16000477: 384006168 - 16000057 + 16000477
    (_text(engram_vocab_size=16000058), ValueError, r"engram_num_embeddings\[0\] = 384006168 .* sum to 384006588"),
    (_text(engram_n_heads=7), ValueError, r"engram_num_embeddings\[0\] = 384006168 .*21 prime buckets"),
    (_text(engram_pad_token_id=129280), ValueError, "engram_pad_token_id = 129280 is not below vocab_size = 129280"),
    (_text(image_token_id=129280), ValueError, "image_token_id = 129280 is not below vocab_size"),
    (_text(engram_compressed_vocab_size=129281), ValueError, "engram_compressed_vocab_size = 129281 exceeds vocab_size"),
    ({**real_config(), "text_config": [1]}, TypeError, "text_config must be an object"),
    ({**real_config(), "quantization_config": {"weight_block_size": [128, 128]}}, ValueError,
     r"weight_block_size = \[128, 128\]; served: \[32, 32\]"),
    ({**real_config(), "quantization_config": {"weight_block_size": [32]}}, TypeError, "a list of two ints"),
    ({**real_config(), "quantization_config": {"scale_fmt": "e4m3"}}, ValueError, "scale_fmt = 'e4m3'; served: 'ue8m0'"),
    ({**real_config(), "quantization_config": "fp8"}, TypeError, "quantization_config must be an object"),
]


@pytest.mark.parametrize("config, error, match", REFUSALS, ids=range(len(REFUSALS)))
def test_a_bad_config_is_refused_naming_its_key(config, error, match):
    with pytest.raises(error, match=match):
        EngramConfig.from_dict(config)


def test_a_quantization_config_without_a_block_or_format_is_the_default():
    assert EngramConfig.from_dict({**real_config(), "quantization_config": {"quant_method": "fp8"}}).block_size == 32
    assert EngramConfig.from_dict({**real_config(), "quantization_config": None}).block_size == 32


def test_from_pretrained_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    assert EngramConfig.from_pretrained(tmp_path) == tiny()
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(engram_num_embeddings=[660, 865])))
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'config.json'}: engram_num_embeddings\[1\] = 865 "):
        EngramConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(engram_n_heads="2", engram_num_embeddings=[660, 864])))
    with pytest.raises(CheckpointError, match="config.json: engram_n_heads must be an int"):
        EngramConfig.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="no such model folder"):
        EngramConfig.from_pretrained(tmp_path / "absent")


def test_index_refuses_a_layer_without_engram():
    cfg = tiny()
    assert [cfg.index(layer) for layer in (1, 3)] == [0, 1] and cfg.index(np.int64(3)) == 1
    with pytest.raises(ValueError, match=r"layer 2 has no Engram \(engram_layer_ids \[1, 3\]\)"):
        cfg.index(2)
    with pytest.raises(TypeError, match="layer must be an int, got bool"):
        cfg.index(True)
