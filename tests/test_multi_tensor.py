"""The multi-tensor optimizer kernels without running them (their CPU runs are
tests/test_multi_tensor_cpu.py): every plan's arguments against the kernel's declared
parameters, nvcc compiles the part with those widths (where a toolkit is installed), the
optimizers' state bookkeeping for one launch per group, the --amp factor rounded to float32
as numpy rounds it, numpy never routed to them (clip_grad_norm unchanged bit for bit); and,
gpu-marked, the multi path against the per-parameter path on cupy.
Run: python -m pytest -q tests/test_multi_tensor.py
     python -m pytest -m gpu --device cuda tests/test_multi_tensor.py   (on a GPU)
"""

import numpy as np
import pytest

from minidist import backend
from minidist.autograd import cuda_kernels as ck, cuda_source as cs
from minidist.optim import AdamW, FlatAdamW, clip_grad_norm, multi_tensor as mt
from minidist.optim.clip import local_sum_sq
from minidist.train.amp import MixedPrecision
from minidist.train.loss_scale import LossScaler
import cuda_cpu
from test_cuda_kernels_cpu import np_dtype
from test_multi_tensor_cpu import HYPER, SIZES, SUM_TOL, Bag, set_grads


def plans(dtype):
    """Each multi kernel's launch for gradient dtype `dtype`, planned with numpy arrays."""
    r = np.random.default_rng(0)
    t = [r.standard_normal(n).astype(np_dtype(dtype)) for n in (3, 1025)]
    f = [np.zeros(n, np.float32) for n in (3, 1025)]
    out = {"multi_sum_sq": mt.multi_sum_sq_launches(np, t, 0.5)[0]}
    if dtype in ("float32", "float64"):
        out["multi_adamw"] = [mt.multi_adamw_launch(np, t, t, t, t, 2, 1e-3, 0.9, 0.95,
                                                    1e-8, 0.1)[0]]
        out["multi_scale"] = [mt.multi_scale_launch(np, t, np.asarray(0.5))[0]]
    else:
        out["multi_amp_adamw"] = [mt.multi_amp_adamw_launch(np, t, t, f, f, f, 0.25, 2, 1e-3,
                                                            0.9, 0.95, 1e-8, 0.1)[0]]
        verdict = np.zeros(mt.VERDICT_SIZE, np.float32)
        out["multi_amp_adamw_dev"] = [mt.multi_amp_adamw_dev_launch(np, t, t, f, f, f, 0.99,
                                                                    verdict)[0]]
        out["amp_verdict"] = [mt.amp_verdict_launch(
            np.zeros(1), np.zeros(len(mt.STATE_FIELDS)), verdict, t[0].dtype, 1.0,
            LossScaler(), 1e-3, 0.9, 0.95, 1e-8)]
    return out


