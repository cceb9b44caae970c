"""Launcher of ``gemm.cu``'s fp8-weight GEMM: ``c[m,n] = a[m,k] @ W^T`` for an e4m3 weight with
e8m0 32 x 32 block scales (a ``BlockFp8Weight``), ``W = bf16(f32(w) * 2^(scale - 127))``.

Each weight is used as the bf16 value ``dequant_weight(w, scale, 32, bfloat16)`` holds; fp32
accumulation, one rounding to bf16: the bf16 GEMM over that weight, up to the order of the sums.

Paths (``path=`` forces one; None: fp8w):
- ``fp8w``  ``dense_gemm_fp8w``, one launch per 64 rows of a: k is cut in slabs (``slab_k``), the
  CTAs share out the (slab, 32-row block of w) items, each holds its slab of a in shared memory and
  streams w once; several slabs' partial sums meet in a ``workspace`` (``workspace_bytes``).
  ``batch_invariant=True`` takes the slab of 64 rows for every m, so each row's bits do not depend
  on m (or on the other rows).
- ``simt``  ``dense_gemm_fp8w_simt``: one output per thread (a check on the other).
The constants mirror gemm.cu's ``kFp8*`` (a CPU test compares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_runtime import GpuBackend, KernelHandle, LaunchConfig, PreparedLaunch, validate

from ..block_fp8_weight import BLOCK, BlockFp8Weight
from ..kernel_files import load_kernel
from .gemm import checked_operands
from .gemm_plan import SMS, THREADS

MODULE = "gemm"
KERNEL = "dense_gemm_fp8w"
SIMT = "dense_gemm_fp8w_simt"
PATHS = ("fp8w", "simt")
MAX_ROWS = 64  # rows of a one launch takes (gemm.cu: kFp8MaxRows)
CHUNK = 64  # k per w stage; a slab is a multiple of it (kFp8Chunk)
RING_BYTES = 98304  # the w rings' shared memory (kFp8RingBytes)
MAX_SLAB = 8192  # k a slab holds at most (kFp8MaxSlab)
SMEM_OPTIN = 232448  # a block's shared memory on sm_90 when the backend does not say
SIMT_BLOCKS_MAX = 1 << 16  # the simt kernel strides over the rest


def _cdiv(x: int, d: int) -> int:
    return -(-x // d)


def tiles(rows: int) -> int:
    """n8 tiles of a rows a launch of ``rows`` rows (1 to 64) holds: 1, 2, 4 or 8 (``fp8w_nt``)."""
    return 1 if rows <= 8 else 2 if rows <= 16 else 4 if rows <= 32 else 8


def pitch(ks: int) -> int:
    """Bytes between two rows of a slab of ``ks`` k in shared memory (``fp8w_pitch``)."""
    return 2 * ks + 16


def smem(rows: int, ks: int) -> int:
    """The shared memory of a launch of ``rows`` rows over slabs of ``ks`` (``fp8w_smem``)."""
    return RING_BYTES + 8 * tiles(rows) * pitch(ks)


def slab_k(k: int, rows: int, optin: int = SMEM_OPTIN) -> int:
    """The slab width for ``rows`` rows: as few slabs as the shared memory ``optin`` holds (at most
    ``MAX_SLAB`` k each), then equal widths, a multiple of ``CHUNK``."""
    widest = min(MAX_SLAB, ((optin - RING_BYTES) // (8 * tiles(rows)) - 16) // 2 // CHUNK * CHUNK)
    if widest < CHUNK:
        raise ValueError(f"{KERNEL}: {optin} bytes of shared memory hold no slab of {rows} rows")
    slabs = _cdiv(k, widest)
    return _cdiv(_cdiv(k, slabs), CHUNK) * CHUNK


def shared_optin(gpu: GpuBackend) -> int:
    """The shared memory a block may opt in to on ``gpu`` (``SMEM_OPTIN`` where the backend does
    not say): what ``slab_k`` and ``workspace_bytes`` take as ``optin``."""
    return int(getattr(gpu, "max_shared_optin", 0)) or SMEM_OPTIN


def _counter_bytes(n: int) -> int:
    """The workspace's counters, one u32 per 32 columns, padded to 256 bytes: the partials follow."""
    return _cdiv(_cdiv(n, BLOCK) * 4, 256) * 256


def workspace_bytes(n: int, k: int, optin: int = SMEM_OPTIN) -> int:
    """The bytes of the workspace every launch over ``n x k`` needs where k takes several slabs
    (0 where it never does): ``ceil(n / 32)`` u32 counters (zero before the first launch; each
    launch leaves them zero), padded to 256 bytes, then ``[slabs][64][n]`` fp32 partial sums."""
    slabs = _cdiv(k, slab_k(k, MAX_ROWS, optin))
    if slabs <= 1:
        return 0
    return _counter_bytes(n) + slabs * MAX_ROWS * n * 4


@dataclass(frozen=True)
class Fp8wLaunch:
    """A planned fp8-weight GEMM: its launches, one per 64 rows of a, run in order on a stream."""

    launches: tuple[PreparedLaunch, ...]

    def run(self, stream: int) -> None:
        for launch in self.launches:
            launch.run(stream)


def _check(
    gpu: GpuBackend, kernel: KernelHandle, w: BlockFp8Weight, m: int, n: int, k: int, path: str | None
) -> tuple[int, int, int]:
    """Every check but the pointers'; returns (m, n, k) as ints."""
    m, n, k = checked_operands(KERNEL, gpu, kernel, w, BlockFp8Weight, m, n, k)
    if w.shape != (n, k):  # the weight's own check: k % 32 == 0
        raise ValueError(f"{KERNEL}: w shape {w.shape}, expected (n, k) = {(n, k)}")
    if path is not None and path not in PATHS:
        raise ValueError(f"{KERNEL}: unknown path {path!r}; one of {PATHS} or None")
    return m, n, k


