"""Fused ops: one Function per layer, backward written by hand and commented term by term.

Composing layer_norm or softmax from primitives works (tests do it, to check these), but
every primitive saves its own inputs and makes its own temporaries. Here each forward saves
only what the backward formula needs, works in place (`out=`) on as few full-size buffers
as it can, and keeps float32 in float32. `examples/bench_fused.py` measures the difference.

Shapes: N rows of C features (layer norm), V classes (cross-entropy). float16 and bfloat16
inputs are computed in float32 inside (statistics, exp and log sums lose too much in 16
bits) and the results cast back, except cross-entropy's scalar loss, which stays float32
(mixed precision scales it before backward). Attention lives in attention.py and is
re-exported here. On cupy arrays, layer norm, GELU and cross-entropy run CUDA kernels
instead (cuda_kernels.py; MINIDIST_CUDA_KERNELS=0 for the code here); numpy arrays never
reach them. Layer norm's and GELU's math are array functions (layer_norm_forward/_backward,
gelu_forward/_backward) that fusions.py's ops across layers share. Tests: tests/test_fused.py,
tests/test_gradcheck.py, tests/test_bfloat16.py, tests/test_cuda_kernels.py (gpu).
"""
import contextlib
import math

from minidist.autograd import cuda_kernels as _ck
from minidist.autograd.function import Function
from minidist.backend import is_half, matmul as _mm, xp_of


def in_f32(a):
    """float16 (or bfloat16) -> float32 for the arithmetic; anything else unchanged (no copy)."""
    return a.astype("float32") if a is not None and is_half(a.dtype) else a


def sum_rows(g2):
    """g2 (N, C) summed over rows in g2's dtype; 16-bit ones add up in float32 (numpy's
    bfloat16 sum keeps a bfloat16 total: 1000 ones add up to 256)."""
    if is_half(g2.dtype):
        return g2.sum(axis=0, dtype="float32").astype(g2.dtype)
    return g2.sum(axis=0)


# ---- linear --------------------------------------------------------------------------------

class Linear(Function):
    """y = x @ W + b for x (..., in), W (in, out), b (out,) or None: one GEMM over all the
    leading axes, the bias added in place (no second (N, out) array), one graph node."""

    @staticmethod
    def forward(ctx, x, w, b=None):
        x2 = x.reshape(-1, x.shape[-1])                          # (N, in)
        out = _mm(x2, w)                                         # (N, out)
        if b is not None:
            out += b
        ctx.save_for_backward(x2, w)
        ctx.shape = x.shape
        return out.reshape(x.shape[:-1] + (w.shape[1],))

    @staticmethod
    def backward(ctx, grad):
        x2, w = ctx.saved
        need_x, need_w, need_b = ctx.needs_input_grad
        g2 = grad.reshape(-1, w.shape[1])                        # (N, out)
        dx = _mm(g2, w.T).reshape(ctx.shape) if need_x else None  # dL/dx = g W^T
        dw = _mm(x2.T, g2) if need_w else None                   # dL/dW = x^T g
        db = sum_rows(g2) if need_b else None                   # dL/db = sum over rows
        return dx, dw, db


def linear(x, weight, bias=None):
    return Linear.apply(x, weight, bias)


# ---- layer norm ------------------------------------------------------------------------------

def layer_norm_forward(x, w, b, eps):
    """(y, saved, cuda): y = (x - mean) / sqrt(var + eps) * w + b over the last axis, what
    layer_norm_backward needs, and whether the kernel made it. Arrays in and out: LayerNorm
    and fusions.ResidualLayerNorm share it."""
    xp, dtype = xp_of(x), x.dtype
    if _ck.use(x, w, b):                     # one kernel; saves x, mean, rstd, not xhat
        y, *saved = _ck.layer_norm(x, w, b, eps)             # saved: x, w, mean, rstd
        return y, tuple(saved), True
    x, w, b = in_f32(x), in_f32(w), in_f32(b)
    xhat = x - x.mean(axis=-1, keepdims=True)                     # x - mean
    out = xp.multiply(xhat, xhat)
    var = out.mean(axis=-1, keepdims=True)
    rstd = 1.0 / xp.sqrt(var + eps)                              # (..., 1)
    xhat *= rstd                                                 # normalized x
    xp.multiply(xhat, w, out=out)
    if b is not None:
        out += b
    return out.astype(dtype, copy=False), (xhat, rstd, w), False


