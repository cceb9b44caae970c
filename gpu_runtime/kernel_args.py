"""``KernelLaunch``: the positional argument builder the seeds launch every kernel with.

Each ``arg_*`` range-checks its value and records a kind letter; ``launch`` hands kinds and
values to the backend, which packs them to the C ABI and checks them, once per kernel and shape,
against the kernel's own signature. Kept lean: the n-gram layer launches dozens of kernels a call.

Once a backend has checked a (kernel, kinds) shape on a thread it may grant it a direct route
(``allow_direct``): that thread's plain launches of the shape on that backend (no ``overlap``; at
most 48 KiB of dynamic shared memory, or as much as the backend has opted the kernel in to) pack
into the backend's buffer and call its driver function from ``launch``, skipping the backend's
frames; a refusal is phrased by the backend's function.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import launch_config, validate
from .backend import GpuBackend, check_backend
from .launch_config import SHARED_WITHOUT_OPT_IN
from .pointers import DevicePtr, KernelHandle

_U32 = 1 << 32
_U64 = 1 << 64
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
# This thread's direct routes: (kernel, kinds) -> (backend, pack, params, driver launch, refusal,
# opted-in shared memory, driver kernel).
_ROUTES = threading.local()


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

    # Each setter has a fast path for plain in-range ints (the common case, written inline with
    # its limits as literals: a helper call or named constants cost more than the checks) and
    # falls back to the general conversion and checks, which also phrase errors.
    def grid(self, dims: Sequence[int]) -> KernelLaunch:
        try:
            x, y, z = dims
            plain = type(x) is type(y) is type(z) is int and 0 < x <= 2147483647 and 0 < y <= 65535 and 0 < z <= 65535
        except (TypeError, ValueError):
            plain = False
        self._grid = (x, y, z) if plain else launch_config.grid_dims(dims)
        return self

    def block(self, dims: Sequence[int]) -> KernelLaunch:
        try:
            x, y, z = dims
            plain = type(x) is type(y) is type(z) is int and 0 < x <= 1024 and 0 < y <= 1024 and 0 < z <= 64
        except (TypeError, ValueError):
            plain = False
        self._block = (x, y, z) if plain and x * y * z <= 1024 else launch_config.block_dims(dims)
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
        kernel, shared = self._kernel, self._shared
        try:
            route = _ROUTES.table[(kernel, self._kinds)]
        except (AttributeError, KeyError):  # no route on this thread (yet)
            route = None
        if (
            route is not None
            and route[0] is self._gpu
            and not overlap
            and (shared <= SHARED_WITHOUT_OPT_IN or shared <= route[5].get(kernel, 0))
        ):
            route[1](self._args)
            gx, gy, gz = self._grid
            bx, by, bz = self._block
            (err,) = route[3](route[6], gx, gy, gz, bx, by, bz, shared, stream, route[2], 0)
            if err:
                raise route[4](err, "cuLaunchKernel", kernel, self._grid, self._block, shared)
        elif overlap:
            self._gpu.launch(kernel, self._grid, self._block, shared, stream, self._kinds, self._args, overlap=True)
        else:
            self._gpu.launch(kernel, self._grid, self._block, shared, stream, self._kinds, self._args)

    @staticmethod
    def allow_direct(
        kernel: int,
        kinds: str,
        backend: object,
        pack: Callable[[Sequence[Any]], None],
        params: int,
        launch: Callable[..., tuple[Any]],
        refusal: Callable[..., Exception],
        opted_in: Mapping[int, int] = launch_config.NO_OPT_IN,
        driver_kernel: object = None,
    ) -> dict[tuple[int, str], Any]:
        """For backends, not users. Let this thread's plain launches of ``kernel`` with argument
        kinds ``kinds`` on ``backend`` write their values with ``pack`` (into the buffer that the
        ``void*[]`` at ``params`` points into) and call ``launch`` (``cuLaunchKernel``'s
        arguments, the kernel given as ``driver_kernel``, by default ``kernel``) instead of
        ``backend.launch``; a nonzero status is raised as ``refusal(status,
        "cuLaunchKernel", kernel, grid, block, shared_mem)``. Launches with more than 48 KiB of
        dynamic shared memory take the route only up to ``opted_in[kernel]`` (as
        ``KernelSpec.allow_direct``). A backend calls this only after its own checks of the shape
        passed on this thread. Returns the thread's table, from which the backend removes its
        routes when it closes."""
        try:
            table = _ROUTES.table
        except AttributeError:
            table = _ROUTES.table = {}
        driver = kernel if driver_kernel is None else driver_kernel
        table[(int(kernel), kinds)] = (backend, pack, params, launch, refusal, opted_in, driver)
        return table
