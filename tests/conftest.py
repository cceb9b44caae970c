"""Shared fixtures: one CUDA backend per session, random generators seeded from each test's node
id (``$TEST_SEED``: a fixed seed, or ``random``), GPU skips."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from gpu_runtime import device_count
from tests.helpers import TOO_SLOW_UNDER_SANITIZER

_NO_GPU_REASON = "no CUDA device on this machine (GPU tests run on a machine with a CUDA GPU: make gpu-check)"


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


def _seed_setting() -> int | str | None:
    """``$TEST_SEED``: a non-negative integer, ``"random"``, or None where it is unset or empty."""
    value = os.environ.get("TEST_SEED", "").strip()
    if not value or value == "random":
        return value or None
    try:
        seed = int(value)
    except ValueError:
        seed = -1
    if seed < 0:
        raise pytest.UsageError(f"TEST_SEED={value!r}: expected a non-negative integer or 'random'")
    return seed


def pytest_configure(config: pytest.Config) -> None:
    _seed_setting()  # a bad TEST_SEED stops the run before any test


def node_seed(nodeid: str) -> int:
    """The default seed of a test: derived from its node id, so every run draws the same inputs."""
    return int.from_bytes(hashlib.sha256(nodeid.encode()).digest()[:8], "little")


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator seeded from the test's node id (the same every run), from ``$TEST_SEED``
    where it is an integer (every test's generator then starts from it), or freshly with
    ``TEST_SEED=random`` (exploration); the seed and its replay line are in the test's output."""
    setting = _seed_setting()
    if setting == "random":
        seed = int.from_bytes(os.urandom(8), "little")
    elif setting is None:
        seed = node_seed(request.node.nodeid)
    else:
        seed = int(setting)
    request.node.user_properties.append(("seed", seed))
    print(f"rng seed {seed} (replay: TEST_SEED={seed})")
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under ``REQUIRE_GPU=1`` (make gpu-check) a skipped GPU test is a failure: the GPU
    machine must run every one of them (but ``multi_gpu`` ones, which need the optional
    ``multi-gpu`` extra and, most of them, a second GPU, and under a sanitizer those marked
    ``TOO_SLOW_UNDER_SANITIZER``)."""
    outcome = yield
    report = outcome.get_result()
    slow = os.environ.get("GPU_SANITIZER") and any(
        m.name == "skipif" and m.kwargs.get("reason") == TOO_SLOW_UNDER_SANITIZER.kwargs["reason"]
        for m in item.iter_markers())
    if (os.environ.get("REQUIRE_GPU") == "1" and report.skipped and "gpu" in item.keywords
            and "multi_gpu" not in item.keywords and not slow):
        report.outcome = "failed"
        report.longrepr = f"GPU test skipped under REQUIRE_GPU=1: {report.longrepr}"
