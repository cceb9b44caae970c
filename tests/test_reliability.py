"""Reliability: nothing leaks over 1000 build/use/close cycles (GPU), the NVRTC cache survives
damaged entries, unwritable directories and two processes racing (CPU), and independent layers
on concurrent streams and threads compute bit for bit what they compute alone (GPU).

The layers have no finalizers: "dropping" one means ``close()`` (or leaving its ``with``); a
runner is closed before the ``NgramWeights`` it borrows."""

from __future__ import annotations

import errno
import multiprocessing
import os
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from gpu_runtime import DevicePtr, compiler
from layers.ngram_embed import FusedNgramEmbedding, NgramDims, NgramEmbedding, NgramWeights, RowCache
from layers.ops.token_overlay import OverlayKernels
from layers.overlay import OverlaySlots, build_overlay
from layers.dense_weight import BF16, DenseWeight
from tests.helpers import DEVICE_MEMORY_MEASURABLE, bits, random_bf16
from tests.helpers.ngram import random_layer, small_dims
from tests.helpers.overlay import adapter_copy
from tests.helpers.row_cache import assert_resident, table_file

TARGET = "compute_90"  # PTX: compiles with no GPU
RUNTIME_TEST_CU = Path(__file__).parent / "kernels" / "runtime_test.cu"


def _tables(host) -> list:
    return [t if s is None else (t, s) for t, s in host.tables]


def _read(gpu, ptr: int, shape: tuple[int, ...], stream: int = 0) -> np.ndarray:
    out = np.empty(shape, BF16)
    gpu.copy_d2h(out, ptr, stream)
    return bits(out)


def _read_written(gpu, ptr: int, shape: tuple[int, ...], stream: int = 0) -> np.ndarray:
    """``_read`` of an output its cycle poisoned first (0xFF bytes: NaN), proving every element
    was written by that cycle."""
    got = _read(gpu, ptr, shape, stream)
    assert not (got == 0xFFFF).any(), "the last cycle left output elements unwritten"
    return got


# -- 1. Leaks (GPU) ---------------------------------------------------------------------------
# Each case yields (cycle, probe): cycle builds, uses and closes the thing once; probe reads what
# the last cycle computed, which must not change from the first cycle to the last.
N, CHECKPOINT = 1000, 100
SLACK = 2 << 20  # device bytes the driver's internal pools may keep
STAGING_SLACK = 4  # the staging pool keeps its peak in-flight uploads; a leak grows it per call


@contextmanager
def _layer_cycle(gpu, rng, tmp_path):
    """(a) NgramWeights.from_numpy (a bf16 and an fp8 table), the seed's runner and the fused one
    on them (which derives the concatenated projections and table descriptors on the weights),
    one embed each; the runners closed, then the weights."""
    dims = small_dims(max_ngram=2, splits=2)
    host, ctx = random_layer(rng, dims, "bf"), rng.integers(0, dims.vocab_size, 12)
    out = gpu.alloc(2 * 8 * dims.hidden_size * 2)  # the seed's rows, then the fused path's
    def cycle() -> None:
        gpu.memset(out, 0xFF, 2 * 8 * dims.hidden_size * 2, 0)
        with NgramWeights.from_numpy(dims, host.word, _tables(host), host.projs, gpu) as weights, \
                NgramEmbedding(weights, 8) as layer, FusedNgramEmbedding(weights, 8) as fused:
            layer.embed(ctx, 8, out, gpu)
            fused.embed(ctx, 8, out.offset(8 * dims.hidden_size * 2))
    try:
        yield cycle, lambda: _read_written(gpu, out, (2, 8, dims.hidden_size))
    finally:
        gpu.synchronize()
        gpu.free(out)


