"""Activation checkpointing (minidist/autograd/recompute.py, GPT.set_checkpointing): the same
numbers as without it (float64, bit for bit, dropout included), far less activation memory in
the ledger, parameter hooks fired once per backward when the gradient is complete, gradient
accumulation, and the recompute's gradient checked by central differences. Arrays come from
the `xp` fixture (pytest --device): `python -m pytest tests/test_checkpointing.py --device cuda`
runs it on the GPU."""
import numpy as np
import pytest

from minidist import backend
from minidist.backend import to_host as H
from minidist.autograd import Tensor, no_grad
from minidist.autograd.gradcheck import gradcheck
from minidist.autograd.recompute import checkpoint
from minidist.nn import GPT, GPTConfig
from minidist.strategy.memory import activation_bytes

CFG = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.1)


def _batch(xp, seed=0, rows=4):
    rng = np.random.default_rng(seed)
    return xp.asarray(rng.integers(0, CFG.vocab_size, (rows, CFG.block_size)))


def _run(xp, ckpt, n_accum=1, hooks=None):
    """Losses, final grads, activation bytes of the first micro-batch, the dropout keys'
    (step, rows) after it all."""
    model = GPT(CFG, seed=3, dtype="float64").set_checkpointing(ckpt)
    if hooks is not None:
        for name, p in model.named_parameters():
            p.register_grad_hook(lambda p, name=name: hooks.append((name, p.grad.copy())))
    x, losses, act = _batch(xp, rows=4 * n_accum), [], None
    for i in range(n_accum):
        _, loss = model(x[4 * i:4 * (i + 1)], x[4 * i:4 * (i + 1)])
        act = act or activation_bytes(loss, model.parameters())
        losses.append(loss.item())
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return losses, grads, act, model.dropout_keys.snapshot()


@pytest.mark.parametrize("n_accum", [1, 2])
def test_same_numbers_bit_for_bit_with_dropout(n_accum, xp):
    losses, grads, _, draw = _run(xp, False, n_accum)
    losses_c, grads_c, _, draw_c = _run(xp, True, n_accum)
    assert losses == losses_c
    for name in grads:
        np.testing.assert_array_equal(H(grads[name]), H(grads_c[name]), err_msg=name)
    assert draw == draw_c == (n_accum, None, None)   # the recompute left the keys as they were


def test_activation_memory_drops_by_more_than_40_percent(xp):
    _, _, full, _ = _run(xp, False)
    _, _, kept, _ = _run(xp, True)
    assert kept < 0.6 * full, f"{kept} vs {full} bytes: only {1 - kept / full:.0%} less"


def test_hooks_fire_once_with_the_complete_gradient_last_block_first(xp):
    fired, fired_c = [], []
    _, grads, _, _ = _run(xp, False, hooks=fired)
    _, grads_c, _, _ = _run(xp, True, hooks=fired_c)
    names = [n for n, _ in fired_c]
    assert sorted(names) == sorted(grads) and len(names) == len(set(names))
    for name, grad_then in fired_c:
        np.testing.assert_array_equal(H(grad_then), H(grads_c[name]), err_msg=name)
    blocks = [int(n.split(".")[2]) for n in names if n.startswith("transformer.h.")]
    assert blocks == sorted(blocks, reverse=True)            # block 3's hooks, then 2, ...
    assert names[-1] in ("transformer.wte.weight", "transformer.wpe.weight")


def test_hooks_fire_once_per_backward_when_accumulating(xp):
    fired = []
    _run(xp, True, n_accum=2, hooks=fired)
    counts = {}
    for name, _ in fired:
        counts[name] = counts.get(name, 0) + 1
    assert set(counts.values()) == {2}


def test_tied_parameter_hook_waits_for_the_use_outside(xp):
    """w is used inside the checkpointed function and again outside: its hook fires once,
    after both contributions, with the gradient of the uncheckpointed graph."""
    rng = np.random.default_rng(1)
    x = Tensor(xp.asarray(rng.standard_normal((3, 4))), requires_grad=True)
    w = Tensor(xp.asarray(rng.standard_normal((4, 4))), requires_grad=True)
    seen = []
    w.register_grad_hook(lambda p: seen.append(p.grad.copy()))
    y = checkpoint(lambda h: (h @ w).tanh(), x, [w])
    ((y @ w) * y).sum().backward()
    x2, w2 = Tensor(x.data, requires_grad=True), Tensor(w.data, requires_grad=True)
    y2 = (x2 @ w2).tanh()
    ((y2 @ w2) * y2).sum().backward()
    assert len(seen) == 1
    np.testing.assert_allclose(H(seen[0]), H(w2.grad), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(H(x.grad), H(x2.grad), rtol=1e-13, atol=1e-15)


@pytest.mark.cpu_only("gradcheck's central differences run on numpy (as tests/test_gradcheck.py)")
def test_gradcheck_through_the_recompute():
    rng = np.random.default_rng(2)
    x = Tensor(rng.standard_normal((3, 5)), requires_grad=True)
    w = Tensor(rng.standard_normal((5, 5)), requires_grad=True)
    gradcheck(lambda x, w: checkpoint(lambda h: (h @ w).tanh() * h, x, [w]), [x, w])


def test_dropout_replays_the_same_mask(xp):
    from minidist.autograd import ops
    rng = backend.rng(5)
    x = Tensor(xp.ones((64, 64)), requires_grad=True)
    y = checkpoint(lambda h: ops.dropout(h, 0.5, rng) * 3.0, x, [], rng)
    y.sum().backward()
    np.testing.assert_array_equal(H(x.grad), H((y.data != 0) * 3.0 * 2.0))  # the forward's mask


def test_eval_and_no_grad_skip_the_checkpoint(xp):
    model = GPT(CFG, seed=3).set_checkpointing(True)
    with no_grad():
        _, loss = model(_batch(xp), _batch(xp))
    assert loss.grad_fn is None
    out = model.generate(_batch(xp)[:1, :4], 3)
    assert out.shape == (1, 7)


def test_several_outputs_travel_through_one_checkpoint(xp):
    """fn returning (y, a scalar) (an MoE block: its output and its router loss): both come
    out of the checkpoint, and the gradient of a loss using both is the one without it."""
    rng = np.random.default_rng(2)
    w0, x0 = rng.standard_normal((3, 3)), rng.standard_normal((2, 3))

    def grads(ckpt):
        w = Tensor(xp.asarray(w0), requires_grad=True)
        x = Tensor(xp.asarray(x0), requires_grad=True)

        def fn(x):
            y = (x @ w).tanh()                                  # (2, 3)
            return y, (y * y).mean()                            # (2, 3), ()
        y, side = checkpoint(fn, x, [w]) if ckpt else fn(x)
        assert y.shape == (2, 3) and side.shape == ()
        loss = (y * 3.0).sum() + side * 0.5
        loss.backward()
        return loss.item(), H(w.grad), H(x.grad)

    plain, ckpt = grads(False), grads(True)
    assert plain[0] == ckpt[0]
    for a, b in zip(plain[1:], ckpt[1:]):
        np.testing.assert_array_equal(a, b)
