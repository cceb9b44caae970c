"""The launchers' cases: on CPU every launcher of every kernel module with its good arguments,
one replaced (the kernels cannot see table sizes, so ids are the layers' to check); on the
device one launcher per kernel module (``device.py``'s rigs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gpu_runtime import ClosedError, CudaBackend, KernelHandle
from layers.block_fp8_weight import BlockFp8Weight
from layers.dense_weight import BF16, FP8, DenseWeight
from tests.bad_inputs.device import (BatchedEmbedRig, GemmRig, NgramGatherRig, Rig, RowdiffRig, ScaledAddRig,
                                     ScatterRig)
from tests.bad_inputs.launcher_rows import LAUNCH_FN, LAUNCH_KERNEL
from tests.bad_inputs.matrix import COUNT, NULL, case, param
from tests.bad_inputs.world import World

GEMM_DIM = r"must be in 0\.\.2\*\*31-1"  # the GEMM kernels index with 32-bit signed arithmetic


def _launch_args(w: World, name: str) -> dict[str, Any]:
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
        "dense_gemm_fp8w": dict(a=p[0], w=BlockFp8Weight(p[1], p[3], (6, 32)), c=p[2], m=5, n=6, k=32, stream=0),
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


def launch(world: World, launcher: str, /, **over: Any) -> None:
    """``launcher`` with its good arguments, ``over`` replacing some (``gpu``, ``kernel``
    included; a callable value is called with the world)."""
    over = {k: v(world) if callable(v) else v for k, v in over.items()}
    gpu = over.pop("gpu", world.gpu)
    kernel = over.pop("kernel", world.gpu.kernel("*", LAUNCH_KERNEL[launcher]))
    LAUNCH_FN[launcher](gpu, kernel, **{**_launch_args(world, launcher), **over})


def L(name: str, column: str, exc: type[BaseException] | None, match: str | None = None,
      detail: str = "", xfail: str | None = None, **over: Any) -> Any:
    """A launcher case: its good arguments with ``over`` replacing some."""
    return case(name, column, lambda w: launch(w, name, **over), exc, match, detail=detail, xfail=xfail)


def closed_gpu(w: World) -> CudaBackend:
    """The world's closed offline ``CudaBackend``: the launchers' "closed" column."""
    return w.target.closed


CLOSED = dict(gpu=closed_gpu, kernel=KernelHandle(0x1234))

CPU_CASES = [
    L("batched_embed", "dtype", TypeError, "must be an int", n=1.5),
    L("batched_embed", "length", ValueError, COUNT, n=2**32),
    L("batched_embed", "range", ValueError, COUNT, dim=-1),
    L("batched_embed", "null", ValueError, NULL, table=0),
    L("batched_embed", "null", ValueError, "null kernel handle", detail="kernel", kernel=KernelHandle(0)),
    L("batched_embed_fp8", "dtype", TypeError, "must be an int", dim="7"),
    L("batched_embed_fp8", "length", ValueError, COUNT, n=2**32),
    L("batched_embed_fp8", "range", ValueError, COUNT, dim=-1),
    L("batched_embed_fp8", "null", ValueError, NULL, row_scale=0),
    L("embed_from_argmax", "dtype", TypeError, "must be an int", m=True),
    L("embed_from_argmax", "length", ValueError, COUNT, dim=2**32),
    L("embed_from_argmax", "range", ValueError, "vocab must be >= 1", vocab=0),
    L("embed_from_argmax", "null", ValueError, NULL, ids_out=0),
    L("scaled_add", "dtype", TypeError, "real number", scale="x"),
    L("scaled_add", "length", ValueError, COUNT, n=2**32),
    L("scaled_add", "range", ValueError, "fit an f32", scale=1e39),
    L("scaled_add", "range", ValueError, "finite", detail="nan", scale=float("nan")),
    L("scaled_add", "null", ValueError, NULL, x=0),
    L("residual_add", "dtype", TypeError, "must be an int", n=2.0),
    L("residual_add", "length", ValueError, COUNT, n=2**32),
    L("residual_add", "range", ValueError, COUNT, n=-1),
    L("residual_add", "null", ValueError, NULL, out=0),
    L("dense_gemm_bf16_pipelined", "dtype", TypeError, "expected bfloat16",
      w=lambda w: DenseWeight(w.p[1], (6, 8), FP8)),
    L("dense_gemm_bf16_pipelined", "dtype", TypeError, "must be a DenseWeight", detail="host-array",
      w=np.zeros((6, 8), BF16)),
    L("dense_gemm_bf16_pipelined", "shape", ValueError, "w shape", w=lambda w: DenseWeight(w.p[1], (6, 9), BF16)),
    L("dense_gemm_bf16_pipelined", "length", ValueError, GEMM_DIM, m=2**31),
    L("dense_gemm_bf16_pipelined", "range", ValueError, "unknown GEMM path", path="bogus"),
    L("dense_gemm_bf16_pipelined", "null", ValueError, NULL, c=0),
    L("dense_gemm_bf16_pipelined", "null", ValueError, "kernel not loaded", detail="kernel",
      kernel=KernelHandle(0)),
    L("dense_gemm_bf16_word", "dtype", TypeError, "real number", scale="x"),
    L("dense_gemm_bf16_word", "length", ValueError, "cannot be forced", m=64, path="tiled"),
    L("dense_gemm_bf16_word", "range", ValueError, "finite", scale=float("inf")),
    L("dense_gemm_bf16_word", "null", ValueError, NULL, word_ids=0),
    L("dense_gemm_fp8w", "dtype", TypeError, "must be a BlockFp8Weight, got DenseWeight",
      w=lambda w: DenseWeight(w.p[1], (6, 32), FP8)),
    L("dense_gemm_fp8w", "dtype", TypeError, "workspace must be an int, got bool", detail="workspace",
      workspace=True),
    L("dense_gemm_fp8w", "shape", ValueError, "w shape", w=lambda w: BlockFp8Weight(w.p[1], w.p[3], (6, 64))),
    L("dense_gemm_fp8w", "length", ValueError, GEMM_DIM, m=2**31),
    L("dense_gemm_fp8w", "range", ValueError, "unknown path", path="tiled"),
    L("dense_gemm_fp8w", "null", ValueError, NULL, w=lambda w: BlockFp8Weight(w.p[1], 0, (6, 32))),
    L("dense_gemm_fp8w", "null", ValueError, "k = 2048 takes 2 slabs: give a workspace", detail="workspace",
      w=lambda w: BlockFp8Weight(w.p[1], w.p[3], (6, 2048)), m=64, k=2048),
    L("dense_gemm_fp8w", "null", ValueError, "kernel not loaded", detail="kernel", kernel=KernelHandle(0)),
    L("embed_rowdiff", "dtype", TypeError, "real number", thresh="x"),
    L("embed_rowdiff", "length", ValueError, ">= 1", h=0),
    L("embed_rowdiff", "range", ValueError, "NaN", thresh=float("nan")),
    L("embed_rowdiff", "null", ValueError, NULL, flags=0),
    L("embed_rowdiff", "null", ValueError, "kernel not loaded", detail="kernel", kernel=KernelHandle(0)),
    L("embed_overlay_routed", "dtype", TypeError, "must be an int", active=1.5),
    L("embed_overlay_routed", "length", ValueError, ">= 1", vocab=0),
    L("embed_overlay_routed", "range", ValueError, r"active must be in -2\*\*31\.\.", active=2**31),
    L("embed_overlay_routed", "null", ValueError, NULL, out=0),
    L("embed_overlay_routed", "null", None, detail="kernel", kernel=KernelHandle(0)),  # a hook: no-op
    L("lmhead_overlay_routed", "dtype", TypeError, "must be an int", m="3"),
    L("lmhead_overlay_routed", "length", ValueError, "grid y", max_n_override=65536),
    L("lmhead_overlay_routed", "range", ValueError, ">= 1", h=0),
    L("lmhead_overlay_routed", "null", ValueError, NULL, logits=0),
    L("scatter_rows", "dtype", TypeError, "must be an int", n=1.5),
    L("scatter_rows", "length", ValueError, COUNT, n=2**32),
    L("scatter_rows", "range", ValueError, COUNT, row_bytes=-1),
    L("scatter_rows", "null", ValueError, NULL, arena=0),
    L("scatter_rows", "null", ValueError, "both be given", detail="scales", scales=lambda w: w.p[3]),
    L("ngram_gather", "dtype", TypeError, "must be an int", rows=2.0),
    L("ngram_gather", "length", ValueError, "num_tables 5 != splits", num_tables=5),
    L("ngram_gather", "range", ValueError, "reserved", eos=0xFFFFFFFF),
    L("ngram_gather", "range", ValueError, "max_ngram must be >= 2", detail="max_ngram", max_ngram=1,
      num_tables=0),
    L("ngram_gather", "null", ValueError, NULL, windows=0),
]

# The columns alike for every launcher: a closed backend is refused, and a launch with nothing to
# do is a no-op (the size named here 0).
ZERO_SIZE = {"batched_embed": "n", "batched_embed_fp8": "dim", "embed_from_argmax": "m", "scaled_add": "n",
             "residual_add": "n", "dense_gemm_bf16_pipelined": "m", "dense_gemm_bf16_word": "m", "dense_gemm_fp8w": "m",
             "embed_rowdiff": "rows", "embed_overlay_routed": "num_tokens",
             "lmhead_overlay_routed": "max_n_override", "scatter_rows": "n", "ngram_gather": "rows"}
assert ZERO_SIZE.keys() == LAUNCH_KERNEL.keys()
CPU_CASES += [c for name, size in ZERO_SIZE.items()
              for c in (L(name, "closed", ClosedError, "closed", **CLOSED), L(name, "empty", None, **{size: 0}))]


def after_launcher(name: str) -> Callable[[World], None]:
    """The good call of launcher ``name``: it launches its kernel, once."""
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


AFTER: dict[str, Callable[[World], None]] = {
    **{name: after_launcher(name) for name in LAUNCH_KERNEL},
    "scatter_rows": _after_scatter,
}


# -- on the device -----------------------------------------------------------------------------------

CLOSED_BACKEND = "closed backend"  # an ``over`` that swaps in the closed backend


def gpu_case(rig: type[Rig], column: str, over: Any, exc: type[BaseException] | None, match: str | None = None,
             detail: str = "") -> Any:
    """One device case of ``rig``'s launcher: ``over`` replaces some of its good arguments (or is
    ``CLOSED_BACKEND``)."""
    return param(rig.row, column, detail, (rig, over, exc, match), None)


GPU_LAUNCH_CASES = []
for _rig, _count, _too_long in ((BatchedEmbedRig, "n", COUNT), (ScaledAddRig, "n", COUNT),
                                (GemmRig, "m", GEMM_DIM), (RowdiffRig, "rows", COUNT),
                                (ScatterRig, "n", COUNT), (NgramGatherRig, "rows", COUNT)):
    GPU_LAUNCH_CASES += [
        gpu_case(_rig, "dtype", {_count: 1.5}, TypeError, "must be an int"),
        gpu_case(_rig, "length", {_count: 2**32}, ValueError, _too_long),
        gpu_case(_rig, "closed", CLOSED_BACKEND, ClosedError, "closed"),
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
