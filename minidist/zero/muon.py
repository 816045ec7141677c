"""Muon on ZeRO shards (--optimizer muon with --zero k): ShardedMuon.

Muon (minidist/optim/muon.py) needs each matrix's whole update, where ZeRO gives a rank a
flat shard that may cut through a matrix (minidist/zero/flat.py). A step, per unit:

    AdamW pieces     adamw_update on this rank's slice of them (ShardedAdamW's math)
    Muon pieces      M <- mu M + G and U <- G + mu M on this rank's slice
    all-gather       U's shards over the shard group (zeros where AdamW's elements are):
                     the unit's whole flat U on every rank, (N-1)/N of it received
    its matrices     each matrix of the unit is one rank's (`unit_owners`: muon.balance, the
                     costliest first to the least busy rank): its owner runs NS on the whole
                     U (under TP with its tp peers, which own it too: muon.whole) and writes
                     lr x scale x O into a flat buffer of the unit, zeros elsewhere
    reduce-scatter   of that buffer: each rank's shard of it, every element one owner's value
                     plus zeros (exact), subtracted from this rank's matrix pieces
So NS runs once per matrix, not on every rank its shard cuts, for the bytes of one more
collective: all-gather + reduce-scatter = an all-reduce of the unit, (N-1)/N x 2 of it.
The groups are Muon's three; the state ShardedOptimizer's, exp_avg M for a matrix's
elements, exp_avg_sq zero there (one checkpoint format for both optimizers). No multi-tensor
path: Muon's steps run per unit, and --amp's verdict is taken on the host.
Tests: tests/test_muon.py (every layout = one process; the bytes), tests/test_planner.py
(the planner's owners = unit_owners').
"""
from minidist.optim.adamw import adamw_update
from minidist.optim.muon import (balance, nesterov_momentum, orthogonalised, packed_flops,
                                 takes_muon, whole_shape)
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
    `packed`: as Muon's."""
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

    def update_bytes(self):
        """The bytes a rank sends per step in the update's all-gathers and reduce-scatters
        (a ring's (K-1)/K of each unit holding a matrix, twice, K the shard group's size, in
        the update's dtype)."""
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
            for i, owner in self.owners[f.name].items():
                if owner != shards.rank:
                    continue
                off = f.offsets[i]
                o = orthogonalised(full[off:off + f.sizes[i]].reshape(f.shapes[i]),
                                   self.splits.get(f.names[i]), self.tp, self.ns_steps,
                                   self.packed.get(f.names[i]))
                o *= lr
                step[off:off + f.sizes[i]] = o.reshape(-1)
            shards.reduce_scatter(look, step)      # this rank's [lo, hi) of every update
            for i, a, b in f.shard_pieces():
                if muon[i]:
                    target[a:b] -= look[a:b]
        if self.amp is not None:
            u.param_shard[...] = target            # float32 master -> 16-bit shard
