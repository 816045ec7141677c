"""Preemption and Ctrl-C: SIGTERM (what Slurm and spot instances send before a kill), SIGUSR1
(Slurm's `--signal=USR1@60`) or SIGINT (Ctrl-C; mpiexec forwards it to every rank) ask the run
to save and stop at the next step boundary.

    python examples/train_gpt.py --save ckpt ...        # kill -TERM <pid>: saves, exits 75
    python examples/train_gpt.py --save ckpt --resume auto ...   # the requeued job continues
    mpiexec -n 4 python examples/train_gpt.py --save ckpt ...    # Ctrl-C: saves, exits 130

The handler only sets a flag: a checkpoint written from inside a signal handler could be cut
in the middle of a collective. At the end of each step the loop asks whether ANY rank was
signalled (one 1-element all-reduce, strategy.any_rank), so all ranks save the same step
together, print one line, then exit: 75 after SIGTERM / SIGUSR1 (EX_TEMPFAIL: "preempted,
resumable", what examples/slurm/train.sbatch requeues on), 130 after Ctrl-C (128 + SIGINT,
what a shell reports for an interrupted command). Without --save the run stops the same way,
its line saying nothing was saved, and a scheduler's signal exits 143 (128 + SIGTERM, as if
killed by it: nothing would resume, so nothing is requeued; until first-use walk 37 the
signal killed the job, MPICH's BAD TERMINATION block and no line).
An evaluation asks before each of its val batches (loop.evaluate), so a long one is cut short
and the step it follows saved.
A second Ctrl-C is Python's KeyboardInterrupt again, for a step that does not end
(minidist/train/cli.py run_main turns it into one line, exit 130).
Before the loop (MPI started, the data opened, the model built or loaded) the same
signals end the run at once (`stop_at_once`, Preempted): exit 75 (143 without --save),
nothing to save.
Tests: tests/test_preemption.py.
"""
import contextlib
import os
import signal
import sys
import time

EXIT_STATUS = 75                    # sysexits.h EX_TEMPFAIL: try again later (--resume)
INTERRUPTED = 130                   # 128 + SIGINT: the shell's status for Ctrl-C
TERMINATED = 143                    # 128 + SIGTERM: a scheduler's signal without --save
SIGNALS = ("SIGTERM", "SIGUSR1")    # a scheduler's
SIGINT = "SIGINT"
ABORT_WAIT = 4.0                    # seconds a rank but 0 waits for rank 0's abort (end_job):
#   FLUSH_S and 3 s for rank 0 to meet the same end later (2.0 printed two lines under load)
FLUSH_S = 1.0                       # the line's head start before MPI_Abort (as the watchdog's)


class Preempted(BaseException):
    """A scheduler's signal (SIGTERM, SIGUSR1) while the run starts, before its loop takes
    signals (`stop_at_once`): a BaseException, as KeyboardInterrupt is, so that no handler of
    errors takes it; cli.run_main ends the job with one line and exit_status (75; 143
    without --save)."""


@contextlib.contextmanager
def handlers_kept():
    """Inside, the run may take SIGTERM, SIGUSR1 and SIGINT (stop_at_once, Flag); after, the
    handlers are the ones before again (loop.train called in-process: a test suite, a
    notebook, which would otherwise swallow a SIGTERM later; review 39)."""
    before = {name: signal.getsignal(getattr(signal, name)) for name in (*SIGNALS, SIGINT)}
    try:
        yield
    finally:
        for name, handler in before.items():
            if handler is not None:           # (None: set outside Python, left as it is)
                signal.signal(getattr(signal, name), handler)


def stop_at_once():
    """Until the loop's Flag replaces them: SIGTERM and SIGUSR1 raise Preempted where the
    run is (starting MPI, tokenizing the text, loading a checkpoint), which ends it with
    exit status 75 (with --save: a requeueing script, examples/slurm/train.sbatch, requeues
    it; first-use walk 36: a SIGTERM while the ranks tokenized ended the job with 15, which
    is not requeued) or 143 (without). Nothing is lost: no step has been taken since the
    checkpoint."""
    for name in SIGNALS:
        signal.signal(getattr(signal, name), _raise_preempted)


