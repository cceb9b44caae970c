"""The command-line tools' argument parser: ``argparse``'s, with a usage error in one line.

``ArgumentParser(...).error(message)`` prints ``<prog>: error: <message>`` (no usage block
before it: ``--help`` has that) to stderr and exits with status 2, as argparse does.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line (status 2)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)
