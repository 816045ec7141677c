"""The ops a Llama-style block adds to GPT-2's (GPTConfig arch="llama": minidist/nn/block.py):

    rms_norm(x, w)              x / sqrt(mean(x^2) + eps) * w over the last axis (no mean
                                subtracted, no bias: Zhang & Sennrich 2019)
    residual_rms_norm(x, r, w)  (x + r, rms_norm(x + r, w)): the block's add_norm
    swiglu(h)                   silu(a) * b for h = [a | b] split in halves on its last axis
                                (Shazeer 2020): the MLP's gate and up projections are one
                                matmul, c_fc, whose output columns are [gate | up]
    rotary(qkv, nh, nkv, pos)   rotary position embedding (RoPE, Su et al. 2021) of the q and
                                k heads of a fused qkv, token t turned by angles pos[t] * f_i
    repeat_kv(qkv, nh, nkv)     grouped-query attention (Ainslie et al. 2023): each of the nkv
                                k and v heads repeated for the nh / nkv q heads that share it

The fused qkv is c_attn's output, (B, T, (nh + 2 nkv) hs): q's nh heads, then k's nkv, then
v's nkv, each head hs contiguous columns. repeat_kv turns it into the (B, T, 3 nh hs) that
every attention path (materialized, tiled, the cp ring, Ulysses) takes, so grouped-query
attention needs no attention kernel of its own: its savings are c_attn's parameters and a
generation cache's size, not the attention's arithmetic. (Llama's reference code repeats k
and v the same way before its attention.) Under context parallelism the repeat comes after
the communication, so k and v travel as nkv heads: the ring repeats each block it holds
(minidist/cp/ring.py), Ulysses repeats its heads after the all-to-all (minidist/cp/ulysses.py).

RoPE's convention is the "rotate half" one of GPT-NeoX and Hugging Face's Llama: in a head
of hs columns, column i and column i + hs/2 form a pair turned by pos * theta^(-2i/hs).
The angles are computed in float64 from the positions, so a rank that holds scattered
positions (context parallelism's zig-zag chunks) turns each token exactly as one process does.

Arrays in, arrays out, in xp code (numpy or cupy): the same code runs on a GPU, one
elementwise pass per line. 16-bit inputs are computed in float32 and cast back (fused.py's
rule). On cupy arrays with MINIDIST_CUDA_NEW_KERNELS=1, RMSNorm, SwiGLU and RoPE run one
kernel each way instead (cuda_source_llama.py, planned by cuda_kernels_llama.py; proven on
the CPU only: tests/test_cuda_llama_cpu.py).
Tests: tests/test_gradcheck.py (float64 finite differences, numpy formulas),
tests/test_llama.py.
"""
from minidist.autograd import cuda_kernels_llama as _ckl
from minidist.autograd.cuda_kernels import acc_dtype, launch
from minidist.autograd.cuda_kernels_new import use_new
from minidist.autograd.function import Function
from minidist.autograd.fused import in_f32, quiet_overflow
from minidist.backend import is_half, xp_of


# ---- RMSNorm --------------------------------------------------------------------------------

class RMSNorm(Function):
    """y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) over the last axis.
    Backward, with xhat = x * rstd and dxhat = g * w:
        dx = rstd * (dxhat - xhat * mean(dxhat * xhat))     (through rstd's mean of x^2)
        dw = sum over rows of g * xhat"""

    @staticmethod
    def forward(ctx, x, w, eps=1e-5):
        if w.shape != x.shape[-1:]:
            raise ValueError("the weight must have the shape of x's last axis")
        xp, dtype = xp_of(x), x.dtype
        ctx.kernel = use_new(x, w)
        if ctx.kernel:                                  # one kernel: a block per row
            y, saved = _ckl.rms_norm(xp, launch, x, w, eps)
            ctx.save_for_backward(*saved)
            return y.reshape(x.shape)
        x32, w32 = in_f32(x), in_f32(w)
        rstd = 1.0 / xp.sqrt(xp.mean(x32 * x32, axis=-1, keepdims=True) + eps)   # (..., 1)
        xhat = x32 * rstd
        ctx.save_for_backward(xhat, rstd, w32)
        return (xhat * w32).astype(dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):
        if ctx.kernel:
            dx, dw = _ckl.rms_norm_backward(xp_of(grad), launch, grad, ctx.saved,
                                            ctx.needs_input_grad)
            return (None if dx is None else dx.reshape(grad.shape)), dw, None
        xhat, rstd, w = ctx.saved
        xp, grad = xp_of(xhat), in_f32(grad)
        C = xhat.shape[-1]
        tmp = xp.multiply(grad, xhat)                          # y = xhat * w
        dw = tmp.reshape(-1, C).sum(axis=0) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, dw, None
        dx = xp.multiply(grad, w)                              # dxhat
        xp.multiply(dx, xhat, out=tmp)
        m = tmp.mean(axis=-1, keepdims=True)                   # mean(dxhat * xhat)
        xp.multiply(xhat, m, out=tmp)
        dx -= tmp
        dx *= rstd
        return dx, dw, None