def starting_line(name, save):
    """The one line of a run preempted before step 1 (`name`: the signal's; `save`: --save
    given)."""
    if not save:
        return f"preempted ({name}) while starting: stopped at once, nothing trained"
    return (f"preempted ({name}) while starting: stopped at once, nothing trained since the "
            "last checkpoint; run the same command with --resume auto to start again")


class WhileLoading:
    """SIGTERM and SIGUSR1 noted from an entry point's first line, while it loads numpy, MPI
    and the package and while MPI starts: `stop_now`, once MPI has started, turns one
    noted into Preempted (exit 75, or 143 without --save, and the one line, every rank
    ended by end_job), and hands the signals to stop_at_once. First-use walk 37: a SIGTERM
    in the first second was status 15 and MPICH's BAD TERMINATION block. Not raised in
    the handler: inside an import numpy turns an exception into an ImportError and its
    page of advice; and not an exit there: a rank gone before MPI_Init leaves the others in
    it for ever (comm/__init__.py, pmodels/mpich#6124)."""

    def __init__(self):
        self.name = None
        for name in SIGNALS:
            signal.signal(getattr(signal, name), self._note)

    def _note(self, signum, frame):
        self.name = signal.Signals(signum).name

    def stop_now(self):
        """After MPI started (or in a run of one process): Preempted if a signal came."""
        stop_at_once()
        if self.name is not None:
            raise Preempted(self.name)


def _raise_preempted(signum, frame):
    for name in SIGNALS:       # once: the launcher may forward the scheduler's signal again
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    raise Preempted(signal.Signals(signum).name)


def end_job(line, status=EXIT_STATUS):
    """Print `line` once and exit with `status` (75; 143 without --save) after a Preempted;
    in a job of several ranks, MPI_Abort with it (the launcher returns it), so a rank
    blocked in a collective, which cannot run its handler, ends too instead of aborting the
    job with status 1 once this one exited (a review of stop_at_once). Rank 0 prints at
    once; another rank waits ABORT_WAIT seconds first: when the scheduler signalled every
    rank, rank 0's abort ends it in that time, unprinted, and when it was signalled alone
    (`kill` of one pid), its line is the job's only one. mpi4py is looked up, not imported:
    a run of one process never started MPI. (run_main ends an out-of-memory job the same
    way, status 1: the ranks that ran out together print one line.)"""
    for name in SIGNALS:        # a second signal while this one ends the job: nothing more
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    mpi = sys.modules.get("mpi4py.MPI")
    several = mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() \
        and mpi.COMM_WORLD.Get_size() > 1
    if several and mpi.COMM_WORLD.Get_rank() != 0:
        time.sleep(ABORT_WAIT)
    print(line, file=sys.stderr, flush=True)
    if several:                 # (the MPI library's own "application called MPI_Abort" line
        time.sleep(FLUSH_S)     # would be a second; the launcher drops what is still in its
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())    # pipes at the abort)
        mpi.COMM_WORLD.Abort(status)
    sys.exit(status)


class Flag:
    """Set by SIGINT, SIGTERM or SIGUSR1 (the previous handlers are replaced for this
    process)."""

    def __init__(self):
        self.name = None
        for name in (*SIGNALS, SIGINT):
            signal.signal(getattr(signal, name), self._handler)

    def _handler(self, signum, frame):
        self.name = signal.Signals(signum).name
        if self.name == SIGINT:     # the next Ctrl-C interrupts at once (KeyboardInterrupt)
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def is_set(self):
        return self.name is not None

    def interrupted(self):
        """Ctrl-C (SIGINT) rather than a scheduler's signal."""
        return self.name == SIGINT


def exit_status(interrupted, save=True):
    """130 after Ctrl-C on any rank; after a scheduler's signal 75 with --save (`save`:
    resumable, requeue), else 143 (nothing would resume)."""
    return INTERRUPTED if interrupted else EXIT_STATUS if save else TERMINATED


def describe(interrupted, name):
    """How the log line names what stopped the run (`name`: this rank's signal, or None when
    only another rank was signalled)."""
    if interrupted:
        return "interrupted (Ctrl-C)"
    return f"preempted ({name or 'SIGTERM or SIGUSR1 on another rank'})"
