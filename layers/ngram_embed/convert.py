"""Convert a model folder's n-gram tables into table files for the disk and host tiers.

    python -m layers.ngram_embed.convert MODEL_DIR OUT_DIR [--fp8] [--chunk-mib 64] [--quiet]

Writes ``OUT_DIR/table_{c:03d}.ngt`` (``layers.ngram_embed.table_file``'s format) for every table
``model.ngram_embeddings.embedders.{c}.weight`` of MODEL_DIR (``checkpoint.py`` says how tables,
names and config are found), and ``OUT_DIR/ngram_tables.json``, the manifest through which
``NgramWeights.from_pretrained(MODEL_DIR, gpu, placement="files" or "host", table_dir=OUT_DIR)``
finds them (the word table and projections stay in MODEL_DIR). File and manifest layout:
docs/table_files.md.

* Streamed: each source tensor is memory-mapped and read in chunks of about ``--chunk-mib`` MiB of
  rows; nothing holds a whole table in memory. A progress line per table goes to stderr.
* Values: bf16 rows are copied bit for bit; F16/F32 rows are rounded to bf16 (nearest even);
  fp8 source rows are dequantised as the gathers do (``bf16(f32(q) * scale)``). With ``--fp8``
  every row is quantised to e4m3 with one f32 scale: ``scale = f32(max|row|) / 448``, ``q =
  e4m3(clip(f32(row) / scale, -448, 448))`` (nearest even; the clip only matters for a scale that
  is an f32 subnormal), an all-zero row gets ``q = 0, scale = 0``; the gathers then read
  ``bf16(f32(q) * scale)`` (``layers.reference.dequant_fp8``). fp8 sources are copied as they are.
  A NaN or infinite value is refused, naming the tensor and row.
* Verified: while a table is written the CRC32 of its row bytes (and scales) is taken from what
  the source gave; after the rename the file is reopened (header, size) and its CRCs recomputed
  from disk; a mismatch deletes the file and fails. The CRCs go in the manifest, so
  ``verify_tables(OUT_DIR)`` can recheck later.
* Resumable: the manifest is rewritten (atomically) after each table. A rerun skips a table whose
  file is listed, still matches its CRCs and header, and comes from the same source tensor (file
  name and size, offset, dtype, shape); it rewrites any other (a partial ``*.tmp`` is started
  over: ``TableWriter`` writes the header last, so a partial file is never taken for a table).
  A rerun with other settings (``--fp8`` or not, other dims) into the same OUT_DIR is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from gpu_runtime import validate

from ..dense_weight import BF16, FP8
from .checkpoint import CheckpointError, NgramCheckpoint
from .table_file import SCALE_DTYPE, TableFile, TableFormatError, TableWriter, _fsync_dir
from .table_manifest import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, manifest_dims, read_manifest

FP8_MAX = np.float32(448.0)  # largest finite e4m3fn
_CRC_CHUNK = 64 << 20


class VerifyError(ValueError):
    """A table file that does not hold what its manifest (or its source) says."""


class NonFiniteRow(ValueError):
    """A row with a NaN or infinity, which has no fp8 form; ``row`` is its index."""

    def __init__(self, row: int, where: str = "") -> None:
        super().__init__(f"{where + ': ' if where else ''}row {row} holds a NaN or infinity; it has no fp8 form")
        self.row = row


def quantize_fp8_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(e4m3 [n, d], f32 scales [n])`` of ``rows`` (any float dtype, read as f32): the
    convention in the module docstring. Refuses non-finite values (``NonFiniteRow``)."""
    x = np.asarray(rows).astype(np.float32, copy=False)
    amax = np.max(np.abs(x), axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    if not np.isfinite(amax).all():
        raise NonFiniteRow(int(np.flatnonzero(~np.isfinite(amax))[0]))
    scale = (amax / FP8_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    q = np.clip(x / safe[:, None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, np.where(amax > 0, scale, np.float32(0.0)).astype(np.float32)


def _target_rows(
    src: np.ndarray, src_scales: np.ndarray | None, fp8: bool, where: str, start: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """One chunk of source rows as the table stores them."""
    if src.dtype == FP8:
        if fp8:
            return src, src_scales
        assert src_scales is not None  # an F8_E4M3 table has its scales (NgramCheckpoint checks)
        return (src.astype(np.float32) * src_scales[:, None]).astype(BF16), None
    if fp8:
        try:
            return quantize_fp8_rows(src)
        except NonFiniteRow as err:
            raise NonFiniteRow(start + err.row, where) from None
    if src.dtype == BF16:
        return src, None
    return src.astype(np.float32).astype(BF16), None


def _crc_file(f: TableFile) -> tuple[int, int | None]:
    # crc32 of an array's ``.data`` (its buffer as a memoryview, no copy) here and in _write_table
    rows = f.rows_bytes.reshape(-1)
    crc = 0
    for at in range(0, rows.size, _CRC_CHUNK):
        crc = zlib.crc32(rows[at : at + _CRC_CHUNK].data, crc)
    scales = f.scales
    return crc, (zlib.crc32(scales.view(np.uint8).data) if scales is not None else None)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(str(path.parent))


class _Progress:
    """One line per table on stderr, rewritten at most every 0.2 s."""

    def __init__(self, enabled: bool, label: str, total: int) -> None:
        self.enabled, self.label, self.total = enabled, label, total
        self.t0 = self.last = time.perf_counter()

    def update(self, done: int, final: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not final and now - self.last < 0.2:
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9) / 2**20
        pct = 100.0 * done / self.total if self.total else 100.0
        line = f"\r{self.label}  {done / 2**30:.2f}/{self.total / 2**30:.2f} GiB  {pct:5.1f}%  {rate:7.1f} MiB/s{final}"
        sys.stderr.write(line + ("\n" if final else ""))
        sys.stderr.flush()


def table_file_name(c: int) -> str:
    return f"table_{c:03d}.ngt"


def _source_entry(ckpt: NgramCheckpoint, c: int) -> dict[str, Any]:
    ref, scale = ckpt.tables[c], ckpt.scales[c]
    out = {
        "file": ref.path.name,
        "file_size": ref.path.stat().st_size,
        "tensor": ref.name,
        "dtype": ref.dtype,
        "shape": list(ref.shape),
        "offset": ref.info.start,
    }
    if scale is not None:
        out["scale_tensor"] = scale.name
        out["scale_offset"] = scale.info.start
    return out


def _check_file(path: Path, entry: dict[str, Any], dtype: np.dtype, rows: int, dim: int) -> str | None:
    """Why ``path`` is not the table ``entry`` describes (None: it is)."""
    try:
        with TableFile(path) as f:
            if (f.dtype, f.rows, f.dim) != (dtype, rows, dim):
                return f"header says {f.dtype.name} [{f.rows}, {f.dim}], expected {dtype.name} [{rows}, {dim}]"
            crc, scales_crc = _crc_file(f)
    except FileNotFoundError:
        return "file missing"
    except TableFormatError as err:
        return str(err)
    if crc != entry.get("rows_crc32") or scales_crc != entry.get("scales_crc32"):
        return (
            f"crc32 rows {crc:#010x} / scales {scales_crc}, the manifest says "
            f"{entry.get('rows_crc32')} / {entry.get('scales_crc32')} (corrupt file)"
        )
    return None


def verify_tables(out_dir: str | os.PathLike) -> None:
    """Recheck every table file of a conversion against its manifest (header, size, CRC32 of rows
    and scales); raises ``VerifyError`` naming the first bad file."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    dtype = FP8 if manifest.get("dtype") == "fp8" else BF16
    for entry in manifest["tables"]:
        path = out_dir / entry["file"]
        problem = _check_file(path, entry, dtype, entry["rows"], entry["dim"])
        if problem:
            raise VerifyError(f"{path}: {problem}")


def convert(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    fp8: bool = False,
    chunk_bytes: int = 64 << 20,
    progress: bool = True,
    on_chunk: Callable[[int, int, int], None] | None = None,
) -> dict[str, Any]:
    """Write (or finish) the table files of ``model_dir``'s n-gram tables into ``out_dir``; returns
    the manifest. ``on_chunk(table, rows_done, rows)`` is called after every chunk written
    (raising from it abandons the table being written: its ``.tmp`` is removed)."""
    chunk_bytes = validate.positive(chunk_bytes, "chunk_bytes")
    ckpt = NgramCheckpoint.open(model_dir, parts="tables", wide_tables=True)
    dims = ckpt.dims
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = "fp8" if fp8 else "bf16"
    dtype = FP8 if fp8 else BF16
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "dtype": kind,
        **manifest_dims(dims),
        "source": str(Path(model_dir).resolve()),
        "tables": [],
    }
    done: dict[int, dict[str, Any]] = {}
    if (out_dir / MANIFEST).exists():
        old = read_manifest(out_dir)
        theirs = {k: old.get(k) for k in ("dtype", *manifest_dims(dims))}
        ours = {k: manifest[k] for k in theirs}
        if theirs != ours:
            raise CheckpointError(
                f"{out_dir / MANIFEST}: a conversion with other settings {theirs} is "
                f"there (this one: {ours}); use another OUT_DIR or remove it"
            )
        done = {e["index"]: e for e in old["tables"] if isinstance(e, dict) and "index" in e}

    t, td = dims.num_tables(), dims.table_dim()
    for c in range(t):
        rows = dims.table_rows(c)
        path = out_dir / table_file_name(c)
        source = _source_entry(ckpt, c)
        label = f"table {c + 1}/{t} {ckpt.tables[c].name} -> {path.name} ({kind})"
        entry = done.get(c)
        if entry is not None and entry.get("source") == source and entry.get("file") == path.name:
            problem = _check_file(path, entry, dtype, rows, td)
            if problem is None:
                if progress:
                    sys.stderr.write(f"{label}: done before, verified, skipped\n")
                manifest["tables"].append(entry)
                continue
            if progress:
                sys.stderr.write(f"{label}: {problem}; writing it again\n")
        entry = _write_table(ckpt, c, path, fp8, chunk_bytes, _Progress(progress, label, 0), on_chunk)
        entry["source"] = source
        manifest["tables"].append(entry)
        # Tables already listed but not yet reached in this run stay listed until they are.
        rest = [done[i] for i in sorted(done) if i > c]
        _write_json(out_dir / MANIFEST, {**manifest, "tables": manifest["tables"] + rest})
    _write_json(out_dir / MANIFEST, manifest)
    return manifest


def _write_table(
    ckpt: NgramCheckpoint,
    c: int,
    path: Path,
    fp8: bool,
    chunk_bytes: int,
    bar: _Progress,
    on_chunk: Callable[[int, int, int], None] | None,
) -> dict[str, Any]:
    dims = ckpt.dims
    rows, td = dims.table_rows(c), dims.table_dim()
    src, src_scales = ckpt.table_arrays(c)
    where = ckpt.tables[c].where()
    dtype = FP8 if fp8 else BF16
    chunk_rows = max(1, chunk_bytes // max(1, td * src.dtype.itemsize))
    bar.total = rows * td * src.dtype.itemsize
    crc, scales_crc = 0, 0
    with TableWriter(path, dtype, rows, td) as writer:
        for start in range(0, rows, chunk_rows):
            stop = min(start + chunk_rows, rows)
            out, scales = _target_rows(
                src[start:stop], None if src_scales is None else src_scales[start:stop], fp8, where, start
            )
            out = np.ascontiguousarray(out)
            crc = zlib.crc32(out.reshape(-1).view(np.uint8).data, crc)
            if scales is not None:
                scales = np.ascontiguousarray(scales, dtype=SCALE_DTYPE)
                scales_crc = zlib.crc32(scales.view(np.uint8).data, scales_crc)
            writer.append(out, scales)
            del out, scales
            bar.update(stop * td * src.dtype.itemsize)
            if on_chunk is not None:
                on_chunk(c, stop, rows)
    del src, src_scales
    entry = {
        "index": c,
        "file": path.name,
        "rows": rows,
        "dim": td,
        "rows_crc32": crc,
        "scales_crc32": scales_crc if fp8 else None,
    }
    problem = _check_file(path, entry, dtype, rows, td)
    if problem is not None:
        path.unlink(missing_ok=True)
        raise VerifyError(f"{path}: written, but reading it back: {problem}")
    bar.update(bar.total, final="  verified")
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m layers.ngram_embed.convert",
        description="Write a model folder's n-gram tables as table files (resumable; see the module docstring).",
    )
    parser.add_argument("model_dir", help="Hugging Face model folder (config.json, *.safetensors)")
    parser.add_argument("out_dir", help="where the table files and ngram_tables.json go")
    parser.add_argument("--fp8", action="store_true", help="quantise rows to e4m3 with per-row f32 scales")
    parser.add_argument("--chunk-mib", type=int, default=64, help="rows read per step, in MiB (default 64)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    if args.chunk_mib < 1:
        parser.error("--chunk-mib must be >= 1")
    try:
        manifest = convert(
            args.model_dir, args.out_dir, fp8=args.fp8, chunk_bytes=args.chunk_mib << 20, progress=not args.quiet
        )
    except (CheckpointError, VerifyError, ValueError, OSError) as err:
        print(f"convert: {err}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"convert: {len(manifest['tables'])} tables ({manifest['dtype']}) in {args.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
