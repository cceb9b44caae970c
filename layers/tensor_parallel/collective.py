"""The one collective tensor parallelism needs, a bf16 sum all-reduce, and who provides it.

Two ways engines run a tensor-parallel group, two protocols:

- ``Collective``: one rank's end of a communicator, for one process per GPU. Each process's
  layer posts its own all-reduce (``nccl.NcclCollective``).
- ``CollectiveGroup``: every rank in this process (``nccl.NcclGroup``: ``ncclCommInitAll`` and
  group calls; ``LocalGroup``: every "rank" on one device, summed here, which checks the sharding
  arithmetic on a single GPU and in CI-style runs). ``embed_all`` drives one.

The buffers hold at most one non-zero contribution per element (``shard``), so any summation
order gives the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from gpu_runtime import DeviceCopies, GpuBackend, validate
from gpu_runtime.backend import check_backend

from ..kernel_files import load_kernel
from ..ops import residual as residual_ops


@runtime_checkable
class Collective(Protocol):
    """One rank of a communicator of ``size`` ranks."""

    rank: int
    size: int

    @property
    def closed(self) -> bool:
        """True once the communicator is closed or aborted (or its backend closed): no more collectives."""

    def allreduce_bf16(self, ptr: int, count: int, stream: int) -> None:
        """``ptr[:count]`` (bf16) summed over the ranks, in place, in ``stream``'s order."""


@runtime_checkable
class CollectiveGroup(Protocol):
    """Every rank of a communicator, driven from this process."""

    size: int

    @property
    def closed(self) -> bool:
        """True once the group is closed (or its backend): no more collectives."""

    def allreduce_bf16_all(self, buffers: Sequence[tuple[int, int, int]]) -> None:
        """Rank r's ``(ptr, count, stream)`` is ``buffers[r]``: each summed over the ranks, in place."""


def check_collective(what: str, collective: Any, shard: Any, how: str) -> None:
    """``collective`` (None: no all-reduce of its own) suits weights whose ``shard`` (its ``rank``
    and ``size``; None: not a shard, which ``how`` says how to make): an open ``Collective`` of
    the shard's rank and size, and only for a shard's weights."""
    if collective is None:
        return
    if shard is None:
        raise ValueError(f"{what}: collective given, but the weights are not a tensor-parallel shard ({how})")
    if not isinstance(collective, Collective):
        raise TypeError(
            f"{what}: collective must be a layers.tensor_parallel.Collective "
            f"(allreduce_bf16, rank, size, closed), got {type(collective).__name__}"
        )
    validate.require_open(collective.closed, f"{what}: its collective")
    if (collective.rank, collective.size) != (shard.rank, shard.size):
        raise ValueError(
            f"{what}: the collective is rank {collective.rank} of {collective.size}, "
            f"the weights rank {shard.rank} of {shard.size}"
        )


def check_group(what: str, group: Any) -> None:
    """``group`` an open ``CollectiveGroup`` (``what`` names the driver of the whole group)."""
    if not isinstance(group, CollectiveGroup):
        raise TypeError(f"{what}: group must be a CollectiveGroup, got {type(group).__name__}")
    validate.require_open(group.closed, f"{what}: the group")


def check_rank_shard(what: str, r: int, shard: Any, size: int) -> None:
    """``shard`` (rank ``r``'s weights' shard: its ``rank`` and ``size``, or None) is rank ``r``
    of a group of ``size``."""
    if shard is None or (shard.rank, shard.size) != (r, size):
        got = "not a shard" if shard is None else f"rank {shard.rank} of {shard.size}"
        raise ValueError(f"{what}: ranks[{r}]'s weights are {got}")


class LocalGroup:
    """``size`` ranks on one device: the sum runs here (bf16 adds into rank 0's buffer in rank
    order, then copied back to the others), all on the stream the ranks share."""

    def __init__(self, gpu: GpuBackend, size: int) -> None:
        check_backend(gpu, "LocalGroup: gpu")
        if not isinstance(gpu, DeviceCopies):
            raise TypeError(
                f"LocalGroup: the backend needs device copies (gpu_runtime.DeviceCopies); "
                f"{type(gpu).__name__} lacks them"
            )
        self.gpu, self.size = gpu, validate.positive(size, "LocalGroup size")
        self.add_kernel = load_kernel(gpu, "residual_add", "bf16_residual_add")
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran or the backend is closed: ``allreduce_bf16_all`` then raises
        ``ClosedError``."""
        return self._closed or self.gpu.closed

    def allreduce_bf16_all(self, buffers: Sequence[tuple[int, int, int]]) -> None:
        """Rank r's ``(ptr, count, stream)`` is ``buffers[r]``: rank 0's buffer gets the sum, then it
        is copied to the others, all queued on the one shared stream. Raises ``ValueError``
        (nothing queued) for a buffer count other than ``size``, a null pointer, or ranks with
        different counts or streams."""
        validate.require_open(self.closed, "LocalGroup")
        if len(buffers) != self.size:
            raise ValueError(f"LocalGroup: {len(buffers)} buffers for a group of {self.size}")
        ptrs = [validate.pointer(p, f"LocalGroup: buffers[{r}] pointer") for r, (p, _, _) in enumerate(buffers)]
        _, count, stream = buffers[0]
        if any(c != count or s != stream for _, c, s in buffers[1:]):
            raise ValueError(
                "LocalGroup: every rank must post the same count on the same stream, got "
                f"{[(c, s) for _, c, s in buffers]}"
            )
        ptr0, others = ptrs[0], ptrs[1:]  # every rank checked before the first add is queued
        for ptr in others:
            residual_ops.residual_add(self.gpu, self.add_kernel, ptr0, ptr, count, stream)
        for ptr in others:
            self.gpu.copy_d2d_async(ptr, ptr0, count * 2, stream)

    def close(self) -> None:
        """Mark the group closed (it owns no device memory; the add kernel stays with the backend)."""
        self._closed = True
