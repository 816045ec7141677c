"""Fused CUDA kernels (CuPy) for GELU, layer norm, softmax + cross-entropy and the causal
attention softmax: the GPU side of fused.py and attention.py. NOT YET RUN ON A GPU: written
and checked for syntax on a machine without one; tests/test_cuda_kernels.py (marked gpu)
compares every kernel with the generic xp code on the same cupy arrays.

Why kernels: the generic xp code is one CuPy launch per line (layer norm forward: ~8 full
passes over (N, C)); each kernel here reads its input once or twice and writes once.
Accumulation is float32 for float16/float32 (float64 for float64), as on the CPU path.
float16 uses cuda_fp16.h's __half; bfloat16 and other dtypes take the generic code.

Nothing here imports cupy at import time: `use(...)` is False for numpy arrays before it
looks at anything else, and kernels are compiled on first use, cached per (kernel, dtype).
MINIDIST_CUDA_KERNELS=0 turns them off (the generic xp code runs instead, for comparison).

Row kernels run one block per row (N rows of C, V or T columns), a power-of-two block of
32..1024 threads striding over the row, reductions by warp shuffles then shared memory.
"""
import math
import os
import sys

import numpy as np

from minidist.backend import is_cupy

_CTYPES = {"float16": ("__half", "float"), "float32": ("float", "float"),
           "float64": ("double", "double")}
_CACHE = {}


def use(*arrays):
    """True when these arrays (None skipped) should go through the kernels: all cupy, one
    dtype the kernels are built for, and MINIDIST_CUDA_KERNELS is not "0"."""
    arrays = [a for a in arrays if a is not None]
    if not arrays or not all(is_cupy(a) for a in arrays):
        return False
    if os.environ.get("MINIDIST_CUDA_KERNELS", "1") == "0":
        return False
    return arrays[0].dtype.name in _CTYPES and all(a.dtype == arrays[0].dtype for a in arrays)


def acc_dtype(dtype):
    """The accumulation dtype for arrays of `dtype`: float32, or float64 for float64."""
    return np.dtype(_CTYPES[np.dtype(dtype).name][1])


# ---- CUDA source -----------------------------------------------------------------------------

# Loads, stores and math overloaded on the storage type T and the accumulation type A, so
# each kernel is written once; a typedef at the top picks T and A per dtype.
_HEADER = r"""
__device__ __forceinline__ float ld(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ float ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ double ld(const double* p, long long i) { return p[i]; }
__device__ __forceinline__ void st(__half* p, long long i, float v) { p[i] = __float2half(v); }
__device__ __forceinline__ void st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(double* p, long long i, double v) { p[i] = v; }
__device__ __forceinline__ float ex(float v) { return expf(v); }
__device__ __forceinline__ double ex(double v) { return exp(v); }
__device__ __forceinline__ float lg(float v) { return logf(v); }
__device__ __forceinline__ double lg(double v) { return log(v); }
__device__ __forceinline__ float rs(float v) { return 1.0f / sqrtf(v); }
__device__ __forceinline__ double rs(double v) { return 1.0 / sqrt(v); }

__device__ __forceinline__ A warp_reduce(A v, bool is_max) {
    for (int o = 16; o > 0; o >>= 1) {
        A u = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? (u > v ? u : v) : v + u;
    }
    return v;
}

// Sum or max over the block (blockDim.x a multiple of 32). The first __syncthreads lets a
// previous call's readers of sh[0] finish before sh is written again.
__device__ A block_reduce(A v, bool is_max) {
    __shared__ A sh[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_reduce(v, is_max);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    if (w == 0) {
        v = lane < nw ? sh[lane] : (is_max ? sh[0] : (A)0);
        v = warp_reduce(v, is_max);
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    return sh[0];
}
"""

