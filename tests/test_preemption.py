"""Preemption: SIGTERM to every rank mid-run (what Slurm's scancel / a spot reclaim does):
the ranks agree at the next step boundary, save, and exit 75; --resume continues.

    mpiexec -n 2 python examples/train_gpt.py --steps 400 --save DIR ...   # then kill -TERM
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from minidist.strategy import checkpoint_dirs
from minidist.train import preemption
from tests.mpirun import ROOT, device_flags, mpi_env, mpiexec, rank_pids, run_job

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--eval-every", "0", "--eval-iters", "1", "--sample", "0",
        "--log-every", "1"]


def _start(cmd, log):
    return subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_steps(log, n, proc, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(log) and sum(1 for _ in open(log)) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} steps logged in {timeout}s")


def _preempt(cmd, log, signum):
    proc = _start(cmd, log)
    try:
        _wait_for_steps(log, 3, proc)
        os.killpg(proc.pid, signum)          # every process of the job, as a scheduler does
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_sigterm_saves_and_exits_75_then_resume_continues(corpus, tmp_path, ranks,
                                                           device):
    log, save = str(tmp_path / "log.jsonl"), str(tmp_path / "ck")
    flags = [*TINY, *device_flags(device), "--data", corpus, "--cache-dir",
             str(tmp_path / "cache"), "--steps", "100000", "--save", save, "--log-json", log]
    launcher = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    cmd = [*launcher, sys.executable, "examples/train_gpt.py", *flags]
    rc, out, err = _preempt(cmd, log, signal.SIGTERM)
    assert rc == 75, (rc, out[-2000:], err[-2000:])
    assert "preempted (SIGTERM)" in out and f"--resume {save}" in out
    done = [json.loads(line)["step"] for line in open(log)]
    resumed = run_job([*launcher, sys.executable, "examples/train_gpt.py", *flags[:-2],
                       "--resume", save, "--stop-at", str(done[-1] + 3)], timeout=120)
    assert f"at step {done[-1] + 1}" in resumed.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_schedulers_signal_without_save_is_one_line_and_143(corpus, tmp_path, signum,
                                                             device):
    """    mpiexec -n 2 python examples/train_gpt.py --steps 100000 (no --save), then SIGTERM
    or SIGUSR1 to the job: it stops at the step boundary with one line saying nothing was
    saved, exit 143 (128 + SIGTERM: nothing to resume, so a requeueing script does not).
    First-use walk 37: the signal killed the job, status 15 and MPICH's BAD TERMINATION
    block, no line."""
    log = str(tmp_path / "log.jsonl")
    cmd = [mpiexec(), "-n", "2", sys.executable, "examples/train_gpt.py", *TINY,
           *device_flags(device), "--data", corpus, "--cache-dir", str(tmp_path / "cache"),
           "--steps", "100000", "--log-json", log]
    rc, out, err = _preempt(cmd, log, signum)
    assert rc == 143, (rc, out[-2000:], err[-2000:])
    said = [line for line in (out + err).splitlines() if line.startswith("preempted")]
    assert len(said) == 1 and said[0].startswith(f"preempted ({signum.name}) after step ") \
        and said[0].endswith(": nothing saved (no --save DIR)"), (out[-2000:], err[-2000:])
    assert "BAD TERMINATION" not in out + err


def _signal_when(cmd, out_path, ready, send, nap=0.2, timeout=60):
    """Start `cmd` (its own session) with stdout and stderr in out_path; once `ready(proc)`
    (polled every `nap` s), `send(proc)` signals it; wait for the job to end (killed if a
    check fails or it outlives 60 s more). Returns (its exit status, what it printed)."""
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + timeout
        while not ready(proc):
            assert proc.poll() is None and time.time() < deadline, open(out_path).read()[-2000:]
            time.sleep(nap)
        send(proc)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, open(out_path).read()


def _interrupt_when(cmd, out_path, text):
    """Ctrl-C the whole job of `cmd` half a second after `text` is in its output."""
    def ctrl_c(proc):
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)      # what mpiexec forwards on Ctrl-C
    return _signal_when(cmd, out_path, lambda proc: text in open(out_path).read(), ctrl_c)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_ctrl_c_during_an_evaluation_stops_it_and_saves_the_step(corpus, tmp_path, ranks,
                                                                 device):
    """An evaluation asks the ranks before each val batch whether any was signalled: a
    Ctrl-C during a long one (10^6 batches) saves the step it follows and exits 130 at once,
    where it used to finish the evaluation, train a step more, then stop; --eval-only's
    evaluation likewise ends, nothing to save, 130 (it used to exit 0 after it)."""
    save = str(tmp_path / "ck")
    flags = [*TINY, *device_flags(device), "--data", corpus, "--cache-dir",
             str(tmp_path / "cache")]
    flags[flags.index("--eval-iters") + 1] = "1000000"
    del flags[flags.index("--eval-every"):flags.index("--eval-every") + 2]
    launcher = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    train = [*launcher, sys.executable, "examples/train_gpt.py", *flags]
    rc, out = _interrupt_when([*train, "--steps", "6", "--eval-every", "2", "--save", save],
                              str(tmp_path / "out.txt"), "evaluating on 1000000 val batches")
    assert rc == 130, out[-2000:]
    assert "interrupted (Ctrl-C) after step 2 (its evaluation cut): saved to " in out, out
    assert "step     3/6" not in out and out.count("interrupted") == 1
    if ranks > 1:
        return
    rc, out = _interrupt_when([sys.executable, "examples/train_gpt.py", *device_flags(device),
                               "--data", corpus, "--cache-dir", str(tmp_path / "cache"),
                               "--eval-iters", "1000000", "--sample", "0", "--resume", save,
                               "--eval-only"],
                              str(tmp_path / "eval.txt"), "evaluating ")
    assert rc == 130, out[-2000:]
    assert "interrupted (Ctrl-C) during the evaluation at step 2: nothing evaluated, " \
        "nothing saved" in out, out


def _sigterm(signalled):
    """What sends SIGTERM to a job `proc` ("every rank", as a scheduler sends it) or to one
    of its ranks alone ("rank R", a `kill PID`): _signal_when's `send`."""
    def send(proc):
        if signalled == "every rank":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            pids = rank_pids(proc)
            rank = int(signalled.split()[-1])
            assert rank in pids, pids
            os.kill(pids[rank], signal.SIGTERM)
    return send


