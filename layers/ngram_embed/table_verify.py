"""``verify_tables(OUT_DIR)``: a whole conversion (``layers.ngram_embed.convert``) rechecked
against its manifest (``ngram_tables.json``): the dims it records, and every table file's header,
size and CRC32s (``layers.ngram_store.table_check``)."""

from __future__ import annotations

import os
from pathlib import Path

from ..dense_weight import BF16, FP8
from ..ngram_store.errors import CheckpointError
from ..ngram_store.table_check import VerifyError, check_table_file
from ..ngram_store.table_manifest import MANIFEST, open_table_files, read_manifest
from .dims import NgramDims


def verify_tables(out_dir: str | os.PathLike) -> None:
    """Recheck a whole conversion: every table the manifest's dims call for is listed, inside
    OUT_DIR, with a header that fits (``open_table_files``), and holds the CRC32 of rows and scales
    its entry records; raises ``VerifyError`` naming the first problem (an unfinished conversion
    among them)."""
    out_dir = Path(out_dir)
    try:
        manifest = read_manifest(out_dir)
        missing = [key for key in _DIM_KEYS if key not in manifest]
        if missing:
            raise CheckpointError(f"no {', '.join(missing)}")
        dims = NgramDims(**{key: manifest[key] for key in _DIM_KEYS})
        files = open_table_files(out_dir, dims)
    except (CheckpointError, TypeError, ValueError) as err:
        raise VerifyError(f"{out_dir / MANIFEST}: {err}") from None
    dtype = FP8 if manifest.get("dtype") == "fp8" else BF16
    entries = {e.get("index"): e for e in manifest["tables"] if isinstance(e, dict)}
    for c, path in enumerate(files.paths):
        problem = check_table_file(path, entries[c], dtype, dims.table_rows(c), dims.table_dim())
        if problem:
            raise VerifyError(f"{path}: {problem}")


_DIM_KEYS = ("vocab_size", "hidden_size", "max_ngram", "splits", "base_rows", "row_bias", "table_dim")
