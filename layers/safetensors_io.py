"""Read and write safetensors files with numpy, fp8 included, without copying tensors.

The format is an 8-byte little-endian header length, a JSON header (dtype, shape, byte range
of each tensor) and the raw little-endian bytes. The ``safetensors`` package's numpy API cannot
return ``F8_E4M3`` tensors (numpy has no such dtype), and it reads whole tensors into memory;
here each tensor is a read-only ``np.memmap`` view with the ``ml_dtypes`` dtype, so a table is
streamed to the device without a second host copy. Files written here load with the package too.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Mapping

import ml_dtypes
import numpy as np

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


def load(path: str | Path) -> dict[str, np.ndarray]:
    """``{name: read-only memory-mapped array}`` of every tensor in the file."""
    path = Path(path)
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    size = path.stat().st_size
    base = 8 + header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise TypeError(f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype = DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - start != count * dtype.itemsize or base + end > size:
            raise ValueError(f"{path.name}: tensor {name!r} byte range [{start}, {end}) does not "
                             f"hold shape {shape} {info['dtype']} (file is {size} bytes)")
        if count == 0:
            out[name] = np.zeros(shape, dtype)
        else:
            out[name] = np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=shape)
    return out


def save(path: str | Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write ``tensors`` (C-contiguous copies are made where needed) as one safetensors file."""
    header, offset, arrays = {}, 0, []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        if array.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r}: dtype {array.dtype} has no safetensors name here")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with Path(path).open("wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for array in arrays:
            f.write(array.tobytes())
