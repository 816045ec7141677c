"""The communication layer: process groups, hand-written ring collectives, MPI and NCCL.

    from minidist import comm

    world = comm.init(algo="ring")                # once per process: MPI_Init + the hooks
    world.all_reduce(buf, op="avg")                # in place, on a flat numpy/cupy array
    mesh = comm.DeviceMesh(dp=2, tp=2, world=world)   # mesh.dp, mesh.tp, mesh.pp: groups
    comm.trace.counters()["all_reduce"]["bytes_sent"]  # what this rank sent, 2(N-1)/N x bytes

Where to read what:
    ring.py      the ring algorithms and their chunk tables, chunk_bounds    (start here)
    simulate.py  the same ring schedule run for N ranks in one process      (step through it)
    naive.py     reduce-to-root + broadcast, for comparison
    hier.py      hierarchical all-reduce: in the node, across nodes, in the node
    mpi.py       the MPI library's own collectives
    nccl.py      NCCL through cupy.cuda.nccl (imported only for algo="nccl")
    group.py     ProcessGroup: dispatch, async_op, staging, counters, sub-groups
    algos.py     which algorithms a group takes; register_algo: a module of your own
    checks.py    what a group checks before it communicates (alike on every rank)
    stream.py    the per-group communication thread behind async_op=True
    mesh.py      DeviceMesh(dp, tp, pp), Megatron's rank order
    trace.py     counters, MINIDIST_TRACE=1 logs, the Chrome trace
    watchdog.py  no hangs: collective timeout, a rank that exited; abort with the message
    debug.py     MINIDIST_DEBUG=1 same-call checks; abort the job on an uncaught exception;
                 breakpoint_on(rank) (attach.py is the client)
    progress.py  how a rank waits for messages (MINIDIST_COMM_WAIT=block|poll)
    mpich.py     MPICH settings, applied by init() before MPI_Init
    staging.py   cupy buffers: CUDA-aware MPI detection and host staging
    channel.py   the counted send/recv the hand-written algorithms use
    alltoall.py  all-to-all(-v): the pairwise exchange and the naive relay (expert parallelism)
    rankpdb.py   every rank of a script, one of them under pdb (python -m minidist.comm.rankpdb)

Importing this package starts nothing: it tells mpi4py not to initialise MPI on import
(mpi4py.rc.initialize = False, so import minidist.comm before mpi4py.MPI); `init()` does, and
every entry point calls it. It never imports cupy. Tests: tests/test_comm.py.
"""
import atexit
import faulthandler
import functools
import os
import sys

import mpi4py

mpi4py.rc.initialize = False   # before mpi4py.MPI is imported: init() below initialises MPI

from mpi4py import MPI  # noqa: E402

from minidist.comm import debug, hier, mpich, progress, trace, watchdog  # noqa: E402
from minidist.comm.debug import (  # noqa: E402
    CollectiveFailed, CollectiveMismatch, LaunchMismatch, install_abort_handler)
from minidist.comm.algos import ALGOS, algos, register_algo  # noqa: E402
from minidist.comm.group import ProcessGroup, shutdown_all  # noqa: E402
from minidist.comm.mesh import DeviceMesh  # noqa: E402
from minidist.comm.ring import chunk_bounds, ring_bytes  # noqa: E402
from minidist.comm.staging import cuda_aware_mpi  # noqa: E402
from minidist.comm.stream import Work  # noqa: E402
from minidist.launcher import world_size_from_env  # noqa: E402

__all__ = ["ALGOS", "CollectiveFailed", "CollectiveMismatch", "DeviceMesh", "LaunchMismatch",
           "ProcessGroup", "Work", "algos", "chunk_bounds", "cuda_aware_mpi", "env_problems",
           "init", "install_abort_handler", "register_algo", "ring_bytes", "trace"]
THREAD_LEVELS = {"single": MPI.THREAD_SINGLE, "funneled": MPI.THREAD_FUNNELED,
                 "serialized": MPI.THREAD_SERIALIZED, "multiple": MPI.THREAD_MULTIPLE}
