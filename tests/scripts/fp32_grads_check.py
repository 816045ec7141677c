"""--amp --grad-dtype float32 through the strategies on 4 ranks against one process, in one
mpiexec run (float32 gradients: Megatron-LM's main_grad, minidist/train/amp.py).

    mpiexec -n 4 python tests/scripts/fp32_grads_check.py --runs dp4+accum2,zero2+accum2

Every rank also trains the one-process reference (SingleProcess under the same
MixedPrecision, float32 gradients, the whole global batch in one pass) on the same batches;
each run builds its strategy from train_gpt's own flags (make_strategy) and trains through
the loop's train_step. The 16-bit forward and backward round each rank's part of the batch
on their own, so the runs match the reference to 16-bit rounding, not bitwise: losses to
--loss-tol (relative), the float32 master weights (gathered as a checkpoint would: world rank
0, or each pipeline stage's first replica) to --master-tol in the mean, both in units of the
16-bit type's epsilon (2^-10 float16, 2^-7 bfloat16), and to --worst-tol at the worst
element (AdamW's first steps move an element whose gradient is near zero by +-lr whatever
its size, so one rounding can flip it). Every gradient the optimizer reads
is float32, and so is every .grad left; under --sequence-parallel no all-reduce on the tp
group is 16-bit (f's sums of the replicated parameters' gradients). Rank 0 prints
`RESULT {json}` per run for tests/test_fp32_grads.py.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exact import (max_abs, run_steps, start, whole_masters,  # noqa: E402
                   worst_over_ranks)

from minidist.comm import ProcessGroup, trace  # noqa: E402
from minidist.strategy.base import SingleProcess  # noqa: E402
from minidist.train.amp import MixedPrecision  # noqa: E402
from minidist.train.args import train_parser  # noqa: E402
from minidist.train.loop import moe_fields  # noqa: E402
from minidist.train.strategy import make_strategy  # noqa: E402
from minidist.nn import GPTConfig  # noqa: E402

SEED = 7
EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}       # the 16-bit types' epsilon
MOE = ["--moe-experts", "4", "--moe-top-k", "2", "--moe-capacity-factor", "2.0"]
# name -> the layout's flags; "+moe", "+muon", "+bf16", "+l4" in a name add the model's
# (the reference takes those too: model_flags)
RUNS = {"dp4+accum2": ["--grad-accum", "2"],
        "dp4+bucketed+accum2": ["--ddp", "bucketed", "--grad-accum", "2"],
        "dp4+naive": ["--ddp", "naive"],
        "dp4+hier": ["--comm", "hier"],
        "dp4+accum2+bf16": ["--grad-accum", "2"],
        "dp4+muon": [],
        "zero1+accum2": ["--zero", "1", "--grad-accum", "2"],
        "zero2+accum2": ["--zero", "2", "--grad-accum", "2"],
        "zero3+accum2": ["--zero", "3", "--grad-accum", "2"],
        "zero2+zs2": ["--zero", "2", "--zero-shard", "2"],
        "zero3+muon": ["--zero", "3"],
        "tp2xdp2+sp+accum2": ["--tp", "2", "--sequence-parallel", "--grad-accum", "2"],
        "tp2xdp2+zero1": ["--tp", "2", "--zero", "1"],
        "pp2xdp2+accum2": ["--pp", "2", "--micro-batches", "2", "--grad-accum", "2"],
        "pp2xdp2+zbh1": ["--pp", "2", "--micro-batches", "4", "--schedule", "zb-h1"],
        "pp2xdp2+gpipe+zero2": ["--pp", "2", "--micro-batches", "2", "--schedule", "gpipe",
                                "--zero", "2"],
        "pp2xtp2+v2+l4": ["--pp", "2", "--tp", "2", "--micro-batches", "2", "--pp-virtual",
                          "2"],
        "cp2xdp2": ["--cp", "2"],
        "cp2xdp2+zero3": ["--cp", "2", "--zero", "3"],
        "ep2xdp2+moe": ["--ep", "2"],
        "ep2xdp2+zero1+moe": ["--ep", "2", "--zero", "1", "--grad-accum", "2"]}
DEFAULT = ["dp4+accum2", "zero1+accum2", "zero2+accum2", "zero3+accum2",
           "tp2xdp2+sp+accum2", "pp2xdp2+zbh1", "ep2xdp2+zero1+moe"]


def model_flags(name):
    """The flags of the model and optimizer a run name asks for (the reference's too)."""
    words = name.split("+")
    return ((MOE if "moe" in words else []) + (["--optimizer", "muon"] if "muon" in words
                                                else [])
            + (["--amp-dtype", "bfloat16"] if "bf16" in words else [])
            + (["--n-layer", "4"] if "l4" in words else []))


def flags(name, layout=True):
    """train_gpt's flags for run `name`; without `layout`, the reference's (one process)."""
    return train_parser().parse_args([
        "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "8",   # last wins
        "--batch-size", "8", "--steps", "3", "--lr", "1e-2", "--seed", str(SEED),
        "--amp", "--grad-dtype", "float32", *model_flags(name),
        *(RUNS[name] if layout else [])])


def config_of(args):
    return GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                     block_size=args.block_size, vocab_size=30, **moe_fields(args))


