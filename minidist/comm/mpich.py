"""MPICH settings that must be in the environment before MPI_Init, applied in one place.

MPICH reads its control variables (MPIR_CVAR_*) once, when MPI is initialised, which mpi4py
does in `minidist.comm.init()` (importing minidist.comm tells mpi4py not to initialise MPI on
import). `init` calls `apply_defaults()` just before MPI_Init; a value already in the
environment always wins. Importing this module sets nothing.

What is set, and why (measurements: examples/BENCHMARKS.md, "When ranks outnumber cores"):
MPICH's intra-node "release_gather" algorithms for Barrier, Bcast, Reduce and Allreduce spin on
shared memory flags without ever yielding. mpi4py asks for MPI_THREAD_MULTIPLE, under which
MPICH does not use them; a program that asks for a lower thread level
(MPI4PY_RC_THREAD_LEVEL=single) gets them, and with more ranks than cores they are 10-100x
slower (a 64 KiB Allreduce: 62 ms instead of 0.2 ms on 4 ranks, 2 cores). Selecting MPICH's
generic point-to-point algorithms ("mpir") fixes that and costs nothing under THREAD_MULTIPLE,
so it is set when ranks outnumber cores.

Nothing else is set. MPICH's other polling knobs did not help here:
MPIR_CVAR_POLLS_BEFORE_YIELD belongs to the old ch3 device (this is ch4), and
MPIR_CVAR_CH4_PROGRESS_THROTTLE (usleep(1) after 4096 empty polls) was slower or no faster.
What helps when cores are shared is minidist's own wait policy: minidist/comm/progress.py.

Tests: tests/test_comm.py::test_mpich_defaults.
"""
import os

from minidist.launcher import available_cores, local_rank_and_size

OVERSUBSCRIBED_DEFAULTS = {
    f"MPIR_CVAR_{op}_POSIX_INTRA_ALGORITHM": "mpir"
    for op in ("BARRIER", "BCAST", "REDUCE", "ALLREDUCE")
}


def apply_defaults(environ=os.environ):
    """Put the defaults in `environ` (unless already set); returns what was added."""
    if local_rank_and_size()[1] <= available_cores():
        return {}
    added = {k: v for k, v in OVERSUBSCRIBED_DEFAULTS.items() if k not in environ}
    environ.update(added)
    return added

