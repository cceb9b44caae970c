"""``EngramCheckpoint`` over tiny synthetic model folders written with the ``safetensors`` package
(CPU): every tensor reads back byte for byte from a sharded folder and from one file, as memory maps
(nothing is read whole, no shard without Engram tensors is opened); every refusal names the tensor
and its file; ``scan_scales`` names the first row holding the e8m0 NaN byte, reading in chunks."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from layers import safetensors_io
from layers.engram.checkpoint import EMBED, EMBED_SCALE, K_WEIGHT, Q_WEIGHT, WKV, WKV_SCALE, EngramCheckpoint
from layers.engram.config import EngramConfig
from layers.ngram_store.errors import CheckpointError
from tests.helpers.engram import make_tensors, tiny, tiny_config, write_model

SHARD_1 = "model-00001-of-00003.safetensors"  # layer 1's tensors (write_model)
SHARD_2 = "model-00002-of-00003.safetensors"  # layer 3's


def _bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("sharded", [True, False])
def test_every_tensor_reads_back_as_written(tmp_path, rng, sharded):
    model = write_model(tmp_path / "m", rng, sharded=sharded)
    ckpt = EngramCheckpoint.open(model.path)
    assert ckpt.config == tiny() and len(ckpt.tensors) == 12
    for layer in (1, 3):
        weight, scale = ckpt.table(layer)
        assert weight.dtype == ml_dtypes.float8_e4m3fn and scale.dtype == np.uint8
        assert weight.shape == (ckpt.config.num_embeddings[ckpt.config.index(layer)], 64) and scale.shape[1] == 2
        assert _bytes(weight) == _bytes(model.tensors[EMBED.format(layer)])
        assert _bytes(scale) == _bytes(model.tensors[EMBED_SCALE.format(layer)])
        w, s = ckpt.wkv(layer)
        assert w.shape == (96, 384) and s.shape == (3, 12) and s.dtype == np.uint8
        assert _bytes(w) == _bytes(model.tensors[WKV.format(layer)])
        assert _bytes(s) == _bytes(model.tensors[WKV_SCALE.format(layer)])
        for name, array in ((Q_WEIGHT, ckpt.q_weight(layer)), (K_WEIGHT, ckpt.k_weight(layer))):
            assert array.dtype == ml_dtypes.bfloat16 and array.shape == (2, 32)
            assert _bytes(array) == _bytes(model.tensors[name.format(layer)])
        ckpt.scan_scales(layer)


def test_nothing_is_mapped_on_open_and_tables_are_memory_maps(tmp_path, rng, monkeypatch):
    """``open`` reads headers only (the shard holding no Engram tensor, not a safetensors file at
    all, is never opened); the arrays are ``np.memmap`` views of the files, not copies."""
    model = write_model(tmp_path / "m", rng)
    headers = []
    real_header = safetensors_io.read_header
    monkeypatch.setattr(safetensors_io, "read_header", lambda p: headers.append(Path(p).name) or real_header(p))
    monkeypatch.setattr(np, "memmap", lambda *a, **k: pytest.fail("open mapped a tensor"))
    ckpt = EngramCheckpoint.open(model.path)
    monkeypatch.undo()
    assert sorted(headers) == [SHARD_1, SHARD_2] == sorted(p.name for p in ckpt.shards)
    for layer in (1, 3):
        arrays = [*ckpt.table(layer), *ckpt.wkv(layer), ckpt.q_weight(layer), ckpt.k_weight(layer)]
        assert all(isinstance(a, np.memmap) and not a.flags.writeable for a in arrays)
        assert Path(arrays[0].filename).name == (SHARD_1 if layer == 1 else SHARD_2)


def _break(rng, cfg: EngramConfig, pattern: str, change) -> dict:
    """``make_tensors`` with layer 1's ``pattern`` tensor dropped (``change`` None) or changed."""
    tensors = make_tensors(rng, cfg)
    name = pattern.format(1)
    if change is None:
        del tensors[name]
    else:
        tensors[name] = change(tensors[name])
    return tensors


def _rows(a):
    return np.concatenate([a, a[:1]])  # one row too many


