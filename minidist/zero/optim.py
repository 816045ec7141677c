"""AdamW on ZeRO shards: each rank updates only flat[lo:hi) of every unit, in place.

The math is minidist/optim/adamw.py's `adamw_update`, element by element the same as the
per-parameter AdamW of one process, so N ranks match one process to rounding. Two details:

    weight decay   AdamW decays matrices but not biases, LayerNorm or embedding weights. A
                   shard can hold both kinds, so decay is applied first, on the decayed ranges
                   of the shard only (FlatUnit.decay_ranges), then adamw_update runs with
                   weight_decay=0: the same `p *= 1 - lr * wd` on the same elements.
    clipping       the global gradient norm is the sum over ranks of each rank's sum of squares
                   of its gradient shards (padding is zero and adds nothing), through the
                   strategy's `reduce_sum_sq` all-reduce; every rank then scales alike.

Mixed precision (`amp`, a minidist/train/amp.py MixedPrecision whose cast_model ran): the model
(and its flat buffers, shards, gradients) is 16-bit; the float32 master weights are cut into
shards here (amp.masters is emptied: no rank keeps a full float32 copy) and live with m and v
as optimizer state, 12 bytes per parameter / N. step() unscales the gradient shard into a
float32 scratch buffer, skips the step on inf/nan (every rank agrees: the norm is global),
updates the master shard and writes it back to the 16-bit parameter shard.

On cupy with MINIDIST_CUDA_NEW_KERNELS=1 (proven on the CPU only) the update of every shard
is two multi-tensor launches (minidist/optim/multi_tensor.py) instead of a few per unit: the
decayed runs of all shards (FlatUnit.update_ranges) with weight decay, the rest without
(`multi_launches`); under amp multi_amp_adamw does the unscale and the copy back too.

After the update the training step calls the strategy's after_step(), which runs the engine's:
all-gather the parameters (stages 1, 2) or free the stale gathered copies (stage 3).
Tests: tests/scripts/zero_check.py (run by tests/test_zero.py); the multi-tensor path:
tests/test_zero_multi_cpu.py.
"""
import numpy as np

from minidist.backend import xp_of
from minidist.optim import multi_tensor
from minidist.optim.adamw import adamw_update
from minidist.optim.clip import clip_grad_norm
from minidist.optim.muon import (balance, nesterov_momentum, ns_flops, orthogonalised,
                                 takes_muon, whole_shape)


