"""--keep-best: DIR/best names the checkpoint of the lowest val loss a run measured, and the
--keep rotation never removes it (minidist/strategy/best_checkpoint.py, minidist/train/saves.py).

By hand (the run's best is step 5 of 8, then a resume that never beats it):

    python examples/train_gpt.py --n-layer 2 --n-head 2 --n-embd 16 --block-size 16 \\
        --batch-size 4 --eval-every 1 --lr 0.05 --steps 12 --stop-at 8 --save ck --keep 1 \\
        --keep-best
    python examples/train_gpt.py --resume ck --save ck --steps 12   # keeps --keep-best
    python examples/sample.py --resume ck/best
"""
import json
import os
import sys

import pytest

from minidist.strategy import best_checkpoint, checkpoint_dirs
from minidist.strategy.checkpoint_dirs import CheckpointError
from tests.mpirun import device_flags, mpiexec, run_job

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--eval-every", "1", "--eval-iters", "1", "--sample", "0",
        "--lr", "0.05", "--steps", "12"]


def _folders(d, *names):
    for name in names:
        os.makedirs(os.path.join(d, name))


def test_prune_keeps_the_best_folder_beside_the_newest_keep(tmp_path):
    d = str(tmp_path)
    _folders(d, "step-00000001", "step-00000002", "step-00000003", "step-00000004")
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("step-00000004\n")
    assert checkpoint_dirs.prune(d, 1, also="step-00000002") == ["step-00000001",
                                                                "step-00000003"]
    assert checkpoint_dirs.numbered(d) == ["step-00000002", "step-00000004"]
    assert checkpoint_dirs.prune(d, 1, also="step-00000004") == ["step-00000002"]


def test_an_overwrite_run_removes_the_replaced_runs_best_past_its_step(tmp_path):
    """--overwrite: the folders past `latest` are the replaced run's, its best one too."""
    d = str(tmp_path)
    _folders(d, "step-00000002", "step-00000006")
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("step-00000002\n")
    assert checkpoint_dirs.prune(d, 0, replacing=True, also="step-00000006") == [
        "step-00000006"]


def test_the_pointer_is_read_back_and_resolved_and_a_bad_one_is_none(tmp_path):
    d = str(tmp_path)
    _folders(d, "step-00000003", "step-00000007")
    assert best_checkpoint.read(d) is None and not best_checkpoint.drop(d)
    best_checkpoint.mark(d, "step-00000003", 2.6972812)
    assert best_checkpoint.read(d) == ("step-00000003", 2.6972812)
    assert checkpoint_dirs.resolve(os.path.join(d, "best")) == os.path.join(d, "step-00000003")
    assert checkpoint_dirs.save_problem(d) is None           # `best` is the directory's own
    os.rmdir(os.path.join(d, "step-00000003"))               # a folder removed by hand
    assert best_checkpoint.read(d) is None
    with pytest.raises(CheckpointError, match="best names step-00000003, which is missing; "
                       "resume from one by its path: .*step-00000007$"):
        checkpoint_dirs.resolve(os.path.join(d, "best"))     # (not latest's "remove it")
    with open(os.path.join(d, "best"), "w") as f:          # edited: not two fields
        f.write("step-00000007\n")
    assert best_checkpoint.read(d) is None
    assert best_checkpoint.drop(d) and not os.path.exists(os.path.join(d, "best"))


def _train(ranks, flags, corpus, tmp_path, device):
    launch = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    cmd = [*launch, sys.executable, "examples/train_gpt.py", "--data", corpus,
           "--cache-dir", str(tmp_path / "cache"), *flags, *device_flags(device)]
    out = run_job(cmd, timeout=180)
    return out.stdout + out.stderr


def _val_rows(log):
    with open(log) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"] + 1: r["val_loss"] for r in rows      # (a row's step is 0-based; a
            if r.get("val_loss") is not None and not r.get("final")}   # folder's, steps done)


# (ranks, extra flags): one process, and two ranks writing on a thread
CASES = [(1, []), (2, ["--async-save"])]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,extra", CASES, ids=["1 process", "2 ranks, --async-save"])
def test_the_best_checkpoint_outlives_keep_and_a_resume_keeps_it(ranks, extra, corpus,
                                                                  tmp_path, device):
    """A run stopped at step 8 (--keep 1 --keep-best, a save at every evaluation): DIR/best
    names the step of the lowest val loss in its --log-json rows, whose folder is kept beside
    the newest; it evaluates to the loss recorded; a resume takes --keep-best from the run and
    compares its evaluations with that best; --no-keep-best then removes the pointer."""
    ck, log = str(tmp_path / "ck"), str(tmp_path / "log.jsonl")
    common = [*TINY, "--save", ck, "--log-json", log, *extra]
    said = _train(ranks, [*common, "--stop-at", "8", "--keep", "1", "--keep-best"], corpus,
                  tmp_path, device)
    vals = _val_rows(log)
    best_step = min(vals, key=vals.get)
    name = f"step-{best_step:08d}"
    assert best_step < 8, vals                         # (else nothing here is tested)
    assert best_checkpoint.read(ck)[0] == name
    assert abs(best_checkpoint.read(ck)[1] - vals[best_step]) < 1e-12
    assert checkpoint_dirs.numbered(ck) == [name, "step-00000008"]
    assert f"saved step {best_step} to {ck}/{name} (the best val loss yet" in said

    evaluated = _train(1, ["--resume", os.path.join(ck, "best"), "--eval-only",
                           "--eval-iters", "1", "--sample", "0"], corpus, tmp_path, device)
    assert f"val loss {vals[best_step]:.4f} nats/token" in evaluated, evaluated[-2000:]
    sampled = run_job([sys.executable, "examples/sample.py", "--resume",
                       os.path.join(ck, "best"), "--tokens", "5"], timeout=120)
    assert f"from step {best_step} of {ck}/{name}:" in sampled.stderr, sampled.stderr
    tuned = _train(1, ["--init-from", os.path.join(ck, "best"), "--steps", "1", "--sample", "0",
                       "--eval-iters", "1"], corpus, tmp_path, device)   # a fine-tune's start
    assert f"(step {best_step} of {ck}/{name})" in tuned, tuned[-2000:]

    said = _train(ranks, ["--resume", ck, "--save", ck, "--log-json", log, "--sample", "0",
                          *extra], corpus, tmp_path, device)
    vals = _val_rows(log)
    best_step = min(vals, key=vals.get)
    assert best_checkpoint.read(ck)[0] == f"step-{best_step:08d}"
    assert checkpoint_dirs.numbered(ck)[-1] == "step-00000012"
    assert set(checkpoint_dirs.numbered(ck)) == {f"step-{best_step:08d}", "step-00000012"}
    assert ("the best val loss yet" in said) == (best_step > 8), said[-2000:]

    said = _train(1, ["--resume", ck, "--save", ck, "--steps", "13", "--sample", "0",
                      "--no-keep-best"], corpus, tmp_path, device)
    assert f"note: removed {ck}/best (this run has --no-keep-best)" in said
    assert best_checkpoint.read(ck) is None and checkpoint_dirs.numbered(ck) == [
        "step-00000013"]


