"""A Mixture of Experts on a sequence split over ranks: sequence parallelism (--tp with
--sequence-parallel: each tp rank holds T/tp of the positions between the split layers,
minidist/tp/region.py) and context parallelism (--cp: each cp rank holds T/cp zig-zag or
naive positions, minidist/cp/context.py), or both (cp x tp x SP: T/(cp tp) positions).

The MoE layer's decisions are per sequence (minidist/nn/moe.py): an expert takes at most cap
tokens of each sequence, in GShard's priority order over the WHOLE sequence, and the
load-balancing loss uses per-sequence statistics. A rank holding only some positions cannot
decide alone, so the layer exchanges the least that lets every rank make one process's
decisions:

    choices  every rank's top-k expert ids (B, n, k) small ints (uint8 for E <= 256),
             all-gathered over tp, then over cp: with the positions each rank holds (known to
             all: no bytes), every rank rebuilds the whole sequence's choices (B, T, k),
             counts each expert's assignments in global priority order, and keeps the slots
             of its own tokens. Host arrays, no gradient.
    sums     each sequence's sum of router probabilities (B, E) and the tokens' sum of
             logsumexp^2 (the z-loss), one all-reduce of B E + 1 values over tp, then cp
             (`SequenceSum`): the aux and z losses are then one process's on every rank.

The experts then run on this rank's own tokens (and, with --ep, the all-to-all sends only
them). Gradients: the router's weight and the experts' parameters are replicated over tp, so
under SP each goes through the region's `shared` (its gradient summed over tp: by f in
backward, or under the strategies once a step, the experts under --ep excepted), as the layer
norms do (MoE.shared). Under CP the data-parallel strategy averages
every gradient over the cp ranks, whose losses are each a 1/cp share of the sequence's: a
loss every cp rank computes WHOLE (aux, z from the summed statistics) must then send cp
times its gradient to this rank's tokens (SequenceSum's backward: grad x cp), so that the
average over cp is one process's gradient. The tp ranks' losses are one loss (each rank's
gradients of its own tokens are summed by `shared`): factor 1.
Calls and bytes per MoE layer forward (host ints and the sums; nothing in backward; a
recompute under --ckpt-activations runs the forward's again): `split_calls`.
Tests: tests/scripts/ep_check.py (the SP / CP runs against one process in float64: the same
drops, the calls and bytes of split_calls; tests/test_ep_exact.py), SequenceSum's
gradient across 2 ranks (tests/scripts/moe_split_check.py; tests/test_moe.py).
"""
import numpy as np

from minidist.autograd import Function


class SequenceParts:
    """How the sequences in hand are split: `groups` (the tp group under SP, then the cp group
    under CP: gathered in that order), `positions` (R, n) the global positions each of the R =
    tp x cp parts holds, in gather order (cp rank major, tp rank minor), `index` this rank's
    part, `T` the whole length, `grad_scale` (cp: see the module docstring)."""

    def __init__(self, groups, positions, index, grad_scale):
        self.groups, self.positions, self.index = groups, positions, index
        self.T = positions.size
        self.grad_scale = grad_scale

    @property
    def mine(self):
        """This rank's positions (n,)."""
        return self.positions[self.index]

    def gather(self, a):
        """a (B, n, k) host ints of this rank's tokens -> (B, T, k): every rank's, at their
        global positions. One all-gather per group."""
        parts = np.ascontiguousarray(a)
        for g in self.groups:                           # tp first, then cp
            out = np.empty((g.size,) + parts.shape, parts.dtype)
            g.all_gather(out, parts)
            parts = out                                 # (cp, tp, B, n, k) after both
        parts = parts.reshape((-1,) + a.shape)          # (R, B, n, k)
        whole = np.empty((a.shape[0], self.T) + a.shape[2:], a.dtype)
        for r, pos in enumerate(self.positions):
            whole[:, pos] = parts[r]
        return whole

    def total(self, x):
        """x Tensor (this rank's sums) -> the sums over every part (SequenceSum)."""
        return SequenceSum.apply(x, self.groups, self.grad_scale)


class SequenceSum(Function):
    """Forward: x summed over `groups` (all-reduces). Backward: grad x `scale` (the cp size:
    module docstring): each rank's tokens get the whole loss's gradient, cp times under CP."""

    @staticmethod
    def forward(ctx, x, groups, scale):
        ctx.scale = scale
        out = x.copy()
        for g in groups:
            g.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None, None


def choice_dtype(E):
    """The smallest unsigned integer type holding expert ids 0 .. E-1."""
    return np.min_scalar_type(max(E - 1, 0))


def sequence_parts(region, context, n):
    """The split of the sequences in hand (n positions each here), or None when this rank
    holds them whole: `region` a TensorParallelRegion (split when `sharded`, i.e. SP in a
    training forward) or None, `context` a RingContext (split when `active`) or None."""
    tp = region is not None and region.sharded
    cp = context is not None and context.active
    if not (tp or cp):
        return None
    groups, t, ntp = [], 0, 1
    if tp:
        groups.append(region.group)
        t, ntp = region.rank, region.size
    if cp:
        groups.append(context.group)
        per_cp = context.all_positions()                # (cp, n tp) zig-zag or naive
        c, ncp = context.group.rank, context.group.size
    else:
        per_cp = np.arange(n * ntp)[None]               # (1, n tp)
        c, ncp = 0, 1
    positions = per_cp.reshape(ncp * ntp, n)            # part (c, t) at row c tp + t
    return SequenceParts(groups, positions, c * ntp + t, ncp)


def split_calls(B, n, k, E, tp, cp, itemsize):
    """The collectives one MoE layer's forward makes on a sequence split over tp (SP) and cp
    ranks, n positions each here: [(group, op, elements of the whole buffer, itemsize)],
    tp's before cp's. All-gathers of the choices (B n k ids of choice_dtype(E); the cp one
    gathers tp parts each), all-reduces of the B E + 1 sums. The ring sends (N-1)/N of an
    all-gather's buffer, about 2 (N-1)/N of an all-reduce's (minidist/comm/ring.py
    ring_bytes: exactly, with its chunks)."""
    ids, calls = choice_dtype(E).itemsize, []
    for name, size, parts in (("tp", tp, 1), ("cp", cp, tp)):
        if size > 1:
            calls += [(name, "all_gather", size * parts * B * n * k, ids),
                      (name, "all_reduce", B * E + 1, itemsize)]
    return calls
