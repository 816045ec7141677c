"""--init-from a GPT-2 folder (its weights as the start of every layout: minidist/nn/pretrained.py
pretrained_weights, gpt_init's `weights`): a run from the seed that drew it, bit for bit; the
sizes and folders it refuses; the folder's BPE fine-tuned, saved and sampled; a checkpoint
exported as a GPT-2 folder that starts a run (examples/export_gpt2.py).

    python -m pytest -q tests/test_init_from_gpt2.py
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
from minidist.train.args import train_parser
from minidist.train.cli import UsageError, check_flags
from minidist.train.bpe import bytes_to_unicode
from mpirun import ROOT, device_flags, logged_losses, mpi_env
from tests.token_files_cases import SMALL, _train, nanogpt_file


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
    rank cuts its tp shard of its stage's parameters out of the folder), 4 ranks as pp 2 x
    dp 2 and as tp 2 x dp 2 under ZeRO-3, and 2 ranks of ZeRO-3 (each unit's weights, its
    tp shards, taken from the folder's as the model or this rank's part is built on
    placeholders: minidist/zero/strategy.py wrap_unbuilt) train to the same losses (float64,
    1e-10).

        mpiexec -n 4 python examples/train_gpt.py --init-from gpt2 --data tokens --tp 2 --pp 2
        mpiexec -n 2 python examples/train_gpt.py --init-from gpt2 --data tokens --zero 3
    """
    folder, tokens = _gpt2_folder(tmp_path, 50257, seed=3)
    common = SMALL + ["--steps", "3", "--seed", "9", "--dtype", "float64", "--init-from",
                      folder, "--data", tokens]
    _train(common + ["--log-json", str(tmp_path / "one.jsonl"),
                     *device_flags(mpi.device)])
    want = logged_losses(tmp_path / "one.jsonl")
    assert len(want) == 3 and abs(want[0] - np.log(50257)) < 0.05      # a near-uniform start
    for n, layout in ((4, ["--tp", "2", "--pp", "2"]),
                      (4, ["--pp", "2", "--dp", "2", "--zero", "3"]),
                      (4, ["--tp", "2", "--dp", "2", "--zero", "3"]), (2, ["--zero", "3"])):
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