def test_every_evaluation_is_saved_whatever_save_every(corpus, tmp_path, device):
    """--keep-best saves at each evaluation, not only at --save-every's steps (until review
    44, --save-every 3 --eval-every 2 saved steps 3 and 6: the evaluations of steps 2 and 4
    were never candidates, though the help said a checkpoint is saved at every evaluation):

        python examples/train_gpt.py --steps 6 --eval-every 2 --save-every 3 --save ck \\
            --keep 0 --keep-best
    """
    ck, log = str(tmp_path / "ck"), str(tmp_path / "log.jsonl")
    flags = [*TINY, "--steps", "6", "--eval-every", "2", "--save-every", "3", "--save", ck,
             "--keep", "0", "--keep-best", "--log-json", log]
    _train(1, flags, corpus, tmp_path, device)
    vals = _val_rows(log)
    assert sorted(vals) == [2, 4, 6], vals
    assert checkpoint_dirs.numbered(ck) == [f"step-{s:08d}" for s in (2, 3, 4, 6)]
    best_step = min(vals, key=vals.get)
    assert best_checkpoint.read(ck) == (f"step-{best_step:08d}", vals[best_step])


def test_an_overwrite_run_without_keep_best_removes_the_pointer_naming_no_typed_flag(
        corpus, tmp_path, device):
    """A fresh --overwrite run into a --keep-best run's folder removes its DIR/best at its
    first save; the note says the run has no --keep-best (until review 44 it said
    "--no-keep-best", a flag nobody typed)."""
    ck = str(tmp_path / "ck")
    _train(1, [*TINY, "--steps", "2", "--save", ck, "--keep-best"], corpus, tmp_path, device)
    assert best_checkpoint.read(ck) is not None
    said = _train(1, [*TINY, "--steps", "2", "--save", ck, "--overwrite"], corpus, tmp_path,
                  device)
    assert f"note: removed {ck}/best (this run has no --keep-best)" in said, said[-2000:]
    assert best_checkpoint.read(ck) is None


@pytest.mark.mpi
def test_a_best_edited_by_hand_is_replaced_and_said(corpus, tmp_path, device):
    """Review 44 F3: a `best` a user wrote as `latest` takes it (one line) was removed by a
    resumed --keep-best run without a word; now the note says why, and the resumed run's
    evaluations start a new best."""
    ck = str(tmp_path / "ck")
    _train(1, [*TINY, "--save", ck, "--keep", "0", "--keep-best", "--stop-at", "2"], corpus,
           tmp_path, device)
    with open(os.path.join(ck, "best"), "w") as f:
        f.write("step-00000001\n")
    said = _train(1, ["--resume", ck, "--save", ck, "--stop-at", "3", "--sample", "0"], corpus,
                  tmp_path, device)
    assert f"note: removed {ck}/best (not as --keep-best writes it" in said, said[-2000:]
    assert best_checkpoint.read(ck)[0] == "step-00000003"


@pytest.mark.mpi
def test_a_resume_from_the_best_step_itself_keeps_the_best(corpus, tmp_path, device):
    """A --keep-best run whose best is the step it was stopped at: the resumed run takes that
    best over (its step is the resumed one, so its val loss is of this run's past), keeps
    it where no evaluation beats it, and says nothing of removing it. (Mutation testing: a
    resume counted only a best before the resumed step, passing every test.)"""
    ck = str(tmp_path / "ck")
    _train(1, [*TINY, "--save", ck, "--keep", "0", "--keep-best", "--stop-at", "2"], corpus,
           tmp_path, device)
    best_checkpoint.mark(ck, "step-00000002", 0.0)      # unbeatable: no later one replaces it
    said = _train(1, ["--resume", ck, "--save", ck, "--stop-at", "3", "--sample", "0"], corpus,
                  tmp_path, device)
    assert "note: removed" not in said, said[-2000:]
    assert best_checkpoint.read(ck) == ("step-00000002", 0.0)
