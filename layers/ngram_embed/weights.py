"""``NgramWeights``: one n-gram embedding's weights on one GPU, which every runner reads.

The word table ``[V, D]`` (a tensor-parallel rank: its word rows), the T hashed tables (each an
``NgramTable`` variant: device, host memory, cached, or absent on this rank) and the T
projections ``[D, td]`` (td: the table width), all bf16 but fp8 tables. The fused runners'
concatenated projection ``[D, T*td]`` and the gather kernels' table descriptors are built from them
once, on first use.
The weights own what their loaders built and free it in ``close()``; runners
(``NgramEmbedding``, ``FusedNgramEmbedding``, ``NgramDecoder``) borrow them and raise
``ClosedError`` on every call once they are closed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpu_runtime import DevicePtr, GpuBackend, PitchedCopies, validate
from gpu_runtime.backend import check_backend

from ..dense_weight import BF16, DenseWeight
from ..ngram_store.host_weight import HostWeight
from ..resources import Closing, Resources, closed_on_failure
from .dims import NgramDims
from .placement import PLACEMENTS, placements
from .shard import NgramShard, resolve_shard
from .tables import AbsentTable, AnyTable, Bf16Table, Fp8Table, HostTable, check_table, gather_entry

HostTableArrays = np.ndarray | tuple[np.ndarray, np.ndarray] | None  # bf16, (fp8, f32 scales), absent


class NgramWeights(Closing):
    """One n-gram embedding's weights on ``gpu``, checked against ``dims``: the bf16 word table
    ``[V, D]``, the T tables (``NgramTable`` variants) and the T bf16 projections ``[D, td]`` (td:
    the table width). Raises ``TypeError`` / ``ValueError`` for a count, shape or dtype the dims
    disagree with. ``shard``: a tensor-parallel rank's share, whose ``word`` holds only its word
    rows and whose other tables are ``NgramTable.Absent``. Runners borrow it; ``close()`` frees
    what its loaders built."""

    def __init__(
        self,
        dims: NgramDims,
        word: DenseWeight,
        tables: Sequence[AnyTable],
        projs: Sequence[DenseWeight],
        gpu: GpuBackend,
        *,
        shard: NgramShard | tuple[int, int] | None = None,
    ) -> None:
        if not isinstance(dims, NgramDims):
            raise TypeError(f"NgramWeights: dims must be NgramDims, got {type(dims).__name__}")
        check_backend(gpu, "NgramWeights: gpu")
        shard = resolve_shard(shard, dims)
        t, h, td = dims.num_tables(), dims.hidden_size, dims.table_dim()
        if len(tables) != t:
            raise ValueError(f"table count: {len(tables)} tables, dims need {t}")
        if len(projs) != t:
            raise ValueError(f"proj count: {len(projs)} projections, dims need {t}")
        for weight, what in [(word, "word"), *((p, f"proj {i}") for i, p in enumerate(projs))]:
            if not isinstance(weight, DenseWeight):
                raise TypeError(f"{what}: expected a DenseWeight (device weight), got {type(weight).__name__}")
        word_rows = dims.vocab_size if shard is None else shard.word_rows
        if word.shape != (word_rows, h) or word.dtype != BF16:
            raise ValueError(f"word embedding must be ({word_rows}, {h}) bfloat16, got {word.shape} {word.dtype}")
        for c, table in enumerate(tables):
            check_table(table, c, dims.table_rows(c), td)
            if shard is None and isinstance(table, AbsentTable):
                raise ValueError(f"table {c}: NgramTable.Absent, but these weights are not a tensor-parallel shard")
            if shard is not None and isinstance(table, AbsentTable) == (c in shard.tables):
                raise ValueError(
                    f"table {c} {'must' if c in shard.tables else 'must not'} be held by rank "
                    f"{shard.rank} (its tables: {list(shard.tables)})"
                )
        for c, proj in enumerate(projs):
            if proj.shape != (h, td) or proj.dtype != BF16:
                raise ValueError(f"proj {c} must be ({h}, {td}) bfloat16, got {proj.shape} {proj.dtype}")
        self.dims, self.gpu, self.shard = dims, gpu, shard
        self.word, self.tables, self.projs = word, list(tables), list(projs)
        self._owned = Resources(gpu)  # what ``own`` hands over: closed after the derived buffers
        self._derived = Resources(gpu)
        self._projs_cat: DenseWeight | None = None
        self._descriptors: tuple[DevicePtr, DevicePtr] | None = None

    # -- loaders -----------------------------------------------------------------------------------
    @classmethod
    def from_numpy(
        cls,
        dims: NgramDims,
        word: np.ndarray,
        tables: Sequence[HostTableArrays],
        projs: Sequence[np.ndarray],
        gpu: GpuBackend,
        *,
        stream: int = 0,
        placement: str | Sequence[str] = "device",
        shard: NgramShard | tuple[int, int] | None = None,
    ) -> NgramWeights:
        """Upload host arrays: ``word [V, D]``; each table bf16 or ``(fp8, f32 scales)`` (None
        where another rank holds it); every projection. ``placement`` ("device", "host", or one
        per table) puts a table on the device or in mapped pinned host memory, read in place over
        PCIe. With ``shard`` only its word rows and tables are uploaded. Returns once the uploads
        (queued on ``stream``) are done, so runners on any stream can read the weights."""
        stream = _check_loader_args("NgramWeights.from_numpy", dims, gpu, stream)
        shard = resolve_shard(shard, dims)
        if len(tables) != dims.num_tables():
            raise ValueError(f"table count: {len(tables)} tables, dims need {dims.num_tables()}")
        places = placements(placement, len(tables), PLACEMENTS)
        word_shape = (dims.vocab_size, dims.hidden_size)
        if shard is not None and np.shape(word) != word_shape:
            raise ValueError(f"word: a shard slices its rows from the full {word_shape} table, got {np.shape(word)}")
        for c, table in enumerate(tables):
            if table is None and (shard is None or c in shard.tables):
                raise ValueError(f"table {c}: None, but this weights object holds it")
        with closed_on_failure() as owned:

            def keep(weight: Any) -> Any:
                owned.append(weight)
                return weight

            word_rows = np.asarray(word)
            if shard is not None:
                word_rows = word_rows[shard.word_lo : shard.word_lo + shard.word_rows]
            w = keep(DenseWeight.from_numpy(gpu, word_rows, None, stream))
            dev_tables: list[AnyTable] = []
            for c, (table, where) in enumerate(zip(tables, places)):
                if shard is not None and c not in shard.tables:
                    dev_tables.append(AbsentTable(dims.table_rows(c), dims.table_dim()))
                    continue
                assert table is not None  # checked above, before any upload
                array, scale = table if isinstance(table, tuple) else (table, None)
                if where == "host":
                    dev_tables.append(HostTable(keep(HostWeight.from_numpy(gpu, array, scale, stream))))
                else:
                    dense = keep(DenseWeight.from_numpy(gpu, array, scale, stream))
                    dev_tables.append(Fp8Table(dense) if isinstance(table, tuple) else Bf16Table(dense))
            dev_projs = [keep(DenseWeight.from_numpy(gpu, p, None, stream)) for p in projs]
            gpu.synchronize(stream)  # uploaded: a runner on any stream may read them (a created one does not wait)
            weights = cls(dims, w, dev_tables, dev_projs, gpu, shard=shard)
        weights.own(*owned)
        return weights

    @classmethod
    def from_safetensors(
        cls,
        path: str | os.PathLike,
        dims: NgramDims,
        gpu: GpuBackend,
        *,
        prefix: str = "",
        stream: int = 0,
        placement: str | Sequence[str] = "device",
        shard: NgramShard | tuple[int, int] | None = None,
    ) -> NgramWeights:
        """``{prefix}word.weight``, ``{prefix}tables.{c}.weight`` (bf16, or F8_E4M3 with
        ``{prefix}tables.{c}.row_scale`` f32) and ``{prefix}projs.{c}.weight`` of one file;
        the rest as ``from_numpy``."""
        from ..safetensors_io import load

        _check_loader_args("NgramWeights.from_safetensors", dims, gpu, stream)
        placements(placement, dims.num_tables(), PLACEMENTS)  # refused before the file is opened
        tensors = load(path)

        def get(name: str) -> np.ndarray:
            try:
                return tensors[prefix + name]
            except KeyError:
                raise KeyError(f"{path}: no tensor {prefix + name!r}") from None

        tables: list[HostTableArrays] = []
        for c in range(dims.num_tables()):
            scale = tensors.get(f"{prefix}tables.{c}.row_scale")
            table = get(f"tables.{c}.weight")
            tables.append(table if scale is None else (table, scale))
        projs = [get(f"projs.{c}.weight") for c in range(dims.num_tables())]
        return cls.from_numpy(
            dims, get("word.weight"), tables, projs, gpu, stream=stream, placement=placement, shard=shard
        )

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike,
        gpu: GpuBackend,
        *,
        placement: Any = "device",
        shard: NgramShard | tuple[int, int] | None = None,
        eos_id: int | None = None,
        table_dir: str | os.PathLike | None = None,
        stream: int = 0,
        cache_rows: int = 1 << 16,
    ) -> NgramWeights:
        """The n-gram weights of a LongCat-Flash-Lite-style Hugging Face model folder
        (``config.json`` and ``model.safetensors`` or a sharded index; ``docs/checkpoints.md``),
        the checkpoint opened once. ``placement``: "device", "host", "files" (a ``RowCache`` of
        ``cache_rows`` rows over ``table_dir``'s table files, the converter's output), one per
        table, or a ``DeviceBudget`` in bytes. ``eos_id`` overrides the config's. Everything is
        read and checked before the first upload (``CheckpointError`` names file and tensor)."""
        from .pretrained import load_weights

        check_backend(gpu, "NgramWeights.from_pretrained: gpu")
        stream = validate.stream(stream, "NgramWeights.from_pretrained: stream")
        return load_weights(cls, model_dir, gpu, placement, shard, eos_id, table_dir, stream, cache_rows)

    # -- what the fused runners read ---------------------------------------------------------------
    def concat_projections(self, stream: int = 0) -> DenseWeight:
        """``[D, T*td]`` bf16, row j = proj_0[j] ++ proj_1[j] ++ ...: the fused GEMM's B operand,
        built on the first call (one pitched copy per table, on ``stream``, waited for: runners
        on other streams read it)."""
        stream = validate.stream(stream, "NgramWeights.concat_projections: stream")
        self._require_open()
        if self._projs_cat is None:
            gpu = self.gpu
            if not isinstance(gpu, PitchedCopies):  # the runners refuse such a backend before this
                raise TypeError(
                    f"NgramWeights.concat_projections: the backend needs PitchedCopies; {type(gpu).__name__} lacks them"
                )
            t, h, td = self.dims.num_tables(), self.dims.hidden_size, self.dims.table_dim()
            cat = self._derived.alloc(h * t * td * 2)
            for c, proj in enumerate(self.projs):
                gpu.copy_2d_async(cat.offset(c * td * 2), t * td * 2, proj.weight, td * 2, td * 2, h, stream)
            gpu.synchronize(stream)
            self._projs_cat = DenseWeight(cat, (h, t * td), np.dtype(BF16), gpu=gpu)  # owns nothing
        return self._projs_cat

    def table_descriptors(self, stream: int = 0) -> tuple[DevicePtr, DevicePtr]:
        """The gather kernels' table arguments, built on the first call: ``desc`` ``[T, 4]`` u64
        (``gather_entry``) and ``pows`` ``[T, N]`` u64 (V^d mod each table's rows); uploaded on
        ``stream`` and waited for, as ``concat_projections``."""
        stream = validate.stream(stream, "NgramWeights.table_descriptors: stream")
        self._require_open()
        if self._descriptors is None:
            dims, n = self.dims, self.dims.max_ngram
            desc = np.array(
                [gather_entry(table, dims.table_rows(c)) for c, table in enumerate(self.tables)], np.uint64
            ).reshape(-1, 4)
            pows = np.array(
                [[pow(dims.vocab_size, d, dims.table_rows(c)) for d in range(n)] for c in range(dims.num_tables())],
                np.uint64,
            )
            descriptors = (self._derived.upload(desc, stream), self._derived.upload(pows, stream))
            self.gpu.synchronize(stream)
            self._descriptors = descriptors
        return self._descriptors

    # -- ownership ---------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: the runners built on these weights then raise ``ClosedError``."""
        return self._owned.closed

    def own(self, *things: Any) -> None:
        """Close ``things`` (anything with a ``close()``: weights, caches) with these weights,
        the last handed over first. The loaders hand over all they built."""
        self._require_open()
        for thing in things:
            self._owned.adopt(thing)

    def close(self) -> None:
        """Free the derived buffers, then what was handed over (``own``); once."""
        try:
            self._derived.close()
        finally:
            self._owned.close()

    def _require_open(self) -> None:
        validate.require_open(self.closed, "NgramWeights")


def _check_loader_args(what: str, dims: Any, gpu: Any, stream: Any) -> int:
    """A loader's ``dims``, ``gpu`` and ``stream`` (returned as an int), checked before anything
    is read or uploaded."""
    if not isinstance(dims, NgramDims):
        raise TypeError(f"{what}: dims must be NgramDims, got {type(dims).__name__}")
    check_backend(gpu, f"{what}: gpu")
    return validate.stream(stream, f"{what}: stream")
