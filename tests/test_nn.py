"""Module tree (names, order, tied parameters, modes, state dicts) and the four layers against
NumPy formulas. Modules build their parameters on --device; inputs come from the `xp`
fixture and results are compared on the host (python -m pytest tests/test_nn.py --device cuda)."""
import numpy as np
import pytest

from minidist import backend
from minidist.autograd import Tensor
from minidist.backend import to_host as H
from minidist.nn import (Dropout, Embedding, LayerNorm, Linear, Module, ModuleDict, ModuleList,
                         Parameter)


class Tiny(Module):
    def __init__(self):
        super().__init__()
        self.emb = Embedding(5, 3, rng=backend.rng(0))
        self.layers = ModuleList([Linear(3, 4, rng=backend.rng(1)), Linear(4, 3, bias=False)])
        self.tied = self.emb.weight                   # the same Parameter under a second name
        self.drop = Dropout(0.5, rng=backend.rng(2))


def test_named_parameters_order_names_and_tied_once():
    m = Tiny()
    names = [n for n, _ in m.named_parameters()]
    assert names == ["emb.weight", "layers.0.weight", "layers.0.bias", "layers.1.weight"]
    assert m.num_parameters() == 15 + 12 + 4 + 12
    assert [n for n, _ in ModuleDict(a=Linear(2, 2)).named_parameters()] == ["a.weight",
                                                                              "a.bias"]


def test_train_eval_reaches_every_module():
    m = Tiny().eval()
    assert not any(mod.training for _, mod in m.named_modules())
    m.train()
    assert all(mod.training for _, mod in m.named_modules())


def test_state_dict_round_trip_and_errors(device):
    a, b = Tiny(), Tiny()
    for p in b.parameters():
        p.data = p.data + 1.0
    b.load_state_dict(a.state_dict())
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(H(pa.data), H(pb.data))
        assert pa.data is not pb.data, na                 # copied, not shared
    sd = a.state_dict()
    sd["layers.0.weight"] = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match=r"layers.0.weight has shape \(4, 3\)"):
        b.load_state_dict(sd)
    sd = a.state_dict()
    del sd["emb.weight"]
    with pytest.raises(KeyError, match="missing"):
        b.load_state_dict(sd)
    assert b.load_state_dict(sd, strict=False) == (["emb.weight"], [])


def test_load_state_dict_casts_to_parameter_dtype(device):
    lin = Linear(2, 2, dtype="float32")
    lin.load_state_dict({"weight": np.ones((2, 2)), "bias": np.zeros(2)})
    assert lin.weight.dtype == np.float32 and lin.bias.dtype == np.float32


def test_linear_is_x_at_w_plus_b_with_in_out_layout(xp):
    lin = Linear(3, 5, rng=backend.rng(0), dtype="float64")
    lin.bias.data[:] = xp.arange(5)
    assert lin.weight.shape == (3, 5)
    x = np.random.default_rng(1).standard_normal((2, 4, 3))
    y = lin(Tensor(xp.asarray(x)))
    w, b = H(lin.weight.data), H(lin.bias.data)
    np.testing.assert_allclose(H(y.data), x @ w + b, rtol=1e-12)
    y.sum().backward()
    np.testing.assert_allclose(H(lin.weight.grad), x.reshape(-1, 3).T @ np.ones((8, 5)))
    np.testing.assert_allclose(H(lin.bias.grad), np.full(5, 8.0))


def test_embedding_rows_and_gradient_accumulates_repeats(xp):
    emb = Embedding(4, 2, rng=backend.rng(0), dtype="float64")
    idx = xp.asarray(np.array([[1, 1, 3]]))
    out = emb(idx)
    np.testing.assert_array_equal(H(out.data)[0], H(emb.weight.data)[[1, 1, 3]])
    out.sum().backward()
    np.testing.assert_array_equal(H(emb.weight.grad)[:, 0], [0, 2, 0, 1])


def test_layer_norm_matches_formula_and_no_bias_variant(xp):
    x = np.random.default_rng(0).standard_normal((3, 6))
    for bias in (True, False):
        ln = LayerNorm(6, bias=bias, dtype="float64")
        ln.weight.data[:] = 2.0
        ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * 2
        np.testing.assert_allclose(H(ln(Tensor(xp.asarray(x))).data), ref, rtol=1e-10,
                                   atol=1e-12)
        assert (ln.bias is None) == (not bias)


def test_dropout_train_and_eval(xp):
    d = Dropout(0.5, rng=backend.rng(0))
    x = Tensor(xp.ones((1000,), np.float32))
    y = H(d(x).data)
    assert set(np.unique(y)) <= {0.0, 2.0} and 0.4 < (y == 0).mean() < 0.6
    d.eval()
    assert d(x) is x


def test_parameter_flags():
    assert Parameter(np.zeros(2)).requires_grad
    assert not Linear(2, 2).bias.decay and Linear(2, 2).weight.decay
    assert not Embedding(2, 2).weight.decay and not LayerNorm(2).weight.decay


def test_a_modules_repr_is_one_line_for_a_debugger():
    """`p self` in a layer's forward printed `<minidist.nn.layers.Linear object at 0x...>`:
    one line now, its own parameters' shapes, its children by name (a long ModuleList cut),
    the parameters in all (first-use walk of 2026-11-30)."""
    layer = Linear(4, 3)
    assert repr(layer) == "Linear(weight (4, 3), bias (3,); 15 parameters)"
    blocks = ModuleList([LayerNorm(2) for _ in range(8)])
    assert repr(blocks) == "ModuleList(0, 1, 2, ..., 7; 32 parameters)"
    assert repr(ModuleDict(ln=LayerNorm(2), fc=layer)) == \
        "ModuleDict(ln, fc; 19 parameters)"
