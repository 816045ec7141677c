"""The communication layer: ring schedule, chunking, simulation, and the real collectives.

Pure tests (schedule, chunk_bounds, simulation) run in-process. Distributed ones start
mpiexec through tests/mpirun.py (with a timeout; a hang is a failure, not a stuck suite);
each docstring gives the command to run it by hand.
"""
import contextlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist import comm
from minidist.comm import trace
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
@pytest.mark.parametrize("repeat", range(3))
def test_raise_on_one_rank_aborts(repeat, mpi):
    """A raise on one rank ends the whole job quickly (MPI Abort), never a hang, and the
    traceback always reaches the output (3 runs here; 20 of 20 by hand). By hand:
    mpiexec -n 4 python tests/scripts/comm_small.py abort"""
    start = time.monotonic()
    out = mpi(4, "tests/scripts/comm_small.py", "abort", timeout=60, check=False)
    assert out.returncode != 0
    assert time.monotonic() - start < 30
    assert "boom on rank 1" in out.stderr and "aborting the whole MPI job" in out.stderr
    assert "unreachable" not in out.stdout


@pytest.mark.mpi
def test_sys_exit_on_one_rank_ends_the_job(mpi):
    """sys.exit(3) on rank 1 while the others wait for it in an all_reduce: no exception hook
    sees a SystemExit, the exit handler does; the job ends in seconds, naming the rank and
    the collective. By hand: mpiexec -n 4 python tests/scripts/comm_small.py exit"""
    start = time.monotonic()
    out = mpi(4, "tests/scripts/comm_small.py", "exit", timeout=60, check=False)
    assert out.returncode != 0 and time.monotonic() - start < 30, out.stderr
    assert "world rank 1 exited" in out.stderr and "all_reduce #1" in out.stderr, out.stderr
    assert out.stderr.count("world rank 1 exited") == 1, out.stderr    # by rank 0 alone
    assert "unreachable" not in out.stdout


@pytest.mark.mpi
def test_sys_exit_while_the_others_gather_objects_ends_the_job(mpi):
    """The object collectives (checkpoint verdicts, the memory table's rows: ProcessGroup's
    gather_object, all_gather_object, broadcast_object) are watched as the array ones are:
    rank 1 exits while the others wait in one, and the job ends in seconds naming it (they
    were raw mpi4py calls, where the others waited for ever). By hand:
    mpiexec -n 3 python tests/scripts/comm_small.py rawexit"""
    start = time.monotonic()
    out = mpi(3, "tests/scripts/comm_small.py", "rawexit", timeout=60, check=False)
    assert out.returncode != 0 and time.monotonic() - start < 30, out.stderr
    assert "world rank 1 exited" in out.stderr and "all_gather_object #1" in out.stderr, \
        out.stderr
    assert "unreachable" not in out.stdout


@pytest.mark.mpi
def test_an_asynchronous_collective_that_fails_ends_the_job_naming_it(mpi):
    """Rank 1's async all_reduce raises in the communication thread (a read-only buffer), and
    the rank goes on to its next collective: the thread ends the job at once, naming the
    operation and the error (it kept the error for a wait() that came too late, and rank 1's
    next collective met the others still in the first: an MPI error naming neither). By
    hand: mpiexec -n 3 python tests/scripts/comm_small.py asyncfail"""
    start = time.monotonic()
    out = mpi(3, "tests/scripts/comm_small.py", "asyncfail", timeout=60, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=20))
    assert out.returncode != 0 and time.monotonic() - start < 15, out.stderr
    assert "[rank 1] asynchronous all_reduce #1 on group 'world' failed on this rank" \
        in out.stderr and "output array is read-only" in out.stderr, out.stderr
    assert "unreachable" not in out.stdout


@pytest.mark.mpi
def test_an_exiting_rank_waits_for_a_straggler_only_up_to_the_timeout(mpi):
    """Rank 0 exits while rank 1 is stuck where no watchdog looks (compute, or MPI outside a
    ProcessGroup): rank 0 waits for it in its exit handler up to the timeout, then ends the
    job saying so (it waited for ever). By hand:
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 2 python tests/scripts/comm_small.py straggler"""
    start = time.monotonic()
    out = mpi(2, "tests/scripts/comm_small.py", "straggler", timeout=60, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=3))
    assert out.returncode != 0 and time.monotonic() - start < 30, out.stderr
    assert "[rank 0] this rank is exiting, and the others have not exited 3 s later" \
        in out.stderr, out.stderr


