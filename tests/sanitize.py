"""Every GPU test under compute-sanitizer: one pass per tool, each pass split over processes.

``make sanitize`` runs this. A tool slows kernels 10-100x: on the H200 one process per tool
over the whole suite took about 270 s (memcheck, synccheck) and 320 s (initcheck); racecheck
was 86% through at 416 s. The GPU tests are collected once and dealt round-robin into shards (racecheck gets
twice as many), and up to ``--jobs`` ``compute-sanitizer ... pytest <shard>`` processes run at
once on the one device. The device, not the host, is what they share: 16 processes at once
finished less work in 470 s than 4 did in 420 s, so the default is one process per shard of
the default split (5), not one per core.
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
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=["tests"])
    ap.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    ap.add_argument("--jobs", type=int, default=5, help="processes at once")
    ap.add_argument("--shards", type=int, default=1, help="shards per tool (racecheck: twice)")
    ap.add_argument("--log-dir", type=Path, default=Path(".logs"))
    args = ap.parse_args()
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
    print(f"\n| tool | tests | passed | failed | skipped | errors |\n|---|---|---|---|---|---|")
    ok = True
    for tool, runs in results.items():
        counts = [outcomes(text) for _, text in runs]
        total = {k: sum(c.get(k, 0) for c in counts) for k in ("passed", "failed", "error", "skipped")}
        tool_errors = [re.findall(r"ERROR SUMMARY: (\d+) error", text) for _, text in runs]
        errors = sum(int(found[-1]) for found in tool_errors if found)
        finished = all(tool_errors) and all(counts)
        ok &= finished and all(rc == 0 for rc, _ in runs) and errors == 0
        print(f"| {tool} | {len(ids)} | {total['passed']} | {total['failed'] + total['error']} | "
              f"{total['skipped']} | {errors if finished else f'{errors} (a process died: see its log)'} |")
    print(f"\n{time.perf_counter() - t0:.0f} s; {'clean' if ok else 'NOT clean'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
