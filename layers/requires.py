"""A missing package in one line, for the command-line tools: ``with installed(prog):`` around a
tool's imports turns a ``ModuleNotFoundError`` for a package the project needs into one line on
stderr, ``<prog>: needs the Python package <distribution>, not installed for <python>: <how>``,
and exit status 1. Any other error passes through. Standard library only (as is ``import
layers``), so a tool imports it before anything that may be missing; library code never uses
it: its imports raise ``ImportError`` as any library's do.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

PROJECT = "metrale-gpu (this project)"
# a missing module (a top-level package, or a subpackage of the namespace package ``cuda``) ->
# the distribution that installs it
DISTRIBUTIONS = {
    "cuda": "cuda-bindings",
    "cuda.bindings": "cuda-bindings",
    "cuda.pathfinder": "cuda-pathfinder",
    "numpy": "numpy",
    "ml_dtypes": "ml_dtypes",
    "safetensors": "safetensors",
    "gpu_runtime": PROJECT,
    "layers": PROJECT,
}
HOW = "activate the project's virtual environment (. .venv/bin/activate) or python3 -m pip install ."


def distribution(module: str | None) -> str | None:
    """The distribution that installs ``module`` (a ``ModuleNotFoundError``'s ``name``), or None
    for a module the project does not need."""
    parts = (module or "").split(".")
    return DISTRIBUTIONS.get(".".join(parts[:2])) or DISTRIBUTIONS.get(parts[0])


def missing_line(prog: str, wanted: str) -> str:
    """The line a tool ends with when the distribution ``wanted`` is not installed."""
    return f"{prog}: needs the Python package {wanted}, not installed for {sys.executable}: {HOW}"


@contextmanager
def installed(prog: str) -> Iterator[None]:
    """Inside: a ``ModuleNotFoundError`` for a package of ``DISTRIBUTIONS`` ends the process with
    ``missing_line`` (status 1); any other exception passes through."""
    try:
        yield
    except ModuleNotFoundError as exc:
        wanted = distribution(exc.name)
        if wanted is None:
            raise
        raise SystemExit(missing_line(prog, wanted)) from None