class ShardedAdamW:
    """AdamW over a ZeRO engine's shards. Used like AdamW by the loop: set_lr, zero_grad,
    clip_grad_norm, step; state_arrays() and ledger_arrays() for the memory ledger."""
    one_process = "AdamW"                 # the class one process uses (checkpoints' type)

    def __init__(self, engine, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 amp=None):
        self.engine, self.amp, self.weight_decay = engine, amp, weight_decay
        hyper = {"lr": lr, "betas": tuple(betas), "eps": eps}
        kinds = {d for u in engine.units for d in u.flat.decay}    # AdamW's default split
        self.param_groups = [{**hyper, "weight_decay": wd} for want, wd in
                             ((True, weight_decay), (False, 0.0)) if want in kinds]
        self.steps = 0                    # updates taken (AdamW's per-parameter "step")
        self.state = {u.flat.name: self._new_state(u) for u in engine.units}
        if amp is not None:               # the full float32 copies: only shards are kept
            for n in (n for u in engine.units for n in u.flat.names):
                amp.masters.pop(n)
        self._factor, self._found_inf, self._scratch = None, False, {}
        self._verdict = None               # --amp's verdict of this step, on the device
        if amp is not None:
            amp.adopt(self)                # its settle() reads the device verdicts back

    def _new_state(self, u):
        """m and v (and the float32 master shard under amp) for unit u's [lo, hi)."""
        xp, f = xp_of(u.param_shard), u.flat
        dtype = np.float32 if self.amp is not None else f.dtype
        state = {"exp_avg": xp.zeros(f.shard_size, dtype),
                 "exp_avg_sq": xp.zeros(f.shard_size, dtype)}
        if self.amp is not None:
            masters = [self.amp.masters[n] for n in f.names]
            state["master"] = f.flatten(masters, dtype=np.float32)[f.lo:f.hi].copy()
        return state

    def set_lr(self, lr):
        for g in self.param_groups:
            g["lr"] = lr

    def zero_grad(self):
        self.engine.zero_grad()

    # ---- clip and step ---------------------------------------------------------------------
    def clip_grad_norm(self, max_norm, sum_sq_across_ranks=None):
        """Global L2 norm of the gradient shards (unscaled under amp); clips if above max_norm.
        Returns the norm before clipping."""
        if self.amp is None:
            return clip_grad_norm([u.grad_shard for u in self.engine.units], max_norm,
                                  sum_sq_across_ranks)
        grads = [u.grad_shard for u in self.engine.units]
        if self.verdict_on_device_ok():            # as MasterWeightOptimizer's
            self._verdict, norm = self.amp.verdict_on_device(
                grads, max_norm, sum_sq_across_ranks, self.steps, self.param_groups[0])
            return norm
        self.settle()
        sum_sq = self.amp.unscaled_sum_sq(grads)
        norm, self._found_inf, self._factor = self.amp.scaler.unscale_and_clip(
            sum_sq, max_norm, sum_sq_across_ranks)
        return norm

    def verdict_on_device_ok(self):
        """--amp's verdict on the device (no host read a step; minidist/train/
        master_weights.py explains it): the multi-tensor path, and this the one optimizer
        of its MixedPrecision (EP's dense and experts optimizers share one: host verdict)."""
        return self.amp is not None and self.amp.optimizers == [self] and self.multi_ok()

    def settle(self):
        """The device verdicts since the last settle read back (one host read, none if
        there were none): the scaler's fields and the step count. Checkpoints call it."""
        step = self.amp.scaler.settle() if self.amp is not None else None
        if step is not None:
            self.steps = step

    def step(self):
        """Update this rank's shards (the engine's after_step, run next by the strategy, makes
        the full parameters from them). Returns False when mixed precision skipped the update
        (inf/nan gradients), None when that was decided on the device."""
        if self.amp is not None:
            if self._factor is None and self._verdict is None:
                self.clip_grad_norm(None)
            if self._verdict is not None:        # every block skips an overflowing step
                verdict, self._verdict = self._verdict, None
                for plan in self.multi_launches(verdict=verdict):
                    multi_tensor.run(plan)
                return None
            if not self.amp.scaler.update(self._found_inf):
                self._factor = None
                return False
        self.update_shards(self._factor)
        self._factor = None
        return True

    def update_shards(self, factor=None):
        """The update once the verdict is in: AdamW on every shard, under amp with the 16-bit
        gradient x `factor` (1/S, times the clip factor). step() calls it; so does an
        optimizer that took the verdict for these shards and others together
        (minidist/ep/optim.py: the experts' shards over their replicas)."""
        self.steps += 1
        if self.multi_ok():
            for plan in self.multi_launches(factor):
                multi_tensor.run(plan)
            return
        for u in self.engine.units:
            self._update(u, factor)

    def _update(self, u, factor):
        s, group = self.state[u.flat.name], self.param_groups[0]
        lr, (beta1, beta2) = group["lr"], group["betas"]
        target = s["master"] if self.amp is not None else u.param_shard
        grad = self.amp.unscaled(u.grad_shard, factor) if self.amp else u.grad_shard
        if self.weight_decay:
            for a, b in u.flat.decay_ranges():     # decoupled decay, decayed params only
                target[a:b] *= 1.0 - lr * self.weight_decay
        adamw_update(target, grad, s["exp_avg"], s["exp_avg_sq"], self.steps, lr, beta1,
                     beta2, group["eps"], 0.0, scratch=self._adam_scratch(target))
        if self.amp is not None:
            u.param_shard[...] = target            # float32 master -> 16-bit shard

    # ---- on cupy with MINIDIST_CUDA_NEW_KERNELS=1: every shard in two launches -------------
    def multi_ok(self):
        """True when update_shards takes the multi-tensor kernels (minidist/optim/
        multi_tensor.py): cupy shards, the switch on, float32 or float64 (under amp 16-bit
        shards and float32 masters). Never on numpy: the CPU path stays the per-unit one."""
        units = self.engine.units
        params, grads = [u.param_shard for u in units], [u.grad_shard for u in units]
        if self.amp is None:
            return multi_tensor.adamw_ok(params, grads)
        return multi_tensor.amp_adamw_ok(params, grads,
                                         [self.state[u.flat.name]["master"] for u in units])

    def multi_launches(self, factor=None, chunk=multi_tensor.CHUNK, verdict=None):
        """The plans ((Launch, tables), minidist/optim/multi_tensor.py) of update_shards'
        multi-tensor path, for the step count self.steps (update_shards advanced it): one
        launch over the decayed runs of every unit's shard with weight decay, one over the
        rest (undecayed parameters and padding) without; each run a slice of the shard, of m,
        of v (and of the master). The kernel decays p first, as _update does: bitwise the
        same. Under amp multi_amp_adamw, `factor` the verdict's, or multi_amp_adamw_dev
        reading `verdict` (the device verdict's array). tests/test_zero_multi_cpu.py runs them
        on numpy."""
        group, plans = self.param_groups[0], []
        beta1, beta2 = group["betas"]
        xp = xp_of(self.engine.units[0].param_shard)
        for wd, runs in zip((self.weight_decay, 0.0), self._runs()):
            if not runs:
                continue
            roles = [[arrays[k][lo:hi] for arrays, lo, hi in runs]
                     for k in range(len(runs[0][0]))]
            hyper = (self.steps, group["lr"], beta1, beta2, group["eps"], wd)
            if self.amp is None:
                plans.append(multi_tensor.multi_adamw_launch(xp, *roles, *hyper, chunk=chunk))
            elif verdict is not None:          # the factor and step count on the device
                plans.append(multi_tensor.multi_amp_adamw_dev_launch(
                    xp, *roles, 1.0 - group["lr"] * wd, verdict, chunk=chunk))
            else:
                plans.append(multi_tensor.multi_amp_adamw_launch(xp, *roles, factor, *hyper,
                                                                 chunk=chunk))
        return plans

    def _runs(self):
        """(decayed, plain): lists of (arrays, lo, hi), a run [lo, hi) of one unit's shard and
        its arrays (parameter shard, gradient shard, (master,) m, v). Without weight decay
        every shard is one plain run."""
        decayed, plain = [], []
        for u in self.engine.units:
            s = self.state[u.flat.name]
            arrays = [u.param_shard, u.grad_shard] + ([s["master"]] if self.amp else [])
            arrays += [s["exp_avg"], s["exp_avg_sq"]]
            d, p = u.flat.update_ranges()
            if not self.weight_decay:
                d, p = [], [(0, u.flat.shard_size)]
            decayed += [(arrays, lo, hi) for lo, hi in d]
            plain += [(arrays, lo, hi) for lo, hi in p]
        return decayed, plain

    def _adam_scratch(self, like, role="adam", size=None):
        """A reusable buffer of `like`'s dtype (and size, or `size`), one per role: a step
        allocates nothing after the first."""
        size = like.size if size is None else size
        key = (role, size, like.dtype.str, type(like).__module__)
        if key not in self._scratch:
            self._scratch[key] = xp_of(like).empty(size, like.dtype)
        return self._scratch[key]

    # ---- memory ledger and checkpoints -----------------------------------------------------
    def state_arrays(self):
        """m, v (and the float32 master shards under amp): the optimizer state."""
        for s in self.state.values():
            yield from s.values()

    def ledger_arrays(self):
        """Parameter and gradient arrays held for the model (shards, flat buffers)."""
        return self.engine.held()

    def shard_arrays(self):
        """"<unit>/<key>" -> this rank's shard, key param, exp_avg, exp_avg_sq (master)."""
        out = {}
        for u in self.engine.units:
            name = u.flat.name
            out[f"{name}/param"] = u.param_shard
            out.update((f"{name}/{k}", v) for k, v in self.state[name].items())
        return out