def layer_norm_backward(grad, saved, cuda, needs):
    """(dx, dw, db) from layer_norm_forward's `saved`; None where needs (x, w, b) is False."""
    if cuda:
        return _ck.layer_norm_backward(grad, *saved, needs)
    xhat, rstd, w = saved
    xp, grad = xp_of(grad), in_f32(grad)
    C = xhat.shape[-1]
    db = grad.reshape(-1, C).sum(axis=0) if needs[2] else None   # y = ... + b
    tmp = xp.multiply(grad, xhat)                                 # y = xhat * w + ...
    dw = tmp.reshape(-1, C).sum(axis=0) if needs[1] else None
    if not needs[0]:
        return None, dw, db
    # dxhat = grad * w; with xhat = (x - mean) * rstd, through mean and var:
    # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    dx = xp.multiply(grad, w)                                     # dxhat
    xp.multiply(dx, xhat, out=tmp)
    m2 = tmp.mean(axis=-1, keepdims=True)                         # mean(dxhat * xhat)
    dx -= dx.mean(axis=-1, keepdims=True)                         # - mean(dxhat)
    xp.multiply(xhat, m2, out=tmp)
    dx -= tmp                                                     # - xhat * mean(dxhat xhat)
    dx *= rstd
    return dx, dw, db


class LayerNorm(Function):
    """y = (x - mean) / sqrt(var + eps) * w + b over the last axis. dw and db are column sums
    (of g xhat, of g) beside dx: zero-bubble pipelines' B pass computes them with dx
    (weight_grads_in_b), so the saved xhat and the output's gradient do not wait for W."""
    weight_grads_in_b = True

    @staticmethod
    def forward(ctx, x, w, b, eps=1e-5):
        if w.shape != x.shape[-1:] or (b is not None and b.shape != w.shape):
            raise ValueError("weight and bias must have the shape of x's last axis")
        y, saved, ctx.cuda = layer_norm_forward(x, w, b, eps)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, grad):
        return layer_norm_backward(grad, ctx.saved, ctx.cuda, ctx.needs_input_grad) + (None,)


def layer_norm(x, weight, bias=None, eps=1e-5):
    return LayerNorm.apply(x, weight, bias, eps)


# ---- GELU ------------------------------------------------------------------------------------

_K = math.sqrt(2.0 / math.pi)
_A = 0.044715


def quiet_overflow(xp):
    """numpy warns when exp overflows to inf; here inf is the right answer."""
    return xp.errstate(over="ignore") if hasattr(xp, "errstate") else contextlib.nullcontext()


def gelu_forward(x):
    """GPT-2's tanh GELU of the array x (Gelu's forward; fusions.BiasGelu's too)."""
    xp, dtype = xp_of(x), x.dtype
    if _ck.use(x):
        return _ck.gelu(x)                         # one elementwise kernel, same formula
    x = in_f32(x)                                    # float16's x^3 overflows at |x| ~ 40
    y = xp.multiply(x, x)
    y *= -2 * _K * _A
    y -= 2 * _K
    y *= x                                         # -2u = -2k (x + a x^3)
    with quiet_overflow(xp):
        xp.exp(y, out=y)                           # exp(-2u); inf for x << 0 is fine:
    y += 1.0
    xp.divide(x, y, out=y)                         # x / inf = -0
    return y.astype(dtype, copy=False)