@contextmanager
def _fused_cycle(gpu, rng, tmp_path):
    """(b) FusedNgramEmbedding over one set of weights, on a created stream: captured, then
    replayed; each cycle's runner closed (its graphs and buffers), the weights kept for the next."""
    dims = small_dims(max_ngram=3, splits=2, eos_id=3)
    host, ctx = random_layer(rng, dims, "fb"), rng.integers(0, dims.vocab_size, 12)
    weights = NgramWeights.from_numpy(dims, host.word, _tables(host), host.projs, gpu)
    stream, out = gpu.create_stream(), gpu.alloc(8 * dims.hidden_size * 2)
    gpu.synchronize()  # weights went up on the default stream, which `stream` does not wait for
    def cycle() -> None:
        gpu.memset(out, 0xFF, 8 * dims.hidden_size * 2, stream)
        with FusedNgramEmbedding(weights, 8, stream) as fused:
            fused.embed(ctx, 8, out, stream, graph=True)
            fused.embed(ctx, 8, out, stream, graph=True)
        assert not weights.closed
    try:
        yield cycle, lambda: _read_written(gpu, out, (8, dims.hidden_size), stream)
    finally:
        gpu.destroy_stream(stream)
        gpu.free(out)
        weights.close()


@contextmanager
def _row_cache_cycle(gpu, rng, tmp_path):
    """(c) RowCache: two pinned 1100-row chunks read by 2 threads, then a decode-sized batch."""
    path, table, scales = table_file(tmp_path, rng, 5000, 16, fp8=True)
    big, small = rng.choice(5000, 2200, replace=False), rng.integers(0, 5000, 20)
    def cycle() -> None:
        with RowCache(gpu, path, 2400, chunk_rows=1100, io_threads=2) as cache:
            for ids in (big, small):
                slots = np.empty(ids.size, np.uint32)
                cache.resolve(ids, slots)
                assert_resident(gpu, cache, ids, slots, table, scales)
                cache.end_batch()
    yield cycle, lambda: np.empty(0)


@contextmanager
def _overlay_cycle(gpu, rng, tmp_path):
    """(d) build_overlay from a full adapter table, OverlaySlots with it loaded, one embed hook."""
    vocab, h, n = 300, 48, 64
    kernels = OverlayKernels.new(gpu)
    served = random_bf16(rng, (vocab, h))
    changed = rng.choice(vocab, 20, replace=False)
    adapter = adapter_copy(rng, served, changed)
    ids, seq = rng.integers(0, vocab, n), rng.integers(-1, 1, n).astype(np.int32)  # slot 0 or none
    ids[:8], seq[:8] = changed[:8], 0  # some tokens surely replaced
    served_w, ids_dev, out = DenseWeight.from_numpy(gpu, served), gpu.alloc(4 * n), gpu.alloc(n * h * 2)
    gpu.copy_h2d_async(ids.astype(np.uint32), ids_dev)
    def cycle() -> None:
        overlay = build_overlay(gpu, kernels, served_w, adapter)
        with OverlaySlots(gpu, 2, vocab, h, kernels=kernels) as slots:
            slots.load(0, overlay)
            gpu.copy_h2d_async(served[ids], out)
            slots.embed_overlay(ids_dev, seq, 0, out, n)
    def probe() -> np.ndarray:
        got = _read(gpu, out, (n, h))
        np.testing.assert_array_equal(got, bits(np.where((seq >= 0)[:, None], adapter[ids], served[ids])))
        return got
    try:
        yield cycle, probe
    finally:
        gpu.synchronize()
        gpu.free(ids_dev)
        gpu.free(out)
        served_w.close()


@contextmanager
def _handles_cycle(gpu, rng, tmp_path):
    """(e) a stream, an event and a pinned buffer: created, used for one upload, destroyed."""
    dev = gpu.alloc(4096)
    def cycle() -> None:
        stream, event, host = gpu.create_stream(), gpu.create_event(), gpu.alloc_host(4096)
        host[:] = rng.integers(0, 256, 4096, dtype=np.uint8)
        gpu.upload_pinned_async(host, dev, stream)
        gpu.record_event(event, stream)
        gpu.event_synchronize(event)
        back = np.empty(4096, np.uint8)
        gpu.copy_d2h(back, dev, stream)
        assert np.array_equal(back, host)
        gpu.free_host(host)
        gpu.destroy_event(event)
        gpu.destroy_stream(stream)
    try:
        yield cycle, lambda: np.empty(0)
    finally:
        gpu.synchronize()
        gpu.free(dev)


LEAK_CASES = {"ngram-layer": _layer_cycle, "fused-graph": _fused_cycle, "row-cache": _row_cache_cycle,
              "overlay-slots": _overlay_cycle, "stream-event-pinned": _handles_cycle}


