"""The bad-input matrix (README, "Bad input"): every public entry point against wrong dtype, shape,
length, range, null pointers, closed objects, ids >= vocab/rows and empty input.

Each case must raise a clear exception (its type, and key words of its message), write nothing
(device memory, pinned and host outputs, files and object state compared before and after; no
launch, no upload) and leave the entry point usable: a good call of it afterwards gives the right
answer. An "empty" case that is a no-op must return without writing anything either.

* CPU (CI): the layers, launchers and host entry points on ``MemGpu``, a host-memory backend that
  logs every write; ``CudaBackend``'s own checks on an *offline* ``CudaBackend`` whose driver calls
  all raise ``DriverReached``, so each refusal is shown to come before the driver.
* GPU: the same ``CudaBackend`` cases on the device (buffers of random bytes compared bit for bit)
  and one launcher per kernel module on guarded buffers, then a small round trip and a good launch
  of that launcher checked against numpy: the backend is still usable.

Known gaps are cases marked ``xfail(strict=True)``: the day one is fixed, the marker must go.
The README table is generated from the case tables: ``python -m tests.test_bad_inputs``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cuda.bindings import driver as cu

import gpu_runtime.gpu as gpu_module
import gpu_runtime.staging as staging_module
from gpu_runtime import (CudaBackend, CudaError, DeviceArray, DevicePtr, GpuError, KernelHandle,
                         KernelLaunch, KernelNotFoundError)
from layers import reference as ref
from layers.ngram_embed import (NgramDims, NgramEmbedding, NgramTable, RowCache, TableFile,
                                TableFormatError, TableWriter, ngram_ids, ngram_ids_tail, write_table)
from layers.ngram_embed.checkpoint import CheckpointError
from layers.ngram_embed.decoder import NgramDecoder
from layers.ngram_embed.fused import FusedNgramEmbedding
from layers.ops import embed, gemm, ngram_fused, residual, row_cache, token_overlay
from layers.ops.token_overlay import OverlayKernels
from layers.overlay import (AdapterOverlay, OverlaySlots, TableOverlay, build_overlay,
                            overlay_from_trainable_tokens)
from layers.peft_adapter import PeftAdapterError, overlay_from_peft
from layers.weight_map import BF16, FP8, DenseWeight
from tests.fakes import MemoryBackend
from tests.helpers import Guarded, bits, random_bf16, random_fp8
from tests.helpers.checkpoint import PROJ, TABLE, make_model, rewrite_tensor, tiny_config, write_model
from tests.helpers.ngram import device_layer, random_layer, small_dims
from tests.helpers.ngram_gather import context, make_tables, pows_for, windows_for
from tests.helpers.overlay import check_slot_contents, emulate_rowdiff, random_overlay
from tests.helpers.peft import EMBED as PEFT_EMBED
from tests.helpers.peft import save_adapter, token_rows, tt_config
from tests.helpers.row_cache import assert_resident, emulate_scatter

README = Path(__file__).resolve().parent.parent / "README.md"

# Matrix rows (test-id prefix, README label) and columns (test-id part, README header).
ROWS = [
    ("CudaBackend.alloc", "`CudaBackend.alloc` / `free`"),
    ("CudaBackend.memset", "`CudaBackend.memset`"),
    ("CudaBackend.copy", "`CudaBackend.copy_h2d_async` / `copy_d2h`"),
    ("CudaBackend.copy_d2d", "`CudaBackend.copy_d2d_async` / `copy_2d_async`"),
    ("CudaBackend.pinned", "`CudaBackend.alloc_host` / `free_host` / `upload_pinned_async`"),
    ("CudaBackend.handles", "`CudaBackend` streams, events, graphs"),
    ("CudaBackend.kernel", "`CudaBackend.kernel`"),
    ("KernelLaunch", "`KernelLaunch`"),
    ("batched_embed", "`batched_embed`"),
    ("batched_embed_fp8", "`batched_embed_fp8`"),
    ("embed_from_argmax", "`embed_from_argmax`"),
    ("scaled_add", "`scaled_add`"),
    ("residual_add", "`residual_add`"),
    ("dense_gemm_bf16_pipelined", "`dense_gemm_bf16_pipelined`"),
    ("dense_gemm_bf16_word", "`dense_gemm_bf16_word`"),
    ("embed_rowdiff", "`embed_rowdiff`"),
    ("embed_overlay_routed", "`embed_overlay_routed`"),
    ("lmhead_overlay_routed", "`lmhead_overlay_routed`"),
    ("scatter_rows", "`scatter_rows`"),
    ("ngram_gather", "`ngram_gather`"),
    ("NgramDims", "`NgramDims`"),
    ("ngram_ids", "`ngram_ids` / `ngram_ids_tail`"),
    ("NgramEmbedding", "`NgramEmbedding(...)` / `from_numpy`"),
    ("NgramEmbedding.embed", "`NgramEmbedding.embed`"),
    ("FusedNgramEmbedding", "`FusedNgramEmbedding(...)`"),
    ("FusedNgramEmbedding.embed", "`FusedNgramEmbedding.embed` / `embed_batch`"),
    ("NgramDecoder", "`NgramDecoder(...)`"),
    ("NgramDecoder.calls", "`NgramDecoder.prefill` / `step` / `rollback` / `reset`"),
    ("from_pretrained", "`NgramEmbedding.from_pretrained` (and the fused / decoder twins)"),
    ("overlay_from_peft", "`overlay_from_peft`"),
    ("RowCache", "`RowCache(...)`"),
    ("RowCache.resolve", "`RowCache.resolve` / `prefetch`"),
    ("TableFile", "`TableFile(...)` / `read_rows`"),
    ("TableWriter", "`TableWriter(...)` / `append`"),
    ("build_overlay", "`build_overlay`"),
    ("overlay_from_trainable_tokens", "`overlay_from_trainable_tokens`"),
    ("OverlaySlots", "`OverlaySlots(...)` / `load` / `replace` / `evict`"),
    ("OverlaySlots.hooks", "`OverlaySlots.embed_overlay` / `lmhead_overlay`"),
]
COLUMNS = [
    ("dtype", "wrong dtype"),
    ("shape", "wrong shape"),
    ("length", "wrong length/count"),
    ("range", "out of range"),
    ("null", "null pointer"),
    ("closed", "closed object"),
    ("id", "id >= vocab/rows"),
    ("empty", "empty input"),
]
ROW_KEYS = [key for key, _ in ROWS]
COLUMN_KEYS = [key for key, _ in COLUMNS]


def _param(row: str, column: str, detail: str, values: tuple, xfail: str | None) -> Any:
    assert row in ROW_KEYS and column in COLUMN_KEYS, (row, column)
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(*values, id=f"{row}-{column}" + (f"-{detail}" if detail else ""), marks=marks)


# ==== CPU: a host-memory backend for every kernel module ========================================

class MemGpu(MemoryBackend):
    """``MemoryBackend`` that hands out a handle for any kernel (names are unique across our
    modules), emulates ``scatter_rows`` and ``embed_rowdiff_bf16``, copies 2-D, and logs every
    call that allocates, frees or writes, so a refusal can be shown to have done none of them."""

    def __init__(self) -> None:
        super().__init__(module="*", names=[],
                         emulate={"scatter_rows": emulate_scatter, "embed_rowdiff_bf16": emulate_rowdiff})
        self.log: list[tuple[str, int]] = []

    def kernel(self, module: str, name: str) -> KernelHandle:
        if name not in self.handles:
            handle = KernelHandle(0x100 + len(self.handles) + 1)
            self.handles[name] = handle
            self.names[int(handle)] = name
        return self.handles[name]

    def alloc(self, nbytes: int) -> DevicePtr:
        ptr = super().alloc(nbytes)
        self.log.append(("alloc", int(ptr)))
        return ptr

    def free(self, ptr: int) -> None:
        self.log.append(("free", int(ptr)))
        super().free(ptr)

    def memset(self, ptr, byte, nbytes, stream=0) -> None:
        self.log.append(("memset", int(ptr)))
        super().memset(ptr, byte, nbytes, stream)

    def copy_h2d_async(self, host, dst, stream=0) -> None:
        self.log.append(("h2d", int(dst)))
        super().copy_h2d_async(host, dst, stream)

    def upload_pinned_async(self, host, dst, stream=0) -> None:
        self.log.append(("pinned", int(dst)))
        super().upload_pinned_async(host, dst, stream)

    def copy_2d_async(self, dst, dst_pitch, src, src_pitch, width, height, stream=0) -> None:
        self.log.append(("copy2d", int(dst)))
        for r in range(height):
            row = self.read(src + r * src_pitch, width)
            buf, off = self._find(dst + r * dst_pitch, width)
            buf[off:off + width] = row

    def launch(self, kernel, grid, block, shared_mem, stream, kinds, args, *, overlap=False) -> None:
        self.log.append(("launch", int(kernel)))
        super().launch(kernel, grid, block, shared_mem, stream, kinds, args)

    def launched(self) -> list[str]:
        return [launch["name"] for launch in self.launches]


# ==== the offline CudaBackend: real checks, no driver ============================================

class DriverReached(AssertionError):
    """Raised by every driver call of the offline backend: a refusal must come before it."""


class _OfflineDriver:
    """Stands in for ``cuda.bindings.driver`` in gpu.py: enums and structs are the real ones, every
    ``cu*`` function raises ``DriverReached``."""

    def __getattr__(self, name: str) -> Any:
        real = getattr(cu, name)
        if name.startswith("cu") and callable(real):
            def reached(*args: Any, **kwargs: Any) -> None:
                raise DriverReached(name)
            return reached
        return real


def _reached(fn: Any, *args: Any, detail: str = "") -> None:
    raise DriverReached(getattr(fn, "__name__", repr(fn)))


@dataclass
class Target:
    """What the ``CudaBackend`` cases act on: ``ptr`` is 4096 bytes 256 bytes into an allocation,
    ``pinned`` a whole ``alloc_host`` buffer, ``host`` a random host array used as a download
    target, ``closed`` a closed backend."""

    ptr: DevicePtr
    pinned: np.ndarray
    host: np.ndarray
    stream: int
    event: int
    closed: CudaBackend


def offline_backends(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
                     ) -> tuple[CudaBackend, Target]:
    """A ``CudaBackend`` built by its own ``__init__`` with the driver answering from Python
    (fake addresses; real host memory for pinned buffers), a ``Target`` on it and a closed twin;
    then every driver call is made to raise ``DriverReached``."""
    keep: list[Any] = []
    next_handle = [0x7F00_0000_0000]

    def permissive(fn: Any, *args: Any, detail: str = "") -> Any:
        name = getattr(fn, "__name__", "")
        if name == "cuDeviceGetName":
            return b"offline\0"
        if name in ("cuMemAlloc", "cuStreamCreate", "cuEventCreate"):
            next_handle[0] += 1 << 20
            return next_handle[0]
        if name == "cuMemHostAlloc":
            buf = ctypes.create_string_buffer(int(args[0]))
            keep.append(buf)
            return ctypes.addressof(buf)
        return 0

    monkeypatch.setattr(gpu_module, "call", permissive)
    monkeypatch.setattr(gpu_module.driver, "init", lambda: None)
    monkeypatch.setattr(gpu_module.driver, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_module.driver, "compute_capability", lambda device: (9, 0))
    backend, closed = CudaBackend(), CudaBackend()
    closed.close()
    base = backend.alloc(8192)
    pinned = backend.alloc_host(4096)
    pinned[:] = rng.integers(0, 256, 4096, dtype=np.uint8)
    target = Target(base.offset(256), pinned, rng.integers(0, 256, 64, dtype=np.uint8),
                    backend.create_stream(), backend.create_event(), closed)
    monkeypatch.setattr(gpu_module, "call", _reached)
    monkeypatch.setattr(staging_module, "call", _reached)
    monkeypatch.setattr(gpu_module, "cu", _OfflineDriver())
    backend._keep = keep  # the pinned buffers' memory lives as long as the backend
    return backend, target


# ==== the CPU world: every subject, built before the snapshot ===================================

LAUNCH_KERNEL = {
    "batched_embed": "batched_embed", "batched_embed_fp8": "batched_embed_fp8",
    "embed_from_argmax": "embed_from_argmax_bf16", "scaled_add": "bf16_scaled_add",
    "residual_add": "bf16_residual_add", "dense_gemm_bf16_pipelined": "dense_gemm_bf16_pipelined",
    "dense_gemm_bf16_word": "dense_gemm_bf16_word", "embed_rowdiff": "embed_rowdiff_bf16",
    "embed_overlay_routed": "embed_overlay_routed_bf16",
    "lmhead_overlay_routed": "lmhead_overlay_routed_bf16", "scatter_rows": "scatter_rows",
    "ngram_gather": "ngram_gather",
}
LAUNCH_FN = {
    "batched_embed": embed.batched_embed, "batched_embed_fp8": embed.batched_embed_fp8,
    "embed_from_argmax": embed.embed_from_argmax, "scaled_add": residual.scaled_add,
    "residual_add": residual.residual_add, "dense_gemm_bf16_pipelined": gemm.dense_gemm_bf16_pipelined,
    "dense_gemm_bf16_word": gemm.dense_gemm_bf16_word, "embed_rowdiff": token_overlay.embed_rowdiff,
    "embed_overlay_routed": token_overlay.embed_overlay_routed,
    "lmhead_overlay_routed": token_overlay.lmhead_overlay_routed,
    "scatter_rows": row_cache.scatter_rows, "ngram_gather": ngram_fused.ngram_gather,
}


def _launch_args(w: "World", name: str) -> dict[str, Any]:
    """Good arguments of each launcher (pointers to random device buffers of 8 KiB)."""
    p = w.p
    return {
        "batched_embed": dict(ids=p[0], table=p[1], out=p[2], n=5, dim=7, stream=0),
        "batched_embed_fp8": dict(ids=p[0], table=p[1], row_scale=p[3], out=p[2], n=5, dim=7, stream=0),
        "embed_from_argmax": dict(logits=p[0], vocab=11, table=p[1], out=p[2], ids_out=p[3], m=5,
                                  dim=7, stream=0),
        "scaled_add": dict(out=p[0], x=p[1], scale=0.25, n=9, stream=0),
        "residual_add": dict(out=p[0], x=p[1], n=9, stream=0),
        "dense_gemm_bf16_pipelined": dict(a=p[0], w=DenseWeight(p[1], (6, 8), BF16), c=p[2], m=5,
                                          n=6, k=8, stream=0),
        "dense_gemm_bf16_word": dict(a=p[0], w=DenseWeight(p[1], (6, 8), BF16), c=p[2], m=5, n=6,
                                     k=8, word_ids=p[3], word=p[4], scale=0.25, stream=0),
        "embed_rowdiff": dict(base=p[0], served=p[1], flags=p[2], rows=50, h=7, thresh=0.5, stream=0),
        "embed_overlay_routed": dict(ids=p[0], seq_slot=p[1], active=1, slot_map_tab=p[2],
                                     rows_tab=p[3], n_tab=p[4], out=p[5], num_tokens=5, h=7,
                                     vocab=11, stream=0),
        "lmhead_overlay_routed": dict(hidden=p[0], seq_slot=p[1], active=1, rows_tab=p[2],
                                      ids_tab=p[3], n_tab=p[4], logits=p[5], m=5, max_n_override=4,
                                      h=7, vocab=11, stream=0),
        "scatter_rows": dict(slots=p[0], rows=p[1], scales=0, arena=p[2], arena_scales=0, n=5,
                             row_bytes=16, stream=0),
        "ngram_gather": dict(windows=p[0], tables=p[1], pows=p[2], slots=0, out=p[3], ids_out=0,
                             rows=5, num_tables=4, max_ngram=3, splits=2, table_dim=7, eos=11,
                             stream=0),
    }[name]


def launch(world: "World", launcher: str, /, **over: Any) -> None:
    """``launcher`` with its good arguments, ``over`` replacing some (``gpu``, ``kernel``
    included; a callable value is called with the world)."""
    over = {k: v(world) if callable(v) else v for k, v in over.items()}
    gpu = over.pop("gpu", world.gpu)
    kernel = over.pop("kernel", world.gpu.kernel("*", LAUNCH_KERNEL[launcher]))
    LAUNCH_FN[launcher](gpu, kernel, **{**_launch_args(world, launcher), **over})


class World:
    """Every subject of the CPU cases on one ``MemGpu``: device buffers of random bytes, an n-gram
    layer and its fused twin, a disk table, its ``RowCache``, ``TableFile`` and a ``TableWriter``,
    overlay slots; each also closed. Rarer subjects are built on demand (``needs``)."""

    def __init__(self, rng: np.random.Generator, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rng, self.tmp = rng, tmp
        gpu = self.gpu = MemGpu()
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
        tensors = tensors or {f"{PEFT_EMBED}.trainable_tokens_delta": token_rows(self.rng, len(ids))}
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


@pytest.fixture
def world(rng, tmp_path, monkeypatch):
    w = World(rng, tmp_path, monkeypatch)
    yield w
    w.close()


# ==== the CPU case table ========================================================================

def case(row: str, column: str, fn: Callable[[World], Any], exc: type[BaseException] | None = None,
         match: str | None = None, *, detail: str = "", temp: bool = False, needs: tuple[str, ...] = (),
         after: Callable[[World], None] | None = None, xfail: str | None = None) -> Any:
    """One refusal (``exc`` and ``match``) or no-op (``exc=None``). ``temp``: the call may upload to
    temporaries it frees before raising (only the memory that existed before is compared, and
    nothing may leak); ``needs``: world subjects to build before the snapshot; ``after``: the good
    call to make afterwards, instead of the row's."""
    return _param(row, column, detail, (row, fn, exc, match, temp, needs, after), xfail)


