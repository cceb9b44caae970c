"""The fused gather kernel's inputs as the layer builds them (token windows, hash powers), random
EOS-laden contexts, and device tables with the rows and ids the kernel must write."""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from layers import reference as ref
from layers.ngram_embed.dims import NgramDims
from layers.ngram_embed.ids import ngram_ids_array
from layers.ops.ngram_fused import CACHED, NO_TOKEN
from layers.dense_weight import DenseWeight
from tests.helpers import Guarded, random_bf16, random_fp8

BF16 = ml_dtypes.bfloat16


def windows_for(tokens: np.ndarray, positions: np.ndarray, max_ngram: int) -> np.ndarray:
    """``[R, N]`` u32: ``tokens[p_r - d]``, or ``NO_TOKEN`` where ``p_r - d < 0``."""
    idx = np.asarray(positions, np.int64)[:, None] - np.arange(max_ngram)[None, :]
    out = np.full(idx.shape, NO_TOKEN, dtype=np.uint32)
    out[idx >= 0] = np.asarray(tokens, np.uint64)[idx[idx >= 0]]
    return out


def pows_for(vocab: int, moduli: list[int], max_ngram: int) -> np.ndarray:
    """``[T, N]`` u64: ``V**d mod M_c`` with Python ints."""
    return np.array([[pow(vocab, d, m) for d in range(max_ngram)] for m in moduli], np.uint64)


def context(rng: np.random.Generator, dims: NgramDims, length: int, eos_rate: float) -> np.ndarray:
    """Random tokens; with an EOS, a fraction of them EOS, one at the start and a run of them."""
    tokens = rng.integers(0, dims.vocab_size, length, dtype=np.uint64)
    if dims.eos_id is not None:
        tokens[rng.random(length) < eos_rate] = dims.eos_id
        tokens[0] = dims.eos_id
        start = int(rng.integers(0, length))
        tokens[start:start + 3] = dims.eos_id
    return tokens


@dataclass
class Tables:
    """The device tables of one case and the rows the kernel must write."""

    entries: np.ndarray  # [T, 4] u64
    want_ids: np.ndarray  # [R, T] u32
    want_out: np.ndarray  # [R, T*td] bf16
    slots: np.ndarray | None  # [R, T] u32, None when no table is cached
    owned: list = field(default_factory=list)  # DenseWeights and Guarded buffers to free
    guarded: list = field(default_factory=list)

    def close(self) -> None:
        """Free every table and scale buffer."""
        for thing in self.owned:
            if isinstance(thing, DenseWeight):
                thing.close()
            else:
                thing.free()


def _upload_table(gpu, rng, tables: Tables, array: np.ndarray, scale: np.ndarray | None,
                  misalign: int) -> tuple[int, int]:
    """Device copies of one table (and its scales): DenseWeight, or Guarded when misaligned."""
    if not misalign:
        weight = DenseWeight.from_numpy(gpu, array, scale)
        tables.owned.append(weight)
        return int(weight.weight), int(weight.row_scale)
    data = Guarded(gpu, array.shape, array.dtype, rng, misalign).upload(array)
    tables.owned.append(data)
    tables.guarded.append(data)
    if scale is None:
        return int(data.ptr), 0
    scales = Guarded(gpu, scale.shape, np.float32, rng).upload(scale)
    tables.owned.append(scales)
    tables.guarded.append(scales)
    return int(data.ptr), int(scales.ptr)


def make_tables(gpu, rng, dims: NgramDims, tokens: np.ndarray, positions: np.ndarray, *,
                cached_rate: float, fp8_rate: float, misalign: int = 0) -> Tables:
    """Random bf16 / fp8 tables of ``dims``'s row counts; cached ones are small arenas whose
    rows the slots pick. The expected ids come from ``ngram_ids``, the rows from the reference."""
    t, td, rows_r = dims.num_tables(), dims.table_dim(), len(positions)
    want_ids = ngram_ids_array(dims, tokens)[:, positions].T.astype(np.uint32)
    tables = Tables(np.zeros((t, 4), np.uint64), want_ids, np.empty((rows_r, t * td), BF16), None)
    slots = np.zeros((rows_r, t), np.uint32)
    for c in range(t):
        cached = rng.random() < cached_rate
        rows = int(rng.integers(1, 40)) if cached else dims.table_rows(c)
        if cached:
            slots[:, c] = rng.integers(0, rows, rows_r)
            want_ids[:, c] = slots[:, c]
        if rng.random() < fp8_rate:
            array = random_fp8(rng, (rows, td))
            scale = np.exp(rng.uniform(-8, 8, rows)).astype(np.float32)
        else:
            array, scale = random_bf16(rng, (rows, td)), None
        data, scale_ptr = _upload_table(gpu, rng, tables, array, scale, misalign)
        tables.entries[c] = (data, scale_ptr, rows, CACHED if cached else 0)
        tables.want_out[:, c * td:(c + 1) * td] = ref.gather_table(array, scale, want_ids[:, c])
    if (tables.entries[:, 3] & CACHED).any():
        tables.slots = slots
    return tables


def ngram_gather(gpu, kernel, windows, tables, pows, slots, out, ids_out, rows, num_tables, max_ngram, splits,
                 table_dim, eos, stream, host_tables=False) -> None:
    """``NgramGather`` planned and run in one call, every argument in the kernel's order."""
    from layers.ops.ngram_fused import NgramGather

    plan = NgramGather(gpu, kernel, tables, pows, num_tables, max_ngram, splits, table_dim, eos, host_tables)
    plan.run(windows, slots, out, ids_out, rows, stream)
