"""Hashed n-gram embeddings (Over-Encoding; LongCat-Flash's variant): dims, ids, tables, layer."""

from .dims import NgramDims
from .embedding import NgramEmbedding
from .ids import ngram_ids, ngram_ids_tail
from .tables import NgramTable, RowSource

__all__ = ["NgramDims", "NgramEmbedding", "NgramTable", "RowSource", "ngram_ids", "ngram_ids_tail"]
