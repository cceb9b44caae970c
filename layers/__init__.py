"""Model layers on the gpu_runtime: the hashed n-gram embedding (``layers.ngram_embed``), LoRA
token overlays (``layers.overlay``, ``layers.peft_adapter``), their launchers (``layers.ops``)
and numpy references (``layers.reference``).

Slow paths (tables placed in host memory, a ``RowCache`` missing most of a batch) are logged on
the ``layers`` logger's children; the package only adds a ``NullHandler``, so nothing is printed
unless the application configures logging.

Importing the package itself needs only the standard library (``__version__``, gpu_runtime's, is
read when asked), so that a tool run as ``python -m layers.<tool>`` can say in one line which
package is missing (``layers.requires``)."""

import logging

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    if name == "__version__":
        from gpu_runtime import __version__

        return __version__
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
