"""The multi-tensor optimizer kernels (minidist/autograd/cuda_source_multi.py, planned by
minidist/optim/multi_tensor.py) RUN on the CPU (tests/cuda_cpu.py, which hands each kernel a
pointer table of its own guarded copies of the tensors) against the per-parameter path they
replace, under both thread orders:

    multi_adamw        bitwise AdamW.step (adamw_update's xp code) and the per-parameter
                       adamw_step kernel, float32 and float64, odd sizes, several steps,
                       two groups (decay and no decay)
    multi_amp_adamw    bitwise MasterWeightOptimizer.step (amp.unscaled, adamw_update, the
                       master rounded to 16 bits), float16 and bfloat16 (skipped without
                       ml_dtypes), with a clip factor
    multi_scale        bitwise clip_grad_norm's per-gradient multiply, float32 and float64
    multi_sum_sq       MixedPrecision.unscaled_sum_sq / clip.local_sum_sq to rounding only:
                       another summation order

Broken variants (no bound at a tensor's end, a barrier missing from the reduction, the
wrong tensor's chunk, a partial left out) must fail; the harness refuses a table that is not
the tensors' addresses. Argument types, nvcc and the gpu tests: tests/test_multi_tensor.py.
Run: python -m pytest -q tests/test_multi_tensor_cpu.py   (skips without a C++ compiler)
"""
import functools

import numpy as np
import pytest

import cuda_cpu
from minidist.autograd import cuda_kernels as ck, cuda_source as cs
from minidist.nn import Module, Parameter
from minidist.optim import AdamW, multi_tensor as mt
from minidist.optim.clip import local_sum_sq
from minidist.train.amp import MixedPrecision
from minidist.train.loss_scale import LossScaler
from test_cuda_kernels_cpu import ORDERS, failing_orders, np_dtype, nth_replaced

pytestmark = pytest.mark.skipif(cuda_cpu.reason_unavailable() is not None,
                                reason=str(cuda_cpu.reason_unavailable()))

SIZES = ((1,), (3,), (1025,), (4099,), (37, 29))     # chunks of 1000: uneven, 1 to 5 each
CHUNK = 1000
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Bag(Module):
    """Parameters of odd sizes; the two smallest without weight decay (AdamW's 2 groups)."""

    def __init__(self, dtype, seed=0):
        super().__init__()
        r = np.random.default_rng(seed)
        for i, shape in enumerate(SIZES):
            setattr(self, f"p{i}", Parameter(r.standard_normal(shape).astype(dtype),
                                             decay=i >= 2))


def set_grads(model, step, scale=1.0):
    r = np.random.default_rng(100 + step)
    for p in model.parameters():
        p.grad = (r.standard_normal(p.shape) * scale).astype(p.dtype)


def multi_step(opt, src, order, chunk=CHUNK):
    """What AdamW.step_group does on cupy with the switch on, on the CPU: advance_states,
    then one group_adamw_launch per group, run by the harness."""
    for group in opt.param_groups:
        params = [p.data for p in group["params"]]
        states = mt.advance_states(opt.state, group["names"], params)
        plan = mt.group_adamw_launch(np, params, [p.grad for p in group["params"]], states,
                                     group, chunk=chunk)
        cuda_cpu.run(plan[0], src, order, plan[1])


def check_multi_adamw(dtype, src=None, order="low", steps=3, chunk=CHUNK):
    """multi_adamw over AdamW's two groups equals AdamW.step bitwise, step after step; and
    the per-parameter adamw_step kernel (float32: run for one step beside it)."""
    ref, got = Bag(dtype), Bag(dtype)
    opt_ref, opt_got = AdamW(ref.named_parameters(), **HYPER), AdamW(got.named_parameters(),
                                                                     **HYPER)
    for step in range(steps):
        set_grads(ref, step), set_grads(got, step)
        opt_ref.step()
        multi_step(opt_got, src, order, chunk)
        for (name, a), b in zip(ref.named_parameters(), got.parameters()):
            np.testing.assert_array_equal(b.data, a.data, err_msg=f"multi_adamw {name}")
            for key in ("exp_avg", "exp_avg_sq"):
                np.testing.assert_array_equal(opt_got.state[name][key],
                                              opt_ref.state[name][key], err_msg=key)


