"""Test helpers: device buffers with canary guards, poisoning, upload and download in one line;
what a call writes into a poisoned buffer; page-aligned host arrays; bit views, bf16 spacing and
random bf16 / fp8 arrays. Topic helpers live in the submodules
(``ngram``, ``row_cache``, ``ngram_gather``, ``overlay``, ``checkpoint``, ``peft``, ``gemm``,
``logging_backend``, ``scripted_driver``)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from gpu_runtime import CudaBackend, DevicePtr

GUARD = 256  # bytes of canary on each side of a guarded buffer
POISON = 0xFF  # bf16 0xFFFF is NaN, u32 0xFFFFFFFF is an id no table has
# Under compute-sanitizer (``make sanitize`` sets GPU_SANITIZER) the tool allocates device
# memory of its own (memcheck: gigabytes over a thousand graph launches) and several test
# processes share the device, so cuMemGetInfo says nothing about this process's leaks.
DEVICE_MEMORY_MEASURABLE = not os.environ.get("GPU_SANITIZER")
# A test too slow under a sanitizer (gigabytes through one kernel): skipped there, and that skip is
# not a REQUIRE_GPU failure (conftest); `make gpu-check` runs it.
TOO_SLOW_UNDER_SANITIZER = pytest.mark.skipif(bool(os.environ.get("GPU_SANITIZER")), reason="too slow under a sanitizer")
PAGE = 4096  # host page size: register_host needs page-aligned arrays


class Guarded:
    """A device buffer of ``shape``/``dtype`` at ``ptr`` (optionally ``misalign`` bytes off a
    16-byte boundary), with random canary bytes before and after that no kernel may touch."""

    def __init__(self, gpu: CudaBackend, shape: Any, dtype: Any, rng: np.random.Generator,
                 misalign: int = 0) -> None:
        self.gpu, self.shape, self.dtype = gpu, tuple(np.atleast_1d(shape)), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.lead = GUARD + misalign
        self.total = self.lead + self.nbytes + GUARD
        self.base = gpu.alloc(self.total)
        self.ptr = DevicePtr(self.base + self.lead)
        self.canary = rng.integers(0, 256, self.total, dtype=np.uint8)
        gpu.copy_h2d_async(self.canary, self.base)

    def poison(self) -> "Guarded":
        self.gpu.memset(self.ptr, POISON, self.nbytes)
        return self

    def upload(self, host: np.ndarray) -> "Guarded":
        host = np.ascontiguousarray(host, dtype=self.dtype)
        assert host.nbytes == self.nbytes
        self.gpu.copy_h2d_async(host, self.ptr)
        return self

    def read(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        self.gpu.copy_d2h(out, self.ptr)
        return out

    def raw(self) -> np.ndarray:
        """Every byte of the allocation, guards included."""
        raw = np.empty(self.total, np.uint8)
        self.gpu.copy_d2h(raw, self.base)
        return raw

    def assert_guards_intact(self) -> None:
        raw = self.raw()
        head, tail = slice(0, self.lead), slice(self.lead + self.nbytes, self.total)
        assert np.array_equal(raw[head], self.canary[head]), "write before the buffer"
        assert np.array_equal(raw[tail], self.canary[tail]), "write past the buffer"

    def free(self) -> None:
        self.gpu.free(self.base)

    def __enter__(self) -> "Guarded":
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


def run_on_poisoned(gpu: CudaBackend, rng: np.random.Generator, fn: Any, rows: int, h: int,
                    stream: int = 0) -> np.ndarray:
    """What ``fn(out)`` writes into a poisoned, guarded ``[rows, h]`` bf16 buffer, checked to be
    written whole and inside the buffer. ``stream`` is where fn queues its work (a created stream
    does not wait for the default stream's poison, nor it for the stream)."""
    import ml_dtypes

    with Guarded(gpu, (rows, h), ml_dtypes.bfloat16, rng) as out:
        out.poison()
        gpu.synchronize(0)
        fn(out.ptr)
        gpu.synchronize(stream)
        got = out.read()
        out.assert_guards_intact()
    assert np.isfinite(got.astype(np.float32)).all(), "unwritten (poisoned) elements"
    return got


def page_aligned(nbytes: int, keep: list) -> np.ndarray:
    """A writable, page-aligned uint8 array (an anonymous mmap, appended to ``keep`` to stay alive)."""
    m = mmap.mmap(-1, nbytes)
    keep.append(m)
    arr = np.frombuffer(m, np.uint8)
    assert arr.ctypes.data % PAGE == 0
    return arr


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of a 2- or 4-byte array, for bit-exact comparisons (NaN == NaN)."""
    return a.view({2: np.uint16, 4: np.uint32, 1: np.uint8}[a.dtype.itemsize])


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """Spacing of bf16 values at |x| (8 significant bits; subnormal spacing below 2^-126)."""
    x = np.maximum(np.abs(np.asarray(x, np.float64)), 2.0**-126)
    return 2.0 ** (np.floor(np.log2(x)) - 7)


def random_bf16(rng: np.random.Generator, shape: Any, scale: float = 1.0) -> np.ndarray:
    import ml_dtypes

    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(ml_dtypes.bfloat16)


def random_fp8(rng: np.random.Generator, shape: Any) -> np.ndarray:
    """Random e4m3 values over the whole finite range (every bit pattern but the two NaNs)."""
    import ml_dtypes

    raw = rng.integers(0, 256, shape, dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # NaN patterns -> 1.5
    return raw.view(ml_dtypes.float8_e4m3fn)


class WindowOnly(Sequence):
    """A huge context that fails the test if anything outside the last ``window`` tokens is read."""

    def __init__(self, length: int, tail: list[int]) -> None:
        self.length, self.tail = length, tail

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):  # type: ignore[override]
        if not isinstance(index, slice):
            raise AssertionError(f"element access {index!r}: the tail path must slice")
        start, stop, step = index.indices(self.length)
        first = self.length - len(self.tail)
        assert step == 1 and stop == self.length and start >= first, f"read {index} beyond the tail"
        return self.tail[start - first:]
