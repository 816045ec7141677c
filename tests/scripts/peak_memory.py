"""A rank's live-array peak over a whole training run, for the start-up's memory bill
(minidist/train/memory_check.py, minidist/train/step_buffers.py): tracemalloc (numpy's
arrays are traced) from before the run to its end, less what was traced when it began,
every minidist module imported before (their code is Python's own memory, not the run's);
written as {"rank", "peak"} JSON to OUT/rank<r>.json (the ranks' lines would interleave).

    mpiexec -n 2 python tests/scripts/peak_memory.py OUT examples/train_gpt.py --data F \\
        --zero 3 --steps 2 ...      # the run's flags after the script

Run by tests/test_memory_check.py.
"""
import argparse
import importlib
import json
import os
import pkgutil
import runpy
import sys
import tracemalloc

from mpi4py import MPI

import minidist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("script")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cli, flags = p.parse_known_args()        # flags: the training script's, handed on
    out = cli.out
    sys.argv = [cli.script, *flags, "--device", cli.device]
    script = cli.script
    for module in pkgutil.walk_packages(minidist.__path__, "minidist."):
        try:
            importlib.import_module(module.name)
        except ImportError:                      # (CuPy's, where it is not installed)
            continue
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    peak = tracemalloc.get_traced_memory()[1] - start
    rank = MPI.COMM_WORLD.Get_rank()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "peak": peak}, f)


if __name__ == "__main__":
    main()