CASES = {
    # what is broken: (the tensor, its change, the file named, what the message says)
    "missing table": (EMBED, None, "model.safetensors.index.json", "no tensor 'layers.1.engram.embed.weight'"),
    "missing scale": (EMBED_SCALE, None, "model.safetensors.index.json", "no tensor 'layers.1.engram.embed.scale'"),
    "missing wkv": (WKV, None, "model.safetensors.index.json", "no tensor 'layers.1.engram.wkv.weight'"),
    "missing wkv scale": (WKV_SCALE, None, "model.safetensors.index.json", "no tensor 'layers.1.engram.wkv.scale'"),
    "missing q": (Q_WEIGHT, None, "model.safetensors.index.json", "no tensor 'layers.1.engram.q_weight'"),
    "missing k": (K_WEIGHT, None, "model.safetensors.index.json", "no tensor 'layers.1.engram.k_weight'"),
    "bf16 table": (EMBED, lambda a: a.astype(ml_dtypes.bfloat16), SHARD_1,
                   "tensor 'layers.1.engram.embed.weight' is BF16; served: F8_E4M3"),
    "u8 scale": (EMBED_SCALE, lambda a: a.view(np.uint8), SHARD_1,
                 "tensor 'layers.1.engram.embed.scale' is U8; served: F8_E8M0"),
    "f32 wkv scale": (WKV_SCALE, lambda a: a.astype(np.float32), SHARD_1,
                      "tensor 'layers.1.engram.wkv.scale' is F32; served: F8_E8M0"),
    "f32 q": (Q_WEIGHT, lambda a: a.astype(np.float32), SHARD_1,
              "tensor 'layers.1.engram.q_weight' is F32; served: BF16"),
    "table rows": (EMBED, _rows, SHARD_1,
                   r"tensor 'layers.1.engram.embed.weight' has shape \[661, 64\], config.json gives \[660, 64\] "
                   r"\(engram_num_embeddings\[0\], engram_head_dim\)"),
    "scale columns": (EMBED_SCALE, lambda a: a[:, :1], SHARD_1,
                      r"tensor 'layers.1.engram.embed.scale' has shape \[660, 1\], config.json gives \[660, 2\]"),
    "wkv transposed": (WKV, lambda a: np.ascontiguousarray(a.T), SHARD_1,
                       r"tensor 'layers.1.engram.wkv.weight' has shape \[384, 96\], config.json gives \[96, 384\]"),
    "wkv scale rows": (WKV_SCALE, lambda a: a[:2], SHARD_1,
                       r"tensor 'layers.1.engram.wkv.scale' has shape \[2, 12\], config.json gives \[3, 12\]"),
    "k columns": (K_WEIGHT, lambda a: a[:, :16], SHARD_1,
                  r"tensor 'layers.1.engram.k_weight' has shape \[2, 16\], config.json gives \[2, 32\]"),
}


@pytest.mark.parametrize("case", CASES)
def test_every_refusal_names_the_tensor_and_its_file(tmp_path, rng, case):
    name, change, file, message = CASES[case]
    tensors = _break(rng, tiny(), name, change)
    model = write_model(tmp_path / "m", rng, tensors=tensors)
    with pytest.raises(CheckpointError, match=rf"^{model.path / file}: .*{message}"):
        EngramCheckpoint.open(model.path)


def test_a_missing_tensor_of_a_single_file_names_that_file(tmp_path, rng):
    model = write_model(tmp_path / "m", rng, sharded=False, tensors=_break(rng, tiny(), K_WEIGHT, None))
    with pytest.raises(CheckpointError, match=rf"^{model.path / 'model.safetensors'}: no tensor '{K_WEIGHT.format(1)}'"):
        EngramCheckpoint.open(model.path)


def test_a_config_whose_primes_do_not_sum_to_its_rows_is_refused(tmp_path, rng):
    model = write_model(tmp_path / "m", rng)
    (model.path / "config.json").write_text(json.dumps(tiny_config(engram_num_embeddings=[661, 864])))
    with pytest.raises(CheckpointError, match=rf"{model.path / 'config.json'}: engram_num_embeddings\[0\] = 661 "
                                              r"rows for layer 1, but its 6 prime buckets .* sum to 660"):
        EngramCheckpoint.open(model.path)


