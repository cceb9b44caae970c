"""The case tables cover every row of the matrix, without repeated ids, and the "Bad input" page
(``docs/BAD_INPUT.md``) is the one they generate (the module keeps its name from when the table
was a section of the README)."""

from __future__ import annotations

from tests.bad_inputs.cases import CPU_CASES, CUDA_CASES, GPU_LAUNCH_CASES
from tests.bad_inputs.matrix import ROW_KEYS
from tests.bad_inputs.readme import PAGE, TITLE, WRITE, matrix_cells, matrix_markdown, matrix_table


def test_every_matrix_row_has_cases():
    for table in (CPU_CASES, CUDA_CASES, GPU_LAUNCH_CASES):
        ids = [param.id for param in table]
        assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    cells = matrix_cells()
    assert {row for row, _ in cells} == set(ROW_KEYS)
    assert all(cell["outcomes"] or cell["xfail"] for cell in cells.values())


def test_page_matrix_matches_the_cases():
    """docs/BAD_INPUT.md holds the table the cases generate, and the rest of the page as generated."""
    assert PAGE.is_file(), f"{PAGE} is missing: write it with {WRITE}"
    text = PAGE.read_text()
    assert text.startswith(TITLE + "\n"), f"{PAGE.name} is not the generated page: regenerate it with {WRITE}"
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert table == matrix_table()[0], f"{PAGE.name}'s bad-input table is stale: regenerate it with {WRITE}"
    assert text == matrix_markdown(), f"{PAGE.name} differs from the generated page: regenerate it with {WRITE}"
