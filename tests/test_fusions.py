"""minidist/autograd/fusions.py: bias_gelu, residual_layer_norm, padded_cross_entropy.

- The xp path is bit for bit the two ops each replaces (Linear with its bias then gelu;
  x + r then layer_norm; -inf in the padding then cross_entropy), forward and gradients, in
  float64, float32 and float16, and so are the GPT block and the padded head.
- The CUDA branch's glue (cuda_kernels_new.bias_gelu, residual_layer_norm,
  cross_entropy_padded and their backwards), given numpy and the CPU harness's `run`
  (tests/cuda_cpu.py) in place of cupy and `launch`, equals the xp path.
- apply_outputs/Pick: one backward per op, whichever outputs get a gradient; B then W.
- On a GPU (-m gpu --device cuda) each op with MINIDIST_CUDA_NEW_KERNELS=1 equals the xp path.
float64 finite differences of each op are in tests/test_gradcheck.py.
Run: python -m pytest -q tests/test_fusions.py
"""
import numpy as np
import pytest

import cuda_cpu
from minidist.autograd import Tensor, cuda_kernels_new as ckn, fused as F, fusions, ops
from minidist.autograd.tensor import defer_weight_grads
from minidist.nn.config import GPTConfig
from minidist.nn.gpt import GPT
from test_cuda_kernels_cpu import DTYPES, close, rand

XP_DTYPES = ["float16", "bfloat16", "float32", "float64"]
needs_cxx = pytest.mark.skipif(cuda_cpu.reason_unavailable() is not None,
                               reason=str(cuda_cpu.reason_unavailable()))


def leaves(*arrays):
    return [Tensor(a.copy(), requires_grad=True) for a in arrays]


def run_grads(fn, arrays, seed_grad):
    """fn's output array and the gradients of sum(out * seed_grad) for each input."""
    ts = leaves(*arrays)
    out = fn(*ts)
    (out * Tensor(seed_grad.astype(out.dtype))).sum().backward()
    return out.data, [t.grad for t in ts]


def assert_bitwise(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), f"{what} #{i}"


# ---- the xp path: bit for bit the unfused ops ------------------------------------------------

@pytest.mark.parametrize("dtype", XP_DTYPES)
def test_bias_gelu_is_linear_with_bias_then_gelu_bitwise(dtype):
    x, w, b, g = rand(dtype, 4, 5, 8), rand(dtype, 8, 12, seed=1), rand(dtype, 12, seed=2), \
        rand(dtype, 4, 5, 12, seed=3)
    new = run_grads(lambda x, w, b: fusions.bias_gelu(F.linear(x, w), b), [x, w, b], g)
    old = run_grads(lambda x, w, b: F.gelu(F.linear(x, w, b)), [x, w, b], g)
    assert_bitwise([new[0]] + new[1], [old[0]] + old[1], f"bias_gelu {dtype}")
    h = F.linear(Tensor(x), Tensor(w))               # the xp path adds b into h (documented)
    h0 = h.data.copy()
    fusions.bias_gelu(h, Tensor(b))
    assert np.array_equal(h.data, h0 + b)


def _residual_loss(s, y, R):
    """What the block does with them: s + f(y), here f(y) = y * y."""
    return ((s + y * y) * Tensor(R.astype(s.dtype))).sum()


@pytest.mark.parametrize("dtype", XP_DTYPES)
def test_residual_layer_norm_is_add_then_layer_norm_bitwise(dtype):
    x, r, R = rand(dtype, 3, 4, 16), rand(dtype, 3, 4, 16, seed=1), rand(dtype, 3, 4, 16, seed=2)
    w, b = rand(dtype, 16, seed=3), rand(dtype, 16, seed=4)
    got, want = leaves(x, r, w, b), leaves(x, r, w, b)
    s, y = fusions.residual_layer_norm(*got)
    _residual_loss(s, y, R).backward()
    s0 = want[0] + want[1]
    _residual_loss(s0, F.layer_norm(s0, want[2], want[3]), R).backward()
    assert_bitwise([s.data, y.data] + [t.grad for t in got],
                   [s0.data, F.layer_norm(s0, want[2], want[3]).data] + [t.grad for t in want],
                   f"residual_layer_norm {dtype}")


