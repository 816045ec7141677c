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
                       The step is MasterWeightOptimizer's (minidist/train/
                       master_weights.py); on cupy with MINIDIST_CUDA_NEW_KERNELS=1 its
                       verdict is taken on the device, and the step reads nothing back.

Memory per parameter: 2 (16-bit weights) + 2 (16-bit gradients) + 12 (float32 master, Adam's
m and v, kept by the optimizer) = 16 bytes, the ZeRO paper's accounting, which the memory
ledger measures and minidist/train/planner.py predicts. No float32 gradient is ever stored
whole: the unscaled gradient lives one parameter at a time in the scratch buffer.

float32 gradients (`grad_dtype="float32"`, train_gpt.py --grad-dtype float32; Megatron-LM's
main_grad, --accumulate-allreduce-grads-in-fp32): cast_model sets every parameter's
grad_dtype (minidist/autograd/tensor.py), so its .grad, and every strategy's gradient buffer
made from it (DDP's buckets, ZeRO's flat units and shards), is float32. Each micro-batch's
gradient still comes out of backward in 16 bits (rounded once, as the GEMM writes it; an op
that returns a float32 gradient, the xp layer norm's for its weight and bias, is no longer
rounded) and is added into the float32 .grad; the sums over micro-batches and the
reductions over ranks run in float32, and the optimizer unscales the float32 gradient.
2 + 4 + 12 = 18 bytes a parameter (the 4 sharded under ZeRO-2/3).

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
from minidist.nn.module import placeholder
from minidist.optim import multi_tensor
from minidist.optim.clip import local_sum_sq
from minidist.train.loss_scale import LossScaler
from minidist.train.master_weights import MasterWeightOptimizer

