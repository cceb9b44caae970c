"""``EngramWeights``: what an Engram runner reads, on the device or, for the tables, in host memory.

Per Engram layer: the table (``RowBlock``: each row packed as its ``head_dim`` fp8 bytes, then its
``head_dim // 32`` e8m0 scale bytes, padded to ``stride``; a tensor-parallel rank holds one range
of rows), ``wkv`` as it comes (a ``BlockFp8Weight``: e4m3 with its 32 x 32 e8m0 scales, what a
step's projection reads) and dequantised once to a bf16 ``DenseWeight`` ``[kv_dim, emb_dim]`` (a
long prefill's), ``q_weight`` and ``k_weight`` (bf16 ``[hc_mult, hidden]``). For
all layers: the token map, the hash's multipliers, primes and offsets, the tables' descriptors
(``kernels/engram.cu``). Built from arrays (``from_arrays``) or a model folder
(``from_checkpoint``: tables copied in pieces, never whole in Python memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from gpu_runtime import DevicePtr, GpuBackend, validate
from gpu_runtime.backend import check_backend

from ..block_fp8_weight import BlockFp8Weight
from ..dense_weight import BF16, FP8, DenseWeight
from ..ngram_store.placement import DeviceBudget, as_budget, fit_budget, placements
from ..ngram_store.row_block import PLACES, RowBlock
from ..resources import Closing, Resources
from .checkpoint import E8M0_NAN, EngramCheckpoint
from .config import BLOCK, EngramConfig
from .token_map import TokenMap

U8 = np.dtype(np.uint8)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)  # ml_dtypes' e8m0 (scales may come as it or as their bytes)
CHUNK_ROWS = 1 << 18  # rows packed and copied at a time (69 MB of Engram's 264-byte rows)


def row_stride(width: int) -> int:
    """Bytes a packed row takes: ``width`` fp8 bytes and ``width // 32`` scale bytes, rounded up
    to 8 (the lookup reads 8 bytes at a time)."""
    return -(-(width + width // BLOCK) // 8) * 8


def pack_rows(weight: np.ndarray, scale: np.ndarray, stride: int, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 ``[n, stride]``: each row's ``weight`` bytes (fp8 or uint8 ``[n, W]``), then its
    ``scale`` bytes (uint8 ``[n, W // 32]``), then zeros; written into ``out`` (uint8 ``[n,
    stride]``, e.g. a view of host rows) when given, else into a new array."""
    n, width = weight.shape
    if out is None:
        out = np.empty((n, stride), U8)
    end = width + width // BLOCK
    out[:, :width] = np.asarray(weight).view(U8)
    out[:, width:end] = np.asarray(scale).view(U8)
    out[:, end:] = 0
    return out