def test_residual_layer_norm_with_one_output_used():
    """Only y (s unused) or only s: the op's backward still runs once, with the other None."""
    x, r, w, b = (rand("float64", 2, 6, seed=i) if i < 2 else rand("float64", 6, seed=i)
                  for i in range(4))
    for pick in (0, 1):
        got, want = leaves(x, r, w, b), leaves(x, r, w, b)
        fusions.residual_layer_norm(*got)[pick].sum().backward()
        s0 = want[0] + want[1]
        (s0 if pick == 0 else F.layer_norm(s0, want[2], want[3])).sum().backward()
        for t, u in zip(got, want):
            assert (t.grad is None) == (u.grad is None)
            assert t.grad is None or np.array_equal(t.grad, u.grad), pick


@pytest.mark.parametrize("dtype", XP_DTYPES)
def test_padded_cross_entropy_is_masked_cross_entropy_bitwise(dtype):
    V, Vp = 50, 64
    z = rand(dtype, 3, 5, Vp) * 3
    t = np.random.default_rng(0).integers(0, V, (3, 5))
    t[0, :2] = -1
    pad = np.zeros(Vp, bool)
    pad[V:] = True
    new = run_grads(lambda z: fusions.padded_cross_entropy(z, t, V), [z], np.float64(0.5))
    old = run_grads(lambda z: F.cross_entropy(ops.masked_fill(z, pad, -np.inf), t), [z],
                    np.float64(0.5))
    assert_bitwise([new[0]] + new[1], [old[0]] + old[1], f"padded_cross_entropy {dtype}")
    assert not new[1][0][..., V:].any()


def _unfused_block(block, x):
    """minidist/nn/block.py's Block.forward before the fusions."""
    x = x + block.attn(block.ln_1(x))
    h = block.ln_2(x)
    return x + block.mlp.dropout(block.mlp.c_proj(F.gelu(block.mlp.c_fc(h))))


def test_gpt_block_and_padded_head_are_the_unfused_ones_bitwise():
    """A block with dropout (same generator state both times) and a vocabulary padded
    100 -> 128: outputs and every parameter gradient, float32."""
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=100,
                    vocab_multiple=64, dropout=0.1)
    runs = []
    for fused in (True, False):
        model = GPT(cfg, seed=0)
        idx = np.random.default_rng(1).integers(0, 100, (2, 8))
        x = model.embed(idx)
        block = model.transformer.h[0]
        y = block(x) if fused else _unfused_block(block, x)
        logits, loss = model.head(y, idx)
        (loss + (y * y).sum()).backward()
        runs.append([logits.data, loss.data] + [p.grad for p in model.parameters()])
    assert_bitwise(runs[0], runs[1], "GPT block + head")


def test_deferred_weight_grads_give_the_same_gradients():
    """B (inputs only) then W (weights): the numbers of one backward (zero-bubble pipelines);
    ResidualLayerNorm and BiasGelu keep nothing for W (weight_grads_in_b: their weights'
    gradients are column sums, computed in B)."""
    x, r, h = rand("float32", 4, 8), rand("float32", 4, 8, seed=1), rand("float32", 4, 12, seed=5)
    w, b, c = rand("float32", 8, seed=2), rand("float32", 8, seed=3), rand("float32", 12, seed=4)
    grads = []
    for split in (False, True):
        ts = leaves(x, r, w, b, h, c)
        s, y = fusions.residual_layer_norm(*ts[:4])
        loss = (s * y).sum() + fusions.bias_gelu(ts[4], ts[5]).sum()
        if split:
            with defer_weight_grads([ts[2], ts[3], ts[5]]) as queue:
                loss.backward()
            assert ts[2].grad is None and ts[5].grad is None and ts[0].grad is not None
            held = [fn.__name__ for fn, ctx, *_ in queue.work if ctx is not None]
            done_in_b = [fn.__name__ for fn, ctx, *_ in queue.work if ctx is None]
            assert held == [] and sorted(done_in_b) == ["BiasGelu", "ResidualLayerNorm"]
            queue.run()
        else:
            loss.backward()
        grads.append([t.grad for t in ts])
    assert_bitwise(grads[1], grads[0], "B then W")


