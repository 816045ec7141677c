"""minidist used as a library, from a script's own loop: the mistakes first-use walk 29 made
are told at once, in a sentence naming the call that was missed, instead of training
something else silently.

    python -m pytest -q tests/test_library_misuse.py

DDP's forgotten sync_grads():
tests/test_ddp.py::test_a_loop_that_forgets_sync_grads_is_stopped_at_its_next_forward.
"""
import numpy as np
import pytest

from minidist.nn import GPT, GPTConfig
from minidist.nn.module import Module
from minidist.optim import AdamW
from minidist.strategy.base import SingleProcess
from minidist.train.args import train_parser
from minidist.train.step import train_step
from minidist.zero.engine import zero_engine

CONFIG = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32)


def _batch(rows):
    x = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (rows, CONFIG.block_size))
    return x, np.roll(x, -1, axis=1)


def test_a_step_without_any_gradient_is_refused():
    """A plain AdamW beside a ZeRO-3 engine (whose gradients are its shards) trained
    nothing, silently: every .grad was None and step() skipped each parameter. A step
    where no parameter has a gradient is now an error; one with some is as before."""
    model = GPT(CONFIG, seed=0)
    opt = AdamW(model.named_parameters(), lr=1e-3)
    with pytest.raises(RuntimeError, match=r"AdamW.step: no parameter has a gradient .* "
                                           r"step with ShardedAdamW\(engine, ...\)"):
        opt.step()
    _, loss = model(*_batch(2))
    loss.backward()
    before = [p.data.copy() for p in model.parameters()]
    opt.step()
    assert all(not np.array_equal(b, p.data) for b, p in zip(before, model.parameters()))


def test_train_step_refuses_rows_that_do_not_split_into_its_micro_batches():
    """train_step with 6 rows and grad_accum 4 trained on rows 0-3 and dropped 4 and 5
    (train_gpt.py refuses the flags first; a script calling train_step was not told)."""
    model = GPT(CONFIG, seed=0)
    strategy = SingleProcess()
    opt = AdamW(model.named_parameters(), lr=1e-3)
    args = train_parser().parse_args(["--grad-accum", "4"])
    with pytest.raises(ValueError, match=r"this rank's 6 rows of the batch do not split "
                                         r"into grad_accum 4 equal micro-batches \(rows 4 to "
                                         r"5 would be dropped\)"):
        train_step(strategy, model, opt, *_batch(6), args)
    train_step(strategy, model, opt, *_batch(8), args)      # 4 x 2 rows: as before


def test_zero3_on_a_model_without_block_hooks_says_what_it_needs():
    """ZeRO-3 on a model of one's own was `AttributeError: 'MLP' object has no attribute
    'set_block_hooks'`; stages 1 and 2 take any model."""
    class Plain(Module):
        pass

    with pytest.raises(TypeError, match="zero_engine: stage 3 gathers .* Plain has no "
                                        "set_block_hooks"):
        zero_engine(Plain(), None, 3)


def test_an_unnamed_optimizers_state_says_to_build_it_from_named_parameters():
    """AdamW(model.parameters()), PyTorch's habit, names its state param0, param1, ...: a
    named optimizer (the strategies', train_gpt.py's checkpoints) could not load it, and
    the error gave no hint."""
    model = GPT(CONFIG, seed=0)
    unnamed = AdamW(model.parameters(), lr=1e-3)
    _, loss = model(*_batch(2))
    loss.backward()
    unnamed.step()
    named = AdamW(model.named_parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"optimizer state for unknown parameters \['param"
                                         r".*build the optimizer from "
                                         r"model.named_parameters\(\)"):
        named.load_state_dict(unnamed.state_dict())
    named.load_state_dict(AdamW(model.named_parameters(), lr=1e-3).state_dict())


def test_a_custom_op_whose_forward_returns_a_tensor_is_told_so():
    """A Function whose forward returned a Tensor (wrapping its result, as a module would)
    failed later, in gradcheck, with "float() argument must be a string or a real number,
    not 'Tensor'"."""
    from minidist.autograd import Function, Tensor

    class Twice(Function):
        @staticmethod
        def forward(ctx, x):
            return Tensor(2 * x)

        @staticmethod
        def backward(ctx, grad):
            return 2 * grad

    with pytest.raises(TypeError, match=r"Twice.forward returned a Tensor: forward and "
                                        r"backward work on the arrays"):
        Twice.apply(Tensor(np.ones(3), requires_grad=True))


