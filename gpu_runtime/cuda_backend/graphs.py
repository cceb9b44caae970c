"""CUDA graphs: a stream's work captured once, replayed with one call."""

from __future__ import annotations

from typing import Any

from cuda.bindings import driver as cu

from .. import validate
from ..driver import call
from .context import CudaContext


class CudaGraphs(CudaContext):
    _graphs: dict[int, Any]  # executable graphs by handle

    def _init_graphs(self) -> None:
        self._graphs = {}

    def _release_graphs(self) -> None:
        try:
            self._release_each(cu.cuGraphExecDestroy, self._graphs.values())
        finally:
            self._graphs.clear()

    def begin_capture(self, stream: int) -> None:
        """Start capturing the work queued on ``stream`` (this thread's capture mode) instead of
        running it; raises ``ValueError`` for the default stream (0)."""
        stream = validate.stream(stream, "begin_capture stream")
        if not stream:
            raise ValueError("begin_capture: the default stream cannot be captured; use create_stream()")
        self._live()
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        call(cu.cuStreamBeginCapture, stream, mode)

    def end_capture(self, stream: int) -> int:
        """Stop capturing ``stream`` and instantiate what it recorded; returns the executable graph's
        handle, owned by the backend until ``destroy_graph`` or ``close``."""
        stream = validate.stream(stream, "end_capture stream")
        self._live()
        graph = call(cu.cuStreamEndCapture, stream)
        try:
            exe = call(cu.cuGraphInstantiate, graph, 0)
        finally:
            call(cu.cuGraphDestroy, graph)  # the executable graph keeps what it needs
        with self._lock:
            self._graphs[int(exe)] = exe
        return int(exe)

    def abort_capture(self, stream: int) -> None:
        """Stop capturing ``stream`` and discard the capture; never raises for a capture an error
        invalidated."""
        stream = validate.stream(stream, "abort_capture stream")
        self._live()
        # The status is not checked on purpose: after an error the capture may be invalidated,
        # and ending it then fails; what matters is that the stream stops capturing.
        (err, graph) = cu.cuStreamEndCapture(stream)
        if not err and graph is not None and int(graph):
            call(cu.cuGraphDestroy, graph)

    def launch_graph(self, graph: int, stream: int) -> None:
        """Queue one replay of ``graph`` on ``stream``; raises ``ValueError`` for a handle that is not
        a live graph of this backend."""
        stream = validate.stream(stream, "launch_graph stream")
        self._live()
        exe = self._graphs.get(int(graph))
        if exe is None:
            raise ValueError(f"launch_graph: 0x{int(graph):x} is not a live graph of this backend")
        call(cu.cuGraphLaunch, exe, stream)

    def destroy_graph(self, graph: int) -> None:
        """Destroy the executable graph ``graph``; raises ``ValueError`` for a handle that is not a
        live graph of this backend (or destroyed already)."""
        self._live()
        with self._lock:
            exe = self._graphs.pop(int(graph), None)
        if exe is None:
            raise ValueError(f"destroy_graph: 0x{int(graph):x} is not a live graph of this backend")
        call(cu.cuGraphExecDestroy, exe)
