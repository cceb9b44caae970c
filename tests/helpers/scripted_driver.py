"""A scripted CUDA driver: ``CudaBackend`` built by its own ``__init__`` on a machine without a
GPU, every driver call logged and answered from Python, or (``strict``) refused with
``DriverReached`` so a check can be shown to come before the driver. This is the one place that
knows how the runtime reaches the driver: ``gpu_runtime.driver`` (``init``, ``device_count``,
``compute_capability``) and, in each module of ``cuda_backend.DRIVER_MODULES``, ``call`` (the
status-checking wrapper) and ``cu`` (the bindings)."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
from cuda.bindings import driver as cu

from gpu_runtime import driver as driver_module
from gpu_runtime.cuda_backend import DRIVER_MODULES
from gpu_runtime.errors import CudaError


class DriverReached(AssertionError):
    """A driver call where a refusal should have come first."""


class ScriptedDriver:
    """Stands in for ``gpu_runtime.driver.call`` in ``CudaBackend``: logs every call and answers with
    plausible values (real host memory for ``cuMemHostAlloc``, a fixed offset for mapped
    device pointers); a call named in ``refuse`` fails as the driver's refusal would
    (``CudaError``); with ``strict`` set, every call raises ``DriverReached``."""

    DEV_OFFSET = 0x1_0000_0000_0000  # device address = host address + this (a fake, distinct VA)

    def __init__(self, read_only_supported: int = 1) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.strict = False
        self.refuse: set[str] = set()
        self.read_only_supported = read_only_supported
        self.keep: list[Any] = []
        self.handle = 0x7F00_0000_0000

    def __call__(self, fn: Any, *args: Any, detail: str = "") -> Any:
        name = getattr(fn, "__name__", repr(fn))
        if self.strict:
            raise DriverReached(name)
        self.calls.append((name, args))
        if name in self.refuse:
            raise CudaError(cu.CUresult.CUDA_ERROR_INVALID_VALUE, name, detail)
        if name == "cuDeviceGetName":
            return b"scripted\0"
        if name == "cuDeviceGetAttribute":
            ro = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED
            return self.read_only_supported if args[0] == ro else 0
        if name in ("cuMemAlloc", "cuStreamCreate", "cuEventCreate"):
            self.handle += 1 << 20
            return self.handle
        if name == "cuMemHostAlloc":
            buf = ctypes.create_string_buffer(int(args[0]))
            self.keep.append(buf)
            return ctypes.addressof(buf)
        if name == "cuMemHostGetDevicePointer":
            return int(args[0]) + self.DEV_OFFSET
        return 0

    def named(self, name: str) -> list[tuple]:
        """The arguments of every logged call of ``name``."""
        return [args for n, args in self.calls if n == name]


def launch_attributes(config: Any) -> dict[str, Any]:
    """What a ``CUlaunchConfig`` asks of the launch, by attribute: ``"overlap"`` (programmatic
    stream serialization allowed) and ``"cluster"`` (its dimensions); any other attribute by its
    id's name, with None."""
    found: dict[str, Any] = {}
    for attr in config.attrs[: config.numAttrs]:
        if attr.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION:
            found["overlap"] = attr.value.programmaticStreamSerializationAllowed
        elif attr.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION:
            dim = attr.value.clusterDim
            found["cluster"] = (dim.x, dim.y, dim.z)
        else:
            found[attr.id.name] = None
    return found


def replace_driver(monkeypatch: pytest.MonkeyPatch, name: str, value: Any) -> None:
    """Set ``name`` (``"call"`` or ``"cu"``) to ``value`` in every ``CudaBackend`` module that
    uses it, until the test ends."""
    for module in DRIVER_MODULES:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)


def scripted_device(monkeypatch: pytest.MonkeyPatch, call: Any) -> None:
    """``CudaBackend()`` finds one sm_90 device and calls the driver through ``call`` (a
    ``ScriptedDriver`` or a test's own), until the test ends."""
    replace_driver(monkeypatch, "call", call)
    monkeypatch.setattr(driver_module, "init", lambda: None)
    monkeypatch.setattr(driver_module, "device_count", lambda: 1)
    monkeypatch.setattr(driver_module, "compute_capability", lambda device: (9, 0))


def install_scripted_driver(monkeypatch: pytest.MonkeyPatch) -> ScriptedDriver:
    """Make ``CudaBackend()`` run on a new ``ScriptedDriver`` (one device, sm_90) until the test
    ends; returns the driver."""
    driver = ScriptedDriver()
    scripted_device(monkeypatch, driver)
    return driver
