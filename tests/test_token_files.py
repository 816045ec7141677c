"""Token files (nanoGPT's and llm.c's formats: minidist/train/token_files.py) and --init-from
(a GPT-2 folder's weights as the start of every layout: minidist/nn/pretrained.py
pretrained_weights, gpt_init's `weights`).

    python -m pytest -q tests/test_token_files.py
"""
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from minidist.nn import GPT, GPTConfig
from minidist.strategy import checkpoint
from minidist.strategy.checkpoint import CheckpointError
from minidist.train import token_files
from minidist.train.args import train_parser
from minidist.train.cli import UsageError, check_flags
from minidist.train.data import DataError, draw_batch
from minidist.train.loop import train
from minidist.train.token_files import TokenFiles, read_tokens, token_file_names
from minidist.train.bpe import bytes_to_unicode
from mpirun import ROOT, device_flags, logged_losses, mpi_env

SMALL = ["--block-size", "16", "--batch-size", "4", "--lr", "1e-2", "--eval-iters", "1",
         "--eval-every", "0", "--sample", "0", "--log-every", "1", "--threads", "1"]


def nanogpt_file(path, tokens):
    np.asarray(tokens, dtype=np.uint16).tofile(path)


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


def _gpt2_folder(tmp_path, vocab, seed, dtype="float32"):
    """A GPT-2 folder (config.json, model.safetensors) of a tiny model drawn from `seed`,
    and a folder of nanoGPT token files in its vocabulary."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=vocab),
                seed=seed, dtype=dtype)
    model.save_pretrained(str(tmp_path / "gpt2"))
    rng = np.random.default_rng(0)
    os.makedirs(tmp_path / "tokens")
    nanogpt_file(tmp_path / "tokens" / "train.bin", rng.integers(0, vocab, 5000))
    nanogpt_file(tmp_path / "tokens" / "val.bin", rng.integers(0, vocab, 500))
    return str(tmp_path / "gpt2"), str(tmp_path / "tokens")


def _train(flags):
    args = train_parser().parse_args(flags)
    check_flags(args)                        # as train_gpt.py: takes --init-from's sizes
    return train(args)


def test_init_from_a_folder_starts_where_the_seed_that_made_it_starts(tmp_path, corpus,
                                                                      device, capsys):
    """A run from a saved model's folder = a run from the seed that drew the model, bit for
    bit (float32 round-trips the folder exactly); the model flags come from the folder."""
    folder, _ = _gpt2_folder(tmp_path, 256, seed=5)
    common = SMALL + ["--steps", "3", "--seed", "5", "--data", corpus,
                      "--cache-dir", str(tmp_path / "c"), *device_flags(device)]
    _train(common + ["--n-layer", "2", "--n-head", "2", "--n-embd", "16",
                     "--log-json", str(tmp_path / "seed.jsonl")])
    capsys.readouterr()
    _train(common + ["--init-from", folder, "--log-json", str(tmp_path / "folder.jsonl")])
    assert logged_losses(tmp_path / "folder.jsonl") == logged_losses(tmp_path / "seed.jsonl")
    assert f"init: the weights of --init-from {folder} (wpe's first 16 positions)" in \
        capsys.readouterr().out
    with pytest.raises(CheckpointError, match=f"a GPT-2 folder, not a minidist checkpoint: "
                       f"start from its weights with --init-from {folder}"):
        checkpoint.verify(folder)


@pytest.mark.parametrize("flags, says", [
    (["--n-embd", "32"], r"--n-embd 32: its model has n_embd 16 \(--init-from"),
    (["--n-layer", "4"], "--n-layer 4: its model has n_layer 2"),     # 4: the flag's default
    (["--block-size", "64"], "--block-size 64: --init-from .* has 32 positions"),
    (["--block-size", "128"], "--block-size 128: --init-from .* has 32 positions"),
    (["--no-bias"], "--no-bias: its model has biases"),
    (["--moe-experts", "2"], "holds a dense model"),
])
def test_init_from_refuses_sizes_it_does_not_have(tmp_path, flags, says):
    """A size given on the command line must be the folder's (given with the flag's default
    value too); one left out is taken from it, --block-size at most its positions."""
    folder, tokens = _gpt2_folder(tmp_path, 256, seed=0)
    with pytest.raises(UsageError, match=says):
        check_flags(train_parser().parse_args(["--init-from", folder, *flags]))
    args = train_parser().parse_args(["--init-from", folder, "--n-head", "2"])
    check_flags(args)
    assert (args.n_layer, args.n_head, args.n_embd, args.block_size) == (2, 2, 16, 32)


def test_init_from_names_what_the_folder_is_instead(tmp_path):
    folder, tokens = _gpt2_folder(tmp_path, 256, seed=0)
    for path, says in ((tmp_path, "no config.json or model.safetensors there"),
                       (tmp_path / "none", "no such folder"),
                       (tmp_path / "gpt2" / "config.json", "is a file; give the folder")):
        with pytest.raises(UsageError, match=says):
            check_flags(train_parser().parse_args(["--init-from", str(path)]))
    os.remove(tmp_path / "gpt2" / "model.safetensors")
    (tmp_path / "gpt2" / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(UsageError, match="pytorch_model.bin are PyTorch pickles"):
        check_flags(train_parser().parse_args(["--init-from", folder]))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("step-00000001\n")
    with pytest.raises(UsageError, match=(  # a checkpoint starts a run (init_from.py): not
            r"--init-from \S+ckpt: \S+ckpt: latest names step-00000001, which is missing")):
        check_flags(train_parser().parse_args(["--init-from", str(tmp_path / "ckpt")]))


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


def test_init_from_needs_data_in_its_vocabulary(tmp_path, corpus):
    folder, tokens = _gpt2_folder(tmp_path, 50257, seed=0)
    with pytest.raises(UsageError, match="50,257-token vocabulary, --data .* 256 tokens"):
        _train(SMALL + ["--steps", "1", "--init-from", folder, "--data", corpus])
    with pytest.raises(UsageError, match="--cache-dir .* holds token files"):
        check_flags(train_parser().parse_args(["--data", tokens, "--cache-dir", "c"]))
    other = tmp_path / "bytes"                   # a byte-level model (export_gpt2.py of one)
    other.mkdir()
    folder, tokens = _gpt2_folder(other, 256, seed=0)
    os.remove(os.path.join(tokens, "val.bin"))
    nanogpt_file(os.path.join(tokens, "val.bin"), np.arange(88).repeat(6))
    os.remove(os.path.join(tokens, "train.bin"))
    nanogpt_file(os.path.join(tokens, "train.bin"), np.arange(88).repeat(60))
    (other / "tokens" / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 88}))
    with pytest.raises(UsageError, match=r"256-token vocabulary, --data .* 88 tokens .*; give "
                       r"--data text \(read as bytes, the vocabulary this model was trained "
                       r"in\)$"):               # (it said: or text with its vocab.json ...)
        _train(SMALL + ["--steps", "1", "--init-from", folder, "--data", tokens])


def test_init_from_every_layout_starts_from_the_folders_weights(tmp_path, mpi):
    """GPT-2's vocabulary, nanoGPT token files: one process, 4 ranks as tp 2 x pp 2 (each
    rank cuts its tp shard of its stage's parameters out of the folder) and 4 ranks as pp 2 x
    dp 2 under ZeRO-3 train to the same losses (float64, 1e-10).

        mpiexec -n 4 python examples/train_gpt.py --init-from gpt2 --data tokens --tp 2 --pp 2
    """
    folder, tokens = _gpt2_folder(tmp_path, 50257, seed=3)
    common = SMALL + ["--steps", "3", "--seed", "9", "--dtype", "float64", "--init-from",
                      folder, "--data", tokens]
    _train(common + ["--log-json", str(tmp_path / "one.jsonl"),
                     *device_flags(mpi.device)])
    want = logged_losses(tmp_path / "one.jsonl")
    assert len(want) == 3 and abs(want[0] - np.log(50257)) < 0.05      # a near-uniform start
    for n, layout in ((4, ["--tp", "2", "--pp", "2"]),
                      (4, ["--pp", "2", "--dp", "2", "--zero", "3"])):
        log = tmp_path / f"{'_'.join(layout)}.jsonl"
        mpi(n, "examples/train_gpt.py", *common, *layout, "--log-json", log, timeout=240)
        got = logged_losses(log)
        assert np.allclose(got, want, rtol=0, atol=1e-10), (layout, got, want)


def _bpe_files(folder):
    """A small GPT-2-style tokenizer in `folder`: the 256 byte characters (ids in byte
    order), a few merges that the test corpus uses, and <|endoftext|> last."""
    chars = [bytes_to_unicode()[b] for b in range(256)]
    merges = [("r", "e"), ("re", "t"), ("u", "r"), ("ret", "ur"), ("Ġ", "x"), ("d", "e"),
              ("de", "f")]
    vocab = {c: i for i, c in enumerate(chars)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return len(vocab)


def test_text_in_the_folders_bpe_fine_tunes_saves_and_samples(tmp_path, corpus, device):
    """--init-from a folder with vocab.json and merges.txt: the text is tokenized by its BPE
    (cached as uint16), the run samples text, and sample.py finds the tokenizer through the
    checkpoint's flags (recorded as absolute paths: --init-from is given relative here, and
    sample.py runs from another folder), or in a GPT-2 folder given as --resume."""
    folder = tmp_path / "gpt2"
    os.makedirs(folder)
    vocab = _bpe_files(folder)
    GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=vocab),
        seed=1).save_pretrained(str(folder))
    summary = _train(SMALL + ["--steps", "2", "--init-from", os.path.relpath(folder),
                              "--data", corpus,
                              "--cache-dir", str(tmp_path / "c"), "--sample", "12",
                              "--save", str(tmp_path / "ft"), *device_flags(device)])
    assert isinstance(summary["sample"], str) and summary["sample"]
    meta = json.load(open(next((tmp_path / "c").glob("*/meta.json"))))
    assert meta["tokenizer"] == f"bpe-{vocab}" and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == vocab
    text = open(corpus, "rb").read()
    assert meta["train_tokens"] + meta["val_tokens"] < 0.8 * len(text)   # merges took hold
    for resume in (tmp_path / "ft", folder):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "sample.py"),
                              "--resume", str(resume), "--tokens", "5", "--prompt", "def f",
                              *device_flags(device)],
                             cwd=tmp_path, env=mpi_env(), capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and out.stdout.startswith("def f"), out.stderr


def test_a_checkpoint_exports_as_a_gpt2_folder_that_starts_a_run(tmp_path, corpus, device):
    """examples/export_gpt2.py: a run's checkpoint (in a BPE's tokens) as a GPT-2 folder, its
    tokenizer files copied beside: the folder holds the checkpoint's parameters exactly and
    starts a new run (--init-from), whose first loss is the checkpoint's model's."""
    folder = tmp_path / "gpt2"
    os.makedirs(folder)
    vocab = _bpe_files(folder)
    GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=vocab),
        seed=1).save_pretrained(str(folder))
    common = SMALL + ["--data", corpus, "--cache-dir", str(tmp_path / "c"),
                      *device_flags(device)]
    _train(common + ["--steps", "3", "--init-from", str(folder), "--save", str(tmp_path / "ft")])
    for dtype in ("float32", "bfloat16"):
        out = subprocess.run([sys.executable, "examples/export_gpt2.py", "--resume",
                              str(tmp_path / "ft"), "--out", str(tmp_path / dtype), "--dtype",
                              dtype], cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and "vocab.json and merges.txt from" in out.stdout, \
            out.stderr
    params = checkpoint.load(tmp_path / "ft")[0]
    exported = GPT.from_pretrained(str(tmp_path / "float32")).state_dict()
    assert set(exported) == set(params)
    assert all(np.array_equal(exported[n], params[n]) for n in params)
    assert sorted(os.listdir(tmp_path / "float32")) == [
        "config.json", "merges.txt", "model.safetensors", "tokenizer_config.json",
        "vocab.json"]
    _train(common + ["--steps", "1", "--init-from", str(tmp_path / "float32"),
                     "--log-json", str(tmp_path / "next.jsonl")])
    first = logged_losses(tmp_path / "next.jsonl")[0]     # step 0 of the ft run was 5.52
    assert first < 5.3, first                            # the trained weights, not gpt2/'s
    half = GPT.from_pretrained(str(tmp_path / "bfloat16")).state_dict()   # widened back
    assert all(np.allclose(half[n], params[n], rtol=2 ** -8, atol=0) for n in params)
    other = tmp_path / "other"                  # a tokenizer of one token more
    os.makedirs(other)
    _bpe_files(other)
    with open(other / "vocab.json") as f:
        more = json.load(f)
    with open(other / "vocab.json", "w") as f:
        json.dump({**more, "extra": len(more)}, f)
    ft, exported = str(tmp_path / "ft"), str(tmp_path / "float32")
    for flags, says in ((["--out", corpus], f"--out {corpus}: is a file; give a folder"),
                        (["--out", "x", "--tokenizer", str(tmp_path)], "no vocab.json and"),
                        # found by a first-use walk (each wrote, or was a traceback)
                        (["--out", "/proc/zz"], "--out /proc/zz: cannot make the folder"),
                        (["--out", ft], f"--out {ft}: is the folder --resume reads"),
                        (["--resume", exported, "--out", ft], f"--out {ft}: holds minidist "
                         "checkpoints (a --save directory); give a new folder"),
                        (["--out", str(tmp_path / "c")], "which this does not write; give a "
                         "new or empty folder"),
                        (["--out", "x", "--tokenizer", str(other)], f"the tokenizer in "
                         f"--tokenizer {other} has {vocab + 1:,} tokens, the model {vocab:,}")):
        bad = subprocess.run([sys.executable, "examples/export_gpt2.py", "--resume", ft,
                              *flags], cwd=ROOT, env=mpi_env(), capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and says in bad.stderr, \
            bad.stderr


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
