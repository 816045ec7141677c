"""Ring attention's pieces (minidist/cp/ring.py) by the flash kernels of
minidist/autograd/cuda_source_flash.py, RUN on the CPU (tests/cuda_cpu.py) against flash.py's
and ring.py's xp code in float64: the forward of one pair of pieces (partial_attention's:
queries at global positions q_start.., keys at k_start..) and the backward of one held block
(attend_block_backward's: dq and the block's dk, dv added into), in float16, bfloat16, float32
and float64, both thread orders, for the pairs a ring makes (q after k; q before k, every row
masked: y 0, lse -inf; the diagonal; Tq != Tk; rows that see no key; lengths not multiples of
a tile; every (rank, held block) of zig-zag and naive rings), with dropout on the weights
(every keep decision the host's, exactly); the whole ring simulated in one process with the
kernels, forward and backward, against tiled attention; broken variants that only offset
pieces expose; and, on a GPU (-m gpu), the kernels on against off. The plans' argument types
and PTX widths: tests/test_cuda_flash_cpu.py.
Run: python -m pytest -q tests/test_cuda_ring_cpu.py   (skips without a C++ compiler)
"""
import functools
import math

import numpy as np
import pytest

import cuda_cpu
from minidist import backend
from minidist.autograd import Tensor, cuda_kernels as ck, cuda_kernels_new as ckn, flash
from minidist.autograd import cuda_source as cs
from minidist.autograd.cuda_source_flash import FLASH
from minidist.autograd.dropout_keys import DropoutKeys, DropoutSite
from minidist.cp import ring
from test_cuda_kernels_cpu import DTYPES, ORDERS, close, f64, failing_orders, nth_replaced, rand

pytestmark = pytest.mark.skipif(cuda_cpu.reason_unavailable() is not None,
                                reason=str(cuda_cpu.reason_unavailable()))

B, NH, HS = 2, 3, 8
PIECES = {   # name -> (Tq, q_start, Tk, k_start): one pair of pieces, global positions
    "q after k": (13, 24, 11, 3),                   # every key before every query: no mask
    "q before k": (9, 0, 10, 20),                   # every key after every query: all masked
    "diagonal": (21, 16, 21, 16),
    "Tq != Tk across the diagonal": (19, 10, 23, 5),
    "rows that see no key": (17, 3, 12, 9),         # queries 3..8 come before key 9
    "one query": (1, 30, 25, 2),
    "the last key seen opens a tile": (5, 12, 20, 0),   # query 16 sees key 16: 16 = 2 x 8
}
RINGS = [(2, "zigzag", 44), (3, "naive", 39), (4, "zigzag", 40)]   # (n, split, T)


def harness(src=None, order="low"):
    """The CPU harness as the glue's `run`: each plan on numpy arrays (this source, order)."""
    return functools.partial(cuda_cpu.run, source=src, order=order)


def attn_dropout(p, T, heads=NH):
    """AttnDropout p over (B, heads, T, T) weights, keyed numbers of a tensor-parallel rank's
    site (heads 3..5 of 6), batch rows 5 and 2, step 3, drawn after the keys moved on to
    step 4 (the kernels read the step on the device: counter 4, lag 1); None for p 0."""
    if not p:
        return None
    site = DropoutSite(DropoutKeys(11), "transformer.h.0.attn.attn_dropout", axis=1, parts=2,
                       index=1)
    for _ in range(3):
        site.keys.next_step()
    with site.keys.rows_of([5, 2]):
        drop = flash.AttnDropout(p, site, (B, heads, T, T))
    site.keys.next_step()
    return drop


def kernel_args(drop):
    """The kernels' dropout arguments (AttnDropout.kernel_args on numpy), or None."""
    return None if drop is None else drop.kernel_args(np)


# ---- forward: one pair of pieces -----------------------------------------------------------

