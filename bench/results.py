"""``bench/RESULTS.md`` from a benchmark log: the machine, the commit and the date above every
table that ``make bench`` printed, so that the recorded figures are never typed by hand.

``make bench`` (and ``make gpu-check``) run it after the benchmarks: the log is their output
(``== bench.<name>`` lines, then each benchmark's lines and markdown tables). Each benchmark
becomes a section; a table keeps its title, its note line and its rows (each row's figure, its
floor and anchor columns and their ratios, as the benchmark printed them); the other lines a
benchmark printed (measured ceilings, checks, targets met or not) are kept as a list above its
tables.

It refuses, writing nothing (one line, status 2), a log without a ``== bench.<name>`` line and an
``--out`` file it did not write itself (one whose first lines are not its title and "Written by"
line) unless ``--force``.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from bench.common import nonempty
from gpu_runtime import cli

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str | None:
    """HEAD of the checkout this file is in, ``+ uncommitted changes`` when the tree differs;
    None outside a git checkout (a copy of the tree without ``.git``)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def device_line() -> str:
    """The GPU, its SM count and the driver's CUDA version, from the driver (no GPU: a note)."""
    try:
        from cuda.bindings import driver as cu

        from gpu_runtime import CudaBackend
        from gpu_runtime.driver import call

        with CudaBackend() as gpu:
            version = int(call(cu.cuDriverGetVersion))
            driver = f"{version // 1000}.{version % 1000 // 10}"
            return f"{gpu.name}, {gpu.sm_count} SMs, L2 {gpu.l2_bytes >> 20} MB, CUDA driver {driver}"
    except Exception as exc:  # noqa: BLE001 -- the record still says what it could not ask
        return f"unknown ({type(exc).__name__}: {exc})"


def sections(log: str) -> list[tuple[str, list[str]]]:
    """(benchmark, its markdown lines) for each ``== bench.<name>`` of the log, in order: each
    table as ``### title``, its note and its rows; every other line a benchmark printed as a list
    item."""
    out: list[tuple[str, list[str]]] = []
    body: list[str] = []
    state = "free"  # "head": after a table's title, before its rows; "rows": inside them
    for line in log.splitlines():
        if line.startswith("== bench."):
            body = []
            out.append((line[3:].strip(), body))
            state = "free"
            continue
        if not out:
            continue
        if line.startswith("## "):
            body += ["", "#" + line]
            state = "head"
            continue
        if state == "head":
            if line.startswith("|"):
                body += ["", line]
                state = "rows"
            elif line.strip():
                body += ["", line.strip()]
            continue
        if state == "rows" and line.startswith("|"):
            body.append(line)
            continue
        if line.strip():
            if state == "rows" or (body and not body[-1].startswith("- ")):
                body.append("")
            body.append(f"- {line.strip()}")
        state = "free"
    return out


TITLE = "# Benchmark results"
WRITTEN_BY = "Written by `python -m bench.results`"


def is_results_file(path: Path) -> bool:
    """Whether ``path`` starts as ``render`` writes (what ``--out`` may replace without ``--force``)."""
    head = f"{TITLE}\n\n{WRITTEN_BY}"
    with path.open("rb") as f:
        return f.read(len(head)).decode("utf-8", "replace") == head


def render(log: str, *, commit: str | None, device: str, when: datetime, python: str | None = None) -> str:
    lines = [
        TITLE,
        "",
        f"{WRITTEN_BY} from the last `make bench` log; do not edit by hand.",
        "",
        f"- machine: {device}",
        f"- commit: {commit or 'unknown (not a git checkout; pass --commit)'}",
        f"- date: {when.strftime('%Y-%m-%d %H:%M UTC')}",
        *([f"- Python {python}"] if python else []),
    ]
    for name, body in sections(log):
        lines += ["", f"## {name}", *body]
    return "\n".join(lines).rstrip() + "\n"


def make_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(
        prog="python -m bench.results", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "log",
        type=Path,
        help="the output of `make bench` (gpu-check: $(LOG_DIR)/bench.log); refused without a `== bench.<name>` line",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "bench" / "RESULTS.md",
        help="where to write (default: bench/RESULTS.md); an existing file is replaced only if this tool wrote it",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace the --out file even if this tool did not write it"
    )
    parser.add_argument(
        "--commit", type=nonempty, help="the commit the benchmarks ran on (default: this checkout's HEAD)"
    )
    parser.add_argument(
        "--device",
        type=nonempty,
        help="the machine line, where the log is rendered off the machine that ran it "
        "(default: asked of this machine's driver)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    out = args.out
    if not args.log.is_file():
        parser.error(f"no benchmark log at {args.log}")
    try:
        log = args.log.read_text(errors="replace")
        foreign = out.is_file() and not args.force and not is_results_file(out)
    except OSError as exc:
        parser.error(f"{exc.filename}: {exc.strerror or exc}")
    if not any(line.startswith("== bench.") for line in log.splitlines()):
        parser.error(f"{args.log}: not a benchmark log (no `== bench.<name>` line: the output of `make bench`)")
    if out.exists() and not out.is_file():
        parser.error(f"--out {out}: not a file")
    if foreign:
        parser.error(f"--out {out}: not a file bench.results wrote; --force replaces it")
    text = render(
        log,
        commit=args.commit or git_commit(),
        device=args.device or device_line(),
        when=datetime.now(UTC),
        python=None if args.device else platform.python_version(),  # off the machine: not its Python
    )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as exc:
        parser.error(f"--out {out}: {exc.strerror or exc}")
    print(f"bench.results: wrote {out} ({text.count(chr(10))} lines)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
