"""``EngramLaunches``: ``kernels/engram.cu``'s lookup (hash, gather, dequantisation, history
update) and the shared history kernels, planned over one Engram runner; ``EngramGate``: its gate.

The lookup's state and tables are bound at construction (the kernel's comment has their layouts):
the histories (``token_history``: an entry is a token's compressed id, ``TokenCode``), ``ctrl``,
the token map, the hash's multipliers ``[L, N]``, primes and offsets ``[L, C]`` (u64), the table
descriptors ``[L, 4]``, ``emb [L, max_rows, C*W]`` bf16 and ``text_out [max_rows]`` u8. Each call
passes what changes: its tokens, sequences, slots and text mask.
"""

from __future__ import annotations

import functools

from gpu_runtime import GpuBackend, LaunchConfig, validate

from ..kernel_files import load_kernel
from .ngram_fused import PairLaunch
from .token_history import HistoryLaunches, TokenCode

MODULE = "engram"
LOOKUP = "engram_lookup"
ROW_IDS = "engram_row_ids"
STAGED_ROWS = "engram_staged_rows"
GATE = "engram_gate"
MAX_NGRAM = 32  # a lane per look-back entry
GATE_THREADS = 256


class EngramLaunches(HistoryLaunches):
    """The lookup and the history kernels over one runner's device state (module docstring):
    ``layers`` tables of ``width``-column rows (packed: ``width`` fp8 bytes and ``width // 32``
    e8m0 bytes in ``stride`` bytes), hashed over ``max_ngram`` look-back entries and ``heads``
    heads; ``host_tables``: a table is in host memory (``PairLaunch``). The calls trust their
    arguments: the runner checks them first."""

    def __init__(
        self,
        gpu: GpuBackend,
        hist: int,
        state: int,
        ctrl: int,
        *,
        max_seqs: int,
        hist_len: int,
        max_draft: int,
        code: TokenCode,
        pad: int,
        mult: int,
        primes: int,
        offsets: int,
        tables: int,
        emb: int,
        text_out: int,
        max_rows: int,
        layers: int,
        max_ngram: int,
        heads: int,
        width: int,
        stride: int,
        host_tables: bool = False,
    ) -> None:
        super().__init__(gpu, hist, state, ctrl, max_seqs=max_seqs, hist_len=hist_len, max_draft=max_draft, code=code)
        self.lookup_kernel = gpu.bind(load_kernel(gpu, MODULE, LOOKUP))
        self.row_ids_kernel = gpu.bind(load_kernel(gpu, MODULE, ROW_IDS))
        self.staged_rows_kernel = gpu.bind(load_kernel(gpu, MODULE, STAGED_ROWS))
        sizes = {"max_rows": max_rows, "layers": layers, "max_ngram": max_ngram, "heads": heads, "width": width}
        for name, value in sizes.items():
            if validate.u32(value, f"{LOOKUP} {name}") < 1:
                raise ValueError(f"{LOOKUP}: {name} must be >= 1, got {value}")
        if not 2 <= max_ngram <= MAX_NGRAM or hist_len < max_ngram - 1:
            raise ValueError(
                f"{LOOKUP}: max_ngram in 2..{MAX_NGRAM} and hist_len >= max_ngram - 1; got {max_ngram}, {hist_len}"
            )
        if width % 32 or validate.u32(stride, f"{LOOKUP} stride") % 8 or stride < width + width // 32:
            raise ValueError(
                f"{LOOKUP}: width a multiple of 32 and stride a multiple of 8 >= width * 33 / 32; got {width}, {stride}"
            )
        pointers = (mult, primes, offsets, tables, emb, text_out)
        validate.pointers(LOOKUP, "mult primes offsets tables emb text_out", *pointers)
        self.cols = (max_ngram - 1) * heads
        self.layers = layers
        self.launches = PairLaunch(gpu, host_tables)
        self.device_launches = PairLaunch(gpu, False)  # the staged halves read no host table by row
        self.tables, self.emb, self.text_out = tables, emb, text_out
        self.max_rows, self.width, self.stride = max_rows, width, stride
        self._hash = (self.hist, self.state, code.map, mult, primes, offsets, tables)
        self._state = (*self._hash, emb, text_out, self.ctrl)
        self._hash_sizes = (
            self.max_seqs,
            self.hist_len,
            code.vocab,
            code.dead,
            validate.u32(pad, f"{LOOKUP} pad"),
            layers,
            max_ngram,
            heads,
        )
        self._sizes = (max_rows, *self._hash_sizes, width, stride)

    def lookup(
        self, tokens: int, cu_seqlens: int, slots: int, text: int, rows: int, num_seqs: int, per_seq: int, stream: int
    ) -> None:
        """Hash, gather and dequantise every layer's rows of ``rows >= 1`` tokens (ragged by
        ``cu_seqlens [num_seqs + 1]``, or ``per_seq`` each when ``cu_seqlens`` is 0; ``text``: a u8
        ``[rows]`` text mask or 0) into ``emb``, their text flags into ``text_out``, then append each
        sequence's tokens to the history of ``slots[s]``."""
        self.lookup_kernel.launch(
            self.launches.config(rows * self.layers * self.cols),
            stream,
            tokens,
            cu_seqlens,
            slots,
            text,
            *self._state,
            rows,
            num_seqs,
            per_seq,
            *self._sizes,
        )

    def row_ids(
        self,
        tokens: int,
        cu_seqlens: int,
        slots: int,
        text: int,
        rows: int,
        num_seqs: int,
        per_seq: int,
        ids: int,
        gen: int,
        stream: int,
    ) -> None:
        """``lookup``'s first half for a staged call: each item's row to ``ids`` (u64 ``[1 +
        layers * rows * C]``, header first) and the call's number to ``gen`` (a u32 the calls
        share); text flags, error bits and the histories as ``lookup``."""
        self.row_ids_kernel.launch(
            self.device_launches.config(rows * self.layers * self.cols),
            stream,
            tokens,
            cu_seqlens,
            slots,
            text,
            *self._hash,
            ids,
            gen,
            self.text_out,
            self.ctrl,
            rows,
            num_seqs,
            per_seq,
            *self._hash_sizes,
        )

    def staged_rows(
        self,
        ids: int,
        staged: int,
        gen: int,
        ready: int,
        rows: int,
        r0: int,
        r1: int,
        chunk: int,
        staged_layers: int,
        stream: int,
    ) -> None:
        """``lookup``'s second half over rows ``r0 < r1`` (chunk ``chunk`` of a staged call of
        ``rows``): every item's row into ``emb``; layer l's from ``staged`` where bit l of
        ``staged_layers`` is set, else from its table."""
        self.staged_rows_kernel.launch(
            self.device_launches.config((r1 - r0) * self.layers * self.cols),
            stream,
            ids,
            staged,
            self.tables,
            gen,
            ready,
            self.ctrl,
            self.emb,
            rows,
            r0,
            r1,
            chunk,
            self.max_rows,
            self.layers,
            self.cols,
            self.width,
            self.stride,
            staged_layers,
        )


