"""The examples' first import (standard library only; ``python examples/x.py`` puts this folder
on the path): ``with installed("x.py"):`` around an example's other imports ends a run on a
Python without a package it needs (numpy, ml_dtypes, cuda-bindings, ... or this project) with
one line naming the package and how to install it, not a traceback: ``layers.requires``, or
where this project itself is not installed for that Python, the same line for it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def installed(prog: str) -> Iterator[None]:
    try:
        from layers import requires
    except ModuleNotFoundError as exc:
        if exc.name != "layers":
            raise
        raise SystemExit(
            f"{prog}: needs the Python package metrale-gpu (this project), not installed for {sys.executable}: "
            "activate the project's virtual environment (. .venv/bin/activate) or python3 -m pip install ."
        ) from None
    with requires.installed(prog):
        yield
