"""Every CPU case on the world's logging host-memory backend: the refusal (or no-op), nothing
written, then the row's good call."""

from __future__ import annotations

from typing import Any

import pytest

from tests.bad_inputs.cases import AFTER, CPU_CASES
from tests.bad_inputs.world import World


@pytest.fixture
def world(rng, tmp_path, monkeypatch):
    w = World(rng, tmp_path, monkeypatch)
    yield w
    w.close()


def assert_nothing_written(before: dict[str, Any], after: dict[str, Any], log: list, temp: bool) -> None:
    """Equal memory, files and state; no launch; no allocation, free or write at all unless
    ``temp`` (then only into temporaries that are gone again)."""
    assert [op for op in log if op[0] == "launch"] == [], f"launched {log}"
    if not temp:
        assert log == [], f"wrote before refusing: {log}"
    assert set(after["mem"]) == set(before["mem"]), "allocations leaked or freed"
    for ptr, data in before["mem"].items():
        assert after["mem"][ptr] == data, f"device buffer 0x{ptr:x} changed"
    for key in before:
        if key != "mem":
            assert after[key] == before[key], f"{key} changed"


@pytest.mark.parametrize("row, fn, exc, match, temp, needs, after", CPU_CASES)
def test_cpu_refusal(world, row, fn, exc, match, temp, needs, after):
    for name in needs:
        getattr(world, name)
    before, mark = world.state(), len(world.gpu.log)
    if exc is None:
        fn(world)
    else:
        with pytest.raises(exc, match=match):
            fn(world)
    assert_nothing_written(before, world.state(), world.gpu.log[mark:], temp)
    (after or AFTER[row])(world)

