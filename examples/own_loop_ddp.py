"""DDP from your own training loop, checked against one process: a tiny GPT trained a few
steps (float64, dropout, two micro-batches a step, clipping) on N ranks by the recipe that
minidist/ddp/README.md shows, every rank comparing its parameters with one process's.

    mpiexec -n 2 python examples/own_loop_ddp.py                 # naive, bucketed, overlapped
    mpiexec -n 4 python examples/own_loop_ddp.py --modes overlapped --dropout 0.5

The lines between the recipe's markers are the README's snippet, word for word
(tests/test_own_loop.py checks it). Rank 0 prints each mode's largest difference over the
ranks; the exit status is 1 if one exceeds --tol.
"""
import sys

import numpy as np

from minidist.nn import GPT
from minidist.optim import AdamW
from minidist.train.args import example_parser
from own_loop_reference import (CLIP, LR, add_check_flags, global_batch,
                                 largest_difference, one_process, start)


def own_loop(group, model, mode, steps, accum):
    """`steps` optimizer steps of DDP over `group`, `accum` micro-batches each."""
    # --- the recipe (minidist/ddp/README.md) ---
    import contextlib
    from minidist.ddp.ddp import DistributedDataParallel
    ddp = DistributedDataParallel(model, group, mode=mode)   # broadcasts rank 0's parameters
    opt = AdamW(model.named_parameters(), lr=LR)     # named: its checkpoints load anywhere
    keys = model.dropout_keys                        # dropout masks keyed by (step, row)
    for step in range(steps):
        x, y = global_batch(step, model.config)      # the same global batch on every rank
        n = len(x) // group.size                     # this rank's rows of it, by number
        rows = np.arange(group.rank * n, (group.rank + 1) * n)
        keys.next_step()                             # once per optimizer step, not per forward
        for i, mb in enumerate(rows.reshape(accum, -1)):    # equal micro-batches
            with ddp.no_sync() if i < accum - 1 else contextlib.nullcontext(), \
                    keys.rows_of(mb):                # masks of these global rows
                _, loss = ddp(x[mb], y[mb])
                (loss * (1 / accum)).backward()
        ddp.sync_grads()                             # every .grad: the mean over the ranks
        opt.clip_grad_norm(CLIP)                     # each rank holds the whole gradient
        opt.step()
        ddp.zero_grad()                              # zeroed in place: still bucket views
    # --- end of the recipe ---


def main():
    p = example_parser(__doc__)
    p.add_argument("--modes", nargs="+", default=["naive", "bucketed", "overlapped"],
                   choices=["naive", "bucketed", "overlapped"], help="DDP modes to run")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step")
    add_check_flags(p, steps=3)
    args, group, config = start(p, lambda args: args.grad_accum)
    ref = one_process(config, args.steps)
    worst = 0.0
    for mode in args.modes:
        model = GPT(config, seed=0, dtype="float64")
        own_loop(group, model, mode, args.steps, args.grad_accum)
        diff = largest_difference(group, {n: p.data for n, p in model.named_parameters()},
                                  ref)
        worst = max(worst, diff)
        if group.rank == 0:
            print(f"DDP {mode:10s} {group.size} ranks, {args.steps} steps, grad-accum "
                  f"{args.grad_accum}, dropout {args.dropout}: max |parameter - one "
                  f"process| = {diff:.2e}", flush=True)
    sys.exit(0 if worst <= args.tol else 1)


if __name__ == "__main__":
    main()