def rms_norm(x, weight, eps=1e-5):
    return RMSNorm.apply(x, weight, eps)


def residual_rms_norm(x, r, weight, eps=1e-5):
    """(s, y) = (x + r, rms_norm(x + r)): the residual add and the norm after it, as
    LayerNorm's add_norm gives them (two ops here; fusions.py fuses LayerNorm's)."""
    s = x + r
    return s, rms_norm(s, weight, eps)


# ---- SwiGLU ---------------------------------------------------------------------------------

def _sigmoid(xp, a):
    """sigmoid(a) = 1 / (1 + exp(-a)) in a new array, in place after its first pass: the
    CUDA kernel's formula, exact to float32's rounding for every a. ((1 + tanh(a/2)) / 2 is
    1.45x faster on numpy but loses the small values, relative error past 1e-3 below -6:
    ~1% of a step, not taken.)"""
    s = xp.negative(a)
    with quiet_overflow(xp):
        xp.exp(s, out=s)                                 # inf for a << 0 ...
    s += 1.0
    return xp.reciprocal(s, out=s)                       # ... then s = 0, exactly right


class SwiGLU(Function):
    """y = silu(a) * b = a * sigmoid(a) * b for h = [a | b] (..., 2F) -> (..., F).
        db = g * silu(a),  da = g * b * s * (1 + a (1 - s)) = g * b * s * (a - silu(a) + 1)
    with s = sigmoid(a). Saves h only (the graph holds it: c_fc's output); backward
    recomputes s. Each line one pass, into as few new arrays as it can."""

    @staticmethod
    def forward(ctx, h):
        if h.shape[-1] % 2:
            raise ValueError(f"swiglu: the last axis ({h.shape[-1]}) must be even: [gate | up]")
        xp, dtype = xp_of(h), h.dtype
        F = h.shape[-1] // 2
        ctx.save_for_backward(h)
        ctx.kernel = use_new(h)
        if ctx.kernel:                                  # one elementwise kernel
            return _ckl.swiglu(xp, launch, h)
        a, b = in_f32(h[..., :F]), in_f32(h[..., F:])
        y = _sigmoid(xp, a)
        y *= a                                               # silu(a)
        y *= b
        return y.astype(dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):
        h, = ctx.saved
        xp = xp_of(h)
        if ctx.kernel:
            return _ckl.swiglu_backward(xp, launch, h, grad)
        F = h.shape[-1] // 2
        a, b, grad = in_f32(h[..., :F]), in_f32(h[..., F:]), in_f32(grad)
        s = _sigmoid(xp, a)
        dh = xp.empty(h.shape, grad.dtype)
        da, db = dh[..., :F], dh[..., F:]
        xp.multiply(a, s, out=db)                            # silu(a)
        xp.subtract(a, db, out=da)                           # a - silu(a)
        da += 1.0
        da *= s
        da *= b
        da *= grad                                           # g b s (a - silu(a) + 1)
        db *= grad                                           # g silu(a)
        return dh


def swiglu(h):
    return SwiGLU.apply(h)


# ---- rotary position embedding --------------------------------------------------------------

def rotary_tables(xp, pos, hs, theta, dtype):
    """(cos, sin), each (T, hs/2) in `dtype`: the angles pos[t] * theta^(-2i/hs) of positions
    pos (T,) ints, computed in float64."""
    pos = xp.asarray(pos).astype("float64")
    inv_freq = theta ** (-xp.arange(0, hs, 2, dtype="float64") / hs)          # (hs/2,)
    angle = pos[:, None] * inv_freq[None, :]                                  # (T, hs/2)
    return xp.cos(angle).astype(dtype), xp.sin(angle).astype(dtype)


