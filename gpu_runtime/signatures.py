"""Kernel signatures read from ``.cu`` source: each kernel's parameters, by name and kind.

A kernel's signature gives its argument layout (``launch.ArgLayout``): the backend reads it when
it binds the kernel and checks it against the parameter layout the driver reports, and a CPU test
checks every launcher's arguments against it by name.

Kinds: ``P`` pointer (any ``T*``), ``U`` u32, ``I`` i32, ``F`` f32, ``L`` u64, ``T`` a
``TensorMap`` (a ``CUtensorMap``) by value.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

# After ``void``, attributes such as ``__launch_bounds__(384, 1)`` or a macro in capitals that
# expands to one (``SPLITK_CLUSTER``) may precede the kernel's name.
_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+'
    r"(?:\w+\s*\([^)]*\)\s*|[A-Z][A-Z0-9_]*\s+)*(\w+)\s*\(([^)]*)\)",
    re.S,
)
# Comments as the compiler drops them: a ``//`` or ``/*`` outside a string or character literal
# (group 1: a literal, kept as it is), once lines ending in a backslash are joined.
_COMMENTS = re.compile(r"""("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')|//[^\n]*|/\*.*?\*/""", re.S)

_SCALAR_KINDS = {
    "uint32_t": "U",
    "unsigned": "U",
    "unsigned int": "U",
    "int32_t": "I",
    "int": "I",
    "float": "F",
    "uint64_t": "L",
    "unsigned long long": "L",
    "size_t": "L",
    "TensorMap": "T",
}


class Param(NamedTuple):
    """One kernel parameter: its C name and its kind letter."""

    name: str
    kind: str


class Signature(tuple):
    """A kernel's parameters in order (a tuple of ``Param``); ``kinds`` is their kind letters."""

    __slots__ = ()

    def __new__(cls, params: Iterable[Param] = ()) -> Signature:
        return super().__new__(cls, params)

    @property
    def kinds(self) -> str:
        return "".join(p.kind for p in self)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self)

    def __repr__(self) -> str:
        return f"Signature({', '.join(f'{p.name}:{p.kind}' for p in self)})"


def param_kind(decl: str) -> str:
    """Kind letter of one C parameter declaration such as ``const bf16* __restrict__ x``."""
    if "*" in decl:
        return "P"
    words = [w for w in decl.replace("__grid_constant__", "").split() if w not in ("const",)]
    type_name = " ".join(words[:-1])  # drop the parameter name
    try:
        return _SCALAR_KINDS[type_name]
    except KeyError:
        raise ValueError(f"unsupported kernel parameter type in {decl!r}") from None


def param_name(decl: str) -> str:
    """The name of one C parameter declaration (``x`` of ``const bf16* __restrict__ x``)."""
    name = decl.replace("*", " ").replace("&", " ").split()[-1]
    if not name.isidentifier():
        raise ValueError(f"no parameter name in {decl!r}")
    return name


def parse_signatures(source: str) -> dict[str, Signature]:
    """``{kernel name: Signature}`` for every ``extern "C" __global__`` kernel in ``source``, as
    the compiler sees it: none inside a comment, no comment taken for a parameter."""
    text = _COMMENTS.sub(lambda m: m.group(1) or " ", source.replace("\\\n", ""))
    out: dict[str, Signature] = {}
    for name, params in _KERNEL.findall(text):
        decls = [p.strip() for p in params.split(",") if p.strip() and p.strip() != "void"]
        out[name] = Signature(Param(param_name(d), param_kind(d)) for d in decls)
    return out


def module_signatures(path: Path) -> dict[str, Signature]:
    return parse_signatures(Path(path).read_text())
