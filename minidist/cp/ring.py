"""Ring attention: causal self-attention over a sequence split across the ranks of a cp group.

Dimensions: B batch, nh heads, T the whole sequence, Tl = T / N this rank's part, hs head size,
N the cp group's size. Each rank keeps its queries; the key/value blocks travel around the
ring (rank r sends to r + 1, receives from r - 1), so at step s rank r holds the keys and
values of rank (r - s) mod N. Each arriving block is attended to with partial_attention and
merged into the running result with merge_partials (the online softmax of
minidist/autograd/flash.py, across ranks instead of tiles):

    step      0        1        2        3          (N = 4: which rank's k/v each rank holds)
    rank 0   kv0      kv3      kv2      kv1
    rank 1   kv1      kv0      kv3      kv2
    rank 2   kv2      kv1      kv0      kv3
    rank 3   kv3      kv2      kv1      kv0

Overlap: the receive of the next block (and the send of this one) is posted before this
block's compute and waited for after it.
Backward: the key/value blocks go around the ring again, in the same direction, and each
carries its gradient accumulator (dk, dv) with it: rank r adds its queries' contribution to
the block it holds and passes block and accumulator on; after N steps every accumulator has
visited every rank and one last hop brings it home. Grouped-query attention (nkv k and v
heads for nh q heads): blocks and accumulators travel as nkv heads; the rank attends to the
block in hand with its q heads seen as nkv groups of nh / nkv (`grouped`, repeat_kv's order)
and the block broadcast over each group, and sums each tile's dk and dv over the group
straight into the accumulator (`group_sum`): nothing is held nh heads wide but a tile
(the flash kernels, which take nh heads, still get the block repeated, `repeat_block`, and
its gradients summed back, `sum_groups`).
Bytes sent per rank per attention layer, with S = B * Tl * nkv * hs * itemsize (one of k
or v; B * Tl * C * itemsize under multi-head attention):
    forward 2 S (N - 1),  backward 2 S (N - 1) for k/v + 2 S N for dk/dv;
with activation recompute (--ckpt-activations) the forward's 2 S (N - 1) again in backward.
Split of the sequence (`layout`): "naive" gives rank r the contiguous piece r of N; causal
attention then makes rank N - 1 do 2N - 1 times rank 0's work (rank 0: half a diagonal
block; rank N - 1: N - 1 whole blocks and half of one). "zigzag" cuts T into 2N chunks and
gives rank r chunks r and 2N-1-r: every rank does the same work (`causal_tiles` counts).
On cupy with MINIDIST_CUDA_NEW_KERNELS=1 (`tile_run`) each pair of pieces of a held block is
one flash kernel launch forward and two backward, at the pieces' global positions
(minidist/autograd/cuda_source_flash.py; proven on the CPU only: tests/test_cuda_ring_cpu.py).
Tests: tests/test_context_parallel.py, tests/test_cp_exact.py (tests/scripts/cp_check.py),
tests/test_cuda_ring_cpu.py.
"""
import math

import numpy as np

from minidist.autograd.attention import per_head
from minidist.autograd.cuda_kernels import launch
from minidist.autograd.cuda_kernels_new import flash_partial, flash_piece_backward
from minidist.autograd.flash import (DEFAULT_BLOCK, AttnDropout, block_pairs, kernels_ok,
                                     merge_partials, partial_attention)
from minidist.autograd.function import Function
from minidist.backend import is_half, matmul, xp_of

SPLITS = ("zigzag", "naive")
KV_TAG, DKV_TAG = 16, 17        # point-to-point tags of the ring's two kinds of message


def layout(T, n, rank, split="zigzag"):
    """The pieces [(start, length), ...] of the whole sequence (length T) that `rank` of `n`
    holds, in the order its local sequence concatenates them."""
    if split == "naive":
        L = T // n
        return [(rank * L, L)]
    L = T // (2 * n)
    return [(rank * L, L), ((2 * n - 1 - rank) * L, L)]


def positions(T, n, rank, split="zigzag"):
    """Global positions of this rank's tokens, (Tl,) int64 on the host."""
    return np.concatenate([np.arange(s, s + L) for s, L in layout(T, n, rank, split)])


def check_split(T, n, split):
    """A sentence saying why T does not split over n ranks, or None."""
    parts = 2 * n if split == "zigzag" else n
    if T % parts:
        return (f"--block-size {T} does not split into {parts} equal chunks for --cp {n} "
                f"--cp-split {split}: choose a multiple of {parts}")
    return None


