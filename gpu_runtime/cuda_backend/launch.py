"""Launches on the driver: ``bind`` makes a loaded kernel a ``Kernel`` once, and its ``launch`` is
a closure over everything a launch needs, so that a call reads no attribute and looks nothing up
but the calling thread's argument buffer and the config's driver form for its stream.

Every launch is one ``cuLaunchKernelEx``: a ``CUlaunchConfig`` (grid, block, shared memory,
stream and the launch attributes: programmatic dependent launch, cluster) is built once per
``LaunchConfig`` and stream and kept on the config, and the bindings convert its object faster
than ``cuLaunchKernel``'s eleven arguments. ``GPU_RUNTIME_OVERLAP=0`` in the environment (read
once, at import) launches ``overlap=True`` configs as plain ones: for a tool that cannot follow
programmatic dependent launches, or to rule them out when hunting a race.
"""

from __future__ import annotations

import functools
import os
import struct
import threading
import weakref
from typing import Any

from cuda.bindings import driver as cu

from .. import validate
from ..errors import ClosedError, CudaError
from ..launch import Kernel, LaunchConfig, PreparedLaunch
from ..pointers import KernelHandle
from .kernels import CudaKernels

OVERLAP = os.environ.get("GPU_RUNTIME_OVERLAP", "1") != "0"
_RETRY = (cu.CUresult.CUDA_ERROR_INVALID_CONTEXT, cu.CUresult.CUDA_ERROR_INVALID_HANDLE)


class CudaLaunch(CudaKernels):
    _bound: dict[int, Kernel]  # kernel handle -> its Kernel
    _prepared: weakref.WeakSet[PreparedLaunch]  # the prepared launches alive, closed with the backend

    def _init_launches(self) -> None:
        self._bound = {}
        self._prepared = weakref.WeakSet()

    def bind(self, kernel: KernelHandle) -> Kernel:
        try:
            return self._bound[kernel]
        except (KeyError, TypeError):
            return self._bind_kernel(kernel)

    def _bind_kernel(self, kernel: KernelHandle) -> Kernel:
        if isinstance(kernel, bool) or not isinstance(kernel, int):
            raise TypeError(f"bind: kernel must be a KernelHandle, got {type(kernel).__name__}")
        if not kernel:
            raise ValueError("bind: null kernel handle (the kernel was not loaded)")
        if self._closed:
            raise ClosedError(f"kernel handle 0x{int(kernel):x}: the backend is closed")
        self._live()
        with self._lock:
            made = self._bound.get(kernel)
            if made is None:
                name, signature = self._signature(kernel)
                self._opt_in_shared(kernel)
                made = Kernel(self, KernelHandle(kernel), name, signature)
                made.launch = _launcher(self, made, self._functions[int(kernel)])
                made.prepare = _preparer(self, made, self._functions[int(kernel)])
                self._bound[kernel] = made
            return made

    def _release_launches(self) -> None:
        """At close: every bound kernel's launch refuses (a runner may still hold one)."""
        for kernel in self._bound.values():
            kernel.launch = kernel.prepare = _closed
        for prepared in list(self._prepared):
            prepared.run = _closed
        self._bound.clear()
        self._prepared.clear()

    def _driver_config(self, config: LaunchConfig, stream: int) -> Any:
        """``config`` on ``stream`` as the driver takes it, made once and kept on the config."""
        if not isinstance(config, LaunchConfig):
            raise TypeError(f"launch: config must be a gpu_runtime.LaunchConfig, got {type(config).__name__}")
        stream = validate.stream(stream, "launch: stream")
        made = cu.CUlaunchConfig()
        made.gridDimX, made.gridDimY, made.gridDimZ = config.grid
        made.blockDimX, made.blockDimY, made.blockDimZ = config.block
        made.sharedMemBytes = config.shared_mem
        made.hStream = cu.CUstream(stream)
        attrs = []
        if config.overlap and OVERLAP:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        if config.cluster is not None:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = config.cluster
            attrs.append(attr)
        if attrs:
            made.attrs = attrs
            made.numAttrs = len(attrs)
        config.driver[stream] = made
        return made

    def _retry(self, err: Any, kernel: Kernel, config: LaunchConfig, driver: Any, params: int) -> None:
        """A launch the driver refused: once more where this thread's current context was
        another backend's (made ours first); else its error, naming the kernel and the config."""
        if err in _RETRY:
            self._bind()
            (err,) = cu.cuLaunchKernelEx(driver, self._functions[int(kernel.handle)], params, 0)
            if not err:
                return
        detail = f"{kernel.name} {config!r}"
        if config.shared_mem > self.max_shared_optin:
            raise ValueError(
                f"{detail}: {config.shared_mem} bytes of shared memory, device allows {self.max_shared_optin}"
            )
        raise CudaError(err, "cuLaunchKernelEx", detail)


