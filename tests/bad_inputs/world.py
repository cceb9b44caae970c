"""The CPU cases' world: every subject, built on a logging host-memory backend before the
snapshot that "nothing written" compares, and that snapshot."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpu_runtime import DevicePtr
from layers import safetensors_io
from layers.engram import EngramCheckpoint, EngramDecoder, EngramWeights, Shard
from layers.ngram_embed import (FusedNgramEmbedding, NgramDecoder, NgramDims, NgramEmbedding, NgramTable, NgramWeights,
                                RowCache, TableFile, TableWriter, write_table)
from layers.ops.token_overlay import OverlayKernels
from layers.overlay import OverlaySlots
from layers.dense_weight import BF16, DenseWeight
from tests.bad_inputs.offline import offline_backends
from tests.helpers import engram as engram_helpers
from tests.helpers import random_bf16, random_fp8
from tests.helpers.checkpoint import make_model, tiny_config, write_model
from tests.helpers.logging_backend import LoggingBackend
from tests.helpers.ngram import HostLayer, device_weights, random_layer, small_dims
from tests.helpers.overlay import random_overlay
from tests.helpers.peft import EMBED, save_adapter, token_rows, tt_config


class FakeCollective:
    """One rank's end of a communicator (``layers.tensor_parallel.Collective``) that records its
    all-reduces and sums nothing: the CPU cases need its checks, not its arithmetic."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.closed = rank, size, False
        self.calls: list[tuple[int, int, int]] = []

    def allreduce_bf16(self, ptr: int, count: int, stream: int) -> None:
        self.calls.append((int(ptr), count, stream))


class FakeGroup:
    """Every rank of a communicator (``layers.tensor_parallel.CollectiveGroup``), recording its
    all-reduces; ``LocalGroup`` needs device copies, which the logging backend lacks."""

    def __init__(self, size: int) -> None:
        self.size, self.closed = size, False
        self.calls: list[list[tuple[int, int, int]]] = []

    def allreduce_bf16_all(self, buffers) -> None:
        self.calls.append([(int(p), c, s) for p, c, s in buffers])


class EngramSubjects:
    """The Engram cases' subjects on a backend, from ``tests.helpers.engram``'s tiny config, a
    token map and random arrays: weights and a decoder over them (a closed one too, and one over
    weights closed under it), both ranks' shares of a group of 2 with a decoder each (a closed rank
    1, a rank 1 with a collective of its own), a model folder (``tmp/engram``) and its checkpoint,
    and in ``tmp`` the map saved, a truncated copy of it and a file that is not a map."""

    def __init__(self, gpu: LoggingBackend, rng: np.random.Generator, tmp: Path) -> None:
        self.cfg = engram_helpers.tiny()
        self.map = engram_helpers.token_map(rng, self.cfg)
        self.arrays = engram_helpers.arrays(rng, self.cfg)
        self.weights = self.build(gpu)
        self.decoder = EngramDecoder(self.weights, max_seqs=4, max_rows=8, max_draft=2)
        self.closed_decoder = EngramDecoder(self.weights, max_seqs=4, max_rows=8)
        self.closed_decoder.close()
        self.closed_weights = self.build(gpu)
        self.decoder_on_closed = EngramDecoder(self.closed_weights, max_seqs=4, max_rows=8)
        self.closed_weights.close()
        self.shard_weights = [self.build(gpu, shard=Shard(r, 2)) for r in range(2)]
        self.ranks = [EngramDecoder(weights, max_seqs=4, max_rows=8) for weights in self.shard_weights]
        self.closed_rank = EngramDecoder(self.shard_weights[1], max_seqs=4, max_rows=8)
        self.closed_rank.close()
        self.rank_with_collective = EngramDecoder(self.shard_weights[1], max_seqs=4, max_rows=8,
                                                  collective=FakeCollective(1, 2))
        self.model = engram_helpers.write_model(tmp / "engram", rng)
        self.checkpoint = EngramCheckpoint.open(self.model.path)
        self.map_path, self.short_path, self.foreign_path = tmp / "map.etm", tmp / "short.etm", tmp / "notes.txt"
        self.map.save(self.map_path)
        self.short_path.write_bytes(self.map_path.read_bytes()[:-4])
        self.foreign_path.write_bytes(b"someone's notes")

    def build(self, gpu: Any, **keywords: Any) -> EngramWeights:
        """``EngramWeights.from_arrays`` of the subjects' arrays on ``gpu``."""
        a = self.arrays
        return EngramWeights.from_arrays(gpu, self.cfg, self.map, a["tables"], a["wkv"], a["q"], a["k"], **keywords)

    def state(self) -> list[bool]:
        return [x.closed for x in (self.weights, self.closed_weights, self.decoder, *self.shard_weights, *self.ranks)]


