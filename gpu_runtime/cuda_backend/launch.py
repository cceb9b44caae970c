"""Launches on the driver: ``bind`` makes a loaded kernel a ``Kernel`` once; its ``launch`` and
``prepare`` are closures over all a launch needs (it reads no attribute, looks up only the
thread's argument buffer and the config's driver form) and end in one ``cuLaunchKernelEx``, whose
``CUlaunchConfig`` is built once per ``LaunchConfig`` and stream. A kernel is opted in to more
than 48 KiB of dynamic shared memory when a launch first asks for it (a prepared one: when
prepared). ``GPU_RUNTIME_OVERLAP=0`` (read at import) launches ``overlap=True`` configs as plain
ones: for a tool that cannot follow programmatic dependent launches, or to rule them out.
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
from ..driver import call
from ..errors import ClosedError, CudaError
from ..launch import SHARED_WITHOUT_OPT_IN, Kernel, LaunchConfig, PreparedLaunch
from ..pointers import KernelHandle
from .kernels import CudaKernels

OVERLAP = os.environ.get("GPU_RUNTIME_OVERLAP", "1") != "0"
_RETRY = (cu.CUresult.CUDA_ERROR_INVALID_CONTEXT, cu.CUresult.CUDA_ERROR_INVALID_HANDLE)
_ATTR = cu.CUlaunchAttributeID


class CudaLaunch(CudaKernels):
    _bound: dict[int, Kernel]  # kernel handle -> its Kernel
    _prepared: weakref.WeakSet[PreparedLaunch]  # the prepared launches alive, closed with the backend

    def _init_launches(self) -> None:
        self._bound = {}
        self._prepared = weakref.WeakSet()

    def bind(self, kernel: KernelHandle) -> Kernel:
        """``kernel`` as a ``Kernel`` (made and checked once, then looked up). Raises ``TypeError``
        for a non-handle, ``ValueError`` for a null one, ``GpuError`` for one this backend did not load,
        ``ClosedError`` once closed, and ``TypeError`` where its source's signature and the driver's
        parameter layout differ."""
        bound = self._bound.get(kernel) if type(kernel) is KernelHandle else None
        return bound if bound is not None else self._bind_kernel(kernel)

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
                made = Kernel(self, KernelHandle(kernel), name, signature)
                made.launch, made.prepare = _launches(self, made, self._functions[int(kernel)])
                self._bound[kernel] = made
            return made

    def _release_launches(self) -> None:
        """At close: every bound kernel and prepared launch raises ``ClosedError`` from then on (a
        runner may still hold one)."""
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
        attrs = [cu.CUlaunchAttribute() for _ in range((config.overlap and OVERLAP) + (config.cluster is not None))]
        if config.overlap and OVERLAP:
            attrs[0].id = _ATTR.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attrs[0].value.programmaticStreamSerializationAllowed = 1
        if config.cluster is not None:
            attrs[-1].id = _ATTR.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            dim = attrs[-1].value.clusterDim
            dim.x, dim.y, dim.z = config.cluster
        if attrs:
            made.attrs = attrs
            made.numAttrs = len(attrs)
        config.driver[stream] = made
        return made

    def _opt_in(self, kernel: Kernel, nbytes: int, opted: list[int]) -> None:
        """Let ``kernel`` launch with ``nbytes`` of dynamic shared memory (``opted[0]``: what it
        may now; only ever raised, under the lock: two threads cannot lower it)."""
        with self._lock:
            if nbytes <= opted[0]:
                return
            if nbytes > self.max_shared_optin:
                raise ValueError(
                    f"{kernel.name}: {nbytes} bytes of shared memory, device allows {self.max_shared_optin}"
                )
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            call(cu.cuFuncSetAttribute, self._functions[int(kernel.handle)], attr, nbytes)
            opted[0] = nbytes

    def _retry(self, err: Any, kernel: Kernel, config: LaunchConfig, driver: Any, params: int) -> None:
        """A launch the driver rejected: once more where this thread's current context was
        another backend's (made ours first); else its error, naming the kernel and the config."""
        if err in _RETRY:
            self._bind()
            (err,) = cu.cuLaunchKernelEx(driver, self._functions[int(kernel.handle)], params, 0)
            if not err:
                return
        raise CudaError(err, "cuLaunchKernelEx", f"{kernel.name} {config!r}")


def _launches(gpu: CudaLaunch, kernel: Kernel, function: Any) -> tuple[Any, Any]:
    """``kernel.launch(config, stream, *args)`` and ``kernel.prepare(config, *args)`` for this
    backend (``Kernel``'s contract). A prepared launch packs into a buffer of its own; a run on a
    thread where another context is current (or none) is rejected by the driver and retried once
    the context is made current."""
    layout, name = kernel.layout, kernel.name
    refusal, new_buffers = layout.refusal, layout.buffers
    driver_config, opt_in, retry, launch_ex = gpu._driver_config, gpu._opt_in, gpu._retry, cu.cuLaunchKernelEx
    check_stream = validate.stream
    opted = [SHARED_WITHOUT_OPT_IN]  # dynamic shared memory the kernel may launch with
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
        if config.shared_mem > opted[0]:
            opt_in(kernel, config.shared_mem, opted)
        (err,) = launch_ex(driver, function, params, 0)
        if err:
            retry(err, kernel, config, driver, params)

    def prepare(config: LaunchConfig, *args: Any) -> PreparedLaunch:
        if not isinstance(config, LaunchConfig):
            raise TypeError(f"{name}: config must be a gpu_runtime.LaunchConfig, got {type(config).__name__}")
        buffer, params, pointers = new_buffers()
        try:
            layout.packer.pack_into(buffer, 0, *args)
        except (struct.error, TypeError, ValueError, OverflowError):
            raise refusal(name, args) from None
        if config.shared_mem > opted[0]:
            opt_in(kernel, config.shared_mem, opted)

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

        run.keep = (buffer, pointers)  # type: ignore[attr-defined]  # alive while run is: the driver reads them
        prepared = PreparedLaunch(kernel, config, args)
        prepared.run = run
        gpu._prepared.add(prepared)
        return prepared

    return launch, prepare


def _closed(*args: Any) -> Any:
    raise ClosedError("kernel launch: the backend is closed")
