"""Multi-tensor optimizer launches: AdamW over a whole parameter group, --amp's step, the
clip's sum of squares and its multiply, each ONE kernel launch however many parameters there
are (the per-parameter path costs one launch per parameter for AdamW, ~8 per parameter with
--amp, ~5 per gradient for the float32 clip).

    tables        for each role (parameters, gradients, m, v, ...) a device array of the
                  tensors' addresses (uint64), built with xp and cached while the addresses
                  do not change (`address_table`); plus the tensors' sizes and, per block,
                  which tensor and which chunk of it (`chunk_tables`, cached by sizes)
    plans         `<kernel>_launch(xp, ...)` pure functions returning (Launch, tables):
                  the Launch of minidist/autograd/cuda_kernels.py (the GPU runs it as is)
                  and {argument index: the tensors that address table points at}, which
                  the CPU harness (tests/cuda_cpu.py) uses to hand the kernel its own
                  guarded copies of those tensors
    groups        `group_adamw_launch`, `group_amp_adamw_launch`: the plan for one optimizer
                  group (what the optimizers `run`, and the CPU tests run on numpy);
                  `amp_verdict_launch` + `group_amp_adamw_dev_launch`: --amp's step with
                  the overflow verdict and step count decided on the device (no host read);
                  `sum_sq` and `scale` run the clip's two kernels on cupy arrays

The kernels (minidist/autograd/cuda_source_multi.py) are proven on the CPU only
(tests/test_multi_tensor_cpu.py); the optimizers reach them on cupy arrays with
MINIDIST_CUDA_NEW_KERNELS=1 (`use_multi`), never on numpy: the CPU path is unchanged.
"""
import math
import sys

import numpy as np

from minidist.autograd.cuda_kernels import Launch, acc_dtype, launch
from minidist.autograd.cuda_kernels_new import use_new
from minidist.backend import is_cupy, xp_of

CHUNK = 32768          # elements per block (each of THREADS threads: CHUNK / THREADS)
THREADS = 256
_TABLES = {}           # (kind, key) -> device table; cleared when it grows past _MAX_TABLES
STATE_FIELDS = ("scale", "good_steps", "skipped", "skips_in_a_row", "step", "norm")
VERDICT_SIZE = 9       # amp_verdict's output: skip, factor, then adamw_scalars without decay
_MAX_TABLES = 256
_MADE = [0]            # tables made so far (tables_made)


def use_multi(*groups):
    """True when these lists of arrays should take the multi-tensor kernels: every array a
    C-contiguous cupy array, each list of one dtype, MINIDIST_CUDA_NEW_KERNELS=1."""
    arrays = [a for g in groups for a in g]
    if not arrays or not all(is_cupy(a) and a.flags.c_contiguous for a in arrays):
        return False
    if sum(a.size for a in arrays) == 0:
        return False
    return all(use_new(*g) for g in groups if g)


def adamw_ok(params, grads):
    """multi_adamw can take these: use_multi, all float32 or all float64, one dtype."""
    return (use_multi(params + grads) and params[0].dtype.name in ("float32", "float64"))


def amp_adamw_ok(weights, grads, masters):
    """multi_amp_adamw can take these: 16-bit weights, gradients of their dtype or float32
    (--grad-dtype float32: multi_amp_adamw_g32), float32 masters (their m and v are made
    like them), each list qualifying for use_multi."""
    return (use_multi(weights, grads, masters)
            and weights[0].dtype.name in ("float16", "bfloat16")
            and grads[0].dtype in (weights[0].dtype, np.float32)
            and masters[0].dtype.name == "float32")


def amp_kernel(name, weights, grads):
    """(kernel, the 16-bit dtype, the gradients' dtype) of an --amp launch over `weights`
    and `grads`: `name` over 16-bit gradients, `name`_g32 over float32 ones (--grad-dtype
    float32). The 16-bit dtype is the gradients' where they are 16-bit (a table of other
    weights is then refused), else the weights'; never float32 or float64."""
    grad = grads[0].dtype
    half = weights[0].dtype if grad == np.float32 else grad
    if half.name not in ("float16", "bfloat16"):
        raise ValueError(f"{name}: 16-bit weights wanted (float16 or bfloat16), not "
                         f"{half.name}")
    return (name + "_g32" if grad == np.float32 else name), half, grad


