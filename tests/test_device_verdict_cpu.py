"""--amp's overflow verdict decided on the device (minidist/train/amp.py, MasterWeightOptimizer
on cupy with MINIDIST_CUDA_NEW_KERNELS=1): the kernels amp_verdict and multi_amp_adamw_dev
(minidist/autograd/cuda_source_multi.py) RUN on the CPU (tests/cuda_cpu.py) against the host
verdict they replace, step after step, through overflows, a growing and a shrinking loss scale,
clipping, and a settle in the middle of the run:

    device   multi_sum_sq of the scaled gradients x (1/S)^2, S read on the device -> amp_verdict
             (one thread: the scaler's rules and AdamW's step count, in
             LossScaler.device_state) -> multi_amp_adamw_dev per group, skipped by every block
             on an overflow; settle() reads it all back
    host     multi_sum_sq of the unscaled gradients -> LossScaler.unscale_and_clip and update
             (one host read a step) -> multi_amp_adamw with the factor, or nothing

Both are what MasterWeightOptimizer launches on cupy; the test replays the launches on numpy
through the plan functions, as tests/test_multi_tensor_cpu.py does for the host verdict.
Equal bitwise: masters, 16-bit weights, m, v, the norms, and after settle() the loss scale,
its counts and every AdamW step count (the scale is a power of two, so the device's sum times
(1/S)^2 is the host's sum of (g/S)^2 exactly). Broken kernels must fail. LossScaler's own device
half (to_device, multiplier, settle, check_skips) runs for real on numpy arrays here.
Run: python -m pytest -q tests/test_device_verdict_cpu.py   (skips without a C++ compiler)
"""
import functools

import numpy as np
import pytest

import cuda_cpu
from minidist.autograd import cuda_source as cs
from minidist.optim import AdamW, multi_tensor as mt
from minidist.train.amp import MixedPrecision
from minidist.train.loss_scale import LossScaler
from test_cuda_kernels_cpu import failing_orders, np_dtype, nth_replaced
import test_zero_multi_cpu as zm
from test_multi_tensor_cpu import CHUNK, HYPER, Bag, assert_amp_same, set_grads

pytestmark = pytest.mark.skipif(cuda_cpu.reason_unavailable() is not None,
                                reason=str(cuda_cpu.reason_unavailable()))

# Per step: (gradient size, an inf in the gradients?, max_norm). Growth after 2 good steps,
# so the scale grows, halves on the overflows, and grows again; the small max_norm clips.
PLAN = ((1.0, False, 5.0), (1.0, False, None), (1.0, True, 5.0), (2.0, False, 0.5),
        (1.0, False, 5.0), (1.0, True, None), (1.0, True, 5.0), (1.0, False, 5.0),
        (0.5, False, 5.0))


def setup(dtype, init_scale=1024.0, growth_interval=2):
    amp = MixedPrecision(LossScaler(init_scale=init_scale, growth_interval=growth_interval),
                         dtype=dtype)
    model = amp.cast_model(Bag(np.float32))
    amp.scaler.scale, amp.scaler.growth_interval = init_scale, growth_interval  # bf16 too
    return amp, model, amp.optimizer(model.named_parameters(), lambda n: AdamW(n, **HYPER))


def set_step_grads(model, amp, step, size, inf):
    """Gradients as a backward from a loss x S would leave them (16 bits), an inf if asked."""
    set_grads(model, step, size * amp.scaler.multiplier())
    if inf:
        next(iter(model.parameters())).grad.reshape(-1)[0] = np.inf
    amp.scaled_upstream()


def groups_of(opt, model):
    named = dict(model.named_parameters())
    for group in opt.inner.param_groups:
        weights = [named[n] for n in group["names"]]
        yield group, [p.data for p in weights], [p.grad for p in weights], [
            m.data for m in group["params"]]


def run_sum_sq(grads, scale, src, order):
    plans, tables, out = mt.multi_sum_sq_launches(np, grads, scale, chunk=CHUNK)
    for plan in plans:
        cuda_cpu.run(plan, src, order, tables if plan.name == "multi_sum_sq" else None)
    return out.reshape(()).astype(np.float64)