@pytest.mark.mpi
def test_a_rank_that_dies_before_mpi_init_ends_the_job(mpi):
    """Rank 1 raises before comm.init: MPICH's launcher leaves the others in MPI_Init for
    ever (pmodels/mpich#6124). With a 3 s timeout the waiting ranks exit with a stack dump
    naming the wait (the first one's always comes through: once it exits the launcher may
    kill the rest before they print); the failing rank's own traceback comes through. By hand:
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 3 python tests/scripts/comm_small.py preinit"""
    start = time.monotonic()
    out = mpi(3, "tests/scripts/comm_small.py", "preinit", timeout=60, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=3))
    assert out.returncode != 0 and time.monotonic() - start < 30, out.stderr
    assert "rank 1 failed before MPI_Init" in out.stderr, out.stderr
    assert 1 <= out.stderr.count("in _wait_in_mpi_init_for_every_rank") <= 2, out.stderr
    assert "unreachable" not in out.stdout


def test_a_sub_second_timeout_does_not_bound_mpi_init(monkeypatch):
    """--comm-timeout 0.01 also bounded MPI_Init, which takes up to a second on a busy
    machine: a healthy job was killed while it started (a stack dump, or only MPICH's
    noise). MPI_Init now waits at least MPI_INIT_AT_LEAST_S; 0 still waits for ever, and a
    timeout above the floor (the 3 s of the test above) is kept."""
    monkeypatch.delenv("MINIDIST_COMM_TIMEOUT", raising=False)
    assert comm.mpi_init_wait_s(0.01) == comm.MPI_INIT_AT_LEAST_S == 2.0
    assert comm.mpi_init_wait_s(0) == 0 and comm.mpi_init_wait_s(3) == 3
    assert comm.mpi_init_wait_s(None) == 600
    # walk 37: "a big number for never" overflowed faulthandler's timer, a traceback per rank
    import faulthandler
    assert comm.mpi_init_wait_s(1e30) == comm.MPI_INIT_AT_MOST_S
    faulthandler.dump_traceback_later(comm.mpi_init_wait_s(1e30), exit=True)
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.mpi
def test_collective_timeout_names_op_group_and_missing_ranks(mpi):
    """Rank 1 never reaches the all_reduce; with a 3 s timeout the others abort the job,
    naming the op, the group and rank 1. By hand:
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 3 python tests/scripts/comm_small.py block"""
    start = time.monotonic()
    out = mpi(3, "tests/scripts/comm_small.py", "block", timeout=60, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=3))
    assert out.returncode != 0 and time.monotonic() - start < 30, out.stderr
    assert "all_reduce #1 on group 'world' (world ranks [0, 1, 2]) waited more than 3 s" \
        in out.stderr, out.stderr
    assert "MINIDIST_COMM_TIMEOUT" in out.stderr
    assert "world ranks that did not arrive: [1]" in out.stderr
    # once, by rank 0, the lowest waiting (walk 37: once per waiting rank)
    assert out.stderr.count("waited more than 3 s") == 1, out.stderr


@pytest.mark.mpi
def test_point_to_point_timeout_names_the_peer(mpi):
    """A pipeline's receive whose sender never comes: with a 3 s timeout the job aborts,
    naming the peer. By hand:
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 2 python tests/scripts/comm_small.py p2p"""
    start = time.monotonic()
    out = mpi(2, "tests/scripts/comm_small.py", "p2p", timeout=60, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=3))
    assert out.returncode != 0 and time.monotonic() - start < 30, out.stderr
    assert "recv with rank 1 of group 'world' waited more than 3 s for world rank 1" \
        in out.stderr, out.stderr
    assert "unreachable" not in out.stdout


@pytest.mark.mpi
def test_ranks_finishing_at_different_times_exit_cleanly(mpi):
    """A clean finish is not an abort: rank 0 leaves 1.5 s after the others (which announce
    their exit and wait for it). By hand: mpiexec -n 3 python tests/scripts/comm_small.py finish"""
    out = mpi(3, "tests/scripts/comm_small.py", "finish", timeout=60)
    assert all(f"rank {r} finished" in out.stdout for r in range(3)), out.stderr
    assert "abort" not in out.stderr.lower()