def dequant_blocks(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """bf16 of an fp8 ``[n, k]`` matrix (or its bytes) scaled by e8m0 bytes ``[ceil(n/32), k/32]``,
    one per 32 x 32 block: ``bf16(f32(e4m3) * 2^(byte - 127))``, exact for normal values."""
    values = np.asarray(weight).view(FP8).astype(np.float32)
    exps = np.asarray(scale).view(U8).astype(np.int32) - 127
    factors = np.ldexp(np.float32(1.0), exps).astype(np.float32)
    full = np.repeat(np.repeat(factors, BLOCK, axis=0), BLOCK, axis=1)[: values.shape[0], : values.shape[1]]
    return (values * full).astype(BF16)


@dataclass(frozen=True)
class Shard:
    """Tensor-parallel rank ``rank`` of ``size``: it holds rows ``rank * per .. (rank + 1) * per``
    of each table (``per = ceil(rows / size)``), as the reference splits them."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        size = validate.positive(self.size, "shard size")
        rank = validate.count(self.rank, "shard rank", limit=size)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "rank", rank)

    def rows(self, total: int) -> tuple[int, int]:
        """(first row, row count) this rank holds of a table of ``total`` rows."""
        per = -(-total // self.size)
        lo = min(total, self.rank * per)
        return lo, min(total, lo + per) - lo


@dataclass(eq=False)
class EngramLayer:
    """One Engram layer's weights: its table rows (``lo`` .. ``lo + count`` of the full table; a
    rank that holds none keeps a one-row block), ``wkv`` (dequantised to bf16) and ``wkv_fp8`` (as
    the checkpoint holds it) on the device, and ``q`` / ``k`` (device addresses, bf16 ``[hc, D]``)."""

    table: RowBlock
    lo: int
    count: int
    wkv: DenseWeight
    wkv_fp8: BlockFp8Weight
    q: DevicePtr
    k: DevicePtr


class EngramWeights(Closing):
    """Every Engram layer's weights (``layers``, in ``config.layer_ids``' order) and the hash's
    device arrays: ``token_map`` (int32 ``[vocab]``), ``mult`` (u64 ``[L, N]``), ``primes`` and
    ``offsets`` (u64 ``[L, C]``), ``tables`` (u64 ``[L, 4]`` descriptors). ``pad``: the compressed
    pad id; ``shard``: this rank's share (None: the whole tables). Owns all of it."""

    def __init__(self, gpu: GpuBackend, config: EngramConfig, token_map: TokenMap, shard: Shard | None) -> None:
        check_backend(gpu, "EngramWeights: gpu")
        if not isinstance(config, EngramConfig):
            raise TypeError(f"EngramWeights: config must be an EngramConfig, got {type(config).__name__}")
        if not isinstance(token_map, TokenMap):
            raise TypeError(f"EngramWeights: token_map must be a TokenMap, got {type(token_map).__name__}")
        if shard is not None and not isinstance(shard, Shard):
            raise TypeError(f"EngramWeights: shard must be a Shard or None, got {type(shard).__name__}")
        token_map.check(config.vocab_size, config.compressed_vocab_size)
        self.gpu, self.config, self.shard = gpu, config, shard
        self.token_map_host = token_map
        self.pad = token_map.pad(config.pad_token_id)
        self.stride = row_stride(config.head_dim)
        self.layers: list[EngramLayer] = []
        self._resources = Resources(gpu)

    # -- builders --------------------------------------------------------------------------------
    @classmethod
    def from_arrays(
        cls,
        gpu: GpuBackend,
        config: EngramConfig,
        token_map: TokenMap,
        tables: Sequence[tuple[np.ndarray, np.ndarray]],
        wkv: Sequence[tuple[np.ndarray, np.ndarray]],
        q_weight: Sequence[np.ndarray],
        k_weight: Sequence[np.ndarray],
        *,
        placement: str | Sequence[str] | DeviceBudget | int = "device",
        shard: Shard | None = None,
        stream: int = 0,
    ) -> EngramWeights:
        """Weights from arrays, one entry per Engram layer: ``tables`` (fp8 or uint8 ``[rows, W]``,
        e8m0 bytes ``[rows, W/32]``; memory maps are read a piece at a time), ``wkv`` (fp8 ``[kv_dim,
        emb_dim]``, e8m0 ``[kv_dim/32, emb_dim/32]``), ``q_weight`` / ``k_weight`` (bf16 ``[hc, D]``);
        each table on the device or in host memory (``placement``: one for all, one per layer, or
        a ``DeviceBudget`` in bytes: tables on the device in order while they fit). Every array is
        checked before anything is allocated (``_checked``): ``TypeError`` / ``ValueError``."""
        return cls._build(gpu, config, token_map, (tables, wkv, q_weight, k_weight), placement, shard, stream, True)

    @classmethod
    def _build(
        cls,
        gpu: GpuBackend,
        config: EngramConfig,
        token_map: TokenMap,
        arrays: tuple[Any, Any, Any, Any],
        placement: Any,
        shard: Shard | None,
        stream: int,
        scan_nan: bool,
    ) -> EngramWeights:
        """``from_arrays`` of ``arrays`` (tables, wkv, q, k); ``scan_nan``: look for e8m0 NaN bytes
        in the scales (``from_checkpoint`` has scanned its files already, naming them)."""
        stream = validate.stream(stream, "EngramWeights: stream")
        self = cls(gpu, config, token_map, shard)
        try:
            layers = self._checked(*arrays, scan_nan)
            places = self._placements(placement)
            for i, (table, w, q, k) in enumerate(layers):
                self._add_layer(i, table, w, q, k, places[i], stream)
            self._upload_hash(stream)
            gpu.synchronize(stream)
        except BaseException:
            self.close()
            raise
        return self

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: EngramCheckpoint,
        gpu: GpuBackend,
        token_map: TokenMap,
        *,
        placement: str | Sequence[str] | DeviceBudget | int = "host",
        shard: Shard | None = None,
        stream: int = 0,
    ) -> EngramWeights:
        """The weights of an opened model folder (``EngramCheckpoint``; its scales are scanned for
        e8m0 NaN bytes first), tables in host memory by default (a table is ~101 GB)."""
        if not isinstance(checkpoint, EngramCheckpoint):
            raise TypeError(f"checkpoint must be an EngramCheckpoint, got {type(checkpoint).__name__}")
        cfg = checkpoint.config
        for layer in cfg.layer_ids:
            checkpoint.scan_scales(layer)  # once, here: its messages name the file
        arrays = (
            [checkpoint.table(layer) for layer in cfg.layer_ids],
            [checkpoint.wkv(layer) for layer in cfg.layer_ids],
            [checkpoint.q_weight(layer) for layer in cfg.layer_ids],
            [checkpoint.k_weight(layer) for layer in cfg.layer_ids],
        )
        return cls._build(gpu, cfg, token_map, arrays, placement, shard, stream, False)

    def _placements(self, placement: Any) -> list[str]:
        """One of ``PLACES`` per layer's table, from names or a ``DeviceBudget``, which counts
        what every layer puts on the device (``wkv`` in bf16 and in fp8, ``q`` / ``k``) and the hash's
        arrays first, then the tables (this rank's rows) in order."""
        cfg = self.config
        budget = as_budget(placement)
        if budget is None:
            return placements(placement, len(cfg.layer_ids), PLACES)
        layers, cols = len(cfg.layer_ids), cfg.n_hash_cols
        wkv = cfg.kv_dim * cfg.emb_dim * 3 + -(-cfg.kv_dim // BLOCK) * (cfg.emb_dim // BLOCK)
        fixed = layers * (wkv + 2 * cfg.hc_mult * cfg.hidden_size * 2)
        fixed += cfg.vocab_size * 4 + layers * (cfg.max_ngram * 8 + 2 * cols * 8 + 32)
        counts = [rows if self.shard is None else self.shard.rows(rows)[1] for rows in cfg.num_embeddings]
        what = "wkv (bf16 and fp8), q, k and the hash's arrays"
        return fit_budget(budget, fixed, what, [n * self.stride for n in counts])

    def _checked(
        self, tables: Any, wkv: Any, q_weight: Any, k_weight: Any, scan_nan: bool
    ) -> list[tuple[Any, Any, Any, Any]]:
        """Each layer's ``(table, wkv, q, k)``, checked: one entry per Engram layer in each
        sequence, a ``(weight, scale)`` pair for a table and ``wkv``, every dtype and shape as the
        config gives it; with ``scan_nan``, no e8m0 NaN byte (255) in ``wkv``'s scales or in the
        table rows this rank holds (read ``CHUNK_ROWS`` rows at a time). ``wkv`` holds no e4m3 NaN
        byte (0x7f, 0xff) either way (the fp8 projection would not see it as NaN)."""
        cfg, n = self.config, len(self.config.layer_ids)
        for name, given in (("tables", tables), ("wkv", wkv), ("q_weight", q_weight), ("k_weight", k_weight)):
            if not isinstance(given, (Sequence, np.ndarray)):
                raise TypeError(
                    f"EngramWeights: {name} must be a sequence, one entry per Engram layer, got {type(given).__name__}"
                )
            if len(given) != n:
                raise ValueError(
                    f"EngramWeights: {name} has {len(given)} entries for the {n} Engram layers {list(cfg.layer_ids)}"
                )
        out = []
        for i, layer in enumerate(cfg.layer_ids):
            what, rows, width = f"Engram layer {layer}", cfg.num_embeddings[i], cfg.head_dim
            weight, scale = _pair(tables[i], f"{what} table")
            _shape(weight, (rows, width), (FP8, U8), f"{what} table")
            _shape(scale, (rows, width // BLOCK), (U8, E8M0), f"{what} table scale")
            lo, count = (0, rows) if self.shard is None else self.shard.rows(rows)
            if scan_nan:
                _no_nan(scale, lo, count, f"{what} table scale")
            w, s = _pair(wkv[i], f"{what} wkv")
            _shape(w, (cfg.kv_dim, cfg.emb_dim), (FP8, U8), f"{what} wkv")
            _shape(s, (-(-cfg.kv_dim // BLOCK), cfg.emb_dim // BLOCK), (U8, E8M0), f"{what} wkv scale")
            if scan_nan:
                _no_nan(s, 0, s.shape[0], f"{what} wkv scale")
            _no_e4m3_nan(w, f"{what} wkv")
            for name, array in (("q_weight", q_weight[i]), ("k_weight", k_weight[i])):
                _shape(array, (cfg.hc_mult, cfg.hidden_size), (BF16,), f"{what} {name}")
            out.append(((weight, scale), (w, s), q_weight[i], k_weight[i]))
        return out

    def _add_layer(self, i: int, table: Any, wkv: Any, q: Any, k: Any, where: str, stream: int) -> None:
        """Upload one layer's arrays, checked by ``_checked``."""
        weight, scale = table
        rows = self.config.num_embeddings[i]
        lo, count = (0, rows) if self.shard is None else self.shard.rows(rows)
        block = self._resources.adopt(RowBlock(self.gpu, max(count, 1), self.stride, where))
        piece = None if block.host is not None else np.empty((min(count, CHUNK_ROWS), self.stride), U8)
        for a in range(lo, lo + count, CHUNK_ROWS):
            b = min(lo + count, a + CHUNK_ROWS)
            w_rows, s_rows = np.asarray(weight[a:b]), np.asarray(scale[a:b])
            if block.host is not None:  # packed in place: the pinned rows are the destination
                pack_rows(w_rows, s_rows, self.stride, block.host_rows(a - lo, b - a))
                continue
            assert piece is not None
            block.write(a - lo, pack_rows(w_rows, s_rows, self.stride, piece[: b - a]), stream)
            self.gpu.synchronize(stream)  # the piece is reused
        own = self._resources
        dense = own.adopt(DenseWeight.from_numpy(self.gpu, dequant_blocks(*wkv), stream=stream))
        fp8 = own.adopt(BlockFp8Weight.from_numpy(self.gpu, wkv[0], wkv[1], stream=stream))
        qk = [own.upload(np.ascontiguousarray(array), stream) for array in (q, k)]
        self.layers.append(EngramLayer(block, lo, count, dense, fp8, qk[0], qk[1]))

    def _upload_hash(self, stream: int) -> None:
        cfg, own = self.config, self._resources
        self.token_map = own.upload(np.ascontiguousarray(self.token_map_host.ids, np.int32), stream)
        self.mult = own.upload(np.ascontiguousarray(cfg.multipliers.astype(np.uint64)), stream)
        self.primes = own.upload(np.ascontiguousarray(cfg.primes.astype(np.uint64)), stream)
        self.offsets = own.upload(np.ascontiguousarray(cfg.offsets.astype(np.uint64)), stream)
        rows = [[int(layer.table.address), layer.lo, layer.count, 0] for layer in self.layers]
        descriptors = np.array(rows, np.uint64)
        self.tables = own.upload(descriptors, stream)

    # -- what the runners read -------------------------------------------------------------------
    @property
    def host_tables(self) -> bool:
        """True when some table is in host memory (the lookup's launch shape depends on it)."""
        return any(layer.table.where == "host" for layer in self.layers)

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran."""
        return self._resources.closed

    def close(self) -> None:
        """Free everything (after every runner on the weights); once."""
        self._resources.close()


def _pair(entry: Any, what: str) -> tuple[Any, Any]:
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
        raise TypeError(f"{what}: expected a (weight, scale) pair, got {type(entry).__name__}")
    return entry[0], entry[1]


def _no_nan(scale: Any, lo: int, count: int, what: str) -> None:
    """``ValueError`` naming the first of rows ``lo .. lo + count`` of the e8m0 bytes ``scale``
    that holds 255 (NaN), read ``CHUNK_ROWS`` rows at a time."""
    for a in range(lo, lo + count, CHUNK_ROWS):
        bad = np.asarray(scale[a : min(lo + count, a + CHUNK_ROWS)]).view(U8) == E8M0_NAN
        if bad.any():
            r = int(np.argmax(bad.any(axis=1)))
            raise ValueError(
                f"{what}: row {a + r} holds the e8m0 byte {E8M0_NAN} (NaN) in column {int(np.argmax(bad[r]))}"
            )


def _no_e4m3_nan(weight: Any, what: str) -> None:
    """``ValueError`` naming the first (row, column) of the e4m3 ``weight`` that is NaN (0x7f, 0xff)."""
    for a in range(0, weight.shape[0], CHUNK_ROWS):
        bad = (np.asarray(weight[a : a + CHUNK_ROWS]).view(U8) & 0x7F) == 0x7F
        if bad.any():
            r = int(np.argmax(bad.any(axis=1)))
            raise ValueError(f"{what}: row {a + r}, column {int(np.argmax(bad[r]))} is an e4m3 NaN")


def _shape(array: Any, shape: tuple[int, ...], dtypes: tuple[np.dtype, ...], what: str) -> None:
    got_shape, got_dtype = tuple(getattr(array, "shape", ())), getattr(array, "dtype", None)
    if got_dtype not in dtypes:
        raise TypeError(f"{what}: dtype {got_dtype}, expected {' or '.join(str(d) for d in dtypes)}")
    if got_shape != shape:
        raise ValueError(f"{what}: shape {list(got_shape)}, expected {list(shape)}")
