"""Engram's token compression: each tokenizer id mapped to a compressed id, shared by the ids whose
text normalises alike (``" The"``, ``"the"``, ``"THE"``, ``"thé"``); the hash reads compressed ids.

    python -m layers.engram.token_map TOKENIZER_JSON OUT [--expect-size N] [--force]

``build_token_map`` reads a model's ``tokenizer.json`` with the ``tokenizers`` library (the
``engram`` extra: ``pip install '.[engram]'``; only this function needs it) as the reference does
(vLLM's ``build_compressed_token_map``). ``TokenMap.save`` writes a small file of its own format,
``TokenMap.load`` reads it back; the command line builds, saves and prints the vocabulary, the
compressed size and the SHA-256 (of the ids as little-endian int32, the published digest's form).

File format, version 1, little-endian: magic ``b"ENGRAMTM"``, then u32 version, vocab, compressed
size and the CRC32 of the ids' bytes (24 bytes), then ``vocab`` int32 ids. ``load`` refuses a file
with another magic, version, length or CRC, or ids not numbered in order of first appearance.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpu_runtime import cli, validate

from ..atomic_write import write_atomically
from ..model_folder import as_path

MAGIC = b"ENGRAMTM"
VERSION = 1
_HEADER = struct.Struct("<8sIIII")  # magic, version, vocab, compressed size, crc32 of the ids
_IDS = np.dtype("<i4")
_SENTINEL = "\ue000"  # keeps a token that is only white space from being stripped to ""
INSTALL_HINT = "pip install '.[engram]'"


@dataclass(frozen=True, eq=False)
class TokenMap:
    """``ids[token_id]`` is the compressed id (int32, read-only, numbered from 0 in order of first
    appearance); ``size`` is the compressed count. ``TypeError`` for ids that are not a numpy int32
    array, ``ValueError`` for an empty one, a negative id or ids out of first-appearance order."""

    ids: np.ndarray
    size: int = field(init=False)

    def __post_init__(self) -> None:
        ids = self.ids
        if not isinstance(ids, np.ndarray) or ids.dtype.kind != "i" or ids.dtype.itemsize != 4:
            raise TypeError(f"TokenMap ids must be a numpy int32 array, got {_describe(ids)}")
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"TokenMap ids must be one non-empty row, got shape {ids.shape}")
        ids = np.array(ids, dtype=np.int32)  # a copy of its own, native order
        ids.flags.writeable = False
        firsts = np.maximum.accumulate(ids)
        if ids[0] != 0 or ids.min() < 0 or np.any(np.diff(firsts) > 1):
            raise ValueError("TokenMap ids must number the compressed ids 0, 1, 2 ... in order of first appearance")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "size", int(firsts[-1]) + 1)

    @property
    def vocab(self) -> int:
        """How many tokenizer ids the map covers (``len(ids)``)."""
        return len(self.ids)

    def pad(self, pad_token_id: int) -> int:
        """The compressed id of ``pad_token_id`` (the config's ``engram_pad_token_id``)."""
        return int(self.ids[validate.count(pad_token_id, "pad_token_id", limit=self.vocab)])

    def sha256(self) -> str:
        """Hex SHA-256 of the ids as little-endian int32 (the published digest's form)."""
        return hashlib.sha256(self.ids.astype(_IDS).tobytes()).hexdigest()

    def check(self, expected_vocab: int, expected_compressed: int) -> None:
        """``ValueError`` unless ``size`` is the config's ``engram_compressed_vocab_size`` and the
        map covers at least its ``vocab_size`` ids."""
        expected_vocab = validate.positive(expected_vocab, "expected_vocab")
        expected_compressed = validate.positive(expected_compressed, "expected_compressed")
        if self.size != expected_compressed:
            raise ValueError(
                f"token map has {self.size} compressed ids but the config's engram_compressed_vocab_size is "
                f"{expected_compressed}: every hash multiplier derives from that size, so this map would hash "
                "every n-gram to other rows (was it built from the model's own tokenizer.json?)"
            )
        if self.vocab < expected_vocab:
            raise ValueError(
                f"token map covers {self.vocab} token ids but the config's vocab_size is {expected_vocab}: "
                f"ids {self.vocab}..{expected_vocab - 1} would have no compressed id"
            )

    def save(self, path: str | os.PathLike, *, force: bool = False) -> None:
        """Write the map to ``path`` atomically. ``ValueError`` if ``path`` holds a file that is not
        a token map (another's data), unless ``force`` (a bool: anything else is a ``TypeError``)."""
        path = as_path(path, "TokenMap.save: path")
        if not validate.boolean(force, "TokenMap.save: force") and os.path.lexists(path) and not _is_token_map(path):
            raise ValueError(f"{path}: exists and is not an Engram token map; not replaced (force=True replaces it)")
        data = self.ids.astype(_IDS).tobytes()
        header = _HEADER.pack(MAGIC, VERSION, self.vocab, self.size, zlib.crc32(data))
        write_atomically(path, [header, data])

    @classmethod
    def load(cls, path: str | os.PathLike) -> TokenMap:
        """Read a map ``save`` wrote. ``ValueError`` (naming the file) for a foreign, truncated or
        damaged file."""
        path = as_path(path, "TokenMap.load: path")
        with path.open("rb") as f:  # the header first: a large foreign file is refused unread
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size or head[: len(MAGIC)] != MAGIC:
                raise ValueError(f"{path}: not an Engram token map (no {MAGIC.decode()} header)")
            _, version, vocab, size, crc = _HEADER.unpack(head)
            if version != VERSION:
                raise ValueError(f"{path}: token map version {version}; this reader reads version {VERSION}")
            have, want = os.fstat(f.fileno()).st_size, _HEADER.size + vocab * _IDS.itemsize
            if have != want:
                raise ValueError(f"{path}: {have} bytes where a token map of {vocab} ids has {want}")
            data = f.read()
        if zlib.crc32(data) != crc:
            raise ValueError(f"{path}: the ids do not match the header's CRC32 (damaged file)")
        try:
            token_map = cls(np.frombuffer(data, dtype=_IDS))
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        if token_map.size != size:
            raise ValueError(f"{path}: header says {size} compressed ids, the ids number {token_map.size}")
        return token_map


def build_token_map(tokenizer_json: str | os.PathLike) -> TokenMap:
    """The map of every id ``0 .. get_vocab_size(with_added_tokens=True) - 1`` of the tokenizer in
    ``tokenizer_json`` (what ``len(tokenizer)`` is for a fast tokenizer: the model's vocabulary
    plus its added and special tokens). Per id: ``text = decode([id], skip_special_tokens=False)``;
    if ``text`` holds U+FFFD (part of a UTF-8 character) its key is ``id_to_token(id)``, else
    ``normalize(text) or text`` (NFKC, NFD, StripAccents, Lowercase, white-space runs to one
    space, a lone space kept, Strip). ``ImportError`` without ``tokenizers``, ``OSError`` for a
    file that cannot be read, ``ValueError`` for one that is not a tokenizer the library reads."""
    try:
        from tokenizers import Regex, Tokenizer, normalizers
    except ImportError as err:
        raise ImportError(f"building an Engram token map needs the tokenizers library: {INSTALL_HINT}") from err
    path = Path(tokenizer_json)
    raw = path.read_bytes()  # OSError here, with the path, rather than the library's message
    try:
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # UnicodeDecodeError, or the bare Exception the library raises
        raise ValueError(f"{path}: not a tokenizer the tokenizers library reads ({err})") from None
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab == 0:
        raise ValueError(f"{path}: the tokenizer has no tokens")
    texts = tokenizer.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    compressed: dict[str | None, int] = {}
    ids = np.empty(vocab, dtype=np.int32)
    for token_id, piece in enumerate(texts):
        key = tokenizer.id_to_token(token_id) if "\ufffd" in piece else normalizer.normalize_str(piece) or piece
        ids[token_id] = compressed.setdefault(key, len(compressed))
    return TokenMap(ids)


def _is_token_map(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except IsADirectoryError:
        return False


def _describe(value: object) -> str:
    return f"{value.dtype} array" if isinstance(value, np.ndarray) else type(value).__name__


PROG = "python -m layers.engram.token_map"


def _parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(
        prog=PROG,
        description="Build Engram's compressed-id map from a tokenizer.json, save it to OUT, and print "
        "its vocabulary, compressed size and SHA-256.",
    )
    parser.add_argument("tokenizer_json", metavar="TOKENIZER_JSON", help="the model's tokenizer.json")
    parser.add_argument("out", metavar="OUT", help="the token map file to write")
    parser.add_argument(
        "--expect-size",
        type=int,
        metavar="N",
        help="the config's engram_compressed_vocab_size: fail (status 1, nothing written) if the map's differs",
    )
    parser.add_argument("--force", action="store_true", help="replace OUT even if it is not a token map")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 written, 1 build or check failed (nothing written), 2 usage error."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.expect_size is not None and args.expect_size < 1:
        parser.error(f"--expect-size must be >= 1, got {args.expect_size}")
    if not os.path.isfile(args.tokenizer_json):
        parser.error(f"TOKENIZER_JSON {args.tokenizer_json!r} is not a file")
    if not args.out or os.path.isdir(args.out):
        parser.error(f"OUT {args.out!r} must name a file, not a folder")
    try:
        token_map = build_token_map(args.tokenizer_json)
        if args.expect_size is not None and token_map.size != args.expect_size:
            raise ValueError(
                f"the map has {token_map.size} compressed ids, not the {args.expect_size} expected "
                "(every hash multiplier derives from that size); nothing written"
            )
        token_map.save(args.out, force=args.force)
    except (ImportError, OSError, ValueError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    print(f"vocab {token_map.vocab}, compressed {token_map.size}, sha256 {token_map.sha256()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
