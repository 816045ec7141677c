"""Launch plans for Llama's block's CUDA kernels (cuda_source_llama.py), proven on the CPU
only (never run on a GPU yet).

As in cuda_kernels.py, each `<kernel>_launch(xp, ...)` is a pure function that allocates the
outputs with `xp` and returns a `Launch`; the glue functions below take `xp` and `run`
(cupy and cuda_kernels.launch in llama_ops.py, on cupy arrays with
MINIDIST_CUDA_NEW_KERNELS=1; numpy and the CPU harness in tests/test_cuda_llama_cpu.py,
which checks every plan's arguments against the kernel's declared parameters and every
result against llama_ops.py's xp code).
"""
import numpy as np

from minidist.autograd.cuda_kernels import Launch, acc_dtype, flat_grid, ln_bwd_wb_launch, \
    row_grid


# ---- RMSNorm: a block per row ----------------------------------------------------------------

def rms_fwd_launch(xp, x, w, eps):
    """The plan and (y, saved): y = x rstd w; saved = (x, w, rstd) for backward, rstd (rows,)
    in the accumulation dtype."""
    x, w = xp.ascontiguousarray(x), xp.ascontiguousarray(w, dtype=x.dtype)
    acc, C = acc_dtype(x.dtype), x.shape[-1]
    y, rstd = xp.empty_like(x), xp.empty(x.size // C, acc)
    args = (x, w, y, rstd, np.int64(C), acc.type(eps))
    return Launch("rms_fwd", x.dtype, *row_grid(x), args), (y, (x, w, rstd))


def rms_bwd_x_launch(xp, grad, x, w, rstd):
    """The plan and dx."""
    g = xp.ascontiguousarray(grad, dtype=x.dtype)
    dx = xp.empty_like(x)
    args = (g, x, w, rstd, dx, np.int64(x.shape[-1]))
    return Launch("rms_bwd_x", x.dtype, *row_grid(x), args), dx


def rms_norm(xp, run, x, w, eps):
    """(y, saved for backward: (x, w, rstd)) by the kernel; `run` executes a plan."""
    plan, (y, saved) = rms_fwd_launch(xp, x, w, eps)
    run(plan)
    return y, saved


def rms_norm_backward(xp, run, grad, saved, needs):
    """(dx, dw), None where needs (x, w) is False: dx by rms_bwd_x, dw = sum of g xhat over
    the rows by ln_bwd_wb with a zero mean (its xhat = (x - 0) rstd)."""
    x, w, rstd = saved
    dx = dw = None
    if needs[0]:
        plan, dx = rms_bwd_x_launch(xp, grad, x, w, rstd)
        run(plan)
    if needs[1]:
        C = x.shape[-1]
        g = xp.ascontiguousarray(grad, dtype=x.dtype).reshape(-1, C)
        zero = xp.zeros(rstd.shape, rstd.dtype)
        plan, (dw_part, _) = ln_bwd_wb_launch(xp, g, x.reshape(-1, C), zero, rstd)
        run(plan)
        dw = dw_part.sum(axis=0).astype(w.dtype)
    return dx, dw


# ---- SwiGLU: elementwise over the outputs ----------------------------------------------------

def swiglu_fwd_launch(xp, h):
    """The plan and y (..., F) for h (..., 2F)."""
    h = xp.ascontiguousarray(h)
    F = h.shape[-1] // 2
    y = xp.empty(h.shape[:-1] + (F,), h.dtype)
    return Launch("swiglu_fwd", h.dtype, *flat_grid(y.size), (h, y, np.int64(y.size),
                                                              np.int64(F))), y


def swiglu_bwd_launch(xp, h, grad):
    """The plan and dh (..., 2F) = [da | db]."""
    h = xp.ascontiguousarray(h)
    F = h.shape[-1] // 2
    g, dh = xp.ascontiguousarray(grad, dtype=h.dtype), xp.empty_like(h)
    return Launch("swiglu_bwd", h.dtype, *flat_grid(g.size), (h, g, dh, np.int64(g.size),
                                                              np.int64(F))), dh


def swiglu(xp, run, h):
    plan, y = swiglu_fwd_launch(xp, h)
    run(plan)
    return y


def swiglu_backward(xp, run, h, grad):
    plan, dh = swiglu_bwd_launch(xp, h, grad)
    run(plan)
    return dh


# ---- RoPE: a pair per thread -----------------------------------------------------------------

def rope_launch(xp, x, y, tables, heads, hs, sign):
    """The plan turning the first `heads` heads (hs columns each) of every row of x (B, T,
    width) into y (x itself: in place) by `tables` (cos, sin), each (T, hs/2) in the
    accumulation dtype."""
    B, T, width = x.shape
    cos, sin = tables
    acc, half = acc_dtype(x.dtype), hs // 2
    n = B * T * heads * half
    args = (x, y, cos, sin, np.int64(n), np.int64(T), np.int64(heads), np.int64(half),
            np.int64(width), acc.type(sign))
    return Launch("rope", x.dtype, *flat_grid(n), args)


def rotary(xp, run, qkv, heads, hs, tables):
    """qkv (contiguous, fresh) with its first `heads` heads turned, in place."""
    run(rope_launch(xp, qkv, qkv, tables, heads, hs, 1.0))
    return qkv


def rotary_backward(xp, run, grad, heads, hs, tables):
    """A copy of grad with its first `heads` heads turned back."""
    d = xp.array(grad, copy=True, order="C")
    run(rope_launch(xp, d, d, tables, heads, hs, -1.0))
    return d
