"""--amp --grad-dtype float32: the optimizer kernels over float32 gradients, run on the CPU.

    kernels      multi_amp_adamw_g32, multi_amp_adamw_dev_g32 (float32 gradients, 16-bit
                 weights) RUN on the CPU (tests/cuda_cpu.py) bitwise against the xp step,
                 the host verdict, and ZeRO's per-unit update; their plans' argument types

    python -m pytest -q tests/test_fp32_grads_kernels.py
"""
import numpy as np
import pytest

import cuda_cpu
from minidist.autograd import cuda_kernels as ck, cuda_source as cs
from minidist.optim import AdamW, multi_tensor as mt
from minidist.train.amp import MixedPrecision
from minidist.train.loss_scale import LossScaler
from test_cuda_kernels_cpu import ORDERS, np_dtype
from test_device_verdict_cpu import PLAN, device_step, host_step
from test_multi_tensor_cpu import CHUNK, HYPER, Bag, assert_amp_same
from tests.fp32_grads_cases import one_rank


needs_cxx = pytest.mark.skipif(cuda_cpu.reason_unavailable() is not None,
                               reason=str(cuda_cpu.reason_unavailable()))


# ---- the optimizer kernels over float32 gradients, run on the CPU ---------------------------

def amp32(dtype, init_scale=1024.0, growth_interval=2):
    """A Bag under --amp with float32 gradients and its MasterWeightOptimizer (AdamW)."""
    amp = MixedPrecision(LossScaler(init_scale=init_scale, growth_interval=growth_interval),
                         dtype=dtype, grad_dtype="float32")
    model = amp.cast_model(Bag(np.float32))
    amp.scaler.scale, amp.scaler.growth_interval = init_scale, growth_interval   # bf16 too
    return amp, model, amp.optimizer(model.named_parameters(), lambda n: AdamW(n, **HYPER))


def set_grads32(model, amp, step, size=1.0, inf=False):
    """float32 gradients as backward from a loss x S leaves them, an inf if asked."""
    r = np.random.default_rng(100 + step)
    for p in model.parameters():
        p.grad = (r.standard_normal(p.shape) * size * amp.scaler.multiplier()).astype(
            np.float32)
    if inf:
        next(iter(model.parameters())).grad.reshape(-1)[0] = np.inf
    amp.scaled_upstream()


@needs_cxx
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_multi_amp_adamw_g32_equals_the_master_weight_optimizer_bitwise(dtype, order):
    """multi_amp_adamw_g32 (16-bit weights, float32 gradients, the factor of the xp step's
    verdict, clipped) leaves the masters, m, v and the 16-bit weights of
    MasterWeightOptimizer.step, step after step."""
    np_dtype(dtype)
    (amp_r, ref, opt_r), (amp_g, got, opt_g) = (amp32(dtype, growth_interval=2000)
                                                for _ in range(2))   # one scale throughout
    for step in range(3):
        set_grads32(ref, amp_r, step), set_grads32(got, amp_g, step)
        norm = opt_r.clip_grad_norm(5.0)
        found_inf, factor = amp_r.scaler.verdict(norm, 5.0)
        assert not found_inf and factor < 1 / 1024.0 and opt_r.step()
        named = dict(got.named_parameters())
        for group in opt_g.inner.param_groups:
            masters = [m.data for m in group["params"]]
            w = [named[n] for n in group["names"]]
            states = mt.advance_states(opt_g.inner.state, group["names"], masters)
            plan_, tables = mt.group_amp_adamw_launch(np, [p.data for p in w],
                                                      [p.grad for p in w], masters, states,
                                                      group, factor, chunk=CHUNK)
            assert plan_.name == "multi_amp_adamw_g32" and plan_.dtype == np_dtype(dtype)
            cuda_cpu.run(plan_, None, order, tables)
        assert_amp_same(ref, opt_r, got, opt_g, dtype, f"step {step}")


