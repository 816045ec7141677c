"""ZeRO's ShardedAdamW on the multi-tensor kernels (minidist/zero/optim.py `multi_launches`,
what update_shards runs on cupy with MINIDIST_CUDA_NEW_KERNELS=1) RUN on the CPU through
tests/cuda_cpu.py, against the per-unit xp path (update_shards on numpy), bitwise, step
after step: the shard, m, v (and the float32 master and the 16-bit shard under --amp).

The engines are real ones (zero_engine on a one-rank group) over FlatUnits cut for a
simulated world: rank r of N owns [lo, hi) of every unit, so shards cut through parameters,
hold decayed and undecayed runs, and, for a small unit, padding only. The gradient shards are
random everywhere, the padding included, so a plan that leaves a run out fails. Two launches
per step (the decayed runs, the rest) whatever the number of units; one without weight decay.
EP's experts optimizer is a ShardedAdamW over expert_engine's units: the same path.
Broken plans (the decay on the other table, the undecayed table left out) must fail.
Run: python -m pytest -q tests/test_zero_multi_cpu.py   (skips without a C++ compiler)
"""
import argparse

import numpy as np
import pytest

import cuda_cpu
from minidist import backend
from minidist.backend import to_host, xp_of
from minidist.nn import GPT, GPTConfig, Parameter
from minidist.optim import multi_tensor as mt
from minidist.train.amp import MixedPrecision
from minidist.train.loss_scale import LossScaler
from minidist.zero.flat import FlatUnit, gpt_units
from minidist.zero.optim import ShardedAdamW
from minidist.zero.engine import zero_engine
from test_cuda_kernels_cpu import ORDERS, np_dtype
from test_multi_tensor_cpu import Bag

pytestmark = pytest.mark.skipif(cuda_cpu.reason_unavailable() is not None,
                                reason=str(cuda_cpu.reason_unavailable()))

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=18, block_size=8, vocab_size=31)
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CHUNK = 300                  # several blocks for the longer runs
FACTOR = 0.7 / 1024.0        # --amp: 1/S x a clip factor


def one_rank(name):
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    return ProcessGroup(MPI.COMM_SELF, name=name)


def prepare(model, on, amp):
    """model's arrays through `on` (to_host for the CPU harness, cupy.asarray on a GPU),
    then 16-bit by `amp`'s cast_model if given."""
    for p in model.parameters():
        p.data = on(p.data)
    return model if amp is None else amp.cast_model(model)


def gpt(world, rank, dtype, on=to_host, amp=None):
    """A small GPT and its ZeRO units (the root and one per block)."""
    model = prepare(GPT(CONFIG, seed=3, dtype=dtype), on, amp)
    return model, gpt_units(model, world, rank)


def bag(world, rank, dtype, on=to_host, amp=None):
    """The Bag's odd sizes in three units: undecayed p0 alone (1 element: at world 8, ranks
    1..7 hold padding only); decayed p3, an empty decayed matrix, undecayed p1, decayed p4;
    decayed p2 alone."""
    model = Bag(dtype)
    model.empty = Parameter(np.zeros((0, 5), dtype))
    model = prepare(model, on, amp)
    p = dict(model.named_parameters())
    layout = {"a": ["p0"], "b": ["p3", "empty", "p1", "p4"], "c": ["p2"]}
    return model, [FlatUnit(name, [(n, p[n]) for n in names], world, rank)
                   for name, names in layout.items()]


def sharded(build, world, rank, stage, dtype, amp_dtype=None, weight_decay=0.1, on=to_host):
    """A ShardedAdamW over a real engine (one-rank group, units cut for rank `rank` of
    `world`); under --amp over the 16-bit model with its float32 masters."""
    amp = None
    if amp_dtype is not None:
        amp = MixedPrecision(LossScaler(init_scale=1024.0), dtype=amp_dtype)
    model, units = build(world, rank, dtype, on, amp)
    engine = zero_engine(model, one_rank("dp"), stage, units)
    return ShardedAdamW(engine, **{**HYPER, "weight_decay": weight_decay}, amp=amp)


def set_grads(opt, step, scale=1.0):
    """Random gradient shards, the padding too (it is part of a run)."""
    r = np.random.default_rng(100 + step)
    for u in opt.engine.units:
        g = (r.standard_normal(u.grad_shard.size) * scale).astype(u.grad_shard.dtype)
        u.grad_shard[...] = xp_of(u.grad_shard).asarray(g)


def multi_update(opt, factor=None, src=None, order="low", broken=None):
    """What update_shards does on cupy with the switch on, on the CPU: the step count
    advanced, then multi_launches' plans run by the harness. Returns the plans."""
    opt.steps += 1
    plans = opt.multi_launches(factor, chunk=CHUNK)
    for launch, tables in (broken(plans) if broken else plans):
        cuda_cpu.run(launch, src, order, tables)
    return plans


def bits(a):
    return a.view(f"u{a.itemsize}")


