"""examples/train_gpt.py as it runs when each node has its own disk where --save points (the
same command on every rank; a --save on a node's local disk): each rank starts in its own
folder, `--node-dirs A,B` (rank r in the r-th), so a relative --save names another folder
on each rank. Every other flag, --device included, is train_gpt.py's (train_parser()).
For tests/test_cli_ranks.py.

    mpiexec -n 2 python tests/scripts/node_own_disk.py --node-dirs A,B --save ck [flags]
"""
import os
import runpy
import sys

from minidist.launcher import launcher_rank

here = os.path.dirname(os.path.abspath(__file__))
i = sys.argv.index("--node-dirs")
folders = sys.argv[i + 1].split(",")
del sys.argv[i:i + 2]
os.chdir(folders[launcher_rank()])        # the launcher's rank (any MPI), before MPI_Init
sys.argv[0] = os.path.join(here, "..", "..", "examples", "train_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