def L(name: str, column: str, exc: type[BaseException] | None, match: str | None = None,
      detail: str = "", xfail: str | None = None, **over: Any) -> Any:
    """A launcher case: its good arguments with ``over`` replacing some."""
    return case(name, column, lambda w: launch(w, name, **over), exc, match, detail=detail, xfail=xfail)


def closed_gpu(w: World) -> CudaBackend:
    return w.target.closed


NULL = "null device pointer"
COUNT = r"must be in 0\.\.2\*\*32-1"
CLOSED = dict(gpu=closed_gpu, kernel=KernelHandle(0x1234))


def _kl(w: World, name: str = "bf16_scaled_add") -> KernelLaunch:
    return KernelLaunch(w.gpu, w.gpu.kernel("residual_add", name))


def _overlay(w: World, ids: list[int], h: int = 5) -> AdapterOverlay:
    return AdapterOverlay(TableOverlay.of(ids, random_bf16(w.rng, (len(ids), h))))


CPU_CASES = [
    # -- KernelLaunch (the backend's own checks are in CUDA_CASES) --
    case("KernelLaunch", "dtype", lambda w: _kl(w).arg_u32(1.0), TypeError, "must be an int"),
    case("KernelLaunch", "shape", lambda w: _kl(w).grid([1, 1]), ValueError, "3 dimensions"),
    case("KernelLaunch", "length", lambda w: _kl(w).block([32, 32, 2]), ValueError, "more than 1024 threads"),
    case("KernelLaunch", "range", lambda w: _kl(w).arg_u32(2**32), ValueError, "does not fit u32"),
    case("KernelLaunch", "range", lambda w: _kl(w).arg_f32(1e39), ValueError, "overflows f32", detail="f32"),
    case("KernelLaunch", "null", lambda w: KernelLaunch(w.gpu, KernelHandle(0)), ValueError, "null kernel handle"),
    # -- launchers: the kernels cannot see table sizes, so ids are the layers' to check --
    L("batched_embed", "dtype", TypeError, "must be an int", n=1.5),
    L("batched_embed", "length", ValueError, COUNT, n=2**32),
    L("batched_embed", "range", ValueError, COUNT, dim=-1),
    L("batched_embed", "null", ValueError, NULL, table=0),
    L("batched_embed", "null", ValueError, "null kernel handle", detail="kernel", kernel=KernelHandle(0)),
    L("batched_embed", "closed", GpuError, "closed", **CLOSED),
    L("batched_embed", "empty", None, n=0),
    L("batched_embed_fp8", "dtype", TypeError, "must be an int", dim="7"),
    L("batched_embed_fp8", "length", ValueError, COUNT, n=2**32),
    L("batched_embed_fp8", "range", ValueError, COUNT, dim=-1),
    L("batched_embed_fp8", "null", ValueError, NULL, row_scale=0),
    L("batched_embed_fp8", "closed", GpuError, "closed", **CLOSED),
    L("batched_embed_fp8", "empty", None, dim=0),
    L("embed_from_argmax", "dtype", TypeError, "must be an int", m=True),
    L("embed_from_argmax", "length", ValueError, COUNT, dim=2**32),
    L("embed_from_argmax", "range", ValueError, "vocab must be >= 1", vocab=0),
    L("embed_from_argmax", "null", ValueError, NULL, ids_out=0),
    L("embed_from_argmax", "closed", GpuError, "closed", **CLOSED),
    L("embed_from_argmax", "empty", None, m=0),
    L("scaled_add", "dtype", TypeError, "real number", scale="x"),
    L("scaled_add", "length", ValueError, COUNT, n=2**32),
    L("scaled_add", "range", ValueError, "fit an f32", scale=1e39),
    L("scaled_add", "range", ValueError, "finite", detail="nan", scale=float("nan")),
    L("scaled_add", "null", ValueError, NULL, x=0),
    L("scaled_add", "closed", GpuError, "closed", **CLOSED),
    L("scaled_add", "empty", None, n=0),
    L("residual_add", "dtype", TypeError, "must be an int", n=2.0),
    L("residual_add", "length", ValueError, COUNT, n=2**32),
    L("residual_add", "range", ValueError, COUNT, n=-1),
    L("residual_add", "null", ValueError, NULL, out=0),
    L("residual_add", "closed", GpuError, "closed", **CLOSED),
    L("residual_add", "empty", None, n=0),
    L("dense_gemm_bf16_pipelined", "dtype", TypeError, "expected bfloat16",
      w=lambda w: DenseWeight(w.p[1], (6, 8), FP8)),
    L("dense_gemm_bf16_pipelined", "dtype", TypeError, "must be a DenseWeight", detail="host-array",
      w=np.zeros((6, 8), BF16)),
    L("dense_gemm_bf16_pipelined", "shape", ValueError, "w shape", w=lambda w: DenseWeight(w.p[1], (6, 9), BF16)),
    L("dense_gemm_bf16_pipelined", "length", ValueError, "exceeds", m=2**31),
    L("dense_gemm_bf16_pipelined", "range", ValueError, "unknown GEMM path", path="bogus"),
    L("dense_gemm_bf16_pipelined", "null", ValueError, NULL, c=0),
    L("dense_gemm_bf16_pipelined", "null", ValueError, "kernel not loaded", detail="kernel",
      kernel=KernelHandle(0)),
    L("dense_gemm_bf16_pipelined", "closed", GpuError, "closed", **CLOSED),
    L("dense_gemm_bf16_pipelined", "empty", None, m=0),
    L("dense_gemm_bf16_word", "dtype", TypeError, "real number", scale="x"),
    L("dense_gemm_bf16_word", "length", ValueError, "cannot be forced", m=65, path="small"),
    L("dense_gemm_bf16_word", "range", ValueError, "finite", scale=float("inf")),
    L("dense_gemm_bf16_word", "null", ValueError, NULL, word_ids=0),
    L("dense_gemm_bf16_word", "closed", GpuError, "closed", **CLOSED),
    L("dense_gemm_bf16_word", "empty", None, m=0),
    L("embed_rowdiff", "dtype", TypeError, "real number", thresh="x"),
    L("embed_rowdiff", "length", ValueError, ">= 1", h=0),
    L("embed_rowdiff", "range", ValueError, "NaN", thresh=float("nan")),
    L("embed_rowdiff", "null", ValueError, NULL, flags=0),
    L("embed_rowdiff", "null", ValueError, "kernel not loaded", detail="kernel", kernel=KernelHandle(0)),
    L("embed_rowdiff", "closed", GpuError, "closed", **CLOSED),
    L("embed_rowdiff", "empty", None, rows=0),
    L("embed_overlay_routed", "dtype", TypeError, "must be an int", active=1.5),
    L("embed_overlay_routed", "length", ValueError, ">= 1", vocab=0),
    L("embed_overlay_routed", "range", ValueError, "fit i32", active=2**31),
    L("embed_overlay_routed", "null", ValueError, NULL, out=0),
    L("embed_overlay_routed", "null", None, detail="kernel", kernel=KernelHandle(0)),  # a hook: no-op
    L("embed_overlay_routed", "closed", GpuError, "closed", **CLOSED),
    L("embed_overlay_routed", "empty", None, num_tokens=0),
    L("lmhead_overlay_routed", "dtype", TypeError, "must be an int", m="3"),
    L("lmhead_overlay_routed", "length", ValueError, "grid y", max_n_override=65536),
    L("lmhead_overlay_routed", "range", ValueError, ">= 1", h=0),
    L("lmhead_overlay_routed", "null", ValueError, NULL, logits=0),
    L("lmhead_overlay_routed", "closed", GpuError, "closed", **CLOSED),
    L("lmhead_overlay_routed", "empty", None, max_n_override=0),
    L("scatter_rows", "dtype", TypeError, "must be an int", n=1.5),
    L("scatter_rows", "length", ValueError, COUNT, n=2**32),
    L("scatter_rows", "range", ValueError, COUNT, row_bytes=-1),
    L("scatter_rows", "null", ValueError, NULL, arena=0),
    L("scatter_rows", "null", ValueError, "both be given", detail="scales", scales=lambda w: w.p[3]),
    L("scatter_rows", "closed", GpuError, "closed", **CLOSED),
    L("scatter_rows", "empty", None, n=0),
    L("ngram_gather", "dtype", TypeError, "must be an int", rows=2.0),
    L("ngram_gather", "length", ValueError, "num_tables 5 != splits", num_tables=5),
    L("ngram_gather", "range", ValueError, "reserved", eos=0xFFFFFFFF),
    L("ngram_gather", "range", ValueError, "max_ngram must be >= 2", detail="max_ngram", max_ngram=1,
      num_tables=0),
    L("ngram_gather", "null", ValueError, NULL, windows=0),
    L("ngram_gather", "closed", GpuError, "closed", **CLOSED),
    L("ngram_gather", "empty", None, rows=0),
    # -- NgramDims --
    case("NgramDims", "dtype", lambda w: NgramDims(1.5, 40, 3, 2, 61), TypeError, "vocab_size must be an int"),
    case("NgramDims", "shape", lambda w: NgramDims(500, 3, 3, 2, 61), ValueError, "too small"),
    case("NgramDims", "length", lambda w: NgramDims(500, 40, 3, 0, 61), ValueError, "splits K must be >= 1"),
    case("NgramDims", "range", lambda w: NgramDims(500, 40, 3, 2, 61, row_bias=2), ValueError, "row_bias"),
    case("NgramDims", "range", lambda w: w.dims.table_index(4, 0), IndexError, "order n=4", detail="table_index"),
    case("NgramDims", "id", lambda w: NgramDims(500, 40, 3, 2, 61, eos_id=500), ValueError, "eos_id must be in"),
    case("NgramDims", "empty", lambda w: NgramDims(0, 40, 3, 2, 61), ValueError, "vocab_size V must be >= 1"),
    # -- ngram_ids / ngram_ids_tail --
    case("ngram_ids", "dtype", lambda w: ngram_ids(w.dims, np.array([1.0, 2.0])), ValueError, "integers"),
    case("ngram_ids", "dtype", lambda w: ngram_ids_tail(w.dims, [1, 2, 3], 1.0), ValueError,
         "seq_len must be an int", detail="seq_len"),
    case("ngram_ids", "shape", lambda w: ngram_ids(w.dims, np.ones((2, 2), np.int64)), ValueError, "1-D"),
    case("ngram_ids", "length", lambda w: ngram_ids_tail(w.dims, [1, 2, 3], 4), ValueError, "seq_len must be in"),
    case("ngram_ids", "range", lambda w: ngram_ids(w.dims, [1, -1, 3]), ValueError, "token -1 at position 1"),
    case("ngram_ids", "id", lambda w: ngram_ids_tail(w.dims, [1, 2, 500], 1), ValueError,
         "token 500 at position 2"),
    case("ngram_ids", "empty", lambda w: _expect(all(a.shape == (0,) for a in ngram_ids(w.dims, [])))),
    # -- NgramEmbedding(...) and from_numpy --
    case("NgramEmbedding", "dtype", lambda w: NgramEmbedding(
        w.dims, w.layer.word, [NgramTable.Bf16(DenseWeight(w.p[0], t.shape, FP8)) for t in w.layer.tables],
        w.layer.projs, 8, w.gpu), TypeError, "NgramTable.Bf16 holds float8"),
    case("NgramEmbedding", "dtype", lambda w: NgramEmbedding.from_numpy(
        w.dims, w.host_layer.word.astype(np.float32), [t for t, _ in w.host_layer.tables],
        w.host_layer.projs, 8, w.gpu), TypeError, "weight dtype", detail="from_numpy"),
    case("NgramEmbedding", "dtype", lambda w: NgramEmbedding(
        w.dims, w.host_layer.word, w.layer.tables, w.layer.projs, 8, w.gpu).embed([1, 2, 3], 2, w.out, w.gpu),
        TypeError, "DenseWeight", detail="host-array"),
    case("NgramEmbedding", "shape", lambda w: NgramEmbedding(
        w.dims, DenseWeight(w.p[0], (501, 40), BF16), w.layer.tables, w.layer.projs, 8, w.gpu),
        ValueError, "word embedding must be"),
    case("NgramEmbedding", "shape", lambda w: NgramEmbedding.from_numpy(
        w.dims, w.host_layer.word, [t if s is None else (t, s) for t, s in w.host_layer.tables],
        [p[0] for p in w.host_layer.projs], 8, w.gpu), ValueError, "non-empty 2-D",
        detail="from_numpy", temp=True),
    case("NgramEmbedding", "length", lambda w: NgramEmbedding(
        w.dims, w.layer.word, w.layer.tables[:-1], w.layer.projs, 8, w.gpu), ValueError, "table count"),
    case("NgramEmbedding", "length", lambda w: NgramEmbedding.from_numpy(
        w.dims, w.host_layer.word, [t if s is None else (t, s) for t, s in w.host_layer.tables],
        w.host_layer.projs[:-1], 8, w.gpu), ValueError, "proj count", detail="from_numpy", temp=True),
    case("NgramEmbedding", "range", lambda w: NgramEmbedding(
        w.dims, w.layer.word, w.layer.tables, w.layer.projs, 0, w.gpu), ValueError, "max_tokens"),
    case("NgramEmbedding", "null", lambda w: NgramEmbedding(
        w.dims, w.layer.word, [NgramTable.Fp8(DenseWeight(w.p[0], t.shape, FP8)) for t in w.layer.tables],
        w.layer.projs, 8, w.gpu), ValueError, "without row scales"),
    case("NgramEmbedding", "id", lambda w: NgramEmbedding(
        w.dims, w.layer.word, [NgramTable.Bf16(DenseWeight(w.p[0], (t.shape[0] - 1, t.shape[1]), BF16))
                               for t in w.layer.tables], w.layer.projs, 8, w.gpu),
        ValueError, "table 0: shape"),
    # -- NgramEmbedding.embed --
    case("NgramEmbedding.embed", "dtype", lambda w: w.layer.embed([1.5, 2, 3], 1, w.out, w.gpu),
         ValueError, "integers"),
    case("NgramEmbedding.embed", "shape", lambda w: w.layer.embed([[1, 2, 3]], 1, w.out, w.gpu),
         ValueError, "1-D"),
    case("NgramEmbedding.embed", "length", lambda w: w.layer.embed(list(range(20)), 9, w.out, w.gpu),
         ValueError, "over staging"),
    case("NgramEmbedding.embed", "length", lambda w: w.layer.embed([1, 2, 3], 4, w.out, w.gpu),
         ValueError, "over ctx", detail="context"),
    case("NgramEmbedding.embed", "length", lambda w: w.cached_layer.embed(np.arange(1, 7), 6, w.out, w.gpu),
         ValueError, "arena holds 3", detail="cached-capacity", needs=("cached_layer",)),
    case("NgramEmbedding.embed", "range", lambda w: w.layer.embed([1, 2, 3], -1, w.out, w.gpu),
         ValueError, "non-negative"),
    case("NgramEmbedding.embed", "null", lambda w: w.layer.embed([1, 2, 3], 2, 0, w.gpu), ValueError, NULL),
    case("NgramEmbedding.embed", "closed", lambda w: w.closed_layer.embed([1, 2, 3], 2, w.out, w.gpu),
         ValueError, "closed"),
    case("NgramEmbedding.embed", "closed", lambda w: w.layer_with_closed_cache.embed([1, 2, 3], 2, w.out, w.gpu),
         ValueError, "RowCache is closed", detail="cached-table", needs=("layer_with_closed_cache",)),
    case("NgramEmbedding.embed", "id", lambda w: w.layer.embed([1, 2, 500], 1, w.out, w.gpu),
         ValueError, "token 500"),
    case("NgramEmbedding.embed", "empty", lambda w: w.layer.embed([1, 2, 3], 0, w.out, w.gpu)),
    # -- NgramDecoder: construction, then the capturable calls (device values are the kernels') --
    case("NgramDecoder", "dtype", lambda w: NgramDecoder(w.layer, max_seqs=2.0, max_rows=8, gpu=w.gpu),
         ValueError, "max_seqs must be an int"),
    case("NgramDecoder", "range", lambda w: NgramDecoder(w.layer, max_seqs=4, max_rows=0, gpu=w.gpu),
         ValueError, "max_rows must be an int in 1"),
    case("NgramDecoder", "range", lambda w: NgramDecoder(w.cached_fused.layer, max_seqs=4, max_rows=8,
                                                        gpu=w.gpu),
         ValueError, "RowCache tables need host work", detail="cached", needs=("cached_fused",)),
    case("NgramDecoder.calls", "dtype", lambda w: w.decoder.step(w.p[0], 1.5, 2, w.out), TypeError,
         "slots: expected a device address"),
    case("NgramDecoder.calls", "dtype", lambda w: w.decoder.step(DeviceArray(w.gpu, w.p[0], (8,), np.int32),
                                                                 w.p[1], 2, w.out),
         ValueError, "dtype int32", detail="device-array"),
    case("NgramDecoder.calls", "length", lambda w: w.decoder.step(DeviceArray(w.gpu, w.p[0], (3,), np.uint32),
                                                                  w.p[1], 2, w.out, k=2),
         ValueError, "3 entries, the call needs 4"),
    case("NgramDecoder.calls", "range", lambda w: w.decoder.step(w.p[0], w.p[1], 5, w.out), ValueError,
         "over max_seqs 4"),
    case("NgramDecoder.calls", "range", lambda w: w.decoder.prefill(w.p[0], w.p[1], w.p[2], 2, 9, w.out),
         ValueError, "9 rows over max_rows 8", detail="rows"),
    case("NgramDecoder.calls", "range", lambda w: w.decoder.reset(4), ValueError, "slot 4 outside 0..3",
         detail="reset"),
    case("NgramDecoder.calls", "null", lambda w: w.decoder.prefill(w.p[0], 0, w.p[2], 2, 5, w.out), ValueError,
         NULL),
    case("NgramDecoder.calls", "null", lambda w: w.decoder.rollback(w.p[0], 0, 2), ValueError, NULL,
         detail="rollback"),
    case("NgramDecoder.calls", "closed", lambda w: w.closed_decoder.step(w.p[0], w.p[1], 1, w.out), ValueError,
         "closed"),
    case("NgramDecoder.calls", "empty", lambda w: w.decoder.step(w.p[0], w.p[1], 0, w.out)),
    case("NgramDecoder.calls", "empty", lambda w: w.decoder.rollback(w.p[0], w.p[1], 0), detail="rollback"),
    # -- model folders and adapter folders (each case damages a fresh copy, then loads it) --
    case("from_pretrained", "dtype", lambda w: NgramEmbedding.from_pretrained(w.model(
        lambda m: rewrite_tensor(m, TABLE.format(0), m.tables[0][0].astype(np.float32))).path, w.gpu),
         CheckpointError, "is F32: tables are served as bf16 or fp8"),
    case("from_pretrained", "shape", lambda w: NgramEmbedding.from_pretrained(w.model(
        lambda m: rewrite_tensor(m, PROJ.format(0), np.ascontiguousarray(m.projs[0].T))).path, w.gpu),
         CheckpointError, r"post_projs.0.weight' has shape \[6, 24\]"),
    case("from_pretrained", "length", lambda w: NgramEmbedding.from_pretrained(w.model().path, w.gpu,
                                                                               placement=["device"] * 3),
         ValueError, "3 entries for 4 tables"),
    case("from_pretrained", "range", lambda w: NgramEmbedding.from_pretrained(w.model().path, w.gpu, eos_id=300),
         CheckpointError, "eos_id must be in 0..V-1"),
    case("from_pretrained", "range", lambda w: NgramEmbedding.from_pretrained(w.model().path, w.gpu, placement="gpu"),
         ValueError, "placement must be", detail="placement"),
    case("from_pretrained", "null", lambda w: NgramEmbedding.from_pretrained(w.model(
        lambda m: rewrite_tensor(m, TABLE.format(2), None)).path, w.gpu),
         CheckpointError, "no tensor 'model.ngram_embeddings.embedders.2.weight'"),
    case("from_pretrained", "empty", lambda w: NgramEmbedding.from_pretrained(w.model(
        lambda m: (m.path / "config.json").unlink()).path, w.gpu), CheckpointError, "no config.json"),
    case("overlay_from_peft", "dtype", lambda w: overlay_from_peft(w.adapter(
        {f"{PEFT_EMBED}.trainable_tokens_delta": np.ones((2, 16), np.int32)}), vocab=64),
         PeftAdapterError, "not a float type"),
    case("overlay_from_peft", "shape", lambda w: overlay_from_peft(w.adapter(
        {f"{PEFT_EMBED}.trainable_tokens_delta": token_rows(w.rng, 3)}), vocab=64),
         PeftAdapterError, r"expected \[2, h\]"),
    case("overlay_from_peft", "id", lambda w: overlay_from_peft(w.adapter(ids=[3, 64]), vocab=64),
         PeftAdapterError, "token id 64 .* outside"),
    case("overlay_from_peft", "empty", lambda w: overlay_from_peft(w.empty_dir("adapter"), vocab=64),
         FileNotFoundError, "adapter_config.json"),
    case("overlay_from_peft", "null", lambda w: overlay_from_peft(w.tmp / "no-adapter", vocab=64),
         FileNotFoundError, "does not exist"),
    # -- FusedNgramEmbedding --
    case("FusedNgramEmbedding", "dtype", lambda w: FusedNgramEmbedding(w.layer, 2.0, w.gpu), ValueError,
         "max_rows must be a positive int"),
    case("FusedNgramEmbedding", "range", lambda w: FusedNgramEmbedding(w.layer, 0, w.gpu), ValueError,
         "max_rows must be a positive int"),
    case("FusedNgramEmbedding", "range", lambda w: FusedNgramEmbedding(w.layer_huge_vocab, 8, w.gpu), ValueError,
         r"vocab_size 4294967296 must be < 2\*\*32 - 1", detail="vocab", needs=("layer_huge_vocab",)),
    case("FusedNgramEmbedding.embed", "dtype", lambda w: w.fused.embed([1.5, 2.5], 1, w.out, w.gpu),
         ValueError, "integer token ids"),
    case("FusedNgramEmbedding.embed", "shape", lambda w: w.fused.embed([[1, 2]], 1, w.out, w.gpu),
         ValueError, "1-D"),
    case("FusedNgramEmbedding.embed", "length", lambda w: w.fused.embed_batch([[1, 2]], [1, 1], w.out, w.gpu),
         ValueError, "1 contexts, 2 seq_lens"),
    case("FusedNgramEmbedding.embed", "length", lambda w: w.fused.embed(list(range(20)), 9, w.out, w.gpu),
         ValueError, "over max_rows 8", detail="max_rows"),
    case("FusedNgramEmbedding.embed", "length",
         lambda w: w.cached_fused.embed(np.arange(1, 7), 6, w.out, w.gpu), ValueError, "arena holds 3",
         detail="cached-capacity", needs=("cached_fused",),
         after=lambda w: w.cached_fused.embed(np.arange(20, 23), 3, w.out, w.gpu)),
    case("FusedNgramEmbedding.embed", "range", lambda w: w.fused.embed([1, 2, 3], -1, w.out, w.gpu),
         ValueError, "non-negative"),
    case("FusedNgramEmbedding.embed", "null", lambda w: w.fused.embed([1, 2, 3], 1, 0, w.gpu), ValueError, NULL),
    case("FusedNgramEmbedding.embed", "null", lambda w: w.fused.embed([1, 2, 3], 1, w.out, w.gpu, 0, graph=True),
         ValueError, "created stream", detail="stream"),
    case("FusedNgramEmbedding.embed", "closed", lambda w: w.closed_fused.embed([1, 2, 3], 1, w.out, w.gpu),
         ValueError, "closed"),
    case("FusedNgramEmbedding.embed", "closed",
         lambda w: w.fused_over_closed_layer.embed([1, 2, 3], 2, w.out, w.gpu), ValueError, "closed",
         detail="layer-closed", needs=("fused_over_closed_layer",)),
    case("FusedNgramEmbedding.embed", "id", lambda w: w.fused.embed([1, 2, 500], 1, w.out, w.gpu),
         ValueError, "token 500 outside"),
    case("FusedNgramEmbedding.embed", "empty", lambda w: w.fused.embed_batch([[1, 2], []], [0, 0], w.out, w.gpu)),
    # -- RowCache --
    case("RowCache", "dtype", lambda w: RowCache(w.gpu, w.table_path, 2.0), ValueError, "capacity"),
    case("RowCache", "length", lambda w: RowCache(w.gpu, w.bad_path, 10), TableFormatError, "bytes"),
    case("RowCache", "range", lambda w: RowCache(w.gpu, w.table_path, 0), ValueError, "capacity"),
    case("RowCache", "empty", lambda w: RowCache(w.gpu, w.empty_path, 10), TableFormatError, "shorter than"),
    case("RowCache.resolve", "dtype", lambda w: w.cache.resolve(np.array([1.0, 2.0, 3.0]), w.slots_out),
         ValueError, "1-D integer"),
    case("RowCache.resolve", "dtype", lambda w: w.cache.resolve(np.array([1, 2, 3]), w.slots_out.view(np.int32)),
         ValueError, "slots_out", detail="slots_out"),
    case("RowCache.resolve", "shape", lambda w: w.cache.resolve(np.ones((3, 1), np.int64), w.slots_out),
         ValueError, "1-D integer"),
    case("RowCache.resolve", "length", lambda w: w.cache.resolve(np.array([1, 2]), w.slots_out),
         ValueError, "slots_out"),
    case("RowCache.resolve", "length", lambda w: w.cache.resolve(np.arange(11), np.empty(11, np.uint32)),
         ValueError, "arena holds 10", detail="capacity"),
    case("RowCache.resolve", "range", lambda w: w.cache.resolve(np.array([3, -1, 4]), w.slots_out),
         ValueError, "id -1 out of range"),
    case("RowCache.resolve", "closed", lambda w: w.closed_cache.resolve(np.array([1, 2, 3]), w.slots_out),
         ValueError, "closed"),
    case("RowCache.resolve", "id", lambda w: w.cache.resolve(np.array([3, 100, 4]), w.slots_out),
         ValueError, "id 100 out of range for a table of 100 rows"),
    case("RowCache.resolve", "id", lambda w: w.cache.prefetch(np.array([100])), ValueError,
         "id 100 out of range", detail="prefetch"),
    case("RowCache.resolve", "empty", lambda w: w.cache.resolve(np.zeros(0, np.int64), np.empty(0, np.uint32))),
    # -- TableFile / TableWriter --
    case("TableFile", "dtype",
         lambda w: w.file.read_rows(np.array([1, 2]), w.rows_out.view(np.int8), w.scales_out),
         ValueError, "out must be C-contiguous uint8"),
    case("TableFile", "shape", lambda w: w.file.read_rows(np.array([1]), w.rows_out, w.scales_out[:1]),
         ValueError, "out must be"),
    case("TableFile", "length", lambda w: w.file.read_rows(np.array([1, 2]), w.rows_out, w.scales_out[:1]),
         ValueError, "scales_out must be"),
    case("TableFile", "length", lambda w: TableFile(w.bad_path), TableFormatError, "header says", detail="file"),
    case("TableFile", "range", lambda w: w.file.read_rows(np.array([1, -1]), w.rows_out, w.scales_out),
         IndexError, r"span \[-1, 1\]"),
    case("TableFile", "null", lambda w: w.file.read_rows(np.array([1, 2]), w.rows_out, None),
         ValueError, "need their scales"),
    case("TableFile", "closed", lambda w: w.closed_file.read_rows(np.array([1, 2]), w.rows_out, w.scales_out),
         ValueError, "closed"),
    case("TableFile", "id", lambda w: w.file.read_rows(np.array([1, 100]), w.rows_out, w.scales_out),
         IndexError, "table has 100 rows"),
    case("TableFile", "empty", lambda w: w.file.read_rows(np.zeros(0, np.int64), np.empty((0, 8), np.uint8),
                                                        np.empty(0, np.float32))),
    case("TableFile", "empty", lambda w: TableFile(w.empty_path), TableFormatError, "shorter than", detail="file"),
    case("TableWriter", "dtype", lambda w: w.writer.append(w.writer_rows[2:].astype(np.float32)),
         TypeError, "rows are float32"),
    case("TableWriter", "dtype", lambda w: TableWriter(w.tmp / "f.ngt", np.float32, 4, 3), TypeError,
         "table dtype", detail="new"),
    case("TableWriter", "shape", lambda w: w.writer.append(random_bf16(w.rng, (2, 4))), ValueError,
         r"rows must be \[n, 3\]"),
    case("TableWriter", "length", lambda w: w.writer.append(random_bf16(w.rng, (3, 3))), ValueError, "overruns"),
    case("TableWriter", "range", lambda w: TableWriter(w.tmp / "r.ngt", BF16, 4, -1), ValueError,
         "dim must be an int >= 1"),
    case("TableWriter", "null", lambda w: w.writer.append(w.writer_rows[2:], np.ones(2, np.float32)),
         ValueError, "only for fp8"),
    case("TableWriter", "closed", lambda w: w.closed_writer.append(w.writer_rows[2:]), ValueError, "closed"),
    case("TableWriter", "empty", lambda w: w.writer.append(np.zeros((0, 3), BF16))),
    case("TableWriter", "empty", lambda w: TableWriter(w.tmp / "z.ngt", BF16, 0, 3), ValueError,
         "rows must be an int >= 1", detail="new"),
    # -- build_overlay --
    case("build_overlay", "dtype", lambda w: build_overlay(
        w.gpu, w.kernels, DenseWeight(w.p[0], (10, 4), FP8, w.p[1]), w.served_host), TypeError, "bfloat16"),
    case("build_overlay", "dtype", lambda w: build_overlay(
        w.gpu, w.kernels, w.served, np.ones((10, 4), np.int32)), TypeError, "bfloat16", detail="adapter"),
    case("build_overlay", "shape",
         lambda w: build_overlay(w.gpu, w.kernels, w.served, random_bf16(w.rng, (10, 5))),
         ValueError, "shape"),
    case("build_overlay", "length",
         lambda w: build_overlay(w.gpu, w.kernels, w.served, random_bf16(w.rng, (11, 4))),
         ValueError, "shape"),
    case("build_overlay", "range", lambda w: build_overlay(w.gpu, w.kernels, w.served, w.served_host,
                                                           thresh=float("nan")),
         ValueError, "NaN", temp=True),  # found in embed_rowdiff: after the adapter's upload to a temporary
    case("build_overlay", "null", lambda w: build_overlay(w.gpu, w.kernels, None, w.served_host),
         ValueError, "no served"),
    case("build_overlay", "null",
         lambda w: build_overlay(w.gpu, OverlayKernels.default(), w.served, w.served_host),
         KernelNotFoundError, "not loaded", detail="kernels"),
    case("build_overlay", "empty", lambda w: _expect(
        build_overlay(w.gpu, w.kernels, w.served, None) == AdapterOverlay(None, None))),
    # -- overlay_from_trainable_tokens --
    case("overlay_from_trainable_tokens", "dtype", lambda w: overlay_from_trainable_tokens(
        [1, 2], np.ones((2, 4), np.int32)), TypeError, "bfloat16"),
    case("overlay_from_trainable_tokens", "dtype", lambda w: overlay_from_trainable_tokens(
        [1.0, 2.0], random_bf16(w.rng, (2, 4))), TypeError, "must be integers", detail="ids"),
    case("overlay_from_trainable_tokens", "shape", lambda w: overlay_from_trainable_tokens(
        [1, 2], random_bf16(w.rng, 8)), ValueError, "2-D"),
    case("overlay_from_trainable_tokens", "length", lambda w: overlay_from_trainable_tokens(
        [1, 2, 3], random_bf16(w.rng, (2, 4))), ValueError, "3 ids but 2 rows"),
    case("overlay_from_trainable_tokens", "range", lambda w: overlay_from_trainable_tokens(
        [1, -2], random_bf16(w.rng, (2, 4))), ValueError, "negative"),
    case("overlay_from_trainable_tokens", "null", lambda w: overlay_from_trainable_tokens([1, 2], None),
         ValueError, "without embedding or LM-head rows"),
    case("overlay_from_trainable_tokens", "id", lambda w: overlay_from_trainable_tokens(
        [1, 30], random_bf16(w.rng, (2, 4)), vocab=30), ValueError, ">= vocab 30"),
    case("overlay_from_trainable_tokens", "empty", lambda w: _expect(overlay_from_trainable_tokens(
        [], np.zeros((0, 4), BF16)).embed.n == 0)),
    # -- OverlaySlots: construction, load / replace / evict --
    case("OverlaySlots", "dtype", lambda w: OverlaySlots(w.gpu, 2, 30, 1.5, kernels=w.kernels), TypeError,
         "must be an int"),
    case("OverlaySlots", "dtype", lambda w: w.slots.load(1, "adapter"), TypeError, "expected an AdapterOverlay",
         detail="overlay"),
    case("OverlaySlots", "dtype", lambda w: w.slots.load(True, _overlay(w, [1])), TypeError,
         "slot index must be an int", detail="slot"),
    case("OverlaySlots", "shape", lambda w: w.slots.load(1, _overlay(w, [1, 2], h=6)), ValueError, "width 6"),
    case("OverlaySlots", "length", lambda w: OverlaySlots(w.gpu, 2, 2**31 + 1, 5, kernels=w.kernels),
         ValueError, "too large"),
    case("OverlaySlots", "range", lambda w: w.slots.load(2, _overlay(w, [1])), ValueError, "slot index 2 outside"),
    case("OverlaySlots", "range", lambda w: w.slots.replace(-1, _overlay(w, [1])), ValueError,
         "slot index -1 outside", detail="replace"),
    case("OverlaySlots", "range", lambda w: w.slots.load(0, _overlay(w, [1])), ValueError, "in use",
         detail="in-use"),
    case("OverlaySlots", "null", lambda w: w.slots_without_kernels.load(1, _overlay(w, [1])),
         KernelNotFoundError, "not loaded", needs=("slots_without_kernels",)),
    case("OverlaySlots", "closed", lambda w: w.closed_slots.load(0, _overlay(w, [1])), ValueError, "closed"),
    case("OverlaySlots", "id", lambda w: w.slots.load(1, _overlay(w, [3, 30])), ValueError, "id 30 >= vocab 30"),
    case("OverlaySlots", "empty", lambda w: OverlaySlots(w.gpu, 0, 30, 5, kernels=w.kernels), ValueError,
         "num_slots"),
    case("OverlaySlots", "empty", lambda w: w.slots.evict(1), detail="evict-free"),
    # -- OverlaySlots forward hooks --
    case("OverlaySlots.hooks", "dtype",
         lambda w: w.slots.lmhead_overlay(w.p[0], None, 0, w.p[1], 3, dtype=np.float16),
         TypeError, "logits dtype"),
    case("OverlaySlots.hooks", "dtype",
         lambda w: w.slots.embed_overlay(w.p[0], np.array([0.0, 1.0]), 0, w.p[1], 2),
         TypeError, "seq_slot must be integers", detail="seq_slot"),
    case("OverlaySlots.hooks", "shape", lambda w: w.slots.embed_overlay(w.p[0], np.zeros((2, 1), np.int32), 0,
                                                                        w.p[1], 2),
         ValueError, "seq_slot shape"),
    case("OverlaySlots.hooks", "length", lambda w: w.slots.embed_overlay(w.p[0], np.array([0, 1]), 0, w.p[1], 3),
         ValueError, "seq_slot shape"),
    case("OverlaySlots.hooks", "range", lambda w: w.slots.embed_overlay(w.p[0], None, 2, w.p[1], 3),
         ValueError, "active slot 2 outside"),
    case("OverlaySlots.hooks", "range", lambda w: w.slots.lmhead_overlay(w.p[0], [0, 5, 1], -1, w.p[1], 3),
         ValueError, "holds slot 5", detail="seq_slot"),
    case("OverlaySlots.hooks", "null", lambda w: w.slots.embed_overlay(0, None, 0, w.p[1], 3), ValueError, NULL),
    case("OverlaySlots.hooks", "null", lambda w: w.slots.embed_overlay(0, np.array([0, 1, 0]), 0, w.p[1], 3),
         ValueError, NULL, detail="host-seq-slot"),
    case("OverlaySlots.hooks", "closed", lambda w: w.closed_slots.embed_overlay(w.p[0], None, 0, w.p[1], 3),
         ValueError, "closed"),
    case("OverlaySlots.hooks", "empty",
         lambda w: w.slots.embed_overlay(w.p[0], np.zeros(0, np.int32), 0, w.p[1], 0)),
]


