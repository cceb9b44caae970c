"""Shared fixtures: one CUDA backend per session, fresh (or ``$TEST_SEED``) random generators,
GPU skips."""

from __future__ import annotations

import os

import numpy as np
import pytest

from gpu_runtime import device_count

_NO_GPU_REASON = "no CUDA device on this machine (GPU tests run on the GPU machine: make gpu-check)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if device_count() > 0:
        return
    skip = pytest.mark.skip(reason=_NO_GPU_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu():
    from gpu_runtime import CudaBackend

    if device_count() == 0:
        pytest.skip(_NO_GPU_REASON)
    backend = CudaBackend()
    yield backend
    backend.close()


def _fixed_seed() -> int | None:
    """``$TEST_SEED`` as a seed (a non-negative integer), or None where it is unset or empty."""
    value = os.environ.get("TEST_SEED", "").strip()
    if not value:
        return None
    try:
        seed = int(value)
    except ValueError:
        seed = -1
    if seed < 0:
        raise pytest.UsageError(f"TEST_SEED={value!r}: expected a non-negative integer")
    return seed


def pytest_configure(config: pytest.Config) -> None:
    _fixed_seed()  # a bad TEST_SEED stops the run before any test


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator with a fresh seed every run, or ``$TEST_SEED`` where it is set (every test's
    generator then starts from it); the seed is in the test's report on failure."""
    seed = _fixed_seed()
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"rng seed {seed} (replay: TEST_SEED={seed})")
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under ``REQUIRE_GPU=1`` (make gpu-check) a skipped GPU test is a failure: the GPU
    machine must run every one of them (but ``multi_gpu`` ones, which need the optional
    ``multi-gpu`` extra and, most of them, a second GPU)."""
    outcome = yield
    report = outcome.get_result()
    if (os.environ.get("REQUIRE_GPU") == "1" and report.skipped and "gpu" in item.keywords
            and "multi_gpu" not in item.keywords):
        report.outcome = "failed"
        report.longrepr = f"GPU test skipped under REQUIRE_GPU=1: {report.longrepr}"