def per_parameter_kernel_step(opt):
    """AdamW through the proven per-parameter adamw_step kernel on the CPU."""
    for group in opt.param_groups:
        for name, p in zip(group["names"], group["params"]):
            s = opt.state.setdefault(name, {"step": 0, "exp_avg": np.zeros_like(p.data),
                                            "exp_avg_sq": np.zeros_like(p.data)})
            s["step"] += 1
            cuda_cpu.run(ck.adamw_launch(p.data, p.grad, s["exp_avg"], s["exp_avg_sq"],
                                         s["step"], group["lr"], *group["betas"], group["eps"],
                                         group["weight_decay"]))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_multi_adamw_equals_adamw_bitwise(dtype, order):
    check_multi_adamw(dtype, order=order)


def test_multi_adamw_equals_the_per_parameter_kernel_bitwise():
    a, b = Bag("float32"), Bag("float32")
    opt_a, opt_b = AdamW(a.named_parameters(), **HYPER), AdamW(b.named_parameters(), **HYPER)
    for step in range(2):
        set_grads(a, step), set_grads(b, step)
        per_parameter_kernel_step(opt_a)
        multi_step(opt_b, None, "low")
    for x, y in zip(a.parameters(), b.parameters()):
        np.testing.assert_array_equal(y.data, x.data)


# ---- --amp: 16-bit weights and gradients, float32 masters ------------------------------------

def amp_setup(dtype):
    amp = MixedPrecision(LossScaler(init_scale=1024.0), dtype=dtype)
    model = amp.cast_model(Bag(np.float32))
    amp.scaler.scale = 1024.0               # bfloat16's policy fixes it at 1: scale anyway
    return amp, model, amp.optimizer(model.named_parameters(), lambda n: AdamW(n, **HYPER))


def check_multi_amp_adamw(dtype, src=None, order="low", steps=3, max_norm=5.0):
    """multi_amp_adamw equals MasterWeightOptimizer.step bitwise: masters, m, v and the
    16-bit weights; the factor includes a clip (max_norm below the gradients' norm)."""
    (amp_r, ref, opt_r), (_, got, opt_g) = amp_setup(dtype), amp_setup(dtype)
    for step in range(steps):
        set_grads(ref, step, 1024.0), set_grads(got, step, 1024.0)
        amp_r.scaled_upstream()
        norm = opt_r.clip_grad_norm(max_norm)
        found_inf, factor = amp_r.scaler.verdict(norm, max_norm)
        assert not found_inf and factor < 1 / 1024.0          # clipped
        assert opt_r.step()
        for group in opt_g.inner.param_groups:          # MasterWeightOptimizer's multi path
            masters = [m.data for m in group["params"]]
            w = [dict(got.named_parameters())[n] for n in group["names"]]
            states = mt.advance_states(opt_g.inner.state, group["names"], masters)
            plan = mt.group_amp_adamw_launch(np, [p.data for p in w], [p.grad for p in w],
                                             masters, states, group, factor, chunk=CHUNK)
            cuda_cpu.run(plan[0], src, order, plan[1])
        assert_amp_same(ref, opt_r, got, opt_g, dtype, f"step {step}")


def assert_amp_same(ref, opt_r, got, opt_g, dtype, what):
    """Two --amp models and their MasterWeightOptimizers hold the same bits: 16-bit weights
    (of `dtype`), float32 masters, m and v."""
    for (name, a), b, ma, mb in zip(ref.named_parameters(), got.parameters(), opt_r.master,
                                    opt_g.master):
        assert b.dtype == np_dtype(dtype)
        np.testing.assert_array_equal(mb.data, ma.data, err_msg=f"{what}: master {name}")
        np.testing.assert_array_equal(b.data.view(np.uint16), a.data.view(np.uint16),
                                      err_msg=f"{what}: 16-bit weight {name}")
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(opt_g.inner.state[name][key],
                                          opt_r.inner.state[name][key],
                                          err_msg=f"{what}: {key} {name}")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_multi_amp_adamw_equals_master_weight_optimizer_bitwise(dtype, order):
    np_dtype(dtype)                                  # skips bfloat16 without ml_dtypes
    check_multi_amp_adamw(dtype, order=order)