@pytest.mark.mpi
def test_trace_log_every_collective_and_step(mpi):
    """MINIDIST_TRACE=2 logs each collective (seq, op, algo, group, dtype, bytes, times) and
    each ring step. By hand:
    MINIDIST_TRACE=2 mpiexec -n 2 python tests/scripts/comm_small.py log"""
    out = mpi(2, "tests/scripts/comm_small.py", "log", env=mpi_env(MINIDIST_TRACE=2))
    for rank in (0, 1):
        assert (f"[rank {rank}] #1 all_reduce algo=ring group=world dtype=float32 bytes=28"
                in out.stderr), out.stderr
        assert f"[rank {rank}] #2 broadcast" in out.stderr
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


# ---- CUDA-aware MPI: device buffers must be ready before MPI touches them -----------------

class _RecordingComm:
    """Stands in for the communicator mpi.py calls: each call is logged with the arrays it
    was handed (nested lists of buffers and counts flattened), nothing is sent."""

    def __init__(self, log, size):
        self.log, self.size = log, size

    def Get_size(self):
        return self.size

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.log.append((name, _arrays_in(args)))


def _arrays_in(args):
    found = []
    for a in args:
        if isinstance(a, np.ndarray):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found += _arrays_in(a)
    return found


def _mpi_calls(dtype):
    """(name, world size, fn(ch, comm, a)) for each of mpi.py's calls; a(n) makes a buffer."""
    from minidist.comm import mpi
    calls = [
        ("all_reduce", 2, lambda ch, comm, a: mpi.mpi_all_reduce(ch, a(6), "avg")),
        ("reduce_scatter", 2, lambda ch, comm, a: mpi.mpi_reduce_scatter(ch, a(3), a(6))),
        ("reduce_scatter uneven", 2,
         lambda ch, comm, a: mpi.mpi_reduce_scatter(ch, a(4), a(7))),
        ("reduce_scatter aliased", 2,
         lambda ch, comm, a: (lambda buf: mpi.mpi_reduce_scatter(ch, buf[:3], buf))(a(6))),
        ("all_gather", 2, lambda ch, comm, a: mpi.mpi_all_gather(ch, a(6), a(3))),
        ("all_gather uneven", 3, lambda ch, comm, a: mpi.mpi_all_gather(ch, a(7), a(3))),
        ("all_gather in place", 2,
         lambda ch, comm, a: (lambda out: mpi.mpi_all_gather(ch, out, out[:3]))(a(6))),
        ("broadcast", 2, lambda ch, comm, a: mpi.mpi_broadcast(ch, a(5), 1)),
        ("all_to_all_v", 2,
         lambda ch, comm, a: mpi.mpi_all_to_all_v(ch, a(5), a(4), [1, 3], [2, 3])),
        ("start_all_gather", 2, lambda ch, comm, a: mpi.start_all_gather(comm, a(6), a(3))),
        ("start_broadcast", 2, lambda ch, comm, a: mpi.start_broadcast(comm, a(5))),
    ]
    if dtype != "bfloat16":                  # MPI's non-blocking reductions refuse bfloat16
        calls += [
            ("start_all_reduce", 2, lambda ch, comm, a: mpi.start_all_reduce(comm, a(6))),
            ("start_reduce_scatter", 2,
             lambda ch, comm, a: mpi.start_reduce_scatter(comm, a(3), a(6))),
        ]
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_mpi_call_waits_for_the_device_before_mpi_touches_its_buffers(monkeypatch,
                                                                           dtype):
    """A CUDA-aware MPI is handed cupy arrays themselves and reads them at once, while the
    kernels that write them (the caller's, or mpi.py's own float32 copies of bfloat16) may
    still be queued: mpi4py's CuPy demo synchronizes before every MPI call. mpi.py called
    MPI with no device_ready. Here (numpy buffers, device_ready recorded in place of the
    stream sync) every array an MPI call is handed must share memory with one readied
    before that call, after the array was made: the bfloat16 reductions' float32 copies
    and the aliased reduce-scatter's copy are new arrays, readied only if after their
    making."""
    from types import SimpleNamespace
    from minidist.comm import mpi
    calls = _mpi_calls(dtype)
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    log = []
    monkeypatch.setattr(mpi, "device_ready", lambda *arrays: log.append(("ready", arrays)),
                        raising=False)    # an mpi.py without it fails the asserts
    for name, size, call in calls:
        log.clear()
        comm = _RecordingComm(log, size)
        ch = SimpleNamespace(comm=comm, rank=0, size=size, count_nominal=lambda n: None,
                             scratch=lambda slot, n, like: np.empty(n, like.dtype))
        call(ch, comm, lambda n: np.arange(n).astype(dtype))
        ready, mpi_calls = [], 0
        for what, arrays in log:
            if what == "ready":
                ready += [a for a in arrays if isinstance(a, np.ndarray)]
                continue
            mpi_calls += 1
            for a in arrays:
                assert any(np.shares_memory(a, r) for r in ready), \
                    f"{name} ({np.dtype(dtype)}): {what} got a buffer not readied before it"
        assert mpi_calls == 1, (name, log)


