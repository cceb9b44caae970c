"""Guards against small bugs the rest of the CPU suite let through (a mutation check found them):
DLPack's ``byte_offset``, the converter's read-back check, the fsync before a rename into place,
``int`` (not ``round``) of ``ratio * V``, a resumed conversion's manifest keeping the tables not
yet reached, and the LM-head overlay's 65535 overrides at its exact limit."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from gpu_runtime import DeviceArray, dlpack
from gpu_runtime.interop import device_address
from layers.atomic_write import write_atomically
from layers.dense_weight import BF16, FP8
from layers.ngram_embed import NgramCheckpoint, NgramDecoder, NgramDims, TableFile
from layers.ngram_embed.convert import convert, verify_tables
from layers.ngram_store import TableWriter, VerifyError
from layers.ngram_store.table_file import write_table
from layers.ngram_store.table_manifest import MANIFEST
from layers.ops.token_overlay import MAX_LMHEAD_OVERRIDES, OverlayKernels, lmhead_overlay_routed
from layers.overlay import AdapterOverlay, OverlaySlots, TableOverlay
from tests.helpers import random_bf16, random_fp8
from tests.helpers.checkpoint import make_model, tiny_config, write_model
from tests.helpers.dlpack_capsule import capsule
from tests.helpers.fakes import ForeignArray, RecordingBackend
from tests.helpers.ngram import device_weights, random_layer, small_dims
from tests.helpers.overlay import overlay_backend

# ==== DLPack: byte_offset ============================================================================

class _SlicedView:
    """Only DLPack: a view ``byte_offset`` bytes into an allocation at ``ptr``."""

    def __init__(self, ptr, byte_offset, shape, dtype, versioned):
        self.args = (ptr, byte_offset, shape, dtype, versioned)

    def __dlpack__(self, **kwargs):
        ptr, byte_offset, shape, dtype, versioned = self.args
        return capsule(ptr, shape, dtype, versioned=versioned, byte_offset=byte_offset)

    def __dlpack_device__(self):
        return dlpack.KDL_CUDA, 0


@pytest.mark.parametrize("versioned", [False, True], ids=["dltensor", "dltensor_versioned"])
def test_dlpack_byte_offset_is_part_of_the_address(rng, versioned):
    """A producer's sliced view (``byte_offset`` past ``data``) is read at ``data + byte_offset``,
    by ``dlpack.read``, by ``device_address`` and in a decoder's launch, not at ``data``."""
    base = 0x7F00_0000_0000 + int(rng.integers(1, 1 << 20)) * 4096
    offset = int(rng.integers(1, 64)) * 256
    shape = (int(rng.integers(1, 9)), int(rng.integers(1, 33)))
    t = dlpack.read(capsule(base, shape, BF16, versioned=versioned, byte_offset=offset))
    assert (t.ptr, t.shape, t.dtype) == (base + offset, shape, BF16)
    view = _SlicedView(base, offset, shape, BF16, versioned)
    assert device_address(view, "x", dtypes=(BF16,), count=shape[0] * shape[1]) == base + offset

    gpu = RecordingBackend()
    dec = NgramDecoder(device_weights(gpu, random_layer(rng, small_dims(max_ngram=3, splits=2, eos_id=7), "bf")),
                       max_seqs=4, max_rows=32, max_draft=2)
    h = dec.dims.hidden_size
    tokens = ForeignArray(0x100000, (2, 3), "<i4")
    slots = DeviceArray(gpu, 0x200000, (2,), np.int32)
    gpu.launches.clear()
    dec.step(tokens, slots, 2, _SlicedView(base, offset, (6, h), BF16, versioned), k=3)
    gather, gemm = gpu.launches
    assert gemm.args[2] == base + offset, "the GEMM writes the view, not the start of its allocation"


# ==== the converter: read-back, fsync before rename, resume's manifest ================================

