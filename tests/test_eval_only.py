"""`--eval-only`: the val loss of a checkpoint (--resume DIR) or of a GPT-2 / Llama folder
(--init-from DIR), in any layout, nothing trained or written: the number its training run
ended with, the same under tensor and pipeline parallelism, the same for the folder the
checkpoint exports to; the flags that would do nothing refused.

Run: python -m pytest -q tests/test_eval_only.py
"""
import json
import os
import re
import subprocess
import sys

import pytest

from minidist.train.args import train_parser
from minidist.train.cli import UsageError, check_flags
from minidist.train.loop import train

SMALL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
         "--batch-size", "4", "--eval-iters", "3", "--sample", "0", "--dtype", "float64"]


def _run(flags):
    args = train_parser().parse_args(flags)
    check_flags(args)                         # as train_gpt.py: the resumed model's flags
    return train(args)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A 3-step float64 run saved to ck: (its folder, its final summary, the data flags)."""
    tmp = tmp_path_factory.mktemp("eval_only")
    data = ["--data", corpus, "--cache-dir", str(tmp / "cache")]
    summary = _run(SMALL + data + ["--steps", "3", "--save", str(tmp / "ck")])
    return str(tmp / "ck"), summary, data


def test_a_checkpoint_evaluates_to_the_val_loss_its_run_ended_with(trained, capsys):
    """    python examples/train_gpt.py --resume ck --eval-only
    The run's val batches (its --batch-size and --eval-iters, taken from the checkpoint as
    its data is; any --seed: the val windows are the same for every seed): the same number,
    bit for bit; no step taken, no folder written. Given, they are this command's (another
    number). With --grad-accum 2 each batch in two forwards: the same to 1e-12."""
    ck, summary, data = trained
    before = sorted(os.listdir(ck))
    capsys.readouterr()
    got = _run(["--resume", ck, "--eval-only", "--sample", "0"])    # data: the checkpoint's
    assert got["val_loss"] == summary["val_loss"] and got["eval_only"]
    assert got["steps"] == 3 and got["eval_tokens"] == 3 * 4 * 16
    assert got["evaluated"].endswith("step-00000003") and got["schedule_steps"] is None
    assert got["perplexity"] == pytest.approx(2.718281828459045 ** summary["val_loss"])
    assert sorted(os.listdir(ck)) == before
    out = capsys.readouterr().out
    assert f"val loss {summary['val_loss']:.4f} nats/token, perplexity" in out
    assert re.search(r"over 192 tokens of the val split \(3 batches of 4 x 16 windows drawn at "
                     r"random from its [\d,]+ tokens\)", out), out
    assert "step    1/" not in out                                     # nothing trained
    # its first line read "resumed from ck/step-00000003 at step 3", as if training went on
    assert out.startswith(f"evaluating {ck}/step-00000003, trained 3 steps\n"), out
    other = _run(["--resume", ck, "--eval-only", "--sample", "0", "--eval-iters", "1"])
    assert other["eval_tokens"] == 4 * 16 and other["val_loss"] != summary["val_loss"]
    assert "(1 batch of 4 x 16 windows" in capsys.readouterr().out     # (was "1 batches")
    seeded = _run(["--resume", ck, "--eval-only", "--sample", "0", "--seed", "99"])
    assert seeded["val_loss"] == summary["val_loss"]    # (walk 41: the seed moved it)
    parts = _run(["--resume", ck, "--eval-only", "--sample", "0", "--grad-accum", "2"])
    assert parts["val_loss"] == pytest.approx(summary["val_loss"], abs=1e-12)  # 2 forwards
    # first-use walk 28: the number came last, under the sample's text
    capsys.readouterr()
    _run(["--resume", ck, "--eval-only", "--sample", "8"])
    out = capsys.readouterr().out
    assert 0 <= out.index(f"val loss {summary['val_loss']:.4f} nats/token") < out.index(
        "sampling 8 tokens"), out


def test_an_amp_checkpoint_evaluates_its_16_bit_weights_with_no_optimizer(corpus, tmp_path,
                                                                         capsys):
    """    python examples/train_gpt.py --amp --steps 2 --save ck ...
    python examples/train_gpt.py --resume ck --eval-only
    The forward the training ran, on the checkpoint's 16-bit parameters (its float32
    masters and AdamW's moments never read: no optimizer is built): its final val loss, bit
    for bit, and the --amp line says so."""
    data = ["--data", corpus, "--cache-dir", str(tmp_path / "cache")]
    flags = [f for f in SMALL if f not in ("--dtype", "float64")]
    summary = _run(flags + data + ["--amp", "--steps", "2", "--save", str(tmp_path / "ck")])
    capsys.readouterr()
    got = _run(["--resume", str(tmp_path / "ck"), "--eval-only", "--sample", "0"])
    assert got["val_loss"] == summary["val_loss"]
    assert "no float32 masters or optimizer state (nothing steps)" in capsys.readouterr().out


def test_its_exported_folder_evaluates_to_the_same_number(trained, tmp_path):
    """    python examples/export_gpt2.py --resume ck --out hf
    python examples/train_gpt.py --init-from hf --eval-only
    The exported GPT-2 folder holds the checkpoint's parameters exactly (float64 written as
    float32: to float32's rounding)."""
    ck, summary, data = trained
    out = subprocess.run([sys.executable, "examples/export_gpt2.py", "--resume", ck, "--out",
                          str(tmp_path / "hf")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = _run(["--init-from", str(tmp_path / "hf"), "--eval-only", "--batch-size", "4",
                "--eval-iters", "3", "--sample", "0", "--block-size", "16"] + data)
    assert got["val_loss"] == pytest.approx(summary["val_loss"], abs=1e-5)


@pytest.mark.mpi
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"], ["--zero", "3"],
                                    ["--cp", "2"]], ids=["tp2", "pp2", "zero3", "cp2"])
