"""Kernel arguments packed to the C ABI: one letter per argument kind, one ``struct`` code each.

Kinds: ``P`` pointer, ``U`` u32, ``I`` i32, ``F`` f32, ``L`` u64, ``T`` tensor map (a ``CUtensorMap``
by value: 128 bytes, 64-byte aligned, the ``bytes`` that ``cuTensorMapEncodeTiled`` wrote). Each
argument sits at the next offset aligned to its alignment (the C ABI's layout, which
``cuLaunchKernel`` expects), written with
explicit pad bytes in a little-endian standard-size format (every CUDA host is little-endian):
unlike the native ``@`` formats, standard ones refuse an f32 that overflows instead of storing
infinity, so packing itself range-checks every kind.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence
from typing import Any

TENSOR_MAP_BYTES = 128
STRUCT_CODES = {"P": "Q", "U": "I", "I": "i", "F": "f", "L": "Q", "T": f"{TENSOR_MAP_BYTES}s"}
KIND_NAMES = {"P": "pointer", "U": "u32", "I": "i32", "F": "f32", "L": "u64", "T": "tensor map"}
KIND_SIZES = {"P": 8, "U": 4, "I": 4, "F": 4, "L": 8, "T": TENSOR_MAP_BYTES}
KIND_ALIGN = {**KIND_SIZES, "T": 64}


def layout(kinds: str) -> tuple[list[int], list[int]]:
    """(offsets, sizes) of each argument in the packed buffer: what the driver must report."""
    offsets, sizes, end = [], [], 0
    for kind in kinds:
        size, align = KIND_SIZES[kind], KIND_ALIGN[kind]
        end = -(-end // align) * align
        offsets.append(end)
        sizes.append(size)
        end += size
    return offsets, sizes


def struct_format(kinds: str) -> str:
    """The ``struct`` format of ``layout(kinds)``: little-endian, pad bytes spelt out."""
    fmt, end = ["<"], 0
    for kind, offset in zip(kinds, layout(kinds)[0]):
        fmt.append("x" * (offset - end) + STRUCT_CODES[kind])
        end = offset + KIND_SIZES[kind]
    return "".join(fmt)


class ArgPlan:
    """Packed-argument scratch for one argument-kind string: the C ABI layout and a ``void*[]``
    pointing into it, built once and reused for every launch of that shape on one thread.
    ``cuLaunchKernel`` copies the arguments before returning, so reuse is safe."""

    __slots__ = ("packer", "buffer", "pointers", "params", "offsets", "sizes", "pack")

    def __init__(self, kinds: str) -> None:
        self.packer = struct.Struct(struct_format(kinds))
        self.offsets, self.sizes = layout(kinds)
        self.buffer = ctypes.create_string_buffer(max(self.packer.size, 1))
        base = ctypes.addressof(self.buffer)
        self.pointers = (ctypes.c_void_p * max(len(kinds), 1))(*[base + o for o in self.offsets])
        self.params = ctypes.addressof(self.pointers) if kinds else 0
        self.pack = _sequence_packer(self.packer, self.buffer, len(kinds))


def _sequence_packer(packer: struct.Struct, buffer: Any, count: int) -> Callable[[Sequence[Any]], None]:
    """``pack(values)``: ``values`` (a sequence of ``count``) packed into ``buffer``. Written out
    per count: ``pack_into(buffer, 0, *values)`` costs about twice as much."""
    names = "".join(f"a{i}, " for i in range(count))
    source = f"def pack(values):\n    {names}= values\n    pack_into(buffer, 0, {names})\n"
    if not count:
        source = "def pack(values):\n    pack_into(buffer, 0)\n"
    namespace: dict[str, Any] = {"pack_into": packer.pack_into, "buffer": buffer}
    exec(compile(source, f"<pack {count}>", "exec"), namespace)
    return namespace["pack"]


def kinds_mismatch(where: str, expected: str, given: str) -> str:
    """Why a launch's kinds do not fit a kernel's (a message naming the first difference)."""
    if len(expected) != len(given):
        return f"{where}: takes {len(expected)} arguments ({expected}), {len(given)} given ({given})"
    i = next(i for i, (a, b) in enumerate(zip(expected, given)) if a != b)
    return f"{where}: argument {i} must be {KIND_NAMES[expected[i]]}, launch passes {KIND_NAMES[given[i]]}"
