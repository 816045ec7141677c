"""The CUDA C source of three more fused kernels (cuda_kernels_new.py plans them), written
over the same T (storage) and A (accumulation) types and helpers (ld, st, ex, lg, rs,
block_reduce, GELU_NEG2U, GELU_D) as cuda_source.py's kernels:

    bias_gelu_fwd/_bwd     y = gelu(x + b) for x (N, C), b (C,): the MLP's c_fc bias added
                           in the GELU's pass instead of its own; backward gives dx (db is
                           its column sum)
    ln_residual_fwd        s = x + r (the residual stream, written once) and y = layer_norm(s)
                           in one block per row; ln_residual_bwd_x gives dx = dr = g_s +
                           layer norm's dx (dw, db: ln_bwd_wb on s)
    ce_pad_fwd/_bwd        cross-entropy over the first V of Vp columns (a vocabulary padded to
                           a multiple): the padding is skipped, not set to -inf in a pass
                           of its own; its gradient is 0

Proven on the CPU (tests/test_cuda_fusions_cpu.py) against the xp code they replace; never
run on a GPU. The model calls them through minidist/autograd/fusions.py (the GPT's MLP, its
second residual + ln_2, its loss) on cupy arrays with MINIDIST_CUDA_NEW_KERNELS=1.
"""

FUSIONS = r"""
extern "C" __global__ void bias_gelu_fwd(const T* x, const T* b, T* y, long long n,
                                         long long C) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        A v = ld(x, i) + ld(b, i % C);
        st(y, i, v / ((A)1 + ex(GELU_NEG2U(v))));
    }
}

extern "C" __global__ void bias_gelu_bwd(const T* x, const T* b, const T* g, T* dx,
                                         long long n, long long C) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        A v = ld(x, i) + ld(b, i % C), s = (A)1 / ((A)1 + ex(GELU_NEG2U(v)));
        st(dx, i, (GELU_D(v) * s * ((A)1 - s) + s) * ld(g, i));
    }
}

// one block per row: s = x + r stored (rounded to T), then ln_fwd's two passes over the
// stored s; each thread reads back only the columns it wrote, so no barrier is needed there
extern "C" __global__ void ln_residual_fwd(const T* x, const T* r, const T* w, const T* b,
                                           T* s, T* y, A* mean, A* rstd, long long C, A eps,
                                           int has_b) {
    long long off = blockIdx.x * C;
    A sum = 0;
    for (long long c = threadIdx.x; c < C; c += blockDim.x) {
        st(s, off + c, ld(x, off + c) + ld(r, off + c));
        sum += ld(s, off + c);
    }
    A mu = block_reduce(sum, false) / C;
    sum = 0;
    for (long long c = threadIdx.x; c < C; c += blockDim.x) {
        A d = ld(s, off + c) - mu;
        sum += d * d;
    }
    A rd = rs(block_reduce(sum, false) / C + eps);
    for (long long c = threadIdx.x; c < C; c += blockDim.x) {
        A v = (ld(s, off + c) - mu) * rd * ld(w, c);
        st(y, off + c, has_b ? v + ld(b, c) : v);
    }
    if (threadIdx.x == 0) { mean[blockIdx.x] = mu; rstd[blockIdx.x] = rd; }
}

// dx = g_s + rstd (dshat - mean(dshat) - shat mean(dshat shat)), dshat = g_y w
extern "C" __global__ void ln_residual_bwd_x(const T* gy, const T* gs, const T* s,
                                             const T* w, const A* mean, const A* rstd, T* dx,
                                             long long C) {
    long long off = blockIdx.x * C;
    A mu = mean[blockIdx.x], rd = rstd[blockIdx.x], s1 = 0, s2 = 0;
    for (long long c = threadIdx.x; c < C; c += blockDim.x) {
        A d = ld(gy, off + c) * ld(w, c);
        s1 += d;
        s2 += d * (ld(s, off + c) - mu) * rd;
    }
    A m1 = block_reduce(s1, false) / C;
    A m2 = block_reduce(s2, false) / C;
    for (long long c = threadIdx.x; c < C; c += blockDim.x) {
        A d = ld(gy, off + c) * ld(w, c);
        st(dx, off + c, ld(gs, off + c) + rd * (d - m1 - (ld(s, off + c) - mu) * rd * m2));
    }
}

// ce_fwd over rows of Vp columns, the first V of them real (ce_row, in the header)
extern "C" __global__ void ce_pad_fwd(const T* z, const long long* t, A* lse, A* loss,
                                      long long V, long long Vp, long long ignore) {
    ce_row(z + blockIdx.x * Vp, t, lse, loss, V, ignore);
}

// dz = (softmax(z) - onehot(t)) * scale over the V real columns, 0 over the padding
extern "C" __global__ void ce_pad_bwd(const T* z, const long long* t, const A* lse,
                                      const A* scale, T* dz, long long V, long long Vp,
                                      long long ignore) {
    long long off = blockIdx.x * Vp, tt = t[blockIdx.x];
    A k = tt == ignore ? (A)0 : scale[0], l = lse[blockIdx.x];
    for (long long c = threadIdx.x; c < Vp; c += blockDim.x)
        st(dz, off + c, c < V ? k * (ex(ld(z, off + c) - l) - (c == tt ? (A)1 : (A)0))
                              : (A)0);
}
"""

FUSION_NAMES = ("bias_gelu_fwd", "bias_gelu_bwd", "ln_residual_fwd", "ln_residual_bwd_x",
                "ce_pad_fwd", "ce_pad_bwd")
