"""The command-line tools (CPU): ``make kernels`` is incremental, and every ``python -m`` tool has
a complete ``--help`` that needs neither a GPU nor torch."""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import runpy
import shutil
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import gpu_runtime
from bench import common as bench_common
from gpu_runtime import cli, compiler, device_count, precompile

ROOT = Path(__file__).resolve().parent.parent


# -- make kernels: incremental ----------------------------------------------------------------
@pytest.fixture
def kernels(tmp_path, monkeypatch) -> Path:
    """Three modules and their headers: a.cu and c.cu include a.cuh, b.cu includes b.cuh, which
    includes common.cuh; a fresh cache."""
    monkeypatch.setenv("GPU_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "kernels"
    src.mkdir()
    (src / "a.cuh").write_text("#define A 1\n")
    (src / "common.cuh").write_text("#define C 3\n")
    (src / "b.cuh").write_text('#include "common.cuh"\n#define B (2 + C)\n')
    for name, header, value in (("a", "a.cuh", "A"), ("b", "b.cuh", "B"), ("c", "a.cuh", "A + 1")):
        (src / f"{name}.cu").write_text(
            f'#include "{header}"\nextern "C" __global__ void k_{name}(float* x) {{ x[0] += {value}; }}\n'
        )
    return src


@pytest.fixture
def nvrtc_runs(monkeypatch) -> list[str]:
    """The modules NVRTC compiles, in order (the real compiler runs)."""
    runs: list[str] = []
    real = compiler._nvrtc_compile

    def counted(source, name, target, options):
        runs.append(Path(name).stem)
        return real(source, name, target, options)

    monkeypatch.setattr(compiler, "_nvrtc_compile", counted)
    return runs


def build(kernels: Path, runs: list[str], capsys, *args: str, arch: str = "compute_90") -> tuple[int, set, str]:
    """One precompile run over ``kernels``: (exit status, modules NVRTC compiled, output)."""
    runs.clear()
    rc = precompile.main(["--arch", arch, *args, *map(str, sorted(kernels.glob("*.cu")))])
    out = capsys.readouterr()
    return rc, set(runs), out.out + out.err


def test_second_run_compiles_nothing(kernels, nvrtc_runs, capsys):
    rc, built, out = build(kernels, nvrtc_runs, capsys)
    assert rc == 0 and built == {"a", "b", "c"}
    assert "ok   a " in out and "3 compiled, 0 up to date" in out
    rc, built, out = build(kernels, nvrtc_runs, capsys)
    assert rc == 0 and built == set()
    assert "ok " not in out and "3 kernel modules up to date for compute_90 (nothing compiled" in out
    rc, built, out = build(kernels, nvrtc_runs, capsys, "-v")
    assert built == set() and "up to date b" in out
    rc, built, out = build(kernels, nvrtc_runs, capsys, "--force")
    assert rc == 0 and built == {"a", "b", "c"}


def test_a_changed_header_rebuilds_exactly_its_dependents(kernels, nvrtc_runs, capsys):
    build(kernels, nvrtc_runs, capsys)
    (kernels / "a.cuh").write_text("#define A 5\n")
    assert build(kernels, nvrtc_runs, capsys)[1] == {"a", "c"}
    (kernels / "common.cuh").write_text("#define C 4\n")  # included by b.cuh, not by b.cu
    assert build(kernels, nvrtc_runs, capsys)[1] == {"b"}
    (kernels / "c.cu").write_text((kernels / "c.cu").read_text() + "// edited\n")
    assert build(kernels, nvrtc_runs, capsys)[1] == {"c"}
    os.utime(kernels / "a.cuh")  # a new mtime, the same bytes: the key is the content
    assert build(kernels, nvrtc_runs, capsys)[1] == set()


def test_a_changed_target_options_or_nvrtc_rebuilds_every_module(kernels, nvrtc_runs, capsys, monkeypatch):
    build(kernels, nvrtc_runs, capsys)
    assert build(kernels, nvrtc_runs, capsys, arch="compute_80")[1] == {"a", "b", "c"}
    assert build(kernels, nvrtc_runs, capsys, arch="compute_80")[1] == set()
    assert build(kernels, nvrtc_runs, capsys)[1] == set()  # each target's build is remembered
    monkeypatch.setattr(compiler, "BASE_OPTIONS", (*compiler.BASE_OPTIONS, "-DEXTRA=1"))
    assert build(kernels, nvrtc_runs, capsys)[1] == {"a", "b", "c"}
    major, minor = compiler.nvrtc_version()
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: (major, minor + 1))
    assert build(kernels, nvrtc_runs, capsys)[1] == {"a", "b", "c"}


