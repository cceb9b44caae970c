"""Engram's token map (``layers.engram.token_map``) on the CPU: built from a small byte-level BPE
``tokenizer.json`` made here with the ``tokenizers`` library and checked against a map worked out by
hand; its file round trip, digest and every refusal; the command line. With
``ENGRAM_TOKENIZER_JSON`` naming DeepSeek-V4.1's tokenizer.json, the real map's size and published
SHA-256 too (skipped otherwise)."""

from __future__ import annotations

import ast
import hashlib
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from layers.engram.token_map import MAGIC, TokenMap, build_token_map, main

REPO = Path(__file__).resolve().parent.parent

# The tokenizer's pieces as raw bytes (the BPE vocabulary holds them byte-level encoded), then its
# added tokens, and the map worked out by hand for each id:
PIECES = [
    b"<pad>",  # 0: also an added special token, so it takes no id of its own -> "<pad>"       c0
    b"The",  # 1: -> "the"                                                                      c1
    b" the",  # 2: one space, stripped -> "the"                                                c1
    b"THE",  # 3: lowercased -> "the"                                                           c1
    "th\u00e9".encode(),  # 4: "thé": NFD then StripAccents -> "the"                               c1
    b" ",  # 5: a lone space is kept -> " "                                                     c2
    b"\n\n",  # 6: a white-space run is one space -> " "                                        c2
    b"\xc3",  # 7: half of a UTF-8 character: decodes to U+FFFD -> its own token string "Ã"    c3
    b"\xa9",  # 8: the other half -> "©", not the U+FFFD that id 7 also decodes to               c4
    "\uff21".encode(),  # 9: fullwidth "Ａ": NFKC -> "a"                                          c5
    b" a",  # 10: -> "a"                                                                         c5
    "\u0301".encode(),  # 11: a lone combining accent normalises to "": the key is the text        c6
    b" \t\r\n",  # 12: -> " "                                                                    c2
    b"Th\xc3",  # 13: "Th" and half a character: U+FFFD in the text -> the token string "ThÃ"     c7
    "\ufb01".encode(),  # 14: the ligature "ﬁ": NFKC -> "fi"                                       c8
    b"fi",  # 15: -> "fi"                                                                        c8
    "\u0308".encode(),  # 16: another lone accent: "" too, but its key is its own text            c9
]
SPECIAL = ["<pad>", "<|BOS|>", "<|bos|>"]  # 17: "<|BOS|>" -> "<|bos|>" c10; 18: "<|bos|>" c10
ADDED = ["THE "]  # 19: a plain added token: -> "the" c1
EXPECTED = [0, 1, 1, 1, 1, 2, 2, 3, 4, 5, 5, 6, 2, 7, 8, 8, 9, 10, 10, 1]


