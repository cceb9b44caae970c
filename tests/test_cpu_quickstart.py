"""The README's CPU quickstart, ``examples/cpu_reference.py``: a tiny LongCat-shaped model folder
opened with ``NgramCheckpoint`` and run through the numpy references of the layer and of a LoRA
token overlay, no GPU.

- The example, run from another directory on the working tree's packages (not an older install),
  prints each result's shape
  and the exact CRC32 of its bytes for the default seed (``EXPECTED``).
- With every CUDA driver and NVRTC function of ``cuda.bindings`` replaced by a recorder, and
  ``CUDA_VISIBLE_DEVICES=``, it prints the same and calls none of them: nothing on the CPU path
  initialises the driver or compiles a kernel (the kernel cache directory is never made).
- ``--help`` is complete; ``--save-model`` / ``--model-dir`` read back the same numbers; a
  missing folder is a usage error naming it.
- Its tiny model is the checkpoint tests' fixture shape (``tiny_config``, the published names)
  and ``NgramWeights.from_pretrained`` loads it to the bytes ``from_numpy`` gives.
- It imports only the standard library, numpy / ml_dtypes and public names (the rule of
  ``tests/test_serve_loop.py``, with ``layers.reference`` and ``layers.safetensors_io`` allowed).
- The README's quickstart commands, parsed from its section, run as written in a copy of the
  checkout and a new virtual environment, and print the output the README shows.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from layers.ngram_embed import NgramCheckpoint, NgramWeights
from tests.helpers.checkpoint import PROJ, SCALE, TABLE, WORD, layer_bytes, make_model, tiny_config, write_model
from tests.helpers.examples import assert_public_imports
from tests.helpers.logging_backend import LoggingBackend
from tests.helpers.readme import readme_block

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cpu_reference.py"
SECTION = "## Quickstart without a GPU"
# the example's output for its defaults (seed 0, 16 tokens, the tiny model it writes)
EXPECTED = [
    "model    temporary tiny folder (seed 0): V=300 D=24 N=3 K=2 eos=2, T=4 tables: bf16, fp8, bf16, fp8",
    "context  18 tokens (seed 0), the last 16 embedded",
    "ngram_embed        shape (16, 24)   bfloat16  crc32 5a4b81f5  the seed's path: T + 1 bf16 roundings",
    "ngram_embed_fused  shape (16, 24)   bfloat16  crc32 990ba8e4  fused path and decoder: one rounding",
    "                   187 of 384 elements differ between the two (their roundings)",
    "embed overlay      shape (16, 24)   bfloat16  crc32 b367ad4a  6 of 16 rows replaced by the adapter",
    "lm_head overlay    shape (16, 300)  bfloat16  crc32 eebd4c5b  8 of 300 logits per row recomputed",
]
BEYOND_THE_FACE = {"layers.reference", "layers.safetensors_io"}  # modules without __all__, public names

# Run as ``python -c GUARD EXAMPLE ARGS...``: every driver (cu*) and NVRTC (nvrtc*) function of
# cuda.bindings is replaced by a recorder before the example imports anything; the run fails if
# any was called (gpu_runtime turns a failing cuInit into NoDeviceError, so raising is not enough).
GUARD = """
import os, runpy, sys
from cuda.bindings import driver, nvrtc
calls = []
def recorder(name):
    def record(*args, **kwargs):
        calls.append(name)
        raise RuntimeError(name + " called on the CPU path")
    return record
for module, prefix in ((driver, "cu"), (nvrtc, "nvrtc")):
    for name in dir(module):
        if name.startswith(prefix) and callable(getattr(module, name)):
            setattr(module, name, recorder(name))
path = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(path)  # as `python path` has it: the example's folder first
try:
    runpy.run_path(path, run_name="__main__")
except SystemExit as exc:
    if exc.code:
        raise
if calls:
    sys.exit("driver or NVRTC calls: " + ", ".join(calls))
