"""Device pointers, kernel handles, the ``GpuBackend`` interface and its CUDA implementation.

The layers are written against ``GpuBackend`` only, so a test can record what a launcher builds
without a GPU; ``CudaBackend`` implements it on ``cuda.bindings.driver`` with the device's
primary context (the one the CUDA runtime, CuPy and torch share).
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from cuda.bindings import driver as cu

from . import compiler, driver
from .driver import call
from .errors import CudaError, GpuError, KernelNotFoundError, NoDeviceError
from .signatures import module_signatures
from .staging import PinnedStaging


class DevicePtr(int):
    """A device address; 0 is null. Behaves as an int, prints as hex."""

    __slots__ = ()

    def __new__(cls, value: int = 0) -> "DevicePtr":
        value = int(value)
        if not 0 <= value < 1 << 64:
            raise ValueError(f"device pointer out of range: {value}")
        return super().__new__(cls, value)

    def offset(self, nbytes: int) -> "DevicePtr":
        """The address ``nbytes`` further on (null stays an error, not a small address)."""
        if not self:
            raise ValueError("offset of a null DevicePtr")
        return DevicePtr(int(self) + nbytes)

    def __repr__(self) -> str:
        return f"DevicePtr(0x{int(self):x})"


class KernelHandle(int):
    """A loaded kernel; 0 means "not loaded" (``try_kernel`` on a missing kernel)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"KernelHandle(0x{int(self):x})"


Host = Any  # bytes, bytearray, memoryview or a numpy array


