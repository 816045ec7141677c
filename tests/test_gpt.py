"""GPT: GPT-2 names and shapes, the init contract, gradients (float64 finite differences of the
whole model's loss, every element of every parameter), overfitting one batch, generation, and
errors on bad input. The models live on --device (the `device` fixture); results are compared
on the host."""
import numpy as np
import pytest

from minidist.autograd import no_grad
from minidist.backend import to_host as H
from minidist.nn import GPT, GPTConfig, gpt_init, gpt_param_specs
from minidist.nn.module import Parameter
from minidist.optim import AdamW

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=6, vocab_size=11)


def _batch(config, B=2, seed=0):
    r = np.random.default_rng(seed)
    x = r.integers(0, config.vocab_size, (B, config.block_size))
    return x, r.integers(0, config.vocab_size, (B, config.block_size))


def test_gpt2_small_names_shapes_and_count():
    specs = gpt_param_specs(GPTConfig())                    # GPT-2 small (124M)
    assert sum(int(np.prod(s)) for s, _ in specs.values()) == 124_439_808
    assert list(specs)[:4] == ["transformer.wte.weight", "transformer.wpe.weight",
                               "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias"]
    assert specs["transformer.h.11.attn.c_attn.weight"][0] == (768, 2304)
    assert specs["transformer.h.0.mlp.c_proj.weight"][0] == (3072, 768)
    assert list(specs)[-1] == "transformer.ln_f.bias"


def test_model_parameters_follow_the_specs_in_order():
    for bias in (True, False):
        config = GPTConfig(**{**TINY.to_dict(), "bias": bias})
        model = GPT(config)
        specs = gpt_param_specs(config)
        assert [(n, p.shape) for n, p in model.named_parameters()] == [
            (n, s) for n, (s, _) in specs.items()]
        assert all(not n.endswith(".bias") for n in specs) or bias


def test_init_contract_deterministic_by_name_and_cast_from_float64(device):
    full = gpt_init(TINY, seed=3)
    again = gpt_init(TINY, seed=3)
    assert all(np.array_equal(full[n], again[n]) for n in full)
    part = gpt_init(TINY, seed=3, names=["transformer.h.1.attn.c_attn.weight"])
    np.testing.assert_array_equal(part["transformer.h.1.attn.c_attn.weight"],
                                  full["transformer.h.1.attn.c_attn.weight"])
    f64 = gpt_init(TINY, seed=3, dtype="float64")
    np.testing.assert_array_equal(f64["transformer.wte.weight"].astype(np.float32),
                                  full["transformer.wte.weight"])
    assert not np.array_equal(gpt_init(TINY, seed=4)["transformer.wte.weight"],
                              full["transformer.wte.weight"])
    model = GPT(TINY, seed=3)
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(H(p.data), full[name], err_msg=name)


class LoadCountingGPT(GPT):
    """GPT counting its load_state_dict calls (each walks every parameter of the model)."""
    loads = 0

    def load_state_dict(self, state, strict=True):
        LoadCountingGPT.loads += 1
        return super().load_state_dict(state, strict)


def test_the_build_loads_a_block_at_a_time():
    """GPT.init_parameters loads a block's numbers (or a root parameter's) at once: a load
    a parameter walked the whole model each time, and 12 blocks of 64 experts (3,184
    parameters) took 20 s to build (0.1 s drawn whole, 0.2 s a block at a time). The
    numbers are gpt_init's whole draw's."""
    config = GPTConfig(n_layer=3, n_head=2, n_embd=8, block_size=6, vocab_size=11,
                       moe_experts=4)
    LoadCountingGPT.loads = 0
    model = LoadCountingGPT(config, seed=5)
    roots = sum(not n.startswith("transformer.h.") for n, _ in model.named_parameters())
    assert LoadCountingGPT.loads == config.n_layer + roots
    full = gpt_init(config, seed=5)
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(H(p.data), full[name], err_msg=name)


class ExtraParameterGPT(GPT):
    """GPT with a parameter gpt_param_specs does not know."""

    def build_transformer(self, layers):
        transformer = super().build_transformer(layers)
        transformer.extra = Parameter(np.zeros(3, np.float32))
        return transformer


