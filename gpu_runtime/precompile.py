"""Compile .cu files ahead of time with NVRTC, rebuilding only what changed.

`make kernels` runs layers.precompile, which gives this tool the layers' files. Each image goes
into the kernel cache that the backend reads ($GPU_RUNTIME_CACHE_DIR, else $XDG_CACHE_HOME/gpu_runtime
where that is set, else ~/.cache/gpu_runtime).
A module is compiled again only when its cache key changed (its source,
the bytes of any header it includes, the compiler options, the target or the NVRTC version) or
its image is missing or damaged. Otherwise it is up to date, and nothing runs NVRTC.

With a GPU present the default target is that device's cubin, so the cache the backend reads is
warm. Without one it is PTX for compute_90, which checks that every module compiles. Any NVRTC
error *or warning* fails the build, with the log, and that module is built again next time.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from . import cli, compiler, driver
from .errors import NvrtcError
from .signatures import module_signatures

MANIFEST = "precompiled.json"  # in the cache directory, next to the images it vouches for


def epilog(tool: str = "gpu_runtime.precompile", files: str = " kernels/*.cu") -> str:
    """The help's closing text: the manifest, the output, the exit status, examples."""
    return f"""\
The manifest ({MANIFEST} in the cache directory) records, per source file and target,
the cache key of its last clean build (compiled without errors or warnings). A module whose key
and image still match is skipped. Output: one "ok" line per module compiled (module, target, image bytes,
kernels), a FAIL line and the NVRTC log per module that failed, then a summary line ("7 kernel
modules up to date for compute_90" when nothing changed). Exit status: 0 if every module is
compiled or up to date, 1 if any failed.

examples:
  python -m {tool}{files}
      this GPU's cubin, or PTX for compute_90 without a GPU
  python -m {tool} --arch sm_80{files}
      a cubin for another chip
  python -m {tool} --force{files}
      compile every module again, changed or not
"""


def default_arch() -> str:
    if driver.device_count() > 0:
        return compiler.target_for(*driver.compute_capability(0))
    return "compute_90"


def manifest_path() -> Path:
    return compiler.cache_dir() / MANIFEST


def read_manifest() -> dict[str, str]:
    """``"<source path>|<target>"`` -> the key of its last clean build; {} when unreadable."""
    try:
        data = json.loads(manifest_path().read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def write_manifest(updates: dict[str, str]) -> None:
    """Merge ``updates`` into the manifest, atomically; a manifest that cannot be written only
    means that the next run compiles again."""
    body = json.dumps(dict(sorted({**read_manifest(), **updates}.items())), indent=1) + "\n"
    try:
        compiler.write_atomic(manifest_path(), body.encode())
    except OSError as exc:
        print(f"note: {manifest_path()} not written ({exc}); the next run compiles again", file=sys.stderr)


def make_parser(
    description: str = __doc__, closing: str = "", prog: str = "python -m gpu_runtime.precompile"
) -> argparse.ArgumentParser:
    """The tool's options under another tool's description (``layers.precompile``)."""
    parser = cli.ArgumentParser(
        prog=prog,
        description=description,
        epilog=closing or epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--arch",
        default="",
        metavar="TARGET",
        help="sm_XX[a|f] for a cubin or compute_XX[a|f] for PTX (default: this GPU's cubin, compute_90 without a GPU)",
    )
    parser.add_argument("--force", action="store_true", help="compile every module, up to date or not")
    parser.add_argument("-v", "--verbose", action="store_true", help="also list each module that is up to date")
    parser.add_argument("files", nargs="*", type=Path, help=".cu files to compile")
    return parser


def refuse(parser: argparse.ArgumentParser, message: str) -> int:
    """A usage error in one line on stderr (``prog: error: message``); returns exit status 2."""
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2


def main(
    argv: list[str] | None = None,
    default_files: Callable[[], list[Path]] | None = None,
    parser: argparse.ArgumentParser | None = None,
    no_default_files: str = "no .cu files given",
) -> int:
    """Compile ``files`` (or ``default_files()`` when none are named); 1 if any failed, 2 for a
    usage error (one line: ``no_default_files`` where there is nothing to compile)."""
    parser = parser or make_parser()
    args = parser.parse_args(argv)
    if args.arch and not re.fullmatch(r"(sm|compute)_\d{2,3}[af]?", args.arch):
        wanted = "sm_XX[a|f] or compute_XX[a|f] (e.g. sm_90a, sm_100f, compute_90)"
        return refuse(parser, f"--arch {args.arch}: not {wanted}")
    for path in args.files:
        if not path.is_file():
            return refuse(parser, f"{path}: {'a folder' if path.is_dir() else 'no such file'}, not a .cu file")
    arch = args.arch or default_arch()
    files = args.files or (default_files() if default_files else [])
    if not files:
        return refuse(parser, no_default_files)
    built = read_manifest()
    updates: dict[str, str] = {}
    compiled = fresh = failed = 0
    for path in files:
        job = compiler.prepare(path, arch)
        name = f"{Path(path).resolve()}|{arch}"
        if not args.force and built.get(name) == job.key and compiler.cached_image(job) is not None:
            fresh += 1
            if args.verbose:
                print(f"up to date {job.path.stem:<20} {arch}")
            continue
        try:
            out = compiler.compile_job(job, refresh=True)
        except NvrtcError as exc:
            print(f"FAIL {job.path.stem:<20} {arch}\n{exc.log}", file=sys.stderr)
            failed += 1
            continue
        if out.log:
            print(f"FAIL {job.path.stem:<20} {arch}: warnings are errors here\n{out.log}", file=sys.stderr)
            compiler.evict(job.path, arch)
            failed += 1
            continue
        updates[name] = job.key
        compiled += 1
        print(f"ok   {job.path.stem:<20} {arch:<10} {len(out.image):>8} bytes  {', '.join(module_signatures(path))}")
    if updates:
        write_manifest(updates)
    status = f"{len(files)} kernel modules for {arch}: {compiled} compiled, {fresh} up to date, {failed} failed"
    if not compiled and not failed:
        status = f"{fresh} kernel modules up to date for {arch} (nothing compiled; --force compiles them again)"
    print(status, file=sys.stderr if failed else sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
