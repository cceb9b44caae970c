"""Host memory the device uses: pinned buffers (``alloc_host``), optionally mapped into the
device's address space, and host ranges registered in place (``register_host``)."""

from __future__ import annotations

import ctypes
from functools import partial
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from .. import validate
from ..driver import call
from ..errors import attempt_each
from ..host_memory import HOST_PAGE, host_view
from ..pointers import DevicePtr
from .context import CudaContext


class CudaHostMemory(CudaContext):
    _host: dict[int, int]  # pinned host buffers: address -> bytes
    _mapped: set[int]  # the addresses of those that are mapped (DEVICEMAP)
    _registered: dict[int, tuple[int, Any]]  # address -> (bytes, the array)
    _read_only_register: bool | None  # the device attribute, read once

    def _init_host_memory(self) -> None:
        self._host = {}
        self._mapped = set()
        self._registered = {}
        self._read_only_register = None

    def _release_host_memory(self) -> None:
        attempt_each(  # the buffers are freed even where an unregistration was refused
            (
                partial(self._release_all, cu.cuMemHostUnregister, self._registered),
                partial(self._release_all, cu.cuMemFreeHost, self._host),
                self._mapped.clear,
            )
        )

    @property
    def host_registrations(self) -> int:
        """``register_host`` ranges not yet unregistered."""
        return len(self._registered)

    def alloc_host(self, nbytes: int, *, mapped: bool = False) -> np.ndarray:
        """``cuMemHostAlloc``: a page-locked uint8 array of ``nbytes`` (>= 1), portable and mapped into
        the device's address space when ``mapped``; owned until ``free_host`` or ``close``."""
        nbytes = validate.count(nbytes, "alloc_host size")
        if nbytes == 0:
            raise ValueError("alloc_host of 0 bytes")
        mapped = validate.boolean(mapped, "alloc_host: mapped")
        self._live()
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE if mapped else 0
        addr = int(call(cu.cuMemHostAlloc, nbytes, flags, detail=f"{nbytes} bytes{', mapped' if mapped else ''}"))
        with self._lock:
            self._host[addr] = nbytes
            if mapped:
                self._mapped.add(addr)
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))

    def free_host(self, array: np.ndarray) -> None:
        """Free a whole ``alloc_host`` buffer (the same array: address and size); raises ``ValueError``
        for anything else, or a buffer freed already."""
        addr = int(array.ctypes.data)
        self._live()
        with self._lock:
            if self._host.get(addr) != array.nbytes:
                raise ValueError(f"free_host of 0x{addr:x}: not a whole buffer from alloc_host (or freed twice)")
            del self._host[addr]
            self._mapped.discard(addr)
        call(cu.cuMemFreeHost, addr)

    def upload_pinned_async(self, host: np.ndarray, dst: int, stream: int = 0) -> None:
        """Queue a copy of ``host`` to ``dst`` on ``stream`` with no staging copy; raises
        ``ValueError`` unless ``host`` lies inside one ``alloc_host`` buffer. Leave ``host`` untouched
        until the copy has run."""
        dst = validate.pointer(dst, "upload_pinned_async destination")
        stream = validate.stream(stream, "upload_pinned_async stream")
        addr, nbytes, _ = host_view(host)
        self._live()
        with self._lock:  # alloc_host / free_host on another thread change the table
            inside = any(base <= addr and addr + nbytes <= base + size for base, size in self._host.items())
        if not inside:
            raise ValueError("upload_pinned_async: host buffer is not inside an alloc_host buffer")
        if nbytes:
            call(cu.cuMemcpyHtoDAsync, dst, addr, nbytes, stream)

    def _mapped_range(self, addr: int, nbytes: int) -> int | None:
        """The start of the mapped ``alloc_host`` buffer or registered range that holds
        ``[addr, addr + nbytes)``, None if none does."""
        with self._lock:
            for base in self._mapped:
                if base <= addr and addr + nbytes <= base + self._host[base]:
                    return base
            for base, (size, _) in self._registered.items():
                if base <= addr and addr + nbytes <= base + size:
                    return base
        return None

    def host_device_ptr(self, array: np.ndarray) -> DevicePtr:
        """The device address of ``array``, which must lie inside a mapped ``alloc_host`` buffer or a
        ``register_host`` range (``ValueError`` otherwise, ``TypeError`` for a non-array)."""
        if not isinstance(array, np.ndarray):
            raise TypeError(f"host_device_ptr: expected a numpy array, got {type(array).__name__}")
        addr, nbytes, _ = host_view(array)
        self._live()
        base = self._mapped_range(addr, nbytes)
        if base is None:
            raise ValueError(
                f"host_device_ptr of 0x{addr:x} (+{nbytes} bytes): not inside a mapped "
                "alloc_host buffer (alloc_host(..., mapped=True)) or a register_host range"
            )
        # The range's own address: cuMemHostGetDevicePointer is defined for it, then the offset.
        dev = int(call(cu.cuMemHostGetDevicePointer, base, 0, detail=f"host 0x{base:x}"))
        return DevicePtr(dev + (addr - base))

    def register_host(self, array: np.ndarray, *, read_only: bool = True) -> DevicePtr:
        """Page-lock and map a C-contiguous, page-aligned array in place (read-only for the device when
        ``read_only`` and the device supports it); returns its device address. Raises ``ValueError`` for
        an empty or misaligned array, or one that overlaps pinned memory this backend holds."""
        if not isinstance(array, np.ndarray):
            raise TypeError(f"register_host: expected a numpy array, got {type(array).__name__}")
        read_only = validate.boolean(read_only, "register_host: read_only")
        if not array.flags.c_contiguous:
            raise ValueError("register_host: host array must be C-contiguous")
        addr, nbytes = int(array.ctypes.data), int(array.nbytes)
        if nbytes == 0:
            raise ValueError("register_host of 0 bytes")
        if addr % HOST_PAGE:
            raise ValueError(f"register_host: address 0x{addr:x} is not {HOST_PAGE}-byte (page) aligned")
        if not read_only and not array.flags.writeable:
            raise ValueError("register_host: a read-only array needs read_only=True")
        self._live()
        with self._lock:
            for base, size in [*self._host.items(), *((b, s) for b, (s, _) in self._registered.items())]:
                if addr < base + size and base < addr + nbytes:
                    raise ValueError(
                        f"register_host of 0x{addr:x} (+{nbytes} bytes): overlaps pinned "
                        f"host memory at 0x{base:x} (+{size} bytes)"
                    )
        flags = cu.CU_MEMHOSTREGISTER_DEVICEMAP
        if read_only and self._supports_read_only_register():
            flags |= cu.CU_MEMHOSTREGISTER_READ_ONLY
        call(cu.cuMemHostRegister, addr, nbytes, flags, detail=f"0x{addr:x} +{nbytes} bytes")
        with self._lock:
            self._registered[addr] = (nbytes, array)  # the array keeps the memory mapped
        try:
            return self.host_device_ptr(array)
        except BaseException:
            self.unregister_host(array)
            raise

    def _supports_read_only_register(self) -> bool:
        if self._read_only_register is None:
            attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED
            self._read_only_register = bool(call(cu.cuDeviceGetAttribute, attr, self._dev))
        return self._read_only_register

    def unregister_host(self, array: np.ndarray) -> None:
        """Undo ``register_host(array)`` (the same address and size); raises ``ValueError`` for
        anything else, or a range unregistered already."""
        if not isinstance(array, np.ndarray):
            raise TypeError(f"unregister_host: expected a numpy array, got {type(array).__name__}")
        addr = int(array.ctypes.data)
        self._live()
        with self._lock:
            entry = self._registered.get(addr)
            if entry is None or entry[0] != array.nbytes:
                raise ValueError(
                    f"unregister_host of 0x{addr:x}: not a whole register_host range (or unregistered twice)"
                )
            del self._registered[addr]
        call(cu.cuMemHostUnregister, addr)