def check_partial(dtype, piece, src=None, order="low", p=0.0):
    """flash_partial (one flash_fwd launch) = partial_attention's xp code in float64."""
    Tq, qs, Tk, ks = piece
    q = rand(dtype, B, NH, Tq, HS, seed=0)
    k, v = rand(dtype, B, NH, Tk, HS, seed=1), rand(dtype, B, NH, Tk, HS, seed=2)
    drop = attn_dropout(p, max(qs + Tq, ks + Tk))
    y, lse = ckn.flash_partial(np, harness(src, order), q, k, v, qs, ks, kernel_args(drop))
    y_want, lse_want = flash.partial_attention(f64(q), f64(k), f64(v), qs, ks, 5,
                                               dropout=drop)
    assert y.dtype == q.dtype and lse.dtype == ck.acc_dtype(q.dtype)
    seen = np.isfinite(lse_want)
    assert np.array_equal(np.isfinite(lse), seen) and (lse[~seen] == -np.inf).all(), \
        "lse -inf exactly for the rows that see no key"
    assert not f64(y)[~seen].any(), "y 0 where no key is seen"
    close(y, y_want, dtype, f"flash_fwd y {piece}")
    close(lse[seen], lse_want[seen], ck.acc_dtype(dtype).name, f"flash_fwd lse {piece}")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_kernel_equals_partial_attention(dtype, order):
    for piece in PIECES.values():
        check_partial(dtype, piece, order=order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_partial_kernel_with_dropout_equals_partial_attention(dtype, order):
    for piece in PIECES.values():
        check_partial(dtype, piece, order=order, p=0.3)


@pytest.mark.parametrize("order", ORDERS)
def test_every_keep_decision_is_the_hosts(order):
    """With v and g the identity (key j -> unit vector j, query i -> unit vector i), the
    forward's y[i, j] = p_ij Z_ij / l_i and the backward's dv[j, i] = p_ij Z_ij: exactly 0
    where a weight was dropped. Both kernels' keeps at every visible (query, key) of an
    offset pair = AttnDropout.tile's on the host, bit for bit (its numbers are Philox's,
    tests/test_cuda_philox_cpu.py)."""
    Tq, qs, Tk, ks = PIECES["Tq != Tk across the diagonal"]
    T, hs = qs + Tq, 24
    drop = attn_dropout(0.3, T)
    q, k = rand("float64", B, NH, Tq, hs, seed=0), rand("float64", B, NH, Tk, hs, seed=1)
    v = np.broadcast_to(np.eye(Tk, hs), (B, NH, Tk, hs)).copy()
    g = np.broadcast_to(np.eye(Tq, hs), (B, NH, Tq, hs)).copy()
    run = harness(order=order)
    y, lse = ckn.flash_partial(np, run, q, k, v, qs, ks, kernel_args(drop))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(k)
    ckn.flash_piece_backward(np, run, g, q, k, v, lse, (g * y).sum(-1), (dq, dk, dv),
                             (0, qs, Tq), (0, ks, Tk), kernel_args(drop))
    visible = np.arange(ks, ks + Tk)[None, :] <= np.arange(qs, qs + Tq)[:, None]
    keep = drop.tile(qs, qs + Tq, ks, ks + Tk, np, np.float64) > 0      # (B, NH, Tq, Tk)
    fwd, bwd = y[..., :Tk] != 0, np.swapaxes(dv[..., :Tq], -1, -2) != 0
    assert np.array_equal(fwd & visible, keep & visible), "forward keeps"
    assert np.array_equal(bwd & visible, keep & visible), "backward keeps"
    assert 0.2 < 1 - (keep & visible).sum() / (visible.sum() * B * NH) < 0.4    # p = 0.3


# ---- backward: one held block of a ring ----------------------------------------------------

def check_block_backward(dtype, n, split, T, src=None, order="low", p=0.0):
    """attend_block_backward by the kernels (run: the CPU harness) = its xp code in float64
    for every (rank, held block) of a ring of n, adding into dq and dkv that already hold
    something, with the whole attention's lse and D."""
    q, k, v, g = (rand(dtype, B, NH, T, HS, seed=s) for s in range(4))
    drop = attn_dropout(p, T)
    y, lse = flash.partial_attention(f64(q), f64(k), f64(v), 0, 0, 5, dropout=drop)
    D = (f64(g) * y).sum(axis=-1)
    lays = [ring.layout(T, n, r, split) for r in range(n)]
    for r in range(n):
        pos = ring.positions(T, n, r, split)
        for held in range(n):
            sp = ring.positions(T, n, held, split)
            kv = np.stack([k[..., sp, :], v[..., sp, :]])
            dq = rand(dtype, B, NH, len(pos), HS, seed=10 + r)               # added into
            dkv = rand(dtype, 2, B, NH, len(sp), HS, seed=20 + held)
            dq_want, dkv_want = f64(dq), f64(dkv)
            ring.attend_block_backward(g[..., pos, :], q[..., pos, :], lays[r], kv,
                                       lays[held], lse[..., pos], D[..., pos], dq, dkv, 5,
                                       drop, harness(src, order))
            ring.attend_block_backward(f64(g[..., pos, :]), f64(q[..., pos, :]), lays[r],
                                       f64(kv), lays[held], lse[..., pos], D[..., pos],
                                       dq_want, dkv_want, 5, drop)
            what = f"{split} ring of {n}: rank {r} holding block {held}"
            close(dq, dq_want, dtype, f"dq, {what}")
            close(dkv[0], dkv_want[0], dtype, f"dk, {what}")
            close(dkv[1], dkv_want[1], dtype, f"dv, {what}")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_backward_kernels_equal_the_xp_code(dtype, order):
    for n, split, T in RINGS:
        check_block_backward(dtype, n, split, T, order=order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_block_backward_kernels_with_dropout_equal_the_xp_code(dtype, order):
    for n, split, T in RINGS[:2]:
        check_block_backward(dtype, n, split, T, order=order, p=0.3)


def check_piece_backward(dtype, piece, src=None, order="low"):
    """One pair of pieces at row offsets of whole arrays (queries rows 3.. of 30, keys rows
    5.. of 40): the kernels add its dq, dk, dv there and leave every other row alone, as
    the tile-by-tile xp code over the same pair does (rows that see no key: nothing)."""
    Tq, qs, Tk, ks = piece
    q, g, dq = (rand(dtype, B, NH, 30, HS, seed=s) for s in (0, 1, 2))
    k, v, dk, dv = (rand(dtype, B, NH, 40, HS, seed=s) for s in (3, 4, 5, 6))
    lse, D = np.abs(f64(q[..., 0])) + 2.0, f64(g[..., 1])       # any finite row statistics
    grads = (dq, dk, dv)
    want = [f64(a) for a in grads]
    ckn.flash_piece_backward(np, harness(src, order), g, q, k, v, lse, D, grads,
                             (3, qs, Tq), (5, ks, Tk))
    scale = 1.0 / math.sqrt(HS)
    for r0, r1, c0, c1, _ in flash.block_pairs(Tq, 4, True, qs, ks, Tk):
        rows, cols = slice(3 + r0, 3 + r1), slice(5 + c0, 5 + c1)
        s = f64(q[..., rows, :]) @ np.swapaxes(f64(k[..., cols, :]), -1, -2) * scale
        later = np.arange(ks + c0, ks + c1)[None, :] > np.arange(qs + r0, qs + r1)[:, None]
        p = np.where(later, 0.0, np.exp(s - lse[..., rows, None]))
        dp = f64(g[..., rows, :]) @ np.swapaxes(f64(v[..., cols, :]), -1, -2)
        ds = p * (dp - D[..., rows, None]) * scale
        want[0][..., rows, :] += ds @ f64(k[..., cols, :])
        want[1][..., cols, :] += np.swapaxes(ds, -1, -2) @ f64(q[..., rows, :])
        want[2][..., cols, :] += np.swapaxes(p, -1, -2) @ f64(g[..., rows, :])
    for name, a, b in zip(("dq", "dk", "dv"), grads, want):
        close(a, b, dtype, f"{name} of the pair {piece} at offsets")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_piece_backward_at_row_offsets(dtype, order):
    for piece in PIECES.values():
        check_piece_backward(dtype, piece, order=order)


# ---- the whole ring in one process ---------------------------------------------------------

def simulate_ring(q, k, v, g, n, split, drop, run):
    """One process playing n ranks, as tests/test_context_parallel.py's _simulate, forward
    and backward in ring order: at step s rank r holds block (r - s) mod n; each block's
    accumulator meets the ranks from its own on, as ring_backward passes it. `run`: the
    kernels' runner (None: the xp code); numpy or cupy arrays. Returns y, lse, dq, dk, dv
    in global order."""
    xp, T = backend.xp_of(q), q.shape[-2]
    lays = [ring.layout(T, n, r, split) for r in range(n)]
    pos = [xp.asarray(ring.positions(T, n, r, split)) for r in range(n)]
    acc = ck.acc_dtype(q.dtype)
    shape = [q.shape[:-2] + (len(p), q.shape[-1]) for p in pos]
    ys = [xp.zeros(sh, q.dtype) for sh in shape]
    lses = [xp.full(sh[:-1], -math.inf, acc) for sh in shape]
    kvs = [xp.ascontiguousarray(xp.stack([k[..., p, :], v[..., p, :]])) for p in pos]
    for step in range(n):
        for r in range(n):
            held = (r - step) % n
            ring.attend_block(q[..., pos[r], :], lays[r], kvs[held], lays[held], ys[r],
                              lses[r], 5, drop, run)
    Ds = [(g[..., p, :].astype(acc) * y.astype(acc)).sum(axis=-1) for p, y in zip(pos, ys)]
    dqs = [xp.zeros(y.shape, y.dtype) for y in ys]                   # contiguous, as the
    dkvs = [xp.zeros(kv.shape, kv.dtype) for kv in kvs]              # kernels add into them
    for step in range(n):
        for r in range(n):
            held = (r - step) % n
            ring.attend_block_backward(g[..., pos[r], :], q[..., pos[r], :], lays[r],
                                       kvs[held], lays[held], lses[r], Ds[r], dqs[r],
                                       dkvs[held], 5, drop, run)
    out = [xp.empty_like(q), xp.empty(q.shape[:-1], acc)] + [xp.empty_like(q) for _ in "qkv"]
    for p, y, lse, dq, dkv in zip(pos, ys, lses, dqs, dkvs):
        out[0][..., p, :], out[1][..., p], out[2][..., p, :] = y, lse, dq
        out[3][..., p, :], out[4][..., p, :] = dkv[0], dkv[1]
    return out


def tiled_reference(q, k, v, g, drop):
    """flash.py's tiled attention in float64 (tiles of 5), with drop's masks: y, lse, dq, dk,
    dv (lse is the undropped softmax's)."""
    ts = [Tensor(f64(a), requires_grad=True) for a in (q, k, v)]
    if drop is None:
        y = flash.tiled_attention(*ts, 5)
    else:
        with drop.site.keys.as_of(drop.state):                   # the forward's step, rows
            y = flash.tiled_attention(*ts, 5, drop.p, drop.site)
    (y * Tensor(f64(g))).sum().backward()
    _, lse = flash.partial_attention(*(f64(a) for a in (q, k, v)), 0, 0, 5)
    return [y.data, lse] + [t.grad for t in ts]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n,split,T,p", [(2, "zigzag", 28, 0.0), (4, "naive", 36, 0.0),
                                         (3, "zigzag", 42, 0.3)])
