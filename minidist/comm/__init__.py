"""The communication layer: process groups, hand-written ring collectives, MPI and NCCL.

    from minidist.comm import ProcessGroup, DeviceMesh, chunk_bounds, trace

    world = ProcessGroup.world(algo="ring")       # "ring" | "naive" | "mpi" | "nccl"
    world.all_reduce(buf, op="avg")                # in place, on a flat numpy/cupy array
    mesh = DeviceMesh(dp=2, tp=2, pp=1)           # mesh.dp, mesh.tp, mesh.pp: ProcessGroups
    trace.counters()["all_reduce"]["bytes_sent"]  # what this rank sent, 2(N-1)/N x bytes

Where to read what:
    ring.py      the ring algorithms and their chunk tables, chunk_bounds    (start here)
    simulate.py  the same ring schedule run for N ranks in one process      (step through it)
    naive.py     reduce-to-root + broadcast, for comparison
    mpi.py       the MPI library's own collectives
    nccl.py      NCCL through cupy.cuda.nccl (imported only for algo="nccl")
    group.py     ProcessGroup: dispatch, async_op, staging, counters, sub-groups
    stream.py    the per-group communication thread behind async_op=True
    mesh.py      DeviceMesh(dp, tp, pp), Megatron's rank order
    trace.py     counters, MINIDIST_TRACE=1 logs, the Chrome trace
    debug.py     MINIDIST_DEBUG=1 same-call checks; abort the job on an uncaught exception;
                 breakpoint_on(rank) (attach.py is the client)
    progress.py  how a rank waits for messages (MINIDIST_COMM_WAIT=block|poll)
    mpich.py     MPICH settings applied before MPI_Init
    staging.py   cupy buffers: CUDA-aware MPI detection and host staging
    channel.py   the counted send/recv the hand-written algorithms use

Importing this package initialises MPI (mpi4py does on import) and never imports cupy.
Tests: tests/test_comm.py.
"""
from minidist.comm import mpich  # noqa: F401  (first: MPICH reads its settings at MPI_Init)
from minidist.comm import trace
from minidist.comm.debug import CollectiveMismatch, install_abort_handler
from minidist.comm.group import ALGOS, ProcessGroup
from minidist.comm.mesh import DeviceMesh
from minidist.comm.ring import chunk_bounds, ring_bytes
from minidist.comm.staging import cuda_aware_mpi
from minidist.comm.stream import Work

__all__ = ["ALGOS", "CollectiveMismatch", "DeviceMesh", "ProcessGroup", "Work", "chunk_bounds",
           "cuda_aware_mpi", "init", "install_abort_handler", "ring_bytes", "trace"]


def init(algo="ring"):
    """The world group: ProcessGroup.world(algo)."""
    return ProcessGroup.world(algo)
