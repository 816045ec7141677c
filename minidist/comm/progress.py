"""How a rank waits for a message: spin inside MPI, or poll and give the core away.

MPICH (ch4) waits for a message by polling in a loop: progress, then `sched_yield`, again.
With a core to yourself that is the fastest thing to do, and with more ranks than cores it
still works well as long as the ranks are all inside MPI (sched_yield passes the core between
them). It goes wrong when the cores are also wanted by something that is not waiting: another
program, or ranks of the same job still computing. Then the waiting rank spins away the time
slices the rank it waits for needs in order to send, and a ring step can cost a whole scheduler
time slice (milliseconds).

So the hand-written algorithms post non-blocking sends and receives and wait in `wait_all`,
with one of two policies (MINIDIST_COMM_WAIT, or `set_wait_policy`):

- "block" (default): MPI_Waitall, MPICH's own spinning wait;
- "poll": MPI_Testall, and between tests `time.sleep(0)`. CPython turns that into
  clock_nanosleep with an already-passed deadline, and the kernel's timer slack (50 us) makes it
  a real nap of about 60 us: the scheduler runs someone else. (`sched_yield`, tried instead,
  is as bad as spinning.)

"block" wins on an idle machine, "poll" when other busy processes share the cores (the
measurements: minidist/comm/README.md).
The MPI library's own collectives (algo="mpi") always keep MPICH's wait: they are the reference.

Tests: tests/test_comm.py runs the collectives under both policies.
"""
import os
import time

from mpi4py import MPI

POLICIES = ("block", "poll")
_state = {"policy": "block"}   # comm.init takes MINIDIST_COMM_WAIT's (policy_from_env)


def set_wait_policy(policy):
    """"block" (MPICH spins) or "poll" (test, nap, test: for cores shared with other work)."""
    if policy not in POLICIES:
        raise ValueError(f"wait policy must be one of {POLICIES}, not {policy!r}")
    _state["policy"] = policy


def env_policy(environ=os.environ):
    """MINIDIST_COMM_WAIT ("block" when unset); another value raises ValueError naming it."""
    value = environ.get("MINIDIST_COMM_WAIT", "") or "block"
    if value not in POLICIES:
        raise ValueError(f"MINIDIST_COMM_WAIT={value!r}: give block (MPI's own wait, the "
                         "default) or poll (test and nap, for cores shared with other work)")
    return value


def policy_from_env(environ=os.environ):
    """set_wait_policy(MINIDIST_COMM_WAIT) where it is set (comm.init; a bad value raises
    ValueError, as env_policy); unset leaves a set_wait_policy made before as it is."""
    if environ.get("MINIDIST_COMM_WAIT", ""):
        set_wait_policy(env_policy(environ))


def wait_policy():
    return _state["policy"]


def wait_all(requests):
    """Complete all `requests` (MPI.Request), the way the policy says."""
    if wait_policy() == "block":
        MPI.Request.Waitall(requests)
        return
    while not MPI.Request.Testall(requests):
        time.sleep(0)  # a ~60 us nap: give this core to a rank that has work to do
