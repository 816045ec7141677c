"""The --amp optimizer: an optimizer (AdamW) over float32 master copies of the 16-bit model
parameters (Micikevicius et al., 2018), with the loss scaler's verdict on each step.
MixedPrecision (minidist/train/amp.py) builds it; it unscales the 16-bit gradients, skips a
step on an overflow, updates the masters and rounds them back into the model.

    host verdict     the sum of squares of the unscaled gradients read back (one host read a
                     step), LossScaler.unscale_and_clip and update decide in Python; then per
                     parameter (unscale into a scratch buffer, AdamW, copy back), or on cupy
                     with MINIDIST_CUDA_NEW_KERNELS=1 one multi_amp_adamw launch per group
    device verdict   on cupy with MINIDIST_CUDA_NEW_KERNELS=1, where every group fits
                     multi_amp_adamw whole: nothing read back. The sum of squares of the
                     unscaled gradients (2 launches and a multiply by 1/S^2, S read on the
                     device), reduced over the ranks on the device (as every strategy's
                     reduce_sum_sq expects: unscaled sums it adds and subtracts),
                     then amp_verdict (one thread: the scaler's rules and AdamW's step count,
                     in LossScaler.device_state), then multi_amp_adamw_dev per group, which
                     every block skips on an overflow. settle() reads the state back, at the
                     steps the loop reads its losses and before a checkpoint.

Both are proven equal on the CPU, bitwise, step after step through overflows and scale
changes (tests/test_device_verdict_cpu.py); never run on a GPU yet.
Tests: tests/test_amp.py, tests/test_multi_tensor_cpu.py, tests/test_device_verdict_cpu.py.
"""
from minidist import backend
from minidist.nn import Parameter
from minidist.optim import AdamW, multi_tensor
from minidist.train.loss_scale import SCALER_KEY


