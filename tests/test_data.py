"""Data: byte tokenizer, file and folder sources, the cache beside the data (or in the home
cache when that is read-only), the train/val split, and batches as a pure function of
(seed, split, step); one tokenizing per node (data_open.py)."""
import json
import os
import resource
import subprocess
import sys

import numpy as np
import pytest

from minidist.train.data import ByteTokenizer, DataError, TokenData
from minidist.train.data_files import list_files
from tests.mpirun import ROOT


def _folder(tmp_path, n_files, size=400):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    for i in range(n_files):
        where = d / "sub" if i % 2 else d
        (where / f"f{i:02d}.txt").write_text(f"# file {i}\n" + "abc def\n" * (size // 8))
    (d / ".hidden").write_text("never read")
    return d


def test_byte_tokenizer_round_trip_including_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("def f():\n    return 'é'")
    assert ids.dtype == np.int64 and ids.max() < 256 and tok.vocab_size == 256
    assert tok.decode(ids) == "def f():\n    return 'é'"


def test_single_file_is_split_by_its_tail_and_cached_beside_it(tmp_path):
    path = tmp_path / "input.txt"
    path.write_text("hello world\n" * 100)                      # 1200 bytes
    data = TokenData(str(path))
    assert data.meta["train_tokens"] == 1080 and data.meta["val_tokens"] == 120
    assert data.cache.startswith(str(tmp_path / ".minidist-cache"))
    assert os.path.isfile(os.path.join(data.cache, "train.bin"))
    assert isinstance(data.splits["train"], np.memmap)
    again = TokenData(str(path))                                # reuses the cache
    assert again.cache == data.cache
    path.write_text("changed\n" * 100)
    os.utime(path, ns=(1, 1))
    assert TokenData(str(path)).cache != data.cache            # edited data: new cache
    edited = TokenData(str(path))
    path.write_text("CHANGED\n" * 100)                          # the same size: the mtime
    os.utime(path, ns=(2, 2))                                   # tells the edit apart
    again = TokenData(str(path))
    assert again.cache != edited.cache and again.built
    assert bytes(again.splits["train"][:8]) == b"CHANGED\n"


def test_folder_holds_out_whole_files_and_skips_hidden(tmp_path):
    d = _folder(tmp_path, 30)
    root, files, _ = list_files(str(d))
    assert len(files) == 30 and not any(".hidden" in f for f in files)
    assert "sub/f01.txt" in files
    data = TokenData(str(d))
    total = sum(os.path.getsize(os.path.join(root, f)) for f in files)
    assert data.meta["train_tokens"] + data.meta["val_tokens"] == total
    assert 0 < data.meta["val_tokens"] < total / 2


def test_read_only_folder_caches_in_home_cache(tmp_path, monkeypatch):
    if os.geteuid() == 0:
        monkeypatch.setattr(os, "access", lambda *a, **k: False)   # root ignores chmod
    d = _folder(tmp_path, 3)
    os.chmod(d, 0o555)
    monkeypatch.setenv("MINIDIST_CACHE", str(tmp_path / "home-cache"))
    try:
        data = TokenData(str(d))
    finally:
        os.chmod(d, 0o755)
    assert data.cache.startswith(str(tmp_path / "home-cache"))


def test_batches_are_a_pure_function_of_seed_split_step(tmp_path):
    path = tmp_path / "input.txt"
    path.write_bytes(bytes(range(1, 256)) * 20)              # (no NUL: a text file)
    data = TokenData(str(path), cache_dir=str(tmp_path / "c"))
    x, y = data.get_batch(1, "train", 5, batch_size=4, block_size=8)
    x2, y2 = TokenData(str(path), cache_dir=str(tmp_path / "c")).get_batch(1, "train", 5, 4, 8)
    assert x.shape == y.shape == (4, 8) and x.dtype == np.int64
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    assert np.array_equal(y[:, :-1], x[:, 1:])                  # y is x shifted by one
    assert np.array_equal((x[:, 1:] - x[:, :-1]) % 255, np.ones((4, 7)))
    assert not np.array_equal(x, data.get_batch(1, "train", 6, 4, 8)[0])
    assert not np.array_equal(x, data.get_batch(2, "train", 5, 4, 8)[0])
    assert not np.array_equal(x, data.get_batch(1, "val", 5, 4, 8)[0])


def test_default_corpus_is_the_stdlib_python_sources():
    root, files, _ = list_files(None)
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f for f in files)
    assert "os.py" in files


def test_binary_files_are_not_text(tmp_path):
    """A file with NUL bytes (a checkpoint's safetensors, a token .bin, an image) given as
    --data is refused by name; in a folder such files are left out (grep -I's rule), and a
    folder of nothing else is refused saying so. (They trained as bytes of "text", and wrote
    a .minidist-cache into a checkpoint folder.)"""
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00{}" + bytes(64))
    with pytest.raises(DataError, match=r"model.safetensors: not a text file \(it holds NUL "
                                        r"bytes\); give a text file"):
        list_files(str(tmp_path / "model.safetensors"))
    with pytest.raises(DataError, match=r"no text files found \(left out: model.safetensors "
                                        r"\(binary\)\)"):
        list_files(str(tmp_path))
    (tmp_path / "npy").mkdir()                      # pre-tokenized numpy arrays (walk 33)
    np.save(tmp_path / "npy" / "train.npy", np.arange(100, dtype=np.uint16))
    with pytest.raises(DataError, match=r"\(binary\)\); train.npy: numpy files are not read: "
                       r"write the token ids as bare uint16 train.bin and val.bin"):
        list_files(str(tmp_path / "npy"))
    (tmp_path / "notes.txt").write_text("some text\n")
    assert list_files(str(tmp_path))[:2] == (str(tmp_path), ["notes.txt"])


def test_bad_data_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no such file or directory"):
        TokenData(str(tmp_path / "missing.txt"))
    (tmp_path / "text.txt").write_text("some text\n" * 20)
    with pytest.raises(DataError, match=r"cannot cache the tokenized text in /proc/self \("
                       r".*\): give --cache-dir a folder you can write to"):  # (was OSError)
        TokenData(str(tmp_path / "text.txt"), "/proc/self")   # a folder even root can't write
    # a disk that fills while the cache is written (walk 37: a traceback, exit 1): the file
    # size limit of a child process stands for it (Python ignores SIGXFSZ: EFBIG)
    (tmp_path / "long.txt").write_text("some longer text\n" * 2000)     # 34,000 bytes
    code = ("from minidist.train.data import DataError, TokenData\n"
            "try:\n    TokenData(%r, %r)\nexcept DataError as e:\n    print(e)\n"
            % (str(tmp_path / "long.txt"), str(tmp_path / "cache")))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, preexec_fn=lambda: resource.setrlimit(
                             resource.RLIMIT_FSIZE, (4096, 4096)))
    assert out.returncode == 0 and out.stdout.startswith(
        f"cannot cache the tokenized text in {tmp_path / 'cache'} (File too large): give "
        "--cache-dir a folder with room for 33 KiB"), (out.stdout, out.stderr)
    assert not list((tmp_path / "cache").glob(".build-*"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text files"):
        TokenData(str(tmp_path / "empty"))
    small = tmp_path / "small.txt"
    small.write_text("tiny text here\n")
    data = TokenData(str(small))
    with pytest.raises(DataError, match="fewer than block_size"):
        data.get_batch(0, "val", 0, 2, 64)
    data.check_block_size(1)                      # 13 train tokens, 2 val tokens: both fit
    with pytest.raises(DataError, match="the val split has 2 tokens, fewer than --block-size "
                       "12 [+] 1; give more text$"):   # (walk 33: not "--block-size below 2")
        data.check_block_size(12)
    with pytest.raises(DataError, match="the val split has 2 tokens"):   # the shorter one,
        data.check_block_size(2)         # not the train split's "below 13", then val's
    with pytest.raises(DataError, match=r"give more text \(--resume ck's block size cannot "
                       r"change\)$"):       # first-use walk 18: not a --block-size it refuses
        data.check_block_size(12, fixed="--resume ck")
    (tmp_path / "three.txt").write_text("abc")   # 2 train tokens, 1 val: no size fits
    with pytest.raises(DataError, match="the val split has 1 token, fewer than --block-size "
                       r"1 \+ 1; give more text \(each split needs at least 2 tokens\)"):
        TokenData(str(tmp_path / "three.txt")).check_block_size(1)
    (tmp_path / "void.txt").write_text("")
    with pytest.raises(DataError, match=r"the train split is empty \(1 file\(s\): 0 train / "
                       r"0 val tokens\); give more text"):
        TokenData(str(tmp_path / "void.txt"))


def test_held_out_files_fall_back_to_each_files_tail(tmp_path):
    """20+ files: whole files go to val by a hash of their names, unless that picks none or
    more than 30% of the text; then each file's last 10% does, and the start-up line says
    which (first-use walk 33: one big file among 19 small ones trained on 114 tokens and
    held 417,540 out; 20 names that all hashed to train were "the val split is empty")."""
    import zlib
    from minidist.train.data_files import split_files
    names = [f"doc{i:03d}.txt" for i in range(40)]
    held = [n for n in names if zlib.crc32(n.encode()) % 10 == 0]
    kept = [n for n in names if n not in held]
    assert held and len(kept) >= 20
    for case, files, big in (("even", names, None), ("none held", kept[:20], None),
                             ("big held", held + kept[:19], held[0])):
        d = tmp_path / case
        d.mkdir()
        for n in files:
            (d / n).write_text(("x" * 999 + "\n") * (100 if n == big else 1))
        train, val, rule = (b"".join(docs) if isinstance(docs, list) else docs
                            for docs in split_files(str(d), sorted(files)))
        if case == "even":
            assert rule == f"{len(held)} of 40 files held out"
            assert len(val) == 1000 * len(held) and len(train) == 1000 * (40 - len(held))
        else:
            assert rule.startswith("the last 10% of each file (")
            assert len(val) == pytest.approx(0.1 * (len(train) + len(val)), abs=len(files))
        data = TokenData(str(d), cache_dir=str(tmp_path / "cache"))
        assert f"val split: {rule}" in data.describe()


def test_odd_folder_entries_and_a_damaged_cache(tmp_path):
    """First-use walk 33: a dangling link was a traceback per rank and a named pipe a hang
    (both skipped now); a Latin-1 file name a UnicodeEncodeError (hashed as bytes); a cut
    inside a UTF-8 character gave both splits a U+FFFD; a cache missing a file was a
    traceback, a truncated one trained silently (both one error line now)."""
    from minidist.train.data_files import split_files, utf8_boundary
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "ok.txt").write_text("hello world\n" * 50)
    os.symlink(tmp_path / "nowhere.txt", d / "broken.txt")
    os.mkfifo(d / "pipe.txt")
    with open(os.path.join(os.fsencode(d), b"caf\xe9.txt"), "wb") as f:
        f.write(b"latin one\n" * 50)
    data = TokenData(str(d), cache_dir=str(tmp_path / "cache"))
    assert data.meta["files"] == 2
    text = "日本語".encode() * 10                          # 90 bytes of 3-byte characters
    assert utf8_boundary(text, 80) == 78 and utf8_boundary(text, 81) == 81
    (tmp_path / "cjk").mkdir()
    (tmp_path / "cjk" / "a.txt").write_bytes(text)
    (train,), (val,), _ = split_files(str(tmp_path / "cjk"), ["a.txt"])
    assert train.decode() + val.decode() == text.decode() + "\n"
    os.remove(os.path.join(data.cache, "val.bin"))
    with pytest.raises(DataError, match=r"cache .* is damaged \(val.bin is missing\); delete"):
        TokenData(str(d), cache_dir=str(tmp_path / "cache"))
    with open(os.path.join(data.cache, "val.bin"), "wb") as f:
        f.write(b"x")
    with pytest.raises(DataError, match=r"val.bin holds 1 bytes, meta.json says"):
        TokenData(str(d), cache_dir=str(tmp_path / "cache"))
    (tmp_path / "only").mkdir()
    os.symlink(tmp_path / "nowhere.txt", tmp_path / "only" / "broken.txt")
    with pytest.raises(DataError, match=r"left out: broken.txt \(a broken link or special "
                                        r"file\)\)"):
        TokenData(str(tmp_path / "only"))


def test_the_data_line_names_what_a_folder_left_out(tmp_path):
    """First-use walk 33: a UTF-16 file (Notepad's) was "not a text file" and in a folder
    dropped without a word; a checkpoint's or a tokenizer's text files inside --data were
    trained on. Now UTF-16 says to re-encode, and the data line names what was left out."""
    d = tmp_path / "corpus"
    (d / "ck" / "step-00000001").mkdir(parents=True)
    (d / "tok").mkdir()
    (d / "a.txt").write_text("hello world\n" * 50)
    (d / "win.txt").write_bytes("hello\n".encode("utf-16"))
    (d / "ck" / "latest").write_text("step-00000001")
    (d / "tok" / "vocab.json").write_text("{}")
    (d / "tok" / "merges.txt").write_text("#version: 0.2\n")
    data = TokenData(str(d), cache_dir=str(tmp_path / "cache"))
    assert data.meta["files"] == 1
    said = data.describe()
    assert "from 1 file(s)" in said and "left out: win.txt (UTF-16/32 text); ck (a " \
        "checkpoint); tok (a tokenizer)" in said, said
    with pytest.raises(DataError, match="UTF-16/32 text: re-encode it as UTF-8"):
        TokenData(str(d / "win.txt"))


def test_a_bpe_of_text_that_is_not_utf8_says_so(tmp_path):
    """First-use walk 33: Latin-1 text under --tokenizer turned every accented letter into
    U+FFFD without a word; the data line now counts them and says to re-encode."""
    from minidist.train.data_files import not_utf8
    assert not_utf8("café".encode()) == 0 and not_utf8("café".encode("latin-1")) == 1
    assert not_utf8("a\ufffd".encode() + b"\xe9") == 1         # a real U+FFFD is not counted


@pytest.mark.mpi
def test_one_rank_per_node_tokenizes_and_errors_are_agreed(corpus, tmp_path, mpi):
    """open_data_shared (minidist/train/data_open.py): on one node only local rank 0
    tokenizes the text and writes the cache; the others map it (first-use walk 33: every
    rank tokenized the whole text itself). A rank whose --data is missing (a node without
    the file: rank 2, which opens second, or rank 0, which tokenizes first while the others
    wait with no timeout) makes every rank raise that rank's error, the same line on all,
    so none is left waiting in a collective.

        mpiexec -n 3 python tests/scripts/data_open_check.py --data D --out O --cache-dir C
    """
    def run(name, *flags):
        out = tmp_path / name
        out.mkdir()
        mpi(3, "tests/scripts/data_open_check.py", "--data", corpus, "--out", out,
            "--cache-dir", tmp_path / name / "cache", *flags, timeout=120)
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]

    rows = run("all")
    assert [r["built"] for r in rows] == [True, False, False], rows
    assert len({r["train_tokens"] for r in rows}) == 1, rows
    for missing in ("2", "0"):
        rows = run(f"missing{missing}", "--missing-on-rank", missing)
        assert len({r.get("error") for r in rows}) == 1, rows
        assert f"--data {corpus}.not-on-this-node: no such file" in rows[0]["error"], rows
    other = tmp_path / "other.txt"                 # a node whose copy differs (walk 36)
    other.write_text(open(corpus).read().replace("return", "yield"))
    rows = run("other", "--other", other, "--other-on-rank", "1")      # (rank 1's path is
    assert all("the ranks read other contents (their digests: " in r.get("error", "")  # its
               for r in rows), rows                                     # own: here another)
    assert " on ranks 0, 2; " in rows[0]["error"] and "do the nodes' copies differ?" in \
        rows[0]["error"], rows


