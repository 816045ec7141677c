"""pdb on one rank of an MPI job, where quitting or finishing the debugger ends the job cleanly.

    mpiexec -n 4 python -m minidist.comm.rankpdb my_script.py ARGS       # pdb on rank 0
    mpiexec -n 4 python -m minidist.comm.rankpdb --rank 1 my_script.py   # pdb on rank 1 ...
    python -m minidist.comm.attach 4445                                  # ... from a 2nd terminal

The chosen rank runs the script under `RankPdb`, stopped at its first line; the other ranks run
it normally (and wait in the first collective that needs the stopped rank). Every rank gets
MINIDIST_COMM_TIMEOUT=0 (unless set): the watchdog must not end a job waiting for a person.
mpiexec forwards the terminal to rank 0 only, so any other rank serves its pdb on 127.0.0.1,
port MINIDIST_PDB_PORT (4444) + rank, for `python -m minidist.comm.attach PORT`. The debugged
rank also gets MINIDIST_SYNC_COMM=1 (unless set): its collectives, DDP's gradient buckets
included, run in the thread pdb traces (minidist/comm/group.py).

What plain pdb gets wrong under mpiexec, and RankPdb does instead:
    q, or Ctrl-D       pdb lets the rank exit while its peers wait in a collective forever:
                       RankPdb ends the whole job (MPI_Abort), saying so in one line.
    c after the end    `python -m pdb` restarts the script on this rank alone, which waits
                       forever for the others: RankPdb lets the rank finish.
    cl (clear all)     pdb asks "Clear all breaks?" on the process's own stdin, where a served
                       rank has nobody: RankPdb asks on its own console.
    an exception       `python -m pdb` stops in post mortem where it was raised; the debugged
                       rank does too (the abort handler ended the job at once, the frames
                       gone), the others waiting; leaving it (q, Ctrl-D, c) ends the job.
`debug.breakpoint_on(rank)` stops a rank in RankPdb from inside the code instead.

Tests: tests/test_debugging.py (each of the above under mpiexec, commands fed on stdin).
"""
import argparse
import bdb
import builtins
import os
import pdb
import signal
import socket
import sys
import traceback

from minidist import comm
from minidist.comm import watchdog
from mpi4py import MPI   # after minidist.comm, which decides when MPI is initialised

DEFAULT_PORT = 4444
_open = []   # the served rank's socket and files: kept, collecting them would trip the tracer
_debuggers = {}   # rank -> its RankPdb (debugger_for)


class RankPdb(pdb.Pdb):
    """pdb for `rank` of an MPI job: its quit ends the job; `cl` asks on its own console."""

    def __init__(self, rank, stdin=None, stdout=None):
        super().__init__(stdin=stdin, stdout=stdout)
        self.rank = rank
        self.prompt = f"(Pdb rank {rank}) "

    def do_quit(self, arg):
        """q(uit): end the whole MPI job (every rank), not only this one. end_job says so on
        the job's stderr; a console of its own (an attached rank's socket) is told too."""
        if self.stdout is not sys.stdout:
            self.message(f"[rank {self.rank}] debugger quit: ending the whole MPI job")
            self.stdout.flush()   # a socket file: send it now
        end_job(self.rank)
    do_q = do_exit = do_quit

    def do_EOF(self, arg):
        """Ctrl-D (or the attach console closing): like quit."""
        self.message("")
        self.do_quit(arg)

    def do_clear(self, arg):
        """cl(ear) with no argument asks on this debugger's console; otherwise pdb's clear."""
        if arg:
            return super().do_clear(arg)
        self.stdout.write("Clear all breaks? ")
        self.stdout.flush()
        if self.stdin.readline().strip().lower() in ("y", "yes"):
            numbered = [bp for bp in bdb.Breakpoint.bpbynumber if bp]
            self.clear_all_breaks()
            for bp in numbered:
                self.message(f"Deleted {bp}")
        return None
    do_cl = do_clear


def end_job(rank):
    """End every rank of the job now: MPI_Abort (mpiexec ends them all), then this process."""
    watchdog.abort_job(f"[rank {rank}] debugger quit: ending the whole MPI job")
    os._exit(1)       # MPICH's Abort may return here before mpiexec ends the process


def debugger_for(rank, port_base=None):
    """A RankPdb on the terminal (rank 0, which mpiexec gives stdin) or, for any other rank,
    on a TCP connection from `python -m minidist.comm.attach`, waited for here. One per rank
    for the process: a second breakpoint (a breakpoint() in a loop) reuses the first's
    console (a second server on its port failed, "Address already in use", and the abort
    handler ended the job: review 43)."""
    if rank not in _debuggers:
        _debuggers[rank] = RankPdb(rank) if rank == 0 else _served(rank, port_base)
    return _debuggers[rank]


