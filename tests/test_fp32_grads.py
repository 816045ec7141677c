"""--amp --grad-dtype float32 (minidist/train/amp.py; Megatron-LM's main_grad): the gradients
of the 16-bit model accumulate over micro-batches and are reduced over ranks in float32.

    the point    m = 32 micro-batches added in float32 land ~1e5x closer to the float64 sum
                 of the same micro-batch gradients than added in 16 bits, and about 2x closer
                 to a float64 model's gradient (float16 and bfloat16)
    the engine   every parameter's .grad is float32 and C-contiguous, recompute or not
    buffers      DDP's buckets, ZeRO's flat units (stages 1-3) are made float32
    kernels      multi_amp_adamw_g32, multi_amp_adamw_dev_g32 (float32 gradients, 16-bit
                 weights) RUN on the CPU (tests/cuda_cpu.py) bitwise against the xp step,
                 the host verdict, and ZeRO's per-unit update; their plans' argument types
    exactness    4 ranks under DDP, ZeRO-1/2/3, TP2 x DP2 + SP, PP2 x DP2 (zero-bubble), EP2
                 x DP2 + ZeRO-1, against one process, to 16-bit rounding
                 (tests/scripts/fp32_grads_check.py; the rest of its runs under `slow`)
    memory       the ledger's 4 bytes of gradient per parameter equal the planner's, one
                 process and ZeRO-2 x 2; plan.py and plan_memory.py price them
    resume       bit for bit with the flag, one process and ZeRO-2 x 2
    refusals     --grad-dtype without --amp (train_gpt.py, bench_step.py, plan.py --fp32)

    python -m pytest -q tests/test_fp32_grads.py
"""
import json
import subprocess
import sys

import numpy as np
import pytest

import cuda_cpu
from minidist.autograd import cuda_kernels as ck, cuda_source as cs
from minidist.backend import to_host
from minidist.ddp.ddp import Bucket
from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW, multi_tensor as mt
from minidist.train.amp import MixedPrecision
from minidist.train.args import train_parser
from minidist.train.cli import UsageError, check_flags
from minidist.train.loop import train
from minidist.train.loss_scale import LossScaler
from minidist.train.planner import Layout, bill, layout_from_name, plan, state_bytes
from minidist.train.search import train_flags
from mpirun import ROOT, tagged_json
from test_cuda_kernels_cpu import ORDERS, np_dtype
from test_device_verdict_cpu import PLAN, device_step, host_step
from test_multi_tensor_cpu import CHUNK, HYPER, Bag, assert_amp_same

needs_cxx = pytest.mark.skipif(cuda_cpu.reason_unavailable() is not None,
                               reason=str(cuda_cpu.reason_unavailable()))
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.0)


# ---- the point: float32 sums of many micro-batches ------------------------------------------

def accumulated(dtype, grad_dtype, m, each=False):
    """The gradients (float64 copies) of m micro-batches of 2 x 16 tokens, backward from
    loss / m x the loss scale as the training step runs them, added up in .grad (each:
    every micro-batch's own gradient, summed here in float64 instead)."""
    amp = MixedPrecision(dtype=dtype, grad_dtype=grad_dtype)
    model = amp.cast_model(GPT(CFG, seed=0))
    xs = np.random.default_rng(1).integers(0, CFG.vocab_size, (m, 2, CFG.block_size))
    total = {}
    for x in xs:
        _, loss = model(x, np.roll(x, -1, axis=1))
        amp.backward(loss, 1.0 / m)
        if each:
            for n, p in model.named_parameters():
                total[n] = total.get(n, 0.0) + p.grad.astype(np.float64)
            model.zero_grad()
    return total or {n: p.grad.astype(np.float64) for n, p in model.named_parameters()}


def float64_gradient(dtype, m):
    """The same micro-batches' gradient x the loss scale from a float64 copy of the 16-bit
    weights: no rounding at all."""
    amp = MixedPrecision(dtype=dtype)
    weights = {n: p.data.astype(np.float64) for n, p in
               amp.cast_model(GPT(CFG, seed=0)).named_parameters()}
    model = GPT(CFG, seed=0, dtype="float64")
    model.load_state_dict(weights)
    for x in np.random.default_rng(1).integers(0, CFG.vocab_size, (m, 2, CFG.block_size)):
        _, loss = model(x, np.roll(x, -1, axis=1))
        (loss * (1.0 / m)).backward()
    return {n: p.grad * amp.scaler.scale for n, p in model.named_parameters()}


def rel_error(got, want):
    """||got - want|| / ||want|| over every parameter."""
    num = sum(float(((got[n] - want[n]) ** 2).sum()) for n in want)
    return (num / sum(float((w ** 2).sum()) for w in want.values())) ** 0.5


