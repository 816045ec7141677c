"""The autograd ops whose behaviour is more than a gradient: split's one buffer, embedding's
scatter-add (16-bit gradients summed in float32), dropout's seed contract, max's ties,
float16; and the backward split in two (zero-bubble pipelines' B and W). The engine:
tests/test_autograd.py; gradients themselves: tests/test_gradcheck.py.

Run: python -m pytest -q tests/test_autograd_ops.py [--device cuda]: P() and the op tests
build their arrays on --device (the `device` fixture, used by every test here) and compare on
the host; numpy-only checks are marked cpu_only.
"""
import numpy as np
import pytest

from minidist import backend
from minidist.autograd import Tensor, ops
from minidist.autograd.indexing import add_dtype, scatter_add_rows
from minidist.backend import to_host as H
from tests.autograd_cases import A, P, rng


pytestmark = pytest.mark.usefixtures("device")      # backend.get_xp() is --device's module


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


def test_repeated_index_adds_run_in_float32_for_16_bit_types():
    """indexing.add_dtype, the one decision both scatter paths follow: 16-bit floats add up
    in float32 (rounded once), every other dtype in itself."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dtype in (np.float16, ml_dtypes.bfloat16):
        assert add_dtype(np.dtype(dtype)) == np.float32, dtype
    for dtype in (np.float32, np.float64):
        assert add_dtype(np.dtype(dtype)) == dtype, dtype


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_scatter_adds_of_16_bit_outs_count_past_2048(dtype):
    """On CuPy, scatter_add_rows (TP's vocabulary-split embedding backward, MoE's combine)
    and GetItem's backward add through indexing._add_at into cupyx.scatter_add, which
    widened only bfloat16: a float16 `out` went as it was, and every atomicAdd on __half
    rounds (float16 stops counting ones at 2048; numpy's path adds in float32). Both now
    add in add_dtype(out.dtype) and round once. On --device (numpy's add.reduceat and add.at
    here, cupyx on a GPU) 3072 ones make 3072, in the out's own dtype."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    dtype = np.dtype(dtype)
    ids = np.array([1] * 3072 + [2])
    got = scatter_add_rows(A(np.zeros((3, 2), dtype)), A(ids), A(np.ones((3073, 2), dtype)))
    assert got.dtype == dtype and H(got)[:, 0].tolist() == [0, 3072, 1], got
    x = Tensor(A(np.zeros(3, dtype)), requires_grad=True)
    x[A(ids)].backward(A(np.ones(3073, dtype)))               # GetItem's backward: _add_at
    assert x.grad.dtype == dtype and H(x.grad).tolist() == [0, 3072, 1], x.grad


def test_16_bit_embedding_gradients_are_summed_in_a_float32_table():
    """Tensor parallelism's vocabulary-split lookup made its gradient table in the gradient's
    16-bit dtype, so on CuPy (indexing._add_at) every step widened the whole (V/tp, C) table
    to float32, scattered into the copy and copied it back: three passes over a table that
    started as zeros (Embedding's backward summed in a float32 table from the start). Both
    now return indexing.rows_into_table, whose table (summed_rows) is float32, rounded once:
    each backward's gradient is rows_into_table's bit for bit, and the float32 sums by hand
    rounded once. (On numpy a 16-bit table would give the same numbers: scatter_add_rows
    sums in float32 there; only its dtype differs.)"""
    from minidist.autograd.indexing import rows_into_table, summed_rows
    from minidist.tp import layers
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 12, (3, 7))
    mine = idx >= 6                              # the lookup holds rows 6..11 of 12
    local = np.where(mine, idx - 6, 0)

    def grads(dtype, g):
        """(the lookup's gradient for rows 6..11 of 12, the whole embedding's)."""
        w = Tensor(np.zeros((6, 4), dtype), requires_grad=True)
        layers.VocabShardLookup.apply(w, idx, 6).backward(g)
        e = Tensor(np.zeros((12, 4), dtype), requires_grad=True)
        ops.embedding(e, idx).backward(g)
        return H(w.grad), H(e.grad)
    for dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        g = rng.standard_normal((3, 7, 4)).astype(dtype)
        lookup, whole = summed_rows((6, 4), local, g * mine[..., None]), \
            summed_rows((12, 4), idx, g)
        assert lookup.dtype == whole.dtype == np.float32, dtype
        by_hand = np.zeros((12, 4))
        np.add.at(by_hand, idx.reshape(-1), g.reshape(-1, 4).astype(np.float64))
        np.testing.assert_allclose(whole, by_hand, rtol=1e-6, atol=1e-6)   # float32 sums
        np.testing.assert_allclose(lookup, by_hand[6:], rtol=1e-6, atol=1e-6)
        want = (rows_into_table((6, 4), local, g * mine[..., None]),
                rows_into_table((12, 4), idx, g))
        for got, table, w in zip(grads(dtype, g), (lookup, whole), want):
            assert got.dtype == w.dtype == dtype and np.array_equal(got, w), dtype
            assert np.array_equal(got, table.astype(dtype)), dtype         # rounded once


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
