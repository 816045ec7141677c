"""A contributor's own optimizer (first-use walk 39 wrote a Lion): what the optimizer
chapter promises it can count on, one process and over a ZeRO engine's shards.

    python -m pytest -q tests/test_optim_extend.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from minidist.backend import to_host as H
from minidist.comm import ProcessGroup
from minidist.nn import GPT, GPTConfig
from minidist.optim import SGD, AdamW, Optimizer, sgd_update, wants_decay
from minidist.zero.engine import zero_engine
from minidist.zero.optim import ShardedOptimizer

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)


class SignDescent(Optimizer):
    """p -= lr * sign(g): an optimizer of its own that wants AdamW's decay split."""
    defaults = {"lr": 1e-2, "weight_decay": 0.1}
    split_decay = True

    def update(self, p, grad, state, group, name=None):
        p -= group["lr"] * np.sign(grad)


class SlowAdamW(AdamW):
    defaults = {**AdamW.defaults, "betas": (0.9, 0.99)}


def test_a_new_optimizer_gets_the_decay_split_and_keeps_its_own_defaults():
    """split_decay gives any Optimizer AdamW's groups (biases and gains undecayed); an
    AdamW subclass's class defaults hold where its caller leaves an argument out (AdamW's
    own keyword defaults used to override them: walk 39's Lion ran betas (0.9, 0.95))."""
    model = GPT(CONFIG, seed=0)
    groups = SignDescent(model.named_parameters()).param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert [[wants_decay(p) for p in g["params"]] for g in groups] == \
        [[True] * len(groups[0]["params"]), [False] * len(groups[1]["params"])]
    assert [g["names"] for g in groups] == \
        [g["names"] for g in AdamW(model.named_parameters()).param_groups]
    assert SlowAdamW(model.named_parameters()).param_groups[0]["betas"] == (0.9, 0.99)
    assert SlowAdamW(model.named_parameters(), betas=(0.8, 0.9)).param_groups[0]["betas"] \
        == (0.8, 0.9)
    assert AdamW(model.named_parameters(), lr=3e-4).param_groups[0]["lr"] == 3e-4


class ShardedMomentum(ShardedOptimizer):
    """SGD with momentum over a ZeRO engine's shards: one state array, exp_avg (state_keys),
    not AdamW's m and v."""
    one_process = "SGD"
    state_keys = ("exp_avg",)

    def __init__(self, engine, lr, momentum):
        super().__init__(engine, [{"lr": lr, "momentum": momentum}], weight_decay=0.0)

    def _update(self, u, factor):
        group = self.param_groups[0]
        sgd_update(u.param_shard, u.grad_shard, self.state[u.flat.name]["exp_avg"],
                   group["lr"], group["momentum"], first=self.steps == 1)


def _batch(step):
    x = np.random.default_rng(step).integers(0, CONFIG.vocab_size, (4, CONFIG.block_size))
    return x, np.roll(x, -1, axis=1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_sharded_optimizer_with_its_own_state_equals_one_process(stage):
    """state_keys: the shards hold only the update's own arrays; three steps on a one-rank
    ZeRO engine = SGD with momentum in one process, float64."""
    ref, model = GPT(CONFIG, seed=0, dtype="float64"), GPT(CONFIG, seed=0, dtype="float64")
    ref_opt = SGD(ref.named_parameters(), lr=0.1, momentum=0.9)
    group = ProcessGroup(MPI.COMM_SELF, name="dp")
    engine = zero_engine(model, group, stage)
    opt = ShardedMomentum(engine, lr=0.1, momentum=0.9)
    assert {k for s in opt.state.values() for k in s} == {"exp_avg"}
    for step in range(3):
        for net, optimizer in ((ref, ref_opt), (model, opt)):
            optimizer.zero_grad()
            _, loss = net(*_batch(step))
            loss.backward()
        engine.sync_grads()
        ref_opt.step()
        opt.step()
        engine.after_step()
    full = engine.full_state_dict()
    assert len(full) == len(ref.parameters())
    for name, q in ref.named_parameters():
        np.testing.assert_allclose(full[name], H(q.data), rtol=0, atol=1e-12, err_msg=name)
    group.destroy()


class ShardedMomentumNamedApart(ShardedMomentum):
    state_keys = ("momentum",)


def test_state_a_sharded_checkpoint_would_not_keep_is_refused():
    """Walk 40: a state key outside the checkpoint's (STATE_KEYS) was saved by no one and
    resumed as zeros, silently; refused when the optimizer is built."""
    group = ProcessGroup(MPI.COMM_SELF, name="dp")
    engine = zero_engine(GPT(CONFIG, seed=0), group, 1)
    with pytest.raises(ValueError, match=r"ShardedMomentumNamedApart.state_keys \['momentum'\]: "
                       "a sharded checkpoint keeps exp_avg and exp_avg_sq"):
        ShardedMomentumNamedApart(engine, lr=0.1, momentum=0.9)
    group.destroy()
