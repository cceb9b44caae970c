"""Building a layer from a model folder (``NgramEmbedding.from_pretrained`` and its twins): where
each table goes (``placement``), then the uploads, with everything read and checked first
(``checkpoint``: config, index, tensor headers; ``table_manifest``: the converter's files)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from gpu_runtime import validate

from ..weight_map import FP8, DenseWeight
from .checkpoint import NgramCheckpoint
from .dims import NgramDims
from .placement import placements
from .host_table import HostWeight
from .resources import closed_on_failure
from .table_file import TableFile
from .table_manifest import open_table_files

PLACES = ("device", "host", "files")
_NEEDS_TABLE_DIR = ("placement 'files' serves table files: pass table_dir= (the converter's OUT_DIR, "
                    "python -m layers.ngram_embed.convert)")


@dataclass(frozen=True)
class DeviceBudget:
    """``placement=DeviceBudget(nbytes)``: as many tables on the device as fit in ``nbytes``
    together with everything else the layer puts there, the rest in host memory."""

    nbytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", validate.count(self.nbytes, "DeviceBudget: nbytes"))


# ---- placement ---------------------------------------------------------------------------------
def resolve_placement(placement: Any, dims: NgramDims, table_dtypes: Sequence[str],
                      max_tokens: int, shard: Any = None) -> list[str]:
    """One of ``PLACES`` per table (see the module docstring); refused before any upload. With a
    tensor-parallel ``shard``, a ``DeviceBudget`` counts only its word rows and tables (the
    others' places are then "device", and unused)."""
    t = dims.num_tables()
    if isinstance(placement, (int, np.integer)) and not isinstance(placement, (bool, np.bool_)):
        placement = DeviceBudget(int(placement))
    if isinstance(placement, DeviceBudget):
        h, td = dims.hidden_size, dims.table_dim()
        held = range(t) if shard is None else shard.tables
        word_rows = dims.vocab_size if shard is None else shard.word_rows
        fixed = word_rows * h * 2 + t * h * td * 2  # word rows, projections (bf16)
        fixed += max_tokens * (4 + 2 * td + 2 * h)  # the layer's staging (ids, gather, projection)
        fixed += sum(dims.table_rows(c) * 4 for c in held if table_dtypes[c] == "F8_E4M3")
        if fixed > placement.nbytes:
            raise ValueError(f"placement DeviceBudget({placement.nbytes}): the word table, projections, "
                             f"fp8 scales and staging alone take {fixed} bytes of device memory")
        used, places = fixed, []
        for c in range(t):
            rows_bytes = dims.table_rows(c) * td * (1 if table_dtypes[c] == "F8_E4M3" else 2)
            if c in held and used + rows_bytes > placement.nbytes:
                places.append("host")
            else:
                used += rows_bytes if c in held else 0
                places.append("device")
        return places
    return placements(placement, t, PLACES)  # a DeviceBudget is the other form


# ---- building the layer ------------------------------------------------------------------------
def load_layer(cls: type, model_dir: str | os.PathLike, gpu: Any, *, max_tokens: int = 8192,
               **kwargs: Any) -> Any:
    """``NgramEmbedding.from_pretrained``: ``load_weights`` then ``cls(dims, word, tables, projs,
    max_tokens, gpu)``, which owns them."""
    validate.positive(max_tokens, "max_tokens")
    return load_weights(model_dir, gpu, max_tokens=max_tokens, **kwargs,
                        build=lambda dims, word, tables, projs: cls(dims, word, tables, projs, max_tokens, gpu))


def load_weights(model_dir: str | os.PathLike, gpu: Any, *, build: Callable[..., Any],
                 placement: Any = "device", max_tokens: int = 8192, eos_id: int | None = None,
                 table_dir: str | os.PathLike | None = None, stream: int = 0, cache_rows: int = 1 << 16,
                 refuse_files: str | None = None, part: Callable[[NgramDims], Any] | None = None) -> Any:
    """Everything is read and checked first (config, index, headers, manifest, placement), then
    uploaded and handed to ``build(dims, word, tables, projs)``, which gets to own it (``own``);
    a failure after the first upload frees what was built. ``refuse_files``: a message for
    callers that cannot serve ``RowCache`` tables. ``part(dims)``: a tensor-parallel rank's share
    (an ``NgramShard``): only its word rows and tables are read and uploaded, the others' tables
    are ``NgramTable.Absent``."""
    validate.positive(cache_rows, "cache_rows")
    if table_dir is None and isinstance(placement, str) and placement == "files":
        raise ValueError(_NEEDS_TABLE_DIR)
    ckpt = NgramCheckpoint.open(model_dir, eos_id=eos_id, parts="all" if table_dir is None else "dense")
    dims = ckpt.dims
    shard = part(dims) if part is not None else None
    held = range(dims.num_tables()) if shard is None else shard.tables
    files = open_table_files(table_dir, dims) if table_dir is not None else None
    dtypes = files.dtypes if files is not None else tuple(t.dtype for t in ckpt.tables)
    places = resolve_placement(placement, dims, dtypes, max_tokens, shard)
    if any(places[c] == "files" for c in held):
        if files is None:
            raise ValueError(_NEEDS_TABLE_DIR)
        if refuse_files:
            raise ValueError(refuse_files)

    from .row_cache import RowCache  # here: row_cache imports the ops, kept off the import path
    from .tables import AbsentTable, Bf16Table, CachedTable, Fp8Table, HostTable

    with closed_on_failure() as owned:

        def keep(weight: Any) -> Any:
            owned.append(weight)
            return weight

        word_rows = ckpt.word_array()
        if shard is not None:
            word_rows = word_rows[shard.word_lo:shard.word_lo + shard.word_rows]
        word = keep(DenseWeight.from_numpy(gpu, word_rows, None, stream))
        del word_rows
        projs = [keep(DenseWeight.from_numpy(gpu, ckpt.proj_array(c), None, stream))
                 for c in range(dims.num_tables())]
        tables = []
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
        built = build(dims, word, tables, projs)
    built.own(*owned)
    return built
