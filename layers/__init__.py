"""Model layers on the gpu_runtime: the hashed n-gram embedding (``layers.ngram_embed``), LoRA
token overlays (``layers.overlay``, ``layers.peft_adapter``), their launchers (``layers.ops``)
and numpy references (``layers.reference``)."""

from gpu_runtime import __version__

__all__ = ["__version__"]
