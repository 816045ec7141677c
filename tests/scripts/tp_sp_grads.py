"""Sequence parallelism's replicated gradients: one coalesced all-reduce over tp per optimizer
step, counted, on 4 ranks in one mpiexec run.

    mpiexec -n 4 python tests/scripts/tp_sp_grads.py
    mpiexec -n 4 python tests/scripts/tp_sp_grads.py --runs tp2xdp2+sp,pp2xtp2+sp

Under --sequence-parallel each tp rank's gradient of a replicated parameter (layer norms,
row-parallel biases, ln_f, wpe: GPT-2's 6 L + 3, Llama's 2 L + 1) covers only its positions.
A model used alone (an own loop) sums each in backward through f, one all-reduce per
parameter and micro-batch: `before`, counted here on one forward + backward of the model as
examples/own_loop_tp.py builds it. The strategies (TensorParallel, PipelineParallel with
--tp) leave them partial and sum them in sync_grads, after the data-parallel sync, in one
flat buffer (minidist/tp/state.py sum_partial_grads): each run trains 2 steps through
train_gpt's flags (make_strategy) and the loop's train_step with the collectives traced
(minidist/comm/trace.py events) and checks, per step, that the tp group's all-reduces are
exactly that one (the arrays the optimizer reads, in their dtype: under ZeRO this rank's
pieces of its shards, which over the dp group add up to every replicated parameter's
gradient, the bytes `before` moves per micro-batch), the clip's norm, and the
vocabulary-parallel cross-entropy's 2 per loss forward (MoE: and each MoE forward's routing
sums). The ep2xtp2 runs (--ep 2, 4 experts) put this rank's experts' gradients in that one
call too, after their sync over edp (ExpertParallel.local_grads). That the numbers are one
process's: tests/scripts/tp_check.py, pp_check.py, fp32_grads_check.py, cp_check.py, ep_split.py.
Last, `poisoned`: under float16 --amp an inf in one rank's partial gradient, which only the
coalesced sum carries to the other tp rank, skips the step on every rank; and
`held_by_the_sum`: the memory the sum holds where the replicated gradients are large (MoE's
experts without --ep).
Rank 0 prints `RESULT {json}` per run (and `POISON`) for tests/test_tp_sp_grads.py.
"""
import argparse
import json
import os
import sys
import tracemalloc
import warnings
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exact import batch, start  # noqa: E402

from minidist import backend  # noqa: E402
from minidist.comm import ProcessGroup, trace  # noqa: E402
from minidist.nn import GPTConfig  # noqa: E402
from minidist.tp.model import TensorParallelGPT  # noqa: E402
from minidist.train.args import arch_fields, train_parser  # noqa: E402
from minidist.train.step import train_step  # noqa: E402
from minidist.train.strategy import make_strategy  # noqa: E402

SEED = 7
RUNS = {"tp2xdp2+sp": ["--dp", "2"],
        "tp2xdp2+sp+accum2": ["--dp", "2", "--grad-accum", "2"],
        "tp2xdp2+zero1+sp": ["--dp", "2", "--zero", "1"],
        "tp2xdp2+zero3+sp+accum2": ["--dp", "2", "--zero", "3", "--grad-accum", "2"],
        "tp2xdp2+sp+amp": ["--dp", "2", "--amp", "--amp-dtype", "float16"],
        "tp2xdp2+sp+bf16+fp32grads": ["--dp", "2", "--amp", "--amp-dtype", "bfloat16",
                                      "--grad-dtype", "float32"],
        "tp2xdp2+sp+llama": ["--dp", "2", "--arch", "llama"],
        "tp2xcp2+sp": ["--cp", "2"],
        "pp2xtp2+sp": ["--pp", "2", "--micro-batches", "2"]}
# --ep (ep 2 x tp 2): this rank's 2 of 4 experts, replicated over tp, summed in the same call
# (their syncs over edp first: DDP's .grad, ZeRO-1's shards), not each in backward by f
EP = ["--moe-experts", "4", "--ep", "2"]
RUNS.update({"ep2xtp2+sp": EP, "ep2xtp2+zero1+sp": [*EP, "--zero", "1"],
             "ep2xtp2+zero3+sp+accum2": [*EP, "--zero", "3", "--grad-accum", "2"],
             "ep2xtp2+sp+amp": [*EP, "--amp", "--amp-dtype", "float16"]})


# an overflow where only the coalesced sum can carry it: one rank's partial gradient
POISON = ["--dp", "2", "--amp", "--amp-dtype", "float16", "--ddp", "naive"]
POISONED = "transformer.h.0.ln_1.weight"        # replicated: its gradient left partial


