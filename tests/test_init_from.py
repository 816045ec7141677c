"""A new run from a minidist checkpoint (--init-from CKPT: minidist/train/init_from.py), and
the model's own tokenizer kept with it (minidist/train/model_tokenizer.py): first-use walks
33 and 36 fine-tuned, sampled and exported in another tokenizer of the same size without a
word, and were sent to --resume, which continued the old run.

Run: python -m pytest -q tests/test_init_from.py
"""
import json
import os
import subprocess
import sys

import pytest

from minidist.train import bpe_train
from minidist.train.cli import UsageError
from minidist.train.loop import train
from tests.mpirun import ROOT, mpi_env, tiny_args


def _script(script, *flags):
    return subprocess.run([sys.executable, f"examples/{script}", *map(str, flags)],
                          cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def base(tmp_path_factory, corpus):
    """A folder with `tok` (a 300-token BPE of the corpus), `same_size` (its vocabulary with
    its last two merges swapped: the same size, other ids), `ck` (2 steps trained in `tok`)
    and `x` (ck exported as a GPT-2 folder with tok's files)."""
    tmp = tmp_path_factory.mktemp("init_from")
    vocab, merges = bpe_train.train_bpe(open(corpus).read(), 300)
    bpe_train.write_tokenizer(str(tmp / "tok"), vocab, merges)
    bpe_train.write_tokenizer(str(tmp / "same_size"), vocab, merges[:-2] + merges[-2:][::-1])
    train(tiny_args("--data", corpus, "--cache-dir", str(tmp / "cache"), "--tokenizer",
                str(tmp / "tok"), "--steps", "2", "--save", str(tmp / "ck")))
    out = _script("export_gpt2.py", "--resume", tmp / "ck", "--out", tmp / "x")
    assert out.returncode == 0, out.stderr
    return tmp


def test_another_tokenizer_of_the_same_size_is_refused(base, corpus):
    """sample.py and export_gpt2.py (which would write it beside the model) with a
    --tokenizer that is not the checkpoint's; --init-from a folder or a checkpoint with one."""
    for script, *flags in (("sample.py", "--tokens", 3), ("export_gpt2.py", "--out",
                                                           base / "z")):
        bad = _script(script, "--resume", base / "ck", "--tokenizer", base / "same_size",
                      *flags)
        assert bad.returncode == 2 and bad.stderr.startswith(
            f"error: --tokenizer {base / 'same_size'}: the model was trained in another "
            "tokenizer (its checkpoint records which); its ids would mean other strings: "
            "leave --tokenizer out"), bad.stderr
    assert not os.path.exists(base / "z")
    with pytest.raises(UsageError, match=r"--tokenizer .*same_size: --init-from .*x holds its "
                       r"model's own tokenizer \(vocab.json, merges.txt\), whose vocabulary"):
        tiny_args("--data", corpus, "--init-from", str(base / "x"), "--tokenizer",
              str(base / "same_size"))
    with pytest.raises(UsageError, match=r"--tokenizer .*same_size: --init-from .*ck: the "
                       "model was trained in another tokenizer"):
        tiny_args("--init-from", str(base / "ck"), "--tokenizer", str(base / "same_size"))


def test_a_fine_tune_from_a_folder_resumes_in_its_bpe(base, corpus, tmp_path):
    """--init-from a GPT-2 folder with its BPE, then `--resume DIR` alone: its text was
    read as bytes and the resume refused as a "config mismatch" (walk 33)."""
    cache = ["--cache-dir", str(tmp_path / "cache")]
    train(tiny_args("--data", corpus, *cache, "--init-from", str(base / "x"), "--steps", "2",
                "--save", str(tmp_path / "ft")))
    again = tiny_args("--resume", str(tmp_path / "ft"), "--steps", "3", *cache)
    assert again.tokenizer == str(base / "x") and train(again)["steps"] == 3


def test_a_run_from_a_checkpoint(base, corpus, tmp_path, capsys):
    """--init-from CKPT: its weights exactly (the val loss --resume --eval-only reports), its
    tokenizer and --data taken, a new run from step 0; --save on the folder it starts from
    (or one holding it) refused: the advice there, --resume auto or --overwrite, continued
    the old run or pruned the model it starts from (walk 36)."""
    cache = ["--cache-dir", str(tmp_path / "cache")]
    evaluated = ["--eval-only", "--data", corpus, *cache, "--batch-size", "4",
                 "--eval-iters", "1", "--seed", "0"]
    resumed = train(tiny_args("--resume", str(base / "ck"), *evaluated))["val_loss"]
    started = tiny_args("--init-from", str(base / "ck"), *evaluated)
    assert started.tokenizer == str(base / "tok") and train(started)["val_loss"] == resumed
    fresh = tiny_args("--init-from", str(base / "ck"), "--data", corpus, *cache, "--steps", "2",
                  "--save", str(tmp_path / "ft2"))
    capsys.readouterr()
    assert train(fresh)["steps"] == 2 and (tmp_path / "ft2" / "step-00000002").is_dir()
    said = capsys.readouterr().out
    assert f"init: the weights of --init-from {base / 'ck'} (step 2 of " in said, said
    assert tiny_args("--init-from", str(base / "ck")).data == corpus
    for save in (base / "ck", base):                  # the folder, or one that holds it
        with pytest.raises(UsageError, match=r"--save .*: holds the checkpoint --init-from "
                           r".*ck starts this run from; save the new run elsewhere"):
            tiny_args("--init-from", str(base / "ck"), "--save", str(save))


def test_a_checkpoints_tokenizer_moved_away_or_none_is_named(base, corpus, tmp_path):
    """A base checkpoint whose tokenizer folder is gone: named as --resume names it (walk 36:
    a vocabulary error); a base trained in bytes given a --tokenizer: "trained without one"."""
    cache = ["--cache-dir", str(tmp_path / "cache")]
    vocab = json.loads((base / "tok" / "vocab.json").read_text())
    merges = [tuple(line.split()) for line in
              (base / "tok" / "merges.txt").read_text().splitlines()[1:]]
    bpe_train.write_tokenizer(str(tmp_path / "tokmv"), vocab, merges)
    train(tiny_args("--data", corpus, *cache, "--tokenizer", str(tmp_path / "tokmv"), "--steps",
                "1", "--save", str(tmp_path / "ck")))
    os.rename(tmp_path / "tokmv", tmp_path / "gone")
    for how in ("--resume", "--init-from"):
        with pytest.raises(UsageError, match="was trained in the tokenizer of --tokenizer "
                           ".*tokmv, which holds no vocab.json and merges.txt now; give "
                           "--tokenizer DIR"):
            tiny_args("--data", corpus, how, str(tmp_path / "ck"))
    train(tiny_args("--data", corpus, *cache, "--steps", "1", "--save", str(tmp_path / "bytes")))
    with pytest.raises(UsageError, match=r"--tokenizer .*tok: --init-from .*bytes was trained "
                       r"without one, in bytes \(256 tokens\); leave --tokenizer out"):
        tiny_args("--init-from", str(tmp_path / "bytes"), "--tokenizer", str(base / "tok"))


def test_eval_only_of_a_folder_runs_at_its_own_context(tmp_path):
    """--init-from FOLDER --eval-only without --block-size evaluates at the folder's own
    context (its n_positions / max_position_embeddings), as the README says (first-use walk
    38: at min(128, its), GPT-2's loss at 128 tokens of context, not comparable with
    published numbers); a training run keeps the default 128 where the folder has more."""
    from minidist.nn import GPT, GPTConfig
    from minidist.train.args import train_parser
    from minidist.train.cli import check_flags
    GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=256, vocab_size=256),
        seed=0).save_pretrained(str(tmp_path / "gpt"))
    for flags, context in ((["--eval-only"], 256), ([], 128), (["--eval-only",
                                                              "--block-size", "64"], 64)):
        args = train_parser().parse_args(["--init-from", str(tmp_path / "gpt"), *flags])
        check_flags(args)
        assert args.block_size == context, (flags, args.block_size)
