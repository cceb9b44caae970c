"""NgramDecoder as an engine drives it: padded graph batches (PAD_SLOT), forks, history-only
seeding (prefix-cache hits), per-sequence adapters inside the n-gram sum, and buffers from other
libraries. On the CPU: the launches and arguments each call makes, and every refusal before any
launch. On the GPU: every row bit for bit the fused path on the same tokens (with the same
adapters, and on weights whose word table holds the adapter's rows), padded rows zeros, flags
exactly where a bad value was, and nothing written outside the outputs."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from gpu_runtime import ClosedError, DeviceArray, DevicePtr, dlpack
from layers import reference as ref
from layers.ngram_embed import NO_ADAPTER, PAD_SLOT, DecodeError, FusedNgramEmbedding, NgramDecoder, NgramWeights
from layers.overlay import OverlaySlots
from layers.dense_weight import BF16, FP8, DenseWeight
from tests.helpers.fakes import ForeignArray, RecordingBackend
from tests.helpers import Guarded, bits
from tests.helpers.decoder import World, u32
from tests.helpers.ngram import device_weights, random_layer, small_dims
from tests.helpers.overlay import random_overlay

P = [DevicePtr(0x100000 * (i + 1)) for i in range(8)]
GATHER_ADAPTERS = slice(21, 28)  # ngram_decode_gather's adapters .. word_over
GEMM_WORD_OVER = 8               # dense_gemm_bf16_word's word_over


def recording(adapters: int = 0, h: int | None = None):
    gpu = RecordingBackend()
    dims = small_dims(max_ngram=3, splits=2, eos_id=7)
    weights = device_weights(gpu, random_layer(np.random.default_rng(1), dims, "bf"))
    slots = OverlaySlots(gpu, adapters, dims.vocab_size, h or dims.hidden_size) if adapters else None
    return gpu, NgramDecoder(weights, max_seqs=4, max_rows=32, max_draft=2, adapter_slots=slots), slots


# -- CPU ----------------------------------------------------------------------------------------
def test_pad_and_no_adapter_are_the_all_ones_word():
    assert PAD_SLOT == NO_ADAPTER == 0xFFFFFFFF == np.uint32(np.int32(-1))


def test_seed_and_fork_are_one_launch_each_with_nothing_else():
    gpu, dec, _ = recording()
    gpu.launches.clear()
    gpu.ops.clear()
    dec.seed(P[0], P[1], P[2], 3, 300, stream=5)  # more tokens than max_rows: no gather, no limit
    dec.fork(P[3], P[4], 7, stream=5)
    assert [gpu.kernel_of(launch)[1] for launch in gpu.launches] == ["ngram_decode_seed", "ngram_decode_fork"]
    assert gpu.ops == [], "no upload, allocation or memset"
    seed, fork = gpu.launches
    assert seed.args == [P[0], P[1], P[2], dec.hist, dec.state, dec.ctrl, 300, 3, 4, dec.hist_len, 500]
    assert seed.grid == (1, 1, 1) and seed.stream == 5
    assert fork.args == [P[3], P[4], dec.hist, dec.state, dec.ctrl, 7, 4, dec.hist_len]
    assert fork.grid == (1, 1, 1) and fork.stream == 5


def test_adapters_route_through_the_gather_into_the_gemm():
    gpu, dec, slots = recording(adapters=3)
    gpu.launches.clear()
    dec.step(P[0], P[1], 4, P[2], stream=2, k=2, adapters=P[3])
    gather, gemm = gpu.launches
    assert gather.args[GATHER_ADAPTERS] == [P[3], slots.embed_slot_map_tab, slots.embed_rows_tab,
                                            slots.embed_n_tab, 3, dec.dims.hidden_size, dec.word_over]
    assert gemm.args[GEMM_WORD_OVER] == dec.word_over
    # one word pair per row beside the T table pairs: (8 rows * (4 + 1)) / 8 warps a block
    assert gather.grid == (5, 1, 1)
    gpu.launches.clear()
    dec.step(P[0], P[1], 4, P[2], stream=2)  # no adapters this call: nulls, the base word table
    gather, gemm = gpu.launches
    assert gather.args[GATHER_ADAPTERS] == [0, 0, 0, 0, 0, 0, 0] and gemm.args[GEMM_WORD_OVER] == 0


def test_adapter_refusals_launch_nothing():
    gpu, dec, _ = recording()
    gpu.launches.clear()
    with pytest.raises(ValueError, match="adapters given, but the decoder was built without adapter_slots"):
        dec.step(P[0], P[1], 2, P[2], adapters=P[3])
    with pytest.raises(ValueError, match="vocab 500 x 41, the model's word table is 500 x 40"):
        recording(adapters=2, h=41)
    gpu, dec, slots = recording(adapters=2)
    with pytest.raises(TypeError, match="adapters: dtype float32"):
        dec.step(P[0], P[1], 2, P[2], adapters=ForeignArray(P[3], (2,), "<f4"))
    with pytest.raises(ValueError, match="adapters: 1 entries, the call needs 2"):
        dec.step(P[0], P[1], 2, P[2], adapters=ForeignArray(P[3], (1,), "<u4"))
    with pytest.raises(ValueError, match="width 41, the served table 40"):  # a wrong adapter, at load
        slots.load(0, random_overlay(np.random.default_rng(2), 500, 41, 3, None))
    with pytest.raises(TypeError, match="adapter_slots must be an OverlaySlots"):
        NgramDecoder(dec.weights, max_seqs=2, max_rows=4, adapter_slots=object())
    gpu.launches.clear()
    slots.close()
    with pytest.raises(ClosedError, match="OverlaySlots is closed"):
        dec.step(P[0], P[1], 2, P[2], adapters=P[3])
    assert gpu.launches == []


def test_foreign_arrays_pass_their_addresses():
    """The array interface (int32 read as u32 bits), DLPack (a DeviceArray's own capsule) and a
    2-D bf16 out of D columns: the launches get the arrays' addresses."""
    gpu, dec, _ = recording()
    h = dec.dims.hidden_size
    gpu.launches.clear()
    tokens = ForeignArray(P[0], (2, 3), "<i4")
    slots = DeviceArray(gpu, P[1], (2,), np.int32)
    out = DeviceArray(gpu, P[2], (6, h), BF16)
    dec.step(tokens, slots, 2, _Dlpack(out), k=3)
    gather, gemm = gpu.launches
    assert gather.args[:3] == [P[0], 0, P[1]] and gemm.args[2] == P[2]
    assert dlpack.live_exports() == 0, "the capsule read was released"
    with pytest.raises(ValueError, match="out: 5 entries, the call needs 240"):
        dec.step(tokens, slots, 2, ForeignArray(P[2], (5,), "<V2"), k=3)
    masked = ForeignArray(P[0], (2, 3), "<i4")
    masked.__cuda_array_interface__ = {**masked.__cuda_array_interface__, "mask": ForeignArray(P[3], (2, 3), "|b1")}
    with pytest.raises(TypeError, match="masked"):
        dec.step(masked, slots, 2, out, k=3)


class _Dlpack:
    """Only DLPack: the capsule of a ``DeviceArray`` (torch's bf16 tensors look like this)."""

    def __init__(self, array: DeviceArray) -> None:
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class _Producer:
    """A DLPack producer over a ``DeviceArray`` that records what it was asked, taking only the
    keywords ``takes`` (others: TypeError, as an older producer), and answering with a versioned
    capsule of ``flags`` when asked for DLPack 1.x (``versioned``)."""

    def __init__(self, array: DeviceArray, takes=("stream", "max_version", "copy"), versioned=False, flags=0):
        self.array, self.takes, self.versioned, self.flags, self.asked = array, takes, versioned, flags, []

    def __dlpack__(self, **kwargs):
        self.asked.append(kwargs)
        if set(kwargs) - set(self.takes):
            raise TypeError(f"__dlpack__() got an unexpected keyword argument {sorted(set(kwargs) - set(self.takes))}")
        if self.versioned and kwargs.get("max_version"):
            return _versioned_capsule(self.array, self.flags)
        return self.array.__dlpack__(**{k: v for k, v in kwargs.items() if k != "max_version"})

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


_KEEP: list = []  # the versioned capsules' structures (the test's capsules have no destructor)


def _versioned_capsule(array: DeviceArray, flags: int):
    """A ``dltensor_versioned`` capsule over ``array`` as a DLPack 1.x producer makes it."""
    import ctypes

    managed = dlpack._ManagedVersioned()
    ndim = len(array.shape)
    shape = (ctypes.c_int64 * ndim)(*array.shape)
    managed.version.major, managed.version.minor, managed.flags = 1, 0, flags
    t = managed.dl_tensor
    t.data, t.device, t.ndim = int(array.ptr), dlpack._Device(dlpack.KDL_CUDA, 0), ndim
    t.dtype = dlpack._DataType(*dlpack._DTYPES[array.dtype], 1)
    t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    _KEEP.append((managed, shape))
    return dlpack._capsule_new(ctypes.addressof(managed), b"dltensor_versioned", None)


def test_dlpack_is_read_without_a_stream_handshake_or_a_copy():
    """``stream=-1`` (no synchronisation: the call stays capturable), ``copy=False`` and DLPack
    1.0 asked first; a producer that takes fewer keywords is asked with fewer; a versioned
    capsule is read, its read-only flag refuses an output, its is-copied flag refuses the array."""
    gpu, dec, _ = recording()
    h = dec.dims.hidden_size
    tokens, slots = DeviceArray(gpu, P[0], (6,), np.uint32), DeviceArray(gpu, P[1], (2,), np.uint32)
    out = DeviceArray(gpu, P[2], (6, h), BF16, stream=77)  # a producer on another stream
    for takes, asked in [(("stream", "max_version", "copy"), [{"stream": -1, "max_version": (1, 0), "copy": False}]),
                         (("stream",), [{"stream": -1, "max_version": (1, 0), "copy": False}, {"stream": -1}]),
                         ((), [{"stream": -1, "max_version": (1, 0), "copy": False}, {"stream": -1}, {}])]:
        producer = _Producer(out, takes)
        before = len(gpu.ops)
        dec.step(tokens, slots, 2, producer, k=3)
        assert producer.asked == asked
        syncs = [op for op in gpu.ops[before:] if op[0] == "sync"]
        assert syncs == ([("sync", 77)] if not takes else [])  # only the oldest producer synchronises
    assert dlpack.live_exports() == 0
    gpu.launches.clear()
    dec.step(tokens, slots, 2, _Producer(out, versioned=True), k=3)
    assert gpu.launches[-1].args[2] == P[2]
    with pytest.raises(ValueError, match="read-only"):
        dec.step(tokens, slots, 2, _Producer(out, versioned=True, flags=dlpack.FLAG_READ_ONLY), k=3)
    with pytest.raises(BufferError, match="IS_COPIED"):
        dec.step(tokens, slots, 2, _Producer(out, versioned=True, flags=dlpack.FLAG_IS_COPIED), k=3)
    t = dlpack.read(_versioned_capsule(out, dlpack.FLAG_READ_ONLY))
    assert (t.ptr, t.shape, t.dtype, t.readonly, t.copied) == (P[2], (6, h), BF16, True, False)


def test_device_array_exports_dlpack_and_releases_it():
    gpu = RecordingBackend()
    arr = DeviceArray(gpu, P[5], (3, 7), BF16)
    capsule = arr.__dlpack__()
    t = dlpack.read(capsule)
    assert (t.ptr, t.shape, t.dtype, t.strides, t.device_type) == (P[5], (3, 7), BF16, None, dlpack.KDL_CUDA)
    assert dlpack.live_exports() == 1
    del capsule  # never consumed: the capsule's destructor releases it
    assert dlpack.live_exports() == 0
    _consume_and_release(arr.__dlpack__())  # consumed: the consumer's deleter releases it
    assert dlpack.live_exports() == 0
    with pytest.raises(BufferError, match="copy=True"):
        arr.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="no DLPack type for float8_e4m3fn"):  # the array API's error
        DeviceArray(gpu, P[5], (3,), FP8).__dlpack__()
    arr.ptr = DevicePtr(0)  # freed: neither protocol hands out a null pointer
    with pytest.raises(BufferError, match="freed"):
        arr.__dlpack__()
    with pytest.raises(BufferError, match="freed"):
        arr.__cuda_array_interface__


