"""The table-file converter (``python -m layers.ngram_embed.convert``) and
``NgramWeights.from_pretrained`` over its output, on the CPU.

bf16 tables round-trip bit for bit (F16/F32 sources rounded as numpy rounds, fp8 sources
dequantised as the gathers do); ``--fp8`` files hold exactly the reference quantisation (and
dequantise within its error bound); a conversion interrupted by an exception or killed outright
resumes, skipping the tables it had finished, and ends with the same files a clean run writes;
verification catches a corrupted file and a rerun rewrites it; ``NgramWeights.from_pretrained``
serves the files as ``RowCache``, registered host tables or device tables, refusing a bad table
directory before anything is uploaded; the decoder refuses the ``RowCache`` ones when it is built."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import zlib

import ml_dtypes
import numpy as np
import pytest

from layers import reference as ref
from layers.ngram_embed import (CheckpointError, FusedNgramEmbedding, NgramDecoder, NgramTable, NgramWeights,
                                TableFile)
from layers.ngram_embed import convert_progress
from layers.ngram_embed.convert import PROG, convert, main, verify_tables
from layers.ngram_store import TableWriter, VerifyError, write_table
from layers.ngram_store.row_encoding import NonFiniteRow, quantize_fp8_rows
from layers.ngram_embed.decoder import NO_ROW_CACHE
from layers.ngram_store.row_cache import RowCache
from layers.ngram_store.table_manifest import MANIFEST
from layers.dense_weight import BF16, FP8
from tests.helpers import bits, random_bf16
from tests.helpers.checkpoint import (PROJ, SCALE, TABLE, layer_bytes, make_model, rewrite_tensor, shard_of, tiny_config,
                                      write_model)
from tests.helpers.logging_backend import LoggingBackend

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGGER = "layers.ngram_embed.convert"


@pytest.fixture
def log(caplog):
    """The converter's log messages at INFO and above (``log()`` lists them)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    return lambda: [r.getMessage() for r in caplog.records if r.name == LOGGER]