def _byte_level(raw: bytes) -> str:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68
    bytes for U+0100 on, in byte order."""
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return "".join(table[b] for b in raw)


def write_tokenizer(path: Path) -> Path:
    """The tokenizer above as ``path`` (a tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models

    tokenizer = Tokenizer(models.BPE(vocab={_byte_level(p): i for i, p in enumerate(PIECES)}, merges=[]))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.add_tokens(ADDED)
    tokenizer.save(str(path))
    return path


@pytest.fixture
def tokenizer_json(tmp_path: Path) -> Path:
    pytest.importorskip("tokenizers", reason="the engram extra (tokenizers) is not installed")
    return write_tokenizer(tmp_path / "tokenizer.json")


def random_map(rng: np.random.Generator, vocab: int | None = None) -> TokenMap:
    """A random map: random keys numbered in order of first appearance."""
    vocab = int(rng.integers(1, 300)) if vocab is None else vocab
    keys = rng.integers(0, max(1, vocab // 3), size=vocab)
    _, first, key_of = np.unique(keys, return_index=True, return_inverse=True)
    number = np.empty(len(first), dtype=np.int32)
    number[np.argsort(first)] = np.arange(len(first))  # the keys numbered by first appearance
    return TokenMap(number[key_of.ravel()])


def test_the_map_of_a_small_tokenizer_is_the_one_worked_by_hand(tokenizer_json):
    token_map = build_token_map(tokenizer_json)
    assert token_map.ids.dtype == np.int32 and token_map.ids.tolist() == EXPECTED
    # the full size, added tokens included (17 pieces, "<pad>" already one of them, 3 more): len(tokenizer)
    assert token_map.vocab == 20 and token_map.size == 11
    assert token_map.pad(2) == 1 and token_map.pad(0) == 0 and token_map.pad(13) == 7
    assert not token_map.ids.flags.writeable
    with pytest.raises(ValueError):
        token_map.ids[0] = 1


def test_the_map_numbers_by_first_appearance_and_copies_its_ids(rng):
    token_map = random_map(rng)
    ids = token_map.ids.copy()
    firsts = np.maximum.accumulate(ids)
    assert ids[0] == 0 and set(np.diff(firsts).tolist()) <= {0, 1} and token_map.size == firsts[-1] + 1
    kept = TokenMap(ids)
    ids[:] = 0
    assert np.array_equal(kept.ids, token_map.ids)  # the map holds a copy of its own


def test_the_digest_is_of_the_ids_as_little_endian_int32(rng):
    token_map = TokenMap(np.array([0, 1, 1, 2, 0, 3], dtype=np.int32))
    assert token_map.sha256() == hashlib.sha256(struct.pack("<6i", 0, 1, 1, 2, 0, 3)).hexdigest()
    assert token_map.sha256() == "d1d51796a1a24d54351e000d9f42168caf82f2b37e36abb7bcaccefcaa858a4b"
    token_map = random_map(rng)
    packed = b"".join(struct.pack("<i", int(i)) for i in token_map.ids)
    assert token_map.sha256() == hashlib.sha256(packed).hexdigest()
    big_endian = TokenMap(token_map.ids.astype(">i4"))  # the digest does not depend on the array's byte order
    assert big_endian.sha256() == token_map.sha256()


def test_a_saved_map_loads_back_the_same(tmp_path, rng):
    token_map = random_map(rng)
    path = tmp_path / "map.etm"
    token_map.save(path)
    raw = path.read_bytes()
    ids_bytes = b"".join(struct.pack("<i", int(i)) for i in token_map.ids)
    header = MAGIC + struct.pack("<4I", 1, token_map.vocab, token_map.size, zlib.crc32(ids_bytes))
    assert raw == header + ids_bytes
    loaded = TokenMap.load(path)
    assert np.array_equal(loaded.ids, token_map.ids) and loaded.size == token_map.size
    assert loaded.sha256() == token_map.sha256() and not loaded.ids.flags.writeable
    assert os.listdir(tmp_path) == ["map.etm"]  # no .tmp left


def test_a_map_replaces_a_token_map_but_not_another_file(tmp_path, rng):
    first, second = random_map(rng), random_map(rng)
    path = tmp_path / "map.etm"
    first.save(path)
    second.save(path)  # a token map is replaced
    assert np.array_equal(TokenMap.load(path).ids, second.ids)
    other = tmp_path / "notes.txt"
    other.write_bytes(b"someone's notes")
    with pytest.raises(ValueError, match=r"notes.txt: exists and is not an Engram token map; not replaced"):
        first.save(other)
    assert other.read_bytes() == b"someone's notes"
    first.save(other, force=True)
    assert np.array_equal(TokenMap.load(other).ids, first.ids)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="folder: exists and is not an Engram token map"):
        first.save(tmp_path / "folder")
    assert sorted(os.listdir(tmp_path)) == ["folder", "map.etm", "notes.txt"]
    with pytest.raises(TypeError):
        first.save(3)  # type: ignore[arg-type]


def _damaged(tmp_path: Path, rng: np.random.Generator, damage) -> Path:
    path = tmp_path / "map.etm"
    random_map(rng, vocab=40).save(path)
    path.write_bytes(damage(bytearray(path.read_bytes())))
    return path


def _recrc(raw: bytearray) -> bytearray:
    raw[20:24] = struct.pack("<I", zlib.crc32(bytes(raw[24:])))
    return raw


def _set(raw: bytearray, at: int, fmt: str, value: int) -> bytearray:
    raw[at : at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return raw


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda r: bytearray(b"x" * 200), "not an Engram token map"),
        (lambda r: r[:10], "not an Engram token map"),
        (lambda r: r[:-1], r"183 bytes where a token map of 40 ids has 184"),
        (lambda r: r + b"\0\0\0\0", r"188 bytes where a token map of 40 ids has 184"),
        (lambda r: _set(r, 8, "<I", 2), "token map version 2; this reader reads version 1"),
        (lambda r: _set(r, 12, "<I", 41), r"184 bytes where a token map of 41 ids has 188"),
        (lambda r: _set(r, 24 + 4 * 7, "<i", 39), "do not match the header's CRC32"),
        (lambda r: _recrc(_set(r, 24 + 4 * 7, "<i", 39)), "in order of first appearance"),
        (lambda r: _recrc(_set(r, 24 + 4 * 7, "<i", -1)), "in order of first appearance"),
        (lambda r: _set(r, 16, "<I", 1000), "header says 1000 compressed ids, the ids number"),
    ],
    ids=["foreign", "short-header", "truncated", "trailing", "version", "vocab", "crc", "order", "negative", "size"],
)
def test_load_refuses_a_foreign_truncated_or_damaged_file(tmp_path, rng, damage, message):
    path = _damaged(tmp_path, rng, damage)
    with pytest.raises(ValueError, match=message) as err:
        TokenMap.load(path)
    assert str(path) in str(err.value)


