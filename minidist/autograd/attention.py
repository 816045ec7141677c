"""Causal scaled-dot-product attention as one fused Function (re-exported by `fused`).

Dimensions: B batch, nh heads, T sequence, hs head size, C = nh * hs.

    S = q k^T / sqrt(hs)          (B, nh, T, T)  scores
    P = softmax(S + causal mask)  (B, nh, T, T)  -inf above the diagonal: no peeking ahead
    y = dropout(P) v              (B, nh, T, hs)

Saved for backward: q, k, v (inputs), P and the dropout mask (with `recompute`, Megatron-LM's
selective recompute, only q, k, v: the backward computes P and the mask again, Redo). It uses
FlashAttention's identity sum_j P_ij dP_ij = g_i . y_i, a (B, nh, T) row sum over hs instead
of over a (T, T) temporary. `CausalSelfAttention` also does GPT-2's head split and merge
inside, as strided views, so a model's graph has one node per attention and no copies.
All matmuls are batched over B*nh; row sums of 16-bit values add up in float32. On cupy
arrays the scale + mask + softmax (and its backward) is one CUDA kernel over (B*nh*T, T)
rows (cuda_kernels.py; MINIDIST_CUDA_KERNELS=0 for the xp code). Tests: tests/test_fused.py,
tests/test_gradcheck.py, tests/test_bfloat16.py, tests/test_cuda_kernels.py (gpu).
"""
import math

import numpy as np

from minidist import backend
from minidist.autograd import cuda_kernels as _ck
from minidist.autograd.dropout_keys import DropoutSite, uniforms
from minidist.autograd.function import Function
from minidist.backend import is_half, matmul as _mm, xp_of

_MASKS = {}


def causal_bias(xp, T, dtype):
    """(T, T): 0 on and below the diagonal, -inf above; cached per (module, T, dtype)."""
    key = (xp.__name__, T, str(dtype))
    if key not in _MASKS:
        i = xp.arange(T)
        _MASKS[key] = xp.where(i[None, :] > i[:, None], -math.inf, 0.0).astype(dtype)
    return _MASKS[key]


CAUSAL_BAND = 16       # query rows per call when only the causal half gets numbers


