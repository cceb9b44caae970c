"""Hashed n-gram embeddings (Over-Encoding; LongCat-Flash's variant).

``NgramWeights`` holds one model's weights on one GPU (from numpy, a safetensors file or a Hugging
Face model folder; a tensor-parallel rank's ``shard``); three runners serve them side by side:
``NgramEmbedding`` (the seed's launch sequence), ``FusedNgramEmbedding`` (two launches, batches,
CUDA graphs) and ``NgramDecoder`` (token histories on the device, inside the caller's graph).
Tables live on the device, in host memory (``HostWeight``) or on disk behind a ``RowCache``
(table files from ``python -m layers.ngram_embed.convert``); those and the table files are
``layers.ngram_store``'s, named here too."""

from ..ngram_store.errors import CheckpointError
from ..ngram_store.host_weight import HostWeight
from ..ngram_store.row_cache import CacheStats, RowCache
from ..ngram_store.table_file import TableFile, TableFormatError, TableWriter, write_table, write_table_from_safetensors
from .checkpoint import NgramCheckpoint
from .decoder import NO_ADAPTER, PAD_SLOT, DecodeError, NgramDecoder
from .dims import NgramDims
from .embedding import NgramEmbedding
from .fused import FusedNgramEmbedding
from .ids import ngram_ids, ngram_ids_tail
from .placement import DeviceBudget
from .rank_group import embed_all
from .shard import NgramShard, reduce_bytes
from .tables import HostTable, NgramTable, RowSource, gather_entry
from .weights import NgramWeights

__all__ = [
    "CacheStats",
    "CheckpointError",
    "DecodeError",
    "DeviceBudget",
    "FusedNgramEmbedding",
    "HostTable",
    "HostWeight",
    "NO_ADAPTER",
    "NgramCheckpoint",
    "NgramDecoder",
    "NgramDims",
    "NgramEmbedding",
    "NgramShard",
    "NgramTable",
    "NgramWeights",
    "PAD_SLOT",
    "RowCache",
    "RowSource",
    "TableFile",
    "TableFormatError",
    "TableWriter",
    "embed_all",
    "gather_entry",
    "ngram_ids",
    "ngram_ids_tail",
    "reduce_bytes",
    "write_table",
    "write_table_from_safetensors",
]
