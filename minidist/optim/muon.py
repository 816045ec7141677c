"""Muon (Jordan et al. 2024; at scale: Liu et al. 2025, "Muon is Scalable for LLM Training"):
momentum whose update for a weight matrix is orthogonalised, for the blocks' matrices; AdamW
for every other parameter (the embeddings, the head, biases, norms).

For a block's weight matrix W (A x B) with gradient G, at every step (--optimizer muon):
    W <- W (1 - lr wd)                          decoupled decay, as AdamW's
    M <- mu M + G                               momentum (the state's exp_avg holds M)
    U <- G + mu M                               Nesterov's look-ahead
    O <- NS(U)                                  ~ the orthogonal factor P Q^T of U = P S Q^T
    W <- W - lr 0.2 sqrt(max(A, B)) O           an update of RMS ~0.2, AdamW's: one --lr
NS (`newton_schulz`) is Newton-Schulz's iteration with the quintic of Jordan et al.:
X = U / ||U||_F, then 5 times X <- a X + b (X X^T) X + c (X X^T)^2 X, (a, b, c) = (3.4445,
-4.7750, 2.0315), on the wide orientation (A <= B) so that X X^T is the smaller product. Each
singular value s of X goes through p(s) = a s + b s^3 + c s^5 while the singular vectors stay
(tests/test_muon.py checks it against the SVD); the quintic is tuned to push every s in
(0, 1] into about [0.7, 1.2] in 5 steps, not to converge: "about orthogonal", cheaply.
Every expert of an MoE layer is a matrix of its own, and so its own NS; so are q, k and v,
which c_attn packs side by side, and SwiGLU's gate and up in c_fc (`orthogonal_blocks`, each
with its own scale, as Jordan's runs split q, k, v: at 300 steps of the default model, lr
1.6e-2, val loss 1.704 against 1.758 with c_attn as one matrix; examples/BENCHMARKS.md).

Why this needs the whole matrix: O depends on all of U (its singular vectors), where AdamW's
update of an element depends on that element only. A rank that holds a piece of W must see
the whole U first:
    tensor parallelism   W split over tp (c_attn by heads, c_proj by rows...): its NS waits
                         for the block's other split matrices (`Muon`'s per-parameter loop
                         defers it); at the block's end (`end_group` at the group's) three
                         loops: all-gather each one's U over tp (`whole`: Split.unshard,
                         the checkpoints' own), each matrix's NS on ONE tp rank (`tp_owners`:
                         `balance`, the order turned per block), a reduce-scatter per matrix
                         of a (tp, shard) buffer its owner fills with every rank's shard of O
                         (Split.shard) and the others with zeros (exact: one nonzero term);
                         the weights tp does not split (router, experts) run NS here
    ZeRO                 a rank owns a flat shard that may cut through W: ShardedMuon
                         (minidist/zero/muon.py) all-gathers each unit's U over the shard
                         group (the bytes of a ZeRO-1 parameter gather), gives each matrix
                         to one rank (`balance`), which runs its NS (under TP its tp peers
                         own it too, and share the split ones as `_flush` does: `whole`,
                         NS on one tp rank by `tp_owners`, a reduce-scatter over tp), and
                         reduce-scatters the steps back to the shards (the same bytes)
Every rank so computes the same O as one process, from the same U, to rounding: N ranks train
one process's numbers (tests/test_muon.py). A matrix's NS runs once per step: on one tp rank
under TP (not Megatron's "duplicated" way, every tp rank the whole matrix's), on one rank of
the shard group under ZeRO (Liu et al.'s "Distributed Muon" runs it on every rank whose shard
the matrix touches), and under TP x ZeRO on one tp rank of its owner; for twice the bytes
of the gather alone.

State: M per matrix (4 bytes a parameter in float32, AdamW's m and v 8); the others AdamW's m
and v. Under ZeRO the unit's flat v spans the matrices too (kept zero there), so that one
flat layout and checkpoint format serve both optimizers. `Muon` is the per-parameter
optimizer (one process, DDP, TP, PP, CP, EP): its groups are always three, [Muon's matrices,
AdamW decayed, AdamW undecayed] (some may be empty), in every layout, so checkpoints of one
layout load in any other.
Tests: tests/test_muon.py.
"""
import collections
import math

from minidist.backend import xp_of
from minidist.optim.adamw import update_with_state
from minidist.optim.optimizer import Optimizer, wants_decay

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
RMS_MATCH = 0.2          # Liu et al.: 0.2 sqrt(max(A, B)) gives AdamW's update RMS


def takes_muon(name, shape, decay=True):
    """True for the matrices Muon updates: a transformer block's decayed weights of 2 or more
    dimensions (attention, MLP, router, every expert's). Embeddings, the head, biases and
    norms stay with AdamW (as in Jordan's and Liu et al.'s runs). A weight that packs several
    matrices side by side (c_attn's q|k|v, SwiGLU's gate|up: nn/config.py packed_widths) is
    orthogonalised matrix by matrix (`orthogonal_blocks`)."""
    return decay and len(shape) >= 2 and name.startswith("transformer.h.")


