"""GPT-2's byte-level BPE tokenizer (minidist/train/bpe.py, trained by bpe_train.py) on a small
vocabulary built here:
the byte table, GPT-2's pre-tokenization pieces (worked out from the pattern), encodings worked
out by hand from the merge ranks (priority, not left to right), the heap merge against the
rescanning description, round trips, the chunked and cached paths, and each load error as
one line naming its file. No GPT-2 download is needed or used."""
import json
import random

import numpy as np
import pytest

from minidist.train import bpe, bpe_train
from minidist.train.bpe import (BPETokenizer, TokenizerError, bpe_merge, bytes_to_unicode,
                                pretokenize, tokenizer_files)

B2U = bytes_to_unicode()
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


def test_chunks_and_the_cache_change_nothing(tok, monkeypatch, tmp_path):
    text = "the  thing\n\n  x  y\t\tz   aaa é 🙂 \n" * 3 + "end"
    whole = tok.encode(text).tolist()
    parts = list(bpe._chunks(text, 5))
    assert len(parts) > 5 and "".join(parts) == text
    monkeypatch.setattr(bpe, "_CHUNK", 5)
    monkeypatch.setattr(bpe, "_CACHE_MAX", 3)
    fresh = BPETokenizer.from_folder(_write(tmp_path / "t"))
    assert fresh.encode(text).tolist() == whole and len(fresh._cache) <= 3


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


# ---- training (bpe_train.py, examples/train_tokenizer.py) -----------------------------------

def test_training_merges_the_most_frequent_pair_first_worked_by_hand():
    """'aaabdaaabac' is one piece. Its pairs: aa 4 (overlaps count), ab 2, bd, da, ba, ac 1:
    'aa' first; then [aa a b d aa a b a c]: (aa, a) and (a, b) 2 each, a tie, taken by string
    order, ('a', 'b') first; then (aa, ab) 2: 'aaab'; then nothing occurs twice, so 3 merges
    and a vocabulary short of the 300 asked, <|endoftext|> last. The trained tokenizer cuts
    the text as training did."""
    vocab, merges = bpe_train.train_bpe("aaabdaaabac", 300)
    assert merges == [("a", "a"), ("a", "b"), ("aa", "ab")]
    assert len(vocab) == 256 + 3 + 1 and vocab[bpe.EOT] == 259 and vocab["aaab"] == 258
    assert [B2U[b] for b in range(256)] == sorted(vocab, key=vocab.get)[:256]  # id b = byte b
    tok = BPETokenizer(vocab, merges)
    assert [tok.decode([i]) for i in tok.encode("aaabdaaabac")] == ["aaab", "d", "aaab", "a",
                                                                    "c"]
    vocab, merges = bpe_train.train_bpe("aaabdaaabac", 258)          # room for one merge only
    assert merges == [("a", "a")] and len(vocab) == 258
    with pytest.raises(TokenizerError, match="a vocabulary of 256 tokens cannot hold the 256 "
                       "bytes and 1 special"):
        bpe_train.train_bpe("abc", 256)