"""


def _env(tmp_path: Path) -> dict[str, str]:
    """No visible GPU, an empty kernel cache path, and the working tree's packages first on the
    path (an installed copy may be older than the tree under test)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "GPU_RUNTIME_CACHE_DIR": str(tmp_path / "kernel-cache")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _registry_reachable(tmp_path: Path) -> bool:
    """Whether pip can fetch the build backend (``hatchling``, from ``pyproject.toml``) from the
    configured package registry: one attempt, no retries, 20 s at most."""
    probe = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--retries", "0", "--timeout", "10",
             "--dest", str(tmp_path / "probe"), "hatchling>=1.24"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _run(tmp_path: Path, *args: str, guard: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", GUARD, str(EXAMPLE)] if guard else [sys.executable, str(EXAMPLE)]
    cwd = tmp_path / "elsewhere"
    cwd.mkdir(exist_ok=True)
    return subprocess.run(
        command + list(args), cwd=cwd, env=_env(tmp_path), capture_output=True, text=True, timeout=300
    )


def _example(monkeypatch: pytest.MonkeyPatch):
    """``examples/cpu_reference.py`` loaded by path, its folder on the path (as when run)."""
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("cpu_reference", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _readme_block(kind: str) -> list[str]:
    """The lines of the section's first ```kind block."""
    return readme_block(SECTION, kind).splitlines()


def _readme_commands() -> list[str]:
    """The quickstart's commands: the bash block's lines, comments and blank lines dropped."""
    commands = [line.split("#", 1)[0].strip() for line in _readme_block("bash")]
    return [c for c in commands if c]


# -- the example ---------------------------------------------------------------------------------
def test_example_prints_shapes_and_exact_checksums(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == EXPECTED
    assert not (tmp_path / "kernel-cache").exists()


def test_cpu_path_calls_no_driver_or_nvrtc_function(tmp_path):
    done = _run(tmp_path, guard=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == EXPECTED
    assert not (tmp_path / "kernel-cache").exists(), "something compiled a kernel"


def test_help_is_complete(tmp_path):
    done = _run(tmp_path, "--help")
    assert done.returncode == 0, done.stderr
    for option in ("--model-dir DIR", "--save-model DIR", "--seed SEED", "--tokens TOKENS"):
        assert option in done.stdout
    # the whole module docstring, up to its last line, and the epilog about the output
    assert "then ``python3 examples/cpu_reference.py``" in done.stdout
    assert "CRC32" in done.stdout and "make kernels" in done.stdout


def test_saved_model_reads_back_with_the_same_numbers(tmp_path):
    folder = tmp_path / "tiny"
    saved = _run(tmp_path, "--save-model", str(folder))
    assert saved.returncode == 0, saved.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    read = _run(tmp_path, "--model-dir", str(folder))
    assert read.returncode == 0, read.stderr
    for done in (saved, read):
        lines = done.stdout.splitlines()
        assert lines[0].startswith(f"model    {folder}") and lines[0].endswith(EXPECTED[0].split(":", 1)[1])
        assert lines[1:] == EXPECTED[1:]
    other = _run(tmp_path, "--model-dir", str(folder), "--seed", "1", "--tokens", "5")
    assert other.returncode == 0, other.stderr
    assert "shape (5, 24)" in other.stdout and "shape (5, 300)" in other.stdout


def test_save_model_accepts_an_existing_empty_folder(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    done = _run(tmp_path, "--save-model", str(folder))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1:] == EXPECTED[1:]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]


def test_force_replaces_a_sharded_model_and_keeps_other_files(tmp_path, rng):
    """``--save-model DIR --force`` over a sharded model (its shards and index, another model's
    weights): the old model goes whole (left beside the new file, its shards and index could be
    read by a loader that globs ``*.safetensors`` or reads the index), the new one reads back;
    a file of the user's stays."""
    folder = write_model(tmp_path / "model", make_model(rng), layout="sharded").path
    (folder / "notes.txt").write_text("mine")
    done = _run(tmp_path, "--save-model", str(folder), "--force")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert (folder / "notes.txt").read_text() == "mine"
    read = _run(tmp_path, "--model-dir", str(folder))
    for run in (done, read):
        assert run.returncode == 0 and run.stdout.splitlines()[1:] == EXPECTED[1:], run.stderr


@pytest.mark.parametrize("where", ["under-a-file", "/proc/nope"])
def test_a_save_model_folder_that_cannot_be_written_is_one_usage_error(tmp_path, where):
    """The folder's parent a file, or a place nothing can be made (issue 49: a FileNotFoundError
    traceback): one line naming the folder, status 2, as the tool's other refusals."""
    (tmp_path / "a-file").write_text("mine")
    folder = tmp_path / "a-file" / "model" if where == "under-a-file" else Path(where)
    if where.startswith("/proc") and not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    done = _run(tmp_path, "--save-model", str(folder))
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith(f"cpu_reference.py: error: --save-model {folder}: cannot write the model there (")
    assert done.stderr.count("\n") == 1 and (tmp_path / "a-file").read_text() == "mine"


def test_bad_arguments_are_usage_errors(tmp_path):
    missing = tmp_path / "no-such-model"
    done = _run(tmp_path, "--model-dir", str(missing))
    assert done.returncode == 2 and str(missing) in done.stderr and not done.stdout
    assert "Traceback" not in done.stderr
    # an empty folder path was Path('.'): --save-model '' wrote the model into the current directory
    for args in (["--tokens", "0"], ["--seed", "-1"], ["--model-dir", "a", "--save-model", "b"], ["--save-model", ""],
                 ["--model-dir", ""]):
        done = _run(tmp_path, *args)  # one line: "cpu_reference.py: error: ..." (issue 44)
        assert done.returncode == 2 and done.stderr.startswith("cpu_reference.py: error: "), args
        assert done.stderr.count("\n") == 1, args
    assert not any((tmp_path / "elsewhere").iterdir()), "written into the current directory"


def test_tiny_model_is_the_checkpoint_fixtures_shape_and_loads(tmp_path, monkeypatch):
    example = _example(monkeypatch)
    assert example.TINY_CONFIG == tiny_config()
    assert (example.WORD, example.TABLE, example.SCALE, example.PROJ) == (WORD, TABLE, SCALE, PROJ)
    folder = example.write_tiny_model(tmp_path / "tiny", seed=0)
    ckpt = NgramCheckpoint.open(folder)
    t = ckpt.dims.num_tables()
    tables = [ckpt.table_arrays(c) for c in range(t)]
    assert [scale is not None for _, scale in tables] == [False, True, False, True]
    gpu, ref_gpu = LoggingBackend(), LoggingBackend()
    host_tables = [table if scale is None else (table, scale) for table, scale in tables]  # from_numpy's form
    projs = [ckpt.proj_array(c) for c in range(t)]
    with NgramWeights.from_pretrained(folder, gpu) as weights, NgramWeights.from_numpy(
        ckpt.dims, np.array(ckpt.word_array()), host_tables, projs, ref_gpu
    ) as ref:
        assert weights.dims == ckpt.dims
        assert layer_bytes(gpu, weights) == layer_bytes(ref_gpu, ref)
    # the same seed writes the same bytes
    again = example.write_tiny_model(tmp_path / "again", seed=0)
    for name in ("config.json", "model.safetensors"):
        assert (folder / name).read_bytes() == (again / name).read_bytes()


def test_example_imports_public_names_only():
    """The examples' rule (``tests.helpers.examples``), with the two modules it reads beyond the
    public face: the numpy references and the safetensors writer."""
    assert_public_imports(EXAMPLE, BEYOND_THE_FACE)


# -- the README --------------------------------------------------------------------------------------
def test_the_example_runs_on_the_working_tree(tmp_path):
    """What the example imports is this checkout's code, whatever ``pip install .`` put in
    site-packages earlier."""
    probe = "import gpu_runtime, layers, layers.reference; print(gpu_runtime.__file__); print(layers.__file__)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert [Path(line).resolve().parents[1] for line in done.stdout.splitlines()] == [ROOT, ROOT]


def test_readme_shows_the_examples_output():
    assert _readme_block("text") == EXPECTED


def test_readme_quickstart_runs_as_written_from_a_fresh_copy(tmp_path):
    """The README's quickstart, as written, in one shell in a copy of the checkout (what git
    tracks or would track: no build outputs, no virtual environments), no GPU visible and no
    kernel cache: three commands (the first makes and enters the virtual environment), no
    ``make``, and the last prints the README's output."""
    commands = _readme_commands()
    assert len(commands) == 3 and commands[0].startswith("python3 -m venv "), commands
    assert not any(c.startswith("make") for c in commands), commands
    if not _registry_reachable(tmp_path):
        pytest.skip("no package registry reachable: the README's `pip install .` fetches its build backend from one")
    clone = tmp_path / "clone"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True,
    )
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.split("\0")):
            source = ROOT / name
            if source.is_file():  # a tracked file deleted in the work tree is not copied
                (clone / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, clone / name)
    else:  # not a git checkout: the tree without what .gitignore names
        ignore = shutil.ignore_patterns(".git", ".ci/venv", "venv", ".venv", "__pycache__", "*.egg-info", "build",
                                        "dist", ".logs", ".pytest_cache", ".mypy_cache", ".ruff_cache")
        shutil.copytree(ROOT, clone, ignore=ignore)
    env = _env(tmp_path)
    env.pop("PYTHONPATH", None)  # the new environment's install only
    env.pop("VIRTUAL_ENV", None)
    marker = "---- output of the last command ----"
    script = "\n".join(["set -e", *commands[:-1], f"echo '{marker}'", commands[-1]])
    done = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{script}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert (clone / ".venv" / "bin" / "python3").exists()
    assert done.stdout.split(marker + "\n", 1)[1].splitlines() == EXPECTED
    assert not (tmp_path / "kernel-cache").exists()


def test_git_ignores_the_readme_venv_and_top_level_build_outputs_only(tmp_path):
    """The README makes its virtual environment inside the checkout (``.venv``): git must ignore
    it, or the quickstart's fresh copy (what git tracks or would track) takes the venv along,
    and a folder named ``build`` deep inside it (pip's own) is dropped and pip breaks. ``build/``
    and ``dist/`` are ignored at the top only. The project's ``.gitignore`` is read alone, at the
    top of a new repository (no global excludes): vendored inside another repository, as an
    engine embeds it, that repository's rules would apply here too."""
    if shutil.which("git") is None or not (ROOT / ".gitignore").is_file():
        pytest.skip("needs git and the project's .gitignore (a git checkout or a copy of one)")
    names = [".venv/bin/python3", ".venv/lib/python3.11/site-packages/pip/_internal/operations/build/x.py",
             "venv/bin/python3", "build/lib/x.py", "dist/x.whl", "layers/build/x.py", "docs/dist/x.md"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    shutil.copy(ROOT / ".gitignore", tmp_path / ".gitignore")
    done = subprocess.run(["git", "-c", "core.excludesFile=", "check-ignore", "--no-index", *names], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr
    assert done.stdout.split() == names[:5]
