"""``bench/results.py``: ``bench/RESULTS.md`` from a ``make bench`` log (no GPU needed)."""

from __future__ import annotations

import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest

from bench import results

LOG = """\
== bench.kernels
device X: measured copy bandwidth 4.22 TB/s (read + write)

## memory-bound kernels
Each row is one kernel.

| kernel | us |
|--------|----|
|      a | 5.8 |
target x <= 2: 1.5 (met)
== bench.tensor_parallel
bench.tensor_parallel: skipped: needs 2 GPUs
"""


def test_each_benchmark_is_a_section_with_its_tables_and_lines_in_order():
    text = results.render(LOG, commit="abc123", device="GPU Z", when=datetime(2026, 12, 4, tzinfo=timezone.utc))
    lines = text.splitlines()
    assert lines[0] == "# Benchmark results"
    assert "- machine: GPU Z" in lines and "- commit: abc123" in lines and "- date: 2026-12-04 00:00 UTC" in lines
    body = lines[lines.index("## bench.kernels"):]
    assert body[:12] == [
        "## bench.kernels",
        "- device X: measured copy bandwidth 4.22 TB/s (read + write)",
        "",
        "### memory-bound kernels",
        "",
        "Each row is one kernel.",
        "",
        "| kernel | us |",
        "|--------|----|",
        "|      a | 5.8 |",
        "",
        "- target x <= 2: 1.5 (met)",
    ]
    assert body[12:] == ["", "## bench.tensor_parallel", "- bench.tensor_parallel: skipped: needs 2 GPUs"]


def test_unknown_commit_says_how_to_name_it(tmp_path):
    log = tmp_path / "bench.log"
    log.write_text(LOG)
    out = tmp_path / "R.md"
    assert results.main([str(log), "--out", str(out), "--commit", "deadbeef"]) == 0
    assert "- commit: deadbeef" in out.read_text()
    assert "pass --commit" in results.render(LOG, commit=None, device="d", when=datetime.now(timezone.utc))


# -- what it reads and what it replaces (issue 49) ------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent


def _main(capsys, *argv: object) -> tuple[int, str]:
    """results.main's exit status and stderr (a usage error raises SystemExit(2))."""
    try:
        rc = results.main([str(a) for a in argv])
    except SystemExit as exit_:
        rc = exit_.code
    return rc, capsys.readouterr().err


def _random_text(rng) -> str:
    return "\n".join("".join(rng.choice(list("abc xyz#=|-.")) for _ in range(40)) for _ in range(5))


@pytest.mark.parametrize("log", ["readme", "empty", "one line", "random text", "random bytes", "results"])
def test_a_file_that_is_not_a_bench_log_is_refused_and_nothing_written(tmp_path, rng, capsys, log):
    """``python -m bench.results README.md`` replaced bench/RESULTS.md with 8 lines, status 0."""
    path = tmp_path / "log"
    if log == "random bytes":
        path.write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    else:
        path.write_text({
            "readme": (ROOT / "README.md").read_text(),
            "empty": "",
            "one line": "bench.kernels\n",
            "random text": _random_text(rng),
            "results": (ROOT / "bench" / "RESULTS.md").read_text(),
        }[log])
    record = tmp_path / "RESULTS.md"
    record.write_text(results.render(LOG, commit="c", device="d", when=datetime.now(timezone.utc)))
    before = record.read_text()
    for out in (record, tmp_path / "new.md"):
        rc, err = _main(capsys, path, "--out", out, "--device", "d", "--commit", "c")
        assert rc == 2 and err.count("\n") == 1, err
        assert err.startswith(f"python -m bench.results: error: {path}: not a benchmark log"), err
    assert record.read_text() == before and not (tmp_path / "new.md").exists()


def test_out_replaces_only_a_file_bench_results_wrote_unless_forced(tmp_path, rng, capsys):
    log = tmp_path / "bench.log"
    log.write_text(LOG)
    mine = tmp_path / "mine.md"
    mine.write_text(_random_text(rng))
    before = mine.read_text()
    rc, err = _main(capsys, log, "--out", mine, "--device", "d")
    assert rc == 2 and err == f"python -m bench.results: error: --out {mine}: not a file bench.results wrote; --force replaces it\n"
    assert mine.read_text() == before
    assert _main(capsys, log, "--out", mine, "--device", "d", "--force")[0] == 0
    assert results.is_results_file(mine) and "## bench.kernels" in mine.read_text()
    assert _main(capsys, log, "--out", mine, "--device", "GPU Q")[0] == 0  # now its own: replaced
    assert "- machine: GPU Q" in mine.read_text()
    rc, err = _main(capsys, log, "--out", tmp_path, "--device", "d")  # a folder: never replaced
    assert rc == 2 and err.endswith(f"--out {tmp_path}: not a file\n")


