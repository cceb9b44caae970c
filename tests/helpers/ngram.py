"""N-gram layers for tests: random host weights, their device copies (resident, or behind an
identity cache), and their release; small dims every test can afford."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from layers.ngram_embed import NgramDims, NgramEmbedding, NgramTable
from layers.weight_map import DenseWeight
from tests.helpers import random_bf16, random_fp8


@dataclass
class HostLayer:
    """Random weights of one layer, on the host, in the form the reference takes."""

    dims: NgramDims
    word: np.ndarray
    tables: list[tuple[np.ndarray, np.ndarray | None]]
    projs: list[np.ndarray]


def random_layer(rng, dims: NgramDims, kinds: str) -> HostLayer:
    """``kinds`` picks each table's storage: 'b' bf16, 'f' fp8, cycled over the tables."""
    td, h = dims.table_dim(), dims.hidden_size
    word = random_bf16(rng, (dims.vocab_size, h))
    tables, projs = [], []
    for c in range(dims.num_tables()):
        rows = dims.table_rows(c)
        if kinds[c % len(kinds)] == "f":
            tables.append((random_fp8(rng, (rows, td)), rng.uniform(0.002, 0.02, rows).astype(np.float32)))
        else:
            tables.append((random_bf16(rng, (rows, td)), None))
        projs.append(random_bf16(rng, (h, td), 1 / np.sqrt(td)))
    return HostLayer(dims, word, tables, projs)


@dataclass
class IdentityCache:
    """A ``RowSource`` whose arena is the whole table and whose slot for id i is i: it runs the
    seed's Cached branch (ids -> slots -> arena gather) with a known answer."""

    weight: DenseWeight
    rows: int = 0
    dim: int = 0
    calls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rows, self.dim = self.weight.shape

    def resolve(self, ids, slots_out) -> None:
        self.calls.append("resolve")
        slots_out[:] = ids

    def table_dev_va(self) -> int:
        return int(self.weight.weight)

    def scale_dev_va(self) -> int | None:
        return int(self.weight.row_scale) if self.weight.row_scale else None

    def end_batch(self) -> None:
        self.calls.append("end_batch")


def device_layer(gpu, host: HostLayer, max_tokens: int, cached: bool = False) -> NgramEmbedding:
    """``host`` uploaded: every table resident, or (``cached``) behind an ``IdentityCache``."""
    word = DenseWeight.from_numpy(gpu, host.word)
    tables = []
    for table, scale in host.tables:
        w = DenseWeight.from_numpy(gpu, table, scale)
        if cached:
            tables.append(NgramTable.Cached(IdentityCache(w)))
        else:
            tables.append(NgramTable.Fp8(w) if scale is not None else NgramTable.Bf16(w))
    projs = [DenseWeight.from_numpy(gpu, p) for p in host.projs]
    return NgramEmbedding(host.dims, word, tables, projs, max_tokens, gpu)


def free_layer(layer: NgramEmbedding) -> None:
    """Close a ``device_layer`` and the weights it was built on (the layer does not own them)."""
    layer.word.close()
    for t in layer.tables:
        (t.cache.weight if isinstance(t, NgramTable.Cached) else t.weight).close()
    for p in layer.projs:
        p.close()
    layer.close()


def small_dims(**kw) -> NgramDims:
    """V=500, D=40, N=3, K=2 (T=4 tables of 61.. rows), ``kw`` replacing any of them."""
    base = dict(vocab_size=500, hidden_size=40, max_ngram=3, splits=2, base_rows=61, row_bias=1,
                table_dim=None, eos_id=None)
    base.update(kw)
    return NgramDims(**base)
