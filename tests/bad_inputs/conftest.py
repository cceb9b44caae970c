"""Fixtures the device tests share."""

from __future__ import annotations

import pytest

from gpu_runtime import CudaBackend


@pytest.fixture(scope="module")
def closed_backend(gpu):
    """A closed ``CudaBackend``: the "closed" column's subject on the device."""
    backend = CudaBackend()
    backend.close()
    return backend
