"""Launcher of ``kernels/ngram_fused.cu``: hash every n-gram table's id on the GPU and gather all
``T`` rows of each output row into one ``[R, T*td]`` bf16 buffer.

Device inputs, built on the host:

* ``windows [R, N]`` u32: ``windows[r, d]`` is the token ``d`` positions before output row r's
  token (``d = 0`` is the token itself), ``NO_TOKEN`` before the context start.
* ``tables [T, 4]`` u64 per table: data address, scale address (0: bf16 rows; else e4m3 rows
  with one f32 scale per row), rows ``M_c`` (the hash modulus), flags (``CACHED``: the row is
  ``slots[r*T + c]`` instead of the hash; ``ABSENT``: another rank holds the table, the row is
  written as zeros).
* ``pows [T, N]`` u64: ``V**d mod M_c``.
"""

from __future__ import annotations

from gpu_runtime import GpuBackend, KernelHandle, validate

from .gemm_plan import SMS
from .specs import NGRAM_GATHER

NO_TOKEN = 0xFFFFFFFF  # a window entry before the context start
NO_EOS = 0xFFFFFFFF  # the kernel's eos argument when the dims have no eos_id
CACHED = 1  # flags bit 0 of a table entry: the row index is the slot, not the hash
ABSENT = 2  # flags bit 1: another rank holds the table (tensor parallelism): its rows are zeros

_BLOCK = (256, 1, 1)  # 8 warps, one (row, table) pair each
_PAIRS_PER_BLOCK = 256 // 32
_BLOCKS_PER_SM = 2048 // 256  # of _BLOCK, resident at once
_MAX_BLOCKS = 4 * SMS * _BLOCKS_PER_SM  # pairs are grid-strided past this: four waves of an H100/H200
_GRID_X_MAX = 2**31 - 1


def pair_launch(gpu: GpuBackend, pairs: int, host_tables: bool) -> tuple[tuple[int, int, int], int]:
    """(grid, dynamic shared memory) of either gather over ``pairs`` (row, table) pairs: one warp
    a pair, taken in table-major order, the warps striding over what the grid does not cover.

    Device tables: a grid of at most ``_MAX_BLOCKS``. Tables in host memory (``host_tables``), once
    the pairs outnumber what the GPU holds at once: one pair a warp, one block an SM. Blocks start
    in order, so the pairs in flight stay one window that moves through the tables; a capped
    grid's warps drift apart and read many tables at once, beyond the GPU's TLB reach over mapped
    host memory (21 against 34 GB/s at an 8192-token prefill, NOTES.md). The kernels use no
    dynamic shared memory: asking for over half of what an SM has (a block's opt-in maximum, about
    an SM's, halved, plus 1 KiB) keeps a second block off the SM.
    """
    blocks = -(-pairs // _PAIRS_PER_BLOCK)
    if host_tables and blocks > getattr(gpu, "sm_count", SMS) * _BLOCKS_PER_SM:
        optin = int(getattr(gpu, "max_shared_optin", 0))
        return (min(blocks, _GRID_X_MAX), 1, 1), optin // 2 + 1024 if optin else 0
    return (min(blocks, _MAX_BLOCKS), 1, 1), 0


def ngram_gather(
    gpu: GpuBackend,
    kernel: KernelHandle,
    windows: int,
    tables: int,
    pows: int,
    slots: int,
    out: int,
    ids_out: int,
    rows: int,
    num_tables: int,
    max_ngram: int,
    splits: int,
    table_dim: int,
    eos: int | None,
    stream: int,
    host_tables: bool = False,
) -> None:
    """``out[r, c*td:(c+1)*td] = row id_c(r) of table c`` for every output row ``r < rows`` and
    table ``c < num_tables``, fp8 rows dequantised and rounded once to bf16; the ids also go to
    ``ids_out [rows, T]`` unless it is 0. ``slots [rows, T]`` may be 0 when no table is cached.
    ``host_tables``: some table is in host memory (the launch's shape, ``pair_launch``).
    ``rows == 0`` launches nothing.

    The kernel cannot see table sizes or slot ranges: every hashed table must have
    ``1 <= M_c < 2**32`` rows and every slot of a cached table must be one of its rows.
    """
    rows = validate.u32(rows, "ngram_gather rows")
    host_tables = validate.boolean(host_tables, "ngram_gather host_tables")
    num_tables, max_ngram, splits, table_dim, eos = check_tables(
        "ngram_gather", num_tables, max_ngram, splits, table_dim, eos
    )
    if rows == 0:
        return
    grid, shared = pair_launch(gpu, rows * num_tables, host_tables)
    args = dict(locals(), rows_r=rows, td=table_dim)
    NGRAM_GATHER.launch_from(gpu, kernel, grid, _BLOCK, stream, args, shared_mem=shared)


def check_tables(
    name: str, num_tables: int, max_ngram: int, splits: int, table_dim: int, eos: int | None
) -> tuple[int, int, int, int, int]:
    """The tables' arguments of both gathers (this one and ``ngram_decode_gather``), checked:
    u32s with ``max_ngram >= 2``, ``splits >= 1``, ``num_tables == splits * (max_ngram - 1)`` and
    ``table_dim >= 1``; ``eos`` as the kernel's word (``eos_arg``)."""
    num_tables = validate.u32(num_tables, f"{name} num_tables")
    max_ngram = validate.u32(max_ngram, f"{name} max_ngram")
    splits = validate.u32(splits, f"{name} splits")
    table_dim = validate.u32(table_dim, f"{name} table_dim")
    eos_word = eos_arg(eos)
    if max_ngram < 2:
        raise ValueError(f"{name}: max_ngram must be >= 2, got {max_ngram}")
    if splits < 1:
        raise ValueError(f"{name}: splits must be >= 1, got {splits}")
    if num_tables != splits * (max_ngram - 1):
        raise ValueError(f"{name}: num_tables {num_tables} != splits * (max_ngram - 1) = {splits} * {max_ngram - 1}")
    if table_dim < 1:
        raise ValueError(f"{name}: table_dim must be >= 1, got {table_dim}")
    return num_tables, max_ngram, splits, table_dim, eos_word


def eos_arg(eos: int | None) -> int:
    """The kernel's eos word: ``NO_EOS`` for None. A real eos must differ from ``NO_EOS``, which
    the kernel cannot tell apart from "no eos" (harmless: both end the look-back)."""
    if eos is None:
        return NO_EOS
    eos = validate.u32(eos, "eos")
    if eos == NO_EOS:
        raise ValueError(f"ngram_gather: eos {eos} is the reserved 'no eos' value 0xFFFFFFFF")
    return eos
