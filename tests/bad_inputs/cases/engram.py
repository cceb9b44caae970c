"""The Engram cases (``layers.engram``): the config, the token map, the checkpoint, the weights
(``EngramWeights`` from arrays and from a checkpoint), ``EngramDecoder`` constructed and called,
``lookup_all``, and the numpy references (``layers.reference.engram``). Every subject is
``World.engram`` (``EngramSubjects``: tiny config, weights, decoders, a model folder, map files)
or a fresh damaged copy: a model folder, a config file, an array. Device values (token ids past
the vocabulary, bad slots or ``cu_seqlens``) are flagged by the kernels in the error word: GPU
tests in tests/test_engram_decoder.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gpu_runtime import ClosedError, DeviceArray
from layers.dense_weight import BF16
from layers.engram import (DeviceBudget, EngramCheckpoint, EngramConfig, EngramDecoder, EngramWeights, Shard,
                           TokenMap, lookup_all)
from layers.engram.checkpoint import E8M0_NAN, EMBED, EMBED_SCALE, WKV, WKV_SCALE
from layers.ngram_store.errors import CheckpointError
from layers.ops import gemm_fp8
from layers.reference import engram as ref
from tests.bad_inputs.matrix import GPU_TYPE, NULL, case, expect
from tests.bad_inputs.world import FakeCollective, World
from tests.helpers import engram as helpers
from tests.helpers import random_bf16, random_fp8
from tests.helpers.fakes import ForeignArray

E = ("engram",)  # the world's Engram subjects, built before the snapshot
RANKS = ("engram", "group")


def _case(row: str, column: str, fn: Callable[[World], Any], exc: type[BaseException] | None = None,
          match: str | None = None, *, needs: tuple[str, ...] = E, **keywords: Any) -> Any:
    """A case on the world's Engram subjects."""
    return case(row, column, fn, exc, match, needs=needs, **keywords)


# -- fresh damaged copies ---------------------------------------------------------------------
def _config_dir(w: World, name: str, **changes: Any) -> Path:
    """A subfolder holding ``tiny_config(**changes)`` as its config.json."""
    folder = w.empty_dir(name)
    (folder / "config.json").write_text(json.dumps(helpers.tiny_config(**changes)))
    return folder


def _with_quant(**quant: Any) -> dict:
    config = helpers.tiny_config()
    config["quantization_config"] = quant
    return config


def _model(w: World, name: str, changes: dict[str, Callable[[np.ndarray], Any]] | None = None,
           config: dict | None = None) -> Path:
    """A fresh tiny model folder (a subfolder) of ``tiny()``'s tensors, each named in ``changes``
    replaced by ``change(tensor)`` (None: removed)."""
    tensors = helpers.make_tensors(w.rng, helpers.tiny())
    for key, change in (changes or {}).items():
        new = change(tensors.pop(key))
        if new is not None:
            tensors[key] = new
    return helpers.write_model(w.tmp / name, w.rng, config, tensors=tensors).path


def _open(w: World, name: str, changes: dict | None = None, config: dict | None = None) -> EngramCheckpoint:
    return EngramCheckpoint.open(_model(w, name, changes, config))


def _nan(row: int, col: int) -> Callable[[np.ndarray], np.ndarray]:
    """A copy of e8m0 scales with the byte 255 (NaN) at ``[row, col]``."""
    def put(scale: np.ndarray) -> np.ndarray:
        raw = np.array(scale).view(np.uint8)
        raw[row, col] = E8M0_NAN
        return raw.view(scale.dtype)
    return put


def _map(w: World, **changes: Any) -> TokenMap:
    return helpers.token_map(w.rng, helpers.tiny(**changes))


def _from_arrays(w: World, **over: Any) -> EngramWeights:
    """``EngramWeights.from_arrays`` of the subjects' arguments, ``over`` replacing some."""
    e = w.engram
    a = e.arrays
    args = dict(gpu=w.gpu, config=e.cfg, token_map=e.map, tables=a["tables"], wkv=a["wkv"], q_weight=a["q"],
                k_weight=a["k"])
    keywords = {k: over.pop(k) for k in ("placement", "shard", "stream") if k in over}
    return EngramWeights.from_arrays(*(args | over).values(), **keywords)


def _layer3(entries: list, value: Any) -> list:
    """``entries`` with layer 3's (the second) replaced."""
    return [entries[0], value]


def _table3(w: World, weight: Any = None, scale: Any = None) -> list:
    """The subjects' tables with layer 3's weight or scale replaced."""
    old = w.engram.arrays["tables"][1]
    new = (old[0] if weight is None else weight, old[1] if scale is None else scale)
    return _layer3(w.engram.arrays["tables"], new)


def _residual(w: World, shape: tuple[int, ...], typestr: str = "<V2", readonly: bool = False) -> ForeignArray:
    return ForeignArray(w.p[3], shape, typestr, readonly)


def _all(w: World, **over: Any) -> None:
    """``lookup_all`` over the world's group (built before the snapshot: ``needs``) and the
    subjects' ranks, 2 sequences of 5 tokens, ``over`` replacing an argument."""
    args = dict(group=w.group, ranks=w.engram.ranks, tokens=[w.p[0]] * 2, cu_seqlens=[w.p[1]] * 2,
                slots=[w.p[2]] * 2, num_seqs=2, num_tokens=5, streams=[0, 0])
    lookup_all(*(args | over).values())