def _launcher(gpu: CudaLaunch, kernel: Kernel, function: Any) -> Any:
    """``kernel.launch(config, stream, *args)`` for this backend (``Kernel``'s contract)."""
    layout, name = kernel.layout, kernel.name
    refusal, new_buffers = layout.refusal, layout.buffers
    driver_config, retry, launch_ex = gpu._driver_config, gpu._retry, cu.cuLaunchKernelEx
    check_stream = validate.stream
    local = threading.local()  # .args: this thread's (pack(*args) into its buffer, kernelParams)

    def thread_args() -> tuple[Any, int]:
        gpu._bind()  # the context current on this thread
        buffer, params, pointers = new_buffers()
        local.keep = (buffer, pointers)
        local.args = args = (functools.partial(layout.packer.pack_into, buffer, 0), params)
        return args

    def launch(config: LaunchConfig, stream: int, *args: Any) -> None:
        if type(stream) is not int:
            stream = check_stream(stream, f"{name}: stream")
        try:
            pack, params = local.args
        except AttributeError:  # this thread's first launch of the kernel
            pack, params = thread_args()
        try:
            pack(*args)
        except (struct.error, TypeError, ValueError, OverflowError):
            raise refusal(name, args) from None
        try:
            driver = config.driver[stream]
        except (KeyError, AttributeError):
            driver = driver_config(config, stream)
        (err,) = launch_ex(driver, function, params, 0)
        if err:
            retry(err, kernel, config, driver, params)

    return launch


def _preparer(gpu: CudaLaunch, kernel: Kernel, function: Any) -> Any:
    """``kernel.prepare(config, *args)`` for this backend: the arguments packed into a buffer of
    the launch's own, ``run`` a closure over it. A run on a thread where another context is
    current (or none) is refused by the driver and retried once the context is made current."""
    layout, name = kernel.layout, kernel.name
    driver_config, retry, launch_ex = gpu._driver_config, gpu._retry, cu.cuLaunchKernelEx
    check_stream = validate.stream

    def prepare(config: LaunchConfig, *args: Any) -> PreparedLaunch:
        if not isinstance(config, LaunchConfig):
            raise TypeError(f"{name}: config must be a gpu_runtime.LaunchConfig, got {type(config).__name__}")
        buffer, params, pointers = layout.buffers()
        try:
            layout.packer.pack_into(buffer, 0, *args)
        except (struct.error, TypeError, ValueError, OverflowError):
            raise layout.refusal(name, args) from None
        prepared = PreparedLaunch(kernel, config, args)

        def run(stream: int) -> None:
            if type(stream) is not int:
                stream = check_stream(stream, f"{name}: stream")
            try:
                driver = config.driver[stream]
            except KeyError:
                driver = driver_config(config, stream)
            (err,) = launch_ex(driver, function, params, 0)
            if err:
                retry(err, kernel, config, driver, params)

        run.keep = (buffer, pointers)  # type: ignore[attr-defined]  # alive while run is (its driver reads them)
        prepared.run = run
        gpu._prepared.add(prepared)
        return prepared

    return prepare


def _closed(*args: Any) -> Any:
    raise ClosedError("kernel launch: the backend is closed")