def check(build, world, rank, stage, dtype, amp_dtype=None, order="low", steps=3,
          broken=None, weight_decay=0.1):
    """The multi path equals update_shards' xp path bitwise after every step; returns the
    plans of the last step."""
    ref = sharded(build, world, rank, stage, dtype, amp_dtype, weight_decay)
    got = sharded(build, world, rank, stage, dtype, amp_dtype, weight_decay)
    assert not ref.multi_ok()                           # numpy: the per-unit path
    factor = FACTOR if amp_dtype else None
    for step in range(steps):
        set_grads(ref, step, 1024.0 if amp_dtype else 1.0)
        set_grads(got, step, 1024.0 if amp_dtype else 1.0)
        ref.update_shards(factor)
        plans = multi_update(got, factor, order=order, broken=broken)
        want, have = ref.shard_arrays(), got.shard_arrays()
        assert want.keys() == have.keys()
        for key in want:
            np.testing.assert_array_equal(bits(have[key]), bits(want[key]),
                                          err_msg=f"step {step}: {key}")
    if amp_dtype:
        assert got.engine.units[0].param_shard.dtype == np_dtype(amp_dtype)
    return plans


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("stage", [1, 3])
def test_gpt_shards_float32_bitwise(stage, order):
    for rank in (0, 3):
        check(gpt, 4, rank, stage, "float32", order=order)


@pytest.mark.parametrize("rank", [0, 6, 7])
def test_odd_units_float64_and_a_shard_of_padding_only_bitwise(rank):
    plans = check(bag, 8, rank, 2, "float64")
    runs = [len(tables[0]) for _, tables in plans]
    _, units = bag(8, rank, "float64")
    assert runs == [sum(len(u.update_ranges()[k]) for u in units) for k in (0, 1)]
    assert units[0].decay_ranges() == [] and (units[0].lo >= units[0].numel) == (rank > 0)


@pytest.mark.parametrize("amp_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("build", [gpt, bag])
def test_amp_shards_bitwise(build, amp_dtype):
    np_dtype(amp_dtype)                                 # skips bfloat16 without ml_dtypes
    world, rank = (4, 1) if build is gpt else (8, 6)
    plans = check(build, world, rank, 2, "float32", amp_dtype)
    assert [p.name for p, _ in plans] == ["multi_amp_adamw"] * 2


def test_two_launches_per_step_whatever_the_units_one_without_decay():
    opt = sharded(gpt, 4, 2, 1, "float32")
    opt.steps = 1
    plans = opt.multi_launches()
    decayed, plain = (sum(len(u.flat.update_ranges()[k]) for u in opt.engine.units)
                      for k in (0, 1))
    assert len(opt.engine.units) == 3 and decayed >= 3 and plain >= 3    # 7 runs, 2 launches
    assert [(p.name, len(t[0])) for p, t in plans] == [("multi_adamw", decayed),
                                                       ("multi_adamw", plain)]
    sizes = [a.size for _, t in plans for a in t[0]]
    assert sum(sizes) == sum(u.flat.shard_size for u in opt.engine.units)
    plans = check(gpt, 4, 2, 1, "float32", weight_decay=0.0, steps=2)
    assert [len(t[0]) for _, t in plans] == [3]        # one run per shard


def test_update_ranges_cover_the_shard_once():
    _, units = bag(8, 0, "float32")
    for u in units + gpt(4, 1, "float32")[1] + gpt(3, 2, "float32")[1]:
        decayed, plain = u.update_ranges()
        runs = sorted(decayed + plain)
        assert runs[0][0] == 0 and runs[-1][1] == u.shard_size
        assert all(a < b for a, b in runs) and all(x[1] == y[0] for x, y in zip(runs, runs[1:]))
        assert all(x[1] != y[0] for x, y in zip(decayed, decayed[1:]))        # merged
        assert sum(b - a for a, b in decayed) == sum(b - a for a, b in u.decay_ranges())


@pytest.mark.parametrize("amp_dtype", [None, "float16"])
def test_experts_optimizer_takes_the_same_path_bitwise(amp_dtype):
    """EP's experts optimizer (minidist/ep/optim.py) is a ShardedAdamW over expert_engine's
    units (one flat unit of experts per MoE block, ZeRO-1 over edp): one process, ep and edp
    groups of one rank; under --amp stepped by update_shards(factor), as DenseAndExperts
    does."""
    from minidist.ep.exchange import attach_experts
    from minidist.ep.optim import expert_engine, experts_optimizer
    config = GPTConfig(n_layer=2, n_head=2, n_embd=18, block_size=8, vocab_size=31,
                       moe_experts=2)
    args = argparse.Namespace(optimizer="adamw", lr=1e-2, weight_decay=0.1, beta1=0.9,
                              beta2=0.95)
    opts = []
    for _ in range(2):
        amp = None
        if amp_dtype is not None:
            amp = MixedPrecision(LossScaler(init_scale=1024.0), dtype=amp_dtype)
        model = prepare(GPT(config, seed=3, dtype="float32"), to_host, amp)
        attach_experts(model, one_rank("ep"))
        opts.append(experts_optimizer(expert_engine(model, one_rank("edp")), args, amp))
    ref, got = opts
    assert type(got) is ShardedAdamW and len(got.engine.units) == 2
    factor = FACTOR if amp_dtype else None
    for step in range(2):
        set_grads(ref, step, 1024.0 if amp_dtype else 1.0)
        set_grads(got, step, 1024.0 if amp_dtype else 1.0)
        ref.update_shards(factor)
        plans = multi_update(got, factor)
        for key, want in ref.shard_arrays().items():
            np.testing.assert_array_equal(bits(got.shard_arrays()[key]), bits(want), key)
    masters = [k for k in got.shard_arrays() if k.endswith("/master")]
    assert len(plans) == 2 and len(masters) == (2 if amp_dtype else 0)


# ---- broken plans must fail -----------------------------------------------------------------

def swap_decay(plans):
    """The weight decay of each table given to the other (args[-4]: `decay`, both kernels)."""
    (a, ta), (b, tb) = plans
    da, db = a.args[-4], b.args[-4]
    return [(a._replace(args=a.args[:-4] + (db,) + a.args[-3:]), ta),
            (b._replace(args=b.args[:-4] + (da,) + b.args[-3:]), tb)]


BROKEN = {"the decay on the other table": swap_decay,
          "the undecayed runs (and the padding) left out": lambda plans: plans[:1]}


@pytest.mark.parametrize("amp_dtype", [None, "float16"])
@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_plan_fails(name, amp_dtype):
    with pytest.raises(AssertionError, match="step 0"):
        check(gpt, 4, 1, 1, "float32", amp_dtype, broken=BROKEN[name])


def test_numpy_never_takes_the_multi_path(monkeypatch):
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "1")
    assert not sharded(gpt, 4, 0, 1, "float32").multi_ok()
    assert not mt.use_multi([np.zeros(3, np.float32)])