_state = {"initialised": False}


def init(algo="ring", timeout=None, sync_comm=None):
    """Start MPI for this process and return the world group (algorithm `algo`).

    The first call, in this order: MPICH's settings (mpich.py), MPI_Init_thread (MULTIPLE;
    MPI4PY_RC_THREAD_LEVEL may say so, or a lower level on one process alone; a rank still
    in it after the timeout below exits 1 with a stack dump: another rank died before
    MPI_Init), a LaunchMismatch where the library gives several ranks less than MULTIPLE,
    the abort-on-uncaught-exception hooks
    (debug.py), the watchdog thread with a collective timeout of `timeout` seconds (default
    MINIDIST_COMM_TIMEOUT or 600; 0: none), and an exit handler: a rank that exits waits for
    the others, then MPI is finalised (watchdog.py). Later calls return another world group
    (another algo).
    `sync_comm`: every collective in the calling thread, for a debugger (group.py; default
    MINIDIST_SYNC_COMM)."""
    if not _state["initialised"]:
        problems = env_problems(algo, timeout)
        if problems:                    # every rank alike, before MPI_Init
            raise ValueError("; ".join(problems))
        debug.enable_from_env()         # the variables are read here, not at import
        trace.enable_from_env()
        progress.policy_from_env()
        mpich.apply_defaults()
        if not MPI.Is_initialized():
            unsupported = pmix_mismatch(os.environ, MPI.Get_library_version())
            if unsupported:             # MPICH would abort inside MPI_Init, a block per rank
                raise LaunchMismatch(unsupported)
            _wait_in_mpi_init_for_every_rank(mpi_init_wait_s(timeout))
        mismatch = launch_mismatch(world_size_from_env(), MPI.COMM_WORLD.Get_size())
        if mismatch:                    # every process alone: no collective could tell
            raise LaunchMismatch(mismatch)
        too_low = thread_level_problem(MPI.Query_thread(), MPI.COMM_WORLD.Get_size())
        if too_low:                     # the same on every rank: one library
            raise LaunchMismatch(too_low)
        trace.set_rank(MPI.COMM_WORLD.Get_rank())
        install_abort_handler()
        if MPI.COMM_WORLD.Get_size() > 1:
            watchdog.start(timeout)
            if (not os.environ.get("PYTHONBREAKPOINT")           # breakpoint(): on any rank,
                    and sys.breakpointhook is sys.__breakpointhook__):   # unless a debugger's
                sys.breakpointhook = debug.breakpoint_here
        atexit.register(_finish)
        _state["initialised"] = True
    return ProcessGroup.world(algo, sync_comm)


def launch_mismatch(launched, in_mpi):
    """Why this job is not one MPI job, or None: the launcher's environment says `launched`
    processes, MPI_COMM_WORLD holds `in_mpi` (first-use walk 31: Open MPI's mpirun with the
    mpich wheel's libmpi started each rank as a job of its own, and N copies trained, saved
    into one folder and exited 0)."""
    if launched <= 1 or in_mpi == launched:
        return None
    library = MPI.Get_library_version().strip().splitlines()[0]
    return (f"the launcher started {launched} processes but MPI sees {in_mpi}: mpi4py loaded "
            f"another MPI than the launcher's ({' '.join(library.split())}); start the job "
            "with that MPI's mpiexec, or point mpi4py at the cluster's MPI (MPI4PY_LIBMPI; "
            "examples/slurm/README.md, \"The cluster's own MPI\")")


# MPICH's names of its PMI version setting (MPIR_CVAR_PMI_VERSION's aliases)
PMI_VERSION_VARS = ("MPIR_CVAR_PMI_VERSION", "MPIR_PARAM_PMI_VERSION", "MPICH_PMI_VERSION")