def test_device_array_exports_name_the_stream_a_consumer_waits_for():
    """The array interface gives the array's stream (0 as 1: the interface's legacy default
    stream; before, 0 went out as None, "no synchronisation needed"); ``__dlpack__`` completes
    the array's stream's work unless the consumer is on that stream (None and 1 name the legacy
    default stream) or asks for none (-1)."""
    gpu = RecordingBackend()
    legacy = DeviceArray(gpu, P[1], (4,), np.uint32)
    own = DeviceArray(gpu, P[2], (4,), np.uint32, stream=77)
    assert legacy.__cuda_array_interface__["stream"] == 1 and own.__cuda_array_interface__["stream"] == 77
    cases = [(legacy, None, []), (legacy, 1, []), (legacy, -1, []), (legacy, 2, [0]), (legacy, 77, [0]),
             (own, None, [77]), (own, 1, [77]), (own, 2, [77]), (own, 77, []), (own, -1, [])]
    for arr, stream, syncs in cases:
        before = len(gpu.ops)
        arr.__dlpack__(stream=stream)  # not consumed: released at once
        assert [op[1] for op in gpu.ops[before:] if op[0] == "sync"] == syncs, (arr.stream, stream)
    assert dlpack.live_exports() == 0


def test_device_array_refuses_bad_shapes_and_frees_a_failed_upload():
    gpu = RecordingBackend()
    for shape, error in (((-1, 4), ValueError), ((2, 2.5), TypeError), ("ab", TypeError), (5, TypeError)):
        with pytest.raises(error, match="shape"):
            DeviceArray.empty(gpu, shape, np.float32)
        with pytest.raises(error, match="shape"):
            DeviceArray(gpu, P[1], shape, np.float32)
    assert not [op for op in gpu.ops if op[0] == "alloc"]
    huge = DeviceArray(gpu, P[1], (2**32, 2**32), np.uint16)  # no int64 wrap in the sizes
    assert (huge.size, huge.nbytes) == (2**64, 2**65)

    def refuse(*args, **kwargs):
        raise RuntimeError("copy refused")

    gpu.copy_h2d_async = refuse  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="copy refused"):
        DeviceArray.from_numpy(gpu, np.arange(6, dtype=np.uint32))
    (alloc,) = [op for op in gpu.ops if op[0] == "alloc"]
    assert ("free", alloc[1]) in gpu.ops  # the allocation went back


