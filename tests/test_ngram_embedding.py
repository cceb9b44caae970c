"""NgramEmbedding: the seed's launch sequence (CPU) and the whole layer against numpy (GPU)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gpu_runtime import ClosedError, DevicePtr
from layers import reference as ref
from layers.ngram_embed import (FusedNgramEmbedding, NgramDecoder, NgramDims, NgramEmbedding, NgramTable,
                                NgramWeights, ngram_ids_tail)
from layers.dense_weight import DenseWeight
from tests.helpers.fakes import MemoryBackend, RecordingBackend
from tests.helpers import Guarded, bits, random_fp8
from tests.helpers.logging_backend import LoggingBackend
from tests.helpers.ngram import HostLayer, device_layer, device_weights, free_layer, random_layer, small_dims

BF16 = ml_dtypes.bfloat16


# -- CPU: the seed's launch sequence and refusals -------------------------------------------
def test_launch_sequence_is_the_seeds():
    gpu = RecordingBackend()
    dims = small_dims()
    layer = device_layer(gpu, random_layer(np.random.default_rng(1), dims, "bf"), max_tokens=16)
    gpu.launches.clear()
    gpu.ops.clear()
    layer.embed(np.arange(10) % dims.vocab_size, 4, DevicePtr(0x900000), gpu, stream=7)
    names = [gpu.kernel_of(launch)[1] for launch in gpu.launches]
    t = dims.num_tables()
    expected = ["batched_embed", "bf16_scaled_add"]
    for c in range(t):
        expected += ["batched_embed_fp8" if c % 2 else "batched_embed", "dense_gemm_bf16_pipelined",
                     "bf16_scaled_add"]
    assert names == expected
    assert gpu.ops[0][0] == "memset" and gpu.ops[0][1] == 0x900000 and gpu.ops[0][3] == 4 * 40 * 2
    assert all(launch.stream == 7 for launch in gpu.launches)
    inv = np.float32(1) / np.float32(1 + t)
    scaled = [l for l in gpu.launches if gpu.kernel_of(l)[1] == "bf16_scaled_add"]
    assert all(l.args[2] == float(inv) for l in scaled)
    # One upload: the new tokens, then each table's ids ([1 + T, seq_len] u32), each gather
    # reading its row of it (the seed uploads them table by table into one [seq_len] buffer).
    (upload,) = [op for op in gpu.ops if op[0] == "h2d"]
    tokens = np.arange(10) % dims.vocab_size
    want = np.concatenate([tokens[-4:], np.ravel(ngram_ids_tail(dims, tokens, 4))]).astype(np.uint32)
    assert upload[1] == want.tobytes()
    gathers = [launch for launch in gpu.launches if gpu.kernel_of(launch)[1].startswith("batched_embed")]
    assert [launch.args[0] - upload[2] for launch in gathers] == [16 * c for c in range(1 + t)]


def test_cached_branch_resolves_then_ends_batch():
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=2, splits=1)
    layer = device_layer(gpu, random_layer(np.random.default_rng(2), dims, "b"), 8, cached=True)
    layer.embed([1, 2, 3], 2, DevicePtr(0x900000), gpu)
    assert layer.weights.tables[0].cache.calls == ["resolve", "end_batch"]
    uploads = [op for op in gpu.ops if op[0] == "h2d" and op[2] >= layer.ids_dev]
    # the new tokens and the ids, then the table's slots over its ids, which the gather reads
    assert [len(u[1]) for u in uploads] == [16, 8] and uploads[1][2] == layer.ids_dev + 8
    assert np.frombuffer(uploads[1][1], np.uint32).tolist() == ngram_ids_tail(dims, [1, 2, 3], 2)[0].tolist()
    (gather,) = [launch for launch in gpu.launches[1:] if gpu.kernel_of(launch)[1] == "batched_embed"]
    assert gather.args[0] == layer.ids_dev + 8


@pytest.mark.parametrize("case, error, match", [
    (dict(tables=-1), ValueError, "table count"),
    (dict(projs=-1), ValueError, "proj count"),
    (dict(proj_shape=True), ValueError, "proj 0 must be"),
    (dict(table_dtype=True), TypeError, "NgramTable.Bf16 holds float8"),
    (dict(table_rows=True), ValueError, "table 1: shape"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
])
def test_constructor_refusals(case, error, match):
    gpu = RecordingBackend()
    dims = small_dims()
    host = random_layer(np.random.default_rng(3), dims, "b")
    word = DenseWeight.from_numpy(gpu, host.word)
    tables = [NgramTable.Bf16(DenseWeight.from_numpy(gpu, t)) for t, _ in host.tables]
    projs = [DenseWeight.from_numpy(gpu, p) for p in host.projs]
    if case.get("tables"):
        tables = tables[:-1]
    if case.get("projs"):
        projs = projs[:-1]
    if case.get("proj_shape"):
        projs[0] = DenseWeight.from_numpy(gpu, host.projs[0][:, :-1])
    if case.get("table_dtype"):
        tables[0] = NgramTable.Bf16(DenseWeight.from_numpy(gpu, random_fp8(np.random.default_rng(0), host.tables[0][0].shape), np.ones(host.tables[0][0].shape[0], np.float32)))
    if case.get("table_rows"):
        tables[1] = NgramTable.Bf16(DenseWeight.from_numpy(gpu, host.tables[1][0][:-1]))
    with pytest.raises(error, match=match):  # the weights check the tables and projections, the runner max_tokens
        NgramEmbedding(NgramWeights(dims, word, tables, projs, gpu), case.get("max_tokens", 8))
    assert gpu.launches == []


def test_the_seed_runner_refuses_weights_it_cannot_serve():
    """Not ``NgramWeights``, closed weights, a tensor-parallel rank's share: refused before the
    runner allocates anything."""
    gpu = RecordingBackend()
    dims = small_dims()
    host = random_layer(np.random.default_rng(3), dims, "bf")
    tables = [t if s is None else (t, s) for t, s in host.tables]
    weights = device_weights(gpu, host)
    shard = NgramWeights.from_numpy(dims, host.word, tables, host.projs, gpu, shard=(0, 2))
    closed = device_weights(gpu, host)
    closed.close()
    gpu.ops.clear()
    for bad, error, match in ((weights.word, TypeError, "weights must be NgramWeights, got DenseWeight"),
                              (closed, ClosedError, "NgramEmbedding: its NgramWeights is closed"),
                              (shard, ValueError, "NgramEmbedding: the weights are a tensor-parallel rank's share")):
        with pytest.raises(error, match=match):
            NgramEmbedding(bad, 8)
    assert gpu.ops == [] and gpu.launches == []
    weights.close()
    shard.close()


@pytest.mark.parametrize("call, error, match", [
    (lambda L, g: L.embed([1, 2, 500], 1, 0x1000, g), ValueError, "500"),
    (lambda L, g: L.embed([1, 2, 3], 9, 0x1000, g), ValueError, "over staging"),
    (lambda L, g: L.embed([1, 2, 3], 4, 0x1000, g), ValueError, "seq_len 4 exceeds the context's 3 tokens"),
    (lambda L, g: L.embed([1, 2, 3], -1, 0x1000, g), ValueError, "non-negative"),
    (lambda L, g: L.embed([1, 2, 3], 2, 0, g), ValueError, "null device pointer"),
    (lambda L, g: L.embed([[1, 2, 3]], 1, 0x1000, g), ValueError, "1-D"),
    (lambda L, g: L.embed([1.5, 2, 3], 1, 0x1000, g), TypeError, "tokens must be integers, got dtype float64"),
    (lambda L, g: L.embed([1, 2, 3], 1.0, 0x1000, g), TypeError, "seq_len must be an int"),
])
def test_embed_refusals_launch_and_write_nothing(call, error, match):
    gpu = RecordingBackend()
    layer = device_layer(gpu, random_layer(np.random.default_rng(4), small_dims(), "b"), max_tokens=8)
    gpu.ops.clear()
    with pytest.raises(error, match=match):
        call(layer, gpu)
    assert gpu.launches == [] and gpu.ops == []


def test_seq_len_zero_is_a_no_op():
    gpu = RecordingBackend()
    layer = device_layer(gpu, random_layer(np.random.default_rng(5), small_dims(), "b"), max_tokens=8)
    gpu.ops.clear()
    layer.embed([1, 2, 3], 0, 0x1000, gpu)
    assert gpu.launches == [] and gpu.ops == []


# -- GPU: the whole layer against the reference ---------------------------------------------
def _check_against_reference(gpu, rng, host: HostLayer, ctx: np.ndarray, seq_len: int,
                             cached: bool = False) -> None:
    layer = device_layer(gpu, host, max_tokens=max(seq_len, 1), cached=cached)
    try:
        with Guarded(gpu, (seq_len, host.dims.hidden_size), BF16, rng) as out:
            out.poison()
            layer.embed(ctx, seq_len, out.ptr, gpu, 0)
            got = out.read()
            out.assert_guards_intact()
    finally:
        free_layer(layer)
    want = ref.ngram_embed(host.dims, host.word, host.tables, host.projs, ctx, seq_len)
    ideal = ref.ngram_embed_ideal(host.dims, host.word, host.tables, host.projs, ctx, seq_len)
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert np.isfinite(g).all(), "unwritten (poisoned) elements"
    # The GEMM's fp32 accumulation order may flip a bf16 rounding; it then carries through
    # the later adds. Elementwise: within 4 bf16 ulps of the row's magnitude.
    ulp = np.abs(w).max(axis=1, keepdims=True) * 2.0**-7
    assert (np.abs(g - w) <= 4 * ulp + 1e-30).all()
    # Against the fp64 ideal: as close as the reference itself (T + 1 bf16 roundings of the
    # running sum put it above 1% for small rows and many tables), plus a few flipped roundings.
    rel = np.linalg.norm(g - ideal) / np.linalg.norm(ideal)
    rel_ref = np.linalg.norm(w - ideal) / np.linalg.norm(ideal)
    assert rel_ref < 0.05 and rel <= 1.5 * rel_ref + 4e-3, (rel, rel_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(2, 1), (3, 2), (4, 4), (5, 8), (3, 8), (2, 4)])
@pytest.mark.parametrize("kinds", ["b", "f", "bf"])
def test_layer_matches_reference_prefill_and_decode(gpu, rng, n, k, kinds):
    vocab = int(rng.integers(300, 5000))
    td = int(rng.choice([1, 7, 9, 16, 33]))
    dims = NgramDims(vocab_size=vocab, hidden_size=int(rng.choice([37, 64, 129])), max_ngram=n,
                     splits=k, base_rows=int(rng.integers(50, 3000)), row_bias=int(rng.integers(0, 2)),
                     table_dim=td, eos_id=int(rng.integers(0, vocab)) if rng.random() < 0.5 else None)
    host = random_layer(rng, dims, kinds)
    ctx = rng.integers(0, vocab, int(rng.integers(40, 200)))
    if dims.eos_id is not None:
        ctx[rng.random(ctx.size) < 0.05] = dims.eos_id
    _check_against_reference(gpu, rng, host, ctx, ctx.size)  # prefill
    long_ctx = rng.integers(0, vocab, 3000)
    _check_against_reference(gpu, rng, host, long_ctx, 1)  # decode after a long context
    _check_against_reference(gpu, rng, host, long_ctx, 17)


@pytest.mark.gpu
def test_layer_at_model_width(gpu, rng):
    dims = NgramDims(vocab_size=32000, hidden_size=1024, max_ngram=3, splits=4, base_rows=5000,
                     row_bias=1, table_dim=None, eos_id=2)
    host = random_layer(rng, dims, "bf")
    _check_against_reference(gpu, rng, host, rng.integers(0, 32000, 300), 300)


@pytest.mark.gpu
def test_cached_identity_tables_match_resident(gpu, rng):
    dims = small_dims(max_ngram=4, splits=2, table_dim=11)
    host = random_layer(rng, dims, "fb")
    ctx = rng.integers(0, dims.vocab_size, 64)
    _check_against_reference(gpu, rng, host, ctx, 20, cached=True)


@pytest.mark.gpu
def test_gpu_refusal_leaves_output_untouched(gpu, rng):
    dims = small_dims()
    layer = device_layer(gpu, random_layer(rng, dims, "b"), max_tokens=8)
    try:
        with Guarded(gpu, (8, dims.hidden_size), BF16, rng) as out:
            before = out.read()
            for bad in (lambda: layer.embed([1, 2, dims.vocab_size], 2, out.ptr, gpu),
                        lambda: layer.embed(list(range(20)), 9, out.ptr, gpu)):
                with pytest.raises(ValueError):
                    bad()
            layer.embed([1, 2, 3], 0, out.ptr, gpu)
            np.testing.assert_array_equal(bits(out.read()), bits(before))
    finally:
        free_layer(layer)


@pytest.mark.gpu
def test_from_safetensors_equals_from_numpy(gpu, rng, tmp_path):
    from layers import safetensors_io

    dims = small_dims(max_ngram=3, splits=2, table_dim=7)
    host = random_layer(rng, dims, "bf")
    tensors = {"model.ngram.word.weight": host.word}
    for c, ((table, scale), proj) in enumerate(zip(host.tables, host.projs)):
        tensors[f"model.ngram.tables.{c}.weight"] = table
        if scale is not None:
            tensors[f"model.ngram.tables.{c}.row_scale"] = scale
        tensors[f"model.ngram.projs.{c}.weight"] = proj
    path = tmp_path / "ngram.safetensors"
    safetensors_io.save(path, tensors)
    ctx = rng.integers(0, dims.vocab_size, 50)
    results = []
    for make in (lambda: NgramWeights.from_safetensors(str(path), dims, gpu, prefix="model.ngram."),
                 lambda: NgramWeights.from_numpy(
                     dims, host.word, [t if s is None else (t, s) for t, s in host.tables], host.projs, gpu)):
        with make() as weights, NgramEmbedding(weights, 50) as layer, \
                Guarded(gpu, (50, dims.hidden_size), BF16, rng) as out:
            out.poison()
            layer.embed(ctx, 50, out.ptr, gpu)
            results.append(out.read())
    np.testing.assert_array_equal(bits(results[0]), bits(results[1]))
    assert np.isfinite(results[0].astype(np.float32)).all()


def test_decode_reads_only_the_tail_of_the_context():
    """Host work is bounded by seq_len: a 10**12-token context is never read beyond its tail."""
    from tests.helpers import WindowOnly

    gpu = RecordingBackend()
    dims = small_dims()
    layer = device_layer(gpu, random_layer(np.random.default_rng(6), dims, "b"), max_tokens=8)
    tail = [5, 6, 7, 8]
    gpu.ops.clear()
    layer.embed(WindowOnly(10**12, tail), 2, DevicePtr(0x900000), gpu)
    uploads = [op[1] for op in gpu.ops if op[0] == "h2d"]
    assert uploads[0][:8] == np.array([7, 8], np.uint32).tobytes()
    assert len(gpu.launches) == 2 + 3 * dims.num_tables()


def test_dense_weight_frees_what_it_allocated_when_the_upload_fails():
    """An fp8 weight whose scale allocation fails leaves nothing allocated behind."""
    class OneAlloc(MemoryBackend):
        def alloc(self, nbytes: int):
            if self.mem:
                raise MemoryError("the scales do not fit")
            return super().alloc(nbytes)

    gpu = OneAlloc("embed_from_argmax", [])
    rng = np.random.default_rng(7)
    with pytest.raises(MemoryError, match="scales"):
        DenseWeight.from_numpy(gpu, random_fp8(rng, (4, 8)), np.ones(4, np.float32))
    assert gpu.mem == {}


# -- CPU: ownership: every build frees what it made, close is idempotent -------------------
def _held(gpu: LoggingBackend) -> tuple:
    return set(gpu.mem), set(gpu.host), set(gpu.events)


_BUILDS = {
    "layer": lambda weights: NgramEmbedding(weights, 8),
    "fused": lambda weights: FusedNgramEmbedding(weights, 8),
    "decoder": lambda weights: NgramDecoder(weights, max_seqs=2, max_rows=8, max_draft=1),
}


@pytest.mark.parametrize("build", list(_BUILDS))
def test_a_construction_failing_part_way_frees_what_it_built(build):
    """Every device allocation of a runner's build fails in turn: each failure leaves exactly
    what was held before (buffers, pinned buffers, events); the build that succeeds frees it all
    again in ``close``, which a second time does nothing. (What the weights derive for the fused
    runners is the weights', built beforehand here: the next test.)"""
    gpu = LoggingBackend()
    weights = device_weights(gpu, random_layer(np.random.default_rng(9), small_dims(), "bf"))
    weights.concat_projections()
    weights.table_descriptors()
    before = _held(gpu)
    for k in range(20):
        gpu.fail_alloc_after = gpu.count("alloc") + k
        try:
            built = _BUILDS[build](weights)
        except MemoryError:
            assert _held(gpu) == before, k
            continue
        gpu.fail_alloc_after = None
        assert k > 0 and _held(gpu) != before
        built.close()
        assert built.closed and _held(gpu) == before and not weights.closed
        mark = len(gpu.log)
        built.close()
        assert gpu.log[mark:] == []
        break
    else:
        pytest.fail("the build never succeeded")
    weights.close()
    assert gpu.empty() and not gpu.events


def test_the_weights_keep_what_they_derive_until_they_close():
    """A fused runner's first build derives the concatenated projections and the table
    descriptors on the weights; with device allocations failing part way through it, a later
    build succeeds, and a second runner reuses what the weights derived (no new copies). Closing
    the runners leaves it with the weights; ``weights.close()`` frees it and all they own."""
    gpu = LoggingBackend()
    weights = device_weights(gpu, random_layer(np.random.default_rng(13), small_dims(), "bf"))
    uploaded = set(gpu.mem)
    fused = None
    for k in range(20):
        gpu.fail_alloc_after = gpu.count("alloc") + k
        try:
            fused = FusedNgramEmbedding(weights, 8)
        except MemoryError:
            continue
        break
    gpu.fail_alloc_after = None
    assert fused is not None and k > 0
    projs = weights.concat_projections()
    desc, pows = weights.table_descriptors()
    assert fused.projection.projs is projs and (fused.projection.desc, fused.projection.pows) == (desc, pows)
    derived = {int(projs.weight), int(desc), int(pows)}
    copies = gpu.count("copy2d")
    dec = NgramDecoder(weights, max_seqs=2, max_rows=8)
    assert dec.projection.projs is projs and (dec.projection.desc, dec.projection.pows) == (desc, pows)
    assert gpu.count("copy2d") == copies
    dec.close()
    fused.close()
    assert derived <= set(gpu.mem) and derived.isdisjoint(uploaded) and not weights.closed
    weights.close()
    assert weights.closed and gpu.empty() and not gpu.events


def test_closing_after_the_backend_frees_nothing_twice():
    """A closed backend has freed everything: closing the three runners and then their weights
    after it touches the backend no more, and every later call is a ``ClosedError``."""
    gpu = LoggingBackend()
    host = random_layer(np.random.default_rng(10), small_dims(), "bf")
    tables = [t if s is None else (t, s) for t, s in host.tables]
    weights = NgramWeights.from_numpy(host.dims, host.word, tables, host.projs, gpu)
    layer = NgramEmbedding(weights, 8)
    fused = FusedNgramEmbedding(weights, 8)
    dec = NgramDecoder(weights, max_seqs=2, max_rows=8)
    gpu.closed = True
    mark = len(gpu.log)
    for obj in (dec, fused, layer, weights):
        obj.close()
        assert obj.closed
    assert [op for op, _ in gpu.log[mark:] if op in ("free", "free_host")] == []
    with pytest.raises(ClosedError, match="NgramEmbedding is closed"):
        layer.embed([1, 2, 3], 1, DevicePtr(0x900000), gpu)
    with pytest.raises(ClosedError, match="FusedNgramEmbedding is closed"):
        fused.embed([1, 2, 3], 1, DevicePtr(0x900000))
    with pytest.raises(ClosedError, match="NgramDecoder is closed"):
        dec.reset_all()
    with pytest.raises(ClosedError, match="NgramWeights is closed"):
        weights.own(layer)


def test_a_runner_frees_only_its_staging_and_the_weights_what_they_own():
    """``close`` of the runner frees its staging, not the weights; ``own`` hands weights over
    to ``NgramWeights``, whose ``close`` frees them, the last handed over first (a weight not
    handed over stays the caller's); closed weights take nothing more."""
    gpu = LoggingBackend()
    host = random_layer(np.random.default_rng(11), small_dims(), "b")
    word = DenseWeight.from_numpy(gpu, host.word)
    tables = [NgramTable.Bf16(DenseWeight.from_numpy(gpu, t)) for t, _ in host.tables]
    projs = [DenseWeight.from_numpy(gpu, p) for p in host.projs]
    weights = NgramWeights(host.dims, word, tables, projs, gpu)  # owns nothing yet
    layer = NgramEmbedding(weights, 8)
    staging = [layer.ids_dev, layer.gather_buf, layer.proj_buf]
    weights.own(word, *projs)
    mark = len(gpu.log)
    layer.close()
    assert [ptr for op, ptr in gpu.log[mark:] if op == "free"] == staging[::-1]
    assert not weights.closed and not word.closed and not any(p.closed for p in projs)
    with pytest.raises(ClosedError, match="NgramEmbedding is closed"):
        layer.embed([1, 2, 3], 1, DevicePtr(0x900000), gpu)
    mark = len(gpu.log)
    weights.close()
    freed = [ptr for op, ptr in gpu.log[mark:] if op == "free"]
    assert freed == [p.weight for p in projs[::-1]] + [word.weight]
    assert word.closed and all(p.closed for p in projs)
    assert not any(t.weight.closed for t in tables)  # never handed over: still the caller's
    with pytest.raises(ClosedError, match="NgramWeights is closed"):
        weights.own(word)
    mark = len(gpu.log)
    weights.close()  # once
    assert gpu.log[mark:] == []
    for t in tables:
        t.weight.close()
    assert gpu.empty()


def test_a_runner_refuses_every_call_once_its_weights_are_closed():
    """Runners borrow their weights: once those are closed every call is a ``ClosedError``
    naming them, before anything is uploaded or launched; no runner can be built on them; each
    runner's ``close`` still frees its own buffers."""
    gpu = LoggingBackend()
    weights = device_weights(gpu, random_layer(np.random.default_rng(14), small_dims(), "bf"))
    layer = NgramEmbedding(weights, 8)
    fused = FusedNgramEmbedding(weights, 8)
    dec = NgramDecoder(weights, max_seqs=2, max_rows=8)
    out = gpu.alloc(8 * weights.dims.hidden_size * 2)
    weights.close()
    mark = len(gpu.log)
    for call, match in ((lambda: layer.embed([1, 2, 3], 1, out, gpu), "ngram embed: its NgramWeights is closed"),
                        (lambda: fused.embed([1, 2, 3], 1, out), "fused ngram embed: its NgramWeights is closed"),
                        (lambda: fused.embed_batch([[1, 2], [3]], [1, 1], out),
                         "fused ngram embed: its NgramWeights is closed"),
                        (lambda: dec.reset_all(), "NgramDecoder: its NgramWeights is closed")):
        with pytest.raises(ClosedError, match=match):
            call()
    for build, name in ((lambda: NgramEmbedding(weights, 8), "NgramEmbedding"),
                        (lambda: FusedNgramEmbedding(weights, 8), "FusedNgramEmbedding"),
                        (lambda: NgramDecoder(weights, max_seqs=2, max_rows=8), "NgramDecoder")):
        with pytest.raises(ClosedError, match=f"{name}: its NgramWeights is closed"):
            build()
    assert gpu.log[mark:] == []
    for runner in (dec, fused, layer):
        runner.close()
    gpu.free(out)
    assert gpu.empty() and not gpu.events


def test_a_dense_weight_frees_only_the_buffers_it_owns():
    gpu = LoggingBackend()
    w = DenseWeight.from_numpy(gpu, random_fp8(np.random.default_rng(12), (4, 8)), np.ones(4, np.float32))
    assert w.gpu is gpu and not w.closed and set(gpu.mem) == {w.weight, w.row_scale}
    view = DenseWeight(w.weight, w.shape, w.dtype, w.row_scale, gpu)  # over the same addresses: owns nothing
    view.close()
    assert set(gpu.mem) == {w.weight, w.row_scale} and view.gpu is None and not view.closed
    w.close()
    assert w.closed and w.gpu is None and gpu.mem == {}
    mark = len(gpu.log)
    w.close()  # once
    assert gpu.log[mark:] == []
