"""``KernelSpec``: a kernel's parameters by name, so that a launch binds its arguments by name.

``SCALED_ADD = KernelSpec("bf16_scaled_add", out="P", x="P", scale="F", n="U")`` names the
kernel's parameters in their C order with their kinds (``P`` pointer, ``P?`` pointer that may be
null, ``U`` u32, ``I`` i32, ``F`` f32, ``L`` u64, ``T`` a tensor map: 128 ``bytes``).
``SCALED_ADD.launch(gpu, kernel, grid, block, stream, out=o, x=x, scale=0.5, n=n)`` takes every
argument by keyword, so two swapped ``uint32_t`` cannot pass: a missing or unknown name is
Python's own ``TypeError``, before anything runs. ``SCALED_ADD.launch_from(gpu, kernel, grid,
block, stream, locals())`` takes each argument by its name from a mapping instead: a launcher
whose parameters carry the kernel's names passes its ``locals()``, with no list to keep in step;
a parameter missing from the mapping is a ``TypeError``, and its other names (the launcher's
own) are left alone.

A spec is checked against the kernel's source (names and kinds, in order) by a CPU test for
every kernel, and by ``CudaBackend`` at the first launch of each kernel with it. It lays out its
packed argument buffer and pointer array once per thread: a launch writes the values into it and
hands it to the backend. The values are checked on the way, by the one policy
(``validate``): a non-integer where an integer belongs (a bool too, for ``U``, ``I``, ``L``),
or a non-number for an f32, is a ``TypeError``; a null pointer (unless ``P?``), a value out of
its kind's range or an f32 overflow is a ``ValueError``; each names the kernel and the
parameter. An f32 may be infinite or NaN, as with ``KernelLaunch.arg_f32``: a launcher that
needs it finite says so.

A launch goes through ``gpu.launch_spec``, unless the backend allowed a direct route: once a
backend has checked a kernel with a spec on a thread, it may call ``allow_direct``, and that
thread's plain launches of the kernel on that backend (no ``overlap``; at most 48 KiB of dynamic
shared memory, or as much as the backend has opted the kernel in to) then call the backend's
driver function straight from the launcher, skipping the backend's frames.
"""

from __future__ import annotations

import dis
import functools
import keyword
import math
import numbers
import struct
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import launch_config, validate
from .backend import check_backend
from .packing import KIND_NAMES, TENSOR_MAP_BYTES, ArgPlan, layout, struct_format
from .signatures import Param, Signature

NULLABLE = "P?"
# cuLaunchKernel's signature: (kernel, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> (status,)
DriverLaunch = Callable[..., tuple[Any]]
LaunchRefusal = Callable[[Any, str, Any, Sequence[int], Sequence[int], int], Exception]


