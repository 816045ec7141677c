"""Checkpoint folders (minidist/strategy/checkpoint_dirs.py): numbered folders with an atomic
`latest` pointer, --keep, a complete checkpoint found at every instant (kill -9 mid-save
included), stale temporaries cleaned (another running save's left alone), the user's umask,
strangers refused, --overwrite, the run's lock, a damaged `latest` named."""
import os
import re
import shutil
import time

import pytest

from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW
from minidist.strategy import checkpoint, checkpoint_dirs, save_lock
from minidist.strategy.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tests.checkpoint_cases import _trained


def test_numbered_folders_latest_pointer_and_keep(tmp_path):
    model, opt = _trained()
    d = tmp_path / "ck"
    for step in (1, 2, 3, 3):                        # step 3 twice: a second folder
        save_checkpoint(d, model, opt, step=step)
    assert checkpoint_dirs.numbered(d) == ["step-00000001", "step-00000002", "step-00000003",
                                           "step-00000003.1"]
    assert (d / "latest").read_text() == "step-00000003.1\n"
    assert checkpoint_dirs.prune(d, keep=2) == ["step-00000001", "step-00000002"]
    (d / "latest").write_text("step-00000003\n")      # latest stays, whatever its number
    assert checkpoint_dirs.prune(d, keep=1) == ["step-00000003.1"]
    assert sorted(os.listdir(d)) == ["latest", "step-00000003"]
    assert checkpoint_dirs.prune(d, keep=0) == []    # 0: keep all


def test_a_step_saved_again_and_again_gets_the_next_free_number_in_order(tmp_path):
    """The same step committed 12 times (a run resumed and stopped at one step, again and
    again): step-N, step-N.1 .. step-N.11, each a new folder, and `numbered` orders them by
    number (step-N.10 after step-N.9, not after step-N.1 as their names sort)."""
    d = tmp_path / "ck"
    for _ in range(12):
        checkpoint_dirs.commit(checkpoint_dirs.begin(d, 5), d, 5)
    names = ["step-00000005"] + [f"step-00000005.{n}" for n in range(1, 12)]
    assert checkpoint_dirs.numbered(d) == names
    assert checkpoint_dirs.read_latest(d) == "step-00000005.11"
    checkpoint_dirs.commit(checkpoint_dirs.begin(d, 123456789), d, 123456789)   # 9 digits
    assert checkpoint_dirs.numbered(d)[-1] == "step-123456789"


def test_resume_finds_a_complete_checkpoint_at_every_instant(tmp_path):
    model, opt = _trained()
    d = tmp_path / "ck"
    assert checkpoint_dirs.resume_dir("auto", str(d)) is None      # nothing yet: start fresh
    save_checkpoint(d, model, opt, step=1)
    save_checkpoint(d, model, opt, step=2)
    assert checkpoint_dirs.resume_dir("auto", str(d)) == str(d / "step-00000002")
    assert checkpoint_dirs.resume_dir(str(d / "step-00000001"), None) == str(
        d / "step-00000001")
    os.remove(d / "latest")          # killed between a folder's rename and the pointer
    assert checkpoint_dirs.resolve(d) == str(d / "step-00000002")
    (d / ".tmp-123-abcd").mkdir()    # a save killed mid-way is not a checkpoint
    assert checkpoint_dirs.resolve(d) == str(d / "step-00000002")
    with pytest.raises(CheckpointError, match="--resume auto .* --save DIR"):
        checkpoint_dirs.resume_dir("auto", None)
    (d / "latest").write_text("step-00000009\n")
    with pytest.raises(CheckpointError, match=f"latest names step-00000009, which is missing; "
                       f"remove {d / 'latest'} \\(then {d} means its newest, "
                       f"{d / 'step-00000002'}\\), or resume from one by its path: "
                       f"{d / 'step-00000001'}, {d / 'step-00000002'}"):
        load_checkpoint(d, model, opt)
    # first-use walk 27: the --save check took the same error, so resuming by that path
    # with the same --save (a requeue's command) was refused as well
    checkpoint_dirs.check_save(str(d), str(d / "step-00000002"))
    with pytest.raises(CheckpointError, match="--save .* holds step 2 .*step-00000002"):
        checkpoint_dirs.check_save(str(d), str(d / "step-00000001"))
    with pytest.raises(CheckpointError, match=f"--resume auto: --save {d}: latest names"):
        checkpoint_dirs.resume_dir("auto", str(d))
    # first-use walk 26: with no folder left the fix offered was "one of []"
    for name in ("step-00000001", "step-00000002"):
        shutil.rmtree(d / name)
    with pytest.raises(CheckpointError, match="which is missing; no checkpoint is left in it: "
                       f"remove {d / 'latest'} to start afresh there, or --save another"):
        checkpoint_dirs.resume_dir("auto", str(d))
    (d / "latest").write_text("")             # an emptied pointer: "write one of []"
    with pytest.raises(CheckpointError, match="no checkpoint folder is left beside it: "
                       "remove it"):
        checkpoint_dirs.read_latest(str(d))