def host_step(amp, model, opt, max_norm, src=None, order="low"):
    """MasterWeightOptimizer's multi path with the verdict on the host (one read)."""
    grads = [p.grad for p in model.parameters()]
    sum_sq = run_sum_sq(grads, 1.0 / amp.scaler.scale, src, order)
    norm, found_inf, factor = amp.scaler.unscale_and_clip(sum_sq, max_norm, None)
    if amp.scaler.update(found_inf):
        for group, w, g, masters in groups_of(opt, model):
            states = mt.advance_states(opt.inner.state, group["names"], masters)
            plan = mt.group_amp_adamw_launch(np, w, g, masters, states, group, factor, CHUNK)
            cuda_cpu.run(plan[0], src, order, plan[1])
    return norm


def run_verdict(scaler, grads, max_norm, step, group, src=None, order="low"):
    """MixedPrecision.verdict_on_device, launch for launch, on the harness: the verdict array
    and the state (numpy)."""
    scaler.check_used()
    state = scaler.to_device(np, step)
    inv = scaler.inverse()                  # MixedPrecision.unscaled_sum_sq's multi path:
    # on cupy a dynamic scale on the device makes inv a 0-d array, which is no float; on
    # numpy it is a np.float64, which is, so the branch is taken as cupy takes it
    if scaler.growth_interval is None:
        sum_sq = run_sum_sq(grads, inv, src, order).reshape(1)
    else:
        sum_sq = (run_sum_sq(grads, 1.0, src, order) * (inv * inv)).reshape(1)
    verdict = np.full(mt.VERDICT_SIZE, np.nan, np.float32)
    cuda_cpu.run(mt.amp_verdict_launch(sum_sq, state, verdict, grads[0].dtype, max_norm,
                                       scaler, group["lr"], *group["betas"], group["eps"]),
                 src, order)
    return verdict, state


def device_step(amp, model, opt, max_norm, src=None, order="low"):
    """MasterWeightOptimizer.clip_grad_norm then step on the device path, launch for launch."""
    grads = [p.grad for p in model.parameters()]
    step = {opt.inner.state.get(n, {"step": 0})["step"] for n in opt.names}.pop()
    verdict, state = run_verdict(amp.scaler, grads, max_norm, step, opt.inner.param_groups[0],
                                 src, order)
    for group, w, g, masters in groups_of(opt, model):
        states = mt.moment_states(opt.inner.state, group["names"], masters)
        plan = mt.group_amp_adamw_dev_launch(np, w, g, masters, states, group, verdict, CHUNK)
        cuda_cpu.run(plan[0], src, order, plan[1])
    return float(state[mt.STATE_FIELDS.index("norm")])


def check_device_verdict(dtype, src=None, order="low", settle_at=(4,)):
    """PLAN's steps, host verdict beside device verdict; settle() where asked and at the
    end, then the scaler's fields and the step counts equal too. Returns the reference
    (amp, model, opt) and the loss scales it used."""
    ref, got, scales = setup(dtype), setup(dtype), set()
    for step, (size, inf, max_norm) in enumerate(PLAN):
        scales.add(ref[0].scaler.scale)
        for amp, model, _ in (ref, got):
            set_step_grads(model, amp, step, size, inf)
        norm_r = host_step(*ref, max_norm, src, order)
        norm_g = device_step(*got, max_norm, src, order)
        assert norm_g == norm_r or (np.isnan(norm_g) and np.isnan(norm_r)), (step, norm_g,
                                                                            norm_r)
        assert_amp_same(ref[1], ref[2], got[1], got[2], dtype, f"step {step}")
        if step in settle_at or step == len(PLAN) - 1:
            got[0].settle()
            assert got[0].scaler.device_state is None
            sr, sg = ref[0].scaler, got[0].scaler
            assert (sg.scale, sg.good_steps, sg.skipped, sg.skips_in_a_row) == (
                sr.scale, sr.good_steps, sr.skipped, sr.skips_in_a_row), step
            assert ({s["step"] for s in got[2].inner.state.values()}
                    == {s["step"] for s in ref[2].inner.state.values()}), step
    return ref, scales


