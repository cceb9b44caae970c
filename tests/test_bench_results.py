"""``bench/results.py``: ``bench/RESULTS.md`` from a ``make bench`` log (no GPU needed)."""

from __future__ import annotations

from datetime import datetime, timezone

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
