"""The CUDA C source of the fused kernels (cuda_kernels.py launches them), per storage dtype.

Each kernel is written once over a storage type T and an accumulation type A; `source(dtype)`
puts the typedefs on top:

    dtype      T               A        header
    float16    __half          float    cuda_fp16.h
    bfloat16   __nv_bfloat16   float    cuda_bf16.h
    float32    float           float
    float64    double          double

`signature(name)` reads a kernel's parameter list back out of the source, so a CPU test can
check every launch's arguments against what the kernel declares (tests/test_cuda_kernels.py,
which also compiles the source with nvcc where one is installed).

The kernels come in parts, each compiled on its own: "fused" (this file), "flash"
(cuda_source_flash.py), "fusions" (cuda_source_fusions.py), "multi" (the multi-tensor
optimizer kernels, cuda_source_multi.py), "philox" (dropout's numbers,
cuda_source_philox.py) and "llama" (Llama's block, cuda_source_llama.py);
`source(dtype, part)`.
The same text compiles for the CPU with g++ and tests/cuda_host/cuda_host.h, where
tests/test_cuda_kernels_cpu.py runs every kernel against the xp code, so write kernels in
the subset that header gives a meaning: no dynamic shared memory, shuffles of up to 8 bytes.
"""
import math
import re

import numpy as np

from minidist.autograd.cuda_source_flash import FLASH, FLASH_NAMES
from minidist.autograd.cuda_source_fusions import FUSION_NAMES, FUSIONS
from minidist.autograd.cuda_source_llama import LLAMA, LLAMA_NAMES
from minidist.autograd.cuda_source_multi import MULTI, MULTI_NAMES
from minidist.autograd.cuda_source_philox import PHILOX, PHILOX_DEVICE, PHILOX_NAMES

CTYPES = {"float16": ("__half", "float"), "bfloat16": ("__nv_bfloat16", "float"),
          "float32": ("float", "float"), "float64": ("double", "double")}
C_TO_NUMPY = {"float": np.dtype(np.float32), "double": np.dtype(np.float64),
              "long long": np.dtype(np.int64), "int": np.dtype(np.int32),
              "unsigned long long": np.dtype(np.uint64)}

# bfloat16's load and store, only in bfloat16's source: a toolkit whose NVRTC cannot find
# cuda_bf16.h then still compiles the other dtypes' kernels
BF16_HEADER = r"""#include <cuda_bf16.h>
__device__ __forceinline__ float ld(const __nv_bfloat16* p, long long i) {
    return __bfloat162float(p[i]);
}
__device__ __forceinline__ void st(__nv_bfloat16* p, long long i, float v) {
    p[i] = __float2bfloat16(v);
}
"""

# Loads, stores and math overloaded on T and A, so each kernel is written once.
HEADER = r"""
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

// cross-entropy of this block's row zr, whose first V columns are the vocabulary (ce_fwd:
// all of them; ce_pad_fwd: a row of Vp >= V): lse = max + log sum exp(z - max), loss =
// lse - z_t; an ignored row 0, an out-of-range target nan (visible in the loss, no host check)
__device__ void ce_row(const T* zr, const long long* t, A* lse, A* loss, long long V,
                       long long ignore) {
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
"""

_K2, _GA = 2 * math.sqrt(2.0 / math.pi), 0.044715
# GELU as x / (1 + exp(-2u)) (fused.Gelu): -2u = x (-2k) (1 + a x^2); exp may be inf for
# x << 0, then x / inf = -0 and s = 0: right. dy/dx = d s (1 - s) + s, d = x 2k (1 + 3 a x^2)
GELU_DEFINES = (f"#define GELU_NEG2U(v) ((v) * ((v) * (v) * (A)({-_K2 * _GA!r}) + "
                f"(A)({-_K2!r})))\n"
                f"#define GELU_D(v) ((v) * ((v) * (v) * (A)({3 * _K2 * _GA!r}) + "
                f"(A)({_K2!r})))\n")

