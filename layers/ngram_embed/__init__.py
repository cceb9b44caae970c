"""Hashed n-gram embeddings (Over-Encoding; LongCat-Flash's variant): dims, ids, tables, layer,
and the disk-backed tables (``RowCache`` over a table file)."""

from .dims import NgramDims
from .embedding import NgramEmbedding
from .ids import ngram_ids, ngram_ids_tail
from .row_cache import CacheStats, RowCache
from .table_file import TableFile, TableFormatError, TableWriter, write_table, write_table_from_safetensors
from .tables import NgramTable, RowSource

__all__ = ["CacheStats", "NgramDims", "NgramEmbedding", "NgramTable", "RowCache", "RowSource",
           "TableFile", "TableFormatError", "TableWriter", "ngram_ids", "ngram_ids_tail",
           "write_table", "write_table_from_safetensors"]
