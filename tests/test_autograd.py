"""The engine: dtypes, accumulation, hooks, freeing, deep graphs, no_grad, errors. The ops whose
behaviour is more than a gradient: tests/test_autograd_ops.py. Gradients themselves:
tests/test_gradcheck.py.

Run: python -m pytest -q tests/test_autograd.py [--device cuda]: P() and the op tests build
their arrays on --device (the `device` fixture, used by every test here) and compare on the
host; the hypothesis gradient checks and numpy-only checks are marked cpu_only.
"""
import gc
import weakref

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

from minidist.autograd import Function, Tensor, is_grad_enabled, no_grad, ops
from minidist.autograd.gradcheck import gradcheck
from minidist.backend import to_host as H
from tests.autograd_cases import A, P, rng


pytestmark = pytest.mark.usefixtures("device")      # backend.get_xp() is --device's module


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


def test_the_graph_keeps_only_what_ops_saved_not_their_outputs():
    """h = x @ w and s = h + b are outputs no backward reads (matmul saves x and w, the add
    nothing, tanh its own output): once the forward code drops them, neither the Tensors nor
    their arrays live on in the graph (its records are Nodes, minidist/autograd/tensor.py),
    and backward still gives the gradients worked out by hand."""
    x, w, b = (Tensor(rng.standard_normal(s), requires_grad=True)
               for s in ((4, 8), (8, 5), (5,)))
    h = ops.matmul(x, w)
    s = h + b
    y = s.tanh()
    refs = [weakref.ref(o) for o in (h, h.data, s, s.data)]
    del h, s
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4
    y.sum().backward()
    xd, wd, bd = (H(t.data) for t in (x, w, b))
    dy = 1 - np.tanh(xd @ wd + bd) ** 2
    assert np.allclose(H(x.grad), dy @ wd.T, rtol=1e-12, atol=0)
    assert np.allclose(H(w.grad), xd.T @ dy, rtol=1e-12, atol=0)
    assert np.allclose(H(b.grad), dy.sum(axis=0), rtol=1e-12, atol=0)


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
