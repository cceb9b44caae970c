"""NCCL through NVIDIA's Python bindings (``nccl4py``, the ``multi-gpu`` extra).

Communicators are made and ended through ``nccl.core`` (``Communicator.init``/``init_all``,
``abort``, ``destroy``); the hot path posts ``ncclAllReduce`` on raw device pointers through
``nccl.bindings.nccl``, with no buffer wrapper per call, so that it can be captured in a CUDA
graph with the rest of a decode step.

A rank whose peer died waits in its collective forever: ``wait`` polls the stream with a
deadline and, past it, aborts the communicator (``ncclCommAbort`` ends the pending collectives)
and raises ``TimeoutError``; an NCCL asynchronous error aborts and raises at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from gpu_runtime import Events, GpuBackend, validate
from gpu_runtime.backend import check_backend

if TYPE_CHECKING:
    from ..backend_caps import EventsBackend

__all__ = ["EXTRA", "NcclCollective", "NcclGroup", "unique_id"]

EXTRA = "pip install 'metrale-gpu[multi-gpu]'"
NCCL_BF16, NCCL_SUM = 9, 0  # ncclBfloat16, ncclSum (nccl.h)
_POLL_S = 1e-4


def _nccl() -> tuple[Any, Any]:
    """(``nccl.core``, ``nccl.bindings.nccl``), or an ImportError that names the extra."""
    try:
        import nccl.core as core
        from nccl.bindings import nccl as raw
    except ImportError as exc:
        raise ImportError(f"tensor parallelism over NCCL needs nccl4py and the NCCL runtime: {EXTRA}") from exc
    return core, raw


def unique_id() -> bytes:
    """A new communicator's id (128 bytes): rank 0 makes it and passes it to the others out of band."""
    core, _ = _nccl()
    return bytes(core.get_unique_id())


class NcclCollective:
    """One rank's NCCL communicator, on ``gpu``'s device: ``Collective`` for one process per GPU."""

    def __init__(self, comm: Any, gpu: GpuBackend) -> None:
        _, self._raw = _nccl()
        self.comm, self.gpu = comm, check_backend(gpu, "NcclCollective: gpu")
        self._handle = self._raw.Comm(comm.ptr)  # what the raw calls take (not an owner)
        self.rank, self.size = int(comm.rank), int(comm.nranks)
        self._closed = False

    @classmethod
    def init(cls, size: int, rank: int, uid: bytes, gpu: GpuBackend) -> NcclCollective:
        """Rank ``rank`` of ``size`` (every rank calls this with the same ``uid``; it returns when
        all have joined). Without nccl4py: an ImportError naming the extra, before anything else."""
        core, _ = _nccl()
        check_backend(gpu, "NcclCollective.init: gpu")
        size = validate.positive(size, "NCCL size")
        rank = validate.count(rank, "NCCL rank", limit=size)
        if not isinstance(uid, (bytes, bytearray)) or len(uid) != 128:
            raise ValueError("NCCL unique id: expected the 128 bytes unique_id() returned")
        gpu.synchronize()  # makes gpu's context current: the communicator takes its device
        return cls(core.Communicator.init(size, rank, core.UniqueId.from_bytes(bytes(uid))), gpu)

    @property
    def closed(self) -> bool:
        """True once ``close()`` or ``abort()`` ran, or the backend is closed."""
        return self._closed or self.gpu.closed

    def allreduce_bf16(self, ptr: int, count: int, stream: int) -> None:
        """Post an in-place bf16 sum all-reduce of ``ptr[:count]`` over the ranks on ``stream``
        (capturable in a CUDA graph); returns at once. Raises ``ClosedError`` once closed,
        ``ValueError`` for a null ``ptr``."""
        validate.require_open(self.closed, "NcclCollective")
        ptr = validate.pointer(ptr, "all-reduce buffer")
        count = validate.count(count, "all-reduce count")
        stream = validate.stream(stream, "NcclCollective.allreduce_bf16: stream")
        self._raw.all_reduce(ptr, ptr, count, NCCL_BF16, NCCL_SUM, self._handle, stream)

    def wait(self, stream: int, timeout_s: float) -> None:
        """Block until ``stream``'s work is done; abort and raise if NCCL reports an error or it
        is not done after ``timeout_s`` seconds (a peer that failed)."""
        validate.require_open(self.closed, "NcclCollective")
        _wait([self], [validate.stream(stream, "NcclCollective.wait: stream")], timeout_s)

    def abort(self) -> None:
        """End the communicator now, pending collectives included (every rank must abort)."""
        if not self._closed:
            self._closed = True
            self.comm.abort()

    def close(self) -> None:
        """Destroy the communicator (once; later calls, and a call after ``abort``, do nothing)."""
        if not self._closed:
            self._closed = True
            self.comm.destroy()