def test_a_trained_tokenizer_is_written_read_back_and_cuts_text_as_training_did(tmp_path,
                                                                                corpus):
    """Written as GPT-2's files are (read back through from_folder's checks), the trained
    tokenizer encodes its training text into the pieces training made: the merges replayed
    in rank order on each piece, every occurrence left to right (what training did to the
    whole text at once), give the same count of tokens as encode; decode gives the text
    back; a piece never seen (non-ASCII) still encodes, by its bytes."""
    text = open(corpus).read()
    vocab, merges = bpe_train.train_bpe(text, 300)
    bpe_train.write_tokenizer(str(tmp_path / "tok"), vocab, merges)
    tok = BPETokenizer.from_folder(str(tmp_path / "tok"))
    assert tok.vocab_size == len(vocab) == 300 and tok.eot == 299
    replayed = 0
    for piece in pretokenize(text):
        word = [B2U[b] for b in piece.encode("utf-8")]
        for pair in merges:
            out, i = [], 0
            while i < len(word):
                if word[i:i + 2] == list(pair):
                    out.append(pair[0] + pair[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            word = out
        replayed += len(word)
    ids = tok.encode(text)
    assert len(ids) == replayed < len(text) / 2 and tok.decode(ids) == text
    assert tok.decode(tok.encode("naïve café")) == "naïve café"
    again = bpe_train.train_bpe(text, 300)                  # deterministic: the same files again
    assert again == (vocab, merges)


def test_a_trained_tokenizer_trains_samples_and_exports(tmp_path, corpus, capsys):
    """examples/train_tokenizer.py on the corpus, then train_gpt.py --tokenizer: the model's
    vocabulary is the tokenizer's, the checkpoint resumes without --tokenizer (taken from
    it), sample.py finds it, export_gpt2.py copies it; nanoGPT-style uint16 files of its ids
    train with --tokenizer as their vocabulary (GPT-2's would be assumed without)."""
    import os
    import subprocess
    import sys
    from minidist.train.cli import UsageError
    from minidist.train.loop import train
    from tests.mpirun import ROOT, mpi_env, tiny_args as args
    tok = tmp_path / "tok"

    def run(script, *flags):
        out = subprocess.run([sys.executable, f"examples/{script}", *map(str, flags)],
                             cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout
    said = run("train_tokenizer.py", "--data", corpus, "--vocab-size", 300, "--out", tok)
    assert said.startswith(f"wrote {tok}: 300 tokens, 43 merges") and "bytes per token" in said

    cache = ["--cache-dir", str(tmp_path / "cache")]
    train(args("--data", corpus, *cache, "--tokenizer", str(tok), "--steps", "2", "--save",
               str(tmp_path / "ck")))
    # its name was GPT-2's ("gpt2-bpe"), in the log's data line and the cache's meta.json
    meta = json.load(open(next((tmp_path / "cache").glob("*/meta.json"))))
    assert meta["tokenizer"] == "bpe-300", meta
    assert " val bpe-300 tokens from 1 file(s), cache " in capsys.readouterr().out
    resumed = args("--data", corpus, *cache, "--resume", str(tmp_path / "ck"), "--steps", "3")
    assert resumed.tokenizer == str(tok)
    # found by a first-use walk: another tokenizer (here one of the same size from other
    # text) was taken silently, and --out replaced the tokenizer a checkpoint names
    other_text = tmp_path / "other.txt"
    other_text.write_text("".join(f"class C{i}:\n    pass\n\n" for i in range(300)))
    run("train_tokenizer.py", "--data", other_text, "--vocab-size", 300, "--out",
        tmp_path / "tok2")
    with pytest.raises(UsageError, match="--tokenizer .*tok2: --resume .* was trained with "
                       "the tokenizer of --tokenizer .*tok, whose vocabulary or merges differ"):
        args("--data", corpus, "--resume", str(tmp_path / "ck"), "--tokenizer",
             str(tmp_path / "tok2"))
    for out, says in ((tok, "holds a tokenizer already"),
                      (tmp_path / "ck", "holds minidist checkpoints")):
        bad = subprocess.run([sys.executable, "examples/train_tokenizer.py", "--data", corpus,
                              "--out", str(out)], cwd=ROOT, env=mpi_env(),
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and says in bad.stderr and bad.stderr.count("\n") == 1, \
            bad.stderr
    os.rename(tok, tmp_path / "moved")
    with pytest.raises(UsageError, match="was trained in the tokenizer of --tokenizer .*tok, "
                       "which holds no vocab.json and merges.txt now; give --tokenizer DIR"):
        args("--data", corpus, "--resume", str(tmp_path / "ck"))
    os.rename(tmp_path / "moved", tok)
    train(resumed)
    assert run("sample.py", "--resume", tmp_path / "ck", "--tokens", 5, "--prompt", "def ")
    assert "vocab.json and merges.txt from" in run("export_gpt2.py", "--resume",
                                                   tmp_path / "ck", "--out", tmp_path / "x")
    assert sorted(os.listdir(tmp_path / "x")) == ["config.json", "merges.txt",
                                                  "model.safetensors", "tokenizer_config.json",
                                                  "vocab.json"]
    # walk 38: AutoTokenizer went by a Llama folder's model_type to a tokenizer wanting
    # tokenizer.model; the folder names the class that reads vocab.json and merges.txt
    said = json.loads((tmp_path / "x" / "tokenizer_config.json").read_text())
    assert said["tokenizer_class"] == "GPT2Tokenizer" and said["eos_token"] == "<|endoftext|>"
    # and config.json names its id (it said null beside a BPE that has <|endoftext|>)
    eot = json.loads((tok / "vocab.json").read_text())["<|endoftext|>"]
    fields = json.loads((tmp_path / "x" / "config.json").read_text())
    assert fields["bos_token_id"] == fields["eos_token_id"] == eot
    # first-use walk 26: a GPT-2 folder exported again (here to bfloat16) lost its tokenizer
    # files, and sample.py refused the result: the folder read is looked in first
    assert f"vocab.json and merges.txt from {tmp_path / 'x'}\n" in run(
        "export_gpt2.py", "--resume", tmp_path / "x", "--out", tmp_path / "y", "--dtype",
        "bfloat16")
    assert sorted(os.listdir(tmp_path / "y")) == sorted(os.listdir(tmp_path / "x"))
    assert run("sample.py", "--resume", tmp_path / "y", "--tokens", 3)
    # and --tokenizer on a checkpoint trained in bytes: a late "config mismatch" naming --data
    train(args("--data", corpus, *cache, "--steps", "1", "--save", str(tmp_path / "bytes")))
    with pytest.raises(UsageError, match=r"--tokenizer .*tok: --resume .*bytes\S* was trained "
                       "without one, on a vocabulary of 256 tokens, and its 300 ids would "
                       "not fit the model; leave --tokenizer out"):
        args("--data", corpus, "--resume", str(tmp_path / "bytes"), "--tokenizer", str(tok),
             "--steps", "2")
    ids = BPETokenizer.from_folder(str(tok)).encode(open(corpus).read()).astype(np.uint16)
    os.makedirs(tmp_path / "bin")
    ids[:2000].tofile(tmp_path / "bin" / "train.bin")
    ids[2000:].tofile(tmp_path / "bin" / "val.bin")
    done = train(args("--data", str(tmp_path / "bin"), "--tokenizer", str(tok), "--steps", "1"))
    assert done["val_loss"] < 7                 # ln 300 = 5.7 at the start, not ln 50257 = 10.8
    with pytest.raises(UsageError, match="--tokenizer .*nowhere: no such folder"):
        args("--tokenizer", str(tmp_path / "nowhere"))


@pytest.mark.parametrize("text, says", [(None, "no such file"), ("", "the train part is empty")])
def test_train_tokenizer_checks_the_text_before_making_out(tmp_path, text, says):
    """    python examples/train_tokenizer.py --data empty.txt --out tok
    An empty corpus was a 257-token tokenizer written to a folder that is never replaced;
    a missing --data left an empty --out folder behind (first-use walk 33)."""
    import subprocess
    import sys
    from tests.mpirun import ROOT, mpi_env
    data = tmp_path / "text.txt"
    if text is not None:
        data.write_text(text)
    bad = subprocess.run([sys.executable, "examples/train_tokenizer.py", "--data", str(data),
                          "--out", str(tmp_path / "tok")], cwd=ROOT, env=mpi_env(),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and says in bad.stderr and bad.stderr.count("\n") == 1, \
        bad.stderr
    assert not (tmp_path / "tok").exists()


def test_train_tokenizer_names_what_it_left_out_and_text_not_utf8(tmp_path):
    """    python examples/train_tokenizer.py --data folder --out tok
    First-use walk 36: Latin-1 text was learnt as U+FFFD tokens and a binary file left out,
    neither said (train_gpt.py's data line says both): now two notes after the result."""
    import subprocess
    import sys
    from tests.mpirun import ROOT, mpi_env
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("the cat sat on the mat\n" * 50)
    (tmp_path / "text" / "b.txt").write_bytes("café très bon\n".encode("latin-1") * 50)
    (tmp_path / "text" / "c.bin").write_bytes(b"\0\1\2" * 10)
    out = subprocess.run([sys.executable, "examples/train_tokenizer.py", "--data",
                          str(tmp_path / "text"), "--vocab-size", "300", "--out",
                          str(tmp_path / "tok")], cwd=ROOT, env=mpi_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == "note: left out of --data: c.bin (binary)", lines
    assert lines[2].startswith("note: 100 character(s) of the text were not UTF-8 and were "
                               "learnt as U+FFFD"), lines
