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
