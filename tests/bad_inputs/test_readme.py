"""The case tables cover every row of the matrix, without repeated ids, and the README's table is
the one they generate."""

from __future__ import annotations

from tests.bad_inputs.cases import CPU_CASES, CUDA_CASES, GPU_LAUNCH_CASES
from tests.bad_inputs.matrix import ROW_KEYS
from tests.bad_inputs.readme import COMMAND, README, matrix_cells, matrix_table


def test_every_matrix_row_has_cases():
    for table in (CPU_CASES, CUDA_CASES, GPU_LAUNCH_CASES):
        ids = [param.id for param in table]
        assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    cells = matrix_cells()
    assert {row for row, _ in cells} == set(ROW_KEYS)
    assert all(cell["outcomes"] or cell["xfail"] for cell in cells.values())


def test_readme_matrix_matches_the_cases():
    """The README's "Bad input" section holds the table the cases generate."""
    text = README.read_text()
    assert "## Bad input" in text, f"README has no 'Bad input' section: add the output of {COMMAND}"
    section = text.split("## Bad input", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert table == matrix_table()[0], \
        f"README's bad-input table is stale: regenerate it with {COMMAND}"

