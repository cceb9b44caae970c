"""Errors at the boundary (issue 28): every public entry point that takes a ``gpu`` or a stream
refuses a wrong one at once, naming the parameter, before it touches the backend.

The walk reads the public surface itself: the names in ``__all__`` of ``gpu_runtime``,
``layers.ngram_embed``, ``layers.overlay``, ``layers.peft_adapter``, ``layers.tensor_parallel``
and ``layers.tensor_parallel.nccl`` (and ``DenseWeight``, ``BlockFp8Weight``, ``OverlayKernels``), each function,
each class's constructor and public methods, and the callables a class declares as attributes
(``Kernel.launch``). Every one whose signature has a ``gpu`` / ``gpus`` or ``stream`` /
``streams`` parameter is an entry point, and needs a case in ``CASES``: how to build valid
arguments for it on a logging host-memory backend. A new entry point without a case fails the
walk. Each case is called with every wrong value of each such parameter, the others valid, and
must raise ``TypeError`` (``ValueError`` for a negative stream) whose message names the
parameter, with nothing logged on the backend; then once with the valid arguments.

Left out: the backend interface itself (``GpuBackend``, its capabilities, ``CudaBackend``: its
streams go to the driver as they are, docs/BAD_INPUT.md) and protocols (``Collective``,
``CollectiveGroup``: implemented elsewhere). ``PENDING``: entry points another change owns.
``pytest -s tests/test_public_surface.py`` prints the counts."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import types
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpu_runtime import (
    DeviceArray,
    DeviceBuffer,
    DeviceCopies,
    DevicePtr,
    Events,
    GpuBackend,
    Graphs,
    HostFunctions,
    KernelLaunch,
    LaunchConfig,
    MappedHostMemory,
    PinnedHostMemory,
    PitchedCopies,
    TensorMaps,
    validate,
)
from gpu_runtime.backend import check_backend
from layers import safetensors_io
from layers.block_fp8_weight import BlockFp8Weight
from layers.dense_weight import BF16, DenseWeight
from layers.engram import EngramCheckpoint, EngramDecoder, EngramWeights, Shard, lookup_all
from layers.ngram_embed import (FusedNgramEmbedding, HostWeight, NgramDecoder, NgramEmbedding, NgramWeights, RowCache,
                                 embed_all, write_table)
from tests.helpers.tensor_parallel import FakeGroup, Ranks
from layers.ops.token_overlay import OverlayKernels
from layers.overlay import OverlaySlots, build_overlay
from layers.peft_adapter import overlay_from_peft, read_peft_adapter
from layers.tensor_parallel import LocalGroup, nccl
from tests.helpers import random_bf16
from tests.helpers import engram
from tests.helpers.checkpoint import make_model, write_model
from tests.helpers.logging_backend import LoggingBackend
from tests.helpers.ngram import device_weights, random_layer, small_dims
from tests.helpers.overlay import adapter_copy, random_overlay
from tests.helpers.peft import EMBED, save_adapter, token_rows, tt_config
from tests.helpers.public_names import exported

INTERFACES = (GpuBackend, PinnedHostMemory, MappedHostMemory, Events, Graphs, PitchedCopies, DeviceCopies, HostFunctions,
              TensorMaps)
BACKENDS, STREAMS = ("gpu", "gpus"), ("stream", "streams")
PENDING: dict[str, str] = {}


# -- the walk ----------------------------------------------------------------------------------
def _declared_callables(cls: type) -> list[str]:
    """The public attributes ``cls`` (or a base in this project) annotates as ``Callable``: set
    per instance, so seen on one only."""
    names = []
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in ("gpu_runtime", "layers"):
            names += [n for n, a in vars(klass).get("__annotations__", {}).items()
                      if not n.startswith("_") and str(a).startswith("Callable")]
    return names


def public_callables() -> dict[str, Any]:
    """Qualified name -> the function, class (its constructor) or method; a declared callable
    attribute maps to None (its signature comes from the case's instance)."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    for module, name, obj in exported():
        if id(obj) in seen or not callable(obj):
            continue
        seen.add(id(obj))
        key = f"{module}.{name}"
        if not inspect.isclass(obj):
            found[key] = obj
            continue
        if issubclass(obj, INTERFACES) or getattr(obj, "_is_protocol", False):
            continue
        found[key] = obj
        for attr, member in inspect.getmembers(obj):
            if not attr.startswith("_") and callable(member) and not inspect.isclass(member):
                found[f"{key}.{attr}"] = member
        for attr in _declared_callables(obj):
            found[f"{key}.{attr}"] = None
    return found


def _parameters(fn: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # exceptions' constructors and the like: no signature to read
        return {}


def entry_points() -> dict[str, Any]:
    """The public callables with a backend or stream parameter (or declared ones, to be read on
    an instance)."""
    return {key: fn for key, fn in public_callables().items()
            if fn is None or set(_parameters(fn)) & {*BACKENDS, *STREAMS}}


def wrong_values(param: inspect.Parameter, backend: Any) -> list[tuple[Any, type[Exception]]]:
    """Each wrong value of a ``gpu`` / stream parameter and the error it must raise; None only
    where None is not the default. A plural parameter gets a wrong last element."""
    if param.name in BACKENDS:
        return [(v, TypeError) for v in (None, "cpu", 0) if not (v is None and param.default is None)]
    return [(-1, ValueError), ("s", TypeError), (1.5, TypeError), (backend, TypeError)]


# -- valid arguments ---------------------------------------------------------------------------
class Backend(LoggingBackend, DeviceCopies):
    """The logging host-memory backend, with device copies (``LocalGroup``) and a device ordinal
    (``NcclGroup``: one backend per device)."""

    def __init__(self, device: int = 0) -> None:
        super().__init__()
        self.device = device

    def copy_d2d_async(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        self.log.append(("d2d", int(dst)))
        self.copy_h2d_async(self.read(src, nbytes), dst, stream)


class FakeComm:
    """A communicator of nccl4py's: rank 1 of 2, no error pending."""

    rank, nranks, ptr = 1, 2, 0xC001
    get_async_error = staticmethod(lambda: 0)
    abort = destroy = staticmethod(lambda: None)


def install_fake_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """nccl4py's modules as ``layers.tensor_parallel.nccl`` calls them, doing nothing."""
    core = types.SimpleNamespace(
        get_unique_id=lambda: b"u" * 128, UniqueId=types.SimpleNamespace(from_bytes=bytes),
        Communicator=types.SimpleNamespace(init=lambda size, rank, uid: FakeComm(),
                                           init_all=lambda devices: [FakeComm() for _ in devices]),
        group_start=lambda: None, group_end=lambda: None)
    raw = types.SimpleNamespace(Comm=int, all_reduce=lambda *args: None)
    bindings = types.SimpleNamespace(nccl=raw)
    modules = {"nccl": types.SimpleNamespace(core=core, bindings=bindings), "nccl.core": core,
               "nccl.bindings": bindings, "nccl.bindings.nccl": raw}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


class Env:
    """The subjects of the cases on one ``Backend``, each built when a case first asks for it."""

    def __init__(self, rng: np.random.Generator, tmp: Path) -> None:
        self.rng, self.tmp, self.gpu = rng, tmp, Backend()
        tmp.mkdir(parents=True, exist_ok=True)

    def u32(self, *values: int) -> DevicePtr:
        return DeviceArray.from_numpy(self.gpu, np.array(values, np.uint32)).ptr

    @cached_property
    def host(self) -> Any:
        return random_layer(self.rng, small_dims(), "bf")

    @cached_property
    def tables(self) -> list:
        return [t if s is None else (t, s) for t, s in self.host.tables]

    @cached_property
    def weights(self) -> NgramWeights:
        return device_weights(self.gpu, self.host)

    @cached_property
    def out(self) -> DevicePtr:
        return self.gpu.alloc(8 * self.host.dims.hidden_size * 2)

    @cached_property
    def decoder(self) -> NgramDecoder:
        return NgramDecoder(self.weights, max_seqs=4, max_rows=8, max_draft=2)

    @cached_property
    def st_path(self) -> Path:
        tensors = {"word.weight": self.host.word}
        for c, ((table, scale), proj) in enumerate(zip(self.host.tables, self.host.projs)):
            tensors |= {f"tables.{c}.weight": table, f"projs.{c}.weight": proj}
            tensors |= {} if scale is None else {f"tables.{c}.row_scale": scale}
        safetensors_io.save(self.tmp / "ngram.safetensors", tensors)
        return self.tmp / "ngram.safetensors"

    @cached_property
    def table_path(self) -> Path:
        write_table(self.tmp / "t.ngt", random_bf16(self.rng, (20, 8)))
        return self.tmp / "t.ngt"

    @cached_property
    def slots(self) -> OverlaySlots:
        slots = OverlaySlots(self.gpu, 2, 30, 5, kernels=self.kernels)
        slots.load(0, self.overlay())
        return slots

    @cached_property
    def kernels(self) -> OverlayKernels:
        return OverlayKernels.new(self.gpu)

    def overlay(self) -> Any:
        return random_overlay(self.rng, 30, 5, 3, 2)

    @cached_property
    def adapter_dir(self) -> Path:
        tensors = {f"{EMBED}.trainable_tokens_delta": token_rows(self.rng, 2)}
        return save_adapter(self.tmp / "adapter", tt_config([1, 2]), tensors)

    @cached_property
    def served(self) -> tuple[DenseWeight, np.ndarray]:
        served = random_bf16(self.rng, (10, 4))
        return DenseWeight.from_numpy(self.gpu, served), adapter_copy(self.rng, served, [3])

    @cached_property
    def collective(self) -> nccl.NcclCollective:
        return nccl.NcclCollective.init(2, 1, b"x" * 128, self.gpu)

    @cached_property
    def engram(self) -> tuple[Any, Any, dict]:
        """A tiny Engram config, its token map and its arrays."""
        cfg = engram.tiny()
        return cfg, engram.token_map(self.rng, cfg), engram.arrays(self.rng, cfg)

    def engram_weights(self, **kw: Any) -> EngramWeights:
        cfg, token_map, a = self.engram
        return EngramWeights.from_arrays(self.gpu, cfg, token_map, a["tables"], a["wkv"], a["q"], a["k"], **kw)

    @cached_property
    def engram_decoder(self) -> EngramDecoder:
        return EngramDecoder(self.engram_weights(), max_seqs=4, max_rows=8, max_draft=2)

    def engram_ranks(self) -> tuple:
        """``lookup_all``'s arguments for a group of two ranks (one prompt of two tokens)."""
        ranks = [EngramDecoder(self.engram_weights(shard=Shard(r, 2)), max_seqs=4, max_rows=8) for r in range(2)]
        return FakeGroup(2), ranks, [self.u32(4, 5)] * 2, [self.u32(0, 2)] * 2, [self.u32(0)] * 2, 1, 2, [0, 0]

    @cached_property
    def engram_residual(self) -> DevicePtr:
        cfg = self.engram[0]
        return self.gpu.alloc(8 * cfg.hc_mult * cfg.hidden_size * 2)

    def bound(self) -> Any:
        return self.gpu.bind(self.gpu.kernel("residual_add", "bf16_residual_add"))


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Callable[..., Any], tuple, dict]:
    return fn, args, kwargs


G, NG, OV, TP = "gpu_runtime.", "layers.ngram_embed.", "layers.overlay.", "layers.tensor_parallel."
EG, ED = "layers.engram.", "layers.engram.EngramDecoder"
DW = "layers.dense_weight.DenseWeight"
BW = "layers.block_fp8_weight.BlockFp8Weight"
CASES: dict[str, Callable[[Env], tuple[Callable[..., Any], tuple, dict]]] = {
    # gpu_runtime
    G + "DeviceArray": lambda e: call(DeviceArray, e.gpu, e.out, (4, 4), np.float32),
    G + "DeviceArray.empty": lambda e: call(DeviceArray.empty, e.gpu, (4, 4), np.float32),
    G + "DeviceArray.from_numpy": lambda e: call(DeviceArray.from_numpy, e.gpu, np.zeros(4, np.float32)),
    G + "DeviceBuffer": lambda e: call(DeviceBuffer, e.gpu, 64),
    G + "DeviceBuffer.upload": lambda e: call(DeviceBuffer.upload, e.gpu, np.zeros(4, np.float32)),
    G + "DeviceBuffer.close": lambda e: call(DeviceBuffer(e.gpu, 64).close, stream=0),
    G + "KernelLaunch": lambda e: call(KernelLaunch, e.gpu, e.gpu.kernel("residual_add", "bf16_residual_add")),
    G + "KernelLaunch.new": lambda e: call(KernelLaunch.new, e.gpu, e.gpu.kernel("residual_add", "bf16_residual_add")),
    G + "KernelLaunch.launch": lambda e: call(
        KernelLaunch(e.gpu, e.gpu.kernel("residual_add", "bf16_residual_add")).arg_ptr(e.out).arg_ptr(e.out).arg_u32(8)
        .launch),
    G + "Kernel.launch": lambda e: call(e.bound().launch, LaunchConfig(1, 32), 0, e.out, e.out, 8),
    G + "PreparedLaunch.run": lambda e: call(e.bound().prepare(LaunchConfig(1, 32), e.out, e.out, 8).run, 0),
    # layers.engram
    EG + "EngramWeights": lambda e: call(EngramWeights, e.gpu, e.engram[0], e.engram[1], None),
    EG + "EngramWeights.from_arrays": lambda e: call(EngramWeights.from_arrays, e.gpu, *e.engram[:2],
                                                     *(e.engram[2][k] for k in ("tables", "wkv", "q", "k"))),
    EG + "EngramWeights.from_checkpoint": lambda e: call(
        EngramWeights.from_checkpoint, EngramCheckpoint.open(engram.write_model(e.tmp / "engram", e.rng).path),
        e.gpu, e.engram[1]),
    ED: lambda e: call(EngramDecoder, e.engram_weights(), max_seqs=4, max_rows=8),
    ED + ".apply": lambda e: call(e.engram_decoder.apply, 1, e.engram_residual, 2),
    ED + ".check_errors": lambda e: call(e.engram_decoder.check_errors),
    ED + ".fork": lambda e: call(e.engram_decoder.fork, e.u32(0), e.u32(1), 1),
    ED + ".gather": lambda e: call(e.engram_decoder.gather, (e.u32(4, 5), e.u32(0, 2), e.u32(0)), 0, 1, 2, 0, 0),
    ED + ".history": lambda e: call(e.engram_decoder.history, 0),
    ED + ".prefill": lambda e: call(e.engram_decoder.prefill, e.u32(4, 5), e.u32(0, 2), e.u32(0), 1, 2),
    ED + ".project": lambda e: call(e.engram_decoder.project, 2, 0),
    ED + ".reset": lambda e: call(e.engram_decoder.reset, 0),
    ED + ".reset_all": lambda e: call(e.engram_decoder.reset_all),
    ED + ".rollback": lambda e: call(e.engram_decoder.rollback, e.u32(0), e.u32(1), 1),
    ED + ".seed": lambda e: call(e.engram_decoder.seed, e.u32(4, 5), e.u32(0, 2), e.u32(0), 1, 2),
    ED + ".step": lambda e: call(e.engram_decoder.step, e.u32(4), e.u32(0), 1),
    EG + "lookup_all": lambda e: call(lookup_all, *e.engram_ranks()),
    # layers.ngram_embed
    NG + "FusedNgramEmbedding": lambda e: call(FusedNgramEmbedding, e.weights, 8),
    NG + "FusedNgramEmbedding.captured_graph": lambda e: call(FusedNgramEmbedding(e.weights, 8).captured_graph,
                                                              2, e.out, 0),
    NG + "FusedNgramEmbedding.embed": lambda e: call(FusedNgramEmbedding(e.weights, 8).embed, [1, 2, 3], 2, e.out),
    NG + "FusedNgramEmbedding.embed_batch": lambda e: call(FusedNgramEmbedding(e.weights, 8).embed_batch,
                                                           [[1, 2, 3]], [2], e.out),
    NG + "FusedNgramEmbedding.project": lambda e: call(FusedNgramEmbedding(e.weights, 8).project, 0, e.out),
    NG + "FusedNgramEmbedding.stage": lambda e: call(FusedNgramEmbedding(e.weights, 8).stage, [[1, 2, 3]], [2]),
    NG + "HostWeight": lambda e: call(HostWeight, DevicePtr(0x1000), (2, 2), BF16, gpu=e.gpu),
    NG + "HostWeight.from_numpy": lambda e: call(HostWeight.from_numpy, e.gpu, random_bf16(e.rng, (4, 4))),
    NG + "HostWeight.from_table_file": lambda e: call(HostWeight.from_table_file, e.gpu, e.table_path),
    NG + "RowCache": lambda e: call(RowCache, e.gpu, e.table_path, 4),
    NG + "embed_all": lambda e: (lambda ranks: call(embed_all, FakeGroup(2), ranks.runners, [[1, 2, 3]], [2],
                                                    [e.out, e.out], [0, 0]))(Ranks(e.gpu, e.host, 2)),
    NG + "NgramDecoder": lambda e: call(NgramDecoder, e.weights, max_seqs=4, max_rows=8),
    NG + "NgramDecoder.check_errors": lambda e: call(e.decoder.check_errors),
    NG + "NgramDecoder.fork": lambda e: call(e.decoder.fork, e.u32(0), e.u32(1), 1),
    NG + "NgramDecoder.history": lambda e: call(e.decoder.history, 0),
    NG + "NgramDecoder.launch_gather": lambda e: call(e.decoder.launch_gather, e.u32(7), 0, e.u32(0), 1, 1, 1, 0),
    NG + "NgramDecoder.prefill": lambda e: call(e.decoder.prefill, e.u32(4, 5), e.u32(0, 2), e.u32(0), 1, 2, e.out),
    NG + "NgramDecoder.reset": lambda e: call(e.decoder.reset, 0),
    NG + "NgramDecoder.reset_all": lambda e: call(e.decoder.reset_all),
    NG + "NgramDecoder.rollback": lambda e: call(e.decoder.rollback, e.u32(0), e.u32(1), 1),
    NG + "NgramDecoder.seed": lambda e: call(e.decoder.seed, e.u32(4, 5), e.u32(0, 2), e.u32(0), 1, 2),
    NG + "NgramDecoder.step": lambda e: call(e.decoder.step, e.u32(4), e.u32(0), 1, e.out),
    NG + "NgramEmbedding.embed": lambda e: call(NgramEmbedding(e.weights, 8).embed, [1, 2, 3], 2, e.out, e.gpu),
    NG + "NgramWeights": lambda e: call(NgramWeights, e.host.dims, e.weights.word, e.weights.tables, e.weights.projs,
                                        e.gpu),
    NG + "NgramWeights.concat_projections": lambda e: call(e.weights.concat_projections),
    NG + "NgramWeights.table_descriptors": lambda e: call(e.weights.table_descriptors),
    NG + "NgramWeights.from_numpy": lambda e: call(NgramWeights.from_numpy, e.host.dims, e.host.word, e.tables,
                                                   e.host.projs, e.gpu),
    NG + "NgramWeights.from_safetensors": lambda e: call(NgramWeights.from_safetensors, e.st_path, e.host.dims, e.gpu),
    NG + "NgramWeights.from_pretrained": lambda e: call(
        NgramWeights.from_pretrained, write_model(e.tmp / "model", make_model(e.rng)).path, e.gpu),
    # layers.overlay, layers.peft_adapter, layers.ops.token_overlay
    OV + "OverlaySlots": lambda e: call(OverlaySlots, e.gpu, 2, 30, 5, kernels=e.kernels),
    OV + "OverlaySlots.check_errors": lambda e: call(e.slots.check_errors),
    OV + "OverlaySlots.close": lambda e: call(e.slots.close),
    OV + "OverlaySlots.embed_overlay": lambda e: call(e.slots.embed_overlay, e.u32(1, 2), None, 0, e.out, 2),
    OV + "OverlaySlots.evict": lambda e: call(e.slots.evict, 0),
    OV + "OverlaySlots.lmhead_overlay": lambda e: call(e.slots.lmhead_overlay, e.out, None, 0, e.out, 2),
    OV + "OverlaySlots.load": lambda e: call(e.slots.load, 1, e.overlay()),
    OV + "OverlaySlots.replace": lambda e: call(e.slots.replace, 0, e.overlay()),
    OV + "build_overlay": lambda e: call(build_overlay, e.gpu, e.kernels, *e.served),
    "layers.peft_adapter.PeftAdapter.overlay": lambda e: call(read_peft_adapter(e.adapter_dir, vocab=30).overlay),
    "layers.peft_adapter.overlay_from_peft": lambda e: call(overlay_from_peft, e.adapter_dir, vocab=30),
    "layers.ops.token_overlay.OverlayKernels.new": lambda e: call(OverlayKernels.new, e.gpu),
    # layers.dense_weight
    DW: lambda e: call(DenseWeight, DevicePtr(0x1000), (2, 2), BF16, gpu=e.gpu),
    DW + ".owning": lambda e: call(DenseWeight.owning, e.gpu, DeviceBuffer(e.gpu, 8), (2, 2), BF16),
    DW + ".check_on": lambda e: call(DenseWeight(DevicePtr(0x1000), (2, 2), BF16, gpu=e.gpu).check_on, e.gpu, "a launch"),
    DW + ".from_numpy": lambda e: call(DenseWeight.from_numpy, e.gpu, random_bf16(e.rng, (2, 2))),
    # layers.block_fp8_weight
    BW: lambda e: call(BlockFp8Weight, DevicePtr(0x1000), DevicePtr(0x2000), (2, 32), gpu=e.gpu),
    BW + ".owning": lambda e: call(BlockFp8Weight.owning, e.gpu, DeviceBuffer(e.gpu, 64), DeviceBuffer(e.gpu, 1),
                                   (2, 32)),
    BW + ".check_on": lambda e: call(
        BlockFp8Weight(DevicePtr(0x1000), DevicePtr(0x2000), (2, 32), gpu=e.gpu).check_on, e.gpu, "a launch"),
    BW + ".from_numpy": lambda e: call(BlockFp8Weight.from_numpy, e.gpu, e.rng.integers(0, 127, (2, 32), np.uint8),
                                       np.full((1, 1), 127, np.uint8)),
    # layers.tensor_parallel (nccl over install_fake_nccl)
    TP + "LocalGroup": lambda e: call(LocalGroup, e.gpu, 2),
    TP + "nccl.NcclCollective": lambda e: call(nccl.NcclCollective, FakeComm(), e.gpu),
    TP + "nccl.NcclCollective.init": lambda e: call(nccl.NcclCollective.init, 2, 1, b"x" * 128, e.gpu),
    TP + "nccl.NcclCollective.allreduce_bf16": lambda e: call(e.collective.allreduce_bf16, e.out, 8, 0),
    TP + "nccl.NcclCollective.wait": lambda e: call(e.collective.wait, 0, 1.0),
    TP + "nccl.NcclGroup": lambda e: call(nccl.NcclGroup, [e.gpu, Backend(1)]),
    TP + "nccl.NcclGroup.wait": lambda e: call(nccl.NcclGroup([e.gpu, Backend(1)]).wait, [0, 0], 1.0),
}


def _bind(fn: Callable[..., Any], args: tuple, kwargs: dict) -> inspect.BoundArguments:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def _snapshot(gpu: Backend) -> tuple:
    return len(gpu.log), len(gpu.launches), len(gpu.syncs), set(gpu.mem), set(gpu.host), set(gpu.events)


def _names_the_parameter(name: str, message: str) -> bool:
    kind = "a GpuBackend" if name in BACKENDS else "a stream handle"
    return re.search(rf"\b{name}(\[\d+\])? must be {kind}", message) is not None


def test_every_entry_point_with_a_gpu_or_stream_has_a_case():
    """A public callable with a ``gpu`` or stream parameter and no case (nor a reason in
    ``PENDING``) fails here; so does a case or a pending entry for nothing public."""
    missing = set(entry_points()) - set(CASES) - set(PENDING)
    assert not missing, f"entry points without a case in CASES: {sorted(missing)}"
    stale = (set(CASES) | set(PENDING)) - set(entry_points())
    assert not stale, f"cases for no public entry point: {sorted(stale)}"


def test_wrong_backends_and_streams_are_refused_at_once_by_name(tmp_path, rng, monkeypatch):
    install_fake_nccl(monkeypatch)
    points = tried = 0
    for key in sorted(set(entry_points()) - set(PENDING)):
        env = Env(rng, tmp_path / f"case{points}")
        fn, args, kwargs = CASES[key](env)
        bound = _bind(fn, args, kwargs)
        params = [p for p in inspect.signature(fn).parameters.values() if p.name in (*BACKENDS, *STREAMS)]
        assert params, f"{key}: no gpu or stream parameter on its case's callable"
        points += 1
        for param in params:
            for wrong, error in wrong_values(param, env.gpu):
                value = wrong
                if param.name in ("gpus", "streams"):  # a plural parameter: its last element is wrong
                    value = [*bound.arguments[param.name][:-1], wrong]
                call_args = inspect.BoundArguments(bound.signature, bound.arguments | {param.name: value})
                before = _snapshot(env.gpu)
                with pytest.raises(error) as refused:
                    fn(*call_args.args, **call_args.kwargs)
                what = f"{key}({param.name}={wrong!r})"
                assert _names_the_parameter(param.name, str(refused.value)), f"{what}: {refused.value}"
                assert _snapshot(env.gpu) == before, f"{what} did something before it refused"
                tried += 1
        fn(*bound.args, **bound.kwargs)  # the case's own arguments are valid
    print(f"\npublic surface: {points} entry points, {tried} wrong arguments")
    assert points == len(CASES) and tried >= 3 * points


def test_a_tensor_parallel_construction_without_nccl_names_the_extra_first(monkeypatch):
    """Without nccl4py (the ``multi-gpu`` extra) every way to a communicator fails at once with
    an ImportError that names the extra, before its arguments are looked at."""
    monkeypatch.setitem(sys.modules, "nccl", None)
    for name in [n for n in sys.modules if n.startswith("nccl.")]:
        monkeypatch.delitem(sys.modules, name)
    gpu = Backend()
    builds = [lambda: nccl.unique_id(), lambda: nccl.NcclCollective.init(2, 1, b"x" * 128, gpu),
              lambda: nccl.NcclCollective.init(0, 5, b"short", None), lambda: nccl.NcclGroup([gpu, Backend(1)]),
              lambda: nccl.NcclGroup("cpu"), lambda: nccl.NcclCollective(FakeComm(), gpu)]
    for build in builds:
        with pytest.raises(ImportError, match=re.escape(nccl.EXTRA)):
            build()
    assert gpu.log == [] and gpu.syncs == []


def test_the_checks_take_what_the_runtime_hands_out():
    """``validate.stream`` takes numpy integers and ``check_backend`` any GpuBackend (and
    None where optional); a bool is not a stream."""
    assert validate.stream(np.uint64(7), "s") == 7 and type(validate.stream(np.int32(3), "s")) is int
    with pytest.raises(TypeError, match="x: stream must be a stream handle .*, got bool True"):
        validate.stream(True, "x: stream")
    with pytest.raises(ValueError, match=r"in 0\.\.2\*\*64-1, 0: the default stream\), got 18446744073709551616"):
        validate.stream(1 << 64, "x: stream")
    gpu = Backend()
    assert check_backend(gpu, "g") is gpu and check_backend(None, "g", optional=True) is None
    with pytest.raises(TypeError, match=r"g must be a GpuBackend \(gpu_runtime\.CudaBackend\) or None, got str 'cpu'"):
        check_backend("cpu", "g", optional=True)
