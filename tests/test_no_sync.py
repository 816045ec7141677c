"""No device-to-host synchronisation inside a training step (issue 14): the loss, the gradient
norm and the clip factor stay arrays on the gradients' device until the loop logs them.

Two honest checks, no stand-ins: train_step on numpy returns numpy values (0-d, float64), not
Python floats, and clipping acts by an array multiply; and the step's code (train_step, the
clip, the strategies' reductions) contains no call that pulls a value to the host (float(),
int(), bool(), .item(), .tolist(), to_host) -- read from its syntax tree.
"""
import ast
import inspect
import textwrap

import numpy as np
import pytest

from minidist.ddp.strategy import DataParallel
from minidist.nn import GPTConfig
from minidist.optim import clip
from minidist.pp.strategy import PipelineParallel
from minidist.strategy import base
from minidist.tp.strategy import TensorParallel
from minidist.tp import state as tp_state
from minidist.train import step as step_module
from minidist.train.args import train_parser
from minidist.train.strategy import make_strategy
from minidist.zero.strategy import ZeroDataParallel

HOST_CALLS = {"float", "int", "bool", "item", "tolist", "to_host", "asnumpy", "get"}


def _host_calls(fn):
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
            if name in HOST_CALLS and not _of_args(node):
                found.append(f"{fn.__qualname__}: {ast.unparse(node)}")
    return found


def _of_args(call):
    """bool(args.log_json) and the like: a command-line flag, a host value already."""
    return (len(call.args) == 1 and isinstance(call.args[0], ast.Attribute)
            and isinstance(call.args[0].value, ast.Name) and call.args[0].value.id == "args")


@pytest.mark.parametrize("fn", [
    step_module.train_step, clip.clip_grad_norm, clip.local_sum_sq, base.all_reduce_number,
    base.SingleProcess.forward_backward, DataParallel.global_mean,
    ZeroDataParallel.global_mean, ZeroDataParallel.reduce_sum_sq,
    PipelineParallel.reduce_sum_sq, TensorParallel.reduce_sum_sq, tp_state.sum_sq_over_tp],
    ids=lambda fn: fn.__qualname__)
def test_step_code_never_pulls_a_value_to_the_host(fn):
    assert _host_calls(fn) == []


def _step(*flags):
    args = train_parser().parse_args(["--n-layer", "1", "--n-head", "2", "--n-embd", "16",
                                      "--block-size", "8", "--batch-size", "4",
                                      "--device", "cpu", *flags])
    strategy = make_strategy(args)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=13)
    model = strategy.build_model(config, seed=0, dtype="float64")
    opt = strategy.build_optimizer(model, args)
    x = np.random.default_rng(0).integers(0, 13, (4, 8))
    return step_module.train_step(strategy, model, opt, x, np.roll(x, -1, 1), args)


@pytest.mark.parametrize("flags", [[], ["--grad-accum", "2", "--grad-clip", "1e-3"]])
def test_train_step_returns_numpy_values_not_python_floats(flags):
    loss, norm, _ = _step(*flags)
    for value in (loss, norm):
        assert type(value) is not float                      # not pulled to the host
        assert isinstance(value, (np.ndarray, np.generic)) and np.ndim(value) == 0
        assert value.dtype == np.float64 and np.isfinite(value)


def test_clip_is_an_array_multiply_exact_when_not_clipping():
    r = np.random.default_rng(1)
    grads = [r.standard_normal((3, 4)).astype(np.float32), r.standard_normal(5)]
    before = [g.copy() for g in grads]
    norm = clip.clip_grad_norm(grads, max_norm=1e3)
    assert type(norm) is not float and np.ndim(norm) == 0
    assert all(np.array_equal(a, b) for a, b in zip(grads, before))    # x 1.0: bitwise
    norm = clip.clip_grad_norm(grads, max_norm=0.5)
    scale = 0.5 / (float(norm) + 1e-6)
    np.testing.assert_array_equal(grads[0], before[0] * np.float32(scale))
    np.testing.assert_array_equal(grads[1], before[1] * scale)
