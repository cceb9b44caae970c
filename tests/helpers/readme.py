"""The README's code blocks, as the tests that run them read them."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(section: str, kind: str) -> str:
    """The text of the first ```kind block of the README's ``section`` (its heading line)."""
    text = README.read_text()
    assert section in text, f"README has no {section!r} section"
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    match = re.search(rf"^```{kind}\n(.*?)^```$", body, re.M | re.S)
    assert match, f"README's {section!r} has no ```{kind} block"
    return match.group(1)
