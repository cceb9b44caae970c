"""Convert a model folder's n-gram tables into table files for the disk and host tiers.

    python -m layers.ngram_embed.convert MODEL_DIR OUT_DIR [--fp8] [--chunk-mib 64] [--log-interval 30] [--quiet]

Writes ``OUT_DIR/table_{c:03d}.ngt`` (``layers.ngram_store.table_file``'s format) for every table
``model.ngram_embeddings.embedders.{c}.weight`` of MODEL_DIR (``checkpoint.py`` says how tables,
names and config are found), and ``OUT_DIR/ngram_tables.json``, the manifest through which
``NgramWeights.from_pretrained(MODEL_DIR, gpu, placement="files" or "host", table_dir=OUT_DIR)``
finds them (the word table and projections stay in MODEL_DIR). File and manifest layout:
docs/table_files.md.

* Streamed: each source tensor is memory-mapped and read in chunks of about ``--chunk-mib`` MiB of
  rows; nothing holds a whole table in memory. Progress (``convert_progress``): a tqdm bar per
  table where stderr is a terminal and tqdm is installed, else lines through the
  ``layers.ngram_embed.convert`` logger. ``model.ngram_embeddings.*`` tensors the layer does not
  use (tables or projections beyond the config's T) are listed in one warning.
* Values: bf16 rows are copied bit for bit; F16/F32 rows are rounded to bf16 (nearest even);
  fp8 source rows are dequantised as the gathers do (``bf16(f32(q) * scale)``). With ``--fp8``
  every row is quantised to e4m3 with one f32 scale: ``scale = f32(max|row|) / 448``, ``q =
  e4m3(clip(f32(row) / scale, -448, 448))`` (nearest even; the clip only matters for a scale that
  is an f32 subnormal), an all-zero row gets ``q = 0, scale = 0``; the gathers then read
  ``bf16(f32(q) * scale)`` (``layers.reference.dequant_fp8``). fp8 sources are copied as they are.
  A NaN or infinite value fails the conversion, naming the tensor and row.
* Verified: while a table is written the CRC32 of its row bytes (and scales) is taken from what
  the source gave; after the rename the file is reopened (header, size) and its CRCs recomputed
  from disk; a mismatch deletes the file and fails. The CRCs go in the manifest, so
  ``verify_tables(OUT_DIR)`` can recheck later.
* Resumable: the manifest is rewritten (atomically) after each table. A rerun skips a table whose
  file is listed, still matches its CRCs and header, and comes from the same source tensor (file
  name and size, offset, dtype, shape); it rewrites any other (a partial ``*.tmp`` is started
  over: ``TableWriter`` writes the header last, so a partial file is never taken for a table).
  A rerun with other settings (``--fp8`` or not, other dims) into the same OUT_DIR raises ``CheckpointError``.
* Only its own files are replaced: a file at a table's name that the manifest does not list and
  that is not a table file of the dtype and shape written there (which a run stopped between a
  table's rename and the manifest's rewrite leaves) raises ``CheckpointError`` before anything
  is written.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gpu_runtime import cli, validate

from ..atomic_write import write_atomically
from ..dense_weight import BF16, FP8
from ..model_folder import read_config, weight_files
from ..ngram_store.errors import CheckpointError
from ..ngram_store.row_encoding import encode_rows
from ..ngram_store.table_check import VerifyError, check_table_file
from ..ngram_store.table_file import SCALE_DTYPE, TableFile, TableFormatError, TableWriter
from ..ngram_store.table_manifest import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, manifest_dims, read_manifest
from ..safetensors_io import read_header
from .checkpoint import PROJ_NAME, SCALE_NAMES, TABLE_NAME, WORD_NAMES, NgramCheckpoint
from .convert_progress import DEFAULT_INTERVAL, LOG, Progress
from .dims import NgramDims
from .table_verify import verify_tables as verify_tables  # its home before


def _write_json(path: Path, data: Any) -> None:
    write_atomically(path, [(json.dumps(data, indent=1, sort_keys=True) + "\n").encode()])


def table_file_name(c: int) -> str:
    return f"table_{c:03d}.ngt"


def _source_entry(ckpt: NgramCheckpoint, c: int) -> dict[str, Any]:
    """What a rerun compares before it skips table ``c``: the source file (resolved path, size,
    modification time), the tensor's name, dtype, shape and offset, and those of its scales. Other
    weights in the same layout (another model's folder, a checkpoint rewritten in place) differ in
    path or modification time."""
    ref, scale = ckpt.tables[c], ckpt.scales[c]
    st = ref.path.stat()
    out = {
        "path": str(ref.path.resolve()),
        "file": ref.path.name,
        "file_size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "tensor": ref.name,
        "dtype": ref.dtype,
        "shape": list(ref.shape),
        "offset": ref.info.start,
    }
    if scale is not None:
        scale_st = scale.path.stat()
        out["scale_path"] = str(scale.path.resolve())
        out["scale_file_size"] = scale_st.st_size
        out["scale_mtime_ns"] = scale_st.st_mtime_ns
        out["scale_tensor"] = scale.name
        out["scale_offset"] = scale.info.start
    return out


NGRAM_PREFIX = "model.ngram_embeddings."


def unused_tensors(ckpt: NgramCheckpoint) -> list[str]:
    """The folder's ``model.ngram_embeddings.*`` tensors that the layer does not read (tables,
    scales or projections beyond the config's T, or any other name), as the index (or the single
    file's header) lists them; no shard is opened."""
    index, source = weight_files(ckpt.model_dir)
    names = index if index is not None else read_header(source)
    t = ckpt.dims.num_tables()
    used = set(WORD_NAMES)
    for c in range(t):
        used.update((TABLE_NAME.format(c), PROJ_NAME.format(c), *(s.format(c) for s in SCALE_NAMES)))
    unused = [n for n in names if n.startswith(NGRAM_PREFIX) and n not in used]
    return sorted(unused, key=lambda n: [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in n.split(".")])


def _warn_unused(ckpt: NgramCheckpoint) -> None:
    unused, dims = unused_tensors(ckpt), ckpt.dims
    if unused:
        why = f"N = {dims.max_ngram}, K = {dims.splits} give tables 0..{dims.num_tables() - 1}"
        LOG.warning(
            "%s: %d tensor(s) the model does not use, not converted (%s): %s",
            ckpt.model_dir,
            len(unused),
            why,
            ", ".join(unused),
        )


def convert(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    fp8: bool = False,
    chunk_bytes: int = 64 << 20,
    progress: bool = True,
    log_interval: float = DEFAULT_INTERVAL,
    on_chunk: Callable[[int, int, int], None] | None = None,
) -> dict[str, Any]:
    """Write (or finish) the table files of ``model_dir``'s n-gram tables into ``out_dir``; returns
    the manifest. ``progress``: a bar or log lines (``convert_progress``; ``log_interval`` seconds
    at most between two lines within a table), or nothing. ``on_chunk(table, rows_done, rows)`` is
    called after every chunk written (raising from it abandons the table being written: its
    ``.tmp`` is removed). An empty ``model_dir`` or ``out_dir`` string is a ``ValueError``."""
    chunk_bytes = validate.positive(chunk_bytes, "chunk_bytes")
    for name, value in (("model_dir", model_dir), ("out_dir", out_dir)):
        if not os.fspath(value):
            raise ValueError(f"convert: {name} is empty (name a folder; '.' is the current one)")
    report = Progress(progress, log_interval)
    ckpt = NgramCheckpoint.open(model_dir, parts="tables", wide_tables=True)
    _warn_unused(ckpt)
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
    _refuse_foreign_files(out_dir, done, dims, dtype)

    t, td = dims.num_tables(), dims.table_dim()
    for c in range(t):
        rows = dims.table_rows(c)
        path = out_dir / table_file_name(c)
        source = _source_entry(ckpt, c)
        label = f"table {c + 1}/{t} {ckpt.tables[c].name} -> {path.name} ({kind})"
        entry = done.get(c)
        if entry is not None and entry.get("source") == source and entry.get("file") == path.name:
            problem = check_table_file(path, entry, dtype, rows, td)
            if problem is None:
                report.note(f"{label}: done before, verified, skipped")
                manifest["tables"].append(entry)
                continue
            report.note(f"{label}: {problem}; writing it again", warning=True)
        elif entry is not None:
            report.note(f"{label}: written before from another source (or the source changed since); writing it again")
        entry = _write_table(ckpt, c, path, fp8, chunk_bytes, report, label, on_chunk)
        entry["source"] = source
        manifest["tables"].append(entry)
        # Tables already listed but not yet reached in this run stay listed until they are.
        rest = [done[i] for i in sorted(done) if i > c]
        _write_json(out_dir / MANIFEST, {**manifest, "tables": manifest["tables"] + rest})
    _write_json(out_dir / MANIFEST, manifest)
    return manifest


def _refuse_foreign_files(out_dir: Path, done: dict[int, dict[str, Any]], dims: NgramDims, dtype: np.dtype) -> None:
    """Raise ``CheckpointError``, before anything is written, for a file at a table's path that
    this conversion did not write: one the manifest does not list that is not a table file of the
    dtype and shape written there either (such a table file is one whose run was stopped between
    its rename and the manifest's rewrite)."""
    for c in range(dims.num_tables()):
        path = out_dir / table_file_name(c)
        if not os.path.lexists(path) or done.get(c, {}).get("file") == path.name:
            continue
        want = f"{dtype.name} [{dims.table_rows(c)}, {dims.table_dim()}]"
        try:
            with TableFile(path) as f:
                got = f"{f.dtype.name} [{f.rows}, {f.dim}]"
        except (OSError, TableFormatError):
            got = None
        if got == want:
            continue
        what = "not a table file" if got is None else f"a {got} table where this conversion writes {want}"
        raise CheckpointError(
            f"{path}: not written by this conversion (not listed in {MANIFEST}, and {what}); "
            "the converter replaces only its own files: move it away or use another OUT_DIR"
        )


def _write_table(
    ckpt: NgramCheckpoint,
    c: int,
    path: Path,
    fp8: bool,
    chunk_bytes: int,
    report: Progress,
    label: str,
    on_chunk: Callable[[int, int, int], None] | None,
) -> dict[str, Any]:
    dims = ckpt.dims
    rows, td = dims.table_rows(c), dims.table_dim()
    src, src_scales = ckpt.table_arrays(c)
    where = ckpt.tables[c].where()
    dtype = FP8 if fp8 else BF16
    chunk_rows = max(1, chunk_bytes // max(1, td * src.dtype.itemsize))
    crc, scales_crc = 0, 0
    with report.table(label, rows, td * src.dtype.itemsize) as bar:
        with TableWriter(path, dtype, rows, td) as writer:
            for start in range(0, rows, chunk_rows):
                stop = min(start + chunk_rows, rows)
                out, scales = encode_rows(
                    src[start:stop], None if src_scales is None else src_scales[start:stop], fp8, where, start
                )
                out = np.ascontiguousarray(out)
                crc = zlib.crc32(out.reshape(-1).view(np.uint8).data, crc)
                if scales is not None:
                    scales = np.ascontiguousarray(scales, dtype=SCALE_DTYPE)
                    scales_crc = zlib.crc32(scales.view(np.uint8).data, scales_crc)
                writer.append(out, scales)
                del out, scales
                bar.update(stop)
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
        problem = check_table_file(path, entry, dtype, rows, td)
        if problem is not None:
            path.unlink(missing_ok=True)
            raise VerifyError(f"{path}: written, but reading it back: {problem}")
        bar.done("verified")
    return entry


PROG = "python -m layers.ngram_embed.convert"
DESCRIPTION = """\
Write a Hugging Face model folder's n-gram tables (model.ngram_embeddings.embedders.*) as table
files OUT_DIR/table_NNN.ngt and their manifest OUT_DIR/ngram_tables.json, which
NgramWeights.from_pretrained(MODEL_DIR, gpu, placement="files" or "host", table_dir=OUT_DIR) reads.
Streamed, verified (CRC32) and resumable."""
EPILOG = """\
example:
  python -m layers.ngram_embed.convert LongCat-Flash-Lite /nvme/lcfl-tables --fp8

progress: a tqdm bar per table when stderr is a terminal and tqdm is installed (the "progress"
extra: pip install 'metrale-gpu[progress]'); otherwise log lines on stderr, one per finished table
(rows, MB, MB/s) and, within a table, at most one per --log-interval seconds.

resuming: an interrupted run (Ctrl-C, a crash, a kill) is finished by running the same command
again: tables listed in OUT_DIR/ngram_tables.json whose files still verify (header, CRC32, same
source tensor) are skipped, and the rest are written; the files end as an uninterrupted run's. A
run with other settings (--fp8 or not, a model of other dims) into the same OUT_DIR is refused.

exit status: 0 done; 1 the conversion failed or was refused (the message names the file: a tensor
missing or malformed, a NaN, OUT_DIR holding a conversion with other settings or a file this
conversion did not write at a table's name); 2 bad arguments (MODEL_DIR or OUT_DIR empty,
MODEL_DIR missing, unreadable or without a readable config.json, OUT_DIR that cannot be created);
130 interrupted.
"""


def _parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(
        prog=PROG,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model folder (config.json, *.safetensors)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where the table files and ngram_tables.json go (created)")
    parser.add_argument(
        "--fp8", action="store_true", help="quantise rows to e4m3 with per-row f32 scales (default: bf16 rows)"
    )
    parser.add_argument(
        "--chunk-mib", type=float, default=64, metavar="MIB", help="rows read per step, in MiB (default 64)"
    )
    interval = f"without a bar: at most one progress line per SECONDS within a table (default {DEFAULT_INTERVAL:g})"
    parser.add_argument("--log-interval", type=float, default=DEFAULT_INTERVAL, metavar="SECONDS", help=interval)
    parser.add_argument("--quiet", action="store_true", help="no progress bar or lines; warnings and errors only")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("model_dir", "out_dir"):
        if not getattr(args, name):
            parser.error(f"{name.upper()} is empty (name a folder; '.' is the current one)")
    if not 0 < args.chunk_mib < math.inf:
        parser.error("--chunk-mib must be a finite number > 0")
    if not args.log_interval >= 0:
        parser.error("--log-interval must be >= 0")
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _run(args)
    except KeyboardInterrupt:
        command = " ".join((PROG, shlex.join(sys.argv[1:] if argv is None else argv)))
        print(
            f"convert: interrupted; to resume, run the same command again (finished tables that verify are "
            f"skipped): {command}",
            file=sys.stderr,
        )
        return 130


def _run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    made = not out_dir.exists()  # a refused conversion leaves no empty OUT_DIR behind
    try:
        read_config(args.model_dir)  # a model folder: one that holds a config.json
        out_dir.mkdir(parents=True, exist_ok=True)
    except CheckpointError as err:
        return _usage_error(f"MODEL_DIR {err}")
    except FileExistsError:
        return _usage_error(f"OUT_DIR {out_dir}: exists and is not a folder")
    except OSError as err:
        return _usage_error(f"OUT_DIR {out_dir}: cannot create it ({err.strerror or err})")
    try:
        manifest = convert(
            args.model_dir,
            out_dir,
            fp8=args.fp8,
            chunk_bytes=max(1, int(args.chunk_mib * 2**20)),
            progress=not args.quiet,
            log_interval=args.log_interval,
        )
    except (CheckpointError, VerifyError, ValueError, OSError) as err:
        print(f"convert: {err}", file=sys.stderr)
        if made and not any(out_dir.iterdir()):
            out_dir.rmdir()
        return 1
    LOG.info("%d tables (%s) in %s", len(manifest["tables"]), manifest["dtype"], out_dir)
    return 0


def _usage_error(message: str) -> int:
    """argparse's form of a bad argument, in one line: exit status 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
