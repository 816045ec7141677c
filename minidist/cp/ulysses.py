"""DeepSpeed-Ulysses attention: under --cp, each rank attends with a share of the heads over the
whole sequence, instead of its tokens over a ring (--cp-attention ulysses).

Dimensions: B batch, T the whole sequence, N the cp group's size, Tl = T / N this rank's
tokens, C the width (C/tp under --tp), H = n_head (n_head/tp under --tp), Hl = H / N this
rank's heads, hs head size. Every rank of the cp group, per attention layer:

    qkv (B, Tl, 3C)        this rank's tokens, q|k|v of ALL H heads
    -> all-to-all          chunk j (every token's q, k, v of rank j's heads) to rank j
    (B, T, 3C/N)           ALL tokens, q|k|v of this rank's Hl heads, in global position order
                           (the pieces arrive in rank order: zig-zag's are put back in place)
    -> attention           the model's own causal attention on (B, Hl, T, hs), materialized or
                           tiled as config.attention says (minidist/autograd/attention.py,
                           flash.py): nothing new, the heads are independent
    (B, T, C/N)            ALL tokens, this rank's heads' outputs
    -> all-to-all          chunk j (rank j's tokens) back to rank j, heads put side by side
    y (B, Tl, C)           this rank's tokens, every head: what c_proj takes

The two exchanges are autograd Functions whose backward is the other one (the all-to-all
undone): `HeadsForTokens` forward gathers tokens and scatters heads, backward the reverse;
`TokensForHeads` the mirror image. Dropout on the attention weights: this rank computes heads
[c Hl, (c+1) Hl) of all T positions, so its site is sliced by head as tensor parallelism's is
(`head_site`: DropoutSite axis 1, parts tp x cp), and the masks are one process's.
Grouped-query attention (nkv < H k and v heads): q crosses as it is; of k and v each rank
is sent the window of c consecutive kv heads its Hl q heads read (`kv_windows`: c the most
any rank reads, as an all-to-all sends equal chunks; `kv_heads_sent` = N c heads in all:
nkv where N divides it, N where nkv divides N), picked before the all-to-all (`pick_kv`),
and picks each of its q heads' kv head out of its window after it (`pick_kv` again; its
backward sums the picks' gradients). Repeating k and v to lcm(nkv, N) heads instead, as
this did before 2026-11-30, sent each rank all nkv heads where nkv and N are coprime
(--n-head 6 --n-kv-head 3 --cp 2: 3 kv heads a rank, as many as its q heads; c = 2).
Bytes each rank sends per attention layer and micro-batch (an all-to-all keeps 1/N of its
buffer), S = B x Tl x C x itemsize: forward 3S(N-1)/N + S(N-1)/N, backward the same again:
8S(N-1)/N; with --ckpt-activations the forward's once more: 12S(N-1)/N (`ulysses_bytes`);
grouped-query, with kv = S kv_heads_sent / H the bytes of k as sent: 4(S + kv)(N-1)/N and
6(S + kv)(N-1)/N.
Tests: tests/test_cp_ulysses.py, tests/scripts/ulysses_check.py.
"""
import numpy as np

from minidist.autograd.attention import causal_self_attention
from minidist.autograd.dropout_keys import DropoutSite
from minidist.autograd.flash import tiled_self_attention
from minidist.autograd.function import Function
from minidist.backend import is_half, xp_of
from minidist.nn.config import uses_tiled


