"""The CPU quickstart: load a LongCat-shaped checkpoint and run the numpy references, no GPU.

What the GPU kernels compute is defined by ``layers.reference`` (numpy, the kernels' bf16
roundings); this runs it on a real model folder:
  1. writes a tiny LongCat-Flash-Lite-shaped model folder (``config.json`` with the published
     keys, ``model.safetensors`` with the published tensor names: the word table, T = 4 hashed
     tables, two bf16 and two fp8 with per-row scales, and their projections) into a temporary
     directory, or takes an existing folder (``--model-dir``);
  2. opens it with ``NgramCheckpoint`` (the checks ``NgramWeights.from_pretrained`` makes before
     it uploads anything; tensors memory-mapped, nothing read in whole);
  3. embeds a seeded random context with the reference of the seed's path (``ngram_embed``: T + 1
     bf16 roundings) and of the fused path and decoder (``ngram_embed_fused``: one rounding);
  4. applies a LoRA token overlay (an ``AdapterOverlay``: replaced embedding rows and LM-head
     rows) with the references of the routed overlay kernels, to the gathered word rows and to
     logits of a stand-in LM head (the word table, tied; its first 1024 rows at most).
Each result is printed with its shape and a CRC32 of its bytes (bf16, little-endian), the same
on every machine for the same model, seed and token count.

Nothing here compiles a kernel or calls the CUDA driver (``make kernels`` is not needed):
``python3 -m pip install .`` then ``python3 examples/cpu_reference.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import zlib
from pathlib import Path

from _requires import installed  # examples/_requires.py: a missing package is one line

with installed("cpu_reference.py"):
    import ml_dtypes
    import numpy as np

    from gpu_runtime import cli
    from layers.ngram_embed import CheckpointError, NgramCheckpoint
    from layers.overlay import AdapterOverlay, TableOverlay
    from layers.reference import gather_then_overlay_ref, gemm_bf16, lmhead_overlay_ref, ngram_embed, ngram_embed_fused
    from layers.safetensors_io import save

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
LM_HEAD_ROWS = 1024  # the stand-in LM head: the word table's first rows, at most this many
ADAPTER_ROWS = 8  # rows the adapter replaces in the embedding and in the LM head

# LongCat-Flash-Lite's config keys at toy size (tests/helpers/checkpoint.py's tiny_config):
# T = emb_split_num * (emb_neighbor_num - 1) = 4 tables of hidden_size // T = 6 columns, table c
# with int(ngram_vocab_size_ratio * vocab_size) + 2*c + 1 rows (75 + 2c + 1).
TINY_CONFIG = {
    "architectures": ["LongcatFlashNgramForCausalLM"],
    "model_type": "longcat_flash_ngram",
    "vocab_size": 300,
    "hidden_size": 24,
    "emb_neighbor_num": 3,
    "emb_split_num": 2,
    "ngram_vocab_size_ratio": 0.25,
    "eos_token_id": 2,
    "bos_token_id": 1,
    "pad_token_id": 3,
    "num_layers": 1,
    "torch_dtype": "bfloat16",
}
# the published checkpoint's tensor names
WORD = "model.embed_tokens.weight"
TABLE = "model.ngram_embeddings.embedders.{}.weight"
SCALE = "model.ngram_embeddings.embedders.{}.weight_scale"
PROJ = "model.ngram_embeddings.post_projs.{}.weight"
# what a model folder's loader reads: --save-model --force replaces these and keeps other files
MODEL_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")


def write_tiny_model(path: Path, seed: int = 0) -> Path:
    """Write a tiny LongCat-Flash-Lite-shaped model folder into ``path`` (made if missing):
    ``config.json`` (``TINY_CONFIG``) and ``model.safetensors`` with random weights drawn from
    ``seed``: the word table [V, D] bf16; table c [rows_c, D // T], bf16 for even c, fp8 (e4m3)
    with f32 per-row scales (``weight_scale``) for odd c; projection c [D, D // T] bf16. Returns
    ``path``; ``NgramWeights.from_pretrained(path, gpu)`` loads it on a GPU."""
    rng = np.random.default_rng(seed)
    config = TINY_CONFIG
    v, d = config["vocab_size"], config["hidden_size"]
    t = config["emb_split_num"] * (config["emb_neighbor_num"] - 1)
    td = d // t
    tensors = {WORD: rng.standard_normal((v, d)).astype(np.float32).astype(BF16)}
    for c in range(t):
        rows = int(config["ngram_vocab_size_ratio"] * v + 2 * c + 1)
        if c % 2:
            tensors[TABLE.format(c)] = (rng.standard_normal((rows, td)) * 64).astype(np.float32).astype(FP8)
            tensors[SCALE.format(c)] = rng.uniform(0.001, 0.05, rows).astype(np.float32)
        else:
            tensors[TABLE.format(c)] = rng.standard_normal((rows, td)).astype(np.float32).astype(BF16)
        proj = rng.standard_normal((d, td)) / np.sqrt(td)
        tensors[PROJ.format(c)] = proj.astype(np.float32).astype(BF16)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save(path / "model.safetensors", tensors)
    return path


def save_model(path: Path, seed: int) -> Path:
    """Write the tiny model into the folder ``path`` (made if missing), replacing any model there:
    the new files are written into a temporary folder inside it first, then the folder's model
    files (``MODEL_FILES``: config, single file or shards and their index) are removed and the
    new ones moved in. Other files are kept. Returns ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path, prefix=".tiny-model-") as tmp:
        new = write_tiny_model(Path(tmp), seed)
        for old in [f for pattern in MODEL_FILES for f in path.glob(pattern)]:
            old.unlink()
        for f in new.iterdir():
            f.replace(path / f.name)
    return path


def crc32(array: np.ndarray) -> str:
    """CRC32 of the array's bytes, little-endian, as 8 hex digits."""
    data = np.ascontiguousarray(array)
    return f"{zlib.crc32(data.view(f'<u{data.dtype.itemsize}').tobytes()):08x}"


def describe(name: str, array: np.ndarray, note: str = "") -> str:
    shape = "(" + ", ".join(map(str, array.shape)) + ")"
    return f"{name:<18} shape {shape:<10} {array.dtype.name:<9} crc32 {crc32(array)}" + (f"  {note}" if note else "")


def run(model_dir: Path, seed: int, tokens: int, origin: str) -> list[str]:
    """Open ``model_dir`` and run the references; returns the printed lines."""
    ckpt = NgramCheckpoint.open(model_dir)
    dims = ckpt.dims
    t = dims.num_tables()
    word = ckpt.word_array()
    tables = [ckpt.table_arrays(c) for c in range(t)]
    projs = [ckpt.proj_array(c) for c in range(t)]
    kinds = ", ".join(
        "fp8" if scale is not None else table.dtype.name.replace("bfloat16", "bf16") for table, scale in tables
    )
    lines = [
        f"model    {origin}: V={dims.vocab_size} D={dims.hidden_size} N={dims.max_ngram} "
        f"K={dims.splits} eos={dims.eos_id}, T={t} tables: {kinds}",
    ]

    # the n-gram embedding of a random context's last `tokens` positions
    rng = np.random.default_rng(seed)
    context = rng.integers(0, dims.vocab_size, tokens + dims.max_ngram - 1, dtype=np.int64)
    lines.append(f"context  {len(context)} tokens (seed {seed}), the last {tokens} embedded")
    seed_path = ngram_embed(dims, word, tables, projs, context, tokens)
    fused_path = ngram_embed_fused(dims, word, tables, projs, context, tokens)
    differ = int(np.count_nonzero(seed_path.view(np.uint16) != fused_path.view(np.uint16)))
    lines.append(describe("ngram_embed", seed_path, "the seed's path: T + 1 bf16 roundings"))
    lines.append(describe("ngram_embed_fused", fused_path, "fused path and decoder: one rounding"))
    lines.append(f"{'':<18} {differ} of {fused_path.size} elements differ between the two (their roundings)")

    # a LoRA token overlay: rows of the embedding and of the LM head that one adapter replaces
    ids = context[len(context) - tokens :]
    lm_rows = min(dims.vocab_size, LM_HEAD_ROWS)
    lm_head = word[:lm_rows]
    embed_ids = np.unique(ids[::3])[:ADAPTER_ROWS]  # tokens of the context, so that some rows change
    lm_ids = rng.choice(lm_rows, min(ADAPTER_ROWS, lm_rows), replace=False)
    h = dims.hidden_size
    adapter = AdapterOverlay(  # the rows are replacements (float64 here, rounded to bf16 by .of)
        embed=TableOverlay.of(embed_ids, rng.standard_normal((len(embed_ids), h)), vocab=dims.vocab_size),
        lm_head=TableOverlay.of(lm_ids, rng.standard_normal((len(lm_ids), h)), vocab=lm_rows),
    )
    emb, lm = adapter.embed, adapter.lm_head
    assert emb is not None and lm is not None
    slot_map = np.full(dims.vocab_size, -1, np.int32)  # one adapter slot: token -> its replacement row
    slot_map[emb.ids] = np.arange(emb.n, dtype=np.int32)
    embedded = gather_then_overlay_ref(word, ids, None, 0, [slot_map], [emb.rows], [emb.n])
    replaced = int(np.isin(ids, emb.ids).sum())
    lines.append(describe("embed overlay", embedded, f"{replaced} of {tokens} rows replaced by the adapter"))
    hidden = fused_path  # a stand-in hidden state: the layer's output
    logits, written = lmhead_overlay_ref(
        gemm_bf16(hidden, lm_head), hidden, None, 0, [lm.rows], [lm.ids], [lm.n], lm.n, lm_rows
    )
    per_row = int(written.sum()) // tokens
    lines.append(describe("lm_head overlay", logits, f"{per_row} of {lm_rows} logits per row recomputed"))
    return lines


def folder_path(text: str) -> Path:
    """A folder option's value; an empty one is refused (``Path('')`` is the current directory)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (the current directory is '.')")
    return Path(text)


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(
        prog="cpu_reference.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Output: one line for the model, one for the context, then per result its name, shape, "
            "dtype and CRC32 (bf16 bytes, little-endian). The defaults print the checksums that "
            "tests/test_cpu_quickstart.py asserts. No GPU, CUDA driver or `make kernels` needed."
        ),
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--model-dir",
        type=folder_path,
        metavar="DIR",
        help="an existing LongCat-Flash(-Lite)-style model folder (config.json and model.safetensors, "
        "or an index and its shards) to read instead of the tiny one written by default",
    )
    where.add_argument(
        "--save-model",
        type=folder_path,
        metavar="DIR",
        help="write the tiny model folder into DIR and keep it (default: a temporary directory, deleted at exit); "
        "DIR must be new or empty, unless --force",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="with --save-model: DIR may hold files; the model in it is replaced, not only the files of the "
        "same names: every config.json, *.safetensors and *.safetensors.index.json there (a sharded model's "
        "shards and index too) is removed once the new model is written; other files are kept",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the tiny model's weights, the context and the adapter (default 0)"
    )
    parser.add_argument("--tokens", type=int, default=16, help="positions to embed (default 16)")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error("--tokens must be >= 1")
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    if args.force and args.save_model is None:
        parser.error("--force goes with --save-model")
    folder = args.save_model
    if folder is not None:
        if folder.exists() and not folder.is_dir():
            parser.error(f"--save-model {folder}: a file is there, not a folder")
        try:
            if folder.is_dir() and any(folder.iterdir()) and not args.force:
                parser.error(f"--save-model {folder}: the folder is not empty (--force replaces the model in it)")
            save_model(folder, args.seed)
        except OSError as err:  # not writable, no such parent, a file on the way, ...
            parser.error(f"--save-model {folder}: cannot write the model there ({err.strerror or err})")
    try:
        if args.model_dir is not None:
            lines = run(args.model_dir, args.seed, args.tokens, str(args.model_dir))
        elif folder is not None:
            lines = run(folder, args.seed, args.tokens, f"{folder} (tiny, seed {args.seed})")
        else:
            with tempfile.TemporaryDirectory(prefix="tiny-longcat-") as tmp:
                path = write_tiny_model(Path(tmp), args.seed)
                origin = f"temporary tiny folder (seed {args.seed})"
                lines = run(path, args.seed, args.tokens, origin)
    except CheckpointError as err:
        parser.error(str(err))
    print(*lines, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