@pytest.mark.cpu_only("the figures are numpy's 16-bit emulation (float32 products rounded)")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_32_micro_batches_add_up_closer_in_float32(dtype):
    """m = 32 (the planner's 7B-on-8-GPUs count): each path's sum against the float64 sum
    of its own micro-batch gradients (the accumulation alone; measured float16 9.7e-4 vs
    7e-9, bfloat16 7.2e-3 vs 2.4e-9), and against a float64 model's gradient (rounding in
    the 16-bit compute included; measured float16 1.14e-3 vs 5.96e-4, bfloat16 8.57e-3 vs
    4.62e-3)."""
    np_dtype(dtype)                                  # skips bfloat16 without ml_dtypes
    m = 32
    sixteen = rel_error(accumulated(dtype, None, m), accumulated(dtype, None, m, each=True))
    thirty_two = rel_error(accumulated(dtype, "float32", m),
                           accumulated(dtype, "float32", m, each=True))
    assert thirty_two < 1e-6 and thirty_two * 1e3 < sixteen, (sixteen, thirty_two)
    exact = float64_gradient(dtype, m)
    end16 = rel_error(accumulated(dtype, None, m), exact)
    end32 = rel_error(accumulated(dtype, "float32", m), exact)
    assert end32 < 0.75 * end16, (end16, end32)


# ---- the engine and the strategies' buffers -------------------------------------------------

def test_every_gradient_is_float32_with_and_without_recompute():
    """cast_model sets each parameter's grad_dtype: backward adds the 16-bit gradients into
    float32 .grad arrays, C-contiguous (wte's, the head's transposed product, too: collectives
    take flat buffers); under activation checkpointing (whose fresh leaf, the block's input,
    keeps the data's 16-bit type) the same numbers bit for bit."""
    grads = {}
    for ckpt in (False, True):
        amp = MixedPrecision(dtype="float16", grad_dtype="float32")
        model = amp.cast_model(GPT(CFG, seed=0))
        model.set_checkpointing(ckpt)
        x = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, CFG.block_size))
        amp.backward(model(x, np.roll(x, -1, axis=1))[1])
        for n, p in model.named_parameters():
            assert p.dtype == np.float16 and p.grad.dtype == np.float32, n
            assert p.grad.flags.c_contiguous, n
        grads[ckpt] = {n: p.grad for n, p in model.named_parameters()}
    for n in grads[False]:
        np.testing.assert_array_equal(to_host(grads[True][n]), to_host(grads[False][n]),
                                      err_msg=n)


def one_rank(name):
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    return ProcessGroup(MPI.COMM_SELF, name=name)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ddp_buckets_and_zero_units_are_float32(stage):
    """DDP's bucket and ZeRO's flat gradient buffers (stage 1's full ones, 2 and 3's
    shards and their transient flat buffer) in float32 over 16-bit parameters: a step's
    micro-batches added there and reduced in float32."""
    from minidist.zero.engine import zero_engine
    amp = MixedPrecision(dtype="float16", grad_dtype="float32")
    model = amp.cast_model(GPT(CFG, seed=0))
    assert Bucket(model.parameters()).buffer.dtype == np.float32
    engine = zero_engine(model, one_rank("dp"), stage)
    for _ in range(2):                                 # two micro-batches, the last syncs
        with engine.accumulating():
            x = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, CFG.block_size))
            amp.backward(model(x, np.roll(x, -1, axis=1))[1])
    engine.sync_grads()
    for u in engine.units:
        assert u.flat.grad_dtype == np.float32 and u.grad_shard.dtype == np.float32
        shard = to_host(u.grad_shard)
        assert np.isfinite(shard).all() and np.abs(shard).max() > 0
    engine.free()


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


# ---- 4 ranks against one process -------------------------------------------------------------

@pytest.mark.mpi
def test_the_strategies_match_one_process_with_float32_gradients(mpi):
    """mpiexec -n 4 python tests/scripts/fp32_grads_check.py
    DDP (grad-accum 2), ZeRO-1/2/3 (grad-accum 2), TP2 x DP2 + SP (grad-accum 2), PP2 x DP2
    (zero-bubble: B and W apart), EP2 x DP2 + ZeRO-1 (MoE, grad-accum 2), each against one
    process to 16-bit rounding (measured: losses within 4e-6 relative, the float32 masters
    within 4e-5 in the mean), every gradient the optimizer reads float32."""
    out = mpi(4, "tests/scripts/fp32_grads_check.py", timeout=300)
    rows = tagged_json(out)
    assert [r["run"] for r in rows] == ["dp4+accum2", "zero1+accum2", "zero2+accum2",
                                        "zero3+accum2", "tp2xdp2+sp+accum2", "pp2xdp2+zbh1",
                                        "ep2xdp2+zero1+moe"]
    assert all(r["grad_dtypes"] == ["float32"] for r in rows)