def warn_of_the_timeout(debugger, rank):
    """Say on the debugger's console how long the other ranks wait for this one, where a
    timeout is set (an exported MINIDIST_COMM_TIMEOUT, which rankpdb keeps: it ended a
    session 3 s into a step, unwarned, first-use walk of 2026-11-30; breakpoint_on)."""
    if watchdog.timeout_s() > 0:
        debugger.message(f"[rank {rank}] note: the other ranks end the job once they wait "
                         f"{watchdog.timeout_s():g} s for this one; MINIDIST_COMM_TIMEOUT=0 "
                         "lets you step for as long as you like (python -m "
                         "minidist.comm.rankpdb sets it where it is not exported)")


def _served(rank, port_base):
    """A RankPdb on the connection an attach console makes to 127.0.0.1:port_base + rank,
    from a terminal on this rank's host (which the waiting line names)."""
    base = port_base or int(os.environ.get("MINIDIST_PDB_PORT", DEFAULT_PORT))
    try:
        server = socket.create_server(("127.0.0.1", base + rank))
    except OSError as e:     # another job's debugger on this node (a shared login node)
        watchdog.abort_job(f"error: [rank {rank}] cannot serve pdb on 127.0.0.1:{base + rank}"
                           f" ({os.strerror(e.errno)}: another debugger or program holds it); set "
                           "MINIDIST_PDB_PORT (rankpdb: --port-base) to another base, rank r "
                           "serving on base + r")
        os._exit(1)
    # the host too: on a cluster the rank's node, where attach must run (127.0.0.1 there)
    sys.stderr.write(f"[rank {rank}] waiting for a debugger on {socket.gethostname()}: "
                     f"python -m minidist.comm.attach {base + rank} (run it there)\n")
    sys.stderr.flush()
    conn, _ = server.accept()
    # two files: one text file for both directions drops read-ahead lines when written to
    fin, fout = conn.makefile("r"), conn.makefile("w", buffering=1)
    _open.append((server, conn, fin, fout))
    return RankPdb(rank, stdin=fin, stdout=fout)


def run_script(path, args, rank, port_base=None):
    """Run the script at `path` with sys.argv = [path, *args] as __main__; on COMM_WORLD rank
    `rank` under RankPdb, stopped at its first line."""
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    scope = {"__name__": "__main__", "__file__": path, "__builtins__": builtins}
    if MPI.COMM_WORLD.Get_rank() != rank:   # Ctrl-C reaches every rank: here it breaks
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # into pdb on `rank` alone (walk 43:
        exec(code, scope)                 # the others died of it at the next `c`); a script's
        return                            # own handler still wins (train_gpt.py's)
    os.environ.setdefault("MINIDIST_SYNC_COMM", "1")
    debugger = debugger_for(rank, port_base)
    warn_of_the_timeout(debugger, rank)    # one exported (train.sbatch does) is kept
    try:
        debugger.run(code, scope)
    except Exception as e:       # not SystemExit: a script's own exit status stands
        post_mortem(debugger, rank, e)
    debugger.message(f"[rank {rank}] {path} finished; not restarted (the job ends here)")


def post_mortem(debugger, rank, error):
    """The debugged rank raised: its traceback on the job's stderr (and the console of a
    served rank), then pdb in the frames that raised, as `python -m pdb` does (`u`, `p`, `w`
    there); the other ranks wait for it in their next collective (no timeout under rankpdb).
    Leaving it ends the job: `q` or Ctrl-D through RankPdb's quit, `c` here."""
    text = "".join(traceback.format_exception(error))
    sys.stderr.write(text)
    sys.stderr.flush()
    if debugger.stdout is not sys.stdout:
        debugger.message(text.rstrip())
    name = type(error).__name__
    debugger.message(f"[rank {rank}] uncaught {name}: post mortem debugging (q ends the job)")
    debugger.interaction(None, error.__traceback__)
    watchdog.abort_job(f"[rank {rank}] uncaught {name} (above): ending the whole MPI job")
    os._exit(1)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minidist.comm.rankpdb",
                                description="Run a script on every rank, under pdb on one.")
    p.add_argument("--rank", type=int, default=0, help="the COMM_WORLD rank to debug")
    p.add_argument("--port-base", type=int, default=None,
                   help="rank r > 0 serves pdb on this + r (default: MINIDIST_PDB_PORT, 4444)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    a = p.parse_args(argv)
    os.environ.setdefault("MINIDIST_COMM_TIMEOUT", "0")   # before init() starts the watchdog
    os.environ.setdefault("MINIDIST_COMM_WAIT", "poll")   # the waiting ranks nap, not spin
    comm.init()      # MPI_Init and the abort hooks; the script's own init() finds them done
    size = MPI.COMM_WORLD.Get_size()
    if not os.path.isfile(a.script):
        fail(f"error: script {a.script!r} not found: give the path of a Python file")
    if not 0 <= a.rank < size:
        fail(f"error: --rank {a.rank}: this job has ranks 0 to {size - 1}")
    run_script(a.script, a.args, a.rank, a.port_base)


def fail(line):
    """A user error: one line, from rank 0 only, and exit status 2 on every rank."""
    if MPI.COMM_WORLD.Get_rank() == 0:
        sys.stderr.write(line + "\n")
    sys.exit(2)


if __name__ == "__main__":
    main()
