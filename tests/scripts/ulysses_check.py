"""Context parallelism with Ulysses attention (--cp-attention ulysses) against one process.

    mpiexec -n 2 python tests/scripts/ulysses_check.py                  # u2, u2+naive
    mpiexec -n 2 python tests/scripts/ulysses_check.py --runs u2+drop,u2+tiled+ckpt
    mpiexec -n 4 python tests/scripts/ulysses_check.py --runs u4,u2xdp2+zero3,u2xtp2+sp
    mpiexec -n 4 python tests/scripts/ulysses_check.py --runs u2xtp2+zero3 \
        --resume-runs u2xtp2+zero3

A run's name: "u<cp>" then "x"-joined axes and "+"-joined options (RUNS); "+drop": --dropout
0.1 (the reference with the same dropout), "+ckpt": --ckpt-activations. Every rank also trains
the single-process reference (SingleProcess, the whole global batch, no recompute), float64,
through the loop's train_step (tests/scripts/exact.py). Checks: losses, grad norms and
parameters equal the reference to --tol; the bytes each rank sent on the cp group equal
minidist/cp/ulysses.py's formula (recompute included); with --resume-runs the run's
checkpoint loaded back (cp_check.check_reload's way). First (`attention_vs_ring`): on the same
random qkv and output gradient, Ulysses' attention and the ring's give each rank the same y
and dqkv (zig-zag and naive, dropout 0 and 0.2); and (`exchange_gradcheck`) the two
all-to-alls' backward against float64 central differences across the ranks
(tests/scripts/dist_gradcheck.py). Rank 0 prints `RESULT {json}` (and one `RING {json}`, one
`GRADCHECK {json}`) lines for tests/test_cp_ulysses.py; any failure raises and aborts the job.
"""
import argparse
import copy
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exact import max_abs, run_steps, start, worst_over_ranks  # noqa: E402
import cp_check  # noqa: E402
from dist_gradcheck import dist_gradcheck  # noqa: E402

from minidist.autograd import Tensor  # noqa: E402
from minidist.autograd.dropout_keys import DropoutKeys, DropoutSite  # noqa: E402
from minidist.comm import ProcessGroup, trace  # noqa: E402
from mpi4py import MPI  # noqa: E402  (after exact: minidist.comm.init() starts MPI)
from minidist.cp.context import RingContext  # noqa: E402
from minidist.cp.strategy import ContextParallel  # noqa: E402
from minidist.cp.ring import layout  # noqa: E402
from minidist.cp.ulysses import (HeadsForTokens, TokensForHeads, kv_heads_sent,  # noqa: E402
                                  sequence_order, ulysses_bytes)
from minidist.nn import GPTConfig  # noqa: E402
from minidist.strategy.base import SingleProcess  # noqa: E402
from minidist.train.args import arch_fields, train_parser  # noqa: E402
from minidist.train.strategy import make_strategy  # noqa: E402

SEED = 7
AXES = {"dp2": ["--dp", "2"], "tp2": ["--tp", "2"]}
OPTIONS = {"naive": ["--cp-split", "naive"], "zero1": ["--zero", "1"], "zero2": ["--zero", "2"],
           "zero3": ["--zero", "3"], "accum": ["--grad-accum", "2"],
           "sp": ["--sequence-parallel"], "tiled": ["--attention", "tiled"],
           "redo": ["--attention", "recompute"],
           "drop": ["--dropout", "0.1"], "ckpt": ["--ckpt-activations"],
           # Llama's block with K kv heads (0: n_head), against one process of that block
           "kv0": ["--arch", "llama", "--n-kv-head", "0"], "kv1": ["--arch", "llama",
                                                               "--n-kv-head", "1"],
           "kv2": ["--arch", "llama", "--n-kv-head", "2"],
           # heads whose kv count and cp are coprime (kv_windows: 2 kv heads a rank, not
           # lcm(3, N) / N = 3): 6 heads (24 wide) at cp 2, 12 (48 wide) at cp 4
           "kv3": ["--arch", "llama", "--n-kv-head", "3"],
           "h6": ["--n-head", "6", "--n-embd", "24"], "h12": ["--n-head", "12", "--n-embd",
                                                             "48"]}


