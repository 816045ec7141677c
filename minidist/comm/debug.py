"""Turning distributed hangs into errors: same-call checks, and aborting the job on an error.

Two classic ways a distributed program dies silently:

1. Ranks disagree about the next collective (one calls all_reduce on 10 floats, another on 12,
   or all_gather): MPI hangs or corrupts memory. With debug mode on (`MINIDIST_DEBUG=1` or
   `enable()`), every collective first all-gathers a small signature (sequence number, op, size,
   dtype, root) over the group and, if they differ, raises `CollectiveMismatch` on every rank,
   naming which ranks called what. If some rank never arrives at all, the watchdog's timeout
   (watchdog.py) ends the job, naming the ranks that did not arrive. Without debug mode a
   mismatch that makes MPI fail (an all-reduce of 10 elements on one rank, 12 on another)
   raises `CollectiveFailed` naming the op, its number, group, count and dtype, and pointing
   here (`failed_in_mpi`; ProcessGroup catches MPI's error around each collective).
2. One rank raises and exits, the others wait forever for its messages. `install_abort_handler`
   (installed by `comm.init()`) replaces `sys.excepthook` and `threading.excepthook`: print the
   traceback, then `MPI.COMM_WORLD.Abort(1)`, which makes mpiexec kill every rank at once.
   (A rank leaving through sys.exit is the watchdog's: comm/__init__.py, watchdog.py.)

3. Stepping through one rank: `breakpoint_on(rank)` stops that rank in pdb. mpiexec gives the
   terminal's stdin to rank 0 only, so other ranks serve pdb on a local TCP port instead and
   you attach with `python -m minidist.comm.attach PORT` from a second terminal. Quitting
   that pdb ends the whole job (minidist/comm/rankpdb.py, which also runs a whole script
   under pdb on one rank: `python -m minidist.comm.rankpdb --rank R script.py`).

Tests: tests/test_comm.py (collectives: mismatch; breakpoint_on), tests/test_comm_failures.py
(raise_on_one_rank_aborts).
"""
import os
import sys
import threading
import traceback

import numpy as np
from mpi4py import MPI

from minidist.comm import watchdog
from minidist.comm.progress import wait_all

_state = {"on": False}       # comm.init turns it on under MINIDIST_DEBUG=1 (enable_from_env)

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "all_to_all",
       "gather_object", "all_gather_object", "broadcast_object")   # objects: no count
REDUCTIONS = ("", "sum", "avg", "max", "min")
DTYPES = ("", "float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8")


class CollectiveMismatch(RuntimeError):
    """Ranks of a group called different collectives (or sizes, dtypes, roots) at one point."""


class LaunchMismatch(RuntimeError):
    """The job is not the one the launcher started: MPI sees another number of processes
    than the launcher's (each its own job: comm.init), or the ranks place themselves on
    nodes differently (--comm hier: hier.Hierarchy), or the MPI library gives less than
    MPI_THREAD_MULTIPLE to a job of several ranks. The same on every rank, before any other
    collective."""


class CollectiveFailed(RuntimeError):
    """A collective failed inside MPI (an MPI.Exception, kept as __cause__). Without debug
    mode that is mostly ranks that disagree on it: the ring's messages do not fit."""


def failed_in_mpi(group, seq, op, count, dtype, error):
    """The CollectiveFailed for MPI's `error` in collective #seq `op` (`count` elements of
    `dtype`) of the group named `group`: what failed, and where to look next. Built only
    once MPI has failed; the collectives' fast path checks nothing."""
    what = f"{op} #{seq} on group {group!r} (count {count}{', ' + dtype if dtype else ''})"
    if enabled():
        hint = ("MINIDIST_DEBUG=1 found every rank calling the same collective (all_to_all's "
                "counts are not compared), so look at the counts, or at MPI itself")
    else:
        hint = ("the ranks probably disagree on the collective (op, size or dtype, or one "
                "rank called another collective); rerun with MINIDIST_DEBUG=1, which checks "
                "every collective's signature across the ranks and names what each called")
    said = "" if error.Get_error_class() == MPI.ERR_IN_STATUS else \
        f" ({error.Get_error_string()})"    # ERR_IN_STATUS's text points to a status we lack
    return CollectiveFailed(f"{what} failed inside MPI{said}: {hint}")


def enable():
    _state["on"] = True


def disable():
    _state["on"] = False


