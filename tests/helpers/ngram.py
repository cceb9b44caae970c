"""N-gram layers for tests: random host weights, their device copies (resident, or behind an
identity cache), and their release; small dims every test can afford; the check that runners
borrow their weights (``assert_runners_borrow_the_weights``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layers.ngram_embed import NgramDims, NgramEmbedding, NgramTable, NgramWeights
from layers.dense_weight import DenseWeight
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


def device_weights(gpu, host: HostLayer, cached: bool = False) -> NgramWeights:
    """``host`` uploaded, owned by the weights: every table resident, or (``cached``) behind an
    ``IdentityCache``."""
    word = DenseWeight.from_numpy(gpu, host.word)
    owned, tables = [word], []
    for table, scale in host.tables:
        w = DenseWeight.from_numpy(gpu, table, scale)
        owned.append(w)
        if cached:
            tables.append(NgramTable.Cached(IdentityCache(w)))
        else:
            tables.append(NgramTable.Fp8(w) if scale is not None else NgramTable.Bf16(w))
    projs = [DenseWeight.from_numpy(gpu, p) for p in host.projs]
    weights = NgramWeights(host.dims, word, tables, projs, gpu)
    weights.own(*owned, *projs)
    return weights


def device_layer(gpu, host: HostLayer, max_tokens: int, cached: bool = False) -> NgramEmbedding:
    """The seed's runner over ``device_weights(gpu, host, cached)``; ``free_layer`` frees both."""
    return NgramEmbedding(device_weights(gpu, host, cached), max_tokens)


def free_layer(layer: NgramEmbedding) -> None:
    """Close a ``device_layer`` and the weights it runs on."""
    layer.close()
    layer.weights.close()


def assert_runners_borrow_the_weights(gpu, weights: NgramWeights, first: Callable[[], Any],
                                      second: Callable[[], Any], call: Callable[[Any], None],
                                      kernels: list[str]) -> list:
    """Runners on ``weights`` (just uploaded to the ``RecordingBackend`` ``gpu``) borrow them:
    ``first()`` derives what the fused kernels read (the concatenated projections, the table
    descriptors) on the weights; ``second()`` derives nothing again, shares those projections,
    and its ``close()`` frees only its own buffers; ``call(first)`` then still launches
    ``kernels``; the first's ``close()`` frees its own buffers, not what was derived, and
    ``weights.close()`` frees every upload and what was derived. Returns ``call``'s launches."""
    def addresses(op: str) -> set[int]:
        return {recorded[1] for recorded in gpu.ops if recorded[0] == op}

    uploads = addresses("alloc")
    one = first()
    derived_and_first = addresses("alloc") - uploads
    gpu.ops.clear()
    two = second()
    own = addresses("alloc")
    assert own and not [op for op in gpu.ops if op[0] in ("copy2d", "h2d")], "nothing derived again"
    assert two.projection.projs is one.projection.projs
    gpu.ops.clear()
    two.close()
    assert addresses("free") == own and not weights.closed
    gpu.launches.clear()
    call(one)
    launches = list(gpu.launches)
    assert [gpu.kernel_of(launch)[1] for launch in launches] == kernels
    gpu.ops.clear()
    one.close()
    first_own = addresses("free")
    assert first_own and first_own < derived_and_first
    gpu.ops.clear()
    weights.close()
    assert addresses("free") == uploads | (derived_and_first - first_own)
    return launches


def small_dims(**kw) -> NgramDims:
    """V=500, D=40, N=3, K=2 (T=4 tables of 61.. rows), ``kw`` replacing any of them."""
    base = dict(vocab_size=500, hidden_size=40, max_ngram=3, splits=2, base_rows=61, row_bias=1,
                table_dim=None, eos_id=None)
    base.update(kw)
    return NgramDims(**base)
