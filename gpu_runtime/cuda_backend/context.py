"""The device and its primary context: what every area of ``CudaBackend`` stands on.

The context is made current on a thread at that thread's first call (``_bind``), and again
whenever another backend's was made current there since; ``_live`` is the check every public
call starts with: the backend is open, and its context current on this thread.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from cuda.bindings import driver as cu

from .. import compiler, driver, validate
from ..driver import call
from ..errors import CudaError, NoDeviceError, attempt_each

_CURRENT = threading.local()  # the context the backends last made current, per thread


class CudaContext:
    """One device's primary context (the one the CUDA runtime, CuPy and torch share)."""

    def __init__(self, device: int = 0, *, target: str | None = None, options: Sequence[str] = ()) -> None:
        driver.init()
        count = driver.device_count()
        if not 0 <= device < count:
            raise NoDeviceError(f"CUDA device {device} requested, {count} present")
        self.device = device
        self._dev = call(cu.cuDeviceGet, device)
        self._ctx = call(cu.cuDevicePrimaryCtxRetain, self._dev)
        call(cu.cuCtxSetCurrent, self._ctx)
        _CURRENT.ctx = self._ctx
        self.compute_capability = driver.compute_capability(device)
        self.target = target or compiler.target_for(*self.compute_capability)
        self.options = tuple(options)
        self.sm_count = self._attribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.l2_bytes = self._attribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        self.max_shared_optin = self._attribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        )
        self.name = call(cu.cuDeviceGetName, 256, self._dev).split(b"\0")[0].decode()
        self._lock = threading.RLock()
        self._closed = False

    def _attribute(self, attr: Any) -> int:
        return int(call(cu.cuDeviceGetAttribute, attr, self._dev))

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: every call but ``close`` then raises ``ClosedError``."""
        return self._closed

    def _bind(self) -> None:
        """Make the context current on this thread: at the thread's first call, and again
        whenever another backend (another device: one process driving several GPUs) was used
        there since."""
        if getattr(_CURRENT, "ctx", None) is not self._ctx:
            validate.require_open(self._closed, "CudaBackend")
            call(cu.cuCtxSetCurrent, self._ctx)
            _CURRENT.ctx = self._ctx

    def _live(self) -> None:
        """Every public call's first check: the backend is open and bound on this thread."""
        validate.require_open(self._closed, "CudaBackend")
        self._bind()

    def _release_all(self, destroy: Any, handles: set[int] | dict[int, Any]) -> None:
        """At close: ``destroy`` each of ``handles`` (a set of them, or a dict keyed by them),
        then forget them, destroyed or not (``_release_each``)."""
        try:
            self._release_each(destroy, handles)
        finally:
            handles.clear()

    def _release_each(self, destroy: Any, handles: Iterable[Any]) -> None:
        """At close: ``destroy`` each of ``handles``, every one attempted even after one fails
        (after a kernel fault the driver may fail some); the first ``CudaError`` is raised after
        the last attempt."""
        attempt_each([functools.partial(call, destroy, handle) for handle in handles], CudaError)

    def _synchronize_context(self) -> None:
        call(cu.cuCtxSynchronize)

    def _release_context(self) -> None:
        call(cu.cuDevicePrimaryCtxRelease, self._dev)
