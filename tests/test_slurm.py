"""examples/slurm/train.sbatch under a fake `srun`: the launch a cluster job makes, on this
machine.

The fake srun (written first on PATH) starts the ranks through the mpich wheel's mpiexec, so
they can talk, and gives each the task variables Slurm's srun sets (SLURM_PROCID,
SLURM_LOCALID, SLURM_STEP_NUM_TASKS, SLURM_STEP_TASKS_PER_NODE, SLURM_NODEID) with Hydra's
own local-rank variables removed: minidist must find its place from Slurm's. A fake scontrol
records the requeue. By hand (a real cluster): sbatch examples/slurm/train.sbatch --steps 100
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mpirun import ROOT, mpi_env, mpiexec

FAKE_SRUN = r"""#!/bin/bash
# fake srun: --ntasks=N (other options ignored), then the command on N local ranks
n=1
while [[ "$1" == -* ]]; do
    case "$1" in --ntasks=*) n="${1#*=}" ;; -n|--ntasks) n="$2"; shift ;; esac
    shift
done
echo "srun: $n task(s): $*" >&2
export SLURM_STEP_NUM_TASKS=$n SLURM_STEP_TASKS_PER_NODE=$n SLURM_NODEID=0
exec "MPIEXEC" -n "$n" bash -c '
    export SLURM_PROCID=$PMI_RANK SLURM_LOCALID=$PMI_RANK
    unset MPI_LOCALRANKID MPI_LOCALNRANKS
    exec "$@"' _ "$@"
"""
# each rank writes its own file: two ranks printing to one pipe can interleave their lines
PROBE = ("import json, os; from minidist import launcher as L; r = os.environ['SLURM_PROCID']; "
         "open(os.path.join(os.environ['PROBE_DIR'], r + '.json'), 'w').write(json.dumps("
         "[int(r), L.local_rank_and_size(), L.world_size_from_env()]))")


def _fake_cluster(tmp_path):
    """A bin/ with the fake srun and scontrol, and the batch job's environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.replace("MPIEXEC", mpiexec()))
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho \"$@\" >> {tmp_path}/scontrol.log\n")
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    env = mpi_env(PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
                  SLURM_JOB_ID="42", SLURM_JOB_NAME="minidist", SLURM_NNODES="1",
                  SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_CPUS_PER_TASK="1",
                  SLURM_SUBMIT_DIR=ROOT, CKPT=str(tmp_path / "ckpt"), PYTHON=sys.executable)
    return env


