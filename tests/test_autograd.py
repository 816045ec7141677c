"""The engine: dtypes, accumulation, hooks, freeing, deep graphs, no_grad, errors, and the
ops whose behaviour is more than a gradient (split's one buffer, embedding's scatter-add,
dropout's seed contract, cast's dtypes). Gradients themselves: tests/test_gradcheck.py.

Run: python -m pytest -q tests/test_autograd.py [--device cuda]: P() and the op tests build
their arrays on --device (the `device` fixture, used by every test here) and compare on the
host; the hypothesis gradient checks and numpy-only checks are marked cpu_only.
"""
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

from minidist import backend
from minidist.autograd import Function, Tensor, is_grad_enabled, no_grad, ops
from minidist.autograd.gradcheck import gradcheck
from minidist.autograd.indexing import scatter_add_rows
from minidist.backend import to_host as H

pytestmark = pytest.mark.usefixtures("device")      # backend.get_xp() is --device's module
rng = np.random.default_rng(0)


def A(a):
    """A host array moved to --device (numpy: no copy)."""
    return backend.get_xp().asarray(a)


def P(*shape, dtype=np.float64):
    """A parameter-like leaf on --device."""
    return Tensor(A(rng.standard_normal(shape).astype(dtype)), requires_grad=True)


# ---- dtypes --------------------------------------------------------------------------------

@pytest.mark.cpu_only("Tensor(list) makes numpy arrays by design: the host constructor")
def test_python_floats_default_to_float32():
    assert Tensor([1.0, 2.0]).dtype == np.float32 and Tensor(3.0).dtype == np.float32
    assert Tensor([1, 2]).dtype.kind == "i"
    assert Tensor(np.zeros(2)).dtype == np.float64          # an array keeps its dtype
    s = Tensor(np.float64(2.0))                             # a numpy scalar: a 0-d array
    assert s.dtype == np.float64 and isinstance(s.data, np.ndarray) and s.shape == ()


def test_float32_stays_float32_through_ops_and_scalars():
    x = P(3, 4, dtype=np.float32)
    y = ((x * 0.5 + 1) * np.float64(2.0) / np.float64(3.0)).exp().sum()
    assert y.dtype == np.float32
    y.backward()
    assert x.grad.dtype == np.float32


def test_float64_seed_gradient_does_not_promote():
    x = P(2, 3, dtype=np.float32)
    (x * 2.0).backward(A(np.ones((2, 3))))
    assert x.grad.dtype == np.float32


def test_mixed_float_arrays_are_an_error_naming_op_and_dtypes():
    with pytest.raises(TypeError, match=r"Mul\(\(3, 4\) float32, \(4,\) float64\).*mixed"):
        P(3, 4, dtype=np.float32) * P(4)


def test_cast_forward_dtype_and_gradient_cast_back():
    x = P(3, dtype=np.float32)
    h = ops.cast(x, "float16")
    assert h.dtype == np.float16
    (h * 2.0).sum().backward()
    assert x.grad.dtype == np.float32
    np.testing.assert_array_equal(H(x.grad), 2.0)


# ---- accumulation --------------------------------------------------------------------------

def test_leaf_used_twice_gets_both_contributions():
    x = P(3)
    (x * x + x).sum().backward()
    np.testing.assert_allclose(H(x.grad), 2 * H(x.data) + 1)


def test_interior_node_used_twice():
    x = P(3)
    h = x * 3.0
    (h * h + h).sum().backward()                            # d/dx = 3 (2h + 1)
    np.testing.assert_allclose(H(x.grad), 3 * (2 * H(h.data) + 1))


def test_x_plus_x_same_array_to_both_inputs():
    x = P(2, 2)
    h = x * 1.0
    (h + h).sum().backward()
    np.testing.assert_allclose(H(x.grad), 2.0)


def test_grads_accumulate_across_backward_calls():
    x = P(4)
    (x * 2.0).sum().backward()
    (x * 3.0).sum().backward()
    np.testing.assert_allclose(H(x.grad), 5.0)


@pytest.mark.cpu_only("gradcheck: numpy finite differences")
@settings(max_examples=25, deadline=None)
@given(shapes=mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=3),
       op=st.sampled_from(["add", "sub", "mul", "div"]))
