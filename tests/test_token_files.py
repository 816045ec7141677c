"""Token files (nanoGPT's and llm.c's formats: minidist/train/token_files.py): found by name and
read in both formats, malformed files, windows inside one shard, the vocabulary's checks, ids
past the vocabulary, files given wrongly, ids written as int32, a resume on data of another
vocabulary. --init-from a GPT-2 folder: tests/test_init_from_gpt2.py.

    python -m pytest -q tests/test_token_files.py
"""
import os
import pickle

import numpy as np
import pytest

from minidist.train import token_files
from minidist.train.args import train_parser
from minidist.train.cli import UsageError, check_flags
from minidist.train.data import DataError, draw_batch
from minidist.train.token_files import TokenFiles, read_tokens, token_file_names
from mpirun import device_flags
from tests.token_files_cases import SMALL, _train, nanogpt_file


def llmc_file(path, tokens, version=1):
    header = np.zeros(256, np.int32)
    header[:3] = 20240520, version, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16 if version == 1 else np.uint32).tobytes())


def test_files_are_found_by_name_and_read_in_both_formats(tmp_path):
    assert token_file_names(str(tmp_path)) is None                 # no token files: text
    for name in ("a_train_000002.bin", "a_train_000001.bin", "a_val_000000.bin", "x.bin"):
        llmc_file(tmp_path / name, [1, 2, 3])
    assert token_file_names(str(tmp_path)) == {
        "train": ["a_train_000001.bin", "a_train_000002.bin"], "val": ["a_val_000000.bin"]}
    nanogpt_file(tmp_path / "n.bin", [5, 50256, 0])
    tokens, vocab, fmt = read_tokens(str(tmp_path / "n.bin"))
    assert tokens.tolist() == [5, 50256, 0] and vocab == 50257 and fmt.startswith("nanoGPT")
    tokens, vocab, fmt = read_tokens(str(tmp_path / "a_val_000000.bin"))
    assert tokens.tolist() == [1, 2, 3] and vocab == 50257 and fmt.startswith("llm.c")
    assert tokens.dtype == np.uint16 and isinstance(tokens, np.memmap)
    llmc_file(tmp_path / "l3.bin", [128000, 7], version=2)         # Llama 3: uint32 tokens
    tokens, vocab, _ = read_tokens(str(tmp_path / "l3.bin"))
    assert tokens.tolist() == [128000, 7] and vocab == 128256


@pytest.mark.parametrize("make, says", [
    (lambda p: llmc_file(p, [1, 2], version=3), "version 3"),
    (lambda p: (llmc_file(p, [1, 2, 3]), open(p, "ab").write(b"\0\0")), "header says 3 tokens"),
    (lambda p: open(p, "wb").write(b"\1\2\3"), "odd number"),
])
def test_a_malformed_token_file_is_one_error_naming_it(tmp_path, make, says):
    make(str(tmp_path / "train.bin"))
    with pytest.raises(DataError, match=says) as e:
        read_tokens(str(tmp_path / "train.bin"))
    assert str(tmp_path / "train.bin") in str(e.value) and "\n" not in str(e.value)


def test_windows_stay_inside_one_shard_and_one_shard_draws_as_text_data_did():
    a, b = np.arange(0, 100), np.arange(1000, 1040)        # two shards, told apart by value
    x, y = draw_batch([a, b], seed=3, split="train", step=0, batch_size=400, block_size=8)
    assert x.shape == y.shape == (400, 8) and np.array_equal(x[:, 1:], y[:, :-1])
    inside_a = (x < 100).all(1) & (y < 100).all(1)
    inside_b = (x >= 1000).all(1) & (y >= 1000).all(1)
    assert (inside_a | inside_b).all()                     # no window crosses the boundary
    assert np.all(np.diff(x, axis=1) == 1) and np.all(y[:, -1] - x[:, -1] == 1)
    # both shards drawn, in proportion to their windows (92 starts in a, 32 in b)
    assert 0.6 < inside_a.mean() < 0.87
    # one shard: the starts TokenData always drew, integers in [0, len - T - 1]
    rng = np.random.Generator(np.random.PCG64([3, 0, 5]))
    starts = rng.integers(0, 100 - 8, size=6)
    x1, _ = draw_batch([a], seed=3, split="train", step=5, batch_size=6, block_size=8)
    assert np.array_equal(x1[:, 0], starts)