_SOURCE = r"""
// layer norm, one block per row: two-pass mean and variance (as the CPU path), saves
// mean and rstd (N,) so backward recomputes xhat instead of keeping an (N, C) copy
extern "C" __global__ void ln_fwd(const T* x, const T* w, const T* b, T* y, A* mean,
                                  A* rstd, long long C, A eps, int has_b) {
    const T* xr = x + blockIdx.x * C;
    T* yr = y + blockIdx.x * C;
    A s = 0;
    for (long long c = threadIdx.x; c < C; c += blockDim.x) s += ld(xr, c);
    A mu = block_reduce(s, false) / C;
    s = 0;
    for (long long c = threadIdx.x; c < C; c += blockDim.x) {
        A d = ld(xr, c) - mu;
        s += d * d;
    }
    A r = rs(block_reduce(s, false) / C + eps);
    for (long long c = threadIdx.x; c < C; c += blockDim.x) {
        A v = (ld(xr, c) - mu) * r * ld(w, c);
        st(yr, c, has_b ? v + ld(b, c) : v);
    }
    if (threadIdx.x == 0) { mean[blockIdx.x] = mu; rstd[blockIdx.x] = r; }
}

// dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = g * w
extern "C" __global__ void ln_bwd_x(const T* g, const T* x, const T* w, const A* mean,
                                    const A* rstd, T* dx, long long C) {
    long long off = blockIdx.x * C;
    A mu = mean[blockIdx.x], r = rstd[blockIdx.x], s1 = 0, s2 = 0;
    for (long long c = threadIdx.x; c < C; c += blockDim.x) {
        A dxh = ld(g, off + c) * ld(w, c);
        s1 += dxh;
        s2 += dxh * (ld(x, off + c) - mu) * r;
    }
    A m1 = block_reduce(s1, false) / C;
    A m2 = block_reduce(s2, false) / C;
    for (long long c = threadIdx.x; c < C; c += blockDim.x) {
        A dxh = ld(g, off + c) * ld(w, c);
        st(dx, off + c, r * (dxh - m1 - (ld(x, off + c) - mu) * r * m2));
    }
}

// dw, db partial column sums over a chunk of `rows` rows (blockIdx.y): coalesced along C;
// the (chunks, C) partials are summed by the caller
extern "C" __global__ void ln_bwd_wb(const T* g, const T* x, const A* mean, const A* rstd,
                                     A* dw_part, A* db_part, long long N, long long C,
                                     long long rows) {
    long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (c >= C) return;
    long long r0 = blockIdx.y * rows, r1 = r0 + rows < N ? r0 + rows : N;
    A sw = 0, sb = 0;
    for (long long r = r0; r < r1; r++) {
        A gv = ld(g, r * C + c);
        sb += gv;
        sw += gv * (ld(x, r * C + c) - mean[r]) * rstd[r];
    }
    dw_part[blockIdx.y * C + c] = sw;
    db_part[blockIdx.y * C + c] = sb;
}

// cross-entropy, one block per row: lse = max + log sum exp(z - max), loss = lse - z_t;
// ignored rows 0; an out-of-range target gives nan (visible in the loss, no host check)
extern "C" __global__ void ce_fwd(const T* z, const long long* t, A* lse, A* loss,
                                  long long V, long long ignore) {
    const T* zr = z + blockIdx.x * V;
    A m = ld(zr, 0);
    for (long long c = threadIdx.x; c < V; c += blockDim.x) m = ld(zr, c) > m ? ld(zr, c) : m;
    m = block_reduce(m, true);
    A s = 0;
    for (long long c = threadIdx.x; c < V; c += blockDim.x) s += ex(ld(zr, c) - m);
    s = block_reduce(s, false);
    if (threadIdx.x == 0) {
        long long tt = t[blockIdx.x];
        A l = lg(s) + m, zero = 0;
        lse[blockIdx.x] = l;
        loss[blockIdx.x] = tt == ignore ? zero : (tt < 0 || tt >= V) ? zero / zero
                                                                       : l - ld(zr, tt);
    }
}

// dz = (softmax(z) - onehot(t)) * scale, scale = dL/dloss / n read from device memory
// (no host sync); ignored rows get 0
extern "C" __global__ void ce_bwd(const T* z, const long long* t, const A* lse,
                                  const A* scale, T* dz, long long V, long long ignore) {
    long long off = blockIdx.x * V, tt = t[blockIdx.x];
    A k = tt == ignore ? (A)0 : scale[0], l = lse[blockIdx.x];
    for (long long c = threadIdx.x; c < V; c += blockDim.x)
        st(dz, off + c, k * (ex(ld(z, off + c) - l) - (c == tt ? (A)1 : (A)0)));
}

// causal softmax in place over rows of S (B*nh*T, T): row r is query i = r % T, columns
// j > i are masked (written 0, never read), so no (T, T) bias array is needed
extern "C" __global__ void attn_softmax_fwd(T* s, long long n, A scale) {
    T* sr = s + blockIdx.x * n;
    long long i = blockIdx.x % n;
    A m = ld(sr, 0) * scale;
    for (long long j = threadIdx.x; j <= i; j += blockDim.x)
        m = ld(sr, j) * scale > m ? ld(sr, j) * scale : m;
    m = block_reduce(m, true);
    A sum = 0;
    for (long long j = threadIdx.x; j <= i; j += blockDim.x) sum += ex(ld(sr, j) * scale - m);
    sum = block_reduce(sum, false);
    for (long long j = threadIdx.x; j < n; j += blockDim.x)
        st(sr, j, j <= i ? ex(ld(sr, j) * scale - m) / sum : (A)0);
}

// dS = P * (dP - gy) * scale in place over dP, gy = g_i . y_i per row; masked entries 0
extern "C" __global__ void attn_softmax_bwd(T* dp, const T* p, const A* gy, long long n,
                                            A scale) {
    long long off = blockIdx.x * n, i = blockIdx.x % n;
    A g = gy[blockIdx.x];
    for (long long j = threadIdx.x; j < n; j += blockDim.x)
        st(dp, off + j, j <= i ? ld(p, off + j) * (ld(dp, off + j) - g) * scale : (A)0);
}
"""

