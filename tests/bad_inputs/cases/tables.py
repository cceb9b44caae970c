"""The row cache's and the table files' cases: ``RowCache`` (construction, ``resolve`` and
``prefetch``), ``TableFile`` and ``TableWriter``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gpu_runtime import ClosedError
from layers.ngram_embed import RowCache, TableFile, TableFormatError, TableWriter
from layers.dense_weight import BF16
from tests.bad_inputs.matrix import case
from tests.bad_inputs.world import World
from tests.helpers import random_bf16
from tests.helpers.row_cache import assert_resident

CPU_CASES = [
    # -- RowCache --
    case("RowCache", "dtype", lambda w: RowCache(w.gpu, w.table_path, 2.0), TypeError,
         "capacity must be an int"),
    case("RowCache", "length", lambda w: RowCache(w.gpu, w.bad_path, 10), TableFormatError, "bytes"),
    case("RowCache", "range", lambda w: RowCache(w.gpu, w.table_path, 0), ValueError,
         r"capacity must be in 1..2\*\*31-1"),
    case("RowCache", "empty", lambda w: RowCache(w.gpu, w.empty_path, 10), TableFormatError, "shorter than"),
    case("RowCache.resolve", "dtype", lambda w: w.cache.resolve(np.array([1.0, 2.0, 3.0]), w.slots_out),
         TypeError, "ids must be integers"),
    case("RowCache.resolve", "dtype", lambda w: w.cache.resolve(np.array([1, 2, 3]), w.slots_out.view(np.int32)),
         TypeError, "slots_out must be a uint32 array", detail="slots_out"),
    case("RowCache.resolve", "shape", lambda w: w.cache.resolve(np.ones((3, 1), np.int64), w.slots_out),
         ValueError, "ids must be 1-D"),
    case("RowCache.resolve", "length", lambda w: w.cache.resolve(np.array([1, 2]), w.slots_out),
         ValueError, "slots_out"),
    case("RowCache.resolve", "length", lambda w: w.cache.resolve(np.arange(11), np.empty(11, np.uint32)),
         ValueError, "arena holds 10", detail="capacity"),
    case("RowCache.resolve", "range", lambda w: w.cache.resolve(np.array([3, -1, 4]), w.slots_out),
         ValueError, "id -1 out of range"),
    case("RowCache.resolve", "closed", lambda w: w.closed_cache.resolve(np.array([1, 2, 3]), w.slots_out),
         ClosedError, "RowCache is closed"),
    case("RowCache.resolve", "id", lambda w: w.cache.resolve(np.array([3, 100, 4]), w.slots_out),
         ValueError, "id 100 out of range for a table of 100 rows"),
    case("RowCache.resolve", "id", lambda w: w.cache.prefetch(np.array([100])), ValueError,
         "id 100 out of range", detail="prefetch"),
    case("RowCache.resolve", "empty", lambda w: w.cache.resolve(np.zeros(0, np.int64), np.empty(0, np.uint32))),
    # -- TableFile / TableWriter --
    case("TableFile", "dtype",
         lambda w: w.file.read_rows(np.array([1, 2]), w.rows_out.view(np.int8), w.scales_out),
         TypeError, "out must be a uint8 array"),
    case("TableFile", "shape", lambda w: w.file.read_rows(np.array([1, 2]), w.rows_out.reshape(4, 4), w.scales_out),
         ValueError, r"out must be of shape \(2, 8\), got \(4, 4\)"),
    case("TableFile", "length", lambda w: w.file.read_rows(np.array([1, 2]), w.rows_out, w.scales_out[:1]),
         ValueError, r"scales_out has 1 rows, expected 2 \(one per id\)"),
    case("TableFile", "length", lambda w: TableFile(w.bad_path), TableFormatError, "header says", detail="file"),
    case("TableFile", "range", lambda w: w.file.read_rows(np.array([1, -1]), w.rows_out, w.scales_out),
         IndexError, r"span \[-1, 1\]"),
    case("TableFile", "null", lambda w: w.file.read_rows(np.array([1, 2]), w.rows_out, None),
         ValueError, "need their scales"),
    case("TableFile", "closed", lambda w: w.closed_file.read_rows(np.array([1, 2]), w.rows_out, w.scales_out),
         ClosedError, "table file is closed"),
    case("TableFile", "id", lambda w: w.file.read_rows(np.array([1, 100]), w.rows_out, w.scales_out),
         IndexError, "table has 100 rows"),
    case("TableFile", "empty", lambda w: w.file.read_rows(np.zeros(0, np.int64), np.empty((0, 8), np.uint8),
                                                        np.empty(0, np.float32))),
    case("TableFile", "empty", lambda w: TableFile(w.empty_path), TableFormatError, "shorter than", detail="file"),
    case("TableWriter", "dtype", lambda w: w.writer.append(w.writer_rows[2:].astype(np.float32)),
         TypeError, "rows are float32"),
    case("TableWriter", "dtype", lambda w: TableWriter(w.tmp / "f.ngt", np.float32, 4, 3), TypeError,
         "table dtype", detail="new"),
    case("TableWriter", "shape", lambda w: w.writer.append(random_bf16(w.rng, (2, 4))), ValueError,
         r"rows must be \[n, 3\]"),
    case("TableWriter", "length", lambda w: w.writer.append(random_bf16(w.rng, (3, 3))), ValueError, "overruns"),
    case("TableWriter", "range", lambda w: TableWriter(w.tmp / "r.ngt", BF16, 4, -1), ValueError,
         "dim must be an int >= 1"),
    case("TableWriter", "null", lambda w: w.writer.append(w.writer_rows[2:], np.ones(2, np.float32)),
         ValueError, "only for fp8"),
    case("TableWriter", "closed", lambda w: w.closed_writer.append(w.writer_rows[2:]), ClosedError,
         "writer is closed"),
    case("TableWriter", "empty", lambda w: w.writer.append(np.zeros((0, 3), BF16))),
    case("TableWriter", "empty", lambda w: TableWriter(w.tmp / "z.ngt", BF16, 0, 3), ValueError,
         "rows must be an int >= 1", detail="new"),
]


def _after_cache(w: World) -> None:
    ids = np.array([3, 97, 3, 41])
    slots = np.empty(4, np.uint32)
    w.cache.resolve(ids, slots)
    assert_resident(w.gpu, w.cache, ids, slots, w.table, w.scales)
    w.cache.end_batch()


def _after_table_file(w: World) -> None:
    ids = np.array([99, 0])
    out, scales = np.empty((2, 8), np.uint8), np.empty(2, np.float32)
    w.file.read_rows(ids, out, scales)
    np.testing.assert_array_equal(out, w.table[ids].view(np.uint8))
    np.testing.assert_array_equal(scales, w.scales[ids])


def _after_writer(w: World) -> None:
    w.writer.append(w.writer_rows[2:])
    w.writer.close()
    with TableFile(w.tmp / "w.ngt") as f:
        np.testing.assert_array_equal(f.rows_bytes, w.writer_rows.view(np.uint8).reshape(4, 6))


AFTER: dict[str, Callable[[World], None]] = {
    "RowCache": lambda w: RowCache(w.gpu, w.table_path, 5, io_threads=1).close(),
    "RowCache.resolve": _after_cache,
    "TableFile": _after_table_file,
    "TableWriter": _after_writer,
}