def test_any_layout_evaluates_to_one_process_number(trained, tmp_path, mpi, layout):
    """    mpirun -n 2 python examples/train_gpt.py --resume ck --eval-only --tp 2
    The one-process checkpoint read into 2 ranks' layout: its val loss to 1e-12 (float64)."""
    ck, summary, data = trained
    log = tmp_path / "log.jsonl"
    out = mpi(2, "examples/train_gpt.py", "--resume", ck, "--eval-only", "--batch-size", "4",
              "--eval-iters", "3", "--sample", "0", "--log-json", str(log), *layout, *data,
              timeout=180).stdout
    row = json.loads(open(log).read().splitlines()[-1])
    assert row["eval_only"] and abs(row["val_loss"] - summary["val_loss"]) < 1e-12
    for per_step in ("per step", "memory table", "in flight",     # no training's summary:
                     "gradients averaged"):             # it printed 0.00 MiB per step; nor
        assert per_step not in out, out                 # its layout line's gradients


@pytest.mark.mpi
def test_a_run_from_a_checkpoint_starts_from_its_numbers_in_another_layout(trained, tmp_path,
                                                                          mpi):
    """    mpirun -n 2 python examples/train_gpt.py --tp 2 --save ck2 ...
    mpirun -n 2 python examples/train_gpt.py --init-from ck2 --pp 2 --eval-only
    A checkpoint of tp 2, read whole (gather.py) as the weights of a new run in another
    layout (pp 2, ZeRO-3 over 2): the val loss `--resume ck2 --eval-only` gives on one
    process, to 1e-12 (float64). minidist/train/init_from.py."""
    _, _, data = trained
    ck = str(tmp_path / "ck2")
    mpi(2, "examples/train_gpt.py", *SMALL, *data, "--steps", "3", "--tp", "2", "--save", ck,
        timeout=180)
    evaluated = ["--eval-only", "--batch-size", "4", "--eval-iters", "3", "--seed", "5",
                 "--sample", "0", *data]
    want = _run(["--resume", ck, *evaluated])["val_loss"]
    for layout in (["--pp", "2"], ["--zero", "3"]):
        log = tmp_path / f"{layout[0][2:]}.jsonl"
        mpi(2, "examples/train_gpt.py", "--init-from", ck, *evaluated, "--log-json", log,
            *layout, timeout=180)
        row = json.loads(open(log).read().splitlines()[-1])
        assert abs(row["val_loss"] - want) < 1e-12, (layout, row["val_loss"], want)


@pytest.mark.parametrize("flags, says", [
    ([], "--eval-only: no weights to evaluate; give --resume DIR"),
    (["--resume", "ck", "--init-from", "hf"], "--init-from hf: --eval-only evaluates one "
     "model, and --resume ck's would be it; give one of the two"),
    (["--resume", "auto", "--save", "x"], "--resume auto: --eval-only evaluates the "
     "checkpoint you name; give --resume DIR"),
    (["--init-from", "nowhere", "--lr", "1"], "--init-from nowhere"),
])
def test_what_eval_only_cannot_use_is_refused(flags, says, tmp_path, monkeypatch):
    """One line each: no weights named; --resume auto (it needs --save, which would do
    nothing); a folder that is not there, as training says it."""
    monkeypatch.chdir(tmp_path)
    args = train_parser().parse_args(["--eval-only"] + flags)
    with pytest.raises(UsageError, match=None) as e:
        check_flags(args)
    assert str(e.value).startswith(says), str(e.value)


