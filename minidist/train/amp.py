"""Mixed precision (Micikevicius et al., 2018): 16-bit compute, float32 master weights,
dynamic loss scaling.

    model parameters   float16, or bfloat16 (the default on CuPy + ml_dtypes; on numpy it
                       is asked for by name: MixedPrecision(dtype="bfloat16"))
    forward, backward  in 16 bits; layer norm, softmax, GELU and cross-entropy do their sums,
                       exps and logs in float32 inside (minidist/autograd/fused.py), and the
                       loss comes out float32
    backward           starts from loss x S (the loss scale), so small gradients do not flush
                       to zero in float16; the gradients land in float16
    step               one parameter at a time, through one float32 scratch buffer:
                       g = float32(g16) / S; the global norm of g (across ranks) is not
                       finite -> an overflow somewhere: skip the step, S /= 2; else clip,
                       AdamW on the float32 master copy, master -> 16-bit model weights.
                       S *= 2 after `growth_interval` good steps in a row.
                       bfloat16 has float32's exponent range: S = 1, fixed (no scaling),
                       and the overflow check stays (a real inf still skips the step).

Memory per parameter: 2 (16-bit weights) + 2 (16-bit gradients) + 12 (float32 master, Adam's
m and v, kept by the optimizer) = 16 bytes, the ZeRO paper's accounting, which the memory
ledger measures and minidist/train/planner.py predicts. No float32 gradient is ever stored
whole: the unscaled gradient lives one parameter at a time in the scratch buffer.

Overflow across ranks: the global norm is a sum over ranks of each rank's sum of squares
(ZeRO, tensor and pipeline ranks hold different gradients and must all-reduce it for
clipping anyway; DDP's ranks hold the same averaged gradients). An inf or nan on any rank
makes that sum inf or nan on every rank, so every rank skips the same steps.

On the CPU, numpy has no float16 BLAS, so backend.matmul multiplies float16 in float32 and
rounds the product to float16 (float16 storage, emulated compute; elementwise float16 ops
are slow in numpy too): CPU mixed precision shows the numbers and the memory, not speed.
Tests: tests/test_amp.py.
"""
import os

import numpy as np

from minidist import backend
from minidist.nn import Parameter
from minidist.optim import AdamW, multi_tensor
from minidist.optim.clip import local_sum_sq
from minidist.train.loss_scale import SCALER_KEY, LossScaler

