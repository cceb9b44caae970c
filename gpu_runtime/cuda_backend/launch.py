"""Launches: the thread's prebuilt argument buffer filled with the values, then the driver.

Two entry points share the submission: ``launch`` (``KernelLaunch``: kinds and values by
position, already range-checked by the builder; packed here) and ``launch_spec``
(``KernelSpec``: packed by the spec into its own buffer). Both check each new kernel and
argument shape once (``kernels.py``); the rest is what every launch pays, so it is kept to a
few lookups.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

from cuda.bindings import driver as cu

from .. import launch_config
from ..errors import CudaError
from ..launch_spec import KernelSpec
from ..pointers import KernelHandle
from .kernels import CudaKernels

_STATIC_SHARED = 48 * 1024  # more dynamic shared memory than this needs the kernel's opt-in


class CudaLaunch(CudaKernels):
    def launch(self, kernel: KernelHandle, grid: tuple[int, int, int], block: tuple[int, int, int],
               shared_mem: int, stream: int, kinds: str, args: Sequence[int | float], *,
               overlap: bool = False) -> None:
        try:
            plan = self._tls.shapes[(kernel, kinds)]
        except (AttributeError, KeyError):  # a new thread, or a new launch shape on this one
            plan = self._launch_shape(kernel, kinds)
        if shared_mem > _STATIC_SHARED and self._shared_set.get(kernel, 0) < shared_mem:
            self._raise_shared_limit(kernel, shared_mem)
        plan.pack(args)
        if overlap and self.overlap:
            self._launch_overlapped(kernel, grid, block, shared_mem, stream, plan.params)
            return
        gx, gy, gz = grid  # checked by KernelLaunch
        bx, by, bz = block
        (err,) = cu.cuLaunchKernel(kernel, gx, gy, gz, bx, by, bz, shared_mem, stream, plan.params, 0)
        if err:
            raise self._launch_error(err, "cuLaunchKernel", kernel, grid, block, shared_mem)

    def launch_spec(self, spec: KernelSpec, kernel: KernelHandle, grid: Sequence[int],
                    block: Sequence[int], shared_mem: int, stream: int, params: int,
                    values: Sequence[Any], overlap: bool = False) -> None:
        try:
            checked = self._tls.specs[kernel] is spec
        except (AttributeError, KeyError):  # a new thread, or a new kernel on this one
            checked = False
        if not checked:
            self._check_spec(kernel, spec)
        if shared_mem > _STATIC_SHARED and self._shared_set.get(kernel, 0) < shared_mem:
            self._raise_shared_limit(kernel, shared_mem)
        if overlap and self.overlap:
            self._launch_overlapped(kernel, grid, block, shared_mem, stream, params)
            return
        # Grid, block and shared memory reach the driver unchecked: a bad one fails there (in
        # the bindings' conversion, or as CUDA_ERROR_INVALID_VALUE) and is phrased after.
        try:
            gx, gy, gz = grid
            bx, by, bz = block
            (err,) = cu.cuLaunchKernel(kernel, gx, gy, gz, bx, by, bz, shared_mem, stream, params, 0)
        except (TypeError, ValueError, OverflowError):
            launch_config.check(grid, block, shared_mem)
            raise
        if err:
            raise self._launch_error(err, "cuLaunchKernel", kernel, grid, block, shared_mem)

    def _launch_overlapped(self, kernel: KernelHandle, grid: Sequence[int], block: Sequence[int],
                           shared_mem: int, stream: int, params: int) -> None:
        try:
            config = _overlap_config(tuple(grid), tuple(block), shared_mem, stream)
            (err,) = cu.cuLaunchKernelEx(config, kernel, params, 0)
        except (TypeError, ValueError, OverflowError):
            launch_config.check(grid, block, shared_mem)
            raise
        if err:
            raise self._launch_error(err, "cuLaunchKernelEx", kernel, grid, block, shared_mem)

    def _launch_error(self, err: Any, call_name: str, kernel: KernelHandle, grid: Sequence[int],
                      block: Sequence[int], shared_mem: int) -> Exception:
        """A bad configuration refused as such (the driver says CUDA_ERROR_INVALID_VALUE), else
        the driver's error naming the kernel and the configuration."""
        launch_config.check(grid, block, shared_mem)
        return CudaError(err, call_name, f"{self.kernel_name(kernel)} grid={tuple(grid)} "
                         f"block={tuple(block)} shared={shared_mem}")


@functools.lru_cache(maxsize=256)
def _overlap_config(grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int,
                    stream: int) -> Any:
    """A ``CUlaunchConfig`` with programmatic stream serialisation (programmatic dependent launch):
    the kernel may start while the previous kernel on the stream still runs, and waits for it
    (``griddepcontrol.wait``) only where it reads that kernel's output. Built once per shape:
    ``cuLaunchKernelEx`` reads it during the call."""
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared_mem
    config.hStream = cu.CUstream(stream)
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config.attrs = [attr]
    config.numAttrs = 1
    return config
