"""An offline ``CudaBackend``: built by its own ``__init__`` with the driver answering from Python,
then every driver call made to raise ``DriverReached``, so a case that passes on it refused (or
did nothing) before reaching the driver. This is the one place that knows ``gpu_runtime.gpu``'s
internals (``call``, ``driver``, ``cu``) and ``gpu_runtime.staging``'s ``call``."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from cuda.bindings import driver as cu

import gpu_runtime.gpu as gpu_module
import gpu_runtime.staging as staging_module
from gpu_runtime import CudaBackend, DevicePtr


class DriverReached(AssertionError):
    """Raised by every driver call of the offline backend: a refusal must come before it."""


class _OfflineDriver:
    """Stands in for ``cuda.bindings.driver`` in gpu.py: enums and structs are the real ones, every
    ``cu*`` function raises ``DriverReached``."""

    def __getattr__(self, name: str) -> Any:
        real = getattr(cu, name)
        if name.startswith("cu") and callable(real):
            def reached(*args: Any, **kwargs: Any) -> None:
                raise DriverReached(name)
            return reached
        return real


def _reached(fn: Any, *args: Any, detail: str = "") -> None:
    raise DriverReached(getattr(fn, "__name__", repr(fn)))


@dataclass
class Target:
    """What the ``CudaBackend`` cases act on: ``ptr`` is 4096 bytes 256 bytes into an allocation,
    ``pinned`` a whole ``alloc_host`` buffer, ``host`` a random host array used as a download
    target, ``closed`` a closed backend."""

    ptr: DevicePtr
    pinned: np.ndarray
    host: np.ndarray
    stream: int
    event: int
    closed: CudaBackend


def offline_backends(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
                     ) -> tuple[CudaBackend, Target]:
    """A ``CudaBackend`` built by its own ``__init__`` with the driver answering from Python
    (fake addresses; real host memory for pinned buffers), a ``Target`` on it and a closed twin;
    then every driver call is made to raise ``DriverReached``."""
    keep: list[Any] = []
    next_handle = [0x7F00_0000_0000]

    def permissive(fn: Any, *args: Any, detail: str = "") -> Any:
        name = getattr(fn, "__name__", "")
        if name == "cuDeviceGetName":
            return b"offline\0"
        if name in ("cuMemAlloc", "cuStreamCreate", "cuEventCreate"):
            next_handle[0] += 1 << 20
            return next_handle[0]
        if name == "cuMemHostAlloc":
            buf = ctypes.create_string_buffer(int(args[0]))
            keep.append(buf)
            return ctypes.addressof(buf)
        return 0

    monkeypatch.setattr(gpu_module, "call", permissive)
    monkeypatch.setattr(gpu_module.driver, "init", lambda: None)
    monkeypatch.setattr(gpu_module.driver, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_module.driver, "compute_capability", lambda device: (9, 0))
    backend, closed = CudaBackend(), CudaBackend()
    closed.close()
    base = backend.alloc(8192)
    pinned = backend.alloc_host(4096)
    pinned[:] = rng.integers(0, 256, 4096, dtype=np.uint8)
    target = Target(base.offset(256), pinned, rng.integers(0, 256, 64, dtype=np.uint8),
                    backend.create_stream(), backend.create_event(), closed)
    monkeypatch.setattr(gpu_module, "call", _reached)
    monkeypatch.setattr(staging_module, "call", _reached)
    monkeypatch.setattr(gpu_module, "cu", _OfflineDriver())
    backend._keep = keep  # the pinned buffers' memory lives as long as the backend
    return backend, target