def _expect(condition: bool) -> None:
    assert condition


# -- the good call after each refusal: the entry point still works --------------------------------

def _after_launcher(name: str) -> Callable[[World], None]:
    def check(w: World) -> None:
        before = len(w.gpu.launches)
        launch(w, name)
        assert w.gpu.launched()[before:] == [LAUNCH_KERNEL[name]]
    return check


def _after_scatter(w: World) -> None:
    slots = np.array([3, 0, 7, 1, 5], np.uint32)
    w.gpu.copy_h2d_async(slots, w.p[0])
    launch(w, "scatter_rows")
    rows = w.gpu.read(w.p[1], 5 * 16).reshape(5, 16)
    arena = w.gpu.read(w.p[2], 8 * 16).reshape(8, 16)
    np.testing.assert_array_equal(arena[slots], rows)


def _after_ngram_ids(w: World) -> None:
    tokens = w.rng.integers(0, w.dims.vocab_size, 9)
    full, tail = ngram_ids(w.dims, tokens), ngram_ids_tail(w.dims, tokens, 4)
    assert len(full) == w.dims.num_tables()
    for f, t in zip(full, tail):
        np.testing.assert_array_equal(f[-4:], t)


def _after_layer_embed(w: World) -> None:
    before = len(w.gpu.launches)
    w.layer.embed(w.rng.integers(0, 500, 6), 3, w.out, w.gpu)
    assert len(w.gpu.launches) - before == 2 + 3 * w.dims.num_tables()


