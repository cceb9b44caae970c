"""A Hugging Face model folder as the model packages read it: ``config.json``, the weight files (one
``model.safetensors``, or an index naming shards) and their tensors found by name, memory-mapped only
on demand. Every refusal is a ``CheckpointError`` naming the folder, file or tensor.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import safetensors_io
from .ngram_store.errors import CheckpointError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def as_path(value: str | os.PathLike, what: str) -> Path:
    """``value`` as a Path; ``TypeError`` naming ``what`` for anything but a str or os.PathLike."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path (str or os.PathLike), got {type(value).__name__}")
    return Path(value)


def model_folder(model_dir: str | os.PathLike) -> Path:
    """``model_dir`` as a Path, or a ``CheckpointError`` naming it: missing, not a folder, or one
    that cannot be listed (``TypeError`` for what is no path)."""
    path = as_path(model_dir, "model_dir")
    try:
        with os.scandir(path):
            pass
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such model folder") from None
    except NotADirectoryError:
        raise CheckpointError(f"{path}: not a folder (a model folder holds {CONFIG} and *.safetensors)") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read the model folder ({err.strerror or err})") from None
    return path


def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The folder's ``config.json`` as a dict; ``CheckpointError`` for a missing or unreadable
    folder or file, invalid JSON, or JSON that is not an object (``TypeError`` for what is no path)."""
    path = as_path(model_dir, "model_dir") / CONFIG
    try:
        text = path.read_text()
    except OSError as err:
        model_folder(model_dir)  # the folder itself missing or unreadable: named as such
        if isinstance(err, FileNotFoundError):
            raise CheckpointError(f"{path}: no {CONFIG} (not a Hugging Face model folder?)") from None
        raise CheckpointError(f"{path}: cannot read it ({err.strerror or err})") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: a JSON {type(config).__name__}, not an object")
    return config


@dataclass(frozen=True)
class TensorRef:
    """A tensor of the checkpoint: its file and header entry (nothing mapped until ``array``)."""

    path: Path
    info: safetensors_io.TensorInfo

    @property
    def name(self) -> str:
        """The tensor's name in its file."""
        return self.info.name

    @property
    def dtype(self) -> str:
        """The dtype as the file spells it (``BF16``, ``F8_E4M3``, ``F8_E8M0`` ...)."""
        return self.info.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape the header gives."""
        return self.info.shape

    def where(self) -> str:
        """``"<file>: tensor '<name>'"``, the start of every message about this tensor."""
        return f"{self.path}: tensor {self.name!r}"

    def array(self) -> np.ndarray:
        """A read-only memory map of the tensor."""
        return safetensors_io.map_tensor(self.path, self.info)

    def check_bytes(self, itemsize: int) -> None:
        """``CheckpointError`` unless the tensor spans its shape at ``itemsize`` bytes per element
        (``read_header`` checks this only for the dtypes numpy has)."""
        count = math.prod(self.shape) * itemsize
        if self.info.nbytes != count:
            raise CheckpointError(
                f"{self.where()} ({self.dtype}) spans {self.info.nbytes} bytes; shape {list(self.shape)} "
                f"at {itemsize} byte(s) per element needs {count}"
            )

    def byte_array(self) -> np.ndarray:
        """A read-only ``uint8`` memory map of a one-byte-per-element tensor, whatever its dtype
        (``F8_E8M0`` has no numpy dtype); ``CheckpointError`` where the bytes do not hold its shape."""
        self.check_bytes(1)
        if self.info.nbytes == 0:
            return np.zeros(self.shape, np.uint8)
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.info.start, shape=self.shape)


def weight_files(model_dir: str | os.PathLike) -> tuple[dict[str, Path] | None, Path]:
    """Where the tensors are: ``(None, model.safetensors)`` for a single file, else the index's
    ``(weight_map as {tensor: shard path}, index path)``. Shards are only named here, not opened."""
    model_dir = Path(model_dir)
    single, index = model_dir / SINGLE, model_dir / INDEX
    if single.is_file():  # as transformers: the single file wins over an index
        return None, single
    if not index.is_file():
        raise CheckpointError(f"{model_dir}: neither {SINGLE} nor {INDEX}")
    try:
        data = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{index}: not valid JSON ({err})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
    out = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise CheckpointError(
                f"{index}: tensor {name!r} maps to {shard!r}, not a file name inside the model folder"
            )
        out[name] = model_dir / shard
    return out, index


class Tensors:
    """The tensors of a model folder by name, reading each needed shard's header once (and only
    those): ``source`` is the single file or the index, ``headers`` the files read so far."""

    def __init__(self, model_dir: Path) -> None:
        self.weight_map, self.source = weight_files(model_dir)
        self.headers: dict[Path, dict[str, safetensors_io.TensorInfo]] = {}

    def _header(self, path: Path) -> dict[str, safetensors_io.TensorInfo]:
        if path not in self.headers:
            if not path.is_file():
                raise CheckpointError(f"{self.source}: shard {path.name} (listed in the index) does not exist")
            try:
                self.headers[path] = safetensors_io.read_header(path)
            except ValueError as err:
                text = str(err)
                text = text[len(path.name) + 2 :] if text.startswith(path.name + ": ") else text
                raise CheckpointError(f"{path}: {text}") from None
        return self.headers[path]

    def find(self, name: str) -> TensorRef | None:
        """The tensor ``name``, or None where the folder has none (an index that maps it to a
        shard without it is a ``CheckpointError``)."""
        if self.weight_map is None:
            header = self._header(self.source)
            return TensorRef(self.source, header[name]) if name in header else None
        path = self.weight_map.get(name)
        if path is None:
            return None
        header = self._header(path)
        if name not in header:
            raise CheckpointError(f"{path}: no tensor {name!r}, though {self.source.name} maps it there")
        return TensorRef(path, header[name])

    def get(self, name: str) -> TensorRef:
        """The tensor ``name``; ``CheckpointError`` naming the single file or index without it."""
        ref = self.find(name)
        if ref is None:
            raise CheckpointError(f"{self.source}: no tensor {name!r}")
        return ref


def expect(ref: TensorRef, shape: tuple[int, ...], dtypes: Sequence[str], why: str) -> None:
    """``CheckpointError`` naming the tensor and its file unless it has ``shape`` (``why``: the
    config keys that give it) and one of ``dtypes``."""
    if ref.shape != shape:
        raise CheckpointError(f"{ref.where()} has shape {list(ref.shape)}, {CONFIG} gives {list(shape)} ({why})")
    if ref.dtype not in dtypes:
        raise CheckpointError(f"{ref.where()} is {ref.dtype}; served: {', '.join(dtypes)}")
