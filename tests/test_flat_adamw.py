"""FlatAdamW (minidist/optim/flat_adamw.py) equals AdamW bitwise on a GPT over several steps
(float64 and float32, decay and no-decay groups), falls back exactly when a gradient is
missing, survives checkpoints and rebound parameters; the fused CuPy AdamW kernel stays off
for numpy arrays (the kernel itself runs on the CPU against adamw_update in
tests/test_cuda_kernels_cpu.py)."""
import numpy as np
import pytest

from minidist.backend import to_host as H
from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW, FlatAdamW
from minidist.optim.adamw import fused_adamw_ok
from minidist.strategy.memory import ledger

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=6, vocab_size=11)


def _batch(step, B=2):
    r = np.random.default_rng(50 + step)
    return r.integers(0, 11, (B, 6)), r.integers(0, 11, (B, 6))


def _train(opt_cls, dtype, steps=4, drop_grad_at=None):
    model = GPT(TINY, seed=3, dtype=dtype)
    opt = opt_cls(model.named_parameters(), lr=0.01, weight_decay=0.1)
    for step in range(steps):
        _, loss = model(*_batch(step))
        loss.backward()
        if step == drop_grad_at:              # a parameter without a gradient this step
            model.transformer.ln_f.weight.grad = None
            model.transformer.h[0].mlp.c_fc.weight.grad = None
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_flat_adamw_is_bitwise_adamw(xp, dtype):
    ref, ref_opt = _train(AdamW, dtype)
    flat, opt = _train(FlatAdamW, dtype)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert len(opt.flats) == 2 and all(f.param.ndim == 1 for f in opt.flats)
    for (name, p), (_, q) in zip(ref.named_parameters(), flat.named_parameters()):
        assert np.array_equal(H(p.data), H(q.data)), name
        assert any(xp.shares_memory(q.data, f.param) for f in opt.flats), name  # a view
    for name, s in ref_opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(H(s[key]), H(opt.state[name][key])), (name, key)
        assert s["step"] == opt.state[name]["step"] == 4


def test_missing_gradient_falls_back_to_per_parameter_exactly(xp):
    ref, ref_opt = _train(AdamW, "float64", steps=4, drop_grad_at=1)
    flat, opt = _train(FlatAdamW, "float64", steps=4, drop_grad_at=1)
    for (name, p), (_, q) in zip(ref.named_parameters(), flat.named_parameters()):
        assert np.array_equal(H(p.data), H(q.data)), name
    assert opt.state["transformer.ln_f.weight"]["step"] == 3
    assert ref_opt.state["transformer.ln_f.weight"]["step"] == 3


def test_the_flat_gradient_is_made_by_the_first_step_that_gathers_and_counted(xp):
    """No flat gradient until a step gathers into it (the multi path on cupy never does:
    tests/test_multi_tensor.py); a group that falls back per parameter gathers nothing; once
    made, the ledger counts it with the gradients (after zero_grad: flat grad, scratch)."""
    fresh = FlatAdamW(GPT(TINY, seed=3, dtype="float32").named_parameters())
    assert [f.grad for f in fresh.flats] == [None, None]
    assert fresh.ledger_arrays() == {"grads": []}
    model, opt = _train(FlatAdamW, "float32", steps=2)
    n = model.num_parameters()
    assert all(f.grad is not None for f in opt.flats)
    assert ledger(model.parameters(), opt)["grads"] == 2 * 4 * n
    _, opt = _train(FlatAdamW, "float32", steps=2, drop_grad_at=0)
    decay, no_decay = opt.flats          # ln_f.weight's step count differs: per parameter
    assert decay.grad is None and no_decay.grad is None       # c_fc.weight too, for decay


def test_state_dict_moves_between_adamw_and_flat_adamw(xp):
    a, a_opt = _train(AdamW, "float64", steps=2)
    f, f_opt = _train(FlatAdamW, "float64", steps=2)
    f2 = GPT(TINY, seed=9, dtype="float64")
    f2_opt = FlatAdamW(f2.named_parameters(), lr=0.01, weight_decay=0.1)
    f2.load_state_dict(a.state_dict())          # rebinds .data: step() copies it back in
    f2_opt.load_state_dict(a_opt.state_dict())  # AdamW's checkpoint into FlatAdamW
    a2 = GPT(TINY, seed=9, dtype="float64")
    a2.load_state_dict(f.state_dict())
    a2_opt = AdamW(a2.named_parameters(), lr=0.01, weight_decay=0.1)
    a2_opt.load_state_dict(f_opt.state_dict())  # and FlatAdamW's into AdamW
    for step in (2, 3):
        for model, opt in ((a, a_opt), (f2, f2_opt), (a2, a2_opt)):
            _, loss = model(*_batch(step))
            loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, p), (_, q), (_, r) in zip(a.named_parameters(), f2.named_parameters(),
                                         a2.named_parameters()):
        assert np.array_equal(H(p.data), H(q.data)), name
        assert np.array_equal(H(p.data), H(r.data)), name
    assert all(any(xp.shares_memory(p.data, f.param) for f in f2_opt.flats)    # step()
               for p in f2.parameters())                           # put them back in


def test_weights_loaded_after_the_optimizer_was_built_are_the_ones_stepped(xp):
    """model.load_state_dict after FlatAdamW was built (no optimizer state to load, as
    --init-from gives): the parameters' .data are new arrays, which step() copies into the
    flat buffer and points back at it, so it steps the loaded weights as AdamW does."""
    weights, _ = _train(AdamW, "float64", steps=1)
    models = []
    for opt_cls in (AdamW, FlatAdamW):
        model = GPT(TINY, seed=9, dtype="float64")
        opt = opt_cls(model.named_parameters(), lr=0.01, weight_decay=0.1)
        model.load_state_dict(weights.state_dict())
        for step in (1, 2):
            _, loss = model(*_batch(step))
            loss.backward()
            opt.step()
            opt.zero_grad()
        models.append(model)
    for (name, p), (_, q) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert np.array_equal(H(p.data), H(q.data)), name


def test_fused_kernel_is_off_for_numpy_and_with_kernels_switched_off(monkeypatch):
    a = np.zeros(4, np.float32)
    assert not fused_adamw_ok(a, a, a, a)
    monkeypatch.setenv("MINIDIST_CUDA_KERNELS", "0")
    assert not fused_adamw_ok(a, a, a, a)
