"""An offline ``CudaBackend``: built by its own ``__init__`` on the scripted driver, then every
driver call made to raise ``DriverReached``, so a case that passes on it refused (or did nothing)
before reaching the driver. Besides ``tests.helpers.scripted_driver``, this knows
``gpu_runtime.staging``'s ``call``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from cuda.bindings import driver as cu

import gpu_runtime.staging as staging_module
from gpu_runtime import CudaBackend, DevicePtr
from tests.helpers.scripted_driver import DriverReached, install_scripted_driver, replace_driver


class _OfflineDriver:
    """Stands in for ``cuda.bindings.driver`` in ``CudaBackend``'s modules: enums and structs are
    the real ones, every ``cu*`` function raises ``DriverReached``."""

    def __getattr__(self, name: str) -> Any:
        real = getattr(cu, name)
        if name.startswith("cu") and callable(real):
            def reached(*args: Any, **kwargs: Any) -> None:
                raise DriverReached(name)
            reached.__name__ = name  # what ``call`` names in its message
            return reached
        return real


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
    """A ``CudaBackend`` built by its own ``__init__`` on the scripted driver (fake addresses; real
    host memory for pinned buffers), a ``Target`` on it and a closed twin; then every driver call,
    through ``call`` or straight to ``cu``, is made to raise ``DriverReached``."""
    driver = install_scripted_driver(monkeypatch)
    backend, closed = CudaBackend(), CudaBackend()
    closed.close()
    base = backend.alloc(8192)
    pinned = backend.alloc_host(4096)
    pinned[:] = rng.integers(0, 256, 4096, dtype=np.uint8)
    target = Target(base.offset(256), pinned, rng.integers(0, 256, 64, dtype=np.uint8),
                    backend.create_stream(), backend.create_event(), closed)
    driver.strict = True
    offline = _OfflineDriver()
    monkeypatch.setattr(staging_module, "call", driver)
    monkeypatch.setattr(staging_module, "cu", offline)
    replace_driver(monkeypatch, "cu", offline)
    backend._keep = driver.keep  # the pinned buffers' memory lives as long as the backend
    return backend, target

