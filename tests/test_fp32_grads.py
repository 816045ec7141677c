"""--amp --grad-dtype float32 (minidist/train/amp.py; Megatron-LM's main_grad): the gradients
of the 16-bit model accumulate over micro-batches and are reduced over ranks in float32.

    the point    m = 32 micro-batches added in float32 land ~1e5x closer to the float64 sum
                 of the same micro-batch gradients than added in 16 bits, and about 2x closer
                 to a float64 model's gradient (float16 and bfloat16)
    the engine   every parameter's .grad is float32 and C-contiguous, recompute or not
    buffers      DDP's buckets, ZeRO's flat units (stages 1-3) are made float32
    exactness    4 ranks under DDP, ZeRO-1/2/3, TP2 x DP2 + SP, PP2 x DP2 (zero-bubble), EP2
                 x DP2 + ZeRO-1, against one process, to 16-bit rounding
                 (tests/scripts/fp32_grads_check.py; the rest of its runs under `slow`)

The optimizer kernels: tests/test_fp32_grads_kernels.py; memory, resume and refusals:
tests/test_fp32_grads_memory.py.

    python -m pytest -q tests/test_fp32_grads.py
"""
import numpy as np
import pytest

from minidist.backend import to_host
from minidist.ddp.sync import Bucket
from minidist.nn import GPT, GPTConfig
from minidist.train.amp import MixedPrecision
from mpirun import tagged_json
from test_cuda_kernels_cpu import np_dtype
from tests.fp32_grads_cases import one_rank


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


def test_tp_sums_a_replicated_parameters_gradient_in_float32():
    """Under sequence parallelism a replicated parameter (layer norms, wpe, row biases)
    enters its layer through f (TensorParallelRegion.shared), whose backward all-reduces the
    per-shard gradients over tp: in the parameter's grad_dtype, float32, not in the 16-bit
    gradient's. One-rank tp group: the all-reduce's payload, as the group counts it, is 4
    bytes a value (the 4-rank runs below match one process to 16-bit rounding either way)."""
    from minidist.autograd import Tensor
    from minidist.comm import trace
    from minidist.tp.region import copy_to_tp
    group = one_rank("tp-fp32-sums")
    w = Tensor(np.ones(8, np.float16), requires_grad=True)
    w.grad_dtype = np.float32
    (copy_to_tp(w, group, w.grad_dtype) * Tensor(np.full(8, 3.0, np.float16))).sum().backward()
    assert trace.counters(group.name)["all_reduce"]["bytes"] == 8 * 4
    assert w.grad.dtype == np.float32 and to_host(w.grad).tolist() == [3.0] * 8


# ---- 4 ranks against one process -------------------------------------------------------------

@pytest.mark.mpi
def test_the_strategies_match_one_process_with_float32_gradients(mpi):
    """mpiexec -n 4 python tests/scripts/fp32_grads_check.py
    DDP (grad-accum 2), ZeRO-1/2/3 (grad-accum 2), TP2 x DP2 + SP (grad-accum 2), PP2 x DP2
    (zero-bubble: B and W apart), EP2 x DP2 + ZeRO-1 (MoE, grad-accum 2), each against one
    process to 16-bit rounding (measured: losses within 4e-6 relative, the float32 masters
    within 4e-5 in the mean), every gradient the optimizer reads float32; under SP no 16-bit
    all-reduce on the tp group (a replicated parameter's sum over tp in float16 stays within
    the tolerances: the script asserts it on the dtypes)."""
    out = mpi(4, "tests/scripts/fp32_grads_check.py", timeout=300)
    rows = tagged_json(out)
    assert [r["run"] for r in rows] == ["dp4+accum2", "zero1+accum2", "zero2+accum2",
                                        "zero3+accum2", "tp2xdp2+sp+accum2", "pp2xdp2+zbh1",
                                        "ep2xdp2+zero1+moe"]
    assert all(r["grad_dtypes"] == ["float32"] for r in rows)
    assert rows[4]["tp_all_reduce_dtypes"] == ["float32", "float64"], rows[4]


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
