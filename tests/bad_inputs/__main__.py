"""``python -m tests.bad_inputs``: print the README's "Bad input" section, generated from the cases."""

from tests.bad_inputs.readme import matrix_markdown

print(matrix_markdown(), end="")