@pytest.mark.mpi
@pytest.mark.slow
def test_every_other_layout_matches_one_process_with_float32_gradients(mpi):
    """MINIDIST_RANKS_PER_NODE=2 mpiexec -n 4 python tests/scripts/fp32_grads_check.py
    --runs <the rest of RUNS>: DDP bucketed, naive and --comm hier, bfloat16, Muon (DDP,
    ZeRO-3), hybrid ZeRO-2, TP x ZeRO-1, PP with grad-accum, GPipe x ZeRO-2, interleaved PP x
    TP, CP (x ZeRO-3), EP x DDP."""
    from mpirun import mpi_env
    rest = ["dp4+bucketed+accum2", "dp4+naive", "dp4+hier", "dp4+accum2+bf16", "dp4+muon",
            "zero2+zs2", "zero3+muon", "tp2xdp2+zero1", "pp2xdp2+accum2",
            "pp2xdp2+gpipe+zero2", "pp2xtp2+v2+l4", "cp2xdp2", "cp2xdp2+zero3",
            "ep2xdp2+moe"]
    out = mpi(4, "tests/scripts/fp32_grads_check.py", "--runs", ",".join(rest), timeout=600,
              env=mpi_env(MINIDIST_RANKS_PER_NODE=2))
    assert [r["run"] for r in tagged_json(out)] == rest


# ---- memory: the ledger and the planners -----------------------------------------------------

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
        "--batch-size", "8", "--eval-every", "0", "--eval-iters", "1", "--sample", "0",
        "--amp", "--grad-dtype", "float32", "--grad-accum", "2"]


def run_log(corpus, tmp, ranks, mpi, *flags):
    """The training rows of train_gpt.py with TINY + flags (--log-json), on `ranks`."""
    log = tmp / f"log{len(list(tmp.glob('log*')))}.jsonl"
    argv = TINY + ["--data", corpus, "--cache-dir", str(tmp / "cache"), "--log-json",
                   str(log), *flags]
    if ranks == 1:
        train(train_parser().parse_args(argv + ["--device", mpi.device]))
    else:
        mpi(ranks, "examples/train_gpt.py", *argv, timeout=180)
    return [json.loads(line) for line in open(log)][:-1]


