"""Compile every layer kernel module ahead of time with NVRTC: what ``make kernels`` runs.

With no files named it compiles every .cu file of the layers' kernel directory
($GPU_RUNTIME_KERNEL_DIR, else the copy inside the package, else the checkout's kernels/), through
gpu_runtime.precompile. A module is compiled again only when its source, a header it includes, the
compiler options, the target or the NVRTC version changed; a second run with nothing changed
compiles nothing and says so. Any NVRTC error or warning fails the build, with the log.

With a GPU present the default target is that device's cubin (the cache the backend reads is then
warm); without one it is PTX for compute_90, which checks that every module compiles.
"""

from __future__ import annotations

import os
import sys

from .requires import installed

PROG = "python -m layers.precompile"

with installed(PROG):  # a Python without cuda-bindings, numpy, ...: one line, not a traceback
    from gpu_runtime import precompile

    from .kernel_files import KERNEL_DIR_ENV, kernel_dir, kernel_files


def main(argv: list[str] | None = None) -> int:
    parser = precompile.make_parser(__doc__, precompile.epilog("layers.precompile", ""), PROG)
    try:
        where = f"no .cu files in {kernel_dir()}" + (f" (${KERNEL_DIR_ENV})" if os.environ.get(KERNEL_DIR_ENV) else "")
        files = kernel_files
    except FileNotFoundError as exc:  # no kernels/ folder anywhere
        where, files = str(exc), list
    return precompile.main(argv, default_files=files, parser=parser, no_default_files=where)


if __name__ == "__main__":
    sys.exit(main())
