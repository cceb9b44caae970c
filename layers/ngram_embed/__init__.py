"""Hashed n-gram embeddings (Over-Encoding; LongCat-Flash's variant): dims, ids, tables, layer,
the fused path (``FusedNgramEmbedding``) and the device-resident decoder (``NgramDecoder``),
the disk-backed tables (``RowCache`` over a table file), the host-memory tables
(``HostWeight`` in ``NgramTable.Host``, read in place by the GPU) and Hugging Face model folders
(``NgramEmbedding.from_pretrained``, ``checkpoint``; table files from ``python -m
layers.ngram_embed.convert``)."""

from .checkpoint import CheckpointError, NgramCheckpoint
from .decoder import NO_ADAPTER, PAD_SLOT, DecodeError, NgramDecoder
from .fused import FusedNgramEmbedding
from .pretrained import DeviceBudget
from .dims import NgramDims
from .embedding import NgramEmbedding
from .host_table import HostWeight
from .ids import ngram_ids, ngram_ids_tail
from .row_cache import CacheStats, RowCache
from .table_file import TableFile, TableFormatError, TableWriter, write_table, write_table_from_safetensors
from .tables import HostTable, NgramTable, RowSource, gather_entry

__all__ = ["CacheStats", "CheckpointError", "DecodeError", "DeviceBudget", "FusedNgramEmbedding", "HostTable",
           "HostWeight", "NO_ADAPTER", "NgramCheckpoint", "NgramDecoder", "NgramDims", "NgramEmbedding",
           "NgramTable", "PAD_SLOT", "RowCache", "RowSource",
           "TableFile", "TableFormatError", "TableWriter", "gather_entry", "ngram_ids",
           "ngram_ids_tail", "write_table", "write_table_from_safetensors"]
