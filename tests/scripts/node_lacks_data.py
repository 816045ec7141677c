"""examples/train_gpt.py as it runs when rank 1's node lacks the --data file (the same
command on every rank; a path on a disk only some nodes mount): rank 1 sees a --data path
that does not exist. Every flag, --device included, is train_gpt.py's (train_parser()).
For tests/test_cli_ranks.py.

    mpiexec -n 2 python tests/scripts/node_lacks_data.py --data FILE [train_gpt flags]
"""
import os
import runpy
import sys

from minidist.launcher import launcher_rank

here = os.path.dirname(os.path.abspath(__file__))
if launcher_rank() == 1:               # the launcher's rank (any MPI), known before MPI_Init
    i = sys.argv.index("--data") + 1
    sys.argv[i] += ".not-on-this-node"
sys.argv[0] = os.path.join(here, "..", "..", "examples", "train_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
