"""Files replaced whole and durably: ``write_atomically`` (a safetensors file, the converter's
manifest) and ``fsync_dir`` (after a rename into place, as ``TableWriter`` does too)."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def write_atomically(path: str | os.PathLike, chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` to ``path.tmp``, fsync it, rename it over ``path`` and fsync the folder:
    a failure at any point leaves what was at ``path`` before, and no ``.tmp``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(str(path.parent))


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable. Where directories cannot be opened or synced (some
    platforms and file systems: EINVAL, ENOTSUP), that is fine; any other failure (EIO) is raised."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)
