"""Kernel launches: ``LaunchConfig`` (how a kernel runs) apart from its arguments; ``ArgLayout``,
a signature's arguments laid out as the C ABI lays them out (each at the next offset aligned to
its kind: ``P`` pointer, ``U`` u32, ``I`` i32, ``F`` f32, ``L`` u64, ``T`` a 128-byte
``CUtensorMap``, 64-aligned), packed by one precompiled little-endian ``struct``; ``Kernel``, a
loaded kernel bound to its backend (``launch``, ``prepare``); ``PreparedLaunch``.

Packing checks what it packs: an integer kind takes an int (or anything with ``__index__``) in
its range, ``F`` a real number that fits an f32. A value that does not pack raises the policy's
``TypeError`` or ``ValueError``, naming the kernel and the parameter, and nothing is launched.
What packing cannot see (a null pointer, a bool for a count, sizes that must agree) the launcher
checks at its public boundary.
"""

from __future__ import annotations

import ctypes
import math
import numbers
import struct
from collections.abc import Callable, Sequence
from typing import Any

from . import validate
from .signatures import Param, Signature

TENSOR_MAP_BYTES = 128
KIND_NAMES = {"P": "pointer", "U": "u32", "I": "i32", "F": "f32", "L": "u64", "T": "tensor map"}
_CODES = {"P": "Q", "U": "I", "I": "i", "F": "f", "L": "Q", "T": f"{TENSOR_MAP_BYTES}s"}
_SIZES = {"P": 8, "U": 4, "I": 4, "F": 4, "L": 8, "T": TENSOR_MAP_BYTES}
_ALIGN = {**_SIZES, "T": 64}

GRID_MAX = ((1 << 31) - 1, 65535, 65535)
BLOCK_MAX = (1024, 1024, 64)
MAX_THREADS = 1024
SHARED_WITHOUT_OPT_IN = 48 * 1024  # a backend opts each kernel in to more where the device has it

Dims = tuple[int, int, int]


def check_dims(value: int | Sequence[int], limits: Dims, what: str) -> Dims:
    """``value`` (an int, or 1 to 3 ints) as three dimensions, each in ``1..limit``; ``what``
    names it in the error."""
    dims = list(value) if isinstance(value, Sequence) else [value]
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {dims}")
    x, y, z = (validate.integer(d, what) for d in [*dims, 1, 1][:3])
    if not all(1 <= d <= limit for d, limit in zip((x, y, z), limits)):
        raise ValueError(f"{what} {[x, y, z]}: each dimension must be in 1..{list(limits)}")
    return x, y, z


def check_block(value: int | Sequence[int], what: str) -> Dims:
    """``check_dims`` of a block, and at most ``MAX_THREADS`` threads in it."""
    x, y, z = check_dims(value, BLOCK_MAX, what)
    if x * y * z > MAX_THREADS:
        raise ValueError(f"{what} {[x, y, z]}: more than {MAX_THREADS} threads")
    return x, y, z


class LaunchConfig:
    """How a kernel runs: ``grid`` and ``block`` (an int, or 1 to 3 ints), ``shared_mem`` bytes
    of dynamic shared memory, ``cluster`` (thread-block cluster dimensions that divide the grid;
    None: none, or the kernel's own ``__cluster_dims__``) and ``overlap`` (a programmatic
    dependent launch: the kernel may start before the previous one on its stream ends, and waits
    for it with ``griddepcontrol.wait``). Checked once, here, and immutable: launches trust it.
    ``driver`` is the backend's cache of what it hands the driver for it, by stream."""

    __slots__ = ("grid", "block", "shared_mem", "cluster", "overlap", "driver")

    grid: Dims
    block: Dims
    shared_mem: int
    cluster: Dims | None
    overlap: bool
    driver: dict[int, Any]

    def __init__(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        shared_mem: int = 0,
        *,
        cluster: int | Sequence[int] | None = None,
        overlap: bool = False,
    ) -> None:
        block_dims = check_block(block, "LaunchConfig block")
        grid_dims = check_dims(grid, GRID_MAX, "LaunchConfig grid")
        cluster_dims = None if cluster is None else check_dims(cluster, (8, 8, 8), "LaunchConfig cluster")
        if cluster_dims is not None and any(g % c for g, c in zip(grid_dims, cluster_dims)):
            raise ValueError(f"LaunchConfig grid {list(grid_dims)} is not whole clusters of {list(cluster_dims)}")
        for name, value in (
            ("grid", grid_dims),
            ("block", block_dims),
            ("shared_mem", validate.count(shared_mem, "LaunchConfig shared_mem", limit=1 << 32)),
            ("cluster", cluster_dims),
            ("overlap", validate.boolean(overlap, "LaunchConfig overlap")),
            ("driver", {}),
        ):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"LaunchConfig is immutable (its {name} cannot be set)")

    def __repr__(self) -> str:
        extra = f", cluster={self.cluster}" * bool(self.cluster) + ", overlap=True" * self.overlap
        return f"LaunchConfig(grid={self.grid}, block={self.block}, shared_mem={self.shared_mem}{extra})"