def test_errors_name_the_op():
    a = Tensor(np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="BiasGelu"):
        fusions.bias_gelu(a, Tensor(np.zeros(3, np.float32)))
    with pytest.raises(TypeError, match="ResidualLayerNorm"):
        fusions.residual_layer_norm(a, Tensor(np.zeros((2, 4))), Tensor(np.ones(4, np.float32)))
    with pytest.raises(ValueError, match="PaddedCrossEntropy"):
        fusions.padded_cross_entropy(a, np.zeros(2, np.int64), 5)


def test_the_placeholder_holds_no_bytes_and_the_kernels_never_take_numpy(monkeypatch):
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "1")
    x = Tensor(np.ones((2, 4), np.float32), requires_grad=True)
    s, y = fusions.residual_layer_norm(x, x, Tensor(np.ones(4, np.float32)))
    op = s.grad_fn.parents[0]                  # the op's Node, which both Picks hang on
    assert y.grad_fn.parents[0] is op and op.shape == (0,)
    assert not ckn.use_new(x.data, x.data) and not op.ctx.kernel


# ---- the kernel glue, on numpy through the CPU harness, equals the xp path -----------------

def _xp_bias_gelu(h, b, g):
    y, (dh, db) = run_grads(fusions.bias_gelu, [h, b], g)
    return y, dh, db


@needs_cxx
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_glue_equals_the_xp_path(dtype):
    h, b, g = rand(dtype, 3, 7, 33) * 2, rand(dtype, 33, seed=1), rand(dtype, 3, 7, 33, seed=2)
    y = ckn.bias_gelu(np, cuda_cpu.run, h, b)
    dh, db = ckn.bias_gelu_backward(np, cuda_cpu.run, h, b, g, (True, True))
    y_want, dh_want, db_want = _xp_bias_gelu(h, b, g)
    for got, want, what in ((y, y_want, "y"), (dh, dh_want, "dh"), (db, db_want, "db")):
        assert got.dtype == want.dtype and got.shape == want.shape, what
        close(got, want, dtype, f"bias_gelu glue {what}")
    assert ckn.bias_gelu_backward(np, cuda_cpu.run, h, b, g, (True, False))[1] is None


def _xp_residual(x, r, w, b, gs, gy):
    ts = leaves(x, r, w, b)
    s, y = fusions.residual_layer_norm(*ts)
    ((s * Tensor(gs)).sum() + (y * Tensor(gy)).sum()).backward()
    return [s.data, y.data] + [t.grad for t in ts]


@needs_cxx
@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_layer_norm_glue_equals_the_xp_path(dtype):
    x, r, gs, gy = (rand(dtype, 3, 5, 37, seed=i) for i in range(4))
    w, b = rand(dtype, 37, seed=4), rand(dtype, 37, seed=5)
    s, y, saved = ckn.residual_layer_norm(np, cuda_cpu.run, x, r, w, b, 1e-5)
    got = [s, y] + list(ckn.residual_layer_norm_backward(np, cuda_cpu.run, gs, gy, saved,
                                                         (True, True, True, True)))
    want = _xp_residual(x, r, w, b, gs, gy)
    for i, (a, c) in enumerate(zip(got, want)):
        assert a.dtype == c.dtype and a.shape == c.shape, i
        close(a, c, dtype, f"residual_layer_norm glue output #{i} (s y dx dr dw db)")
    b_only = ckn.residual_layer_norm_backward(np, cuda_cpu.run, gs, gy, saved,
                                              (True, True, False, False))
    w_only = ckn.residual_layer_norm_backward(np, cuda_cpu.run, gs, gy, saved,
                                              (False, False, True, True))
    assert b_only[2] is None and w_only[0] is None
    assert np.array_equal(b_only[0], got[2]) and np.array_equal(w_only[2], got[4])
    no_y = ckn.residual_layer_norm_backward(np, cuda_cpu.run, gs, None, saved, (True,) * 4)
    assert no_y[0] is gs and no_y[2] is None


