"""GPT-2's byte-level BPE tokenizer (minidist/train/bpe.py) on a small vocabulary built here:
the byte table, GPT-2's pre-tokenization pieces (worked out from the pattern), encodings worked
out by hand from the merge ranks (priority, not left to right), the heap merge against the
rescanning description, round trips, the chunked and cached paths, and each load error as
one line naming its file. No GPT-2 download is needed or used. Training a tokenizer:
tests/test_bpe_train.py."""
import json
import random

import numpy as np
import pytest

from minidist.train import bpe
from minidist.train.bpe import (BPETokenizer, TokenizerError, bpe_merge, pretokenize,
                                tokenizer_files)
from tests.bpe_cases import B2U


BYTE_TOKENS = [B2U[b] for b in range(256)]          # id b = byte b
MERGES = [("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġt", "he"), ("in", "g"), ("t", "h"),
          ("a", "a"), ("Ã", "©")]                   # ranks 0..7 -> ids 256..263
GT, HE, IN, GTHE, ING, TH, AA, E_ACUTE, EOT = range(256, 265)


def _write(folder, vocab_text=None, merges_text=None, vocab=None, merges=None):
    """A tokenizer folder: the small vocabulary (+ <|endoftext|> last) unless told otherwise."""
    folder.mkdir(exist_ok=True)
    if vocab is None:
        tokens = BYTE_TOKENS + ["".join(m) for m in MERGES] + [bpe.EOT]
        vocab = {t: i for i, t in enumerate(tokens)}
    if merges is None:
        merges = MERGES
    if vocab_text is None:
        vocab_text = json.dumps(vocab, ensure_ascii=False)
    if merges_text is None:
        merges_text = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    (folder / "vocab.json").write_text(vocab_text, encoding="utf-8")
    (folder / "merges.txt").write_text(merges_text, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return BPETokenizer.from_folder(_write(tmp_path_factory.mktemp("bpe") / "tok"))


def test_bytes_to_unicode_is_gpt2s_table():
    chars = [B2U[b] for b in range(256)]
    assert len(set(chars)) == 256 and all(c.isprintable() for c in chars)
    assert B2U[ord(" ")] == "Ġ" and B2U[ord("\n")] == "Ċ" and B2U[ord("A")] == "A"
    assert B2U[ord("!")] == "!" and B2U[0xA1] == "¡" and B2U[0xFF] == "ÿ"
    assert B2U[0] == chr(256) and B2U[0xAD] == chr(323)     # the 1st and 68th moved bytes


@pytest.mark.parametrize("text, pieces", [
    ("Hello world's 123  x\n\n",
     ["Hello", " world", "'s", " 123", " ", " x", "\n\n"]),   # last space goes to the word
    ("don't  stop\n    return x",
     ["don", "'t", " ", " stop", "\n   ", " return", " x"]),
    ("I'M (a)b_c!!! ?", ["I", "'", "M", " (", "a", ")", "b", "_", "c", "!!!", " ?"]),
    ("x1y22 3.5", ["x", "1", "y", "22", " 3", ".", "5"]),
    ("\t\tfoo  ", ["\t", "\t", "foo", "  "]),               # only a space joins a word
    ("'sup they'll", ["'s", "up", " they", "'ll"]),
    ("", []),
])
def test_pretokenize_ascii_is_gpt2s_pattern(text, pieces):
    assert pretokenize(text) == pieces


@pytest.mark.parametrize("text, pieces", [
    ("x²½ Ⅻ", ["x", "²½", " Ⅻ"]),           # No/Nl are numbers (`[^\W\d_]` says letters)
    ("a \x1cb a \xa0b",                      # U+00A0 is White_Space, U+001C is not
     ["a", " \x1c", "b", " a", " ", "\xa0", "b"]),
    ("e\u0301", ["e", "\u0301"]),            # a mark is neither letter nor number
    ("𝐀𝐁 x𝟙 hi🙂🙂 x'𝐬",                     # astral letters, digit, emoji; '𝐬 is no 's
     ["𝐀𝐁", " x", "𝟙", " hi", "🙂🙂", " x", "'", "𝐬"]),
])
def test_pretokenize_unicode_classes(text, pieces):
    assert pretokenize(text) == pieces


def test_encode_by_hand_merge_rank_not_left_to_right(tok):
    assert tok.vocab_size == 265 and tok.eot == EOT and tok.name == "bpe-265"
    # " the": Ġ t h e -> (Ġ t rank 0) Ġt h e -> (h e 1) Ġt he -> (Ġt he 3) Ġthe
    # " thing": Ġ t h i n g -> Ġt h i n g -> (i n 2) Ġt h in g -> (in g 4) Ġt h ing;
    #   't h' (rank 5) could not apply: 'Ġ t' (rank 0) took the t first
    ids = tok.encode(" the thing")
    assert ids.dtype == np.int64 and ids.ndim == 1
    assert ids.tolist() == [GTHE, GT, ord("h"), ING]
    # "the": t h e: 'h e' (1) outranks 't h' (5) -> t he; left to right would give th e
    assert tok.encode("the").tolist() == [ord("t"), HE]
    # "thing": t h i n g -> t h in g -> t h ing -> (t h 5) th ing
    assert tok.encode("thing").tolist() == [TH, ING]
    # a pair merges at each occurrence from the left, without overlaps
    assert tok.encode("aaa").tolist() == [AA, ord("a")]
    assert tok.encode("aaaa").tolist() == [AA, AA]
    assert tok.encode("é").tolist() == [E_ACUTE]               # bytes C3 A9 = 'Ã' '©'
    assert tok.encode("x").tolist() == [ord("x")] and tok.encode("").shape == (0,)


def _reference_bpe(symbols, ranks):
    """The rule as described, rescanning: the lowest-ranked adjacent pair merges at each of
    its occurrences, left to right; repeat until no adjacent pair has a rank."""
    symbols = list(symbols)
    while True:
        pairs = [p for p in zip(symbols, symbols[1:]) if p in ranks]
        if not pairs:
            return symbols
        best, out, i = min(pairs, key=ranks.get), [], 0
        while i < len(symbols):
            if tuple(symbols[i:i + 2]) == best:
                out.append(symbols[i] + symbols[i + 1])
                i += 2
            else:
                out.append(symbols[i])
                i += 1
        symbols = out


@pytest.mark.parametrize("shuffled", [False, True])
def test_heap_merge_matches_the_rescanning_rule(shuffled):
    """Random merge tables over 'abc'; shuffled ranks put merges before those that make their
    parts, where the order in which new pairs join matters."""
    rng = random.Random(7)
    for _ in range(20):
        tokens, merges = ["a", "b", "c"], []
        while len(merges) < 25:
            pair = (rng.choice(tokens), rng.choice(tokens))
            if pair not in merges and len("".join(pair)) <= 6:
                merges.append(pair)
                tokens.append("".join(pair))
        if shuffled:
            rng.shuffle(merges)
        ranks = {p: r for r, p in enumerate(merges)}
        for _ in range(60):
            word = [rng.choice("abc") for _ in range(rng.randint(0, 16))]
            assert bpe_merge(word, ranks) == _reference_bpe(word, ranks), (word, merges)


@pytest.mark.parametrize("text", [
    "def f(x):\n    return x * 2  # plain ASCII\n",
    "café, naïve, é", "中文 and 日本語", "emoji 🙂 and 👩‍👩‍👧 family",
    "  \t\n\n   x  \r\n  ", "I'll say they're 'quoted' can't", "3.14159 2024 1e-5 0x1F",
    "<|endoftext|>", "x²½ Ⅻ e\u0301 a\x00b\x7f\x85",
])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_decode_split_character_gives_replacement_not_error(tok):
    ids = tok.encode("é中")                       # é = one merged token, 中 = 3 byte tokens
    assert ids.tolist() == [E_ACUTE, 0xE4, 0xB8, 0xAD]
    assert tok.decode(ids[:-1]) == "é\ufffd" and tok.decode([0xE4]) == "\ufffd"
    assert tok.decode([ord("Ã")]) == "\ufffd"     # half of é's two bytes


def test_endoftext_is_plain_text_in_encode_and_eot_decodes(tok):
    ids = tok.encode("a<|endoftext|>b")
    assert EOT not in ids.tolist() and tok.decode(ids) == "a<|endoftext|>b"
    assert tok.decode([ord("a"), EOT, ord("b")]) == "a<|endoftext|>b"


def test_decode_inputs_and_its_errors(tok):
    assert tok.decode([]) == "" and tok.decode(np.array([], np.int64)) == ""
    assert tok.decode(np.array([GTHE, GT], np.int32)) == " the t"
    assert tok.decode((GTHE,)) == " the" and tok.decode(np.int64(GTHE)) == " the"
    for bad in ([1, 265], [-1], np.array([1.0])):
        with pytest.raises(TokenizerError) as e:
            tok.decode(bad)
        assert "\n" not in str(e.value) and str(e.value).startswith("decode:")
    with pytest.raises(TokenizerError, match="id 265 is out of range for bpe-265"):
        tok.decode([1, 265])
    with pytest.raises(TokenizerError, match="1-D"):
        tok.decode(np.zeros((2, 2), np.int64))


def test_encode_takes_utf8_bytes_and_refuses_lone_surrogates(tok):
    assert tok.encode(" the".encode()).tolist() == [GTHE]
    with pytest.raises(TokenizerError, match="U\\+D800, a lone surrogate"):
        tok.encode("a\ud800")
    with pytest.raises(TokenizerError, match="not UTF-8"):
        tok.encode(b"\xff")


def test_chunks_and_the_cache_change_nothing(tok, tmp_path):
    """encode in 5-character chunks with a 3-piece cache gives the whole text's ids."""
    text = "the  thing\n\n  x  y\t\tz   aaa é 🙂 \n" * 3 + "end"
    whole = tok.encode(text).tolist()
    parts = list(bpe.chunks(text, 5))
    assert len(parts) > 5 and "".join(parts) == text
    fresh = BPETokenizer.from_folder(_write(tmp_path / "t"), chunk=5, cache_max=3)
    assert fresh.encode(text).tolist() == whole and 0 < fresh.cache_size <= 3


def test_one_long_piece_is_fast(tok):
    """20001 letters are one piece: a heap merge, not 10^4 rescans of 2 * 10^4 symbols."""
    assert tok.encode("a" * 20001).tolist() == [AA] * 10000 + [ord("a")]


def test_merges_file_variants_load_the_same(tmp_path, tok):
    lines = "".join(f"{a} {b}\r\n" for a, b in MERGES)
    for name, text in (("crlf", "#version: 0.2\r\n" + lines), ("bare", lines.rstrip())):
        other = BPETokenizer.from_folder(_write(tmp_path / name, merges_text=text))
        assert other.encode(" the thing").tolist() == tok.encode(" the thing").tolist()
    vocab = {t: i for i, t in enumerate(BYTE_TOKENS)}
    plain = BPETokenizer.from_folder(_write(tmp_path / "bytes", vocab=vocab, merges=[]))
    assert plain.eot is None and plain.encode("hé").tolist() == [104, 0xC3, 0xA9]
    empty = BPETokenizer.from_folder(_write(tmp_path / "empty", vocab=vocab, merges_text=""))
    assert empty.encode("hé").tolist() == [104, 0xC3, 0xA9]


def test_tokenizer_files(tmp_path):
    assert tokenizer_files(_write(tmp_path / "ok"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "vocab.json").write_text("{}")
    assert not tokenizer_files(tmp_path / "half")
    assert not tokenizer_files(tmp_path / "missing") and not tokenizer_files(None)


def _vocab(**changes):
    tokens = BYTE_TOKENS + ["".join(m) for m in MERGES]
    vocab = {t: i for i, t in enumerate(tokens)}
    vocab.update(changes)
    return vocab


def _merges(*lines):
    return "#version: 0.2\n" + "\n".join(lines) + "\n"


ERRORS = [   # (file, what to write, the message after "<path>: ")
    ("vocab.json", {"vocab_text": '{"a": 0,\n "b": 1\n "c": 2}'},
     "not JSON (line 3 column 2: Expecting ',' delimiter)"),
    ("vocab.json", {"vocab_text": "[1, 2]"}, "holds a JSON list, not an object"),
    ("vocab.json", {"vocab_text": '{"a": 0, "a": 1}'}, "token 'a' is listed twice"),
    ("vocab.json", {"vocab": _vocab(a="7")}, "token 'a' has id '7'; ids are integers"),
    ("vocab.json", {"vocab": _vocab(a=7)}, "id 7 is given to both"),
    ("vocab.json", {"vocab": _vocab(a=300)}, "token 'a' has id 300, outside 0..263"),
    ("vocab.json", {"vocab": {t: i for i, t in enumerate(BYTE_TOKENS[1:])}},
     "lacks the token 'Ā' of byte 0x00; a byte-level BPE vocabulary has all 256"),
    ("merges.txt", {"merges_text": _merges("Ġ t", "h e x")},
     "line 3 has 3 fields, expected 2"),
    ("merges.txt", {"merges_text": _merges("Ġ t", "", "h e")}, "line 3 has 0 fields"),
    ("merges.txt", {"merges_text": _merges("h zz")},
     "line 2: merge 'h zz' uses 'zz', which vocab.json lacks"),
    ("merges.txt", {"merges_text": _merges("e h")},
     "line 2: merge 'e h' makes 'eh', which vocab.json lacks"),
    ("merges.txt", {"merges_text": _merges("h e", "i n", "h e")},
     "line 4 repeats the merge 'h e' of line 2"),
]


@pytest.mark.parametrize("name, files, message", ERRORS, ids=[e[2][:24] for e in ERRORS])
def test_each_load_error_is_one_line_naming_the_file(tmp_path, name, files, message):
    folder = _write(tmp_path / "gpt2", **files)
    with pytest.raises(TokenizerError) as e:
        BPETokenizer.from_folder(folder)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{folder / name}: {message}"), text


def test_missing_files_and_folder(tmp_path):
    folder = _write(tmp_path / "gpt2")
    (folder / "merges.txt").unlink()
    with pytest.raises(TokenizerError, match="merges.txt: no such file; a GPT-2 tokenizer"):
        BPETokenizer.from_folder(folder)
    (folder / "vocab.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(TokenizerError, match="vocab.json: not UTF-8 text"):
        BPETokenizer.from_folder(folder)
    with pytest.raises(TokenizerError, match="nowhere: no such folder"):
        BPETokenizer.from_folder(tmp_path / "nowhere")
