"""Launcher of ``kernels/ngram_fused.cu``: hash every n-gram table's id on the GPU and gather all
``T`` rows of each output row into one ``[R, T*td]`` bf16 buffer.

Device inputs, built on the host:

* ``windows [R, N]`` u32: ``windows[r, d]`` is the token ``d`` positions before output row r's
  token (``d = 0`` is the token itself), ``NO_TOKEN`` before the context start.
* ``tables [T, 4]`` u64 per table: data address, scale address (0: bf16 rows; else e4m3 rows
  with one f32 scale per row), rows ``M_c`` (the hash modulus), flags (``CACHED``: the row is
  ``slots[r*T + c]`` instead of the hash).
* ``pows [T, N]`` u64: ``V**d mod M_c``.
"""

from __future__ import annotations

from gpu_runtime import GpuBackend, KernelHandle, KernelLaunch

from .checks import require_count, require_ptr

NO_TOKEN = 0xFFFFFFFF  # a window entry before the context start
NO_EOS = 0xFFFFFFFF  # the kernel's eos argument when the dims have no eos_id
CACHED = 1  # flags bit 0 of a table entry: the row index is the slot, not the hash

_BLOCK = 256  # 8 warps, one (row, table) pair each
_PAIRS_PER_BLOCK = _BLOCK // 32
_MAX_BLOCKS = 4 * 132 * 8  # pairs are grid-strided past this: plenty to fill an H100/H200


def ngram_gather(gpu: GpuBackend, kernel: KernelHandle, windows: int, tables: int, pows: int,
                 slots: int, out: int, ids_out: int, rows: int, num_tables: int, max_ngram: int,
                 splits: int, table_dim: int, eos: int | None, stream: int) -> None:
    """``out[r, c*td:(c+1)*td] = row id_c(r) of table c`` for every output row ``r < rows`` and
    table ``c < num_tables``, fp8 rows dequantised and rounded once to bf16; the ids also go to
    ``ids_out [rows, T]`` unless it is 0. ``slots [rows, T]`` may be 0 when no table is cached.

    The kernel cannot see table sizes or slot ranges: every hashed table must have
    ``1 <= M_c < 2**32`` rows and every slot of a cached table must be one of its rows.
    """
    rows = require_count(rows, "rows")
    num_tables = require_count(num_tables, "num_tables")
    max_ngram = require_count(max_ngram, "max_ngram")
    splits = require_count(splits, "splits")
    table_dim = require_count(table_dim, "table_dim")
    eos_word = eos_arg(eos)
    if max_ngram < 2:
        raise ValueError(f"ngram_gather: max_ngram must be >= 2, got {max_ngram}")
    if splits < 1:
        raise ValueError(f"ngram_gather: splits must be >= 1, got {splits}")
    if num_tables != splits * (max_ngram - 1):
        raise ValueError(f"ngram_gather: num_tables {num_tables} != splits * (max_ngram - 1) = "
                         f"{splits} * {max_ngram - 1}")
    if table_dim < 1:
        raise ValueError(f"ngram_gather: table_dim must be >= 1, got {table_dim}")
    for ptr, what in ((windows, "windows"), (tables, "tables"), (pows, "pows"), (out, "out")):
        require_ptr(ptr, f"ngram_gather {what}")
    if rows == 0:
        return
    blocks = min(-(-rows * num_tables // _PAIRS_PER_BLOCK), _MAX_BLOCKS)
    (KernelLaunch(gpu, kernel).grid([blocks, 1, 1]).block([_BLOCK, 1, 1])
     .arg_ptr(windows).arg_ptr(tables).arg_ptr(pows).arg_ptr(slots).arg_ptr(out).arg_ptr(ids_out)
     .arg_u32(rows).arg_u32(num_tables).arg_u32(max_ngram).arg_u32(splits).arg_u32(table_dim)
     .arg_u32(eos_word).launch(stream))


def eos_arg(eos: int | None) -> int:
    """The kernel's eos word: ``NO_EOS`` for None. A real eos must differ from ``NO_EOS``, which
    the kernel cannot tell apart from "no eos" (harmless: both end the look-back)."""
    if eos is None:
        return NO_EOS
    eos = require_count(eos, "eos")
    if eos == NO_EOS:
        raise ValueError(f"ngram_gather: eos {eos} is the reserved 'no eos' value 0xFFFFFFFF")
    return eos

