"""The communication layer: ring schedule, chunking, simulation, and the real collectives.

Pure tests (schedule, chunk_bounds, simulation) run in-process. Distributed ones start
mpiexec through tests/mpirun.py (with a timeout; a hang is a failure, not a stuck suite);
each docstring gives the command to run it by hand. A rank that fails, exits or hangs:
tests/test_comm_failures.py; device buffers under CUDA-aware MPI: tests/test_comm_cuda_aware.py.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist.comm.ring import (all_gather_step, chain_step, chunk_bounds, reduce_scatter_step,
                                ring_bytes)
from minidist.comm.simulate import (simulate_all_gather, simulate_all_reduce,
                                    simulate_broadcast, simulate_reduce_scatter)
from mpirun import ROOT, mpi_env


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 64))
def test_chunk_bounds_cover_and_balance(n, size):
    bounds = chunk_bounds(n, size)
    assert len(bounds) == size and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))           # contiguous
    lengths = [hi - lo for lo, hi in bounds]
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
    assert lengths == [len(c) for c in np.array_split(np.arange(n), size)]  # numpy's rule


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_ring_schedule(world):
    """Every receive matches the left neighbour's send; rank r ends reduce-scatter owning
    chunk r; each phase sends every chunk but one."""
    for step_fn in (reduce_scatter_step, all_gather_step):
        for step in range(world - 1):
            for r in range(world):
                assert step_fn(r, world, step)[1] == step_fn((r - 1) % world, world, step)[0]
    for r in range(world):
        if world > 1:
            assert reduce_scatter_step(r, world, world - 2)[1] == r
            assert all_gather_step(r, world, 0)[0] == r
        sent = {reduce_scatter_step(r, world, s)[0] for s in range(world - 1)}
        assert sent == set(range(world)) - {r} or world == 1


def test_chain_schedule_pipelines():
    """Each segment reaches every rank exactly once, one hop per step after the root."""
    world, nseg = 5, 4
    for pos in range(1, world):
        got = [chain_step(pos, world, t, nseg)[1] for t in range(nseg + world - 2)]
        assert [g for g in got if g is not None] == list(range(nseg))
        assert got.index(0) == pos - 1


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ring_bytes_theory(world):
    """2(N-1)/N x bytes per rank for all-reduce when the length divides; within one element
    per phase otherwise."""
    n = 1024 * world
    assert all(ring_bytes("all_reduce", n, 4, r, world) == 2 * (world - 1) * n * 4 // world
               for r in range(world))
    for r in range(world):
        got = ring_bytes("all_reduce", n + 1, 4, r, world)
        assert abs(got - 2 * (world - 1) * (n + 1) * 4 / world) <= 2 * 4


@pytest.mark.cpu_only("comm/simulate.py, the ring's one-process simulation, is numpy by design")
@pytest.mark.parametrize("world,n,op", [(1, 5, "sum"), (2, 3, "sum"), (3, 10, "max"),
                                        (4, 10, "sum"), (5, 7, "avg"), (4, 2, "min")])
def test_simulation_matches_sum(world, n, op):
    """The single-process simulation (ring.py's schedule) computes the reduction exactly."""
    rng = np.random.default_rng(world * 100 + n)
    inputs = [rng.integers(-50, 50, n).astype(np.float64) for _ in range(world)]
    outputs = simulate_all_reduce(inputs, op=op, show=lambda *_: None)
    expect = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}[op](inputs, axis=0)
    for out in outputs:
        np.testing.assert_allclose(out, expect, rtol=1e-12)
    if op in ("sum", "avg"):        # its two phases alone (ZeRO's): rank r's own chunk
        bounds = chunk_bounds(n, world)
        halves = simulate_reduce_scatter(inputs, op=op, show=lambda *_: None)
        for r, (lo, hi) in enumerate(bounds):
            np.testing.assert_allclose(halves[r][lo:hi], expect[lo:hi], rtol=1e-12)
            halves[r][:lo], halves[r][hi:] = np.nan, np.nan    # only its own chunk goes out
        for out in simulate_all_gather(halves, show=lambda *_: None):
            np.testing.assert_allclose(out, expect, rtol=1e-12)
    bufs = simulate_broadcast(np.arange(n, dtype=float), world, root=world - 1,
                              show=lambda *_: None)
    assert all(np.array_equal(b, np.arange(n)) for b in bufs)


