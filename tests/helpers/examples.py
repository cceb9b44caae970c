"""The rule every example follows, as user code does: imports from the standard library, numpy /
ml_dtypes, or names a public package exports (``__all__``), plus public names of the modules a
given example is allowed beyond that face; no ``sys.path`` edits, no ``# noqa: E402``."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from gpu_runtime import dlpack

PUBLIC = {"gpu_runtime", "layers.engram", "layers.ngram_embed", "layers.overlay", "layers.tensor_parallel"}
THIRD_PARTY = {"numpy", "ml_dtypes"}
LOCAL = {"_requires", "_serving"}  # examples/_requires.py, examples/_serving.py: the examples' own helpers


def assert_public_imports(path: Path, beyond: set[str] | frozenset[str] = frozenset()) -> None:
    """``path``'s imports keep to the rule; ``beyond``: modules without ``__all__`` whose public
    names it may import too."""
    name, source = path.name, path.read_text()
    assert "sys.path" not in source and "E402" not in source, name
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                assert root in sys.stdlib_module_names or root in THIRD_PARTY | LOCAL, f"{name}: import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            assert node.level == 0, f"{name}: a relative import"
            if module.split(".")[0] in sys.stdlib_module_names or module in LOCAL:
                continue
            assert module in PUBLIC | beyond, f"{name}: from {module} import ..."
            exported = importlib.import_module(module)
            for alias in node.names:
                if module in PUBLIC:
                    assert alias.name in exported.__all__, f"{name}: {module}.{alias.name} is not exported"
                else:
                    assert not alias.name.startswith("_") and hasattr(exported, alias.name), (module, alias.name)


def load_example(path: Path) -> Any:
    """The example at ``path`` loaded as a module, as ``python examples/x.py`` runs it: its folder
    on the path (``_requires``, ``_serving``), its ``__name__`` not ``"__main__"`` (no command line)."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def assert_loop_report(loop: Any, report: Any, steps: int) -> None:
    """What a serving loop's ``report`` shows after ``steps`` steps of ``loop.run``: no DLPack
    capsule alive, every step run, every fault kind injected, prefix hits, forks and rollbacks,
    padded batches of many ladder sizes."""
    assert dlpack.live_exports() == 0, "DLPack capsules left alive"
    assert report.steps == steps
    assert all(report.faults[kind] >= 1 for kind in loop.FAULTS), report.faults
    assert report.prefix_hits and report.forks and report.rollbacks
    assert len(report.replays) >= (3 if steps < 2000 else 6), "padded batches of many ladder sizes"