def moment_states(state, names, arrays):
    """An optimizer's states of a group (state[name] for each name), m and v made (zeros
    like `arrays`) where missing; step counts untouched."""
    states = [state.setdefault(n, {"step": 0}) for n in names]
    for s, a in zip(states, arrays):
        if "exp_avg" not in s:
            s["exp_avg"], s["exp_avg_sq"] = xp_of(a).zeros_like(a), xp_of(a).zeros_like(a)
    return states


def advance_states(state, names, arrays):
    """An optimizer's states of a group for one multi launch (moment_states), each step
    count advanced by one. None, and nothing changed, when the step counts differ (state
    loaded from a run where some parameter had no gradient): the per-parameter path takes
    that group."""
    if len({state.get(n, {"step": 0})["step"] for n in names}) != 1:
        return None
    states = moment_states(state, names, arrays)
    for s in states:
        s["step"] += 1
    return states


def address(a):
    """The device (cupy) or host (numpy) address of a's first element."""
    return a.data.ptr if is_cupy(a) else a.ctypes.data


def tables_made():
    """How many tables this process has made (a step that makes none found its tensors where
    an earlier step had them: examples/bench_step.py waits for that before capturing)."""
    return _MADE[0]


def _cached(key, make):
    if key not in _TABLES:
        _refuse_while_capturing(key)
        _MADE[0] += 1
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        _TABLES[key] = make()
    return _TABLES[key]


def _refuse_while_capturing(key):
    """A table is uploaded from a pinned buffer CuPy recycles once the copy is done: made
    while a CUDA graph is being captured, every replay would copy that buffer again, long
    after CuPy reused it. So no new table then (a capture must follow eager steps whose
    tensors sat where the captured step's do: examples/bench_step.py `captured`)."""
    cupy = sys.modules.get("cupy")
    if key[1] == "cupy" and cupy is not None and cupy.cuda.get_current_stream().is_capturing():
        raise RuntimeError(f"multi-tensor {key[0]} table made during CUDA graph capture (the "
                           f"tensors moved since the warm-up steps); it cannot be captured")


def address_table(xp, arrays):
    """uint64 array (on xp's device) of the arrays' addresses; cached by those addresses, so
    a step whose tensors have not moved copies nothing to the device."""
    addrs = tuple(address(a) for a in arrays)
    return _cached(("addr", xp.__name__, addrs),
                   lambda: xp.asarray(np.array(addrs, dtype=np.uint64)))


def chunk_tables(xp, sizes, chunk=CHUNK):
    """(sizes int64, blk_tensor int32, blk_start int64) on xp's device: block b covers
    elements [blk_start[b], blk_start[b] + chunk) of tensor blk_tensor[b], cut at its size;
    an empty tensor gets no block."""
    sizes = tuple(int(n) for n in sizes)

    def make():
        tensor = [t for t, n in enumerate(sizes) for _ in range(0, n, chunk)]
        start = [s for n in sizes for s in range(0, n, chunk)]
        return (xp.asarray(np.array(sizes, dtype=np.int64)),
                xp.asarray(np.array(tensor, dtype=np.int32)),
                xp.asarray(np.array(start, dtype=np.int64)))
    return _cached(("chunks", xp.__name__, sizes, chunk), make)


def _tables(xp, roles, dtypes, chunk):
    """The address tables of each role's list of arrays, then the chunk tables, as kernel
    arguments; {argument index: arrays} for the CPU harness; the number of blocks. Refuses
    a role whose arrays are not all C-contiguous of its dtype (the kernel casts an address
    to that type) or not of the first role's sizes."""
    args, tables = [], {}
    sizes = [a.size for a in roles[0]]
    for i, (arrays, dtype) in enumerate(zip(roles, dtypes)):
        bad = [k for k, (a, n) in enumerate(zip(arrays, sizes))
               if a.dtype != dtype or not a.flags.c_contiguous or a.size != n]
        if bad or len(arrays) != len(sizes):
            raise ValueError(f"multi-tensor table #{i}: {len(sizes)} C-contiguous "
                             f"{np.dtype(dtype).name} arrays of the first table's sizes "
                             f"wanted; arrays {bad[:4]} of {len(arrays)} are not")
        args.append(address_table(xp, arrays))
        tables[i] = list(arrays)
    sizes, blk_tensor, blk_start = chunk_tables(xp, sizes, chunk)
    if len(blk_start) == 0:
        raise ValueError("multi-tensor launch over no elements (the caller skips it)")
    return args + [sizes, blk_tensor, blk_start, np.int64(chunk)], tables, len(blk_start)