def keep_mask(rng, shape, p, xp):
    """Dropout's mask over (B, nh, T, T) weights, the same contract as ops.dropout: rng's
    numbers >= p, on xp. A DropoutSite (keyed numbers, dropout_keys.py) computes only the
    causal half, CAUSAL_BAND query rows at a time, each band's keys up to its last query:
    above the diagonal the weights are 0 whatever the mask says (False there). On a GPU, one
    band of all T rows: the launches per band cost more than the numbers saved."""
    if not isinstance(rng, DropoutSite):
        return uniforms(rng, shape, xp) >= p
    T = shape[-1]
    band = CAUSAL_BAND if xp is np else T
    keep = xp.zeros(shape, dtype=bool)
    heads = np.arange(shape[1])
    for r0 in range(0, T, band):
        r1 = min(r0 + band, T)
        c1 = min(-(-r1 // 4) * 4, T)                 # whole Philox blocks where T allows
        u = rng.block(shape, [heads, np.arange(r0, r1), np.arange(c1)], xp)
        keep[..., r0:r1, :c1] = u >= p
    return keep


def _acc(dtype):
    """Where a row sum of `dtype` values adds up: float32 for 16-bit dtypes."""
    return "float32" if is_half(dtype) else dtype


def _matmul_into(a, b, out):
    """out[...] = a @ b. numpy writes straight into a strided `out`; elsewhere (cupy) we do
    not rely on matmul's `out=` accepting non-contiguous views."""
    if backend.is_cupy(out):
        out[...] = _mm(a, b)
    else:
        _mm(a, b, out=out)


def _attn_weights(q, k, dropout_p, rng):
    """What the attention multiplies v by: (P, keep mask or None, scale), P = softmax(S +
    causal mask) (B, nh, T, T), keep = dropout's mask over it (None for p == 0)."""
    xp = xp_of(q)
    T, hs = q.shape[-2], q.shape[-1]
    P = _mm(q, xp.swapaxes(k, -1, -2))                       # (B, nh, T, T)
    if _ck.use(P) and P.flags.c_contiguous:
        _ck.attn_softmax_(P, 1.0 / math.sqrt(hs))            # all of the below, one kernel
    else:
        P *= 1.0 / math.sqrt(hs)                             # S
        P += causal_bias(xp, T, P.dtype)
        P -= P.max(axis=-1, keepdims=True)                   # the diagonal is always finite
        xp.exp(P, out=P)
        P /= P.sum(axis=-1, keepdims=True)                   # P = softmax(S)
    if dropout_p <= 0:
        return P, None, 1.0
    keep = keep_mask(rng, P.shape, dropout_p, xp)
    return P, keep, (1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0)


def _attn_forward(q, k, v, dropout_p, rng, out):
    """Write y into `out`; return what backward needs: (P, keep mask or None, scale)."""
    P, keep, scale = _attn_weights(q, k, dropout_p, rng)
    if keep is None:
        _matmul_into(P, v, out)                              # y = P v
        return P, None, 1.0
    Pd = P * keep
    Pd *= scale
    _matmul_into(Pd, v, out)                                 # y = dropout(P) v
    return P, keep, scale


class Redo:
    """Selective recompute (--attention recompute, Megatron-LM's selective activation
    recomputation): the forward keeps no (B, nh, T, T) weights, only q, k, v; the backward
    computes P and dropout's mask again from them. The mask's numbers are keyed by place
    (a DropoutSite): the keys' state of the forward (step, rows, cp positions) is kept and
    the backward draws as of it, as a pipeline's backward runs micro-batches later."""

    def __init__(self, dropout_p, rng):
        if dropout_p > 0 and not isinstance(rng, DropoutSite):
            raise TypeError("recomputed attention's dropout needs keyed numbers (a "
                            "DropoutSite, as GPT gives its layers), not a generator")
        self.p, self.rng = dropout_p, rng
        self.state = rng.keys.snapshot() if dropout_p > 0 else None

    def weights(self, q, k):
        """(P, keep, scale) as the forward computed them, bit for bit."""
        if self.state is None:
            return _attn_weights(q, k, self.p, self.rng)
        with self.rng.keys.as_of(self.state):
            return _attn_weights(q, k, self.p, self.rng)


def _attn_backward(g, gy, q, k, v, saved, out):
    """Write dq, dk, dv into out[0], out[1], out[2]. g: dL/dy (B, nh, T, hs);
    gy: sum_d g*y over hs, (B, nh, T, 1)."""
    xp = xp_of(g)
    P, keep, scale = saved
    kT = xp.swapaxes
    dP = _mm(g, kT(v, -1, -2))                               # y = Pd v: dPd = g v^T
    if keep is None:
        _matmul_into(kT(P, -1, -2), g, out[2])               #           dv = P^T g
    else:
        Pd = P * keep
        Pd *= scale
        _matmul_into(kT(Pd, -1, -2), g, out[2])              #           dv = Pd^T g
        dP *= keep                                           # dP = dPd * keep * scale
        dP *= scale
    # softmax: dS_ij = P_ij (dP_ij - sum_j' P_ij' dP_ij'), and that sum is g_i . y_i
    if _ck.use(dP, P) and dP.flags.c_contiguous and P.flags.c_contiguous:
        _ck.attn_softmax_backward_(dP, P, gy, 1.0 / math.sqrt(q.shape[-1]))   # one kernel
    else:
        dP -= gy
        dP *= P                                              # masked P_ij = 0: no gradient
        dP *= 1.0 / math.sqrt(q.shape[-1])                   # S = q k^T / sqrt(hs)
    _matmul_into(dP, k, out[0])                              # dq = dS k
    _matmul_into(kT(dP, -1, -2), q, out[1])                  # dk = dS^T q


class CausalAttention(Function):
    """q, k, v (B, nh, T, hs) -> y (B, nh, T, hs)."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p=0.0, rng=None, recompute=False):
        if not (q.shape == k.shape == v.shape) or q.ndim < 2:
            raise ValueError("q, k, v must have one shape (B, nh, T, hs)")
        y = xp_of(q).empty(q.shape, q.dtype)
        ctx.redo = Redo(dropout_p, rng) if recompute else None
        saved = _attn_forward(q, k, v, dropout_p, rng, y)
        ctx.save_for_backward(q, k, v, y, None if recompute else saved)
        return y

    @staticmethod
    def backward(ctx, grad):
        q, k, v, y, saved = ctx.saved
        xp = xp_of(grad)
        gy = (grad * y).sum(axis=-1, keepdims=True, dtype=_acc(y.dtype))
        out = xp.empty((3,) + q.shape, q.dtype)
        saved = ctx.redo.weights(q, k) if ctx.redo else saved
        _attn_backward(grad, gy, q, k, v, saved, out)
        return out[0], out[1], out[2], None, None, None


def causal_attention(q, k, v, dropout_p=0.0, rng=None, recompute=False):
    """Causal attention over heads already split: (B, nh, T, hs) each, scale 1/sqrt(hs).
    Dropout on the attention weights follows ops.dropout's rng contract. recompute: keep
    no weights, compute them again in backward (Redo; rng then a DropoutSite)."""
    return CausalAttention.apply(q, k, v, dropout_p, rng, recompute)


def heads_view(a, n_head):
    """(B, T, 3C) -> a (3, B, nh, T, hs) view, no copy: each (T, hs) matrix is strided
    (row stride 3C) in a way BLAS takes directly, so the matmuls read qkv in place."""
    B, T, C3 = a.shape
    return a.reshape(B, T, 3, n_head, C3 // 3 // n_head).transpose(2, 0, 3, 1, 4)


def per_head(a, n_head):
    """(B, T, C) -> its (B, nh, T, hs) view, no copy: head h's slice of every row."""
    B, T, C = a.shape
    return a.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def saved_heads(ctx, grad):
    """A tiled or ring attention's backward inputs, as (B, nh, T, hs) views: the incoming
    gradient g, the saved output yh, q, k, v out of the saved qkv, and the saved lse (B, nh, T);
    the forward saved (qkv, y, lse) and ctx.n_head."""
    qkv, y, lse = ctx.saved
    nh = ctx.n_head
    q, k, v = heads_view(qkv, nh)
    return per_head(grad, nh), per_head(y, nh), q, k, v, lse


def split_heads(qkv, n_head):
    """GPT-2's fused (B, T, 3C) -> q, k, v as (B, nh, T, hs) views, and the output buffers:
    y (B, T, C) and yh, its (B, nh, T, hs) view, which an attention writes head by head."""
    B, T, C3 = qkv.shape
    if C3 % 3 or (C3 // 3) % n_head:
        raise ValueError(f"last axis {C3} is not 3 * n_head({n_head}) * head size")
    q, k, v = heads_view(qkv, n_head)                        # (B, nh, T, hs) views
    y = xp_of(qkv).empty((B, T, C3 // 3), qkv.dtype)         # (B, T, C)
    return q, k, v, y, per_head(y, n_head)                    # yh: (B, nh, T, hs) view


class CausalSelfAttention(Function):
    """GPT-2's fused c_attn output (B, T, 3C), q|k|v along the last axis -> y (B, T, C),
    heads split inside and merged back: y[b, t, h*hs:(h+1)*hs] is head h's output.
    Split and merge are strided views: no transposed copies in forward or backward."""

    @staticmethod
    def forward(ctx, qkv, n_head, dropout_p=0.0, rng=None, recompute=False):
        q, k, v, y, yh = split_heads(qkv, n_head)
        ctx.redo = Redo(dropout_p, rng) if recompute else None
        saved = _attn_forward(q, k, v, dropout_p, rng, yh)
        ctx.save_for_backward(qkv, y, None if recompute else saved)
        ctx.n_head = n_head
        return y

    @staticmethod
    def backward(ctx, grad):
        qkv, y, saved = ctx.saved
        xp, nh = xp_of(grad), ctx.n_head
        B, T, C = grad.shape
        g4 = grad.reshape(B, T, nh, C // nh)                 # (B, T, nh, hs)
        gy = (g4 * y.reshape(B, T, nh, C // nh)).sum(axis=-1, dtype=_acc(y.dtype))  # (B,T,nh)
        gy = gy.transpose(0, 2, 1)[..., None]                # (B, nh, T, 1)
        dqkv = xp.empty_like(qkv)                            # (B, T, 3C)
        q, k, v = heads_view(qkv, nh)
        saved = ctx.redo.weights(q, k) if ctx.redo else saved
        _attn_backward(g4.transpose(0, 2, 1, 3), gy, q, k, v, saved, heads_view(dqkv, nh))
        return dqkv, None, None, None, None


def causal_self_attention(qkv, n_head, dropout_p=0.0, rng=None, recompute=False):
    """(B, T, 3C) -> (B, T, C) causal self-attention with n_head heads of size C/n_head.
    With tensor parallelism pass the local shard (B, T, 3C/tp) and n_head/tp. recompute:
    keep no (B, nh, T, T) weights, compute them again in backward (Redo)."""
    return CausalSelfAttention.apply(qkv, n_head, dropout_p, rng, recompute)