def _turn(x, cos, sin, sign):
    """Turn the pairs (x1, x2) = (first, second half of each head) of x (B, T, heads, hs) in
    place by the angles (sign 1) or back (sign -1): x1 c - x2 s, x2 c + x1 s."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :], sign * sin[:, None, :]                  # (T, 1, hs/2)
    x1, x2 = x[..., :half], x[..., half:]                           # views of x
    x1_s = x1 * s                                                   # x1 s, before x1 turns
    t = x2 * s
    x1 *= c
    x1 -= t                                                         # x1 c - x2 s
    x2 *= c
    x2 += x1_s                                                      # x2 c + x1 s


class Rotary(Function):
    """RoPE on the q and k heads of qkv (B, T, (nh + 2 nkv) hs), v untouched. A rotation:
    backward turns the gradient back by the same angles. The turn is made IN PLACE on qkv
    (as fusions.BiasGelu adds its bias into h): qkv must be a fresh array nobody else reads,
    c_attn's output, which no op saves; backward needs only the angles. A 16-bit qkv is
    turned in a float32 copy and cast back."""

    @staticmethod
    def forward(ctx, qkv, n_head, n_kv_head, pos, theta=10000.0):
        B, T, width = qkv.shape
        hs = width // (n_head + 2 * n_kv_head)
        if hs * (n_head + 2 * n_kv_head) != width or hs % 2:
            raise ValueError(f"rotary: qkv's {width} columns are not {n_head} + 2 x "
                             f"{n_kv_head} heads of an even size")
        if len(pos) != T:
            raise ValueError(f"rotary: {len(pos)} positions for {T} tokens")
        xp, dtype = xp_of(qkv), qkv.dtype
        ctx.heads, ctx.hs, ctx.kernel = n_head + n_kv_head, hs, use_new(qkv)
        if ctx.kernel:                                    # a pair per thread, in place
            ctx.tables = rotary_tables(xp, pos, hs, theta, acc_dtype(dtype))
            return _ckl.rotary(xp, launch, xp.ascontiguousarray(qkv), ctx.heads, hs,
                               ctx.tables)
        out = in_f32(qkv)                                   # qkv itself, or a float32 copy
        ctx.tables = rotary_tables(xp, pos, hs, theta, out.dtype)
        qk = out[..., :ctx.heads * hs].reshape(B, T, ctx.heads, hs)      # a view of out
        _turn(qk, *ctx.tables, 1.0)
        return out.astype(dtype, copy=False)

    @staticmethod
    def backward(ctx, grad):
        if ctx.kernel:
            return (_ckl.rotary_backward(xp_of(grad), launch, grad, ctx.heads, ctx.hs,
                                         ctx.tables), None, None, None, None)
        B, T, _ = grad.shape
        dqkv = in_f32(grad).copy()
        qk = dqkv[..., :ctx.heads * ctx.hs].reshape(B, T, ctx.heads, ctx.hs)
        _turn(qk, *ctx.tables, -1.0)
        return dqkv, None, None, None, None


def rotary(qkv, n_head, n_kv_head, pos, theta=10000.0):
    """qkv (B, T, (nh + 2 nkv) hs) with its q and k heads turned for positions pos (T,);
    qkv must be fresh (c_attn's output): the turn overwrites it (Rotary)."""
    return Rotary.apply(qkv, n_head, n_kv_head, pos, theta)


# ---- grouped-query attention ----------------------------------------------------------------

class RepeatKV(Function):
    """(B, T, (nh + 2 nkv) hs) -> (B, T, (nh + 2 to) hs), to = nh unless given: q as it is,
    each k and v head repeated g = to / nkv times in a row (q head j reads kv head
    j // (nh / to)). Backward sums each group's g gradients into its head. A `to` short of
    nh: fewer k and v heads than q (Ulysses sends each cp rank a window of the kv heads
    instead: minidist/cp/ulysses.py kv_windows, pick_kv)."""

    @staticmethod
    def forward(ctx, qkv, n_head, n_kv_head, to=None):
        B, T, width = qkv.shape
        to = to or n_head
        if n_head % n_kv_head or to % n_kv_head or n_head % to:
            raise ValueError(f"repeat_kv: {n_head} heads do not share {n_kv_head} kv heads "
                             f"repeated to {to}")
        hs = width // (n_head + 2 * n_kv_head)
        xp, g, Q = xp_of(qkv), to // n_kv_head, n_head * hs
        ctx.shape, ctx.sizes = qkv.shape, (n_head, n_kv_head, to, hs)
        out = xp.empty((B, T, Q + 2 * to * hs), qkv.dtype)
        out[..., :Q] = qkv[..., :Q]
        for i, lo in enumerate((Q, Q + n_kv_head * hs)):                   # k, then v
            heads = qkv[..., lo:lo + n_kv_head * hs].reshape(B, T, n_kv_head, 1, hs)
            start = Q + i * to * hs
            dst = out[..., start:start + to * hs].reshape(B, T, n_kv_head, g, hs)
            dst[...] = heads                                             # broadcast over g
        return out

    @staticmethod
    def backward(ctx, grad):
        B, T, _ = grad.shape
        nh, nkv, to, hs = ctx.sizes
        xp, g, Q = xp_of(grad), to // nkv, nh * hs
        dqkv = xp.empty(ctx.shape, grad.dtype)
        dqkv[..., :Q] = grad[..., :Q]
        for i, lo in enumerate((Q, Q + nkv * hs)):
            start = Q + i * to * hs
            part = grad[..., start:start + to * hs].reshape(B, T, nkv, g, hs)
            total = part.sum(axis=3, dtype="float32") if is_half(part.dtype) else \
                part.sum(axis=3)                                         # 16 bits: in f32
            dqkv[..., lo:lo + nkv * hs] = total.reshape(B, T, nkv * hs)
        return dqkv, None, None, None


def repeat_kv(qkv, n_head, n_kv_head, to=None):
    """qkv with nkv k and v heads -> the (B, T, 3 nh hs) of nh each (or of `to` k and v
    heads: (B, T, (nh + 2 to) hs)); nkv already that many: qkv itself."""
    return qkv if n_kv_head == (to or n_head) else RepeatKV.apply(qkv, n_head, n_kv_head, to)