def test_a_table_of_the_wrong_dtype_size_or_layout_is_refused():
    """The kernel casts each address to its role's type: a float32 master where a 16-bit
    weight belongs, a float64 m in a float32 group, a strided view or a size that differs
    from the parameter's would read or write the wrong bytes, so the plan refuses them."""
    h = [np.zeros(n, np.float16) for n in (3, 5)]
    f = [np.zeros(n, np.float32) for n in (3, 5)]
    with pytest.raises(ValueError, match="table #0"):
        mt.multi_amp_adamw_launch(np, f, h, f, f, f, 0.5, 1, 1e-3, 0.9, 0.95, 1e-8, 0.0)
    with pytest.raises(ValueError, match="table #2.*float32"):
        mt.multi_adamw_launch(np, f, f, [f[0], f[1].astype(np.float64)], f, 1, 1e-3, 0.9,
                              0.95, 1e-8, 0.0)
    with pytest.raises(ValueError, match="table #1"):
        mt.multi_adamw_launch(np, f, [f[0], np.zeros(10, np.float32)[::2]], f, f, 1, 1e-3,
                              0.9, 0.95, 1e-8, 0.0)
    with pytest.raises(ValueError, match="table #3"):
        mt.multi_adamw_launch(np, f, f, f, [f[0], np.zeros(6, np.float32)], 1, 1e-3, 0.9,
                              0.95, 1e-8, 0.0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_every_multi_launch_hands_the_kernel_its_declared_types(dtype):
    """T* tables point at the gradient dtype (checked by the harness, above); here each
    argument against the parameter list: unsigned long long* uint64, int* int32, long
    long* int64, A* the accumulation dtype, float and A scalars numpy scalars of exactly
    that width (a Python float would be a double)."""
    acc = ck.acc_dtype(dtype).name
    want = {"A": acc, "float": "float32", "long long": "int64", "int": "int32",
            "unsigned long long": "uint64", "double": "float64"}
    for key, launches in plans(dtype).items():
        for plan in launches:
            assert cs.part_of(plan.name) == "multi" and cs.dtype_name(plan.dtype) == dtype
            params, args = cs.signature(plan.name), ck.describe(plan.args)
            assert len(params) == len(args), f"{plan.name}: {len(args)} for {len(params)}"
            for i, ((ctype, pointer), arg) in enumerate(zip(params, args)):
                kind = ("array" if pointer else "scalar", want[ctype])
                assert arg[:2] == kind, f"{plan.name} argument #{i} ({ctype}): {arg}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_nvcc_compiles_the_multi_kernels(dtype, tmp_path):
    """Where a CUDA toolkit is installed (no GPU needed): the part compiles for sm_90 and
    each kernel's PTX parameters have the planned widths."""
    text = cuda_cpu.nvcc_ptx(cs.source(dtype, "multi"), tmp_path)
    for launches in plans(dtype).values():
        for plan in launches:
            assert cuda_cpu.ptx_params(text, plan.name) == cuda_cpu.planned_widths(plan), \
                plan.name


def test_the_factor_is_rounded_to_float32_as_numpy_does():
    """`float32_buffer *= factor` (amp.unscaled) multiplies by float32(factor), rounded to
    nearest: the plan passes exactly that value (NEP 50: a Python float is weak)."""
    factor = 0.7 / 1024.0 / 3.0
    buf = np.array([1.0, 3.0, 1 / 3], np.float32)
    want = buf * np.float32(factor)
    buf *= factor
    np.testing.assert_array_equal(buf, want)
    a = [np.ones(3, np.float16)]
    f = [np.ones(3, np.float32)]
    plan, _ = mt.multi_amp_adamw_launch(np, a, a, f, f, f, factor, 1, 1e-3, 0.9, 0.95, 1e-8,
                                        0.0)
    assert plan.args[9] == np.float32(factor) and plan.args[9].dtype == np.float32


def test_clip_grad_norm_on_numpy_is_unchanged_with_the_switch_on(monkeypatch):
    """MINIDIST_CUDA_NEW_KERNELS=1 changes nothing on numpy: the same gradients after the
    clip, the same norm, bit for bit."""
    grads = [np.random.default_rng(4).standard_normal(s).astype(np.float32) for s in SIZES]
    runs = []
    for new in "01":
        monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", new)
        g = [a.copy() for a in grads]
        runs.append((clip_grad_norm(g, 1.0), g))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        np.testing.assert_array_equal(a, b)


def test_numpy_arrays_never_take_the_multi_kernels(monkeypatch):
    """The CPU path is unchanged: numpy arrays never qualify, even with the switch on."""
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "1")
    a = [np.zeros(3, np.float32)]
    assert not mt.use_multi(a, a, a, a) and not mt.use_multi()


def test_advance_states_makes_m_v_and_refuses_mixed_step_counts():
    a, b = np.ones(3, np.float32), np.ones(5, np.float32)
    state = {"x": {"step": 2, "exp_avg": a + 1, "exp_avg_sq": a + 2}, "y": {"step": 1}}
    assert mt.advance_states(state, ["x", "y"], [a, b]) is None
    assert state["x"]["step"] == 2 and state["y"] == {"step": 1}          # nothing changed
    fresh = {}
    s = mt.advance_states(fresh, ["x", "y"], [a, b])
    assert [t["step"] for t in s] == [1, 1] and s[0] is fresh["x"]
    assert s[1]["exp_avg"].shape == (5,) and not s[1]["exp_avg_sq"].any()


# ---- on a GPU: the multi path against the per-parameter path on cupy -------------------------

@pytest.fixture
def cp(device):
    if device != "cuda":
        pytest.skip("needs --device cuda")
    return backend.get_xp()


def on_gpu(cp, model):
    for p in model.parameters():
        p.data = cp.asarray(p.data)
    return model