def _after_fused_embed(w: World) -> None:
    before = len(w.gpu.launches)
    w.fused.embed_batch([w.rng.integers(0, 500, 6), [4]], [3, 1], w.out, w.gpu)
    assert w.gpu.launched()[before:] == ["ngram_gather", "dense_gemm_bf16_word"]


def _after_from_pretrained(w: World) -> None:
    model = w.model()
    layer = NgramEmbedding.from_pretrained(model.path, w.gpu)
    assert layer.dims == model.dims and len(layer.tables) == model.dims.num_tables()
    layer.close()


def _after_peft(w: World) -> None:
    overlay = overlay_from_peft(w.adapter(ids=[5, 9]), vocab=64)
    assert overlay.embed.ids.tolist() == [5, 9]


def _after_decoder(w: World) -> None:
    before = len(w.gpu.launches)
    w.decoder.step(w.p[0], w.p[1], 2, w.out, k=2)
    w.decoder.rollback(w.p[1], w.p[2], 2)
    assert w.gpu.launched()[before:] == ["ngram_decode_gather", "dense_gemm_bf16_word", "ngram_decode_rollback"]


def _after_cache(w: World) -> None:
    ids = np.array([3, 97, 3, 41])
    slots = np.empty(4, np.uint32)
    w.cache.resolve(ids, slots)
    assert_resident(w.gpu, w.cache, ids, slots, w.table, w.scales)
    w.cache.end_batch()


