"""Host buffers as the runtime takes them: anything C-contiguous with the buffer protocol."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

Host = Any  # bytes, bytearray, memoryview or a numpy array
HOST_PAGE = 4096  # register_host needs page-aligned addresses


def host_view(host: Host, writable: bool = False) -> tuple[int, int, Any]:
    """(address, nbytes, keep-alive object) of a C-contiguous host buffer."""
    arr = host if isinstance(host, np.ndarray) else np.frombuffer(host, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("host buffer must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("host output buffer is read-only")
    try:  # a third of ``arr.ctypes.data``'s cost (it builds a ctypes helper object every time)
        return ctypes.addressof(ctypes.c_char.from_buffer(arr)), arr.nbytes, arr  # type: ignore[arg-type]  # a buffer
    except (TypeError, ValueError):  # read-only, or empty
        return arr.ctypes.data, arr.nbytes, arr
