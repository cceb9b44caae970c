"""Launchers of ``kernels/residual_add.cu``: in-place bf16 accumulation."""

from __future__ import annotations

from gpu_runtime import GpuBackend, KernelHandle, LaunchConfig, validate

_THREADS = 256
_ELEMS_PER_BLOCK = 8 * _THREADS  # each thread adds 8 elements
_MAX_BLOCKS = 4096  # grid-stride beyond this: 1M threads cover any H200-sized tensor


_CONFIGS: dict[int, LaunchConfig] = {}  # by block count: at most _MAX_BLOCKS


def add_config(n: int) -> LaunchConfig:
    """The launch of either kernel over ``n >= 1`` elements."""
    blocks = min((n + _ELEMS_PER_BLOCK - 1) // _ELEMS_PER_BLOCK, _MAX_BLOCKS)
    config = _CONFIGS.get(blocks)
    if config is None:
        config = _CONFIGS[blocks] = LaunchConfig(blocks, _THREADS)
    return config


def scaled_add(gpu: GpuBackend, kernel: KernelHandle, out: int, x: int, scale: float, n: int, stream: int) -> None:
    """``out[i] = bf16(float(out[i]) + scale * float(x[i]))`` for ``i < n``, in place; ``scale``
    finite. ``n == 0`` launches nothing."""
    if type(scale) is not float or not -validate.F32_MAX <= scale <= validate.F32_MAX:
        scale = validate.real32(scale, "scaled_add scale")
    if (type(n) is not int or not 0 < n < 1 << 32) and validate.u32(n, "scaled_add n") == 0:
        return
    validate.pointers("scaled_add", "out x", out, x)
    blocks = (n + _ELEMS_PER_BLOCK - 1) // _ELEMS_PER_BLOCK  # add_config, inline: this runs every call
    config = _CONFIGS.get(blocks if blocks < _MAX_BLOCKS else _MAX_BLOCKS) or add_config(n)
    gpu.bind(kernel).launch(config, stream, out, x, scale, n)


def residual_add(gpu: GpuBackend, kernel: KernelHandle, out: int, x: int, n: int, stream: int) -> None:
    """``out[i] = bf16(float(out[i]) + float(x[i]))`` for ``i < n``, in place. ``n == 0``
    launches nothing."""
    if validate.u32(n, "residual_add n") == 0:
        return
    validate.pointer(out, "residual_add out")
    validate.pointer(x, "residual_add x")
    gpu.bind(kernel).launch(add_config(n), stream, out, x, n)
