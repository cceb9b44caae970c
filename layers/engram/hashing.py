"""The Engram hash in numpy: the rule the GPU kernel must equal exactly (``docs/ENGRAM.md``).

``compress`` maps raw token ids to compressed ids (``DEAD`` at non-text positions); ``row_ids``
hashes a sequence's compressed ids into every Engram layer's table rows. For the token at position
``p``, the look-back ``t[k] = compressed[p - k]`` (``k = 0`` the token itself, up to
``max_ngram - 1``) becomes the pad from the first ``k`` that lies before the sequence or on a
``DEAD`` position on (blocked is sticky); there is no reset at EOS or BOS. Then, in int64 (no
overflow by construction of the multipliers), ``r = t[0] * M[0]``, and for each order
``n = 2..max_ngram``: ``r ^= t[n-1] * M[n-1]``, and head ``h``'s row is ``r % P + OFF`` of column
``(n - 2) * n_heads + h``.
"""

from __future__ import annotations

import numpy as np

from gpu_runtime import validate

from .config import EngramConfig

DEAD = -1  # the compressed id of a position that takes no part in an n-gram (an image token)


def _ids(value: object, what: str) -> np.ndarray:
    """``value`` as a 1-D int64 array; TypeError for a non-integer dtype, ValueError for another rank."""
    array = np.asarray(value)
    if array.dtype == np.bool_ or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise TypeError(f"{what} must hold integers, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {list(array.shape)}")
    return array.astype(np.int64)


def compress(token_map: np.ndarray, tokens: object, text_mask: object = None) -> np.ndarray:
    """The compressed ids (int64) of ``tokens`` (1-D raw token ids) through ``token_map`` (1-D:
    compressed id of each raw id), ``DEAD`` where ``text_mask`` (1-D bool, as long as ``tokens``)
    is False. Every token id is checked, masked ones too: ValueError for one outside the map."""
    table = _ids(token_map, "token_map")
    ids = _ids(tokens, "tokens")
    bad = (ids < 0) | (ids >= len(table))
    if bad.any():
        p = int(np.argmax(bad))
        raise ValueError(f"tokens[{p}] = {ids[p]} is outside the token map's {len(table)} ids")
    out = table[ids]
    if text_mask is not None:
        mask = np.asarray(text_mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"text_mask must be bool, got dtype {mask.dtype}")
        if mask.shape != ids.shape:
            raise ValueError(f"text_mask has shape {list(mask.shape)}, tokens {list(ids.shape)}")
        out[~mask] = DEAD
    return out


def row_ids(cfg: EngramConfig, compressed: object, pad: int, history: object = None) -> np.ndarray:
    """Table rows ``int64 [T, layers, n_hash_cols]`` of ``compressed`` (1-D: compressed ids or
    ``DEAD``), the pad being ``pad`` (the compressed id of ``cfg.pad_token_id``). ``history``: the
    compressed ids before ``compressed`` in the same sequence, oldest first (only the last
    ``max_ngram - 1`` are read; fewer, or None, where the sequence starts within that reach), so
    that hashing a sequence in chunks, each with its history, equals hashing it whole."""
    if not isinstance(cfg, EngramConfig):
        raise TypeError(f"cfg must be an EngramConfig, got {type(cfg).__name__}")
    pad = validate.integer(pad, "pad")
    if not 0 <= pad < cfg.compressed_vocab_size:
        raise ValueError(f"pad = {pad} is not a compressed id (0..{cfg.compressed_vocab_size - 1})")
    back = cfg.max_ngram - 1
    seq = _ids(compressed, "compressed")
    before = _ids([] if history is None else history, "history")[-back:]  # back >= 1: max_ngram >= 2
    ext = np.concatenate([before, seq])
    bad = (ext != DEAD) & ((ext < 0) | (ext >= cfg.compressed_vocab_size))
    if bad.any():
        raise ValueError(
            f"compressed id {ext[np.argmax(bad)]} (history, then compressed) is neither DEAD ({DEAD}) "
            f"nor in 0..{cfg.compressed_vocab_size - 1}"
        )
    t_len, h = len(seq), len(before)
    pos = np.arange(t_len) + h  # each token's index in ext
    blocked = np.zeros(t_len, bool)
    window = []  # t[k] for k = 0..max_ngram-1
    for k in range(cfg.max_ngram):
        src = np.where(pos - k >= 0, ext[np.maximum(pos - k, 0)], DEAD)  # before the sequence: as DEAD
        blocked |= src == DEAD
        window.append(np.where(blocked, np.int64(pad), src))
    out = np.empty((t_len, len(cfg.layer_ids), cfg.n_hash_cols), np.int64)
    heads = cfg.n_heads
    for i in range(len(cfg.layer_ids)):
        m, primes, offsets = cfg.multipliers[i], cfg.primes[i], cfg.offsets[i]
        r = window[0] * m[0]
        for n in range(2, cfg.max_ngram + 1):
            r = r ^ (window[n - 1] * m[n - 1])
            cols = slice((n - 2) * heads, (n - 1) * heads)
            out[:, i, cols] = r[:, None] % primes[None, cols] + offsets[None, cols]
    return out
