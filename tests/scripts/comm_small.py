"""Small jobs for tests/test_comm.py that must run alone.

    mpiexec -n 4 python tests/scripts/comm_small.py abort   # rank 1 raises; the job must end
    mpiexec -n 4 python tests/scripts/comm_small.py exit    # rank 1 calls sys.exit(3)
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 3 python tests/scripts/comm_small.py block   # rank 1 sleeps
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 2 python tests/scripts/comm_small.py p2p     # never sent
    mpiexec -n 2 python tests/scripts/comm_small.py finish  # ranks exit 60 ms apart: clean
    MINIDIST_TRACE=2 mpiexec -n 2 python tests/scripts/comm_small.py log
    mpiexec -n 2 python tests/scripts/comm_small.py breakpoint
    python -m minidist.comm.attach 4445          # in a second terminal: pdb on rank 1
"""
import sys
import time

import numpy as np

from minidist import comm

world = comm.init("ring")   # MPI_Init, the abort hooks and the watchdog (MINIDIST_COMM_TIMEOUT)
mode = sys.argv[1]
if mode == "abort":
    if world.rank == 1:
        time.sleep(0.5)  # let the others get into the collective first
        raise RuntimeError("boom on rank 1")
    world.all_reduce(np.ones(1000))   # would wait forever for rank 1 without the abort
    print("unreachable: the all_reduce cannot finish")
elif mode == "exit":
    if world.rank == 1:
        time.sleep(0.5)
        sys.exit(3)                   # no exception hook sees this: the exit handler must
    world.all_reduce(np.ones(1000))
    print("unreachable: the all_reduce cannot finish")
elif mode == "block":
    if world.rank == 1:
        time.sleep(3600)              # never arrives
    world.all_reduce(np.ones(10))
    print("unreachable: the all_reduce cannot finish")
elif mode == "p2p":
    if world.rank == 1:
        time.sleep(3600)              # never sends (a pipeline stage stuck in compute)
    world.recv(np.ones(10), peer=1)
    print("unreachable: the recv cannot finish")
elif mode == "finish":
    world.all_reduce(np.ones(10))
    time.sleep(0.06 * world.rank + (1.5 if world.rank == 0 else 0))  # rank 0 leaves last
    print(f"rank {world.rank} finished", flush=True)
elif mode == "log":
    world.all_reduce(np.ones(7, np.float32))
    world.broadcast(np.ones(3), root=1)
elif mode == "breakpoint":
    from minidist.comm import debug
    buf = np.full(4, world.rank + 1.0)
    debug.breakpoint_on(1)   # rank 1 serves pdb on MINIDIST_PDB_PORT + 1
    world.all_reduce(buf)
    print(f"rank {world.rank} done {buf[0]}")
