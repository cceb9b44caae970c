"""Print the "Bad input" page, docs/BAD_INPUT.md, generated from the cases in tests/bad_inputs/cases/.

The page is a table of every public entry point (rows) against each kind of bad input
(columns), each cell the exception raised, then how to run the tests;
tests/bad_inputs/test_readme.py checks that docs/BAD_INPUT.md is the page generated.
"""

import argparse

from gpu_runtime import cli
from tests.bad_inputs.readme import matrix_markdown


def make_parser() -> argparse.ArgumentParser:
    return cli.ArgumentParser(
        prog="python -m tests.bad_inputs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Output: markdown on stdout (no GPU needed); from the repository root, "
               "`python -m tests.bad_inputs > docs/BAD_INPUT.md` rewrites the page.")


if __name__ == "__main__":
    make_parser().parse_args()
    print(matrix_markdown(), end="")
