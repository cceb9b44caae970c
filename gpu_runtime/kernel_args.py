"""``KernelLaunch``: the seed's positional builder, a thin front on ``Kernel.launch``.

Each ``arg_*`` range-checks its value as it is given and records its kind; ``launch`` binds the
kernel (``gpu.bind``, made once per backend), raises ``TypeError`` for arguments whose kinds
differ from the kernel's signature, and launches them with the ``LaunchConfig`` of the builder's
grid, block and shared memory (made once per shape).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from . import validate
from .backend import GpuBackend, check_backend
from .launch import GRID_MAX, KIND_NAMES, Dims, LaunchConfig, check_block, check_dims
from .pointers import DevicePtr, KernelHandle

_U32 = 1 << 32
_U64 = 1 << 64
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_F32_MAX = validate.F32_MAX
_CONFIGS: dict[tuple[Dims, Dims, int, bool], LaunchConfig] = {}  # every shape launched, up to 1024


class KernelLaunch:
    """``KernelLaunch(gpu, k).grid([x,y,z]).block([x,y,z]).arg_ptr(p).arg_u32(n).launch(stream)``:
    ``k`` a handle from ``gpu.kernel``, arguments in the kernel's order."""

    __slots__ = ("_gpu", "_kernel", "_grid", "_block", "_shared", "_kinds", "_args")

    def __init__(self, gpu: GpuBackend, kernel: KernelHandle) -> None:
        check_backend(gpu, "KernelLaunch: gpu")
        if not kernel:
            raise ValueError("KernelLaunch: null kernel handle (the kernel was not loaded)")
        self._gpu = gpu
        self._kernel = kernel
        self._grid: Dims = (1, 1, 1)
        self._block: Dims = (1, 1, 1)
        self._shared = 0
        self._kinds = ""
        self._args: list[int | float] = []

    @classmethod
    def new(cls, gpu: GpuBackend, kernel: KernelHandle) -> KernelLaunch:
        """``KernelLaunch(gpu, kernel)``: a builder for ``kernel`` on ``gpu``, in the spelling of the Rust
        engine this package mirrors, ``KernelLaunch::new(gpu, kernel)`` (docs/SEED.md)."""
        return cls(gpu, kernel)

    # Each setter takes plain in-range values on a fast path written inline (a helper call costs
    # more than the checks), and falls back to the general conversion, which also phrases errors.
    def grid(self, dims: Sequence[int]) -> KernelLaunch:
        """Grid dimensions ``[x, y, z]``, each >= 1 (x < 2**31, y and z < 65536)."""
        try:
            x, y, z = dims
            plain = type(x) is type(y) is type(z) is int and 0 < x < 2147483648 and 0 < y < 65536 and 0 < z < 65536
        except (TypeError, ValueError):
            plain = False
        if not plain:
            _three(dims, "grid")
            x, y, z = check_dims(dims, GRID_MAX, "grid")
        self._grid = (x, y, z)
        return self

    def block(self, dims: Sequence[int]) -> KernelLaunch:
        """Block dimensions ``[x, y, z]``: at most 1024 threads (z <= 64)."""
        try:
            x, y, z = dims
            plain = type(x) is type(y) is type(z) is int and x > 0 and y > 0 and 0 < z <= 64 and x * y * z <= 1024
        except (TypeError, ValueError):
            plain = False
        if not plain:
            _three(dims, "block")
            x, y, z = check_block(dims, "block")
        self._block = (x, y, z)
        return self

    def shared_mem(self, nbytes: int) -> KernelLaunch:
        """Dynamic shared memory in bytes (0 by default)."""
        self._shared = validate.count(nbytes, "shared_mem", limit=_U32)
        return self

    def arg_ptr(self, ptr: int) -> KernelLaunch:
        """A device address (a ``DevicePtr``, an int, or anything with ``__index__``)."""
        if not (type(ptr) is DevicePtr or type(ptr) is int and 0 <= ptr < _U64):
            ptr = _int(ptr, 0, _U64, "pointer", len(self._args))
        self._kinds += "P"
        self._args.append(ptr)
        return self

    def arg_u32(self, value: int) -> KernelLaunch:
        """An unsigned 32-bit integer."""
        if not (type(value) is int and 0 <= value < _U32):
            value = _int(value, 0, _U32, "u32", len(self._args))
        self._kinds += "U"
        self._args.append(value)
        return self

    def arg_i32(self, value: int) -> KernelLaunch:
        """A signed 32-bit integer."""
        self._args.append(_int(value, _I32_MIN, _I32_MAX + 1, "i32", len(self._args)))
        self._kinds += "I"
        return self

    def arg_u64(self, value: int) -> KernelLaunch:
        """An unsigned 64-bit integer."""
        self._args.append(_int(value, 0, _U64, "u64", len(self._args)))
        self._kinds += "L"
        return self

    def arg_f32(self, value: float) -> KernelLaunch:
        """A real number that fits an f32 (infinities and NaN too)."""
        if type(value) is not float or not -_F32_MAX <= value <= _F32_MAX:
            if isinstance(value, bool) or not hasattr(value, "__float__"):
                raise TypeError(f"argument {len(self._args)}: f32 needs a real number, got {value!r}")
            value = float(value)
            if math.isfinite(value) and abs(value) > _F32_MAX:
                raise ValueError(f"argument {len(self._args)}: {value} overflows f32")
        self._kinds += "F"
        self._args.append(value)
        return self

    def launch(self, stream: int = 0, *, overlap: bool = False) -> None:
        """Launch on ``stream``. ``overlap=True``: a programmatic dependent launch
        (``LaunchConfig.overlap``). ``TypeError`` where the arguments' kinds are not the
        kernel's signature's."""
        kernel = self._gpu.bind(self._kernel)
        if kernel.layout.kinds != self._kinds:
            raise TypeError(_mismatch(kernel.name, kernel.layout.kinds, self._kinds))
        key = (self._grid, self._block, self._shared, overlap)
        config = _CONFIGS.get(key)
        if config is None:
            config = LaunchConfig(self._grid, self._block, self._shared, overlap=overlap)
            if len(_CONFIGS) >= 1024:
                _CONFIGS.clear()
            _CONFIGS[key] = config
        kernel.launch(config, stream, *self._args)


def _three(dims: Sequence[int], what: str) -> None:
    """Refuse anything but three dimensions (``LaunchConfig`` also takes one or two)."""
    if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) or len(dims) != 3:
        raise ValueError(f"{what} must have 3 dimensions, got {dims!r}")


def _int(value: object, low: int, high: int, what: str, index: int) -> int:
    n = validate.integer(value, f"{what} argument")
    if not low <= n < high:
        raise ValueError(f"argument {index}: {n} does not fit {what}")
    return n


def _mismatch(kernel: str, expected: str, given: str) -> str:
    """Why a launch's kinds do not fit a kernel's: the first difference."""
    if len(expected) != len(given):
        return f"{kernel}: takes {len(expected)} arguments ({expected}), {len(given)} given ({given})"
    i = next(i for i, (a, b) in enumerate(zip(expected, given)) if a != b)
    return f"{kernel}: argument {i} must be {KIND_NAMES[expected[i]]}, launch passes {KIND_NAMES[given[i]]}"