def _after_table_file(w: World) -> None:
    ids = np.array([99, 0])
    out, scales = np.empty((2, 8), np.uint8), np.empty(2, np.float32)
    w.file.read_rows(ids, out, scales)
    np.testing.assert_array_equal(out, w.table[ids].view(np.uint8))
    np.testing.assert_array_equal(scales, w.scales[ids])


def _after_writer(w: World) -> None:
    w.writer.append(w.writer_rows[2:])
    w.writer.close()
    with TableFile(w.tmp / "w.ngt") as f:
        np.testing.assert_array_equal(f.rows_bytes, w.writer_rows.view(np.uint8).reshape(4, 6))


def _after_build_overlay(w: World) -> None:
    adapter = w.served_host.copy()
    adapter[[2, 7]] = random_bf16(w.rng, (2, 4), 5.0)
    ov = build_overlay(w.gpu, w.kernels, w.served, adapter)
    np.testing.assert_array_equal(ov.embed.ids, [2, 7])
    np.testing.assert_array_equal(bits(ov.embed.rows), bits(adapter[[2, 7]]))


def _after_trainable(w: World) -> None:
    rows = random_bf16(w.rng, (3, 4))
    ov = overlay_from_trainable_tokens([5, 1, 3], rows, vocab=8)
    np.testing.assert_array_equal(ov.embed.ids, [1, 3, 5])
    np.testing.assert_array_equal(bits(ov.embed.rows), bits(rows[[1, 2, 0]]))