@pytest.mark.mpi
@pytest.mark.parametrize("signalled", ["every rank", "rank 0", "rank 1"])
def test_sigterm_while_the_ranks_tokenize_exits_75(tmp_path, device, signalled):
    """    mpiexec -n 2 python examples/train_gpt.py --data big.txt --tokenizer tok --save ck
    --resume auto, then SIGTERM while rank 0 tokenizes (rank 1 naps in wait_for_all): exit
    75, one line, no cache half-written. First-use walk 36: the loop's handlers came after
    the data, so the job died of the signal (143/15), which a requeueing script does not
    requeue (preemption.stop_at_once). To the job (as a scheduler signals) or to one rank
    (`kill PID`): the other, never signalled, is ended by the signalled one's MPI_Abort(75)
    (preemption.end_job), and the line is printed once, by rank 0 or the rank signalled."""
    from minidist.train import bpe_train
    text = "".join(f"the quick brown fox {i} jumps over the lazy dog.\n" for i in range(200))
    vocab, merges = bpe_train.train_bpe(text, 300)
    bpe_train.write_tokenizer(str(tmp_path / "tok"), vocab, merges)
    (tmp_path / "big.txt").write_text(text * 1000)                        # ~10 MB
    out_path = tmp_path / "out.txt"
    cmd = [mpiexec(), "-n", "2", sys.executable, "examples/train_gpt.py", *TINY,
           *device_flags(device), "--data", str(tmp_path / "big.txt"), "--tokenizer",
           str(tmp_path / "tok"), "--cache-dir", str(tmp_path / "cache"), "--steps", "5",
           "--save", str(tmp_path / "ck"), "--resume", "auto"]
    def starting(proc):            # its resume line is printed before the data is opened
        return "no checkpoint in" in open(out_path).read()
    rc, said = _signal_when(cmd, out_path, starting, _sigterm(signalled), nap=0.05)
    assert rc == 75, (rc, said[-2000:])
    assert said.count("preempted (SIGTERM) while starting: stopped at once, nothing trained "
                      "since the last checkpoint") == 1, said
    assert "data:" not in said
    cache = tmp_path / "cache"
    assert not list(cache.glob(".build-*")), list(cache.iterdir())     # nothing half-written
    if signalled != "rank 1":         # (signalled alone, rank 1 waits 4 s before its abort:
        assert not list(cache.glob("*/meta.json"))   # rank 0 may finish the cache meanwhile)


@pytest.mark.mpi
def test_sigterm_to_one_rank_in_the_loop_stops_every_rank_at_one_step(corpus, tmp_path,
                                                                       device):
    """    mpiexec -n 2 python examples/train_gpt.py --steps 100000 --save ck ..., then
    `kill -TERM` of rank 1 alone while it trains: the step boundary's agreement
    (strategy.any_rank, an all-reduce max) stops both ranks after the same step, which is
    saved; exit 75, and rank 0's line names a signal on another rank. (Mutation testing: an
    all-reduce min there, every rank signalled, passed every test, which all signalled the
    whole job or landed before the loop.)"""
    log, save, out_path = str(tmp_path / "log.jsonl"), str(tmp_path / "ck"), tmp_path / "out"
    cmd = [mpiexec(), "-n", "2", sys.executable, "examples/train_gpt.py", *TINY,
           *device_flags(device), "--data", corpus, "--cache-dir", str(tmp_path / "cache"),
           "--steps", "100000", "--save", save, "--log-json", log]
    def stepping(proc):
        return os.path.exists(log) and sum(1 for _ in open(log)) >= 3
    rc, said = _signal_when(cmd, out_path, stepping, _sigterm("rank 1"))
    assert rc == 75, (rc, said[-2000:])
    done = [json.loads(line)["step"] for line in open(log)][-1] + 1
    assert f"preempted (SIGTERM or SIGUSR1 on another rank) after step {done}: saved" in said
    assert checkpoint_dirs.numbered(save) == [f"step-{done:08d}"], said[-2000:]