def bfloat16():
    """ml_dtypes' bfloat16 (the type numpy and CuPy both use), or a clear error."""
    try:
        import ml_dtypes
    except ImportError:
        raise RuntimeError("bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
    return np.dtype(ml_dtypes.bfloat16)


def half_dtype(xp, name=None):
    """The 16-bit compute dtype for the array library `xp` (pick_half_dtype), probing the
    device (bfloat16_problem) only where the answer depends on it: a GPU, no float16 asked."""
    on_numpy = xp is np
    probe = not on_numpy and name in (None, "bfloat16")
    return pick_half_dtype(name, on_numpy, bfloat16_problem(xp) if probe else None)


def pick_half_dtype(name, on_numpy, problem):
    """The 16-bit compute dtype: `name` ("float16" or "bfloat16") if given; else bfloat16
    where the array library computes with it (a GPU whose CuPy has no `problem`: see
    bfloat16_problem), float16 otherwise (numpy, `on_numpy`: its bfloat16 through ml_dtypes
    works, but is emulated and slow, so the CPU default stays float16; tests ask for
    bfloat16 by name). CuPy computes with bfloat16 from CuPy 14 on, given ml_dtypes and
    NumPy >= 2.1.2 (cupy/_core/_scalar.pyx, v14.0.1); asked for by name where it cannot,
    this says so instead of failing later."""
    if name is not None and name not in ("float16", "bfloat16"):
        raise ValueError(f"mixed precision dtype must be float16 or bfloat16, not {name!r}")
    if name == "float16" or (name is None and on_numpy):
        return np.dtype(np.float16)
    if on_numpy or problem is None:
        return bfloat16()
    if name == "bfloat16":
        raise RuntimeError(f"bfloat16 asked for, but {problem}, or ask for float16")
    return np.dtype(np.float16)


def bfloat16_problem(xp):
    """Why the GPU array library `xp` cannot compute in bfloat16 (bfloat16_reason), or None
    where it can: a 4 x 4 matmul, a product and a cast tried once (one device read, at
    setup)."""
    try:
        a = xp.ones((4, 4), dtype=bfloat16())
        float(((a @ a) * a).astype(xp.float32).sum())     # matmul, elementwise, cast
        return None
    except Exception as e:
        return bfloat16_reason(e)


def bfloat16_reason(error):
    """The phrase for the `error` a CuPy raised computing in bfloat16."""
    return (f"this CuPy cannot compute with it ({type(error).__name__}: {error}); it needs "
            f"CuPy >= 14, ml_dtypes and NumPy >= 2.1.2")


def device_note(device, dtype_name, problem):
    """The end of the --amp log line for `device` ("cpu" or "cuda") computing in
    `dtype_name`: on the CPU, that 16-bit matmuls are emulated; on a GPU in float16, why not
    bfloat16 where it was out of reach (`problem`: bfloat16_problem's phrase, CuPy 13), so
    the log does not say only "float16 compute"; else nothing."""
    if device == "cpu":
        return (f"; on the CPU numpy has no 16-bit BLAS, so matmuls multiply in float32 "
                f"and round to {dtype_name} ({dtype_name} storage, emulated compute)")
    return f"; not bfloat16: {problem}" if problem and dtype_name == "float16" else ""


class MixedPrecision:
    """The --amp policy: casts a float32 model to 16 bits (keeping its float32 arrays as the
    master weights), scales losses, and builds the master-weight optimizer."""

    def __init__(self, scaler=None, dtype=None, grad_dtype=None, masters=True):
        self.scaler = scaler or LossScaler()
        # masters False (--eval-only): no step will read a float32 master, so cast_model
        # keeps none (4 bytes a parameter held for nothing; nor ZeRO-3's: zero/stage3.py)
        self.keep_masters = masters
        # None: chosen by cast_model, once the device is known; MINIDIST_AMP_DTYPE=bfloat16
        # asks for bfloat16 on numpy too (the CPU tests of the bfloat16 path through the
        # strategies: tests/test_bfloat16.py)
        self.dtype_name = dtype or os.environ.get("MINIDIST_AMP_DTYPE") or None
        self.dtype = None
        if grad_dtype not in (None, "float32"):
            raise ValueError(f"--grad-dtype {grad_dtype}: give float32, or leave it out for "
                             "the 16-bit type")
        # float32: the gradients accumulate and are reduced in float32 (module docstring)
        self.grad_dtype = None if grad_dtype is None else np.dtype(np.float32)
        self.masters = {}            # parameter name -> float32 array
        self.optimizers = []         # the MasterWeightOptimizers built here: settle()
        self._scratch = {}           # (shape, array module) -> float32 buffer: unscaled()

    def cast_model(self, model, placeholders=False):
        """Parameters to 16 bits in place, their float32 arrays kept as the masters; returns
        the model. `placeholders`: a model built with materialize=False (nn/gpt.py), whose
        parameters hold no numbers yet: each becomes a 16-bit placeholder and no master is
        kept (ZeRO-3 makes each unit's master shard as it draws the unit: zero/stage3.py)."""
        params = list(model.named_parameters())
        xp = backend.xp_of(params[0][1].data)
        self.dtype = half_dtype(xp, self.dtype_name)
        if self.dtype.name == "bfloat16":    # float32's exponent range: no scaling needed
            self.scaler.scale, self.scaler.growth_interval = 1.0, None
        for name, p in params:
            if p.dtype != np.float32:
                raise ValueError(f"mixed precision starts from a float32 model; {name} is "
                                 f"{p.dtype} (use --dtype float32 with --amp)")
            if placeholders:
                p.data = placeholder(p.shape, xp.empty(0, self.dtype))
            else:
                if self.keep_masters:
                    self.masters[name] = p.data
                p.data = p.data.astype(self.dtype)
            p.grad_dtype = self.grad_dtype           # None: the 16-bit type
        return model

    def keep_master(self, name, value):
        """`value` (a float32 array) as parameter `name`'s master, as cast_model keeps one;
        for a parameter that got its numbers after a placeholders cast (--ep's experts under
        ZeRO-3's unit build: minidist/ep/strategy.py). Not under --eval-only (no masters)."""
        if self.keep_masters:
            self.masters[name] = value

    def grad_bytes(self):
        """Bytes of a parameter's gradient: 2, or 4 with float32 gradients."""
        return 4 if self.grad_dtype is not None else 2

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
        return self.adopt(MasterWeightOptimizer(named_params, self, make_inner))

    def adopt(self, optimizer):
        """Count `optimizer` among those whose verdicts settle() reads back (those built
        here, and ZeRO's ShardedAdamW over this policy's 16-bit shards). An optimizer takes
        the verdict on the device only as the one optimizer of its policy: two would both
        update the one scaler's state. Returns it."""
        self.optimizers.append(optimizer)
        return optimizer

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
        divided by the loss scale (read on the device while it lives there: the verdict on
        the device, minidist/train/master_weights.py; every strategy's reduce_sum_sq adds and
        subtracts these unscaled sums)."""
        inv = self.scaler.inverse()
        if multi_tensor.use_multi(grads):          # cupy, MINIDIST_CUDA_NEW_KERNELS=1
            if isinstance(inv, float):
                return multi_tensor.sum_sq(grads, inv)     # 2 launches, not ~4 per gradient
            return multi_tensor.sum_sq(grads, 1.0) * (inv * inv)   # S a power of two: exact
        return sum(local_sum_sq([self.unscaled(g, inv)]) for g in grads)

    def verdict_on_device(self, grads, max_norm, reduce_sum_sq, step, group):
        """--amp's verdict on the device for an optimizer whose update kernels read it
        (MasterWeightOptimizer's, ZeRO's ShardedAdamW's): the scaled-loss check, the
        scaler's state on the device (with AdamW's step count `step`), this rank's unscaled
        sum of squares of `grads`, then LossScaler.decide_on_device. Returns (verdict, norm),
        device arrays; no host read."""
        self.scaler.check_used(bool(grads))
        self.scaler.to_device(backend.xp_of(grads[0]), step)
        return self.scaler.decide_on_device(self.unscaled_sum_sq(grads), max_norm,
                                            reduce_sum_sq, self.dtype, group)

    def describe(self, training=True):
        """The log's --amp line; `training` False (--eval-only): the 16-bit weights alone."""
        if not training:
            return (f"mixed precision: {self.dtype} weights and compute (the checkpoint's "
                    "16-bit parameters, which its training's forward used); no float32 "
                    "masters or optimizer state (nothing steps)")
        s = self.scaler
        scaling = (f"dynamic loss scale from {s.scale:g} (x{s.backoff_factor:g} on overflow, "
                   f"x{s.growth_factor:g} after {s.growth_interval} good steps)"
                   if s.growth_interval is not None else f"fixed loss scale {s.scale:g}")
        on_gpu_in_float16 = backend.device() != "cpu" and self.dtype.name == "float16"
        problem = bfloat16_problem(backend.get_xp()) if on_gpu_in_float16 else None
        device = device_note(backend.device(), self.dtype.name, problem)
        g = self.grad_bytes()
        grads = ("; float32 gradients: accumulated over micro-batches and reduced over "
                 "ranks in float32 (--grad-dtype float32)" if g == 4 else "")
        return (f"mixed precision: {self.dtype} compute, float32 master weights and "
                f"optimizer state (2+{g}+12 bytes per parameter with AdamW, 2+{g}+8 for "
                f"Muon's matrices outside ZeRO), {scaling}; steps "
                f"with inf/nan "
                f"gradients are skipped{grads}{device}")