def plan_fp8w_gemm(
    gpu: GpuBackend,
    kernel: KernelHandle,
    a: int,
    w: BlockFp8Weight,
    c: int,
    m: int,
    n: int,
    k: int,
    *,
    workspace: int = 0,
    batch_invariant: bool = False,
    path: str | None = None,
    overlap: bool = False,
) -> Fp8wLaunch | None:
    """``dense_gemm_fp8w``'s launches for these operands, checked, worked out and prepared once
    (``overlap=True``: the first is a programmatic dependent launch); None where m, n or k is 0.
    ``workspace``: a device buffer of ``workspace_bytes(n, k)`` bytes, this plan's alone while it
    runs (where that is 0, none is needed)."""
    m, n, k = _check(gpu, kernel, w, m, n, k, path)
    overlap = validate.boolean(overlap, "overlap")
    batch_invariant = validate.boolean(batch_invariant, "batch_invariant")
    if not (m and n and k):
        return None
    return _prepare(gpu, kernel, a, w, c, m, n, k, workspace, batch_invariant, path, overlap)


def _prepare(
    gpu: GpuBackend,
    kernel: KernelHandle,
    a: int,
    w: BlockFp8Weight,
    c: int,
    m: int,
    n: int,
    k: int,
    workspace: int,
    batch_invariant: bool,
    path: str | None,
    overlap: bool,
) -> Fp8wLaunch:
    """The launches on checked sizes: the fp8w kernel (``kernel``), a CTA per SM at most, per 64
    rows of a; or the simt kernel with a thread per output."""
    validate.pointers(KERNEL, "a w.weight w.scale c", a, w.weight, w.scale, c)
    a, c = validate.pointer(a, f"{KERNEL} a"), validate.pointer(c, f"{KERNEL} c")  # (added to below: ints)
    workspace = validate.pointer(workspace, f"{KERNEL} workspace", nullable=True)
    if workspace % 4:
        raise ValueError(f"{KERNEL}: the workspace must be 4-byte aligned, got {workspace:#x}")
    if path == "simt":
        bound = gpu.bind(load_kernel(gpu, MODULE, SIMT))  # (a closed backend refuses here)
        config = LaunchConfig(min(_cdiv(m * n, THREADS), SIMT_BLOCKS_MAX), THREADS, 0, overlap=overlap)
        return Fp8wLaunch((bound.prepare(config, a, w.weight, w.scale, c, m, n, k),))
    bound = gpu.bind(kernel)
    optin = shared_optin(gpu)
    sms = int(getattr(gpu, "sm_count", SMS))
    need = workspace_bytes(n, k, optin)
    counters, work = int(workspace), int(workspace) + _counter_bytes(n)
    launches = []
    for row0 in range(0, m, MAX_ROWS):
        rows = min(MAX_ROWS, m - row0)
        ks = slab_k(k, MAX_ROWS if batch_invariant else rows, optin)
        slabs = _cdiv(k, ks)
        if slabs > 1 and not workspace:
            raise ValueError(f"{KERNEL}: k = {k} takes {slabs} slabs: give a workspace of {need} bytes")
        grid = min(sms, slabs * _cdiv(n, BLOCK))
        config = LaunchConfig(grid, THREADS, smem(rows, ks), overlap=overlap and row0 == 0)
        args = (int(a) + row0 * k * 2, w.weight, w.scale, int(c) + row0 * n * 2, rows, n, k, ks)
        launches.append(bound.prepare(config, *args, work if slabs > 1 else 0, counters if slabs > 1 else 0))
    return Fp8wLaunch(tuple(launches))


# Prepared launches by (backend, kernel, path, a, w, scale, c, m, n, k, workspace, batch
# invariance), as gemm.py keeps its own: a repeated call skips the plan and the packing.
_LAUNCHES: dict[tuple[Any, ...], Fp8wLaunch] = {}
_LAUNCHES_MAX = 1024


def dense_gemm_fp8w(
    gpu: GpuBackend,
    kernel: KernelHandle,
    a: int,
    w: BlockFp8Weight,
    c: int,
    m: int,
    n: int,
    k: int,
    stream: int,
    *,
    workspace: int = 0,
    batch_invariant: bool = False,
    path: str | None = None,
) -> None:
    """``c[m,n] = bf16(a[m,k] @ W^T)``: bf16 row-major a, c; w an (n, k) ``BlockFp8Weight``;
    ``workspace`` as ``plan_fp8w_gemm`` takes it.

    ``kernel`` is ``load_kernel(gpu, "gemm", "dense_gemm_fp8w")``; ``path="simt"`` looks up the
    scalar kernel here. Every check runs before any launch; m, n or k == 0 is a no-op.
    """
    m, n, k = _check(gpu, kernel, w, m, n, k, path)
    batch_invariant = validate.boolean(batch_invariant, "batch_invariant")
    if not (m and n and k):
        return
    key = (id(gpu), kernel, path, a, w.weight, w.scale, c, m, n, k, workspace, batch_invariant)
    try:
        prepared = _LAUNCHES.get(key)
    except TypeError:  # an operand that cannot be a key: refused by _prepare
        _prepare(gpu, kernel, a, w, c, m, n, k, workspace, batch_invariant, path, False).run(stream)
        return
    if prepared is None or prepared.launches[0].kernel.backend is not gpu:
        prepared = _prepare(gpu, kernel, a, w, c, m, n, k, workspace, batch_invariant, path, False)
        if len(_LAUNCHES) >= _LAUNCHES_MAX:
            _LAUNCHES.clear()
        _LAUNCHES[key] = prepared
    prepared.run(stream)
