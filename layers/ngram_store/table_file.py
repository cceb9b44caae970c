"""On-disk n-gram tables too big for the device: ``TableFile`` memory-maps one read-only and
gathers rows by id (nothing reads a whole table into RAM); ``TableWriter`` / ``write_table``
stream one to disk in chunks, atomically (``.tmp``, header last, fsync, rename). A file whose
header or size is not what this package writes raises ``TableFormatError``. The format is
``table_format``'s; the layout and the design: docs/table_files.md.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
from types import TracebackType

import numpy as np

from gpu_runtime import ClosedError, validate

from ..atomic_write import fsync_dir
from ..dense_weight import FP8
from ..safetensors_io import load as load_safetensors
from .table_format import HEADER_BYTES, PAGE, SCALE_DTYPE, TableFormatError, TableHeader, _table_dtype


def _check_out(what: str, out: np.ndarray, dtype: type, shape: tuple[int, ...]) -> None:
    """An output array of ``read_rows``: ``TypeError`` for another dtype, ``ValueError`` for
    another shape or a layout that is not C-contiguous."""
    if not isinstance(out, np.ndarray) or out.dtype != dtype:
        raise TypeError(
            f"{what} must be a {np.dtype(dtype).name} array, got {getattr(out, 'dtype', type(out).__name__)}"
        )
    if out.shape[1:] != shape[1:] or out.ndim != len(shape):
        raise ValueError(f"{what} must be of shape {shape}, got {out.shape}")
    if out.shape[0] != shape[0]:
        raise ValueError(f"{what} has {out.shape[0]} rows, expected {shape[0]} (one per id)")
    if not out.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")


class TableFile:
    """Read-only memory map of a table file; nothing is read until rows are asked for."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        self._mmap: mmap.mmap | None = None
        try:
            st = os.fstat(self._fd)
            if stat.S_ISDIR(st.st_mode):  # open(2) takes a folder read-only; its reads would name no path
                raise IsADirectoryError(errno.EISDIR, "a folder, not a table file", self.path)
            size = st.st_size
            if size < HEADER_BYTES:
                raise TableFormatError(
                    f"{self.path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte header"
                )
            self.header = TableHeader.unpack(os.pread(self._fd, HEADER_BYTES, 0), self.path)
            if size != self.header.file_size:
                raise TableFormatError(f"{self.path}: file is {size} bytes, header says {self.header.file_size}")
            self._mmap = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
            if hasattr(self._mmap, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                self._mmap.madvise(mmap.MADV_RANDOM)  # gathers are random: no readahead
        except BaseException:
            self.close()
            raise
        h = self.header
        self.rows, self.dim, self.dtype, self.row_bytes = h.rows, h.dim, h.dtype, h.row_bytes
        self._rows_bytes: np.ndarray | None = np.frombuffer(
            self._mmap,
            np.uint8,
            count=h.rows * h.row_bytes,
            offset=h.rows_offset,
        ).reshape(h.rows, h.row_bytes)
        self._scales: np.ndarray | None = None
        if h.dtype == FP8:
            self._scales = np.frombuffer(self._mmap, SCALE_DTYPE, count=h.rows, offset=h.scales_offset)

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: reads then raise ``ClosedError``."""
        return self._fd < 0

    def _check_open(self) -> None:
        validate.require_open(self.closed, f"{self.path}: table file")

    @property
    def rows_bytes(self) -> np.ndarray:
        """uint8 ``[rows, row_bytes]`` read-only view of the mapped rows."""
        self._check_open()
        assert self._rows_bytes is not None
        return self._rows_bytes

    @property
    def scales(self) -> np.ndarray | None:
        """float32 ``[rows]`` read-only view of the per-row scales; None for bf16."""
        self._check_open()
        return self._scales

    def read_rows(self, ids: np.ndarray, out: np.ndarray, scales_out: np.ndarray | None = None) -> None:
        """Gather rows ``ids`` into ``out`` (uint8 ``[len(ids), row_bytes]``), scales likewise
        (``scales_out`` float32 ``[len(ids)]``, fp8 tables only); ids out of range are an
        ``IndexError`` before anything is written."""
        self._check_open()
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"ids must be integers, got dtype {ids.dtype}")
        if ids.ndim != 1:
            raise ValueError(f"ids must be 1-D, got shape {ids.shape}")
        n = ids.shape[0]
        _check_out("out", out, np.uint8, (n, self.row_bytes))
        if self._scales is None and scales_out is not None:
            raise ValueError(f"{self.path}: a bf16 table has no scales; pass scales_out=None")
        if self._scales is not None:
            if scales_out is None:
                raise ValueError(f"{self.path}: an fp8 table's rows need their scales: pass scales_out")
            _check_out("scales_out", scales_out, np.float32, (n,))
        if n == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.rows:
            raise IndexError(f"{self.path}: row ids span [{lo}, {hi}], table has {self.rows} rows")
        if ids.dtype != np.intp:
            ids = ids.astype(np.intp)
        rows, scales = self._rows_bytes, self._scales
        assert rows is not None  # open (checked above): mapped
        np.take(rows, ids, axis=0, out=out, mode="clip")  # bounds checked above
        if scales_out is not None:
            assert scales is not None  # scales_out is refused above for a bf16 table
            np.take(scales, ids, out=scales_out, mode="clip")

    def advise_willneed(self, ids: np.ndarray) -> None:
        """Ask the kernel to start reading rows ``ids`` (and their scales) into the page cache,
        without waiting: one ``posix_fadvise(WILLNEED)`` per run of adjacent pages, so a later
        ``read_rows`` finds them cached, and many reads are in flight at once on a cold disk."""
        self._check_open()
        if not hasattr(os, "posix_fadvise") or len(ids) == 0:
            return
        ids = np.asarray(ids, np.int64)
        h = self.header
        regions = [(h.rows_offset, self.row_bytes)]
        if self._scales is not None:
            regions.append((h.scales_offset, SCALE_DTYPE.itemsize))
        for base, size in regions:
            first = (base + ids * size) // PAGE
            last = (base + ids * size + size - 1) // PAGE
            pages = first[:, None] + np.arange(-(-size // PAGE) + 1)  # every page a row touches
            pages = np.unique(pages[pages <= last[:, None]])
            breaks = np.flatnonzero(np.diff(pages) != 1) + 1
            for run in np.split(pages, breaks):
                os.posix_fadvise(self._fd, int(run[0]) * PAGE, len(run) * PAGE, os.POSIX_FADV_WILLNEED)

    def advise_dontneed(self) -> None:
        """Drop the file from the page cache so the next reads are cold (for benchmarks).

        Pages mapped into this process are not evicted, so they are unmapped first."""
        self._check_open()
        if self._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Release the map and file. Views still held elsewhere keep the mapping alive."""
        self._rows_bytes = self._scales = None
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a view; the mapping goes when that view does
                self._mmap.close()
            self._mmap = None
        if self._fd >= 0:
            fd, self._fd = self._fd, -1  # close(2) frees the descriptor even when it reports an error
            os.close(fd)

    def __enter__(self) -> TableFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.dtype.name} [{self.rows}, {self.dim}]"
        return f"TableFile({self.path!r}, {state})"