def test_each_document_ends_with_the_bpes_end_of_text(tmp_path):
    """Under a BPE with <|endoftext|>, each file's part of a split ends with that token, as
    nanoGPT's and llm.c's data scripts end each document (first-use walk 33: a folder's
    files ran into each other); in bytes, files are joined, each ending in a newline. The
    cache's digest follows the tokens (a resume compares it: resume.py)."""
    from minidist.train import bpe_train
    from minidist.train.bpe import BPETokenizer
    d = tmp_path / "docs"
    d.mkdir()
    texts = {"a.txt": "the cat sat on the mat\n" * 20, "b.txt": "a dog ran in the fog\n" * 20}
    for name, text in texts.items():
        (d / name).write_text(text)
    vocab, merges = bpe_train.train_bpe("".join(texts.values()), 300)
    bpe_train.write_tokenizer(str(tmp_path / "tok"), vocab, merges)
    tok = BPETokenizer.from_folder(str(tmp_path / "tok"))
    data = TokenData(str(d), cache_dir=str(tmp_path / "cache"), tokenizer=tok)
    train, val = (np.asarray(data.splits[s]) for s in ("train", "val"))
    assert list(np.flatnonzero(train == tok.eot)) != [] and train[-1] == val[-1] == tok.eot
    ends = np.flatnonzero(train == tok.eot)
    first = tok.decode(train[:ends[0]])
    assert len(ends) == 2 and texts["a.txt"].startswith(first) and first.endswith("\n")
    assert tok.decode(train[ends[0] + 1:ends[1]]).startswith("a dog ran")
    assert tok.decode(val).count("<|endoftext|>") == 2
    raw = TokenData(str(d), cache_dir=str(tmp_path / "cache"))        # bytes: no such token
    assert bytes(np.asarray(raw.splits["train"])).decode().startswith(first + "a dog ran")
    assert len({data.meta["digest"], raw.meta["digest"]}) == 2


