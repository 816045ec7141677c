"""Muon on ZeRO shards (--optimizer muon with --zero k): ShardedMuon.

Muon (minidist/optim/muon.py) needs each matrix's whole update, where ZeRO gives a rank a
flat shard that may cut through a matrix (minidist/zero/flat.py). A step, per unit:

    AdamW pieces     adamw_update on this rank's slice of them (ShardedAdamW's math)
    Muon pieces      M <- mu M + G and U <- G + mu M on this rank's slice
    all-gather       U's shards over the shard group (zeros where AdamW's elements are):
                     the unit's whole flat U on every rank, (N-1)/N of it received
    its matrices     each matrix of the unit is one rank's (`unit_owners`: muon.balance, the
                     costliest first to the least busy rank): its owner runs NS on the whole
                     U and writes lr x scale x O into a flat buffer of the unit, zeros
                     elsewhere (`_steps`)
    reduce-scatter   of that buffer: each rank's shard of it, every element one owner's value
                     plus zeros (exact), subtracted from this rank's matrix pieces
So NS runs once per matrix, not on every rank its shard cuts, for the bytes of one more
collective: all-gather + reduce-scatter = an all-reduce of the unit, (N-1)/N x 2 of it.
Under TP the owner's tp peers own the matrix too (the owners come from whole shapes: the
same on every tp rank), and what they own of a unit that tp splits is shared as Muon._flush
shares a block's: all-gather each one's U shards over tp, NS on one tp rank each
(`tp_owners`: muon.tp_owners over the unit's matrices this rank owns, the order turned by the
unit's index), which fills a (tp, *shard) buffer with every tp rank's shard of O (the others
zeros), and a reduce-scatter over tp into the unit's buffer (exact). So each matrix's NS runs
on one rank of the shard group x tp, not on each tp peer, for (tp-1)/tp of it each way over tp
(measured by TP's summary, not update_bytes: `--tp 2 --zero 1`, the default model, 3.000
MiB a step, as `--tp 2`'s). The router and the experts, whole on every tp rank, run on
every tp peer of their owner, as under TP.
The groups are Muon's three; the state ShardedOptimizer's, exp_avg M for a matrix's
elements, exp_avg_sq zero there (one checkpoint format for both optimizers). No multi-tensor
path: Muon's steps run per unit, and --amp's verdict is taken on the host.
Tests: tests/test_muon.py (every layout = one process; the bytes; the NS FLOPs each rank
runs, under TP x ZeRO too: muon_tp_check.py), tests/test_plan_muon.py (the planner's
owners = unit_owners').
"""
from minidist.backend import xp_of
from minidist.optim.adamw import adamw_update
from minidist.optim.muon import (balance, nesterov_momentum, orthogonal_blocks, packed_flops,
                                 takes_muon, tp_owners, whole, whole_shape)
from minidist.zero.optim import ShardedOptimizer


def unit_owners(f, ranks, k, splits=None, steps=5, packed=None):
    """{index: the shard-group rank (of `ranks`) that runs its NS} for FlatUnit f's Muon
    weights, by NS FLOPs of the whole weight (`splits`: {name: Split} under TP; `packed`:
    {name: widths} of those that pack several matrices); f is the k-th unit, which turns the
    ranks' order (muon.balance's `first`)."""
    mats = [i for i, m in enumerate(muon_mask(f)) if m]
    costs = [packed_flops(whole_shape(f.shapes[i], (splits or {}).get(f.names[i])),
                          (packed or {}).get(f.names[i]), steps) for i in mats]
    return dict(zip(mats, balance(costs, ranks, k % ranks)))


def muon_mask(f):
    """Per parameter of FlatUnit f: whether Muon updates it (takes_muon)."""
    return [takes_muon(n, s, d) for n, s, d in zip(f.names, f.shapes, f.decay)]