def _held(gpu) -> dict[str, int]:
    """Everything the backend tracks: each count must come back exactly."""
    return {"allocs": len(gpu._allocs), "streams": len(gpu._streams), "events": len(gpu._events),
            "graphs": len(gpu._graphs), "alloc_host": len(gpu._host), "modules": len(gpu._modules),
            "kernels": len(gpu._kernels)}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(LEAK_CASES))
def test_build_use_close_1000_times_leaks_nothing(gpu, rng, tmp_path, case):
    with LEAK_CASES[case](gpu, rng, tmp_path) as (cycle, probe):
        cycle()  # warm-up: modules loaded, staging pool and driver pools grown
        first = probe()
        gpu.synchronize()
        held, handles, threads = _held(gpu), dict(gpu._kernels), set(threading.enumerate())
        free, staged = {}, {}
        for i in range(1, N + 1):
            cycle()
            if i in (CHECKPOINT, N):
                gpu.synchronize()
                free[i], staged[i] = gpu.mem_info()[0], gpu.pinned_buffers - len(gpu._host)
        assert _held(gpu) == held
        assert not set(threading.enumerate()) - threads, "threads left running"
        assert all(gpu.kernel(*key) is handle for key, handle in handles.items())  # loaded once
        grew = free[CHECKPOINT] - free[N]
        assert grew <= SLACK or not DEVICE_MEMORY_MEASURABLE, f"device memory in use grew by {grew} bytes from cycle {CHECKPOINT} to {N}"
        assert staged[N] <= staged[CHECKPOINT] + STAGING_SLACK, f"staging pool grew: {staged}"
        np.testing.assert_array_equal(probe(), first)


# -- 2. The kernel cache under faults (CPU) ---------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GPU_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _tiny(tmp_path: Path, rng) -> Path:
    src = tmp_path / "tiny.cu"
    src.write_text(f'extern "C" __global__ void k(float* x) {{ x[0] *= {int(rng.integers(2, 999))}.0f; }}\n')
    return src


def _flip(blob: bytes, rng, lo: int, hi: int) -> bytes:
    out = bytearray(blob)
    out[int(rng.integers(lo, hi))] ^= 1 << int(rng.integers(0, 8))
    return bytes(out)


