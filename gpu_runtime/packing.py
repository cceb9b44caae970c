"""Kernel arguments packed to the C ABI: one letter per argument kind, one ``struct`` code each.

Kinds: ``P`` pointer, ``U`` u32, ``I`` i32, ``F`` f32, ``L`` u64 (``struct``'s native alignment
is the C ABI's, so ``@`` formats give the offsets ``cuLaunchKernel`` expects).
"""

from __future__ import annotations

import ctypes
import struct

STRUCT_CODES = {"P": "Q", "U": "I", "I": "i", "F": "f", "L": "Q"}
KIND_NAMES = {"P": "pointer", "U": "u32", "I": "i32", "F": "f32", "L": "u64"}


def struct_format(kinds: str) -> str:
    return "@" + "".join(STRUCT_CODES[k] for k in kinds)


class ArgPlan:
    """Packed-argument scratch for one argument-kind string: the C ABI layout and a ``void*[]``
    pointing into it, built once and reused for every launch of that shape on one thread.
    ``cuLaunchKernel`` copies the arguments before returning, so reuse is safe."""

    __slots__ = ("packer", "buffer", "pointers", "params", "offsets", "sizes")

    def __init__(self, kinds: str) -> None:
        fmt = struct_format(kinds)
        self.packer = struct.Struct(fmt)
        self.sizes = [struct.calcsize("@" + STRUCT_CODES[k]) for k in kinds]
        self.offsets = [
            struct.calcsize(fmt[: i + 2]) - self.sizes[i] for i in range(len(kinds))
        ]
        self.buffer = ctypes.create_string_buffer(max(self.packer.size, 1))
        base = ctypes.addressof(self.buffer)
        self.pointers = (ctypes.c_void_p * max(len(kinds), 1))(*[base + o for o in self.offsets])
        self.params = ctypes.addressof(self.pointers) if kinds else 0


def kinds_mismatch(where: str, expected: str, given: str) -> str:
    """Why a launch's kinds do not fit a kernel's (a message naming the first difference)."""
    if len(expected) != len(given):
        return f"{where}: takes {len(expected)} arguments ({expected}), {len(given)} given ({given})"
    i = next(i for i, (a, b) in enumerate(zip(expected, given)) if a != b)
    return f"{where}: argument {i} must be {KIND_NAMES[expected[i]]}, launch passes {KIND_NAMES[given[i]]}"
