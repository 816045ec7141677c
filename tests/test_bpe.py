"""GPT-2's byte-level BPE (minidist/train/bpe.py) on a small vocabulary written here: no GPT-2
download is needed (none is reachable from CI), so the expected ids are worked out by hand
from the rules, in the comments.

    python -m pytest -q tests/test_bpe.py
"""
import json

import numpy as np
import pytest

from minidist.train.bpe import (BPETokenizer, TokenizerError, bpe_merge, bytes_to_unicode,
                                pretokenize, tokenizer_files)

MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("in", "g"), ("Ġt", "h"),
          ("b", "c"), ("a", "b")]


def _write(folder, merges=MERGES, vocab=None, header="#version: 0.2\n"):
    """vocab.json (the 256 byte characters as ids 0..255 in byte order, then each merge's
    result, then <|endoftext|>) and merges.txt in `folder`; returns the vocab."""
    if vocab is None:
        vocab = {bytes_to_unicode()[b]: b for b in range(256)}
        for a, b in merges:
            vocab.setdefault(a + b, len(vocab))
        vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text(header + "".join(f"{a} {b}\n" for a, b in merges),
                                       encoding="utf-8")
    return vocab


def test_the_byte_table_is_gpt2s():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert (table[ord(" ")], table[ord("\n")], table[ord("A")], table[0]) == \
        ("Ġ", "Ċ", "A", chr(256))                          # 0x00 is the first byte moved


def test_pretokenize_splits_as_gpt2s_pattern():
    # `\s+(?!\S)` leaves the last space of a run to the word after it: "  x" -> " ", " x";
    # a run of whitespace at the end stays whole
    assert pretokenize("Hello world's 123  x\n\n") == \
        ["Hello", " world", "'s", " 123", " ", " x", "\n\n"]
    assert pretokenize("I'll do-it!") == ["I", "'ll", " do", "-", "it", "!"]
    # \p{L} and \p{N} as Unicode's categories: '²' and '½' are numbers, 'é' a letter
    assert pretokenize("x²½ café") == ["x", "²½", " café"]
    text = "a\u00a0b\u3000c \t\r\nd"                       # non-ASCII white space too
    assert "".join(pretokenize(text)) == text


def test_merges_apply_by_rank_not_left_to_right():
    ranks = {pair: r for r, pair in enumerate(MERGES)}
    # "abc": (b, c) has rank 6, (a, b) rank 7: rank order merges "bc" first, so "a" + "bc";
    # a greedy left-to-right pass would have made "ab" + "c"
    assert bpe_merge(list("abc"), ranks) == ["a", "bc"]
    # " the": Ġt (0), then he (1), then Ġt + he (2)
    assert bpe_merge(["Ġ", "t", "h", "e"], ranks) == ["Ġthe"]
    # " thing": Ġt (0), in (3), ing (4), then Ġt + h (5); no rank for Ġth + ing
    assert bpe_merge(["Ġ", "t", "h", "i", "n", "g"], ranks) == ["Ġth", "ing"]
    # every occurrence of a pair at its rank, left to right: "a a a" with "a a" -> "aa a"
    assert bpe_merge(["a", "a", "a"], {("a", "a"): 0}) == ["aa", "a"]


def test_encode_and_decode(tmp_path):
    vocab = _write(tmp_path)
    assert tokenizer_files(str(tmp_path)) and not tokenizer_files(str(tmp_path / "no"))
    tok = BPETokenizer.from_folder(str(tmp_path))
    assert tok.vocab_size == len(vocab) and tok.eot == vocab["<|endoftext|>"]
    ids = tok.encode(" the thing")
    assert ids.dtype == np.int64
    assert ids.tolist() == [vocab["Ġthe"], vocab["Ġth"], vocab["ing"]]
    assert tok.encode("abc").tolist() == [vocab["a"], vocab["bc"]]
    for text in ["def f(x):\n    return x * 2\n", "naïve café, 中文, 🙂", "  \t\n\n end ",
                 "it's 2026, we'll see", "<|endoftext|>"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eot not in tok.encode("<|endoftext|>").tolist()      # plain text in encode
    assert tok.decode([tok.eot]) == "<|endoftext|>"
    first_byte_of_e_acute = tok.encode("é")[:1]                     # 0xc3 alone: not UTF-8
    assert tok.decode(first_byte_of_e_acute) == "\ufffd"
    with pytest.raises(TokenizerError, match="id 999 is out of range"):
        tok.decode([1, 999])
    big = "The quick brown fox, the thing. " * 40000            # > 1M characters: chunked
    assert tok.decode(tok.encode(big)) == big


@pytest.mark.parametrize("break_it, says", [
    (lambda d: (d / "vocab.json").write_text("{\"a\": 0,"), "vocab.json: not JSON"),
    (lambda d: (d / "vocab.json").unlink(), "vocab.json: no such file"),
    (lambda d: (d / "merges.txt").write_text("#version: 0.2\nĠ t x\n"),
     "merges.txt: line 2 has 3 fields, expected 2"),
    (lambda d: (d / "merges.txt").write_text("#version: 0.2\nq z\n"),
     "merges.txt: line 2: merge 'q z' makes 'qz', which vocab.json lacks"),
    (lambda d: _write(d, vocab={"a": 0, "b": 1}), "vocab.json: lacks the token"),
    (lambda d: _write(d, vocab={**{bytes_to_unicode()[b]: b for b in range(256)}, "x1": 5}),
     "vocab.json: id 5 is given to both"),
])
def test_bad_files_are_one_line_naming_the_file(tmp_path, break_it, says):
    _write(tmp_path)
    break_it(tmp_path)
    with pytest.raises(TokenizerError, match=says) as e:
        BPETokenizer.from_folder(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)