class ShardedMuon(ShardedAdamW):
    """Muon (minidist/optim/muon.py) over a ZeRO engine's shards: each unit's matrices by
    Muon, the rest by AdamW, as the per-parameter Muon does, to rounding. A step, per unit:

        AdamW pieces     adamw_update on this rank's slice of them (ShardedAdamW's math)
        Muon pieces      M <- mu M + G and U <- G + mu M on this rank's slice
        all-gather       U's shards over the shard group (zeros where AdamW's elements are):
                         the unit's whole flat U on every rank, (N-1)/N of it received
        its matrices     each matrix of the unit is one rank's (`owners`: muon.balance, the
                         costliest first to the least busy rank): its owner runs NS on the
                         whole U (under TP with its tp peers, which own it too: `whole`) and
                         writes lr x scale x O into a flat buffer of the unit, zeros elsewhere
        reduce-scatter   of that buffer: each rank's shard of it, every element one owner's
                         value plus zeros (exact), subtracted from this rank's matrix pieces
    So NS runs once per matrix, not on every rank its shard cuts, for the bytes of one more
    collective: all-gather + reduce-scatter = an all-reduce of the unit, (N-1)/N x 2 of it.

    `tp`, `splits`: as Muon's. The groups are Muon's three; the state ShardedAdamW's, exp_avg
    M for a matrix's elements, exp_avg_sq zero there. The multi-tensor path is AdamW's only:
    Muon's steps run per unit, and --amp's verdict on the host."""
    one_process = "Muon"

    def __init__(self, engine, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 amp=None, momentum=0.95, ns_steps=5, tp=None, splits=None):
        super().__init__(engine, lr, betas, eps, weight_decay, amp)
        self.momentum, self.ns_steps = momentum, ns_steps
        self.tp, self.splits = tp, dict(splits or {})
        hyper = {"lr": lr, "betas": tuple(betas), "eps": eps}
        self.param_groups = [{**hyper, "weight_decay": weight_decay, "muon": True},
                             {**hyper, "weight_decay": weight_decay, "muon": False},
                             {**hyper, "weight_decay": 0.0, "muon": False}]
        self.muon = {u.flat.name: [takes_muon(n, s, d) for n, s, d in
                                   zip(u.flat.names, u.flat.shapes, u.flat.decay)]
                     for u in engine.units}
        self.owners = {u.flat.name: self._owners(u.flat, k) for k, u in enumerate(engine.units)}

    def _owners(self, f, k):
        """{index: the shard-group rank that runs its NS} for unit f's matrices (the k-th
        unit: the ranks' order turned by k), by NS FLOPs of the whole matrix."""
        mats = [i for i, m in enumerate(self.muon[f.name]) if m]
        costs = [ns_flops(whole_shape(f.shapes[i], self.splits.get(f.names[i])),
                          self.ns_steps) for i in mats]
        size = self.engine.group.size
        return dict(zip(mats, balance(costs, size, k % size)))

    def multi_ok(self):
        return False

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
        group = self.param_groups[0]
        lr, (beta1, beta2) = group["lr"], group["betas"]
        target = s["master"] if self.amp is not None else u.param_shard
        grad = self.amp.unscaled(u.grad_shard, factor) if self.amp else u.grad_shard
        if self.weight_decay:
            for a, b in f.decay_ranges():          # decoupled decay, both optimizers alike
                target[a:b] *= 1.0 - lr * self.weight_decay
        look, tmp = self._adam_scratch(target, "look"), self._adam_scratch(target)
        look[...] = 0
        for i, a, b in self._pieces(f):
            if muon[i]:
                nesterov_momentum(s["exp_avg"][a:b], grad[a:b], self.momentum, look[a:b])
            else:
                adamw_update(target[a:b], grad[a:b], s["exp_avg"][a:b], s["exp_avg_sq"][a:b],
                             self.steps, lr, beta1, beta2, group["eps"], 0.0, scratch=tmp[a:b])
        if any(muon):
            group = self.engine.group
            full = self._adam_scratch(look, "gathered", f.padded)
            group.all_gather(full, look)
            step = self._adam_scratch(look, "step", f.padded)
            step[...] = 0
            for i, owner in self.owners[f.name].items():
                if owner != group.rank:
                    continue
                off = f.offsets[i]
                o = orthogonalised(full[off:off + f.sizes[i]].reshape(f.shapes[i]),
                                   self.splits.get(f.names[i]), self.tp, self.ns_steps)
                o *= lr
                step[off:off + f.sizes[i]] = o.reshape(-1)
            group.reduce_scatter(look, step)       # this rank's [lo, hi) of every update
            for i, a, b in self._pieces(f):
                if muon[i]:
                    target[a:b] -= look[a:b]
        if self.amp is not None:
            u.param_shard[...] = target            # float32 master -> 16-bit shard

    @staticmethod
    def _pieces(f):
        """(index, a, b): each parameter's piece of this rank's shard, [a, b) in shard
        coordinates."""
        for i, start, stop in f.pieces():
            yield i, f.offsets[i] + start - f.lo, f.offsets[i] + stop - f.lo