def _consume_and_release(capsule) -> None:
    """What a consumer (torch, CuPy) does: rename the capsule, later call the tensor's deleter."""
    import ctypes

    set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_SetName", ctypes.pythonapi))
    get = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi))
    managed = dlpack._Managed.from_address(get(capsule, b"dltensor"))
    assert set_name(capsule, b"used_dltensor") == 0
    del capsule
    assert dlpack.live_exports() == 1, "a consumed capsule leaves the tensor to its consumer"
    managed.deleter(ctypes.pointer(managed))


# -- GPU: padded graph batches ------------------------------------------------------------------
LADDER = (1, 2, 4, 8, 16)


def _padded(live: list[int], size: int, fill: np.ndarray) -> np.ndarray:
    """``live`` then ``fill`` values up to ``size`` entries (u32)."""
    return np.concatenate([np.asarray(live, np.uint32), fill[:size - len(live)].astype(np.uint32)])


@pytest.mark.gpu
def test_one_decoder_serves_every_graph_of_a_padded_ladder(gpu, rng):
    """Graphs captured at every batch size of a ladder (and k = 1, 2) over one set of buffers;
    each replay pads the live batch with PAD_SLOT entries whose tokens are garbage (even >=
    vocab): their rows come out zeros, no flag is raised and no history moves."""
    w = World(gpu, rng, max_seqs=16, max_rows=64, max_draft=2, batch_invariant=True)  # padding changes m
    dec, s, v = w.dec, w.stream, w.dims.vocab_size
    tok_d, slot_d, cnt_d = (DeviceArray.empty(gpu, (32,), np.uint32, s) for _ in range(3))
    graphs: dict[tuple[int, int], int] = {}
    try:
        w.prefill(list(range(10)), [int(n) for n in rng.integers(0, 9, 10)])
        for size in LADDER:
            for k in (1, 2):
                slot_d.upload(np.full(32, PAD_SLOT, np.uint32))
                tok_d.upload(rng.integers(0, 2 * v, 32).astype(np.uint32))
                w.out.poison()
                gpu.synchronize(0)
                dec.step(tok_d, slot_d, size, w.out.ptr, s, k=k)  # eager, all padding: loads kernels
                assert not bits(w.read(size * k)).any()
                gpu.begin_capture(s)
                dec.step(tok_d, slot_d, size, w.out.ptr, s, k=k)
                graphs[size, k] = gpu.end_capture(s)
        assert dec.check_errors() == DecodeError.NONE
        for it in range(40):
            b, k = int(rng.integers(1, 11)), int(rng.integers(1, 3))
            size = next(x for x in LADDER if x >= b)
            live = [int(x) for x in rng.choice(10, b, replace=False)]
            toks = w.tokens(b * k)
            gpu.synchronize(s)
            tok_d.upload(np.concatenate([toks, rng.integers(0, 2 * v, 32 - b * k)]).astype(np.uint32))
            slot_d.upload(_padded(live, 32, np.full(32, PAD_SLOT)))
            w.out.poison()
            gpu.synchronize(0)
            gpu.launch_graph(graphs[size, k], s)
            got = w.read(size * k)
            for i, slot in enumerate(live):
                w.ctx[slot].extend(int(x) for x in toks[i * k:(i + 1) * k])
            assert np.array_equal(bits(got[:b * k]), bits(w.expect(live, [k] * b, b * k))), it
            assert not bits(got[b * k:]).any(), "padded rows are zeros"
            assert dec.check_errors() == DecodeError.NONE, it
            if k == 2:  # reject some drafts; the padded entries' garbage counts are ignored
                counts = rng.integers(0, 3, b)
                cnt_d.upload(_padded(list(counts), 32, rng.integers(0, 2**32, 32, dtype=np.uint64)))
                dec.rollback(slot_d, cnt_d, size, s)
                for slot, n in zip(live, counts):
                    del w.ctx[slot][len(w.ctx[slot]) - int(n):]
                assert dec.check_errors() == DecodeError.NONE
        for slot in range(16):
            assert dec.history(slot).tolist() == w.ctx[slot][-2:], slot
    finally:
        gpu.synchronize(s)
        for exe in graphs.values():
            gpu.destroy_graph(exe)
        for a in (tok_d, slot_d, cnt_d):
            a.free()
        w.close()


