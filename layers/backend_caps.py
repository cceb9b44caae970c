"""Static types for a ``GpuBackend`` known to have some of the optional capabilities of
``gpu_runtime.backend`` (events, pinned or mapped host memory, graphs, copies, host functions).

A layer checks a capability at run time, ``isinstance(gpu, Events)``; a backend may have one by
defining its methods without inheriting it, so the type checker cannot follow that check into an
attribute. The layer then ``cast``s the backend, once, where it checked, to the class here that
names what it checked, and keeps it typed so. These classes exist for the type checker only
(under ``TYPE_CHECKING``: nothing inherits them, nothing is checked against them at run time);
import them under ``TYPE_CHECKING`` and name them as strings in ``cast``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_runtime import (
        DeviceCopies,
        Events,
        GpuBackend,
        Graphs,
        HostFunctions,
        MappedHostMemory,
        PinnedHostMemory,
        PitchedCopies,
    )

    class EventsBackend(GpuBackend, Events):
        """Events: a watchdog polling streams (``tensor_parallel.nccl``)."""

    class PinnedEventsBackend(EventsBackend, PinnedHostMemory):
        """Pinned host buffers and the events that say when an upload is done with one (``RowCache``)."""

    class MappedBackend(GpuBackend, MappedHostMemory):
        """Host memory the device reads in place (``HostWeight.from_table_file``)."""

    class PinnedMappedBackend(MappedBackend, PinnedHostMemory):
        """Mapped pinned buffers (``HostWeight.from_numpy``)."""

    class StagingBackend(PinnedMappedBackend, DeviceCopies, HostFunctions):
        """Host functions in stream order over mapped pinned buffers (``engram.HostStaging``)."""

    class RunnerBackend(EventsBackend, PitchedCopies):
        """What the fused runners need (``runner_checks.check_weights``)."""

    class GraphBackend(RunnerBackend, Graphs, PinnedHostMemory):
        """A fused runner's ``graph=True`` calls: captured graphs, replayed from a pinned upload."""
