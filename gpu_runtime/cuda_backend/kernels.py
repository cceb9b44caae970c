"""Kernels: NVRTC modules loaded from ``.cu`` sources, and the checks a kernel passes once,
when it is first bound (``launch.py``): its signature, read from its source, against the
parameter layout the driver reports.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

from cuda.bindings import driver as cu

from .. import compiler
from ..driver import call
from ..errors import ClosedError, CudaError, GpuError, KernelNotFoundError
from ..launch import ArgLayout
from ..pointers import KernelHandle
from ..signatures import Signature, module_signatures
from .context import CudaContext

_log = logging.getLogger(__name__)


class _Loaded(NamedTuple):
    module: str  # the source file's stem, for messages
    name: str
    path: Path


class CudaKernels(CudaContext):
    _modules: dict[Path, Any]
    _signatures: dict[Path, dict[str, Signature]]
    _kernels: dict[tuple[Any, str], KernelHandle]  # (source as given, name) -> handle
    _loaded: dict[int, _Loaded]
    _functions: dict[int, Any]  # kernel -> the driver's CUfunction (the bindings convert it faster than an int)

    def _init_kernels(self) -> None:
        self._modules = {}
        self._signatures = {}
        self._kernels = {}
        self._loaded = {}
        self._functions = {}

    def _release_kernels(self) -> None:
        try:
            self._release_each(cu.cuModuleUnload, self._modules.values())
        finally:
            self._modules.clear()
            self._kernels.clear()
            self._loaded.clear()
            self._functions.clear()

    # -- loading ----------------------------------------------------------------------------
    def kernel(self, source: str | os.PathLike, name: str) -> KernelHandle:
        """Load kernel ``name`` of the ``.cu`` file ``source`` (compiled by NVRTC, or read from the
        kernel cache) and return its handle, cached per (source, name). Raises ``KernelNotFoundError``
        for a missing file or kernel, ``NvrtcError`` when the source does not compile."""
        handle = self._kernels.get((source, name))
        if handle is not None:
            return handle
        self._live()
        with self._lock:
            path = Path(source)
            mod = self._module(path)
            try:
                fn = call(cu.cuModuleGetFunction, mod, name.encode())
            except CudaError as exc:
                raise KernelNotFoundError(f"kernel {name!r} not in module {path.stem!r} ({exc.name})") from exc
            handle = KernelHandle(int(fn))
            self._kernels[(source, name)] = handle
            self._loaded[int(handle)] = _Loaded(path.stem, name, path.resolve())
            self._functions[int(handle)] = fn
            return handle

    def _module(self, path: Path) -> Any:
        if not path.is_file():
            raise KernelNotFoundError(f"no kernel module {path.stem!r} ({path} does not exist)")
        key = path.resolve()
        loaded = self._modules.get(key)
        if loaded is not None:
            return loaded
        signatures = module_signatures(path)  # first: a source it refuses loads nothing
        compiled = compiler.compile_module(path, self.target, self.options)
        try:
            loaded = call(cu.cuModuleLoadData, compiled.image)
        except CudaError:
            if not compiled.cached:
                raise
            compiler.evict(path, self.target)  # a stale or damaged entry: rebuild it once
            _log.info("kernel module %r: the cached %s image did not load; compiling it again", path.stem, self.target)
            compiled = compiler.compile_module(path, self.target, self.options)
            loaded = call(cu.cuModuleLoadData, compiled.image)
        self._modules[key] = loaded
        self._signatures[key] = signatures
        return loaded

    def kernel_name(self, kernel: int) -> str:
        """``module.kernel`` of a handle this backend loaded, for messages; an unknown handle gives
        ``?.<unknown kernel 0x...>`` rather than raising."""
        loaded = self._loaded.get(int(kernel))
        if loaded is None:
            return f"?.<unknown kernel 0x{int(kernel):x}>"
        return f"{loaded.module}.{loaded.name}"

    # -- checks, once per kernel ------------------------------------------------------------
    def _loaded_kernel(self, kernel: int) -> _Loaded:
        loaded = self._loaded.get(int(kernel))
        if loaded is None:
            if self._closed:
                raise ClosedError(f"kernel handle 0x{int(kernel):x}: backend is closed")
            raise GpuError(f"kernel handle 0x{int(kernel):x}: not loaded by this backend")
        return loaded

    def _signature(self, kernel: int) -> tuple[str, Signature]:
        """The kernel's name (module.kernel) and its signature read from its source, checked
        against the parameter layout the driver reports (``TypeError`` where they differ)."""
        loaded = self._loaded_kernel(kernel)
        where = f"{loaded.module}.{loaded.name}"
        signature = self._signatures[loaded.path].get(loaded.name)
        if signature is None:
            raise TypeError(f'{where}: no signature found in its source (an extern "C" __global__ declaration)')
        layout = ArgLayout(signature)
        self._check_layout(kernel, where, layout.offsets, layout.sizes)
        return where, signature

    def _check_layout(self, kernel: int, where: str, offsets: list[int], sizes: list[int]) -> None:
        layout = self._param_layout(kernel)
        if layout is None:  # this driver cannot report layouts
            return
        if len(layout) != len(sizes):
            raise TypeError(f"{where}: takes {len(layout)} arguments, {len(sizes)} given")
        # The driver reports offsets from the base of the kernel's parameter bank, which is 8-byte
        # but not 64-byte aligned: a tensor map (64-byte aligned) then sits elsewhere than the C
        # layout from 0 says. Each argument reaches the driver through its own pointer, so with
        # one there only the sizes are compared.
        exact = max(sizes, default=0) <= 8
        for i, (offset, size) in enumerate(layout):
            if size != sizes[i] or (exact and offset != offsets[i]):
                raise TypeError(
                    f"{where}: argument {i} is {size} bytes at offset {offset}, "
                    f"launch packs {sizes[i]} bytes at offset {offsets[i]}"
                )

    @staticmethod
    def _param_layout(kernel: int) -> list[tuple[int, int]] | None:
        """(offset, size) of each parameter from the driver (CUDA 12.4+), None where the driver
        cannot say. Where the driver has ``cuFuncGetParamCount`` no call goes past the last one;
        elsewhere the end is found by probing (one CUDA_ERROR_INVALID_VALUE, once per kernel)."""
        info = getattr(cu, "cuFuncGetParamInfo", None)
        if info is None:
            return None
        count = None
        try:  # the bindings may know it while the driver (13.0) does not: RuntimeError
            err, value = cu.cuFuncGetParamCount(kernel)
            count = None if err else int(value)
        except (AttributeError, RuntimeError):
            pass
        layout: list[tuple[int, int]] = []
        while count is None or len(layout) < count:
            err, offset, size = info(kernel, len(layout))
            if err == cu.CUresult.CUDA_ERROR_INVALID_VALUE and count is None:
                return layout  # probed past the last parameter
            if err:
                return None
            layout.append((int(offset), int(size)))
        return layout