_RAW = ("ln_fwd", "ln_bwd_x", "ln_bwd_wb", "ce_fwd", "ce_bwd", "attn_softmax_fwd",
        "attn_softmax_bwd")


def source(dtype):
    """The CUDA source for arrays of `dtype`: __half's header, typedefs of T and A, kernels."""
    t, a = _CTYPES[np.dtype(dtype).name]
    return f"#include <cuda_fp16.h>\ntypedef {t} T;\ntypedef {a} A;\n" + _HEADER + _SOURCE


def _raw(name, dtype):
    """cupy.RawKernel `name` for `dtype`, compiled on first call (by CuPy, then cached)."""
    key = (name, np.dtype(dtype).name)
    if key not in _CACHE:
        cp = sys.modules["cupy"]       # imported already: use() saw cupy arrays
        _CACHE[key] = cp.RawKernel(source(dtype), name, options=("--std=c++14",))
    return _CACHE[key]


def _threads(n):
    """Block size for rows of n: a power of two, 32..1024 (a multiple of the warp)."""
    return min(1024, max(32, 1 << (max(int(n), 1) - 1).bit_length()))


# ---- GELU: elementwise, x / (1 + exp(-2u)) as in fused.Gelu ---------------------------------

_K2, _A = 2 * math.sqrt(2.0 / math.pi), 0.044715
_GELU_PRE = ("__device__ __forceinline__ float md_exp(float v) { return expf(v); }\n"
             "__device__ __forceinline__ double md_exp(double v) { return exp(v); }\n")
# -2u = x (-2k) (1 + a x^2); exp may be inf for x << 0, then x / inf = -0 and s = 0: right
_NEG2U = f"v * (v * v * (A){-_K2 * _A!r} + (A){-_K2!r})"
_GELU_FWD = f"A v = (A)x; dx_out = (T)(v / ((A)1 + md_exp({_NEG2U})));"
# dy/dx = d s (1 - s) + s, s = sigmoid(2u), d = x 2k (1 + 3 a x^2)
_GELU_BWD = (f"A v = (A)x; A s = (A)1 / ((A)1 + md_exp({_NEG2U}));"
             f" A d = v * (v * v * (A){3 * _K2 * _A!r} + (A){_K2!r});"
             " dx_out = (T)((d * s * ((A)1 - s) + s) * (A)g);")


def _gelu_kernel(backward, dtype):
    key = ("gelu_bwd" if backward else "gelu_fwd", np.dtype(dtype).name)
    if key not in _CACHE:
        cp = sys.modules["cupy"]
        pre = f"typedef {_CTYPES[key[1]][1]} A;\n" + _GELU_PRE
        ins = "T x, G g" if backward else "T x"
        _CACHE[key] = cp.ElementwiseKernel(ins, "T dx_out", _GELU_BWD if backward else
                                           _GELU_FWD, "minidist_" + key[0], preamble=pre)
    return _CACHE[key]


def gelu(x):
    return _gelu_kernel(False, x.dtype)(x)


def gelu_backward(x, grad):
    return _gelu_kernel(True, x.dtype)(x, grad)


# ---- layer norm ------------------------------------------------------------------------------

