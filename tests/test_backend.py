"""The array backend: device choice, host moves, threads per rank, memory stats."""
import ast
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist import backend
from mpirun import mpi_env, run_mpi


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
    monkeypatch.setattr(backend, "available_cores", lambda: 2)
    assert backend.default_threads() == 1  # 2 cores shared by 4 ranks: never 0


def test_import_sets_blas_threads_before_numpy_loads():
    """A fresh interpreter under a fake 4-rank launcher env gets cores // 4 threads (>= 1)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MINIDIST_THREADS")}
    env.update(MPI_LOCALRANKID="0", MPI_LOCALNRANKS="4")
    code = ("import minidist, os; from minidist import backend as b; "
            "print(os.environ['OPENBLAS_NUM_THREADS'], b.blas_threads())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    expected = max(1, backend.available_cores() // 4)
    assert out == [str(expected), str(expected)]


@pytest.mark.mpi
def test_threads_per_rank_under_mpiexec(tmp_path):
    """Each of 4 ranks on this node gets cores // 4 BLAS threads (at least 1). By hand:
    mpiexec -n 4 python -c 'import minidist; print(minidist.backend.blas_threads())'"""
    script = tmp_path / "threads.py"
    # Rank 0 gathers and prints one line: per-rank prints can interleave mid-line on stdout.
    script.write_text("import minidist\nfrom minidist import backend as b\n"
                      "from mpi4py import MPI\n"
                      "rows = MPI.COMM_WORLD.gather((b.local_rank_and_size(), b.blas_threads()))\n"
                      "if rows: print('threads', rows)\n")
    env = mpi_env()
    for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MINIDIST_THREADS"):
        env.pop(k)
    out = run_mpi(4, str(script), env=env, timeout=60).stdout
    line = next(line for line in out.splitlines() if line.startswith("threads"))
    rows = ast.literal_eval(line[len("threads"):])
    expected = max(1, backend.available_cores() // 4)
    assert rows == [((r, 4), expected) for r in range(4)], out
