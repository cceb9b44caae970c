"""The GPU tests' pieces: a check that a backend is still usable after a refusal, and one rig per
kernel module: a launcher's guarded device buffers (random bytes) and its good call, checked
against numpy."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu_runtime import CudaBackend, KernelHandle
from layers import reference as ref
from layers.ngram_embed import NgramDims
from layers.ops import residual
from layers.dense_weight import BF16, DenseWeight
from tests.bad_inputs.launcher_rows import LAUNCH_FN, scaled_add_kernel
from tests.helpers import Guarded, bits, random_bf16
from tests.helpers.ngram_gather import context, make_tables, pows_for, windows_for


def assert_backend_usable(gpu: CudaBackend, rng: np.random.Generator) -> None:
    """A small allocation round trip and a good scaled_add launch, checked against numpy."""
    host = rng.integers(0, 256, 777, dtype=np.uint8)
    ptr = gpu.alloc(777)
    try:
        gpu.copy_h2d_async(host, ptr)
        back = np.empty_like(host)
        gpu.copy_d2h(back, ptr)
        np.testing.assert_array_equal(back, host)
    finally:
        gpu.free(ptr)
    out0, x = random_bf16(rng, 300), random_bf16(rng, 300)
    with Guarded(gpu, 300, BF16, rng) as o, Guarded(gpu, 300, BF16, rng) as g:
        o.upload(out0), g.upload(x)
        residual.scaled_add(gpu, scaled_add_kernel(gpu), o.ptr, g.ptr, -0.37, 300, 0)
        np.testing.assert_array_equal(bits(o.read()), bits(ref.scaled_add(out0, x, -0.37)))
        o.assert_guards_intact()


class Rig:
    """A launcher's device buffers (guarded, random bytes) and its good call. ``call`` takes the
    backend and kernel and any arguments to replace; ``good`` uploads valid inputs, launches and
    checks the answer against numpy."""

    row = module = kernel = ""

    def __init__(self, gpu: CudaBackend, rng: np.random.Generator) -> None:
        self.gpu, self.rng = gpu, rng
        self.bufs: list[Guarded] = []

    def buf(self, shape: Any, dtype: Any) -> Guarded:
        g = Guarded(self.gpu, shape, dtype, self.rng)  # its body starts as random bytes too
        self.bufs.append(g)
        return g

    def args(self) -> dict[str, Any]:
        raise NotImplementedError

    def call(self, gpu: CudaBackend, kernel: KernelHandle, **over: Any) -> None:
        LAUNCH_FN[self.row](gpu, kernel, **{**self.args(), **over})

    def good(self, kernel: KernelHandle) -> None:
        raise NotImplementedError

    def raw(self) -> list[np.ndarray]:
        self.gpu.synchronize()
        return [g.raw() for g in self.bufs]

    def close(self) -> None:
        self.gpu.synchronize()
        for g in self.bufs:
            g.free()


class BatchedEmbedRig(Rig):
    row, module, kernel = "batched_embed", "embed_from_argmax", "batched_embed"

    def __init__(self, gpu, rng):
        super().__init__(gpu, rng)
        self.ids, self.table = self.buf(17, np.uint32), self.buf((300, 40), BF16)
        self.out = self.buf((17, 40), BF16)

    def args(self):
        return dict(ids=self.ids.ptr, table=self.table.ptr, out=self.out.ptr, n=17, dim=40, stream=0)

    def good(self, kernel):
        table, ids = random_bf16(self.rng, (300, 40)), self.rng.integers(0, 300, 17, dtype=np.uint32)
        self.table.upload(table), self.ids.upload(ids), self.out.poison()
        self.call(self.gpu, kernel)
        np.testing.assert_array_equal(bits(self.out.read()), bits(ref.batched_embed(table, ids)))


class ScaledAddRig(Rig):
    row, module, kernel = "scaled_add", "residual_add", "bf16_scaled_add"

    def __init__(self, gpu, rng):
        super().__init__(gpu, rng)
        self.out, self.x = self.buf(1000, BF16), self.buf(1000, BF16)

    def args(self):
        return dict(out=self.out.ptr, x=self.x.ptr, scale=0.37, n=1000, stream=0)

    def good(self, kernel):
        out0, x = random_bf16(self.rng, 1000, 3.0), random_bf16(self.rng, 1000)
        self.out.upload(out0), self.x.upload(x)
        self.call(self.gpu, kernel)
        np.testing.assert_array_equal(bits(self.out.read()), bits(ref.scaled_add(out0, x, 0.37)))


class GemmRig(Rig):
    row, module, kernel = "dense_gemm_bf16_pipelined", "gemm", "dense_gemm_bf16_pipelined"
    M, N, K = 5, 48, 32

    def __init__(self, gpu, rng):
        super().__init__(gpu, rng)
        m, n, k = self.M, self.N, self.K
        self.a, self.w, self.c = self.buf((m, k), BF16), self.buf((n, k), BF16), self.buf((m, n), BF16)

    def args(self):
        return dict(a=self.a.ptr, w=DenseWeight(self.w.ptr, (self.N, self.K), BF16), c=self.c.ptr,
                    m=self.M, n=self.N, k=self.K, stream=0)

    def good(self, kernel):
        # small integers: every fp32 sum is exact and fits bf16, so the answer is bit-exact
        a = self.rng.integers(-2, 3, (self.M, self.K)).astype(np.float32)
        w = self.rng.integers(-2, 3, (self.N, self.K)).astype(np.float32)
        self.a.upload(a.astype(BF16)), self.w.upload(w.astype(BF16)), self.c.poison()
        self.call(self.gpu, kernel)
        np.testing.assert_array_equal(bits(self.c.read()), bits((a @ w.T).astype(BF16)))


class RowdiffRig(Rig):
    row, module, kernel = "embed_rowdiff", "token_overlay", "embed_rowdiff_bf16"

    def __init__(self, gpu, rng):
        super().__init__(gpu, rng)
        self.base, self.served = self.buf((50, 24), BF16), self.buf((50, 24), BF16)
        self.flags = self.buf(50, np.uint8)

    def args(self):
        return dict(base=self.base.ptr, served=self.served.ptr, flags=self.flags.ptr, rows=50, h=24,
                    thresh=0.0, stream=0)

    def good(self, kernel):
        served = random_bf16(self.rng, (50, 24))
        base = served.copy()
        changed = self.rng.choice(50, 7, replace=False)
        base[changed, self.rng.integers(0, 24, 7)] = random_bf16(self.rng, 7, 10.0)
        self.base.upload(base), self.served.upload(served), self.flags.poison()
        self.call(self.gpu, kernel)
        np.testing.assert_array_equal(self.flags.read(), ref.rowdiff_ref(base, served, 0.0))


class ScatterRig(Rig):
    row, module, kernel = "scatter_rows", "row_cache", "scatter_rows"
    CAP, N, ROW_BYTES = 64, 10, 48

    def __init__(self, gpu, rng):
        super().__init__(gpu, rng)
        self.slots, self.rows = self.buf(self.N, np.uint32), self.buf((self.N, self.ROW_BYTES), np.uint8)
        self.scales, self.arena = self.buf(self.N, np.float32), self.buf((self.CAP, self.ROW_BYTES), np.uint8)
        self.arena_scales = self.buf(self.CAP, np.float32)

    def args(self):
        return dict(slots=self.slots.ptr, rows=self.rows.ptr, scales=self.scales.ptr, arena=self.arena.ptr,
                    arena_scales=self.arena_scales.ptr, n=self.N, row_bytes=self.ROW_BYTES, stream=0)

    def good(self, kernel):
        slots = self.rng.choice(self.CAP, self.N, replace=False).astype(np.uint32)
        rows = self.rng.integers(0, 256, (self.N, self.ROW_BYTES), dtype=np.uint8)
        scales = self.rng.standard_normal(self.N).astype(np.float32)
        self.slots.upload(slots), self.rows.upload(rows), self.scales.upload(scales)
        arena, arena_scales = self.arena.read(), self.arena_scales.read()
        arena[slots], arena_scales[slots] = rows, scales
        self.call(self.gpu, kernel)
        np.testing.assert_array_equal(self.arena.read(), arena)
        np.testing.assert_array_equal(bits(self.arena_scales.read()), bits(arena_scales))


class NgramGatherRig(Rig):
    row, module, kernel = "ngram_gather", "ngram_fused", "ngram_gather"

    def __init__(self, gpu, rng):
        super().__init__(gpu, rng)
        self.dims = NgramDims(300, 32, 3, 2, 97, row_bias=1, table_dim=8, eos_id=5)
        self.tokens = context(rng, self.dims, 40, eos_rate=0.1)
        self.positions = np.arange(40)
        self.tables = make_tables(gpu, rng, self.dims, self.tokens, self.positions, cached_rate=0.0, fp8_rate=0.5)
        t, n, td = self.dims.num_tables(), self.dims.max_ngram, self.dims.table_dim()
        moduli = [int(m) for m in self.tables.entries[:, 2]]
        self.windows = self.buf((40, n), np.uint32).upload(windows_for(self.tokens, self.positions, n))
        self.entries = self.buf((t, 4), np.uint64).upload(self.tables.entries)
        self.pows = self.buf((t, n), np.uint64).upload(pows_for(self.dims.vocab_size, moduli, n))
        self.out, self.ids = self.buf((40, t * td), BF16), self.buf((40, t), np.uint32)

    def args(self):
        d = self.dims
        return dict(windows=self.windows.ptr, tables=self.entries.ptr, pows=self.pows.ptr, slots=0,
                    out=self.out.ptr, ids_out=self.ids.ptr, rows=40, num_tables=d.num_tables(),
                    max_ngram=d.max_ngram, splits=d.splits, table_dim=d.table_dim(), eos=d.eos_id, stream=0)

    def good(self, kernel):
        self.out.poison(), self.ids.poison()
        self.call(self.gpu, kernel)
        np.testing.assert_array_equal(self.ids.read(), self.tables.want_ids)
        np.testing.assert_array_equal(bits(self.out.read()), bits(self.tables.want_out))

    def close(self):
        super().close()
        self.tables.close()