# ---- the clip's sum of squares -----------------------------------------------------------

SUM_TOL = {"float16": 1e-5, "bfloat16": 1e-5, "float32": 1e-5, "float64": 1e-13}


def check_multi_sum_sq(dtype, src=None, order="low", chunk=CHUNK):
    """multi_sum_sq then multi_sum_sq_final equal the xp path's sum of squares to rounding
    (float32 accumulation in another order; float64 for float64): 16-bit gradients against
    MixedPrecision.unscaled_sum_sq, float32 and float64 against clip.local_sum_sq."""
    grads = [g.astype(np_dtype(dtype)) for g in
             (np.random.default_rng(7).standard_normal(s) * 300 for s in SIZES)]
    inv = 1.0 / 1024.0 if dtype in ("float16", "bfloat16") else 1.0
    plans, tables, out = mt.multi_sum_sq_launches(np, grads, inv, chunk=chunk)
    out[...] = np.nan
    for plan in plans:
        cuda_cpu.run(plan, src, order, tables if plan.name == "multi_sum_sq" else None)
    # each block's partial on its own: a final sum can hide wrong partials whose errors
    # cancel (before the harness poisoned shared memory per block, a missing barrier left one
    # block's warp sums to the next and the total came out right)
    chunks = [(g.reshape(-1)[a:a + chunk].astype(np.float64) * inv) for g in grads
              for a in range(0, g.size, chunk)]
    np.testing.assert_allclose(plans[0].args[-1], [(c * c).sum() for c in chunks],
                               rtol=SUM_TOL[dtype], err_msg="multi_sum_sq partials")
    if inv != 1.0:
        amp = MixedPrecision(LossScaler(init_scale=1024.0), dtype=dtype)
        want = amp.unscaled_sum_sq(grads)
    else:
        want = local_sum_sq(grads)
    assert out.dtype == ck.acc_dtype(dtype)
    np.testing.assert_allclose(float(out[0]), float(want), rtol=SUM_TOL[dtype],
                               err_msg=f"multi_sum_sq {dtype}")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_multi_sum_sq_equals_the_xp_sum_to_rounding(dtype, order):
    check_multi_sum_sq(dtype, order=order)


def test_multi_sum_sq_with_one_block_per_tensor_and_many_partials():
    check_multi_sum_sq("float32", chunk=1 << 20)             # 5 partials
    check_multi_sum_sq("float32", chunk=64)                   # 1 + 1 + 17 + 65 + 17 = 101


# ---- the clip's multiply -------------------------------------------------------------------

def check_multi_scale(dtype, src=None, order="low", chunk=CHUNK):
    """multi_scale equals clip_grad_norm's per-gradient `g *= scale.astype(g.dtype)` bitwise,
    the factor a float64 0-d array (read by the kernel, rounded to the gradients' type)."""
    r = np.random.default_rng(3)
    want = [r.standard_normal(s).astype(dtype) for s in SIZES]
    got = [g.copy() for g in want]
    factor = np.asarray(1.0 / 3.0 + 1e-12)                  # not a float32 number
    for g in want:
        g *= factor.astype(g.dtype)
    plan = mt.multi_scale_launch(np, got, factor, chunk=chunk)
    cuda_cpu.run(plan[0], src, order, plan[1])
    for a, b in zip(want, got):
        np.testing.assert_array_equal(b, a, err_msg=f"multi_scale {dtype}")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_multi_scale_equals_the_clip_multiply_bitwise(dtype, order):
    check_multi_scale(dtype, order=order)


# ---- broken variants must fail -----------------------------------------------------------