def reference_fp8(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The quantisation the converter documents, row by row in plain numpy."""
    x = np.asarray(rows, np.float32)
    q = np.zeros(x.shape, ml_dtypes.float8_e4m3fn)
    s = np.zeros(x.shape[0], np.float32)
    for r in range(x.shape[0]):
        amax = np.float32(np.abs(x[r]).max())
        if amax == 0:
            continue
        s[r] = amax / np.float32(448)
        q[r] = np.clip(x[r] / s[r], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, s


def table_contents(path) -> tuple[np.ndarray, np.ndarray | None]:
    with TableFile(path) as f:
        return f.rows_bytes.view(f.dtype).reshape(f.rows, f.dim).copy(), None if f.scales is None else f.scales.copy()


def files_of(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


# ==== contents ========================================================================================

@pytest.mark.parametrize("layout", ["sharded", "single"])
@pytest.mark.parametrize("chunk_bytes", [1, 200, 1 << 20])
def test_bf16_tables_round_trip_bit_for_bit(tmp_path, rng, log, layout, chunk_bytes):
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"), layout)
    manifest = convert(model.path, tmp_path / "out", chunk_bytes=chunk_bytes)
    dims = model.dims
    assert manifest["dtype"] == "bf16" and manifest["base_rows"] == dims.base_rows and manifest["row_bias"] == 1
    assert [e["index"] for e in manifest["tables"]] == [0, 1, 2, 3]
    assert json.loads((tmp_path / "out" / MANIFEST).read_text()) == manifest
    for c, (table, scale) in enumerate(model.tables):
        rows, scales = table_contents(tmp_path / "out" / f"table_{c:03d}.ngt")
        assert scales is None and rows.dtype == BF16 and rows.shape == (dims.table_rows(c), dims.table_dim())
        want = table if scale is None else ref.dequant_fp8(table, scale)  # fp8 source: as the gathers read it
        np.testing.assert_array_equal(bits(rows), bits(want))
        assert manifest["tables"][c]["source"]["tensor"] == TABLE.format(c)
    lines = log()
    assert lines[0].startswith("table 1/4 model.ngram_embeddings.embedders.0.weight -> table_000.ngt (bf16): 76 rows")
    assert sum(line.endswith(", verified") for line in lines) == 4
    verify_tables(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_wide_sources_are_rounded_to_bf16(tmp_path, rng):
    model = make_model(rng, kinds="b")
    wide = [model.tables[0][0].astype(np.float32) + np.float32(1e-3), model.tables[1][0].astype(np.float16)]
    model.tensors[TABLE.format(0)], model.tensors[TABLE.format(1)] = wide
    write_model(tmp_path / "m", model)
    convert(model.path, tmp_path / "out", progress=False)
    for c, source in enumerate(wide):
        rows, _ = table_contents(tmp_path / "out" / f"table_{c:03d}.ngt")
        np.testing.assert_array_equal(bits(rows), bits(source.astype(np.float32).astype(BF16)))


def test_fp8_files_hold_the_reference_quantisation(tmp_path, rng):
    model = make_model(rng, kinds="bbfb")
    t0 = model.tables[0][0].copy()
    t0[3] = 0  # an all-zero row: q = 0, scale = 0
    t0[4, 1] = BF16.type(-1e-38)  # a row of tiny values
    t0[4, [0, 2, 3, 4, 5]] = 0
    model.tensors[TABLE.format(0)] = t0
    model.tables[0] = (t0, None)
    f32 = rng.standard_normal(model.tables[3][0].shape).astype(np.float32) * 5
    model.tensors[TABLE.format(3)] = f32
    write_model(tmp_path / "m", model)
    manifest = convert(model.path, tmp_path / "out", fp8=True, chunk_bytes=100, progress=False)
    assert manifest["dtype"] == "fp8" and all(e["scales_crc32"] is not None for e in manifest["tables"])
    sources = [t0, model.tables[1][0], None, f32]
    for c, source in enumerate(sources):
        q, s = table_contents(tmp_path / "out" / f"table_{c:03d}.ngt")
        assert q.dtype == FP8 and s.dtype == np.float32
        if source is None:  # an fp8 source is copied as it is
            np.testing.assert_array_equal(bits(q), bits(model.tables[c][0]))
            np.testing.assert_array_equal(bits(s), bits(model.tables[c][1]))
            continue
        want_q, want_s = reference_fp8(source)
        np.testing.assert_array_equal(bits(q), bits(want_q))
        np.testing.assert_array_equal(bits(s), bits(want_s))
        got = quantize_fp8_rows(source)  # the function itself agrees, chunk or whole
        np.testing.assert_array_equal(bits(got[0]), bits(want_q))
        # what the gathers read: within e4m3's half-ulp (2**-4 relative; subnormals 2**-10 * scale),
        # plus the one bf16 rounding of the product
        deq = ref.dequant_fp8(q, s).astype(np.float64)
        x = source.astype(np.float64)
        bound = np.maximum(np.abs(x) * 2.0**-4, s[:, None] * 2.0**-10) + np.abs(x) * 2.0**-8 * 1.07 + 1e-45
        assert (np.abs(deq - x) <= bound).all()
    q0, s0 = table_contents(tmp_path / "out" / "table_000.ngt")
    assert s0[3] == 0 and not q0[3].view(np.uint8).any()


def test_non_finite_rows_have_no_fp8_form(tmp_path, rng):
    model = make_model(rng, kinds="b")
    bad = model.tables[2][0].copy()
    bad[41, 2] = np.inf
    model.tensors[TABLE.format(2)] = bad
    write_model(tmp_path / "m", model)
    with pytest.raises(NonFiniteRow, match=r"embedders.2.weight'.*row 41 holds a NaN or infinity"):
        convert(model.path, tmp_path / "out", fp8=True, chunk_bytes=7 * 12, progress=False)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == [MANIFEST, "table_000.ngt", "table_001.ngt"]  # no table 2, no .tmp
    convert(model.path, tmp_path / "bf16", progress=False)  # bf16 copies bits, infinities included


# ==== interrupted conversions ========================================================================

class Stop(Exception):
    pass


def _stop_after(n: int):
    count = [0]

    def on_chunk(table, done, rows):
        count[0] += 1
        if count[0] == n:
            raise Stop(f"stopped in table {table} at row {done} of {rows}")
    return on_chunk


@pytest.mark.parametrize("fp8", [False, True])
def test_an_interrupted_conversion_resumes_to_the_same_files(tmp_path, rng, log, fp8):
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    chunk = 10 * 6 * 2  # 10 bf16 rows of 6: 8 chunks per table
    clean = convert(model.path, tmp_path / "clean", fp8=fp8, chunk_bytes=chunk, progress=False)
    out = tmp_path / "out"
    with pytest.raises(Stop, match="stopped in table 2"):
        convert(model.path, out, fp8=fp8, chunk_bytes=chunk, progress=False, on_chunk=_stop_after(2 * 8 + 3))
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "table_000.ngt", "table_001.ngt"]
    assert [e["index"] for e in json.loads((out / MANIFEST).read_text())["tables"]] == [0, 1]
    before = {c: os.stat(out / f"table_00{c}.ngt") for c in (0, 1)}
    resumed = convert(model.path, out, fp8=fp8, chunk_bytes=chunk)
    assert sum(line.endswith("done before, verified, skipped") for line in log()) == 2
    for c in (0, 1):  # not rewritten
        after = os.stat(out / f"table_00{c}.ngt")
        assert (after.st_ino, after.st_mtime_ns) == (before[c].st_ino, before[c].st_mtime_ns)
    assert resumed == clean
    assert files_of(out) == files_of(tmp_path / "clean")


def test_a_killed_conversion_resumes_to_the_same_files(tmp_path, rng):
    """SIGKILL in the middle of table 1: its ``.tmp`` stays behind (no clean-up ran); a rerun of
    the command line starts that table over and ends with the clean run's files."""
    model = write_model(tmp_path / "m", make_model(rng, kinds="fb"))
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {REPO!r})
        from layers.ngram_embed.convert import convert
        count = [0]
        def on_chunk(table, done, rows):
            count[0] += 1
            if table == 1 and done >= rows // 2:
                os.kill(os.getpid(), signal.SIGKILL)
        convert({str(model.path)!r}, {str(out)!r}, chunk_bytes=96, progress=False, on_chunk=on_chunk)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == [MANIFEST, "table_000.ngt", "table_001.ngt.tmp"], names
    with open(out / "table_001.ngt.tmp", "rb") as fh:
        assert fh.read(8) != b"NGRAMTBL"  # the header goes in last: a partial file is no table
    proc = subprocess.run([sys.executable, "-m", "layers.ngram_embed.convert", str(model.path), str(out),
                           "--chunk-mib", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "table 1/4" in proc.stderr and "skipped" in proc.stderr and "4 tables (bf16)" in proc.stderr
    convert(model.path, tmp_path / "clean", progress=False)
    assert files_of(out) == files_of(tmp_path / "clean")


# ==== verification ===================================================================================

def _flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, match", [
    (lambda p: _flip(p, 4096 + 77), "crc32 rows"),
    (lambda p: _flip(p, 20), "corrupt header"),
    (lambda p: p.write_bytes(p.read_bytes()[:-2]), "header says"),
    (lambda p: p.unlink(), "does not exist"),
])
def test_verification_catches_a_damaged_file_and_a_rerun_rewrites_it(tmp_path, rng, caplog, log, damage, match):
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    out = tmp_path / "out"
    convert(model.path, out, progress=False)
    good = files_of(out)
    damage(out / "table_002.ngt")
    with pytest.raises(VerifyError, match=f"table_002.ngt: .*{match}"):
        verify_tables(out)
    convert(model.path, out)
    again = [r for r in caplog.records if "writing it again" in r.getMessage()]
    assert len(again) == 1 and again[0].levelno == logging.WARNING and "table 3/4" in again[0].getMessage()
    assert sum("skipped" in line for line in log()) == 3
    verify_tables(out)
    assert files_of(out) == good


