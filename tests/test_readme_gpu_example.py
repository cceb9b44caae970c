"""The README's "On a GPU" example, as written: on the CPU every name it uses is imported or
defined in it and every import exists; on a GPU it runs, after the quickstart's
``examples/cpu_reference.py --save-model tiny-model``, in a fresh interpreter on the working tree,
and its asserts (decoder rows equal to the fused path's, bit for bit) hold."""

from __future__ import annotations

import ast
import builtins
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.readme import readme_block

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## On a GPU"


def _example() -> str:
    return readme_block(SECTION, "python")


def _env() -> dict[str, str]:
    # the kernel cache `make kernels` filled, as a user who followed the README has it (a fresh
    # cache made this test compile every module: 20 s, too slow under a sanitizer)
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_every_name_the_example_uses_is_defined_in_it():
    tree = ast.parse(_example())
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert used - bound == set()


def test_every_name_the_example_imports_exists():
    for node in ast.walk(ast.parse(_example())):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            assert [a.name for a in node.names if not hasattr(module, a.name)] == [], node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)


@pytest.mark.gpu
def test_the_example_runs_as_shown(gpu, tmp_path):
    env = _env()
    save = [sys.executable, str(ROOT / "examples" / "cpu_reference.py"), "--save-model", "tiny-model"]
    done = subprocess.run(save, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, "-c", _example()], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.fullmatch(r"seed vs fused: \d+ of 384 differ\n", done.stdout), done.stdout
