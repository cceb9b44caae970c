"""safetensors reading and writing: every dtype the layers use, fp8 included, and refusals."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from layers import safetensors_io
from tests.helpers import random_bf16, random_fp8


def test_round_trip_every_layer_dtype(tmp_path, rng):
    tensors = {
        "word.weight": random_bf16(rng, (7, 5)),
        "tables.0.weight": random_fp8(rng, (9, 3)),
        "tables.0.row_scale": rng.random(9).astype(np.float32),
        "ids": rng.integers(-5, 5, 4).astype(np.int32),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.float32(rng.random()).reshape(()),
        "transposed": rng.random((3, 5)).astype(np.float32).T,  # not C-contiguous
    }
    path = tmp_path / "w.safetensors"
    safetensors_io.save(path, tensors)
    back = safetensors_io.load(path)
    assert set(back) == set(tensors)
    for name, array in tensors.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape
        assert back[name].tobytes() == array.tobytes()  # C order, bit for bit
    assert not back["word.weight"].flags.writeable


def test_a_failed_save_keeps_the_old_file_and_leaves_no_partial_one(tmp_path, rng, monkeypatch):
    path = tmp_path / "w.safetensors"
    old = {"a": random_bf16(rng, (4, 4))}
    safetensors_io.save(path, old)
    before = path.read_bytes()

    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_io.os, "fsync", no_space)
    with pytest.raises(OSError, match="No space"):
        safetensors_io.save(path, {"a": random_bf16(rng, (64, 64))})
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_truncated_file_and_unknown_dtype_refused(tmp_path, rng):
    path = tmp_path / "w.safetensors"
    safetensors_io.save(path, {"a": random_bf16(rng, (64, 64))})
    whole = path.read_bytes()
    path.write_bytes(whole[:-10])
    base = 8 + struct.unpack("<Q", whole[:8])[0]  # the data start, past the header
    # the offsets named as the file's (the header's data_offsets start after it: issue 44)
    with pytest.raises(ValueError, match=rf"at bytes \[{base}, {base + 64 * 64 * 2}\) of the file \(data_offsets "
                                         rf"\[0, {64 * 64 * 2}\) after the {base}-byte header\) does not hold shape"):
        safetensors_io.load(path)
    header = json.dumps({"x": {"dtype": "F8_E5M2", "shape": [1], "data_offsets": [0, 1]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    with pytest.raises(TypeError, match="unsupported dtype F8_E5M2"):
        safetensors_io.load(path)


def _raw(path, entries: dict, data: bytes) -> None:
    header = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_hostile_headers_are_refused(tmp_path):
    """Two tensors over the same bytes, and a shape whose element count wraps in int64 to fit
    the bytes given (2**62 + 1 rows of 4 f32: 16 bytes), are refused as malformed files, with
    ``ValueError``, not accepted or left to numpy."""
    path = tmp_path / "w.safetensors"
    _raw(path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16))
    with pytest.raises(ValueError, match="tensors 'a' and 'b' share bytes"):
        safetensors_io.read_header(path)
    _raw(path, {"a": {"dtype": "F32", "shape": [2**62 + 1, 4], "data_offsets": [0, 16]}}, bytes(16))
    with pytest.raises(ValueError, match="does not hold shape"):
        safetensors_io.read_header(path)
    _raw(path, {"a": {"dtype": "F32", "shape": [2**70], "data_offsets": [0, 16]}}, bytes(16))
    with pytest.raises(ValueError, match="does not hold shape"):  # not an OverflowError
        safetensors_io.read_header(path)
    _raw(path, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},  # touching, not sharing
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
                "e": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}}, bytes(16))
    assert set(safetensors_io.read_header(path)) == {"a", "b", "e"}


def test_agrees_with_the_safetensors_package(tmp_path, rng):
    st = pytest.importorskip("safetensors.numpy")
    a, f = random_bf16(rng, (6, 4)), rng.random((3, 2)).astype(np.float32)
    ours = tmp_path / "ours.safetensors"
    safetensors_io.save(ours, {"a": a, "f": f})
    theirs = st.load_file(str(ours))
    np.testing.assert_array_equal(theirs["a"].view(np.uint16), a.view(np.uint16))
    np.testing.assert_array_equal(theirs["f"], f)
    written = tmp_path / "theirs.safetensors"
    st.save_file({"a": a, "f": f}, str(written))
    back = safetensors_io.load(written)
    assert back["a"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back["a"].view(np.uint16), a.view(np.uint16))