def test_verification_refuses_an_unfinished_conversion_and_malformed_entries(tmp_path, rng):
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    out = tmp_path / "out"
    with pytest.raises(Stop):
        convert(model.path, out, chunk_bytes=10 * 6 * 2, progress=False, on_chunk=_stop_after(2 * 8 + 3))
    with pytest.raises(VerifyError, match=r"no table file for tables \[2, 3\]"):
        verify_tables(out)
    convert(model.path, out, progress=False)
    verify_tables(out)
    manifest = json.loads((out / MANIFEST).read_text())
    for key, value, match in [("file", "../m/config.json", "not a file inside"), ("index", None, r"tables \[0\]")]:
        bad = json.loads(json.dumps(manifest))
        bad["tables"][0][key] = value
        (out / MANIFEST).write_text(json.dumps(bad))
        with pytest.raises(VerifyError, match=match):
            verify_tables(out)
    del manifest["max_ngram"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(VerifyError, match="max_ngram"):
        verify_tables(out)


def test_fp8_scale_corruption_is_caught(tmp_path, rng):
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    out = tmp_path / "out"
    convert(model.path, out, fp8=True, progress=False)
    path = out / "table_001.ngt"
    _flip(path, path.stat().st_size - 3)  # inside the scales
    with pytest.raises(VerifyError, match="table_001.ngt: crc32 rows .* scales"):
        verify_tables(out)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_crc_mismatch_gives_both_sides_in_hex(tmp_path, rng, caplog, fp8):
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    out = tmp_path / "out"
    entry = convert(model.path, out, fp8=fp8, progress=False)["tables"][1]
    path = out / "table_001.ngt"
    _flip(path, 4096 + int(rng.integers(0, 400)))
    with TableFile(path) as f:
        crc = zlib.crc32(f.rows_bytes.tobytes())
        scales = None if f.scales is None else f"{zlib.crc32(f.scales.tobytes()):#010x}"
    listed = None if entry["scales_crc32"] is None else f"{entry['scales_crc32']:#010x}"
    want = (f"crc32 rows {crc:#010x} / scales {scales}, the manifest says {entry['rows_crc32']:#010x} / {listed} "
            "(corrupt file)")
    with pytest.raises(VerifyError, match=f"^{re.escape(f'{path}: {want}')}$"):
        verify_tables(out)
    convert(model.path, out, fp8=fp8)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].endswith(f": {want}; writing it again"), warnings


def test_a_conversion_with_other_settings_is_not_mixed_in(tmp_path, rng):
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    convert(model.path, tmp_path / "out", progress=False)
    with pytest.raises(CheckpointError, match="other settings"):
        convert(model.path, tmp_path / "out", fp8=True, progress=False)
    other = write_model(tmp_path / "m2", make_model(rng, tiny_config(ngram_vocab_size_ratio=0.3), "b"))
    with pytest.raises(CheckpointError, match="other settings"):
        convert(other.path, tmp_path / "out", progress=False)


