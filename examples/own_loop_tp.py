"""Tensor parallelism (and TP x DP) from your own training loop, checked against one process: a
tiny GPT trained a few steps (float64, dropout, clipping) over tp ranks, DDP across the tp
groups when there are more ranks than --tp, by the recipe that minidist/tp/README.md shows,
without and with sequence parallelism; every rank compares the gathered parameters with one
process's.

    mpiexec -n 2 python examples/own_loop_tp.py                  # tp 2
    mpiexec -n 4 python examples/own_loop_tp.py --tp 2           # tp 2 x dp 2
    mpiexec -n 4 python examples/own_loop_tp.py --tp 4 --dropout 0.5

The lines between the recipe's markers are the README's snippet, word for word
(tests/test_own_loop.py checks it). Rank 0 prints each run's largest difference over the
ranks; the exit status is 1 if one exceeds --tol.
"""
import sys

import numpy as np

from minidist.optim import AdamW
from minidist.train.args import example_parser
from own_loop_reference import (CLIP, LR, add_check_flags, global_batch,
                                 largest_difference, one_process, start)


def own_loop(group, config, tp, sp, steps):
    """`steps` optimizer steps of a GPT split over tp ranks of `group` (sequence parallel if
    `sp`), DDP over the rest. Returns the model."""
    # --- the recipe (minidist/tp/README.md) ---
    from minidist.comm import DeviceMesh
    from minidist.ddp.ddp import DistributedDataParallel
    from minidist.tp.model import TensorParallelGPT
    from minidist.tp.state import sum_sq_over_tp
    mesh = DeviceMesh(dp=group.size // tp, tp=tp, world=group)   # tp: neighbouring ranks
    model = TensorParallelGPT(config, mesh.tp, seed=0, dtype="float64", sequence_parallel=sp)
    ddp = DistributedDataParallel(model, mesh.dp)    # across the tp groups (dp 1: a no-op)
    opt = AdamW(model.named_parameters(), lr=LR)     # named: its checkpoints load anywhere
    replicated = [p for p in model.parameters() if p.tp_split is None]  # whole on each rank
    keys = model.dropout_keys                        # dropout masks keyed by (step, row)
    for step in range(steps):
        x, y = global_batch(step, config)            # the same global batch on every rank
        n = len(x) // mesh.dp.size                   # the dp rank's rows: the SAME rows on
        rows = np.arange(mesh.dp_rank * n, (mesh.dp_rank + 1) * n)   # each rank of a tp group
        keys.next_step()                             # once per optimizer step
        with keys.rows_of(rows):
            _, loss = ddp(x[rows], y[rows])          # the loss of all the rows, on each tp rank
            loss.backward()
        ddp.sync_grads()                             # the mean over dp
        opt.clip_grad_norm(CLIP, lambda s: sum_sq_over_tp(    # split: summed over tp;
            model, mesh.tp, s, [p.grad for p in replicated]))  # replicated: counted once
        opt.step()
        ddp.zero_grad()
    # --- end of the recipe ---
    return model


def main():
    p = example_parser(__doc__)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (the rest: dp)")
    add_check_flags(p, steps=3)
    args, group, config = start(p, lambda args: 1)
    if group.size % args.tp:
        p.error(f"--tp {args.tp} does not divide the {group.size} ranks")
    ref = one_process(config, args.steps)
    worst = 0.0
    for sp in (False, True):
        model = own_loop(group, config, args.tp, sp, args.steps)
        diff = largest_difference(group, model.full_state_dict(), ref)   # gathered over tp
        worst = max(worst, diff)
        if group.rank == 0:
            print(f"TP {args.tp} x DP {group.size // args.tp}, sequence parallel "
                  f"{'on ' if sp else 'off'}, {args.steps} steps, dropout {args.dropout}: "
                  f"max |parameter - one process| = {diff:.2e}", flush=True)
    sys.exit(0 if worst <= args.tol else 1)


if __name__ == "__main__":
    main()