def newton_schulz(u, steps=5):
    """NS(u) over the last two axes (a stack is each matrix's NS): the quintic Newton-Schulz
    iteration from u / ||u||_F, in u's dtype; returns a new array."""
    xp = xp_of(u)
    a, b, c = NS_COEFFICIENTS
    tall = u.shape[-2] > u.shape[-1]
    x = xp.swapaxes(u, -1, -2) if tall else u
    norm = xp.sqrt((x * x).sum(axis=(-2, -1), keepdims=True))
    x = xp.ascontiguousarray(x / (norm + NS_EPS))
    for _ in range(steps):
        s = x @ xp.swapaxes(x, -1, -2)                  # X X^T, the small side
        x = a * x + (b * s + c * (s @ s)) @ x
    return xp.ascontiguousarray(xp.swapaxes(x, -1, -2)) if tall else x


def ns_flops(shape, steps=5):
    """FLOPs of newton_schulz on a matrix of `shape` (its last two axes; A <= B on the wide
    orientation): each step X X^T (2 A^2 B), S S (2 A^3), (b S + c S S) X (2 A^2 B), so
    steps x (4 A^2 B + 2 A^3) (the norm, scalings and adds, O(A B), left out)."""
    a, b = sorted(shape[-2:])
    return steps * (4 * a * a * b + 2 * a ** 3)


def packed_flops(shape, widths=None, steps=5):
    """FLOPs of orthogonal_blocks on a weight of `shape` whose last axis packs matrices of
    `widths` (None: one matrix): each one's ns_flops."""
    widths = widths or (shape[-1],)
    return sum(ns_flops(tuple(shape[:-1]) + (w,), steps) for w in widths)


