"""Which ``.cu`` file a ``kernel(source, name)`` call means: the runtime compiles the sources it
is given, as paths (str or PathLike). Finding them is the caller's job (the layers' is
``layers.kernel_files``)."""

from __future__ import annotations

import os
from pathlib import Path


def module_of(source: str | os.PathLike) -> str:
    """The module name of a source: the file's stem (``"residual_add"`` for ``.../residual_add.cu``)."""
    return Path(source).stem
