"""The fused layers again, composed from primitive ops only: the obvious way to write them.

Autograd differentiates these for free, which makes them the yardstick for `fused`: the
tests check that both give the same values and gradients, and examples/bench_fused.py
measures how much more time and saved memory the composed versions cost.
Tests: tests/test_fused.py.
"""
import math

from minidist.autograd import ops
from minidist.backend import xp_of


def linear(x, weight, bias=None):
    lead = x.shape[:-1]
    y = x.reshape(-1, x.shape[-1]) @ weight
    y = y if bias is None else y + bias
    return y.reshape(*lead, y.shape[-1])


def layer_norm(x, weight, bias=None, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)
    out = xc / (var + eps).sqrt() * weight
    return out if bias is None else out + bias


def gelu(x):
    return 0.5 * x * (1.0 + (math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)).tanh())


def softmax(x, axis=-1):
    e = (x - x.data.max(axis=axis, keepdims=True)).exp()   # the max: a constant shift
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax(x, axis=-1):
    z = x - x.data.max(axis=axis, keepdims=True)
    return z - z.exp().sum(axis=axis, keepdims=True).log()


def cross_entropy(logits, targets, ignore_index=-1):
    V = logits.shape[-1]
    logp = log_softmax(logits.reshape(-1, V))
    t = targets.reshape(-1)
    valid = t != ignore_index
    rows = xp_of(t).arange(len(t))
    picked = logp[rows, t * valid] * valid                  # ignored rows: class 0, zeroed
    return -picked.sum() / max(int(valid.sum()), 1)


def causal_attention(q, k, v):
    T, hs = q.shape[-2], q.shape[-1]
    att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))
    i = xp_of(q.data).arange(T)
    future = i[None, :] > i[:, None]                        # (T, T): key after query
    att = ops.masked_fill(att, future, -math.inf)
    return softmax(att) @ v


def causal_self_attention(qkv, n_head):
    B, T, C3 = qkv.shape
    q, k, v = ops.split(qkv, 3, axis=-1)
    heads = [t.reshape(B, T, n_head, C3 // 3 // n_head).transpose(0, 2, 1, 3)
             for t in (q, k, v)]
    y = causal_attention(*heads)                            # (B, nh, T, hs)
    return y.transpose(0, 2, 1, 3).reshape(B, T, C3 // 3)