def test_a_parameter_gpt_init_does_not_know_is_refused():
    """The build loads a part at a time, not strictly: a parameter without gpt_init's numbers
    would keep its zeros silently (the whole model's strict load raised KeyError)."""
    with pytest.raises(KeyError, match="transformer.extra"):
        ExtraParameterGPT(TINY)


def test_init_statistics_follow_gpt2():
    config = GPTConfig(n_layer=8, n_head=4, n_embd=256, block_size=64, vocab_size=512)
    init = gpt_init(config, seed=0, dtype="float64")
    assert init["transformer.wte.weight"].std() == pytest.approx(0.02, rel=0.02)
    assert init["transformer.h.0.attn.c_proj.weight"].std() == pytest.approx(0.02 / 4, rel=0.03)
    assert init["transformer.h.0.mlp.c_proj.weight"].std() == pytest.approx(0.02 / 4, rel=0.03)
    assert np.all(init["transformer.h.0.ln_1.weight"] == 1)
    assert np.all(init["transformer.h.0.attn.c_attn.bias"] == 0)


def test_forward_shapes_and_loss_none_without_targets(device):
    model = GPT(TINY)
    x, y = _batch(TINY)
    logits, loss = model(x)
    assert logits.shape == (2, 6, 11) and loss is None
    logits, loss = model(x[:, :4], y[:, :4])
    assert logits.shape == (2, 4, 11) and loss.shape == ()
    assert abs(loss.item() - np.log(11)) < 0.5                # near uniform at init


def test_tied_embedding_is_one_parameter_with_both_gradients(device):
    model = GPT(TINY, dtype="float64")
    x, y = _batch(TINY)
    _, loss = model(x, y)
    loss.backward()
    g = H(model.transformer.wte.weight.grad)
    unused = np.setdiff1d(np.arange(11), x)                   # rows never looked up
    assert len(unused) and np.abs(g[unused]).max() > 0      # still get the head's gradient


def test_whole_model_gradient_matches_finite_differences(device):
    """Every element of every parameter (1888 of them: both blocks' layer norms, attention
    and MLP weights and biases, wte by both its uses, wpe, ln_f): backward's gradient of the
    loss against its central difference, float64, with an ignored target among them. Every
    parameter gets some gradient (none is cut off the loss, which both sides would agree on
    as zero). About 3800 forwards of a tiny model: seconds."""
    config = GPTConfig(**{**TINY.to_dict(), "block_size": 5})
    model = GPT(config, seed=1, dtype="float64")
    x, y = _batch(config, seed=2)
    y[0, 1] = -1                                              # an ignored target too
    _, loss = model(x, y)
    loss.backward()
    eps, checked = 1e-6, 0
    for name, p in model.named_parameters():
        grad, numeric = H(p.grad), np.zeros(p.shape)
        for i in np.ndindex(p.shape):
            orig = float(p.data[i])
            with no_grad():
                p.data[i] = orig + eps
                plus = model(x, y)[1].item()
                p.data[i] = orig - eps
                minus = model(x, y)[1].item()
            p.data[i] = orig
            numeric[i] = (plus - minus) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-8, err_msg=name)
        assert np.abs(grad).max() > 0, f"{name}: no gradient reaches it"
        checked += p.size
    assert checked == sum(p.size for p in model.parameters()) == 1888


def test_tiny_model_overfits_a_fixed_batch(device):
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=32)
    model = GPT(config, seed=0)
    opt = AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.0)
    x, y = _batch(config, B=4)
    for _ in range(150):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.05


def test_generate_is_deterministic_under_a_seed_and_crops_context(device):
    model = GPT(TINY, seed=0)
    prompt = np.array([[1, 2, 3]])
    a = model.generate(prompt, 10, temperature=1.0, top_k=5, seed=7)
    b = model.generate(prompt, 10, temperature=1.0, top_k=5, seed=7)
    c = model.generate(prompt, 10, temperature=1.0, top_k=5, seed=8)
    assert a.shape == (1, 13) and np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.array_equal(a[:, :3], prompt) and a.max() < 11
    greedy = model.generate(prompt, 4, temperature=0)
    logits, _ = model(prompt)
    assert greedy[0, 3] == H(logits.data)[0, -1].argmax()
    assert model.training                                      # mode restored