@pytest.mark.gpu
def test_padded_prefill_sequences_write_zero_rows(gpu, rng):
    w = World(gpu, rng, batch_invariant=True)
    try:
        w.prefill([0, 1], [4, 2])
        before = {s: w.dec.history(s).tolist() for s in range(6)}
        lens = [3, 5, 0, 2, 0]
        slots = [0, PAD_SLOT, PAD_SLOT, 1, 2]
        toks = w.tokens(sum(lens))
        toks[4] = w.dims.vocab_size + 9  # a bad token in a padded sequence: not looked at
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.uint32)
        w.out.poison()
        gpu.synchronize(0)
        with u32(gpu, toks) as t, u32(gpu, cu) as c, u32(gpu, slots) as sl:
            gpu.synchronize(0)
            w.dec.prefill(t, c, sl, 5, len(toks), w.out.ptr, w.stream)
            got = w.read(len(toks))
        assert w.dec.check_errors() == DecodeError.NONE
        assert not bits(got[3:8]).any()
        w.ctx[0].extend(int(x) for x in toks[:3])
        w.ctx[1].extend(int(x) for x in toks[8:10])
        want = w.expect([0, 1], [3, 2], 5)
        assert np.array_equal(bits(got[:3]), bits(want[:3])) and np.array_equal(bits(got[8:]), bits(want[3:]))
        assert w.dec.history(2).tolist() == before[2] == []
        for s in range(3, 6):
            assert w.dec.history(s).tolist() == before[s]
    finally:
        w.close()