def numpy_tables(host: HostLayer) -> list:
    """``host``'s tables as ``NgramWeights.from_numpy`` takes them: bf16, or (fp8, scales)."""
    return [t if s is None else (t, s) for t, s in host.tables]


class World:
    """Every subject of the CPU cases on one ``LoggingBackend``: device buffers of random bytes,
    ``NgramWeights`` and the three runners over them (each also closed, and each over closed
    weights), weights no runner has touched, the weights' safetensors file, a disk table, its
    ``RowCache``, ``TableFile`` and a ``TableWriter``, overlay slots (closed ones too). Rarer
    subjects (cached tables, tensor-parallel shares and their runners, ``EngramSubjects``) are
    built on demand (``needs``)."""

    def __init__(self, rng: np.random.Generator, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rng, self.tmp = rng, tmp
        gpu = self.gpu = LoggingBackend()
        self.p = [self.random_buffer(8192) for _ in range(6)]
        self.dims = small_dims()  # V=500, D=40, N=3, K=2: T=4 tables of 10 columns
        self.host_layer = random_layer(rng, self.dims, "bf")
        self.numpy_tables = numpy_tables(self.host_layer)
        # the weights and the runners on them, side by side (the fused runners build the
        # weights' concatenated projections and table descriptors now, before the snapshot)
        self.weights = device_weights(gpu, self.host_layer)
        self.layer = NgramEmbedding(self.weights, 8)
        self.closed_layer = NgramEmbedding(self.weights, 8)
        self.closed_layer.close()
        self.fused = FusedNgramEmbedding(self.weights, 8)
        self.closed_fused = FusedNgramEmbedding(self.weights, 8)
        self.closed_fused.close()
        self.decoder = NgramDecoder(self.weights, max_seqs=4, max_rows=8, max_draft=2)
        self.closed_decoder = NgramDecoder(self.weights, max_seqs=4, max_rows=8)
        self.closed_decoder.close()
        # weights no runner has used yet: a refused runner must not build their concatenated
        # projections or table descriptors either (the runners' constructor cases)
        self.bare_weights = device_weights(gpu, self.host_layer)
        # open runners over weights closed under them (which freed their buffers)
        self.closed_weights = device_weights(gpu, self.host_layer)
        self.layer_on_closed = NgramEmbedding(self.closed_weights, 8)
        self.fused_on_closed = FusedNgramEmbedding(self.closed_weights, 8)
        self.decoder_on_closed = NgramDecoder(self.closed_weights, max_seqs=4, max_rows=8)
        self.closed_weights.close()
        # the weights as one safetensors file (from_safetensors' names, under a prefix)
        self.st_path = tmp / "ngram.safetensors"
        tensors = {"ngram.word.weight": self.host_layer.word}
        for c, ((table, scale), proj) in enumerate(zip(self.host_layer.tables, self.host_layer.projs)):
            tensors[f"ngram.tables.{c}.weight"] = table
            if scale is not None:
                tensors[f"ngram.tables.{c}.row_scale"] = scale
            tensors[f"ngram.projs.{c}.weight"] = proj
        safetensors_io.save(self.st_path, tensors)
        self.out = self.random_buffer(8 * self.dims.hidden_size * 2)
        # a 100-row fp8 disk table and what reads and writes it
        self.table, self.scales = random_fp8(rng, (100, 8)), rng.uniform(0.1, 2, 100).astype(np.float32)
        self.table_path = tmp / "t.ngt"
        write_table(self.table_path, self.table, self.scales)
        self.bad_path = tmp / "trailing.ngt"
        self.bad_path.write_bytes(self.table_path.read_bytes() + b"\0" * 16)
        self.empty_path = tmp / "empty.ngt"
        self.empty_path.write_bytes(b"")
        self.cache = RowCache(gpu, self.table_path, 10, io_threads=1)
        self.closed_cache = RowCache(gpu, self.table_path, 10, io_threads=1)
        self.closed_cache.close()
        self.file = TableFile(self.table_path)
        self.closed_file = TableFile(self.table_path)
        self.closed_file.close()
        self.writer_rows = random_bf16(rng, (4, 3))
        self.writer = TableWriter(tmp / "w.ngt", BF16, 4, 3)
        self.writer.append(self.writer_rows[:2])
        self.closed_writer = TableWriter(tmp / "a.ngt", BF16, 4, 3)
        self.closed_writer.abort()
        # host outputs that refused calls must leave alone
        self.slots_out = rng.integers(0, 2**32, 3, dtype=np.uint32)
        self.rows_out = rng.integers(0, 256, (2, 8), dtype=np.uint8)
        self.scales_out = rng.standard_normal(2).astype(np.float32)
        # overlays
        self.kernels = OverlayKernels.new(gpu)
        self.served_host = random_bf16(rng, (10, 4))
        self.served = DenseWeight.from_numpy(gpu, self.served_host)
        self.slots = OverlaySlots(gpu, 2, vocab=30, h=5, kernels=self.kernels)
        self.slots.load(0, random_overlay(rng, 30, 5, 3, 2))
        self.closed_slots = OverlaySlots(gpu, 2, vocab=30, h=5, kernels=self.kernels)
        self.closed_slots.close()
        # a closed offline CudaBackend: the launchers' "closed" column
        self.cuda, self.target = offline_backends(monkeypatch, rng)
        self._caches: list[RowCache] = []

    def random_buffer(self, nbytes: int) -> DevicePtr:
        ptr = self.gpu.alloc(nbytes)
        self.gpu.copy_h2d_async(self.rng.integers(0, 256, nbytes, dtype=np.uint8), ptr)
        return ptr

    # -- subjects built on demand ------------------------------------------------------------
    def _cached_weights(self, name: str, capacities: tuple[int, int]) -> NgramWeights:
        """T = 2 tables, both ``RowCache``s of the given capacities, over disk copies of random
        rows (the weights own their uploads, the world the caches)."""
        dims = small_dims(max_ngram=2, splits=2)
        host = random_layer(self.rng, dims, "b")
        tables = []
        for c, ((table, _), capacity) in enumerate(zip(host.tables, capacities)):
            path = self.tmp / f"{name}{c}.ngt"
            write_table(path, table)
            cache = RowCache(self.gpu, path, capacity, io_threads=1)
            self._caches.append(cache)
            tables.append(NgramTable.Cached(cache))
        word = DenseWeight.from_numpy(self.gpu, host.word)
        projs = [DenseWeight.from_numpy(self.gpu, p) for p in host.projs]
        weights = NgramWeights(dims, word, tables, projs, self.gpu)
        weights.own(word, *projs)
        return weights

    @functools.cached_property
    def cached_layer(self) -> NgramEmbedding:
        return NgramEmbedding(self._cached_weights("cached", (8, 3)), 16)

    @functools.cached_property
    def cached_fused(self) -> FusedNgramEmbedding:
        return FusedNgramEmbedding(self._cached_weights("fused", (8, 3)), 16)

    @functools.cached_property
    def layer_with_closed_cache(self) -> NgramEmbedding:
        layer = NgramEmbedding(self._cached_weights("half", (8, 8)), 16)
        layer.weights.tables[1].cache.close()
        return layer

    @functools.cached_property
    def weights_huge_vocab(self) -> NgramWeights:
        """The world's weights (borrowed, owning nothing) under dims whose vocabulary the fused
        kernels cannot hash."""
        w = self.weights
        weights = NgramWeights(self.dims, w.word, w.tables, w.projs, self.gpu)
        weights.dims = NgramDims(2**32, 40, 3, 2, 61, row_bias=1)
        return weights

    @functools.cached_property
    def shard_weights(self) -> list[NgramWeights]:
        """Both ranks' shares of the world's weights for a group of 2 (``shard=(r, 2)``)."""
        h = self.host_layer
        return [NgramWeights.from_numpy(self.dims, h.word, self.numpy_tables, h.projs, self.gpu, shard=(r, 2))
                for r in range(2)]

    @functools.cached_property
    def group(self) -> FakeGroup:
        """The group of 2 that ``ranks`` sum over."""
        return FakeGroup(2)

    @functools.cached_property
    def ranks(self) -> list[FusedNgramEmbedding]:
        """A ``FusedNgramEmbedding`` per rank of ``shard_weights``, without a collective (what
        ``embed_all`` drives over ``group``)."""
        return [FusedNgramEmbedding(weights, 8) for weights in self.shard_weights]

    @functools.cached_property
    def closed_rank(self) -> FusedNgramEmbedding:
        """A closed rank 1 beside ``ranks``."""
        rank = FusedNgramEmbedding(self.shard_weights[1], 8)
        rank.close()
        return rank

    @functools.cached_property
    def collective(self) -> FakeCollective:
        """Rank 1's end of a communicator of 2."""
        return FakeCollective(1, 2)

    @functools.cached_property
    def rank_fused(self) -> FusedNgramEmbedding:
        """Rank 1's runner that serves ``embed`` itself, through ``collective``."""
        return FusedNgramEmbedding(self.shard_weights[1], 8, collective=self.collective)

    @functools.cached_property
    def closed_collective(self) -> FakeCollective:
        collective = FakeCollective(1, 2)
        collective.closed = True
        return collective

    @functools.cached_property
    def closed_group(self) -> FakeGroup:
        group = FakeGroup(2)
        group.closed = True
        return group

    @functools.cached_property
    def rank_on_closed_weights(self) -> FusedNgramEmbedding:
        """Rank 1's runner over its own shard weights, closed under it."""
        h = self.host_layer
        weights = NgramWeights.from_numpy(self.dims, h.word, self.numpy_tables, h.projs, self.gpu, shard=(1, 2))
        rank = FusedNgramEmbedding(weights, 8)
        weights.close()
        return rank

    @functools.cached_property
    def rank_fused_closed_collective(self) -> FusedNgramEmbedding:
        """Rank 1's runner whose collective was closed after it was built."""
        collective = FakeCollective(1, 2)
        rank = FusedNgramEmbedding(self.shard_weights[1], 8, collective=collective)
        collective.closed = True
        return rank

    @functools.cached_property
    def fused_with_slots(self) -> FusedNgramEmbedding:
        """A fused runner with two adapter slots of the model's vocab and width (slot 0 loaded)."""
        slots = OverlaySlots(self.gpu, 2, vocab=self.dims.vocab_size, h=self.dims.hidden_size, kernels=self.kernels)
        slots.load(0, random_overlay(self.rng, self.dims.vocab_size, self.dims.hidden_size, 3, None))
        return FusedNgramEmbedding(self.weights, 8, adapter_slots=slots)

    @functools.cached_property
    def foreign_slots(self) -> OverlaySlots:
        """Adapter slots of the model's vocab and width, but on another backend."""
        other = LoggingBackend()
        return OverlaySlots(other, 2, vocab=self.dims.vocab_size, h=self.dims.hidden_size,
                            kernels=OverlayKernels.new(other))

    @functools.cached_property
    def slots_without_kernels(self) -> OverlaySlots:
        return OverlaySlots(self.gpu, 2, vocab=30, h=5, kernels=OverlayKernels.default())

    @functools.cached_property
    def engram(self) -> EngramSubjects:
        return EngramSubjects(self.gpu, self.rng, self.tmp)

    # -- what "nothing written" compares -----------------------------------------------------
    def model(self, damage: Callable[[Any], Any] | None = None) -> Any:
        """A fresh tiny LongCat-Flash-Lite folder (sharded; ``.path``) in a subfolder (the state
        compares top-level files only), ``damage``d before it is returned."""
        self._models = getattr(self, "_models", 0) + 1
        model = write_model(self.tmp / f"model{self._models}", make_model(self.rng, tiny_config()))
        if damage is not None:
            damage(model)
        return model

    def empty_dir(self, name: str) -> Path:
        (self.tmp / name).mkdir()
        return self.tmp / name

    def adapter(self, tensors: dict | None = None, ids: list[int] = (1, 2)) -> Path:
        """A fresh standalone trainable-tokens adapter folder (ids, rows of width 16)."""
        self._adapters = getattr(self, "_adapters", 0) + 1
        ids = list(ids)
        tensors = tensors or {f"{EMBED}.trainable_tokens_delta": token_rows(self.rng, len(ids))}
        return save_adapter(self.tmp / f"adapter{self._adapters}", tt_config(ids), tensors)

    def state(self) -> dict[str, Any]:
        g = self.gpu
        files = {p.name: p.read_bytes() for p in sorted(self.tmp.iterdir()) if p.is_file()}
        cache = self.cache
        return dict(
            mem={ptr: buf.tobytes() for ptr, buf in g.mem.items()},
            host={addr: buf.tobytes() for addr, buf in g.host.items()},
            events=set(g.events), streams=set(g.streams), files=files,
            cache=(dataclasses.astuple(cache.stats), cache.index.slot_of.tobytes(),
                   cache.index.n_pinned),
            writer=self.writer.written,
            slots=[t.tobytes() for t in self.slots._host_tables()] + [id(s) for s in self.slots._slots],
            host_out=(self.slots_out.tobytes(), self.rows_out.tobytes(), self.scales_out.tobytes()),
            target=(self.target.pinned.tobytes(), self.target.host.tobytes()),
            weights=[w.closed for w in (self.weights, self.closed_weights)],
            reduces=[len(self.__dict__[name].calls) for name in ("group", "collective") if name in self.__dict__],
            engram=self.engram.state() if "engram" in self.__dict__ else None,
        )

    def close(self) -> None:
        for thing in (self.cache, self.file, *self._caches):
            thing.close()
        for writer in (self.writer, self.closed_writer):
            writer.abort()

