"""``NgramWeights.from_pretrained``'s loader: where each table goes (``placement``), then the
uploads, with everything read and checked first (``checkpoint``: config, index, tensor headers;
``table_manifest``: the converter's files). The tables it puts in host memory or behind a
``RowCache``, and why, are logged at INFO (the slower paths: every gather reads them over PCIe or
from the file)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from gpu_runtime import validate

from ..dense_weight import FP8, DenseWeight
from ..ngram_store.host_weight import HostWeight
from ..ngram_store.table_file import TableFile
from ..ngram_store.table_manifest import open_table_files
from ..resources import closed_on_failure
from .checkpoint import NgramCheckpoint
from .placement import DeviceBudget, resolve_placement
from .shard import resolve_shard

_log = logging.getLogger(__name__)
_NEEDS_TABLE_DIR = (
    "placement 'files' serves table files: pass table_dir= (the converter's OUT_DIR, "
    "python -m layers.ngram_embed.convert)"
)


def load_weights(
    cls: type,
    model_dir: str | os.PathLike,
    gpu: Any,
    placement: Any = "device",
    shard: Any = None,
    eos_id: int | None = None,
    table_dir: str | os.PathLike | None = None,
    stream: int = 0,
    cache_rows: int = 1 << 16,
) -> Any:
    """``NgramWeights.from_pretrained``: everything is read and checked first (config, index,
    headers, manifest, placement), then uploaded into ``cls(dims, word, tables, projs, gpu,
    shard=)``, which owns it; a failure after the first upload frees what was built. With a
    ``shard`` only its word rows and tables are read and uploaded. Returns once the uploads are
    done, so runners on any stream can read the weights."""
    validate.positive(cache_rows, "cache_rows")
    if table_dir is None and isinstance(placement, str) and placement == "files":
        raise ValueError(_NEEDS_TABLE_DIR)
    ckpt = NgramCheckpoint.open(model_dir, eos_id=eos_id, parts="all" if table_dir is None else "dense")
    dims = ckpt.dims
    shard = resolve_shard(shard, dims)
    held = range(dims.num_tables()) if shard is None else shard.tables
    files = open_table_files(table_dir, dims) if table_dir is not None else None
    dtypes = files.dtypes if files is not None else tuple(t.dtype for t in ckpt.tables)
    places = resolve_placement(placement, dims, dtypes, held, dims.vocab_size if shard is None else shard.word_rows)
    if any(places[c] == "files" for c in held) and files is None:
        raise ValueError(_NEEDS_TABLE_DIR)
    _log_slow_places(placement, places, held)

    from ..ngram_store.row_cache import RowCache  # here: row_cache imports the ops, kept off the import path
    from .tables import AbsentTable, AnyTable, Bf16Table, CachedTable, Fp8Table, HostTable

    with closed_on_failure() as owned:

        def keep(weight: Any) -> Any:
            owned.append(weight)
            return weight

        word_rows = ckpt.word_array()
        if shard is not None:
            word_rows = word_rows[shard.word_lo : shard.word_lo + shard.word_rows]
        word = keep(DenseWeight.from_numpy(gpu, word_rows, None, stream))
        del word_rows
        projs = [keep(DenseWeight.from_numpy(gpu, ckpt.proj_array(c), None, stream)) for c in range(dims.num_tables())]
        tables: list[AnyTable] = []
        for c, where in enumerate(places):
            if c not in held:
                tables.append(AbsentTable(dims.table_rows(c), dims.table_dim()))
            elif files is None:
                table, scale = ckpt.table_arrays(c)
                if where == "host":
                    tables.append(HostTable(keep(HostWeight.from_numpy(gpu, table, scale, stream))))
                else:
                    w = keep(DenseWeight.from_numpy(gpu, table, scale, stream))
                    tables.append(Fp8Table(w) if scale is not None else Bf16Table(w))
                del table, scale
            elif where == "files":
                tables.append(CachedTable(keep(RowCache(gpu, files.paths[c], cache_rows, stream=stream))))
            elif where == "host":
                tables.append(HostTable(keep(HostWeight.from_table_file(gpu, files.paths[c], stream))))
            else:
                with TableFile(files.paths[c]) as f:
                    rows = f.rows_bytes.view(f.dtype).reshape(f.rows, f.dim)
                    w = keep(DenseWeight.from_numpy(gpu, rows, f.scales, stream))
                    del rows  # the map can close
                tables.append(Fp8Table(w) if w.dtype == FP8 else Bf16Table(w))
        gpu.synchronize(stream)  # uploaded: a runner on any stream may read them (a created one does not wait)
        weights = cls(dims, word, tables, projs, gpu, shard=shard)
    weights.own(*owned)
    return weights


_SLOW_PLACES = {"host": "in host memory (each gather reads them over PCIe)", "files": "on disk behind a RowCache"}


def _log_slow_places(placement: Any, places: Sequence[str], held: Sequence[int] | range) -> None:
    """INFO: which held tables go to host memory or to files, and why (the placement asked for
    it, or a ``DeviceBudget`` left no room for them)."""
    for where, how in _SLOW_PLACES.items():
        tables = [c for c in held if places[c] == where]
        if not tables:
            continue
        if isinstance(placement, str):
            why = f"placement={placement!r}"
        elif isinstance(placement, Sequence):
            why = "placement names them"
        else:
            budget = placement.nbytes if isinstance(placement, DeviceBudget) else int(placement)
            why = f"they do not fit DeviceBudget({budget}) after the word table, projections and earlier tables"
        _log.info(
            "NgramWeights.from_pretrained: %d of %d tables %s (tables %s): %s",
            len(tables),
            len(places),
            how,
            ", ".join(map(str, tables)),
            why,
        )
