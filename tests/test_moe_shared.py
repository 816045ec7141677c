"""Shared experts (`--moe-shared S`, DeepSeekMoE: minidist/nn/moe.py): every token runs one
MLP S experts wide beside its routed ones, ungated. The layer = the routed layer + that MLP,
bit for bit (its gradient against finite differences: tests/test_moe.py
test_gradcheck_moe_layer); the parameter counts (the planner's, per tp
rank too) = the model's; every layout (ep, tp + SP where the MLP is split as a dense one,
pp, ep x tp x ZeRO, ep x dp x ZeRO-3 with recompute and dropout) = one process, resumed bit
for bit; a resumed run takes S from its checkpoint; the flag refused where it does nothing.

Run: python -m pytest -q tests/test_moe_shared.py
"""
import math
import re
from dataclasses import replace

import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.nn import GPT, GPTConfig
from minidist.nn.block import MLP
from minidist.nn.config import gpt_param_specs
from minidist.nn.moe import MoE
from minidist.train.moe_cost import moe_block_flops
from minidist.train.plan_args import model_text
from minidist.train.planner import stage_params
from mpirun import train_tiny



def config(**kw):
    return GPTConfig(**{**dict(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=16,
                               moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0,
                               moe_shared=2), **kw})


def test_the_layer_is_the_routed_one_plus_an_mlp_every_token_runs():
    """out = routed(x) + shared(x), the shared MLP 2 x F wide (2 experts' worth), ungated:
    the same numbers as the layer without it plus that MLP run on every token."""
    c = config()
    shared = MLP(c.shared_expert(), dtype="float64")
    assert shared.c_fc.weight.shape == (8, 2 * 32) and shared.c_proj.weight.shape == (64, 8)
    both = MoE(c, MLP, dtype="float64", shared_expert=shared)
    routed = MoE(c, MLP, dtype="float64")
    for (name, p), q in zip(routed.named_parameters(), both.parameters()):
        p.data[...] = q.data                                     # the same routed weights
    x = Tensor(np.random.default_rng(0).standard_normal((2, 5, 8)))
    np.testing.assert_array_equal(both(x).data, (routed(x) + shared(x)).data)


def test_parameters_and_flops_count_the_shared_experts():
    """The model's parameters = the specs' = the planner's; S more MLPs a token in the model
    FLOPs; the config records S (an older checkpoint's, without the field, is S = 0)."""
    c = config(n_layer=3, moe_every=1)
    model = GPT(c, dtype="float64")
    specs = gpt_param_specs(c)
    assert model.num_parameters() == sum(math.prod(s) for s, _ in specs.values()) == \
        sum(stage_params(c))
    S, mlp = 2, 2 * 8 * 32
    assert model.flops_per_token() - GPT(replace(c, moe_shared=0)).flops_per_token() == \
        6 * 3 * S * mlp
    assert c.to_dict()["moe_shared"] == 2 and "moe_shared" not in replace(
        c, moe_shared=0).to_dict()
    # the planners' model line says where the count went (first-use walk 18b)
    assert model_text(model.num_parameters(), c.to_dict()).endswith(
        "made 4 experts, top-2 + 2 shared")
    # the step-time model: S MLPs a token more, forward, split by tp as a dense MLP's
    for tp in (1, 2):
        extra = moe_block_flops(c, 3, 8, tp) - moe_block_flops(replace(c, moe_shared=0), 3,
                                                               8, tp)
        assert extra == 2 * S * mlp * 3 * 8 / tp


LAYOUT = {"--moe-experts": 4, "--moe-top-k": 2, "--moe-shared": 1}


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, flags", [
    (2, {"--ep": 2}),
    (2, {"--tp": 2, "--sequence-parallel": True, "--dropout": 0.1}),
    (2, {"--pp": 2, "--micro-batches": 2}),
    (4, {"--ep": 2, "--tp": 2, "--zero": 1}),
    (4, {"--ep": 2, "--dp": 2, "--zero": 3, "--ckpt-activations": True, "--dropout": 0.1}),
], ids=["ep2", "tp2-sp-dropout", "pp2", "ep2-tp2-zero1", "ep2-dp2-zero3-ckpt-dropout"])
def test_shared_experts_train_one_process_numbers_in_every_layout(sweep, ranks, flags):
    """float64: each step's loss and gradient norm, the val loss and every parameter within
    1e-10 of one process; the 4-rank ones also stopped after step 2 and resumed bit for bit.
    Under tp the shared MLP is split as a dense block's (its own all-reduce, or SP's
    reduce-scatter), under ep it is dense (averaged over every replica)."""
    ok, errs, run = sweep.check(ranks, {**LAYOUT, **flags}, resume=ranks == 4)
    assert ok, (errs, run["stderr"][-2000:])


@pytest.mark.mpi
def test_each_tp_rank_holds_the_planners_count(mpi, corpus, tmp_path):
    """    mpiexec -n 2 python examples/train_gpt.py --tp 2 --moe-experts 4 --moe-shared 1
    The model line's "on this rank" = stage_params(config, tp=2): the shared MLP split in
    two, the routed experts whole."""
    out = mpi(2, "examples/train_gpt.py", "--tp", "2", "--moe-experts", "4", "--moe-shared",
              "1", "--n-layer", "2", "--n-embd", "32", "--block-size", "16", "--batch-size",
              "4", "--steps", "1", "--eval-iters", "1", "--sample", "0", "--data", corpus,
              "--cache-dir", str(tmp_path / "c"), timeout=120).stdout
    here = int(re.search(r"\(([\d,]+) on this rank", out).group(1).replace(",", ""))
    c = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=256,
                  moe_experts=4, moe_shared=1)
    assert here == stage_params(c, tp=2)[0]


def test_a_resumed_run_takes_the_shared_experts_and_the_flag_is_refused_alone(tmp_path):
    ck = str(tmp_path / "ck")
    first = train_tiny("--moe-experts", "2", "--moe-shared", "1", "--save", ck)
    assert first.returncode == 0, first.stderr
    again = train_tiny("--steps", "2", "--resume", ck)                    # no --moe-* flag
    assert again.returncode == 0 and "moe_shared=1" in again.stdout, again.stderr
    alone = train_tiny("--moe-shared", "1")
    assert alone.returncode == 2 and alone.stderr == (
        "error: --moe-shared 1: only used with --moe-experts (add --moe-experts E, 2 or more, "
        "or leave --moe-shared out)\n")
    negative = train_tiny("--moe-experts", "2", "--moe-shared", "-1")
    assert negative.returncode == 2 and "--moe-shared -1: shared experts, 0 or more" in \
        negative.stderr