def test_broadcasting_gradients(shapes, op):
    a, b = (Tensor(rng.uniform(0.5, 2.0, s), requires_grad=True) for s in shapes.input_shapes)
    fn = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b,
          "mul": lambda a, b: a * b, "div": lambda a, b: a / b}[op]
    assert fn(a, b).shape == shapes.result_shape
    gradcheck(fn, [a, b], name=f"{op}{shapes.input_shapes}")


@pytest.mark.cpu_only("gradcheck: numpy finite differences")
@settings(max_examples=20, deadline=None)
@given(shapes=mutually_broadcastable_shapes(signature=np.matmul.signature, max_dims=2,
                                            max_side=3))
def test_matmul_broadcasting_gradients(shapes):
    """1-D operands, batch broadcasting on either side: numpy's matmul rules."""
    a, b = (Tensor(rng.standard_normal(s), requires_grad=True) for s in shapes.input_shapes)
    assert ops.matmul(a, b).shape == shapes.result_shape
    gradcheck(ops.matmul, [a, b], name=f"matmul{shapes.input_shapes}")


# ---- hooks ---------------------------------------------------------------------------------

def test_hooks_fire_once_after_grad_complete_in_reverse_usage_order():
    w1, w2, tied = P(4, 4), P(4, 4), P(4, 4)
    x = Tensor(A(rng.standard_normal((2, 4))))
    fired = []

    def hook(name):
        def fn(p):
            fired.append((name, p.grad.copy()))
        return fn

    for name, p in (("w1", w1), ("w2", w2), ("tied", tied)):
        p.register_grad_hook(hook(name))
    h = (x @ tied).tanh()                    # tied used first ...
    h = (h @ w1).tanh()
    h = (h @ w2) @ tied                      # ... and last, like GPT-2's wte
    h.sum().backward()
    names = [n for n, _ in fired]
    assert sorted(names) == ["tied", "w1", "w2"]            # exactly once each
    assert names.index("w2") < names.index("w1")            # reverse of use
    for name, grad_at_hook in fired:                        # complete when it fired
        want = {"w1": w1, "w2": w2, "tied": tied}[name].grad
        np.testing.assert_array_equal(H(grad_at_hook), H(want))


def test_hook_on_leaf_backward_and_removal():
    x = P(1)
    calls = []
    handle = x.register_grad_hook(lambda p: calls.append(1))
    x.sum().backward()
    x.backward()
    handle.remove()
    x.sum().backward()
    assert calls == [1, 1]


def test_hook_only_on_leaves():
    with pytest.raises(RuntimeError, match="leaf"):
        (P(2) * 2.0).register_grad_hook(lambda p: None)


# ---- freeing, depth, no_grad ---------------------------------------------------------------

def test_backward_frees_the_graph_and_second_backward_raises():
    x = P(3)
    h = x.exp()
    loss = (h * h).sum()
    loss.backward()
    assert h.grad_fn.ctx is None and loss.grad_fn.ctx is None and loss.grad_fn.parents == ()
    with pytest.raises(RuntimeError, match="already freed"):
        loss.backward()


def test_deep_chain_has_no_recursion_limit():
    x = P(2)
    y = x
    for _ in range(10_000):
        y = y + 1.0
    y.sum().backward()
    np.testing.assert_array_equal(H(x.grad), 1.0)
    z = x
    for _ in range(30_000):                  # never backpropagated: dropping it must not crash
        z = z * 1.0
    del z


def test_no_grad_builds_no_graph_and_restores_state():
    x = P(3)
    with no_grad():
        assert not is_grad_enabled()
        y = x * 2.0
        with no_grad():
            pass
        assert not is_grad_enabled()
    assert is_grad_enabled()
    assert not y.requires_grad and y.grad_fn is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()
    with pytest.raises(ZeroDivisionError), no_grad():
        1 / 0
    assert is_grad_enabled()


def test_detach_item_and_properties():
    x = P(2, 3)
    d = (x * 2.0).detach()
    assert not d.requires_grad and d.grad_fn is None and d.shape == (2, 3)
    assert d.ndim == 2 and d.size == 6 and d.dtype == np.float64 and len(d) == 2
    assert isinstance(x.sum().item(), float)


def test_constants_get_no_gradient_work():
    seen = []

    class Spy(Function):
        @staticmethod
        def forward(ctx, a, b):
            seen.append(ctx.needs_input_grad)
            return a * b

        @staticmethod
        def backward(ctx, grad):
            return grad, grad

    Spy.apply(P(2), A(np.ones(2)))
    with no_grad():
        Spy.apply(P(2), P(2))
    assert seen == [(True, False), (False, False)]