# Chunks of 32 elements for the variants that write past a tensor: the overrun (< 32
# elements, <= 248 bytes) stays inside the harness's 256 guard bytes, where it is caught
SHORT = functools.partial(check_multi_adamw, chunk=32)
BROKEN = {   # name -> (check, dtype, old, new, occurrence): one defect each
    "no bound at the tensor's end": (SHORT, "float32",
                                     "min(*start + chunk, sizes[*t])", "*start + chunk", 0),
    "a chunk one element too long": (SHORT, "float64",
                                     "min(*start + chunk, sizes[*t])",
                                     "min(*start + chunk, sizes[*t] + 1)", 0),
    "the next tensor's chunk": (check_multi_adamw, "float32", "*t = blk_tensor[blockIdx.x];",
                                "*t = (blk_tensor[blockIdx.x] + 1) % 2;", 0),
    "amp: the factor not applied": (check_multi_amp_adamw, "float16", "ld(g, i) * s[0]",
                                    "ld(g, i)", 0),
    "amp: the weight not copied back": (check_multi_amp_adamw, "float16", "st(w, i, pn);", "",
                                        0),
    "sum_sq: the reduction's second barrier missing": (check_multi_sum_sq, "float32",
                                                       "__syncthreads();", "", 1),
    "scale: the factor read as float32": (check_multi_scale, "float64", "A f = (A)factor[0];",
                                          "A f = (float)factor[0];", 0),
    "scale: no bound at the tensor's end": (functools.partial(check_multi_scale, chunk=32),
                                            "float32", "min(*start + chunk, sizes[*t])",
                                            "*start + chunk", 0),
    "sum_sq_final: the last partial skipped": (check_multi_sum_sq, "float32",
                                               "i = threadIdx.x; i < n;",
                                               "i = threadIdx.x; i < n - 1;", 0),
}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_multi_kernel_fails_its_check(name):
    """Each defect makes its check fail (a wrong answer or a write outside a tensor caught by
    its guard) in at least one thread order; the intact source passes (tests above)."""
    check, dtype, old, new, n = BROKEN[name]
    src = nth_replaced(cs.source(dtype, "multi"), old, new, n)
    failed = failing_orders(functools.partial(check, dtype), src)
    assert failed, f"{name}: the broken kernel passed in both orders"


# ---- the harness's tables and the plans' argument types ----------------------------------

def test_a_table_that_is_not_the_tensors_addresses_is_refused():
    a, b = np.ones(5, np.float32), np.ones(7, np.float32)
    plans, tables, _ = mt.multi_sum_sq_launches(np, [a, b], 1.0)
    with pytest.raises(cuda_cpu.KernelError, match="not the table"):
        cuda_cpu.run(plans[0], tables={0: [b, a]})


def test_a_write_past_a_tensor_of_a_table_is_caught_by_its_guard():
    src = nth_replaced(cs.source("float32", "multi"), "min(*start + chunk, sizes[*t])",
                       "*start + chunk", 0)
    p = [np.zeros(n, np.float32) for n in (3, 5)]
    plan, tables = mt.multi_adamw_launch(np, p, p, p, p, 1, 1e-3, 0.9, 0.95, 1e-8, 0.0,
                                         chunk=8)
    with pytest.raises(cuda_cpu.KernelError, match="wrote outside tensor 0 of table #0"):
        cuda_cpu.run(plan, src, tables=tables)


def test_tables_are_cached_while_the_addresses_stay():
    a = [np.ones(n, np.float32) for n in (3, 5)]
    t1, t2 = mt.address_table(np, a), mt.address_table(np, a)
    assert t1 is t2 and list(t1) == [x.ctypes.data for x in a]
    b = [np.ones(3, np.float32), a[1]]
    assert mt.address_table(np, b) is not t1
    sizes, blk_tensor, blk_start = mt.chunk_tables(np, [3, 0, 2500], chunk=1000)
    assert list(blk_tensor) == [0, 2, 2, 2] and list(blk_start) == [0, 0, 1000, 2000]
    assert mt.chunk_tables(np, [3, 0, 2500], chunk=1000)[1] is blk_tensor
