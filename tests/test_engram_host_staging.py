"""``HostStaging``: the staged lookup of host-memory Engram tables.

CPU: the protocol on a simulated device (``MemoryBackend``; the kernels emulated, the host
functions run where they are queued, real semaphores and the real worker): every chunk is
staged, stamped with its call's number and released before its read, every host layer's staged
row is its table's row, a device layer is not staged, calls follow each other, a worker failure
is reported and never blocks the stream, ``close`` stops the worker.
GPU: a staged prefill (eager, and replayed from a captured graph with new tokens) writes the
bits the in-place lookup writes, and ``kv`` and the text flags the same.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from gpu_runtime import DeviceArray, DeviceCopies, HostFunctions, KernelHandle
from layers.engram import host_staging
from layers.engram.host_staging import HostStaging, chunk_bounds
from layers.ngram_store.row_block import RowBlock
from layers.ops.engram import EngramLaunches
from layers.ops.token_history import TokenCode
from layers.resources import Resources
from tests.helpers.fakes import MemoryBackend

NO_ROW = np.uint64(0xFFFFFFFFFFFFFFFF)
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
LAYERS, HEADS, NGRAM, WIDTH, STRIDE = 2, 2, 3, 32, 40
COLS = (NGRAM - 1) * HEADS


class StagingBackend(MemoryBackend, DeviceCopies, HostFunctions):
    """``MemoryBackend`` with any kernel, device copies, and host functions called where they
    are queued (a ``sem_wait`` blocks this thread until the worker posts, as the stream would)."""

    def __init__(self, emulate) -> None:
        super().__init__("engram", [], emulate)
        self.host_calls: list[int] = []

    def kernel(self, source, name):
        if name not in self.handles:
            handle = KernelHandle(0x100 + len(self.handles))
            self.handles[name] = handle
            self.names[int(handle)] = name
        return self.handles[name]

    def copy_d2d_async(self, dst, src, nbytes, stream=0) -> None:
        data = self.read(src, nbytes)
        buf, off = self._find(dst, nbytes)
        buf[off:off + nbytes] = data

    def launch_host_func(self, stream, fn, data) -> None:
        self.host_calls.append(fn)
        HOST_FN(fn)(data)


class Rig:
    """A staged lookup over two layers (``places``) on the simulated device; each call's ids are
    drawn by the test (``plan``) and the reads of each chunk checked against the tables."""

    def __init__(self, rng, places=("host", "host"), rows=(50, 70), max_rows=20, threads=3) -> None:
        self.rng = rng
        self.plan: list[np.ndarray] = []  # each call's ids [LAYERS * rows * COLS], NO_ROW for zeros
        self.reads: list[tuple[int, int, int]] = []  # (call number, r0, r1) of each chunk read
        self.gpu = gpu = StagingBackend({"engram_row_ids": self.row_ids, "engram_staged_rows": self.staged_rows})
        self.own = own = Resources(gpu)
        self.blocks = [own.adopt(RowBlock(gpu, n, STRIDE, where)) for n, where in zip(rows, places)]
        self.rows = []
        for block, n in zip(self.blocks, rows):
            data = rng.integers(0, 256, (n, STRIDE), np.uint8)
            block.write(0, data)
            self.rows.append(data)
        ptr = [own.alloc(64) for _ in range(10)]
        self.launches = EngramLaunches(
            gpu, ptr[0], ptr[1], ptr[2], max_seqs=4, hist_len=NGRAM - 1, max_draft=0, code=TokenCode(ptr[3], 50),
            pad=2, mult=ptr[4], primes=ptr[5], offsets=ptr[6], tables=ptr[7], emb=ptr[8], text_out=ptr[9],
            max_rows=max_rows, layers=LAYERS, max_ngram=NGRAM, heads=HEADS, width=WIDTH, stride=STRIDE,
            host_tables=True)
        self.staging = HostStaging(gpu, own, self.launches, self.blocks, max_rows=max_rows, threads=threads)

    def call(self, rows: int, timeout: float = 20.0) -> None:
        """One staged lookup of ``rows`` rows with fresh ids, in a thread: it must finish."""
        ids = np.stack([self.rng.integers(0, len(t), rows * COLS) for t in self.rows]).astype(np.uint64)
        ids[self.rng.random(ids.shape) < 0.2] = NO_ROW
        self.plan.append(ids.reshape(-1))
        done = threading.Thread(target=self.staging.lookup, args=(1, 2, 3, 0, rows, 1, rows, 7))
        done.start()
        done.join(timeout)
        assert not done.is_alive(), "the staged call never finished: a chunk was not released"

    # emulated kernels (argument order: kernels/engram.cu)
    def row_ids(self, gpu, args) -> None:
        ids, gen, rows = args[11], args[12], args[15]
        g = int(gpu.read_as(gen, 1, np.uint32)[0]) + 1
        gpu.copy_h2d_async(np.array([g], np.uint32), gen)
        gpu.copy_h2d_async(np.concatenate([[np.uint64(rows | g << 32)], self.plan[-1]]), ids)

    def staged_rows(self, gpu, args) -> None:
        ids_p, staged_p, _, gen, ready, _, _, rows, r0, r1, chunk = args[:11]
        staged_layers = args[16]
        g = int(gpu.read_as(gen, 1, np.uint32)[0])
        assert not any(p <= ready < p + n for p, n in gpu.mapped.values()), "every warp reads its stamp over the link"
        assert int(gpu.read_as(ready + 4 * chunk, 1, np.uint32)[0]) == g, "read before the host stamped it"
        ids = gpu.read_as(ids_p + 8, LAYERS * rows * COLS, np.uint64).reshape(LAYERS, rows, COLS)
        staged = gpu.read_as(staged_p, LAYERS * rows * COLS * STRIDE, np.uint8).reshape(LAYERS, rows, COLS, STRIDE)
        for layer in range(LAYERS):
            if not staged_layers >> layer & 1:
                continue
            for r in range(r0, r1):
                for j in range(COLS):
                    if ids[layer, r, j] != NO_ROW:
                        assert (staged[layer, r, j] == self.rows[layer][ids[layer, r, j]]).all()
        self.reads.append((g, r0, r1))


def test_chunks_cover_the_rows_in_order():
    assert chunk_bounds(1) == [(0, 1)]
    assert chunk_bounds(3) == [(0, 1), (1, 2), (2, 3)]
    assert chunk_bounds(20, 8) == [(0, 2), (2, 5), (5, 7), (7, 10), (10, 12), (12, 15), (15, 17), (17, 20)]
    for rows in range(1, 40):
        b = chunk_bounds(rows)
        assert b[0][0] == 0 and b[-1][1] == rows and all(x[1] == y[0] and x[0] < x[1] for x, y in zip(b, b[1:]))


@pytest.mark.parametrize("places", [("host", "host"), ("host", "device"), ("device", "host")])
def test_every_chunk_is_staged_and_stamped_before_it_is_read(rng, places):
    rig = Rig(rng, places)
    assert rig.staging.staged_layers == sum(1 << i for i, p in enumerate(places) if p == "host")
    for call, rows in enumerate([20, 1, 7, 20], start=1):
        rig.call(rows)
        reads = [(r0, r1) for g, r0, r1 in rig.reads if g == call]
        assert reads == chunk_bounds(rows)
    post, wait = (ctypes.cast(getattr(host_staging._libc, n), ctypes.c_void_p).value for n in ("sem_post", "sem_wait"))
    assert rig.gpu.host_calls[:1 + len(chunk_bounds(20))] == [post] + [wait] * len(chunk_bounds(20))
    assert rig.staging.error is None
    rig.own.close()
    assert not rig.staging._worker.is_alive()


def test_a_failed_gather_is_reported_and_releases_every_chunk(rng, monkeypatch):
    rig = Rig(rng)

    def fail(*args):
        raise MemoryError("no room")

    monkeypatch.setattr(rig.staging, "_take", fail)
    rig.gpu.emulate["engram_staged_rows"] = lambda gpu, args: rig.reads.append(tuple(args[8:10]))
    rig.call(20)
    assert rig.reads == chunk_bounds(20)  # every chunk released: the stream goes on
    assert isinstance(rig.staging.error, MemoryError)
    rig.own.close()


def test_close_stops_an_idle_worker_and_frees_the_buffers(rng):
    rig = Rig(rng)
    pinned = [rig.staging.ids_host, rig.staging.staging, rig.staging.ready]
    rig.own.close()
    assert not rig.staging._worker.is_alive()
    assert all(array.ctypes.data not in rig.gpu.host for array in pinned)


# -- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["host", ["host", "device"]])
def test_a_staged_prefill_writes_the_bits_of_the_in_place_lookup(gpu, rng, monkeypatch, placement):
    """Eager calls, then a captured graph replayed with new tokens: emb, kv, text flags and the
    histories equal a decoder that reads every row in place; no error raised."""
    from tests.test_engram_decoder import Model, read, sequences, u32

    monkeypatch.setattr("layers.engram.decoder.STAGED_ROWS", 4)
    m = Model(gpu, rng, placement)
    cfg, max_rows = m.cfg, 40
    staged, direct = (m.decoder(max_seqs=4, max_rows=max_rows, host_threads=t) for t in (3, 0))
    assert staged.staging is not None and direct.staging is None
    stream = gpu.create_stream()

    def compare(t: int) -> None:
        gpu.synchronize(stream)
        for i in range(len(cfg.layer_ids)):
            for addr, width in ((staged.emb_of(i), cfg.emb_dim), (staged.kv_of(i), cfg.kv_dim)):
                other = direct.emb_of(i) if addr == staged.emb_of(i) else direct.kv_of(i)
                got, want = read(gpu, addr, (t, width), np.uint16), read(gpu, other, (t, width), np.uint16)
                assert (got == want).all()
        assert (read(gpu, staged.text, t, np.uint8) == read(gpu, direct.text, t, np.uint8)).all()

    for dec in (staged, direct):
        for s in range(3):
            dec.reset(s)
    for lengths in ([7, 1, 12], [3, 30, 2]):  # eager: prompts, then continued
        seqs = sequences(rng, lengths)
        tokens, cu = np.concatenate(seqs), np.cumsum([0] + lengths)
        args = (u32(gpu, tokens), u32(gpu, cu), u32(gpu, [2, 0, 1]), 3, len(tokens))
        for dec in (staged, direct):
            gpu.memset(dec.emb, 0x5A, 2 * max_rows * cfg.emb_dim * 2)
            dec.prefill(*args, stream=stream)
        compare(len(tokens))
    t = 24  # a graph of one 24-token sequence per slot 3, replayed with new tokens
    tok, cu, slot = DeviceArray.from_numpy(gpu, np.zeros(t, np.uint32)), u32(gpu, [0, t]), u32(gpu, [3])
    staged.reset(3)
    direct.reset(3)
    gpu.synchronize()
    gpu.begin_capture(stream)
    staged.prefill(tok, cu, slot, 1, t, stream=stream)
    graph = gpu.end_capture(stream)
    for _ in range(3):
        tokens = sequences(rng, [t])[0].astype(np.uint32)
        gpu.copy_h2d_async(tokens, tok.ptr, stream)
        gpu.launch_graph(graph, stream)
        direct.prefill(tok, cu, slot, 1, t, stream=stream)
        compare(t)
    gpu.destroy_graph(graph)
    for dec in (staged, direct):
        assert dec.check_errors(stream) == 0
        dec.close()
    m.weights.close()