@functools.cache
def _gate_config(blocks: int) -> LaunchConfig:
    return LaunchConfig(blocks, GATE_THREADS)


class EngramGate:
    """``engram_gate`` over one layer's weights: ``q``, ``k`` ``[hc, dim]`` bf16, ``eps``."""

    def __init__(self, gpu: GpuBackend, q: int, k: int, *, hc: int, dim: int, eps: float) -> None:
        self.kernel = gpu.bind(load_kernel(gpu, MODULE, GATE))
        validate.pointers(GATE, "q k", q, k)
        self.hc, self.dim = validate.u32(hc, f"{GATE} hc"), validate.u32(dim, f"{GATE} dim")
        if self.hc < 1 or self.dim < 1:
            raise ValueError(f"{GATE}: hc and dim must be >= 1, got {hc}, {dim}")
        self.q, self.k, self.eps = q, k, validate.real32(eps, f"{GATE} eps")
        self.kv_stride = (self.hc + 1) * self.dim

    def run(self, x: int, kv: int, text: int, rows: int, stream: int) -> None:
        """``x [rows, hc, dim]`` bf16 gated in place from ``kv [rows, (hc + 1) * dim]`` where
        ``text [rows]`` (u8) is set; ``rows >= 1``."""
        self.kernel.launch(
            _gate_config(rows * self.hc),
            stream,
            x,
            kv,
            self.q,
            self.k,
            text,
            rows,
            self.hc,
            self.dim,
            self.kv_stride,
            self.eps,
        )