def ring_bytes(S, n, recompute=False):
    """Bytes one rank sends per attention layer and micro-batch, forward + backward, where S
    is the bytes of its k (or v): blocks 2S(N-1) forward and again backward, accumulators
    2SN backward; (6N - 4) S. `recompute`: the forward runs once more inside backward
    (--ckpt-activations), + 2S(N-1): (8N - 6) S."""
    forward = 2 * S * (n - 1)
    return forward * (2 if recompute else 1) + 2 * S * (n - 1) + 2 * S * n


def _pairs(q_pieces, k_pieces):
    """(q offset, q start, q len, k offset, k start, k len) of every pair of pieces in
    which some query sees some key (the others are skipped whole: causal)."""
    qo = 0
    for qs, ql in q_pieces:
        ko = 0
        for ks, kl in k_pieces:
            if ks <= qs + ql - 1:
                yield qo, qs, ql, ko, ks, kl
            ko += kl
        qo += ql


def causal_tiles(T, n, split, block):
    """Tiles (block x block of query x key) each rank computes over a whole ring pass:
    a list of n counts. Naive grows with the rank; zig-zag is flat."""
    counts = []
    for r in range(n):
        mine = layout(T, n, r, split)
        counts.append(sum(sum(1 for _ in block_pairs(ql, block, True, qs, ks, kl))
                          for src in range(n)
                          for _, qs, ql, _, ks, kl in _pairs(mine, layout(T, n, src, split))))
    return counts


def tile_run(*arrays):
    """How the ring's tiles run: cuda_kernels.launch where the flash kernels take these
    arrays (flash.kernels_ok: cupy, MINIDIST_CUDA_NEW_KERNELS=1, head size <= 128), else
    None: flash.py's xp code, tile by tile."""
    return launch if kernels_ok(*arrays) else None


def attend_block(q, q_pieces, kv, k_pieces, y, lse, block, dropout=None, run=None):
    """Merge the attention of queries q (B, nh, Tl, hs) over one held key/value block
    kv (2, B, nkv, Tl, hs) into the running (y, lse), in place (grouped-query, nkv < nh:
    q, y and lse seen as (B, nkv, nh / nkv, ...) and the block broadcast over each group,
    never repeated, where no kernels run); dropout: flash.py's
    AttnDropout over the whole (B, nh, T, T) weights (positions global), or None.
    run: executes the flash kernels' plans, one launch per pair of pieces (ring_forward
    passes tile_run's; a test the CPU harness), or None: partial_attention."""
    xp = xp_of(q)
    drop = None if run is None or dropout is None else dropout.kernel_args(xp)
    nh, nkv = q.shape[1], kv.shape[2]
    if run is None and nkv != nh:     # grouped-query: the q heads as (nkv, nh / nkv), k and
        q, y, lse = (grouped(a, nkv) for a in (q, y, lse))   # v broadcast over the group
        kv = kv[:, :, :, None]
    elif nkv != nh:                   # the kernels take nh heads: the block repeated
        kv = repeat_block(kv, nh)
    for qo, qs, ql, ko, ks, kl in _pairs(q_pieces, k_pieces):
        rows, cols = slice(qo, qo + ql), slice(ko, ko + kl)
        q_i, k_j, v_j = q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :]
        if run is None:
            y_b, lse_b = partial_attention(q_i, k_j, v_j, qs, ks, block, dropout=dropout)
        else:
            y_b, lse_b = flash_partial(xp, run, q_i, k_j, v_j, qs, ks, drop)
        y[..., rows, :], lse[..., rows] = merge_partials(y[..., rows, :], lse[..., rows],
                                                         y_b, lse_b)


def _kernels_backward(g, q, q_pieces, kv, k_pieces, lse, D, dq, dkv, dropout, run):
    """attend_block_backward by the flash kernels: per pair of pieces a dk/dv launch and a
    dq launch, each adding into dq and dkv in place (so they must be contiguous; q, g, lse
    and D are best so too, or each launch's plan copies them)."""
    xp = xp_of(q)
    drop = None if dropout is None else dropout.kernel_args(xp)
    for qo, qs, ql, ko, ks, kl in _pairs(q_pieces, k_pieces):
        flash_piece_backward(xp, run, g, q, kv[0], kv[1], lse, D, (dq, dkv[0], dkv[1]),
                             (qo, qs, ql), (ko, ks, kl), drop)