def test_dropout_masks_are_seeded_and_off_in_eval(device):
    config = GPTConfig(**{**TINY.to_dict(), "dropout": 0.3})
    x, y = _batch(config)
    losses = [GPT(config, seed=5)(x, y)[1].item() for _ in range(2)]
    assert losses[0] == losses[1]
    model = GPT(config, seed=5)
    assert model(x, y)[1].item() != model(x, y)[1].item()     # the generator moves on
    model.eval()
    assert model(x, y)[1].item() == model(x, y)[1].item()


def test_top_k_draws_from_the_k_largest_logits_only():
    """sample(): top_k 2 of logits 0, 1, 2, 3 draws tokens 2 and 3 alone, both; top_k 1 is
    the argmax; temperature 0 the argmax whatever top_k."""
    from minidist import backend
    from minidist.nn.sampling import sample
    logits = np.array([[0.0, 1.0, 2.0, 3.0]] * 400)
    assert set(sample(logits, 1.0, 2, backend.rng(0)).tolist()) == {2, 3}
    assert set(sample(logits, 1.0, 1, backend.rng(0)).tolist()) == {3}
    assert set(sample(logits, 0, 2, backend.rng(0)).tolist()) == {3}
    assert set(sample(logits, 1.0, None, backend.rng(0)).tolist()) == {0, 1, 2, 3}


def test_bad_input_is_a_clear_error(device):
    model = GPT(TINY)
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(np.zeros((1, 7), np.int64))
    with pytest.raises(ValueError, match="integer dtype and shape"):
        model(np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=10, n_head=3)


def test_a_token_id_outside_the_vocabulary_is_one_clear_error(device):
    """numpy raised a bare IndexError deep in the embedding for an id >= V, CuPy wraps such
    an id around silently (and its cross-entropy kernels read past the logits), and on both
    a negative id wrapped and an id in the padding rows (vocab_multiple) was taken. The
    batch is checked on the host, where it arrives: a ValueError naming the id and V, for
    idx and targets (whose -1 is the loss's ignore_index), padded or not."""
    for config in (TINY, GPTConfig(**{**TINY.to_dict(), "vocab_multiple": 8})):
        model = GPT(config)
        x, y = _batch(config)
        for bad in (11, 13, -1):
            xb = x.copy()
            xb[1, 2] = bad
            with pytest.raises(ValueError, match=rf"^idx: token id {bad} is outside the "
                                                 r"vocabulary of 11 tokens \(ids 0\.\.10\)"):
                model(xb, y)
        for bad in (11, 13, -2):
            yb = y.copy()
            yb[0, 3] = bad
            with pytest.raises(ValueError, match=rf"^targets: token id {bad} is outside the "
                                                 r"vocabulary of 11 tokens \(ids 0\.\.10, or "
                                                 r"-1: ignored\)"):
                model(x, yb)
        y[0, 3] = -1
        assert np.isfinite(float(H(model(x, y)[1].data)))          # ignore_index is allowed


def test_flops_per_token_formula():
    config = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=128, vocab_size=256)
    model = GPT(config)
    n = 4 * 12 * 256 ** 2 + 256 * 256
    assert model.flops_per_token() == 6 * n + 12 * 4 * 128 * 256


def _padded_and_plain(dtype="float64"):
    plain = GPT(TINY, seed=5, dtype=dtype)
    padded = GPT(GPTConfig(**{**TINY.to_dict(), "vocab_multiple": 8}), seed=5, dtype=dtype)
    return plain, padded


