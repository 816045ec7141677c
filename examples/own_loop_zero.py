"""ZeRO from your own training loop, checked against one process: a tiny GPT trained (float64,
dropout, two micro-batches a step, clipping) on N ranks at each ZeRO stage by the recipe that
minidist/zero/README.md shows, saved half way as a sharded checkpoint and resumed from it
into a fresh model; its parameters are then compared with one process's.

    mpiexec -n 2 python examples/own_loop_zero.py                # stages 1, 2 and 3
    mpiexec -n 4 python examples/own_loop_zero.py --stages 3 --dropout 0.5

The lines between the recipe's markers are the README's snippet, word for word
(tests/test_own_loop.py checks it). Rank 0 prints each stage's largest difference; the exit
status is 1 if one exceeds --tol.
"""
import os
import shutil
import sys
import tempfile

import numpy as np

from minidist.nn import GPT
from minidist.train.args import example_parser
from own_loop_reference import (CLIP, LR, add_check_flags, global_batch,
                                 largest_difference, one_process, start)


def own_loop(group, model, stage, steps, accum, resume=None, save=None):
    """Train `model` to `steps` at ZeRO `stage` over `group` (from the checkpoint `resume`
    if given; into the checkpoint `save` if given). Returns the engine."""
    # --- the recipe (minidist/zero/README.md) ---
    import contextlib
    from minidist.strategy.base import all_reduce_number
    from minidist.zero.checkpoint import load_sharded, save_sharded
    from minidist.zero.engine import zero_engine
    from minidist.zero.optim import ShardedAdamW
    engine = zero_engine(model, group, stage)        # shards the model over the group's ranks
    opt = ShardedAdamW(engine, lr=LR)                # not AdamW(...): ZeRO-3 leaves no .grad
    keys, start = model.dropout_keys, 0              # dropout masks keyed by (step, row)
    if resume:                                       # any world size and stage, or one process
        meta = load_sharded(resume, model, opt, group)
        keys.load_state_dict(meta["rng"]["dropout"])
        start = meta["step"]
    for step in range(start, steps):
        x, y = global_batch(step, model.config)      # the same global batch on every rank
        n = len(x) // group.size                     # this rank's rows of it, by number
        rows = np.arange(group.rank * n, (group.rank + 1) * n)
        keys.next_step()                             # once per optimizer step, not per forward
        for i, mb in enumerate(rows.reshape(accum, -1)):    # equal micro-batches
            with engine.accumulating() if i < accum - 1 else contextlib.nullcontext(), \
                    keys.rows_of(mb):                # masks of these global rows
                _, loss = model(x[mb], y[mb])        # ZeRO-3: each block gathered as it runs
                (loss * (1 / accum)).backward()
        engine.sync_grads()                          # this rank's shard of the mean gradient
        opt.clip_grad_norm(CLIP, lambda s: all_reduce_number(group, s, "sum", s))  # shards
        opt.step()                                   # this rank's shard of the parameters
        engine.after_step()                          # all-gather them (ZeRO-3: drop copies)
        opt.zero_grad()
    if save:                                         # each rank its shards; rank 0 commits
        save_sharded(save, model, opt, group, steps, rng_states={"dropout": keys.state_dict()})
    # --- end of the recipe ---
    return engine


def main():
    p = example_parser(__doc__)
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3],
                   help="ZeRO stages to run")
    p.add_argument("--save-at", type=int, default=2, help="save after this step, resume")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step")
    add_check_flags(p, steps=4)
    args, group, config = start(p, lambda args: args.grad_accum)
    ref = one_process(config, args.steps)
    tmp = group.broadcast_object(tempfile.mkdtemp() if group.rank == 0 else None, root=0)
    worst = 0.0
    for stage in args.stages:
        folder = os.path.join(tmp, f"zero{stage}")
        own_loop(group, GPT(config, seed=0, dtype="float64"), stage, args.save_at,
                 args.grad_accum, save=folder)
        fresh = GPT(config, seed=0, dtype="float64")     # the seed: dropout's keys follow it
        engine = own_loop(group, fresh, stage, args.steps, args.grad_accum, resume=folder)
        diff = largest_difference(group, engine.full_state_dict(), ref)   # {} off rank 0
        worst = max(worst, diff)
        if group.rank == 0:
            print(f"ZeRO-{stage} {group.size} ranks, {args.steps} steps (saved after "
                  f"{args.save_at}, resumed), grad-accum {args.grad_accum}, dropout "
                  f"{args.dropout}: max |parameter - one process| = {diff:.2e}", flush=True)
    group.barrier()
    if group.rank == 0:
        shutil.rmtree(tmp)
    sys.exit(0 if worst <= args.tol else 1)


if __name__ == "__main__":
    main()