class NcclGroup:
    """Every GPU of this process in one communicator (``ncclCommInitAll``): ``CollectiveGroup``.
    ``gpus[r]`` is rank r's backend, on device ``gpus[r].device``. Without nccl4py: an
    ImportError naming the extra, before anything else."""

    def __init__(self, gpus: Sequence[GpuBackend]) -> None:
        core, _ = _nccl()
        if not isinstance(gpus, (list, tuple)):
            raise TypeError(f"NcclGroup: gpus must be a list or tuple of GpuBackends, got {type(gpus).__name__}")
        for r, g in enumerate(gpus):
            check_backend(g, f"NcclGroup: gpus[{r}]")
        devices = [int(getattr(g, "device", -1)) for g in gpus]
        if len(set(devices)) != len(devices) or min(devices, default=0) < 0:
            raise ValueError(f"NcclGroup: one backend per device, got devices {devices}")
        self.members = [NcclCollective(comm, g) for comm, g in zip(core.Communicator.init_all(devices), gpus)]
        self.size = len(self.members)

    @property
    def closed(self) -> bool:
        """True once any member communicator is closed or aborted."""
        return any(m.closed for m in self.members)

    def allreduce_bf16_all(self, buffers: Sequence[tuple[int, int, int]]) -> None:
        """Every rank's ``(ptr, count, stream)`` is checked (the counts equal) before any is
        posted: a group call that posted some ranks and not the others would leave those
        waiting for good."""
        validate.require_open(self.closed, "NcclGroup")
        if len(buffers) != self.size:
            raise ValueError(f"NcclGroup: {len(buffers)} buffers for a group of {self.size}")
        checked = [
            (
                validate.pointer(ptr, f"NcclGroup: buffers[{r}] pointer"),
                validate.count(count, f"NcclGroup: buffers[{r}] count"),
                validate.stream(stream, f"NcclGroup: buffers[{r}] stream"),
            )
            for r, (ptr, count, stream) in enumerate(buffers)
        ]
        if len({count for _, count, _ in checked}) > 1:
            raise ValueError(f"NcclGroup: every rank sums the same count, got {[c for _, c, _ in checked]}")
        with self.group():
            for member, (ptr, count, stream) in zip(self.members, checked):
                member.allreduce_bf16(ptr, count, stream)

    @contextmanager
    def group(self) -> Iterator[None]:
        """NCCL group calls: one thread posting to every device must not block on the first."""
        core, _ = _nccl()
        core.group_start()
        try:
            yield
        finally:
            core.group_end()

    def wait(self, streams: Sequence[int], timeout_s: float) -> None:
        """Block until every rank's ``streams[r]`` has finished; past ``timeout_s`` seconds, or on an
        NCCL asynchronous error, abort every member and raise ``TimeoutError`` / ``RuntimeError``.
        Raises ``ValueError`` for a stream count other than ``size``."""
        if len(streams) != self.size:
            raise ValueError(f"NcclGroup.wait: {len(streams)} streams for a group of {self.size}")
        _wait(
            self.members,
            [validate.stream(s, f"NcclGroup.wait: streams[{r}]") for r, s in enumerate(streams)],
            timeout_s,
        )

    def abort(self) -> None:
        """Abort every member's communicator now, pending collectives included."""
        for m in self.members:
            m.abort()

    def close(self) -> None:
        """Destroy every member's communicator (each once)."""
        for m in self.members:
            m.close()


def _wait(members: Sequence[NcclCollective], streams: Sequence[int], timeout_s: float) -> None:
    """Each member's stream finished, or every member aborted and an error raised."""
    if not timeout_s > 0:
        raise ValueError(f"NCCL wait: timeout_s must be > 0, got {timeout_s!r}")
    gpus = []
    for m, _ in zip(members, streams):  # every backend checked before any event is made
        if not isinstance(m.gpu, Events):
            raise TypeError(f"NCCL wait: the backend needs events; {type(m.gpu).__name__} has none")
        gpus.append(cast("EventsBackend", m.gpu))  # checked just above
    events: list[int] = []  # made so far: each destroyed at the end, after a failure too
    try:
        for gpu, stream in zip(gpus, streams):
            events.append(gpu.create_event())
            gpu.record_event(events[-1], stream)
        deadline = time.monotonic() + timeout_s
        pending = list(zip(members, gpus, events))
        while pending:
            pending = [(m, gpu, e) for m, gpu, e in pending if not gpu.event_done(e)]
            errors = [m.comm.get_async_error() for m, _, _ in pending]
            failed = [int(err) for err in errors if int(err) not in (0, 7)]  # ncclSuccess, ncclInProgress
            if failed or (pending and time.monotonic() > deadline):
                for m in members:
                    m.abort()
                if failed:
                    raise RuntimeError(f"NCCL asynchronous error {failed[0]}: communicator aborted")
                raise TimeoutError(
                    f"NCCL: a collective did not finish in {timeout_s} s (a failed rank?); communicator aborted"
                )
            if pending:
                time.sleep(_POLL_S)
    finally:
        for gpu, e in zip(gpus, events):
            if not gpu.closed:
                gpu.destroy_event(e)