def grad_dtypes(strategy, model):
    """The dtypes of the gradients this rank's optimizer reads (local_grads: .grad, or
    ZeRO's shard pieces) and of every .grad left after the step."""
    dense = [p for p in model.parameters() if not p.expert_parallel]
    read = {g.dtype.name for g in strategy.local_grads(dense)}
    left = {p.grad.dtype.name for p in model.parameters() if p.grad is not None}
    return sorted(read | left)


def run(name, refs, comm, cli):
    args, ref_args = flags(name), flags(name, layout=False)
    config = config_of(args)
    key = tuple(model_flags(name))
    if key not in refs:
        one = SingleProcess(MixedPrecision(dtype=ref_args.amp_dtype, grad_dtype="float32"))
        refs[key] = run_steps(one, ref_args, config, SEED, "float32")
    r_model, r_opt, r_losses, _, _ = refs[key]
    r_masters = {n: np.asarray(m.data, np.float64)
                 for n, m in zip(r_opt.names, r_opt.master)} if hasattr(r_opt, "master") \
        else {}
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    trace.clear_events()
    trace.enable()                      # the dtypes of the tp group's all-reduces (below)
    model, opt, losses, _, _ = run_steps(strategy, args, config, SEED, "float32")
    trace.disable()
    tp = strategy.mesh.tp.name if args.tp > 1 else None
    tp_sums = sorted({e["dtype"] for e in trace.events()
                      if e["op"] == "all_reduce" and e["group"] == tp})
    got = whole_masters(strategy, model, opt)
    loss_rel = max_abs([(float(a) - float(b)) / float(b) for a, b in zip(losses, r_losses)])
    diffs = [np.abs(v - r_masters[n]) for n, v in got.items()]
    mean = float(np.concatenate([d.ravel() for d in diffs]).mean()) if diffs else 0.0
    worst = max_abs(diffs)
    dtypes = comm.allgather(grad_dtypes(strategy, model))
    compared = comm.allreduce(len(got))
    row = {"run": name, "loss_rel_diff": worst_over_ranks(comm, loss_rel),
           "master_mean_diff": worst_over_ranks(comm, mean),
           "master_worst_diff": worst_over_ranks(comm, worst),
           "masters_compared": compared, "grad_dtypes": sorted(set(sum(dtypes, []))),
           "tp_all_reduce_dtypes": tp_sums}
    assert row["grad_dtypes"] == ["float32"], row
    if "+sp" in name:          # f's all-reduces: the replicated parameters' sums, in float32
        assert not {"float16", "bfloat16"} & set(tp_sums), row
    assert compared >= len(r_masters), (row, len(r_masters))     # every parameter seen
    eps = EPS[strategy.amp.dtype.name]
    assert row["loss_rel_diff"] < cli.loss_tol * eps, row
    assert row["master_mean_diff"] < cli.master_tol * eps, row
    assert row["master_worst_diff"] < cli.worst_tol, row
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default=",".join(DEFAULT), help="names of RUNS, comma-separated")
    p.add_argument("--loss-tol", type=float, default=0.1, help="x the 16-bit epsilon")
    p.add_argument("--master-tol", type=float, default=0.2, help="x the 16-bit epsilon")
    p.add_argument("--worst-tol", type=float, default=0.05)
    cli, comm = start(p)
    refs = {}
    for name in cli.runs.split(","):
        row = run(name, refs, comm, cli)
        if comm.rank == 0:
            print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