@pytest.mark.parametrize("kinds", ["b", "f"], ids=["bf16", "fp8"])
def test_another_models_tables_of_the_same_layout_are_written_again(tmp_path, rng, log, kinds):
    a = write_model(tmp_path / "a", make_model(rng, kinds=kinds))
    b = write_model(tmp_path / "b", make_model(rng, kinds=kinds))  # same config and layout, other weights
    convert(b.path, tmp_path / "clean", progress=False)
    convert(a.path, tmp_path / "out", progress=False)
    log_before = len(log())
    convert(b.path, tmp_path / "out")
    written_again = [line for line in log()[log_before:] if line.endswith("writing it again")]
    assert len(written_again) == len(b.tables)
    assert files_of(tmp_path / "out") == files_of(tmp_path / "clean")


def test_a_table_rewritten_in_place_is_written_again(tmp_path, rng, log):
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    convert(model.path, tmp_path / "out", progress=False)
    file = rewrite_tensor(model, TABLE.format(1), random_bf16(rng, model.tables[1][0].shape))
    st = file.stat()  # the same layout; a later modification time (the clock may not have moved yet)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    log_before = len(log())
    convert(model.path, tmp_path / "out")
    rewritten = [line for line in log()[log_before:] if line.endswith("writing it again")]
    convert(model.path, tmp_path / "clean", progress=False)
    assert files_of(tmp_path / "out") == files_of(tmp_path / "clean")
    in_that_file = [c for c in range(len(model.tables)) if shard_of(model, TABLE.format(c)) == file]
    assert 1 in in_that_file and len(rewritten) == len(in_that_file)  # every table of that file, no other


def test_the_converter_needs_no_word_table_nor_eos(tmp_path, rng):
    model = write_model(tmp_path / "m", make_model(rng, tiny_config(eos_token_id=[2, 9]), "b"))
    rewrite_tensor(model, "model.embed_tokens.weight", None)
    convert(model.path, tmp_path / "out", progress=False)
    verify_tables(tmp_path / "out")


# ==== what OUT_DIR holds already =====================================================================

def _snapshot(out) -> dict:
    """Each entry of ``out``: its bytes (a folder: its listing), inode and modification time."""
    return {p.name: (p.read_bytes() if p.is_file() else sorted(os.listdir(p)), p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(out.iterdir())}


@pytest.mark.parametrize("resuming", [False, True], ids=["fresh", "resuming"])
@pytest.mark.parametrize("foreign", ["bytes", "table", "folder", "link"])
def test_a_file_the_converter_did_not_write_is_refused_and_kept(tmp_path, rng, foreign, resuming):
    """A user's file at a table's name (random bytes, a table file of another width, a folder, a
    link to a file elsewhere), which the manifest does not list and which is no table file of the
    dtype and shape written there, is refused before anything is written, in an empty OUT_DIR or
    in one whose conversion stopped in that very table."""
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    out = tmp_path / "out"
    if resuming:  # tables 0 and 1 written and listed; stopped in table 2
        with pytest.raises(Stop):
            convert(model.path, out, chunk_bytes=10 * 6 * 2, progress=False, on_chunk=_stop_after(2 * 8 + 3))
    else:
        out.mkdir()
    mine, rows, td = out / "table_002.ngt", model.dims.table_rows(2), model.dims.table_dim()
    what = "not a table file"
    if foreign == "bytes":
        mine.write_bytes(rng.bytes(int(rng.integers(1, 3 * 4096))))
    elif foreign == "table":
        write_table(mine, random_bf16(rng, (rows, td + 2)))
        what = rf"a bfloat16 \[{rows}, {td + 2}\] table where this conversion writes bfloat16 \[{rows}, {td}\]"
    elif foreign == "folder":
        mine.mkdir()
        (mine / "notes").write_bytes(rng.bytes(100))
    else:
        (tmp_path / "elsewhere").write_bytes(rng.bytes(5000))
        mine.symlink_to(tmp_path / "elsewhere")
    before = _snapshot(out)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(mine))}: not written by this conversion \(not "
                                              rf"listed in {MANIFEST}, and {what}\); .* use another OUT_DIR$"):
        convert(model.path, out, progress=False)
    assert _snapshot(out) == before
    assert not list(out.glob("*.tmp"))


@pytest.mark.parametrize("listed", [2, 0], ids=["manifest-lists-2", "no-manifest"])
def test_a_table_renamed_into_place_but_not_yet_listed_is_the_converters(tmp_path, rng, listed):
    """A run killed between a table's rename and the manifest's rewrite leaves a table file the
    manifest does not list (or no manifest yet, for table 0): a table file of the dtype and shape
    written there, which a rerun takes as its own and finishes to the clean run's files."""
    model = write_model(tmp_path / "m", make_model(rng, kinds="fb"))
    convert(model.path, tmp_path / "clean", fp8=True, progress=False)
    out = tmp_path / "out"
    convert(model.path, out, fp8=True, progress=False)
    for c in range(listed + 1, 4):
        (out / f"table_00{c}.ngt").unlink()
    if listed:
        _edit_manifest(out, lambda m: m.update(tables=m["tables"][:listed]))
    else:
        (out / MANIFEST).unlink()
    convert(model.path, out, fp8=True, progress=False)
    assert files_of(out) == files_of(tmp_path / "clean")