def pmix_mismatch(environ, library):
    """Why MPI_Init would abort, or None: a PMIx launcher (PMIX_NAMESPACE set: Open MPI 5's
    mpirun, `srun --mpi=pmix`) starting ranks whose mpi4py loaded an MPICH built without
    PMIx (the mpich wheel: "Runtime environment uses unsupported PMI version PMIx" and an
    error stack on every rank, then the launcher's report; the first-use walk of
    2026-11-30). `library`: MPI_Get_library_version's text, which MPI allows before MPI_Init
    and MPICH's holds its configure line. A PMI version named (MPIR_CVAR_PMI_VERSION 1 or 2:
    MPICH then reads no PMIX_* variable; hydra's mpiexec run inside an srun --mpi=pmix step,
    whose PMIX_NAMESPACE its ranks inherit, starts so) passes."""
    named = {environ.get(v) for v in PMI_VERSION_VARS}
    if "PMIX_NAMESPACE" not in environ or not library.startswith("MPICH") \
            or "pmix" in library.lower() or named & {"1", "2"}:
        return None
    version = library.strip().splitlines()[0]
    if "PMI_FD" in environ or "PMI_PORT" in environ:     # MPICH's own mpiexec started it
        return ("PMIX_NAMESPACE is set, inherited from an outer PMIx launch (srun "
                "--mpi=pmix?), though mpiexec started this rank over PMI, and MPICH "
                f"({' '.join(version.split())}) would abort in MPI_Init reading it; unset "
                "PMIX_NAMESPACE for the job, or set MPIR_CVAR_PMI_VERSION=1")
    return (f"the launcher speaks PMIx (Open MPI's mpirun, or srun --mpi=pmix) but mpi4py "
            f"loaded an MPI without it ({' '.join(version.split())}); start the job with "
            "the mpiexec beside that Python (the virtual environment's own), or point mpi4py at "
            "the cluster's MPI (MPI4PY_LIBMPI; examples/slurm/README.md, \"The cluster's own "
            "MPI\")")


# MPI_Init of a few ranks on a busy machine takes up to a second: a collective timeout below
# that (--comm-timeout 0.01) killed a healthy job while it started, with a stack dump
MPI_INIT_AT_LEAST_S = 2.0
# faulthandler's timer takes at most ~1e9 s: "a big number for never" (--comm-timeout 1e30)
# was an OverflowError per rank (first-use walk 37)
MPI_INIT_AT_MOST_S = 365 * 86400.0


# MPI_Finalize waits for every rank: one slower to reach it (its threads stopping, a loaded
# machine) is no fault, however short the collective timeout (--comm-timeout 1 killed a
# healthy job there: tests/test_async_save.py); a frozen one is, after this at least
FINALIZE_AT_LEAST_S = 10.0


def mpi_init_wait_s(timeout):
    """How long a rank waits in MPI_Init for the others (0: for ever): the collective
    timeout (`timeout`, else MINIDIST_COMM_TIMEOUT or 600 s), but at least
    MPI_INIT_AT_LEAST_S."""
    wait_s = watchdog.default_timeout() if timeout is None else timeout
    return wait_s and min(max(wait_s, MPI_INIT_AT_LEAST_S), MPI_INIT_AT_MOST_S)


def _wait_in_mpi_init_for_every_rank(timeout):
    """MPI_Init_thread, or exit 1 with a stack dump (faulthandler's) once it has waited
    `timeout` seconds (0: wait for ever). A rank that dies before MPI_Init (an import that
    fails on one node, a file edited while the job starts) leaves every other rank in MPI_Init
    for ever: MPICH's launcher waits for it (pmodels/mpich#6124, wontfix), and the watchdog
    cannot start before MPI has. MPI_Init_thread holds the GIL, so no Python thread could act;
    faulthandler's timer is a C thread (a process has one such timer: this one replaces any
    other while MPI starts)."""
    if timeout:
        faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        MPI.Init_thread(THREAD_LEVELS[_thread_level()])
    finally:                         # a failed MPI_Init raises: no timer left to kill later
        if timeout:
            faulthandler.cancel_dump_traceback_later()