# ---- errors --------------------------------------------------------------------------------

def test_matmul_shape_mismatch_names_op_and_shapes():
    with pytest.raises(ValueError, match=r"MatMul\(\(2, 3\) float64, \(4, 5\) float64\): "
                                         r"inner dimensions differ: 3 .* vs 4"):
        P(2, 3) @ P(4, 5)


def test_broadcast_mismatch_names_op_and_shapes():
    with pytest.raises(ValueError, match=r"Add\(\(3, 4\) float64, \(5,\) float64\)"):
        P(3, 4) + P(5)


def test_backward_on_non_scalar_needs_a_gradient():
    with pytest.raises(RuntimeError, match=r"non-scalar tensor of shape \(2, 3\)"):
        (P(2, 3) * 2.0).backward()
    with pytest.raises(ValueError, match=r"gradient of shape \(3,\) for a tensor of shape"):
        (P(2, 3) * 2.0).backward(A(np.ones(3)))


def test_embedding_rejects_float_ids():
    with pytest.raises(TypeError, match=r"Embedding\(\(5, 3\) float64, \(2,\) float64\).*int"):
        ops.embedding(P(5, 3), np.array([1.0, 2.0]))


def test_split_rejects_uneven_sections():
    with pytest.raises(ValueError, match=r"split: axis 1 of shape \(2, 5\)"):
        ops.split(P(2, 5), 2, axis=1)


# ---- op behaviour beyond gradients ---------------------------------------------------------

def test_split_with_another_consumer_and_unused_piece():
    x = P(4, 6)
    a, b, c = ops.split(x, [2, 1, 3], axis=1)
    (a.sum() * 2.0 + (x * 3.0).sum() + c.sum()).backward()
    want = np.full((4, 6), 3.0)
    want[:, :2] += 2.0
    want[:, 3:] += 1.0
    np.testing.assert_array_equal(H(x.grad), want)
    assert [p.shape for p in (a, b, c)] == [(4, 2), (4, 1), (4, 3)]


def test_split_without_grad_returns_views():
    x = Tensor(A(np.arange(6.0)))
    parts = ops.split(x, 3)
    assert [p.data.base is x.data for p in parts] == [True] * 3


@pytest.mark.parametrize("vocab", [7, 50257])
def test_embedding_scatter_add_matches_add_at(vocab):
    w = P(vocab, 4)
    idx = rng.integers(0, min(vocab, 20), size=(3, 50))      # many repeats
    g = rng.standard_normal((3, 50, 4))
    ops.embedding(w, idx).backward(A(g))
    want = np.zeros((vocab, 4))
    np.add.at(want, idx.reshape(-1), g.reshape(-1, 4))
    np.testing.assert_allclose(H(w.grad), want, rtol=1e-12, atol=1e-12)


class _FakeCupyArray(np.ndarray):
    """A numpy array that backend.is_cupy takes for a cupy one (patched below)."""


@pytest.mark.cpu_only("stands numpy in for cupy and a recording fake for cupyx")
def test_cupy_scatter_adds_16_bit_outs_in_float32(monkeypatch):
    """On CuPy, scatter_add_rows (TP's vocabulary-split embedding backward, MoE's combine;
    GetItem's backward too) adds through indexing._add_at into cupyx.scatter_add, which
    widened only bfloat16: a float16 `out` went as it was, and every atomicAdd on __half
    rounds (float16 stops counting ones at 2048; numpy's path adds in float32). The fake
    scatter adds in the dtype it is handed, as the atomics do. Every 16-bit out must reach
    it as float32 and come back in its own dtype, 3072 ones making 3072."""
    seen = []

    def scatter_add(a, index, values):
        seen.append(a.dtype)
        np.add.at(a, index, values)
    monkeypatch.setattr(backend, "is_cupy", lambda a: isinstance(a, _FakeCupyArray))
    monkeypatch.setitem(sys.modules, "cupy", np)       # xp_of's module for such arrays
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(scatter_add=scatter_add))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        dtype = np.dtype(dtype)
        out = np.zeros((3, 2), dtype).view(_FakeCupyArray)
        ids = np.array([1] * 3072 + [2])
        got = scatter_add_rows(out, ids, np.ones((3073, 2), dtype))
        assert seen == [np.float32], (dtype, seen)
        assert got.dtype == dtype and np.asarray(got)[:, 0].tolist() == [0, 3072, 1], dtype
        seen.clear()