class _Ref:
    """Inputs of the references: an fp8 table of 10 rows of 64 with its scales, ``wkv`` [96, 128]
    with its scales, a residual [3, 2, 32], gate weights, a text mask, row ids [3, 2]."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.table, self.table_scale = random_fp8(rng, (10, 64)), helpers.scale_bytes(rng, (10, 2))
        self.wkv, self.wkv_scale = random_fp8(rng, (96, 128)), helpers.scale_bytes(rng, (3, 4))
        self.x = random_bf16(rng, (3, 2, 32))
        self.q, self.k = random_bf16(rng, (2, 32)), random_bf16(rng, (2, 32))
        self.mask = np.array([True, False, True])
        self.ids = rng.integers(0, 10, (3, 2))
        self.kv = random_bf16(rng, (3, 96))

    def layer(self, **over: Any) -> ref.EngramRef:
        args = dict(x=self.x, row_ids=self.ids, table=self.table, table_scale=self.table_scale, wkv_weight=self.wkv,
                    wkv_scale=self.wkv_scale, q_weight=self.q, k_weight=self.k, text_mask=self.mask, eps=1e-6,
                    hc_mult=2)
        return ref.engram_layer_ref(**(args | over))

    def gate(self, **over: Any) -> tuple:
        args = dict(x=self.x, kv=self.kv, q_weight=self.q, k_weight=self.k, text_mask=self.mask, eps=1e-6, hc_mult=2)
        return ref.gate_ref(**(args | over))


def _r(w: World) -> _Ref:
    return _Ref(w.rng)


TABLE_TYPE = r"Engram layer 3 table: dtype float32, expected float8_e4m3fn or uint8"
SCALE_NAN = r"Engram layer 3 table scale: row 7 holds the e8m0 byte 255 \(NaN\) in column 1"

CPU_CASES = [
    # -- EngramConfig.from_dict / from_pretrained --
    case("EngramConfig", "dtype", lambda w: EngramConfig.from_dict(helpers.tiny_config(
        engram_n_heads="2", engram_num_embeddings=[660, 864])), TypeError,
         "engram_n_heads must be an int, got str '2'"),
    case("EngramConfig", "dtype", lambda w: EngramConfig.from_dict([]), TypeError, "config must be a dict, got list",
         detail="config"),
    case("EngramConfig", "dtype", lambda w: EngramConfig.from_dict(helpers.tiny_config(rms_norm_eps="1e-6")),
         TypeError, "rms_norm_eps must be a number, got str", detail="eps"),
    case("EngramConfig", "dtype", lambda w: EngramConfig.from_dict(_with_quant(weight_block_size=32)), TypeError,
         "quantization_config.weight_block_size must be a list of two ints, got 32", detail="block"),
    case("EngramConfig", "shape", lambda w: EngramConfig.from_dict(helpers.tiny_config(engram_head_dim=48)),
         ValueError, "engram_head_dim = 48 is not a multiple of the 32-column scale block"),
    case("EngramConfig", "shape", lambda w: EngramConfig.from_dict(_with_quant(weight_block_size=[128, 128])),
         ValueError, r"weight_block_size = \[128, 128\]; served: \[32, 32\]", detail="block"),
    case("EngramConfig", "length", lambda w: EngramConfig.from_dict(helpers.tiny_config(engram_num_embeddings=[660])),
         ValueError, "engram_num_embeddings has 1 entries, engram_layer_ids 2: one table per layer"),
    case("EngramConfig", "range", lambda w: EngramConfig.from_dict(helpers.tiny_config(
        engram_num_embeddings=[661, 864])), ValueError,
         r"engram_num_embeddings\[0\] = 661 rows for layer 1, but its 6 prime buckets .* sum to 660"),
    case("EngramConfig", "range", lambda w: EngramConfig.from_pretrained(_config_dir(
        w, "rows", engram_num_embeddings=[660, 865])), CheckpointError,
         r"rows/config\.json: engram_num_embeddings\[1\] = 865 rows for layer 3", detail="from_pretrained"),
    case("EngramConfig", "range", lambda w: EngramConfig.from_dict(helpers.tiny_config(rms_norm_eps=-1.0)),
         ValueError, "rms_norm_eps must be a finite number > 0, got -1.0", detail="eps"),
    case("EngramConfig", "range", lambda w: EngramConfig.from_dict(helpers.tiny_config(
        engram_compressed_vocab_size=51)), ValueError, "engram_compressed_vocab_size = 51 exceeds vocab_size = 50",
         detail="compressed"),
    case("EngramConfig", "range", lambda w: EngramConfig.from_dict(_with_quant(scale_fmt="e4m3")), ValueError,
         "scale_fmt = 'e4m3'; served: 'ue8m0'", detail="scale_fmt"),
    case("EngramConfig", "id", lambda w: EngramConfig.from_dict(helpers.tiny_config(engram_pad_token_id=50)),
         ValueError, "engram_pad_token_id = 50 is not below vocab_size = 50"),
    case("EngramConfig", "id", lambda w: EngramConfig.from_dict(helpers.tiny_config(image_token_id=50)),
         ValueError, "image_token_id = 50 is not below vocab_size = 50", detail="image"),
    case("EngramConfig", "null", lambda w: EngramConfig.from_dict(None), TypeError,
         "config must be a dict, got NoneType"),
    case("EngramConfig", "null", lambda w: EngramConfig.from_dict(helpers.tiny_config(engram_head_dim=None)),
         ValueError, "missing key 'engram_head_dim'", detail="key"),
    case("EngramConfig", "null", lambda w: EngramConfig.from_pretrained(None), TypeError,
         r"model_dir must be a path \(str or os.PathLike\), got NoneType", detail="path"),
    case("EngramConfig", "null", lambda w: EngramConfig.from_pretrained(w.tmp / "absent"), CheckpointError,
         "absent: no such model folder", detail="folder"),
    case("EngramConfig", "empty", lambda w: EngramConfig.from_dict({}), ValueError,
         "missing key 'engram_layer_ids'"),
    case("EngramConfig", "empty", lambda w: EngramConfig.from_dict(helpers.tiny_config(
        engram_layer_ids=[], engram_num_embeddings=[])), ValueError, "engram_layer_ids is empty", detail="layers"),
    case("EngramConfig", "empty", lambda w: EngramConfig.from_pretrained(w.empty_dir("folder")), CheckpointError,
         "no config.json", detail="folder"),
    # -- TokenMap(...), load, save, check, pad --
    case("TokenMap", "dtype", lambda w: TokenMap(np.arange(5)), TypeError,
         "TokenMap ids must be a numpy int32 array, got int64 array"),
    case("TokenMap", "dtype", lambda w: TokenMap.load(w.engram.foreign_path), ValueError,
         "notes.txt: not an Engram token map", detail="load", needs=E),
    case("TokenMap", "null", lambda w: TokenMap.load(None), TypeError,
         r"TokenMap.load: path must be a path \(str or os.PathLike\), got NoneType", detail="load-path"),
    _case("TokenMap", "null", lambda w: w.engram.map.save(None), TypeError,
          r"TokenMap.save: path must be a path \(str or os.PathLike\), got NoneType", detail="save"),
    _case("TokenMap", "dtype", lambda w: w.engram.map.save(w.engram.foreign_path, force="yes"), TypeError,
          "TokenMap.save: force must be a bool, got 'yes'", detail="force"),
    case("TokenMap", "dtype", lambda w: _map(w).check(50.0, 40), TypeError, "expected_vocab must be an int",
         detail="check"),
    case("TokenMap", "shape", lambda w: TokenMap(np.zeros((2, 2), np.int32)), ValueError,
         r"TokenMap ids must be one non-empty row, got shape \(2, 2\)"),
    _case("TokenMap", "length", lambda w: TokenMap.load(w.engram.short_path), ValueError,
          "short.etm: 220 bytes where a token map of 50 ids has 224"),
    case("TokenMap", "length", lambda w: _map(w).check(51, 40), ValueError,
         r"token map covers 50 token ids but the config's vocab_size is 51: ids 50\.\.50", detail="check"),
    case("TokenMap", "range", lambda w: TokenMap(np.array([0, 1, -1], np.int32)), ValueError,
         r"TokenMap ids must number the compressed ids 0, 1, 2 \.\.\. in order of first appearance"),
    case("TokenMap", "range", lambda w: _map(w).check(50, 39), ValueError,
         "token map has 40 compressed ids but the config's engram_compressed_vocab_size is 39: every hash "
         "multiplier derives from that size", detail="size"),
    _case("TokenMap", "range", lambda w: w.engram.map.save(w.engram.foreign_path), ValueError,
          r"notes\.txt: exists and is not an Engram token map; not replaced \(force=True replaces it\)",
          detail="save-foreign"),
    case("TokenMap", "id", lambda w: _map(w).pad(50), ValueError, r"pad_token_id must be in 0\.\.49, got 50"),
    case("TokenMap", "null", lambda w: TokenMap(None), TypeError,
         "TokenMap ids must be a numpy int32 array, got NoneType"),
    case("TokenMap", "null", lambda w: TokenMap.load(w.tmp / "absent.etm"), FileNotFoundError, "absent.etm",
         detail="load"),
    case("TokenMap", "empty", lambda w: TokenMap(np.zeros(0, np.int32)), ValueError,
         r"TokenMap ids must be one non-empty row, got shape \(0,\)"),
    case("TokenMap", "empty", lambda w: TokenMap.load(w.empty_path), ValueError,
         r"empty\.ngt: not an Engram token map \(no ENGRAMTM header\)", detail="load"),
    # -- EngramCheckpoint.open, its arrays and scan_scales --
    case("EngramCheckpoint", "dtype", lambda w: _open(w, "f32", {EMBED.format(1): lambda t: t.astype(np.float32)}),
         CheckpointError, r"f32/model-00001-of-00003\.safetensors: tensor 'layers\.1\.engram\.embed\.weight' is F32; "
         "served: F8_E4M3"),
    case("EngramCheckpoint", "dtype", lambda w: _open(w, "scale-u8", {WKV_SCALE.format(3): lambda s: s.view(np.uint8)}),
         CheckpointError, r"tensor 'layers\.3\.engram\.wkv\.scale' is U8; served: F8_E8M0", detail="scale"),
    case("EngramCheckpoint", "dtype", lambda w: w.engram.checkpoint.table("1"), TypeError,
         "layer must be an int, got str '1'", detail="layer", needs=E),
    case("EngramCheckpoint", "dtype", lambda w: w.engram.checkpoint.scan_scales(1, chunk_bytes=1.5), TypeError,
         "EngramCheckpoint.scan_scales: chunk_bytes must be an int", detail="chunk_bytes", needs=E),
    case("EngramCheckpoint", "shape", lambda w: _open(w, "narrow", {EMBED.format(1): lambda t: t[:, :32]}),
         CheckpointError, r"tensor 'layers\.1\.engram\.embed\.weight' has shape \[660, 32\], config\.json gives "
         r"\[660, 64\] \(engram_num_embeddings\[0\], engram_head_dim\)"),
    case("EngramCheckpoint", "shape", lambda w: _open(w, "wkv-t", {WKV.format(3): lambda t: np.ascontiguousarray(t.T)}),
         CheckpointError, r"model-00002-of-00003\.safetensors: tensor 'layers\.3\.engram\.wkv\.weight' has shape "
         r"\[384, 96\], config\.json gives \[96, 384\]", detail="wkv"),
    case("EngramCheckpoint", "length", lambda w: _open(w, "rows", {EMBED.format(3): lambda t: t[:-1]}),
         CheckpointError, r"tensor 'layers\.3\.engram\.embed\.weight' has shape \[863, 64\], config\.json gives "
         r"\[864, 64\]"),
    case("EngramCheckpoint", "length", lambda w: _open(w, "primes", config=helpers.tiny_config(
        engram_num_embeddings=[661, 864])), CheckpointError,
         r"primes/config\.json: engram_num_embeddings\[0\] = 661 rows for layer 1, but its 6 prime buckets",
         detail="num_embeddings"),
    case("EngramCheckpoint", "range", lambda w: w.engram.checkpoint.wkv(2), ValueError,
         r"layer 2 has no Engram \(engram_layer_ids \[1, 3\]\)", detail="layer", needs=E),
    case("EngramCheckpoint", "range", lambda w: _open(w, "nan", {EMBED_SCALE.format(3): _nan(7, 1)}).scan_scales(3),
         CheckpointError, r"model-00002-of-00003\.safetensors: tensor 'layers\.3\.engram\.embed\.scale': row 7 "
         r"holds the e8m0 byte 255 \(NaN\) in column 1", detail="nan-table"),
    case("EngramCheckpoint", "range", lambda w: _open(w, "wnan", {WKV_SCALE.format(1): _nan(2, 3)}).scan_scales(1),
         CheckpointError, r"tensor 'layers\.1\.engram\.wkv\.scale': row 2 holds the e8m0 byte 255 \(NaN\) in "
         "column 3", detail="nan-wkv"),
    case("EngramCheckpoint", "range", lambda w: w.engram.checkpoint.scan_scales(1, chunk_bytes=0), ValueError,
         "chunk_bytes must be an int >= 1, got 0", detail="chunk_bytes", needs=E),
    case("EngramCheckpoint", "null", lambda w: _open(w, "missing", {WKV.format(3): lambda t: None}),
         CheckpointError, r"missing/model\.safetensors\.index\.json: no tensor 'layers\.3\.engram\.wkv\.weight'"),
    case("EngramCheckpoint", "null", lambda w: EngramCheckpoint.open(None), TypeError,
         r"model_dir must be a path \(str or os.PathLike\), got NoneType", detail="path"),
    case("EngramCheckpoint", "null", lambda w: EngramCheckpoint.open(w.tmp / "absent"), CheckpointError,
         "absent: no such model folder", detail="folder"),
    case("EngramCheckpoint", "null", lambda w: w.engram.checkpoint.q_weight(None), TypeError,
         "layer must be an int, got NoneType", detail="layer", needs=E),
    case("EngramCheckpoint", "empty", lambda w: EngramCheckpoint.open(w.empty_dir("folder")), CheckpointError,
         r"folder/config\.json: no config\.json"),
    # -- EngramWeights.from_arrays / from_checkpoint --
    _case("EngramWeights", "dtype", lambda w: _from_arrays(w, tables=_table3(
        w, weight=w.engram.arrays["tables"][1][0].astype(np.float32))), TypeError, TABLE_TYPE),
    _case("EngramWeights", "dtype", lambda w: _from_arrays(w, k_weight=_layer3(
        w.engram.arrays["k"], w.engram.arrays["k"][1].astype(np.float32))), TypeError,
          "Engram layer 3 k_weight: dtype float32, expected bfloat16", detail="k_weight"),
    _case("EngramWeights", "dtype", lambda w: _from_arrays(w, gpu="cpu"), TypeError,
          "EngramWeights: " + GPU_TYPE + " str 'cpu'", detail="gpu"),
    _case("EngramWeights", "dtype", lambda w: _from_arrays(w, config=helpers.tiny_config()), TypeError,
          "EngramWeights: config must be an EngramConfig, got dict", detail="config"),
    _case("EngramWeights", "dtype", lambda w: _from_arrays(w, token_map=w.engram.map.ids), TypeError,
          "EngramWeights: token_map must be a TokenMap, got ndarray", detail="token_map"),
    _case("EngramWeights", "dtype", lambda w: _from_arrays(w, tables=_layer3(
        w.engram.arrays["tables"], w.engram.arrays["tables"][1][0])), TypeError,
          r"Engram layer 3 table: expected a \(weight, scale\) pair, got ndarray", detail="pair"),
    _case("EngramWeights", "dtype", lambda w: _from_arrays(w, shard=(0, 2)), TypeError,
          "EngramWeights: shard must be a Shard or None, got tuple", detail="shard"),
    _case("EngramWeights", "dtype", lambda w: _from_arrays(w, placement=True), TypeError,
          "placement must be 'device' or 'host' or a sequence of them, got bool", detail="placement"),
    _case("EngramWeights", "dtype", lambda w: EngramWeights.from_checkpoint(w.engram.model.path, w.gpu, w.engram.map),
          TypeError, "checkpoint must be an EngramCheckpoint, got PosixPath", detail="checkpoint"),
    _case("EngramWeights", "shape", lambda w: _from_arrays(w, tables=_table3(
        w, weight=w.engram.arrays["tables"][1][0][:, :32])), ValueError,
          r"Engram layer 3 table: shape \[864, 32\], expected \[864, 64\]"),
    _case("EngramWeights", "shape", lambda w: _from_arrays(w, wkv=_layer3(w.engram.arrays["wkv"], (
        w.engram.arrays["wkv"][1][0].T, w.engram.arrays["wkv"][1][1]))), ValueError,
          r"Engram layer 3 wkv: shape \[384, 96\], expected \[96, 384\]", detail="wkv"),
    _case("EngramWeights", "shape", lambda w: _from_arrays(w, q_weight=_layer3(
        w.engram.arrays["q"], w.engram.arrays["q"][1].T)), ValueError,
          r"Engram layer 3 q_weight: shape \[32, 2\], expected \[2, 32\]", detail="q_weight"),
    _case("EngramWeights", "length", lambda w: _from_arrays(w, tables=w.engram.arrays["tables"][:1]), ValueError,
          r"EngramWeights: tables has 1 entries for the 2 Engram layers \[1, 3\]"),
    _case("EngramWeights", "length", lambda w: _from_arrays(w, k_weight=w.engram.arrays["k"] * 2), ValueError,
          r"EngramWeights: k_weight has 4 entries for the 2 Engram layers", detail="k_weight"),
    _case("EngramWeights", "length", lambda w: _from_arrays(w, tables=_table3(
        w, scale=w.engram.arrays["tables"][1][1][:-1])), ValueError,
          r"Engram layer 3 table scale: shape \[863, 2\], expected \[864, 2\]", detail="rows"),
    _case("EngramWeights", "length", lambda w: _from_arrays(w, placement=["device"]), ValueError,
          "placement: 1 entries for 2 tables", detail="placement"),
    _case("EngramWeights", "range", lambda w: _from_arrays(w, token_map=_map(w, engram_compressed_vocab_size=39)),
          ValueError, "token map has 39 compressed ids but the config's engram_compressed_vocab_size is 40"),
    _case("EngramWeights", "range", lambda w: _from_arrays(w, tables=_table3(
        w, scale=_nan(7, 1)(w.engram.arrays["tables"][1][1]))), ValueError, SCALE_NAN, detail="nan-table"),
    _case("EngramWeights", "range", lambda w: _from_arrays(w, tables=_table3(
        w, scale=_nan(700, 0)(w.engram.arrays["tables"][1][1])), shard=Shard(1, 2)), ValueError,
          r"Engram layer 3 table scale: row 700 holds the e8m0 byte 255", detail="nan-table-shard"),
    _case("EngramWeights", "range", lambda w: _from_arrays(w, wkv=_layer3(w.engram.arrays["wkv"], (
        w.engram.arrays["wkv"][1][0], _nan(1, 2)(w.engram.arrays["wkv"][1][1])))), ValueError,
          r"Engram layer 3 wkv scale: row 1 holds the e8m0 byte 255 \(NaN\) in column 2", detail="nan-wkv"),
    _case("EngramWeights", "range", lambda w: EngramWeights.from_checkpoint(_open(
        w, "nan", {EMBED_SCALE.format(1): _nan(5, 0)}), w.gpu, w.engram.map), CheckpointError,
          r"model-00001-of-00003\.safetensors: tensor 'layers\.1\.engram\.embed\.scale': row 5 holds the e8m0 byte "
          "255", detail="nan-checkpoint"),
    _case("EngramWeights", "range", lambda w: _from_arrays(w, placement="gpu"), ValueError,
          "placement must be 'device' or 'host'", detail="placement"),
    _case("EngramWeights", "range", lambda w: _from_arrays(w, placement=DeviceBudget(1000)), ValueError,
          r"placement DeviceBudget\(1000\): wkv \(bf16 and fp8\), q, k and the hash's arrays alone take",
          detail="budget"),
    _case("EngramWeights", "range", lambda w: _from_arrays(w, stream=-1), ValueError,
          "EngramWeights: stream must be a stream handle", detail="stream"),
    _case("EngramWeights", "id", lambda w: _from_arrays(w, token_map=TokenMap(w.engram.map.ids[:49])), ValueError,
          r"token map covers 49 token ids but the config's vocab_size is 50: ids 49\.\.49 would have no compressed id"),
    _case("EngramWeights", "null", lambda w: _from_arrays(w, gpu=None), TypeError,
          "EngramWeights: " + GPU_TYPE + " None"),
    _case("EngramWeights", "null", lambda w: _from_arrays(w, tables=None), TypeError,
          "EngramWeights: tables must be a sequence, one entry per Engram layer, got NoneType", detail="tables"),
    _case("EngramWeights", "null", lambda w: _from_arrays(w, tables=_layer3(w.engram.arrays["tables"], None)),
          TypeError, r"Engram layer 3 table: expected a \(weight, scale\) pair, got NoneType", detail="table"),
    _case("EngramWeights", "null", lambda w: _from_arrays(w, token_map=None), TypeError,
          "EngramWeights: token_map must be a TokenMap, got NoneType", detail="token_map"),
    _case("EngramWeights", "null", lambda w: EngramWeights.from_checkpoint(None, w.gpu, w.engram.map), TypeError,
          "checkpoint must be an EngramCheckpoint, got NoneType", detail="checkpoint"),
    _case("EngramWeights", "closed", lambda w: _from_arrays(w, gpu=w.target.closed), ClosedError,
          "CudaBackend is closed"),
    _case("EngramWeights", "empty", lambda w: _from_arrays(w, wkv=[]), ValueError,
          r"EngramWeights: wkv has 0 entries for the 2 Engram layers \[1, 3\]"),
    # -- EngramDecoder(...) --
    _case("EngramDecoder", "dtype", lambda w: EngramDecoder(w.engram.weights, max_seqs=4.0, max_rows=8), TypeError,
          "EngramDecoder: max_seqs must be an int, got float 4.0"),
    _case("EngramDecoder", "dtype", lambda w: EngramDecoder(w.weights, max_seqs=4, max_rows=8), TypeError,
          "EngramDecoder: weights must be EngramWeights, got NgramWeights", detail="weights"),
    _case("EngramDecoder", "dtype", lambda w: EngramDecoder(w.engram.weights, 4, 8), TypeError,
          "positional argument", detail="positional"),
    _case("EngramDecoder", "dtype", lambda w: EngramDecoder(w.engram.weights, max_seqs=4, max_rows=8,
                                                            batch_invariant=1),
          TypeError, "EngramDecoder: batch_invariant must be a bool, got 1", detail="batch_invariant"),
    _case("EngramDecoder", "dtype", lambda w: EngramDecoder(w.engram.shard_weights[1], max_seqs=4, max_rows=8,
                                                            collective=object()),
          TypeError, "EngramDecoder: collective must be a layers.tensor_parallel.Collective", detail="collective"),
    _case("EngramDecoder", "length", lambda w: EngramDecoder(w.engram.weights, max_seqs=2**31, max_rows=8),
          ValueError, r"EngramDecoder: max_seqs must be in 1\.\.2\*\*31-1, got 2147483648"),
    _case("EngramDecoder", "range", lambda w: EngramDecoder(w.engram.weights, max_seqs=4, max_rows=0), ValueError,
          r"EngramDecoder: max_rows must be in 1\.\.2\*\*31-1, got 0"),
    _case("EngramDecoder", "range", lambda w: EngramDecoder(w.engram.weights, max_seqs=4, max_rows=8, max_draft=-1),
          ValueError, r"EngramDecoder: max_draft must be in 0\.\.2\*\*31-1, got -1", detail="max_draft"),
    _case("EngramDecoder", "range", lambda w: EngramDecoder(w.engram.weights, max_seqs=4, max_rows=8, stream=-1),
          ValueError, "EngramDecoder: stream must be a stream handle", detail="stream"),
    _case("EngramDecoder", "range", lambda w: EngramDecoder(w.engram.weights, max_seqs=4, max_rows=8,
                                                            collective=FakeCollective(0, 1)),
          ValueError, "EngramDecoder: collective given, but the weights are not a tensor-parallel shard",
          detail="collective"),
    _case("EngramDecoder", "range", lambda w: EngramDecoder(w.engram.shard_weights[1], max_seqs=4, max_rows=8,
                                                            collective=FakeCollective(0, 2)),
          ValueError, "the collective is rank 0 of 2, the weights rank 1 of 2", detail="collective-rank"),
    _case("EngramDecoder", "empty", lambda w: EngramDecoder(w.engram.weights, max_seqs=0, max_rows=8), ValueError,
          r"EngramDecoder: max_seqs must be in 1\.\.2\*\*31-1, got 0"),
    _case("EngramDecoder", "null", lambda w: EngramDecoder(None, max_seqs=4, max_rows=8), TypeError,
          "EngramDecoder: weights must be EngramWeights, got NoneType"),
    _case("EngramDecoder", "closed", lambda w: EngramDecoder(w.engram.closed_weights, max_seqs=4, max_rows=8),
          ClosedError, "EngramDecoder: its weights is closed"),
    _case("EngramDecoder", "closed", lambda w: EngramDecoder(w.engram.shard_weights[1], max_seqs=4, max_rows=8,
                                                             collective=w.closed_collective),
          ClosedError, "EngramDecoder: its collective is closed", detail="collective",
          needs=("engram", "closed_collective")),
    # -- EngramDecoder calls (device values are the kernels': flagged in the error word) --
    _case("EngramDecoder.calls", "dtype", lambda w: w.engram.decoder.step(w.p[0], 1.5, 2), TypeError,
          "EngramDecoder slots: expected a device address"),
    _case("EngramDecoder.calls", "dtype", lambda w: w.engram.decoder.prefill(
        DeviceArray(w.gpu, w.p[0], (8,), np.int64), w.p[1], w.p[2], 2, 5), TypeError,
          "EngramDecoder tokens: dtype int64, expected uint32 or int32", detail="tokens"),
    _case("EngramDecoder.calls", "dtype", lambda w: w.engram.decoder.apply(1, _residual(w, (4, 2, 32), "<f2"), 4),
          TypeError, "EngramDecoder.apply residual: dtype float16, expected bfloat16", detail="residual"),
    _case("EngramDecoder.calls", "dtype", lambda w: w.engram.decoder.apply(
        3, DeviceArray(w.gpu, w.p[3], (4, 2, 32), np.float32), 4), TypeError,
          "EngramDecoder.apply residual: dtype float32, expected bfloat16", detail="residual-device-array"),
    _case("EngramDecoder.calls", "dtype", lambda w: w.engram.decoder.prefill(
        w.p[0], w.p[1], w.p[2], 2, 5, text=DeviceArray(w.gpu, w.p[4], (8,), np.uint32)), TypeError,
          "EngramDecoder text: dtype uint32, expected uint8 or bool", detail="text"),
    _case("EngramDecoder.calls", "dtype", lambda w: w.engram.decoder.step(w.p[0], w.p[1], 2, k=1.0), TypeError,
          "EngramDecoder.step: k must be an int, got float", detail="k"),
    _case("EngramDecoder.calls", "dtype", lambda w: w.engram.decoder.apply("1", w.p[3], 4), TypeError,
          "layer must be an int, got str '1'", detail="layer"),
    _case("EngramDecoder.calls", "dtype", lambda w: w.engram.decoder.fork(object(), w.p[1], 2), TypeError,
          "EngramDecoder src_slots: expected a device address", detail="fork"),
    _case("EngramDecoder.calls", "shape", lambda w: w.engram.decoder.apply(1, _residual(w, (4, 2, 33)), 4),
          ValueError, "EngramDecoder.apply residual: rows of 33 values, expected 32"),
    _case("EngramDecoder.calls", "shape", lambda w: w.engram.decoder.apply(1, _residual(w, (4, 65)), 4),
          ValueError, "EngramDecoder.apply residual: rows of 65 values, expected 32", detail="residual-2d"),
    _case("EngramDecoder.calls", "shape", lambda w: w.engram.decoder.step(
        ForeignArray(w.p[0], (4,), "<u4", strides=(8,)), w.p[1], 2), ValueError,
          r"EngramDecoder tokens: not C-contiguous \(a strided view\)", detail="strided"),
    _case("EngramDecoder.calls", "length", lambda w: w.engram.decoder.step(
        DeviceArray(w.gpu, w.p[0], (3,), np.uint32), w.p[1], 2, k=2), ValueError,
          "EngramDecoder tokens: 3 entries, the call needs 4"),
    _case("EngramDecoder.calls", "length", lambda w: w.engram.decoder.apply(1, _residual(w, (3, 2, 32)), 4),
          ValueError, "EngramDecoder.apply residual: 192 entries, the call needs 256", detail="residual"),
    _case("EngramDecoder.calls", "length", lambda w: w.engram.decoder.prefill(
        w.p[0], w.p[1], w.p[2], 2, 5, text=DeviceArray(w.gpu, w.p[4], (4,), np.uint8)), ValueError,
          "EngramDecoder text: 4 entries, the call needs 5", detail="text"),
    _case("EngramDecoder.calls", "length", lambda w: w.engram.decoder.seed(
        ForeignArray(w.p[0], (5,), "<i4"), w.p[1], w.p[2], 2, 6), ValueError,
          "EngramDecoder tokens: 5 entries, the call needs 6", detail="seed"),
    _case("EngramDecoder.calls", "range", lambda w: w.engram.decoder.step(w.p[0], w.p[1], 5), ValueError,
          "EngramDecoder: num_seqs 5 over max_seqs 4"),
    _case("EngramDecoder.calls", "range", lambda w: w.engram.decoder.prefill(w.p[0], w.p[1], w.p[2], 2, 9),
          ValueError, "EngramDecoder: 9 rows over max_rows 8", detail="rows"),
    _case("EngramDecoder.calls", "range", lambda w: w.engram.decoder.step(w.p[0], w.p[1], 2, k=5), ValueError,
          "EngramDecoder: 10 rows over max_rows 8", detail="k"),
    _case("EngramDecoder.calls", "range", lambda w: w.engram.decoder.prefill(w.p[0], w.p[1], w.p[2], 0, 3),
          ValueError, "EngramDecoder: 3 tokens in no sequence", detail="no-sequence"),
    _case("EngramDecoder.calls", "range", lambda w: w.engram.decoder.apply(1, w.p[3], 9), ValueError,
          "EngramDecoder.apply: 9 rows over max_rows 8", detail="apply-rows"),
    _case("EngramDecoder.calls", "range", lambda w: w.engram.decoder.apply(2, w.p[3], 4), ValueError,
          r"layer 2 has no Engram \(engram_layer_ids \[1, 3\]\)", detail="layer"),
    _case("EngramDecoder.calls", "range", lambda w: w.engram.decoder.apply(
        1, _residual(w, (4, 2, 32), readonly=True), 4), ValueError,
          "EngramDecoder.apply residual: a read-only array", detail="read-only-residual"),
    _case("EngramDecoder.calls", "range", lambda w: w.engram.decoder.reset(4), ValueError,
          r"EngramDecoder.reset: slot must be in 0\.\.3, got 4", detail="reset"),
    _case("EngramDecoder.calls", "range", lambda w: w.engram.decoder.rollback(w.p[0], w.p[1], 2, stream=-1),
          ValueError, "EngramDecoder: stream must be a stream handle", detail="stream"),
    _case("EngramDecoder.calls", "range", lambda w: w.engram.ranks[1].step(w.p[0], w.p[1], 2), ValueError,
          "the weights are rank 1 of a tensor-parallel group: build the decoder with collective=",
          detail="rank-without-collective"),
    _case("EngramDecoder.calls", "null", lambda w: w.engram.decoder.prefill(w.p[0], 0, w.p[2], 2, 5), ValueError,
          "EngramDecoder cu_seqlens: " + NULL),
    _case("EngramDecoder.calls", "null", lambda w: w.engram.decoder.apply(1, 0, 4), ValueError,
          "EngramDecoder.apply residual: " + NULL, detail="residual"),
    _case("EngramDecoder.calls", "null", lambda w: w.engram.decoder.apply(1, None, 4), TypeError,
          "EngramDecoder.apply residual: expected a device address", detail="residual-none"),
    _case("EngramDecoder.calls", "null", lambda w: w.engram.decoder.prefill(w.p[0], w.p[1], w.p[2], 2, 5, text=0),
          ValueError, "EngramDecoder text: " + NULL, detail="text"),
    _case("EngramDecoder.calls", "null", lambda w: w.engram.decoder.seed(w.p[0], w.p[1], 0, 2, 5), ValueError,
          "EngramDecoder slots: " + NULL, detail="seed"),
    _case("EngramDecoder.calls", "null", lambda w: w.engram.decoder.fork(w.p[0], 0, 2), ValueError,
          "EngramDecoder dst_slots: " + NULL, detail="fork"),
    _case("EngramDecoder.calls", "null", lambda w: w.engram.decoder.rollback(w.p[0], 0, 2), ValueError,
          "EngramDecoder counts: " + NULL, detail="rollback"),
    _case("EngramDecoder.calls", "closed", lambda w: w.engram.closed_decoder.step(w.p[0], w.p[1], 1), ClosedError,
          "EngramDecoder is closed"),
    _case("EngramDecoder.calls", "closed", lambda w: w.engram.closed_decoder.apply(1, w.p[3], 1), ClosedError,
          "EngramDecoder is closed", detail="apply"),
    _case("EngramDecoder.calls", "closed", lambda w: w.engram.decoder_on_closed.prefill(w.p[0], w.p[1], w.p[2], 2, 5),
          ClosedError, "EngramDecoder: its weights is closed", detail="weights-closed"),
    _case("EngramDecoder.calls", "closed", lambda w: w.engram.decoder_on_closed.apply(3, w.p[3], 4), ClosedError,
          "EngramDecoder: its weights is closed", detail="weights-closed-apply"),
    _case("EngramDecoder.calls", "closed", lambda w: w.engram.decoder_on_closed.reset(0), ClosedError,
          "EngramDecoder: its weights is closed", detail="weights-closed-reset"),
    _case("EngramDecoder.calls", "empty", lambda w: w.engram.decoder.step(w.p[0], w.p[1], 0)),
    _case("EngramDecoder.calls", "empty", lambda w: w.engram.decoder.prefill(w.p[0], w.p[1], w.p[2], 0, 0),
          detail="prefill"),
    _case("EngramDecoder.calls", "empty", lambda w: w.engram.decoder.prefill(w.p[0], w.p[1], w.p[2], 2, 0),
          detail="prefill-no-tokens"),
    _case("EngramDecoder.calls", "empty", lambda w: w.engram.decoder.apply(1, w.p[3], 0), detail="apply"),
    _case("EngramDecoder.calls", "empty", lambda w: w.engram.decoder.seed(w.p[0], w.p[1], w.p[2], 0, 0),
          detail="seed"),
    _case("EngramDecoder.calls", "empty", lambda w: w.engram.decoder.fork(w.p[0], w.p[1], 0), detail="fork"),
    _case("EngramDecoder.calls", "empty", lambda w: w.engram.decoder.rollback(w.p[0], w.p[1], 0), detail="rollback"),
    # -- lookup_all: one process driving every rank of a group --
    _case("lookup_all", "dtype", lambda w: _all(w, group=object()), TypeError,
          "lookup_all: group must be a CollectiveGroup, got object", needs=RANKS),
    _case("lookup_all", "dtype", lambda w: _all(w, ranks=[w.decoder, w.engram.ranks[1]]), TypeError,
          r"lookup_all: ranks\[0\] is a NgramDecoder, not an EngramDecoder", detail="ranks", needs=RANKS),
    _case("lookup_all", "dtype", lambda w: _all(w, streams=[0, "0"]), TypeError,
          r"lookup_all: streams\[1\] must be a stream handle", detail="streams", needs=RANKS),
    _case("lookup_all", "length", lambda w: _all(w, ranks=w.engram.ranks[:1]), ValueError,
          "lookup_all: every per-rank sequence needs 2 entries, one a rank", needs=RANKS),
    _case("lookup_all", "range", lambda w: _all(w, ranks=w.engram.ranks[::-1]), ValueError,
          r"lookup_all: ranks\[0\]'s weights are rank 1 of 2", needs=RANKS),
    _case("lookup_all", "range", lambda w: _all(w, ranks=[w.engram.decoder, w.engram.ranks[1]]), ValueError,
          r"lookup_all: ranks\[0\]'s weights are not a shard", detail="not-shard", needs=RANKS),
    _case("lookup_all", "range", lambda w: _all(w, ranks=[w.engram.ranks[0], w.engram.rank_with_collective]),
          ValueError, r"lookup_all: ranks\[1\] has a collective of its own", detail="collective", needs=RANKS),
    _case("lookup_all", "range", lambda w: _all(w, num_tokens=9), ValueError, "EngramDecoder: 9 rows over max_rows 8",
          detail="rows", needs=RANKS),
    _case("lookup_all", "range", lambda w: _all(w, streams=[0, -1]), ValueError,
          r"lookup_all: streams\[1\] must be a stream handle", detail="streams", needs=RANKS),
    _case("lookup_all", "null", lambda w: _all(w, tokens=[w.p[0], 0]), ValueError, "EngramDecoder tokens: " + NULL,
          needs=RANKS),
    _case("lookup_all", "null", lambda w: _all(w, ranks=None), TypeError,
          "lookup_all: ranks must be a sequence, one entry per rank, got NoneType", detail="ranks", needs=RANKS),
    _case("lookup_all", "closed", lambda w: _all(w, group=w.closed_group), ClosedError,
          "lookup_all: the group is closed", needs=("engram", "group", "closed_group")),
    _case("lookup_all", "closed", lambda w: _all(w, ranks=[w.engram.ranks[0], w.engram.closed_rank]), ClosedError,
          "EngramDecoder is closed", detail="rank", needs=RANKS),
    _case("lookup_all", "empty", lambda w: _all(w, num_tokens=0), needs=RANKS),
    # -- layers.reference.engram: the numpy references refuse as the runners do --
    case("layers.reference.engram", "dtype", lambda w: ref.dequant_rows(_r(w).table.astype(np.float32),
                                                                        _r(w).table_scale),
         TypeError, "dequant_rows: weight must be float8_e4m3fn or uint8, got dtype float32"),
    case("layers.reference.engram", "dtype", lambda w: _r(w).gate(text_mask=np.array([1, 0, 1], np.uint8)),
         TypeError, "gate_ref: text_mask must be bool, got dtype uint8", detail="text_mask"),
    case("layers.reference.engram", "dtype", lambda w: ref.emb_from_rows(
        _r(w).table, _r(w).table_scale, np.zeros((2, 2))), TypeError,
         "emb_from_rows: row_ids must be a numpy array of integers", detail="row_ids"),
    case("layers.reference.engram", "dtype", lambda w: ref.act_quant(random_bf16(w.rng, (2, 64)).astype(np.float32)),
         TypeError, "act_quant: x must be bfloat16, got dtype float32", detail="act_quant"),
    case("layers.reference.engram", "dtype", lambda w: ref.dequant_weight(_r(w).wkv, _r(w).wkv_scale,
                                                                          dtype=np.float64),
         TypeError, "dequant_weight: dtype must be float32 or bfloat16", detail="dequant_weight"),
    case("layers.reference.engram", "shape", lambda w: ref.dequant_rows(_r(w).table, _r(w).table_scale[:, :1]),
         ValueError, r"dequant_rows: scale must be \[10, 2\], got shape \[10, 1\]"),
    case("layers.reference.engram", "shape", lambda w: _r(w).gate(kv=random_bf16(w.rng, (3, 64))), ValueError,
         r"gate_ref: kv must be \[3, 96\], got shape \[3, 64\]", detail="kv"),
    case("layers.reference.engram", "shape", lambda w: _r(w).layer(wkv_weight=random_fp8(w.rng, (96, 64)),
                                                                   wkv_scale=helpers.scale_bytes(w.rng, (3, 2))),
         ValueError, r"engram_layer_ref: wkv_weight must be \[96, 128\], got shape \[96, 64\]", detail="wkv"),
    case("layers.reference.engram", "length", lambda w: _r(w).layer(row_ids=np.zeros((2, 2), np.int64)), ValueError,
         "engram_layer_ref: row_ids has 2 tokens, x has 3"),
    case("layers.reference.engram", "length", lambda w: _r(w).gate(text_mask=np.ones(2, bool)), ValueError,
         r"gate_ref: text_mask must be \[3\], got shape \[2\]", detail="text_mask"),
    case("layers.reference.engram", "range", lambda w: ref.dequant_rows(_r(w).table, _nan(4, 1)(_r(w).table_scale)),
         ValueError, r"dequant_rows: scale\[4, 1\] is 255 \(e8m0 NaN\): row 4"),
    case("layers.reference.engram", "range", lambda w: _r(w).layer(wkv_scale=_nan(2, 3)(_r(w).wkv_scale)),
         ValueError, r"engram_layer_ref: wkv_scale\[2, 3\] is 255 \(e8m0 NaN\): the block of rows 64\.\. and "
         r"columns 96\.\.", detail="nan-wkv"),
    case("layers.reference.engram", "range", lambda w: ref.act_quant(np.full((1, 32), np.inf, BF16)), ValueError,
         r"act_quant: x\[0, 0\] is inf: act_quant takes finite values only", detail="inf"),
    case("layers.reference.engram", "range", lambda w: _r(w).gate(eps=-1.0), ValueError,
         "gate_ref: eps must be >= 0, got -1.0", detail="eps"),
    case("layers.reference.engram", "range", lambda w: ref.dequant_rows(_r(w).table, _r(w).table_scale, 0),
         ValueError, "dequant_rows: block must be an int >= 1, got 0", detail="block"),
    case("layers.reference.engram", "id", lambda w: ref.emb_from_rows(
        _r(w).table, _r(w).table_scale, np.array([[0, 10]])), ValueError,
         r"emb_from_rows: row_ids\[0, 1\] = 10 outside 0\.\.9"),
    case("layers.reference.engram", "id", lambda w: _r(w).layer(row_ids=np.array([[0, 1], [2, -1], [3, 4]])),
         ValueError, r"engram_layer_ref: row_ids\[1, 1\] = -1 outside 0\.\.9", detail="layer"),
    case("layers.reference.engram", "null", lambda w: ref.dequant_rows(None, _r(w).table_scale), TypeError,
         "dequant_rows: weight must be a numpy array, got NoneType"),
    case("layers.reference.engram", "null", lambda w: _r(w).gate(eps=None), TypeError,
         "gate_ref: eps must be a real number, got None", detail="eps"),
    case("layers.reference.engram", "empty", lambda w: expect(
        ref.dequant_rows(_r(w).table[:0], _r(w).table_scale[:0]).shape == (0, 64))),
    case("layers.reference.engram", "empty", lambda w: expect(
        ref.emb_from_rows(_r(w).table, _r(w).table_scale, np.zeros((0, 2), np.int64)).shape == (0, 128)),
         detail="emb_from_rows"),
    case("layers.reference.engram", "empty", lambda w: expect(
        _r(w).layer(x=_r(w).x[:0], row_ids=np.zeros((0, 2), np.int64), text_mask=np.ones(0, bool)).out.shape
        == (0, 2, 32)), detail="layer"),
]


# -- the good calls after each case ------------------------------------------------------------
def _after_config(w: World) -> None:
    """The config from a dict and from a folder: the same, its primes summing to its rows."""
    cfg = EngramConfig.from_dict(helpers.tiny_config())
    expect(EngramConfig.from_pretrained(_config_dir(w, "good")) == cfg)
    expect(cfg.primes.sum(axis=1).tolist() == list(cfg.num_embeddings) == [660, 864])


def _after_token_map(w: World) -> None:
    """A map saved and loaded back is the same map, and fits its config."""
    cfg, token_map = helpers.tiny(), _map(w)
    token_map.save(w.tmp / "good.etm")
    back = TokenMap.load(w.tmp / "good.etm")
    expect(back.sha256() == token_map.sha256() and back.size == cfg.compressed_vocab_size)
    back.check(cfg.vocab_size, cfg.compressed_vocab_size)
    expect(back.pad(cfg.pad_token_id) == token_map.ids[cfg.pad_token_id])


def _after_checkpoint(w: World) -> None:
    """A fresh folder opens; its arrays are the tensors written, its scales free of NaN."""
    model = helpers.write_model(w.tmp / "good", w.rng)
    checkpoint = EngramCheckpoint.open(model.path)
    for layer in checkpoint.config.layer_ids:
        checkpoint.scan_scales(layer)
        weight, scale = checkpoint.table(layer)
        expect(weight.tobytes() == model.tensors[EMBED.format(layer)].tobytes())
        expect(scale.tobytes() == model.tensors[EMBED_SCALE.format(layer)].tobytes())


def _after_weights(w: World) -> None:
    """The arrays load on the device, the checkpoint as rank 1 of 2 in host memory; closing frees
    every upload."""
    e, mem, host = w.engram, set(w.gpu.mem), set(w.gpu.host)
    with _from_arrays(w) as weights:
        expect([layer.table.where for layer in weights.layers] == ["device", "device"])
    with EngramWeights.from_checkpoint(e.checkpoint, w.gpu, e.map, shard=Shard(1, 2)) as rank:
        expect([layer.table.where for layer in rank.layers] == ["host", "host"])
        expect([(layer.lo, layer.count) for layer in rank.layers] == [(330, 330), (432, 432)])
    expect(set(w.gpu.mem) == mem and set(w.gpu.host) == host)


def _after_decoder_new(w: World) -> None:
    e, mem = w.engram, set(w.gpu.mem)
    EngramDecoder(e.weights, max_seqs=2, max_rows=4).close()
    EngramDecoder(e.shard_weights[1], max_seqs=2, max_rows=4, collective=FakeCollective(1, 2)).close()
    expect(set(w.gpu.mem) == mem)


def _after_calls(w: World) -> None:
    """Every call launches its kernels: the lookup and both layers' projections, the gate on a
    residual ``[T, hc_mult, hidden]``, the histories' seed, fork and rollback."""
    e, before = w.engram, len(w.gpu.launches)
    d, cfg = e.decoder, e.cfg
    d.reset(0)
    d.prefill(w.p[0], w.p[1], w.p[2], 2, 5)
    d.apply(3, DeviceArray(w.gpu, w.p[3], (5, cfg.hc_mult, cfg.hidden_size), BF16), 5)
    d.step(w.p[0], w.p[2], 2, k=2)
    d.seed(w.p[0], w.p[1], w.p[2], 2, 5)
    d.fork(w.p[1], w.p[2], 2)
    d.rollback(w.p[1], w.p[2], 2)
    project = [gemm_fp8.KERNEL] * 2  # (up to FP8_ROWS rows: over the fp8 wkv)
    expect(w.gpu.launched()[before:] == ["engram_lookup", *project, "engram_gate", "engram_lookup", *project,
                                         "token_history_seed", "token_history_fork", "token_history_rollback"])


