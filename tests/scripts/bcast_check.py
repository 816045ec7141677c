"""DDP's start-up broadcast of the parameters, coalesced into buckets, on 4 ranks.

    mpiexec -n 4 python tests/scripts/bcast_check.py
    mpiexec -n 4 python tests/scripts/bcast_check.py --runs dp4,ep2xdp2

Every rank draws different parameters (its own seed), so only the broadcast can make them
equal. Two checks, each a `RESULT {json}` line from rank 0 for tests/test_ddp_exact.py:

- `direct`: minidist/ddp/sync.py broadcast_parameters from root 1 over the world, with
  buckets of 0.002 MiB over float32 and float64 tensors (one transposed, not contiguous):
  every rank's tensors = root 1's, bit for bit; one broadcast per bucket of
  broadcast_buckets (the trace counters' calls), fewer than the tensors.
- each run of RUNS, a strategy built from train_gpt's flags (make_strategy) with the model
  drawn from SEED + the world rank: every parameter of every rank = its DDP group's root's
  draw (the model's initial_state for that seed, as the rank holds it: its tp shard, its
  stage, its experts; a parameter no sync holds, the rank's own), bit for bit; each DDP
  sync (the dense one over its group, under --ep the experts' one over edp) issued one
  broadcast per bucket on its group.
Any failure raises and aborts the job.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exact import start  # noqa: E402

from minidist import backend  # noqa: E402
from minidist.autograd import Tensor  # noqa: E402
from minidist.comm import ProcessGroup, trace  # noqa: E402
from minidist.ddp.strategy import DataParallel  # noqa: E402
from minidist.ddp.sync import broadcast_buckets, broadcast_parameters  # noqa: E402
from minidist.ep.strategy import ExpertParallel  # noqa: E402
from minidist.nn import GPTConfig  # noqa: E402
from minidist.train.args import train_parser  # noqa: E402
from minidist.train.loop import moe_fields  # noqa: E402
from minidist.train.strategy import make_strategy  # noqa: E402

MOE = ["--moe-experts", "4", "--moe-top-k", "2"]
RUNS = {"dp4": [], "dp4+naive": ["--ddp", "naive"], "dp4+amp": ["--amp", "--dtype", "float32"],
        "tp2xdp2": ["--tp", "2"], "pp2xdp2": ["--pp", "2", "--micro-batches", "2"],
        "cp2xdp2": ["--cp", "2"], "ep2xdp2": ["--ep", "2", "--dp", "2", *MOE],
        "ep2xtp2": ["--ep", "2", "--tp", "2", *MOE]}
SEED = 7


def direct(world):
    """broadcast_parameters from root 1 in buckets of 0.002 MiB: (tensors, broadcasts)."""
    xp = backend.get_xp()
    rng = np.random.default_rng(100 + world.rank)
    shapes = [(40,), (7, 30), (300,), (3,), (20, 20), (5,), (64, 9)]
    params = []
    for i, shape in enumerate(shapes):
        dtype = np.float64 if i % 3 == 1 else np.float32
        data = xp.asarray(rng.standard_normal(shape).astype(dtype))
        params.append(Tensor(data.T if i == 4 else data, requires_grad=True))   # 4: a view
    assert not params[4].data.flags.c_contiguous
    root_values = world.comm.bcast([backend.to_host(p.data) for p in params], root=1)
    trace.reset_counters()
    issued = broadcast_parameters(params, world, root=1, bucket_mb=0.002)
    calls = trace.counters(world.name)["broadcast"]["calls"]
    assert issued == calls == len(broadcast_buckets(params, 0.002)) < len(params), \
        (issued, calls, len(params))
    for p, want in zip(params, root_values):
        got = backend.to_host(p.data)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    return {"run": "direct", "tensors": len(params), "broadcasts": calls}


def flags(name):
    return train_parser().parse_args([
        "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
        "--batch-size", "8", "--dtype", "float64", *RUNS[name]])


def syncs(strategy):
    """The DDP syncs the strategy built, each with the parameters it broadcast: the dense
    one (DataParallel's), and under --ep the experts' over edp."""
    found = []
    while strategy is not None:
        if isinstance(strategy, DataParallel):
            found.append(strategy.ddp)
        if isinstance(strategy, ExpertParallel) and strategy.expert_sync is not None:
            found.append(strategy.expert_sync)
        strategy = getattr(strategy, "inner", None)
    return found


def run(name, world):
    """Build the run's strategy and model, this rank's seed SEED + world rank; check every
    parameter against its sync group's root's draw, and the broadcasts per group."""
    args = flags(name)
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                       block_size=args.block_size, vocab_size=30, **moe_fields(args))
    strategy = make_strategy(args, world)
    trace.reset_counters()
    model = strategy.build_model(config, SEED + world.rank, args.dtype)
    named = {id(p): n for n, p in model.named_parameters()}
    seeds = {n: SEED + world.rank for n in named.values()}   # held by this rank alone
    tensors, broadcasts = 0, 0
    for sync in syncs(strategy):
        seeds.update({named[id(p)]: SEED + sync.group.ranks[0] for p in sync.params})
        calls = trace.counters(sync.group.name).get("broadcast", {}).get("calls", 0)
        assert calls == len(broadcast_buckets(sync.params)), (name, sync.group.name, calls)
        tensors, broadcasts = tensors + len(sync.params), broadcasts + calls
    for seed in set(seeds.values()):
        names = {n for n, s in seeds.items() if s == seed}
        want = model.initial_state(names, seed, args.dtype)
        for n, p in model.named_parameters():
            if n in names:
                got = backend.to_host(p.data)
                expected = np.asarray(backend.to_host(want[n])).astype(got.dtype)
                assert got.tobytes() == expected.tobytes(), (name, n, seed)
    assert broadcasts and len(seeds) == len(list(model.parameters()))
    for group in {id(s.group): s.group for s in syncs(strategy)}.values():
        group.synchronize()
    return {"run": name, "tensors": tensors, "broadcasts": broadcasts,
            "dtypes": sorted({str(p.data.dtype) for p in model.parameters()})}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default=",".join(RUNS))
    cli, comm = start(p)
    world = ProcessGroup.world()
    results = [direct(world)] + [run(name, world) for name in cli.runs.split(",")]
    for result in results:
        if comm.rank == 0:
            print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