def test_what_a_run_writes_may_not_go_inside_its_text_folder(tmp_path):
    """    python examples/train_gpt.py --data corpus --log-json corpus/run.jsonl
    First-use walk 36: the log became training text of the next run (and its resume said the
    data had changed); --trace and --cache-dir too. A hidden folder is not read: allowed."""
    from minidist.train.args import train_parser
    from minidist.train.cli import UsageError, check_flags
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("some text\n" * 20)
    for flag, path in (("--log-json", "run.jsonl"), ("--trace", "t.json"),
                       ("--cache-dir", "cache")):
        where = str(tmp_path / "corpus" / path)
        with pytest.raises(UsageError, match=rf"^{flag} {where}: inside --data .*corpus, "
                           "whose files are the text trained on"):
            check_flags(train_parser().parse_args(["--data", str(tmp_path / "corpus"), flag,
                                                   where]))
    with pytest.raises(UsageError, match="^--cache-dir .*corpus: inside --data"):   # itself
        check_flags(train_parser().parse_args(["--data", str(tmp_path / "corpus"),
                                               "--cache-dir", str(tmp_path / "corpus")]))
    check_flags(train_parser().parse_args(["--data", str(tmp_path / "corpus"), "--cache-dir",
                                           str(tmp_path / "corpus" / ".cache")]))