def _after_slots(w: World) -> None:
    ov = random_overlay(w.rng, 30, 5, 4, 2)
    w.slots.load(1, ov)
    check_slot_contents(w.gpu, w.slots, 1, ov)


def _after_hooks(w: World) -> None:
    before = len(w.gpu.launches)
    w.slots.embed_overlay(w.p[0], np.array([0, 1, -1]), 0, w.p[1], 3)
    assert w.gpu.launched()[before:] == ["embed_overlay_routed_bf16"]


AFTER: dict[str, Callable[[World], None]] = {
    **{name: _after_launcher(name) for name in LAUNCH_KERNEL},
    "scatter_rows": _after_scatter,
    "KernelLaunch": lambda w: _after_launcher("scaled_add")(w),
    "NgramDims": lambda w: _expect(NgramDims(500, 40, 3, 2, 61, row_bias=1) == w.dims),
    "ngram_ids": _after_ngram_ids,
    "NgramEmbedding": lambda w: NgramEmbedding(w.dims, w.layer.word, w.layer.tables, w.layer.projs, 8,
                                               w.gpu).close(),
    "NgramEmbedding.embed": _after_layer_embed,
    "FusedNgramEmbedding": lambda w: FusedNgramEmbedding(w.layer, 8, w.gpu).close(),
    "FusedNgramEmbedding.embed": _after_fused_embed,
    "from_pretrained": _after_from_pretrained,
    "overlay_from_peft": _after_peft,
    "NgramDecoder": lambda w: NgramDecoder(w.layer, max_seqs=2, max_rows=4, gpu=w.gpu).close(),
    "NgramDecoder.calls": _after_decoder,
    "RowCache": lambda w: RowCache(w.gpu, w.table_path, 5, io_threads=1).close(),
    "RowCache.resolve": _after_cache,
    "TableFile": _after_table_file,
    "TableWriter": _after_writer,
    "build_overlay": _after_build_overlay,
    "overlay_from_trainable_tokens": _after_trainable,
    "OverlaySlots": _after_slots,
    "OverlaySlots.hooks": _after_hooks,
}


def assert_nothing_written(before: dict[str, Any], after: dict[str, Any], log: list, temp: bool) -> None:
    """Equal memory, files and state; no launch; no allocation, free or write at all unless
    ``temp`` (then only into temporaries that are gone again)."""
    assert [op for op in log if op[0] == "launch"] == [], f"launched {log}"
    if not temp:
        assert log == [], f"wrote before refusing: {log}"
    assert set(after["mem"]) == set(before["mem"]), "allocations leaked or freed"
    for ptr, data in before["mem"].items():
        assert after["mem"][ptr] == data, f"device buffer 0x{ptr:x} changed"
    for key in before:
        if key != "mem":
            assert after[key] == before[key], f"{key} changed"


@pytest.mark.parametrize("row, fn, exc, match, temp, needs, after", CPU_CASES)
def test_cpu_refusal(world, row, fn, exc, match, temp, needs, after):
    for name in needs:
        getattr(world, name)
    before, mark = world.state(), len(world.gpu.log)
    if exc is None:
        fn(world)
    else:
        with pytest.raises(exc, match=match):
            fn(world)
    assert_nothing_written(before, world.state(), world.gpu.log[mark:], temp)
    (after or AFTER[row])(world)


# ==== CudaBackend: offline on CPU, then on the device ===========================================

def cuda(row: str, column: str, fn: Callable[[CudaBackend, Target], Any],
         exc: type[BaseException] | None = None, match: str | None = None, *, detail: str = "",
         gpu_only: bool = False, xfail: str | None = None) -> Any:
    return _param(row, column, detail, (fn, exc, match, gpu_only), xfail)


def _k_scaled(b: CudaBackend) -> KernelHandle:
    return b.kernel("residual_add", "bf16_scaled_add")