DAMAGE = {  # an entry is magic (8 bytes), sha256 of the payload (32), payload
    "cut-in-half": lambda b, rng: b[: len(b) // 2],
    "cut-in-header": lambda b, rng: b[: int(rng.integers(1, 40))],
    "header-only": lambda b, rng: b[:40],
    "cut-near-end": lambda b, rng: b[: len(b) - int(rng.integers(1, 8))],
    "magic-bit": lambda b, rng: _flip(b, rng, 0, 8),
    "digest-bit": lambda b, rng: _flip(b, rng, 8, 40),
    "payload-bit": lambda b, rng: _flip(b, rng, 40, len(b)),
    "appended": lambda b, rng: b + rng.integers(0, 256, 5, dtype=np.uint8).tobytes(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_entry_is_rebuilt_and_rewritten_whole(tmp_path, cache, rng, damage):
    src = _tiny(tmp_path, rng)
    first = compiler.compile_module(src, TARGET)
    (entry,) = cache.iterdir()
    whole = entry.read_bytes()
    entry.write_bytes(DAMAGE[damage](whole, rng))
    rebuilt = compiler.compile_module(src, TARGET)
    assert not rebuilt.cached and rebuilt.image == first.image
    assert list(cache.iterdir()) == [entry], "a temp file was left behind"
    assert entry.read_bytes() == whole
    assert compiler.compile_module(src, TARGET).cached


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("how", ["parent-is-a-file", "read-only-dir"])
def test_unwritable_cache_compiles_in_memory_and_writes_nothing(tmp_path, monkeypatch, rng, how):
    src = _tiny(tmp_path, rng)
    want = compiler.compile_module(src, TARGET, use_cache=False).image
    if how == "parent-is-a-file":
        (tmp_path / "blocker").write_text("")
        monkeypatch.setenv("GPU_RUNTIME_CACHE_DIR", str(tmp_path / "blocker" / "cache"))
    else:  # a directory that refuses new files, as a read-only mount does (chmod would not stop root)
        monkeypatch.setenv("GPU_RUNTIME_CACHE_DIR", str(tmp_path / "cache"))
        compiler.compile_module(src, TARGET)
        (entry,) = (tmp_path / "cache").iterdir()
        good = entry.read_bytes()
        entry.write_bytes(good[:-1])  # damaged: forces a rebuild the directory cannot take
        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "cache"))
        monkeypatch.setattr(compiler.tempfile, "mkstemp", refuse)
    before = _tree(tmp_path)
    with pytest.warns(UserWarning, match="kernel cache not written"):
        out = compiler.compile_module(src, TARGET)
    assert out.image == want and not out.cached
    assert _tree(tmp_path) == before, "an unwritable cache was written to"
    if how == "read-only-dir":  # a valid entry is still read, silently
        entry.write_bytes(good)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            hit = compiler.compile_module(src, TARGET)
        assert hit.cached and hit.image == want


@pytest.mark.parametrize("fault", ["disk-full", "entry-is-a-directory"])
def test_failed_cache_write_leaves_no_temp_file(tmp_path, cache, monkeypatch, rng, fault):
    src = _tiny(tmp_path, rng)
    want = compiler.compile_module(src, TARGET, use_cache=False).image
    if fault == "disk-full":  # the temp file's bytes go to /dev/full: a real ENOSPC
        if not os.path.exists("/dev/full"):
            pytest.skip("no /dev/full")
        monkeypatch.setattr(compiler.os, "fdopen", lambda fd, mode: (os.close(fd), open("/dev/full", mode))[1])
    else:  # os.replace cannot put a file where a directory is
        compiler.compile_module(src, TARGET)
        (entry,) = cache.iterdir()
        entry.unlink()
        entry.mkdir()
    with pytest.warns(UserWarning, match="kernel cache not written"):
        assert compiler.compile_module(src, TARGET).image == want
    assert [p.name for p in cache.iterdir() if p.name.endswith(".tmp")] == []


def _compile_at_barrier(barrier, cache_dir: str, source: str, results) -> None:
    """Runs in a spawned process: wait for the other one, then compile through the cache."""
    os.environ["GPU_RUNTIME_CACHE_DIR"] = cache_dir
    try:
        barrier.wait(timeout=120)
        out = compiler.compile_module(Path(source), TARGET)
        results.put((out.image, out.cached, None))
    except BaseException as exc:  # reported to the parent
        results.put((b"", False, repr(exc)))


def test_two_processes_compiling_at_once_leave_one_good_entry(tmp_path, cache):
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_compile_at_barrier, args=(barrier, str(cache), str(RUNTIME_TEST_CU), results))
             for _ in range(2)]
    try:
        for p in procs:
            p.start()
        got = [results.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert [err for _, _, err in got] == [None, None]
    assert [p.exitcode for p in procs] == [0, 0]
    assert got[0][0] and got[0][0] == got[1][0], "the two processes got different images"
    assert not (got[0][1] and got[1][1]), "the cache was empty: one of them must have compiled"
    names = [p.name for p in cache.iterdir()]  # no *.tmp left, one entry
    assert len(names) == 1 and names[0].startswith("runtime_test-compute_90-") and names[0].endswith(".bin"), names
    again = compiler.compile_module(RUNTIME_TEST_CU, TARGET)
    assert again.cached and again.image == got[0][0]


# -- 3. Concurrency (GPU) -----------------------------------------------------------------------
MAX_ROWS, STEPS, THREAD_CALLS = 32, 6, 20


class _Job:
    """One runner (fused or the seed's) on its own dims and random weights, ``count`` calls
    (context, seq_len) and one output slice per call, so no call overwrites another's result."""

    def __init__(self, gpu, rng, count: int, fused: bool) -> None:
        vocab = int(rng.integers(300, 4000))
        self.dims = dims = NgramDims(
            vocab_size=vocab, hidden_size=int(rng.choice([64, 96, 160])), max_ngram=int(rng.integers(2, 5)),
            splits=int(rng.integers(1, 3)), base_rows=int(rng.integers(100, 3000)),
            row_bias=int(rng.integers(0, 2)), table_dim=int(rng.choice([8, 16, 33])),
            eos_id=int(rng.integers(0, vocab)))
        host = random_layer(rng, dims, "bf")
        self.gpu, self.count, self.calls, self.out = gpu, count, [], DevicePtr(0)
        self.layer: NgramEmbedding | None = None
        self.fused: FusedNgramEmbedding | None = None
        self.weights = NgramWeights.from_numpy(dims, host.word, _tables(host), host.projs, gpu)
        try:
            if fused:
                self.fused = FusedNgramEmbedding(self.weights, MAX_ROWS)
            else:
                self.layer = NgramEmbedding(self.weights, MAX_ROWS)
            self.out = gpu.alloc(count * MAX_ROWS * dims.hidden_size * 2)
        except BaseException:
            self.close()
            raise
        self.new_calls(rng)
        gpu.synchronize()  # uploads went to the default stream; created streams do not wait for it

    def new_calls(self, rng) -> None:
        """Fresh tokens; seq_lens kept after the first draw, so graphs are replayed, not recaptured."""
        lens = [s for _, s in self.calls] or [int(rng.integers(1, MAX_ROWS + 1)) for _ in range(self.count)]
        self.calls = [(rng.integers(0, self.dims.vocab_size, s + int(rng.integers(0, 40))), s) for s in lens]

    def run(self, i: int, stream: int, graph: bool = False) -> None:
        ctx, seq = self.calls[i]
        out = self.out.offset(i * MAX_ROWS * self.dims.hidden_size * 2)
        if self.fused is not None:
            self.fused.embed(ctx, seq, out, stream, graph=graph)
        else:
            self.layer.embed(ctx, seq, out, self.gpu, stream)

    def poison(self) -> None:
        self.gpu.memset(self.out, 0xFF, self.count * MAX_ROWS * self.dims.hidden_size * 2)
        self.gpu.synchronize()

    def read(self, stream: int) -> np.ndarray:
        return _read(self.gpu, self.out, (self.count, MAX_ROWS, self.dims.hidden_size), stream)

    def reference(self) -> np.ndarray:
        """Every call alone and in order on the default stream (eager), then poison for the next run."""
        self.poison()
        for i in range(self.count):
            self.run(i, 0)
        want = self.read(0)
        for i, (_, seq) in enumerate(self.calls):
            assert (want[i, :seq] != 0xFFFF).all(), "the reference left elements unwritten"
        self.poison()
        return want

    def close(self) -> None:
        self.gpu.synchronize()
        for runner in (self.fused, self.layer):
            if runner is not None:
                runner.close()
        self.weights.close()
        if self.out:
            self.gpu.free(self.out)


@contextmanager
def _jobs(gpu, rng, count: int, fused: bool):
    jobs: list[_Job] = []
    try:
        for _ in range(2):
            jobs.append(_Job(gpu, rng, count, fused))
        yield jobs
    finally:
        for job in jobs:
            job.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["seed", "fused-graph"])
