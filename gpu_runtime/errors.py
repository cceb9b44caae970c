"""Exceptions of the runtime: every failure names the call and the CUDA/NVRTC status."""

from __future__ import annotations

from collections.abc import Callable, Iterable


class GpuError(RuntimeError):
    """Base class of every error the runtime raises on purpose."""


class ClosedError(GpuError):
    """An object was used after ``close()``: a backend, a buffer, a layer, a cache..."""


class NoDeviceError(GpuError):
    """No usable CUDA driver or device: GPU work cannot run on this machine.

    ``cause`` keeps the exception that showed it, where there was one (the driver library not
    found, or ``CudaError`` from ``cuInit``), without chaining it into the printed traceback;
    the message already ends with its text.
    """

    def __init__(self, message: str, *, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class CudaError(GpuError):
    """A driver call returned something other than CUDA_SUCCESS.

    The message starts with the CUresult's name (``CUDA_ERROR_INVALID_VALUE: cuMemAlloc ...``)
    so that logs can be grepped for it; ``result`` keeps the numeric code.
    """

    def __init__(self, result: int, call: str, detail: str = "") -> None:
        self.result = int(result)
        self.call = call
        self.name = _cuda_result_name(self.result)
        super().__init__(f"{self.name}: {call}" + (f" ({detail})" if detail else ""))


class NvrtcError(GpuError):
    """NVRTC failed to compile a kernel source; ``log`` holds the compiler's own file:line messages."""

    def __init__(self, result: str, source: str, log: str) -> None:
        self.result = result
        self.source = source
        self.log = log
        super().__init__(f"{result}: compiling {source}\n{log}".rstrip())


class KernelNotFoundError(GpuError, LookupError):
    """A kernel module file, or a kernel inside it, does not exist."""


def _cuda_result_name(code: int) -> str:
    try:
        from cuda.bindings.driver import CUresult

        return CUresult(code).name
    except Exception:  # unknown code, or bindings missing
        return f"CUresult({code})"


def attempt_each(steps: Iterable[Callable[[], object]], catch: type[Exception] = Exception) -> None:
    """Run every one of ``steps``, even after one raised ``catch`` (a release after a kernel
    fault: the driver may fail some and must still be asked for the rest); the first such
    error is raised once the last step ran."""
    first: Exception | None = None
    for step in steps:
        try:
            step()
        except catch as exc:
            first = first or exc
    if first is not None:
        raise first