@needs_cxx
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_device_verdict_over_float32_gradients_equals_the_host_verdict(dtype):
    """tests/test_device_verdict_cpu.py's plan (overflows, a growing and shrinking scale,
    clipping) with float32 gradients: amp_verdict and multi_amp_adamw_dev_g32 against the
    host verdict and multi_amp_adamw_g32, bitwise, and the scaler after settle()."""
    np_dtype(dtype)
    ref, got = amp32(dtype), amp32(dtype)
    for step, (size, inf, max_norm) in enumerate(PLAN):
        for amp, model, _ in (ref, got):
            set_grads32(model, amp, step, size, inf)
        norm_r, norm_g = host_step(*ref, max_norm), device_step(*got, max_norm)
        assert norm_g == norm_r or (np.isnan(norm_g) and np.isnan(norm_r)), step
        assert_amp_same(ref[1], ref[2], got[1], got[2], dtype, f"step {step}")
    got[0].settle()
    sr, sg = ref[0].scaler, got[0].scaler
    assert (sg.scale, sg.skipped) == (sr.scale, sr.skipped) and sr.skipped == 3


@needs_cxx
@pytest.mark.parametrize("amp_dtype", ["float16", "bfloat16"])
def test_zero_shards_of_float32_gradients_take_the_g32_kernel_bitwise(amp_dtype):
    """ShardedAdamW over ZeRO-2's float32 gradient shards (rank 1 of 4: shards cut through
    parameters, decayed and undecayed runs): multi_launches' multi_amp_adamw_g32 plans
    against update_shards' per-unit xp path, bitwise."""
    import test_zero_multi_cpu as zm
    from minidist.zero.engine import zero_engine
    from minidist.zero.optim import ShardedAdamW
    np_dtype(amp_dtype)

    def sharded():
        amp = MixedPrecision(LossScaler(init_scale=1024.0), dtype=amp_dtype,
                             grad_dtype="float32")
        model, units = zm.gpt(4, 1, "float32", amp=amp)
        return ShardedAdamW(zero_engine(model, one_rank("dp"), 2, units), **zm.HYPER,
                            amp=amp)
    ref, got = sharded(), sharded()
    assert {u.grad_shard.dtype.name for u in got.engine.units} == {"float32"}
    for step in range(3):
        zm.set_grads(ref, step, 1024.0), zm.set_grads(got, step, 1024.0)
        ref.update_shards(zm.FACTOR)
        plans = zm.multi_update(got, zm.FACTOR)
        assert {launch.name for launch, _ in plans} == {"multi_amp_adamw_g32"}
        want, have = ref.shard_arrays(), got.shard_arrays()
        for key in want:
            np.testing.assert_array_equal(zm.bits(have[key]), zm.bits(want[key]),
                                          err_msg=f"step {step}: {key}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_g32_plans_hand_their_kernels_the_declared_types(dtype):
    """Each g32 launch's arguments against the kernel's parameter list (the weights' table is
    T*, the gradients' float*: the plan refuses a table of another dtype); 16-bit
    gradients still plan the 16-bit kernels; float32 weights are refused."""
    half = np_dtype(dtype)
    w = [np.zeros(n, half) for n in (3, 1025)]
    f = [np.zeros(n, np.float32) for n in (3, 1025)]
    verdict = np.zeros(mt.VERDICT_SIZE, np.float32)
    plans = [mt.multi_amp_adamw_launch(np, w, f, f, f, f, 0.25, 2, 1e-3, 0.9, 0.95, 1e-8,
                                       0.1),
             mt.multi_amp_adamw_dev_launch(np, w, f, f, f, f, 0.99, verdict)]
    want = {"float": "float32", "long long": "int64", "int": "int32",
            "unsigned long long": "uint64"}
    for launch, tables in plans:
        assert launch.name.endswith("_g32") and launch.dtype == half
        assert [a.dtype for a in tables[0]] == [half] * 2
        assert [a.dtype.name for a in tables[1]] == ["float32"] * 2
        params, args = cs.signature(launch.name), ck.describe(launch.args)
        assert len(params) == len(args), launch.name
        for (ctype, pointer), arg in zip(params, args):
            assert arg[0] == ("array" if pointer else "scalar"), (launch.name, ctype, arg)
            assert arg[1] == want[ctype], (launch.name, ctype, arg)
    assert mt.multi_amp_adamw_launch(np, w, w, f, f, f, 0.25, 2, 1e-3, 0.9, 0.95, 1e-8,
                                     0.1)[0].name == "multi_amp_adamw"
    with pytest.raises(ValueError, match="16-bit weights wanted"):
        mt.multi_amp_adamw_launch(np, f, f, f, f, f, 0.25, 2, 1e-3, 0.9, 0.95, 1e-8, 0.1)
