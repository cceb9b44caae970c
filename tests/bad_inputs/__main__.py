"""Print the README's "Bad input" section, generated from the cases in tests/bad_inputs/cases/.

The section is a table of every public entry point (rows) against each kind of bad input
(columns), each cell the exception raised, then how to run the tests;
tests/bad_inputs/test_readme.py checks that the README's table is the one generated.
"""

import argparse

from gpu_runtime import cli
from tests.bad_inputs.readme import matrix_markdown


def make_parser() -> argparse.ArgumentParser:
    return cli.ArgumentParser(
        prog="python -m tests.bad_inputs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Output: markdown on stdout, to paste over the README's section (no GPU needed).")


if __name__ == "__main__":
    make_parser().parse_args()
    print(matrix_markdown(), end="")