def flags(name, given=None):
    return train_parser().parse_args([
        "--tp", "2", "--sequence-parallel", "--n-layer", "2", "--n-head", "4", "--n-embd",
        "16", "--block-size", "8", "--batch-size", "8", "--lr", "1e-2", "--grad-clip",
        "0.05", "--dtype", "float32", "--seed", str(SEED), *(given or RUNS[name])])


def config_of(args):
    from minidist.train.loop import moe_fields
    return GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                     block_size=args.block_size, vocab_size=30, **arch_fields(args),
                     **moe_fields(args))


def tp_all_reduces(group):
    """(dtype, bytes) of every all-reduce traced on `group` since the events were cleared."""
    return [(e["dtype"], e["bytes"]) for e in trace.events()
            if e["op"] == "all_reduce" and e["group"] == group.name]


def before(config, group, rows):
    """One forward + backward of the model alone (f in backward, as an own loop runs it):
    (the replicated parameters' all-reduces, their bytes), the cross-entropy's 2 left out."""
    model = TensorParallelGPT(config, group, SEED, "float32", sequence_parallel=True)
    x, y = batch(0, rows, config, SEED)
    trace.clear_events()
    model(x, y)[1].backward()
    found = tp_all_reduces(group)
    ce = [("float32", x.size * 4), ("float32", 2 * x.size * 4)]    # max; sum of exps, target
    assert all(c in found for c in ce), found
    return len(found) - 2, sum(b for _, b in found) - sum(b for _, b in ce)


def run(name, comm):
    args = flags(name)
    config = config_of(args)
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    model = strategy.build_model(config, SEED, "float32")
    opt = strategy.build_optimizer(model, args)
    part, tp = strategy.model, strategy.mesh.tp
    replicated = [p for p in part.parameters() if p.tp_split is None]
    pp = args.pp > 1
    losses = args.grad_accum * ((args.micro_batches if part.last else 0) if pp else 1)
    steps = []
    trace.enable()
    for step in range(2):
        trace.clear_events()
        x, y = batch(step, args.batch_size, config, SEED)
        train_step(strategy, model, opt, x, y, args)
        grads = strategy.local_grads(replicated)
        mine = sum(g.nbytes for g in grads)
        found = tp_all_reduces(tp)
        # MoE under SP: each MoE forward's B E + 1 routing sums over tp (the model's dtype,
        # minidist/nn/moe_split.py split_calls), B the rows of one forward
        rows = args.batch_size // strategy.mesh.shape["dp"] // args.grad_accum
        routing = [f for f in found if config.moe_experts and
                   f[1] == (rows * config.moe_experts + 1) * part.parameters()[0].data.itemsize]
        moe = sum(config.is_moe(i) for i in range(config.n_layer))
        assert len(routing) == moe * losses, (name, step, found)
        sums = [f for f in found if f == (grads[0].dtype.name, mine)]
        assert len(sums) == (1 if mine else 0), (name, step, found, mine)
        assert len(found) == len(sums) + 1 + 2 * losses + len(routing), (name, step, found)
        steps.append({"sums": len(sums), "bytes": mine, "dtype": grads[0].dtype.name,
                      "routing": len(routing)})
    trace.disable()
    # under ZeRO each dp rank sums its pieces (--ep: the dense ones over dp x ep, the
    # experts' over their replicas edp): together, every replicated gradient once
    experts = [p for p in replicated if p.expert_parallel]
    whole = (shard_bytes(strategy, strategy.mesh.dp, args,
                         [p for p in replicated if not p.expert_parallel])
             + (shard_bytes(strategy, strategy.inner.edp, args, experts) if experts else 0))
    item = {"float16": 2, "bfloat16": 2}.get(steps[0]["dtype"], 4)
    assert whole == sum(p.size for p in replicated) * item, (name, whole)
    row = {"run": name, "params": len(replicated), "steps": steps, "whole_bytes": whole,
           "grad_accum": args.grad_accum, "experts": len(experts),
           "expert_bytes": sum(p.size for p in experts) * item}
    rows = comm.gather(row, root=0)
    if comm.rank == 0:
        print("RESULT " + json.dumps({"run": name, "ranks": rows}), flush=True)


def shard_bytes(strategy, group, args, params):
    """The bytes of `params`' gradients the optimizer reads on this rank, summed over `group`
    under ZeRO (each rank of it holds its own pieces)."""
    mine = sum(g.nbytes for g in strategy.local_grads(params))
    return group.comm.allreduce(mine) if args.zero else mine