# -- GPU: fork ---------------------------------------------------------------------------------
@pytest.mark.gpu
def test_fork_copies_history_and_position(gpu, rng):
    """A request forks into three samples (one pair padded); every sample then decodes on its
    own tokens, drafts and rollbacks (the position copied too), equal to the fused path on the
    copied context. A bad slot is flagged and its pair left alone. The fork is captured once and
    replayed with other slots."""
    w = World(gpu, rng, max_seqs=8)
    dec, s = w.dec, w.stream
    try:
        w.prefill([0, 5], [9, 4])
        w.reset(2)
        src = [0, 0, 0, PAD_SLOT]
        dst = [2, 3, 4, 1]
        with u32(gpu, src) as a, u32(gpu, dst) as b:
            gpu.synchronize(0)
            dec.fork(a, b, 4, s)
            gpu.synchronize(s)
        for d in (2, 3, 4):
            w.ctx[d] = list(w.ctx[0])
        assert dec.check_errors() == DecodeError.NONE
        assert dec.history(1).tolist() == []  # the padded pair's destination
        samples = [0, 2, 3, 4]
        for it in range(6):
            k = int(rng.integers(1, 4))
            toks = w.tokens(4 * k)
            with u32(gpu, toks) as t, u32(gpu, samples) as sl:
                w.out.poison()
                gpu.synchronize(0)
                dec.step(t, sl, 4, w.out.ptr, s, k=k)
                got = w.read(4 * k)
            for i, slot in enumerate(samples):
                w.ctx[slot].extend(int(x) for x in toks[i * k:(i + 1) * k])
            assert np.array_equal(bits(got), bits(w.expect(samples, [k] * 4, 4 * k))), it
            counts = rng.integers(0, k, 4)
            with u32(gpu, samples) as sl, u32(gpu, counts) as c:
                gpu.synchronize(0)
                dec.rollback(sl, c, 4, s)
                gpu.synchronize(s)
            for slot, n in zip(samples, counts):
                del w.ctx[slot][len(w.ctx[slot]) - int(n):]
        assert dec.check_errors() == DecodeError.NONE
        before = {x: dec.history(x).tolist() for x in range(8)}
        with u32(gpu, [5, 8, 3]) as a, u32(gpu, [6, 1, 9]) as b:  # src 8 and dst 9 are bad
            gpu.synchronize(0)
            dec.fork(a, b, 3, s)
            gpu.synchronize(s)
        assert dec.check_errors() == DecodeError.SLOT
        w.ctx[6] = list(w.ctx[5])
        assert dec.history(6).tolist() == w.ctx[5][-2:]
        assert all(dec.history(x).tolist() == before[x] for x in (0, 1, 2, 3, 4, 5, 7))
        # captured: replayed with other slots in the same buffers
        with u32(gpu, [2, 3]) as a, u32(gpu, [7, 1]) as b:
            gpu.synchronize(0)
            gpu.begin_capture(s)
            dec.fork(a, b, 2, s)
            exe = gpu.end_capture(s)
            gpu.launch_graph(exe, s)
            gpu.synchronize(s)
            a.upload(np.array([4, 4], np.uint32))
            b.upload(np.array([0, 5], np.uint32))
            gpu.synchronize(0)
            gpu.launch_graph(exe, s)
            gpu.synchronize(s)
            gpu.destroy_graph(exe)
        for d, x in ((7, 2), (1, 3), (0, 4), (5, 4)):
            w.ctx[d] = list(w.ctx[x])
        for slot in range(8):
            assert dec.history(slot).tolist() == w.ctx[slot][-2:], slot
        every = list(range(8))
        got = w.step(w.tokens(8), every)  # poisoned first: the output holds an earlier step's rows
        assert np.array_equal(bits(got), bits(w.expect(every, [1] * 8, 8)))
        assert dec.check_errors() == DecodeError.NONE
    finally:
        w.close()