def attend_block_backward(g, q, q_pieces, kv, k_pieces, lse, D, dq, dkv, block, dropout=None,
                          run=None, matmul=matmul):
    """Gradients of one held block: dq (B, nh, Tl, hs) and the block's accumulator dkv
    (2, B, nkv, Tl, hs), added to in place (grouped-query, nkv < nh, in the xp code: q, g,
    dq, lse and D seen as (B, nkv, nh / nkv, ...), each tile's dk and dv summed over the
    group (group_sum) straight into dkv: nothing nh heads wide but a tile; the kernels take
    kv and dkv nh heads wide). Each tile's probabilities (and dropout's
    Z = keep / (1 - p)) are recomputed, as flash.py's backward does; D = rowsum(g * y).
    run: executes the flash kernels' plans (_kernels_backward), or None: the xp code below.
    matmul: the xp code's products (backend.matmul; another gives products of another
    dtype, as tests/test_context_parallel.py's bfloat16 GEMM does)."""
    if run is not None:
        _kernels_backward(g, q, q_pieces, kv, k_pieces, lse, D, dq, dkv, dropout, run)
        return
    xp = xp_of(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    nh, nkv = q.shape[1], kv.shape[2]
    fold = (lambda a: a) if nkv == nh else group_sum
    if nkv != nh:            # grouped-query: the q heads as (nkv, nh / nkv), k and v (and
        q, g, dq, lse, D = (grouped(a, nkv) for a in (q, g, dq, lse, D))   # dk, dv) with
        kv, dkv = kv[:, :, :, None], dkv[:, :, :, None]   # a group axis of 1 broadcast over it
    for qo, qs, ql, ko, ks, kl in _pairs(q_pieces, k_pieces):
        for r0, r1, c0, c1, masked in block_pairs(ql, block, True, qs, ks, kl):
            rows, cols = slice(qo + r0, qo + r1), slice(ko + c0, ko + c1)
            q_i, g_i, k_j, v_j = q[..., rows, :], g[..., rows, :], kv[0][..., cols, :], \
                kv[1][..., cols, :]
            s = matmul(q_i * scale, xp.swapaxes(k_j, -1, -2))         # (B, nh, bq, bk)
            if masked:                                                # key after query
                later = xp.arange(ks + c0, ks + c1)[None, :] > xp.arange(qs + r0, qs + r1)[:, None]
                # a bfloat16 s stays bfloat16: numpy's where would make it float64
                # beside a Python float, CuPy's (no bfloat16 loop) float32
                s = xp.where(later, s.dtype.type(-math.inf), s).astype(s.dtype, copy=False)
            p = xp.exp(s - lse[..., rows, None])                      # forward's softmax
            dpz = matmul(g_i, xp.swapaxes(v_j, -1, -2))               # d(p z) = g v^T
            if dropout is not None:                                   # y = (p z) v
                z = dropout.tile(qs + r0, qs + r1, ks + c0, ks + c1, xp, p.dtype)
                z = z.reshape(p.shape)                                # (grouped: as p)
                dpz *= z
                p_used = p * z
            else:
                p_used = p
            dkv[1][..., cols, :] += fold(matmul(xp.swapaxes(p_used, -1, -2), g_i))  # dv =
            ds = p * (dpz - D[..., rows, None]) * scale               # (p z)^T g
            dq[..., rows, :] += matmul(ds, k_j)                       # dq = ds k
            dkv[0][..., cols, :] += fold(matmul(xp.swapaxes(ds, -1, -2), q_i))  # dk = ds^T q


def grouped(a, nkv):
    """(B, nh, ...) -> its (B, nkv, nh / nkv, ...) view: q head j as (j // (nh / nkv), j %
    (nh / nkv)), the kv head it reads first (repeat_kv's order)."""
    return a.reshape(a.shape[:1] + (nkv, a.shape[1] // nkv) + a.shape[2:])


def group_sum(a):
    """A tile's gradients of k or v for each q head, (B, nkv, nh / nkv, bk, hs) -> summed
    over the group, (B, nkv, 1, bk, hs): what each kv head gets (in float32 for 16-bit
    dtypes, as repeat_kv's backward sums)."""
    total = a.sum(axis=2, keepdims=True, dtype="float32" if is_half(a.dtype) else None)
    return total.astype(a.dtype, copy=False)


def repeat_block(kv, n_head):
    """A held key/value block (2, B, nkv, Tl, hs) -> (2, B, nh, Tl, hs), each kv head
    repeated nh / nkv times in a row, as repeat_kv (minidist/autograd/llama_ops.py) does
    (q head j reads kv head j // (nh / nkv)); nkv = nh: the block itself."""
    nkv = kv.shape[2]
    return kv if nkv == n_head else xp_of(kv).repeat(kv, n_head // nkv, axis=2)


def sum_groups(d_full, d_kv):
    """repeat_block's backward: add the gradients (2, B, nh, Tl, hs) of the repeated heads,
    summed over each kv head's nh / nkv copies (in float32 for 16-bit dtypes, as repeat_kv's
    backward), into the block's accumulator d_kv (2, B, nkv, Tl, hs)."""
    two, B, nh, Tl, hs = d_full.shape
    nkv = d_kv.shape[2]
    part = d_full.reshape(two, B, nkv, nh // nkv, Tl, hs)
    total = part.sum(axis=3, dtype="float32") if is_half(part.dtype) else part.sum(axis=3)
    d_kv += total.astype(d_kv.dtype, copy=False)


def ring_forward(group, layouts, q, kv, block=DEFAULT_BLOCK, dropout=None):
    """Causal attention of this rank's queries (B, nh, Tl, hs) over every rank's keys/values
    kv (2, B, nkv, Tl, hs), which travel as nkv heads (attend_block: grouped, not repeated,
    but for the kernels). layouts[r]: rank r's pieces. Returns y (B, nh, Tl, hs) and lse
    (B, nh, Tl)."""
    xp = xp_of(q)
    n, r = group.size, group.rank
    right, left = (r + 1) % n, (r - 1) % n
    y = xp.zeros(q.shape, q.dtype)
    lse = xp.full(q.shape[:-1], -math.inf, xp.result_type(q.dtype, xp.float32))
    run = tile_run(q, kv)                         # the flash kernels, or None: xp tiles
    cur, nxt = kv, xp.empty_like(kv)
    for step in range(n):
        src = (r - step) % n                      # whose keys/values this rank holds now
        if step < n - 1:                          # posted before the compute: overlap
            recv = group.recv(nxt, left, async_op=True, tag=KV_TAG)
            send = group.send(cur, right, async_op=True, tag=KV_TAG)
        attend_block(q, layouts[r], cur, layouts[src], y, lse, block, dropout, run)
        if step < n - 1:
            send.wait()
            recv.wait()
            cur, nxt = nxt, cur
    return y, lse


def ring_backward(group, layouts, g, q, kv, y, lse, block=DEFAULT_BLOCK, dropout=None):
    """dq (B, nh, Tl, hs) and dkv (2, B, nkv, Tl, hs) of this rank's queries and keys/values.
    Each block travels with its accumulator; the accumulator's last hop brings it home. Under
    grouped-query attention (nkv < nh) both travel as nkv heads, and each held block's
    gradients are summed over each group of q heads into the accumulator tile by tile
    (attend_block_backward; the kernels: computed for the nh repeated heads into one
    scratch of nh heads and summed in, sum_groups)."""
    xp = xp_of(q)
    n, r = group.size, group.rank
    right, left = (r + 1) % n, (r - 1) % n
    D = (g * y).sum(axis=-1, dtype=lse.dtype)         # (B, nh, Tl): in float32 at least
    run = tile_run(q, kv, g, y)
    if run is not None:               # what the kernels read, made so once, not per block
        q, g = xp.ascontiguousarray(q), xp.ascontiguousarray(g)
    else:                             # the xp tiles compute in q's dtype: rounded once
        D = D.astype(q.dtype, copy=False)
    dq = xp.zeros(q.shape, q.dtype)
    cur, nxt = kv, xp.empty_like(kv)
    d_cur, d_nxt = xp.zeros_like(kv), xp.empty_like(kv)
    nh = q.shape[1]
    d_full = None if kv.shape[2] == nh or run is None else \
        xp.empty(kv.shape[:2] + q.shape[1:], kv.dtype)
    for step in range(n):
        src = (r - step) % n
        if step < n - 1:
            recv = group.recv(nxt, left, async_op=True, tag=KV_TAG)
            send = group.send(cur, right, async_op=True, tag=KV_TAG)
        if d_full is None:                    # into the accumulator itself, nkv heads wide
            attend_block_backward(g, q, layouts[r], cur, layouts[src], lse, D, dq, d_cur,
                                  block, dropout, run)
        else:                                 # kernels: nh heads' gradients, summed in
            d_full.fill(0)
            attend_block_backward(g, q, layouts[r], repeat_block(cur, nh), layouts[src], lse,
                                  D, dq, d_full, block, dropout, run)
            sum_groups(d_full, d_cur)
        d_recv = group.recv(d_nxt, left, async_op=True, tag=DKV_TAG)  # block src's dk, dv
        d_send = group.send(d_cur, right, async_op=True, tag=DKV_TAG)  # on to the next rank
        if step < n - 1:
            send.wait()
            recv.wait()
            cur, nxt = nxt, cur
        d_send.wait()
        d_recv.wait()
        d_cur, d_nxt = d_nxt, d_cur
    return dq, d_cur                          # d_cur: this rank's own block, home again


def ring_dropout(p, rng, q, layouts):
    """flash.py's AttnDropout over the whole sequence's (B, nh, T, T) weights, T the sum of
    every rank's pieces (a tile's numbers are found by global positions), or None."""
    T = sum(length for pieces in layouts for _, length in pieces)
    return AttnDropout(p, rng, q.shape[:2] + (T, T)) if p > 0 else None


def split_gqa(qkv, n_head, n_kv_head):
    """The fused (B, Tl, (nh + 2 nkv) hs) -> q (B, nh, Tl, hs), k and v (B, nkv, Tl, hs)
    views (with nkv = nh heads_view's, of GPT-2's (B, Tl, 3C))."""
    B, T, W = qkv.shape
    hs = W // (n_head + 2 * n_kv_head)
    Q, K = n_head * hs, n_kv_head * hs
    return tuple(qkv[..., lo:lo + w].reshape(B, T, w // hs, hs).transpose(0, 2, 1, 3)
                 for lo, w in ((0, Q), (Q, K), (Q + K, K)))


class RingSelfAttention(Function):
    """GPT-2's fused qkv (B, Tl, 3C) of this rank's tokens -> y (B, Tl, C), causal over the
    whole sequence held by the ring's ranks. `ring`: a RingContext (minidist/cp/context.py)
    in a forward (its group, block and the layouts of this sequence); dropout_p > 0: on the
    attention weights, each tile's numbers from `rng` (a DropoutSite) by global position.
    n_kv_head (grouped-query attention; None: nh): qkv is (B, Tl, (nh + 2 nkv) hs), and the
    k/v blocks and their accumulators travel as nkv heads (ring_forward, ring_backward); the
    gradient of each k and v head is the sum over the nh / nkv q heads that read it, as
    repeat_kv's backward gives it."""

    @staticmethod
    def forward(ctx, qkv, n_head, ring, dropout_p=0.0, rng=None, n_kv_head=None):
        xp, nkv = xp_of(qkv), n_kv_head or n_head
        q, k, v = split_gqa(qkv, n_head, nkv)
        B, Tl, _ = qkv.shape
        y = xp.empty((B, Tl) + (q.shape[1] * q.shape[3],), qkv.dtype)   # (B, Tl, C)
        kv = xp.ascontiguousarray(xp.stack([k, v]))                # (2, B, nkv, Tl, hs)
        ctx.dropout = ring_dropout(dropout_p, rng, q, ring.layouts)
        out, lse = ring_forward(ring.group, ring.layouts, q, kv, ring.block, ctx.dropout)
        per_head(y, n_head)[...] = out
        ctx.save_for_backward(qkv, y, lse)
        ctx.n_head, ctx.n_kv_head, ctx.group, ctx.layouts, ctx.block = n_head, nkv, \
            ring.group, ring.layouts, ring.block
        return y

    @staticmethod
    def backward(ctx, grad):
        qkv, y, lse = ctx.saved
        nh, nkv = ctx.n_head, ctx.n_kv_head
        q, k, v = split_gqa(qkv, nh, nkv)                           # views
        xp = xp_of(q)
        kv = xp.ascontiguousarray(xp.stack([k, v]))
        dq, dkv = ring_backward(ctx.group, ctx.layouts, per_head(grad, nh), q, kv,
                                per_head(y, nh), lse, ctx.block, ctx.dropout)
        B, Tl, _ = qkv.shape
        dqkv = xp.concatenate([d.transpose(0, 2, 1, 3).reshape(B, Tl, -1)   # q | k | v
                               for d in (dq, dkv[0], dkv[1])], axis=-1)
        return dqkv, None, None, None, None, None                # (B, Tl, (nh + 2 nkv) hs)
