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

from tests.mpirun import ROOT, device_flags, mpi_env, mpiexec

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
    resumed = subprocess.run([*launcher, sys.executable, "examples/train_gpt.py", *flags[:-2],
                              "--resume", save, "--stop-at", str(done[-1] + 3)], cwd=ROOT,
                             env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"at step {done[-1] + 1}" in resumed.stdout
