"""Every launcher passes its kernel the argument kinds its C signature declares, in order; the
token-overlay launchers pass them in exactly the seed's order (arguments go by position, so a
swap would launch garbage without any error). Every kernel has a ``KernelSpec`` whose parameter
names and kinds are its source's, and a spec launch binds by name, so a swap cannot pass."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpu_runtime import DevicePtr, compiler
from gpu_runtime.launch_spec import KernelSpec
from gpu_runtime.signatures import parse_signatures
from layers.ops import embed, gemm, ngram_decode, ngram_fused, residual, row_cache, token_overlay
from layers.ops.specs import BATCHED_EMBED, SPECS
from layers.weight_map import BF16, DenseWeight
from tests.fakes import RecordingBackend

SEEDS = Path(__file__).parent / "seeds"


def _p(i: int) -> DevicePtr:
    return DevicePtr(0x100000 * (i + 1))


LAUNCHERS = {
    ("embed_from_argmax", "batched_embed"):
        lambda g, k: embed.batched_embed(g, k, _p(0), _p(1), _p(2), 5, 7, 3),
    ("embed_from_argmax", "batched_embed_fp8"):
        lambda g, k: embed.batched_embed_fp8(g, k, _p(0), _p(1), _p(2), _p(3), 5, 7, 3),
    ("embed_from_argmax", "embed_from_argmax_bf16"):
        lambda g, k: embed.embed_from_argmax(g, k, _p(0), 11, _p(1), _p(2), _p(3), 5, 7, 3),
    ("residual_add", "bf16_scaled_add"):
        lambda g, k: residual.scaled_add(g, k, _p(0), _p(1), 0.25, 9, 3),
    ("residual_add", "bf16_residual_add"):
        lambda g, k: residual.residual_add(g, k, _p(0), _p(1), 9, 3),
    ("gemm", "dense_gemm_bf16_pipelined"):
        lambda g, k: gemm.dense_gemm_bf16_pipelined(
            g, k, _p(0), DenseWeight(_p(1), (6, 8), BF16), _p(2), 5, 6, 8, 3),
    ("gemm", "dense_gemm_bf16_word"):
        lambda g, k: gemm.dense_gemm_bf16_word(
            g, k, _p(0), DenseWeight(_p(1), (6, 8), BF16), _p(2), 5, 6, 8, _p(3), _p(4), 0.25, 3),
    ("ngram_fused", "ngram_gather"):
        lambda g, k: ngram_fused.ngram_gather(g, k, _p(0), _p(1), _p(2), _p(3), _p(4), _p(5),
                                              5, 6, 4, 2, 7, 11, 3),
    ("ngram_decode", "ngram_decode_gather"):
        lambda g, k: ngram_decode.ngram_decode_gather(
            g, k, _p(0), _p(1), _p(2), _p(3), _p(4), _p(5), _p(6), _p(7), _p(8), _p(9),
            9, 2, 0, 4, 5, 500, 6, 4, 2, 7, 11, 3),
    ("ngram_decode", "ngram_decode_rollback"):
        lambda g, k: ngram_decode.ngram_decode_rollback(g, k, _p(0), _p(1), _p(2), _p(3), 2, 4, 3, 3),
    ("row_cache", "scatter_rows"):
        lambda g, k: row_cache.scatter_rows(g, k, _p(0), _p(1), _p(2), _p(3), _p(4), 5, 14, 3),
    ("token_overlay", "embed_rowdiff_bf16"):
        lambda g, k: token_overlay.embed_rowdiff(g, k, _p(0), _p(1), _p(2), 300, 7, 0.5, 3),
    ("token_overlay", "embed_overlay_routed_bf16"):
        lambda g, k: token_overlay.embed_overlay_routed(
            g, k, _p(0), _p(1), 2, _p(2), _p(3), _p(4), _p(5), 5, 7, 11, 3),
    ("token_overlay", "lmhead_overlay_routed_bf16"):
        lambda g, k: token_overlay.lmhead_overlay_routed(
            g, k, _p(0), _p(1), 2, _p(2), _p(3), _p(4), _p(5), 5, 4, 7, 11, 3),
    ("token_overlay", "lmhead_overlay_routed_f32"):
        lambda g, k: token_overlay.lmhead_overlay_routed(
            g, k, _p(0), _p(1), 2, _p(2), _p(3), _p(4), _p(5), 5, 4, 7, 11, 3),
}


def _all_kernels() -> set[tuple[str, str]]:
    found = set()
    for path in compiler.kernel_dir().glob("*.cu"):
        found |= {(path.stem, name) for name in parse_signatures(path.read_text())}
    return found


def test_every_kernel_has_a_launcher_here():
    assert _all_kernels() <= set(LAUNCHERS) | {k for k in _all_kernels() if k[0] == "gemm"}
    assert {k for k in LAUNCHERS if k[0] != "gemm"} <= _all_kernels()


@pytest.mark.parametrize("module, name", sorted(LAUNCHERS))
def test_launcher_kinds_match_c_signature(module, name):
    gpu = RecordingBackend()
    LAUNCHERS[(module, name)](gpu, gpu.kernel(module, name))
    assert gpu.launches, "the launcher launched nothing"
    signatures = parse_signatures((compiler.kernel_dir() / f"{module}.cu").read_text())
    for launch in gpu.launches:
        launched_module, launched_name = gpu.kernel_of(launch)
        assert launched_module == module
        assert launch.kinds == signatures[launched_name], launched_name
        assert launch.stream == 3


def _seed_launches(path: Path) -> dict[str, list[tuple[str, str]]]:
    """{function: [(kind, expression), ...]} of each ``KernelLaunch::new`` chain in a seed."""
    text = path.read_text()
    out = {}
    for fn in re.finditer(r"pub fn (\w+)\((.*?)\n\}", text, re.S):
        chain = re.findall(r"\.arg_(ptr|u32|i32|f32|u64)\(([^)]*)\)", fn.group(2))
        if chain:
            out[fn.group(1)] = chain
    return out


_KIND = {"ptr": "P", "u32": "U", "i32": "I", "f32": "F", "u64": "L"}


def test_overlay_launchers_follow_the_seed_position_for_position():
    seed = _seed_launches(SEEDS / "ops_token_overlay.rs")
    assert set(seed) == {"embed_rowdiff", "embed_overlay_routed", "lmhead_overlay_routed"}
    for fn_name, chain in seed.items():
        fn = getattr(token_overlay, fn_name)
        params = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
        assert params[:2] == ["gpu", "kernel"] and params[-1] == "stream"
        values = {p: (i + 1) * 16 for i, p in enumerate(params[2:-1])}  # distinct per parameter
        gpu = RecordingBackend()
        kernel = gpu.kernel("token_overlay", "x")
        fn(gpu, kernel, *values.values(), 5)
        (launch,) = gpu.launches
        assert launch.kinds == "".join(_KIND[k] for k, _ in chain), fn_name
        expected = [values[expr.strip()] for _, expr in chain]
        assert [int(a) for a in launch.args] == expected, fn_name


# -- KernelSpec: named arguments ---------------------------------------------------------------
def _sources() -> dict[str, dict]:
    return {path.stem: parse_signatures(path.read_text()) for path in compiler.kernel_dir().glob("*.cu")}


def test_every_kernel_has_one_spec_and_every_spec_a_kernel():
    sources = _sources()
    assert set(SPECS) == set(sources)
    for module, specs in SPECS.items():
        names = [spec.name for spec in specs]
        assert sorted(names) == sorted(sources[module]), module
        assert len(set(names)) == len(names), module


@pytest.mark.parametrize("spec", [s for specs in SPECS.values() for s in specs], ids=lambda s: s.name)
def test_spec_matches_its_kernel_source_names_and_kinds(spec):
    (signature,) = [sigs[spec.name] for sigs in _sources().values() if spec.name in sigs]
    spec.check_signature(signature, spec.name)  # raises on any difference
    assert spec.params == signature and spec.params.names == signature.names


def test_spec_with_two_same_kind_parameters_swapped_is_refused():
    """batched_embed takes (ids, table, out, n, dim): a spec that names n and dim the other way
    round has the same kinds, and is refused by name."""
    swapped = KernelSpec("batched_embed", ids="P", table="P", out="P", dim="U", n="U")
    (signature,) = [sigs["batched_embed"] for sigs in _sources().values() if "batched_embed" in sigs]
    assert swapped.kinds == signature.kinds
    with pytest.raises(TypeError, match=r"parameter 3 is n: u32 in the source, dim: u32 in spec"):
        swapped.check_signature(signature, "embed_from_argmax.batched_embed")


def test_arguments_bound_by_name_land_in_their_positions():
    """Keywords in any order launch the kernel's order; a missing or unknown name is refused
    before anything is launched."""
    gpu = RecordingBackend()
    k = gpu.kernel("embed_from_argmax", "batched_embed")
    BATCHED_EMBED.launch(gpu, k, (2, 1, 1), (256, 1, 1), 3, dim=7, n=5, out=_p(2), table=_p(1), ids=_p(0))
    (launch,) = gpu.launches
    assert launch.kinds == "PPPUU" and launch.args == [int(_p(0)), int(_p(1)), int(_p(2)), 5, 7]
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'dim'"):
        BATCHED_EMBED.launch(gpu, k, (2, 1, 1), (256, 1, 1), 3, n=5, out=_p(2), table=_p(1), ids=_p(0))
    with pytest.raises(TypeError, match="unexpected keyword argument 'count'"):
        BATCHED_EMBED.launch(gpu, k, (2, 1, 1), (256, 1, 1), 3, count=5, dim=7, out=_p(2), table=_p(1),
                             ids=_p(0))
    with pytest.raises(TypeError):  # arguments cannot be given by position
        BATCHED_EMBED.launch(gpu, k, (2, 1, 1), (256, 1, 1), 3, _p(0), _p(1), _p(2), 5, 7)
    assert len(gpu.launches) == 1