# -- GPU: seed (prefix-cache hits) ----------------------------------------------------------------
@pytest.mark.gpu
def test_seed_then_prefill_equals_prefilling_everything(gpu, rng):
    """Prefixes seeded (longer and shorter than the history, empty, padded), then the suffixes
    prefilled: the rows equal the fused path on prefix + suffix; a seed in a captured graph
    replays with new tokens; bad tokens and slots are flagged."""
    w = World(gpu, rng, max_seqs=8, max_draft=3)
    dec, s = w.dec, w.stream
    try:
        for slot in range(8):
            w.reset(slot)
        prefix_lens = [40, 1, 0, 3, 7, 2]
        slots = [0, 1, 2, PAD_SLOT, 3, 4]
        prefixes = [w.tokens(n) for n in prefix_lens]
        flat = np.concatenate(prefixes)
        cu = np.concatenate([[0], np.cumsum(prefix_lens)]).astype(np.uint32)
        with u32(gpu, flat) as t, u32(gpu, cu) as c, u32(gpu, slots) as sl:
            gpu.synchronize(0)
            dec.seed(t, c, sl, len(slots), flat.size, s)
            gpu.synchronize(s)
        for slot, p in zip(slots, prefixes):
            if slot != PAD_SLOT:
                w.ctx[slot].extend(int(x) for x in p)
        assert dec.check_errors() == DecodeError.NONE
        got, want = w.prefill([0, 1, 2, 3, 4], [3, 1, 2, 5, 1])
        assert np.array_equal(bits(got), bits(want))
        # captured seed, replayed with new prefixes for slots 5 and 6
        with u32(gpu, np.zeros(12)) as t, u32(gpu, [0, 5, 12]) as c, u32(gpu, [5, 6]) as sl:
            gpu.synchronize(0)
            gpu.begin_capture(s)
            dec.seed(t, c, sl, 2, 12, s)
            exe = gpu.end_capture(s)
            for _ in range(2):
                new = w.tokens(12)
                t.upload(new)
                gpu.synchronize(0)
                gpu.launch_graph(exe, s)
                gpu.synchronize(s)
                w.ctx[5].extend(int(x) for x in new[:5])
                w.ctx[6].extend(int(x) for x in new[5:])
            gpu.destroy_graph(exe)
        got, want = w.prefill([5, 6], [2, 4])
        assert np.array_equal(bits(got), bits(want))
        assert dec.check_errors() == DecodeError.NONE
        # bad values: a token >= vocab among the last ones read (kept as "no token"), a bad slot
        before = dec.history(7).tolist()
        bad = w.tokens(6)
        bad[5] = w.dims.vocab_size
        with u32(gpu, bad) as t, u32(gpu, [0, 6, 6]) as c, u32(gpu, [7, 9]) as sl:
            gpu.synchronize(0)
            dec.seed(t, c, sl, 2, 6, s)
            gpu.synchronize(s)
        assert dec.check_errors() == DecodeError.TOKEN | DecodeError.SLOT
        assert dec.history(7).tolist() == [int(bad[4]), 0xFFFFFFFF] != before
    finally:
        w.close()


# -- GPU: adapters inside the n-gram sum ----------------------------------------------------------
@contextmanager
def _adapter_runners(w: World, count: int):
    """For each of adapters 0..count-1: the fused path (batch invariant as ``w``'s) on weights
    that borrow ``w``'s tables and projections and own a word table holding that adapter's rows;
    runners, then weights, closed on exit."""
    made = []
    try:
        for a in range(count):
            weight = DenseWeight.from_numpy(w.gpu, w.word_table(a))
            weights = NgramWeights(w.dims, weight, w.weights.tables, w.weights.projs, w.gpu)
            weights.own(weight)
            w.gpu.synchronize(0)
            made.append((FusedNgramEmbedding(weights, w.fused.max_rows, w.stream,
                                             batch_invariant=w.fused.projection.path is not None), weights))
        yield [fused for fused, _ in made]
    finally:
        w.gpu.synchronize(w.stream)
        for things in made:
            for thing in things:
                thing.close()


def _alone(w: World, fused: FusedNgramEmbedding, ctx, n: int) -> np.ndarray:
    """The last ``n`` rows of ``ctx`` embedded by ``fused`` on their own."""
    with Guarded(w.gpu, (n, w.dims.hidden_size), BF16, w.rng) as out:
        out.poison()
        w.gpu.synchronize(0)
        fused.embed_batch([np.asarray(ctx)], [n], out.ptr, w.stream)
        w.gpu.synchronize(w.stream)
        return out.read()


