"""The "Bad input" page, ``docs/BAD_INPUT.md``, generated from the case tables: which exception
each entry point raises for each kind of bad input. ``python -m tests.bad_inputs`` prints it
(``python -m tests.bad_inputs > docs/BAD_INPUT.md`` rewrites it); the module keeps its old name,
from when the table was a section of the README."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from tests.bad_inputs.cases import CPU_CASES, CUDA_CASES, GPU_LAUNCH_CASES
from tests.bad_inputs.matrix import COLUMN_KEYS, COLUMNS, ROW_KEYS, ROWS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "BAD_INPUT.md"
COMMAND = "python -m tests.bad_inputs"
WRITE = f"{COMMAND} > docs/BAD_INPUT.md"  # regenerates the page, run from the repository root


def _outcome(exc: type[BaseException] | None) -> str:
    return "no-op" if exc is None else exc.__name__


def matrix_cells() -> dict[tuple[str, str], dict[str, Any]]:
    """(row, column) -> outcomes, whether any CPU test covers the cell, and its xfail ids."""
    cells: dict[tuple[str, str], dict[str, Any]] = {}

    def add(param: Any, exc: Any, cpu: bool, temp: bool = False) -> None:
        row = next(r for r in sorted(ROW_KEYS, key=len, reverse=True) if param.id.startswith(r + "-"))
        column = param.id[len(row) + 1:].split("-")[0]
        cell = cells.setdefault((row, column), dict(outcomes=set(), cpu=False, xfail=[], temp=False))
        cell["temp"] |= temp
        if any(mark.name == "xfail" for mark in param.marks):
            cell["xfail"].append(param.id)
        else:
            cell["outcomes"].add(_outcome(exc))
        cell["cpu"] |= cpu

    for param in CPU_CASES:
        add(param, param.values[2], True, param.values[4])
    for param in CUDA_CASES:
        add(param, param.values[1], not param.values[3])
    for param in GPU_LAUNCH_CASES:
        add(param, param.values[2], False)
    return cells


TITLE = "# Bad input"
GENERATED = (f"<!-- Generated from the cases in tests/bad_inputs/cases/ by `{WRITE}`:\n"
             "     edit the cases, then regenerate (tests/bad_inputs/test_readme.py checks this page). -->")

INTRO = """\
Every public entry point refuses bad input with a clear exception before it writes or launches
anything, and stays usable afterwards. `tests/bad_inputs/` holds a test for every
cell (test ids `<row>-<column>[-<detail>]`, e.g. `scatter_rows-null`): it compares device memory,
pinned and host outputs, files and object state before and after the refused call, then makes a
good call of the same entry point and checks its answer. On CPU the layers run on a host-memory
backend, and `CudaBackend`'s checks on an offline backend whose driver calls all fail, so every
refusal is shown to come before the driver; on the GPU the `CudaBackend` cases and one launcher per
kernel module run on the device, on buffers of random bytes compared bit for bit."""

LEGEND = """\
A cell names the exception (several: the cell's cases differ); "no-op": returns without writing or
launching; "–": does not apply (the kernels cannot see table sizes, so the launchers take ids on
trust and the layers that build them check them; the overlay kernels skip ids >= vocab by design;
`NgramDecoder`'s and `EngramDecoder`'s tokens, slots, counts and adapter indices live on the device:
their kernels flag bad ones in the error word that `check_errors` reads, and never read or write
outside their buffers);
"(GPU)": checked on a machine with a CUDA GPU only; †: uploads to temporaries, freed before it raises
(`from_numpy` checks each array as it uploads it, `build_overlay` its threshold after uploading
the adapter), nothing that existed before is written."""
GAPS = "✗: not refused yet, or not before writing, pinned by a strict xfail test:"

NOT_CHECKED = """\
Not checked: copies and memsets against the size of the allocation they write (a pointer may point
inside one); the `stream` and event handles given to `record_event`, `wait_event`,
`event_synchronize`, `synchronize` and every copy and launch, which go to the driver as they are."""


def matrix_table() -> tuple[list[str], list[str]]:
    """The table's lines, and the ids of the xfail cases, in table order."""
    cells = matrix_cells()
    lines = ["| entry point | " + " | ".join(header for _, header in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    gaps: list[str] = []
    for row, label in ROWS:
        texts = []
        for column in COLUMN_KEYS:
            cell = cells.get((row, column))
            if cell is None:
                texts.append("–")
                continue
            outcomes = sorted(cell["outcomes"], key=lambda o: (o == "no-op", o))
            text = ", ".join(f"`{o}`" if o != "no-op" else o for o in outcomes)
            if cell["temp"]:
                text += " †"
            if not cell["cpu"]:
                text += " (GPU)"
            if cell["xfail"]:
                text = (text + " " if text else "") + "✗"
                gaps += cell["xfail"]
            texts.append(text)
        lines.append(f"| {label} | " + " | ".join(texts) + " |")
    return lines, gaps


def matrix_markdown() -> str:
    """The whole page, generated from the case tables."""
    lines, gaps = matrix_table()
    reasons = {p.id: next(m.kwargs["reason"] for m in p.marks if m.name == "xfail")
               for p in CPU_CASES + CUDA_CASES if any(m.name == "xfail" for m in p.marks)}
    notes = [textwrap.fill(f"- `{gap}`: {reasons[gap]}.", 100, subsequent_indent="  ") for gap in gaps]
    run = ("Run it with `pytest tests/bad_inputs` (the GPU cases with the rest: `make gpu-check`);\n"
           f"`{COMMAND}` prints this page from the cases;\n`{WRITE}` rewrites it.")
    gaps_text = [GAPS + "\n" + "\n".join(notes)] if notes else []
    return "\n\n".join([TITLE, GENERATED, INTRO, "\n".join(lines), LEGEND, *gaps_text, NOT_CHECKED,
                        run]) + "\n"

