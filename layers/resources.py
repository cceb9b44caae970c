"""``Resources``: what one n-gram object holds on the GPU, owned and released in one place.

A layer allocates its device scratch through ``alloc`` / ``upload`` (each a
``gpu_runtime.DeviceBuffer``), registers its other handles (events, pinned host buffers, graphs)
with ``on_close`` and the objects it owns with ``adopt``; ``close()`` releases everything once,
in reverse order of creation, also after a constructor failed half-way. The layer keeps the
returned addresses (``DevicePtr``) for its launches: a ``DeviceBuffer`` is taken for an address
too, but a plain address costs less per launch on the decode paths, and a layer raises
``ClosedError`` on every call once ``closed``, so a freed address never reaches a kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from typing import Any, Self, TypeVar

from gpu_runtime import DeviceBuffer, DevicePtr, GpuBackend
from gpu_runtime.host_memory import Host

T = TypeVar("T", bound=Any)


class Closing:
    """``with`` for an object with ``close()``: leaving the block closes it."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Resources:
    """Device buffers and handles of one object on ``gpu``; ``close()`` releases them all."""

    def __init__(self, gpu: GpuBackend) -> None:
        self.gpu = gpu
        self.closed = False
        self._stack = ExitStack()

    def alloc(self, nbytes: int) -> DevicePtr:
        """A new device buffer of ``nbytes`` (uninitialised), freed by ``close``."""
        return self._stack.enter_context(DeviceBuffer(self.gpu, nbytes)).ptr

    def upload(self, array: Host, stream: int = 0) -> DevicePtr:
        """A new device buffer holding a copy of ``array`` (queued on ``stream``)."""
        return self._stack.enter_context(DeviceBuffer.upload(self.gpu, array, stream)).ptr

    def adopt(self, thing: T) -> T:
        """Close ``thing`` (anything with a ``close()``: a fused layer, a weight) on ``close``, in
        reverse order with everything else; returns it."""
        self._stack.callback(thing.close)
        return thing

    def on_close(self, release: Callable[[], object]) -> None:
        """Call ``release`` on ``close`` (in reverse order with everything else), unless the
        backend is closed by then: it has released every handle it gave out itself."""
        gpu = self.gpu

        def run() -> None:
            if not gpu.closed:
                release()

        self._stack.callback(run)

    def close(self) -> None:
        """Release everything, last acquired first; once (later calls do nothing). Every
        release runs even if an earlier one raised, and the error then propagates."""
        self.closed = True
        self._stack.close()


@contextmanager
def closed_on_failure() -> Iterator[list[Any]]:
    """A list for the objects a constructor builds one by one (weights, caches: anything with a
    ``close()``): if the block raises, every one is closed, the last built first, and the error
    propagates; otherwise the caller hands them on (``NgramWeights.own``)."""
    built: list[Any] = []
    try:
        yield built
    except BaseException:
        for thing in reversed(built):
            with suppress(Exception):  # the others still close; the first error propagates
                thing.close()
        raise