def _sbatch_preempted(flags, env, ready, timeout=90):
    """Run examples/slurm/train.sbatch with `flags` under `env` and, once `ready()` holds
    (None: no signal, the run ends by itself), send SIGTERM to its whole process group -- the
    batch shell, srun and every rank -- as Slurm's preemption does. Returns (the finished
    Popen, stdout, stderr); the group is killed if it outlives `timeout`."""
    proc = subprocess.Popen(["bash", "examples/slurm/train.sbatch", *map(str, flags)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        if ready is not None:
            deadline = time.time() + timeout
            while not ready():
                assert time.time() < deadline and proc.poll() is None, proc.communicate()
                time.sleep(0.1)
            os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, out, err


@pytest.mark.mpi
def test_fake_srun_gives_slurm_variables(tmp_path):
    """Each rank reads its local rank and the job size from Slurm's variables alone."""
    env = {**_fake_cluster(tmp_path), "PROBE_DIR": str(tmp_path)}
    out = subprocess.run(["srun", "--mpi=pmi2", "--ntasks=2", sys.executable, "-c", PROBE],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    rows = sorted(json.loads(p.read_text()) for p in tmp_path.glob("[0-9].json"))
    assert rows == [[0, [0, 2], 2], [1, [1, 2], 2]], (out.stdout, out.stderr)


@pytest.mark.mpi
def test_sbatch_script_requeues_after_sigterm_to_the_whole_job(tmp_path, corpus):
    """Preemption as Slurm does it: SIGTERM to every process of the job, the batch shell
    too. The ranks save at the next step boundary and exit 75, and the script, which traps
    the signal to outlive it, requeues the job (without the trap bash died of it at once, and
    the requeue line never ran: the job was not restarted). By hand: run the script under the
    fake srun, then kill -TERM -PGID."""
    env = _fake_cluster(tmp_path)
    log = tmp_path / "log.jsonl"
    flags = ["--data", corpus, "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
             "--block-size", "16", "--batch-size", "4", "--eval-iters", "1", "--sample", "0",
             "--device", "cpu", "--steps", "100000", "--log-json", log]
    proc, out, err = _sbatch_preempted(flags, env, lambda: log.exists() and sum(
        1 for _ in open(log)) >= 2)
    assert proc.returncode == 75, (proc.returncode, out[-2000:], err[-2000:])
    assert "requeueing job 42" in out and os.listdir(tmp_path / "ckpt"), out[-2000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 42\n"


@pytest.mark.mpi
def test_sbatch_script_requeues_when_the_signal_comes_before_the_ranks_handler(tmp_path):
    """A SIGTERM in a rank's first ~0.1 s, before Python runs the script's first line and its
    handler, kills the rank (2026-11-29's chaos campaign met it: exit 143 or BAD
    TERMINATION, not 75), and the script requeued only on 75: the job was not restarted. It
    requeues now when it was itself signalled and the launch failed. Here $PYTHON is a shell
    script that sleeps, so each rank dies of SIGTERM as Python does before that first line;
    without a signal a failing launch is not requeued. By hand: PYTHON=... bash
    train.sbatch, then kill -TERM -PGID."""
    env = _fake_cluster(tmp_path)
    ranks = tmp_path / "python"
    ranks.write_text(f"#!/bin/bash\ntouch {tmp_path}/started.$SLURM_PROCID\n"
                     "[ -n \"${FAIL:-}\" ] && exit 3\nexec sleep 600\n")
    ranks.chmod(0o755)
    env["PYTHON"] = str(ranks)
    for fail in ("1", ""):
        for marker in tmp_path.glob("started.*"):
            marker.unlink()
        proc, out, err = _sbatch_preempted(
            ["--steps", "10"], {**env, "FAIL": fail},
            None if fail else lambda: len(list(tmp_path.glob("started.*"))) == 2)
        requeues = tmp_path / "scontrol.log"
        if fail:
            assert proc.returncode != 0 and not requeues.exists(), (out, err)
        else:
            assert proc.returncode not in (0, 75), (proc.returncode, out, err)
            assert "without saving this step: requeueing job 42" in out, (out, err)
            assert requeues.read_text() == "requeue 42\n"


@pytest.mark.mpi
@pytest.mark.slow
def test_sbatch_script_trains_then_resumes(tmp_path, corpus):
    """The batch script trains 2 ranks through srun, saves; started again (as after a requeue)
    with the same command it resumes from its checkpoint. By hand (fake srun on PATH):
    SLURM_NNODES=1 SLURM_NTASKS=2 bash examples/slurm/train.sbatch --steps 2 ..."""
    env = _fake_cluster(tmp_path)
    flags = ["--data", corpus, "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
             "--block-size", "16", "--batch-size", "4", "--eval-iters", "1", "--sample", "0",
             "--device", "cpu"]
    first = subprocess.run(["bash", "examples/slurm/train.sbatch", *flags, "--steps", "2"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, (first.stdout, first.stderr)
    assert "srun: 2 task(s)" in first.stderr and "2 process(es)" in first.stdout
    assert os.listdir(tmp_path / "ckpt"), "no checkpoint saved"
    again = subprocess.run(["bash", "examples/slurm/train.sbatch", *flags, "--steps", "3"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, (again.stdout, again.stderr)
    assert "resumed from" in again.stdout and "at step 2" in again.stdout, again.stdout
    assert not (tmp_path / "scontrol.log").exists()   # a finished run is not requeued


def test_dry_run_prints_the_launch_and_the_venv_it_found(tmp_path):
    """DRY_RUN=1 runs nothing (no srun on PATH here) and prints the Python the job would use:
    $VENV's (its bin/activate sourced), whether CuPy imports in it (--comm nccl needs it: a
    job without it waited in the queue to fail), the cores and BLAS threads each rank gets,
    then the command. By hand:

        DRY_RUN=1 VENV=.venv bash examples/slurm/train.sbatch --steps 5
    """
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv}/bin:$PATH"\n')
    env = mpi_env(VENV=str(venv), DRY_RUN="1", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="3",
                  CKPT=str(tmp_path / "ck"), SLURM_CPUS_PER_TASK="8")
    env.pop("PYTHON", None)
    env.pop("SRUN_CPUS_PER_TASK", None)
    out = subprocess.run(["bash", "examples/slurm/train.sbatch", "--steps", "5"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"python: {venv}/bin/python (minidist from {ROOT}/minidist)" in out.stdout, out.stdout
    cupy = importlib.util.find_spec("cupy") is not None      # only the import is checked
    assert ("cupy: not installed: --comm nccl and --device cuda need it" in out.stdout) \
        != cupy, out.stdout
    # first-use walk 26: from Slurm 22.05 srun does not take the job's --cpus-per-task
    # (each rank one core, 8 BLAS threads on it): SRUN_CPUS_PER_TASK hands it on
    assert "cores per rank: 8 (SRUN_CPUS_PER_TASK), BLAS threads 8 (OPENBLAS_NUM_THREADS)" \
        in out.stdout, out.stdout
    assert (f"would run: srun --mpi=pmi2 --kill-on-bad-exit=1 --ntasks=6 python "
            f"examples/train_gpt.py --save {tmp_path / 'ck'} --resume auto --steps 5"
            in out.stdout), out.stdout
    assert not (tmp_path / "ck").exists()
    # submitted from another folder, the job would wait in the queue, then fail on every
    # rank (found by a first-use walk: the dry run passed): one line, before anything runs
    away = subprocess.run(["bash", os.path.join(ROOT, "examples/slurm/train.sbatch")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert away.returncode == 2 and away.stdout == "" and away.stderr == (
        f"error: {tmp_path} has no examples/train_gpt.py: submit from the repository's root "
        "(cd minidist && sbatch examples/slurm/train.sbatch ...)\n"), away.stderr


def test_dry_run_launches_for_the_clusters_mpi_and_the_jobs_own_folder(tmp_path):
    """First-use walk 31: the script launched only the mpich wheel's way (srun --mpi=pmi2,
    Hydra's mpirun -ppn) and saved every submission into one folder. SRUN_MPI picks srun's
    PMI (pmix: Open MPI); under LAUNCH=mpirun an Open MPI mpirun gets --map-by ppr:N:node;
    CKPT defaults to checkpoints/<job name>-<job id>, which a requeue keeps."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "mpirun").write_text("#!/bin/sh\necho 'mpirun (Open MPI) 5.0.6'\n")
    (fake / "mpirun").chmod(0o755)
    env = mpi_env(DRY_RUN="1", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="8",
                  SLURM_JOB_NAME="gpt", SLURM_JOB_ID="4242", PYTHON=sys.executable,
                  PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    env.pop("CKPT", None)

    def would_run(**extra):
        out = subprocess.run(["bash", "examples/slurm/train.sbatch", "--tp", "8"], cwd=ROOT,
                             env={**env, **extra}, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.split("would run: ")[1].split(sys.executable)[0].strip()

    assert would_run(SRUN_MPI="pmix") == "srun --mpi=pmix --kill-on-bad-exit=1 --ntasks=16"
    assert would_run(LAUNCH="mpirun") == "mpirun -n 16 --map-by ppr:8:node"
    out = subprocess.run(["bash", "examples/slurm/train.sbatch"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60).stdout
    assert "--save checkpoints/gpt-4242 --resume auto" in out, out