class ShardedMuon(ShardedOptimizer):
    """Muon over a ZeRO engine's shards (the module's docstring): each unit's matrices by
    Muon, the rest by AdamW, as the per-parameter Muon does, to rounding. `tp`, `splits`,
    `packed`: as Muon's; so is `ns_flops_run`, the NS FLOPs this rank ran."""
    one_process = "Muon"

    def __init__(self, engine, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 amp=None, momentum=0.95, ns_steps=5, tp=None, splits=None, packed=None):
        hyper = {"lr": lr, "betas": tuple(betas), "eps": eps}
        super().__init__(engine, [{**hyper, "weight_decay": weight_decay, "muon": True},
                                  {**hyper, "weight_decay": weight_decay, "muon": False},
                                  {**hyper, "weight_decay": 0.0, "muon": False}],
                         weight_decay, amp)
        self.momentum, self.ns_steps = momentum, ns_steps
        self.tp, self.splits, self.packed = tp, dict(splits or {}), dict(packed or {})
        self.muon = {u.flat.name: muon_mask(u.flat) for u in engine.units}
        self.owners = {u.flat.name: unit_owners(u.flat, engine.group.size, k, self.splits,
                                                ns_steps, self.packed)
                       for k, u in enumerate(engine.units)}
        # of the split matrices this rank owns, the tp rank that runs each one's NS: the same
        # on every tp peer (the same shard-group rank, the same units, the same owners)
        self.tp_owners = {u.flat.name: self._tp_owners(u.flat, k)
                          for k, u in enumerate(engine.units)}
        self.ns_flops_run = 0            # packed_flops of each whole matrix NS ran here

    def _tp_owners(self, f, k):
        """{index: tp rank} for the matrices of FlatUnit f (the k-th unit) that this rank of
        the shard group owns and tp splits: muon.tp_owners over them, by whole-matrix NS
        FLOPs, the order turned by k."""
        rank = self.engine.group.rank
        mats = [i for i, o in self.owners[f.name].items()
                if o == rank and f.names[i] in self.splits]
        if not mats:
            return {}
        shapes = [whole_shape(f.shapes[i], self.splits[f.names[i]]) for i in mats]
        widths = [self.packed.get(f.names[i]) for i in mats]
        return dict(zip(mats, tp_owners(shapes, widths, self.tp.size, k, self.ns_steps)))

    def update_bytes(self):
        """The bytes a rank sends per step in the update's all-gathers and reduce-scatters over
        the shard group (a ring's (K-1)/K of each unit holding a matrix, twice, K the shard
        group's size, in the update's dtype); those over tp are TP's (its summary measures
        them on the tp group, as the per-parameter Muon's)."""
        k = self.engine.group.size
        itemsize = 4 if self.amp is not None else self.engine.units[0].flat.dtype.itemsize
        return sum(2 * (u.flat.padded * itemsize * (k - 1) // k) for u in self.engine.units
                   if any(self.muon[u.flat.name]))

    def _update(self, u, factor):
        s, f, muon = self.state[u.flat.name], u.flat, self.muon[u.flat.name]
        hyper = self.param_groups[0]
        lr, (beta1, beta2) = hyper["lr"], hyper["betas"]
        target = s["master"] if self.amp is not None else u.param_shard
        grad = self.amp.unscaled(u.grad_shard, factor) if self.amp else u.grad_shard
        if self.weight_decay:
            for a, b in f.decay_ranges():          # decoupled decay, both optimizers alike
                target[a:b] *= 1.0 - lr * self.weight_decay
        look, tmp = self._scratch_buffer(target, "look"), self._scratch_buffer(target)
        look[...] = 0
        for i, a, b in f.shard_pieces():
            if muon[i]:
                nesterov_momentum(s["exp_avg"][a:b], grad[a:b], self.momentum, look[a:b])
            else:
                adamw_update(target[a:b], grad[a:b], s["exp_avg"][a:b], s["exp_avg_sq"][a:b],
                             self.steps, lr, beta1, beta2, hyper["eps"], 0.0, scratch=tmp[a:b])
        if any(muon):
            shards = self.engine.group
            full = self._scratch_buffer(look, "gathered", f.padded)
            shards.all_gather(full, look)
            step = self._scratch_buffer(look, "step", f.padded)
            step[...] = 0
            self._steps(f, full, step, lr)
            shards.reduce_scatter(look, step)      # this rank's [lo, hi) of every update
            for i, a, b in f.shard_pieces():
                if muon[i]:
                    target[a:b] -= look[a:b]
        if self.amp is not None:
            u.param_shard[...] = target            # float32 master -> 16-bit shard

    def _orthogonal(self, u, name):
        """orthogonal_blocks of the whole U `u` of parameter `name`, counted in ns_flops_run."""
        widths = self.packed.get(name)
        self.ns_flops_run += packed_flops(u.shape, widths, self.ns_steps)
        return orthogonal_blocks(u, widths, self.ns_steps)

    def _steps(self, f, full, step, lr):
        """lr x O of each matrix of unit f this rank owns, into the unit's flat `step` (zeros
        elsewhere), from `full`, the unit's gathered U. A matrix whole here: its NS here (on
        each tp peer: the router, the experts). One tp splits, in three loops as Muon._flush
        (blocking collectives over tp, in the same order on every tp peer): all-gather each
        one's U whole over tp; each one's NS on its tp owner (self.tp_owners), which fills a
        (tp, *shard) buffer with every tp rank's shard of O (the others: zeros); a
        reduce-scatter of each buffer into this rank's shard of the step (exact). The
        buffers of the unit's matrices are held at once, as Muon._flush holds a block's."""
        xp, tp, names = xp_of(full), self.tp, f.names

        def here(i):                         # matrix i's piece of a flat buffer of the unit
            return slice(f.offsets[i], f.offsets[i] + f.sizes[i])
        for i, owner in self.owners[f.name].items():                        # whole here
            if owner == self.engine.group.rank and names[i] not in self.splits:
                o = self._orthogonal(full[here(i)].reshape(f.shapes[i]), names[i])
                step[here(i)] = o.reshape(-1)
        split = self.tp_owners[f.name]
        wholes = {i: whole(full[here(i)].reshape(f.shapes[i]), self.splits[names[i]], tp)
                  for i in split}                                           # all-gather
        bufs = {}
        for i, owner in split.items():                                      # NS, once each
            bufs[i] = xp.zeros((tp.size,) + tuple(f.shapes[i]), full.dtype)
            if owner == tp.rank:
                o = self._orthogonal(wholes[i], names[i])
                for r in range(tp.size):
                    bufs[i][r] = self.splits[names[i]].shard(o, tp.size, r)
            wholes[i] = None                 # held no longer than its NS
        for i, buf in bufs.items():                                         # reduce-scatter
            tp.reduce_scatter(step[here(i)], buf)
        step *= lr                           # O where this rank has a step, zeros elsewhere
