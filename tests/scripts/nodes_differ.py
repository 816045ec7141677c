"""examples/train_gpt.py as it runs when the ranks are told different node sizes: rank 0 has
MINIDIST_RANKS_PER_NODE=2, the others 4 (one node's environment set otherwise). Every flag
is train_gpt.py's, --device included (train_parser()). For tests/test_hier.py.

    mpiexec -n 4 python tests/scripts/nodes_differ.py --comm hier [train_gpt flags]
"""
import os
import runpy
import sys

from minidist.launcher import launcher_rank

here = os.path.dirname(os.path.abspath(__file__))
os.environ["MINIDIST_RANKS_PER_NODE"] = "2" if launcher_rank() == 0 else "4"
sys.argv[0] = os.path.join(here, "..", "..", "examples", "train_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
