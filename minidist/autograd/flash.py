"""Tiled causal attention (FlashAttention's algorithm) in plain xp code: O(T) memory per row.

Dimensions: B batch, nh heads, T sequence, hs head size, b the tile (block) size.
attention.py materialises P = softmax(q k^T / sqrt(hs)) as a (B, nh, T, T) array and keeps it
for backward. Here the queries are cut into row blocks of b and the keys/values into column
blocks of b; for each row block the key blocks arrive one by one and an online softmax keeps,
per query row, a running max m and a running sum l of exp(s - m):

    s = q_i k_j^T / sqrt(hs)                   (B, nh, b, b)  one tile of scores
    m' = max(m, rowmax(s));  a = exp(m - m')   rescales what was summed under the old max
    p = exp(s - m');  l = a l + rowsum(p);  acc = a acc + p v_j
    after the last block:  y_i = acc / l,  lse_i = m + log l      (log-sum-exp per row)

Only (q, k, v, y, lse) are saved: lse is (B, nh, T), O(T), not O(T^2). Backward recomputes
each tile's probabilities p = exp(s - lse) and uses the identity sum_j P_ij dP_ij = g_i . y_i
(as attention.py does). Causal: a tile whose first key comes after its last query is never
computed, so about half the (T/b)^2 tiles are skipped (`attention_flops` counts them); only
tiles that cross the diagonal are masked.
Dropout on the attention weights (`AttnDropout`) without a (T, T) mask: each tile computes its
own (query, key) numbers from the dropout keys (a counter-based generator: any element's
number from its place, minidist/autograd/dropout_keys.py), forward and again in backward. The
softmax's sums use the undropped p; only p v uses the dropped p Z (Z = keep / (1 - p_drop)):

    forward   l += rowsum(p);  acc += (p Z) v_j
    backward  dv += (p Z)^T g;  ds = p (Z (g v^T) - D);  D = rowsum(g y) still, since
              sum_j P_ij Z_ij (g_i . v_j) = g_i . y_i
`partial_attention` + `merge_partials` are the same online softmax across key chunks held
elsewhere (ring attention's building blocks). On cupy arrays with MINIDIST_CUDA_NEW_KERNELS=1
forward and backward run as CUDA kernels, dropout included: they compute each weight's
Philox number where they need it (cuda_source_flash.py, proven on the CPU by
tests/test_cuda_flash_cpu.py; off by default until a GPU session confirms them), and so does
partial_attention (causal), at any global positions (tests/test_cuda_ring_cpu.py).
Tests: tests/test_attention_tiled.py, tests/test_gradcheck.py.
"""
import itertools
import math

import numpy as np

from minidist.autograd import cuda_kernels_new as _ck
from minidist.autograd.attention import heads_view, saved_heads, split_heads
from minidist.autograd.cuda_kernels import launch
from minidist.autograd.dropout_keys import DropoutSite
from minidist.autograd.function import Function
from minidist.backend import matmul as _mm, xp_of

DEFAULT_BLOCK = 64


def block_pairs(T, block, causal=True, q_start=0, k_start=0, T_k=None):
    """The (query rows r0:r1, keys c0:c1, crosses_diagonal) tiles computed, row block by row
    block. Positions are global (queries from q_start, keys from k_start); causal skips a
    tile whose first key is after its last query and marks the ones that need a mask."""
    T_k = T if T_k is None else T_k
    for r0 in range(0, T, block):
        r1 = min(r0 + block, T)
        for c0 in range(0, T_k, block):
            c1 = min(c0 + block, T_k)
            if causal and k_start + c0 > q_start + r1 - 1:
                break                                        # this tile and all after: future
            yield r0, r1, c0, c1, causal and k_start + c1 - 1 > q_start + r0


