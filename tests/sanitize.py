"""Every GPU test under compute-sanitizer: one pass per tool, each pass split over processes.

``make sanitize`` runs this. A tool slows kernels 10-100x. The GPU tests are collected once and
dealt round-robin into ``--shards`` shards per tool (racecheck, the slowest, gets twice as
many), and up to ``--jobs`` ``compute-sanitizer ... pytest <shard>`` processes run at once on
the one device. Measured on the H200 over 990 tests: one process per tool, four at once, took
270-320 s (racecheck 86% through at 416 s); racecheck alone in 4 shards, 4 at once, 331 s;
memcheck, initcheck and synccheck in 2 shards each, 6 at once, 155 s; 16 processes at once did
less in 470 s than 4 in 420 s. The defaults (2 shards, 6 jobs) follow those runs.
Each process's output is kept in ``<log-dir>/sanitize-<tool>-<shard>.log``; the summary is a
table of tool, tests collected, passed / failed / skipped, and the tool's error count.

API errors are not reported (``--report-api-errors no``): the runtime checks every call's
status itself and some tests provoke errors on purpose (out of memory, missing kernels).
Every kernel error counts; nothing is suppressed. ``GPU_SANITIZER=<tool>`` tells the tests
they run under a tool, whose own device allocations make ``cuMemGetInfo`` meaningless.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from gpu_runtime import cli

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
SHARD_WEIGHT = {"racecheck": 2}  # racecheck runs about twice as long as the others


def collect(paths: list[str]) -> list[str]:
    """Node ids of the GPU tests under ``paths`` (collection needs no device)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                          "-p", "no:cacheprovider", *paths], capture_output=True, text=True)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    if out.returncode != 0 or not ids:
        sys.exit(f"sanitize: collecting GPU tests failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return ids


def run_shard(tool: str, shard: int, ids: list[str], log_dir: Path) -> tuple[str, int, Path]:
    log = log_dir / f"sanitize-{tool}-{shard}.log"
    cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "99", "--print-limit", "20",
           "--report-api-errors", "no", sys.executable, "-m", "pytest", "-q", "-rfE",
           "-p", "no:cacheprovider", f"--basetemp=/tmp/sanitize-{tool}-{shard}", *ids]
    env = dict(os.environ, GPU_SANITIZER=tool, REQUIRE_GPU="1")
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    return tool, rc, log


def outcomes(log: str) -> dict[str, int]:
    """pytest's closing line ("3 failed, 120 passed, 1 skipped in 80.1s") as counts."""
    lines = re.findall(r"^(?:=+ )?(\d+ \w+.* in [\d.]+s.*)$", log, re.M)
    pairs = re.findall(r"(\d+) (\w+)", lines[-1]) if lines else []
    return {word.rstrip("s") if word.startswith("error") else word: int(n) for n, word in pairs}


def tool_errors(log: str) -> int | None:
    """The tool's closing count: memcheck, initcheck and synccheck print "ERROR SUMMARY: N
    errors", racecheck "RACECHECK SUMMARY: H hazards displayed (E errors, W warnings)", whose
    warnings (possible hazards) count too. None when the log has no summary (the tool died)."""
    if found := re.findall(r"ERROR SUMMARY: (\d+) error", log):
        return int(found[-1])
    if found := re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)", log):
        return sum(map(int, found[-1]))
    return None


EPILOG = """\
Needs a CUDA GPU and compute-sanitizer on PATH (collection alone runs anywhere). Output: a line per
process as it ends, then a markdown table (tool, tests collected, passed, failed, skipped, the
tool's error count) and the seconds taken. Exit status 0 only when every process finished with
rc 0, its tool's summary and no error.

examples:
  python -m tests.sanitize                                   # every GPU test, every tool
  python -m tests.sanitize --tools racecheck --shards 2 --jobs 4
  python -m tests.sanitize tests/test_gemm.py --tools memcheck --log-dir /tmp/logs
"""


def make_parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(prog="python -m tests.sanitize", description=__doc__, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", default=["tests"], help="test files or directories (default: tests)")
    ap.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS, metavar="TOOL",
                    help=f"compute-sanitizer tools to run, one pass each (default: all of {', '.join(TOOLS)})")
    ap.add_argument("--jobs", type=int, default=6, help="processes at once on the device (default: 6)")
    ap.add_argument("--shards", type=int, default=2,
                    help="processes each tool's tests are dealt into; racecheck gets twice as many (default: 2)")
    ap.add_argument("--log-dir", type=Path, default=Path(".logs"),
                    help="where each process's log sanitize-<tool>-<shard>.log goes (default: .logs)")
    return ap


def main(argv: list[str] | None = None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    if shutil.which("compute-sanitizer") is None:
        parser.exit(2, f"{parser.prog}: compute-sanitizer is not on PATH (it comes with the CUDA toolkit, not with "
                       "the pip packages: add the toolkit's bin folder to PATH)\n")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    ids = collect(args.paths)
    jobs = [(tool, k, ids[k::n]) for tool in args.tools
            for n in [args.shards * SHARD_WEIGHT.get(tool, 1)] for k in range(n) if ids[k::n]]
    print(f"sanitize: {len(ids)} GPU tests x {len(args.tools)} tools in {len(jobs)} processes, "
          f"{args.jobs} at a time; logs in {args.log_dir}", flush=True)
    t0, results = time.perf_counter(), {tool: [] for tool in args.tools}
    with ThreadPoolExecutor(args.jobs) as pool:
        for done in as_completed([pool.submit(run_shard, *job, args.log_dir) for job in jobs]):
            tool, rc, log = done.result()
            results[tool].append((rc, log.read_text(errors="replace")))
            print(f"  {log.name}: rc {rc} at {time.perf_counter() - t0:.0f} s", flush=True)
    print("\n| tool | tests | passed | failed | skipped | errors |\n|---|---|---|---|---|---|")
    ok = True
    for tool, runs in results.items():
        counts = [outcomes(text) for _, text in runs]
        total = {k: sum(c.get(k, 0) for c in counts) for k in ("passed", "failed", "error", "skipped")}
        found = [tool_errors(text) for _, text in runs]
        errors = sum(n for n in found if n is not None)
        finished = None not in found and all(counts)
        ok &= finished and all(rc == 0 for rc, _ in runs) and errors == 0
        print(f"| {tool} | {len(ids)} | {total['passed']} | {total['failed'] + total['error']} | "
              f"{total['skipped']} | {errors if finished else f'{errors} (a process died: see its log)'} |")
    print(f"\n{time.perf_counter() - t0:.0f} s; {'clean' if ok else 'NOT clean'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