def gelu_backward(x, grad):
    """dL/dx of gelu_forward(x) given dL/dy = grad."""
    if _ck.use(x):
        return _ck.gelu_backward(x, grad)
    xp, x = xp_of(x), in_f32(x)
    # y = x s, s = sigmoid(2u) = 1 / (1 + exp(-2u)), ds/d(2u) = s (1 - s)
    # dy/dx = s                                 (from the x factor)
    #       + x s (1 - s) 2k (1 + 3 a x^2)      (through s, d(2u)/dx = 2k (1 + 3 a x^2))
    #       = d s (1 - s) + s                   with d = x 2k (1 + 3 a x^2)
    s = xp.multiply(x, x)
    d = s * (6 * _K * _A)
    d += 2 * _K
    d *= x                                         # d
    s *= -2 * _K * _A
    s -= 2 * _K
    s *= x                                         # -2u
    with quiet_overflow(xp):
        xp.exp(s, out=s)                           # may be inf for x << 0 ...
    s += 1.0
    xp.reciprocal(s, out=s)                        # ... then s = 0, exactly right
    d *= s                                         # d s      (bounded, unlike d exp(-2u))
    xp.subtract(1.0, s, out=s)                     # 1 - s
    d *= s                                         # d s (1 - s)
    d += 1.0
    d -= s                                         # + s
    d *= grad
    return d


