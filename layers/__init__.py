"""Model layers on the gpu_runtime: the hashed n-gram embedding (``layers.ngram_embed``), LoRA
token overlays (``layers.overlay``, ``layers.peft_adapter``), their launchers (``layers.ops``)
and numpy references (``layers.reference``).

Slow paths (tables placed in host memory, a ``RowCache`` missing most of a batch) are logged on
the ``layers`` logger's children; the package only adds a ``NullHandler``, so nothing is printed
unless the application configures logging."""

import logging

from gpu_runtime import __version__

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["__version__"]