@pytest.mark.parametrize("flag, says", [
    (["--lr", "1"], r"^--lr 1.0: sets the learning rate, which this run does not use \(drop "
     r"--eval-only to train, or leave --lr out\)"),
    (["--save", "x"], r"^--save x: sets where to save, which this run does not use"),
    (["--steps", "9"], r"^--steps 9: sets the steps to train"),
    (["--ddp", "naive"], r"^--ddp naive: sets how DDP averages gradients"),
    (["--attention", "recompute"], r"^--attention recompute: sets what the attention's "),
    (["--save-every", "2"], r"^--save-every 2: sets steps between checkpoints, which this "
     r"run does not use \(drop --eval-only"),
    (["--dropout", "0.5"], r"^--dropout 0.5: sets the training's dropout \(an evaluation "
     r"drops nothing\), which this run does not use"),
    # another context: --init-from's, which --resume's refusal now names (it said "a resumed
    # run takes its model from the checkpoint" only: first-use walk, session 35)
    (["--block-size", "8"], r"^--block-size 8: --resume .* holds a model with block_size 16; "
     r"leave --block-size out \(--eval-only --resume evaluates the model its run trained; "
     r"--init-from .*step-00000003 --eval-only --block-size 8 evaluates its weights at "
     r"another context\)$"),
])
def test_a_training_flag_is_refused_by_name(trained, flag, says):
    """Every flag only training reads (the learning rate's, the steps', --save...) is
    refused, not ignored."""
    ck, _, data = trained
    args = train_parser().parse_args(["--eval-only", "--resume", ck] + flag + data)
    with pytest.raises(UsageError, match=says):
        check_flags(args)


def test_a_llama_folder_evaluates_at_its_own_context_and_a_dropout_run_is_not_refused(
        corpus, tmp_path):
    """    python examples/export_gpt2.py --resume llama-ck --out llama-hf
    python examples/train_gpt.py --init-from llama-hf --eval-only
    A Llama folder's max_position_embeddings (16) is the block size when --block-size is
    not given (it evaluated at the default 128, another number); the checkpoint of a
    --dropout 0.1 run evaluates with no flag refused (its dropout is taken, not typed)."""
    data = ["--data", corpus, "--cache-dir", str(tmp_path / "cache")]
    ck, hf = str(tmp_path / "ck"), str(tmp_path / "hf")
    summary = _run(SMALL + data + ["--arch", "llama", "--n-kv-head", "1", "--steps", "2",
                                   "--dropout", "0.1", "--save", ck])
    resumed = _run(["--resume", ck, "--eval-only", "--sample", "0"])
    assert resumed["val_loss"] == summary["val_loss"]
    out = subprocess.run([sys.executable, "examples/export_gpt2.py", "--resume", ck, "--out",
                          hf], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    folder = _run(["--init-from", hf, "--eval-only", "--batch-size", "4", "--eval-iters",
                   "3", "--sample", "0"] + data)
    assert folder["val_loss"] == pytest.approx(summary["val_loss"], abs=1e-5)


@pytest.mark.parametrize("size", ["8", "32"])
def test_the_block_size_refusal_names_an_init_from_that_runs(trained, size):
    """--eval-only --resume ck --block-size N (ck's run: 16) is refused; the --init-from
    command it names passes the checks. 32 is past a GPT-2's 16 learned positions, which
    --init-from refuses too: its refusal names none there, and says how far it reads."""
    ck, _, data = trained
    args = train_parser().parse_args(["--eval-only", "--resume", ck, "--block-size", size]
                                     + data)
    with pytest.raises(UsageError) as e:
        check_flags(args)
    advice = re.search(r"--init-from (\S+) --eval-only --block-size (\d+)", str(e.value))
    assert (advice is not None) == (size == "8"), str(e.value)
    if advice:
        check_flags(train_parser().parse_args(
            ["--init-from", advice[1], "--eval-only", "--block-size", advice[2]] + data))
    else:
        assert "its 16 learned positions" in str(e.value), str(e.value)