def layer_norm(x, w, b, eps):
    """(y, x, w, mean, rstd) for x (..., C): x and w contiguous, as backward takes them;
    mean and rstd (N,) in the accumulation dtype."""
    cp, C = sys.modules["cupy"], x.shape[-1]
    x, w = cp.ascontiguousarray(x), cp.ascontiguousarray(w)   # no copy if already so
    b = None if b is None else cp.ascontiguousarray(b)
    N, acc = x.size // C, acc_dtype(x.dtype)
    y = cp.empty_like(x)
    mean, rstd = cp.empty(N, acc), cp.empty(N, acc)
    _raw("ln_fwd", x.dtype)((N,), (_threads(C),), (x, w, w if b is None else b, y, mean, rstd,
                            np.int64(C), acc.type(eps), np.int32(b is not None)))
    return y, x, w, mean, rstd


def layer_norm_backward(grad, x, w, mean, rstd, needs):
    """(dx, dw, db) for layer_norm's saved (x, w, mean, rstd); None where `needs` is False."""
    cp, C = sys.modules["cupy"], x.shape[-1]
    g = cp.ascontiguousarray(grad.astype(x.dtype, copy=False))
    N, acc = x.size // C, acc_dtype(x.dtype)
    dx = dw = db = None
    if needs[0]:
        dx = cp.empty_like(x)
        _raw("ln_bwd_x", x.dtype)((N,), (_threads(C),), (g, x, w, mean, rstd, dx, np.int64(C)))
    if needs[1] or needs[2]:
        rows = max(32, -(-N // 65535))     # >= 32 rows per block; grid.y stays <= 65535
        chunks = -(-N // rows)
        dw_part, db_part = cp.empty((chunks, C), acc), cp.empty((chunks, C), acc)
        _raw("ln_bwd_wb", x.dtype)((-(-C // 256), chunks), (256,),
                                   (g, x, mean, rstd, dw_part, db_part, np.int64(N),
                                    np.int64(C), np.int64(rows)))
        dw = dw_part.sum(axis=0).astype(w.dtype) if needs[1] else None
        db = db_part.sum(axis=0).astype(w.dtype) if needs[2] else None
    return dx, dw, db


# ---- softmax + cross-entropy -----------------------------------------------------------------

def cross_entropy(logits, targets, ignore_index):
    """(loss on the device, saved): the mean over non-ignored rows, all on the GPU; n counted
    there too (the CPU path's int(valid.sum()) would be a device-to-host sync)."""
    cp, V = sys.modules["cupy"], logits.shape[-1]
    z = cp.ascontiguousarray(logits).reshape(-1, V)
    t = cp.ascontiguousarray(cp.asarray(targets).reshape(-1), dtype=cp.int64)
    acc = acc_dtype(z.dtype)
    lse, rows = cp.empty(len(t), acc), cp.empty(len(t), acc)
    _raw("ce_fwd", z.dtype)((len(t),), (_threads(V),),
                            (z, t, lse, rows, np.int64(V), np.int64(ignore_index)))
    n = cp.maximum((t != ignore_index).sum(), 1).astype(acc)   # all ignored: loss 0, not nan
    return rows.sum() / n, (z, t, lse, n)


def cross_entropy_backward(grad, saved, ignore_index):
    """dL/dlogits (N, V) in the logits' dtype from cross_entropy's saved values."""
    cp = sys.modules["cupy"]
    z, t, lse, n = saved
    scale = (cp.asarray(grad, dtype=lse.dtype) / n).reshape(1)    # stays on the device
    dz = cp.empty_like(z)
    _raw("ce_bwd", z.dtype)((len(t),), (_threads(z.shape[1]),),
                            (z, t, lse, scale, dz, np.int64(z.shape[1]), np.int64(ignore_index)))
    return dz


# ---- causal attention softmax ----------------------------------------------------------------

def attn_softmax_(S, scale):
    """S (..., T, T) contiguous -> softmax(S * scale + causal mask) in place."""
    T = S.shape[-1]
    _raw("attn_softmax_fwd", S.dtype)((S.size // T,), (_threads(T),),
                                      (S, np.int64(T), acc_dtype(S.dtype).type(scale)))
    return S


def attn_softmax_backward_(dP, P, gy, scale):
    """dP (..., T, T) contiguous -> dS = P (dP - gy) scale in place; gy (..., T, 1)."""
    cp, T = sys.modules["cupy"], dP.shape[-1]
    acc = acc_dtype(dP.dtype)
    gy = cp.ascontiguousarray(gy.reshape(-1), dtype=acc)
    _raw("attn_softmax_bwd", dP.dtype)((dP.size // T,), (_threads(T),),
                                       (dP, P, gy, np.int64(T), acc.type(scale)))
    return dP
