"""Read and write safetensors files with numpy, fp8 included, without copying tensors.

The format is an 8-byte little-endian header length, a JSON header (dtype, shape, byte range
of each tensor) and the raw little-endian bytes. The ``safetensors`` package's numpy API cannot
return ``F8_E4M3`` tensors (numpy has no such dtype), and it reads whole tensors into memory;
here each tensor is a read-only ``np.memmap`` view with the ``ml_dtypes`` dtype, so a table is
streamed to the device without a second host copy. Files written here load with the package too.

``read_header`` reads one file's header only (no tensor is mapped), ``map_tensor`` maps one
tensor of it: a sharded checkpoint's loader opens only the shards, and maps only the tensors,
it needs.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from .atomic_write import write_atomically

DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
    "U32": np.dtype("<u4"),
}
_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header: its dtype name as the file spells it (kept
    even where this reader has no numpy dtype for it), shape and absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """The header of one file, read without touching (or mapping) any tensor data: ``{name:
    TensorInfo}``. Checks the header's structure and that every byte range lies inside the file;
    a dtype this reader cannot map is kept by name (``map_tensor`` raises for it), so a shard whose
    other tensors have exotic dtypes can still be read for the ones that matter."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path.name}: file is {size} bytes, too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise ValueError(
                f"{path.name}: header length {header_len} runs past the end of the "
                f"file ({size} bytes); not a safetensors file?"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path.name}: header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: header is a JSON {type(header).__name__}, not an object")
    base = 8 + header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (
                isinstance(dtype, str)
                and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)
                and type(start) is int
                and type(end) is int
                and 0 <= start <= end
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{path.name}: tensor {name!r} has a malformed header entry {info!r}")
        shape = tuple(shape)
        if dtype in DTYPES:
            count = math.prod(shape)  # Python ints: a huge shape cannot wrap to a small count
            ok = end - start == count * DTYPES[dtype].itemsize
        if not ok or base + end > size:
            raise ValueError(
                f"{path.name}: tensor {name!r} at bytes [{base + start}, {base + end}) of the file "
                f"(data_offsets [{start}, {end}) after the {base}-byte header) does not hold shape {shape} "
                f"{dtype} (file is {size} bytes)"
            )
        out[name] = TensorInfo(name, dtype, shape, base + start, base + end)
    ranges = sorted((t.start, t.end, t.name) for t in out.values() if t.end > t.start)
    for (_, end_a, a), (start_b, _, b) in zip(ranges, ranges[1:]):
        if start_b < end_a:  # two tensors over the same bytes: the spec gives each its own
            raise ValueError(f"{path.name}: tensors {a!r} and {b!r} share bytes of the file")
    return out


def map_tensor(path: str | os.PathLike, info: TensorInfo) -> np.ndarray:
    """A read-only memory-mapped array of one tensor of ``read_header(path)``."""
    path = Path(path)
    if info.dtype not in DTYPES:
        raise TypeError(f"{path.name}: tensor {info.name!r} has unsupported dtype {info.dtype}")
    dtype = DTYPES[info.dtype]
    if info.nbytes == 0:
        return np.zeros(info.shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=info.start, shape=info.shape)


def load(path: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """``{name: read-only memory-mapped array}`` of every tensor in the file (or of ``names``
    only: a missing one is a KeyError naming the file)."""
    header = read_header(path)
    if names is None:
        names = list(header)
    out = {}
    for name in names:
        if name not in header:
            raise KeyError(f"{Path(path).name}: no tensor {name!r}")
        out[name] = map_tensor(path, header[name])
    return out


def save(path: str | os.PathLike, tensors: Mapping[str, np.ndarray]) -> None:
    """Write ``tensors`` (C-contiguous copies are made where needed; 0-d arrays keep shape ``[]``)
    as one safetensors file, replaced whole (``write_atomically``): a failed write leaves what was
    there before, and no partial file."""
    header, offset, arrays = {}, 0, []
    for name, array in tensors.items():
        array = np.asarray(array)
        if array.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r}: dtype {array.dtype} has no safetensors name here")
        header[name] = {
            "dtype": _NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    head = struct.pack("<Q", len(blob)) + blob
    write_atomically(path, itertools.chain([head], (a.tobytes() for a in arrays)))  # one copy at a time, C order