def _after_lookup_all(w: World) -> None:
    """Every rank gathers, the group sums each layer's rows once, every rank projects."""
    before, reduces = len(w.gpu.launches), len(w.group.calls)
    _all(w)
    expect(len(w.group.calls) == reduces + 2)
    expect(w.gpu.launched()[before:] == ["engram_lookup"] * 2 + [gemm_fp8.KERNEL] * 4)


def _after_reference(w: World) -> None:
    """The whole layer is its stages, bit for bit."""
    r = _r(w)
    out = r.layer()
    emb = ref.emb_from_rows(r.table, r.table_scale, r.ids)
    kv = ref.wkv_ref(emb, r.wkv, r.wkv_scale)
    gated = r.gate(kv=kv)[0]
    expect(out.emb.tobytes() == emb.tobytes() and out.kv.tobytes() == kv.tobytes())
    expect(out.out.tobytes() == gated.tobytes())


AFTER: dict[str, Callable[[World], None]] = {
    "EngramConfig": _after_config,
    "TokenMap": _after_token_map,
    "EngramCheckpoint": _after_checkpoint,
    "EngramWeights": _after_weights,
    "EngramDecoder": _after_decoder_new,
    "EngramDecoder.calls": _after_calls,
    "lookup_all": _after_lookup_all,
    "layers.reference.engram": _after_reference,
}