def test_vocab_padding_changes_no_number_and_pad_rows_stay_zero(device):
    """V 11 padded to 16 rows: the same logits (B, T, V) (bitwise before the first step), loss
    and gradients to 1e-14 and 1e-13 (the softmax row sums add zeros) as the unpadded model,
    float64, over 3 AdamW steps; the pad rows' gradient is 0 and they stay 0; sampling draws
    the same tokens."""
    plain, padded = _padded_and_plain()
    wte = padded.transformer.wte.weight
    assert padded.config.padded_vocab_size == 16 and wte.shape == (16, 8)
    assert not H(wte.data)[11:].any()
    opts = [AdamW(m.named_parameters(), lr=0.05) for m in (plain, padded)]
    for step in range(3):
        x, y = _batch(TINY, seed=step)
        outs = [m(x, y) for m in (plain, padded)]
        (l0, a), (l1, b) = outs
        assert l0.shape == l1.shape == (2, 6, 11)
        # the softmax sums 5 more zeros: row sums may round differently in the last bit, so
        # after a step the weights (and logits) differ by rounding, bitwise before it
        tol = 0 if step == 0 else 1e-12
        np.testing.assert_allclose(H(l0.data), H(l1.data), rtol=tol, atol=tol)
        assert abs(float(a.data) - float(b.data)) <= 1e-14 * abs(float(a.data))
        for _, o in outs:
            o.backward()
        g = H(wte.grad)
        np.testing.assert_allclose(g[:11], H(plain.transformer.wte.weight.grad), rtol=1e-13,
                                   atol=1e-16)
        assert not g[11:].any()
        for o in opts:
            o.step()
            o.zero_grad()
    assert not H(wte.data)[11:].any()
    for (name, p), (_, q) in zip(plain.state_dict().items(), padded.state_dict().items()):
        assert p.shape == q.shape, name                   # state_dict: no padding rows
        # atol: the attention's key bias has a ~0 gradient (softmax ignores it), AdamW's
        # m / sqrt(v) turns its rounding noise into steps of ~1e-13
        np.testing.assert_allclose(H(p), H(q), rtol=1e-10, atol=1e-10, err_msg=name)
    idx = np.zeros((1, 1), np.int64)
    assert np.array_equal(plain.generate(idx, 5, seed=1), padded.generate(idx, 5, seed=1))


def test_vocab_padding_loads_unpadded_state_and_refuses_a_bad_multiple(device):
    plain, padded = _padded_and_plain()
    padded.load_state_dict(plain.state_dict())           # pad rows added, zero
    assert padded.transformer.wte.weight.shape == (16, 8)
    plain.load_state_dict(padded.state_dict())           # and stripped on the way out
    with pytest.raises(ValueError, match="vocab_multiple"):
        GPTConfig(vocab_multiple=0)


@pytest.mark.parametrize("block", [{}, dict(arch="llama", bias=False, n_kv_head=2),
                                   dict(arch="llama", bias=False, n_kv_head=1)],
                         ids=["gpt2", "llama-gqa", "llama-mqa"])
def test_sampling_with_the_kv_cache_is_the_whole_context_forward(block):
    """minidist/nn/kv_cache.py: the logits after each token, run alone against the cached k
    and v, are the whole context's (float64, 1e-12), through the prompt, token by token and
    past block_size (where the window slides and the cache starts again); generate's tokens
    (sampled, which uses the cache) are the uncached steps' own."""
    from minidist import backend
    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=12, vocab_size=50, **block)
    model = GPT(config, seed=0, dtype="float64").eval()
    idx = np.random.default_rng(0).integers(0, 50, (2, 20))
    cache = model.sampling_cache()
    with no_grad():
        for T in range(5, 21):
            ctx = idx[:, max(0, T - 12):T]
            np.testing.assert_allclose(model.last_logits(ctx, cache), model.last_logits(ctx),
                                       rtol=1e-12, atol=1e-12)
    assert cache.length == 12                       # refilled after sliding past block_size
    out = model.generate(idx[:, :5], 15, temperature=1.0, seed=4)
    rng, steps = backend.rng(4), idx[:, :5]
    with no_grad():
        for _ in range(15):
            nxt = model.next_token(steps[:, -12:], 1.0, None, rng)      # no cache
            steps = np.concatenate([steps, nxt[:, None]], axis=1)
    np.testing.assert_array_equal(out, steps)