def test_token_folder_vocabulary_checks_and_nanogpt_character_vocabulary(tmp_path):
    nanogpt_file(tmp_path / "train.bin", np.arange(400) % 65)
    nanogpt_file(tmp_path / "val.bin", np.arange(100) % 65)
    chars = "\n !$&',-.3:;?" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "abcdefghijklmnopqrstuvwxyz"
    with open(tmp_path / "meta.pkl", "wb") as f:                # as nanoGPT's data script
        pickle.dump({"vocab_size": 65, "itos": dict(enumerate(chars)),
                     "stoi": {c: i for i, c in enumerate(chars)}}, f)
    data = TokenFiles(str(tmp_path), token_file_names(str(tmp_path)))
    assert data.vocab_size == 65 and data.tokenizer.name == "chars"
    assert data.tokenizer.decode(data.tokenizer.encode("To be, or not")) == "To be, or not"
    assert data.meta == {"train_tokens": 400, "val_tokens": 100}
    assert abs(data.unigram_entropy - np.log(65)) < 0.01          # 400 tokens, near uniform
    x, y = data.get_batch(0, "val", 2, 3, 16)
    assert x.dtype == np.int64 and x.shape == (3, 16)

    with open(tmp_path / "meta.pkl", "wb") as f:               # a pickle that would run code
        pickle.dump({"vocab_size": 65, "itos": os.system}, f)
    with pytest.raises(DataError, match="only plain data is read"):
        TokenFiles(str(tmp_path), token_file_names(str(tmp_path)))
    with open(tmp_path / "meta.pkl", "wb") as f:       # numpy ids (walk 33: no word of how)
        pickle.dump({"vocab_size": np.int64(65), "itos": {np.int64(0): "a"}}, f)
    with pytest.raises(DataError, match=r"only plain data is read\); write vocab_size, itos "
                       r"and stoi as Python ints and strs \(int\(i\) for numpy integers\)"):
        TokenFiles(str(tmp_path), token_file_names(str(tmp_path)))

    os.remove(tmp_path / "meta.pkl")                            # GPT-2's vocabulary now
    nanogpt_file(tmp_path / "val.bin", [3, 60000, 4])
    with pytest.raises(DataError, match=r"val.bin: token id 60000 at position 1 is past the "
                       r"vocabulary \(50,257 tokens\)"):
        TokenFiles(str(tmp_path), token_file_names(str(tmp_path)))


def test_a_short_file_suggests_a_block_size_that_fits_unless_a_checkpoint_fixes_it(tmp_path):
    """The longest val file has 40 tokens: --block-size below 40; resumed (the block size
    is the checkpoint's), longer files instead (first-use walk 18)."""
    nanogpt_file(tmp_path / "train.bin", np.zeros(300, np.int64))
    nanogpt_file(tmp_path / "val.bin", np.zeros(40, np.int64))
    data = TokenFiles(str(tmp_path), token_file_names(str(tmp_path)))
    data.check_block_size(39)
    with pytest.raises(DataError, match="fewer than --block-size 64 [+] 1; give a --block-size "
                       "below 40$"):
        data.check_block_size(64)
    with pytest.raises(DataError, match=r"give a val file of more tokens \(--resume ck's "
                       r"block size cannot change\)$"):
        data.check_block_size(64, fixed="--resume ck")


def test_a_token_past_the_vocabulary_is_found_in_the_batch_that_reads_it(tmp_path,
                                                                         monkeypatch):
    """Past the part of the train files checked when the data is opened, each batch is
    checked as it is read; the val split is checked whole at open."""
    tokens = np.zeros(300, np.int64)
    tokens[250:] = 50300
    nanogpt_file(tmp_path / "train.bin", tokens)
    nanogpt_file(tmp_path / "val.bin", np.zeros(50))
    monkeypatch.setattr(token_files, "CHECKED_AT_OPEN", 100)
    monkeypatch.setattr(token_files, "ENTROPY_TOKENS", 100)
    data = TokenFiles(str(tmp_path), token_file_names(str(tmp_path)))
    with pytest.raises(DataError, match="train.bin: token id 50300 at position 250 is past"):
        for step in range(50):
            data.get_batch(0, "train", step, 8, 16)
    # the val split is checked whole when opened (first-use walk 33: an id past the first
    # 1M val tokens stopped the run at its first evaluation, the steps before it unsaved)
    nanogpt_file(tmp_path / "train.bin", np.zeros(300, np.int64))
    nanogpt_file(tmp_path / "val.bin", tokens)
    with pytest.raises(DataError, match="val.bin: token id 50300 at position 250 is past"):
        TokenFiles(str(tmp_path), token_file_names(str(tmp_path)))