def test_the_committed_record_is_replaced_by_a_full_run(tmp_path, capsys):
    """What ``make bench`` does after every benchmark ran: the log over bench/RESULTS.md."""
    record = tmp_path / "RESULTS.md"
    record.write_text((ROOT / "bench" / "RESULTS.md").read_text())
    log = tmp_path / "bench.log"
    log.write_text(LOG)
    assert results.is_results_file(record)
    assert _main(capsys, log, "--out", record, "--device", "d", "--commit", "c")[0] == 0
    text = record.read_text()
    assert "- commit: c\n" in text and text.endswith("## bench.tensor_parallel\n- bench.tensor_parallel: skipped: needs 2 GPUs\n")


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_bench_writes_the_record_only_after_every_benchmark():
    """``make bench BENCHES=<name>`` (a subset) leaves bench/RESULTS.md alone; ``make bench`` ends
    with bench.results over the log into it."""
    def dry(*args: str) -> str:
        return subprocess.run(["make", "-n", "--no-print-directory", "bench", *args], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout

    assert "-m bench.results .logs/bench.log --out bench/RESULTS.md" in dry()
    assert "bench.results" not in dry("BENCHES=kernels")


# -- bench.engram's tables (issue 50) --------------------------------------------------------------
def _table(markdown: str, title: str) -> list[list[str]]:
    """The cells of the rows of the table under ``### title``."""
    lines = markdown.splitlines()
    at = lines.index(f"### {title}")
    rows = []
    for line in lines[at + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("| "):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[1:]  # not the header


def test_bench_engram_tables_and_targets_come_through_results(rng, capsys):
    """bench.engram's report (rows of made-up times, each target met or missed by a margin) prints
    tables that bench.results keeps, and each issue 50 target is met or missed as its numbers say:
    host lookups at B = 1, 64 against 3x the torch form's, at 1024, 8192 against 1.1x the read
    floor, every whole step against the torch form's (none: not measured); device lookups have none.
    Issue 51's host reads: each staged host prefill lookup's GB/s of rows against 13 and against
    0.7x the small table's rate (the in-place and busy-interpreter rows have none)."""
    from bench.engram import Check, Results, Row, report

    def row(where, call, n, part, torch_x, floor_x, gbs=None):
        # torch_x: torch / ours, floor_x: ours / floor; gbs: ours from GB/s of rows (n x 24 rows of 264 bytes,
        # which the floor's read rate counts too, as bench.engram's floors do)
        ours = float(rng.uniform(5, 5000)) if gbs is None else n * 24 * 264 / gbs / 1e3
        floor = ours / floor_x
        return Row(where, call, n, part, ours, None if torch_x is None else ours * torch_x, floor, 0,
                   n * 24 * 264 / floor / 1e3)

    host = Results("host", 384006168, 384006168 * 264, [
        row("host", "decode", 1, "lookup", 3.2, 2.0), row("host", "decode", 1, "whole", 1.1, 2.0),
        row("host", "decode", 64, "lookup", 2.8, 2.0), row("host", "decode", 64, "whole", 0.9, 2.0),
        row("host", "prefill", 1024, "lookup", 0.5, 1.05), row("host", "prefill", 1024, "whole", 1.3, 3.0),
        row("host", "prefill", 1024, "lookup staged", None, 0.5, 20.0),
        row("host", "prefill", 1024, "lookup staged, busy Python", None, 5.0, 1.0),
        row("host", "prefill", 8192, "lookup", 9.0, 1.15), row("host", "prefill", 8192, "whole", None, 3.0),
        row("host", "prefill", 8192, "lookup staged", None, 0.5, 12.0),
    ], [Check("host", "decode", 1, 0, 6144, 0.0, 1e-3, 5e-3)], {1024: 40.0, 8192: 16.0})
    device = Results("device", 384006168, 384006168 * 264, [
        row("device", "decode", 1, "lookup", 0.5, 9.0), row("device", "decode", 1, "whole", 0.95, 2.0),
    ], [Check("device", "decode", 1, 0, 6144, 0.0, 1e-3, 0.1)])
    report([host, device])
    text = results.render("== bench.engram\n" + capsys.readouterr().out, commit="c", device="d",
                          when=datetime.now(timezone.utc))
    got = [(t, where, call, int(n), met) for t, where, call, n, _, met in _table(text, "issue 50's targets")]
    assert got == [
        ("lookup >= 3x the torch form's", "host", "decode", 1, "met"),
        ("whole step never slower than the torch form", "host", "decode", 1, "met"),
        ("lookup >= 3x the torch form's", "host", "decode", 64, "missed"),
        ("whole step never slower than the torch form", "host", "decode", 64, "missed"),
        ("lookup <= 1.1x its rows' read floor", "host", "prefill", 1024, "met"),
        ("whole step never slower than the torch form", "host", "prefill", 1024, "met"),
        ("lookup <= 1.1x its rows' read floor", "host", "prefill", 8192, "missed"),
        ("whole step never slower than the torch form", "host", "prefill", 8192, "-"),
        ("whole step never slower than the torch form", "device", "decode", 1, "missed"),
    ]
    reads = [(t, int(n), float(v), met) for t, _, _, n, v, met in _table(text, "issue 51's host-read targets")]
    assert reads == [("host lookup >= 13 GB/s of rows", 1024, 20.0, "met"),
                     ("host lookup >= 0.7x the small-table rate", 1024, 0.5, "missed"),
                     ("host lookup >= 13 GB/s of rows", 8192, 12.0, "missed"),
                     ("host lookup >= 0.7x the small-table rate", 8192, 0.75, "met")]
    assert "- targets: 6 met, 6 missed, 1 not measured" in text.splitlines()
    title = "Engram layer 1 at DeepSeek-V4.1-Flash's dims, table in {} memory (384006168 rows, 101.4 GB)"
    host_rows, device_rows = _table(text, title.format("host")), _table(text, title.format("device"))
    assert [r[:3] for r in host_rows] == [[r.call, str(r.tokens), r.part] for r in host.rows]
    assert len(device_rows) == 2 and device_rows[0][4] == f"{device.rows[0].torch:.3g}"
    notes = [line for line in text.splitlines() if line.startswith("Each row is one call")]
    assert len(notes) == 2 and notes[0].endswith(": ok") and notes[1].endswith(": MISMATCH")


def test_bench_engram_table_slices_are_views_of_its_pool(rng):
    """bench.engram's synthetic table: row r is row r % period of its random base; a slice as
    from_arrays reads one (at most CHUNK_ROWS rows) is a view of its pool, any other a copy of the
    same rows. Its config: the real primes at the real row count, else 24 primes near rows / 24."""
    from bench.engram import REAL_ROWS, Repeating, engram_config
    from layers.engram.weights import CHUNK_ROWS

    period = int(rng.integers(3, 50))
    base = rng.integers(0, 256, (period, 3), dtype=np.uint8)
    table = Repeating(base, 10 * CHUNK_ROWS)
    for a, b, step in [(0, CHUNK_ROWS, 1), (int(rng.integers(0, 9 * CHUNK_ROWS)), None, 1),
                       (int(rng.integers(0, CHUNK_ROWS)), 3 * CHUNK_ROWS, 1), (5, 900, int(rng.integers(2, 9)))]:
        b = a + int(rng.integers(0, CHUNK_ROWS)) if b is None else b
        got = table[a:b:step]
        assert (got == base[np.arange(a, b, step) % period]).all()
        assert np.shares_memory(got, table.pool) == (step == 1 and b - a <= CHUNK_ROWS)
    real = engram_config(REAL_ROWS)
    assert (real.primes[0, 0], real.primes[0, -1], real.num_embeddings) == (16000057, 16000463, (REAL_ROWS,))
    rows = int(rng.integers(10**5, 10**7))
    small = engram_config(rows)
    assert small.num_embeddings[0] == small.primes.sum() and abs(small.num_embeddings[0] - rows) < rows // 100