def test_a_missing_or_damaged_image_is_rebuilt(kernels, nvrtc_runs, capsys):
    build(kernels, nvrtc_runs, capsys)
    cache = Path(os.environ["GPU_RUNTIME_CACHE_DIR"])
    (entry_a,) = cache.glob("a-compute_90-*.bin")
    (entry_b,) = cache.glob("b-compute_90-*.bin")
    entry_a.unlink()
    entry_b.write_bytes(entry_b.read_bytes()[:-1])
    assert build(kernels, nvrtc_runs, capsys)[1] == {"a", "b"}
    (cache / precompile.MANIFEST).write_text("not json")
    assert build(kernels, nvrtc_runs, capsys)[1] == {"a", "b", "c"}


@pytest.mark.parametrize(
    "body, says, rebuilt",
    [
        ('extern "C" __global__ void k_b(float* x) { x[0] = undefined_name; }\n', "undefined_name", set()),
        # a warning evicts the module's images (the runtime must not load it): the good one comes back
        ('extern "C" __global__ void k_b(float* x) { int unused = 1; x[0] = 0; }\n', "warnings are errors here", {"b"}),
    ],
    ids=["error", "warning"],
)
def test_an_error_or_warning_fails_every_run_until_fixed(kernels, nvrtc_runs, capsys, body, says, rebuilt):
    build(kernels, nvrtc_runs, capsys)
    good = (kernels / "b.cu").read_text()
    (kernels / "b.cu").write_text(body)
    for _ in range(2):  # never recorded as built: the second run compiles (and fails) again
        rc, built, out = build(kernels, nvrtc_runs, capsys)
        assert rc == 1 and built == {"b"}
        assert "FAIL b" in out and says in out and "1 failed" in out
    (kernels / "b.cu").write_text(good)
    rc, built, out = build(kernels, nvrtc_runs, capsys)
    assert rc == 0 and built == rebuilt and "FAIL" not in out  # the good source's build is still on record


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_kernels_twice_without_a_gpu(kernels, tmp_path):
    """What CI runs: ``make kernels`` (no ARCH) with no device visible: PTX for compute_90, and
    the second run compiles nothing."""
    env = dict(os.environ, GPU_RUNTIME_KERNEL_DIR=str(kernels), CUDA_VISIBLE_DEVICES="")
    runs = [
        subprocess.run(["make", "--no-print-directory", "kernels", f"PYTHON={sys.executable}"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
        for _ in range(2)
    ]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr
    assert "ok   a                    compute_90" in runs[0].stdout
    assert "ok " not in runs[1].stdout
    assert "3 kernel modules up to date for compute_90" in runs[1].stdout


# -- --help of every python -m tool -------------------------------------------------------------
TOOLS = [
    "layers.precompile",
    "gpu_runtime.precompile",
    *(f"bench.{name}" for name in
      ("launch", "kernels", "overlay", "ngram_embed", "cached", "decode", "host_gather", "host_pages", "host_staging",
       "tensor_parallel", "gemm", "results", "row_reads", "real_scale", "engram", "engram_gemm", "engram_cache")),
    "tests.sanitize",
    "tests.bad_inputs",
]
CPU_BENCHES = ("bench.engram_cache",)  # need no GPU: run here, on a small table


def _module(tool: str):
    return importlib.import_module("tests.bad_inputs.__main__" if tool == "tests.bad_inputs" else tool)


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every tool's ``--help``, run at once, with no device visible and torch and CuPy made
    unimportable (a module of each name that raises ImportError, first on the path)."""
    blocked = tmp_path_factory.mktemp("no_torch")
    for name in ("torch", "cupy"):
        (blocked / f"{name}.py").write_text(f"raise ImportError('{name} is blocked in this test')\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join([str(blocked), str(ROOT)]))

    def run(tool: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", tool, "--help"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)

    with ThreadPoolExecutor(8) as pool:
        return dict(zip(TOOLS, pool.map(run, TOOLS)))


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("tool", TOOLS)
def test_help_is_complete_and_needs_no_gpu_or_torch(helps, tool):
    run = helps[tool]
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"usage: python -m {tool} ")
    mod = _module(tool)
    assert _flat(mod.__doc__) in _flat(run.stdout), "the description is cut: --help holds the whole docstring"
    parser = precompile.make_parser() if tool == "layers.precompile" else getattr(mod, "make_parser", lambda: None)()
    for action in parser._actions if parser is not None else []:
        for option in action.option_strings:
            assert option in run.stdout, f"{tool} --help does not mention {option}"
        assert action.help, f"{tool}: {action.option_strings or action.dest} has no help text"
    if tool.startswith("bench.") and tool != "bench.results":  # results writes the tables, it prints none
        assert "## title" in run.stdout, "a benchmark's help says how its tables read"


def test_every_runnable_bench_module_is_listed():
    """A new benchmark gets a --help test (bench.common and bench.decode_serving are no tools)."""
    runnable = {p.stem for p in (ROOT / "bench").glob("*.py") if "\ndef make_parser(" in p.read_text()}
    assert {f"bench.{name}" for name in runnable} == {t for t in TOOLS if t.startswith("bench.")}
    assert set(_makefile_benches()) <= runnable


def _makefile_benches() -> list[str]:
    makefile = (ROOT / "Makefile").read_text()
    return next(line for line in makefile.splitlines() if line.startswith("BENCHES ?=")).split("=", 1)[1].split()


@pytest.mark.parametrize("doc", ["docs/INSTALL.md", "docs/GPU_CHECKS.md"])
def test_the_docs_list_the_makefiles_benchmarks(doc):
    """``make bench BENCHES=<name>  # one of: ...``: the names the Makefile runs, in its order."""
    (line,) = [line for line in (ROOT / doc).read_text().splitlines() if "make bench BENCHES=" in line]
    assert line.split("# one of:", 1)[1].split() == _makefile_benches()


@pytest.mark.parametrize("module", sorted({p.stem for p in (ROOT / "bench").glob("*.py")} - {"__init__"}
                                          - {t.removeprefix("bench.") for t in TOOLS}))
def test_a_bench_library_module_says_it_is_no_tool(module):
    """``python -m bench.decode_serving --help`` printed nothing, status 0: a module that only
    serves the benchmarks says so in one line, status 2, and what to run instead."""
    done = _run(["-m", f"bench.{module}", "--help"])
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"python -m bench.{module}: error: not a tool: ")
    assert "python -m bench." in done.stderr.split("not a tool: ", 1)[1]


def test_every_bench_table_has_a_header_line():
    """Each ``print_table`` call passes ``note=``: the line above the table saying what its rows
    and columns are (the keyword is required, but a GPU run is what would find a missing one)."""
    calls = 0
    for path in (ROOT / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print_table":
                calls += 1
                note = next((k.value for k in node.keywords if k.arg == "note"), None)
                assert note is not None, f"{path.name}:{node.lineno}: print_table without note="
    assert calls >= 19


@pytest.mark.parametrize("arch", ["bogus", "sm90", "sm_9x", "compute_", "sm_90b", "sm_100af"])
def test_a_bad_target_is_one_usage_error(arch, capsys):
    assert precompile.main(["--arch", arch, str(ROOT / "kernels" / "residual_add.cu")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--arch {arch}: not sm_XX[a|f] or compute_XX[a|f]" in err


@pytest.mark.parametrize("args, env, says", [
    (["missing.cu"], {}, "error: missing.cu: no such file, not a .cu file"),
    (["kernels"], {}, "error: kernels: a folder, not a .cu file"),
    ([], {"GPU_RUNTIME_KERNEL_DIR": "/nowhere"}, "error: no .cu files in /nowhere ($GPU_RUNTIME_KERNEL_DIR)"),
])
def test_make_kernels_refuses_what_it_cannot_compile_in_one_line(args, env, says):
    """A missing file, a folder, or a kernel directory (named by the variable) with no sources:
    one line on stderr, exit status 2, nothing compiled (issue 44: a 15-line traceback before)."""
    done = subprocess.run([sys.executable, "-m", "layers.precompile", *args], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT), **env), timeout=120)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"python -m layers.precompile: {says}\n"


def test_sanitize_without_compute_sanitizer_says_so(monkeypatch, capsys):
    from tests import sanitize

    monkeypatch.setattr(sanitize.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as exit_:
        sanitize.main(["--tools", "memcheck"])
    assert exit_.value.code == 2 and "compute-sanitizer is not on PATH" in capsys.readouterr().err


# -- usage errors and missing GPUs: one line each (issue 44) ------------------------------------
def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", **env))


@pytest.mark.parametrize("argv, says", [
    (["examples/greedy_decode.py", "--bogus"], "greedy_decode.py: error: unrecognized arguments: --bogus"),
    (["examples/serve_loop.py", "--bogus"], "serve_loop.py: error: unrecognized arguments: --bogus"),
    (["examples/serve_loop.py", "--steps", "0"], "serve_loop.py: error: --steps must be >= 1 and --seed >= 0"),
    (["examples/cpu_reference.py", "--bogus"], "cpu_reference.py: error: unrecognized arguments: --bogus"),
    (["examples/cpu_reference.py", "--force"], "cpu_reference.py: error: --force goes with --save-model"),
    (["-m", "bench.launch", "--bogus"], "python -m bench.launch: error: unrecognized arguments: --bogus"),
    (["-m", "layers.ngram_embed.convert"],
     "python -m layers.ngram_embed.convert: error: the following arguments are required: MODEL_DIR, OUT_DIR"),
    (["-m", "tests.sanitize", "--tools", "bogus"], "python -m tests.sanitize: error: argument --tools: invalid choice"),
    # issue 49: ValueError tracebacks (status 1), and the GPU check does not come first
    (["-m", "bench.gemm", "--shape", "banana"], "python -m bench.gemm: error: argument --shape: not MxNxK"),
    (["-m", "bench.gemm", "--sweep", "12"], "python -m bench.gemm: error: argument --sweep: not NxK"),
    (["-m", "bench.gemm", "--path", "simt"], "python -m bench.gemm: error: --path goes with --shape"),
    (["-m", "bench.gemm", "--shape", "1x2x3", "--sweep", "4x8"],
     "python -m bench.gemm: error: argument --sweep: not allowed with argument --shape"),
    (["-m", "bench.decode", "--placements", "cpu"], "python -m bench.decode: error: argument --placements: takes some"),
])
def test_a_usage_error_is_one_line_and_status_2(argv, says):
    done = _run(argv)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(says), done.stderr


# -- every option of every benchmark and example, given a bad value (issue 49) ---------------------
EXAMPLES = sorted(f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
BAD_VALUES = ("", "banana", "-1", "0", "nan")  # each option is given each, but those ACCEPTED
ANY_TEXT = {"banana", "-1", "0", "nan"}  # a path or a name: only '' is wrong
ACCEPTED = {
    ("bench.cached", "--table-dir"): ANY_TEXT,
    ("bench.results", "--out"): ANY_TEXT,
    ("bench.results", "--commit"): ANY_TEXT,
    ("bench.results", "--device"): ANY_TEXT,
    ("examples/cpu_reference.py", "--save-model"): ANY_TEXT,
    ("examples/cpu_reference.py", "--seed"): {"0"},
    ("examples/serve_loop.py", "--seed"): {"0"},
    ("examples/engram_serve_loop.py", "--seed"): {"0"},
}
MORE_BAD = {  # values of the form an option takes, wrong all the same
    ("bench.gemm", "--shape"): ("12", "1x2", "1x0x8", "1x2x3x4", "-1x2x3"),
    ("bench.gemm", "--sweep"): ("12", "1x2x3", "0x8"),
    ("bench.gemm", "--sweep-wide"): ("12", "1x2x3"),
    ("bench.decode", "--placements"): (",", "device,cpu"),
    ("bench.engram", "--placements"): (",", "host,cpu"),
    ("bench.engram", "--rows"): ("1.5", "1e9"),
    ("bench.host_pages", "--ways"): (",", "hostalloc,bogus"),
    ("bench.host_gather", "--gib"): ("inf", "-inf"),
    ("bench.host_staging", "--gib"): ("inf", "0"),
    ("bench.row_reads", "--ncu"): ("1.5",),
    ("bench.results", "log"): ("README.md", "bench/RESULTS.md", "bench"),
}


class _Parser(Exception):
    """Raised by parse_args with the parser, to read a tool's parser where its main builds it."""


def _run_in_process(tool: str, argv: list[str]) -> int | str | None:
    """``tool argv`` as its ``__main__`` runs it: the exit status (an exception's name where one
    escaped). Run in this process (its modules are imported once) with the GPU check standing in
    for a missing GPU, so that nothing a test passes can reach the device."""
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before
        mp.setattr(sys, "argv", [tool, *argv])
        mp.setattr(bench_common, "require_gpu", lambda prog: sys.exit(f"{prog}: needs a CUDA GPU: (the test's)"))
        mp.setattr(gpu_runtime, "CudaBackend", _no_gpu)  # the examples' GPU: bound when runpy runs them
        try:
            if tool.startswith("bench."):
                runpy.run_module(tool, run_name="__main__")
            else:
                mp.syspath_prepend(str(ROOT / "examples"))  # as `python examples/x.py` has it (_requires.py)
                runpy.run_path(str(ROOT / tool), run_name="__main__")
        except SystemExit as exit_:
            return exit_.code
        except _Parser:
            raise
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return 0


def _no_gpu(*args, **kwargs):
    raise gpu_runtime.NoDeviceError("(the test's)")


def _parser_of(tool: str) -> argparse.ArgumentParser:
    def caught(parser, *args, **kwargs):
        raise _Parser(parser)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli.ArgumentParser, "parse_args", caught)
        try:
            _run_in_process(tool, [])
        except _Parser as found:
            return found.args[0]
    raise AssertionError(f"{tool} parsed no arguments with gpu_runtime.cli.ArgumentParser")


@pytest.mark.parametrize("tool", [t for t in TOOLS if t.startswith("bench.")] + EXAMPLES)
def test_every_option_given_a_bad_value_is_one_line_and_status_2(tool, tmp_path, capsys):
    """Each option of the tool's parser (a new one is covered when it is added): each of
    BAD_VALUES it does not accept, and MORE_BAD, gives ``<prog>: error: ...`` in one line on
    stderr, nothing on stdout, status 2, before any GPU is looked for (none here); a flag given
    a value and an unknown option likewise. ``bench.gemm --shape banana`` was a ValueError
    traceback, status 1."""
    parser = _parser_of(tool)
    log = tmp_path / "bench.log"
    log.write_text("== bench.kernels\nx\n")
    # bench.results writes only into tmp_path, whatever it accepts
    base = [str(log), "--out", str(tmp_path / "R.md"), "--device", "d", "--commit", "c"] if tool == "bench.results" else []
    cases = [base + ["--bogus"]]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[-1] if action.option_strings else action.dest
        bad = [v for v in BAD_VALUES if v not in ACCEPTED.get((tool, name), set())] + list(MORE_BAD.get((tool, name), ()))
        if not action.option_strings:  # a positional: the first of base
            assert base and action is [a for a in parser._actions if not a.option_strings][0], name
            cases += [[v, *base[1:]] for v in bad]
        elif action.nargs == 0:  # a flag
            cases.append(base + [f"{name}=banana"])
        else:
            cases += [base + [f"{name}={v}"] for v in bad]
    wrong = []
    for argv in cases:
        status = _run_in_process(tool, argv)
        out = capsys.readouterr()
        if status != 2 or out.out or out.err.count("\n") != 1 or not out.err.startswith(f"{parser.prog}: error: "):
            wrong.append(f"{tool} {' '.join(map(repr, argv))}: status {status!r}, stderr {out.err[-300:]!r}")
    assert not wrong, "\n".join(wrong)


def test_the_bad_value_tables_name_real_options():
    """ACCEPTED and MORE_BAD name options that exist (a renamed one would silently go untested)."""
    for tool, name in [*ACCEPTED, *MORE_BAD]:
        names = {a.option_strings[-1] if a.option_strings else a.dest for a in _parser_of(tool)._actions}
        assert name in names, (tool, name)


def test_without_a_gpu_every_benchmark_refuses_before_it_writes_anything(tmp_path):
    """``bench.cached`` wrote 8 GB of tables and only then said it needs a GPU. Every benchmark,
    run with no device visible and its temporary, table and kernel-cache folders in an empty one,
    says so in one line (status 1) and leaves the folder empty; writes are capped at 1 MiB
    (``ulimit -f``), so one that starts its work is stopped rather than left to fill the disk."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), TMPDIR=str(scratch),
               BENCH_TABLE_DIR=str(scratch / "tables"), GPU_RUNTIME_CACHE_DIR=str(scratch / "cache"))
    benches = [t for t in TOOLS if t.startswith("bench.") and t not in ("bench.results", *CPU_BENCHES)]

    def run(tool: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", 'ulimit -f 1024 && exec "$@"', "bash", sys.executable, "-m", tool],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    with ThreadPoolExecutor(8) as pool:
        done = dict(zip(benches, pool.map(run, benches)))
    for tool, run_ in done.items():
        assert (run_.returncode, run_.stdout) == (1, ""), (tool, run_.returncode, run_.stderr[-2000:])
        assert run_.stderr.count("\n") == 1 and run_.stderr.startswith(f"python -m {tool}: needs a CUDA GPU: ")
    assert sorted(p.name for p in scratch.iterdir()) == []


def test_the_cpu_benchmarks_run_without_a_gpu():
    done = _run(["-m", "bench.engram_cache", "--rows", "100000", "--tokens", "64", "--batch", "4",
                 "--zipf", "1.1", "--capacity", "5", "50"])
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("|   ")]
    assert len(lines) == 2, done.stdout  # a row per (zipf, capacity)
    assert all(0 <= float(line.split("|")[4]) <= 100 for line in lines), done.stdout


@pytest.mark.parametrize("capacity, rate, read", [(100, 0.5, 1.0), (2, 0.25, 1.5)])
def test_engram_cache_counts_as_row_cache_does(capacity, rate, read):
    """Four steps of two rows; the last two counted. A cache that never evicts: step 3 finds row 2
    and reads 4, step 4 reads 5 once and hits its repeat. Two slots: step 2 evicts 2 (1 is pinned),
    step 3 evicts 1 and 3 and hits nothing."""
    from bench.engram_cache import hit_rate

    rows = np.array([[1, 2], [1, 3], [2, 4], [5, 5]])
    assert hit_rate(rows, capacity, 10) == (rate, read)


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_bench_cached_refuses_to_replace_what_is_no_table_file(kind, tmp_path, rng):
    """``--table-dir``'s ``table_00.bin`` that is not a table file (a user's file, a folder) is
    refused in one line and left as it was (it was rewritten as a table)."""
    from bench.cached import ensure_tables

    mine = tmp_path / "table_00.bin"
    data = rng.bytes(int(rng.integers(1, 4096)))
    mine.mkdir() if kind == "folder" else mine.write_bytes(data)
    with pytest.raises(SystemExit) as exit_:
        ensure_tables(str(tmp_path), rng)
    assert str(mine) in str(exit_.value) and "not a table file, not replaced" in str(exit_.value)
    assert mine.is_dir() if kind == "folder" else mine.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table_00.bin"]


def test_the_examples_answer_help_with_what_they_do():
    for example, words in (("greedy_decode.py", "captured graph"), ("serve_loop.py", "--steps STEPS engine steps")):
        done = _run([f"examples/{example}", "--help"])
        assert done.returncode == 0 and words in _flat(done.stdout), done.stdout


def test_save_model_refuses_a_folder_with_files_or_a_file_unless_forced(tmp_path):
    """``--save-model DIR`` replaced a model folder's files silently, and a file was a traceback."""
    full, file = tmp_path / "model", tmp_path / "file"
    full.mkdir()
    (full / "config.json").write_text("mine")
    file.write_text("mine")
    for target, says in ((full, "the folder is not empty"), (file, "a file is there, not a folder")):
        done = _run(["examples/cpu_reference.py", "--save-model", str(target)])
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    assert (full / "config.json").read_text() == "mine" and file.read_text() == "mine"
    done = _run(["examples/cpu_reference.py", "--save-model", str(full), "--force"])
    assert done.returncode == 0 and (full / "model.safetensors").is_file(), done.stderr
    done = _run(["examples/cpu_reference.py", "--save-model", str(tmp_path / "new")])
    assert done.returncode == 0 and (tmp_path / "new" / "config.json").is_file(), done.stderr


@pytest.mark.skipif(device_count() > 0, reason="a GPU is present: the examples and benchmarks would run")
@pytest.mark.parametrize("argv", [["examples/greedy_decode.py"], ["examples/serve_loop.py", "--steps", "1"],
                                  ["-m", "bench.decode"], ["-m", "bench.kernels"]])
def test_without_a_gpu_the_gpu_tools_say_so_in_one_line(argv):
    done = _run(argv)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.splitlines()[-1]
    assert "needs a CUDA GPU" in last and len(done.stderr.splitlines()) == 1, done.stderr


# -- make kernels' targets; a package missing from the Python that runs a tool (issue 49) ----------
@pytest.mark.parametrize("arch", ["sm_100a", "sm_120", "compute_100", "sm_100f", "compute_120f"])
def test_make_kernels_takes_three_digit_targets(arch, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPU_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    from layers import precompile as layers_precompile

    source = tmp_path / "k.cu"
    source.write_text('extern "C" __global__ void k(float* x) { x[0] += 1; }\n')
    assert layers_precompile.main(["--arch", arch, str(source)]) == 0, capsys.readouterr().err
    assert f"ok   k                    {arch} " in capsys.readouterr().out
    assert len(list((tmp_path / "cache").glob(f"k-{arch}-*.bin"))) == 1


MISSING = "{prog}: needs the Python package {wanted}, not installed for {python}: activate the project's virtual \
environment (. .venv/bin/activate) or python3 -m pip install .\n"


@pytest.mark.parametrize("argv, blocked, prog, wanted", [
    (["-m", "layers.precompile"], "cuda", "python -m layers.precompile", "cuda-bindings"),
    (["-m", "layers.precompile", "--arch", "sm_90a"], "numpy", "python -m layers.precompile", "numpy"),
    (["examples/cpu_reference.py"], "ml_dtypes", "cpu_reference.py", "ml_dtypes"),
    (["examples/cpu_reference.py", "--tokens", "4"], "layers", "cpu_reference.py", "metrale-gpu (this project)"),
    (["examples/greedy_decode.py"], "cuda", "greedy_decode.py", "cuda-bindings"),
    (["examples/serve_loop.py", "--help"], "ml_dtypes", "serve_loop.py", "ml_dtypes"),
    (["examples/serve_loop.py"], "gpu_runtime", "serve_loop.py", "metrale-gpu (this project)"),
])
def test_a_missing_package_is_one_line_naming_what_to_install(argv, blocked, prog, wanted, tmp_path):
    """Run by a Python that cannot import ``blocked`` (a module of that name first on the path
    raises ``ModuleNotFoundError`` as a missing one does): one line on stderr naming the
    distribution to install and how, status 1, no traceback (``layers.requires``,
    ``examples/_requires.py``). A library import still raises."""
    (tmp_path / f"{blocked}.py").write_text(f'raise ModuleNotFoundError("No module named {blocked!r}", name={blocked!r})\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr == MISSING.format(prog=prog, wanted=wanted, python=sys.executable)
    if blocked != "layers":
        library = subprocess.run([sys.executable, "-c", "import layers.ngram_embed"], cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=120)
        assert library.returncode == 1 and "Traceback" in library.stderr
        assert library.stderr.endswith(f"ModuleNotFoundError: No module named {blocked!r}\n"), library.stderr


def test_the_layers_package_imports_with_the_standard_library_only():
    """What lets ``python -m layers.precompile`` reach its guard: ``import layers`` (run first)
    and ``layers.requires`` import no third-party package; ``layers.__version__`` is still
    gpu_runtime's."""
    probe = "import sys, layers, layers.requires; print(*sorted({m.split('.')[0] for m in sys.modules}))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert {"layers", "sys"} <= set(done.stdout.split())
    assert not {"cuda", "numpy", "ml_dtypes", "gpu_runtime"} & set(done.stdout.split()), done.stdout
    import layers

    assert layers.__version__ == gpu_runtime.__version__ and "__version__" in layers.__all__


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_kernels_on_a_python_without_cuda_bindings_says_so_in_one_line(tmp_path):
    (tmp_path / "cuda.py").write_text("raise ModuleNotFoundError(\"No module named 'cuda'\", name='cuda')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(["make", "--no-print-directory", "kernels", f"PYTHON={sys.executable}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    python_says = MISSING.format(prog="python -m layers.precompile", wanted="cuda-bindings", python=sys.executable)
    assert done.stderr.splitlines()[0] == python_says.strip(), done.stderr  # then make's own "Error 1" line
