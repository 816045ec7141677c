"""What each rank of an mpiexec job was told to run on: the plumbing of pytest's --device.

    mpiexec -n 2 python tests/scripts/device_echo.py --device cpu

Parses --device like every rank script run by tests/mpirun.py, makes it the current device
(backend.set_device); rank 0 gathers every rank's {"rank", "device", "xp", "library"} (the
first line of MPI_Get_library_version: which MPI mpi4py loaded) and prints them as
`RESULT {json}` lines (one writer: lines from several ranks could interleave).
Run by tests/test_mpirun.py and tests/test_openmpi.py.
"""
import argparse
import json

from minidist import backend, comm


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cli = p.parse_args()
    world = comm.init()
    backend.set_device(cli.device)
    from mpi4py import MPI   # after comm.init: MPI is started there
    row = {"rank": world.rank, "device": backend.device(), "xp": backend.get_xp().__name__,
           "library": MPI.Get_library_version().strip().splitlines()[0]}
    rows = MPI.COMM_WORLD.gather(row, root=0)
    for row in rows or []:
        print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
