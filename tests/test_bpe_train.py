"""Training a byte-level BPE tokenizer (minidist/train/bpe_train.py, examples/train_tokenizer.py):
the most frequent pair merged first, worked by hand; a trained tokenizer written, read back
and cutting text as GPT-2's would; one that trains, samples and exports; the text checked
before anything is made, and what was left out named. No GPT-2 download is needed or used."""
import json

import numpy as np
import pytest

from minidist.train import bpe, bpe_train
from minidist.train.bpe import BPETokenizer, TokenizerError, pretokenize
from tests.bpe_cases import B2U


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