def flags(name, *extra):
    """train_gpt's flags for run `name` (cp_check's tiny model: 4 heads, 16 wide, T 16)."""
    head, *options = name.split("+")
    cp, *axes = head.split("x")
    c = cp_check.CONFIG
    more = [f for a in axes for f in AXES[a]] + [f for o in options for f in OPTIONS[o]]
    return train_parser().parse_args([
        "--cp", cp[1:], "--cp-attention", "ulysses", "--n-layer", str(c.n_layer),
        "--n-head", str(c.n_head), "--n-embd", str(c.n_embd), "--block-size",
        str(c.block_size), "--dropout", "0", "--attention-block", str(c.attention_block),
        "--batch-size", "4", "--steps", "3", "--lr", "1e-2", "--grad-clip", "0.05",
        "--dtype", "float64", "--seed", str(SEED), *more, *extra])


def config_of(args):
    c = cp_check.CONFIG
    return GPTConfig(n_layer=c.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                     block_size=c.block_size, vocab_size=c.vocab_size, dropout=args.dropout,
                     attention=args.attention, attention_block=args.attention_block,
                     **arch_fields(args))


def reference(args, refs):
    """One process on the whole global batch (no accum, no recompute), per dropout and
    block: (model, optimizer, losses, norms)."""
    key = (args.dropout, args.arch, args.n_kv_head, args.n_head)
    if key not in refs:
        one = copy.copy(args)
        one.grad_accum, one.ckpt_activations = 1, False
        refs[key] = run_steps(SingleProcess(), one, config_of(args), SEED, "float64")[:4]
    return refs[key]


def reload_flags(name, *extra):
    """flags() for cp_check.check_reload's layouts; its one without cp (--cp 1) runs the
    default attention (--cp-attention is refused without --cp)."""
    return flags(name, *extra, *(["--cp-attention", "ring"] if "--cp" in extra else []))


