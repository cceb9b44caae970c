"""On-disk n-gram tables: bit-exact round trips, streaming writes, every refusal, mapping not reading."""

from __future__ import annotations

import mmap
import os
import struct
import tracemalloc
import zlib

import numpy as np
import pytest

from gpu_runtime import ClosedError
from layers import safetensors_io
from layers.ngram_store import table_check
from layers.ngram_store.table_file import (TableFile, TableFormatError, TableHeader, TableWriter,
                                           write_table, write_table_from_safetensors)
from layers.dense_weight import BF16, FP8
from tests.helpers import bits, random_bf16, random_fp8


def _table(rng, dtype, rows, dim):
    if dtype == BF16:
        return random_bf16(rng, (rows, dim)), None
    return random_fp8(rng, (rows, dim)), (rng.random(rows) * 4 + 0.01).astype(np.float32)


def _uneven_chunks(rng, rows):
    """Cut points 0 < ... < rows at random, some chunks possibly a single row."""
    k = int(rng.integers(1, min(rows, 6) + 1))
    cuts = np.sort(rng.choice(np.arange(1, rows), size=k - 1, replace=False)) if rows > 1 else []
    return [0, *map(int, cuts), rows]


def _check_file(path, table, scales, rng):
    rows, dim = table.shape
    with TableFile(path) as f:
        assert (f.rows, f.dim, f.dtype, f.row_bytes) == (rows, dim, table.dtype, dim * table.itemsize)
        assert os.path.getsize(path) == f.header.file_size
        assert not f.rows_bytes.flags.writeable
        np.testing.assert_array_equal(f.rows_bytes, table.view(np.uint8).reshape(rows, -1))
        ids = rng.integers(0, rows, size=int(rng.integers(1, 2 * rows + 2)), dtype=np.int64)
        out = np.full((len(ids), f.row_bytes), 0xA5, np.uint8)
        got_scales = np.full(len(ids), np.nan, np.float32) if scales is not None else None
        f.read_rows(ids, out, got_scales)
        np.testing.assert_array_equal(bits(out.view(table.dtype)), bits(table[ids]))
        if scales is None:
            assert f.scales is None and f.header.scales_offset == 0
        else:
            assert f.header.scales_offset % 4096 == 0
            np.testing.assert_array_equal(bits(got_scales), bits(scales[ids]))
            np.testing.assert_array_equal(bits(f.scales), bits(scales))


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rows", [1, 5, 1000])
@pytest.mark.parametrize("dim", [1, 7, 33])
def test_round_trip(tmp_path, rng, dtype, rows, dim):
    table, scales = _table(rng, dtype, rows, dim)
    path = tmp_path / "a.ngt"
    header = write_table(path, table, scales, chunk_rows=int(rng.integers(1, rows + 3)))
    assert header == TableHeader(dtype, rows, dim)
    _check_file(path, table, scales, rng)

    streamed = tmp_path / "b.ngt"
    cuts = _uneven_chunks(rng, rows)
    with TableWriter(streamed, dtype, rows, dim) as w:
        for a, b in zip(cuts, cuts[1:]):
            w.append(table[a:b], None if scales is None else scales[a:b])
        assert not streamed.exists()  # only the .tmp until close
    assert not (tmp_path / "b.ngt.tmp").exists()
    assert streamed.read_bytes() == path.read_bytes()