@pytest.mark.gpu
def test_adapter_rows_are_used_inside_the_sum(gpu, rng):
    """Each sequence on one of three adapters or none (NO_ADAPTER, or int32 -1): its rows are bit
    for bit those of weights whose word table holds that adapter's rows, and of the fused path
    with the same adapters, and within the fused contract of the numpy reference on that table."""
    # a third of the vocabulary overridden; batch invariant: rows are compared with single sequences
    w = World(gpu, rng, max_seqs=6, adapters=3, override=200, batch_invariant=True)
    dec, s = w.dec, w.stream
    try:
        with _adapter_runners(w, 3) as runners:
            seqs = [0, 1, 2, 3, 4]
            choice = [0, NO_ADAPTER, 2, 1, 0]
            lens = [7, 5, 9, 1, 4]
            got, want = w.prefill(seqs, lens, adapters=choice)
            assert np.array_equal(bits(got), bits(want))
            at = np.concatenate([[0], np.cumsum(lens)])
            for i, (slot, a) in enumerate(zip(seqs, choice)):
                rows = got[at[i]:at[i + 1]]
                if a != NO_ADAPTER:
                    assert np.array_equal(bits(rows), bits(_alone(w, runners[a], w.ctx[slot], lens[i]))), i
                x = ref.ngram_embed_fused(w.dims, w.word_table(None if a == NO_ADAPTER else a), w.host.tables,
                                          w.host.projs, np.asarray(w.ctx[slot]), lens[i]).astype(np.float64)
                assert (np.abs(rows.astype(np.float64) - x) <= np.abs(x) * 2.0**-7 + 1e-6).all(), i
            for it in range(5):  # steps of k = 2, adapters as int32 with -1 for none
                toks = w.tokens(10)
                index = np.array([-1 if a == NO_ADAPTER else a for a in choice], np.int32)
                with u32(gpu, toks) as t, u32(gpu, seqs) as sl, DeviceArray.from_numpy(gpu, index) as ad:
                    w.out.poison()
                    gpu.synchronize(0)
                    dec.step(t, sl, 5, w.out.ptr, s, k=2, adapters=ad)
                    got = w.read(10)
                for i, slot in enumerate(seqs):
                    w.ctx[slot].extend(int(x) for x in toks[2 * i:2 * i + 2])
                assert np.array_equal(bits(got), bits(w.expect(seqs, [2] * 5, 10, adapters=choice))), it
                for i, (slot, a) in enumerate(zip(seqs, choice)):
                    if a != NO_ADAPTER:
                        want = _alone(w, runners[a], w.ctx[slot], 2)
                        assert np.array_equal(bits(got[2 * i:2 * i + 2]), bits(want)), (it, i)
        assert dec.check_errors() == DecodeError.NONE
        # a bad adapter index: flagged, that sequence's rows zeros, the others unharmed
        toks = w.tokens(5)
        with u32(gpu, toks) as t, u32(gpu, seqs) as sl, u32(gpu, [0, 3, NO_ADAPTER, 7, 1]) as ad:
            w.out.poison()
            gpu.synchronize(0)
            dec.step(t, sl, 5, w.out.ptr, s, adapters=ad)
            got = w.read(5)
        for slot, x in zip(seqs, toks):
            w.ctx[slot].append(int(x))
        assert dec.check_errors() == DecodeError.ADAPTER
        assert not bits(got[[1, 3]]).any()
        want = w.expect(seqs, [1] * 5, 5, adapters=[0, 0, NO_ADAPTER, 0, 1])
        assert np.array_equal(bits(got[[0, 2, 4]]), bits(want[[0, 2, 4]]))
    finally:
        w.close()


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_fused_embed_batch_takes_adapters(gpu, rng, graph):
    """A batch of three sequences on two adapters or none: each sequence's rows bit for bit those
    of weights whose word table holds its adapter's rows, embedding it alone (batch invariant)."""
    w = World(gpu, rng, adapters=2, override=150, batch_invariant=True)
    try:
        with _adapter_runners(w, 2) as runners:
            for it in range(4):
                contexts = [w.tokens(int(n)) for n in rng.integers(1, 30, 3)]
                seq_lens = [int(rng.integers(1, len(c) + 1)) for c in contexts]
                choice = [int(x) for x in rng.choice([0, 1, NO_ADAPTER], 3)]
                rows = sum(seq_lens)
                with Guarded(gpu, (rows, w.dims.hidden_size), BF16, rng) as out:
                    out.poison()
                    gpu.synchronize(0)
                    w.fused.embed_batch(contexts, seq_lens, out.ptr, w.stream, graph=graph, adapters=choice)
                    gpu.synchronize(w.stream)
                    got = out.read()
                    out.assert_guards_intact()
                at = 0
                for ctx, n, a in zip(contexts, seq_lens, choice):
                    want = _alone(w, w.fused if a == NO_ADAPTER else runners[a], ctx, n)
                    assert np.array_equal(bits(got[at:at + n]), bits(want)), (it, a)
                    at += n
    finally:
        w.close()