def adamw_scalars(step, lr, beta1, beta2, eps, weight_decay):
    """adamw_step's scalars, as cuda_kernels.adamw_launch computes them on the host."""
    return (beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 - lr * weight_decay,
            1.0 / math.sqrt(1.0 - beta2 ** step), eps, lr / (1.0 - beta1 ** step))


def multi_adamw_launch(xp, params, grads, ms, vs, step, lr, beta1, beta2, eps, weight_decay,
                       chunk=CHUNK):
    """One AdamW step over a group (lists of contiguous arrays of one dtype, float32 or
    float64, p, m, v in place) and the tables. The group's hyperparameters, one step count."""
    dtype = params[0].dtype
    args, tables, blocks = _tables(xp, (params, grads, ms, vs), [dtype] * 4, chunk)
    acc = acc_dtype(dtype).type
    args += [acc(x) for x in adamw_scalars(step, lr, beta1, beta2, eps, weight_decay)]
    return Launch("multi_adamw", dtype, (blocks,), (THREADS,), tuple(args)), tables


def multi_amp_adamw_launch(xp, weights, grads, masters, ms, vs, factor, step, lr, beta1,
                           beta2, eps, weight_decay, chunk=CHUNK):
    """--amp's step over a group: 16-bit weights, their gradients (16-bit, or float32 under
    --grad-dtype float32: amp_kernel), float32 masters, m, v.
    `factor` (1/S, or 1/S x clip: a Python float) becomes float32 by rounding to nearest,
    as numpy does for `float32_buffer *= factor` (amp.unscaled)."""
    name, half, grad = amp_kernel("multi_amp_adamw", weights, grads)
    args, tables, blocks = _tables(xp, (weights, grads, masters, ms, vs),
                                   [half, grad] + [np.float32] * 3, chunk)
    scalars = (factor,) + adamw_scalars(step, lr, beta1, beta2, eps, weight_decay)
    args += [np.float32(x) for x in scalars]
    plan = Launch(name, half, (blocks,), (THREADS,), tuple(args))
    return plan, tables


def multi_amp_adamw_dev_launch(xp, weights, grads, masters, ms, vs, decay, verdict,
                               chunk=CHUNK):
    """multi_amp_adamw_launch with the verdict on the device: `verdict` the float32 array
    amp_verdict fills (skip, factor, Adam's scalars for the new step count); `decay`
    (1 - lr x weight decay, a Python float) the group's."""
    name, half, grad = amp_kernel("multi_amp_adamw_dev", weights, grads)
    args, tables, blocks = _tables(xp, (weights, grads, masters, ms, vs),
                                   [half, grad] + [np.float32] * 3, chunk)
    args += [np.float32(decay), verdict]
    return Launch(name, half, (blocks,), (THREADS,), tuple(args)), tables


def amp_verdict_launch(sum_sq, state, verdict, half, max_norm, scaler, lr, beta1, beta2, eps):
    """The one-thread launch that decides --amp's step on the device: `sum_sq` (float64, 1
    element) of the unscaled gradients over every rank, `state` (float64, STATE_FIELDS, in
    place: the scaler's and AdamW's step count), `verdict` (float32, VERDICT_SIZE) out.
    `half`: the 16-bit dtype (the kernel is in that dtype's module); `scaler` a LossScaler
    (its growth policy and max_skips, after which the state freezes: settle() raises; its
    scale lives in `state` meanwhile)."""
    interval = scaler.growth_interval or 0
    args = (sum_sq, state, verdict, max_norm or 0.0, scaler.growth_factor,
            scaler.backoff_factor, interval, scaler.max_skips, lr, beta1, beta2, eps)
    return Launch("amp_verdict", half, (1,), (1,), tuple(args[:3]) + tuple(
        np.float64(x) for x in args[3:]))