def _finish():
    """At exit: agree with the other ranks that the job ends (watchdog.announce_exit), stop the
    threads that call MPI, finalise MPI. MPICH's MPI_Finalize waits for every rank: one that
    froze after the agreement (a node hung; tests/scripts/chaos.py's SIGSTOP found it) held
    the others there for ever, past --comm-timeout. Now a rank still there after the timeout
    (FINALIZE_AT_LEAST_S at least) exits 1 with a stack dump (faulthandler's timer, as in
    MPI_Init: Finalize holds the GIL), and the launcher ends the job."""
    if MPI.Is_finalized():
        return
    wait_s = 0.0
    if MPI.COMM_WORLD.Get_size() > 1:
        wait_s = watchdog.timeout_s()
        watchdog.announce_exit()
        watchdog.stop()
    if wait_s:
        faulthandler.dump_traceback_later(min(max(wait_s, FINALIZE_AT_LEAST_S),
                                              MPI_INIT_AT_MOST_S), exit=True)
    shutdown_all()
    MPI.Finalize()
    if wait_s:
        faulthandler.cancel_dump_traceback_later()


SWITCHES = ("MINIDIST_SYNC_COMM", "MINIDIST_DEBUG")     # on/off variables: 1 or 0


def _switches():
    """The on/off variables hold 1, 0 or nothing: 'false' or 'no' read as on before."""
    for name in SWITCHES:
        value = os.environ.get(name, "")
        if value not in ("", "0", "1"):
            raise ValueError(f"{name}={value!r}: give 1 (on) or 0 (off)")


def _thread_level():
    """MPI4PY_RC_THREAD_LEVEL, checked: on a job of more than one rank only "multiple" (the
    watchdog thread and the communication streams call MPI beside the main thread; under
    "single" MPICH aborted now and then with "Message truncated" in a Comm_dup: first-use
    walk 32)."""
    level = os.environ.get("MPI4PY_RC_THREAD_LEVEL", "") or "multiple"
    if level.lower() not in THREAD_LEVELS:
        raise ValueError(f"MPI4PY_RC_THREAD_LEVEL={level!r}: give one of "
                         f"{', '.join(THREAD_LEVELS)} (default: multiple)")
    if level.lower() != "multiple" and world_size_from_env() > 1:
        raise ValueError(f"MPI4PY_RC_THREAD_LEVEL={level}: minidist's watchdog and "
                         "communication streams call MPI from threads of their own, which "
                         "needs MPI_THREAD_MULTIPLE; unset it (or give multiple)")
    return level.lower()


def thread_level_problem(provided, size):
    """Why a job of `size` ranks cannot run at the thread level the MPI library `provided`
    (MPI_Query_thread after MPI_Init), or None: below MPI_THREAD_MULTIPLE the watchdog's and
    the streams' threads may not call MPI (an MPI built without thread support)."""
    if size <= 1 or provided >= MPI.THREAD_MULTIPLE:
        return None
    name = next(k for k, v in THREAD_LEVELS.items() if v == provided)
    return (f"this MPI library provides thread level {name}, not multiple: minidist's "
            f"watchdog and communication streams call MPI from threads of their own; use an "
            f"MPI built with thread support (the mpich wheel has it)")


def env_problems(algo="ring", timeout=None):
    """What is wrong with the environment variables init() and the collectives read, as
    sentences naming each variable and what to write (empty: nothing). init() raises them
    before MPI_Init; examples/train_gpt.py's flag checks make them its one `error:` line.
    `timeout`: init's (train_gpt.py's --comm-timeout: 0 or at least 1 s); MINIDIST_COMM_TIMEOUT
    is read only without it, MINIDIST_RANKS_PER_NODE only under algo "hier"."""
    checks = [trace.env_level, progress.env_policy, _thread_level, _switches]
    checks += [watchdog.default_timeout] if timeout is None else [
        functools.partial(watchdog.check_timeout, timeout, f"--comm-timeout {timeout:g}")]
    checks += [hier.ranks_per_node] if algo == "hier" else []
    problems = []
    for check in checks:
        try:
            check()
        except ValueError as e:
            problems.append(str(e))
    return problems