KERNELS = r"""
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

// cross-entropy, one block per row (ce_row, in the header): lse and loss per row
extern "C" __global__ void ce_fwd(const T* z, const long long* t, A* lse, A* loss,
                                  long long V, long long ignore) {
    ce_row(z + blockIdx.x * V, t, lse, loss, V, ignore);
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

// GELU, elementwise over n contiguous values (grid-stride loop)
extern "C" __global__ void gelu_fwd(const T* x, T* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        A v = ld(x, i);
        st(y, i, v / ((A)1 + ex(GELU_NEG2U(v))));
    }
}

extern "C" __global__ void gelu_bwd(const T* x, const T* g, T* dx, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        A v = ld(x, i), s = (A)1 / ((A)1 + ex(GELU_NEG2U(v)));
        st(dx, i, (GELU_D(v) * s * ((A)1 - s) + s) * ld(g, i));
    }
}

// AdamW in place on p, m, v over n contiguous values (grid-stride): optim/adamw.py's
// adamw_update line by line, in the same order (decay is 1 when weight decay is 0)
extern "C" __global__ void adamw_step(T* p, const T* g, T* m, T* v, long long n, A b1,
                                      A one_minus_b1, A b2, A one_minus_b2, A decay,
                                      A inv_sqrt_bc2, A eps, A step_size) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        A gi = ld(g, i), pi = ld(p, i) * decay;
        A mi = ld(m, i) * b1 + gi * one_minus_b1;
        A vi = ld(v, i) * b2 + gi * gi * one_minus_b2;
        st(m, i, mi);
        st(v, i, vi);
        st(p, i, pi - mi / (sqrt(vi) * inv_sqrt_bc2 + eps) * step_size);
    }
}
"""

NAMES = ("ln_fwd", "ln_bwd_x", "ln_bwd_wb", "ce_fwd", "ce_bwd", "attn_softmax_fwd",
         "attn_softmax_bwd", "gelu_fwd", "gelu_bwd", "adamw_step")


def dtype_name(dtype):
    """"bfloat16" for "bfloat16" or ml_dtypes.bfloat16 (np.dtype("bfloat16") needs
    ml_dtypes imported first), "float32" for np.float32, ..."""
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


# The kernels in parts, each compiled on its own: "flash" (cuda_source_flash.py),
# "fusions" (cuda_source_fusions.py), "multi" (cuda_source_multi.py), "philox"
# (cuda_source_philox.py) and "llama" (cuda_source_llama.py) have not run on a GPU yet, so
# they are kept out of the source the other kernels are compiled from
PARTS = {"fused": (KERNELS, NAMES), "flash": (PHILOX_DEVICE + FLASH, FLASH_NAMES),
         "fusions": (FUSIONS, FUSION_NAMES), "multi": (MULTI, MULTI_NAMES),
         "philox": (PHILOX_DEVICE + PHILOX, PHILOX_NAMES), "llama": (LLAMA, LLAMA_NAMES)}


def part_of(kernel):
    """The part whose source holds `kernel`."""
    return next(p for p, (_, names) in PARTS.items() if kernel in names)


def source(dtype, part="fused"):
    """The CUDA source for arrays of `dtype`: headers, typedefs of T and A, one part's
    kernels ("fused": the kernels in this file; "flash": tiled attention; "fusions";
    "multi": the multi-tensor optimizer kernels; "philox": dropout's numbers)."""
    name = dtype_name(dtype)
    t, a = CTYPES[name]
    bf16 = BF16_HEADER if name == "bfloat16" else ""
    return ("#include <cuda_fp16.h>\n" + bf16 + f"typedef {t} T;\ntypedef {a} A;\n" + HEADER
            + GELU_DEFINES + PARTS[part][0])


def signature(name, text=KERNELS + FLASH + FUSIONS + MULTI + PHILOX + LLAMA):
    """Kernel `name`'s parameters as (C type, is_pointer) pairs, read from the source:
    ("T", True) for `const T* x`, ("long long", False) for `long long C`."""
    m = re.search(r'extern "C" __global__ void ' + name + r"\(([^)]*)\)", text)
    if m is None:
        raise KeyError(f"no kernel {name!r} in the source")
    params = []
    for p in m.group(1).split(","):
        words = p.replace("const ", "").replace("*", " * ").split()
        pointer = "*" in words
        params.append((" ".join(w for w in words[:-1] if w != "*"), pointer))
    return params
