"""Launch plans for the CUDA kernels proven on the CPU only (never run on a GPU yet): tiled
(flash) attention (cuda_source_flash.py), bias+GELU, residual+layer norm and the
cross-entropy over a padded vocabulary (cuda_source_fusions.py), and dropout's Philox
numbers (cuda_source_philox.py).

As in cuda_kernels.py, each `<kernel>_launch(xp, ...)` is a pure function that allocates the
outputs with `xp` and returns a `Launch`; tests/test_cuda_flash_cpu.py and
tests/test_cuda_fusions_cpu.py run every plan on numpy arrays through the CPU harness
(tests/cuda_cpu.py) and check each argument against the kernel's declared parameters.
The model reaches them only on cupy arrays with MINIDIST_CUDA_NEW_KERNELS=1 (`use_new`):
flash.py's tiled attention and partial_attention, ring attention's blocks
(minidist/cp/ring.py: `flash_partial`, `flash_piece_backward`) and fusions.py's ops, through
the glue functions here that take `xp` and `run` (cupy and `launch` there; numpy and the CPU
harness in tests/test_fusions.py and tests/test_cuda_ring_cpu.py).
A GPU session confirms them (python -m pytest -m gpu --device cuda
tests/test_cuda_ring_cpu.py tests/test_cuda_flash_cpu.py tests/test_fusions.py), then turns
them on.
"""
import math
import os
import sys

import numpy as np

from minidist.autograd.cuda_kernels import (Launch, acc_dtype, flat_grid, kernels_on, launch,
                                            ln_bwd_wb_launch, row_grid, use)
from minidist.autograd.cuda_source_flash import HS_MAX, THREADS, tiles


def new_kernels_on():
    """MINIDIST_CUDA_NEW_KERNELS=1: the kernels proven on the CPU only (not yet run on a
    GPU) are off by default."""
    return os.environ.get("MINIDIST_CUDA_NEW_KERNELS", "0") == "1"


def use_new(*arrays):
    """use(...) and the new kernels switched on (new_kernels_on)."""
    return use(*arrays) and new_kernels_on()


def new_on(xp):
    """The new kernels are on for arrays of the module xp: cupy, kernels_on() and
    new_kernels_on() (dropout's integer counters, which use() does not take: it asks for a
    floating dtype)."""
    return xp.__name__ == "cupy" and kernels_on() and new_kernels_on()


# ---- tiled (flash) attention ----------------------------------------------------------------

def flash_ok(q):
    """The flash kernels take head sizes up to HS_MAX and up to 65535 batch x heads."""
    return q.shape[-1] <= HS_MAX and q.size // max(q.shape[-1] * q.shape[-2], 1) <= 65535


def _heads(xp, a):
    """(..., T, hs) -> (BH, T, hs) contiguous (a copy only if a is strided)."""
    return xp.ascontiguousarray(a).reshape(-1, a.shape[-2], a.shape[-1])


def _check_kv(q, k, v):
    """The flash kernels read k and v at q's batch x heads and head size (a grouped-query
    k, v must be repeated first: llama_ops.repeat_kv): anything else would be read past."""
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"flash kernels: keys and values {k.shape}, {v.shape} do not match "
                         f"queries {q.shape} (batch x heads, T, head size)")


def dropout_args(xp, acc, dropout):
    """The flash kernels' last ten arguments: (drows, nh, h0, dT, dcount, dlag, dk0, dk1,
    dprob, dscale) from `dropout` = (rows (B,) global batch rows, nh heads here, h0 the first
    of them in the whole model, T the whole sequence (positions are global), (count, lag):
    the step, count[0] - lag, read on the device, (k0, k1) the site's Philox key, p)
    (flash.py's AttnDropout.kernel_args), or none drawn (None: dprob 0; drows and dcount one
    unused value)."""
    if dropout is None:
        unused = xp.zeros(1, xp.int64)
        return (unused, np.int64(1), np.int64(0), np.int64(0), unused) + tuple(
            np.int64(0) for _ in range(3)) + (np.float32(0), acc.type(1))
    rows, nh, h0, T, (count, lag), key, p = dropout
    rows = xp.ascontiguousarray(xp.asarray(rows), dtype=xp.int64)
    count = xp.ascontiguousarray(count, dtype=xp.int64)
    return (rows, np.int64(nh), np.int64(h0), np.int64(T), count) + tuple(
        np.int64(v) for v in (lag, key[0], key[1])) + (np.float32(p), acc.type(1.0 / (1.0 - p)))