def _a_pid_that_ended():
    import subprocess
    import sys
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temporaries_cleaned_umask_and_strangers_refused(tmp_path):
    model, opt = _trained()
    d = tmp_path / "ck"
    save_checkpoint(d, model, opt, step=1)
    gone = _a_pid_that_ended()
    for stale in (f".tmp-{gone}-dead", ".old-99-dead", f".latest.tmp-{gone}"):
        (d / stale).mkdir() if "latest" not in stale else (d / stale).write_text("x")
    old = os.umask(0o022)
    try:
        folder = save_checkpoint(d, model, opt, step=2)
    finally:
        os.umask(old)
    assert sorted(os.listdir(d)) == ["latest", "step-00000001", "step-00000002"]
    assert os.stat(folder).st_mode & 0o777 == 0o755             # not mkdtemp's 0700
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not minidist checkpoints"):
        save_checkpoint(tmp_path / "notes", model, opt, step=1)
    with pytest.raises(CheckpointError, match="one checkpoint .* new directory"):
        save_checkpoint(folder, model, opt, step=3)


def test_train_keeps_the_newest_k_folders(corpus, tmp_path):
    """--save DIR --save-every 1 --keep 2: after 4 steps, step-3 and step-4 (latest) remain."""
    from minidist.train.args import train_parser
    from minidist.train.loop import train
    args = train_parser().parse_args([
        "--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--block-size", "8",
        "--batch-size", "2", "--steps", "4", "--eval-every", "0", "--eval-iters", "1",
        "--sample", "0", "--device", "cpu", "--data", corpus, "--cache-dir",
        str(tmp_path / "cache"),
        "--save", str(tmp_path / "ck"), "--save-every", "1", "--keep", "2"])
    train(args)
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step-00000003", "step-00000004"]
    assert (tmp_path / "ck" / "latest").read_text() == "step-00000004\n"


def test_overwrite_replaces_the_other_runs_checkpoints(corpus, tmp_path):
    """--save ck --overwrite over a longer run: its steps 2 and 4 replace that run's folders,
    its step 6 too (counted as the newest, it would outlive this run's step 2 under --keep
    2). The same command again saves step 2 over a step 2: step-00000002.1, latest pointed
    at it once it is complete, the old folder then removed; every folder left verifies. A
    run resumed from a `latest` set back by hand keeps the later folders (no --overwrite):

        python examples/train_gpt.py ... --steps 6 --save-every 2 --keep 2 --save ck
        python examples/train_gpt.py ... --steps 4 --save-every 2 --keep 2 --save ck \\
            --overwrite      (twice)"""
    from minidist.train.args import train_parser
    from minidist.train.loop import train
    ck = tmp_path / "ck"

    def run(*flags):
        train(train_parser().parse_args([
            "--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--block-size", "8",
            "--batch-size", "2", "--eval-every", "0", "--eval-iters", "1", "--sample", "0",
            "--device", "cpu", "--data", corpus, "--cache-dir", str(tmp_path / "cache"),
            "--save", str(ck), "--save-every", "2", "--keep", "2", *flags]))
        return sorted(os.listdir(ck)), (ck / "latest").read_text()
    assert run("--steps", "6") == (["latest", "step-00000004", "step-00000006"],
                                   "step-00000006\n")
    assert run("--steps", "4", "--overwrite") == (
        ["latest", "step-00000002", "step-00000004"], "step-00000004\n")
    assert run("--steps", "4", "--overwrite") == (
        ["latest", "step-00000002.1", "step-00000004"], "step-00000004\n")
    for name in ("step-00000002.1", "step-00000004"):
        assert checkpoint.verify(ck / name)["step"] == int(name[5:13])
    (ck / "latest").write_text("step-00000002.1\n")              # set back by hand
    assert checkpoint_dirs.prune(ck, 5) == [] and checkpoint_dirs.prune(ck, 0) == []
    assert checkpoint_dirs.prune(ck, 5, replacing=True) == ["step-00000004"]


_SAVER = """
import sys
from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW
from minidist.strategy.checkpoint import save_checkpoint
from minidist.strategy.checkpoint_dirs import has_checkpoint, prune, resolve, step_of
model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
opt = AdamW(model.named_parameters())
start = step_of(resolve(sys.argv[1])) + 1 if has_checkpoint(sys.argv[1]) else 1
for step in range(start, 10**6):          # on from the killed run's latest
    print("saving", step, flush=True)
    save_checkpoint(sys.argv[1], model, opt, step=step)
    print("saved", step, flush=True)
    prune(sys.argv[1], 1)
"""


