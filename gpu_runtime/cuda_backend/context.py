"""The device and its primary context: what every area of ``CudaBackend`` stands on.

The context is made current on each thread at that thread's first call (``_bind``), which also
gives the thread its own packed-argument plans and tables of the launches it has checked;
``_live`` is the check every public call starts with: the backend is open, and bound on this
thread.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from cuda.bindings import driver as cu

from .. import compiler, driver, validate
from ..driver import call
from ..errors import CudaError, NoDeviceError, attempt_each
from ..packing import ArgPlan

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
        self._tls = threading.local()
        # each thread's checked launches, beside a weak reference to the thread
        self._thread_tables: list[tuple[Any, dict[Any, Any]]] = []
        self._bind_thread()
        # GPU_RUNTIME_OVERLAP=0 runs overlap=True launches as plain ones (a tool that cannot
        # follow programmatic dependent launches, or to rule them out when hunting a race).
        self.overlap = os.environ.get("GPU_RUNTIME_OVERLAP", "1") != "0"
        self._closed = False

    def _attribute(self, attr: Any) -> int:
        return int(call(cu.cuDeviceGetAttribute, attr, self._dev))

    @property
    def closed(self) -> bool:
        return self._closed

    def _bind(self) -> None:
        """Make the context current on this thread: once per thread, and again whenever another
        backend (another device: one process driving several GPUs) was used since."""
        if getattr(_CURRENT, "ctx", None) is not self._ctx and not self._closed:  # closed: the caller says so
            call(cu.cuCtxSetCurrent, self._ctx)
            _CURRENT.ctx = self._ctx
        if not hasattr(self._tls, "shapes"):
            validate.require_open(self._closed, "CudaBackend")
            self._bind_thread()

    def _bind_thread(self) -> None:
        """This thread's tables: argument plans by kinds; the (kernel, kinds) launch shapes and
        the kernel -> ``KernelSpec`` pairs it has checked (cleared on close, so that a launch on
        a closed backend meets the checks again, and their refusal)."""
        shapes: dict[tuple[int, str], ArgPlan] = {}
        specs: dict[int, Any] = {}
        with self._lock:  # (a thread that ended needs its tables no more: dropped here)
            me = weakref.ref(threading.current_thread())
            self._thread_tables = [(t, table) for t, table in self._thread_tables if _alive(t)]
            self._thread_tables += [(me, shapes), (me, specs)]
        self._tls.plans = {}
        self._tls.shapes = shapes
        self._tls.specs = specs

    def _live(self) -> None:
        """Every public call's first check: the backend is open and bound on this thread."""
        validate.require_open(self._closed, "CudaBackend")
        self._bind()

    def _release_all(self, destroy: Any, handles: set[int] | dict[int, Any]) -> None:
        """At close: ``destroy`` each of ``handles`` (a set of them, or a dict keyed by them),
        then forget them, refused or not (``_release_each``)."""
        try:
            self._release_each(destroy, handles)
        finally:
            handles.clear()

    def _release_each(self, destroy: Any, handles: Iterable[Any]) -> None:
        """At close: ``destroy`` each of ``handles``, every one attempted even after a refusal
        (after a kernel fault the driver may refuse some); the first refusal is raised after the
        last attempt."""
        attempt_each([functools.partial(call, destroy, handle) for handle in handles], CudaError)

    def _synchronize_context(self) -> None:
        call(cu.cuCtxSynchronize)

    def _release_context(self) -> None:
        call(cu.cuDevicePrimaryCtxRelease, self._dev)


def _alive(thread: Any) -> bool:
    """``thread`` (a weak reference to a ``threading.Thread``) still running."""
    t = thread()
    return t is not None and t.is_alive()