def poisoned(comm):
    """float16 --amp, tp 2 x dp 2 (--ddp naive: the dp mean at sync_grads, after every
    backward hook), 3 steps; at step 1 an inf put into POISONED's partial gradient on world
    rank 1 alone (a grad hook, after its backward): the coalesced sum over tp carries it to
    the tp partner and DDP's mean to the other replica, so every rank skips that step and
    halves its loss scale, with the same collectives as the others. Rank 0 prints `POISON`
    with each rank's skips, scale, norms, whether its replicated parameters are bit-equal to
    its tp partner's, and the RuntimeWarnings numpy raised (the clip's inf - inf)."""
    args = flags(None, POISON)
    config = config_of(args)
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    model = strategy.build_model(config, SEED, "float32")
    opt = strategy.build_optimizer(model, args)
    params, now = dict(model.named_parameters()), {"poison": False}
    if comm.rank == 1:
        params[POISONED].register_grad_hook(
            lambda p: p.grad.__setitem__((0,), np.inf) if now["poison"] else None)
    norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            now["poison"] = step == 1
            norms.append(float(train_step(strategy, model, opt,
                                          *batch(step, args.batch_size, config, SEED),
                                          args)[1]))
    mine = {n: backend.to_host(p.data) for n, p in params.items() if p.tp_split is None}
    theirs = strategy.mesh.tp.comm.allgather(mine)
    scaler = strategy.amp.scaler
    row = {"skipped": scaler.skipped, "scale": scaler.scale, "norms": norms,
           "tp_equal": all(np.array_equal(a, t[n]) for t in theirs for n, a in mine.items()),
           "warnings": [str(w.message) for w in caught
                        if issubclass(w.category, RuntimeWarning)]}
    rows = comm.gather(row, root=0)
    if comm.rank == 0:
        print("POISON " + json.dumps(rows), flush=True)


def held_by_the_sum(comm):
    """MoE without --ep (every expert replicated over tp, its gradient partial): 8 experts, C
    128, 4 layers, tp 2 x dp 2 + SP; a step's forward and backward, then sync_grads under
    tracemalloc (host arrays: CPU). Rank 0 prints `MEMORY` with each rank's replicated
    gradient bytes, the most sync_grads held above what it started with, and its tp
    all-reduces (minidist/tp/state.py SUM_PIECE_BYTES: pieces of at most 4 MiB)."""
    args = flags(None, ["--dp", "2", "--moe-experts", "8", "--n-embd", "128", "--n-layer", "4"])
    config = replace(config_of(args), moe_experts=8)
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    model = strategy.build_model(config, SEED, "float32")
    replicated = [p for p in strategy.model.parameters() if p.tp_split is None]
    x, y = batch(0, args.batch_size, config, SEED)
    x, y, ids = strategy.local_rows(x, y, np.arange(len(x)))
    strategy.start_step()
    model.dropout_keys.next_step()
    with model.dropout_keys.rows_of(ids):
        strategy.forward_backward(model, x, y, 1.0, False)
    trace.enable()
    trace.clear_events()
    tracemalloc.start()
    start_bytes = tracemalloc.get_traced_memory()[0]
    strategy.sync_grads(model)
    extra = tracemalloc.get_traced_memory()[1] - start_bytes
    tracemalloc.stop()
    row = {"replicated": sum(p.data.nbytes for p in replicated), "extra": extra,
           "calls": len(tp_all_reduces(strategy.mesh.tp))}
    trace.disable()
    rows = comm.gather(row, root=0)
    if comm.rank == 0:
        print("MEMORY " + json.dumps(rows), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default=",".join(RUNS))
    cli, comm = start(parser)
    trace.enable()
    args = flags("tp2xdp2+sp")
    mesh_tp = make_strategy(args, ProcessGroup.world(args.comm)).mesh.tp
    for arch in ("gpt2", "llama"):
        config = GPTConfig(**{**config_of(args).to_dict(), **arch_fields(
            train_parser().parse_args(["--arch", arch]))})
        calls, nbytes = before(config, mesh_tp, 4)
        if comm.rank == 0:
            print("BEFORE " + json.dumps({"arch": arch, "layers": config.n_layer,
                                          "calls": calls, "bytes": nbytes}), flush=True)
    trace.disable()
    for name in cli.runs.split(","):
        run(name, comm)
    poisoned(comm)
    held_by_the_sum(comm)


if __name__ == "__main__":
    main()