class ArgLayout:
    """A signature's arguments as the kernel receives them: ``offsets`` and ``sizes`` in the
    packed buffer (what the driver reports for the kernel) and the ``packer`` that writes them."""

    __slots__ = ("signature", "kinds", "offsets", "sizes", "packer")

    def __init__(self, signature: Signature) -> None:
        self.signature = signature
        self.kinds = signature.kinds
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        fmt, end = ["<"], 0  # standard sizes: an f32 that overflows is refused, not stored as inf
        for kind in self.kinds:
            offset = -(-end // _ALIGN[kind]) * _ALIGN[kind]
            fmt.append("x" * (offset - end) + _CODES[kind])
            self.offsets.append(offset)
            self.sizes.append(_SIZES[kind])
            end = offset + _SIZES[kind]
        self.packer = struct.Struct("".join(fmt))

    def buffers(self) -> tuple[Any, int, Any]:
        """A new packed-argument buffer, the address of the ``void*[]`` pointing at each argument
        in it (the driver's ``kernelParams``), and that array (kept alive with the buffer)."""
        buffer = ctypes.create_string_buffer(max(self.packer.size, 1))
        base = ctypes.addressof(buffer)
        pointers = (ctypes.c_void_p * max(len(self.kinds), 1))(*[base + o for o in self.offsets])
        return buffer, (ctypes.addressof(pointers) if self.kinds else 0), pointers

    def refusal(self, kernel: str, args: Sequence[Any]) -> Exception:
        """The policy's exception for ``args`` that did not pack: the first parameter at fault."""
        params = self.signature
        if len(args) != len(params):
            names = ", ".join(f"{p.name}: {KIND_NAMES[p.kind]}" for p in params)
            return TypeError(f"{kernel} takes {len(params)} arguments ({names}), {len(args)} given")
        try:
            for param, value in zip(params, args):
                _check(f"{kernel} {param.name}", param, value)
        except (TypeError, ValueError) as exc:
            return exc
        return TypeError(f"{kernel}: arguments {list(args)!r} do not pack as {self.kinds}")


def _check(what: str, param: Param, value: Any) -> None:
    """Raise the error the validation policy gives ``value`` for ``param`` (the slow path: a launch failed)."""
    kind = param.kind
    if kind == "P":
        validate.pointer(value, what, nullable=True)
    elif kind == "U":
        validate.u32(value, what)
    elif kind == "L":
        validate.count(value, what, limit=1 << 64)
    elif kind == "I":
        if not -(1 << 31) <= validate.integer(value, what) < 1 << 31:
            raise ValueError(f"{what} must be in -2**31..2**31-1, got {value}")
    elif kind == "T":
        if type(value) is not bytes or len(value) != TENSOR_MAP_BYTES:
            raise TypeError(f"{what} must be a tensor map's {TENSOR_MAP_BYTES} bytes, got {type(value).__name__}")
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {value!r}")
    elif math.isfinite(value) and abs(float(value)) > validate.F32_MAX:
        raise ValueError(f"{what}: {value!r} overflows f32")


class PreparedLaunch:
    """One launch of a kernel with its ``config`` and ``args`` packed once (``Kernel.prepare``):
    ``run(stream)`` submits it, packing nothing. The arguments are the ones it was prepared
    with: a pointer then is the pointer of every run. Safe to run from several threads at once
    (nothing is written after it is made); ``ClosedError`` once its backend is closed."""

    __slots__ = ("kernel", "config", "args", "run", "__weakref__")

    run: Callable[[int], None]  # run(stream), set by the backend

    def __init__(self, kernel: Kernel, config: LaunchConfig, args: tuple[Any, ...]) -> None:
        self.kernel, self.config, self.args = kernel, config, args


class Kernel:
    """A kernel loaded on a backend (``gpu.bind(handle)``, which makes it), with its ``name``
    (module.kernel), ``signature`` and argument ``layout``.

    ``launch(config, stream, *args)`` runs it with ``args`` in the signature's order on
    ``stream`` (an int handle, 0: the default stream); ``prepare(config, *args)`` packs them
    once, for a ``PreparedLaunch`` to run as often as needed. Both are set by the backend that
    made the kernel: a launch packs, submits, and raises ``CudaError`` naming the kernel if the
    driver rejects it; ``ClosedError`` once the backend is closed. Safe to call from several threads
    at once (each packs into its own buffer)."""

    __slots__ = ("backend", "handle", "name", "layout", "launch", "prepare")

    launch: Callable[..., None]  # launch(config, stream, *args), set by the backend

    def __init__(self, backend: Any, handle: int, name: str, signature: Signature) -> None:
        self.backend, self.handle, self.name = backend, handle, name
        self.layout = ArgLayout(signature)
        self.launch = self._unbound
        self.prepare: Callable[..., PreparedLaunch] = self._unbound  # prepare(config, *args), set by the backend

    @property
    def signature(self) -> Signature:
        """The kernel's parameters in order (``Param``: C name and kind letter), read from its source:
        what ``launch`` checks its arguments against."""
        return self.layout.signature

    def _unbound(self, *args: Any) -> Any:
        raise NotImplementedError(f"{self.name}: no launch set by its backend")

    def __repr__(self) -> str:
        return f"Kernel({self.name}{self.signature!r})"