def test_state_bytes_and_layout_names_price_4_byte_gradients():
    """2 + 4 + 12 bytes a parameter; ZeRO-2 shards the 4; the name says "fp32 grads" and
    reads back; a search row runs train_gpt.py with --grad-dtype float32."""
    assert state_bytes(True, True) == (2, 4, 12) and state_bytes(True) == (2, 2, 12)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    flat = bill(cfg, Layout(grad32=True), 16)["grads"]
    assert flat == 2 * bill(cfg, Layout(), 16)["grads"]
    assert bill(cfg, Layout(dp=4, zero=2, grad32=True), 16)["grads"] == 4 * -(-flat // 16)
    name = Layout(dp=8, zero=1, grad32=True).name()
    assert name == "ZeRO-1 (amp, fp32 grads)"
    assert layout_from_name(name, 8)["grad32"] is True
    rows = plan(cfg, 8, grad32=True)["rows"]
    assert [r["grad32"] for r in rows] == [r["amp"] for r in rows]     # fp32 rows: as is
    row = {**rows[1], "micro_batch": 1, "micro_batches": 1, "schedule": "1f1b"}
    assert train_flags(cfg, row)[-2:] == ["--grad-dtype", "float32"]


@pytest.mark.parametrize("ranks, flags, layout", [
    (1, [], Layout(grad32=True)),
    pytest.param(2, ["--zero", "2"], Layout(dp=2, zero=2, grad32=True),
                 marks=pytest.mark.mpi)])
def test_the_ledger_holds_4_bytes_of_gradient_as_the_planner_says(ranks, flags, layout,
                                                                  corpus, tmp_path, mpi):
    """e.g. mpiexec -n 2 python examples/train_gpt.py --zero 2 --amp --grad-dtype float32
    --grad-accum 2 --log-json L (TINY): L's "mem" params, grads, optimizer = planner.bill."""
    mem = run_log(corpus, tmp_path, ranks, mpi, "--steps", "2", *flags)[-1]["mem"]
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=256)
    want = bill(cfg, layout, 16, 8 // (2 * layout.dp), formula="minidist")
    assert {k: mem[k] for k in ("params", "grads", "optimizer")} == \
        {k: want[k] for k in ("params", "grads", "optimizer")}


def example(script, *flags, check=True):
    """examples/<script> in a subprocess: the CompletedProcess."""
    return subprocess.run([sys.executable, f"examples/{script}", *flags], cwd=ROOT,
                          capture_output=True, text=True, check=check)


def test_plan_prices_and_runs_float32_gradients():
    """python examples/plan.py --params 1e9 --gpus 8 --seq 1024 --global-batch 64 --layout
    dp=8,zero=1,micro=1 --grad-dtype float32 --json: 4 bytes of gradient a parameter, and
    the command runs it;
    plan_memory.py's mixed-precision rows too."""
    def one(*flags):
        return json.loads(example("plan.py", "--params", "1e9", "--gpus", "8", "--seq", "1024",
                                  "--global-batch", "64", "--layout", "dp=8,zero=1,micro=1",
                                  "--json", *flags).stdout)
    plain, fp32 = one(), one("--grad-dtype", "float32")
    assert fp32["rows"][0]["mem"]["grads"] == 2 * plain["rows"][0]["mem"]["grads"]
    assert fp32["command"].endswith("--grad-dtype float32") and fp32["rows"][0]["grad32"]
    assert fp32["rows"][0]["layout"] == "ZeRO-1 (amp, fp32 grads, tiled)"
    rows = json.loads(example("plan_memory.py", "--params", "1e9", "--grad-dtype", "float32",
                              "--json").stdout)["rows"]
    assert all(r["grad32"] == r["amp"] and ("fp32 grads" in r["layout"]) == r["amp"]
               for r in rows)


# ---- resume, refusals --------------------------------------------------------------------------

@pytest.mark.parametrize("ranks, flags", [
    (1, []), pytest.param(2, ["--zero", "2"], marks=pytest.mark.mpi)])
def test_a_resume_with_float32_gradients_is_bit_identical(ranks, flags, corpus, tmp_path,
                                                          mpi):
    """mpiexec -n 2 python examples/train_gpt.py --zero 2 --amp --grad-dtype float32 ...
    --steps 4 (straight), --stop-at 2 --save DIR, then --resume DIR: the same losses.
    Checkpoints hold no gradient; the flag is the run's, taken from the checkpoint unless
    given (resume.py notes a change)."""
    common = ["--steps", "4", *flags]
    straight = run_log(corpus, tmp_path, ranks, mpi, *common)
    run_log(corpus, tmp_path, ranks, mpi, *common, "--stop-at", "2", "--save",
            str(tmp_path / "ck"))
    resumed = run_log(corpus, tmp_path, ranks, mpi, *common, "--resume", str(tmp_path / "ck"))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[2:]]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in straight[2:]]
    if ranks == 1:       # the flag is the run's: a resume without it takes the checkpoint's
        bare = [f for f in TINY if f not in ("--amp", "--grad-dtype", "float32")]
        log = tmp_path / "bare.jsonl"
        subprocess.run([sys.executable, "examples/train_gpt.py", *bare, "--data", corpus,
                        "--cache-dir", str(tmp_path / "cache"), "--log-json", str(log),
                        *common, "--resume", str(tmp_path / "ck"), "--device", mpi.device],
                       cwd=ROOT, check=True, capture_output=True, timeout=120)
        rows = [json.loads(line) for line in open(log)]
        assert [r["loss"] for r in rows if "loss" in r] == [r["loss"] for r in straight[2:]]


def test_grad_dtype_is_refused_without_amp_in_one_line(tmp_path):
    """train_gpt.py (check_flags: before MPI), bench_step.py, plan.py with --fp32, and
    MixedPrecision itself."""
    args = train_parser().parse_args(["--grad-dtype", "float32", "--save", str(tmp_path)])
    with pytest.raises(UsageError) as e:
        check_flags(args)
    assert str(e.value) == ("--grad-dtype float32: only used with --amp (without it the "
                            "gradients are --dtype float32's; add --amp, or leave "
                            "--grad-dtype out)")
    out = example("bench_step.py", "--grad-dtype", "float32", "--steps", "1", "--device",
                  "cpu", check=False)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: --grad-dtype float32: only used with --amp (add --amp, or leave --grad-dtype "
        "out)"), out.stderr
    out = example("plan.py", "--params", "1e9", "--fp32", "--grad-dtype", "float32",
                  check=False)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: --grad-dtype float32: only with mixed precision, and --fp32 is given (its "
        "gradients are float32 already); leave --grad-dtype out"), out.stderr
    with pytest.raises(ValueError, match="--grad-dtype float16: give float32"):
        MixedPrecision(grad_dtype="float16")