def test_from_memmap_and_safetensors(tmp_path, rng):
    table, scales = _table(rng, FP8, 300, 9)
    st = tmp_path / "w.safetensors"
    safetensors_io.save(st, {"t.weight": table, "t.scale": scales, "b": random_bf16(rng, (4, 3))})
    header = write_table_from_safetensors(tmp_path / "t.ngt", st, "t.weight", "t.scale",
                                          chunk_rows=64)
    assert header == TableHeader(FP8, 300, 9)
    _check_file(tmp_path / "t.ngt", table, scales, rng)
    write_table_from_safetensors(tmp_path / "b.ngt", st, "b", chunk_rows=3)
    _check_file(tmp_path / "b.ngt", safetensors_io.load(st)["b"], None, rng)
    with pytest.raises(KeyError, match="nope"):
        write_table_from_safetensors(tmp_path / "x.ngt", st, "nope")
    with pytest.raises(KeyError, match="t.scales"):
        write_table_from_safetensors(tmp_path / "x.ngt", st, "t.weight", "t.scales")
    with pytest.raises(ValueError, match="scales"):  # fp8 without its scale tensor
        write_table_from_safetensors(tmp_path / "x.ngt", st, "t.weight")
    assert not (tmp_path / "x.ngt").exists() and not (tmp_path / "x.ngt.tmp").exists()


