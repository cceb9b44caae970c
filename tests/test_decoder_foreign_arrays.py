"""NgramDecoder's buffers from other libraries: the CUDA array interface (int32 read as u32
bits, masks refused), DLPack (asked with no stream handshake and no copy, versioned capsules and
their flags), ``DeviceArray``'s own exports (released, naming the stream a consumer waits for,
bad shapes refused), and on the GPU CuPy arrays and torch tensors in a captured step, bit for bit
the rows DeviceArrays give, and DeviceArrays read by torch and CuPy through DLPack."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_runtime import DeviceArray, DevicePtr, dlpack
from layers.ngram_embed import NO_ADAPTER, DecodeError
from layers.dense_weight import BF16, FP8
from tests.helpers.fakes import ForeignArray, RecordingBackend
from tests.helpers import bits
from tests.helpers.decoder import P, World, recording
from tests.helpers.dlpack_capsule import capsule


# -- CPU ----------------------------------------------------------------------------------------
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


def _versioned_capsule(array: DeviceArray, flags: int):
    """A ``dltensor_versioned`` capsule over ``array`` as a DLPack 1.x producer makes it."""
    return capsule(int(array.ptr), array.shape, array.dtype, flags=flags)


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