def bfloat16():
    """ml_dtypes' bfloat16 (the type numpy and CuPy both use), or a clear error."""
    try:
        import ml_dtypes
    except ImportError:
        raise RuntimeError("bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
    return np.dtype(ml_dtypes.bfloat16)


def half_dtype(xp, name=None):
    """The 16-bit compute dtype: `name` ("float16" or "bfloat16") if given; else bfloat16
    where the array library computes with it (CuPy given ml_dtypes' bfloat16), float16
    otherwise (numpy: its bfloat16 through ml_dtypes works, but is emulated and slow, so
    the CPU default stays float16; tests ask for bfloat16 by name)."""
    if name is not None:
        if name not in ("float16", "bfloat16"):
            raise ValueError(f"mixed precision dtype must be float16 or bfloat16, not {name!r}")
        return bfloat16() if name == "bfloat16" else np.dtype(np.float16)
    if xp is np:
        return np.dtype(np.float16)
    try:
        a = xp.ones((4, 4), dtype=bfloat16())
        float(((a @ a) * a).astype(xp.float32).sum())     # matmul, elementwise, cast
        return bfloat16()
    except Exception:
        return np.dtype(np.float16)


class MixedPrecision:
    """The --amp policy: casts a float32 model to 16 bits (keeping its float32 arrays as the
    master weights), scales losses, and builds the master-weight optimizer."""

    def __init__(self, scaler=None, dtype=None):
        self.scaler = scaler or LossScaler()
        # None: chosen by cast_model, once the device is known; MINIDIST_AMP_DTYPE=bfloat16
        # asks for bfloat16 on numpy too (the CPU tests of the bfloat16 path through the
        # strategies: tests/test_bfloat16.py)
        self.dtype_name = dtype or os.environ.get("MINIDIST_AMP_DTYPE") or None
        self.dtype = None
        self.masters = {}            # parameter name -> float32 array
        self.optimizers = []         # the MasterWeightOptimizers built here: settle()
        self._scratch = {}           # (shape, array module) -> float32 buffer: unscaled()

    def cast_model(self, model):
        """Parameters to 16 bits in place; returns the model."""
        params = list(model.named_parameters())
        self.dtype = half_dtype(backend.xp_of(params[0][1].data), self.dtype_name)
        if self.dtype.name == "bfloat16":    # float32's exponent range: no scaling needed
            self.scaler.scale, self.scaler.growth_interval = 1.0, None
        for name, p in params:
            if p.dtype != np.float32:
                raise ValueError(f"mixed precision starts from a float32 model; {name} is "
                                 f"{p.dtype} (use --dtype float32 with --amp)")
            self.masters[name] = p.data
            p.data = p.data.astype(self.dtype)
        return model

    def scale_loss(self, loss, factor=1.0):
        """The tensor backward starts from: loss x factor x the loss scale."""
        self.scaler.used = True
        return loss * self.scaler.multiplier(factor)

    def scaled_upstream(self):
        """This rank's backward starts from a gradient that another rank's scaled loss made
        (a pipeline stage before the last): it is scaled too."""
        self.scaler.used = True

    def backward(self, loss, factor=1.0):
        """Backpropagate the scaled loss. An overflow to inf is expected now and then (the
        step is skipped), so numpy is told not to warn about it."""
        with np.errstate(over="ignore", invalid="ignore"):
            self.scale_loss(loss, factor).backward()

    def optimizer(self, named_params, make_inner):
        """A MasterWeightOptimizer; `make_inner(named float32 params)` builds e.g. AdamW."""
        self.optimizers.append(MasterWeightOptimizer(named_params, self, make_inner))
        return self.optimizers[-1]

    def settle(self):
        """Read back the verdicts the optimizers built here took on the device since the
        last settle (one host read, none when there were none): the loop calls it at the
        steps that read their losses anyway. Raises FloatingPointError after too many
        skipped steps in a row, as a host verdict would at that step."""
        for opt in self.optimizers:
            opt.settle()

    # ---- unscaling: every optimizer's (this file's, ZeRO's) and the strategies' norms -----
    def unscaled(self, grad, factor):
        """float32(grad) * factor (1/S, or the step's 1/S x clip), in a scratch buffer reused
        for every gradient of that shape: no float32 gradient is ever stored whole."""
        key = (grad.shape, type(grad).__module__)
        if key not in self._scratch:
            self._scratch[key] = backend.xp_of(grad).empty(grad.shape, np.float32)
        buf = self._scratch[key]
        buf[...] = grad
        buf *= factor
        return buf

    def unscaled_sum_sq(self, grads):
        """This rank's sum of squares of `grads` as the master gradients will be: float32,
        divided by the loss scale."""
        inv = 1.0 / self.scaler.scale
        if multi_tensor.use_multi(grads):          # cupy, MINIDIST_CUDA_NEW_KERNELS=1
            return multi_tensor.sum_sq(grads, inv)     # 2 launches, not ~4 per gradient
        return sum(local_sum_sq([self.unscaled(g, inv)]) for g in grads)

    def describe(self):
        s = self.scaler
        scaling = (f"dynamic loss scale from {s.scale:g} (x{s.backoff_factor:g} on overflow, "
                   f"x{s.growth_factor:g} after {s.growth_interval} good steps)"
                   if s.growth_interval is not None else f"fixed loss scale {s.scale:g}")
        cpu = (f"; on the CPU numpy has no 16-bit BLAS, so matmuls multiply in float32 and "
               f"round to {self.dtype} ({self.dtype} storage, emulated compute)"
               if backend.device() == "cpu" else "")
        return (f"mixed precision: {self.dtype} compute, float32 master weights and Adam "
                f"state (2+2+12 bytes per parameter), {scaling}; steps with inf/nan "
                f"gradients are skipped{cpu}")


class MasterWeightOptimizer:
    """An optimizer (e.g. AdamW) over float32 master copies of 16-bit model parameters.

    Used like the inner one: zero_grad, set_lr, clip_grad_norm, step, state_dict. step()
    returns False when it skipped the update because some gradient was inf or nan, None
    when that was decided on the device (below).

    The verdict on the device: on cupy with MINIDIST_CUDA_NEW_KERNELS=1, when every group is
    an AdamW group multi_amp_adamw can take whole, the step reads nothing back. Three
    launches and one per group: the sum of squares of the scaled gradients (2), reduced
    over the ranks on the device, then amp_verdict (one thread: the scaler's rules and
    AdamW's step count, in the scaler's device_state), then multi_amp_adamw_dev per group,
    which every block skips on an overflow. settle() reads the state back."""

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

    param_groups = property(lambda self: self.inner.param_groups)

    def set_lr(self, lr):
        self.inner.set_lr(lr)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def clip_grad_norm(self, max_norm, reduce_sum_sq=None):
        """Global L2 norm of the unscaled gradients (inf or nan: an overflow on some rank);
        sets step()'s factor 1/S, times max_norm / norm if that is smaller. Returns it (a
        float; a 0-d device array when the verdict is taken on the device)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        groups = self._device_groups()
        if groups is not None:
            return self._verdict_on_device(groups, grads, max_norm, reduce_sum_sq)
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
        on the device: an AdamW, every parameter with a gradient, each group fit for
        multi_amp_adamw, one step count for all (already so on the device). Else None."""
        if not isinstance(self.inner, AdamW):
            return None
        out = []
        for group in self.inner.param_groups:
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

    def _verdict_on_device(self, groups, grads, max_norm, reduce_sum_sq):
        """The sum of squares, its reduction and amp_verdict, launched; the norm (a 0-d
        device array) returned. No host read."""
        self.scaler.check_used(bool(grads))
        xp, half = backend.xp_of(grads[0]), grads[0].dtype
        state = self.scaler.to_device(xp, self._host_steps().pop())
        sum_sq = multi_tensor.sum_sq(grads, 1.0)     # scaled: amp_verdict divides by S^2
        if reduce_sum_sq is not None:
            sum_sq = reduce_sum_sq(sum_sq)
        sum_sq = xp.ascontiguousarray(xp.asarray(sum_sq, dtype=np.float64).reshape(1))
        self._verdict = xp.empty(multi_tensor.VERDICT_SIZE, np.float32)
        group = groups[0][0]
        multi_tensor.run((multi_tensor.amp_verdict_launch(
            sum_sq, state, self._verdict, half, max_norm, self.scaler, group["lr"],
            *group["betas"], group["eps"]), None))
        return state[multi_tensor.STATE_FIELDS.index("norm")].copy()

    def _step_on_device(self):
        """multi_amp_adamw_dev over each group, reading this step's verdict on the device
        (every block returns at once on an overflow). Returns None: skipped or not is
        known on the device only."""
        verdict, self._verdict = self._verdict, None
        groups = self._device_groups()
        if groups is None:
            raise RuntimeError("mixed precision: the gradients changed between "
                               "clip_grad_norm and step")
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
        """Per parameter: unscale into the scratch buffer, the inner update, copy back."""
        for name, master in zip(group["names"], group["params"]):
            p = self._model_param[name]
            if p.grad is None:
                continue
            state = self.inner.state.setdefault(name, {"step": 0})
            state["step"] += 1
            self.inner.update(master.data, self.amp.unscaled(p.grad, factor), state, group)
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