@needs_cxx
@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_cross_entropy_glue_equals_the_xp_path(dtype):
    V, Vp = 1001, 1024
    z = rand(dtype, 2, 4, Vp) * 3
    t = np.random.default_rng(4).integers(0, V, (2, 4))
    t[0, 1], t[1, 3] = -1, V - 1
    loss, saved = ckn.cross_entropy_padded(np, cuda_cpu.run, z, t, V, -1)
    dz = ckn.cross_entropy_padded_backward(np, cuda_cpu.run, np.float32(0.5), saved, V, -1)
    loss_want, (dz_want,) = run_grads(lambda a: fusions.padded_cross_entropy(a, t, V), [z],
                                      np.float64(0.5))
    close(loss, loss_want, "float32", "padded_cross_entropy glue loss")
    close(dz.reshape(z.shape), dz_want, dtype, "padded_cross_entropy glue dz")
    assert dz.dtype == dz_want.dtype and not dz.reshape(z.shape)[..., V:].any()


# ---- on a GPU: python -m pytest -m gpu --device cuda tests/test_fusions.py ----------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_on_a_gpu_equals_the_xp_path(cupy_new, dtype):
    h, b, g = rand(dtype, 4, 9, 96) * 2, rand(dtype, 96, seed=1), rand(dtype, 4, 9, 96, seed=2)
    y, (dh, db) = run_grads(fusions.bias_gelu, [cupy_new.asarray(a) for a in (h, b)],
                            cupy_new.asarray(g))
    for a, c, what in zip((y, dh, db), _xp_bias_gelu(h, b, g), ("y", "dh", "db")):
        close(cupy_new.asnumpy(a), c, dtype, f"bias_gelu {what} on cupy")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_layer_norm_on_a_gpu_equals_the_xp_path(cupy_new, dtype):
    x, r, gs, gy = (rand(dtype, 4, 9, 96, seed=i) for i in range(4))
    args = [x, r, rand(dtype, 96, seed=4), rand(dtype, 96, seed=5), gs, gy]
    got = _xp_residual(*(cupy_new.asarray(a) for a in args))
    for i, (a, c) in enumerate(zip(got, _xp_residual(*args))):
        close(cupy_new.asnumpy(a), c, dtype, f"residual_layer_norm #{i} (s y dx dr dw db)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_cross_entropy_on_a_gpu_equals_the_xp_path(cupy_new, dtype):
    z, t = rand(dtype, 4, 9, 128) * 3, np.random.default_rng(0).integers(0, 100, (4, 9))
    t[0, 0] = -1
    loss, (dz,) = run_grads(lambda a: fusions.padded_cross_entropy(a, cupy_new.asarray(t), 100),
                            [cupy_new.asarray(z)], cupy_new.asarray(np.float64(0.5)))
    loss_want, (dz_want,) = run_grads(lambda a: fusions.padded_cross_entropy(a, t, 100), [z],
                                      np.float64(0.5))
    close(cupy_new.asnumpy(loss), loss_want, "float32", "padded_cross_entropy loss on cupy")
    close(cupy_new.asnumpy(dz), dz_want, dtype, "padded_cross_entropy dz on cupy")


@pytest.mark.gpu
@pytest.mark.parametrize("block", [{}, dict(arch="llama", bias=False, n_kv_head=1)],
                         ids=["gpt2", "llama"])
def test_gpt_with_the_fusion_kernels_equals_without_on_a_gpu(cupy_new, monkeypatch, block):
    """The model's loss and every gradient, float32, padded vocabulary, kernels on vs off;
    a Llama's block runs tests/test_cuda_llama_cpu.py's kernels instead of the fusions."""
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=100,
                    vocab_multiple=64, **block)
    idx = np.random.default_rng(1).integers(0, 100, (3, 32))
    runs = []
    for new in ("1", "0"):
        monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", new)
        model = GPT(cfg, seed=0)
        _, loss = model(idx, idx)
        loss.backward()
        runs.append([loss.data] + [p.grad for p in model.parameters()])
    for i, (a, c) in enumerate(zip(*runs)):
        close(cupy_new.asnumpy(a), cupy_new.asnumpy(c), "float32", f"GPT output/grad #{i}")