def test_simulated_ring_with_kernels_equals_tiled_attention(n, split, T, p, dtype, order):
    """Every block of the ring by the kernels (forward merged by merge_partials, backward
    added into the travelling accumulators) = tiled attention over the whole sequence:
    y, lse, dq, dk, dv (float64 1e-12, float32 1e-5)."""
    q, k, v, g = (rand(dtype, B, NH, T, HS, seed=s) for s in range(4))
    drop = attn_dropout(p, T)
    got = simulate_ring(q, k, v, g, n, split, drop, harness(order=order))
    want = tiled_reference(q, k, v, g, drop)
    for name, a, b in zip(("y", "lse", "dq", "dk", "dv"), got, want):
        close(a, b, dtype, f"{name}: {split} ring of {n}, dropout {p}")


@pytest.mark.parametrize("nkv", [1, 2])
def test_grouped_query_blocks_by_the_kernels_equal_the_xp_code(nkv):
    """Grouped-query attention (4 q heads, nkv k/v heads) as ring.py hands it to the kernels
    on a GPU (attend_block repeats the block itself; ring_backward sums an nh-wide scratch
    into the accumulator, sum_groups) = the xp code's grouped path (group_sum), which
    tests/test_context_parallel.py holds to repeat_kv: zig-zag ring of 2, dropout 0.3."""
    nh, T, n = 4, 28, 2
    q, g, k, v = (rand("float64", B, h, T, HS, seed=s) for s, h in enumerate((nh, nh, nkv, nkv)))
    drop, run = attn_dropout(0.3, T, nh), harness()
    lays, at = ([f(T, n, r, "zigzag") for r in range(n)] for f in (ring.layout, ring.positions))
    kvs = [np.ascontiguousarray(np.stack([k[..., p, :], v[..., p, :]])) for p in at]
    for r in range(n):
        qr, gr = np.ascontiguousarray(q[..., at[r], :]), np.ascontiguousarray(g[..., at[r], :])
        got, want = ([np.zeros(qr.shape), np.full(qr.shape[:-1], -np.inf)] for _ in "ab")
        for held in range(n):
            ring.attend_block(qr, lays[r], kvs[held], lays[held], *got, 5, drop, run)
            ring.attend_block(qr, lays[r], kvs[held], lays[held], *want, 5, drop)
        for name, a, b in zip(("y", "lse"), got, want):
            close(a, b, "float64", f"{name}, rank {r}")
        D = (gr * want[0]).sum(axis=-1)                 # the whole attention's, as ring.py's
        for held, kv in enumerate(kvs):
            dq, dq_want, dkv, dkv_want = (np.zeros(a.shape) for a in (qr, qr, kv, kv))
            d_full = np.zeros(kv.shape[:2] + (nh,) + kv.shape[3:])
            ring.attend_block_backward(gr, qr, lays[r], ring.repeat_block(kv, nh), lays[held],
                                       want[1], D, dq, d_full, 5, drop, run)
            ring.sum_groups(d_full, dkv)
            ring.attend_block_backward(gr, qr, lays[r], kv, lays[held], want[1], D, dq_want,
                                       dkv_want, 5, drop)
            for name, a, b in (("dq", dq, dq_want), ("dkv", dkv, dkv_want)):
                close(a, b, "float64", f"{name}, rank {r} holding block {held}")