def test_16_bit_embedding_gradients_are_summed_in_a_float32_table(monkeypatch):
    """Tensor parallelism's vocabulary-split lookup made its gradient table in the gradient's
    16-bit dtype, so on CuPy (indexing._add_at) every step widened the whole (V/tp, C) table
    to float32, scattered into the copy and copied it back: three passes over a table that
    started as zeros (Embedding's backward summed in a float32 table from the start). Both
    now hand scatter_add_rows a float32 table (indexing.rows_into_table) and round it once;
    the gradients are the same bit for bit."""
    from minidist.autograd import indexing
    from minidist.tp import layers
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 12, (3, 7))

    def grads(dtype, g):
        """(the lookup's gradient for rows 6..11 of 12, the whole embedding's)."""
        w = Tensor(np.zeros((6, 4), dtype), requires_grad=True)
        layers.VocabShardLookup.apply(w, idx, 6).backward(g)
        e = Tensor(np.zeros((12, 4), dtype), requires_grad=True)
        ops.embedding(e, idx).backward(g)
        return H(w.grad), H(e.grad)
    seen = []

    def scatter(out, index, rows):
        seen.append(out.dtype)
        return scatter_add_rows(out, index, rows)
    for dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        g = rng.standard_normal((3, 7, 4)).astype(dtype)
        want = grads(dtype, g)
        with monkeypatch.context() as m:
            m.setattr(indexing, "scatter_add_rows", scatter)
            m.setattr(layers, "scatter_add_rows", scatter, raising=False)
            got = grads(dtype, g)
        assert seen == [np.float32, np.float32], (dtype, seen)
        for a, b in zip(got, want):
            assert a.dtype == dtype and np.array_equal(a, b), dtype
        seen.clear()
    want = np.zeros((6, 4), np.float32)          # the lookup's gradient by hand, float32
    g = rng.standard_normal((3, 7, 4)).astype(np.float32)
    for i, row in zip(idx.reshape(-1), g.reshape(-1, 4)):
        if i >= 6:
            want[i - 6] += row
    got = grads(np.float16, g.astype(np.float16))[0]
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=2e-2)


def test_dropout_seed_contract():
    x = Tensor(A(np.ones((50, 40), np.float32)), requires_grad=True)
    a = ops.dropout(x, 0.25, backend.rng(11))
    b = ops.dropout(x, 0.25, backend.rng(11))
    np.testing.assert_array_equal(H(a.data), H(b.data))
    keep = backend.rng(11).random(x.shape, dtype="float32") >= 0.25   # the documented mask
    np.testing.assert_allclose(H(a.data), keep / 0.75, rtol=1e-6)
    assert a.dtype == np.float32
    a.sum().backward()
    np.testing.assert_allclose(H(x.grad), keep / 0.75, rtol=1e-6)
    assert ops.dropout(x, 0.0, None) is x and ops.dropout(x, 0.5, None, training=False) is x
    assert not ops.dropout(x, 1.0, backend.rng(0)).data.any()
    with pytest.raises(ValueError, match="probability"):
        ops.dropout(x, 1.5, backend.rng(0))


def test_max_splits_gradient_between_ties():
    x = Tensor(A(np.array([[1.0, 3.0, 3.0]])), requires_grad=True)
    x.max(axis=1).sum().backward()
    np.testing.assert_array_equal(H(x.grad), [[0.0, 0.5, 0.5]])


@pytest.mark.parametrize("op", ["add", "mul", "matmul", "exp", "tanh", "relu", "sum", "gelu",
                                "embedding"])
def test_float16_forward_backward(op):
    from minidist.autograd import fused as F
    x = Tensor(A(rng.standard_normal((4, 8)).astype(np.float16)), requires_grad=True)
    w = Tensor(A(rng.standard_normal((8, 8)).astype(np.float16)), requires_grad=True)
    fn = {"add": lambda: x + w[:4], "mul": lambda: x * w[:4], "matmul": lambda: x @ w,
          "exp": lambda: x.exp(), "tanh": lambda: x.tanh(), "relu": lambda: x.relu(),
          "sum": lambda: x.sum(axis=0), "gelu": lambda: F.gelu(x),
          "embedding": lambda: ops.embedding(w, np.array([1, 1, 3]))}[op]
    out = fn()
    assert out.dtype == np.float16
    out.sum().backward()
    for t in (x, w):
        assert t.grad is None or (t.grad.dtype == np.float16 and np.isfinite(H(t.grad)).all())