def test_a_second_ctrl_c_is_a_keyboard_interrupt():
    """The loop's Flag notes the first Ctrl-C (the run stops and saves at the step boundary)
    and gives the next one back to Python: a KeyboardInterrupt, which run_main makes one
    line and exit 130, for a step that does not end. In this process, its handlers given
    back after (handlers_kept)."""
    with preemption.handlers_kept():
        flag = preemption.Flag()
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.is_set() and flag.interrupted()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)                   # (the handler runs before this ends)


def _takes_sigterm(pid):
    """Whether process `pid` has a handler of its own for SIGTERM (/proc's SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,signalled", [(1, "every rank"), (2, "every rank"),
                                             (2, "rank 1")])
def test_sigterm_while_python_loads_the_package_exits_75(tmp_path, device, ranks, signalled):
    """    mpiexec -n 2 python examples/train_gpt.py --save ck ..., then SIGTERM to the job as
    soon as every rank's Python runs the script (its first lines take SIGTERM), while it
    still loads numpy, MPI and minidist (a second or more on a cluster's file system):
    exit 75 and the one line, as later in the start (first-use walk 37: status 15 and
    MPICH's BAD TERMINATION block, which a requeueing script does not requeue). To rank 1
    alone: rank 0 goes on into MPI_Init, where a rank that left before it would leave it
    waiting for ever (preemption.WhileLoading notes the signal and stops once MPI runs)."""
    out_path = tmp_path / "out.txt"
    launch = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    cmd = [*launch, sys.executable, "examples/train_gpt.py", *TINY, *device_flags(device),
           "--steps", "5", "--save", str(tmp_path / "ck")]
    def loading(proc):             # every rank's Python runs the script's first lines
        pids = rank_pids(proc)
        return len(pids) == ranks and all(map(_takes_sigterm, pids.values()))
    rc, said = _signal_when(cmd, out_path, loading, _sigterm(signalled), nap=0.01)
    assert rc == 75, (rc, said[-2000:])
    assert said == "preempted (SIGTERM) while starting: stopped at once, nothing trained " \
        "since the last checkpoint; run the same command with --resume auto to start " \
        "again\n", said


def test_a_signal_during_a_save_stops_at_the_step_saved(tmp_path, device):
    """    python examples/train_gpt.py --save ck --save-every 2, SIGTERM while it writes
    step 2: it stops there, exit 75, step 2 its one checkpoint (first-use walk 37: it
    trained step 3 and saved that too, twice the time a scheduler's grace period must
    cover). The process is stopped (SIGSTOP) while its save's temporary folder exists, so
    the signal is sure to land inside the save, then continued."""
    ck, out_path = tmp_path / "ck", tmp_path / "out.txt"
    cmd = [sys.executable, "examples/train_gpt.py", *TINY, "--n-layer", "4", "--n-embd",
           "256", *device_flags(device), "--steps", "6", "--save", str(ck), "--save-every",
           "2"]
    def saving(proc):              # a save's folder; not the start's write probe, a file
        return ck.exists() and any(p.name.startswith(".tmp-") and "probe" not in p.name
                                   and p.is_dir() for p in ck.iterdir())

    def sigterm_inside(proc):
        os.kill(proc.pid, signal.SIGSTOP)
        assert not (ck / "latest").exists(), "step 2's save was over before the signal"
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGCONT)
    rc, said = _signal_when(cmd, out_path, saving, sigterm_inside, nap=0.002)
    assert rc == 75, (rc, said[-2000:])
    assert f"preempted (SIGTERM) after step 2: saved to {ck}/step-00000002" in said, said
    assert "step     3/" not in said and said.count("saved") == 2, said   # (one save said)
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == \
        ["step-00000002"]


def test_train_gives_the_signal_handlers_back(corpus, tmp_path):
    """minidist.train.loop.train in-process (a test suite, a notebook) takes SIGTERM,
    SIGUSR1 and SIGINT while it runs (stop_at_once, then the loop's Flag) and leaves them
    as they were when it returns (review 39: a later SIGTERM was swallowed)."""
    from minidist.train.loop import train
    from tests.mpirun import tiny_args
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    train(tiny_args("--data", corpus, "--cache-dir", str(tmp_path / "cache"), "--steps", "1"))
    assert {s: signal.getsignal(s) for s in before} == before
