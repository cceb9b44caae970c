"""A launch's configuration, checked: grid and block dimensions, dynamic shared memory.

``KernelLaunch`` checks these as they are set; a ``KernelSpec`` launch leaves them to the
driver on its fast path and calls these only to phrase a refusal (and on backends that do not
launch for real, so that they refuse what the device would).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from . import validate

GRID_MAX = ((1 << 31) - 1, 65535, 65535)
BLOCK_MAX = (1024, 1024, 64)
MAX_THREADS = 1024
SHARED_WITHOUT_OPT_IN = 48 * 1024  # more dynamic shared memory than this needs the kernel's opt-in
NO_OPT_IN: Mapping[int, int] = {}  # a direct route's opt-ins when it takes only launches within 48 KiB


def _dims(dims: Sequence[int], limits: tuple[int, int, int], what: str) -> tuple[int, int, int]:
    if len(dims) != 3:
        raise ValueError(f"{what} must have 3 dimensions, got {list(dims)}")
    x, y, z = (validate.integer(d, what) for d in dims)  # three: checked above
    out = (x, y, z)
    for d, limit in zip(out, limits):
        if not 1 <= d <= limit:
            raise ValueError(f"{what} {list(out)}: each dimension must be in 1..{list(limits)}")
    return out


def grid_dims(dims: Sequence[int]) -> tuple[int, int, int]:
    return _dims(dims, GRID_MAX, "grid")


def block_dims(dims: Sequence[int]) -> tuple[int, int, int]:
    block = _dims(dims, BLOCK_MAX, "block")
    if block[0] * block[1] * block[2] > MAX_THREADS:
        raise ValueError(f"block {list(block)}: more than {MAX_THREADS} threads")
    return block


def shared_bytes(nbytes: int) -> int:
    return validate.count(nbytes, "shared_mem", limit=1 << 32)


Dims = tuple[int, int, int]


def check(grid: Sequence[int], block: Sequence[int], shared_mem: int) -> tuple[Dims, Dims, int]:
    """All three, normalised (tuples of ints); the first refusal raises."""
    return grid_dims(grid), block_dims(block), shared_bytes(shared_mem)
