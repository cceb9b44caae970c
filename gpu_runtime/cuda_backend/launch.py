"""Launches: the thread's prebuilt argument buffer filled with the values, then the driver.

Two entry points share the submission: ``launch`` (``KernelLaunch``: kinds and values by
position, already range-checked by the builder; packed here) and ``launch_spec``
(``KernelSpec``: packed by the spec into its own buffer). Both check each new kernel and
argument shape once (``kernels.py``); the rest is what every launch pays, so it is kept to a
few lookups. Once a (kernel, spec) pair or a (kernel, kinds) shape passed on a thread, the
launcher gets a direct route (``KernelSpec.allow_direct``, ``KernelLaunch.allow_direct``): that
thread's plain launches of it then call ``cuLaunchKernel`` from the launcher and only come here
to phrase a refusal (a route also takes launches over 48 KiB of shared memory once
``_shared_set`` holds the kernel's opt-in to that much). Every launch hands the driver the
kernel's ``CUfunction`` object, which the bindings convert faster than the ``KernelHandle`` int.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from cuda.bindings import driver as cu

from .. import launch_config
from ..errors import CudaError
from ..kernel_args import KernelLaunch
from ..launch_config import SHARED_WITHOUT_OPT_IN
from ..launch_spec import KernelSpec
from ..pointers import KernelHandle
from .context import _alive
from .kernels import CudaKernels


class CudaLaunch(CudaKernels):
    def launch(
        self,
        kernel: KernelHandle,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: int,
        kinds: str,
        args: Sequence[int | float | bytes],
        *,
        overlap: bool = False,
    ) -> None:
        try:
            plan = self._tls.shapes[(kernel, kinds)]
        except (AttributeError, KeyError):  # a new thread, or a new launch shape on this one
            plan = self._launch_shape(kernel, kinds)
            self._keep_routes(
                KernelLaunch.allow_direct(
                    kernel,
                    kinds,
                    self,
                    plan.pack,
                    plan.params,
                    cu.cuLaunchKernel,
                    self._launch_error,
                    self._shared_set,
                    self._functions.get(kernel, kernel),
                )
            )
        plan.pack(args)
        self._submit(kernel, plan.params, grid, block, shared_mem, stream, overlap)

    def launch_spec(
        self,
        spec: KernelSpec,
        kernel: KernelHandle,
        grid: Sequence[int],
        block: Sequence[int],
        shared_mem: int,
        stream: int,
        params: int,
        values: Sequence[Any],
        overlap: bool = False,
    ) -> None:
        try:
            checked = self._tls.specs[kernel] is spec
        except (AttributeError, KeyError):  # a new thread, or a new kernel on this one
            checked = False
        if not checked:
            self._check_spec(kernel, spec)
            self._keep_routes(
                spec.allow_direct(
                    kernel,
                    self,
                    cu.cuLaunchKernel,
                    self._launch_error,
                    self._shared_set,
                    self._functions.get(kernel, kernel),
                )
            )
        self._submit(kernel, params, grid, block, shared_mem, stream, overlap)

    def _keep_routes(self, table: dict[Any, Any]) -> None:
        """Remember a launcher's per-thread table of direct routes, from which close() removes
        this backend's."""
        with self._lock:
            tables = self._direct_tables  # (a thread that ended needs its routes no more: dropped here)
            for key in [k for k, (thread, _) in tables.items() if not _alive(thread)]:
                del tables[key]
            tables[id(table)] = (weakref.ref(threading.current_thread()), table)

    def _submit(
        self,
        kernel: KernelHandle,
        params: int,
        grid: Sequence[int],
        block: Sequence[int],
        shared_mem: int,
        stream: int,
        overlap: bool,
    ) -> None:
        """``kernel`` launched with its packed ``params`` (both entry points' checks done):
        ``cuLaunchKernel``, or for ``overlap`` (unless ``GPU_RUNTIME_OVERLAP=0``)
        ``cuLaunchKernelEx`` with programmatic stream serialisation. Grid, block and shared
        memory reach the driver unchecked (a ``KernelSpec`` launch's): a bad one fails there (in
        the bindings' conversion, or as CUDA_ERROR_INVALID_VALUE) and is phrased after."""
        if shared_mem > SHARED_WITHOUT_OPT_IN and self._shared_set.get(kernel, 0) < shared_mem:
            self._raise_shared_limit(kernel, shared_mem)
        function = self._functions.get(kernel, kernel)
        try:
            if overlap and self.overlap:
                call_name = "cuLaunchKernelEx"
                config = _overlap_config(tuple(grid), tuple(block), shared_mem, stream)
                (err,) = cu.cuLaunchKernelEx(config, function, params, 0)
            else:
                call_name = "cuLaunchKernel"
                gx, gy, gz = grid
                bx, by, bz = block
                (err,) = cu.cuLaunchKernel(function, gx, gy, gz, bx, by, bz, shared_mem, stream, params, 0)
        except (TypeError, ValueError, OverflowError):
            launch_config.check(grid, block, shared_mem)
            raise
        if err:
            raise self._launch_error(err, call_name, kernel, grid, block, shared_mem)

    def _launch_error(
        self, err: Any, call_name: str, kernel: KernelHandle, grid: Sequence[int], block: Sequence[int], shared_mem: int
    ) -> Exception:
        """A bad configuration refused as such (the driver says CUDA_ERROR_INVALID_VALUE), else
        the driver's error naming the kernel and the configuration."""
        launch_config.check(grid, block, shared_mem)
        return CudaError(
            err, call_name, f"{self.kernel_name(kernel)} grid={tuple(grid)} block={tuple(block)} shared={shared_mem}"
        )


@functools.lru_cache(maxsize=256)
def _overlap_config(grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int, stream: int) -> Any:
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