def test_two_layers_interleaved_on_two_streams_equal_sequential_runs(gpu, rng, fused):
    with _jobs(gpu, rng, STEPS, fused) as jobs:
        streams = [gpu.create_stream() for _ in jobs]
        try:
            for rnd in range(2):  # fused: round 0 captures one graph per call, round 1 replays them
                if rnd:
                    for job in jobs:
                        job.new_calls(rng)
                want = [job.reference() for job in jobs]
                for i in range(STEPS):  # interleaved, nothing synchronised in between
                    for job, stream in zip(jobs, streams):
                        job.run(i, stream, graph=fused)
                for job, stream, w in zip(jobs, streams, want):
                    np.testing.assert_array_equal(job.read(stream), w)
            if fused:
                assert [job.fused.captured_graphs for job in jobs] == [STEPS, STEPS]
        finally:
            for stream in streams:
                gpu.destroy_stream(stream)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["seed", "fused"])
def test_two_threads_each_with_its_stream_and_layer_equal_sequential_runs(gpu, rng, fused):
    with _jobs(gpu, rng, THREAD_CALLS, fused) as jobs:
        want = [job.reference() for job in jobs]
        barrier = threading.Barrier(len(jobs), timeout=120)
        got: dict[int, np.ndarray] = {}
        errors: list[BaseException] = []

        def work(index: int) -> None:
            try:
                stream = gpu.create_stream()
                try:
                    barrier.wait()
                    for i in range(THREAD_CALLS):
                        jobs[index].run(i, stream)
                    got[index] = jobs[index].read(stream)
                finally:
                    gpu.destroy_stream(stream)
            except BaseException as exc:  # surfaced below
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        for i, w in enumerate(want):
            np.testing.assert_array_equal(got[i], w)