CUDA_CASES = [
    cuda("CudaBackend.alloc", "dtype", lambda b, t: b.alloc(1.5), ValueError,
         "alloc size must be a non-negative int"),
    cuda("CudaBackend.alloc", "length", lambda b, t: b.alloc(1 << 50), CudaError, "CUDA_ERROR_OUT_OF_MEMORY",
         gpu_only=True),
    cuda("CudaBackend.alloc", "range", lambda b, t: b.alloc(-1), ValueError, "non-negative int"),
    cuda("CudaBackend.alloc", "range", lambda b, t: b.free(t.ptr), ValueError, "not allocated by this backend",
         detail="free-interior"),
    cuda("CudaBackend.alloc", "null", lambda b, t: b.free(0)),
    cuda("CudaBackend.alloc", "closed", lambda b, t: t.closed.alloc(16), GpuError, "closed"),
    cuda("CudaBackend.alloc", "closed", lambda b, t: t.closed.free(t.ptr), GpuError, "closed", detail="free"),
    cuda("CudaBackend.alloc", "empty", lambda b, t: b.alloc(0), ValueError, "alloc of 0 bytes"),
    cuda("CudaBackend.memset", "dtype", lambda b, t: b.memset(t.ptr, 0, "16"), ValueError, "memset size"),
    cuda("CudaBackend.memset", "dtype", lambda b, t: b.memset(t.ptr, 1.5, 16), ValueError, "byte",
         detail="float-byte"),
    cuda("CudaBackend.memset", "length", lambda b, t: b.memset(t.ptr, 0, -1), ValueError, "memset size"),
    cuda("CudaBackend.memset", "range", lambda b, t: b.memset(t.ptr, 256, 16), ValueError, "0..255"),
    cuda("CudaBackend.memset", "null", lambda b, t: b.memset(0, 0, 16), ValueError, NULL),
    cuda("CudaBackend.memset", "closed", lambda b, t: t.closed.memset(t.ptr, 0, 16), GpuError, "closed"),
    cuda("CudaBackend.memset", "empty", lambda b, t: b.memset(t.ptr, 7, 0)),
    cuda("CudaBackend.copy", "dtype", lambda b, t: b.copy_h2d_async("abcd", t.ptr), TypeError, "bytes-like"),
    cuda("CudaBackend.copy", "dtype", lambda b, t: b.copy_d2h(b"four", t.ptr), ValueError, "read-only",
         detail="d2h"),
    cuda("CudaBackend.copy", "shape", lambda b, t: b.copy_h2d_async(np.arange(32, dtype=np.uint8)[::2], t.ptr),
         ValueError, "C-contiguous"),
    cuda("CudaBackend.copy", "shape", lambda b, t: b.copy_d2h(t.host[::2], t.ptr), ValueError, "C-contiguous",
         detail="d2h"),
    cuda("CudaBackend.copy", "null", lambda b, t: b.copy_h2d_async(b"abcd", 0), ValueError, NULL),
    cuda("CudaBackend.copy", "null", lambda b, t: b.copy_d2h(t.host, 0), ValueError, NULL, detail="d2h"),
    cuda("CudaBackend.copy", "closed", lambda b, t: t.closed.copy_h2d_async(b"abcd", t.ptr), GpuError, "closed"),
    cuda("CudaBackend.copy", "closed", lambda b, t: t.closed.copy_d2h(t.host, t.ptr), GpuError, "closed",
         detail="d2h"),
    cuda("CudaBackend.copy", "empty", lambda b, t: b.copy_h2d_async(b"", t.ptr)),
    cuda("CudaBackend.copy", "empty", lambda b, t: b.copy_d2h(t.host[:0], t.ptr), detail="d2h"),
    cuda("CudaBackend.copy_d2d", "dtype", lambda b, t: b.copy_d2d_async(t.ptr, t.ptr.offset(64), 1.5),
         ValueError, "copy size"),
    cuda("CudaBackend.copy_d2d", "shape", lambda b, t: b.copy_2d_async(t.ptr, 32, t.ptr.offset(1024), 64, 64, 2),
         ValueError, "pitches"),
    cuda("CudaBackend.copy_d2d", "length", lambda b, t: b.copy_d2d_async(t.ptr, t.ptr.offset(64), -1),
         ValueError, "copy size"),
    cuda("CudaBackend.copy_d2d", "length", lambda b, t: b.copy_2d_async(t.ptr, 64, t.ptr.offset(1024), 64, 64, -1),
         ValueError, "copy height", detail="2d"),
    cuda("CudaBackend.copy_d2d", "null", lambda b, t: b.copy_d2d_async(t.ptr, 0, 16), ValueError, NULL),
    cuda("CudaBackend.copy_d2d", "null", lambda b, t: b.copy_2d_async(0, 64, t.ptr, 64, 64, 1), ValueError, NULL,
         detail="2d"),
    cuda("CudaBackend.copy_d2d", "closed", lambda b, t: t.closed.copy_d2d_async(t.ptr, t.ptr.offset(64), 16),
         GpuError, "closed"),
    cuda("CudaBackend.copy_d2d", "empty", lambda b, t: b.copy_d2d_async(t.ptr, t.ptr.offset(64), 0)),
    cuda("CudaBackend.copy_d2d", "empty", lambda b, t: b.copy_2d_async(t.ptr, 64, t.ptr.offset(1024), 64, 64, 0),
         detail="2d"),
    cuda("CudaBackend.pinned", "dtype", lambda b, t: b.free_host(np.zeros(4096, np.uint8)), ValueError,
         "not a whole buffer"),
    cuda("CudaBackend.pinned", "shape", lambda b, t: b.free_host(t.pinned[16:]), ValueError, "not a whole buffer"),
    cuda("CudaBackend.pinned", "range", lambda b, t: b.upload_pinned_async(np.zeros(16, np.uint8), t.ptr),
         ValueError, "not inside an alloc_host buffer"),
    cuda("CudaBackend.pinned", "range", lambda b, t: b.alloc_host(-1), ValueError, "alloc_host size",
         detail="alloc_host"),
    cuda("CudaBackend.pinned", "null", lambda b, t: b.upload_pinned_async(t.pinned, 0), ValueError, NULL),
    cuda("CudaBackend.pinned", "closed", lambda b, t: t.closed.alloc_host(16), GpuError, "closed"),
    cuda("CudaBackend.pinned", "empty", lambda b, t: b.alloc_host(0), ValueError, "alloc_host of 0 bytes"),
    cuda("CudaBackend.pinned", "empty", lambda b, t: b.upload_pinned_async(t.pinned[:0], t.ptr), detail="upload"),
    cuda("CudaBackend.handles", "range", lambda b, t: b.destroy_stream(0x1234), ValueError,
         "not created by this backend"),
    cuda("CudaBackend.handles", "range", lambda b, t: b.destroy_event(0x1234), ValueError,
         "not created by this backend", detail="event"),
    cuda("CudaBackend.handles", "range", lambda b, t: b.launch_graph(0x1234, t.stream), ValueError,
         "not a live graph", detail="graph"),
    cuda("CudaBackend.handles", "range", lambda b, t: b.destroy_graph(0x1234), ValueError, "not a live graph",
         detail="destroy-graph"),
    cuda("CudaBackend.handles", "null", lambda b, t: b.begin_capture(0), ValueError, "default stream"),
    cuda("CudaBackend.handles", "closed", lambda b, t: t.closed.create_stream(), GpuError, "closed"),
    cuda("CudaBackend.handles", "closed", lambda b, t: t.closed.create_event(), GpuError, "closed",
         detail="event"),
    cuda("CudaBackend.kernel", "range", lambda b, t: b.kernel("no_such_module", "k"), KernelNotFoundError,
         "no kernel module"),
    cuda("CudaBackend.kernel", "range", lambda b, t: b.kernel("residual_add", "no_such_kernel"),
         KernelNotFoundError, "not in module", detail="kernel", gpu_only=True),
    cuda("CudaBackend.kernel", "closed", lambda b, t: _k_scaled(t.closed), GpuError, "closed"),
    cuda("KernelLaunch", "dtype", lambda b, t: KernelLaunch(b, _k_scaled(b)).arg_ptr(t.ptr).arg_ptr(t.ptr)
         .arg_u32(1).arg_u32(8).launch(), TypeError, "argument 2 must be f32", detail="kinds", gpu_only=True),
    cuda("KernelLaunch", "length", lambda b, t: KernelLaunch(b, _k_scaled(b)).arg_ptr(t.ptr).arg_ptr(t.ptr)
         .arg_f32(1.0).arg_u32(8).arg_u32(1).launch(), TypeError, "takes 4 arguments", detail="arguments",
         gpu_only=True),
    cuda("KernelLaunch", "range", lambda b, t: KernelLaunch(b, KernelHandle(0xDEAD)).launch(), GpuError,
         "not loaded by this backend", detail="foreign-kernel"),
    cuda("KernelLaunch", "closed", lambda b, t: KernelLaunch(t.closed, KernelHandle(0xDEAD)).arg_u32(1).launch(),
         GpuError, "backend is closed"),
    cuda("KernelLaunch", "empty", lambda b, t: KernelLaunch(b, _k_scaled(b)).launch(), TypeError,
         "takes 4 arguments", gpu_only=True),
]


def _run_cuda_case(backend: CudaBackend, target: Target, fn, exc, match) -> None:
    if exc is None:
        fn(backend, target)
    else:
        with pytest.raises(exc, match=match):
            fn(backend, target)


@pytest.mark.parametrize("fn, exc, match, gpu_only", [p for p in CUDA_CASES if not p.values[3]])
def test_offline_cuda_backend_refuses_before_the_driver(monkeypatch, rng, fn, exc, match, gpu_only):
    """``CudaBackend``'s checks with no device: any driver call raises ``DriverReached``, so a
    passing case refused (or did nothing) without reaching the driver. (Cases that need the
    driver's answer, ``gpu_only``, run on the device only.)"""
    backend, target = offline_backends(monkeypatch, rng)
    pinned, host = target.pinned.copy(), target.host.copy()
    _run_cuda_case(backend, target, fn, exc, match)
    np.testing.assert_array_equal(target.pinned, pinned)
    np.testing.assert_array_equal(target.host, host)


# -- on the device ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def closed_backend(gpu):
    backend = CudaBackend()
    backend.close()
    return backend


def _raw(g: Guarded) -> np.ndarray:
    """Every byte of a guarded buffer, guards included."""
    raw = np.empty(g.total, np.uint8)
    g.gpu.copy_d2h(raw, g.base)
    return raw


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
        residual.scaled_add(gpu, _k_scaled(gpu), o.ptr, g.ptr, -0.37, 300, 0)
        np.testing.assert_array_equal(bits(o.read()), bits(ref.scaled_add(out0, x, -0.37)))
        o.assert_guards_intact()


