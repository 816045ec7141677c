"""Fused CUDA kernels (CuPy RawKernel) for GELU, layer norm, softmax + cross-entropy, the
causal attention softmax and AdamW: the GPU side of fused.py, attention.py and
optim/adamw.py. The CUDA source is in cuda_source.py; float16, bfloat16 and float32
accumulate in float32, float64 in float64.

Why kernels: the generic xp code is one CuPy launch per line (layer norm forward: ~8 full
passes over (N, C)); each kernel here reads its input once or twice and writes once.

Every launch is planned by a pure function, `<kernel>_launch(xp, ...)`, that allocates the
outputs with `xp` and returns a `Launch` (kernel name, dtype, grid, block, argument tuple:
arrays and numpy scalars of the exact C width). The GPU path runs that same plan
(`launch`); tests/test_cuda_kernels.py plans every kernel with numpy arrays on the CPU and
checks each argument against the kernel's declared parameters (the float64 `A` buffers
and 8-byte `A` scalars handed to float32 kernels were caught this way, without a GPU), and
tests/test_cuda_kernels_cpu.py RUNS every plan on the CPU (the same source compiled with
g++, tests/cuda_cpu.py) against the xp code. Kernels not yet run on a GPU are planned in
cuda_kernels_new.py.

Nothing here imports cupy at import time: `use(...)` is False for numpy arrays before it
looks at anything else, and kernels are compiled on first use, cached per (kernel, dtype).
MINIDIST_CUDA_KERNELS=0 turns them off (the generic xp code runs instead, for comparison).
Row kernels run one block per row (N rows of C, V or T columns), a power-of-two block of
32..1024 threads striding over the row, reductions by warp shuffles then shared memory.
"""
import collections
import math
import os
import sys

import numpy as np

from minidist.autograd.cuda_source import C_TO_NUMPY, CTYPES, dtype_name, part_of, source
from minidist.backend import is_cupy

Launch = collections.namedtuple("Launch", "name dtype grid block args")
_CACHE = {}


def kernels_on():
    """The hand-written kernels are switched on: MINIDIST_CUDA_KERNELS is not "0"."""
    return os.environ.get("MINIDIST_CUDA_KERNELS", "1") != "0"


def use(*arrays):
    """True when these arrays (None skipped) should go through the kernels: all cupy, one
    dtype the kernels are built for, and MINIDIST_CUDA_KERNELS is not "0"."""
    arrays = [a for a in arrays if a is not None]
    if not arrays or not all(is_cupy(a) for a in arrays):
        return False
    if not kernels_on():
        return False
    return arrays[0].dtype.name in CTYPES and all(a.dtype == arrays[0].dtype for a in arrays)


def acc_dtype(dtype):
    """The accumulation dtype for arrays of `dtype`: float32, or float64 for float64.
    (The C name "float" is float32: numpy's np.dtype("float") would be float64.)"""
    return C_TO_NUMPY[CTYPES[dtype_name(dtype)][1]]


def describe(args):
    """A launch's arguments as ("array", dtype name, shape) or ("scalar", dtype name); a
    Python number, whose C width CuPy would guess, shows as ("python", type name)."""
    out = []
    for a in args:
        if isinstance(a, np.generic):
            out.append(("scalar", a.dtype.name))
        elif hasattr(a, "dtype"):
            out.append(("array", a.dtype.name, tuple(a.shape)))
        else:
            out.append(("python", type(a).__name__))
    return tuple(out)


def _raw(name, dtype):
    """cupy.RawKernel `name` for `dtype`, compiled on first call (by CuPy, then cached)."""
    key = (name, dtype_name(dtype))
    if key not in _CACHE:
        cp = sys.modules["cupy"]       # imported already: use() saw cupy arrays
        _CACHE[key] = cp.RawKernel(source(dtype, part_of(name)), name,
                                   options=("--std=c++14",))
    return _CACHE[key]


def launch(plan):
    """Run a planned launch on the GPU."""
    _raw(plan.name, plan.dtype)(plan.grid, plan.block, plan.args)


def _threads(n):
    """Block size for rows of n: a power of two, 32..1024 (a multiple of the warp)."""
    return min(1024, max(32, 1 << (max(int(n), 1) - 1).bit_length()))