class GpuBackend(ABC):
    """What the layers need from a GPU. Streams are raw ``CUstream`` handles as ints, 0 = default."""

    @abstractmethod
    def kernel(self, module: str, name: str) -> KernelHandle:
        """Load ``kernels/<module>.cu`` if needed and return kernel ``name``; raises if missing."""

    @abstractmethod
    def alloc(self, nbytes: int) -> DevicePtr: ...

    @abstractmethod
    def free(self, ptr: int) -> None: ...

    @abstractmethod
    def memset(self, ptr: int, byte: int, nbytes: int, stream: int = 0) -> None: ...

    @abstractmethod
    def copy_h2d_async(self, host: Host, dst: int, stream: int = 0) -> None:
        """Upload ``host``; the caller may reuse ``host`` as soon as this returns."""

    @abstractmethod
    def copy_d2h(self, host_out: Host, src: int, stream: int = 0) -> None:
        """Fill ``host_out`` from ``src`` after the work queued on ``stream``; returns when done."""

    @abstractmethod
    def synchronize(self, stream: int = 0) -> None: ...

    @abstractmethod
    def create_stream(self) -> int: ...

    @abstractmethod
    def launch(self, kernel: KernelHandle, grid: tuple[int, int, int], block: tuple[int, int, int],
               shared_mem: int, stream: int, kinds: str, args: Sequence[int | float]) -> None:
        """Launch primitive behind ``KernelLaunch``: ``kinds`` has one letter per argument
        (``P`` pointer, ``U`` u32, ``I`` i32, ``F`` f32, ``L`` u64), already range-checked.
        ``KernelLaunch.launch(stream, overlap=True)`` passes ``overlap=True``: a programmatic
        dependent launch (the kernel may start before the previous one on the stream ends; it
        must wait for it itself). Backends that cannot overlap may run it as a plain launch."""

    def copy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                      height: int, stream: int = 0) -> None:
        """Device to device: ``height`` rows of ``width`` bytes, rows ``*_pitch`` bytes apart."""
        raise NotImplementedError(f"{type(self).__name__} has no pitched copies")

    # Optional: pinned host buffers and events, for code that overlaps host I/O with copies
    # (the row cache). Backends without them refuse clearly.
    def alloc_host(self, nbytes: int, *, mapped: bool = False) -> np.ndarray:
        """A page-locked uint8 host buffer (the DMA engine reads it directly); ``mapped=True``
        also maps it into the device's address space (``host_device_ptr``: kernels read it in
        place, over PCIe)."""
        raise NotImplementedError(f"{type(self).__name__} has no pinned host memory")

    def free_host(self, array: np.ndarray) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no pinned host memory")

    # Optional: host memory the device reads in place (zero-copy), for tables bigger than the
    # device. Backends without it refuse clearly.
    def host_device_ptr(self, array: np.ndarray) -> DevicePtr:
        """The device address of ``array``, which lies inside a mapped ``alloc_host`` buffer or
        a ``register_host`` range."""
        raise NotImplementedError(f"{type(self).__name__} has no mapped host memory")

    def register_host(self, array: np.ndarray, *, read_only: bool = True) -> DevicePtr:
        """Page-lock a page-aligned, C-contiguous host array where it is (e.g. a read-only
        ``np.memmap`` of a file), map it for the device and return its device address.
        ``read_only``: the device only reads it (required for a read-only mapping)."""
        raise NotImplementedError(f"{type(self).__name__} has no mapped host memory")

    def unregister_host(self, array: np.ndarray) -> None:
        """Undo ``register_host(array)`` (the same array: its address and size)."""
        raise NotImplementedError(f"{type(self).__name__} has no mapped host memory")

    def upload_pinned_async(self, host: np.ndarray, dst: int, stream: int = 0) -> None:
        """Copy from (a view of) an ``alloc_host`` buffer with no staging copy. The DMA reads
        ``host`` after this returns: do not touch it before an event recorded after the copy."""
        raise NotImplementedError(f"{type(self).__name__} has no pinned host memory")

    def create_event(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} has no events")

    def record_event(self, event: int, stream: int = 0) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no events")

    def wait_event(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` after this waits for ``event`` (on the GPU; the host goes on)."""
        raise NotImplementedError(f"{type(self).__name__} has no events")

    def event_synchronize(self, event: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no events")

    def destroy_event(self, event: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no events")

    # Optional: CUDA graphs, to replay a captured sequence of launches with one call.
    def begin_capture(self, stream: int) -> None:
        """Record the work queued on ``stream`` (not the default stream) instead of running it."""
        raise NotImplementedError(f"{type(self).__name__} has no graphs")

    def end_capture(self, stream: int) -> int:
        """Stop recording; returns an executable graph handle for ``launch_graph``."""
        raise NotImplementedError(f"{type(self).__name__} has no graphs")

    def abort_capture(self, stream: int) -> None:
        """Stop recording and discard it (after an error during capture)."""
        raise NotImplementedError(f"{type(self).__name__} has no graphs")

    def launch_graph(self, graph: int, stream: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no graphs")

    def destroy_graph(self, graph: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no graphs")


_STRUCT_CODES = {"P": "Q", "U": "I", "I": "i", "F": "f", "L": "Q"}
HOST_PAGE = 4096  # register_host needs page-aligned addresses


def host_view(host: Host, writable: bool = False) -> tuple[int, int, Any]:
    """(address, nbytes, keep-alive object) of a C-contiguous host buffer."""
    arr = host if isinstance(host, np.ndarray) else np.frombuffer(host, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("host buffer must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("host output buffer is read-only")
    return arr.ctypes.data, arr.nbytes, arr


class _ArgPlan:
    """Packed-argument scratch for one argument-kind string: the C ABI layout (``struct``'s native
    alignment is the C ABI's) and a ``void*[]`` pointing into it, built once and reused for every
    launch of that shape on one thread. ``cuLaunchKernel`` copies the arguments before returning,
    so reuse is safe."""

    __slots__ = ("packer", "buffer", "pointers", "params", "offsets", "sizes")

    def __init__(self, kinds: str) -> None:
        fmt = "@" + "".join(_STRUCT_CODES[k] for k in kinds)
        self.packer = struct.Struct(fmt)
        self.sizes = [struct.calcsize("@" + _STRUCT_CODES[k]) for k in kinds]
        self.offsets = [
            struct.calcsize(fmt[: i + 2]) - self.sizes[i] for i in range(len(kinds))
        ]
        self.buffer = ctypes.create_string_buffer(max(self.packer.size, 1))
        base = ctypes.addressof(self.buffer)
        self.pointers = (ctypes.c_void_p * max(len(kinds), 1))(*[base + o for o in self.offsets])
        self.params = ctypes.addressof(self.pointers) if kinds else 0


class CudaBackend(GpuBackend):
    """``GpuBackend`` on the CUDA driver API, on one device's primary context.

    Owns what it hands out: allocations, streams, loaded modules and the pinned staging pool are
    released by ``close()`` (or leaving a ``with`` block). Safe to use from several threads, each
    with its own streams: the context is made current on each thread at its first call.
    """

    def __init__(self, device: int = 0, *, target: str | None = None,
                 kernel_dir: str | Path | None = None, options: Sequence[str] = ()) -> None:
        driver.init()
        count = driver.device_count()
        if not 0 <= device < count:
            raise NoDeviceError(f"CUDA device {device} requested, {count} present")
        self.device = device
        self._dev = call(cu.cuDeviceGet, device)
        self._ctx = call(cu.cuDevicePrimaryCtxRetain, self._dev)
        call(cu.cuCtxSetCurrent, self._ctx)
        self.compute_capability = driver.compute_capability(device)
        self.target = target or compiler.target_for(*self.compute_capability)
        self.kernel_dir = Path(kernel_dir) if kernel_dir else compiler.kernel_dir()
        self.options = tuple(options)
        attr = cu.CUdevice_attribute
        get = lambda a: int(call(cu.cuDeviceGetAttribute, a, self._dev))  # noqa: E731
        self.sm_count = get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.l2_bytes = get(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        self.max_shared_optin = get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        self.name = call(cu.cuDeviceGetName, 256, self._dev).split(b"\0")[0].decode()

        self._modules: dict[str, Any] = {}
        self._signatures: dict[str, dict[str, str]] = {}
        self._kernels: dict[tuple[str, str], KernelHandle] = {}
        self._kernel_names: dict[int, tuple[str, str]] = {}
        self._checked: set[tuple[int, str]] = set()
        self._shared_set: dict[int, int] = {}
        self._allocs: dict[int, int] = {}
        self._streams: set[int] = set()
        self._events: set[int] = set()
        self._graphs: dict[int, Any] = {}  # executable graphs by handle
        self._host: dict[int, int] = {}  # pinned host buffers: address -> bytes
        self._mapped: set[int] = set()  # the addresses of those that are mapped (DEVICEMAP)
        self._registered: dict[int, tuple[int, Any]] = {}  # address -> (bytes, the array)
        self._read_only_register: bool | None = None  # the device attribute, read once
        self._staging = PinnedStaging()
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._tls.plans = {}
        # GPU_RUNTIME_OVERLAP=0 runs overlap=True launches as plain ones (a tool that cannot
        # follow programmatic dependent launches, or to rule them out when hunting a race).
        self.overlap = os.environ.get("GPU_RUNTIME_OVERLAP", "1") != "0"
        self.closed = False

    # -- context and lifetime ---------------------------------------------------------------
    def _bind(self) -> dict[str, _ArgPlan]:
        """Make the context current on this thread (once per thread); return its arg plans."""
        try:
            return self._tls.plans
        except AttributeError:
            if self.closed:
                raise GpuError("CudaBackend is closed") from None
            call(cu.cuCtxSetCurrent, self._ctx)
            self._tls.plans = {}
            return self._tls.plans

    def _live(self) -> None:
        if self.closed:
            raise GpuError("CudaBackend is closed")
        self._bind()

    def close(self) -> None:
        """Wait for the device, then free allocations, streams, modules, staging; idempotent."""
        if self.closed:
            return
        self._bind()
        with self._lock:
            self.closed = True
            call(cu.cuCtxSynchronize)
            for ptr in list(self._allocs):
                call(cu.cuMemFree, ptr)
            for stream in list(self._streams):
                call(cu.cuStreamDestroy, stream)
            for graph in self._graphs.values():
                call(cu.cuGraphExecDestroy, graph)
            for event in list(self._events):
                call(cu.cuEventDestroy, event)
            for addr in list(self._registered):
                call(cu.cuMemHostUnregister, addr)
            for addr in list(self._host):
                call(cu.cuMemFreeHost, addr)
            self._events.clear()
            self._graphs.clear()
            self._registered.clear()
            self._host.clear()
            self._mapped.clear()
            for module in self._modules.values():
                call(cu.cuModuleUnload, module)
            self._staging.close()
            self._allocs.clear()
            self._streams.clear()
            self._modules.clear()
            self._kernels.clear()
            self._kernel_names.clear()
            self._checked.clear()
            call(cu.cuDevicePrimaryCtxRelease, self._dev)

    def __enter__(self) -> "CudaBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- kernels ----------------------------------------------------------------------------
    def kernel(self, module: str, name: str) -> KernelHandle:
        handle = self._kernels.get((module, name))
        if handle is not None:
            return handle
        self._live()
        with self._lock:
            mod = self._module(module)
            try:
                fn = call(cu.cuModuleGetFunction, mod, name.encode())
            except CudaError as exc:
                raise KernelNotFoundError(f"kernel {name!r} not in module {module!r} ({exc.name})") from exc
            handle = KernelHandle(int(fn))
            self._kernels[(module, name)] = handle
            self._kernel_names[int(handle)] = (module, name)
            return handle

    def _module(self, module: str) -> Any:
        loaded = self._modules.get(module)
        if loaded is not None:
            return loaded
        path = self.kernel_dir / f"{module}.cu"
        if not path.is_file():
            raise KernelNotFoundError(f"no kernel module {module!r} ({path} does not exist)")
        compiled = compiler.compile_module(path, self.target, self.options)
        try:
            loaded = call(cu.cuModuleLoadData, compiled.image)
        except CudaError:
            if not compiled.cached:
                raise
            compiler.evict(path, self.target)  # a stale or damaged entry: rebuild it once
            compiled = compiler.compile_module(path, self.target, self.options)
            loaded = call(cu.cuModuleLoadData, compiled.image)
        self._modules[module] = loaded
        self._signatures[module] = module_signatures(path)
        return loaded

    def kernel_name(self, kernel: int) -> str:
        module, name = self._kernel_names.get(int(kernel), ("?", f"<unknown kernel 0x{int(kernel):x}>"))
        return f"{module}.{name}"

    def _check_launch(self, kernel: int, kinds: str, plan: _ArgPlan) -> None:
        """Once per (kernel, kinds): the kernel is ours, and the arguments match its signature
        (kinds read from the source, offsets and sizes from ``cuFuncGetParamInfo``)."""
        if int(kernel) not in self._kernel_names:
            state = "backend is closed" if self.closed else "not loaded by this backend"
            raise GpuError(f"kernel handle 0x{int(kernel):x}: {state}")
        module, name = self._kernel_names[int(kernel)]
        expected = self._signatures[module].get(name)
        where = f"{module}.{name}"
        if expected is not None and expected != kinds:
            raise TypeError(_mismatch(where, expected, kinds))
        layout = self._param_layout(kernel)
        if layout is not None:  # None: this driver cannot report layouts
            if len(layout) != len(kinds):
                raise TypeError(f"{where}: takes {len(layout)} arguments, {len(kinds)} given")
            for i, (offset, size) in enumerate(layout):
                if (offset, size) != (plan.offsets[i], plan.sizes[i]):
                    raise TypeError(
                        f"{where}: argument {i} is {size} bytes at offset {offset}, "
                        f"launch packs {plan.sizes[i]} bytes at offset {plan.offsets[i]}"
                    )
        self._checked.add((int(kernel), kinds))

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

    def launch(self, kernel: KernelHandle, grid: tuple[int, int, int], block: tuple[int, int, int],
               shared_mem: int, stream: int, kinds: str, args: Sequence[int | float], *,
               overlap: bool = False) -> None:
        try:
            plans = self._tls.plans
        except AttributeError:
            plans = self._bind()
        plan = plans.get(kinds)
        if plan is None:
            plan = plans[kinds] = _ArgPlan(kinds)
        if (kernel, kinds) not in self._checked:
            self._check_launch(kernel, kinds, plan)
        if shared_mem > 48 * 1024 and self._shared_set.get(kernel, 0) < shared_mem:
            self._raise_shared_limit(kernel, shared_mem)
        plan.packer.pack_into(plan.buffer, 0, *args)
        if overlap and self.overlap:
            config = _overlap_config(grid, block, shared_mem, stream)
            (err,) = cu.cuLaunchKernelEx(config, kernel, plan.params, 0)
            call_name = "cuLaunchKernelEx"
        else:
            gx, gy, gz = grid
            bx, by, bz = block
            (err,) = cu.cuLaunchKernel(kernel, gx, gy, gz, bx, by, bz, shared_mem, stream, plan.params, 0)
            call_name = "cuLaunchKernel"
        if err:
            raise CudaError(err, call_name, f"{self.kernel_name(kernel)} grid={grid} "
                            f"block={block} shared={shared_mem}")

    def _raise_shared_limit(self, kernel: int, shared_mem: int) -> None:
        if shared_mem > self.max_shared_optin:
            raise ValueError(f"{self.kernel_name(kernel)}: {shared_mem} bytes of shared memory, "
                             f"device allows {self.max_shared_optin}")
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        call(cu.cuFuncSetAttribute, kernel, attr, shared_mem)
        self._shared_set[kernel] = shared_mem

    # -- memory -----------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DevicePtr:
        nbytes = _count(nbytes, "alloc size")
        if nbytes == 0:
            raise ValueError("alloc of 0 bytes")
        self._live()
        ptr = int(call(cu.cuMemAlloc, nbytes, detail=f"{nbytes} bytes"))
        with self._lock:
            self._allocs[ptr] = nbytes
        return DevicePtr(ptr)

    def free(self, ptr: int) -> None:
        if not ptr:
            return
        self._live()
        with self._lock:
            if int(ptr) not in self._allocs:
                raise ValueError(f"free of {DevicePtr(ptr)!r}: not allocated by this backend (or freed twice)")
            del self._allocs[int(ptr)]
        call(cu.cuMemFree, int(ptr))

    def allocation_size(self, ptr: int) -> int | None:
        """Size of the allocation that starts at ``ptr``, None if it is not one of ours."""
        return self._allocs.get(int(ptr))

    def memset(self, ptr: int, byte: int, nbytes: int, stream: int = 0) -> None:
        _require(ptr, "memset")
        if isinstance(byte, bool) or not isinstance(byte, (int, np.integer)) or not 0 <= byte <= 255:
            raise ValueError(f"memset byte must be an int in 0..255, got {byte!r}")
        nbytes = _count(nbytes, "memset size")
        if nbytes:
            self._live()
            call(cu.cuMemsetD8Async, int(ptr), int(byte), nbytes, stream)

    def copy_h2d_async(self, host: Host, dst: int, stream: int = 0) -> None:
        _require(dst, "copy_h2d_async destination")
        addr, nbytes, keep = host_view(host)
        if nbytes:
            self._live()
            self._staging.upload(addr, nbytes, int(dst), stream)
        del keep

    def copy_d2h(self, host_out: Host, src: int, stream: int = 0) -> None:
        _require(src, "copy_d2h source")
        addr, nbytes, keep = host_view(host_out, writable=True)
        if nbytes:
            self._live()
            call(cu.cuMemcpyDtoHAsync, addr, int(src), nbytes, stream)
            call(cu.cuStreamSynchronize, stream)
        del keep

    def copy_d2d_async(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        _require(dst, "copy_d2d_async destination")
        _require(src, "copy_d2d_async source")
        nbytes = _count(nbytes, "copy size")
        if nbytes:
            self._live()
            call(cu.cuMemcpyDtoDAsync, int(dst), int(src), nbytes, stream)

    def copy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                      height: int, stream: int = 0) -> None:
        _require(dst, "copy_2d_async destination")
        _require(src, "copy_2d_async source")
        width, height = _count(width, "copy width"), _count(height, "copy height")
        if _count(dst_pitch, "dst_pitch") < width or _count(src_pitch, "src_pitch") < width:
            raise ValueError(f"copy_2d_async: pitches ({dst_pitch}, {src_pitch}) below the width {width}")
        if width and height:
            self._live()
            p = cu.CUDA_MEMCPY2D()
            p.srcMemoryType = p.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
            p.srcDevice, p.srcPitch = int(src), src_pitch
            p.dstDevice, p.dstPitch = int(dst), dst_pitch
            p.WidthInBytes, p.Height = width, height
            call(cu.cuMemcpy2DAsync, p, stream)

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes."""
        self._live()
        free, total = call(cu.cuMemGetInfo)
        return int(free), int(total)

    @property
    def pinned_buffers(self) -> int:
        """Page-locked host buffers held: the staging pool's, ``alloc_host``'s and the
        ``register_host`` ranges (for leak tests)."""
        return self._staging.buffers + len(self._host) + len(self._registered)

    @property
    def host_registrations(self) -> int:
        """``register_host`` ranges not yet unregistered."""
        return len(self._registered)

    def alloc_host(self, nbytes: int, *, mapped: bool = False) -> np.ndarray:
        nbytes = _count(nbytes, "alloc_host size")
        if nbytes == 0:
            raise ValueError("alloc_host of 0 bytes")
        if not isinstance(mapped, bool):
            raise TypeError(f"alloc_host: mapped must be a bool, got {mapped!r}")
        self._live()
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE if mapped else 0
        addr = int(call(cu.cuMemHostAlloc, nbytes, flags,
                        detail=f"{nbytes} bytes{', mapped' if mapped else ''}"))
        with self._lock:
            self._host[addr] = nbytes
            if mapped:
                self._mapped.add(addr)
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))

    def free_host(self, array: np.ndarray) -> None:
        addr = int(array.ctypes.data)
        self._live()
        with self._lock:
            if self._host.get(addr) != array.nbytes:
                raise ValueError(f"free_host of 0x{addr:x}: not a whole buffer from alloc_host (or freed twice)")
            del self._host[addr]
            self._mapped.discard(addr)
        call(cu.cuMemFreeHost, addr)

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
        if not isinstance(array, np.ndarray):
            raise TypeError(f"host_device_ptr: expected a numpy array, got {type(array).__name__}")
        addr, nbytes, _ = host_view(array)
        self._live()
        base = self._mapped_range(addr, nbytes)
        if base is None:
            raise ValueError(f"host_device_ptr of 0x{addr:x} (+{nbytes} bytes): not inside a mapped "
                             "alloc_host buffer (alloc_host(..., mapped=True)) or a register_host range")
        # The range's own address: cuMemHostGetDevicePointer is defined for it, then the offset.
        dev = int(call(cu.cuMemHostGetDevicePointer, base, 0, detail=f"host 0x{base:x}"))
        return DevicePtr(dev + (addr - base))

    def register_host(self, array: np.ndarray, *, read_only: bool = True) -> DevicePtr:
        if not isinstance(array, np.ndarray):
            raise TypeError(f"register_host: expected a numpy array, got {type(array).__name__}")
        if not isinstance(read_only, bool):
            raise TypeError(f"register_host: read_only must be a bool, got {read_only!r}")
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
                    raise ValueError(f"register_host of 0x{addr:x} (+{nbytes} bytes): overlaps pinned "
                                     f"host memory at 0x{base:x} (+{size} bytes)")
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
        if not isinstance(array, np.ndarray):
            raise TypeError(f"unregister_host: expected a numpy array, got {type(array).__name__}")
        addr = int(array.ctypes.data)
        self._live()
        with self._lock:
            entry = self._registered.get(addr)
            if entry is None or entry[0] != array.nbytes:
                raise ValueError(f"unregister_host of 0x{addr:x}: not a whole register_host range "
                                 "(or unregistered twice)")
            del self._registered[addr]
        call(cu.cuMemHostUnregister, addr)

    def upload_pinned_async(self, host: np.ndarray, dst: int, stream: int = 0) -> None:
        _require(dst, "upload_pinned_async destination")
        addr, nbytes, _ = host_view(host)
        if not any(base <= addr and addr + nbytes <= base + size for base, size in self._host.items()):
            raise ValueError("upload_pinned_async: host buffer is not inside an alloc_host buffer")
        if nbytes:
            self._live()
            call(cu.cuMemcpyHtoDAsync, int(dst), addr, nbytes, stream)

    # -- streams ----------------------------------------------------------------------------
    def create_stream(self) -> int:
        self._live()
        stream = int(call(cu.cuStreamCreate, cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        with self._lock:
            self._streams.add(stream)
        return stream

    def destroy_stream(self, stream: int) -> None:
        self._live()
        with self._lock:
            if stream not in self._streams:
                raise ValueError(f"stream 0x{stream:x} was not created by this backend")
            self._streams.discard(stream)
        call(cu.cuStreamSynchronize, stream)
        call(cu.cuStreamDestroy, stream)

    def synchronize(self, stream: int = 0) -> None:
        self._live()
        call(cu.cuStreamSynchronize, stream)

    # -- events -----------------------------------------------------------------------------
    def create_event(self) -> int:
        self._live()
        event = int(call(cu.cuEventCreate, cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        with self._lock:
            self._events.add(event)
        return event

    def record_event(self, event: int, stream: int = 0) -> None:
        self._live()
        call(cu.cuEventRecord, event, stream)

    def wait_event(self, stream: int, event: int) -> None:
        self._live()
        call(cu.cuStreamWaitEvent, stream, event, 0)

    def event_synchronize(self, event: int) -> None:
        self._live()
        call(cu.cuEventSynchronize, event)

    def destroy_event(self, event: int) -> None:
        self._live()
        with self._lock:
            if event not in self._events:
                raise ValueError(f"event 0x{event:x} was not created by this backend (or destroyed twice)")
            self._events.discard(event)
        call(cu.cuEventDestroy, event)


    # -- graphs -----------------------------------------------------------------------------
    def begin_capture(self, stream: int) -> None:
        if not stream:
            raise ValueError("begin_capture: the default stream cannot be captured; use create_stream()")
        self._live()
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        call(cu.cuStreamBeginCapture, stream, mode)

    def end_capture(self, stream: int) -> int:
        self._live()
        graph = call(cu.cuStreamEndCapture, stream)
        try:
            exe = call(cu.cuGraphInstantiate, graph, 0)
        finally:
            call(cu.cuGraphDestroy, graph)  # the executable graph keeps what it needs
        with self._lock:
            self._graphs[int(exe)] = exe
        return int(exe)

    def abort_capture(self, stream: int) -> None:
        self._live()
        (err, graph) = cu.cuStreamEndCapture(stream)  # may fail: the capture was invalidated
        if not err and graph is not None and int(graph):
            call(cu.cuGraphDestroy, graph)

    def launch_graph(self, graph: int, stream: int) -> None:
        exe = self._graphs.get(int(graph))
        if exe is None:
            raise ValueError(f"launch_graph: 0x{int(graph):x} is not a live graph of this backend")
        call(cu.cuGraphLaunch, exe, stream)

    def destroy_graph(self, graph: int) -> None:
        self._live()
        with self._lock:
            exe = self._graphs.pop(int(graph), None)
        if exe is None:
            raise ValueError(f"destroy_graph: 0x{int(graph):x} is not a live graph of this backend")
        call(cu.cuGraphExecDestroy, exe)

@functools.lru_cache(maxsize=256)
def _overlap_config(grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int,
                    stream: int) -> Any:
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


def _mismatch(where: str, expected: str, given: str) -> str:
    names = {"P": "pointer", "U": "u32", "I": "i32", "F": "f32", "L": "u64"}
    if len(expected) != len(given):
        return f"{where}: takes {len(expected)} arguments ({expected}), {len(given)} given ({given})"
    i = next(i for i, (a, b) in enumerate(zip(expected, given)) if a != b)
    return f"{where}: argument {i} must be {names[expected[i]]}, launch passes {names[given[i]]}"


def _require(ptr: int, what: str) -> None:
    if not ptr:
        raise ValueError(f"{what}: null device pointer")


def _count(n: int, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"{what} must be a non-negative int, got {n!r}")
    return int(n)
