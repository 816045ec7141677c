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
Grouped-query attention (nkv < H k and v heads): q, k and v cross as they are, k and v
repeated first only to `kv_heads_sent` = lcm(nkv, N) heads, the fewest that split over the
N ranks with each rank's q heads finding theirs (nkv where N divides it; N where nkv
divides N: one each); each rank repeats its share to its Hl heads after the all-to-all
(repeat_kv, minidist/autograd/llama_ops.py, whose backward sums the copies' gradients).
Bytes each rank sends per attention layer and micro-batch (an all-to-all keeps 1/N of its
buffer), S = B x Tl x C x itemsize: forward 3S(N-1)/N + S(N-1)/N, backward the same again:
8S(N-1)/N; with --ckpt-activations the forward's once more: 12S(N-1)/N (`ulysses_bytes`);
grouped-query, with kv = S lcm(nkv, N) / H the bytes of k as sent: 4(S + kv)(N-1)/N and
6(S + kv)(N-1)/N.
Tests: tests/test_cp_ulysses.py, tests/scripts/ulysses_check.py.
"""
import math

import numpy as np

from minidist.autograd.attention import causal_self_attention
from minidist.autograd.dropout_keys import DropoutSite
from minidist.autograd.flash import tiled_self_attention
from minidist.autograd.function import Function
from minidist.autograd.llama_ops import repeat_kv
from minidist.backend import xp_of
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


def kv_heads_sent(n_head, n_kv_head, n):
    """The k and v heads Ulysses' all-to-all carries under grouped-query attention: the
    fewest, lcm(nkv, N), that split over the N cp ranks so that each rank gets those its
    nh / N q heads read (nkv itself where N divides it; N where nkv divides N: one each).
    At most nh, as N and nkv both divide nh."""
    return math.lcm(n_kv_head or n_head, n)


def ulysses_attention(qkv, n_head, context, dropout_p=0.0, rng=None, n_kv_head=None):
    """(B, Tl, (nh + 2 nkv) hs) Tensor -> (B, Tl, C): causal self-attention over the whole
    sequence with this rank's n_head/N heads. context: a RingContext in a forward (its
    group, layouts, tile size and the model's --attention). Grouped-query attention (nkv
    < nh): the k and v heads are repeated only to kv_heads_sent(nh, nkv, N) before the
    all-to-all, and to this rank's nh/N after it, where the attention computes (repeat_kv
    both times: its backward sums the copies' gradients)."""
    group, nkv = context.group, n_kv_head or n_head
    n, order = group.size, sequence_order(context.layouts)
    sent = kv_heads_sent(n_head, nkv, n)
    qkv = repeat_kv(qkv, n_head, nkv, sent)                     # (B, Tl, (nh + 2 sent) hs)
    hs = qkv.shape[-1] // (n_head + 2 * sent)
    widths = (n_head * hs, sent * hs, sent * hs)                      # q | k | v
    qkv_h = HeadsForTokens.apply(qkv, group, order, widths)     # (B, T, (nh + 2 sent) hs/N)
    heads, site = n_head // n, head_site(rng, group)
    qkv_h = repeat_kv(qkv_h, heads, sent // n)                       # (B, T, 3C/N)
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