@pytest.mark.gpu
@pytest.mark.parametrize("fn, exc, match, gpu_only", CUDA_CASES)
def test_gpu_cuda_backend_refusal(gpu, closed_backend, rng, fn, exc, match, gpu_only):
    """The ``CudaBackend`` cases on the device: the 4 KiB target (random bytes, in a guarded
    allocation), the pinned buffer and the host array are bit for bit unchanged afterwards."""
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(gpu.synchronize)  # runs first: nothing queued may outlive the buffers
        stream = gpu.create_stream()
        cleanup.callback(gpu.destroy_stream, stream)
        event = gpu.create_event()
        cleanup.callback(gpu.destroy_event, event)
        pinned = gpu.alloc_host(4096)
        cleanup.callback(gpu.free_host, pinned)
        buf = cleanup.enter_context(Guarded(gpu, 4096, np.uint8, rng))
        cleanup.callback(gpu.synchronize)
        pinned[:] = rng.integers(0, 256, 4096, dtype=np.uint8)
        target = Target(buf.ptr, pinned, rng.integers(0, 256, 64, dtype=np.uint8), stream, event,
                        closed_backend)
        before, pinned_before, host_before = _raw(buf), pinned.copy(), target.host.copy()
        _run_cuda_case(gpu, target, fn, exc, match)
        gpu.synchronize()
        np.testing.assert_array_equal(_raw(buf), before)
        np.testing.assert_array_equal(pinned, pinned_before)
        np.testing.assert_array_equal(target.host, host_before)
        assert_backend_usable(gpu, rng)


# -- one launcher per kernel module on the device ----------------------------------------------------

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
        return [_raw(g) for g in self.bufs]

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
        self.table.upload(table), self.ids.upload(ids)
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
        self.a.upload(a.astype(BF16)), self.w.upload(w.astype(BF16))
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
        self.base.upload(base), self.served.upload(served)
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
        self.call(self.gpu, kernel)
        np.testing.assert_array_equal(self.ids.read(), self.tables.want_ids)
        np.testing.assert_array_equal(bits(self.out.read()), bits(self.tables.want_out))

    def close(self):
        super().close()
        self.tables.close()


CLOSED_BACKEND = "closed backend"  # an ``over`` that swaps in the closed backend


def gpu_case(rig: type[Rig], column: str, over: Any, exc: type[BaseException] | None, match: str | None = None,
             detail: str = "") -> Any:
    return _param(rig.row, column, detail, (rig, over, exc, match), None)


GPU_LAUNCH_CASES = []
for _rig, _count in ((BatchedEmbedRig, "n"), (ScaledAddRig, "n"), (GemmRig, "m"), (RowdiffRig, "rows"),
                     (ScatterRig, "n"), (NgramGatherRig, "rows")):
    GPU_LAUNCH_CASES += [
        gpu_case(_rig, "dtype", {_count: 1.5}, TypeError, "must be an int"),
        gpu_case(_rig, "length", {_count: 2**32}, ValueError, COUNT),
        gpu_case(_rig, "closed", CLOSED_BACKEND, GpuError, "closed"),
        gpu_case(_rig, "empty", {_count: 0}, None),
    ]
GPU_LAUNCH_CASES += [
    gpu_case(BatchedEmbedRig, "null", {"table": 0}, ValueError, NULL),
    gpu_case(ScaledAddRig, "null", {"x": 0}, ValueError, NULL),
    gpu_case(ScaledAddRig, "range", {"scale": 1e39}, ValueError, "fit an f32"),
    gpu_case(GemmRig, "null", {"c": 0}, ValueError, NULL),
    gpu_case(GemmRig, "shape", {"w": None}, ValueError, "w shape"),  # None: a weight of the wrong shape
    gpu_case(RowdiffRig, "null", {"flags": 0}, ValueError, NULL),
    gpu_case(RowdiffRig, "range", {"thresh": float("nan")}, ValueError, "NaN"),
    gpu_case(ScatterRig, "null", {"arena_scales": 0}, ValueError, "both be given"),
    gpu_case(NgramGatherRig, "null", {"windows": 0}, ValueError, NULL),
    gpu_case(NgramGatherRig, "length", {"num_tables": 5}, ValueError, "num_tables", detail="tables"),
    gpu_case(NgramGatherRig, "range", {"eos": 0xFFFFFFFF}, ValueError, "reserved"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("rig_type, over, exc, match", GPU_LAUNCH_CASES)
def test_gpu_launcher_refusal(gpu, closed_backend, rng, rig_type, over, exc, match):
    rig = rig_type(gpu, rng)
    try:
        kernel = gpu.kernel(rig.module, rig.kernel)
        before = rig.raw()
        if over == CLOSED_BACKEND:
            backend, over = closed_backend, {}
        else:
            backend = gpu
        if over.get("w", 0) is None:
            over = {"w": DenseWeight(rig.w.ptr, (GemmRig.N, GemmRig.K + 1), BF16)}
        if exc is None:
            rig.call(backend, kernel, **over)
        else:
            with pytest.raises(exc, match=match):
                rig.call(backend, kernel, **over)
        for a, b in zip(rig.raw(), before):
            np.testing.assert_array_equal(a, b)
        assert_backend_usable(gpu, rng)
        rig.good(kernel)
        for g in rig.bufs:
            g.assert_guards_intact()
    finally:
        rig.close()


# ==== the README table, generated from the cases ================================================

def _outcome(exc: type[BaseException] | None) -> str:
    return "no-op" if exc is None else exc.__name__


def matrix_cells() -> dict[tuple[str, str], dict[str, Any]]:
    """(row, column) -> outcomes, whether any CPU test covers the cell, and its xfail ids."""
    cells: dict[tuple[str, str], dict[str, Any]] = {}

    def add(param: Any, exc: Any, cpu: bool, temp: bool = False) -> None:
        row = next(r for r in sorted(ROW_KEYS, key=len, reverse=True) if param.id.startswith(r + "-"))
        column = param.id[len(row) + 1:].split("-")[0]
        cell = cells.setdefault((row, column), dict(outcomes=set(), cpu=False, xfail=[], temp=False))
        cell["temp"] |= temp
        if any(mark.name == "xfail" for mark in param.marks):
            cell["xfail"].append(param.id)
        else:
            cell["outcomes"].add(_outcome(exc))
        cell["cpu"] |= cpu

    for param in CPU_CASES:
        add(param, param.values[2], True, param.values[4])
    for param in CUDA_CASES:
        add(param, param.values[1], not param.values[3])
    for param in GPU_LAUNCH_CASES:
        add(param, param.values[2], False)
    return cells


INTRO = """\
Every public entry point refuses bad input with a clear exception before it writes or launches
anything, and stays usable afterwards. `tests/test_bad_inputs.py` holds a test for every
cell (test ids `<row>-<column>[-<detail>]`, e.g. `scatter_rows-null`): it compares device memory,
pinned and host outputs, files and object state before and after the refused call, then makes a
good call of the same entry point and checks its answer. On CPU the layers run on a host-memory
backend, and `CudaBackend`'s checks on an offline backend whose driver calls all fail, so every
refusal is shown to come before the driver; on the GPU the `CudaBackend` cases and one launcher per
kernel module run on the device, on buffers of random bytes compared bit for bit."""

LEGEND = """\
A cell names the exception (several: the cell's cases differ); "no-op": returns without writing or
launching; "–": does not apply (the kernels cannot see table sizes, so the launchers take ids on
trust and the layers that build them check them; the overlay kernels skip ids >= vocab by design;
`NgramDecoder`'s tokens, slots and counts live on the device: its kernels flag bad ones in the error
word that `check_errors` reads, and never read or write outside their buffers);
"(GPU)": checked on the GPU machine only; †: uploads to temporaries, freed before it raises
(`from_numpy` checks each array as it uploads it, `build_overlay` its threshold after uploading
the adapter), nothing that existed before is written."""
GAPS = "✗: not refused yet, or not before writing, pinned by a strict xfail test:"

NOT_CHECKED = """\
Not checked: copies and memsets against the size of the allocation they write (a pointer may point
inside one); the `stream` and event handles given to `record_event`, `wait_event`,
`event_synchronize`, `synchronize` and every copy and launch, which go to the driver as they are."""


def matrix_table() -> tuple[list[str], list[str]]:
    """The table's lines, and the ids of the xfail cases, in table order."""
    cells = matrix_cells()
    lines = ["| entry point | " + " | ".join(header for _, header in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    gaps: list[str] = []
    for row, label in ROWS:
        texts = []
        for column in COLUMN_KEYS:
            cell = cells.get((row, column))
            if cell is None:
                texts.append("–")
                continue
            outcomes = sorted(cell["outcomes"], key=lambda o: (o == "no-op", o))
            text = ", ".join(f"`{o}`" if o != "no-op" else o for o in outcomes)
            if cell["temp"]:
                text += " †"
            if not cell["cpu"]:
                text += " (GPU)"
            if cell["xfail"]:
                text = (text + " " if text else "") + "✗"
                gaps += cell["xfail"]
            texts.append(text)
        lines.append(f"| {label} | " + " | ".join(texts) + " |")
    return lines, gaps


def matrix_markdown() -> str:
    """The README section, generated from the case tables."""
    lines, gaps = matrix_table()
    reasons = {p.id: next(m.kwargs["reason"] for m in p.marks if m.name == "xfail")
               for p in CPU_CASES + CUDA_CASES if any(m.name == "xfail" for m in p.marks)}
    notes = [textwrap.fill(f"- `{gap}`: {reasons[gap]}.", 100, subsequent_indent="  ") for gap in gaps]
    run = textwrap.fill("Run it with `pytest tests/test_bad_inputs.py` (the GPU cases with the rest: "
                        "`make gpu-check`); `python -m tests.test_bad_inputs` prints this section "
                        "from the cases.", 100)
    gaps_text = [GAPS + "\n" + "\n".join(notes)] if notes else []
    return "\n\n".join(["## Bad input", INTRO, "\n".join(lines), LEGEND, *gaps_text, NOT_CHECKED,
                        run]) + "\n"


def test_every_matrix_row_has_cases():
    for table in (CPU_CASES, CUDA_CASES, GPU_LAUNCH_CASES):
        ids = [param.id for param in table]
        assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    cells = matrix_cells()
    assert {row for row, _ in cells} == set(ROW_KEYS)
    assert all(cell["outcomes"] or cell["xfail"] for cell in cells.values())


def test_readme_matrix_matches_the_cases():
    """Once the README holds the "Bad input" section, its table is the one the cases generate."""
    text = README.read_text()
    if "## Bad input" not in text:
        pytest.skip("README has no 'Bad input' section yet")
    section = text.split("## Bad input", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert table == matrix_table()[0], \
        "README's bad-input table is stale: regenerate it with python -m tests.test_bad_inputs"


if __name__ == "__main__":
    print(matrix_markdown(), end="")