def _op(broken):
    """A one-input Function doubling its input whose backward returns `broken(ctx, grad)`."""
    from minidist.autograd import Function

    class Twice(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return 2 * x

        @staticmethod
        def backward(ctx, grad):
            return broken(ctx, grad)
    return Twice


@pytest.mark.parametrize("backward,error,says", [
    (lambda ctx, grad: None, RuntimeError,                   # `2 * grad` without `return`
     r"Twice.backward returned None: return its input's gradient \(several inputs: a "
     r"tuple"),
    (lambda ctx, grad: 1j * grad, TypeError, r"returned a complex128 gradient for input 0"),
    (lambda ctx, grad: 2.0, TypeError, r"Twice.backward returned float for input 0"),
    (lambda ctx, grad: (ctx.saved[0] > 0), TypeError,
     r"Twice.backward returned a bool gradient for input 0: a gradient is floats"),
    (lambda ctx, grad: grad.missing, AttributeError,
     r"Twice.backward\(\(3,\) float64\): 'numpy.ndarray' object has no attribute"),
])
def test_a_custom_ops_broken_backward_is_named(backward, error, says):
    """First-use walk 39: a backward that forgot its `return` left x.grad None and the
    parameter untrained, silently; a mask returned for a gradient was cast to floats; an
    error inside backward named neither the op nor its place. Each is now an error naming
    the op."""
    from minidist.autograd import Tensor
    x = Tensor(np.ones(3), requires_grad=True)
    out = _op(backward).apply(x)
    with pytest.raises(error, match=says):
        out.sum().backward()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_zero_loop_that_misses_sync_grads_or_after_step_is_told_at_the_step(stage):
    """First-use walk 29: an own loop under ZeRO without engine.sync_grads() stepped on
    gradients not yet averaged (ZeRO-3: other numbers, silently; ZeRO-1: 93 off, then an
    error at the next backward advising no_sync()); without engine.after_step() the next
    forward read the old parameters (silently). The optimizer's step now names the call."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    from minidist.zero.optim import ShardedAdamW
    model = GPT(CONFIG, seed=0)
    engine = zero_engine(model, ProcessGroup(MPI.COMM_SELF, name="dp"), stage)
    opt = ShardedAdamW(engine, lr=1e-3)

    def backward():
        _, loss = model(*_batch(2))
        loss.backward()

    backward()
    with pytest.raises(RuntimeError, match=rf"ZeRO-{stage}: ShardedAdamW.step before "
                                           r"engine.sync_grads\(\)"):
        opt.step()
    engine.sync_grads()
    opt.step()
    with pytest.raises(RuntimeError, match=rf"ZeRO-{stage}: ShardedAdamW.step again before "
                                           r"engine.after_step\(\)"):
        opt.step()
    engine.after_step()                    # the recipe's order from here on: no error
    opt.zero_grad()
    backward()
    engine.sync_grads()
    opt.step()
    engine.after_step()


def test_dropout_keys_refuse_a_model_of_another_seed():
    """A checkpoint's dropout state held only the step: a model resumed with another seed
    drew other masks, silently (3e-2 off in first-use walk 29's own ZeRO loop). It now
    holds the seed, and loading it into another seed's keys is refused unless allowed
    (train_gpt.py's --resume --seed N, whose resumed line notes the change)."""
    saved = GPT(CONFIG, seed=7).dropout_keys
    saved.next_step()
    state = saved.state_dict()
    assert state == {"step": 1, "seed": 7}
    other = GPT(CONFIG, seed=0).dropout_keys
    with pytest.raises(ValueError, match="the checkpoint's masks are drawn from seed 7, this "
                                         "model's from seed 0: build the model with seed=7"):
        other.load_state_dict(state)
    other.load_state_dict(state, seed_may_change=True)
    GPT(CONFIG, seed=7).dropout_keys.load_state_dict(state)
    other.load_state_dict({"step": 3})                 # a checkpoint from before: no seed
    assert other.step == 3


def test_a_save_of_an_older_step_does_not_move_latest_back(tmp_path):
    """save_checkpoint of step 1 into a directory whose latest was step 3 made `latest`
    name step 1, and the next load_checkpoint read the older state, silently (the CLI's
    check_save refuses the run; a script's own saves were not checked). Refused now, naming
    both steps; overwrite=True replaces that run; saving the same step again still adds a
    folder beside it."""
    from minidist.strategy.checkpoint import load_checkpoint, save_checkpoint
    from minidist.strategy.checkpoint_dirs import CheckpointError, read_latest
    model = GPT(CONFIG, seed=0)
    opt = AdamW(model.named_parameters(), lr=1e-3)
    save_checkpoint(tmp_path, model, opt, step=3)
    with pytest.raises(CheckpointError, match=r"latest checkpoint is step 3 \(step-00000003\), "
                                              r"newer than step 1 this save writes.*"
                                              r"overwrite=True"):
        save_checkpoint(tmp_path, model, opt, step=1)
    assert read_latest(tmp_path) == "step-00000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003"]
    assert load_checkpoint(tmp_path, model, opt)["step"] == 3
    save_checkpoint(tmp_path, model, opt, step=3)
    assert read_latest(tmp_path) == "step-00000003.1"
    save_checkpoint(tmp_path, model, opt, step=1, overwrite=True)
    assert read_latest(tmp_path) == "step-00000001"