class _FakeCupyArray(np.ndarray):
    """A numpy array that the patched is_cupy takes for a cupy one (_fake_is_cupy)."""

    def set(self, host):
        """cupy.ndarray.set: copy a host array in (staging's write_back)."""
        self[...] = host


def _fake_is_cupy(a):
    return isinstance(a, _FakeCupyArray)


class _LoggedComm:
    """An mpi4py communicator whose calls are logged (name, first argument) and then made."""

    def __init__(self, comm, log):
        self.comm, self.log = comm, log

    def __getattr__(self, name):
        real = getattr(self.comm, name)

        def call(*args, **kwargs):
            self.log.append((name, args[0] if args else None))
            return real(*args, **kwargs)
        return call


@pytest.mark.cpu_only("stands a numpy subclass in for a cupy array")
def test_recv_into_a_device_buffer_waits_for_the_device_before_posting_irecv(monkeypatch):
    """With a CUDA-aware MPI, recv hands the device buffer to MPI_Irecv itself, and MPI may
    write it while queued kernels still read it: ring attention posts the recv of the next
    block into the buffer the previous step's kernels read as `cur`. send waited
    (device_ready) and recv did not. Here (one rank, a message to itself) device_ready on
    the buffer must come before the Irecv that is handed that buffer itself."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup, group as group_module, staging
    log = []
    monkeypatch.setattr(staging, "cuda_aware_mpi", lambda: True)
    monkeypatch.setattr(staging, "is_cupy", _fake_is_cupy)
    monkeypatch.setattr(group_module, "is_cupy", _fake_is_cupy)
    monkeypatch.setattr(group_module, "device_ready",
                        lambda *arrays: log.append(("ready", arrays)))
    g = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank recv")
    p2p = g._p2p
    buf = np.zeros(5, np.float32).view(_FakeCupyArray)
    try:
        g._p2p = _LoggedComm(p2p, log)
        work = g.send(np.arange(5, dtype=np.float32), 0, async_op=True)
        g.recv(buf, 0)
        work.wait()
    finally:
        g._p2p = p2p
        g.destroy()
        trace.reset_counters()  # its 20 bytes showed in a later run's comm_bytes (test_train)
    assert np.array_equal(buf, np.arange(5)), buf
    irecv = [name for name, _ in log].index("Irecv")
    handed = log[irecv][1]
    assert _fake_is_cupy(handed) and np.shares_memory(handed, buf)     # not staged: buf itself
    assert any(name == "ready" and any(np.shares_memory(a, buf) for a in arrays)
               for name, arrays in log[:irecv]), log


@pytest.mark.cpu_only("stands a numpy subclass in for a cupy array")
def test_staging_copies_to_the_host_only_the_buffers_mpi_reads(monkeypatch):
    """MPI without CUDA support (the PyPI wheels) gets host copies of device buffers, made
    with cupy's get(), which also waits for every kernel queued on the stream. Buffers that
    MPI only writes were copied too: a recv's (ring attention and the pipeline post theirs
    before the compute they mean to overlap: the CPU stalled until the GPU was idle) and the
    out of reduce-scatter, all-gather and all-to-all (ZeRO-3 moved each gathered unit
    device -> host for nothing). Here (one rank, to_host logged) only what MPI reads is copied,
    every result is right, and every out is copied back to its device array."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup, group as group_module, staging
    copied, ready = [], []
    monkeypatch.setattr(staging, "cuda_aware_mpi", lambda: False)
    monkeypatch.setattr(staging, "is_cupy", _fake_is_cupy)
    monkeypatch.setattr(group_module, "is_cupy", _fake_is_cupy)
    monkeypatch.setattr(staging, "to_host", lambda a: copied.append(a) or np.array(a))
    monkeypatch.setattr(staging, "device_ready", lambda *arrays: ready.extend(arrays))
    monkeypatch.setattr(group_module, "device_of", lambda *arrays: contextlib.nullcontext())
    monkeypatch.setattr(group_module, "device_ready", lambda *arrays: None)   # send's

    def device(values):
        return np.asarray(values, np.float32).view(_FakeCupyArray)

    def was_copied(a):
        return any(np.shares_memory(a, c) for c in copied)
    g = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank staging")
    try:
        for op in ("reduce_scatter", "all_gather", "all_to_all"):
            out, inp = device(np.full(6, np.nan)), device(np.arange(6))
            getattr(g, op)(out, inp)
            assert np.array_equal(out, np.arange(6)), (op, out)
            assert was_copied(inp) and not was_copied(out), op       # out only written
            assert any(np.shares_memory(a, out) for a in ready), op  # set, then waited for
            copied.clear()
        for op in ("all_reduce", "broadcast"):                         # these read their buf
            buf = device(np.arange(6))
            getattr(g, op)(buf)
            assert np.array_equal(buf, np.arange(6)) and was_copied(buf), op
            copied.clear()
        work, buf = g.send(device(np.arange(5)), 0, async_op=True), device(np.full(5, np.nan))
        g.recv(buf, 0)
        work.wait()
        assert np.array_equal(buf, np.arange(5)) and len(copied) == 1, copied   # the send's
        assert not was_copied(buf)
    finally:
        g.destroy()
        trace.reset_counters()


