"""NVRTC compilation of ``.cu`` files with an on-disk cache.

Targets: ``sm_XX[a]`` gives a cubin for that exact chip (what the backend loads: a cubin from an
NVRTC newer than the driver still loads, PTX does not); ``compute_XX`` gives PTX (what
``make kernels`` builds on a machine with no GPU, to check every module compiles).

Cache entries are keyed by sha256 over the schema version, the NVRTC version, the target, the
options, the source bytes and the bytes of every header it includes (local headers followed
recursively, CUDA headers at their top level). Entries are written atomically (temp file +
``os.replace``) and carry a digest of their payload, so a truncated or corrupt entry is detected
and rebuilt. An unwritable cache directory costs a warning, not a failure.

Every NVRTC run (a cache miss, not a hit) is logged at INFO on ``gpu_runtime.compiler`` with the
module, the target and the seconds it took: the slow path of a kernel's first use.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from cuda.bindings import nvrtc

from .errors import NvrtcError

_log = logging.getLogger(__name__)
CACHE_SCHEMA = 1
_MAGIC = b"GRTCACHE"
_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
# -default-device: NVRTC 13.0 treats an unannotated (generic) lambda inside a kernel as host code
# and refuses it; nvcc and newer NVRTC infer __device__. Every function in kernels/ is device code.
BASE_OPTIONS: tuple[str, ...] = ("-std=c++17", "-lineinfo", "-default-device")


def cache_dir() -> Path:
    env = os.environ.get("GPU_RUNTIME_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpu_runtime"


@lru_cache(maxsize=1)
def cuda_include_dir() -> str:
    """The CUDA headers NVRTC needs (``cuda_bf16.h``, ``cuda_fp8.h``), found by cuda.pathfinder."""
    from cuda.pathfinder import find_nvidia_header_directory

    found = find_nvidia_header_directory("cudart")
    if not found:
        raise FileNotFoundError("CUDA runtime headers not found (pip install 'cuda-toolkit[cudart]' or set CUDA_HOME)")
    return str(found)


@lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion", "-")
    return int(major), int(minor)


def target_for(major: int, minor: int) -> str:
    """Cubin target for a device: the arch-specific ``a`` variant from Hopper on, so that
    kernels may use wgmma and friends (the cubin only ever runs on this exact chip)."""
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


@dataclass(frozen=True)
class Compiled:
    """One compiled module: ``image`` is a cubin for ``sm_*`` targets, NUL-terminated PTX else."""

    image: bytes
    target: str
    log: str
    cached: bool


def _check(err: object, what: str, source: str, log: str = "") -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        name = getattr(err, "name", str(err))
        raise NvrtcError(name, source, log or what)


def _headers(source: str, src_dir: Path, include_dirs: Sequence[Path] = ()) -> list[tuple[str, bytes]]:
    """(name, bytes) of every header the module ``source`` (in ``src_dir``) includes, found where
    NVRTC looks: a quoted name beside the including file first, then in each ``-I`` folder in
    the order ``prepare`` gives them (``src_dir``, CUDA's include folder, ``include_dirs``: the
    caller's own). Headers outside CUDA's folder are followed recursively, CUDA's at their top
    level."""
    search = (src_dir, Path(cuda_include_dir()), *include_dirs)
    return _found_headers(source, src_dir, search, set())


def _found_headers(source: str, here: Path, search: Sequence[Path], seen: set[Path]) -> list[tuple[str, bytes]]:
    cuda = search[1]
    out: list[tuple[str, bytes]] = []
    for quote, name in _INCLUDE.findall(source):
        folders = (here, *search) if quote == '"' else search
        found = next((d / name for d in folders if (d / name).is_file()), None)
        if found is None or found in seen:
            continue
        seen.add(found)
        text = found.read_bytes()
        out.append((name, text))
        if cuda not in found.parents:
            out.extend(_found_headers(text.decode(), found.parent, search, seen))
    return out


def _include_dirs(options: Sequence[str]) -> list[Path]:
    """The folders of ``-I<dir>`` and ``--include-path=<dir>`` options, in order."""
    dirs = []
    for option in options:
        for prefix in ("-I", "--include-path="):
            if option.startswith(prefix) and len(option) > len(prefix):
                dirs.append(Path(option[len(prefix) :]))
    return dirs


def cache_key(
    source: bytes, headers: list[tuple[str, bytes]], target: str, options: tuple[str, ...], version: tuple[int, int]
) -> str:
    h = hashlib.sha256()
    for part in (str(CACHE_SCHEMA), f"{version[0]}.{version[1]}", target, "\0".join(options)):
        h.update(part.encode() + b"\0")
    h.update(hashlib.sha256(source).digest())
    for name, text in headers:
        h.update(name.encode() + b"\0" + hashlib.sha256(text).digest())
    return h.hexdigest()


def _read_entry(path: Path) -> bytes | None:
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    if len(blob) < 40 or blob[:8] != _MAGIC:
        return None
    payload = blob[40:]
    if hashlib.sha256(payload).digest() != blob[8:40]:
        return None
    return payload


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file and ``os.replace``: readers see the old file
    or the new one, never part of it. Raises ``OSError`` (the temp file removed)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a full disk or a directory in the entry's place
        raise


def _write_entry(path: Path, payload: bytes) -> None:
    try:
        write_atomic(path, _MAGIC + hashlib.sha256(payload).digest() + payload)
    except OSError as exc:
        warnings.warn(f"kernel cache not written ({exc}); compiled in memory only", stacklevel=4)


def _nvrtc_compile(source: bytes, name: str, target: str, options: tuple[str, ...]) -> tuple[bytes, str]:
    err, prog = nvrtc.nvrtcCreateProgram(source, name.encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram", name)
    try:
        opts = [o.encode() for o in options] + [f"--gpu-architecture={target}".encode()]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        # Mutable buffers: NVRTC writes into them, and ``b" " * 1`` would be CPython's shared
        # one-byte ``b" "`` object, which the write would corrupt for the whole process.
        log_buf = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, log_buf)
        log = bytes(log_buf).rstrip(b"\0").decode(errors="replace").strip()
        _check(err, "nvrtcCompileProgram", name, log)
        if target.startswith("sm_"):
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            image = bytearray(size)
            (err2,) = nvrtc.nvrtcGetCUBIN(prog, image)
        else:
            err, size = nvrtc.nvrtcGetPTXSize(prog)
            image = bytearray(size)
            (err2,) = nvrtc.nvrtcGetPTX(prog, image)
        _check(err, "nvrtcGet*Size", name, log)
        _check(err2, "nvrtcGet*", name, log)
        return bytes(image), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@dataclass(frozen=True)
class Job:
    """One module's compilation, prepared: its source, the full NVRTC options and the cache key
    (what the image depends on: source, headers, target, options, NVRTC version)."""

    path: Path
    target: str
    source: bytes
    options: tuple[str, ...]
    key: str

    @property
    def entry(self) -> Path:
        """The cache entry this job reads and writes."""
        return cache_dir() / f"{self.path.stem}-{self.target}-{self.key[:32]}.bin"


def prepare(path: Path, target: str, options: tuple[str, ...] = ()) -> Job:
    """Read ``path`` and its headers and key them (no NVRTC call but its version)."""
    path = Path(path)
    source = path.read_bytes()
    headers = _headers(source.decode(), path.parent, _include_dirs(options))  # the caller's -I folders too
    options = BASE_OPTIONS + (f"-I{path.parent}", f"-I{cuda_include_dir()}") + tuple(options)
    key_options = tuple(o for o in options if not o.startswith("-I"))  # paths differ per machine
    key = cache_key(source, headers, target, key_options, nvrtc_version())
    return Job(path, target, source, options, key)


def cached_image(job: Job) -> bytes | None:
    """The job's image from the cache, or None when absent or damaged."""
    return _read_entry(job.entry)


def compile_module(
    path: Path, target: str, options: tuple[str, ...] = (), use_cache: bool = True, refresh: bool = False
) -> Compiled:
    """Compile one ``.cu`` file for ``target`` through the cache (``use_cache=False``: neither
    read nor write it; ``refresh=True``: compile anew and overwrite the entry)."""
    return compile_job(prepare(path, target, options), use_cache, refresh)


def compile_job(job: Job, use_cache: bool = True, refresh: bool = False) -> Compiled:
    """``compile_module`` of a prepared job (its image is the one its key names)."""
    if use_cache and not refresh:
        cached = cached_image(job)
        if cached is not None:
            return Compiled(cached, job.target, "", cached=True)
    t0 = time.perf_counter()
    image, log = _nvrtc_compile(job.source, job.path.name, job.target, job.options)
    why = "refresh" if refresh else "cache miss" if use_cache else "cache off"
    seconds = time.perf_counter() - t0
    _log.info("NVRTC compiled kernel module %r for %s in %.2f s (%s)", job.path.stem, job.target, seconds, why)
    if use_cache:
        _write_entry(job.entry, image)
    return Compiled(image, job.target, log, cached=False)


def evict(path: Path, target: str) -> None:
    """Remove every cache entry of one module and target (used when a cached image fails to load)."""
    for entry in cache_dir().glob(f"{Path(path).stem}-{target}-*.bin"):
        with contextlib.suppress(OSError):
            entry.unlink()
