"""The references' refusal check: what a reference cannot compute raises the given exception with a
message that starts with the function's name and names the argument."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest


def assert_refused(call: Callable[[], Any], exc: type[Exception], name: str, arg: str) -> None:
    """``call()`` raises ``exc``, its message starting ``"<name>: "`` and naming ``arg`` as a word."""
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{name}: "), message
    assert re.search(rf"(?<![\w.]){re.escape(arg)}(?![\w\[])", message), message