class KernelSpec:
    """A kernel's name and parameters (``params``, a ``Signature``; ``nullable``, the pointers
    that may be null), and ``launch`` and ``launch_from``, which bind them by name (keywords, or
    a mapping's entries). ``offsets`` / ``sizes``: where each argument lies in the packed buffer."""

    __slots__ = ("name", "params", "nullable", "kinds", "offsets", "sizes", "packer", "launch", "launch_from", "_local")

    name: str
    params: Signature
    nullable: frozenset[str]
    kinds: str
    offsets: list[int]
    sizes: list[int]
    packer: struct.Struct
    launch: Callable[..., None]
    launch_from: Callable[..., None]
    _local: threading.local  # .plan: this thread's _SpecPlan

    def __init__(self, kernel: str, /, **params: str) -> None:
        for pname, kind in params.items():
            if kind not in KIND_NAMES and kind != NULLABLE:
                raise ValueError(
                    f"KernelSpec {kernel}: {pname}={kind!r} is not a kind ({', '.join(KIND_NAMES)} or {NULLABLE})"
                )
            if pname in _launcher_names() or pname.startswith("_") or keyword.iskeyword(pname):
                raise ValueError(
                    f"KernelSpec {kernel}: {pname!r} cannot name a parameter (a keyword, or a name the launcher uses)"
                )
        self.name = kernel
        self.params = Signature(Param(n, k[0]) for n, k in params.items())
        self.nullable = frozenset(n for n, k in params.items() if k == NULLABLE)
        self.kinds = self.params.kinds
        self.offsets, self.sizes = layout(self.kinds)
        self.packer = struct.Struct(struct_format(self.kinds))
        self._local = threading.local()
        self.launch, self.launch_from = _launchers(self)

    def __repr__(self) -> str:
        args = "".join(f", {p.name}={self._kind(p)!r}" for p in self.params)
        return f"KernelSpec({self.name!r}{args})"

    def _kind(self, param: Param) -> str:
        return NULLABLE if param.name in self.nullable else param.kind

    def thread_plan(self) -> _SpecPlan:
        """This thread's packed-argument buffer for the spec (made at its first use)."""
        try:
            return self._local.plan
        except AttributeError:
            plan = self._local.plan = _SpecPlan(self.kinds)
            return plan

    def allow_direct(
        self,
        kernel: int,
        backend: object,
        launch: DriverLaunch,
        refusal: LaunchRefusal,
        opted_in: Mapping[int, int] = launch_config.NO_OPT_IN,
        driver_kernel: object = None,
    ) -> dict[int, Any]:
        """For backends, not users. Let this thread's plain launches of ``kernel`` on ``backend``
        call ``launch`` (with ``cuLaunchKernel``'s arguments, the kernel given as
        ``driver_kernel``: the driver's own handle object, by default ``kernel``) instead of
        ``backend.launch_spec``;
        a nonzero status it returns is raised as ``refusal(status, "cuLaunchKernel", kernel,
        grid, block, shared_mem)``. Launches with more than 48 KiB of dynamic shared memory take
        the route only up to ``opted_in[kernel]``: the backend's live table of the shared memory
        each kernel is opted in to. A backend calls this only after its own checks of ``kernel``
        with this spec passed on this thread. Returns the thread's table, from which the backend
        removes its routes when it closes (the next launch then goes through ``launch_spec``
        again, and meets its refusal)."""
        table = self.thread_plan().direct
        table[int(kernel)] = (backend, launch, refusal, opted_in, kernel if driver_kernel is None else driver_kernel)
        return table

    def check_signature(self, signature: Sequence[Param], where: str) -> None:
        """``TypeError`` unless ``signature`` (read from the source) has this spec's parameter
        names and kinds, in this order."""
        source = tuple(Param(*p) for p in signature)
        if source == tuple(self.params):
            return
        if len(source) != len(self.params):
            raise TypeError(
                f"{where}: the source has {len(source)} parameters ({_show(source)}), "
                f"spec {self.name} names {len(self.params)} ({_show(self.params)})"
            )
        i = next(i for i, (a, b) in enumerate(zip(source, self.params)) if a != b)
        raise TypeError(
            f"{where}: parameter {i} is {_show([source[i]])} in the source, "
            f"{_show([self.params[i]])} in spec {self.name}"
        )

    def values(self, values: Sequence[Any]) -> list[int | float | bytes]:
        """``values`` (checked already) as the kernel receives them: ints, floats for f32, bytes
        for a tensor map. What a backend that records launches records."""
        return [
            float(v) if p.kind == "F" else bytes(v) if p.kind == "T" else int(v) for p, v in zip(self.params, values)
        ]

    def refusal(self, values: Sequence[Any]) -> Exception:
        """The error for values that failed the launch's checks: the first parameter at fault,
        by the one policy."""
        try:
            for param, value in zip(self.params, values):
                self._check(param, value)
        except (TypeError, ValueError) as exc:
            return exc
        return TypeError(f"{self.name}: arguments {list(values)!r} do not pack as {self.kinds}")

    def missing(self, exc: KeyError) -> TypeError:
        """The error for a ``launch_from`` whose mapping lacks the parameter ``exc`` names."""
        return TypeError(f"{self.name}: no value for parameter {exc.args[0]!r} in the launch's arguments")

    def _check(self, param: Param, value: Any) -> None:
        what = f"{self.name} {param.name}"
        kind = param.kind
        if kind == "P":
            validate.pointer(value, what, nullable=param.name in self.nullable)
        elif kind == "U":
            validate.u32(value, what)
        elif kind == "L":
            validate.count(value, what, limit=1 << 64)
        elif kind == "I":
            if not -(1 << 31) <= validate.integer(value, what) < 1 << 31:
                raise ValueError(f"{what} must be in -2**31..2**31-1, got {value}")
        elif kind == "T":
            if type(value) is not bytes:
                raise TypeError(f"{what} must be a tensor map's bytes, got {type(value).__name__}")
            if len(value) != TENSOR_MAP_BYTES:
                raise ValueError(f"{what}: a tensor map is {TENSOR_MAP_BYTES} bytes, got {len(value)}")
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{what} must be a real number, got {value!r}")
        elif math.isfinite(value) and abs(value) > validate.F32_MAX:  # type: ignore[operator]  # typeshed: abs(Real) lacks >
            raise ValueError(f"{what}: {value!r} overflows f32")