def multi_sum_sq_launches(xp, grads, scale, chunk=CHUNK):
    """The two launches of sum((g x scale)^2) over `grads` (one dtype): per-block partials,
    then one block sums them; the tables and the (1,) result in the accumulation dtype."""
    dtype = grads[0].dtype
    acc = acc_dtype(dtype)
    args, tables, blocks = _tables(xp, (grads,), [dtype], chunk)
    partial, out = xp.empty(blocks, acc), xp.empty(1, acc)
    first = Launch("multi_sum_sq", dtype, (blocks,), (THREADS,),
                   tuple(args) + (acc.type(scale), partial))
    final = Launch("multi_sum_sq_final", dtype, (1,), (1024,),
                   (partial, np.int64(len(partial)), out))
    return [first, final], tables, out


def multi_scale_launch(xp, grads, factor, chunk=CHUNK):
    """g *= factor over `grads` (one dtype, float32 or float64) in one launch; `factor` a
    float64 array of one element on the device (clip_grad_norm's), read there."""
    dtype = grads[0].dtype
    args, tables, blocks = _tables(xp, (grads,), [dtype], chunk)
    factor = xp.ascontiguousarray(factor, dtype=np.float64).reshape(1)
    return Launch("multi_scale", dtype, (blocks,), (THREADS,), tuple(args) + (factor,)), tables


# ---- an optimizer group's plan, and the runners --------------------------------------------

def group_adamw_launch(xp, params, grads, states, group, chunk=CHUNK):
    """multi_adamw's plan for one group of an AdamW: its hyperparameters, `states` as
    advance_states returned them (m, v and the one step count). What AdamW.step_group and
    FlatAdamW.step launch on cupy; tests/test_multi_tensor_cpu.py runs it on numpy."""
    beta1, beta2 = group["betas"]
    return multi_adamw_launch(xp, params, grads, [s["exp_avg"] for s in states],
                              [s["exp_avg_sq"] for s in states], states[0]["step"],
                              group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                              chunk)


def group_amp_adamw_launch(xp, weights, grads, masters, states, group, factor, chunk=CHUNK):
    """multi_amp_adamw's plan for one group of MasterWeightOptimizer's inner AdamW: 16-bit
    weights and gradients, float32 masters, `states` from advance_states, the step's
    factor."""
    beta1, beta2 = group["betas"]
    return multi_amp_adamw_launch(xp, weights, grads, masters,
                                  [s["exp_avg"] for s in states],
                                  [s["exp_avg_sq"] for s in states], factor,
                                  states[0]["step"], group["lr"], beta1, beta2, group["eps"],
                                  group["weight_decay"], chunk)


def group_amp_adamw_dev_launch(xp, weights, grads, masters, states, group, verdict,
                               chunk=CHUNK):
    """multi_amp_adamw_dev's plan for one group: as group_amp_adamw_launch, but the factor
    and step count come from the device (`verdict`, amp_verdict's output); `states` hold m
    and v (their step counts are the device's meanwhile)."""
    return multi_amp_adamw_dev_launch(xp, weights, grads, masters,
                                      [s["exp_avg"] for s in states],
                                      [s["exp_avg_sq"] for s in states],
                                      1.0 - group["lr"] * group["weight_decay"], verdict, chunk)


def run(plan):
    """Run a (Launch, tables) plan on the GPU (the tables are for the CPU harness)."""
    launch(plan[0])


def scale(grads, factor):
    """g *= factor for every gradient (float32 or float64 cupy arrays), one launch."""
    run(multi_scale_launch(xp_of(grads[0]), grads, factor))


def sum_sq(grads, scale):
    """sum((g x scale)^2) over `grads` as a 0-d float64 array on the device (two launches),
    like optim/clip.local_sum_sq's result."""
    plans, _, out = multi_sum_sq_launches(xp_of(grads[0]), grads, scale)
    for plan in plans:
        launch(plan)
    return out.reshape(()).astype(np.float64)
