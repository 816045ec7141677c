"""AdamW (Loshchilov & Hutter): Adam with weight decay applied to the weights, not the gradient.

For each parameter p with gradient g, at step t (1-based):
    p <- p * (1 - lr * wd)                                   decoupled decay
    m <- b1 m + (1 - b1) g                                   first moment
    v <- b2 v + (1 - b2) g^2                                 second moment
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
the same formula as torch.optim.AdamW. `adamw_update` does it in place on raw arrays with one
scratch buffer, so ZeRO can run it on flat shards; `AdamW` keeps m, v per parameter
(FlatAdamW, flat_adamw.py, one flat buffer per group). By default, biases, LayerNorm and
embedding weights get no decay (Parameter.decay).

On CuPy (contiguous float32 or float64, MINIDIST_CUDA_KERNELS not "0") the same update runs as
one fused CUDA kernel, `adamw_step` in autograd/cuda_source.py: one launch and one pass over
p, g, m, v instead of ~11. The xp code of adamw_update is its generic twin;
`cuda_kernels.adamw_launch` plans the launch, and tests/test_cuda_kernels_cpu.py runs that
very kernel on the CPU against this code. With MINIDIST_CUDA_NEW_KERNELS=1 (proven on the CPU
only) AdamW.step does a whole parameter group in ONE launch, `multi_adamw`
(optim/multi_tensor.py; tests/test_multi_tensor_cpu.py), the same arithmetic per element.
Tests: tests/test_optim.py, tests/test_flat_adamw.py.
"""
import math

from minidist.autograd import cuda_kernels
from minidist.backend import xp_of
from minidist.optim import multi_tensor
from minidist.optim.optimizer import Optimizer


def adamw_update(p, g, m, v, step, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
                 scratch=None):
    """One AdamW step on arrays of one shape, in place on p, m, v. `step` is 1-based.
    `scratch` (same shape and dtype as p) avoids allocating a temporary."""
    if fused_adamw_ok(p, g, m, v):
        cuda_kernels.launch(cuda_kernels.adamw_launch(p, g, m, v, step, lr, beta1, beta2, eps,
                                                      weight_decay))
        return
    xp = xp_of(p)
    tmp = scratch if scratch is not None else xp.empty_like(p)
    if weight_decay:
        p *= 1.0 - lr * weight_decay
    m *= beta1                                       # m = b1 m + (1 - b1) g
    xp.multiply(g, 1.0 - beta1, out=tmp)
    m += tmp
    v *= beta2                                       # v = b2 v + (1 - b2) g^2
    xp.multiply(g, g, out=tmp)
    tmp *= 1.0 - beta2
    v += tmp
    xp.sqrt(v, out=tmp)                              # denominator sqrt(v_hat) + eps
    tmp *= 1.0 / math.sqrt(1.0 - beta2 ** step)
    tmp += eps
    xp.divide(m, tmp, out=tmp)                       # m / denom, then the bias-corrected lr
    tmp *= lr / (1.0 - beta1 ** step)
    p -= tmp


def fused_adamw_ok(p, g, m, v):
    """True when adamw_update should run as the fused kernel: contiguous cupy arrays, all
    float32 or all float64, kernels not switched off (MINIDIST_CUDA_KERNELS=0)."""
    return (cuda_kernels.use(p, g, m, v) and p.dtype.name in ("float32", "float64")
            and all(a.flags.c_contiguous for a in (p, g, m, v)))


class AdamW(Optimizer):
    defaults = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    split_decay = True              # biases and norms' gains undecayed (wants_decay)

    def __init__(self, params, lr=None, betas=None, eps=None, weight_decay=None):
        """An argument left out takes `defaults`' value, a subclass's own defaults too
        (first-use walk 39: a subclass's class defaults were overridden by these)."""
        given = {"lr": lr, "betas": None if betas is None else tuple(betas), "eps": eps,
                 "weight_decay": weight_decay}
        super().__init__(params, **{k: v for k, v in given.items() if v is not None})

    def step_group(self, group):
        """The per-parameter update (Optimizer.step_group), or on cupy with
        MINIDIST_CUDA_NEW_KERNELS=1 one multi-tensor launch over the whole group."""
        if not self.multi_step_group(group):
            super().step_group(group)

    def multi_step_group(self, group):
        """AdamW over the group in ONE launch (optim/multi_tensor.py) when every parameter
        has a gradient, all share one step count and the arrays qualify
        (multi_tensor.adamw_ok); False, having changed nothing, otherwise."""
        params = [p.data for p in group["params"]]
        grads = [p.grad for p in group["params"]]
        if any(g is None for g in grads) or not multi_tensor.adamw_ok(params, grads):
            return False
        states = multi_tensor.advance_states(self.state, group["names"], params)
        if states is None:
            return False
        multi_tensor.run(multi_tensor.group_adamw_launch(xp_of(params[0]), params, grads,
                                                         states, group))
        return True

    def update(self, p, grad, state, group, name=None):
        update_with_state(p, grad, state, group, self.scratch(p))


def update_with_state(p, grad, state, group, scratch=None):
    """adamw_update of one parameter from its optimizer `state` ({"step", "exp_avg",
    "exp_avg_sq"}: m and v made on the first step) and its `group`'s hyperparameters. AdamW
    and Muon (for the parameters it leaves to AdamW) both call it."""
    if "exp_avg" not in state:
        xp = xp_of(p)
        state["exp_avg"], state["exp_avg_sq"] = xp.zeros_like(p), xp.zeros_like(p)
    beta1, beta2 = group["betas"]
    adamw_update(p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], group["lr"],
                 beta1, beta2, group["eps"], group["weight_decay"], scratch=scratch)