class _SpecPlan(ArgPlan):
    """A thread's packed arguments for one spec, and its direct routes: kernel -> (backend,
    driver launch, refusal, opted-in shared memory, driver kernel), from
    ``KernelSpec.allow_direct``."""

    __slots__ = ("direct",)

    def __init__(self, kinds: str) -> None:
        super().__init__(kinds)
        self.direct: dict[int, tuple[object, DriverLaunch, LaunchRefusal, Mapping[int, int], object]] = {}


def _show(params: Sequence[Param]) -> str:
    return ", ".join(f"{p.name}: {KIND_NAMES[p.kind]}" for p in params)


@functools.cache
def _launcher_names() -> frozenset[str]:
    """Every name the generated launchers bind or read as a variable (their own parameters and
    locals, the namespace's helpers, the builtins they call): a kernel parameter of that name
    would shadow one, so none may have it."""
    every_kind = [Param(f"_{kind}", kind) for kind in KIND_NAMES]  # so that each kind's guard is written
    code = compile(_launcher_source(every_kind, frozenset()), "<launcher>", "exec")
    names: set[str] = set()
    for fn in code.co_consts:
        if isinstance(fn, types.CodeType):
            names.update(fn.co_varnames)
            names.update(i.argval for i in dis.get_instructions(fn) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME"))
    return frozenset(names)


def _launcher_source(params: Sequence[Param], nullable: frozenset[str]) -> str:
    """The source of ``launch`` and ``launch_from`` for these parameters (see ``_launchers``)."""
    names = "".join(f"{p.name}, " for p in params)
    lookups = "".join(f"args[{p.name!r}], " for p in params)
    guards = [f"not {p.name}" for p in params if p.kind == "P" and p.name not in nullable]
    guards += [f"type({p.name}) is bool" for p in params if p.kind in "UIL"]
    guards += [
        f"type({p.name}) is not bytes or len({p.name}) != {TENSOR_MAP_BYTES}"  # "128s" pads
        for p in params
        if p.kind == "T"
    ]
    body = (  # the values bound to their names: check, pack, launch (directly, or through the backend)
        f"    try:\n"
        f"        _plan = _local.plan\n"
        f"    except AttributeError:\n"
        f"        _plan = _spec.thread_plan()\n"
        f"    try:\n"
        f"        _bad = {' or '.join(guards) or 'False'}\n"
        f"        if not _bad:\n"
        f"            _pack_into(_plan.buffer, 0, {names})\n"
        f"    except (TypeError, ValueError, OverflowError, _struct_error):\n"
        f"        _bad = True\n"
        f"    if _bad:\n"
        f"        raise _spec.refusal(({names}))\n"
        f"    if type(stream) is not int or stream < 0:\n"
        f"        stream = _check_stream(stream, _spec.name + ': stream')\n"
        f"    if not overlap:\n"
        f"        try:\n"
        f"            _direct = _plan.direct[kernel]\n"
        f"        except KeyError:\n"
        f"            _direct = None  # not checked on this thread yet, or another backend's kernel\n"
        f"        if _direct is not None and _direct[0] is gpu and (\n"
        f"                not shared_mem or type(shared_mem) is int\n"
        f"                and (shared_mem <= {launch_config.SHARED_WITHOUT_OPT_IN}\n"
        f"                     or shared_mem <= _direct[3].get(kernel, 0))):\n"
        f"            try:\n"
        f"                _gx, _gy, _gz = grid\n"
        f"                _bx, _by, _bz = block\n"
        f"                (_err,) = _direct[1](_direct[4], _gx, _gy, _gz, _bx, _by, _bz, shared_mem, stream,\n"
        f"                                     _plan.params, 0)\n"
        f"            except (TypeError, ValueError, OverflowError):\n"
        f"                pass  # not launched: the backend's launch_spec below phrases the refusal\n"
        f"            else:\n"
        f"                if _err:\n"
        f"                    raise _direct[2](_err, 'cuLaunchKernel', kernel, grid, block, shared_mem)\n"
        f"                return\n"
        f"    try:\n"
        f"        gpu.launch_spec(_spec, kernel, grid, block, shared_mem, stream, _plan.params, ({names}),\n"
        f"                        overlap)\n"
        f"    except AttributeError:\n"
        f"        _check_backend(gpu, _spec.name + ': gpu')  # not a backend: refused by name\n"
        f"        raise\n"
    )
    unpack = f"{names}= {lookups}" if params else "pass"  # (a kernel without parameters)
    return (
        f"def launch(gpu, kernel, grid, block, stream, /, *, {names}shared_mem=0, overlap=False):\n"
        f"{body}"
        f"def launch_from(gpu, kernel, grid, block, stream, args, /, *, shared_mem=0, overlap=False):\n"
        f"    try:\n"
        f"        {unpack}\n"
        f"    except KeyError as _exc:\n"
        f"        raise _spec.missing(_exc) from None\n"
        f"{body}"
    )


def _launchers(spec: KernelSpec) -> tuple[Callable[..., None], Callable[..., None]]:
    """``launch(gpu, kernel, grid, block, stream, /, *, <each parameter>, shared_mem=0,
    overlap=False)`` and ``launch_from(gpu, kernel, grid, block, stream, args, /, *,
    shared_mem=0, overlap=False)``, written out for this spec: Python itself binds the keywords
    (``launch_from`` looks each parameter up in ``args``, a missing one a ``TypeError``), the
    checks are one expression, and the values go to ``pack_into`` as plain positional arguments
    (a ``**kwargs`` version, or one that unpacks a tuple into ``pack_into``, costs several times
    as much per launch). What ``pack_into`` checks itself (types, ranges, f32 overflow) it is
    left to; the expression adds what it lets pass: null pointers, bools for integers, and tensor
    maps that are not exactly 128 bytes, which ``pack_into`` would pad or cut (one test per
    parameter, a few ns each: bools for pointers and floats are not looked for). The stream
    passes on one type test; a ``gpu`` that is not a backend is named once its missing
    ``launch_spec`` is (no cost on the way to the backend)."""
    source = _launcher_source(spec.params, spec.nullable)
    namespace: dict[str, Any] = {  # "_" names: no kernel parameter may start with one
        "_spec": spec,
        "_local": spec._local,  # one argument buffer a thread, for both
        "_pack_into": spec.packer.pack_into,
        "_struct_error": struct.error,
        "_check_stream": validate.stream,
        "_check_backend": check_backend,
    }
    exec(compile(source, f"<KernelSpec {spec.name}>", "exec"), namespace)
    launch, launch_from = namespace["launch"], namespace["launch_from"]
    launch.__qualname__ = f"KernelSpec({spec.name!r}).launch"
    launch.__doc__ = (
        f"Launch {spec.name}({_show(spec.params)}), every argument by name. "
        "``overlap=True``: a programmatic dependent launch (see ``KernelLaunch``)."
    )
    launch_from.__qualname__ = f"KernelSpec({spec.name!r}).launch_from"
    launch_from.__doc__ = (
        f"Launch {spec.name}({_show(spec.params)}), each argument looked up by its name in the "
        "mapping ``args``, whose other names are left alone. As ``launch`` otherwise."
    )
    return launch, launch_from
