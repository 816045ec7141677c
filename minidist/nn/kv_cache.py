"""The key/value cache of sampling: each attention layer keeps the k and v of the tokens it has
seen, so the next token runs the model on that one token instead of on the whole context.

    generate (minidist/nn/sampling.py)    cache = model.sampling_cache(B)
    GPT.next_token(ctx, ..., cache)        new = cache.new_tokens(ctx): the columns of ctx the
                                           cache has not seen (all of ctx when it holds a
                                           prefix of nothing: the first call, or a context that
                                           slid past block_size), at positions cache.length..
    CausalSelfAttention.forward            with a LayerCache: q, k, v of the new tokens, k and
                                           v appended (after RoPE, before grouped-query
                                           attention's repeat: nkv heads, the cache GQA
                                           shrinks), the new queries attend to every cached
                                           key at or before their own position

A context longer than block_size slides (generate keeps its last block_size tokens), and
then every token's hidden states change with the window, so the cache starts again from the
window: past block_size each token costs a whole forward, as without a cache. The numbers
are the uncached model's to rounding (the same sums in another order), not bit for bit.
Inference only (no_grad): nothing here has a backward. Tests: tests/test_gpt.py.
"""
import numpy as np

from minidist.autograd import Tensor, is_grad_enabled
from minidist.autograd.cuda_kernels import acc_dtype
from minidist.autograd.llama_ops import rotary
from minidist.backend import xp_of


class LayerCache:
    """One attention layer's cached k and v, (B, block_size, nkv, hs) each, of `length`
    tokens."""

    def __init__(self, capacity):
        self.capacity = capacity            # block_size: the longest context generate runs
        self.k = self.v = None
        self.length = 0

    def attend(self, qkv, n_head, n_kv_head, rope_theta):
        """y (B, t, nh hs) of the new tokens' qkv (B, t, (nh + 2 nkv) hs), a Tensor: RoPE at
        positions length.. (rope_theta None: none), k and v appended, then causal attention
        over every cached key (query i of position length + i sees keys 0..length + i)."""
        if is_grad_enabled():
            raise RuntimeError("the key/value cache is for sampling, under no_grad")
        B, t, width = qkv.shape
        hs, p0 = width // (n_head + 2 * n_kv_head), self.length
        xp = xp_of(qkv.data)
        if rope_theta is not None:
            qkv = rotary(qkv, n_head, n_kv_head, xp.arange(p0, p0 + t), rope_theta)
        data = qkv.data
        q = data[..., :n_head * hs].reshape(B, t, n_head, hs)
        k, v = (data[..., lo:lo + n_kv_head * hs].reshape(B, t, n_kv_head, hs)
                for lo in (n_head * hs, (n_head + n_kv_head) * hs))
        self._append(xp, k, v)
        K, V = self.k[:, :p0 + t], self.v[:, :p0 + t]                  # (B, L, nkv, hs)
        g, L = n_head // n_kv_head, p0 + t
        f32 = acc_dtype(data.dtype)                  # float32, float64 for float64
        qg = q.reshape(B, t, n_kv_head, g, hs).transpose(0, 2, 3, 1, 4).astype(f32)
        kt = K.transpose(0, 2, 3, 1).astype(f32)                      # (B, nkv, hs, L)
        s = xp.matmul(qg.reshape(B, n_kv_head, g * t, hs), kt) / np.sqrt(hs)
        s = s.reshape(B, n_kv_head, g, t, L)
        seen = xp.arange(L)[None, :] <= (p0 + xp.arange(t))[:, None]    # (t, L)
        s = xp.where(seen, s, -xp.inf)
        s = xp.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        y = xp.matmul(s.reshape(B, n_kv_head, g * t, L), V.transpose(0, 2, 1, 3).astype(f32))
        y = y.reshape(B, n_kv_head, g, t, hs).transpose(0, 3, 1, 2, 4)  # (B, t, nkv, g, hs)
        return Tensor(y.reshape(B, t, n_head * hs).astype(data.dtype))

    def clear(self):
        """Forget every token (the context slid: the cache starts again)."""
        self.k = self.v = None
        self.length = 0

    def _append(self, xp, k, v):
        B, t = k.shape[:2]
        if self.k is None:
            self.k = xp.empty((B, self.capacity) + k.shape[2:], k.dtype)
            self.v = xp.empty_like(self.k)
        self.k[:, self.length:self.length + t] = k
        self.v[:, self.length:self.length + t] = v
        self.length += t


class KVCache:
    """Every attention layer's LayerCache and the tokens they hold (B, length), host ints."""

    def __init__(self, n_layers, block_size):
        self.layers = [LayerCache(block_size) for _ in range(n_layers)]
        self.tokens = None

    @property
    def length(self):
        return 0 if self.tokens is None else self.tokens.shape[1]

    def new_tokens(self, ctx):
        """(the columns of ctx (B, T) to run, their first position): those past the cached
        prefix when ctx extends it; else all of ctx, the cache emptied first."""
        ctx = np.asarray(ctx)
        n = self.length
        if not (0 < n < ctx.shape[1] and np.array_equal(ctx[:, :n], self.tokens)):
            for layer in self.layers:
                layer.clear()
            self.tokens, n = None, 0
        self.tokens = ctx.copy()
        return ctx[:, n:], n