def flash_fwd_launch(xp, q, k, v, dropout=None, q_start=0, k_start=0):
    """The plan and (y (BH, Tq, hs), lse (BH, Tq)) of causal attention of queries q
    (..., Tq, hs) at global positions q_start.. over keys and values (..., Tk, hs) at
    k_start.. (a whole sequence: both 0, Tq = Tk); dropout: dropout_args' tuple, or None."""
    q, k, v = _heads(xp, q), _heads(xp, k), _heads(xp, v)
    _check_kv(q, k, v)
    BH, Tq, hs = q.shape
    if hs > HS_MAX or BH > 65535:
        raise ValueError(f"flash kernels take head sizes up to {HS_MAX} and up to 65535 "
                         f"batch x heads (grid.y), not {hs} and {BH}")
    acc = acc_dtype(q.dtype)
    ft, _ = tiles(acc.itemsize)
    y, lse = xp.empty_like(q), xp.empty((BH, Tq), acc)
    args = (q, k, v, y, lse, np.int64(Tq), np.int64(q_start), np.int64(k.shape[1]),
            np.int64(k_start), np.int32(hs), acc.type(1.0 / math.sqrt(hs)))
    args += dropout_args(xp, acc, dropout)
    return Launch("flash_fwd", q.dtype, (-(-Tq // ft), BH), (THREADS,), args), (y, lse)


def _bwd_plans(q, k, v, g, lse, D, dq, dk, dv, pieces, add, dropout):
    """flash_bwd_dkdv's and flash_bwd_dq's plans over (BH, L, hs) arrays; pieces: the
    kernels' (Lq, qo, Tq, q_start, Lk, ko, Tk, k_start)."""
    BH, _, hs = q.shape
    acc = lse.dtype
    _, bt = tiles(acc.itemsize)
    geometry = tuple(np.int64(n) for n in pieces) + (np.int32(add), np.int32(hs),
                                                     acc.type(1.0 / math.sqrt(hs)))
    Tq, Tk = pieces[2], pieces[6]
    return [Launch("flash_bwd_dkdv", q.dtype, (-(-Tk // bt), BH), (THREADS,),
                   (q, k, v, g, lse, D, dk, dv) + geometry + dropout),
            Launch("flash_bwd_dq", q.dtype, (-(-Tq // bt), BH), (THREADS,),
                   (q, k, v, g, lse, D, dq) + geometry + dropout)]


def flash_bwd_launches(xp, g, q, k, v, y, lse, dropout=None):
    """The plans (D = g.y per row, dk and dv, dq) and (dq, dk, dv), each (BH, T, hs), of a
    whole sequence; dropout as flash_fwd_launch's."""
    g, q, k, v, y = (_heads(xp, a) for a in (g, q, k, v, y))
    _check_kv(q, k, v)
    BH, T, hs = q.shape
    if k.shape[1] != T:              # a whole sequence: its keys are its queries' positions
        raise ValueError(f"flash backward kernels: keys {k.shape} of another length than "
                         f"the queries {q.shape} (a whole sequence's; pieces: "
                         "flash_piece_bwd_launches)")
    acc = acc_dtype(q.dtype)
    lse = xp.ascontiguousarray(lse, dtype=acc).reshape(BH, T)
    D, dq, dk, dv = xp.empty((BH, T), acc), xp.empty_like(q), xp.empty_like(q), xp.empty_like(q)
    dot = Launch("flash_bwd_dot", q.dtype, *flat_grid(BH * T),
                 (g, y, D, np.int64(BH * T), np.int32(hs)))
    plans = _bwd_plans(q, k, v, g, lse, D, dq, dk, dv, (T, 0, T, 0, T, 0, T, 0), 0,
                       dropout_args(xp, acc, dropout))
    return [dot] + plans, (dq, dk, dv)


def flash_piece_bwd_launches(xp, g, q, k, v, lse, D, grads, q_piece, k_piece, dropout=None):
    """The plans (dk and dv, dq) that ADD one pair of pieces' gradients into grads = (dq, dk,
    dv) (ring attention's backward of one held block, minidist/cp/ring.py). q, g, dq
    (..., Lq, hs), lse and D (..., Lq) (the whole attention's merged log-sum-exp and
    rowsum(g y)); k, v, dk, dv (..., Lk, hs). q_piece = (qo, q_start, Tq): the queries are
    rows qo .. qo+Tq-1, at global positions q_start..; k_piece = (ko, k_start, Tk) the keys
    likewise; causal by global position. dropout as flash_fwd_launch's."""
    if not all(a.flags.c_contiguous and a.dtype == q.dtype for a in grads):
        raise ValueError("the flash kernels add into contiguous dq, dk, dv of q's dtype")
    g, q, k, v = (_heads(xp, a) for a in (g, q, k, v))
    _check_kv(q, k, v)
    dq, dk, dv = (a.reshape(-1, a.shape[-2], a.shape[-1]) for a in grads)   # views
    BH, Lq, _ = q.shape
    acc = acc_dtype(q.dtype)
    lse, D = (xp.ascontiguousarray(a, dtype=acc).reshape(BH, Lq) for a in (lse, D))
    (qo, q_start, Tq), (ko, k_start, Tk) = q_piece, k_piece
    Lk = k.shape[1]
    if min(qo, Tq, ko, Tk) < 0 or qo + Tq > Lq or ko + Tk > Lk:
        raise ValueError(f"pieces rows {qo}..+{Tq} of {Lq}, {ko}..+{Tk} of {Lk}: outside")
    pieces = (Lq, qo, Tq, q_start, Lk, ko, Tk, k_start)
    return _bwd_plans(q, k, v, g, lse, D, dq, dk, dv, pieces, 1, dropout_args(xp, acc, dropout))


def flash_attention(q, k, v, dropout=None):
    """(y like q, lse (..., T)) of causal attention on the GPU (dropout: dropout_args')."""
    plan, (y, lse) = flash_fwd_launch(sys.modules["cupy"], q, k, v, dropout)
    launch(plan)
    return y.reshape(q.shape), lse.reshape(q.shape[:-1])


def flash_attention_backward(g, q, k, v, y, lse, dropout=None):
    """(dq, dk, dv), each shaped like q (dropout: the forward's)."""
    plans, grads = flash_bwd_launches(sys.modules["cupy"], g, q, k, v, y, lse, dropout)
    for plan in plans:
        launch(plan)
    return tuple(a.reshape(q.shape) for a in grads)


def flash_partial(xp, run, q, k, v, q_start, k_start, dropout=None):
    """(y like q, lse (..., Tq) in the accumulation dtype): causal attention of queries q
    (..., Tq, hs) at global positions q_start.. over ONE piece of keys and values (..., Tk,
    hs) at k_start.. (flash.partial_attention), one launch; a row that sees no key gets
    y 0 and lse -inf. `run` executes the plan (`launch` on the GPU; the tests run the same
    glue on numpy through the CPU harness)."""
    plan, (y, lse) = flash_fwd_launch(xp, q, k, v, dropout, q_start, k_start)
    if y.size:                                                  # no empty grid
        run(plan)
    return y.reshape(q.shape), lse.reshape(q.shape[:-1])


def flash_piece_backward(xp, run, g, q, k, v, lse, D, grads, q_piece, k_piece, dropout=None):
    """flash_piece_bwd_launches' plans run: one pair of pieces' dq, dk, dv added into grads,
    two launches."""
    if q_piece[2] and k_piece[2]:
        for plan in flash_piece_bwd_launches(xp, g, q, k, v, lse, D, grads, q_piece, k_piece,
                                             dropout):
            run(plan)


# ---- bias + GELU: elementwise ---------------------------------------------------------------

def bias_gelu_fwd_launch(xp, x, b):
    """The plan and y = gelu(x + b) for x (..., C), b (C,)."""
    x, b = xp.ascontiguousarray(x), xp.ascontiguousarray(b, dtype=x.dtype)
    y = xp.empty_like(x)
    args = (x, b, y, np.int64(x.size), np.int64(b.size))
    return Launch("bias_gelu_fwd", x.dtype, *flat_grid(x.size), args), y


def bias_gelu_bwd_launch(xp, x, b, grad):
    """The plan and dx (= d(x + b)); db is dx summed over the rows."""
    x, b = xp.ascontiguousarray(x), xp.ascontiguousarray(b, dtype=x.dtype)
    g, dx = xp.ascontiguousarray(grad, dtype=x.dtype), xp.empty_like(x)
    args = (x, b, g, dx, np.int64(x.size), np.int64(b.size))
    return Launch("bias_gelu_bwd", x.dtype, *flat_grid(x.size), args), dx


def bias_gelu(xp, run, h, b):
    """gelu(h + b) by the kernel: `run` executes a plan (`launch` on the GPU; the tests run
    the same glue on numpy through the CPU harness)."""
    plan, y = bias_gelu_fwd_launch(xp, h, b)
    run(plan)
    return y


def bias_gelu_backward(xp, run, h, b, grad, needs):
    """(dh, db), None where needs (h, b) is False; db sums dh's rows in the accumulation
    dtype (float32 for 16-bit h)."""
    plan, dh = bias_gelu_bwd_launch(xp, h, b, grad)
    run(plan)
    db = None
    if needs[1]:
        db = dh.reshape(-1, b.size).sum(axis=0, dtype=acc_dtype(dh.dtype)).astype(b.dtype)
    return (dh if needs[0] else None), db


# ---- residual + layer norm ------------------------------------------------------------------

def ln_residual_fwd_launch(xp, x, r, w, b, eps):
    """The plan and (s = x + r, y = layer_norm(s), w, mean, rstd); backward takes s, w, mean,
    rstd (ln_residual_bwd_x_launch; dw, db from cuda_kernels.ln_bwd_wb_launch on s)."""
    x, r, w = (xp.ascontiguousarray(a) for a in (x, r, w))
    b = w if b is None else xp.ascontiguousarray(b)            # not read when has_b is 0
    acc, C = acc_dtype(x.dtype), x.shape[-1]
    s, y = xp.empty_like(x), xp.empty_like(x)
    mean, rstd = xp.empty(x.size // C, acc), xp.empty(x.size // C, acc)
    args = (x, r, w, b, s, y, mean, rstd, np.int64(C), acc.type(eps), np.int32(b is not w))
    return Launch("ln_residual_fwd", x.dtype, *row_grid(x), args), (s, y, w, mean, rstd)


def ln_residual_bwd_x_launch(xp, grad_y, grad_s, s, w, mean, rstd):
    """The plan and dx = dr: the gradient reaching s from later (grad_s) plus layer norm's."""
    gy = xp.ascontiguousarray(grad_y, dtype=s.dtype)
    gs = xp.ascontiguousarray(grad_s, dtype=s.dtype)
    dx = xp.empty_like(s)
    args = (gy, gs, s, w, mean, rstd, dx, np.int64(s.shape[-1]))
    return Launch("ln_residual_bwd_x", s.dtype, *row_grid(s), args), dx


def residual_layer_norm(xp, run, x, r, w, b, eps):
    """(s = x + r, y = layer_norm(s), saved for backward: (s, w, mean, rstd)) by the kernel."""
    plan, (s, y, w, mean, rstd) = ln_residual_fwd_launch(xp, x, r, w, b, eps)
    run(plan)
    return s, y, (s, w, mean, rstd)


def residual_layer_norm_backward(xp, run, grad_s, grad_y, saved, needs):
    """(dx, dr, dw, db), None where needs (x, r, w, b) is False: dx = dr = grad_s + layer
    norm's dx (ln_residual_bwd_x), dw and db summed from ln_bwd_wb's partial sums (one
    kernel for both, in the accumulation dtype). grad_y None: y had no gradient; grad_s
    None: s had none."""
    s, w, mean, rstd = saved
    if grad_y is None:
        return grad_s, grad_s, None, None
    gy = xp.ascontiguousarray(grad_y, dtype=s.dtype).reshape(-1, s.shape[-1])
    dx = dw = db = None
    if needs[0] or needs[1]:
        gs = xp.zeros_like(s) if grad_s is None else grad_s
        plan, dx = ln_residual_bwd_x_launch(xp, gy, gs, s, w, mean, rstd)
        run(plan)
        dx = dx.reshape(s.shape)
    if needs[2] or needs[3]:
        plan, (dw_part, db_part) = ln_bwd_wb_launch(xp, gy, s.reshape(gy.shape), mean, rstd)
        run(plan)
        dw = dw_part.sum(axis=0).astype(w.dtype) if needs[2] else None
        db = db_part.sum(axis=0).astype(w.dtype) if needs[3] else None
    return dx, dx, dw, db


# ---- cross-entropy over a padded vocabulary -------------------------------------------------

def ce_pad_fwd_launch(xp, logits, targets, V, ignore_index):
    """The plan and (z (N, Vp), t (N,) int64, lse, per-row loss) over the first V columns."""
    Vp = logits.shape[-1]
    z = xp.ascontiguousarray(logits).reshape(-1, Vp)
    t = xp.ascontiguousarray(xp.asarray(targets).reshape(-1), dtype=np.int64)
    acc = acc_dtype(z.dtype)
    lse, rows = xp.empty(len(t), acc), xp.empty(len(t), acc)
    args = (z, t, lse, rows, np.int64(V), np.int64(Vp), np.int64(ignore_index))
    grid, block = row_grid(z[:, :V])
    return Launch("ce_pad_fwd", z.dtype, grid, block, args), (z, t, lse, rows)


def ce_pad_bwd_launch(xp, grad, saved, V, ignore_index):
    """The plan and dL/dlogits (N, Vp), 0 in the padding; saved from ce_pad_fwd_launch and n,
    the count of rows not ignored (on the device), as cuda_kernels.ce_bwd_launch."""
    z, t, lse, n = saved
    scale = (xp.asarray(grad, dtype=lse.dtype) / n).reshape(1).astype(lse.dtype)
    dz = xp.empty_like(z)
    args = (z, t, lse, scale, dz, np.int64(V), np.int64(z.shape[1]), np.int64(ignore_index))
    return Launch("ce_pad_bwd", z.dtype, *row_grid(z), args), dz


def cross_entropy_padded(xp, run, logits, targets, V, ignore_index):
    """(mean loss over the rows not ignored, on the device; saved for backward) over the
    first V columns of logits (..., Vp): n is counted on the device (no host sync)."""
    plan, (z, t, lse, rows) = ce_pad_fwd_launch(xp, logits, targets, V, ignore_index)
    run(plan)
    n = xp.maximum((t != ignore_index).sum(), 1).astype(lse.dtype)  # all ignored: loss 0
    return rows.sum() / n, (z, t, lse, n)


def cross_entropy_padded_backward(xp, run, grad, saved, V, ignore_index):
    """dL/dlogits (N, Vp), 0 in the padding columns."""
    plan, dz = ce_pad_bwd_launch(xp, grad, saved, V, ignore_index)
    run(plan)
    return dz


# ---- dropout's numbers: Philox4x32-10 ----------------------------------------------------------

def philox_uniforms_launch(xp, blocks, rows, step, key):
    """The plan and out (n, 4) float32 of DropoutKeys' numbers (minidist/autograd/
    dropout_keys.py): counters (blocks[i], rows[i], step), int64 arrays of n, key (k0, k1);
    step = (count, lag): count[0] - lag, read on the device (DropoutKeys.device_step)."""
    blocks, rows = (xp.ascontiguousarray(a, dtype=xp.int64) for a in (blocks, rows))
    count, lag = step
    count = xp.ascontiguousarray(count, dtype=xp.int64)
    n = blocks.size
    out = xp.empty((n, 4), dtype=xp.float32)
    args = (blocks, rows, out, np.int64(n), count, np.int64(lag), np.int64(key[0]),
            np.int64(key[1]))
    return Launch("philox_uniforms", "float32", *flat_grid(n), args), out


def philox_uniforms(xp, run, blocks, rows, step, key):
    """philox_uniforms_launch's numbers, one launch: `run` executes the plan (`launch` on the
    GPU; the tests run the same glue on numpy through the CPU harness)."""
    plan, out = philox_uniforms_launch(xp, blocks, rows, step, key)
    run(plan)
    return out