@pytest.mark.cpu_only("stands a numpy subclass in for a cupy array")
def test_an_unstaged_device_collective_waits_for_its_last_kernels(monkeypatch):
    """With a CUDA-aware MPI the ring works on the device arrays themselves, and its last
    step (the final adds of a reduce-scatter, an average's division) runs as kernels on the
    stream of the thread running the collective: an async one's worker thread. Its Work
    completed with those kernels queued; the caller's next kernels were ordered after them
    only because CuPy's default stream is shared by every thread, which per-thread default
    streams or bench_step's graph stream undo. Here every op waits for its out (device_ready
    on it) before it returns, blocking or async."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup, group as group_module, staging
    ready = []
    monkeypatch.setattr(staging, "cuda_aware_mpi", lambda: True)
    monkeypatch.setattr(staging, "is_cupy", _fake_is_cupy)
    monkeypatch.setattr(group_module, "is_cupy", _fake_is_cupy)
    monkeypatch.setattr(staging, "device_ready", lambda *arrays: ready.extend(arrays))
    monkeypatch.setattr(group_module, "device_of", lambda *arrays: contextlib.nullcontext())
    monkeypatch.setattr(group_module, "ready_event", lambda *arrays: None)
    g = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank unstaged")
    try:
        for async_op in (False, True):
            for op in ("reduce_scatter", "all_gather", "all_to_all", "all_reduce"):
                out = np.zeros(4, np.float32).view(_FakeCupyArray)
                args = (out,) if op == "all_reduce" else \
                    (out, np.arange(4, dtype=np.float32).view(_FakeCupyArray))
                work = getattr(g, op)(*args, async_op=async_op)
                if async_op:
                    work.wait()
                assert any(np.shares_memory(a, out) for a in ready), (op, async_op)
                ready.clear()
    finally:
        g.destroy()
        trace.reset_counters()


def test_the_stop_flag_on_an_nccl_group_is_a_host_all_reduce_and_no_device_read(monkeypatch):
    """strategy.base.any_rank_of, the loop's stop/diverged agreement every step, put the flag
    on the device on an NCCL group and read it back (a host_read: the CPU waited for the
    whole step) though a group hands a host buffer to the MPI library on NCCL groups too.
    Here a one-rank "nccl" group (its NCCL module a fake that refuses every call: there is no
    GPU) agrees on the flag through MPI with no host_read."""
    import types
    from mpi4py import MPI
    import minidist.comm
    from minidist import backend
    from minidist.comm import ProcessGroup
    from minidist.strategy.base import any_rank_of

    def no_nccl(*args, **kwargs):
        raise AssertionError("a host buffer reached NCCL")
    fake = types.ModuleType("minidist.comm.nccl")
    fake.NcclComm = lambda comm: None
    for name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all_v"):
        setattr(fake, name, no_nccl)
    monkeypatch.setitem(sys.modules, "minidist.comm.nccl", fake)
    monkeypatch.delattr(minidist.comm, "nccl", raising=False)
    g = ProcessGroup(MPI.COMM_SELF, "nccl", name="one-rank nccl")
    try:
        before = backend.host_reads()
        assert (any_rank_of(g, True), any_rank_of(g, False)) == (True, False)
        assert backend.host_reads() == before
    finally:
        g.destroy()
        trace.reset_counters()
