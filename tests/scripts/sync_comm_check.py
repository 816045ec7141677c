"""Overlapped DDP with sync_comm on: exact, and every bucket all-reduce in the calling thread.

    MINIDIST_SYNC_COMM=1 mpiexec -n 2 python tests/scripts/sync_comm_check.py --watch
    mpiexec -n 2 python tests/scripts/sync_comm_check.py --watch      # the default, to compare

With --watch, a trace function on the main thread (what pdb is) counts the calls of the ring's
`ring_reduce_scatter_in_place` it sees and the largest buffer among them. With sync_comm the
gradient buckets pass through it; without, only the 1-element loss average does (the buckets
run on the group's communication thread). Losses and parameters must equal one process's in
float64. Rank 0 prints `RESULT {json}` for tests/test_debugging.py, which also runs this
script under pdb (minidist/comm/rankpdb.py) without --watch.
"""
import argparse
import json
import sys
import threading

import numpy as np

from minidist import backend, comm
from minidist.ddp.strategy import DataParallel
from minidist.nn import GPTConfig
from minidist.strategy.base import SingleProcess
from minidist.train.args import train_parser

from exact import max_abs, run_steps

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)
seen = {"calls": 0, "max_size": 0}


def watch(frame, event, arg):
    """A minimal debugger: notes every call of the ring's in-place reduce-scatter."""
    if event == "call" and frame.f_code.co_name == "ring_reduce_scatter_in_place":
        seen["calls"] += 1
        seen["max_size"] = max(seen["max_size"], frame.f_locals["buf"].size)
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--watch", action="store_true", help="count the ring calls seen (no pdb)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the arrays live (tests/mpirun.py passes pytest's --device)")
    cli = p.parse_args()
    world = comm.init("ring")   # sync_comm from MINIDIST_SYNC_COMM
    backend.set_device(cli.device)   # numpy or cupy, on every rank
    args = train_parser().parse_args(["--steps", "2", "--batch-size", "4", "--lr", "1e-2",
                                      "--grad-clip", "0"])
    ref_model, _, ref, _, _ = run_steps(SingleProcess(), args, CONFIG, 7, "float64")
    if cli.watch:
        sys.settrace(watch)
    strategy = DataParallel(world, mode="overlapped", bucket_mb=0.004)
    model, _, losses, _, _ = run_steps(strategy, args, CONFIG, 7, "float64")
    if cli.watch:
        sys.settrace(None)
    ref_params = dict(ref_model.named_parameters())
    param_diff = max_abs(p.data - ref_params[n].data for n, p in model.named_parameters())
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("minidist"))
    result = {"sync_comm": world.sync_comm,
              "loss_diff": max_abs(np.subtract(losses, ref)),
              "param_diff": param_diff, "buckets": len(strategy.ddp.buckets),
              "comm_threads": threads,
              "traced_calls": seen["calls"], "traced_max_size": seen["max_size"],
              "grad_size": sum(int(np.prod(p.shape)) for p in strategy.ddp.params)}
    if world.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
