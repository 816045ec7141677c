"""How a rank waits for a message: spin inside MPI, or poll and give the core away.

MPICH (ch4) waits for a message by polling in a loop (progress, then `sched_yield`, again).
That is the fastest thing to do with a core to yourself. With more ranks than cores (4 ranks on
this 2-core machine, or any machine also running something else) the rank that spins burns the
time slice the rank it waits for needs in order to send: each step of a ring can cost a whole
scheduler time slice (milliseconds), and `sched_yield` does little to stop it. MPICH's knobs
for this do not help here (measured; README "Collectives and process groups"):
MPIR_CVAR_POLLS_BEFORE_YIELD belongs to the old ch3 device, MPIR_CVAR_CH4_PROGRESS_THROTTLE
only adds usleep(1) after thousands of empty polls, and MPIR_CVAR_ASYNC_PROGRESS adds a
spinning thread.

So the hand-written algorithms post non-blocking sends and receives and wait in `wait_all`:

- "block": MPI_Waitall, i.e. MPICH's own spinning wait;
- "poll": MPI_Testall, and between tests `time.sleep(0)`, which releases the GIL and enters the
  kernel's sleep path, so the scheduler really runs someone else;
- "auto" (default): "poll" when this node has more ranks than this process has cores, else
  "block".

Choose with MINIDIST_COMM_WAIT=block|poll|auto or `set_wait_policy`. The MPI library's own
collectives (algo="mpi") keep their own spinning wait: that is the reference they are.

Tests: tests/test_comm.py runs the collectives under both policies.
"""
import os
import time

from mpi4py import MPI

from minidist.backend import available_cores, local_rank_and_size

POLICIES = ("auto", "block", "poll")
_state = {}


def set_wait_policy(policy):
    """"block", "poll" or "auto" (resolved now from ranks per node vs cores)."""
    if policy not in POLICIES:
        raise ValueError(f"wait policy must be one of {POLICIES}, not {policy!r}")
    if policy == "auto":
        oversubscribed = local_rank_and_size()[1] > available_cores()
        policy = "poll" if oversubscribed else "block"
    _state["policy"] = policy
    return policy


def wait_policy():
    """The policy in force ("block" or "poll")."""
    if "policy" not in _state:
        set_wait_policy(os.environ.get("MINIDIST_COMM_WAIT", "auto"))
    return _state["policy"]


def wait_all(requests):
    """Complete all `requests` (MPI.Request), the way the policy says."""
    if wait_policy() == "block":
        MPI.Request.Waitall(requests)
        return
    while not MPI.Request.Testall(requests):
        time.sleep(0)  # give this core to a rank that has work to do