def test_ring_walkthrough_example():
    """python examples/ring_walkthrough.py --ranks 3 --n 7 --broadcast"""
    out = subprocess.run([sys.executable, "examples/ring_walkthrough.py", "--ranks", "3",
                          "--n", "7", "--broadcast"], cwd=ROOT, env=mpi_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "reduce-scatter step 1" in out.stdout and ": OK" in out.stdout


def test_import_has_no_side_effects():
    """Importing minidist and minidist.comm sets no environment variable, starts no MPI,
    installs no hook; comm.init() does all three (MPI, the excepthook, MPICH's settings)."""
    code = ("import os, sys; before = dict(os.environ); hook = sys.excepthook\n"
            "import minidist, minidist.backend, minidist.comm as c\n"
            "from mpi4py import MPI\n"
            "assert dict(os.environ) == before and sys.excepthook is hook\n"
            "assert not MPI.Is_initialized()\n"
            "world = c.init()\n"
            "assert MPI.Is_initialized() and sys.excepthook is not hook\n"
            "print('ok', world.size)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=mpi_env(MPI_LOCALNRANKS="64"))
    assert out.returncode == 0 and out.stdout.split() == ["ok", "1"], out.stderr


def test_group_before_init_is_a_clear_error():
    code = ("from minidist.comm import ProcessGroup\n"
            "try:\n    ProcessGroup.world()\nexcept RuntimeError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=mpi_env())
    assert "call minidist.comm.init() first" in out.stdout, (out.stdout, out.stderr)


def test_a_gpu_run_whose_collectives_go_through_the_host_is_told():
    """First-use walk 31: a GPU run of several ranks with --comm ring (or naive, mpi, hier)
    over an MPI that is not CUDA-aware copies every collective through host memory, and
    nothing said so. The start-up note (train/loop.py, under --device cuda with more than
    one rank) names the cost and --comm nccl; nothing under nccl or a CUDA-aware MPI."""
    from minidist.comm.staging import host_staging_note
    for algo in ("ring", "naive", "mpi", "hier"):
        note = host_staging_note(algo, aware=False)
        assert note.startswith(f"--comm {algo} on GPUs: this MPI is not CUDA-aware, so every "
                               "collective copies its buffers to host memory and back")
        assert note.endswith("--comm nccl moves them GPU to GPU")
        assert host_staging_note(algo, aware=True) is None
    assert host_staging_note("nccl", aware=False) is None


def test_import_does_not_import_cupy_and_detects_cuda_awareness():
    """The PyPI mpich wheel is not CUDA-aware; MINIDIST_CUDA_AWARE_MPI overrides it."""
    code = ("import sys, minidist.comm as c; c.init(); assert 'cupy' not in sys.modules; "
            "print(c.cuda_aware_mpi())")
    for env, expect in (({}, "False"), ({"MINIDIST_CUDA_AWARE_MPI": "1"}, "True")):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=mpi_env(**env),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == expect, (out.stdout, out.stderr)


@pytest.mark.mpi
@pytest.mark.cpu_only("comm_check.py's buffers are numpy; cupy's: tests/test_comm_gpu.py")
@pytest.mark.parametrize("nprocs,wait", [(2, "poll"), (3, "block"), (4, "poll")])
def test_collectives(nprocs, wait, tmp_path, mpi):
    """All collectives x algorithms (ring, naive, mpi) x dtypes x odd lengths, async, p2p,
    counters, sub-groups, 2x2 mesh, debug mismatch, Chrome trace, under each wait policy.
    By hand: MINIDIST_COMM_WAIT=poll mpiexec -n 4 python tests/scripts/comm_check.py"""
    path = tmp_path / "trace.json"
    out = mpi(nprocs, "tests/scripts/comm_check.py", "--trace", path, timeout=180,
              env=mpi_env(MINIDIST_COMM_WAIT=wait))
    assert f"comm_check OK: {nprocs} ranks" in out.stdout
    events = json.loads(path.read_text())["traceEvents"]
    rows = {e["pid"] for e in events if e["ph"] == "X"}
    assert rows == set(range(nprocs)), "one row per rank"
    assert {"all_reduce", "reduce_scatter", "all_gather", "broadcast"} <= \
        {e["name"] for e in events if e["ph"] == "X"}


@pytest.mark.mpi
def test_trace_log_every_collective_and_step(mpi):
    """MINIDIST_TRACE=2 logs each collective (seq, op, algo, group, dtype, bytes, times),
    the object ones too (first-use walk 43: their numbers were holes in the log), and each
    ring step. By hand:
    MINIDIST_TRACE=2 mpiexec -n 2 python tests/scripts/comm_small.py log"""
    out = mpi(2, "tests/scripts/comm_small.py", "log", env=mpi_env(MINIDIST_TRACE=2))
    for rank in (0, 1):
        assert (f"[rank {rank}] #1 all_reduce algo=ring group=world dtype=float32 bytes=28"
                in out.stderr), out.stderr
        assert f"[rank {rank}] #2 broadcast" in out.stderr
        assert f"[rank {rank}] #3 all_gather_object group=world (Python objects)" in out.stderr
    assert "reduce-scatter step 0: chunk" in out.stderr and "all-gather step 0" in out.stderr


@pytest.mark.mpi
def test_breakpoint_on_one_rank():
    """Rank 1 stops in pdb; another terminal attaches and steps over a real all_reduce. By hand:
    mpiexec -n 2 python tests/scripts/comm_small.py breakpoint
    python -m minidist.comm.attach 4445          # in a second terminal"""
    import signal
    from mpirun import mpiexec
    base = 20000 + os.getpid() % 20000
    env = mpi_env(MINIDIST_PDB_PORT=base)
    job = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "tests/scripts/comm_small.py",
                            "breakpoint"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for _ in range(100):   # until rank 1 listens
            client = subprocess.run([sys.executable, "-m", "minidist.comm.attach",
                                     str(base + 1)], cwd=ROOT, env=env, timeout=60, text=True,
                                    input="n\np world.rank, buf\nc\n", capture_output=True)
            if "ConnectionRefused" not in client.stderr:
                break
            time.sleep(0.2)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert "(1, array([3., 3., 3., 3.]))" in client.stdout, (client.stdout, client.stderr)
    assert "rank 0 done 3.0" in out and "rank 1 done 3.0" in out, (out, err)


def test_mpich_defaults():
    """With more ranks on the node than cores, comm.init() selects MPICH's "mpir" intra-node
    algorithms before MPI_Init (a value already set wins); otherwise nothing."""
    code = ("import os, minidist.comm; from minidist.comm import mpich; mpich.apply_defaults(); "
            "print(os.environ.get('MPIR_CVAR_BCAST_POSIX_INTRA_ALGORITHM', 'unset'))")
    for env, expect in (({"MPI_LOCALNRANKS": "64"}, "mpir"), ({"MPI_LOCALNRANKS": "1"}, "unset"),
                        ({"MPI_LOCALNRANKS": "64",
                          "MPIR_CVAR_BCAST_POSIX_INTRA_ALGORITHM": "auto"}, "auto")):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                             env=mpi_env(MPI_LOCALRANKID="0", **env),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == expect, (env, out.stdout, out.stderr)


@pytest.mark.parametrize("flags", [["--ranks", "0"], ["--ranks", "-2"], ["--n", "-1"]])
def test_ring_walkthrough_refuses_bad_input(flags):
    """python examples/ring_walkthrough.py --ranks 0 (and -2, --n -1): one `error:` line
    naming the flag, exit 2, no traceback from the simulator."""
    out = subprocess.run([sys.executable, "examples/ring_walkthrough.py", *flags], cwd=ROOT,
                         env=mpi_env(), capture_output=True, text=True, timeout=60)
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(errors) == 1 and f"error: {' '.join(flags)}:" in errors[0], out.stderr


@pytest.mark.cpu_only("the non-blocking calls' numpy arrays")
def test_a_non_blocking_collective_holds_its_arrays_until_done():
    """mpi.start_reduce_scatter & co. keep the arrays MPI reads and writes alive until the
    request is dropped: mpi4py's request held no reference to Ireduce_scatter's send buffer
    or Iallreduce's in-place one, so a temporary passed in was freed before Wait, and under
    Open MPI (which does the work in Wait) rank 0's result was garbage (comm_check.py under
    tests/test_openmpi.py's setup). On one rank, COMM_SELF: each array outlives `del` until
    the request goes, and the results are right."""
    import gc
    import weakref

    from mpi4py import MPI

    from minidist.comm import mpi
    out, full = np.empty(5), np.empty(5)
    temps = [np.arange(5.0), np.ones(5), np.full(5, 3.0), np.full(5, 4.0)]
    alive = [weakref.ref(a) for a in temps]
    requests = [mpi.start_reduce_scatter(MPI.COMM_SELF, out, temps[0]),
                mpi.start_all_reduce(MPI.COMM_SELF, temps[1]),
                mpi.start_all_gather(MPI.COMM_SELF, full, temps[2]),
                mpi.start_broadcast(MPI.COMM_SELF, temps[3])]
    del temps
    gc.collect()
    assert all(ref() is not None for ref in alive)
    MPI.Request.Waitall(requests)
    assert out.tolist() == [0, 1, 2, 3, 4] and full.tolist() == [3.0] * 5
    del requests
    gc.collect()
    assert all(ref() is None for ref in alive)


def test_a_channel_says_its_collective_group_and_rank_in_a_debugger():
    """`p ch` in a debugger stopped in ring.py (the comm chapter's recipe prints
    `p ch.rank, buf.size`) printed an address: the collective, the group and this rank now
    (first-use walk of 2026-11-30)."""
    from mpi4py import MPI
    from minidist.comm.channel import Channel
    assert repr(Channel(MPI.COMM_SELF, "dp", "reduce_scatter")) == \
        "Channel('reduce_scatter' on group 'dp', rank 0 of 1)"
