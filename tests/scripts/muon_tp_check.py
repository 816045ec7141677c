"""Muon under tensor parallelism shares the Newton-Schulz work over the tp ranks, and still
trains one process's numbers, float64.

    mpiexec -n 2 python tests/scripts/muon_tp_check.py     # gpt2, moe, gpt2-zero1, moe-zero1
    mpiexec -n 2 python tests/scripts/muon_tp_check.py --runs moe
    mpiexec -n 4 python tests/scripts/muon_tp_check.py --runs gpt2-zero1    # dp 2 x tp 2

Each run trains `--tp 2 --optimizer muon` (the -zero1 runs with `--zero 1`: ShardedMuon,
minidist/zero/muon.py; dp = the ranks / 2) from train_gpt's flags (make_strategy, the loop's
train_step: tests/scripts/exact.py) and, on every rank, the one-process reference. The
largest difference of the losses, gradient norms and parameters (the whole model as a
checkpoint gathers it) from the reference's must be within --tol on every rank (a NaN
fails). Rank 0 prints `RESULT {json}` per run: those differences, and the NS
FLOPs each rank ran (Muon's or ShardedMuon's ns_flops_run, in world rank order: tp rank
fastest) beside the reference's.
gpt2: every Muon matrix is split over tp, so each one's NS runs on one tp rank (tp_owners;
under ZeRO one tp rank of the dp rank that owns it); moe (a shared expert): the router and
the routed experts are whole on both tp ranks and run NS on both, the attention and the
shared expert are split. tests/test_muon.py reads it.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exact import max_abs, run_steps, start, whole_params, worst_over_ranks  # noqa: E402

from mpi4py import MPI  # noqa: E402  (after exact, so minidist.comm.init() starts MPI)
from minidist.comm import ProcessGroup  # noqa: E402
from minidist.nn import GPTConfig  # noqa: E402
from minidist.strategy.base import SingleProcess  # noqa: E402
from minidist.train.args import train_parser  # noqa: E402
from minidist.train.strategy import make_strategy  # noqa: E402

CONFIG = dict(n_layer=2, n_head=4, n_embd=16, block_size=8, vocab_size=32)
MOE = {"moe_experts": 2, "moe_top_k": 1, "moe_shared": 1}
RUNS = {"gpt2": ({}, []), "moe": (MOE, []), "gpt2-zero1": ({}, ["--zero", "1"]),
        "moe-zero1": (MOE, ["--zero", "1"])}          # name: (the model's, the layout's flags)
SEED = 5


def flags(config, tp, layout=()):
    """train_gpt's flags for `config` under --tp `tp` and `layout`, Muon, float64, 3 steps."""
    moe = ["--moe-experts", str(config.moe_experts), "--moe-top-k", str(config.moe_top_k),
           "--moe-shared", str(config.moe_shared)] if config.moe_experts else []
    return train_parser().parse_args([
        "--tp", str(tp), "--optimizer", "muon", "--n-layer", str(config.n_layer), "--n-head",
        str(config.n_head), "--n-embd", str(config.n_embd), "--block-size",
        str(config.block_size), "--batch-size", "4", "--steps", "3", "--lr", "1e-2",
        "--dtype", "float64", "--seed", str(SEED), *moe, *layout])


def run(name, comm, tol):
    """One run against the reference: {run, *_diff, ns_flops per tp rank, ns_flops_one}.
    Raises if a difference on any rank is over `tol` or NaN."""
    model_flags, layout = RUNS[name]
    config = GPTConfig(**CONFIG, **model_flags)
    one = flags(config, 1)
    ref_model, ref_opt, ref_losses, ref_norms, _ = run_steps(SingleProcess(), one, config,
                                                             SEED, "float64")
    args = flags(config, 2, layout)
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    model, opt, losses, norms, _ = run_steps(strategy, args, config, SEED, "float64")
    whole = whole_params(strategy, model, opt)
    ref = {n: np.asarray(p.data) for n, p in ref_model.named_parameters()}
    row = {"run": name, "ranks": comm.size,
           "loss_diff": max_abs(np.subtract(losses, ref_losses)),
           "norm_diff": max_abs(np.subtract(norms, ref_norms)),
           "param_diff": max_abs(whole[n] - ref[n] for n in whole),
           "params_compared": len(whole),
           "ns_flops": comm.allgather(opt.ns_flops_run), "ns_flops_one": ref_opt.ns_flops_run}
    worst = worst_over_ranks(comm, max_abs([row["loss_diff"], row["norm_diff"],
                                            row["param_diff"]]))
    assert worst <= tol, (name, row, worst)                      # a NaN fails too
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default=",".join(RUNS))        # on 2 ranks; gpt2-zero1 on 4
    cli, comm = start(p)
    for name in cli.runs.split(","):
        result = run(name, comm, cli.tol)
        if comm.rank == 0:
            print("RESULT " + json.dumps(result), flush=True)
    MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main()