def step_bytes(args, mesh):
    """Bytes one rank sends on the cp group in one step (minidist/cp/ulysses.py's formula:
    kv the bytes of its k as sent, kv_heads_sent of this tp rank's heads)."""
    n, c, tp = mesh.shape["cp"], cp_check.CONFIG, mesh.shape["tp"]
    rows = args.batch_size // mesh.shape["dp"] // args.grad_accum
    S = rows * (c.block_size // n) * (args.n_embd // tp) * 8      # float64
    heads = args.n_head // tp
    sent = kv_heads_sent(heads, (args.n_kv_head or args.n_head) // tp, n)
    return ulysses_bytes(S, n, args.ckpt_activations, S * sent // heads) * c.n_layer * \
        args.grad_accum


def cp_summary(strategy):
    """ContextParallel's summary line, found inside TensorParallel (its inner) if need be."""
    while not isinstance(strategy, ContextParallel):
        strategy = strategy.inner
    return strategy.summary()


def run(name, refs, comm, tol, reload=False):
    args = flags(name)
    ref = reference(args, refs)
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    sent0 = trace.bytes_sent("cp")
    model, opt, losses, norms, _ = run_steps(strategy, args, config_of(args), SEED, "float64")
    sent = (trace.bytes_sent("cp") - sent0) / args.steps
    params = cp_check.full_params(strategy, model)
    r_model, _, r_losses, r_norms = ref
    d = max_abs
    row = {"run": name, "loss_diff": d([float(a) - float(b) for a, b in zip(losses, r_losses)]),
           "norm_diff": d([float(a) - float(b) for a, b in zip(norms, r_norms)]),
           "param_diff": d([d(params[n] - np.asarray(p.data))
                            for n, p in r_model.named_parameters()]) if params else 0.0,
           "bytes_sent": sent, "theory_sent": step_bytes(args, strategy.mesh),
           "losses": [float(v) for v in losses], "summary": cp_summary(strategy)}
    ok = all(row[k] < tol for k in ("loss_diff", "norm_diff", "param_diff"))
    assert comm.allreduce(ok, op=MPI.LAND), (name, row)           # NaN fails too
    assert sent == row["theory_sent"], (name, row)
    if reload:
        row["reload"] = cp_check.check_reload(name, strategy, model, opt, ref[:2], comm,
                                              make_flags=reload_flags)
    return row


def attention_vs_ring(comm, n_head=4, C=16, T=16, B=2):
    """Every rank: Ulysses' and the ring's attention on this rank's tokens of one random
    (B, T, 3C) qkv, and their gradients for one random output gradient: the largest
    difference over y and dqkv, per (split, dropout)."""
    group = ProcessGroup.world()
    n, r = group.size, group.rank
    rng = np.random.default_rng(0)
    out = {}
    for split, kv in (("zigzag", None), ("naive", None), ("zigzag", 1), ("naive", 2)):
        width = C + 2 * C // n_head * (kv or n_head)                     # q | k | v
        qkv_all, g_all = rng.standard_normal((B, T, width)), rng.standard_normal((B, T, C))
        pos = np.concatenate([np.arange(s, s + L) for s, L in layout(T, n, r, split)])
        for p in (0.0, 0.2):
            keys = DropoutKeys(SEED)
            site = DropoutSite(keys, "transformer.h.0.attn.attn_dropout")
            ys = []
            for kind in ("ring", "ulysses"):
                ctx = RingContext(group, split, block=4, attention=kind, local="materialized")
                ctx.layouts = [layout(T, n, s, split) for s in range(n)]
                qkv = Tensor(qkv_all[:, pos].copy(), requires_grad=True)
                y = ctx.self_attention(qkv, n_head, p, site, kv)          # (B, Tl, C)
                (y * Tensor(g_all[:, pos])).sum().backward()
                ys.append((y.data, qkv.grad))
            out[f"{split} p={p}" + (f" kv={kv}" if kv else "")] = \
                max_abs([a - b for a, b in zip(*ys)])
    return {k: worst_over_ranks(comm, v) for k, v in out.items()}


def exchange_gradcheck(comm, B=2):
    """HeadsForTokens (q|k|v of this rank's tokens, every head -> every token, this rank's
    heads) and TokensForHeads (back), zig-zag and naive: each rank's input its own shard,
    every rank's output in the loss, so a gradient sent to the wrong rank or the wrong
    position fails. T = 2N tokens, C = 2N wide (two columns per rank's heads). The largest
    |backward - central difference| over the ranks, per (Function, split)."""
    group = ProcessGroup.world()
    n, r = group.size, group.rank
    T, C = 2 * n, 2 * n
    rng = np.random.default_rng([3, r])
    out = {}
    for split in ("zigzag", "naive"):
        order = sequence_order([layout(T, n, s, split) for s in range(n)])
        for name, fn, x in [
                ("HeadsForTokens", lambda t: HeadsForTokens.apply(t, group, order, 3),
                 rng.standard_normal((B, T // n, 3 * C))),
                ("TokensForHeads", lambda t: TokensForHeads.apply(t, group, order, 1),
                 rng.standard_normal((B, T, C // n))),
                ("HeadsForTokens q|k|v", lambda t: HeadsForTokens.apply(      # grouped-query:
                    t, group, order, (C, C // 2, C // 2)),                  # k, v narrower
                 rng.standard_normal((B, T // n, 2 * C)))]:
            row = dist_gradcheck(f"{name} {split}", fn, x, comm, "sharded", "sharded")
            out[f"{name} {split}"] = comm.allreduce(row["max_abs_diff"], op=MPI.MAX)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default="u2,u2+naive")
    p.add_argument("--resume-runs", default="", help="runs whose checkpoint is saved and "
                   "loaded back (cp_check.check_reload)")
    cli, comm = start(p)
    row = attention_vs_ring(comm)
    assert all(v < cli.tol for v in row.values()), row
    if comm.rank == 0:
        print("RING " + json.dumps(row), flush=True)
    row = exchange_gradcheck(comm)
    if comm.rank == 0:
        print("GRADCHECK " + json.dumps(row), flush=True)
    refs = {}
    for name in cli.runs.split(","):
        row = run(name, refs, comm, cli.tol, name in cli.resume_runs.split(","))
        if comm.rank == 0:
            print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