def _shorten(path: Path, name: str) -> None:
    """Make tensor ``name`` of a safetensors file span one byte less (its header entry rewritten
    in place, the header keeping its length)."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header[name]["data_offsets"][1] -= 1
    blob = json.dumps(header, separators=(",", ":")).encode()
    assert len(blob) <= n
    raw[8 : 8 + n] = blob + b" " * (n - len(blob))
    path.write_bytes(bytes(raw))


def test_an_e8m0_tensor_whose_bytes_do_not_hold_its_shape_is_refused(tmp_path, rng):
    """``read_header`` checks the byte span only for dtypes numpy has; F8_E8M0's is checked here."""
    model = write_model(tmp_path / "m", rng)
    name = WKV_SCALE.format(1)
    _shorten(model.path / SHARD_1, name)
    with pytest.raises(CheckpointError, match=rf"{model.path / SHARD_1}: tensor '{name}' \(F8_E8M0\) spans 35 bytes; "
                                              r"shape \[3, 12\] at 1 byte\(s\) per element needs 36"):
        EngramCheckpoint.open(model.path)


def test_arrays_refuse_a_layer_without_engram(tmp_path, rng):
    ckpt = EngramCheckpoint.open(write_model(tmp_path / "m", rng).path)
    for method in (ckpt.table, ckpt.wkv, ckpt.q_weight, ckpt.k_weight, ckpt.scan_scales):
        with pytest.raises(ValueError, match=r"layer 2 has no Engram \(engram_layer_ids \[1, 3\]\)"):
            method(2)
        with pytest.raises(TypeError, match="layer must be an int"):
            method("1")
    with pytest.raises(ValueError, match="chunk_bytes must be an int >= 1"):
        ckpt.scan_scales(1, chunk_bytes=0)


@pytest.mark.parametrize("which", [EMBED_SCALE, WKV_SCALE])
def test_scan_scales_names_the_first_row_holding_the_nan_byte(tmp_path, rng, monkeypatch, which):
    cfg = tiny()
    tensors = make_tensors(rng, cfg)
    scale = tensors[which.format(3)].view(np.uint8).copy()
    rows, cols = scale.shape
    first = int(rng.integers(1, rows - 1))
    col = int(rng.integers(0, cols))
    scale[first, col] = 255
    scale[first + 1 :, :][rng.random((rows - first - 1, cols)) < 0.3] = 255  # later bad rows: not named
    tensors[which.format(3)] = scale.view(ml_dtypes.float8_e8m0fnu)
    model = write_model(tmp_path / "m", rng, tensors=tensors)
    ckpt = EngramCheckpoint.open(model.path)
    ckpt.scan_scales(1)  # layer 1 is clean
    monkeypatch.setattr(np, "memmap", lambda *a, **k: pytest.fail("scan_scales mapped the tensor"))
    for chunk in (1, 5, cols * 2, 1 << 24):  # one row at a time, rows across chunk edges, all at once
        with pytest.raises(CheckpointError, match=rf"{model.path / SHARD_2}: tensor '{which.format(3)}': row {first} "
                                                  rf"holds the e8m0 byte 255 \(NaN\) in column {col} "):
            ckpt.scan_scales(3, chunk_bytes=chunk)


def test_a_scale_byte_of_254_is_no_nan(tmp_path, rng):
    tensors = make_tensors(rng, tiny())
    s = tensors[EMBED_SCALE.format(1)].view(np.uint8).copy()
    s[rng.integers(0, len(s))] = 254
    s[0] = 0
    tensors[EMBED_SCALE.format(1)] = s.view(ml_dtypes.float8_e8m0fnu)
    EngramCheckpoint.open(write_model(tmp_path / "m", rng, tensors=tensors).path).scan_scales(1, chunk_bytes=7)


def test_the_helper_writes_finite_fp8_and_sane_scales(rng):
    """The synthetic weights are what a real checkpoint holds: no NaN, scales 2^-7 .. 2^7."""
    tensors = make_tensors(rng, tiny())
    for name, a in tensors.items():
        if a.dtype == ml_dtypes.float8_e8m0fnu:
            assert 120 <= a.view(np.uint8).min() and a.view(np.uint8).max() <= 134, name
        else:
            assert np.isfinite(a.astype(np.float32)).all(), name