def balance(costs, ranks, first=0):
    """The owner (0..ranks-1) of each of the matrices whose NS costs are `costs`: the most
    costly first, each to the rank with the least work so far, ties to the first in the order
    first, first + 1, ... (the longest-processing-time rule: the busiest rank within 4/3 of
    the best split). ZeRO's Muon gives each matrix of a unit to one rank of the shard group;
    `first` turns the order from unit to unit, which spreads the work (and the transient
    memory) over the ranks, not the time: each unit waits for its busiest rank anyway."""
    load, owner = [0] * ranks, [0] * len(costs)
    order = [(first + k) % ranks for k in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner[i] = min(order, key=lambda r: load[r])
        load[owner[i]] += costs[i]
    return owner


def block_of(name):
    """The index i of the block that the Muon matrix `name` ("transformer.h.<i>. ...") is of."""
    return int(name.split(".")[2])


def tp_owners(shapes, widths, ranks, block, steps=5):
    """The tp rank (0..ranks-1) that runs the NS of each of one block's tp-split matrices
    (`Muon` under TP; under TP x ZeRO, zero/muon.py ShardedMuon's, of the ones a rank of the
    shard group owns, `block` the unit's index), of whole `shapes`, each packing matrices of
    its `widths` (None: one): `balance` by packed_flops, the ranks' order turned by
    `block`, as zero/muon.py unit_owners turns it by the unit's."""
    costs = [packed_flops(shape, w, steps) for shape, w in zip(shapes, widths)]
    return balance(costs, ranks, block % ranks)


def muon_scale(shape):
    """The update's factor for matrices of `shape` (last two axes A x B): 0.2 sqrt(max(A, B))."""
    return RMS_MATCH * math.sqrt(max(shape[-2], shape[-1]))


def nesterov_momentum(m, g, momentum, out):
    """M <- mu M + G in place; `out` <- G + mu M (the look-ahead NS takes)."""
    m *= momentum
    m += g
    xp_of(out).multiply(m, momentum, out=out)
    out += g
    return out


def whole(u, split, tp):
    """U of a parameter split over the tp group `tp` (its Split `split`): every rank's shard
    all-gathered and glued in one process's order. Collective over tp; None split: u."""
    if split is None:
        return u
    xp = xp_of(u)
    shards = xp.empty((tp.size,) + tuple(u.shape), u.dtype)
    tp.all_gather(shards, xp.ascontiguousarray(u))
    return split.unshard(list(shards))


def whole_shape(shape, split):
    """The whole matrix's shape of a parameter whose shape here is `shape`, split by `split`
    over tp (None: whole here)."""
    if split is None:
        return tuple(shape)
    return tuple(split.size if k == split.axis else n for k, n in enumerate(shape))


def orthogonal_blocks(u, widths=None, steps=5):
    """0.2 sqrt(max(A, B)) NS(U) of each matrix U (A x B) that the whole update `u` packs
    side by side on its last axis, `widths` wide (None: u is one matrix), in place of it;
    returns a new array."""
    if widths is None or len(widths) == 1:
        o = newton_schulz(u, steps)
        o *= muon_scale(u.shape)
        return o
    out, lo = [], 0
    for w in widths:
        out.append(orthogonal_blocks(u[..., lo:lo + w], None, steps))
        lo += w
    return xp_of(u).concatenate(out, axis=-1)


Pending = collections.namedtuple("Pending", "name p u split lr")
# a tp-split matrix whose NS waits for its block's end: its weight p (updated in place), a
# copy of U's shard here (the look-ahead scratch is reused), its Split, the group's lr


class Muon(Optimizer):
    """Muon for the blocks' matrices (`takes_muon`), AdamW for the rest, per parameter.
    `tp`: the tensor-parallel group and `splits` {name: Split} of the parameters split over
    it (their NS deferred to the block's end and shared over tp: `_flush`); None: every
    parameter is whole here. `packed` {name: widths} of the weights that pack several
    matrices (orthogonal_blocks); the three: strategy/base.py matrix_views. `ns_flops_run`
    counts the NS FLOPs this rank ran (packed_flops of each whole matrix), for the tests."""
    defaults = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 momentum=0.95, ns_steps=5, tp=None, splits=None, packed=None):
        self.momentum, self.ns_steps = momentum, ns_steps
        self.tp, self.splits, self.packed = tp, dict(splits or {}), dict(packed or {})
        self.ns_flops_run = 0
        self.pending = []                # one block's Pending, at most
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)

    def _default_groups(self, groups):
        """One group -> [Muon's matrices, AdamW decayed, AdamW undecayed], always all three
        (empty ones too), each marked by "muon"."""
        if len(groups) != 1:
            raise ValueError("Muon takes one list of (name, parameter) pairs and makes its "
                             "own groups")
        g = groups[0]
        pairs = list(zip(g["names"], g["params"]))
        muon = [takes_muon(n, p.shape, wants_decay(p)) for n, p in pairs]
        kinds = ((True, None), (False, True), (False, False))
        out = []
        for want_muon, want_decay in kinds:
            chosen = [(n, p) for (n, p), m in zip(pairs, muon) if m == want_muon
                      and (want_decay is None or wants_decay(p) == want_decay)]
            out.append({**g, "names": [n for n, _ in chosen], "params": [p for _, p in chosen],
                        "muon": want_muon})
        out[2]["weight_decay"] = 0.0
        return out

    def update(self, p, grad, state, group, name=None):
        if not group["muon"]:
            update_with_state(p, grad, state, group, self.scratch(p))
            return
        if "exp_avg" not in state:
            state["exp_avg"] = xp_of(p).zeros_like(p)
        if group["weight_decay"]:
            p *= 1.0 - group["lr"] * group["weight_decay"]
        u = nesterov_momentum(state["exp_avg"], grad, self.momentum,
                              self.scratch(p, "look-ahead"))
        split = self.splits.get(name)
        if split is not None:                # its NS at the block's end, on one tp rank
            if self.pending and block_of(self.pending[0].name) != block_of(name):
                self._flush()
            self.pending.append(Pending(name, p, u.copy(), split, group["lr"]))
            return
        o = self._orthogonal(u, name)
        o *= group["lr"]
        p -= o

    def end_group(self, group):
        """The last block's deferred split matrices (`_flush`)."""
        self._flush()

    def _orthogonal(self, u, name):
        """orthogonal_blocks of the whole U `u` of parameter `name`, counted in ns_flops_run."""
        widths = self.packed.get(name)
        self.ns_flops_run += packed_flops(u.shape, widths, self.ns_steps)
        return orthogonal_blocks(u, widths, self.ns_steps)

    def _flush(self):
        """The pending split matrices of one block, in three loops (blocking collectives, in
        the same order on every tp rank, so that the owners run their NS at the same time):
        all-gather each one's U whole over tp; each one's NS on its owner (tp_owners), which
        fills a (tp, *shard) buffer with every rank's shard of O (the other ranks: zeros);
        a reduce-scatter of each buffer (one nonzero term: exact), and lr x this rank's
        shard of O subtracted from its weight."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        tp, xp = self.tp, xp_of(pending[0].u)
        wholes = [whole(q.u, q.split, tp) for q in pending]                  # all-gather
        owners = tp_owners([w.shape for w in wholes], [self.packed.get(q.name) for q in pending],
                           tp.size, block_of(pending[0].name), self.ns_steps)
        steps = []
        for k, (q, owner) in enumerate(zip(pending, owners)):               # NS, once each
            step = xp.zeros((tp.size,) + q.u.shape, q.u.dtype)
            if owner == tp.rank:
                o = self._orthogonal(wholes[k], q.name)
                for r in range(tp.size):
                    step[r] = q.split.shard(o, tp.size, r)
            wholes[k] = None                 # held no longer than its NS
            steps.append(step)
        for q, step in zip(pending, steps):                                 # reduce-scatter
            p, o = q.p, q.u                  # U's copy, done with: this rank's shard of O
            tp.reduce_scatter(o, step)
            o *= q.lr
            p -= o

    def load_state_dict(self, sd):
        """Optimizer's; a matrix's exp_avg_sq (ZeRO's flat v, zero there) is left out."""
        muon = {n for g in self.param_groups if g["muon"] for n in g["names"]}
        state = {n: {k: v for k, v in s.items() if not (n in muon and k == "exp_avg_sq")}
                 for n, s in sd["state"].items()}
        super().load_state_dict({"groups": sd["groups"], "state": state})
        for g in self.param_groups:
            g["betas"] = tuple(g["betas"])