# -- GPU: batch invariance --------------------------------------------------------------------------
@pytest.mark.gpu
def test_batch_invariant_rows_equal_each_request_alone(gpu, rng):
    """batch_invariant=True: a ragged prefill of 85 rows and a padded step of 48 in 64 give every
    sequence's rows bit for bit as the fused path embeds that sequence alone (1 to 30 rows)."""
    w = World(gpu, rng, max_seqs=64, max_rows=128, adapters=2, batch_invariant=True)
    try:
        lens, choice = [30, 20, 25, 1, 9], [0, NO_ADAPTER, 1, 0, NO_ADAPTER]
        got, _ = w.prefill(list(range(5)), lens, adapters=choice)
        at = 0
        for slot, (n, a) in enumerate(zip(lens, choice)):
            assert np.array_equal(bits(got[at:at + n]), bits(w.expect([slot], [n], n, adapters=[a]))), slot
            at += n
        toks = w.tokens(48)
        slots = list(range(5)) + list(range(10, 53)) + [PAD_SLOT] * 16
        with u32(gpu, np.concatenate([toks, np.zeros(16, np.uint32)])) as t, u32(gpu, slots) as sl:
            w.out.poison()
            gpu.synchronize(0)
            w.dec.step(t, sl, 64, w.out.ptr, w.stream)
            got = w.read(64)
        assert not bits(got[48:]).any()
        for i, slot in enumerate(slots[:48]):
            w.ctx[slot].append(int(toks[i]))
            assert np.array_equal(bits(got[i:i + 1]), bits(w.expect([slot], [1], 1))), slot
        assert w.dec.check_errors() == DecodeError.NONE
    finally:
        w.close()


# -- GPU: arrays from CuPy and torch ----------------------------------------------------------------
@pytest.mark.gpu
def test_cupy_and_torch_buffers_in_a_captured_step(gpu, rng):
    """tokens a CuPy uint32 array, slots and adapters torch int32 tensors (the array interface),
    out a torch bf16 tensor (DLPack: torch has no array interface for bf16): the same rows as
    DeviceArrays give, eagerly and in a captured graph."""
    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    w = World(gpu, rng, adapters=1)
    s = w.stream
    try:
        w.prefill([0, 1, 2], [5, 3, 8])
        h = w.dims.hidden_size
        tokens = cupy.zeros(3, dtype=cupy.uint32)
        slots = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
        adapters = torch.tensor([0, -1, 0], dtype=torch.int32, device="cuda")
        out = torch.empty((3, h), dtype=torch.bfloat16, device="cuda")

        def run(launch) -> None:
            """New tokens through CuPy, ``launch()`` on our stream, the rows read through torch."""
            toks = w.tokens(3)
            tokens.set(toks)
            out.view(torch.int16).fill_(-1)  # poison (bf16 0xFFFF is NaN): each run must write every row
            cupy.cuda.runtime.deviceSynchronize()
            torch.cuda.synchronize()
            launch()
            gpu.synchronize(s)
            for slot, x in zip(range(3), toks):
                w.ctx[slot].append(int(x))
            want = w.expect([0, 1, 2], [1] * 3, 3, adapters=[0, NO_ADAPTER, 0])
            assert np.array_equal(out.view(torch.int16).cpu().numpy().view(np.uint16), bits(want))

        run(lambda: w.dec.step(tokens, slots, 3, out, s, adapters=adapters))  # eager
        gpu.begin_capture(s)
        w.dec.step(tokens, slots, 3, out, s, adapters=adapters)
        exe = gpu.end_capture(s)
        for _ in range(3):
            run(lambda: gpu.launch_graph(exe, s))
        gpu.destroy_graph(exe)
        assert w.dec.check_errors() == DecodeError.NONE
        with pytest.raises(ValueError, match="not C-contiguous"):
            w.dec.step(tokens, torch.zeros(6, dtype=torch.int32, device="cuda")[::2], 3, out, s)
        with pytest.raises(TypeError, match="out: dtype float32, expected bfloat16"):
            w.dec.step(tokens, slots, 3, torch.empty((3, h), device="cuda"), s)
        with pytest.raises(ValueError, match="not device memory"):
            w.dec.step(ForeignArray(np.zeros(4, np.uint32).ctypes.data, (4,), "<u4"), slots, 3, out, s)
    finally:
        gpu.synchronize(s)
        w.close()


@pytest.mark.gpu
def test_device_arrays_are_read_by_torch_and_cupy_through_dlpack(gpu, rng):
    cupy = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    host = rng.integers(0, 2**32, (5, 7), dtype=np.uint64).astype(np.uint32)
    words = (rng.standard_normal((4, 6)) * 3).astype(BF16)
    with DeviceArray.from_numpy(gpu, host) as a, DeviceArray.from_numpy(gpu, words) as b:
        gpu.synchronize(0)
        t = torch.from_dlpack(b)
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == (4, 6)
        assert np.array_equal(t.view(torch.int16).cpu().numpy().view(np.uint16), bits(words))
        c = cupy.from_dlpack(a)
        assert np.array_equal(cupy.asnumpy(c), host)
        del t, c
        torch.cuda.synchronize()
    import gc

    gc.collect()
    assert dlpack.live_exports() == 0