def part_widths(W, parts):
    """The widths of the parts of a last axis of W columns: `parts` equal ones (an int), or
    `parts` itself (a tuple of widths: q | k | v under grouped-query attention)."""
    if isinstance(parts, int):
        return (W // parts,) * parts
    if sum(parts) != W:
        raise ValueError(f"parts {parts} do not make up a last axis of {W}")
    return tuple(parts)


def to_heads(x, group, order, parts):
    """(B, Tl, W) this rank's tokens, all heads -> (B, T, W/N) every rank's tokens at their
    global positions (`order[k]`: the position of the k-th token in rank order), this rank's
    heads: slice `rank` of N of each part (`parts`: their number, or widths, part_widths),
    side by side."""
    xp, n = xp_of(x), group.size
    B, Tl, W = x.shape
    pieces, lo = [], 0
    for w in part_widths(W, parts):                  # (B, Tl, N, w/N): rank j's heads at j
        pieces.append(x[..., lo:lo + w].reshape(B, Tl, n, w // n))
        lo += w
    send = xp.ascontiguousarray(xp.concatenate(pieces, axis=-1).transpose(2, 0, 1, 3))
    recv = xp.empty_like(send)                                      # (N, B, Tl, W/N)
    group.all_to_all(recv, send)                                    # recv[i]: rank i's tokens
    y = recv.transpose(1, 0, 2, 3).reshape(B, n * Tl, W // n)       # rank order
    return y if order is None else y[:, xp.asarray(np.argsort(order))]   # (B, T, W/N)


def to_tokens(x, group, order, parts):
    """to_heads undone: (B, T, W/N) every token, this rank's heads -> (B, Tl, W) this rank's
    tokens, every rank's heads side by side in each part."""
    xp, n = xp_of(x), group.size
    B, T, Wn = x.shape
    Tl = T // n
    x = x if order is None else x[:, xp.asarray(order)]             # rank order
    send = xp.ascontiguousarray(x.reshape(B, n, Tl, Wn).transpose(1, 0, 2, 3))
    recv = xp.empty_like(send)                                      # (N, B, Tl, W/N)
    group.all_to_all(recv, send)                                    # recv[j]: rank j's heads
    pieces, lo = [], 0
    for w in part_widths(n * Wn, parts):
        pieces.append(recv[..., lo:lo + w // n].transpose(1, 2, 0, 3).reshape(B, Tl, w))
        lo += w // n
    return xp.concatenate(pieces, axis=-1)                          # (B, Tl, W)


class HeadsForTokens(Function):
    """All-to-all forward: this rank's tokens of every head (B, Tl, W) -> every token of this
    rank's heads (B, T, W/N), in global order (`order`, or None: already so), of each of the
    `parts` (a number of equal parts, or their widths). Backward: the inverse all-to-all
    (each token's gradient back to the rank holding it)."""

    @staticmethod
    def forward(ctx, x, group, order, parts):
        ctx.group, ctx.order, ctx.parts = group, order, parts
        return to_heads(x, group, order, parts)

    @staticmethod
    def backward(ctx, grad):
        return to_tokens(grad, ctx.group, ctx.order, ctx.parts), None, None, None


class TokensForHeads(Function):
    """HeadsForTokens the other way: forward to_tokens, backward to_heads."""

    @staticmethod
    def forward(ctx, x, group, order, parts):
        ctx.group, ctx.order, ctx.parts = group, order, parts
        return to_tokens(x, group, order, parts)

    @staticmethod
    def backward(ctx, grad):
        return to_heads(grad, ctx.group, ctx.order, ctx.parts), None, None, None


def head_site(site, group):
    """The attention-weights dropout site of this rank's heads: `site` (whole, or sliced by
    head over tp) sliced again into the cp group's N parts, this rank's the `rank`-th. tp rank
    t's heads are [t H, (t+1) H), this rank's of them [c Hl, (c+1) Hl): part t N + c of tp N.
    A generator (not a DropoutSite) is returned as it is."""
    if not isinstance(site, DropoutSite):
        return site
    parts, index = (site.parts, site.index) if site.axis == 1 and site.sliced() else (1, 0)
    n = group.size
    return DropoutSite(site.keys, site.name, axis=1, parts=parts * n,
                       index=index * n + group.rank, seq_axis=site.seq_axis)


def sequence_order(layouts):
    """Global positions of every token in rank order ((T,) host ints), or None where that
    is already 0 .. T-1 (the naive split): nothing to reorder."""
    order = np.concatenate([np.arange(s, s + L) for pieces in layouts for s, L in pieces])
    return None if np.array_equal(order, np.arange(len(order))) else order


def kv_windows(n_head, n_kv_head, n):
    """Grouped-query attention's k and v heads for each cp rank: (starts, c), rank j getting
    the c consecutive kv heads [starts[j], starts[j] + c). Rank j's nh / N q heads read kv
    heads floor(q / g), g = nh / nkv; an all-to-all sends every rank the same count, so c
    is the most any rank reads, and each window is moved inside 0 .. nkv - 1. Where N
    divides nkv the windows are its N parts (c = nkv / N); where nkv divides N, one head
    each (c = 1): lcm(nkv, N) / N, what repeating k and v to lcm(nkv, N) heads sent. Where
    neither divides the other that repeat sent every rank nkv heads (lcm = nkv N: as many
    as its q heads at --n-head 6 --n-kv-head 3 --cp 2, nothing saved); the windows send
    c = 2 there (tests/test_cp_ulysses.py)."""
    nkv = n_kv_head or n_head
    g, per = n_head // nkv, n_head // n
    firsts = [j * per // g for j in range(n)]
    c = max(((j + 1) * per - 1) // g - firsts[j] + 1 for j in range(n))
    return [min(f, nkv - c) for f in firsts], c


def kv_heads_sent(n_head, n_kv_head, n):
    """The k and v heads Ulysses' all-to-all carries under grouped-query attention: N
    windows of kv_windows' c heads (nkv itself where N divides it; N where nkv divides N:
    one each). At most nh (multi-head attention's), and at most lcm(nkv, N)."""
    return n * kv_windows(n_head, n_kv_head, n)[1]


class PickKV(Function):
    """(B, T, (nh + 2 nkv) hs) -> (B, T, (nh + 2 len(heads)) hs): q as it is, then k and v
    heads `heads` (indices into the nkv, repeats allowed) in that order. Backward adds each
    pick's gradient into its head (in float32 for 16-bit dtypes, as repeat_kv's sums)."""

    @staticmethod
    def forward(ctx, qkv, n_head, n_kv_head, heads):
        B, T, width = qkv.shape
        hs = width // (n_head + 2 * n_kv_head)
        xp, Q, K = xp_of(qkv), n_head * hs, n_kv_head * hs
        ctx.shape, ctx.sizes, ctx.heads = qkv.shape, (n_head, n_kv_head, hs), list(heads)
        index = xp.asarray(ctx.heads)
        parts = [qkv[..., :Q]] + [
            xp.take(qkv[..., lo:lo + K].reshape(B, T, n_kv_head, hs), index, axis=2)
            .reshape(B, T, len(ctx.heads) * hs) for lo in (Q, Q + K)]
        return xp.concatenate(parts, axis=-1)

    @staticmethod
    def backward(ctx, grad):
        B, T, _ = grad.shape
        nh, nkv, hs = ctx.sizes
        xp, Q, m = xp_of(grad), nh * hs, len(ctx.heads)
        wide = "float32" if is_half(grad.dtype) else grad.dtype
        dqkv = xp.empty(ctx.shape, grad.dtype)
        dqkv[..., :Q] = grad[..., :Q]
        for i in range(2):                                                 # k, then v
            picked = grad[..., Q + i * m * hs:Q + (i + 1) * m * hs].reshape(B, T, m, hs)
            total = xp.zeros((B, T, nkv, hs), wide)
            for at, head in enumerate(ctx.heads):
                total[:, :, head] += picked[:, :, at]
            dqkv[..., Q + i * nkv * hs:Q + (i + 1) * nkv * hs] = \
                total.reshape(B, T, nkv * hs).astype(grad.dtype, copy=False)
        return dqkv, None, None, None


def pick_kv(qkv, n_head, n_kv_head, heads):
    """PickKV, or qkv itself where `heads` is every kv head in order."""
    if list(heads) == list(range(n_kv_head)):
        return qkv
    return PickKV.apply(qkv, n_head, n_kv_head, heads)


def ulysses_attention(qkv, n_head, context, dropout_p=0.0, rng=None, n_kv_head=None):
    """(B, Tl, (nh + 2 nkv) hs) Tensor -> (B, Tl, C): causal self-attention over the whole
    sequence with this rank's n_head/N heads. context: a RingContext in a forward (its
    group, layouts, tile size and the model's --attention). Grouped-query attention (nkv
    < nh): each rank is sent only the window of kv heads its q heads read (kv_windows:
    pick_kv picks every rank's window before the all-to-all), and picks each of its q
    heads' kv head out of its window after it (pick_kv again: its backward sums the picks'
    gradients)."""
    group, nkv = context.group, n_kv_head or n_head
    n, r, order = group.size, group.rank, sequence_order(context.layouts)
    starts, c = kv_windows(n_head, nkv, n)
    qkv = pick_kv(qkv, n_head, nkv, [s + i for s in starts for i in range(c)])
    hs = qkv.shape[-1] // (n_head + 2 * n * c)                   # (B, Tl, (nh + 2 N c) hs)
    widths = (n_head * hs, n * c * hs, n * c * hs)                   # q | k | v
    qkv_h = HeadsForTokens.apply(qkv, group, order, widths)     # (B, T, (nh/N + 2 c) hs)
    heads, site, g = n_head // n, head_site(rng, group), n_head // nkv
    qkv_h = pick_kv(qkv_h, heads, c, [(r * heads + i) // g - starts[r]      # (B, T, 3C/N)
                                      for i in range(heads)])
    if uses_tiled(context.local, qkv_h.shape[1]):
        y = tiled_self_attention(qkv_h, heads, context.block, dropout_p, site)   # (B, T, C/N)
    else:
        y = causal_self_attention(qkv_h, heads, dropout_p, site,                 # (B, T, C/N)
                                  recompute=context.local == "recompute")
    return TokensForHeads.apply(y, group, order, 1)                   # (B, Tl, C)


def ulysses_bytes(S, n, recompute=False, kv=None):
    """Bytes one rank sends per attention layer and micro-batch, forward + backward, where S
    is the bytes of its tokens' (B, Tl, C) and kv those of its k (or v) as sent
    (kv_heads_sent of the heads; None: S, multi-head attention): each all-to-all sends
    (N-1)/N of its buffer, qkv S + 2 kv and y S forward, their gradients backward:
    4(S + kv)(N-1)/N, 8S(N-1)/N for multi-head; `recompute` (--ckpt-activations): the
    forward once more, 6(S + kv)(N-1)/N. Exact when N divides S and kv."""
    kv = S if kv is None else kv
    forward = (2 * S + 2 * kv) * (n - 1) // n
    return forward * (3 if recompute else 2)
