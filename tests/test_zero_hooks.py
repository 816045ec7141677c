"""ZeRO-3 through the model's block hooks, in process on one-rank groups: the hooks GPT calls
around each block, ZeRO-3 gathering in them for GPT, the tensor-parallel GPT and a pipeline
stage (bit for bit the plain model's numbers), and BeforeBackward's gradient check.

    python -m pytest -q tests/test_zero_hooks.py
"""
import numpy as np
import pytest

from minidist.backend import to_host as H
from minidist.nn import GPT
from minidist.nn.gpt import BlockHooks
from tests.zero_cases import CONFIG, SEED, batch


class Recorder(BlockHooks):
    """Block hooks that write down each call, in the order the model makes them."""

    def __init__(self):
        self.calls = []

    def before_root(self):
        self.calls.append("root")

    def before_block(self, i):
        self.calls.append(f"before {i}")

    def after_block(self, i, y):
        self.calls.append(f"after {i}")
        return y


@pytest.mark.parametrize("ckpt", [False, True])
def test_gpt_calls_its_block_hooks_around_each_block(ckpt):
    model = GPT(CONFIG, seed=0, dtype="float64").set_checkpointing(ckpt)
    x = batch(0, 2)[0]
    plain = float(model(x)[0].data.sum())
    hooks = Recorder()
    model.set_block_hooks(hooks)
    assert float(model(x)[0].data.sum()) == plain
    blocks = [f"{k} {i}" for i in range(CONFIG.n_layer) for k in ("before", "after")]
    assert hooks.calls == ["root"] + blocks + ["root"]               # embed, blocks, head
    assert type(model.set_block_hooks(None).block_hooks) is BlockHooks


def one_rank(name):
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    return ProcessGroup(MPI.COMM_SELF, name=name)


def zero3_models():
    """(name, model builder) for each model class ZeRO-3 wraps: GPT, the tensor-parallel GPT
    and a pipeline stage holding every block (tp and pp groups of one rank)."""
    from minidist.pp.stage import GPTStage
    from minidist.tp.model import TensorParallelGPT
    return [("gpt", lambda: GPT(CONFIG, SEED, "float64")),
            ("tp", lambda: TensorParallelGPT(CONFIG, one_rank("tp"), SEED, "float64")),
            ("pp", lambda: GPTStage(CONFIG, one_rank("pp"), range(CONFIG.n_layer), SEED,
                                    "float64"))]


@pytest.mark.parametrize("kind", ["gpt", "tp", "pp"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_zero3_gathers_in_block_hooks_and_matches_the_plain_model(kind, ckpt):
    """ZeRO-3 on a one-rank group: the engine is the model's block hooks and no method of the
    model or its blocks is replaced; outside a gather the parameters are NaN placeholders;
    loss, gradient shards and samples equal the unsharded model's bit for bit (the backward
    re-gathers block 0 after block 2 took its buffer, or its gradients would be wrong)."""
    from minidist.zero.engine import zero_engine
    build = dict(zero3_models())[kind]
    ref, model = build().set_checkpointing(ckpt), build().set_checkpointing(ckpt)
    engine = zero_engine(model, one_rank("dp"), 3)
    assert model.block_hooks is engine
    for m in [model] + list(model.transformer.h):
        assert not {"forward", "embed", "head"} & set(vars(m)), type(m)
    assert all(np.isnan(p.data).all() for p in model.parameters())
    x, y = batch(0, 4)

    def loss_of(m):
        return m.stage_forward(None, x, y) if kind == "pp" else m(x, y)[1]

    want, got = loss_of(ref), loss_of(model)
    assert float(got.data) == float(want.data)
    want.backward()
    got.backward()
    engine.sync_grads()
    grads = dict(ref.named_parameters())
    for u in engine.units:
        expected = u.flat.flatten([grads[n].grad for n in u.flat.names])
        assert np.array_equal(H(u.grad_shard), H(expected)), u.flat.name
    engine.free()
    assert all(np.isnan(p.data).all() for p in model.parameters())
    assert np.array_equal(H(model.generate(x[:, :2], 3, seed=1)),
                          H(ref.generate(x[:, :2], 3, seed=1)))


def test_before_backward_gradcheck_calls_its_function_first():
    """ZeRO-3's BeforeBackward (a block's output: its backward gathers the block's
    parameters before any of the block's ops runs) is the identity, its gradient checked
    against central differences, float64, and calls its function once per backward."""
    from minidist.autograd import Tensor
    from minidist.autograd.gradcheck import gradcheck
    from minidist.zero.stage3 import BeforeBackward
    calls = []
    x = Tensor(np.random.default_rng(7).standard_normal((3, 4)), requires_grad=True)
    gradcheck(lambda t: BeforeBackward.apply(t, lambda: calls.append(1)) * t, [x],
              name="BeforeBackward")
    assert calls
    calls.clear()
    (BeforeBackward.apply(x, lambda: calls.append(1)) * 2.0).sum().backward()
    assert calls == [1]


def test_a_units_and_a_gather_buffers_reprs_are_a_line_each():
    """`p u` in a debugger stopped in ZeRO's reduce-scatter printed every array the unit
    holds (hundreds of lines) and `p self.buffers` addresses: one line each now, saying
    what this rank holds and which unit a buffer holds (first-use walk of 2026-11-30)."""
    from minidist.zero.engine import zero_engine
    model = GPT(CONFIG, SEED, "float64")
    engine = zero_engine(model, one_rank("dp"), 3)
    model(*batch(0, 4))                               # forward: block gathers into buffers
    u = engine.units[1]
    assert repr(u) == (f"ZeroUnit('h.0': this rank's [0, {u.flat.padded}) of "
                       f"{u.flat.padded:,}, 0 of {len(u.flat.params)} gradients ready, "
                       f"holding param_shard, grad_shard; its slot holds {u.slot!r})"), repr(u)
    assert repr(u.slot) in (f"GatherBuffer({u.flat.padded:,} elements, holding {name!r})"
                            for name in ("h.0", f"h.{CONFIG.n_layer - 2}")), repr(u.slot)
    engine.free()