@pytest.mark.parametrize("order", ["low", "high"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_device_verdict_equals_the_host_verdict_bitwise(dtype, order):
    np_dtype(dtype)                                  # skips bfloat16 without ml_dtypes
    ref, scales = check_device_verdict(dtype, order=order)
    assert ref[0].scaler.skipped == 3               # the plan exercises what it means to:
    assert scales == {512.0, 1024.0, 2048.0}        # the scale grown and backed off
    assert {st["step"] for st in ref[2].inner.state.values()} == {len(PLAN) - 3}


def test_a_fixed_scale_stays_fixed_on_the_device():
    """bfloat16's policy (growth_interval None: S = 1): an overflow skips, the scale stays."""
    np_dtype("bfloat16")
    ref, got = setup("bfloat16", 1.0, None), setup("bfloat16", 1.0, None)
    for step, inf in enumerate((False, True, False)):
        for amp, model, _ in (ref, got):
            set_step_grads(model, amp, step, 1.0, inf)
        host_step(*ref, 1.0), device_step(*got, 1.0)
        assert_amp_same(ref[1], ref[2], got[1], got[2], "bfloat16", f"step {step}")
    got[0].settle()
    assert got[0].scaler.scale == 1.0 and got[0].scaler.skipped == 1


def test_settle_stops_a_run_after_too_many_skips_in_a_row():
    amp, model, opt = setup("float16")
    amp.scaler.max_skips = 2
    for step in range(2):
        set_step_grads(model, amp, step, 1.0, True)
        device_step(amp, model, opt, 1.0)              # the device cannot raise: no error yet
    with pytest.raises(FloatingPointError, match="2 steps in a row"):
        amp.settle()


def test_too_many_skips_stop_the_device_run_where_the_host_run_stops():
    """The host verdict raises at the max_skips-th skipped step in a row, and the run stops
    there. The device cannot raise: amp_verdict freezes its state from that step on (later
    steps skipped, nothing updated), so a stretch whose gradients recover before the loop
    settles still stops, with the host's counts, scale and parameters."""
    ref, got = setup("float16"), setup("float16")
    for amp, _, _ in (ref, got):
        amp.scaler.max_skips = 2
    for step, inf in enumerate((False, True, True, False, False)):
        set_step_grads(got[1], got[0], step, 1.0, inf)
        device_step(*got, 5.0)
        if step > 2:
            continue                                  # the host run has stopped
        set_step_grads(ref[1], ref[0], step, 1.0, inf)
        if step < 2:
            host_step(*ref, 5.0)
            continue
        with pytest.raises(FloatingPointError, match="2 steps in a row"):
            host_step(*ref, 5.0)
    with pytest.raises(FloatingPointError, match="2 steps in a row") as stopped:
        got[0].settle()
    sr, sg = ref[0].scaler, got[0].scaler
    assert (sg.scale, sg.good_steps, sg.skipped, sg.skips_in_a_row) == (
        sr.scale, sr.good_steps, sr.skipped, sr.skips_in_a_row) == (256.0, 0, 2, 2)
    assert f"loss scale now {sr.scale:g}" in str(stopped.value)
    assert_amp_same(ref[1], ref[2], got[1], got[2], "float16", "after the stop")


def test_unscaled_sums_read_the_scale_on_the_device_while_it_lives_there():
    """Every strategy's reduce_sum_sq adds and subtracts MixedPrecision.unscaled_sum_sq's
    sums (TP's replicated parameters, PP's tied copies, EP's experts): with the scale on the
    device they divide by that one, bitwise as by the host's (a power of two)."""
    amp, model, _ = setup("float16")
    set_grads(model, 0, 1024.0)
    grads = [p.grad for p in model.parameters()]
    want = amp.unscaled_sum_sq(grads)
    amp.scaler.to_device(np, 0)
    assert amp.unscaled_sum_sq(grads) == want
    amp.scaler.device_state[0] = 2048.0               # grown on the device: the host's is 1024
    assert amp.unscaled_sum_sq(grads) == want / 4 and amp.scaler.scale == 1024.0


def test_the_scale_a_loss_is_multiplied_by_comes_from_the_device_while_it_lives_there():
    s = LossScaler(init_scale=8.0, growth_interval=3)
    assert s.multiplier(0.5) == 4.0
    state = s.to_device(np, step=7)
    state[0] = 32.0                                   # as amp_verdict would grow it
    assert s.multiplier(0.5) == 16.0 and s.scale == 8.0
    with pytest.raises(RuntimeError, match="settles it first"):
        s.state_dict()
    assert s.settle() == 7 and s.scale == 32.0 and s.device_state is None
    assert s.settle() is None                       # nothing on the device: no read
    fixed = LossScaler(init_scale=1.0, growth_interval=None)
    fixed.to_device(np, 0)
    assert fixed.multiplier(2.0) == 2.0              # a fixed scale stays a host number


# ---- broken variants must fail -------------------------------------------------------------

BROKEN = {   # name -> (old, new, occurrence): one defect each
    "the step count advanced on an overflow": ("state[3] += 1.0;",
                                               "state[3] += 1.0; state[4] += 1.0;", 0),
    "no skip on an overflow": ("if (verdict[0] != 0.0f) return;", "", 0),
    "the factor not divided by the scale": ("(found_inf ? 1.0 : clip) / scale;",
                                            "(found_inf ? 1.0 : clip);", 0),
    "the scale never backs off": ("state[0] = scale * backoff;", "", 0),
    "the bias correction of the old step": ("double step = state[4];",
                                            "double step = state[4] - 1.0;", 0),
}


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_verdict_kernel_fails_its_check(name):
    old, new, n = BROKEN[name]
    src = nth_replaced(cs.source("float16", "multi"), old, new, n)
    check = functools.partial(check_device_verdict, "float16", settle_at=())
    assert failing_orders(check, src), f"{name}: the broken kernel passed in both orders"


# ---- ZeRO's ShardedAdamW: the same verdict over its shards ---------------------------------

@pytest.mark.parametrize("amp_dtype", ["float16", "bfloat16"])
def test_zero_shards_take_the_device_verdict_bitwise(amp_dtype):
    """ShardedAdamW (one of 4 ranks' shards, ZeRO-2) with the device verdict
    (verdict_on_device, then multi_launches(verdict=...)) against its host verdict (the sum
    of unscaled squares read back, unscale_and_clip, update, multi_launches(factor)),
    through PLAN: shards, masters, m, v bitwise; after settle() the step count and scale."""
    np_dtype(amp_dtype)
    ref, got = (zm.sharded(zm.gpt, 4, 1, 2, "float32", amp_dtype) for _ in range(2))
    for opt in (ref, got):
        opt.amp.scaler.scale, opt.amp.scaler.growth_interval = 1024.0, 2     # bf16 too
        assert opt.amp.optimizers == [opt]       # adopted: the one optimizer of its policy
    for step, (size, inf, max_norm) in enumerate(PLAN):
        for opt in (ref, got):
            zm.set_grads(opt, step, size * opt.amp.scaler.multiplier())
            if inf:
                opt.engine.units[0].grad_shard[0] = np.inf
            opt.amp.scaled_upstream()
        grads = [u.grad_shard for u in ref.engine.units]
        sum_sq = run_sum_sq(grads, 1.0 / ref.amp.scaler.scale, None, "low")
        _, found_inf, factor = ref.amp.scaler.unscale_and_clip(sum_sq, max_norm, None)
        if ref.amp.scaler.update(found_inf):
            zm.multi_update(ref, factor)
        verdict, _ = run_verdict(got.amp.scaler, [u.grad_shard for u in got.engine.units],
                                 max_norm, got.steps, got.param_groups[0])
        for launch, tables in got.multi_launches(chunk=CHUNK, verdict=verdict):
            cuda_cpu.run(launch, None, "low", tables)
        want, have = ref.shard_arrays(), got.shard_arrays()
        for key in want:
            np.testing.assert_array_equal(zm.bits(have[key]), zm.bits(want[key]),
                                          err_msg=f"step {step}: {key}")
    got.settle()
    assert (got.steps, got.amp.scaler.scale, got.amp.scaler.skipped) == (
        ref.steps, ref.amp.scaler.scale, ref.amp.scaler.skipped) == (len(PLAN) - 3, 1024.0, 3)
