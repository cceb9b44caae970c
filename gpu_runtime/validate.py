"""The one validation policy: ``TypeError`` for a wrong type, ``ValueError`` for a wrong value,
``ClosedError`` for a closed object.

Each check returns the normalised value (an ``int``, ``float`` or ``bool``; an int subclass such
as ``DevicePtr`` is returned as it is); ``what`` names the argument in the message
(``"alloc size"``, ``"scaled_add n"``, ``"DeviceBuffer: stream"``). Every public entry point
checks its ``gpu`` with ``gpu_runtime.backend.check_backend`` and its stream with ``stream``
before it does anything else. Launchers call these on every launch, so each starts
with a fast path for the common case (a plain in-range value) before the general checks.
"""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np

from .errors import ClosedError
from .pointers import DevicePtr

F32_MAX = 3.4028234663852886e38
STREAM_LIMIT = 1 << 64  # a CUstream handle is a pointer


def integer(value: object, what: str) -> int:
    """An int or numpy integer (anything with ``__index__``), not a bool."""
    if type(value) is int:
        return value
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    if isinstance(value, int):
        return value
    try:
        return operator.index(value)  # type: ignore[arg-type]  # any object: a TypeError is the refusal below
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def _bound(limit: int) -> str:
    """``limit - 1`` as the messages write it: ``2**32-1`` for large powers of two."""
    if limit > 1 << 16 and limit & (limit - 1) == 0:
        return f"2**{limit.bit_length() - 1}-1"
    return str(limit - 1)


def count(value: object, what: str, *, limit: int | None = None) -> int:
    """An integer >= 0 (and < ``limit``)."""
    if type(value) is int and value >= 0 and (limit is None or value < limit):
        return value
    return _at_least(0, value, what, limit)


def positive(value: object, what: str, *, limit: int | None = None) -> int:
    """An integer >= 1 (and < ``limit``)."""
    if type(value) is int and value >= 1 and (limit is None or value < limit):
        return value
    return _at_least(1, value, what, limit)


def _at_least(low: int, value: object, what: str, limit: int | None) -> int:
    n = integer(value, what)
    if limit is not None and not low <= n < limit:
        raise ValueError(f"{what} must be in {low}..{_bound(limit)}, got {n}")
    if n < low:
        raise ValueError(f"{what} must be {'a non-negative int' if low == 0 else 'an int >= 1'}, got {n}")
    return n


def u32(value: object, what: str) -> int:
    """What a ``uint32_t`` kernel parameter takes."""
    if type(value) is int and 0 <= value <= 0xFFFFFFFF:
        return value
    return count(value, what, limit=1 << 32)


def pointer(value: object, what: str, *, nullable: bool = False) -> int:
    """A device address: an integer below 2**64; 0 (null) only where ``nullable``."""
    if (type(value) is DevicePtr or type(value) is int) and 0 < value < 0x10000000000000000:
        return value
    ptr = integer(value, what)
    if not ptr and not nullable:
        raise ValueError(f"{what}: null device pointer")
    if not 0 <= ptr < 1 << 64:
        raise ValueError(f"{what}: device pointer out of range: {ptr}")
    return ptr


def pointers(what: str, names: str, *values: object) -> None:
    """Raise for the first of ``values`` (named by the words of ``names``) that is not a non-null
    device address: ``ValueError("scaled_add x: null device pointer")``, or the ``TypeError`` of
    a value that is no address at all (an array, None). The launchers' one check of the pointers
    their kernels need; the plain case is one ``all``."""
    try:
        if all(values):
            return
    except ValueError:  # a numpy array's truth value
        pass
    for name, value in zip(names.split(), values):
        pointer(value, f"{what} {name}")
    raise ValueError(f"{what}: a null device pointer among {names}")  # (not reached: one was refused)


def stream(value: object, what: str) -> int:
    """A stream handle: an int in 0..2**64-1 (0: the default stream), not a bool, a float or a
    backend (``what``: "FusedNgramEmbedding.embed: stream")."""
    if type(value) is int and 0 <= value < 0x10000000000000000:
        return value
    if isinstance(value, (bool, np.bool_)) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{what} must be a stream handle (an int >= 0, 0: the default stream), got {_kind(value)}")
    handle = operator.index(value)  # type: ignore[arg-type]  # has __index__: checked just above
    if not 0 <= handle < STREAM_LIMIT:
        raise ValueError(f"{what} must be a stream handle (an int in 0..2**64-1, 0: the default stream), got {handle}")
    return handle


def _kind(value: object) -> str:
    """A value of the wrong type as an error message names it: its type, and a short scalar's repr
    (``str 'cpu'``, ``int 0``, ``None``; a backend or an array by its type alone)."""
    if value is None:
        return "None"
    text = repr(value) if isinstance(value, (str, int, float, np.generic)) else ""
    return f"{type(value).__name__} {text}" if text and len(text) <= 40 else type(value).__name__


def real32(value: object, what: str) -> float:
    """A real number that is finite and fits an f32 (the kernels compute in fp32)."""
    if type(value) is float and -F32_MAX <= value <= F32_MAX:  # NaN and infinities fail this
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {value!r}")
    x = float(value)
    if not math.isfinite(x) or abs(x) > F32_MAX:
        raise ValueError(f"{what} must be finite and fit an f32, got {value!r}")
    return x


def boolean(value: object, what: str) -> bool:
    """Exactly a bool (an int is not taken for one)."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be a bool, got {value!r}")
    return value


def require_open(closed: bool, what: str) -> None:
    """``ClosedError("<what> is closed")`` where ``closed``."""
    if closed:
        raise ClosedError(f"{what} is closed")
