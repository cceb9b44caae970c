"""DeepSeek-V4.1's Engram memory: hashed n-gram rows from two huge fp8 tables, a projection and a
gate on the residual stream (``docs/ENGRAM.md``). A model package beside ``layers.ngram_embed``:
neither imports the other; what both need lives below them (``layers.ngram_store``, ``layers.ops``)."""

from ..ngram_store.placement import DeviceBudget
from .checkpoint import EngramCheckpoint
from .config import EngramConfig
from .decoder import PAD_SLOT, DecodeError, EngramDecoder
from .rank_group import lookup_all
from .token_map import TokenMap, build_token_map
from .weights import EngramWeights, Shard

__all__ = [
    "PAD_SLOT",
    "DecodeError",
    "DeviceBudget",
    "EngramCheckpoint",
    "EngramConfig",
    "EngramDecoder",
    "EngramWeights",
    "Shard",
    "TokenMap",
    "build_token_map",
    "lookup_all",
]