# ---- the backward split in two (zero-bubble pipelines' B and W) ---------------------------

def _split_backward(loss, weights):
    """B (inside defer_weight_grads) then W; returns the names of the ops queued for W."""
    from minidist.autograd.tensor import defer_weight_grads
    with defer_weight_grads(weights) as w:
        loss.backward()
    queued = [fn.__name__ for fn, *_ in w.work]
    assert all(p.grad is None for p in weights), "B must leave the weights' .grad alone"
    w.run()
    return queued


def test_split_backward_gives_the_same_gradients_bitwise_and_fires_hooks_after_w():
    """B then W on a GPT (float64) gives exactly the gradients of one plain backward; each
    weight's hook fires once, during W; the tied head's x @ wte.T waits for W too (wte.T is
    a view of a weight)."""
    from minidist.nn import GPT, GPTConfig
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=30)
    x = np.random.default_rng(0).integers(0, 30, (4, 8))
    y = np.roll(x, -1, axis=1)
    plain, split = GPT(config, seed=1, dtype="float64"), GPT(config, seed=1, dtype="float64")
    plain(x, y)[1].backward()
    fired = []
    for p in split.parameters():
        p.register_grad_hook(lambda leaf: fired.append(id(leaf)))
    loss = split(x, y)[1]
    queued = _split_backward(loss, split.parameters())
    assert {"MatMul", "Transpose", "Linear", "LayerNorm", "Embedding"} <= set(queued)
    assert sorted(fired) == sorted(id(p) for p in split.parameters())
    for (name, a), b in zip(plain.named_parameters(), split.parameters()):
        assert np.array_equal(H(a.grad), H(b.grad)), name


def test_split_backward_gradcheck():
    """B's input gradient and W's weight gradients are the finite-difference derivatives
    (float64): x -> layer_norm -> linear -> gelu -> linear, every weight deferred."""
    from minidist.autograd import fused as F
    from minidist.autograd.gradcheck import numeric_grad
    rng = np.random.default_rng(3)
    x = Tensor(rng.standard_normal((3, 5)), requires_grad=True)
    g, b = (Tensor(rng.standard_normal(5), requires_grad=True) for _ in range(2))
    w1, w2 = (Tensor(rng.standard_normal(s) * 0.5, requires_grad=True)
              for s in ((5, 6), (6, 4)))
    b1 = Tensor(rng.standard_normal(6), requires_grad=True)
    inputs, weights = [x, g, b, w1, b1, w2], [g, b, w1, b1, w2]
    r = rng.standard_normal((3, 4))

    def f(x, g, b, w1, b1, w2):
        h = F.gelu(F.linear(F.layer_norm(x, g, b), w1, b1))
        return F.linear(h, w2)

    _split_backward((f(*inputs) * Tensor(r)).sum(), weights)
    for k, t in enumerate(inputs):
        want = numeric_grad(f, inputs, k, [r])
        assert np.allclose(H(t.grad), want, atol=1e-7, rtol=1e-6), (k, H(t.grad), want)


def test_backward_all_is_the_sum_of_separate_backwards_hooks_fire_once():
    """backward_all([y, s], [g, None]) = y.backward(g) then s.backward(), in one pass: each
    parameter's hook fires once, with the complete gradient."""
    from minidist.autograd.function import backward_all
    rng = np.random.default_rng(0)
    w0, g = rng.standard_normal((3, 3)), rng.standard_normal((2, 3))
    x = Tensor(rng.standard_normal((2, 3)))

    def outputs(w):
        y = (x @ w).tanh()                                            # (2, 3)
        return y, (y * y).mean() * 0.5                                # shared graph
    w = Tensor(w0.copy(), requires_grad=True)
    y, s = outputs(w)
    y.backward(g)
    y, s = outputs(w)
    s.backward()
    fired = []
    w2 = Tensor(w0.copy(), requires_grad=True)
    w2.register_grad_hook(lambda p: fired.append(p.grad.copy()))
    backward_all(outputs(w2), [g, None])
    assert len(fired) == 1
    np.testing.assert_allclose(w2.grad, w.grad, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(fired[0], w2.grad)