def test_token_files_given_wrongly_are_refused(tmp_path):
    """The slips from nanoGPT: --data of one .bin file, a folder of .bin files named
    otherwise, two sets of files in one folder."""
    nanogpt_file(tmp_path / "train.bin", np.arange(100))
    nanogpt_file(tmp_path / "val.bin", np.arange(50))
    with pytest.raises(UsageError, match=f"give their folder, --data {tmp_path}"):
        check_flags(train_parser().parse_args(["--data", str(tmp_path / "train.bin")]))
    other = tmp_path / "other"
    other.mkdir()
    nanogpt_file(other / "data.bin", np.arange(100))
    with pytest.raises(UsageError, match="holds .bin files, none named as token files"):
        check_flags(train_parser().parse_args(["--data", str(other)]))
    nanogpt_file(tmp_path / "old_train.bin", np.arange(100))
    with pytest.raises(DataError, match="holds 2 sets of token files .*move all but one"):
        TokenFiles(str(tmp_path), token_file_names(str(tmp_path)))


def test_ids_written_as_int32_are_refused(tmp_path):
    """First-use walk 33: np.int32 ids tofile'd into train.bin were read as uint16, twice the
    tokens and every other one 0, without a word."""
    ids = np.arange(1, 200) % 700
    ids.astype(np.int32).tofile(tmp_path / "train.bin")
    ids.astype(np.uint16).tofile(tmp_path / "val.bin")
    with pytest.raises(DataError, match=r"train.bin: every other uint16 is 0: the ids look "
                       r"written as int32 or int64"):
        TokenFiles(str(tmp_path), token_file_names(str(tmp_path)))
    ids.astype(np.uint16).tofile(tmp_path / "train.bin")
    assert TokenFiles(str(tmp_path), token_file_names(str(tmp_path))).meta["train_tokens"] == 199


def test_a_resume_on_data_of_another_vocabulary_names_the_data(tmp_path, corpus, device):
    """First-use walk 33: a checkpoint trained in bytes, resumed on GPT-2 token files, was a
    "checkpoint config mismatch" about model flags nobody typed; now one line names --data,
    the two vocabularies and the data the run trained on. The files' digest (TokenFiles
    .digest) follows their tokens."""
    os.makedirs(tmp_path / "tokens")
    rng = np.random.default_rng(0)
    nanogpt_file(tmp_path / "tokens" / "train.bin", rng.integers(0, 50257, 3000))
    nanogpt_file(tmp_path / "tokens" / "val.bin", rng.integers(0, 50257, 300))
    _train(SMALL + ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--steps", "1",
                    "--data", corpus, "--cache-dir", str(tmp_path / "c"),
                    "--save", str(tmp_path / "ck"), *device_flags(device)])
    with pytest.raises(UsageError, match=(
            rf"--data {tmp_path / 'tokens'}: in a 50,257-token vocabulary \(nanoGPT \(uint16 "
            rf"tokens\)\); --resume \S+ holds a model of 256 tokens: give the data it was "
            rf"trained on \(text, read as bytes: --data {corpus}\)")):
        _train(SMALL + ["--steps", "2", "--data", str(tmp_path / "tokens"), "--resume",
                        str(tmp_path / "ck"), *device_flags(device)])
    names = token_file_names(str(tmp_path / "tokens"))
    before = TokenFiles(str(tmp_path / "tokens"), names).digest
    nanogpt_file(tmp_path / "tokens" / "val.bin", rng.integers(0, 50257, 300))
    assert TokenFiles(str(tmp_path / "tokens"), names).digest != before