def test_load_of_a_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        TokenMap.load(tmp_path / "absent.etm")


@pytest.mark.parametrize(
    "ids, error, message",
    [
        ([0, 1, 1], TypeError, "must be a numpy int32 array, got list"),
        (np.array([0, 1, 1]), TypeError, "must be a numpy int32 array, got int64 array"),
        (np.array([0.0, 1.0]), TypeError, "got float64 array"),
        (np.array([0, 1, 1], dtype=np.uint32), TypeError, "got uint32 array"),
        (np.zeros(0, dtype=np.int32), ValueError, r"one non-empty row, got shape \(0,\)"),
        (np.zeros((2, 2), dtype=np.int32), ValueError, r"one non-empty row, got shape \(2, 2\)"),
        (np.array([1, 0], dtype=np.int32), ValueError, "in order of first appearance"),
        (np.array([0, 2, 1], dtype=np.int32), ValueError, "in order of first appearance"),
        (np.array([0, 1, -1], dtype=np.int32), ValueError, "in order of first appearance"),
    ],
    ids=["list", "int64", "float", "uint32", "empty", "2-d", "starts-at-1", "skips", "negative"],
)
def test_a_map_refuses_ids_that_are_not_a_token_map(ids, error, message):
    with pytest.raises(error, match=message):
        TokenMap(ids)


def test_pad_refuses_an_id_outside_the_vocabulary(rng):
    token_map = random_map(rng, vocab=30)
    assert token_map.pad(np.int64(29)) == token_map.ids[29]
    with pytest.raises(ValueError, match=r"pad_token_id must be in 0..29, got 30"):
        token_map.pad(30)
    with pytest.raises(ValueError, match=r"pad_token_id must be in 0..29, got -1"):
        token_map.pad(-1)
    with pytest.raises(TypeError, match="pad_token_id must be an int, got bool"):
        token_map.pad(True)