# ---- on a GPU: the multi path against the per-unit path on cupy ----------------------------

@pytest.fixture
def cp(device):
    if device != "cuda":
        pytest.skip("needs --device cuda")
    return backend.get_xp()


@pytest.mark.gpu
@pytest.mark.parametrize("amp_dtype", [None, "float16", "bfloat16"])
def test_gpu_sharded_adamw_multi_equals_per_unit(cp, monkeypatch, amp_dtype):
    """update_shards with MINIDIST_CUDA_NEW_KERNELS=1 (two launches) vs =0 (per unit: the
    decay multiplies, adamw_step, under amp the unscale and copy back): bitwise; and the
    kernels one step launches, counted (CUPTI, minidist/kernel_count.py)."""
    if amp_dtype:
        np_dtype(amp_dtype)
    opts = [sharded(gpt, 4, 1, 1, "float32", amp_dtype, on=cp.asarray) for _ in range(2)]
    for step in range(3):
        for new, opt in zip("10", opts):
            monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", new)
            set_grads(opt, step, 1024.0 if amp_dtype else 1.0)
            assert opt.multi_ok() == (new == "1")
            opt.update_shards(FACTOR if amp_dtype else None)
    want, have = opts[1].shard_arrays(), opts[0].shard_arrays()
    for key in want:
        cp.testing.assert_array_equal(bits(have[key]), bits(want[key]), err_msg=key)
    from minidist.kernel_count import KernelCounter
    counter, counts = KernelCounter(), []
    for new, opt in zip("10", opts):                  # tables cached: kernels only
        monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", new)
        set_grads(opt, 3, 1024.0 if amp_dtype else 1.0)
        with counter:
            opt.update_shards(FACTOR if amp_dtype else None)
        counts.append(counter.count)
    assert counts[0] == 2 and counts[1] > len(opts[1].engine.units), counts


@pytest.mark.gpu
@pytest.mark.parametrize("amp_dtype", ["float16", "bfloat16"])
def test_gpu_sharded_adamw_takes_the_verdict_on_the_device(cp, monkeypatch, amp_dtype):
    """clip_grad_norm + step with the switch on (the verdict on the device: no host read)
    vs off (the host verdict), through an overflow: the same steps and scale after settle(),
    the shards equal to float32 rounding (the two sums of squares round differently)."""
    np_dtype(amp_dtype)
    runs = []
    for new in "10":
        monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", new)
        opt = sharded(gpt, 4, 1, 2, "float32", amp_dtype, on=cp.asarray)
        reads = backend.host_reads().get("amp overflow verdict", 0)
        for step, inf in enumerate((False, True, False)):
            set_grads(opt, step, float(opt.amp.scaler.multiplier()))
            if inf:
                opt.engine.units[0].grad_shard[0] = cp.inf
            opt.amp.scaled_upstream()
            opt.clip_grad_norm(1.0)
            opt.step()
        assert backend.host_reads().get("amp overflow verdict", 0) - reads == (
            0 if new == "1" else 3)
        opt.amp.settle()
        runs.append(opt)
    dev, host = runs
    assert (dev.steps, dev.amp.scaler.scale) == (host.steps, host.amp.scaler.scale) == (
        2, host.amp.scaler.scale)
    want, have = host.shard_arrays(), dev.shard_arrays()
    for key in want:
        cp.testing.assert_allclose(have[key].astype(cp.float32), want[key].astype(cp.float32),
                                   rtol=1e-2, atol=1e-5, err_msg=key)
