"""``KernelLaunch``: the positional argument builder the seeds launch every kernel with.

Each ``arg_*`` range-checks its value and records a kind letter; ``launch`` hands kinds and
values to the backend, which packs them to the C ABI and checks them, once per kernel and shape,
against the kernel's own signature. Kept lean: the n-gram layer launches dozens of kernels a call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from . import launch_config, validate
from .backend import GpuBackend, check_backend
from .pointers import DevicePtr, KernelHandle

_U32 = 1 << 32
_U64 = 1 << 64
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


class KernelLaunch:
    """``KernelLaunch(gpu, k).grid([x,y,z]).block([x,y,z]).arg_ptr(p).arg_u32(n).launch(stream)``."""

    __slots__ = ("_gpu", "_kernel", "_grid", "_block", "_shared", "_kinds", "_args")

    def __init__(self, gpu: GpuBackend, kernel: KernelHandle) -> None:
        check_backend(gpu, "KernelLaunch: gpu")
        if not kernel:
            raise ValueError("KernelLaunch: null kernel handle (the kernel was not loaded)")
        self._gpu = gpu
        self._kernel = kernel
        self._grid = (1, 1, 1)
        self._block = (1, 1, 1)
        self._shared = 0
        self._kinds = ""
        self._args: list[int | float] = []

    @classmethod
    def new(cls, gpu: GpuBackend, kernel: KernelHandle) -> KernelLaunch:
        """The seed's spelling, ``KernelLaunch::new(gpu, kernel)``."""
        return cls(gpu, kernel)

    # Each setter has a fast path for plain in-range ints (the common case: ``_plain_dims``, or
    # one type test, about 1 us cheaper for grid and block together; limits written as literals,
    # which Python loads faster than names) and falls back to the general conversion and
    # checks, which also phrase errors.
    def grid(self, dims: Sequence[int]) -> KernelLaunch:
        self._grid = _plain_dims(dims, 2147483647, 65535, 65535) or launch_config.grid_dims(dims)
        return self

    def block(self, dims: Sequence[int]) -> KernelLaunch:
        block = _plain_dims(dims, 1024, 1024, 64)
        if block is None or block[0] * block[1] * block[2] > 1024:
            block = launch_config.block_dims(dims)
        self._block = block
        return self

    def shared_mem(self, nbytes: int) -> KernelLaunch:
        self._shared = launch_config.shared_bytes(nbytes)
        return self

    def _push_int(self, kind: str, value: int, low: int, high: int, what: str) -> KernelLaunch:
        value = validate.integer(value, f"{what} argument")
        if not low <= value < high:
            raise ValueError(f"argument {len(self._args)}: {value} does not fit {what}")
        self._kinds += kind
        self._args.append(value)
        return self

    def arg_ptr(self, ptr: int) -> KernelLaunch:
        if type(ptr) is DevicePtr:  # in range by construction
            self._kinds += "P"
            self._args.append(ptr)
            return self
        return self._push_int("P", ptr, 0, _U64, "pointer")

    def arg_u32(self, value: int) -> KernelLaunch:
        if type(value) is int and 0 <= value <= 0xFFFFFFFF:
            self._kinds += "U"
            self._args.append(value)
            return self
        return self._push_int("U", value, 0, _U32, "u32")

    def arg_i32(self, value: int) -> KernelLaunch:
        return self._push_int("I", value, _I32_MIN, _I32_MAX + 1, "i32")

    def arg_u64(self, value: int) -> KernelLaunch:
        return self._push_int("L", value, 0, _U64, "u64")

    def arg_f32(self, value: float) -> KernelLaunch:
        if type(value) is float and -3.4028234663852886e38 <= value <= 3.4028234663852886e38:
            self._kinds += "F"
            self._args.append(value)
            return self
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
            raise TypeError(f"argument {len(self._args)}: f32 needs a real number, got {value!r}")
        value = float(value)
        if math.isfinite(value) and abs(value) > 3.4028234663852886e38:
            raise ValueError(f"argument {len(self._args)}: {value} overflows f32")
        self._kinds += "F"
        self._args.append(value)
        return self

    def launch(self, stream: int = 0, *, overlap: bool = False) -> None:
        """``overlap=True``: programmatic dependent launch, for kernels that start with work
        independent of the previous kernel and wait for it (``griddepcontrol.wait``) before
        reading its output."""
        if type(stream) is not int or stream < 0:
            stream = validate.stream(stream, "KernelLaunch.launch: stream")
        if overlap:
            self._gpu.launch(
                self._kernel, self._grid, self._block, self._shared, stream, self._kinds, self._args, overlap=True
            )
        else:
            self._gpu.launch(self._kernel, self._grid, self._block, self._shared, stream, self._kinds, self._args)


def _plain_dims(dims: Sequence[int], x_max: int, y_max: int, z_max: int) -> tuple[int, int, int] | None:
    """``dims`` as a tuple if it is three plain ints in ``1..x_max``, ``1..y_max``, ``1..z_max``
    (the setters' fast path), else None."""
    try:
        x, y, z = dims
    except (TypeError, ValueError):
        return None
    if type(x) is int and type(y) is int and type(z) is int and 0 < x <= x_max and 0 < y <= y_max and 0 < z <= z_max:
        return (x, y, z)
    return None
