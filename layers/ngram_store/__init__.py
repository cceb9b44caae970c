"""The n-gram tables' storage tier, below the runners of ``layers.ngram_embed``.

Table files (``table_format``, ``table_file``: one table's rows, and its fp8 scales, in a file a
reader maps), how a source's rows are stored in them (``row_encoding``), the converter's manifest
(``table_manifest``) and the check of a file against it (``table_check``); tables served from the
host (``HostWeight``: pinned host memory the gathers read in place) or from disk (``RowCache``: a
device arena of rows loaded batch by batch by its ``row_loader``; ``slot_index`` maps a row to
its arena slot; ``CacheGroup`` resolves a layer's caches in one step). It knows nothing of the
model: the manifest checks files against any ``TableLayout`` (``NgramDims`` is one)."""

from .cache_group import CacheGroup, cache_group
from .errors import CheckpointError
from .host_weight import HostWeight
from .row_cache import CacheStats, RowCache
from .table_check import VerifyError, check_table_file
from .table_file import TableFile, TableWriter, write_table, write_table_from_safetensors
from .table_format import TableFormatError
from .table_manifest import MANIFEST, TableFiles, TableLayout, open_table_files

__all__ = [
    "MANIFEST",
    "CacheGroup",
    "CacheStats",
    "CheckpointError",
    "HostWeight",
    "RowCache",
    "TableFile",
    "TableFiles",
    "TableFormatError",
    "TableLayout",
    "TableWriter",
    "VerifyError",
    "cache_group",
    "check_table_file",
    "open_table_files",
    "write_table",
    "write_table_from_safetensors",
]
