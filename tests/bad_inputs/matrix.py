"""The matrix's vocabulary: its rows (entry points) and columns (kinds of bad input), the test-id
scheme ``<row>-<column>[-<detail>]`` every case follows, the constructors of the CPU and the
``CudaBackend`` case tables, and the message patterns several tables share."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from gpu_runtime import CudaBackend

if TYPE_CHECKING:
    from tests.bad_inputs.offline import Target
    from tests.bad_inputs.world import World

# Matrix rows (test-id prefix, table label) and columns (test-id part, table header) of docs/BAD_INPUT.md.
ROWS = [
    ("CudaBackend.alloc", "`CudaBackend.alloc` / `free`"),
    ("CudaBackend.memset", "`CudaBackend.memset`"),
    ("CudaBackend.copy", "`CudaBackend.copy_h2d_async` / `copy_d2h`"),
    ("CudaBackend.copy_d2d", "`CudaBackend.copy_d2d_async` / `copy_2d_async`"),
    ("CudaBackend.pinned", "`CudaBackend.alloc_host` / `free_host` / `upload_pinned_async`"),
    ("CudaBackend.handles", "`CudaBackend` streams, events, graphs"),
    ("CudaBackend.kernel", "`CudaBackend.kernel`"),
    ("CudaBackend.tensor_map", "`CudaBackend.tensor_map_2d`"),
    ("KernelLaunch", "`KernelLaunch`"),
    ("batched_embed", "`batched_embed`"),
    ("batched_embed_fp8", "`batched_embed_fp8`"),
    ("embed_from_argmax", "`embed_from_argmax`"),
    ("scaled_add", "`scaled_add`"),
    ("residual_add", "`residual_add`"),
    ("dense_gemm_bf16_pipelined", "`dense_gemm_bf16_pipelined`"),
    ("dense_gemm_bf16_word", "`dense_gemm_bf16_word`"),
    ("dense_gemm_fp8w", "`dense_gemm_fp8w`"),
    ("embed_rowdiff", "`embed_rowdiff`"),
    ("embed_overlay_routed", "`embed_overlay_routed`"),
    ("lmhead_overlay_routed", "`lmhead_overlay_routed`"),
    ("scatter_rows", "`scatter_rows`"),
    ("ngram_gather", "`ngram_gather`"),
    ("NgramDims", "`NgramDims`"),
    ("ngram_ids", "`ngram_ids` / `ngram_ids_tail`"),
    ("layers.reference", "`layers.reference` (the numpy references)"),
    ("NgramWeights", "`NgramWeights(...)` / `own`"),
    ("NgramWeights.from_numpy", "`NgramWeights.from_numpy` / `from_safetensors`"),
    ("NgramWeights.from_pretrained", "`NgramWeights.from_pretrained`"),
    ("NgramCheckpoint", "`NgramCheckpoint` arrays"),
    ("NgramEmbedding", "`NgramEmbedding(...)`"),
    ("NgramEmbedding.embed", "`NgramEmbedding.embed`"),
    ("FusedNgramEmbedding", "`FusedNgramEmbedding(...)`"),
    ("FusedNgramEmbedding.embed", "`FusedNgramEmbedding.embed` / `embed_batch`"),
    ("NgramDecoder", "`NgramDecoder(...)`"),
    ("NgramDecoder.calls", "`NgramDecoder.prefill` / `step` / `seed` / `fork` / `rollback` / `reset`"),
    ("embed_all", "`embed_all`"),
    ("overlay_from_peft", "`overlay_from_peft`"),
    ("RowCache", "`RowCache(...)`"),
    ("RowCache.resolve", "`RowCache.resolve` / `prefetch`"),
    ("TableFile", "`TableFile(...)` / `read_rows`"),
    ("TableWriter", "`TableWriter(...)` / `append`"),
    ("build_overlay", "`build_overlay`"),
    ("overlay_from_trainable_tokens", "`overlay_from_trainable_tokens`"),
    ("OverlaySlots", "`OverlaySlots(...)` / `load` / `replace` / `evict`"),
    ("OverlaySlots.hooks", "`OverlaySlots.embed_overlay` / `lmhead_overlay`"),
    ("EngramConfig", "`EngramConfig.from_dict` / `from_pretrained`"),
    ("TokenMap", "`TokenMap(...)` / `load` / `save` / `check` / `pad`"),
    ("EngramCheckpoint", "`EngramCheckpoint.open` and its arrays"),
    ("EngramWeights", "`EngramWeights.from_arrays` / `from_checkpoint`"),
    ("EngramDecoder", "`EngramDecoder(...)`"),
    ("EngramDecoder.calls",
     "`EngramDecoder.prefill` / `step` / `seed` / `apply` / `fork` / `rollback` / `reset`"),
    ("lookup_all", "`lookup_all`"),
    ("layers.reference.engram", "`layers.reference.engram` (the Engram references)"),
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

NULL = "null device pointer"
GPU_TYPE = r"gpu must be a GpuBackend \(gpu_runtime\.CudaBackend\), got"  # then the value: str 'cpu'
COUNT = r"must be in 0\.\.2\*\*32-1"


def param(row: str, column: str, detail: str, values: tuple, xfail: str | None) -> Any:
    """One case of any table: its values, the id ``row-column[-detail]``, strict xfail if a gap."""
    assert row in ROW_KEYS and column in COLUMN_KEYS, (row, column)
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(*values, id=f"{row}-{column}" + (f"-{detail}" if detail else ""), marks=marks)


def case(row: str, column: str, fn: Callable[[World], Any], exc: type[BaseException] | None = None,
         match: str | None = None, *, detail: str = "", temp: bool = False, needs: tuple[str, ...] = (),
         after: Callable[[World], None] | None = None, xfail: str | None = None) -> Any:
    """One CPU refusal (``exc`` and ``match``) or no-op (``exc=None``) of ``fn(world)``. ``temp``:
    the call may upload to temporaries it frees before raising (only the memory that existed
    before is compared, and nothing may leak); ``needs``: world subjects to build before the
    snapshot; ``after``: the good call to make afterwards, instead of the row's."""
    return param(row, column, detail, (row, fn, exc, match, temp, needs, after), xfail)


def cuda(row: str, column: str, fn: Callable[[CudaBackend, Target], Any],
         exc: type[BaseException] | None = None, match: str | None = None, *, detail: str = "",
         gpu_only: bool = False, xfail: str | None = None) -> Any:
    """One ``CudaBackend`` case, ``fn(backend, target)``: offline on CPU unless ``gpu_only`` (it
    needs the driver's answer), and on the device."""
    return param(row, column, detail, (fn, exc, match, gpu_only), xfail)


def expect(condition: bool) -> None:
    """An assertion usable inside a case's or a good call's lambda."""
    assert condition