class TableWriter:
    """Streams a table to disk: rows appended in order; written to ``path + '.tmp'`` and renamed
    on close, so a crash never leaves a valid-looking partial file.

    The header goes in last, just before the fsync and rename: a leftover ``.tmp`` has no magic.
    """

    def __init__(self, path: str | os.PathLike, dtype: object, rows: int, dim: int) -> None:
        self.header = TableHeader(_table_dtype(dtype), rows, dim)
        self.path = os.fspath(path)
        self.tmp_path = self.path + ".tmp"
        self.written = 0
        self._committed = False
        self._fd = os.open(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self._fd, self.header.file_size)  # every offset is known up front
        except BaseException:
            self.abort()
            raise

    @property
    def closed(self) -> bool:
        """True once the writer committed (``close``) or gave up (``abort``): writes then raise ``ClosedError``."""
        return self._fd < 0

    def _pwrite(self, array: np.ndarray, offset: int) -> None:
        view = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data  # a memoryview, no copy
        while view:
            done = os.pwrite(self._fd, view, offset)
            view, offset = view[done:], offset + done

    def append(self, rows: np.ndarray, scales: np.ndarray | None = None) -> None:
        """Write the next ``[n, dim]`` rows (and, for fp8, their ``[n]`` float32 scales)."""
        validate.require_open(self.closed, f"{self.path}: writer")
        h = self.header
        rows = np.asarray(rows)
        if rows.dtype != h.dtype:
            raise TypeError(f"{self.path}: rows are {rows.dtype}, the table is {h.dtype.name}")
        if rows.ndim != 2 or rows.shape[1] != h.dim:
            raise ValueError(f"{self.path}: rows must be [n, {h.dim}], got {rows.shape}")
        n = rows.shape[0]
        if self.written + n > h.rows:
            raise ValueError(f"{self.path}: appending {n} rows after {self.written} overruns the declared {h.rows}")
        if h.dtype == FP8:
            if scales is None:
                raise ValueError(f"{self.path}: fp8 rows need their float32 scales")
            scales = np.asarray(scales)
            if scales.dtype != np.float32:
                raise TypeError(f"{self.path}: scales must be float32, got {scales.dtype}")
            if scales.shape != (n,):
                raise ValueError(f"{self.path}: scales must be ({n},), got {scales.shape}")
        elif scales is not None:
            raise ValueError(f"{self.path}: scales are only for fp8 tables")
        if n == 0:
            return
        self._pwrite(rows, h.rows_offset + self.written * h.row_bytes)
        if scales is not None:
            self._pwrite(scales.astype(SCALE_DTYPE, copy=False), h.scales_offset + self.written * SCALE_DTYPE.itemsize)
        self.written += n

    def close(self) -> TableHeader:
        """Write the header, fsync and rename into place; returns the header. Raises ``ValueError``
        (writing nothing) when fewer rows than declared were appended, ``ClosedError`` after ``abort``."""
        if self._committed:
            return self.header
        if self.closed:
            raise ClosedError(f"{self.path}: writer was aborted")
        if self.written != self.header.rows:
            self.abort()
            raise ValueError(
                f"{self.path}: only {self.written} of {self.header.rows} rows were appended; nothing written"
            )
        try:
            self._pwrite(np.frombuffer(self.header.pack(), np.uint8), 0)
            os.fsync(self._fd)
            fd, self._fd = self._fd, -1  # close(2) frees the descriptor even when it reports an error
            os.close(fd)
            os.replace(self.tmp_path, self.path)
        except BaseException:
            self.abort()
            raise
        self._committed = True
        fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        return self.header

    def abort(self) -> None:
        """Discard the partial file. Safe to call more than once."""
        fd, self._fd = self._fd, -1
        try:
            if fd >= 0:
                os.close(fd)
        finally:
            if not self._committed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.tmp_path)

    def __enter__(self) -> TableWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_table(
    path: str | os.PathLike, table: np.ndarray, scales: np.ndarray | None = None, chunk_rows: int = 1 << 16
) -> TableHeader:
    """Write a ``[rows, dim]`` array (an ``np.memmap`` works: it is read chunk by chunk)."""
    chunk_rows = validate.positive(chunk_rows, "chunk_rows")
    table = np.asarray(table)  # a view, never a copy, of a memmap
    scales = None if scales is None else np.asarray(scales)
    if table.ndim != 2:
        raise ValueError(f"table must be 2-D [rows, dim], got shape {table.shape}")
    if scales is not None and scales.shape != (table.shape[0],):
        raise ValueError(f"scales shape {scales.shape} != ({table.shape[0]},)")
    rows = table.shape[0]
    with TableWriter(path, table.dtype, rows, table.shape[1]) as writer:
        for start in range(0, rows, chunk_rows):
            stop = min(start + chunk_rows, rows)
            writer.append(table[start:stop], None if scales is None else scales[start:stop])
    return writer.header


def write_table_from_safetensors(
    path: str | os.PathLike,
    st_path: str | os.PathLike,
    name: str,
    scale_name: str | None = None,
    chunk_rows: int = 1 << 16,
) -> TableHeader:
    """Convert one tensor (and its per-row scales) of a safetensors file, memory-mapped."""
    tensors = load_safetensors(st_path)
    for wanted in (name, scale_name):
        if wanted is not None and wanted not in tensors:
            raise KeyError(f"{os.fspath(st_path)}: no tensor {wanted!r} (has {', '.join(sorted(tensors)) or 'none'})")
    scales = tensors[scale_name] if scale_name is not None else None
    return write_table(path, tensors[name], scales, chunk_rows)
