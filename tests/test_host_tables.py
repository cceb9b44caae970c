"""Tables in host memory (``NgramTable.Host``): ``HostWeight`` on a host-memory backend,
``check_table`` and ``gather_entry`` for every variant, ``from_numpy``'s placement; on the GPU,
layers whose tables the kernels read in place from pinned host memory give the bits the same
layers give with device tables (seed path and fused path), from numpy or from a table file, and
free what they pinned. (``CudaBackend``'s host memory itself: test_host_memory.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from gpu_runtime import ClosedError, CudaBackend, DeviceArray, DevicePtr, GpuBackend
from layers import reference as ref
from layers.kernel_files import load_kernel
from layers.ngram_embed import (PAD_SLOT, FusedNgramEmbedding, HostTable, HostWeight, NgramDecoder, NgramEmbedding,
                                NgramTable, NgramWeights, TableFile,
                                TableFormatError, gather_entry, ngram_ids_tail, write_table)
from layers.ngram_embed.tables import check_table
from layers.ops import embed as embed_ops
from layers.ops.ngram_fused import CACHED, PairLaunch
from layers.dense_weight import BF16, FP8, DenseWeight
from tests.helpers.fakes import MemoryBackend, RecordingBackend
from tests.helpers import PAGE, POISON, Guarded, bits, page_aligned, random_bf16, random_fp8, run_on_poisoned
from tests.helpers.logging_backend import LoggingBackend
from tests.helpers.ngram import IdentityCache, device_layer, device_weights, free_layer, random_layer, small_dims
from tests.helpers.row_cache import table_file

OUT = DevicePtr(0x900000)
ONE_BLOCK_AN_SM = 227 * 1024 // 2 + 1024  # over half an H200 SM's 228 KiB of shared memory


# ==== HostWeight on a host-memory backend =======================================================

def _gather(gpu: MemoryBackend, args: list, fp8: bool) -> None:
    if fp8:
        ids, table, scale, out, n, dim = args
    else:
        ids, table, out, n, dim = args
    ids_h = gpu.read_as(ids, n, np.uint32).astype(np.int64)
    item = 1 if fp8 else 2
    rows = np.stack([gpu.read(table + int(i) * dim * item, dim * item) for i in ids_h])
    if fp8:
        scales = np.array([gpu.read_as(scale + 4 * int(i), 1, np.float32)[0] for i in ids_h], np.float32)
        got = ref.dequant_fp8(rows.view(FP8), scales)
    else:
        got = rows.view(BF16)
    gpu.copy_h2d_async(np.ascontiguousarray(got), out)
    gpu.gathered.append(np.ascontiguousarray(got).copy())


class HostMem(LoggingBackend):
    """``LoggingBackend`` with the two row gathers emulated (their output kept in ``gathered``)."""

    def __init__(self) -> None:
        super().__init__(emulate={"batched_embed": lambda g, a: _gather(g, a, False),
                                  "batched_embed_fp8": lambda g, a: _gather(g, a, True)})
        self.gathered: list[np.ndarray] = []


def _is_mapped(gpu: MemoryBackend, ptr: int) -> bool:
    return any(dev <= ptr < dev + size for dev, size in gpu.mapped.values())


@pytest.mark.parametrize("fp8", [False, True])
def test_host_weight_from_numpy(rng, fp8):
    gpu = HostMem()
    rows, dim = 37, 9
    table = random_fp8(rng, (rows, dim)) if fp8 else random_bf16(rng, (rows, dim))
    scale = rng.uniform(0.01, 1, rows).astype(np.float32) if fp8 else None
    w = HostWeight.from_numpy(gpu, table, scale)
    assert (w.shape, w.dtype, w.rows, w.cols, w.nbytes) == ((rows, dim), table.dtype, rows, dim, table.nbytes)
    assert _is_mapped(gpu, w.weight) and len(gpu.host) == 1
    np.testing.assert_array_equal(gpu.read(w.weight, table.nbytes), table.view(np.uint8).reshape(-1))
    if fp8:  # the scales on the device, not in mapped host memory
        assert w.row_scale and not _is_mapped(gpu, w.row_scale)
        np.testing.assert_array_equal(gpu.read_as(w.row_scale, rows, np.float32), scale)
    else:
        assert w.row_scale == 0
    table_before = table.copy()
    table[:] = table[::-1]  # the weight holds a copy
    np.testing.assert_array_equal(gpu.read(w.weight, table.nbytes), table_before.view(np.uint8).reshape(-1))
    with w:
        pass
    assert gpu.empty() and w.closed and w.weight == 0 and w.row_scale == 0
    w.close()  # once
    assert gpu.count("free_host") == 1


@pytest.mark.parametrize("array, scale, exc, match", [
    (np.zeros(8, BF16), None, ValueError, "2-D"),
    (np.zeros((0, 4), BF16), None, ValueError, "non-empty"),
    (np.zeros((4, 4), np.float32), None, TypeError, "bfloat16 or float8"),
    (np.zeros((4, 4), FP8), None, ValueError, "needs row_scale"),
    (np.zeros((4, 4), FP8), np.ones(3, np.float32), ValueError, "row_scale shape"),
    (np.zeros((4, 4), BF16), np.ones(4, np.float32), ValueError, "only for fp8"),
])
def test_host_weight_refusals_pin_nothing(array, scale, exc, match):
    gpu = RecordingBackend()
    with pytest.raises(exc, match=match):
        HostWeight.from_numpy(gpu, array, scale)
    assert gpu.ops == [] and gpu.launches == []


def test_host_weights_need_a_backend_that_maps_host_memory(tmp_path, rng):
    path, _, _ = table_file(tmp_path, rng, 10, 8, False)
    # a GpuBackend with the required core alone: isinstance finds neither alloc_host nor host_device_ptr on it
    no_host_memory = type("DeviceOnly", (GpuBackend,), dict.fromkeys(GpuBackend.__abstractmethods__))()
    with pytest.raises(TypeError, match="needs MappedHostMemory, PinnedHostMemory"):
        HostWeight.from_numpy(no_host_memory, random_bf16(rng, (4, 4)))
    with pytest.raises(TypeError, match="needs MappedHostMemory"):
        HostWeight.from_table_file(no_host_memory, path)


@pytest.mark.parametrize("fp8", [False, True])
def test_host_weight_from_table_file_registers_the_map(tmp_path, rng, fp8):
    gpu = HostMem()
    path, table, scales = table_file(tmp_path, rng, 123, 40, fp8)
    w = HostWeight.from_table_file(gpu, path)
    assert (w.shape, w.dtype) == ((123, 40), table.dtype)
    assert gpu.count("register_host") == 1 and gpu.count("alloc_host") == 0  # nothing copied
    ((addr, (nbytes, read_only)),) = gpu.registered.items()
    assert read_only and nbytes == table.nbytes and addr % PAGE == 0
    assert isinstance(w.file, TableFile) and addr == w.file.rows_bytes.ctypes.data
    np.testing.assert_array_equal(gpu.read(w.weight, table.nbytes), table.view(np.uint8).reshape(-1))
    if fp8:
        assert not _is_mapped(gpu, w.row_scale)
        np.testing.assert_array_equal(gpu.read_as(w.row_scale, 123, np.float32), scales)
    file = w.file
    gpu.log.clear()
    w.close()
    assert gpu.empty() and file.closed and w.file is None and w.weight == 0
    assert gpu.ops() == (["free", "unregister_host"] if fp8 else ["unregister_host"])


def test_host_weight_from_a_bad_file_registers_nothing(tmp_path, rng):
    gpu = HostMem()
    path, _, _ = table_file(tmp_path, rng, 50, 8, fp8=False)
    with open(path, "ab") as f:
        f.write(b"x")  # a stray append: the size no longer matches the header
    with pytest.raises(TableFormatError, match="header says"):
        HostWeight.from_table_file(gpu, path)
    assert gpu.log == [] and gpu.empty()


def test_host_weight_from_table_file_undoes_the_registration_when_a_later_step_fails(tmp_path, rng):
    class NoAlloc(HostMem):
        def alloc(self, nbytes):
            raise MemoryError("device full")

    gpu = NoAlloc()
    path, _, _ = table_file(tmp_path, rng, 50, 8, fp8=True)
    with pytest.raises(MemoryError):
        HostWeight.from_table_file(gpu, path)
    assert gpu.ops() == ["register_host", "unregister_host"] and gpu.empty()


# ==== variants: check_table and gather_entry ====================================================

def _weights(gpu, rng, rows=11, dim=6):
    bf = random_bf16(rng, (rows, dim))
    f8, sc = random_fp8(rng, (rows, dim)), rng.uniform(0.1, 1, rows).astype(np.float32)
    return dict(dev_bf=DenseWeight.from_numpy(gpu, bf), dev_f8=DenseWeight.from_numpy(gpu, f8, sc),
                host_bf=HostWeight.from_numpy(gpu, bf), host_f8=HostWeight.from_numpy(gpu, f8, sc))


def test_check_table_accepts_host_tables_and_refuses_mixups(rng):
    gpu = HostMem()
    w = _weights(gpu, rng)
    check_table(NgramTable.Host(w["host_bf"]), 0, 11, 6)
    check_table(NgramTable.Host(w["host_f8"]), 0, 11, 6)
    assert NgramTable.Host is HostTable
    cases = [
        (NgramTable.Host(w["dev_bf"]), TypeError, "needs a HostWeight"),
        (NgramTable.Bf16(w["host_bf"]), TypeError, "goes in NgramTable.Host"),
        (NgramTable.Fp8(w["host_f8"]), TypeError, "goes in NgramTable.Host"),
        (NgramTable.Host(HostWeight(w["host_f8"].weight, (11, 6), np.dtype(FP8), gpu=gpu)), ValueError,
         "without row scales"),
        (NgramTable.Host(HostWeight(w["host_bf"].weight, (11, 6), np.dtype(np.float16), gpu=gpu)), TypeError,
         "not bfloat16 or float8"),
        ("host", TypeError, "Bf16/Fp8/Host/Cached"),
    ]
    for table, exc, match in cases:
        with pytest.raises(exc, match=match):
            check_table(table, 3, 11, 6)
    with pytest.raises(ValueError, match=r"table 2: shape \(11, 6\)"):
        check_table(NgramTable.Host(w["host_bf"]), 2, 12, 6)
    w["host_bf"].close()
    with pytest.raises(ClosedError, match="table 0: NgramTable.Host's HostWeight is closed"):
        check_table(NgramTable.Host(w["host_bf"]), 0, 11, 6)


def test_gather_entry_of_every_variant(rng):
    gpu = HostMem()
    w = _weights(gpu, rng)
    hb, hf, db, df = w["host_bf"], w["host_f8"], w["dev_bf"], w["dev_f8"]
    assert gather_entry(NgramTable.Bf16(db), 11) == (db.weight, 0, 11, 0)
    assert gather_entry(NgramTable.Fp8(df), 11) == (df.weight, df.row_scale, 11, 0)
    assert gather_entry(NgramTable.Host(hb), 11) == (hb.weight, 0, 11, 0)
    assert gather_entry(NgramTable.Host(hf), 11) == (hf.weight, hf.row_scale, 11, 0)
    assert gather_entry(NgramTable.Cached(IdentityCache(db)), 11) == (db.weight, 0, 11, CACHED)
    assert gather_entry(NgramTable.Cached(IdentityCache(df)), np.int64(11)) == (df.weight, df.row_scale, 11, CACHED)
    entries = [gather_entry(t, 11) for t in (NgramTable.Host(hb), NgramTable.Cached(IdentityCache(df)))]
    assert all(type(v) is int for e in entries for v in e)
    np.array(entries, np.uint64)  # what the fused layer uploads
    with pytest.raises(TypeError, match="Bf16/Fp8/Host/Cached"):
        gather_entry(db, 11)
    for rows, error in ((0, ValueError), (-1, ValueError), (1 << 64, ValueError), (True, TypeError),
                        (1.5, TypeError), (None, TypeError)):
        with pytest.raises(error, match="gather_entry: rows must be"):
            gather_entry(NgramTable.Host(hb), rows)


# ==== the weights and the seed's runner: placement, ownership, the gathers it launches ==========

def _tables_arg(host) -> list:
    return [t if s is None else (t, s) for t, s in host.tables]


@pytest.mark.parametrize("placement, exc, match", [
    ("gpu", ValueError, "'device' or 'host'"),
    (["host"], ValueError, "1 entries for 4 tables"),
    (["host", "device", "hosts", "device"], ValueError, r"placement\[2\]"),
    (["host", "device", 1, "device"], TypeError, r"placement\[2\] must be 'device' or 'host', got int 1"),
    (5, TypeError, "sequence"),
    ({"host"}, TypeError, "sequence"),
])
def test_bad_placement_is_refused_before_anything_is_uploaded(placement, exc, match, tmp_path):
    gpu = RecordingBackend()
    dims = small_dims()
    host = random_layer(np.random.default_rng(1), dims, "bf")
    with pytest.raises(exc, match=match):
        NgramWeights.from_numpy(dims, host.word, _tables_arg(host), host.projs, gpu, placement=placement)
    with pytest.raises(exc, match=match):  # before the file is even opened
        NgramWeights.from_safetensors(str(tmp_path / "missing.safetensors"), dims, gpu, placement=placement)
    assert gpu.ops == [] and gpu.launches == []


@pytest.mark.parametrize("placement", ["host", ["host", "device", "device", "host"]])
def test_host_placement_builds_host_tables_and_gathers_through_them(placement):
    gpu = RecordingBackend()
    dims = small_dims()  # 4 tables, "bf": bf16, fp8, bf16, fp8
    host = random_layer(np.random.default_rng(2), dims, "bf")
    weights = NgramWeights.from_numpy(dims, host.word, _tables_arg(host), host.projs, gpu, placement=placement)
    layer = NgramEmbedding(weights, 16)
    places = [placement] * 4 if isinstance(placement, str) else placement
    for table, where, (_, scale) in zip(weights.tables, places, host.tables):
        want = HostTable if where == "host" else (NgramTable.Fp8 if scale is not None else NgramTable.Bf16)
        assert type(table) is want
    assert sum(isinstance(tb.weight, HostWeight) for tb in weights.tables) == places.count("host")
    assert [op[2] for op in gpu.ops if op[0] == "alloc_host"] == [True] * places.count("host")
    gpu.launches.clear()
    layer.embed(np.arange(10) % dims.vocab_size, 4, OUT, gpu, stream=3)
    gathers = [l for l in gpu.launches if gpu.kernel_of(l)[1].startswith("batched_embed")][1:]  # after the word rows
    assert len(gathers) == dims.num_tables()  # one gather a table, host tables among them
    for launch, table in zip(gathers, weights.tables):
        name, w = gpu.kernel_of(launch)[1], table.weight
        if w.dtype == FP8:
            assert name == "batched_embed_fp8" and launch.args[1:3] == [w.weight, w.row_scale]
        else:
            assert name == "batched_embed" and launch.args[1] == w.weight
    assert all(l.stream == 3 for l in gpu.launches)
    layer.close()  # its staging only: the host tables are the weights'
    assert sum(op[0] == "free_host" for op in gpu.ops) == 0
    weights.close()
    assert sum(op[0] == "free_host" for op in gpu.ops) == places.count("host")


def test_host_and_device_placements_gather_the_same_rows(rng):
    dims = small_dims(max_ngram=4, splits=2, table_dim=5)
    host = random_layer(rng, dims, "fb")
    ctx = rng.integers(0, dims.vocab_size, 40)
    runs = []
    for placement in ("device", "host", ["host", "device"] * 3):
        gpu = HostMem()
        with NgramWeights.from_numpy(dims, host.word, _tables_arg(host), host.projs, gpu,
                                     placement=placement) as weights, NgramEmbedding(weights, 16) as layer:
            out = gpu.alloc(16 * dims.hidden_size * 2)
            layer.embed(ctx, 16, out, gpu)
            gpu.free(out)
        assert gpu.empty(), "the runner or its weights left memory behind"
        runs.append(gpu.gathered)
    ids = [i.astype(np.int64) for i in ngram_ids_tail(dims, ctx, 16)]
    for c, (table, scale) in enumerate(host.tables):
        np.testing.assert_array_equal(bits(runs[0][1 + c]), bits(ref.gather_table(table, scale, ids[c])))
    for other in runs[1:]:
        assert len(other) == len(runs[0])
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("placement", ["device", "host", ["host", "device", "device", "device"]])
def test_prefill_sized_gathers_of_host_tables_take_one_pair_a_warp(placement):
    """Past one wave of (row, table) pairs, the gathers of a runner with any table in host memory
    take one pair a warp and one block an SM (``PairLaunch``); decode-sized calls and device
    tables keep the capped grid."""
    gpu = RecordingBackend()
    gpu.sm_count, gpu.max_shared_optin = 132, 227 * 1024  # type: ignore[attr-defined]
    dims = small_dims()  # 4 tables
    host = random_layer(np.random.default_rng(5), dims, "bf")
    rows = 8000  # decoder: 40000 pairs (word pairs too), 5000 blocks; fused: twice the rows, 8000 blocks
    with NgramWeights.from_numpy(dims, host.word, _tables_arg(host), host.projs, gpu, placement=placement) as w, \
            NgramDecoder(w, max_seqs=2, max_rows=rows) as dec, FusedNgramEmbedding(w, 2 * rows) as fused:
        gpu.launches.clear()
        dec.prefill(OUT, OUT + 64, OUT + 128, 2, rows, OUT)
        dec.step(OUT, OUT + 128, 2, OUT)
        fused.embed(np.arange(2 * rows) % dims.vocab_size, 2 * rows, OUT)
        gathers = [(k.grid[0], k.shared_mem) for k in gpu.launches if gpu.kernel_of(k)[1].endswith("gather")]
    capped = 4 * 132 * 8
    on_host = placement != "device"
    assert gathers == ([(5000, ONE_BLOCK_AN_SM), (2, 0), (8000, ONE_BLOCK_AN_SM)] if on_host else
                       [(capped, 0), (2, 0), (capped, 0)])


def test_refused_weights_free_the_host_tables_they_pinned():
    gpu = HostMem()
    dims = small_dims()
    host = random_layer(np.random.default_rng(3), dims, "bf")
    projs = list(host.projs)
    projs[-1] = projs[-1][:, :-1]  # the constructor refuses it, after every table was pinned
    with pytest.raises(ValueError, match="proj 3 must be"):
        NgramWeights.from_numpy(dims, host.word, _tables_arg(host), projs, gpu, placement="host")
    assert gpu.count("alloc_host") == 4 and gpu.count("free_host") == 4 and gpu.empty()


def test_weights_refuse_a_closed_host_table():
    gpu = RecordingBackend()
    dims = small_dims()
    host = random_layer(np.random.default_rng(4), dims, "b")
    weights = device_weights(gpu, host)
    tables = list(weights.tables)
    w = HostWeight.from_numpy(gpu, host.tables[1][0])
    w.close()
    tables[1] = NgramTable.Host(w)
    with pytest.raises(ClosedError, match="table 1: NgramTable.Host's HostWeight is closed"):
        NgramWeights(dims, weights.word, tables, weights.projs, gpu)
    weights.close()


# ==== GPU =======================================================================================

def _pinned_held(gpu: CudaBackend) -> int:
    """alloc_host buffers and registrations (the staging pool may grow between two readings)."""
    return gpu.pinned_buffers - gpu._staging.buffers


def _check_descriptors(gpu, fused, weights) -> None:
    """The fused runner's table descriptors must be ``gather_entry``'s of its weights: checked
    before any launch, so a weights.py / fused.py that does not hand host tables to the kernel
    fails here, not in the kernel."""
    t = weights.dims.num_tables()
    desc = np.empty((t, 4), np.uint64)
    gpu.copy_d2h(desc, fused.projection.desc)
    want = np.array([gather_entry(tb, weights.dims.table_rows(c)) for c, tb in enumerate(weights.tables)],
                    np.uint64)
    if not np.array_equal(desc, want):
        pytest.fail(f"FusedNgramEmbedding's table descriptors are not gather_entry's:\n{desc}\nwant\n{want}")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8, td", [(False, 16), (True, 33), (False, 7), (True, 256)])
def test_mapped_gather_equals_device_gather(gpu, rng, fp8, td):
    rows, n = 5003, 700
    table = random_fp8(rng, (rows, td)) if fp8 else random_bf16(rng, (rows, td))
    scale = rng.uniform(0.002, 0.02, rows).astype(np.float32) if fp8 else None
    ids = rng.integers(0, rows, n).astype(np.uint32)
    ids[:3] = [0, rows - 1, rows - 1]
    name = "batched_embed_fp8" if fp8 else "batched_embed"
    k = load_kernel(gpu, "embed_from_argmax", name)
    got = []
    with HostWeight.from_numpy(gpu, table, scale) as hw, DenseWeight.from_numpy(gpu, table, scale) as dw, \
            Guarded(gpu, n, np.uint32, rng) as ids_dev:
        if fp8:  # the scales are in device memory
            back = np.empty(rows, np.float32)
            gpu.copy_d2h(back, hw.row_scale)
            np.testing.assert_array_equal(back, scale)
        ids_dev.upload(ids)
        for w in (hw, dw):
            with Guarded(gpu, (n, td), BF16, rng) as out:
                out.poison()
                if fp8:
                    embed_ops.batched_embed_fp8(gpu, k, ids_dev.ptr, w.weight, w.row_scale, out.ptr, n, td, 0)
                else:
                    embed_ops.batched_embed(gpu, k, ids_dev.ptr, w.weight, out.ptr, n, td, 0)
                got.append(out.read())
                out.assert_guards_intact()
        gpu.synchronize()
    np.testing.assert_array_equal(bits(got[0]), bits(got[1]))
    np.testing.assert_array_equal(bits(got[0]), bits(ref.gather_table(table, scale, ids.astype(np.int64))))


@pytest.mark.gpu
def test_registered_host_memory_is_read_in_place(gpu, rng, tmp_path):
    rows, td = 2000, 24  # 48-byte rows
    table = random_bf16(rng, (rows, td))
    keep: list = []
    anon = page_aligned(table.nbytes, keep)
    anon[:] = table.view(np.uint8).reshape(-1)
    path = tmp_path / "rows.bin"
    table.tofile(path)
    mapped_file = np.memmap(path, np.uint8, mode="r", shape=(table.nbytes,))
    k = load_kernel(gpu, "embed_from_argmax", "batched_embed")
    ids = rng.integers(0, rows, 333).astype(np.uint32)
    before = (gpu.host_registrations, _pinned_held(gpu))
    with Guarded(gpu, ids.size, np.uint32, rng) as ids_dev:
        ids_dev.upload(ids)
        for array, read_only in ((anon, False), (anon, True), (mapped_file, True)):
            ptr = gpu.register_host(array, read_only=read_only)
            try:
                assert gpu.host_registrations == before[0] + 1
                with pytest.raises(ValueError, match="overlaps"):
                    gpu.register_host(array)
                assert gpu.host_device_ptr(array[48:]) == ptr + 48
                with Guarded(gpu, (ids.size, td), BF16, rng) as out:
                    out.poison()
                    embed_ops.batched_embed(gpu, k, ids_dev.ptr, ptr, out.ptr, ids.size, td, 0)
                    np.testing.assert_array_equal(bits(out.read()), bits(table[ids]))
                    out.assert_guards_intact()
            finally:
                gpu.synchronize()
                gpu.unregister_host(array)
    assert (gpu.host_registrations, _pinned_held(gpu)) == before
    del mapped_file


def _layers_equal(gpu, rng, a: NgramEmbedding, b: NgramEmbedding, ctx: np.ndarray, fused: bool) -> None:
    """``a`` and ``b`` give the same bits, seed path (and fused path: one call, a batch, a graph)."""
    # imported here: the CPU tests of this file do not depend on the fused path
    from layers.ngram_embed.fused import FusedNgramEmbedding

    h = a.dims.hidden_size
    for seq in (1, 17, 64):
        x = run_on_poisoned(gpu, rng, lambda o: a.embed(ctx, seq, o, gpu, 0), seq, h)
        y = run_on_poisoned(gpu, rng, lambda o: b.embed(ctx, seq, o, gpu, 0), seq, h)
        np.testing.assert_array_equal(bits(x), bits(y), err_msg=f"seed path, seq_len {seq}")
    if not fused:
        return
    fa, fb = FusedNgramEmbedding(a.weights, 64), FusedNgramEmbedding(b.weights, 64)
    stream = gpu.create_stream()
    try:
        _check_descriptors(gpu, fa, a.weights)
        _check_descriptors(gpu, fb, b.weights)
        for seq in (1, 17, 64):
            x = run_on_poisoned(gpu, rng, lambda o: fa.embed(ctx, seq, o, 0), seq, h)
            y = run_on_poisoned(gpu, rng, lambda o: fb.embed(ctx, seq, o, 0), seq, h)
            np.testing.assert_array_equal(bits(x), bits(y), err_msg=f"fused path, seq_len {seq}")
        contexts = [ctx[:int(rng.integers(1, ctx.size))] for _ in range(8)]
        lens = [int(rng.integers(0, min(len(c), 6) + 1)) for c in contexts]
        lens[0] = max(lens[0], 1)
        rows = sum(lens)
        x = run_on_poisoned(gpu, rng, lambda o: fa.embed_batch(contexts, lens, o, stream), rows, h, stream)
        with Guarded(gpu, (rows, h), BF16, rng) as out:
            for step in range(3):  # eager run and capture, then replays of the graph
                out.poison()
                gpu.synchronize(0)
                fb.embed_batch(contexts, lens, out.ptr, stream, graph=True)
                gpu.synchronize(stream)
                np.testing.assert_array_equal(bits(out.read()), bits(x), err_msg=f"fused batch, graph, {step}")
                out.assert_guards_intact()
        assert fb.captured_graphs == 1
    finally:
        gpu.synchronize(stream)
        fa.close()
        fb.close()
        gpu.destroy_stream(stream)


@pytest.mark.gpu
@pytest.mark.parametrize("kinds", ["b", "f", "bf"])
def test_host_tables_equal_device_tables(gpu, rng, kinds):
    dims = small_dims(max_ngram=3, splits=2, table_dim=int(rng.choice([7, 16, 33])), hidden_size=72,
                      base_rows=int(rng.integers(500, 3000)), eos_id=3)
    host = random_layer(rng, dims, kinds)
    ctx = rng.integers(0, dims.vocab_size, 200)
    held = _pinned_held(gpu)
    t = dims.num_tables()
    make = lambda placement: NgramWeights.from_numpy(dims, host.word, _tables_arg(host), host.projs, gpu,  # noqa: E731
                                                     placement=placement)
    with make("device") as w_dev, make("host") as w_host, make(["host", "device"] * (t // 2)) as w_mixed, \
            NgramEmbedding(w_dev, 64) as dev, NgramEmbedding(w_host, 64) as on_host, \
            NgramEmbedding(w_mixed, 64) as mixed:
        assert all(isinstance(tb, HostTable) for tb in w_host.tables)
        assert _pinned_held(gpu) == held + t + t // 2
        _layers_equal(gpu, rng, dev, on_host, ctx, fused=True)
        _layers_equal(gpu, rng, dev, mixed, ctx, fused=False)
        gpu.synchronize()
    assert _pinned_held(gpu) == held, "close() left pinned host memory behind"


@pytest.mark.gpu
def test_host_tables_from_table_files_equal_device_tables(gpu, rng, tmp_path):
    dims = small_dims(max_ngram=3, splits=2, table_dim=24, hidden_size=72, base_rows=3000)
    host = random_layer(rng, dims, "bf")
    held, registered = _pinned_held(gpu), gpu.host_registrations
    resident = device_layer(gpu, host, max_tokens=64)
    host_weights: list[HostWeight] = []
    try:
        for c, (table, scale) in enumerate(host.tables):
            write_table(tmp_path / f"t{c}.ngt", table, scale)
            host_weights.append(HostWeight.from_table_file(gpu, tmp_path / f"t{c}.ngt"))
            assert host_weights[-1].dtype == table.dtype and host_weights[-1].shape == table.shape
        assert gpu.host_registrations == registered + len(host_weights)
        # weights that own nothing (the word and projections are resident's, the tables host_weights'),
        # closed for what they derive for the fused path
        with NgramWeights(dims, resident.weights.word, [NgramTable.Host(w) for w in host_weights],
                          resident.weights.projs, gpu) as on_host_weights, \
                NgramEmbedding(on_host_weights, 64) as on_host:
            _layers_equal(gpu, rng, resident, on_host, rng.integers(0, dims.vocab_size, 300), fused=True)
            gpu.synchronize()
    finally:
        files = [w.file for w in host_weights]
        for w in host_weights:
            w.close()
        free_layer(resident)
    assert all(f.closed for f in files)
    assert (gpu.host_registrations, _pinned_held(gpu)) == (registered, held)


@pytest.mark.gpu
def test_prefill_sized_gathers_of_host_tables_equal_device_tables(gpu, rng):
    """``PairLaunch``'s host shape (one pair a warp, one block an SM, all the shared memory a
    block may have): a decoder's ragged prefill, captured after one eager call on padding, and
    the fused path give the device tables' bits."""
    dims = small_dims(max_ngram=3, splits=2, table_dim=24, hidden_size=72,
                      base_rows=int(rng.integers(500, 3000)), eos_id=3)
    host = random_layer(rng, dims, "bf")
    t, h, rows = dims.num_tables(), dims.hidden_size, 2500
    assert PairLaunch(gpu, True).config(rows * t).shared_mem > 0, "too few rows for the host shape on this GPU"
    tokens = rng.integers(0, dims.vocab_size, rows).astype(np.uint32)
    cu = np.array([0, *np.sort(rng.choice(np.arange(1, rows), 2, replace=False)), rows], np.uint32)
    stream = gpu.create_stream()
    args = [DeviceArray.from_numpy(gpu, a) for a in (tokens, cu, np.arange(3, dtype=np.uint32),
                                                     np.full(3, PAD_SLOT, np.uint32))]
    got: dict[str, list[np.ndarray]] = {}
    try:
        for placement in ("host", "device"):
            with NgramWeights.from_numpy(dims, host.word, _tables_arg(host), host.projs, gpu,
                                         placement=placement) as w, \
                    NgramDecoder(w, max_seqs=3, max_rows=rows, stream=stream) as dec, \
                    FusedNgramEmbedding(w, rows, stream) as fused:
                gpu.synchronize(0)

                def prefill(out: int) -> None:
                    tok, cu_d, slots, pad = (a.ptr for a in args)
                    dec.prefill(tok, cu_d, pad, 3, rows, out, stream)  # the documented eager first call
                    gpu.memset(out, POISON, rows * h * 2, stream)  # it wrote zero rows: poison again
                    gpu.begin_capture(stream)
                    dec.prefill(tok, cu_d, slots, 3, rows, out, stream)
                    graph = gpu.end_capture(stream)
                    gpu.launch_graph(graph, stream)
                    gpu.synchronize(stream)
                    gpu.destroy_graph(graph)

                got[placement] = [run_on_poisoned(gpu, rng, prefill, rows, h, stream),
                                  run_on_poisoned(gpu, rng, lambda o: fused.embed(tokens, rows, o, stream), rows, h,
                                                  stream)]
                assert dec.check_errors() == 0
    finally:
        gpu.synchronize(stream)
        for a in args:
            a.free()
        gpu.destroy_stream(stream)
    for what, a, b in zip(("decoder prefill", "fused path"), got["host"], got["device"]):
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=what)
