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
from layers.ngram_embed import NgramDims, NgramEmbedding, NgramTable, RowCache, TableFile, TableWriter, write_table
from layers.ngram_embed.decoder import NgramDecoder
from layers.ngram_embed.fused import FusedNgramEmbedding
from layers.ops.token_overlay import OverlayKernels
from layers.overlay import OverlaySlots
from layers.weight_map import BF16, DenseWeight
from tests.bad_inputs.offline import offline_backends
from tests.helpers import random_bf16, random_fp8
from tests.helpers.checkpoint import make_model, tiny_config, write_model
from tests.helpers.logging_backend import LoggingBackend
from tests.helpers.ngram import device_layer, random_layer, small_dims
from tests.helpers.overlay import random_overlay
from tests.helpers.peft import EMBED, save_adapter, token_rows, tt_config


class World:
    """Every subject of the CPU cases on one ``LoggingBackend``: device buffers of random bytes, an n-gram
    layer and its fused twin, a disk table, its ``RowCache``, ``TableFile`` and a ``TableWriter``,
    overlay slots; each also closed. Rarer subjects are built on demand (``needs``)."""

    def __init__(self, rng: np.random.Generator, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rng, self.tmp = rng, tmp
        gpu = self.gpu = LoggingBackend()
        self.p = [self.random_buffer(8192) for _ in range(6)]
        self.dims = small_dims()  # V=500, D=40, N=3, K=2: T=4 tables of 10 columns
        self.host_layer = random_layer(rng, self.dims, "bf")
        self.layer = device_layer(gpu, self.host_layer, max_tokens=8)
        self.closed_layer = device_layer(gpu, self.host_layer, max_tokens=8)
        self.closed_layer.close()
        self.fused = FusedNgramEmbedding(self.layer, 8, gpu)
        self.closed_fused = FusedNgramEmbedding(self.layer, 8, gpu)
        self.closed_fused.close()
        self.decoder = NgramDecoder(self.layer, max_seqs=4, max_rows=8, gpu=gpu, max_draft=2)
        self.closed_decoder = NgramDecoder(self.layer, max_seqs=4, max_rows=8, gpu=gpu)
        self.closed_decoder.close()
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
    def _cached_layer(self, name: str, capacities: tuple[int, int]) -> NgramEmbedding:
        """T = 2 tables, both ``RowCache``s of the given capacities, over disk copies of random rows."""
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
        return NgramEmbedding(dims, word, tables, projs, 16, self.gpu)

    @functools.cached_property
    def cached_layer(self) -> NgramEmbedding:
        return self._cached_layer("cached", (8, 3))

    @functools.cached_property
    def cached_fused(self) -> FusedNgramEmbedding:
        return FusedNgramEmbedding(self._cached_layer("fused", (8, 3)), 16, self.gpu)

    @functools.cached_property
    def layer_with_closed_cache(self) -> NgramEmbedding:
        layer = self._cached_layer("half", (8, 8))
        layer.tables[1].cache.close()
        return layer

    @functools.cached_property
    def layer_huge_vocab(self) -> NgramEmbedding:
        """The layer's weights under dims whose vocabulary the fused kernel cannot hash."""
        layer = NgramEmbedding(self.dims, self.layer.word, self.layer.tables, self.layer.projs, 8, self.gpu)
        layer.dims = NgramDims(2**32, 40, 3, 2, 61, row_bias=1)
        return layer

    @functools.cached_property
    def slots_without_kernels(self) -> OverlaySlots:
        return OverlaySlots(self.gpu, 2, vocab=30, h=5, kernels=OverlayKernels.default())

    @functools.cached_property
    def fused_over_closed_layer(self) -> FusedNgramEmbedding:
        """A fused layer whose ``NgramEmbedding`` (built by ``from_numpy``, so owning its weights)
        was closed: the weights it gathers from are freed."""
        h = self.host_layer
        tables = [t if s is None else (t, s) for t, s in h.tables]
        layer = NgramEmbedding.from_numpy(self.dims, h.word, tables, h.projs, 8, self.gpu)
        fused = FusedNgramEmbedding(layer, 8, self.gpu)
        layer.close()
        return fused

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
        )

    def close(self) -> None:
        for thing in (self.cache, self.file, *self._caches):
            thing.close()
        for writer in (self.writer, self.closed_writer):
            writer.abort()

