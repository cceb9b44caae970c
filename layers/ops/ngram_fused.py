"""Launcher of ``kernels/ngram_fused.cu``: hash every n-gram table's id on the GPU and gather all
``T`` rows of each output row into one ``[R, T*td]`` bf16 buffer (td: the table width).

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

from gpu_runtime import GpuBackend, KernelHandle, LaunchConfig, PreparedLaunch, validate

from .gemm_plan import SMS

NO_TOKEN = 0xFFFFFFFF  # a window entry before the context start
NO_EOS = 0xFFFFFFFF  # the kernel's eos argument when the dims have no eos_id
CACHED = 1  # flags bit 0 of a table entry: the row index is the slot, not the hash
ABSENT = 2  # flags bit 1: another rank holds the table (tensor parallelism): its rows are zeros

_THREADS = 256  # 8 warps, one (row, table) pair each
_PAIRS_PER_BLOCK = _THREADS // 32
_BLOCKS_PER_SM = 2048 // _THREADS  # resident at once
_MAX_BLOCKS = 4 * SMS * _BLOCKS_PER_SM  # pairs are grid-strided past this: four waves of an H100/H200
_GRID_X_MAX = 2**31 - 1


class PairLaunch:
    """The launches of either gather (this one and ``ngram_decode_gather``) on ``gpu``, by the
    number of (row, table) pairs: one warp a pair, taken in table-major order, the warps striding
    over what the grid does not cover.

    Device tables: a grid of at most ``_MAX_BLOCKS``. Tables in host memory (``host_tables``),
    once the pairs outnumber what the GPU holds at once: one pair a warp, one block an SM. Blocks
    start in order, so the pairs in flight stay one window that moves through the tables; a
    capped grid's warps drift apart and read many tables at once (NOTES.md). The kernels use no
    dynamic shared memory: asking for over half of what an SM has (a block's opt-in maximum,
    about an SM's, halved, plus 1 KiB) keeps a second block off the SM."""

    def __init__(self, gpu: GpuBackend, host_tables: bool) -> None:
        self.host_tables = validate.boolean(host_tables, "host_tables")
        self.resident = int(getattr(gpu, "sm_count", SMS)) * _BLOCKS_PER_SM
        optin = int(getattr(gpu, "max_shared_optin", 0))
        self.one_per_sm = optin // 2 + 1024 if optin else 0
        self._configs: dict[int, LaunchConfig] = {}

    def config(self, pairs: int) -> LaunchConfig:
        """The launch over ``pairs >= 1`` pairs (made once per count)."""
        config = self._configs.get(pairs)
        if config is None:
            blocks = -(-pairs // _PAIRS_PER_BLOCK)
            if self.host_tables and blocks > self.resident:
                config = LaunchConfig(min(blocks, _GRID_X_MAX), _THREADS, self.one_per_sm)
            else:
                config = LaunchConfig(min(blocks, _MAX_BLOCKS), _THREADS)
            if len(self._configs) >= 4096:
                self._configs.clear()
            self._configs[pairs] = config
        return config


class NgramGather:
    """``ngram_gather`` planned over one set of tables: ``tables [T, 4]`` u64 descriptors and
    ``pows [T, N]`` (laid out in the module docstring), with the dims' table count, n-gram order,
    splits, row width and eos (None: none); ``host_tables``: some table is in host memory
    (``PairLaunch``).

    ``run`` writes ``out[r, c*td:(c+1)*td] = row id_c(r) of table c`` for every output row
    ``r < rows`` and table ``c``, fp8 rows dequantised and rounded once to bf16, and the ids to
    ``ids_out [rows, T]`` unless it is 0. ``slots [rows, T]`` may be 0 when no table is cached.
    The kernel cannot see table sizes or slot ranges: every hashed table must have
    ``1 <= M_c < 2**32`` rows and every slot of a cached table must be one of its rows."""

    def __init__(
        self,
        gpu: GpuBackend,
        kernel: KernelHandle,
        tables: int,
        pows: int,
        num_tables: int,
        max_ngram: int,
        splits: int,
        table_dim: int,
        eos: int | None,
        host_tables: bool = False,
    ) -> None:
        what = "ngram_gather"
        self.kernel = gpu.bind(kernel)
        self.tables, self.pows = validate.pointer(tables, f"{what} tables"), validate.pointer(pows, f"{what} pows")
        self.dims = check_tables(what, num_tables, max_ngram, splits, table_dim, eos)
        self.launches = PairLaunch(gpu, host_tables)

    def run(self, windows: int, slots: int, out: int, ids_out: int, rows: int, stream: int) -> None:
        """One launch over ``rows`` rows of ``windows [rows, N]``; ``rows == 0`` launches nothing."""
        if validate.u32(rows, "ngram_gather rows") == 0:
            return
        self._check(windows, out)
        config = self.launches.config(rows * self.dims[0])
        self.kernel.launch(config, stream, windows, self.tables, self.pows, slots, out, ids_out, rows, *self.dims)

    def prepare(self, windows: int, slots: int, out: int, ids_out: int, rows: int) -> PreparedLaunch:
        """``run``'s launch for ``rows >= 1`` rows, prepared once (a runner's fixed buffers)."""
        if validate.u32(rows, "ngram_gather rows") == 0:
            raise ValueError("ngram_gather: a prepared launch needs rows >= 1")
        self._check(windows, out)
        config = self.launches.config(rows * self.dims[0])
        return self.kernel.prepare(config, windows, self.tables, self.pows, slots, out, ids_out, rows, *self.dims)

    @staticmethod
    def _check(windows: int, out: int) -> None:
        validate.pointers("ngram_gather", "windows out", windows, out)


def check_tables(
    name: str, num_tables: int, max_ngram: int, splits: int, table_dim: int, eos: int | None
) -> tuple[int, int, int, int, int]:
    """The tables' arguments of both gathers (this one and ``ngram_decode_gather``), checked:
    u32s with ``max_ngram >= 2``, ``splits >= 1``, ``num_tables == splits * (max_ngram - 1)`` and
    ``table_dim >= 1``; ``eos`` as the kernel's word (``eos_arg``). Returns them in the kernels'
    order: (num_tables, max_ngram, splits, table_dim, eos word)."""
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
