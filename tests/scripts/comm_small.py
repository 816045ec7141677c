"""Small jobs for tests/test_comm.py that must run alone.

    mpiexec -n 4 python tests/scripts/comm_small.py abort   # rank 1 raises; the job must end
    MINIDIST_TRACE=2 mpiexec -n 2 python tests/scripts/comm_small.py log
    mpiexec -n 2 python tests/scripts/comm_small.py breakpoint
    python -m minidist.comm.attach 4445          # in a second terminal: pdb on rank 1
"""
import sys
import time

import numpy as np

from minidist.comm import ProcessGroup

world = ProcessGroup.world("ring")
mode = sys.argv[1]
if mode == "abort":
    if world.rank == 1:
        time.sleep(0.5)  # let the others get into the collective first
        raise RuntimeError("boom on rank 1")
    world.all_reduce(np.ones(1000))   # would wait forever for rank 1 without the abort
    print("unreachable: the all_reduce cannot finish")
elif mode == "log":
    world.all_reduce(np.ones(7, np.float32))
    world.broadcast(np.ones(3), root=1)
elif mode == "breakpoint":
    from minidist.comm import debug
    buf = np.full(4, world.rank + 1.0)
    debug.breakpoint_on(1)   # rank 1 serves pdb on MINIDIST_PDB_PORT + 1
    world.all_reduce(buf)
    print(f"rank {world.rank} done {buf[0]}")
