"""A contributor's own optimizer (first-use walk 39 wrote a Lion): what the optimizer
chapter promises it can count on, one process and over a ZeRO engine's shards on 3 ranks
(the template: tests/scripts/optim_extend_check.py).

    python -m pytest -q tests/test_optim_extend.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from minidist.comm import ProcessGroup
from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW, Optimizer, wants_decay
from minidist.zero.engine import zero_engine
from minidist.zero.optim import ShardedOptimizer
from mpirun import tagged_json

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


@pytest.mark.mpi
def test_a_sharded_optimizer_with_its_own_state_equals_one_process(mpi):
    """mpiexec -n 3 python tests/scripts/optim_extend_check.py
    The chapter's template, SGD with momentum over ZeRO's shards (state_keys: the shards hold
    only its exp_avg): three steps of ZeRO-1, 2 and 3 on 3 ranks (shards cut parameters and
    pad) = one process's SGD, float64 to 1e-10 (measured 2.8e-17)."""
    rows = tagged_json(mpi(3, "tests/scripts/optim_extend_check.py", timeout=180))
    assert [(r["stage"], r["ranks"], r["state_keys"]) for r in rows] == \
        [(s, 3, ["exp_avg"]) for s in (1, 2, 3)]
    assert all(r["param_diff"] <= 1e-10 for r in rows)


class MomentumNamedApart(ShardedOptimizer):
    """A sharded optimizer whose state is named outside the checkpoint's keys."""
    state_keys = ("momentum",)

    def __init__(self, engine):
        super().__init__(engine, [{"lr": 0.1}], weight_decay=0.0)


def test_state_a_sharded_checkpoint_would_not_keep_is_refused():
    """Walk 40: a state key outside the checkpoint's (STATE_KEYS) was saved by no one and
    resumed as zeros, silently; refused when the optimizer is built."""
    group = ProcessGroup(MPI.COMM_SELF, name="dp")
    engine = zero_engine(GPT(CONFIG, seed=0), group, 1)
    with pytest.raises(ValueError, match=r"MomentumNamedApart.state_keys \['momentum'\]: "
                       "a sharded checkpoint keeps exp_avg and exp_avg_sq"):
        MomentumNamedApart(engine)
    group.destroy()
