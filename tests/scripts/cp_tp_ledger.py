"""What cp_check.py checks of context parallelism with tensor (and sequence) parallelism:
the tp group's traffic per step against its formula, and the activation ledger of a
cp x tp rank without and with --sequence-parallel.

    mpiexec -n 4 python tests/scripts/cp_check.py --runs cp2xtp2,cp2xtp2+sp

Under cp x tp each rank holds Tl = T/cp tokens of every sequence; tensor parallelism's
collectives run on them (B, Tl, C), and sequence parallelism splits the residual stream
between the blocks' split layers again, to (B, Tl/tp, C) (minidist/cp/README.md).
"""
import collections

import numpy as np

from minidist.comm import trace
from minidist.nn.config import gpt_param_specs
from minidist.strategy import memory


def step_tp_traffic(args, config, strategy, model):
    """{op: (calls, payload bytes)} one rank passes to the tp group's collectives in one step,
    and the bytes it sends (ring: 2(tp-1)/tp of an all-reduce, (tp-1)/tp of the others), as
    minidist/tp/README.md counts them on this rank's Tl = T/cp tokens: per block 4 of
    B*Tl*C (all-reduces; under SP all-gathers and as many reduce-scatters), 2 more for a
    recompute's forward, 2 for the embedding and the head; the cross-entropy's 3 numbers
    per token; under SP the replicated parameters' gradients, summed in one all-reduce a
    step (TensorParallel.sync_grads: every one's whole gradient, or under ZeRO this rank's
    pieces of them in its shards), and backward's re-gather of each column layer's input
    shard (tp/gathered.py: one more all-gather of B*Tl*C for c_attn, c_fc and the head); the
    clip's one number."""
    mesh = strategy.mesh
    tp, dp, cp, L = mesh.shape["tp"], mesh.shape["dp"], mesh.shape["cp"], config.n_layer
    s, mb = 8, args.grad_accum                                   # float64; micro-batches
    tokens = args.batch_size // dp // mb * config.block_size // cp
    pairs = mb * (4 * L + 2 + (2 * L if args.ckpt_activations else 0))
    btc = tokens * config.n_embd * s
    small = [tokens * s, 2 * tokens * s] * mb + ([s] if args.grad_clip else [])
    if args.sequence_parallel:
        specs = gpt_param_specs(config)
        rep = [(n, p) for n, p in model.named_parameters() if p.tp_split is None]
        whole = sum(int(np.prod(specs[n][0])) * s for n, _ in rep)
        mine = sum(g.nbytes for g in strategy.local_grads([p for _, p in rep]))
        assert mine == whole or args.zero, (mine, whole)
        small += [mine] if mine else []
    gathers = pairs + mb * (2 * L + 1)                           # + backward's re-gathers
    ops = {"all_gather": (gathers, gathers * btc), "reduce_scatter": (pairs, pairs * btc)} \
        if args.sequence_parallel else {"all_reduce": (pairs, pairs * btc)}
    n, b = ops.get("all_reduce", (0, 0))
    ops["all_reduce"] = (n + len(small), b + sum(small))
    ring = (tp - 1) / tp
    sent = sum(b * ring * (2 if op == "all_reduce" else 1) for op, (_, b) in ops.items())
    return ops, sent


def tp_counted(before, steps):
    """{op: (calls, bytes)} per step on the tp group since `before` (trace.counters), and the
    bytes sent per step."""
    now = trace.counters("tp")
    ops = {op: tuple((e[k] - before.get(op, {}).get(k, 0)) / steps for k in ("calls", "bytes"))
           for op, e in now.items() if e["calls"] > before.get(op, {}).get("calls", 0)}
    sent = sum(e["bytes_sent"] - before.get(op, {}).get("bytes_sent", 0)
               for op, e in now.items()) / steps
    return ops, sent


def owner(a):
    """The array that owns a's memory (a view's base, as the ledger counts buffers)."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


def stream_census(loss, params, B, Tl, C, tp):
    """Bytes of the (B, Tl, C) and of the (B, Tl/tp, C) buffers the graph behind `loss`
    keeps (parameters excluded)."""
    exclude = {id(owner(p.data)) for p in params}
    sizes, seen = collections.Counter(), set()
    for a in memory.graph_arrays(loss):
        buf = owner(a)
        if id(buf) not in seen and id(buf) not in exclude:
            seen.add(id(buf))
            sizes[tuple(buf.shape)] += int(buf.nbytes)
    return sizes[(B, Tl, C)], sizes[(B, Tl // tp, C)]


def sp_activations(flags, make, config, seed, x, y):
    """The activation ledger of a cp x tp rank (flags(name) -> args, make(args) -> its
    strategy) on the batch x, y, without and with --sequence-parallel, without and with recompute:
    bytes the graph keeps, and its census of (B, Tl, C) and (B, Tl/tp, C) buffers."""
    row = {}
    for name in ("cp2xtp2", "cp2xtp2+sp", "cp2xtp2+ckpt", "cp2xtp2+sp+ckpt"):
        args = flags(name)
        strategy = make(args)
        model = strategy.build_model(config, seed, "float64")
        loss = model(x, y)[1]
        whole, split = stream_census(loss, model.parameters(), x.shape[0],
                                     config.block_size // args.cp, config.n_embd, args.tp)
        row[name] = {"per_rank": memory.activation_bytes(loss, model.parameters()),
                     "whole": whole, "split": split}
    return row