def test_a_save_leaves_another_running_saves_temporary_alone(tmp_path):
    """First-use walk 31: two jobs saving into one folder (a submission twice, one default
    checkpoint folder): each save removed every temporary folder, the other job's included,
    and that job died mid-write ("No such file ... .tmp-..."). A temporary is now removed only
    once its process is gone: this host's by its pid, another host's after FOREIGN_AFTER_S."""
    model, opt = _trained()
    d = tmp_path / "ck"
    save_checkpoint(d, model, opt, step=1)
    host = checkpoint_dirs.temporary_name().split("-")[1]
    running = d / f".tmp-{host}-{os.getpid()}-0abc"          # a save in progress here
    ended = d / f".tmp-{host}-{_a_pid_that_ended()}-0abc"    # killed mid-way
    fresh, stale = d / ".tmp-othernode-12-0abc", d / ".tmp-othernode-13-0abc"
    for folder in (running, ended, fresh, stale):
        folder.mkdir()
    long_ago = time.time() - checkpoint_dirs.FOREIGN_AFTER_S - 60
    os.utime(stale, (long_ago, long_ago))
    save_checkpoint(d, model, opt, step=2)
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == \
        sorted([running.name, fresh.name])
    assert checkpoint_dirs.left_behind(str(fresh), now=time.time() + 7 * 3600)


def test_a_lock_released_under_a_waiting_run_is_no_claim(tmp_path):
    """Three runs on one --save: A holds DIR/.lock; B opens the file; A releases (unlinks
    it); C makes a new .lock and holds it. B's flock on the unlinked file succeeds, and B
    took itself for the holder beside C. hold() now checks that the path still names the
    file it locked (same_file), and a second hold() while C holds is refused."""
    import fcntl
    d = tmp_path / "ck"
    a = save_lock.hold(str(d))
    b = open(d / ".lock", "a+")                         # B, between its open and its flock
    save_lock.release(a)
    c = save_lock.hold(str(d))
    fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)       # the race: B's lock is granted
    assert not save_lock.same_file(b, str(d / ".lock"))   # ... on no file of DIR's
    assert save_lock.same_file(c, str(d / ".lock"))
    with pytest.raises(CheckpointError, match="another run saves into it"):
        save_lock.hold(str(d))
    b.close()
    save_lock.release(c)
    assert not (d / ".lock").exists()


def test_a_lock_left_by_a_killed_run_names_only_the_new_holder(tmp_path):
    """A .lock a killed run left (never released) holds its line; the next run's hold()
    replaces that line with its own, so a third run's refusal names the run that holds it,
    not the dead one first."""
    d = tmp_path / "ck"
    d.mkdir()
    (d / ".lock").write_text("deadhost, pid 1, since 2026-01-01 00:00:00\n")
    held = save_lock.hold(str(d))
    try:
        text = (d / ".lock").read_text()
        assert "deadhost" not in text and text.count("\n") == 1 and f"pid {os.getpid()}" in text
    finally:
        save_lock.release(held)


@pytest.mark.parametrize("held", [b"", b"\x00" * 14, b"\x00\xff junk", b"the newest\n"])
def test_a_damaged_latest_is_one_error_naming_the_folders_left(tmp_path, held):
    """`latest` emptied, zeroed by a crash, holding bytes that are not UTF-8 (first-use walk
    37: a UnicodeDecodeError traceback on every rank) or hand-edited: one CheckpointError
    naming the file and the checkpoint folders beside it."""
    model, opt = _trained()
    d = tmp_path / "ck"
    checkpoint.save_checkpoint(str(d), model, opt, step=1)
    (d / "latest").write_bytes(held)
    with pytest.raises(CheckpointError, match=re.escape(f"{d}/latest: ") + r".* is not a "
                       r"checkpoint folder name \(edited\?\); write one of step-00000001 "
                       r"into it, or remove it"):
        checkpoint_dirs.read_latest(str(d))


def test_a_lock_that_cannot_be_removed_is_released_quietly(tmp_path):
    """First-use walk 37: a --save folder turned read-only mid-run (chattr +i; here the
    .lock path made a folder, which os.remove refuses the same way) made release(), in
    train_gpt.py's `finally`, raise over the save's one-line error: a two-exception
    traceback, exit 1. The lock goes with the file's close; release says nothing."""
    d = tmp_path / "ck"
    held = save_lock.hold(str(d))
    os.remove(d / ".lock")
    os.mkdir(d / ".lock")                               # os.remove: IsADirectoryError
    save_lock.release(held)
    assert held.closed


