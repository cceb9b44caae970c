"""Hit rate of a device row cache over one Engram layer's real table (384 006 168 rows) for a
Zipfian token stream: the share of a decode step's rows that a table on NVMe, behind the cache,
would not have to read. CPU only (no GPU, no table: the rows are only counted).

``--batch`` sequences of i.i.d. compressed ids (probability of rank r proportional to r^-s over
the real compressed vocabulary, ranks shuffled over the ids) are hashed as the lookup hashes them
(``layers.engram.hashing.row_ids``, 24 rows a token) and decoded a token of each sequence a step.
Each step's rows go through ``SlotIndex`` (CLOCK, what ``RowCache`` runs) as ``RowCache.resolve``
does: the step's distinct rows pinned, the missing ones assigned (evicting), all unpinned at the
step's end. The first half of the steps warms the cache; the rates count the second half.

I.i.d. tokens repeat n-grams far less than text does (a 4-gram of them is nearly always new): the
rates are a floor for text with the same token frequencies.
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.common import bench_parser, positive_float, positive_int, print_table, run
from bench.engram import REAL_ROWS, engram_config
from layers.engram.hashing import row_ids
from layers.ngram_store.slot_index import SlotIndex

CPU_ONLY = "CPU only: needs no GPU."


def zipf_stream(rng: np.random.Generator, vocab: int, s: float, shape: tuple[int, int]) -> np.ndarray:
    """Compressed ids ``shape``, rank r (1-based) drawn with probability proportional to r^-s over
    ``vocab`` ids, ranks mapped to ids by a random permutation."""
    weights = np.arange(1, vocab + 1, dtype=np.float64) ** -s
    ranks = rng.choice(vocab, size=shape, p=weights / weights.sum())
    return rng.permutation(vocab)[ranks]


def hit_rate(rows: np.ndarray, capacity: int, table_rows: int) -> tuple[float, float]:
    """(hit rate, distinct rows a step read) over the second half of the steps of ``rows``
    ``[steps, batch * 24]``, through a CLOCK cache of ``capacity`` rows."""
    index = SlotIndex(table_rows, capacity)
    hits = total = read = 0
    counted = len(rows) // 2
    for step, ids in enumerate(rows):
        uniq = np.unique(ids)
        slots = index.slot_of[uniq].astype(np.int64)
        hit = slots >= 0
        index.pin(slots[hit])
        missing = uniq[~hit]
        if len(missing):
            index.pin(index.assign(missing))
        index.unpin_all()
        if step >= counted:  # as CacheStats counts: a missing row is read once, its repeats hit
            hits += len(ids) - len(missing)
            total += len(ids)
            read += len(missing)
    steps = len(rows) - counted
    return hits / total, read / steps


def make_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, "bench.engram_cache", epilog=CPU_ONLY)
    parser.add_argument(
        "--rows",
        type=positive_int,
        default=REAL_ROWS,
        help=f"about this many table rows (default the real {REAL_ROWS}; others: a quick check)",
    )
    parser.add_argument("--tokens", type=positive_int, default=4096, help="tokens a sequence (default 4096)")
    parser.add_argument("--batch", type=positive_int, default=64, help="sequences decoded together (default 64)")
    parser.add_argument(
        "--zipf", type=positive_float, nargs="+", default=[1.0, 1.2], help="Zipf exponents (default 1.0 1.2)"
    )
    parser.add_argument(
        "--capacity",
        type=positive_float,
        nargs="+",
        default=[0.5, 2.0, 8.0],
        help="cache sizes in percent of the table's rows (default 0.5 2 8)",
    )
    return parser


def main(args: argparse.Namespace) -> None:
    cfg = engram_config(args.rows)
    table_rows = cfg.num_embeddings[0]
    rng = np.random.default_rng(0)  # replayable: the same stream every run
    pad = 0  # the compressed id the first tokens' look-back reads before the sequence
    table = []
    for s in args.zipf:
        seqs = zipf_stream(rng, cfg.compressed_vocab_size, s, (args.batch, args.tokens))
        per_seq = np.stack([row_ids(cfg, seq, pad)[:, 0, :] for seq in seqs])  # [batch, tokens, 24]
        rows = per_seq.transpose(1, 0, 2).reshape(args.tokens, -1)  # a step: a token of each sequence
        for pct in args.capacity:
            capacity = min(table_rows, max(rows.shape[1], round(table_rows * pct / 100)))
            rate, read = hit_rate(rows, capacity, table_rows)
            table.append((s, pct, capacity, f"{100 * rate:.1f}", f"{read:.0f}", rows.shape[1]))
    print_table(
        f"Engram row cache hit rate, {args.batch} sequences x {args.tokens} i.i.d. Zipfian tokens",
        ["zipf s", "cache % of rows", "cache rows", "hit rate %", "rows read a step", "rows a step"],
        table,
        note=f"CLOCK over a {table_rows}-row table; the second half of the steps counted; a floor for text",
    )


if __name__ == "__main__":
    run(main, make_parser(), needs_gpu=lambda args: False)