# ---- broken variants: defects a whole sequence (offsets 0, Tq = Tk) cannot show ------------

def check_ring_pieces(src=None, order="low"):
    """Every pair in PIECES forward and backward, every held block of a zig-zag ring of 3
    (pieces of 9: two backward tiles), with dropout, float32."""
    for piece in PIECES.values():
        check_partial("float32", piece, src, order, p=0.3)
        check_piece_backward("float32", piece, src, order)
    check_block_backward("float32", 3, "zigzag", 54, src, order, p=0.3)


BROKEN = {   # name -> (old, new, occurrence) in the flash kernels' text
    "flash_fwd's mask ignores the key offset": ("k_start + c0 + c > q_start", "c0 + c > q_start",
                                                0),
    "flash_fwd's causal offset off by one": ("k_start + c0 + c > q_start + r0 + r",
                                             "k_start + c0 + c > q_start + r0 + r + 1", 0),
    "keys_seen one short": ("q_start + r_last - k_start + 1", "q_start + r_last - k_start", 0),
    "flash_fwd: a row that sees no key divides by l = 0": ("lr == (A)0 ? (A)0 : acc[e] / lr",
                                                          "acc[e] / lr", 0),
    # without it, a tile no key reaches reads l before any barrier orders its initialisation
    "flash_fwd's early exit for a tile that sees no key dropped": ("if (c_end <= 0) {",
                                                                   "if (false) {", 0),
    "flash_fwd's dropout at local positions": ("dropout_z(blockIdx.y, q_start + i, k_start + j",
                                               "dropout_z(blockIdx.y, i, j", 0),
    "bwd_tile's mask ignores the offsets": ("if (k_start + j <= q_start + i && i < Tq",
                                            "if (j <= i && i < Tq", 0),
    "bwd_tile's dropout at local positions": ("dropout_z(bh, q_start + i, k_start + j",
                                              "dropout_z(bh, i, j", 0),
    "flash_bwd_dkdv starts at the key's local row": ("r_first = k_start + c0 - q_start",
                                                     "r_first = c0", 0),
    "flash_bwd_dkdv's keys at row 0, not ko": ("kh = (blockIdx.y * Lk + ko) * hs",
                                               "kh = (blockIdx.y * Lk) * hs", 0),
    "flash_bwd_dq's lse at row 0, not qo": ("lse + blockIdx.y * Lq + qo, D",
                                            "lse + blockIdx.y * Lq, D", 0),
    "flash_bwd_dq writes instead of adding": ("add ? ld(dq, at) + dqs[e] : dqs[e]", "dqs[e]", 0),
    "flash_bwd_dkdv adds dv twice": ("add ? ld(dv, at) + dvs[e]",
                                     "add ? 2 * ld(dv, at) + dvs[e]", 0),
    "the dropout's row length is the piece's": ("* dT + i) * dT + j", "* dT + i) * (dT - 1) + j",
                                                0),
    "flash_bwd_dkdv's barrier after bwd_tile dropped": (
        "dscale);\n        __syncthreads();\n        for (int e = threadIdx.x; e < BT * hs; "
        "e += blockDim.x) {   // dv",
        "dscale);\n        for (int e = threadIdx.x; e < BT * hs; e += blockDim.x) {   // dv",
        0),
}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_ring_kernel_fails(name):
    """Each defect fails in at least one thread order; most are invisible to whole
    sequences (tests/test_cuda_flash_cpu.py), where every offset and start is 0."""
    old, new, n = BROKEN[name]
    src = cs.source("float32", "flash").replace(FLASH, nth_replaced(FLASH, old, new, n))
    failed = failing_orders(check_ring_pieces, src)
    assert failed, f"{name}: the broken kernel passed in both orders"