def test_command_line(tmp_path, rng, capsys):
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    assert main([str(model.path), str(tmp_path / "out"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), str(tmp_path / "out2")]) == 2  # not a model folder: a bad argument
    assert "no config.json" in capsys.readouterr().err
    rewrite_tensor(model, TABLE.format(1), None)
    assert main([str(model.path), str(tmp_path / "out3"), "--fp8"]) == 1
    assert "no tensor 'model.ngram_embeddings.embedders.1.weight'" in capsys.readouterr().err
    # a refused conversion leaves no empty OUT_DIR behind (it did, issue 44); one that was there stays
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()
    (tmp_path / "mine").mkdir()
    assert main([str(model.path), str(tmp_path / "mine"), "--fp8"]) == 1
    assert (tmp_path / "mine").is_dir()


# ==== progress, Ctrl-C, unused tensors, bad folders and --help =====================================

def _cli(*args, script=None):
    """Run the command line (or ``script``, which ends by calling it) in a subprocess, stderr a pipe."""
    cmd = ["-c", script] if script else ["-m", "layers.ngram_embed.convert"]
    return subprocess.run([sys.executable, *cmd, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_off_a_terminal_progress_is_log_lines(tmp_path, rng):
    """stderr a pipe (a log file): no ``\r``, one line per table, and within a table at most one
    line per --log-interval (0 here: one per chunk)."""
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    proc = _cli(model.path, tmp_path / "out", "--chunk-mib", 240 / 2**20, "--log-interval", 0)  # 20 bf16 rows of 6
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert all(f" INFO {LOGGER}: " in line for line in lines), lines
    done = [line for line in lines if line.endswith(", verified")]
    assert len(done) == 4 and re.search(r"table_000.ngt \(bf16\): 76 rows, [\d.]+ MB in [\d.]+ s \([\d.]+ MB/s\)", done[0])
    rows = [line for line in lines if ": rows " in line]
    assert len(rows) == 3 + 3 + 3 + 4  # chunks of 20 rows of tables of 76, 78, 80 and 82, the last one not logged
    assert re.search(r"table 1/4 .* -> table_000.ngt \(bf16\): rows 20/76 \(26.3%\), [\d.]+ MB/s$", rows[0])
    assert lines[-1].endswith(f"4 tables (bf16) in {tmp_path / 'out'}")
    quiet = _cli(model.path, tmp_path / "out2", "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == ""
    default = _cli(model.path, tmp_path / "out3")  # --log-interval 30: the table lines only
    assert len(default.stderr.splitlines()) == 5 and ": rows " not in default.stderr


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_without_tqdm_gets_log_lines(tmp_path, rng, monkeypatch, log):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    monkeypatch.setattr(sys, "stderr", FakeTTY())
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    convert(model.path, tmp_path / "out", chunk_bytes=120, log_interval=0)
    assert convert_progress.Progress().mode == "log"
    assert sys.stderr.getvalue() == ""  # no bar: the lines go through logging
    assert sum(line.endswith(", verified") for line in log()) == 4 and any(": rows 10/76" in line for line in log())


class FakeBar:
    """tqdm's interface as the converter uses it, recorded."""

    bars: list = []

    def __init__(self, total, desc, file, **kwargs):
        self.total, self.desc, self.file, self.n, self.postfix, self.closed = total, desc, file, 0, "", False
        self.bars.append(self)

    def update(self, n):
        self.n += n

    def set_postfix_str(self, text, refresh=True):
        self.postfix = text

    def close(self):
        self.closed = True


def test_a_terminal_with_tqdm_gets_a_bar_per_table(tmp_path, rng, monkeypatch, log):
    FakeBar.bars = []
    monkeypatch.setitem(sys.modules, "tqdm", type(sys)("tqdm"))
    monkeypatch.setattr(sys.modules["tqdm"], "tqdm", FakeBar, raising=False)
    monkeypatch.setattr(sys, "stderr", FakeTTY())
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    convert(model.path, tmp_path / "out", chunk_bytes=120, log_interval=0)
    assert [(b.desc[:9], b.total, b.n, b.postfix, b.closed) for b in FakeBar.bars] == [
        (f"table {c + 1}/4", model.dims.table_rows(c) * 12, model.dims.table_rows(c) * 12, "verified", True)
        for c in range(4)]
    assert all(b.file is sys.stderr for b in FakeBar.bars) and log() == []  # no log lines beside the bars
    with pytest.raises(KeyboardInterrupt):  # an interrupted table's bar is closed (the terminal's line ended)
        convert(model.path, tmp_path / "out2", chunk_bytes=120, on_chunk=_interrupt_at(2))
    assert FakeBar.bars[-1].closed and FakeBar.bars[-1].postfix == ""


def test_a_terminal_with_the_real_tqdm(tmp_path, rng, monkeypatch):
    pytest.importorskip("tqdm")  # the progress extra
    monkeypatch.setattr(sys, "stderr", FakeTTY())
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    convert(model.path, tmp_path / "out", chunk_bytes=120)
    out = sys.stderr.getvalue()
    assert "\r" in out and out.count("100%") >= 4 and out.count("verified") == 4


def _interrupt_at(n):
    count = [0]

    def on_chunk(table, done, rows):
        count[0] += 1
        if count[0] == n:
            raise KeyboardInterrupt
    return on_chunk


def test_ctrl_c_exits_130_with_how_to_resume(tmp_path, rng, monkeypatch, capsys, log):
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    args = [str(model.path), str(tmp_path / "out"), "--fp8", "--chunk-mib", "0.0001"]  # chunks of 104 bytes
    append, count = TableWriter.append, [0]

    def interrupted(self, *a, **k):  # Ctrl-C in the middle of table_002 (tables of 10 and 5 chunks before it)
        count[0] += 1
        if count[0] == 20:
            raise KeyboardInterrupt
        return append(self, *a, **k)
    monkeypatch.setattr(TableWriter, "append", interrupted)
    assert main(args) == 130
    err = capsys.readouterr().err
    assert err == ("convert: interrupted; to resume, run the same command again (finished tables that verify are "
                   f"skipped): python -m layers.ngram_embed.convert {' '.join(args)}\n")
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "table_000.ngt", "table_001.ngt"]  # no .tmp
    monkeypatch.setattr(TableWriter, "append", append)
    assert main(args) == 0  # the same command: resumes
    assert [line[:9] for line in log() if line.endswith("done before, verified, skipped")] == ["table 1/4", "table 2/4"]
    convert(model.path, tmp_path / "clean", fp8=True, progress=False)
    assert files_of(out) == files_of(tmp_path / "clean")


def test_a_real_sigint_gives_one_line_and_no_traceback(tmp_path, rng):
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    script = textwrap.dedent("""
        import os, signal, sys
        from layers.ngram_embed import convert
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as on a terminal, even under a runner that ignores it
        append = convert.TableWriter.append
        def once(self, *args):
            convert.TableWriter.append = append
            os.kill(os.getpid(), signal.SIGINT)
            return append(self, *args)
        convert.TableWriter.append = once
        sys.argv[0] = "convert"
        raise SystemExit(convert.main())
    """)
    proc = _cli(model.path, tmp_path / "o u t", script=script)
    assert proc.returncode == 130
    assert proc.stderr.splitlines()[-1] == ("convert: interrupted; to resume, run the same command again (finished "
                                           f"tables that verify are skipped): python -m layers.ngram_embed.convert "
                                           f"{model.path} '{tmp_path / 'o u t'}'")
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_tensors_the_model_does_not_use_are_one_warning(tmp_path, rng, caplog, layout):
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"), layout)
    convert(model.path, tmp_path / "out0", progress=False)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    extra = [TABLE.format(4), SCALE.format(4), PROJ.format(11), "model.ngram_embeddings.embedders.0.bias"]
    for name in extra:  # T = 4: embedders 0..3 and post_projs 0..3 only
        rewrite_tensor(model, name, np.zeros(3, np.float32), near=TABLE.format(0))
    convert(model.path, tmp_path / "out", progress=False)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].name == LOGGER
    assert warnings[0].getMessage() == (
        f"{model.path}: 4 tensor(s) the model does not use, not converted (N = 3, K = 2 give tables 0..3): "
        "model.ngram_embeddings.embedders.0.bias, model.ngram_embeddings.embedders.4.weight, "
        "model.ngram_embeddings.embedders.4.weight_scale, model.ngram_embeddings.post_projs.11.weight")
    tables = [f"table_00{c}.ngt" for c in range(4)]  # the same (the manifest's source offsets moved)
    assert [files_of(tmp_path / "out")[t] for t in tables] == [files_of(tmp_path / "out0")[t] for t in tables]


def test_a_missing_or_unusable_folder_is_named_with_exit_status_2(tmp_path, rng, capsys):
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    prefix = "python -m layers.ngram_embed.convert: error: "
    cases = [
        ([tmp_path / "nothing", tmp_path / "o1"], f"MODEL_DIR {tmp_path / 'nothing'}: no such model folder"),
        ([model.path / "config.json", tmp_path / "o2"], f"MODEL_DIR {model.path / 'config.json'}: not a folder"),
        ([model.path, model.path / "config.json" / "o"], f"OUT_DIR {model.path / 'config.json' / 'o'}: cannot create"),
        ([model.path, model.path / "config.json"], f"OUT_DIR {model.path / 'config.json'}: exists and is not a folder"),
    ]
    for args, message in cases:
        assert main([str(a) for a in args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(prefix + message) and err.count("\n") == 1, err
    assert not (tmp_path / "o1").exists()
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(tmp_path / 'nothing'))}: no such model folder$"):
        NgramWeights.from_pretrained(tmp_path / "nothing", LoggingBackend())
    proc = _cli("/nonexistent/model", tmp_path / "o3")  # the process: status 2, one line, no traceback
    assert (proc.returncode, proc.stderr) == (2, prefix + "MODEL_DIR /nonexistent/model: no such model folder\n")
    for chunk in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit) as exit_:
            main([str(model.path), str(tmp_path / "o4"), "--chunk-mib", chunk])
        assert exit_.value.code == 2 and "--chunk-mib must be a finite number > 0" in capsys.readouterr().err
    assert not (tmp_path / "o4").exists()


