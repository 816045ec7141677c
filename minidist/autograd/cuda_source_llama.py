"""The CUDA C source of Llama's block's kernels (cuda_kernels_llama.py plans them), over the
same T (storage) and A (accumulation) types and helpers (ld, st, ex, rs, block_reduce) as
cuda_source.py's kernels. Each replaces several xp passes of llama_ops.py with one:

    rms_fwd / rms_bwd_x    RMSNorm, one block per row: y = s * rstd * w with rstd (A, per
                           row) saved; dx = rstd (g w - xhat mean(g w xhat)), xhat = s rstd
                           (dw: cuda_source.py's ln_bwd_wb over a zero mean)
    swiglu_fwd / _bwd      y = silu(a) b for h = [a | b], rows of 2F; dh = [da | db] with
                           sigmoid(a) recomputed, as the xp code does
    rope                   RoPE's turn of the pairs (i, i + hs/2) of the first `heads` heads
                           of each row, by float A tables (T, hs/2) of cos and sign x sin;
                           in place (y = x) forward, on the gradient's copy backward

Each kernel computes in the order the xp code does (`(s * a) * b`, `x1 c - x2 s`), so on the
CPU harness float64 agrees to rounding. Proven on the CPU (tests/test_cuda_llama_cpu.py)
against llama_ops.py's xp code; never run on a GPU. llama_ops.py calls them on cupy arrays
with MINIDIST_CUDA_NEW_KERNELS=1.
"""

LLAMA = r"""
// RMSNorm forward, one block per row of C: rstd = 1 / sqrt(mean(x^2) + eps), saved (A)
extern "C" __global__ void rms_fwd(const T* x, const T* w, T* y, A* rstd, long long C,
                                   A eps) {
    long long off = blockIdx.x * C;
    A sum = 0;
    for (long long c = threadIdx.x; c < C; c += blockDim.x) {
        A v = ld(x, off + c);
        sum += v * v;
    }
    A rd = rs(block_reduce(sum, false) / C + eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = rd;
    for (long long c = threadIdx.x; c < C; c += blockDim.x)
        st(y, off + c, ld(x, off + c) * rd * ld(w, c));
}

// RMSNorm's dx, one block per row: dxhat = g w, dx = rstd (dxhat - xhat mean(dxhat xhat))
extern "C" __global__ void rms_bwd_x(const T* g, const T* x, const T* w, const A* rstd,
                                     T* dx, long long C) {
    long long off = blockIdx.x * C;
    A rd = rstd[blockIdx.x], sum = 0;
    for (long long c = threadIdx.x; c < C; c += blockDim.x)
        sum += ld(g, off + c) * ld(w, c) * (ld(x, off + c) * rd);
    A m = block_reduce(sum, false) / C;
    for (long long c = threadIdx.x; c < C; c += blockDim.x) {
        A xh = ld(x, off + c) * rd;
        st(dx, off + c, (ld(g, off + c) * ld(w, c) - xh * m) * rd);
    }
}

// SwiGLU forward over n = N F outputs: a, b = h[row, c], h[row, F + c]; y = (s a) b
extern "C" __global__ void swiglu_fwd(const T* h, T* y, long long n, long long F) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long row = i / F, c = i - row * F;
        A a = ld(h, row * 2 * F + c), b = ld(h, row * 2 * F + F + c);
        A s = (A)1 / ((A)1 + ex(-a));            // exp(-a) inf for a << 0: s = 0, right
        st(y, i, s * a * b);
    }
}

// SwiGLU backward: db = g silu(a), da = g b s (a - silu(a) + 1), written into dh's halves
extern "C" __global__ void swiglu_bwd(const T* h, const T* g, T* dh, long long n,
                                      long long F) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long row = i / F, c = i - row * F, o = row * 2 * F + c;
        A a = ld(h, o), b = ld(h, o + F), gv = ld(g, i);
        A s = (A)1 / ((A)1 + ex(-a)), silu = a * s;
        st(dh, o + F, silu * gv);
        st(dh, o, ((a - silu + (A)1) * s) * b * gv);
    }
}

// RoPE over n = rows x heads x half pairs; a row is one token's `width` columns (token t =
// row % Tn); the pair (p, p + half) of head hd turned by cos_t[t, p], sign sin_t[t, p].
// y may be x: each thread reads its pair before it writes it, and no other thread touches it
extern "C" __global__ void rope(const T* x, T* y, const A* cos_t, const A* sin_t, long long n,
                                long long Tn, long long heads, long long half,
                                long long width, A sign) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long p = i % half, hd = (i / half) % heads, row = i / (half * heads);
        long long t = row % Tn, o = row * width + hd * 2 * half + p;
        A c = cos_t[t * half + p], s = sign * sin_t[t * half + p];
        A x1 = ld(x, o), x2 = ld(x, o + half);
        st(y, o, x1 * c - x2 * s);
        st(y, o + half, x2 * c + x1 * s);
    }
}
"""

LLAMA_NAMES = ("rms_fwd", "rms_bwd_x", "swiglu_fwd", "swiglu_bwd", "rope")
