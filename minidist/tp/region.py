"""Tensor parallelism's communication, as autograd Functions (Megatron-LM, Shoeybi et al. 2019;
sequence parallelism, Korthikanti et al. 2022).

A tensor-parallel layer pair splits one big matmul over the `tp` ranks of a group: the first
layer by output columns (each rank computes some heads, some MLP units), the second by input
rows (each rank holds the rows that multiply its own columns' output), so nothing is
communicated between them. Two conjugate ops wrap the pair:

    f  CopyToTP       identity forward     all-reduce backward   (before the column layer)
    g  ReduceFromTP   all-reduce forward   identity backward     (after the row layer)

With sequence parallelism the replicated activations between the pairs (layer norms,
dropout, residual adds) are split along the sequence instead, and f / g become

    GatherFromSequence        all-gather forward (T/tp -> T)   reduce-scatter backward
    ReduceScatterToSequence   reduce-scatter forward (T -> T/tp)   all-gather backward

moving the same bytes as the all-reduces they replace (an all-reduce is a reduce-scatter
then an all-gather). Plus the gather/scatter pair along the last axis (GatherFromTP,
ScatterToTP), used to gather the vocabulary-split logits for sampling.

`TensorParallelRegion` holds the group and picks f/g or the sequence-parallel pair for each
forward; under sequence parallelism its `linear` runs a column layer's matmul as one op with
the all-gather inside, which keeps only the shard for backward (minidist/tp/gathered.py).
How one parameter is cut into per-rank shards and glued back: `Split`
(minidist/strategy/split.py). The collectives along an axis that these ops call:
minidist/tp/collectives.py.
The layers built on these: minidist/tp/layers.py; the model: minidist/tp/model.py.
Tests: tests/test_tensor_parallel.py (distributed gradchecks of every Function here in
tests/scripts/tp_check.py on 2 ranks; `--only gradcheck` for those alone).
"""
from minidist.autograd import Function
from minidist.autograd import fused as F
from minidist.tp.collectives import (SEQ_AXIS, all_gather, all_reduce, own_chunk,
                                     reduce_scatter)
from minidist.tp.gathered import gathered_linear


# ---- the conjugate pairs ------------------------------------------------------------------

class CopyToTP(Function):
    """Identity forward, all-reduce backward: Megatron's f.

    Where a replicated activation x enters a column-parallel layer: every rank reads all of
    x, so dL/dx is the sum of every rank's contribution (each computed only its columns).
    `grad_dtype` (a replicated parameter's, TensorParallelRegion.shared): the all-reduce
    sums in that dtype, float32 under --amp --grad-dtype float32; None: the gradient's."""

    @staticmethod
    def forward(ctx, x, group, grad_dtype=None):
        ctx.group, ctx.grad_dtype = group, grad_dtype
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_dtype is not None:
            grad = grad.astype(ctx.grad_dtype, copy=False)
        return all_reduce(grad, ctx.group), None, None


class ReduceFromTP(Function):
    """All-reduce forward, identity backward: Megatron's g.

    After a row-parallel layer: each rank's output is a partial sum over its rows, the
    layer's output is their sum; every rank holds that sum, so dL/d(partial) = dL/d(sum)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTP(Function):
    """All-gather along the last axis forward, keep this rank's slice backward.

    Column-parallel outputs (e.g. vocabulary-split logits) glued into the full tensor; each
    rank's slice only influenced its own part, so backward takes that part of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return own_chunk(grad, ctx.group, -1), None


class ScatterToTP(Function):
    """Keep this rank's slice of the last axis forward, all-gather backward (GatherFromTP's
    conjugate): a replicated tensor handed to a layer that wants only its shard."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return own_chunk(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, -1), None


class GatherFromSequence(Function):
    """All-gather along the sequence forward, reduce-scatter backward: sequence parallelism's
    f. (B, T/tp, C) shards -> the whole (B, T, C) a column-parallel layer needs; every rank
    used every position, so each shard's gradient is the sum over ranks of its positions."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, SEQ_AXIS)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group, SEQ_AXIS), None