def test_help_is_complete():
    proc = _cli("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    usage, described = proc.stdout.split("\n\n", 1)
    for option in ("MODEL_DIR", "OUT_DIR", "--fp8", "--chunk-mib MIB", "--log-interval SECONDS", "--quiet", "-h"):
        assert option in usage and re.search(rf"^  {option}", described, re.M), option
    text = " ".join(proc.stdout.split())
    assert "example: python -m layers.ngram_embed.convert LongCat-Flash-Lite /nvme/lcfl-tables --fp8" in text
    assert "by running the same command again" in text and "still verify" in text and "are skipped" in text
    assert "130 interrupted" in text and "2 bad arguments" in text and "metrale-gpu[progress]" in text


def test_each_exit_status_the_help_lists_is_the_one_given(tmp_path, rng, monkeypatch, capsys):
    """--help's exit statuses, every one pinned by runs of the kinds it names (ending in one line
    on stderr unless 0); it lists no other. An empty MODEL_DIR exited 1 and an empty OUT_DIR
    converted into the current folder (issue 49)."""

    def status(*args) -> int:
        try:
            return main([str(a) for a in args])
        except SystemExit as exit_:  # argparse's own refusals and --help
            return exit_.code

    assert status("--help") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert re.findall(r"(?:^|; )(\d+) ", text.split("exit status: ", 1)[1]) == ["0", "1", "2", "130"]
    model = write_model(tmp_path / "m", make_model(rng, kinds="b"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "table_003.ngt").write_bytes(rng.bytes(100))
    (tmp_path / "m" / "notes").mkdir()
    (tmp_path / "m" / "notes" / "config.json").write_text("[1, 2]")
    monkeypatch.chdir(tmp_path / "empty")  # an empty OUT_DIR would have been the current folder
    runs = {
        0: [(model.path, tmp_path / "o0")],
        1: [(model.path, tmp_path / "mine"), (model.path, tmp_path / "o0", "--fp8")],
        2: [("", tmp_path / "o2"), (model.path, ""), (tmp_path / "empty", tmp_path / "o2"),
            (tmp_path / "nothing", tmp_path / "o2"), (tmp_path / "m" / "notes", tmp_path / "o2"),
            (model.path, tmp_path / "o2", "--chunk-mib", "0"), (model.path,)],
    }
    for code, cases in runs.items():
        for args in cases:
            assert status(*args, "--quiet") == code, args
            err = capsys.readouterr().err
            assert err.count("\n") == (code != 0) and ("Traceback" not in err), (args, err)
            assert err.startswith({0: "", 1: "convert: ", 2: f"{PROG}: error: "}[code]), (args, err)
    for empty in ((model.path, ""), ("", tmp_path / "o2")):  # convert() itself: a ValueError
        with pytest.raises(ValueError, match=r"^convert: (out|model)_dir is empty \(name a folder"):
            convert(*empty, progress=False)
    assert not (tmp_path / "o2").exists() and os.listdir(tmp_path / "empty") == []
    monkeypatch.setattr(TableWriter, "append", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert status(model.path, tmp_path / "o130") == 130
    assert capsys.readouterr().err.startswith("convert: interrupted; to resume")


# ==== NgramWeights.from_pretrained over table files ===============================================================

@pytest.fixture
def converted(tmp_path, rng):
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    convert(model.path, tmp_path / "bf16", progress=False)
    convert(model.path, tmp_path / "fp8", fp8=True, progress=False)
    return model, tmp_path


def test_files_placement_serves_row_caches_over_the_table_files(converted, rng):
    model, root = converted
    gpu = LoggingBackend()
    weights = NgramWeights.from_pretrained(model.path, gpu, placement=["files", "host", "device", "files"],
                                           table_dir=root / "bf16", cache_rows=32)
    kinds = [type(t).__name__ for t in weights.tables]
    assert kinds == ["CachedTable", "HostTable", "Bf16Table", "CachedTable"]
    assert gpu.count("register_host") == 1  # the host table is the file, registered in place
    for c in (0, 3):
        cache = weights.tables[c].cache
        assert isinstance(cache, RowCache) and cache.capacity == 32
        assert cache.file.path == str(root / "bf16" / f"table_00{c}.ngt")
        ids = rng.integers(0, cache.rows, 20)
        slots = np.empty(20, np.uint32)
        cache.resolve(ids, slots)
        arena = gpu.read(cache.table_dev_va(), cache.capacity * cache.file.row_bytes).reshape(cache.capacity, -1)
        want = model.tables[c][0] if model.tables[c][1] is None else ref.dequant_fp8(*model.tables[c])
        np.testing.assert_array_equal(arena[slots.astype(np.int64)], want[ids].view(np.uint8).reshape(20, -1))
        cache.end_batch()
    host = weights.tables[1].weight
    np.testing.assert_array_equal(gpu.read(host.weight, host.nbytes).view(BF16).reshape(host.shape),
                                  ref.dequant_fp8(*model.tables[1]))
    weights.close()
    assert gpu.empty()


@pytest.mark.parametrize("placement", ["device", "host", ["host", "device", "device", "host"]])
def test_fp8_table_files_load_as_from_numpy_of_their_contents(converted, placement):
    model, root = converted
    tables = [table_contents(root / "fp8" / f"table_00{c}.ngt") for c in range(4)]
    gpu, ref_gpu = LoggingBackend(), LoggingBackend()
    with NgramWeights.from_pretrained(model.path, gpu, placement=placement, table_dir=root / "fp8") as weights, \
            NgramWeights.from_numpy(model.dims, model.word, tables, model.projs, ref_gpu,
                                    placement=placement) as want:
        assert layer_bytes(gpu, weights) == layer_bytes(ref_gpu, want)
    assert gpu.empty()


def test_table_dir_needs_no_checkpoint_tables(converted):
    model, root = converted
    for c in range(4):
        rewrite_tensor(model, TABLE.format(c), None)
    rewrite_tensor(model, SCALE.format(1), None)
    rewrite_tensor(model, SCALE.format(3), None)
    gpu = LoggingBackend()
    NgramWeights.from_pretrained(model.path, gpu, placement="host", table_dir=root / "bf16").close()
    assert gpu.empty()


def _edit_manifest(root, edit):
    path = root / MANIFEST
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("damage, match", [
    (lambda d: _edit_manifest(d, lambda m: m.update(base_rows=m["base_rows"] + 1)), "tables for other dims: base_rows"),
    (lambda d: _edit_manifest(d, lambda m: m["tables"].pop(2)), r"no table file for tables \[2\]"),
    (lambda d: _edit_manifest(d, lambda m: m.update(version=9)), "manifest version 9"),
    (lambda d: _edit_manifest(d, lambda m: m.pop("version")), "manifest version None, this reader knows 1"),
    (lambda d: _edit_manifest(d, lambda m: m.update(format="x")), "not a metrale-ngram-tables manifest"),
    (lambda d: _edit_manifest(d, lambda m: m["tables"][0].update(file="../t.ngt")), "not a file inside"),
    (lambda d: (d / MANIFEST).write_text("{"), "not valid JSON"),
    (lambda d: (d / "table_001.ngt").unlink(), "table 1's file .* does not exist"),
    (lambda d: _flip(d / "table_003.ngt", 8), "format version|crc"),
    (lambda d: (d / "table_000.ngt").write_bytes((d / "table_000.ngt").read_bytes()[:-1]), "header says"),
    (lambda d: os.replace(d / "table_001.ngt", d / "table_000.ngt"), r"table 0 is \[78, 6\]"),
])
def test_a_bad_table_dir_is_refused_before_any_upload(converted, damage, match):
    model, root = converted
    damage(root / "bf16")
    gpu = LoggingBackend()
    with pytest.raises(CheckpointError, match=match):
        NgramWeights.from_pretrained(model.path, gpu, placement="files", table_dir=root / "bf16")
    assert gpu.log == [] and gpu.empty()


@pytest.mark.parametrize("placement", ["files", "host"])
@pytest.mark.parametrize("wider", [-1, 2])
def test_a_table_file_of_another_row_width_is_refused(converted, rng, placement, wider):
    """The rows the config gives, not its table dim: refused before any upload, and by verify_tables."""
    model, root = converted
    rows, td = model.dims.table_rows(2), model.dims.table_dim()
    path = root / "bf16" / "table_002.ngt"
    write_table(path, random_bf16(rng, (rows, td + wider)))
    message = rf"^{re.escape(str(path))}: table 2 is \[{rows}, {td + wider}\], the config gives \[{rows}, {td}\]$"
    gpu = LoggingBackend()
    with pytest.raises(CheckpointError, match=message):
        NgramWeights.from_pretrained(model.path, gpu, placement=placement, table_dir=root / "bf16")
    assert gpu.log == [] and gpu.empty()
    with pytest.raises(VerifyError, match=re.escape(f"table 2 is [{rows}, {td + wider}]")):
        verify_tables(root / "bf16")


def test_the_decoder_refuses_row_caches_when_it_is_built(converted):
    """The weights load ``RowCache`` tables for any runner; the decoder refuses them at its own
    construction (``NO_ROW_CACHE``), before it allocates or launches anything, and leaves the
    weights open: the fused path serves them, and closing them frees all they loaded. Host
    tables from the files it serves."""
    model, root = converted
    gpu = LoggingBackend()
    for placement in ("files", ["host", "files", "device", "device"]):
        with NgramWeights.from_pretrained(model.path, gpu, placement=placement, table_dir=root / "bf16") as weights:
            mark = len(gpu.log)
            with pytest.raises(ValueError, match=re.escape(NO_ROW_CACHE)):
                NgramDecoder(weights, max_seqs=2, max_rows=8)
            assert gpu.log[mark:] == [] and not weights.closed
            FusedNgramEmbedding(weights, 8).close()
        assert gpu.empty()
    with NgramWeights.from_pretrained(model.path, gpu, placement="host", table_dir=root / "fp8") as weights:
        dec = NgramDecoder(weights, max_seqs=2, max_rows=8)
        assert dec.weights is weights and all(isinstance(t, NgramTable.Host) for t in weights.tables)
        dec.close()
        assert not weights.closed
    assert gpu.empty()
