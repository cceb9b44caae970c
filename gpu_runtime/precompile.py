"""Compile ``.cu`` files ahead of time with NVRTC (``make kernels`` runs ``layers.precompile``,
which gives it the layers' files).

With a GPU present the default target is that device's cubin (so the cache the backend reads
is warm); without one it is PTX for ``compute_90``, which checks every module compiles. Any
NVRTC error *or warning* fails the build, with the log.

    python3 -m gpu_runtime.precompile [--arch sm_90a|compute_90|...] files...
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from . import compiler, driver
from .errors import NvrtcError
from .signatures import module_signatures


def default_arch() -> str:
    if driver.device_count() > 0:
        return compiler.target_for(*driver.compute_capability(0))
    return "compute_90"


def main(argv: list[str] | None = None, default_files: Callable[[], list[Path]] | None = None) -> int:
    """Compile ``files`` (or ``default_files()`` when none are named); 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="", help="sm_XX[a] (cubin) or compute_XX (PTX)")
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args(argv)
    arch = args.arch or default_arch()
    files = args.files or (default_files() if default_files else [])
    if not files:
        parser.error("no .cu files given")
    failed = 0
    for path in files:
        kernels = ", ".join(module_signatures(path))
        try:
            out = compiler.compile_module(path, arch, refresh=True)
        except NvrtcError as exc:
            print(f"FAIL {path.stem:<20} {arch}\n{exc.log}", file=sys.stderr)
            failed += 1
            continue
        if out.log:
            print(f"FAIL {path.stem:<20} {arch}: warnings are errors here\n{out.log}", file=sys.stderr)
            compiler.evict(path, arch)
            failed += 1
            continue
        print(f"ok   {path.stem:<20} {arch:<10} {len(out.image):>8} bytes  {kernels}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