class Gelu(Function):
    """GPT-2's tanh approximation: y = x/2 (1 + tanh(u)), u = k (x + a x^3), k = sqrt(2/pi),
    computed as y = x * sigmoid(2u) = x / (1 + exp(-2u)) (the same function: one exp, which
    is cheaper than tanh, and fewer passes). Saves only x; backward recomputes the exp."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return gelu_forward(x)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved
        return gelu_backward(x, grad)


def gelu(x):
    return Gelu.apply(x)


# ---- softmax and log-softmax -----------------------------------------------------------------

class Softmax(Function):
    """p = exp(x - max) / sum(exp(x - max)) along `axis`."""

    @staticmethod
    def forward(ctx, x, axis=-1):
        xp, dtype = xp_of(x), x.dtype
        p = in_f32(x) - x.max(axis=axis, keepdims=True)           # max: exp cannot overflow
        xp.exp(p, out=p)
        p /= p.sum(axis=axis, keepdims=True)
        ctx.save_for_backward(p)
        ctx.axis = axis
        return p.astype(dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):
        p, = ctx.saved
        # dx_i = sum_j grad_j dp_j/dx_i = sum_j grad_j p_j (delta_ij - p_i)
        #      = p_i (grad_i - sum_j grad_j p_j)
        dx = in_f32(grad) * p
        s = dx.sum(axis=ctx.axis, keepdims=True)                  # sum_j grad_j p_j
        xp_of(p).subtract(grad, s, out=dx)
        dx *= p
        return dx, None


def softmax(x, axis=-1):
    return Softmax.apply(x, axis)


class LogSoftmax(Function):
    """out = x - max - log(sum(exp(x - max))) along `axis`."""

    @staticmethod
    def forward(ctx, x, axis=-1):
        xp, dtype = xp_of(x), x.dtype
        out = in_f32(x) - x.max(axis=axis, keepdims=True)
        e = xp.exp(out)                                          # exp(x - max)
        s = e.sum(axis=axis, keepdims=True)
        out -= xp.log(s)
        ctx.save_for_backward(e, s)                              # softmax = e / s, lazily
        ctx.axis = axis
        return out.astype(dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):
        e, s = ctx.saved
        # out_j = x_j - lse, d lse / dx_i = softmax_i = e_i / s:
        # dx_i = grad_i - softmax_i * sum_j grad_j
        dx = e * (in_f32(grad).sum(axis=ctx.axis, keepdims=True) / s)
        xp_of(e).subtract(grad, dx, out=dx)
        return dx, None


def log_softmax(x, axis=-1):
    return LogSoftmax.apply(x, axis)


# ---- cross-entropy ---------------------------------------------------------------------------

class CrossEntropy(Function):
    """Mean over non-ignored rows of -log softmax(logits)[target]; logits (..., V)."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index=-1):
        xp, V = xp_of(logits), logits.shape[-1]
        if targets.dtype.kind not in "iu":
            raise TypeError(f"targets must be integers, not {targets.dtype}")
        if targets.shape != logits.shape[:-1]:
            raise ValueError("targets must have the shape of logits without its last axis")
        if _ck.use(logits):                  # two row kernels, no device-to-host sync
            loss, saved = _ck.cross_entropy(logits, targets, ignore_index)
            ctx.save_for_backward(*saved)
            ctx.cuda, ctx.shape, ctx.ignore = True, logits.shape, ignore_index
            return loss                      # float32 (float64 for float64 logits)
        z, t = in_f32(logits).reshape(-1, V), xp.asarray(targets).reshape(-1)  # to the device
        valid = t != ignore_index
        t = xp.where(valid, t, 0)                                # any in-range id
        rows = xp.arange(len(t))
        m = z.max(axis=-1, keepdims=True)
        p = z - m
        target_logit = p[rows, t]                                # z_t - max
        xp.exp(p, out=p)
        s = p.sum(axis=-1)
        p /= counted_rows_sum(s, valid)[:, None]     # softmax, saved; ignored rows: 0
        n = rows_counted(valid, z.dtype)  # on the device; all ignored: loss 0, not nan
        loss = ((xp.log(s) - target_logit) * valid).sum() / n    # lse - z_t, averaged
        ctx.save_for_backward(p, t, valid)
        ctx.n, ctx.shape, ctx.dtype = n, logits.shape, logits.dtype
        # a 16-bit loss would keep 3 digits, and mixed precision's loss scale (2^16) times
        # its gradient would overflow float16: the scalar loss stays float32
        return xp.asarray(loss, dtype="float32" if is_half(logits.dtype) else logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        if getattr(ctx, "cuda", False):
            dz = _ck.cross_entropy_backward(grad, ctx.saved, ctx.ignore)
            return dz.reshape(ctx.shape), None, None
        p, t, valid = ctx.saved
        ctx.saved = ()                   # the softmax buffer becomes the gradient: no copy
        # loss = 1/n sum_i (lse_i - z_{i,t_i}):  dloss/dz_ij = (p_ij - [j == t_i]) / n
        p[xp_of(p).arange(len(t)), t] -= valid                   # 1, but 0 on ignored rows
        p *= grad.astype(p.dtype) / ctx.n
        return p.reshape(ctx.shape), None, None


def rows_counted(valid, dtype):
    """max(number of rows not ignored, 1) as a 0-d array of `dtype` on the device: no host
    read (an int() here would wait for the GPU). Dividing by it gives the bits dividing by
    the Python int gives (the count is exact in float32 below 2^24 rows)."""
    return xp_of(valid).maximum(valid.sum(), 1).astype(dtype)


def counted_rows_sum(s, valid):
    """The softmax's row sums `s`, inf on the ignored rows: the division that normalises the
    softmax also zeroes those rows (e / inf = 0; e <= 1 after the max is subtracted), and the
    counted rows divide by s itself, bitwise as before. No boolean mask (CuPy reads a mask's
    size to the host) and no host-side `if` on whether any row is ignored."""
    return xp_of(s).where(valid, s, xp_of(s).inf)


def cross_entropy(logits, targets, ignore_index=-1):
    """Scalar mean cross-entropy of logits (N, V) or (B, T, V) against integer targets
    (N,) or (B, T); rows whose target is `ignore_index` count neither in the sum nor in n."""
    return CrossEntropy.apply(logits, targets, ignore_index)


from minidist.autograd.attention import (  # noqa: E402,F401  (re-exported: F.<name>)
    CausalAttention, CausalSelfAttention, causal_attention, causal_self_attention)