def gpu_grads(cp, model, step, scale=1.0):
    set_grads(model, step, scale)
    for p in model.parameters():
        p.grad = cp.asarray(p.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_multi_adamw_equals_per_parameter_kernels(cp, monkeypatch, dtype, flat):
    """AdamW / FlatAdamW with MINIDIST_CUDA_NEW_KERNELS=1 (one multi_adamw per group) vs =0
    (one adamw_step per parameter, or per flat group): bitwise, the same arithmetic (should
    NVRTC contract the two kernels' expressions differently, this is where it shows); the
    FlatAdamW on the multi path holds no flat gradient."""
    cls = FlatAdamW if flat else AdamW
    models = [on_gpu(cp, Bag(dtype)) for _ in range(2)]
    opts = [cls(m.named_parameters(), **HYPER) for m in models]
    for step in range(3):
        for new, model, opt in zip("01", models, opts):
            monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", new)
            gpu_grads(cp, model, step)
            opt.step()
    for a, b in zip(*(m.parameters() for m in models)):
        cp.testing.assert_array_equal(b.data, a.data)
    if flat:                         # the multi path never made a flat gradient
        assert [f.grad is None for f in opts[0].flats + opts[1].flats] == [False] * 2 + [True] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_multi_amp_adamw_equals_master_weight_optimizer(cp, monkeypatch, dtype):
    """MasterWeightOptimizer.step with the switch on (one multi_amp_adamw per group) vs off
    (per parameter: unscale, adamw_step, copy back): bitwise, given the same factor (the
    norm is measured with the switch off for both; multi_sum_sq differs in rounding)."""
    np_dtype(dtype)
    runs = []
    for new in "01":
        amp = MixedPrecision(LossScaler(init_scale=1024.0), dtype=dtype)
        model = amp.cast_model(on_gpu(cp, Bag(np.float32)))
        amp.scaler.scale = 1024.0
        opt = amp.optimizer(model.named_parameters(), lambda n: AdamW(n, **HYPER))
        for step in range(3):
            gpu_grads(cp, model, step, 1024.0)
            amp.scaled_upstream()
            monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "0")
            opt.clip_grad_norm(5.0)
            monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", new)
            assert opt.step()
        runs.append((model, opt))
    (ma, oa), (mb, ob) = runs
    for a, b, xa, xb in zip(ma.parameters(), mb.parameters(), oa.master, ob.master):
        cp.testing.assert_array_equal(xb.data, xa.data)
        cp.testing.assert_array_equal(b.data.view(cp.uint16), a.data.view(cp.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_gpu_multi_sum_sq_equals_the_xp_sum_to_rounding(cp, monkeypatch, dtype):
    grads = [cp.asarray((np.random.default_rng(7).standard_normal(s) * 300)
                        .astype(np_dtype(dtype))) for s in SIZES]
    amp = MixedPrecision(LossScaler(init_scale=1024.0), dtype=dtype)
    sums = []
    for new in "01":
        monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", new)
        sums.append(float(amp.unscaled_sum_sq(grads) if dtype in ("float16", "bfloat16")
                          else local_sum_sq(grads)))
    np.testing.assert_allclose(sums[1], sums[0], rtol=SUM_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_clip_grad_norm_with_the_multi_kernels(cp, monkeypatch, dtype):
    """clip_grad_norm on cupy with the switch on (multi_sum_sq, multi_scale) vs off: the
    norm to rounding (another summation order), the clipped gradients likewise."""
    grads = [cp.asarray((np.random.default_rng(4).standard_normal(s) * 3).astype(dtype))
             for s in SIZES]
    runs = []
    for new in "01":
        monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", new)
        g = [a.copy() for a in grads]
        runs.append((float(clip_grad_norm(g, 1.0)), g))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=SUM_TOL[dtype])
    for a, b in zip(runs[0][1], runs[1][1]):
        cp.testing.assert_allclose(b, a, rtol=SUM_TOL[dtype], atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_the_device_verdict_matches_the_host_verdict(cp, monkeypatch, dtype):
    """MasterWeightOptimizer with the switch on (the verdict on the device: no host read in
    clip_grad_norm + step) vs off (the host verdict, per parameter), through an overflow
    and a clip: the same steps skipped, the same scale and step counts after settle(), the
    masters equal to float32 rounding (the two sums of squares round differently)."""
    np_dtype(dtype)
    runs = []
    for new in "10":
        monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", new)
        amp = MixedPrecision(LossScaler(init_scale=1024.0, growth_interval=2), dtype=dtype)
        model = amp.cast_model(on_gpu(cp, Bag(np.float32)))
        amp.scaler.scale, amp.scaler.growth_interval = 1024.0, 2
        opt = amp.optimizer(model.named_parameters(), lambda n: AdamW(n, **HYPER))
        reads = backend.host_reads().get("amp overflow verdict", 0)
        for step, inf in enumerate((False, False, True, False)):
            gpu_grads(cp, model, step, float(amp.scaler.multiplier()))
            if inf:
                model.p0.grad[0] = cp.inf
            amp.scaled_upstream()
            opt.clip_grad_norm(5.0)
            opt.step()
        host_reads = backend.host_reads().get("amp overflow verdict", 0) - reads
        assert host_reads == (0 if new == "1" else 4)
        amp.settle()
        runs.append((model, opt, amp.scaler))
    (ma, oa, sa), (mb, ob, sb) = runs
    assert (sa.scale, sa.skipped, sa.good_steps) == (sb.scale, sb.skipped, sb.good_steps)
    assert {s["step"] for s in oa.inner.state.values()} == {3}
    assert {s["step"] for s in ob.inner.state.values()} == {3}
    for xa, xb in zip(oa.master, ob.master):
        cp.testing.assert_allclose(xa.data, xb.data, rtol=1e-5, atol=1e-6)