def test_header_pack_unpack(rng):
    for dtype in (BF16, FP8):
        h = TableHeader(dtype, int(rng.integers(1, 1 << 40)), int(rng.integers(1, 1 << 14)))
        block = h.pack()
        assert len(block) == 4096 and block[:8] == b"NGRAMTBL" and not any(block[52:])
        assert TableHeader.unpack(block) == h
        rows_bytes = h.rows * h.dim * dtype.itemsize
        assert h.rows_offset == 4096
        expect_size = 4096 + rows_bytes if dtype == BF16 else \
            4096 + -(-rows_bytes // 4096) * 4096 + 4 * h.rows
        assert h.file_size == expect_size
    with pytest.raises(TypeError):
        TableHeader(np.dtype(np.float32), 1, 1)
    with pytest.raises(ValueError):
        TableHeader(BF16, 0, 1)


def _written(tmp_path, rng, dtype=BF16):
    table, scales = _table(rng, dtype, int(rng.integers(2, 50)), int(rng.integers(1, 20)))
    path = tmp_path / "t.ngt"
    write_table(path, table, scales)
    return path


def _patch(path, offset, data, fix_crc=False, xor=False):
    """Write ``data`` at ``offset`` (``xor``: XOR it into the bytes there, so that a nonzero mask
    changes them whatever they were); ``fix_crc`` recomputes the header's CRC afterwards."""
    raw = bytearray(path.read_bytes())
    if xor:
        data = bytes(a ^ b for a, b in zip(raw[offset:offset + len(data)], data))
    raw[offset:offset + len(data)] = data
    if fix_crc:
        raw[48:52] = struct.pack("<I", zlib.crc32(bytes(raw[:48])))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("offset, data, xor, fix_crc, match", [
    (0, b"NGRAMTBX", False, True, "magic"),
    (8, struct.pack("<I", 2), False, True, "version 2"),
    (12, struct.pack("<I", 3), False, True, "dtype code 3"),
    (16, b"\x07", True, False, "crc"),  # a flipped rows byte
    (49, b"\x5a", True, False, "crc"),  # a flipped crc byte
    (32, struct.pack("<Q", 8192), False, True, "offsets"),
])
def test_corrupt_header_refused(tmp_path, rng, offset, data, xor, fix_crc, match):
    path = _written(tmp_path, rng)
    good = path.read_bytes()
    _patch(path, offset, data, fix_crc, xor)
    assert path.read_bytes() != good  # the corruption changed the header
    with pytest.raises(TableFormatError, match=match) as err:
        TableFile(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_wrong_size_refused(tmp_path, rng, dtype):
    path = _written(tmp_path, rng, dtype)
    good = path.read_bytes()
    path.write_bytes(good[:-1])
    with pytest.raises(TableFormatError, match=f"is {len(good) - 1} bytes, header says {len(good)}"):
        TableFile(path)
    path.write_bytes(good + b"\x00")
    with pytest.raises(TableFormatError, match="header says"):
        TableFile(path)
    path.write_bytes(good[:100])
    with pytest.raises(TableFormatError, match="shorter than"):
        TableFile(path)


def test_writer_refusals(tmp_path, rng):
    path = tmp_path / "w.ngt"
    table, scales = _table(rng, FP8, 10, 4)
    with pytest.raises(TypeError):
        TableWriter(path, np.float32, 10, 4)
    for rows, dim, error in [(0, 4, ValueError), (10, 0, ValueError), (10.0, 4, TypeError),
                             (True, 4, TypeError)]:
        with pytest.raises(error, match="rows must be an int|dim must be an int"):
            TableWriter(path, FP8, rows, dim)
    with TableWriter(path, FP8, 10, 4) as w:
        with pytest.raises(ValueError, match="scales"):
            w.append(table[:3])
        with pytest.raises(ValueError, match=r"scales must be \(3,\)"):
            w.append(table[:3], scales[:2])
        with pytest.raises(TypeError, match="scales must be float32, got float64"):
            w.append(table[:3], scales[:3].astype(np.float64))
        with pytest.raises(TypeError):
            w.append(table[:3].astype(np.float32), scales[:3])
        with pytest.raises(ValueError, match=r"\[n, 4\]"):
            w.append(table[:3, :3], scales[:3])
        w.append(table[:6], scales[:6])
        with pytest.raises(ValueError, match="overruns"):
            w.append(table[:5], scales[:5])
        w.append(table[6:], scales[6:])
    _check_file(path, table, scales, rng)
    bf, _ = _table(rng, BF16, 3, 4)
    with TableWriter(tmp_path / "b.ngt", BF16, 3, 4) as w:
        with pytest.raises(ValueError, match="only for fp8"):
            w.append(bf, scales[:3])
        w.append(bf)


def test_short_or_failed_write_leaves_nothing(tmp_path, rng):
    path = tmp_path / "s.ngt"
    table, _ = _table(rng, BF16, 8, 3)
    w = TableWriter(path, BF16, 8, 3)
    w.append(table[:7])
    assert (tmp_path / "s.ngt.tmp").exists()
    with pytest.raises(ValueError, match="only 7 of 8"):
        w.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError):
        with TableWriter(path, BF16, 8, 3) as w:
            w.append(table)
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_a_failed_final_close_removes_the_partial_file(tmp_path, rng, monkeypatch):
    """close(2) frees the descriptor even when it reports EIO: the writer must not close it
    again (EBADF, hiding the EIO) and must remove its .tmp."""
    import errno

    from layers.ngram_store import table_file

    table, _ = _table(rng, BF16, 4, 8)
    w = TableWriter(tmp_path / "t.ngt", BF16, 4, 8)
    w.append(table)
    real_close = os.close

    def close_eio(fd: int) -> None:
        real_close(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(table_file.os, "close", close_eio)
    with pytest.raises(OSError) as err:
        w.close()
    monkeypatch.undo()
    assert err.value.errno == errno.EIO
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("code, raised", [("EIO", True), ("EINVAL", False)])
def test_a_directory_fsync_failure_is_raised_unless_unsupported(tmp_path, rng, monkeypatch, code, raised):
    import errno
    import stat

    from layers.ngram_store import table_file

    table, _ = _table(rng, BF16, 4, 8)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(getattr(errno, code), code)
        real_fsync(fd)

    monkeypatch.setattr(table_file.os, "fsync", fsync)
    w = TableWriter(tmp_path / "t.ngt", BF16, 4, 8)
    w.append(table)
    if raised:
        with pytest.raises(OSError, match="EIO"):
            w.close()
    else:
        w.close()


def test_read_checks_and_close(tmp_path, rng):
    path = _written(tmp_path, rng, FP8)
    f = TableFile(path)
    n = 3
    out, sc = np.empty((n, f.row_bytes), np.uint8), np.empty(n, np.float32)
    ids = rng.integers(0, f.rows, n)
    with pytest.raises(ValueError, match="scales_out"):
        f.read_rows(ids, out)
    with pytest.raises(ValueError, match=r"^out has 2 rows, expected 3 \(one per id\)$"):
        f.read_rows(ids, out[:-1], sc)
    with pytest.raises(ValueError, match=r"^scales_out has 4 rows, expected 3 \(one per id\)$"):
        f.read_rows(ids, out, np.empty(n + 1, np.float32))
    with pytest.raises(ValueError, match=rf"^out must be of shape \(3, {f.row_bytes}\), got \(3, {f.row_bytes - 1}\)$"):
        f.read_rows(ids, out[:, 1:].copy(), sc)
    with pytest.raises(ValueError, match="^out must be C-contiguous$"):
        f.read_rows(ids, np.empty((n, 2 * f.row_bytes), np.uint8)[:, ::2], sc)
    with pytest.raises(TypeError, match="out must be a uint8 array, got int8"):
        f.read_rows(ids, out.view(np.int8), sc)
    with pytest.raises(TypeError, match="ids must be integers, got dtype float64"):
        f.read_rows(ids.astype(np.float64), out, sc)
    with pytest.raises(ValueError, match="ids must be 1-D"):
        f.read_rows(ids.reshape(1, n), out, sc)
    with pytest.raises(IndexError):
        f.read_rows(np.array([0, f.rows, 1]), out, sc)
    f.read_rows(ids, out, sc)
    f.advise_dontneed()
    f.close()
    f.close()
    assert f.closed
    with pytest.raises(ClosedError, match="table file is closed"):
        f.read_rows(ids, out, sc)


def test_a_folder_is_refused_by_its_path(tmp_path, monkeypatch):
    folder = tmp_path / "tables"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    fds = len(os.listdir("/proc/self/fd"))
    for path in ("tables", folder):
        with pytest.raises(IsADirectoryError, match=f"a folder, not a table file: '{folder if path == folder else path}'"):
            TableFile(path)
    assert len(os.listdir("/proc/self/fd")) == fds  # its descriptor closed


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_a_crc_over_several_chunks_is_the_crc_of_the_whole(tmp_path, rng, monkeypatch, dtype):
    """``crc_file`` over three chunks (the last one short) equals one crc32 of all the rows."""
    rows, dim = int(rng.integers(20, 40)), int(rng.integers(3, 9))
    table, scales = _table(rng, dtype, rows, dim)
    write_table(tmp_path / "t.ngt", table, scales)
    monkeypatch.setattr(table_check, "_CRC_CHUNK", table.nbytes // 3 + 1)
    with TableFile(tmp_path / "t.ngt") as f:
        crc, scales_crc = table_check.crc_file(f)
    assert crc == zlib.crc32(table.tobytes())
    assert scales_crc == (None if scales is None else zlib.crc32(scales.tobytes()))


def test_large_table_is_mapped_not_read(tmp_path, rng):
    """A 2 GiB (sparse) table opens without allocating; rows come from the mapping on demand."""
    header = TableHeader(BF16, 1 << 20, 1024)
    path = tmp_path / "big.ngt"
    row_id = int(rng.integers(0, header.rows))
    row = random_bf16(rng, (1, header.dim))
    with open(path, "wb") as fh:
        fh.write(header.pack())
        fh.truncate(header.file_size)
        fh.seek(header.rows_offset + row_id * header.row_bytes)
        fh.write(row.tobytes())
    tracemalloc.start()
    try:
        with TableFile(path) as f:
            peak = tracemalloc.get_traced_memory()[1]
            base = f.rows_bytes
            while isinstance(base, np.ndarray):
                base = base.base
            assert isinstance(getattr(base, "obj", base), mmap.mmap)  # via a memoryview
            out = np.empty((2, f.row_bytes), np.uint8)
            f.read_rows(np.array([row_id, (row_id + 1) % f.rows]), out)
            assert bits(out[:1].view(BF16)).tolist() == bits(row).tolist()
            with pytest.raises(ValueError, match="no scales"):
                f.read_rows(np.array([row_id]), out[:1], np.empty(1, np.float32))
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"opening allocated {peak} bytes"
