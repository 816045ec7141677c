"""AdamW on ZeRO shards: each rank updates only flat[lo:hi) of every unit, in place
(ShardedOptimizer: what any optimizer over shards is; ShardedAdamW; Muon's: zero/muon.py).

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
from minidist.strategy.readers import STATE_KEYS


class ShardedOptimizer:
    """What an optimizer over a ZeRO engine's shards is, whatever its update: the state per
    unit shard (m and v: exp_avg, exp_avg_sq; the float32 master under amp), the clip and
    --amp's verdict, the step, the arrays the ledger and checkpoints read. Used like AdamW by
    the loop: set_lr, zero_grad, clip_grad_norm, step; state_arrays() and ledger_arrays()
    for the memory ledger. A subclass gives `param_groups` and `_update(unit, factor)`, and
    `state_keys` where its update keeps other arrays than m and v (a Lion: m alone):
    ShardedAdamW here, ShardedMuon (minidist/zero/muon.py)."""
    one_process = None                    # the class one process uses (checkpoints' type)
    # the update's arrays per unit shard, zeros at the start; checkpoints keep those named in
    # minidist/strategy/readers.py STATE_KEYS (the master under --amp is the base's own)
    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, engine, param_groups, weight_decay=0.1, amp=None):
        unkept = [k for k in self.state_keys if k not in STATE_KEYS or k == "master"]
        if unkept:                       # (walk 40: resumed as zeros, without a word)
            raise ValueError(f"{type(self).__name__}.state_keys {unkept}: a sharded "
                             "checkpoint keeps exp_avg and exp_avg_sq (minidist/strategy/"
                             "readers.py STATE_KEYS); name the update's arrays from those")
        self.engine, self.amp, self.weight_decay = engine, amp, weight_decay
        self.param_groups = param_groups
        self.steps = 0                    # updates taken (AdamW's per-parameter "step")
        self.state = {u.flat.name: self._new_state(u) for u in engine.units}
        self._factor, self._found_inf, self._scratch = None, False, {}
        self._verdict = None               # --amp's verdict of this step, on the device
        if amp is not None:
            amp.adopt(self)                # its settle() reads the device verdicts back

    def _new_state(self, u):
        """state_keys' arrays (and the float32 master shard under amp) for unit u's
        [lo, hi)."""
        xp, f = xp_of(u.param_shard), u.flat
        dtype = np.float32 if self.amp is not None else f.dtype
        state = {key: xp.zeros(f.shard_size, dtype) for key in self.state_keys}
        if self.amp is not None and u.master is not None:    # drawn with the unit (stage 3)
            state["master"], u.master = u.master, None
        elif self.amp is not None:      # the full float32 copies go as each unit's shard is
            masters = [self.amp.masters.pop(n) for n in f.names]     # cut: only shards kept
            state["master"] = f.shard_of(masters, np.float32)
        return state

    def set_lr(self, lr):
        for g in self.param_groups:
            g["lr"] = lr

    def hyperparameters(self):
        """Each group's settings (lr, betas, weight decay, ...): a checkpoint's "groups"."""
        return [{k: v for k, v in g.items() if k not in ("params", "names")}
                for g in self.param_groups]

    def set_hyperparameters(self, groups):
        """Each group's settings from `groups` (a checkpoint's, or a resumed run's flags'
        put back after its load), and the decay the matrices' ranges take."""
        for group, settings in zip(self.param_groups, groups):
            group.update(settings)
            group["betas"] = tuple(group["betas"])
        self.weight_decay = max((g["weight_decay"] for g in self.param_groups),
                                default=self.weight_decay)      # no units: no groups

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
        self.engine.check_step_ready(type(self).__name__)
        if self.amp is not None:
            if self._factor is None and self._verdict is None:
                self.clip_grad_norm(None)
            if self._verdict is not None:        # every block skips an overflowing step
                verdict, self._verdict = self._verdict, None
                self.update_on_device(verdict)
                return None
            if not self.amp.scaler.update(self._found_inf):
                self._factor = None
                return False
        self.update_shards(self._factor)
        self._factor = None
        return True

    def update_shards(self, factor=None):
        """The update once the verdict is in, unit by unit, under amp with the 16-bit
        gradient x `factor` (1/S, times the clip factor). step() calls it; so does an
        optimizer that took the verdict for these shards and others together
        (minidist/ep/optim.py: the experts' shards over their replicas)."""
        self.steps += 1
        for u in self.engine.units:
            self._update(u, factor)

    def _update(self, u, factor):
        raise NotImplementedError

    def multi_ok(self):
        """Whether the update runs as multi-tensor launches (ShardedAdamW's, on cupy); only
        then can --amp's verdict stay on the device."""
        return False

    def update_on_device(self, verdict):
        raise NotImplementedError("only a multi-tensor update reads the verdict on the "
                                  "device")

    def _scratch_buffer(self, like, role="adam", size=None):
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


class ShardedAdamW(ShardedOptimizer):
    """AdamW over a ZeRO engine's shards; on cupy with MINIDIST_CUDA_NEW_KERNELS=1 every
    shard in two multi-tensor launches."""
    one_process = "AdamW"

    def __init__(self, engine, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 amp=None):
        hyper = {"lr": lr, "betas": tuple(betas), "eps": eps}
        kinds = {d for u in engine.units for d in u.flat.decay}    # AdamW's default split
        super().__init__(engine, [{**hyper, "weight_decay": wd} for want, wd in
                                  ((True, weight_decay), (False, 0.0)) if want in kinds],
                         weight_decay, amp)

    def update_shards(self, factor=None):
        """AdamW on every shard: the multi-tensor launches where they apply, else unit by
        unit (ShardedOptimizer's)."""
        if not self.multi_ok():
            super().update_shards(factor)
            return
        self.steps += 1
        for plan in self.multi_launches(factor):
            multi_tensor.run(plan)

    def update_on_device(self, verdict):
        """The update reading --amp's verdict on the device (multi_amp_adamw_dev)."""
        for plan in self.multi_launches(verdict=verdict):
            multi_tensor.run(plan)

    def _update(self, u, factor):
        s, group = self.state[u.flat.name], self.param_groups[0]
        lr, (beta1, beta2) = group["lr"], group["betas"]
        target = s["master"] if self.amp is not None else u.param_shard
        grad = self.amp.unscaled(u.grad_shard, factor) if self.amp else u.grad_shard
        if self.weight_decay:
            for a, b in u.flat.decay_ranges():     # decoupled decay, decayed params only
                target[a:b] *= 1.0 - lr * self.weight_decay
        adamw_update(target, grad, s["exp_avg"], s["exp_avg_sq"], self.steps, lr, beta1,
                     beta2, group["eps"], 0.0, scratch=self._scratch_buffer(target))
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