@pytest.mark.parametrize("what", ["rows", "scales"])
def test_a_table_that_reads_back_wrong_fails_the_conversion_and_is_removed(tmp_path, rng, monkeypatch, what):
    """A table file whose bytes on disk differ from what the source gave (a bit flipped on the way)
    is caught by the read-back after the rename: VerifyError, the file deleted, the manifest
    without it; the guarded bug: no read-back check after writing a table."""
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    victim = int(rng.integers(0, len(model.tables)))
    append = TableWriter.append

    def flipping_append(self, rows, scales=None):
        if self.path.endswith(f"table_{victim:03d}.ngt") and self.written == 0:
            if what == "rows":
                rows = np.array(rows)
                flat = rows.reshape(-1).view(np.uint8)
                flat[int(rng.integers(0, flat.size))] ^= 1 << int(rng.integers(0, 8))
            else:
                scales = np.array(scales)
                scales[int(rng.integers(0, scales.size))] *= np.float32(2)
        append(self, rows, scales)

    monkeypatch.setattr(TableWriter, "append", flipping_append)
    out = tmp_path / "out"
    name = f"table_{victim:03d}.ngt"
    with pytest.raises(VerifyError, match=f"{name}: written, but reading it back: crc32 rows"):
        convert(model.path, out, fp8=what == "scales", chunk_bytes=10 * 6 * 2, progress=False)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([MANIFEST] * (victim > 0) + [f"table_{c:03d}.ngt" for c in range(victim)])
    if victim:
        assert [e["index"] for e in json.loads((out / MANIFEST).read_text())["tables"]] == list(range(victim))


class _FileOps:
    """Records ``os.pwrite``, ``os.fsync`` and ``os.replace`` in order: each with the (device,
    inode) of the file it acts on, an fsync with the file's size then and whether it is a folder."""

    def __init__(self, monkeypatch):
        self.events: list[tuple] = []
        real = {name: getattr(os, name) for name in ("pwrite", "fsync", "replace")}

        def ident(st):
            return st.st_dev, st.st_ino

        def pwrite(fd, data, offset):
            self.events.append(("pwrite", ident(os.fstat(fd))))
            return real["pwrite"](fd, data, offset)

        def fsync(fd):
            st = os.fstat(fd)
            self.events.append(("fsync", ident(st), st.st_size, stat.S_ISDIR(st.st_mode)))
            return real["fsync"](fd)

        def replace(src, dst, **kw):
            self.events.append(("replace", ident(os.stat(src)), os.path.abspath(dst)))
            return real["replace"](src, dst, **kw)

        for name, fn in (("pwrite", pwrite), ("fsync", fsync), ("replace", replace)):
            monkeypatch.setattr(os, name, fn)

    def check_durable(self, dst) -> None:
        """``dst`` was renamed into place after an fsync of its data (no write after that fsync, the
        size then the final size), and the rename was followed by an fsync of its folder."""
        dst = os.path.abspath(dst)
        at = [i for i, e in enumerate(self.events) if e[0] == "replace" and e[2] == dst]
        assert at, f"{dst} was never renamed into place"
        i = at[-1]
        src = self.events[i][1]
        before = [j for j, e in enumerate(self.events) if e[0] == "replace" and j < i]
        since = before[-1] + 1 if before else 0  # since the previous rename (an inode may be reused)
        syncs = [j for j in range(since, i) if self.events[j][:2] == ("fsync", src)]
        assert syncs, f"{dst}: renamed into place without an fsync of its data"
        last = syncs[-1]
        late = [j for j in range(last, i) if self.events[j][:2] == ("pwrite", src)]
        assert not late, f"{dst}: written after its fsync"
        assert self.events[last][2] == os.stat(dst).st_size, f"{dst}: fsynced before all of it was written"
        after = [j for j, e in enumerate(self.events) if e[0] == "replace" and j > i]
        until = after[0] if after else len(self.events)
        folder = os.stat(os.path.dirname(dst))
        assert [e for e in self.events[i + 1:until] if e[0] == "fsync" and e[1] == (folder.st_dev, folder.st_ino)
                and e[3]], f"{dst}: its folder not fsynced after the rename"


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_a_table_file_is_fsynced_before_it_is_renamed_into_place(tmp_path, rng, monkeypatch, dtype):
    """``write_table`` fsyncs the ``.tmp`` after its last write (the header) and before the rename,
    then the folder; the guarded bug: a table file renamed into place without an fsync of its data."""
    rows, dim = int(rng.integers(1, 200)), int(rng.integers(1, 40))
    table = random_bf16(rng, (rows, dim)) if dtype == BF16 else random_fp8(rng, (rows, dim))
    scales = None if dtype == BF16 else rng.uniform(0.01, 2, rows).astype(np.float32)
    ops = _FileOps(monkeypatch)
    write_table(tmp_path / "t.ngt", table, scales, chunk_rows=int(rng.integers(1, rows + 1)))
    ops.check_durable(tmp_path / "t.ngt")
    monkeypatch.undo()
    with TableFile(tmp_path / "t.ngt") as f:
        assert f.rows_bytes.tobytes() == table.tobytes()