def test_kill_9_during_saves_always_leaves_a_complete_checkpoint(tmp_path):
    """A process saving (and pruning) in a loop is killed with SIGKILL at varied moments of a
    save (0-12 ms after it says the save begins; one takes about 8 ms): the --save directory
    always resolves to a complete checkpoint that loads, at least as new as the last save the
    process finished, and the next save removes what the killed one left half-written. At
    least one kill is seen to land mid-save: its half-written temporary folder is there
    (more trials, up to 12, until one is: a kill can miss on a busy machine)."""
    import subprocess
    import sys
    import time
    from tests.mpirun import lines_of
    d = tmp_path / "ck"
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    opt = AdamW(model.named_parameters())
    delays, trials, cut = (0.0, 0.003, 0.006, 0.012), 0, 0
    while trials < len(delays) or (not cut and trials < 12):
        child = subprocess.Popen([sys.executable, "-c", _SAVER, str(d)],
                                 stdout=subprocess.PIPE)
        lines, saved = lines_of(child, timeout=120), 0
        for line in lines:                   # a save begins after one was done: kill in it
            word, step = line.split()
            if word == "saved":
                saved = int(step)
            elif saved:
                break
        time.sleep(delays[trials % len(delays)])
        child.kill()
        child.wait()
        for line in lines:                   # what it said before the kill
            word, step = line.split()
            saved = int(step) if word == "saved" else saved
        cut += any(n.startswith(".tmp-") for n in os.listdir(d))     # a save cut mid-way
        meta = load_checkpoint(d, model, opt)
        assert meta["step"] >= saved, (trials, meta["step"], saved)
        trials += 1
    assert cut > 0, f"no kill of {trials} landed mid-save"
    save_checkpoint(d, model, opt, step=10**6)
    assert not [n for n in os.listdir(d) if n.startswith(".")]     # temporaries cleaned


_PRUNER = """
import os, signal, sys
from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW
from minidist.strategy.checkpoint import save_checkpoint
from minidist.strategy.checkpoint_dirs import prune
model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64))
opt = AdamW(model.named_parameters())
for step in (1, 2):
    save_checkpoint(sys.argv[1], model, opt, step=step)
unlinks = []
def die_at_the_second_unlink(frame, event, arg):     # a kill inside the removal: one file gone
    if event == "c_call" and getattr(arg, "__name__", "") == "unlink":
        unlinks.append(1)
        if len(unlinks) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
sys.setprofile(die_at_the_second_unlink)
prune(sys.argv[1], 1)
"""


def test_a_kill_while_prune_removes_a_folder_leaves_no_broken_checkpoint(tmp_path):
    """The chaos campaign (tests/scripts/chaos.py, seed 4 trial 208) found a numbered folder
    that did not verify (no manifest.json) after a SIGKILL: --keep's prune was removing it,
    file by file, and it stayed, half there, for ever under --keep 0. A process killed after
    the first file prune removes now leaves every numbered folder whole (the one being
    removed was renamed to a temporary first), and the next save removes that temporary."""
    import subprocess
    import sys
    d = tmp_path / "ck"
    child = subprocess.run([sys.executable, "-c", _PRUNER, str(d)], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == -9, child.stderr            # killed inside prune
    for name in checkpoint_dirs.numbered(d):
        checkpoint.verify(d / name)                       # (step-1 had lost a file)
    assert checkpoint_dirs.numbered(d) == ["step-00000002"]
    model, opt = _trained()
    save_checkpoint(d, model, opt, step=3)
    assert not [n for n in os.listdir(d) if n.startswith(".tmp-")]


def test_a_save_removes_a_temporary_whose_process_is_a_zombie(tmp_path):
    """A rank killed with its launcher (SIGKILL of mpiexec) can stay a zombie until something
    reaps it; kill(pid, 0) answers for a zombie, so every save of the resumed run kept the
    killed save's temporary folder (the chaos campaign, tests/scripts/chaos.py seed 7 trial
    9). A zombie's temporary is removed like a gone process's."""
    import subprocess
    import sys
    model, opt = _trained()
    d = tmp_path / "ck"
    save_checkpoint(d, model, opt, step=1)
    child = subprocess.Popen([sys.executable, "-c", "pass"])     # not waited for: a zombie
    deadline = time.monotonic() + 60
    while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    host = checkpoint_dirs.temporary_name().split("-")[1]
    killed = d / f".tmp-{host}-{child.pid}-0abc"
    killed.mkdir()
    try:
        save_checkpoint(d, model, opt, step=2)
        assert not killed.exists()
    finally:
        child.wait()