def enabled():
    return _state["on"]


def enable_from_env(environ=os.environ):
    """enable() where MINIDIST_DEBUG=1 (comm.init, after env_problems checked the value);
    unset or 0 leaves an enable() made by the caller as it is."""
    if environ.get("MINIDIST_DEBUG", "") == "1":
        enable()


def _index(table, name):
    return table.index(name) if name in table else -1


def _describe(row):
    seq, op, red, count, dtype, root = (int(x) for x in row)
    red = f" {REDUCTIONS[red]}" if red > 0 else ""
    dt = DTYPES[dtype] if dtype >= 0 else "other dtype"
    where = f", root={root}" if OPS[op] in ("broadcast", "gather_object",
                                             "broadcast_object") else ""
    if OPS[op].endswith("_object"):
        return f"#{seq} {OPS[op]}({where[2:]})"
    return f"#{seq} {OPS[op]}{red}(count={count}, {dt}{where})"


def check_same_call(comm, group, seq, op, count, dtype, reduction="", root=0):
    """Raise CollectiveMismatch on every rank of `comm` unless all ranks are about to run the
    same collective: same sequence number, op, reduction, element count, dtype and root."""
    sig = np.array([seq, _index(OPS, op), _index(REDUCTIONS, reduction), count,
                    _index(DTYPES, str(dtype)), root], dtype=np.int64)
    table = np.empty((comm.Get_size(), sig.size), dtype=np.int64)
    wait_all([comm.Iallgather(sig, table)])   # a rank that never comes: the watchdog's case
    if (table == table[0]).all():
        return
    calls = {}
    for rank, row in enumerate(table):
        calls.setdefault(_describe(row), []).append(rank)
    detail = "; ".join(f"ranks {ranks} called {call}" for call, ranks in calls.items())
    raise CollectiveMismatch(f"group {group!r}: ranks disagree on the next collective: {detail}")


def install_abort_handler():
    """An uncaught exception on any rank prints its traceback and aborts the whole MPI job, so
    the other ranks do not wait forever in their next collective. Safe to call twice."""
    if getattr(sys.excepthook, "_minidist_abort", False):
        return
    previous = sys.excepthook

    def abort_on_exception(etype, value, tb):
        if MPI.COMM_WORLD.Get_size() == 1:
            return previous(etype, value, tb)
        rank = MPI.COMM_WORLD.Get_rank()
        watchdog.abort_job(f"[rank {rank}] uncaught exception; aborting the whole MPI job\n"
                           + "".join(traceback.format_exception(etype, value, tb)))

    abort_on_exception._minidist_abort = True
    sys.excepthook = abort_on_exception
    threading.excepthook = lambda args: abort_on_exception(args.exc_type, args.exc_value,
                                                           args.exc_traceback)


def breakpoint_on(rank, port_base=None, frame=None):
    """Stop COMM_WORLD rank `rank` in pdb here (in `frame`, default the caller's); other
    ranks go on (until they need it).

    Rank 0 reads the terminal mpiexec forwards; any other rank listens on 127.0.0.1 at port
    `port_base + rank` (MINIDIST_PDB_PORT, default 4444) and waits for
    `python -m minidist.comm.attach PORT` to attach. The pdb is minidist/comm/rankpdb.py's
    RankPdb: `q` ends the whole job, `cl` asks on that console. Under the watchdog's timeout
    it says first how long the others will wait (walk 43 lost a session at it, unwarned)."""
    if MPI.COMM_WORLD.Get_rank() != rank:
        return
    # imported here, not at the top: `python -m minidist.comm.rankpdb` needs it unimported
    from minidist.comm.rankpdb import debugger_for, warn_of_the_timeout
    debugger = debugger_for(rank, port_base)
    warn_of_the_timeout(debugger, rank)
    debugger.set_trace(frame or sys._getframe().f_back)


def breakpoint_here(*args, **kwargs):
    """sys.breakpointhook on a job of several ranks (comm.init, where PYTHONBREAKPOINT is
    unset): the builtin breakpoint() stops this rank in breakpoint_on's pdb. Plain pdb read
    a stdin that mpiexec gives rank 0 alone: breakpoint() on rank 1 showed a prompt that
    nothing could answer (first-use walk 43)."""
    breakpoint_on(MPI.COMM_WORLD.Get_rank(), frame=sys._getframe().f_back)

