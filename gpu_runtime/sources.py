"""Which ``.cu`` file a ``kernel(source, name)`` call means.

The runtime compiles the sources it is given: ``source`` is a path (str or PathLike) to a
``.cu`` file. For now a bare module name (no ``/``, no ``.cu``) is also taken and resolved
against the backend's kernel directory, so that callers written before paths keep working;
kernel discovery moves to the layers (``layers/kernels.py``), after which only paths remain.
"""

from __future__ import annotations

import os
from pathlib import Path


def is_module_name(source: str | os.PathLike) -> bool:
    """A bare module name such as ``"residual_add"`` (not a path)."""
    return isinstance(source, str) and "/" not in source and not source.endswith(".cu")


def source_path(source: str | os.PathLike, kernel_dir: Path) -> Path:
    """The file ``source`` names: itself, or ``kernel_dir/<module>.cu`` for a bare name."""
    if is_module_name(source):
        return kernel_dir / f"{source}.cu"
    return Path(source)


def module_of(source: str | os.PathLike) -> str:
    """The module name of a source: the file's stem (``"residual_add"`` for both spellings)."""
    return source if is_module_name(source) else Path(source).stem  # type: ignore[return-value]
