"""Preemption: SIGTERM (what Slurm and spot instances send before a kill) or SIGUSR1 (Slurm's
`--signal=USR1@60`) ask the run to save and stop at the next step boundary.

    python examples/train_gpt.py --save ckpt ...        # kill -TERM <pid>: saves, exits 75
    python examples/train_gpt.py --save ckpt --resume auto ...   # the requeued job continues

The handler only sets a flag: a checkpoint written from inside a signal handler could be cut
in the middle of a collective. At the end of each step the loop asks whether ANY rank was
signalled (one 1-element all-reduce, strategy.any_rank), so all ranks save the same step
together, then exit with status 75 (EX_TEMPFAIL: "preempted, resumable"). Installed only
with --save (without it there is nowhere to save). Tests: tests/test_preemption.py.
"""
import signal

EXIT_STATUS = 75                    # sysexits.h EX_TEMPFAIL: try again later (--resume)
SIGNALS = ("SIGTERM", "SIGUSR1")


class Flag:
    """Set by SIGTERM or SIGUSR1 (the previous handlers are replaced for this process)."""

    def __init__(self):
        self.name = None
        for name in SIGNALS:
            signal.signal(getattr(signal, name), self._handler)

    def _handler(self, signum, frame):
        self.name = signal.Signals(signum).name

    def is_set(self):
        return self.name is not None