def attention_flops(T, hs, block, causal=True):
    """Forward matmul FLOPs of one head: 2 b_q b_k hs for s = q k^T and as many for p v, per
    computed tile. Returns {"tiles", "tiles_full", "flops", "flops_full"}; "full" is the
    whole T x T square. Causal tiles: n (n + 1) / 2 of n^2 for n = T / b, so the ratio
    is (n + 1) / (2 n): 0.53 at T = 1024, b = 64; backward does 2.5x forward's matmuls."""
    tiles = flops = 0
    for r0, r1, c0, c1, _ in block_pairs(T, block, causal):
        tiles += 1
        flops += 4 * (r1 - r0) * (c1 - c0) * hs
    n = -(-T // block)
    return {"tiles": tiles, "tiles_full": n * n, "flops": flops, "flops_full": 4 * T * T * hs}


_BIASES = {}


def _diagonal_bias(xp, shift, bq, bk, dtype):
    """(bq, bk): -inf where tile key c comes after tile query r (c + shift > r), else 0;
    cached per (module, shift, bq, bk, dtype). An added bias, not a boolean scatter: no
    host sync on cupy."""
    key = (xp.__name__, shift, bq, bk, str(dtype))
    if key not in _BIASES:
        r, c = xp.arange(bq)[:, None], xp.arange(bk)[None, :]
        _BIASES[key] = xp.where(c + shift > r, -math.inf, 0.0).astype(dtype)
    return _BIASES[key]


def _tile_scores(q_i, k_j, r0, c0, masked, offset):
    """s = q_i k_j^T (q_i pre-scaled), with -inf where key position > query position.
    offset = k_start - q_start, so key c is after query r when c + offset > r."""
    xp = xp_of(q_i)
    s = _mm(q_i, xp.swapaxes(k_j, -1, -2))                   # (B, nh, bq, bk)
    if masked:
        s += _diagonal_bias(xp, c0 + offset - r0, s.shape[-2], s.shape[-1], s.dtype)
    return s


class AttnDropout:
    """Dropout with probability `p` on attention weights of shape (B, nh, T, T) (`shape`;
    T the whole sequence, positions global), computed a tile at a time from `site`, a
    DropoutSite (its numbers for any (query, key) block, minidist/autograd/dropout_keys.py).
    It keeps the keys' state of its forward (step, rows, positions): the backward redraws
    the same numbers whenever it runs (a pipeline's backward comes micro-batches later)."""

    def __init__(self, p, site, shape):
        if not isinstance(site, DropoutSite):
            raise TypeError("tiled attention's dropout needs keyed numbers (a DropoutSite, "
                            "as GPT gives its layers), not a generator")
        self.p, self.site, self.shape = p, site, tuple(shape)
        self.state = site.keys.snapshot()

    def kernel_args(self, xp):
        """What the flash kernels draw with (cuda_kernels_new.dropout_args), as of the
        forward: the batch's global rows (kept on xp: DropoutKeys.on_device), the local
        heads, the first of them in the whole model, the whole sequence's length (the
        kernels take global positions: a whole sequence or ring attention's pieces), the
        step as (counter, lag) read on the device (DropoutKeys.device_step: a captured
        graph's replays draw their own masks), the site's Philox key, p."""
        keys = self.site.keys
        with keys.as_of(self.state):
            if self.site.seq_axis is not None and keys.positions is not None:
                raise ValueError("the flash kernels take the weights' global positions, not "
                                 "a site that maps them through cp's positions")
            rows = keys.on_device(self.site.rows(self.shape[0]), xp)
            return (rows, self.shape[1], self.site.start(self.shape, 1), self.shape[3],
                    keys.device_step(xp), keys.philox_key(self.site.name), self.p)

    def tile(self, q0, q1, k0, k1, xp, dtype):
        """Z (B, nh, q1 - q0, k1 - k0): keep / (1 - p) for queries q0:q1, keys k0:k1."""
        heads = np.arange(self.shape[1])
        with self.site.keys.as_of(self.state):
            u = self.site.block(self.shape, [heads, np.arange(q0, q1), np.arange(k0, k1)],
                                xp)
        return ((u >= self.p) * (1.0 / (1.0 - self.p))).astype(dtype)


def _stat_dtype(xp, dtype):
    """Row statistics (m, l, lse) at least in float32, even for float16 inputs."""
    return xp.result_type(dtype, xp.float32)


def _row_block(q_i, k, v, tiles, starts, scale, dropout=None):
    """Online softmax of one query row block over its key tiles -> (y_i, lse_i); starts:
    the global positions (q_start, k_start) of q's and k's first rows."""
    xp = xp_of(q_i)
    lead, bq = q_i.shape[:-2], q_i.shape[-2]
    sd = _stat_dtype(xp, q_i.dtype)
    m = xp.full(lead + (bq, 1), -math.inf, sd)               # running max per row
    l = xp.zeros(lead + (bq, 1), sd)                         # running sum of exp(s - m)
    acc = xp.zeros(q_i.shape, sd)                            # running sum of p v
    q_s = q_i * scale
    q_start, k_start = starts
    for r0, r1, c0, c1, masked in tiles:
        s = _tile_scores(q_s, k[..., c0:c1, :], r0, c0, masked, k_start - q_start)
        m_new = xp.maximum(m, s.max(axis=-1, keepdims=True))
        m_new = xp.where(xp.isfinite(m_new), m_new, 0.0)     # a row with no key yet: exp(-inf)
        alpha = xp.exp(m - m_new)                            # old sums under the new max
        s -= m_new
        p = xp.exp(s, out=s)                                 # (B, nh, bq, bk)
        l *= alpha
        l += p.sum(axis=-1, keepdims=True)                   # the undropped sum
        acc *= alpha
        if dropout is not None:                              # p Z: this tile's numbers
            p *= dropout.tile(q_start + r0, q_start + r1, k_start + c0, k_start + c1, xp,
                              p.dtype).reshape(p.shape)      # (ring attention's grouped q)
        acc += _mm(p.astype(v.dtype, copy=False), v[..., c0:c1, :])
        m = m_new
    seen = l > 0                                             # False: every key was masked
    y = acc / xp.where(seen, l, 1.0)
    lse = xp.where(seen, m + xp.log(xp.where(seen, l, 1.0)), -math.inf)
    return y.astype(q_i.dtype, copy=False), lse[..., 0]


def kernels_ok(q, *arrays):
    """The CUDA flash kernels (cuda_source_flash.py) instead of the code here: cupy arrays,
    MINIDIST_CUDA_NEW_KERNELS=1 (off by default: proven on the CPU, never run on a GPU yet),
    head size <= 128. They tile on their own (16 or 8 rows), whatever `block` says."""
    return _ck.use_new(q, *arrays) and _ck.flash_ok(q)


def partial_attention(q, k, v, q_start=0, k_start=0, block=DEFAULT_BLOCK, causal=True,
                      dropout=None):
    """Attention of queries q (.., Tq, hs) at positions q_start.. over ONE chunk of keys and
    values (.., Tk, hs) at positions k_start.., arrays in and out, no graph; dropout: an
    AttnDropout or None.
    Returns (y, lse): y (.., Tq, hs) normalised over this chunk only, lse (.., Tq) its
    log-sum-exp (-inf for a row that sees no key: y 0 there). `merge_partials` combines
    chunks. Causal on cupy with the kernels on (kernels_ok): one flash_fwd launch, which
    tiles on its own."""
    xp = xp_of(q)
    if causal and kernels_ok(q, k, v):                       # one launch (cuda_source_flash)
        drop = None if dropout is None else dropout.kernel_args(xp)
        return _ck.flash_partial(xp, launch, q, k, v, q_start, k_start, drop)
    Tq, Tk = q.shape[-2], k.shape[-2]
    y = xp.empty(q.shape, q.dtype)
    lse = xp.empty(q.shape[:-1], _stat_dtype(xp, q.dtype))
    scale = 1.0 / math.sqrt(q.shape[-1])
    rows = itertools.groupby(block_pairs(Tq, block, causal, q_start, k_start, Tk),
                             key=lambda tile: tile[:2])
    y[...], lse[...] = 0, -math.inf                          # rows that see no key at all
    for (r0, r1), tiles in rows:
        y[..., r0:r1, :], lse[..., r0:r1] = _row_block(q[..., r0:r1, :], k, v, tiles,
                                                       (q_start, k_start), scale, dropout)
    return y, lse


def merge_partials(y_a, lse_a, y_b, lse_b):
    """Two results of the same queries over disjoint key chunks -> the result over both:
    lse = log(e^lse_a + e^lse_b), y = y_a e^(lse_a - lse) + y_b e^(lse_b - lse).
    A chunk a row cannot see (lse -inf) gets weight 0."""
    xp = xp_of(y_a)
    lse = xp.logaddexp(lse_a, lse_b)                         # (.., T)
    ref = xp.where(xp.isfinite(lse), lse, 0.0)
    w_a = xp.exp(lse_a - ref)[..., None]                     # (.., T, 1)
    w_b = xp.exp(lse_b - ref)[..., None]
    return (y_a * w_a + y_b * w_b).astype(y_a.dtype, copy=False), lse


def _forward(q, k, v, block, out, dropout=None):
    """Causal attention of q, k, v (B, nh, T, hs) into `out` (may be a strided view);
    returns lse (B, nh, T). The CUDA kernels compute dropout's numbers themselves."""
    if kernels_ok(q, k, v):
        drop = None if dropout is None else dropout.kernel_args(xp_of(q))
        out[...], lse = _ck.flash_attention(q, k, v, drop)
        return lse
    y, lse = partial_attention(q, k, v, 0, 0, block, dropout=dropout)
    out[...] = y
    return lse


def _backward(g, q, k, v, y, lse, block, out, dropout=None):
    """dq, dk, dv into out[0], out[1], out[2] (zeroed here), tile by tile: each tile's
    probabilities (and dropout numbers) are recomputed; nothing (T, T) is ever held."""
    if kernels_ok(q, k, v, g, y):
        drop = None if dropout is None else dropout.kernel_args(xp_of(q))
        out[0][...], out[1][...], out[2][...] = _ck.flash_attention_backward(g, q, k, v, y, lse,
                                                                             drop)
        return
    xp = xp_of(g)
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dk, dv = out[0], out[1], out[2]
    dq[...] = 0
    dk[...] = 0
    dv[...] = 0
    # (B, nh, T, 1): g_i . y_i, added up in float32 at least, rounded once to the tiles' dtype
    D = (g * y).sum(axis=-1, keepdims=True, dtype=_stat_dtype(xp, y.dtype))
    D = D.astype(y.dtype, copy=False)
    rows = itertools.groupby(block_pairs(q.shape[-2], block), key=lambda tile: tile[:2])
    for (r0, r1), tiles in rows:
        q_i, g_i = q[..., r0:r1, :], g[..., r0:r1, :]
        q_s, lse_i, D_i = q_i * scale, lse[..., r0:r1, None], D[..., r0:r1, :]
        for _, _, c0, c1, masked in tiles:
            k_j, v_j = k[..., c0:c1, :], v[..., c0:c1, :]
            s = _tile_scores(q_s, k_j, r0, c0, masked, 0)
            s -= lse_i
            p = xp.exp(s, out=s).astype(q.dtype, copy=False)  # the forward's probabilities
            z = None if dropout is None else dropout.tile(r0, r1, c0, c1, xp, p.dtype)
            pz = p if z is None else p * z                    # y = (p z) v
            dv[..., c0:c1, :] += _mm(xp.swapaxes(pz, -1, -2), g_i)  # dv = (p z)^T g
            dp = _mm(g_i, xp.swapaxes(v_j, -1, -2))           # d(p z) = g v^T
            if z is not None:
                dp *= z                                       # dp = z g v^T
            dp -= D_i                                         # softmax: ds = p (dp - g.y)
            dp *= p
            dp *= scale                                       # s = q k^T / sqrt(hs)
            dq[..., r0:r1, :] += _mm(dp, k_j)                 # dq = ds k
            dk[..., c0:c1, :] += _mm(xp.swapaxes(dp, -1, -2), q_i)  # dk = ds^T q


def _dropout(p, rng, q):
    """AttnDropout over q's (B, nh, T, T) weights, or None for p == 0."""
    return AttnDropout(p, rng, q.shape[:-1] + q.shape[-2:-1]) if p > 0 else None


class TiledAttention(Function):
    """q, k, v (B, nh, T, hs) -> y (B, nh, T, hs), causal, tiles of `block` rows/keys;
    dropout_p > 0: on the attention weights, numbers from `rng` (a DropoutSite)."""

    @staticmethod
    def forward(ctx, q, k, v, block=DEFAULT_BLOCK, dropout_p=0.0, rng=None):
        if not (q.shape == k.shape == v.shape) or q.ndim < 2:
            raise ValueError("q, k, v must have one shape (B, nh, T, hs)")
        y = xp_of(q).empty(q.shape, q.dtype)
        ctx.dropout = _dropout(dropout_p, rng, q)
        lse = _forward(q, k, v, block, y, ctx.dropout)
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.block = block
        return y

    @staticmethod
    def backward(ctx, grad):
        q, k, v, y, lse = ctx.saved
        out = xp_of(grad).empty((3,) + q.shape, q.dtype)
        _backward(grad, q, k, v, y, lse, ctx.block, out, ctx.dropout)
        return out[0], out[1], out[2], None, None, None


class TiledSelfAttention(Function):
    """GPT-2's fused qkv (B, T, 3C) -> y (B, T, C), as attention.CausalSelfAttention (heads
    split and merged as strided views), computed tile by tile."""

    @staticmethod
    def forward(ctx, qkv, n_head, block=DEFAULT_BLOCK, dropout_p=0.0, rng=None):
        q, k, v, y, yh = split_heads(qkv, n_head)
        ctx.dropout = _dropout(dropout_p, rng, q)
        lse = _forward(q, k, v, block, yh, ctx.dropout)       # (B, nh, T)
        ctx.save_for_backward(qkv, y, lse)
        ctx.n_head, ctx.block = n_head, block
        return y

    @staticmethod
    def backward(ctx, grad):
        g, yh, q, k, v, lse = saved_heads(ctx, grad)          # (B, nh, T, hs) views
        dqkv = xp_of(grad).empty_like(ctx.saved[0])           # (B, T, 3C)
        _backward(g, q, k, v, yh, lse, ctx.block, heads_view(dqkv, ctx.n_head), ctx.dropout)
        return dqkv, None, None, None, None


def tiled_attention(q, k, v, block=DEFAULT_BLOCK, dropout_p=0.0, rng=None):
    """Causal attention over heads already split, (B, nh, T, hs) each, in tiles of `block`;
    dropout on the weights with probability dropout_p, numbers from rng (a DropoutSite)."""
    return TiledAttention.apply(q, k, v, block, dropout_p, rng)


def tiled_self_attention(qkv, n_head, block=DEFAULT_BLOCK, dropout_p=0.0, rng=None):
    """(B, T, 3C) -> (B, T, C) causal self-attention in tiles of `block`; dropout as
    tiled_attention's."""
    return TiledSelfAttention.apply(qkv, n_head, block, dropout_p, rng)