def test_a_linked_folder_is_read_once(tmp_path):
    """First-use walk 33 and 36: a symlinked folder inside --data was skipped without a word.
    Now read, as a linked file is; a link back to a folder read already (a loop) is left out
    and named."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text("linked text\n" * 10)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("own text\n" * 10)
    os.symlink(tmp_path / "docs", tmp_path / "corpus" / "linkdir")
    os.symlink(tmp_path / "corpus", tmp_path / "corpus" / "loop")
    root, files, skipped = list_files(str(tmp_path / "corpus"))
    assert files == ["a.txt", os.path.join("linkdir", "b.txt")], files
    assert skipped == [("loop", "a link to a folder read already")], skipped


def test_a_files_train_part_ends_a_line_near_its_90_percent():
    """data_files.cut_point: the 90% cut moves back to a line's start, at most 4 KiB and 5%
    of the file (a review: a title line before a long paragraph kept 8 of 3,009 bytes for
    training), else to a UTF-8 character's start."""
    from minidist.train.data_files import cut_point
    lines = b"".join(b"line %03d of the text\n" % i for i in range(100))     # 2,100 bytes
    cut = cut_point(lines)
    assert lines[cut - 1:cut] == b"\n" and 0.85 * len(lines) <= cut <= 0.9 * len(lines)
    titled = b"Title\n" + b"word " * 600 + b"\n"                             # one paragraph
    assert cut_point(titled) == int(0.9 * len(titled))          # not back to the title
    wide = "日本語".encode() * 100                                             # no newline
    assert cut_point(wide) % 3 == 0 and cut_point(wide) <= int(0.9 * len(wide))
