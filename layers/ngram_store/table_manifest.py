"""The converter's table files for a layer: its manifest (``ngram_tables.json``, written by
``python -m layers.ngram_embed.convert`` into OUT_DIR) and each table file's header, checked
against the dims before anything is read or uploaded. The manifest's fields: docs/table_files.md."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..dense_weight import FP8
from .errors import CheckpointError
from .table_file import TableFile, TableFormatError

MANIFEST = "ngram_tables.json"  # written by layers.ngram_embed.convert into its OUT_DIR
MANIFEST_FORMAT = "metrale-ngram-tables"
MANIFEST_VERSION = 1


class TableLayout(Protocol):
    """The dims a manifest records and its files are checked against (``NgramDims`` is one)."""

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (the word table's rows)."""

    @property
    def hidden_size(self) -> int:
        """The embedding width D."""

    @property
    def max_ngram(self) -> int:
        """The largest n-gram order N (the tables cover orders 2..N)."""

    @property
    def splits(self) -> int:
        """Tables per n-gram order."""

    @property
    def base_rows(self) -> int:
        """m, the rows every table starts from (``NgramDims``: table c has ``m + 2*c + b`` rows)."""

    @property
    def row_bias(self) -> int:
        """b (0 or 1), added to every table's rows (``NgramDims``: ``m + 2*c + b``)."""

    def num_tables(self) -> int:
        """The table count, ``splits * (max_ngram - 1)``."""

    def table_rows(self, index: int) -> int:
        """The rows of table ``index`` (its hash modulus)."""

    def table_dim(self) -> int:
        """The table width (td): the columns of every table (``NgramDims``: ``D // T`` unless given)."""


@dataclass(frozen=True)
class TableFiles:
    """The converter's output for a layer: one table file per table, checked (manifest, headers
    and sizes) against the dims, still closed."""

    table_dir: Path
    manifest: dict[str, Any]
    paths: tuple[Path, ...]
    dtypes: tuple[str, ...]  # "BF16" or "F8_E4M3" per table


def manifest_dims(dims: TableLayout) -> dict[str, int]:
    return {
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.hidden_size,
        "max_ngram": dims.max_ngram,
        "splits": dims.splits,
        "base_rows": dims.base_rows,
        "row_bias": dims.row_bias,
        "table_dim": dims.table_dim(),
    }


def read_manifest(table_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(table_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: no manifest (write the table files with python -m layers.ngram_embed.convert MODEL_DIR OUT_DIR)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or not isinstance(manifest.get("tables"), list)
    ):
        raise CheckpointError(f"{path}: not a {MANIFEST_FORMAT} manifest")
    if manifest.get("version") != MANIFEST_VERSION:
        raise CheckpointError(
            f"{path}: manifest version {manifest.get('version')!r}, this reader knows {MANIFEST_VERSION}"
        )
    return manifest


def open_table_files(table_dir: str | os.PathLike, dims: TableLayout) -> TableFiles:
    """Find every table's file through the manifest and check each header (dtype, rows, dim,
    size) against ``dims``; the files are closed again (``RowCache`` and ``HostWeight`` reopen)."""
    table_dir = Path(table_dir)
    manifest = read_manifest(table_dir)
    path = table_dir / MANIFEST
    want = manifest_dims(dims)
    got = {key: manifest.get(key) for key in want}
    if got != want:
        diff = ", ".join(f"{k} {got[k]} (config: {want[k]})" for k in want if got[k] != want[k])
        raise CheckpointError(f"{path}: tables for other dims: {diff}")
    entries = {e.get("index"): e for e in manifest["tables"] if isinstance(e, dict)}
    missing = [c for c in range(dims.num_tables()) if c not in entries]
    if missing:
        raise CheckpointError(
            f"{path}: no table file for tables {missing} (an unfinished "
            "conversion: run the converter again to finish it)"
        )
    paths, dtypes = [], []
    for c in range(dims.num_tables()):
        name = entries[c].get("file")
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{path}: table {c} names file {name!r}, not a file inside {table_dir}")
        file = table_dir / name
        try:
            with TableFile(file) as f:
                header = (f.dtype, f.rows, f.dim)
        except FileNotFoundError:
            raise CheckpointError(f"{file}: table {c}'s file (listed in {MANIFEST}) does not exist") from None
        except TableFormatError as err:
            raise CheckpointError(str(err)) from None
        rows, td = dims.table_rows(c), dims.table_dim()
        if header[1:] != (rows, td):
            raise CheckpointError(f"{file}: table {c} is [{header[1]}, {header[2]}], the config gives [{rows}, {td}]")
        paths.append(file)
        dtypes.append("F8_E4M3" if header[0] == FP8 else "BF16")
    return TableFiles(table_dir, manifest, tuple(paths), tuple(dtypes))