def test_check_refuses_a_map_the_config_does_not_describe(rng):
    token_map = random_map(rng, vocab=60)
    token_map.check(60, token_map.size)
    token_map.check(50, token_map.size)  # a tokenizer with more ids than the config's vocab_size is fine
    want = token_map.size + 1
    with pytest.raises(ValueError, match=rf"has {token_map.size} compressed ids but the config's "
                       rf"engram_compressed_vocab_size is {want}: every hash multiplier derives from that size"):
        token_map.check(60, want)
    with pytest.raises(ValueError, match=r"covers 60 token ids but the config's vocab_size is 61: ids 60..60 would"):
        token_map.check(61, token_map.size)
    with pytest.raises(TypeError, match="expected_vocab must be an int"):
        token_map.check(60.0, token_map.size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected_compressed must be an int >= 1"):
        token_map.check(60, 0)


def test_build_refuses_a_missing_or_foreign_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        build_token_map(tmp_path / "absent.json")
    bad = tmp_path / "config.json"
    bad.write_text('{"vocab_size": 10}')
    with pytest.raises(ValueError, match="config.json: not a tokenizer the tokenizers library reads"):
        build_token_map(bad)
    bad.write_bytes(b'{"model": "\xff"}')  # not UTF-8
    with pytest.raises(ValueError, match="config.json: not a tokenizer the tokenizers library reads"):
        build_token_map(bad)
    with pytest.raises(TypeError):
        build_token_map(3)  # type: ignore[arg-type]


def test_build_without_tokenizers_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers raises ImportError
    with pytest.raises(ImportError, match=r"needs the tokenizers library: pip install '\.\[engram\]'"):
        build_token_map(tmp_path / "tokenizer.json")


def test_only_the_token_map_imports_tokenizers_and_only_when_it_builds():
    importers = []
    for package in ("gpu_runtime", "layers"):
        for f in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module or ""]
                if any(n.split(".")[0] == "tokenizers" for n in names):
                    importers.append(str(f.relative_to(REPO)))
    assert importers == ["layers/engram/token_map.py"]
    code = (
        "import sys; sys.modules['tokenizers'] = None\n"
        "import layers.engram, layers.engram.token_map\n"
        "assert 'tokenizers' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_the_command_line_builds_saves_and_prints(tokenizer_json, tmp_path, capsys):
    out = tmp_path / "map.etm"
    digest = hashlib.sha256(struct.pack(f"<{len(EXPECTED)}i", *EXPECTED)).hexdigest()
    for argv in ([str(tokenizer_json), str(out)], [str(tokenizer_json), str(out), "--expect-size", "11"]):
        assert main(argv) == 0
        assert capsys.readouterr().out == f"vocab 20, compressed 11, sha256 {digest}\n"
        assert TokenMap.load(out).ids.tolist() == EXPECTED
    out.unlink()
    assert main([str(tokenizer_json), str(out), "--expect-size", "12"]) == 1
    err = capsys.readouterr().err
    assert "the map has 11 compressed ids, not the 12 expected" in err and "nothing written" in err
    assert not out.exists()
    other = tmp_path / "other.bin"
    other.write_bytes(b"not a map")
    assert main([str(tokenizer_json), str(other)]) == 1
    assert "other.bin: exists and is not an Engram token map" in capsys.readouterr().err
    assert other.read_bytes() == b"not a map"
    assert main([str(tokenizer_json), str(other), "--force"]) == 0
    assert TokenMap.load(other).ids.tolist() == EXPECTED


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: TOKENIZER_JSON, OUT"),
        (["{tok}", "{out}", "--expect-size", "0"], "--expect-size must be >= 1, got 0"),
        (["{tok}", "{out}", "--expect-size", "many"], "argument --expect-size: invalid int value: 'many'"),
        (["{tmp}/absent.json", "{out}"], "TOKENIZER_JSON '{tmp}/absent.json' is not a file"),
        (["{tok}", "{tmp}"], "OUT '{tmp}' must name a file, not a folder"),
        (["{tok}", "{out}", "--bogus"], "unrecognized arguments: --bogus"),
    ],
    ids=["no-args", "expect-0", "expect-text", "no-tokenizer", "out-folder", "unknown-option"],
)
def test_the_command_line_usage_errors_are_one_line(tokenizer_json, tmp_path, capsys, argv, message):
    fill = {"tok": str(tokenizer_json), "out": str(tmp_path / "map.etm"), "tmp": str(tmp_path)}
    with pytest.raises(SystemExit) as exit_:
        main([a.format(**fill) for a in argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == f"python -m layers.engram.token_map: error: {message.format(**fill)}\n"
    assert not (tmp_path / "map.etm").exists()


def test_the_module_runs_as_a_command(tokenizer_json, tmp_path):
    out = tmp_path / "map.etm"
    done = subprocess.run([sys.executable, "-m", "layers.engram.token_map", str(tokenizer_json), str(out)],
                          cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.startswith("vocab 20, compressed 11, sha256 ")


REAL = os.environ.get("ENGRAM_TOKENIZER_JSON")


@pytest.mark.skipif(not REAL, reason="ENGRAM_TOKENIZER_JSON does not name DeepSeek-V4.1's tokenizer.json")
def test_the_real_tokenizer_gives_the_published_map():
    token_map = build_token_map(REAL)  # type: ignore[arg-type]
    assert (token_map.vocab, token_map.size, token_map.pad(2)) == (129280, 99092, 2)
    assert token_map.sha256() == "c60a86322ec17b4142bfef3c57a8d81fb428550cdf487f88a4320cb59fe46481"
    token_map.check(129280, 99092)