def test_every_file_a_conversion_renames_into_place_is_fsynced_first(tmp_path, rng, monkeypatch):
    """The converter's table files and its manifest (``write_atomically``) are each fsynced before
    their rename and their folder after it; the guarded bug: a rename without that fsync."""
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    ops = _FileOps(monkeypatch)
    convert(model.path, tmp_path / "out", chunk_bytes=200, progress=False)
    for c in range(len(model.tables)):
        ops.check_durable(tmp_path / "out" / f"table_{c:03d}.ngt")
    ops.check_durable(tmp_path / "out" / MANIFEST)
    data = rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8).tobytes()
    write_atomically(tmp_path / "blob", [data[:7], data[7:]])
    ops.check_durable(tmp_path / "blob")
    assert (tmp_path / "blob").read_bytes() == data


def _flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))


def test_a_resume_interrupted_again_keeps_the_tables_not_yet_reached(tmp_path, rng):
    """A rerun that rewrites table 1 and is stopped in table 3 leaves a manifest that still lists
    tables 2 and 3 (already listed, not yet reached) and table 0, so the next run skips 0, 1 and 2;
    the guarded bug: the manifest written mid-way keeps only the tables this run has passed."""
    model = write_model(tmp_path / "m", make_model(rng, kinds="bf"))
    out = tmp_path / "out"
    clean = convert(model.path, out, chunk_bytes=120, progress=False)
    _flip(out / "table_001.ngt", 4096 + int(rng.integers(0, 76 * 6 * 2)))
    _flip(out / "table_003.ngt", 4096 + int(rng.integers(0, 76 * 6 * 2)))
    before = os.stat(out / "table_002.ngt")

    class Stop(Exception):
        pass

    def stop_in_table_3(table, done, rows):
        if table == 3:
            raise Stop

    with pytest.raises(Stop):
        convert(model.path, out, chunk_bytes=120, progress=False, on_chunk=stop_in_table_3)
    midway = json.loads((out / MANIFEST).read_text())
    assert [e["index"] for e in midway["tables"]] == [0, 1, 2, 3]
    assert midway == clean  # table 1 rewritten as it was; 0, 2 and 3 as listed before
    written = []
    resumed = convert(model.path, out, chunk_bytes=120, progress=False,
                      on_chunk=lambda table, done, rows: written.append(table))
    assert set(written) == {3}, "only the table the interruption left unwritten is written again"
    after = os.stat(out / "table_002.ngt")
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert resumed == clean
    verify_tables(out)


# ==== NgramDims: int(ratio * V) =====================================================================