# ---- on a GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_ring_kernels_on_a_gpu_equal_the_xp_tiles(device, dtype, monkeypatch):
    """For the GPU session, first: the simulated ring on cupy arrays with its blocks by the
    flash kernels (MINIDIST_CUDA_NEW_KERNELS=1: ring.tile_run gives cuda_kernels.launch)
    against the same ring by the xp tiles on cupy (=0) and tiled attention in float64 on
    the CPU, zig-zag with dropout 0.3 and naive without; and partial_attention of a pair
    that sees no key (y 0, lse -inf)
    (python -m pytest -m gpu --device cuda tests/test_cuda_ring_cpu.py)."""
    if device != "cuda":
        pytest.skip("needs --device cuda")
    import cupy
    for n, split, T, p in ((4, "zigzag", 88, 0.3), (3, "naive", 75, 0.0)):
        host = [rand(dtype, B, NH, T, 64, seed=s) for s in range(4)]
        q, k, v, g = (cupy.asarray(a) for a in host)
        drop = attn_dropout(p, T)
        monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "1")
        run = ring.tile_run(q, k)
        assert run is ck.launch
        on = simulate_ring(q, k, v, g, n, split, drop, run)
        monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "0")
        assert ring.tile_run(q, k) is None
        off = simulate_ring(q, k, v, g, n, split, drop, None)
        want = tiled_reference(*host, drop)
        for name, a, b, c in zip(("y", "lse", "dq", "dk", "dv"), on, off, want):
            close(cupy.asnumpy(a), c, dtype, f"{name}, kernels on: {split} ring of {n}")
            close(cupy.asnumpy(b), c, dtype, f"{name}, kernels off: {split} ring of {n}")
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "1")
    q, k = cupy.asarray(rand(dtype, B, NH, 9, 64)), cupy.asarray(rand(dtype, B, NH, 10, 64))
    y, lse = flash.partial_attention(q, k, k, 0, 20)                  # every key after
    assert not cupy.asnumpy(y).astype(np.float64).any() and (cupy.asnumpy(lse) == -np.inf).all()