def row_grid(x):
    """One row kernel's (grid, block) for x (..., n): a block per row."""
    n = x.shape[-1]
    return (x.size // n,), (_threads(n),)


# ---- GELU: elementwise ------------------------------------------------------------------------

def flat_grid(n):
    """(grid, block) for an elementwise grid-stride kernel over n values."""
    return (max(1, min(-(-n // 256), 1 << 20)),), (256,)


def gelu_fwd_launch(xp, x):
    x = xp.ascontiguousarray(x)
    y = xp.empty_like(x)
    return Launch("gelu_fwd", x.dtype, *flat_grid(x.size), (x, y, np.int64(x.size))), y


def gelu_bwd_launch(xp, x, grad):
    x = xp.ascontiguousarray(x)
    g = xp.ascontiguousarray(grad, dtype=x.dtype)
    dx = xp.empty_like(x)
    return Launch("gelu_bwd", x.dtype, *flat_grid(x.size), (x, g, dx, np.int64(x.size))), dx


def gelu(x):
    plan, y = gelu_fwd_launch(sys.modules["cupy"], x)
    launch(plan)
    return y


def gelu_backward(x, grad):
    plan, dx = gelu_bwd_launch(sys.modules["cupy"], x, grad)
    launch(plan)
    return dx


# ---- AdamW: elementwise --------------------------------------------------------------------

def adamw_launch(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay):
    """The plan of one AdamW step in place on contiguous p, m, v (g read): the scalars of
    optim/adamw.py's adamw_update, precomputed on the host in the accumulation dtype."""
    acc = acc_dtype(p.dtype).type
    scalars = (beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 - lr * weight_decay,
               1.0 / math.sqrt(1.0 - beta2 ** step), eps, lr / (1.0 - beta1 ** step))
    args = (p, g, m, v, np.int64(p.size)) + tuple(acc(x) for x in scalars)
    return Launch("adamw_step", p.dtype, *flat_grid(p.size), args)


# ---- layer norm ------------------------------------------------------------------------------

def ln_fwd_launch(xp, x, w, b, eps):
    """The plan and (y, x, w, mean, rstd): x and w contiguous, as backward takes them;
    mean and rstd (N,) in the accumulation dtype."""
    x, w = xp.ascontiguousarray(x), xp.ascontiguousarray(w)   # no copy if already so
    b = w if b is None else xp.ascontiguousarray(b)            # not read when has_b is 0
    acc, C = acc_dtype(x.dtype), x.shape[-1]
    y = xp.empty_like(x)
    mean, rstd = xp.empty(x.size // C, acc), xp.empty(x.size // C, acc)
    args = (x, w, b, y, mean, rstd, np.int64(C), acc.type(eps), np.int32(b is not w))
    return Launch("ln_fwd", x.dtype, *row_grid(x), args), (y, x, w, mean, rstd)


def layer_norm(x, w, b, eps):
    plan, out = ln_fwd_launch(sys.modules["cupy"], x, w, b, eps)
    launch(plan)
    return out


def ln_bwd_x_launch(xp, g, x, w, mean, rstd):
    dx = xp.empty_like(x)
    args = (g, x, w, mean, rstd, dx, np.int64(x.shape[-1]))
    return Launch("ln_bwd_x", x.dtype, *row_grid(x), args), dx


def ln_bwd_wb_launch(xp, g, x, mean, rstd):
    """The plan and the (chunks, C) partial sums of dw and db."""
    C = x.shape[-1]
    N, acc = x.size // C, acc_dtype(x.dtype)
    rows = max(32, -(-N // 65535))     # >= 32 rows per block; grid.y stays <= 65535
    chunks = -(-N // rows)
    dw_part, db_part = xp.empty((chunks, C), acc), xp.empty((chunks, C), acc)
    args = (g, x, mean, rstd, dw_part, db_part, np.int64(N), np.int64(C), np.int64(rows))
    return Launch("ln_bwd_wb", x.dtype, (-(-C // 256), chunks), (256,), args), (dw_part,
                                                                                  db_part)


def layer_norm_backward(grad, x, w, mean, rstd, needs):
    """(dx, dw, db) for layer_norm's saved (x, w, mean, rstd); None where `needs` is False."""
    cp = sys.modules["cupy"]
    g = cp.ascontiguousarray(grad, dtype=x.dtype)
    dx = dw = db = None
    if needs[0]:
        plan, dx = ln_bwd_x_launch(cp, g, x, w, mean, rstd)
        launch(plan)
    if needs[1] or needs[2]:
        plan, (dw_part, db_part) = ln_bwd_wb_launch(cp, g, x, mean, rstd)
        launch(plan)
        dw = dw_part.sum(axis=0).astype(w.dtype) if needs[1] else None
        db = db_part.sum(axis=0).astype(w.dtype) if needs[2] else None
    return dx, dw, db


# ---- softmax + cross-entropy -----------------------------------------------------------------

def ce_fwd_launch(xp, logits, targets, ignore_index):
    """The plan and (z (N, V), t (N,) int64, lse, per-row loss)."""
    V = logits.shape[-1]
    z = xp.ascontiguousarray(logits).reshape(-1, V)
    t = xp.ascontiguousarray(xp.asarray(targets).reshape(-1), dtype=np.int64)
    acc = acc_dtype(z.dtype)
    lse, rows = xp.empty(len(t), acc), xp.empty(len(t), acc)
    args = (z, t, lse, rows, np.int64(V), np.int64(ignore_index))
    return Launch("ce_fwd", z.dtype, *row_grid(z), args), (z, t, lse, rows)


def cross_entropy(logits, targets, ignore_index):
    """(loss on the device, saved): the mean over non-ignored rows, all on the GPU; n counted
    there too (the CPU path's int(valid.sum()) would be a device-to-host sync)."""
    cp = sys.modules["cupy"]
    plan, (z, t, lse, rows) = ce_fwd_launch(cp, logits, targets, ignore_index)
    launch(plan)
    n = cp.maximum((t != ignore_index).sum(), 1).astype(lse.dtype)  # all ignored: loss 0
    return rows.sum() / n, (z, t, lse, n)


def ce_bwd_launch(xp, grad, saved, ignore_index):
    """The plan and dL/dlogits (N, V) in the logits' dtype."""
    z, t, lse, n = saved
    scale = (xp.asarray(grad, dtype=lse.dtype) / n).reshape(1).astype(lse.dtype)  # on device
    dz = xp.empty_like(z)
    args = (z, t, lse, scale, dz, np.int64(z.shape[1]), np.int64(ignore_index))
    return Launch("ce_bwd", z.dtype, *row_grid(z), args), dz


def cross_entropy_backward(grad, saved, ignore_index):
    plan, dz = ce_bwd_launch(sys.modules["cupy"], grad, saved, ignore_index)
    launch(plan)
    return dz


# ---- causal attention softmax ----------------------------------------------------------------

def attn_fwd_launch(S, scale):
    """S (..., T, T) contiguous, softmaxed in place."""
    args = (S, np.int64(S.shape[-1]), acc_dtype(S.dtype).type(scale))
    return Launch("attn_softmax_fwd", S.dtype, *row_grid(S), args)


def attn_softmax_(S, scale):
    """S (..., T, T) contiguous -> softmax(S * scale + causal mask) in place."""
    launch(attn_fwd_launch(S, scale))
    return S


def attn_bwd_launch(xp, dP, P, gy, scale):
    """dP (..., T, T) contiguous, turned into dS in place; gy (..., T, 1)."""
    acc = acc_dtype(dP.dtype)
    gy = xp.ascontiguousarray(gy.reshape(-1), dtype=acc)
    args = (dP, P, gy, np.int64(dP.shape[-1]), acc.type(scale))
    return Launch("attn_softmax_bwd", dP.dtype, *row_grid(dP), args)


def attn_softmax_backward_(dP, P, gy, scale):
    """dP (..., T, T) contiguous -> dS = P (dP - gy) scale in place; gy (..., T, 1)."""
    launch(attn_bwd_launch(sys.modules["cupy"], dP, P, gy, scale))
    return dP

