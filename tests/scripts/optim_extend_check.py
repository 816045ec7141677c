"""A contributor's sharded optimizer on N ranks = its one-process counterpart: the template of
the optimizer chapter (minidist/optim/README.md, "Adding an optimizer"), SGD with momentum over
a ZeRO engine's shards, three steps of ZeRO-1, 2 and 3 against one process's SGD, float64.
On 3 ranks no unit divides evenly: a parameter is cut across shards and the last is padded,
so a momentum buffer that slipped against its shard would show.

    mpiexec -n 3 python tests/scripts/optim_extend_check.py
"""
import argparse
import json

import numpy as np

from minidist import backend
from minidist.nn import GPT, GPTConfig
from minidist.optim import SGD, sgd_update
from minidist.zero.engine import zero_engine
from minidist.zero.optim import ShardedOptimizer

from exact import batch, start

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)
ROWS, STEPS, LR, MOMENTUM = 6, 3, 0.1, 0.9


class ShardedMomentum(ShardedOptimizer):
    """SGD with momentum over a ZeRO engine's shards: one state array, exp_avg (state_keys),
    not AdamW's m and v."""
    one_process = "SGD"
    state_keys = ("exp_avg",)

    def __init__(self, engine, lr, momentum):
        super().__init__(engine, [{"lr": lr, "momentum": momentum}], weight_decay=0.0)

    def _update(self, u, factor):
        group = self.param_groups[0]
        sgd_update(u.param_shard, u.grad_shard, self.state[u.flat.name]["exp_avg"],
                   group["lr"], group["momentum"], first=self.steps == 1)


def one_process():
    """The whole model after STEPS of SGD with momentum on the whole global batches."""
    model = GPT(CONFIG, seed=0, dtype="float64")
    opt = SGD(model.named_parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        opt.zero_grad()
        model(*batch(step, ROWS, CONFIG, seed=0))[1].backward()
        opt.step()
    return {name: backend.to_host(p.data) for name, p in model.named_parameters()}


def sharded(stage, group):
    """The same steps, each rank on its rows of the global batches, ZeRO `stage` over
    `group`; the whole model on rank 0 ({} elsewhere) and the state keys the shards hold."""
    model = GPT(CONFIG, seed=0, dtype="float64")
    engine = zero_engine(model, group, stage)
    opt = ShardedMomentum(engine, lr=LR, momentum=MOMENTUM)
    rows = slice(group.rank * ROWS // group.size, (group.rank + 1) * ROWS // group.size)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, ROWS, CONFIG, seed=0)
        model(x[rows], y[rows])[1].backward()
        engine.sync_grads()
        opt.step()
        engine.after_step()
    keys = sorted({k for s in opt.state.values() for k in s})
    return engine.full_state_dict(), keys


def main():
    cli, world = start(argparse.ArgumentParser(description=__doc__))
    from minidist.comm import ProcessGroup
    group = ProcessGroup(world, name="dp")
    ref = one_process() if group.rank == 0 else {}
    for stage in (1, 2, 3):
        full, keys = sharded(stage, group)
        if group.rank == 0:
            assert sorted(full) == sorted(ref), "the gathered model's names differ"
            diff = float(np.max([np.max(np.abs(full[n] - ref[n])) for n in ref]))  # NaN stays
            print("RESULT " + json.dumps({"stage": stage, "ranks": group.size,
                                          "param_diff": diff, "state_keys": keys}),
                  flush=True)
            assert diff <= cli.tol, f"ZeRO-{stage}: parameters differ by {diff}"
    group.destroy()


if __name__ == "__main__":
    main()
