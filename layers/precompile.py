"""``make kernels``: compile every layer kernel module ahead of time with NVRTC.

The runtime's ``gpu_runtime.precompile`` compiles the files it is given; this names the
layers' files (``layers.kernel_files``) when none are given.

    python3 -m layers.precompile [--arch sm_90a|compute_90|...] [files...]
"""

from __future__ import annotations

import sys

from gpu_runtime import precompile

from .kernel_files import kernel_files


def main(argv: list[str] | None = None) -> int:
    return precompile.main(argv, default_files=kernel_files)


if __name__ == "__main__":
    sys.exit(main())