@pytest.mark.parametrize("ratio, vocab, base", [
    (0.25, 303, 75),   # 75.75
    (0.7, 11, 7),      # 7.7
    (0.29, 100, 28),   # 28.999999999999996 in floating point, as the published code computes it
    (0.5, 301, 150),   # 150.5: round() gives 150 too (to even), but 0.5 * 303 = 151.5 below does not
    (0.5, 303, 151),
])
def test_longcat_rows_truncate_ratio_times_vocab(ratio, vocab, base):
    """Table rows are ``int(ratio * V) + 2c + 1`` (the published code truncates); the guarded bug:
    ``round(ratio * V)``, one row more for these ratios and vocabularies."""
    dims = NgramDims.longcat_flash(vocab, 24, 3, 2, ratio, None)
    assert dims.base_rows == base == int(ratio * vocab)
    assert [dims.table_rows(c) for c in range(dims.num_tables())] == [base + 2 * c + 1 for c in range(4)]


def test_a_checkpoint_whose_ratio_times_vocab_is_not_whole_opens_and_converts(tmp_path, rng):
    """A model folder of V = 303, ratio 0.25 (75.75) has tables of 76, 78, .. rows, which the
    checkpoint accepts and the converter writes; the guarded bug: ``round`` expects 77, 79, .."""
    model = write_model(tmp_path / "m", make_model(rng, tiny_config(vocab_size=303), "b"))
    ckpt = NgramCheckpoint.open(model.path, parts="tables")
    assert ckpt.dims.base_rows == 75 and [r.shape[0] for r in ckpt.tables] == [76, 78, 80, 82]
    manifest = convert(model.path, tmp_path / "out", progress=False)
    assert manifest["base_rows"] == 75 and [e["rows"] for e in manifest["tables"]] == [76, 78, 80, 82]


# ==== the LM-head overlay's 65535 overrides ==========================================================

@pytest.mark.parametrize("which", ["lmhead_overlay_bf16", "lmhead_overlay_f32"])
def test_lmhead_overlay_launches_at_exactly_65535_overrides(rng, which):
    """``max_n_override`` = 65535 (the grid's y limit) is launched with a grid of 65535 rows of
    warps, 65536 refused before any launch; the guarded bug: ``>=`` for ``>`` in the limit check."""
    assert MAX_LMHEAD_OVERRIDES == 65535
    gpu = RecordingBackend()
    k = getattr(OverlayKernels.new(gpu), which)
    p = [0x10000 * (i + 1) for i in range(6)]
    m = int(rng.integers(1, 100))
    lmhead_overlay_routed(gpu, k, p[0], p[1], 0, p[2], p[3], p[4], p[5], m, 65535, 64, 131072, stream=3)
    (rec,) = gpu.launches
    assert (rec.grid, rec.block, rec.stream) == ((m, 65535, 1), (32, 1, 1), 3)
    with pytest.raises(ValueError, match="max_n_override 65536 > 65535"):
        lmhead_overlay_routed(gpu, k, p[0], p[1], 0, p[2], p[3], p[4], p[5], m, 65536, 64, 131072, stream=3)
    assert len(gpu.launches) == 1


def test_a_slot_holds_exactly_65535_lm_head_overrides(rng):
    """An adapter overriding 65535 LM-head ids loads and its hook launches over all of them; the
    guarded bug: ``>=`` for ``>`` in ``OverlaySlots``' limit (65536 is refused by the builder test)."""
    gpu = overlay_backend()
    with OverlaySlots(gpu, 2, vocab=70_000, h=3) as slots:
        ids = np.sort(rng.choice(70_000, 65535, replace=False))
        slots.load(1, AdapterOverlay(None, TableOverlay.of(ids, random_bf16(rng, (65535, 3)))))
        assert slots.max_n_override == 65535
        slots.lmhead_overlay(0x1000, None, 1, 0x2000, 5)
        (rec,) = gpu.launches
        assert rec["name"] == "lmhead_overlay_routed_bf16" and rec["grid"] == (5, 65535, 1)