class MasterWeightOptimizer:
    """An optimizer (e.g. AdamW) over float32 master copies of 16-bit model parameters.

    Used like the inner one: zero_grad, set_lr, clip_grad_norm, step, state_dict. step()
    returns False when it skipped the update because some gradient was inf or nan, None
    when that was decided on the device (the module's docstring)."""

    def __init__(self, named_params, amp, make_inner):
        named = list(named_params)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]                  # the 16-bit model parameters
        self.master = [Parameter(amp.masters[n], decay=bool(getattr(p, "decay", p.ndim >= 2)))
                       for n, p in named]
        self.inner = make_inner(list(zip(self.names, self.master)))
        self.amp, self.scaler = amp, amp.scaler
        self._model_param = {n: p for n, p in named}
        self._factor, self._found_inf = None, False
        self._verdict = None           # the device verdict of this step (float32 array)
        self._groups = None            # and the groups it was taken over (_device_groups)

    param_groups = property(lambda self: self.inner.param_groups)

    def set_lr(self, lr):
        self.inner.set_lr(lr)

    def hyperparameters(self):
        return self.inner.hyperparameters()

    def set_hyperparameters(self, groups):
        self.inner.set_hyperparameters(groups)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def clip_grad_norm(self, max_norm, reduce_sum_sq=None):
        """Global L2 norm of the unscaled gradients (inf or nan: an overflow on some rank);
        sets step()'s factor 1/S, times max_norm / norm if that is smaller. Returns it (a
        float; a 0-d device array when the verdict is taken on the device)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        groups = self._device_groups()
        if groups is not None:                   # no host read: the verdict kept for step()
            self._groups = groups
            self._verdict, norm = self.amp.verdict_on_device(
                grads, max_norm, reduce_sum_sq, self._host_steps().pop(), groups[0][0])
            return norm
        self.settle()
        sum_sq = self.amp.unscaled_sum_sq(grads)
        norm, self._found_inf, self._factor = self.scaler.unscale_and_clip(
            sum_sq, max_norm, reduce_sum_sq, has_grads=bool(grads))
        return norm

    def step(self):
        """Skip (and lower the scale) on an overflow; else update masters and model."""
        if self._factor is None and self._verdict is None:
            self.clip_grad_norm(None)            # not clipped: still unscale and check
        if self._verdict is not None:
            return self._step_on_device()
        found_inf, factor, self._factor = self._found_inf, self._factor, None
        if not self.scaler.update(found_inf):
            return False
        for group in self.inner.param_groups:
            if not self._multi_step_group(group, factor):
                self._step_group(group, factor)
        return True

    # ---- the verdict on the device ---------------------------------------------------------
    def _device_groups(self):
        """[(group, 16-bit weights, gradients, masters)] when the whole step can be decided
        on the device: an AdamW, the one optimizer of its MixedPrecision (whose scaler the
        verdict updates), every parameter with a gradient, each group fit for
        multi_amp_adamw, one lr, betas and eps, one step count for all (already so on the
        device). Else None."""
        groups = self.inner.param_groups
        if (not isinstance(self.inner, AdamW) or self.amp.optimizers != [self]
                or len({(g["lr"], tuple(g["betas"]), g["eps"]) for g in groups}) != 1):
            return None
        out = []
        for group in groups:
            weights = [self._model_param[n].data for n in group["names"]]
            grads = [self._model_param[n].grad for n in group["names"]]
            masters = [m.data for m in group["params"]]
            if (any(g is None for g in grads)
                    or not multi_tensor.amp_adamw_ok(weights, grads, masters)):
                return None
            out.append((group, weights, grads, masters))
        if self.scaler.device_state is None and len(self._host_steps()) != 1:
            return None
        return out

    def _host_steps(self):
        return {self.inner.state.get(n, {"step": 0})["step"] for n in self.names}

    def _step_on_device(self):
        """multi_amp_adamw_dev over each group clip_grad_norm found fit (_device_groups, run
        once a step), reading this step's verdict on the device (every block returns at once
        on an overflow). Returns None: skipped or not is
        known on the device only."""
        verdict, groups = self._verdict, self._groups
        self._verdict = self._groups = None
        for group, weights, grads, masters in groups:
            states = multi_tensor.moment_states(self.inner.state, group["names"], masters)
            multi_tensor.run(multi_tensor.group_amp_adamw_dev_launch(
                backend.xp_of(masters[0]), weights, grads, masters, states, group, verdict))
        return None

    def settle(self):
        """The device verdicts since the last settle, read back (one host read; nothing when
        there were none): the scaler's fields and every parameter's AdamW step count.
        Raises FloatingPointError after too many skipped steps in a row."""
        step = self.scaler.settle()
        if step is not None:
            for name in self.names:
                self.inner.state.setdefault(name, {"step": 0})["step"] = step

    def _step_group(self, group, factor):
        """Per parameter: unscale into the scratch buffer, the inner update; the inner's
        end_group (Muon's tp-split matrices land there); then the masters copied back."""
        stepped = []
        for name, master in zip(group["names"], group["params"]):
            p = self._model_param[name]
            if p.grad is None:
                continue
            state = self.inner.state.setdefault(name, {"step": 0})
            state["step"] += 1
            self.inner.update(master.data, self.amp.unscaled(p.grad, factor), state, group,
                              name)
            stepped.append((p, master))
        self.inner.end_group(group)
        for p, master in stepped:
            p.data[...] = master.data            # float32 master -> 16-bit weights

    def _multi_step_group(self, group, factor):
        """_step_group's work for an AdamW group in ONE launch (multi_amp_adamw, on cupy with
        MINIDIST_CUDA_NEW_KERNELS=1) when every parameter has a gradient and all share one
        step count; False, having changed nothing, otherwise."""
        weights = [self._model_param[n] for n in group["names"]]
        grads = [p.grad for p in weights]
        masters = [m.data for m in group["params"]]
        if (not isinstance(self.inner, AdamW) or any(g is None for g in grads)
                or not multi_tensor.amp_adamw_ok([p.data for p in weights], grads, masters)):
            return False
        states = multi_tensor.advance_states(self.inner.state, group["names"], masters)
        if states is None:
            return False
        multi_tensor.run(multi_tensor.group_amp_adamw_launch(
            backend.xp_of(masters[0]), [p.data for p in weights], grads, masters, states, group,
            factor))
        return True

    # ---- memory ledger and checkpoints ---------------------------------------------------
    def state_arrays(self):
        """Master weights and the inner optimizer's state (Adam's m and v)."""
        yield from (m.data for m in self.master)
        yield from self.inner.state_arrays()

    def state_dict(self):
        """The inner optimizer's, plus each parameter's "master" array and the scaler."""
        self.settle()
        sd = self.inner.state_dict()
        for name, m in zip(self.names, self.master):
            sd["state"].setdefault(name, {})["master"] = backend.to_host(m.data).copy()
        sd["state"][SCALER_KEY] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, sd):
        state = dict(sd["state"])
        self._verdict = None
        self.scaler.load_state_dict(state.pop(SCALER_KEY))
        inner = {}
        for name, s in state.items():
            s = dict(s)
            if "master" in s:
                m = self.master[self.names.index(name)]
                m.data[...] = backend.to_device(s.pop("master"), backend.xp_of(m.data))
                self._model_param[name].data[...] = m.data
            if s:
                inner[name] = s
        self.inner.load_state_dict({"groups": sd["groups"], "state": inner})
