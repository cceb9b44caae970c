"""Kernel signatures read from ``.cu`` source: the argument kinds each kernel takes, by position.

Arguments are passed by position, so a launcher that swaps two ``uint32_t`` or passes a pointer
where a length belongs launches garbage. The backend checks every new (kernel, argument kinds)
pair against the signature read here, and a CPU test checks every launcher against it.

Kinds: ``P`` pointer (any ``T*``), ``U`` u32, ``I`` i32, ``F`` f32, ``L`` u64.
"""

from __future__ import annotations

import re
from pathlib import Path

_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+'
    r"(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)",
    re.S,
)
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)

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
}


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


def parse_signatures(source: str) -> dict[str, str]:
    """``{kernel name: kinds}`` for every ``extern "C" __global__`` kernel in ``source``."""
    text = _COMMENTS.sub(" ", source)
    out: dict[str, str] = {}
    for name, params in _KERNEL.findall(text):
        decls = [p.strip() for p in params.split(",") if p.strip() and p.strip() != "void"]
        out[name] = "".join(param_kind(d) for d in decls)
    return out


def module_signatures(path: Path) -> dict[str, str]:
    return parse_signatures(Path(path).read_text())