class ReduceScatterToSequence(Function):
    """Reduce-scatter along the sequence forward, all-gather backward: sequence parallelism's
    g. Row-parallel partial sums (B, T, C) -> this rank's positions of their sum, (B, T/tp, C);
    backward hands every rank the whole gradient, as g's identity backward does."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group, SEQ_AXIS)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, SEQ_AXIS), None


def copy_to_tp(x, group, grad_dtype=None):
    return CopyToTP.apply(x, group, grad_dtype)


def reduce_from_tp(x, group):
    return ReduceFromTP.apply(x, group)


def gather_from_tp(x, group):
    return GatherFromTP.apply(x, group)


def scatter_to_tp(x, group):
    return ScatterToTP.apply(x, group)


def gather_from_sequence(x, group):
    return GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x, group):
    return ReduceScatterToSequence.apply(x, group)


# ---- where activations enter and leave the split layers -----------------------------------

class TensorParallelRegion:
    """The tp group, and which conjugate pair this forward uses.

    `enter(x)` before a column-parallel matmul, `leave(y)` after a row-parallel one: f and g,
    or with sequence parallelism (`sharded`) the all-gather / reduce-scatter along T, so that
    everything between leave and the next enter (layer norms, dropout, residual adds) works
    on (B, T/tp, C), with the replicated parameters they use passed through `shared`
    (f: all-reduce of their gradients; or, for a strategy that sums them once a step,
    left partial: `leave_partial`). The model calls `begin(T, shard)` at the start of each
    forward and says there whether this forward shards the sequence: the TP models pass
    `shard=is_grad_enabled()`, since sequence parallelism saves the activation memory of a
    forward that records a graph (training), while evaluation and sampling (no_grad, any
    length) take the f/g path, same numbers.
    `keep_gathered` (default False): the column layers' matmuls run as the naive pair,
    all-gather then Linear, which keeps the gathered (B, T, C) for backward instead of
    re-gathering the shard there (`linear`); the same numbers, kept to measure the memory
    the re-gather saves (tests/scripts/tp_probes.py, examples/BENCHMARKS.md)."""

    def __init__(self, group, sequence_parallel=False, keep_gathered=False):
        self.group, self.size, self.rank = group, group.size, group.rank
        self.sequence_parallel = bool(sequence_parallel) and group.size > 1
        self.keep_gathered = keep_gathered
        self.sharded = False
        self.partial = set()        # ids of the parameters `shared` leaves partial (leave_partial)

    def begin(self, T, shard):
        """Start a forward of length T; `shard`: split the sequence (if sequence parallel)."""
        self.sharded = self.sequence_parallel and shard
        if self.sharded and T % self.size:
            raise ValueError(f"sequence parallelism splits the sequence over {self.size} "
                             f"ranks: length {T} must be a multiple of {self.size}")

    def enter(self, x):
        """(B, T, C) replicated, or (B, T/tp, C) shards -> (B, T, C) on every rank."""
        if self.sharded:
            return gather_from_sequence(x, self.group)
        return copy_to_tp(x, self.group)

    def linear(self, x, w, b=None):
        """enter(x) @ w + b: a column-parallel layer's matmul, (B, T, out/tp). Sharded,
        gathered_linear (minidist/tp/gathered.py) all-gathers x inside the op and keeps only
        the shard for backward, re-gathering it there; otherwise (or keep_gathered) enter,
        then F.linear."""
        if self.sharded and not self.keep_gathered:
            return gathered_linear(x, w, b, self.group)
        return F.linear(self.enter(x), w, b)

    def leave(self, y):
        """(B, T, C) partial sums -> their sum: (B, T, C) replicated or (B, T/tp, C)."""
        if self.sharded:
            return reduce_scatter_to_sequence(y, self.group)
        return reduce_from_tp(y, self.group)

    def leave_partial(self, params):
        """Under sequence parallelism, `shared` passes these replicated parameters as they
        are, not through f: their gradients stay partial (each tp rank's covers only its
        positions) until the strategy sums them over tp once a step, all in one all-reduce
        after the gradient sync over dp (TensorParallel.sync_grads; minidist/tp/state.py
        sum_partial_grads), as Megatron-LM does. Only a strategy that runs that sum may say
        so: a loop of one's own (examples/own_loop_tp.py) leaves it empty, and f sums each
        gradient in backward."""
        self.partial = {id(p) for p in params}

    def shared(self, p):
        """A replicated parameter as a layer on the sequence shards uses it (layer norms,
        row-parallel biases, wpe): through f when sharded, since each rank's gradient then
        covers only its positions and f's all-reduce sums them into the whole gradient, in
        the graph, before any hook (DDP, ZeRO) sees it: in p's grad_dtype (float32 under
        --amp --grad-dtype float32, a float32 sum over the ranks). A parameter the strategy
        sums itself (leave_partial) passes as it is."""
        if not self.sharded or id(p) in self.partial:
            return p
        return copy_to_tp(p, self.group, p.grad_dtype)
