"""CPU checks of ``bench.host_staging``'s gather: the split covers every id once, and the threaded
gather equals numpy's fancy indexing (the probe itself needs a GPU and a 101 GB table)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from bench.host_staging import ROW, cpu_gather_s, split


@pytest.mark.parametrize("n, parts", [(0, 1), (1, 4), (7, 3), (24576, 16), (196608, 5)])
def test_split_covers_every_index_once_in_order(n, parts):
    spans = split(n, parts)
    assert len(spans) == parts
    assert np.array_equal(np.concatenate([np.arange(n)[s] for s in spans]), np.arange(n))


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_the_threaded_gather_is_the_table_rows(threads):
    rng = np.random.default_rng(11)
    table = rng.integers(0, 256, (5003, ROW), dtype=np.uint8)
    ids = rng.integers(0, table.shape[0], 1237)
    out = np.full((ids.size, ROW), 0xA5, np.uint8)
    with ThreadPoolExecutor(threads) as pool:
        seconds = cpu_gather_s(pool, threads, table, ids, out)
    assert seconds > 0
    assert np.array_equal(out, table[ids])
